# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A trained target/drafter pair for DDTree and DFlash benchmarks, made offline.

Five steps, each a subcommand that resumes from the files the previous one left in
``--out`` (see ``docs/train_pair.md``):

1. ``corpus``: Python sources and docs of this interpreter's standard library and
   site-packages, picked in a fixed hash order up to a byte cap; a hash rule on each
   file's relative path holds some out for evaluation.
2. ``tokenizer``: a byte-level BPE (with ``<mask>``) trained on the training part;
   both parts tokenized; held-out evaluation prompts written to JSON.
3. ``target``: a ``Qwen3ForCausalLM`` trained from scratch on the token stream.
4. ``continuations``: the target's greedy continuations of corpus windows.
5. ``drafter``: a DFlash drafter in vLLM's ``DFlashDraftModel`` layout, trained on
   those continuations with the target frozen.

    python -m benchmarks.train_pair all --scale tiny --out /tmp/pair
"""
