# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/bench_tree_ops.py on the CPU: its crowded drafter logits leave the
top-token search's fast path (the GPU timing itself runs on the H200)."""

import torch

from benchmarks import bench_tree_ops as bto


def test_crowded_logits_crowd_the_best_tokens_into_low_ids():
    gen = torch.Generator().manual_seed(0)
    shape = (4, bto.DEPTH, bto.QWEN3_VOCAB)
    logits = bto.crowded_logits(torch.randn(shape, generator=gen))
    top = logits.topk(31, dim=-1).indices
    assert (top < 2048).all()  # all in the search's first 2048-token chunk
    # The chunk search reports one value per chunk at this vocabulary, so its
    # threshold (the 31st largest chunk maximum) lets far more than the
    # default cap of 64 candidates through: the spill sort runs.
    chunk_max = (
        torch.nn.functional.pad(
            logits, (0, 2048 * 75 - bto.QWEN3_VOCAB), value=float("-inf")
        )
        .unflatten(-1, (75, 2048))
        .amax(-1)
    )
    threshold = chunk_max.topk(31, dim=-1).values[..., -1:]
    assert ((logits >= threshold).sum(-1) > 64).all()
