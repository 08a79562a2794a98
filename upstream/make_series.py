# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Build the upstream patch series against vLLM v0.26.0 (commit f2654939e).

    python upstream/make_series.py [--out DIR]   # write the series (upstream/series/)
    python upstream/make_series.py --check       # fail if upstream/series/ is stale

Each patch is one reviewable change: the new files it adds, read from this
repository (so patch and package cannot drift), and its hand-written edits to
vLLM's own files (``upstream/edits/NNNN-name.diff``, unified diffs against the
v0.26.0 files; they do in vLLM's code what ``vllm_ddtree/glue.py`` does at run
time). The output is ``NNNN-name.patch`` in ``git format-patch`` style,
applicable in order with ``git apply`` or ``git am``, and ``series`` (the order).

The output is not committed (upstream/series/ is ignored): it repeats the
package's modules, and a committed copy would need regenerating with every
change to one. Generate it to read or send it; ``--check`` tells whether a
generated copy is still current.

The build fails when a module under ``vllm/`` is in no patch or in two, or a
listed file is missing: a module added, moved or renamed in the package must be
placed in the series by hand.
"""

import argparse
import difflib
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = ROOT / "upstream"
EDITS = UPSTREAM / "edits"
SERIES = UPSTREAM / "series"
BASE = "v0.26.0 (f2654939e)"
AUTHOR = "vllm-ddtree contributors <vllm-ddtree@users.noreply.github.com>"


@dataclass(frozen=True)
class Patch:
    name: str
    title: str
    body: str
    # Repository paths of new files; each lands at the same path upstream.
    files: tuple[str, ...] = ()
    # Whether upstream/edits/<name>.diff holds edits to vLLM's files.
    edits: bool = False


PATCHES = (
    Patch(
        "0001-dflash-propose-steps",
        "[Spec Decode][MRv2] DFlash: propose in overridable steps",
        """\
A refactor of DFlashSpeculator.propose with no change in behaviour: its
body becomes steps that propose calls, so a speculator built on DFlash's
drafter overrides the step that differs instead of copying propose.

* _prepare_draft_context(input_batch, last_hidden_states,
  aux_hidden_states, num_sampled, num_rejected, last_sampled,
  next_prefill_tokens, dummy_run, skip_attn_for_dummy_run): the target's
  hidden states as the drafter's context, prepare_dflash_inputs for each
  draft KV-cache group, and the context K/V stored by
  _store_context_kv(context_states, dummy_run) (each layer at its group's
  context slots; no cache write in dummy runs).
* _run_drafter(input_batch, num_tokens_across_dp, is_profile, skip_attn)
  -> num_tokens_padded: the draft's max sequence length, the CUDA-graph
  dispatch with DP padding, the draft attention metadata and slot
  mappings, EPLB, then the FULL graph's replay or _generate_draft; in the
  memory-profiling run (skip_attn) the eager forward without attention
  metadata. It returns the padded token count the drafter ran, which
  sizes what _generate_draft wrote.

propose copies the request inputs, calls the two steps and returns
draft_tokens[:num_reqs] as before. The one reordering: the request inputs
(temperature, seeds, idx_mapping) are copied before the hidden states
instead of after; the two copies write different buffers on one stream.
No host sync is added and the captured graphs are unchanged. DSpark,
which overrides _generate_draft, runs as before.

DDTree (patch 7) overrides _prepare_draft_context (its drafter's context is
each request's root and accepted path) and _generate_draft (logits to
trees), and runs the drafter through _run_drafter.

Tests: no new test in this patch (nothing observable changes). The
overlay's tests/upstream/test_dflash_steps.py runs v0.26.0's propose and
this one side by side on the CPU (dispatch to eager and to FULL graphs,
dummy and memory-profiling runs, one and two draft KV-cache groups): the
same draft tokens, buffers and calls in the same order, but for the copy
above. vLLM's CPU tests under tests/v1/spec_decode pass the same with
and without the series; DFlash's and DSpark's end-to-end tests
(tests/v1/e2e/spec_decode/test_spec_decode.py) need a GPU.""",
        edits=True,
    ),
    Patch(
        "0002-prompt-logprobs-padded-joins",
        "[Bugfix][Spec Decode][MRv2] No prompt logprobs for a padded join's "
        "placeholder drafts",
        """\
With speculative decoding (EAGLE, DFlash, any num_spec_tokens > 0 without a
per-batch-size schedule), the scheduler pads a one-token prompt that joins
running decodes to 1 + num_spec_tokens tokens with placeholder drafts, so
the step keeps its uniform-decode CUDA graph; so is a prompt whose tokens
but the last were computed (a prefix-cache or KV-connector hit).
PromptLogprobsWorker.compute_prompt_logprobs returns one row per scheduled
token but the last, so such a prompt gets num_spec_tokens rows of prompt
logprobs for the placeholders (scored against whatever follows the prompt
in the request's token buffer), where the same request without
speculation gets none.

* prompt_logprob_rows.py: num_prompt_tokens_scheduled, the prompt tokens
  among each request's scheduled tokens (min(scheduled, prompt_len -
  computed prefill), on the host arrays the worker already reads).
* prompt_logprob.py: each request's rows end at its last prompt token
  (start + prompt tokens, less the prompt's last when the prompt is done).
  Steps without placeholders get the rows they got before; nothing changes
  when no request asks for prompt logprobs (the early return).

The count is its own module so that the DDTree overlay, which runs on
vLLM 0.26 as released, trims DDTree's padded joins with the same function.

Tests: tests/v1/worker/test_gpu_prompt_logprobs_padded_join.py runs MRv2's
own PromptLogprobsWorker (Triton interpreted on the CPU) on a padded step,
with 1, 3 and 15 placeholder drafts, and on the same step without
speculation: a one-token prompt, a cached prompt's last token and a chunked
prompt's last chunk, in request-state slots out of batch order; the prompt
logprobs are equal field by field. The test fails on v0.26.0's worker (it is
marked as an expected failure there, so that the overlay's run on stock vLLM
keeps proving it).""",
        files=(
            "vllm/v1/worker/gpu/sample/prompt_logprob_rows.py",
            "tests/v1/worker/test_gpu_prompt_logprobs_padded_join.py",
        ),
        edits=True,
    ),
    Patch(
        "0003-tree-primitives",
        "[Spec Decode] Tree builder, tree rejection sampler and tree KV compaction",
        """\
The GPU pieces a tree speculator needs, independent of any model runner:

* dflash_tree_builder.py: the best-first tree of B nodes per request from a
  block drafter's per-position logits, batched on the GPU depth by depth
  with no host sync (the B most probable prefixes under the product of the
  per-position marginals), with parent ids, depths and bit-packed
  ancestor-or-self masks.
* tree_rejection_sampler.py: the lossless tree walk. Every node's token is
  sampled from the target's processed distribution (the request's own
  generator), and the walk follows the child whose token matches; a chain
  reproduces the greedy rejection sampler token for token. Penalties and
  bad words are read along each node's path.
* ops/tree_kv_compaction.py: moves the accepted path's KV to the slots
  after the committed tokens in every layer, one fused launch with a fixed
  grid (CUDA-graph safe).
* ops/tree_mask.py: the bit-packed ancestor-mask layout the builder writes
  and tree attention reads (attention-side, so the backend does not import
  the drafter's builder).

The modules sit where the DDTree overlay keeps them (vllm/v1/spec_decode,
vllm/v1/sample, vllm/v1/attention/ops); nothing calls them yet.

Tests: each kernel against a slow torch reference in tests/v1/ddtree_reference.py
(exact match), the sampler's statistical check and seeded determinism,
degenerate trees (budget 1, a chain, all and none accepted) and awkward
vocabulary sizes; on the CPU through TRITON_INTERPRET=1.""",
        files=(
            "vllm/v1/spec_decode/dflash_tree_builder.py",
            "vllm/v1/sample/tree_rejection_sampler.py",
            "vllm/v1/attention/ops/tree_kv_compaction.py",
            "vllm/v1/attention/ops/tree_mask.py",
            "tests/v1/ddtree_reference.py",
            "tests/v1/sample/mrv2_stubs.py",
            "tests/v1/spec_decode/top_search_spy.py",
            "tests/v1/sample/biased_verifier.py",
            "tests/v1/spec_decode/test_dflash_tree_builder.py",
            "tests/v1/sample/test_tree_rejection_sampler.py",
            "tests/v1/sample/test_tree_penalties.py",
            "tests/v1/attention/test_tree_kv_compaction.py",
        ),
    ),
    Patch(
        "0004-tree-attn-backend",
        "[Attention] TREE_ATTN: paged attention with per-request token-tree masks",
        """\
Revives tree attention (the old backend was removed in #42121), with a mask
per request instead of one [Q, Q] bias shared by the batch, which DDTree
(#42910) needs.

* backends/tree_attn.py: the backend. Tree rows (a request's root and its
  B nodes) run the Triton kernel with the request's bit-packed ancestor
  mask; plain decodes and prefills take the causal path.
* ops/triton_tree_attention.py: the kernel (paged KV, GQA heads packed per
  tile, head sizes 64/128/256, bf16/fp16, int64 offsets, fixed launch
  shapes for CUDA graphs).
* registry.py: TREE_ATTN, a member of AttentionBackendEnum. The backend's
  get_name() returns TREE_ATTN_NAME, "TREE_ATTN" wherever the enum has that
  member (the attention layer maps the name back to it), so nothing
  registers it and the CUSTOM slot stays free for out-of-tree backends.
  (The same module runs out of tree on vLLM 0.26 as released, where the enum
  has no such member: get_name() then says "CUSTOM" and the DDTree plugin
  registers that slot.)

The metadata builder serves requests of up to 1 + num_speculative_tokens
query tokens (a tree and its root) with the tree kernel, not vLLM's
spec-as-decode bound, which doubles the draft count under parallel drafting.

Tests: test_tree_attention.py: every tree node's output equals causal
attention over the committed prefix plus its own root-to-node path (float32
torch reference); a chain equals causal attention; odd sizes.
test_tree_attn_decode_threshold.py: the builder's decode bound with and
without parallel drafting.
test_tree_attn_backend.py: get_name() maps back to the TREE_ATTN member and
its class, the declared capabilities and their reasons for every unsupported
setting, FLASH_ATTN's KV layout, and the metadata builder and layer through
vLLM's own metadata objects (trees and causal rows against the reference,
persistent tree buffers shared, not copied; prefills split off to
FlashAttention).""",
        files=(
            "vllm/v1/attention/ops/triton_tree_attention.py",
            "vllm/v1/attention/backends/tree_attn.py",
            "tests/v1/attention/test_tree_attention.py",
            "tests/v1/attention/test_tree_attn_backend.py",
            "tests/v1/attention/test_tree_attn_decode_threshold.py",
        ),
        edits=True,
    ),
    Patch(
        "0005-ddtree-method-config",
        '[Spec Decode] method "ddtree" with tree_budget in --speculative-config',
        """\
"ddtree" joins SpeculativeMethod: {"method": "ddtree", "model": <DFlash
drafter>, "tree_budget": B, ...}. SpeculativeConfig gains three fields,
checked and expanded in __post_init__ by ddtree_config.py (the same parser
the DDTree plugin uses on stock vLLM, so the rules cannot drift):

* tree_budget: tree nodes per request and step, 1..1024 or "auto" (the
  default); num_speculative_tokens is set from it (B draft slots per
  request: the scheduler, the input batch and the CUDA graphs size decode
  steps for B + 1 verified tokens), and a user's num_speculative_tokens is
  refused. The target bounds it: Model Runner V2's start-up warm-up
  prefills B + 2 prompt tokens (ids 0 .. B + 1), then decodes B + 1 per
  request, so B needs max_model_len >= 2B + 3 (past it the warm-up writes
  beyond a block-table row) and a vocabulary of more than B + 1 tokens.
  "auto" takes the largest budget that fits; a larger explicit budget is
  refused, naming the most that fits.
* tree_budget_per_batch_size: budgets by batch size, mapped onto vLLM's
  dynamic speculative decoding schedule.
* adaptive_budget: each step's trees sized on the worker, tree_budget a
  per-request cap (the default; the hooks are patch 8, and until then the
  engine refuses it with a clear error).

A before-validator hands each field's raw value to ddtree_config's
check_tree_setting, so pydantic's lax mode never turns "12" or true into a
budget, or 1 into adaptive_budget: the error names the key, as the plugin's.

_verify_args checks the drafter is DFlash with a block_size (its depth).
DDTree drafts with DFlash's drafter, so use_dflash() is true for it and the
DFlash-keyed branches take it: drafter loading (EAGLEConfig as DFlash),
parallel_drafting, aux hidden states (compute_hash, MRv2's runner),
use_eagle(), async scheduling (EagleModelTypes), Model Runner V2's supported
methods, the scheduler's lookahead. max_num_new_slots_for_drafting is 0 for
DDTree: its drafter runs the mask tokens in its own batch, never in the
target's, so the step budget is not cut by (B - 1) x max_num_seqs.
Two properties: draft_depth (DDTree: the drafter's block_size - 1, the
deepest a tree can be) and num_draft_positions (the positions the
spec-decode stats count: num_speculative_tokens for chains, the depth for
trees; ddtree_config.num_draft_positions, which the plugin calls too).

EngineArgs builds the DDTree SpeculativeConfig after refusing engine
settings DDTree cannot run with (pipeline or context parallelism, LoRA, a
quantized KV cache, non-dense targets, Model Runner V1); the target's
attention backend becomes TREE_ATTN (patch 4's member; a user's other
choice is an error), the drafter keeps its own. Batch defaults: max_num_seqs and
max_num_batched_tokens fit trees of B + 1 tokens (or the user's values are
checked), and CUDA graphs are captured in multiples of B + 1 within vLLM's
largest capture size, unless the user set sizes. The finished config must
run on Model Runner V2. DDTree is untested with tensor_parallel_size > 1: a
warning says so.

The speculator and tree verification come with patch 7; DDTree's modules
read the settings with DDTreeConfig.from_vllm_config.

Tests: tests/v1/spec_decode/test_ddtree_config.py (parsing and every error
message, the engine checks, batch limits, CUDA-graph sizes, the adaptive
budget's caps and slot counts, the config's round trip, TREE_ATTN as the
target's backend), test_ddtree_method_config.py (the settings' parser and
reader for SpeculativeConfig fields and for the plugin's additional_config),
test_ddtree_budget.py and test_ddtree_cost.py (the budget and cost models the
config's schedules use); SpeculativeConfig and the engine-config path through
EngineArgs are checked against the patched tree by
tests/upstream/applied_wiring.py in the overlay's repository.""",
        files=(
            "vllm/v1/spec_decode/ddtree_cost.py",
            "vllm/v1/spec_decode/ddtree_budget.py",
            "vllm/v1/spec_decode/ddtree_config.py",
            "tests/log_records.py",
            "tests/v1/spec_decode/test_ddtree_config.py",
            "tests/v1/spec_decode/test_ddtree_method_config.py",
            "tests/v1/spec_decode/test_ddtree_budget.py",
            "tests/v1/spec_decode/test_ddtree_cost.py",
        ),
        edits=True,
    ),
    Patch(
        "0006-scheduler-lookahead-stats",
        "[Core] Scheduler lookahead, structured outputs and stats for DDTree",
        """\
* Lookahead slots: DDTree's drafter writes KV for [bonus, mask x depth]
  past the committed tokens, so num_lookahead_tokens is the drafter's block
  (draft_depth + 1 = 16 for DFlash b16), not DFlash's num_speculative_tokens
  + 1 (too few for budgets under 15, wasted KV above). The scheduler and the
  grammar bitmask key on speculative_config.method == "ddtree".
* Spec-decode stats: a tree's accepted path is at most the drafter's depth
  long, so SpecDecodingStats (the scheduler's) and SpecDecodingProm's
  per-position counters are sized by SpeculativeConfig.num_draft_positions
  (patch 5: the depth for trees, num_speculative_tokens for chains), not by
  tree_budget (up to 1024 series); observe_draft counts draft positions up
  to that size (a tree's nodes outnumber its depths). Chains are unchanged.
* Structured-output requests decode without drafts: vLLM validates drafts
  against the grammar as a chain, which a tree in node order is not. The
  scheduler records them in add_request and clears their spec_token_ids
  before each step is sized (drop_grammar_drafts in ddtree_grammar.py,
  added here); the grammar bitmask (host memory) is then sized one row per
  request, not 1 + tree_budget.

The tree is fed as B draft tokens, parents before children, so any prefix
the scheduler keeps is still a tree; nothing else in the scheduler changes.

Tests: tests/v1/core/test_ddtree_scheduler.py builds a DDTree engine config
through EngineArgs and vLLM's Scheduler over a stand-in KV cache (CPU): the
lookahead is the drafter's block at budgets 4 and 64, the stats count two
trees' accepted paths per depth, the Prometheus per-position series has one
counter per depth, the grammar bitmask one row per request, and schedule()
schedules a structured-output request without drafts while a plain request
keeps its own. tests/v1/spec_decode/test_ddtree_grammar.py: drafts cleared, finished
requests forgotten. tests/models/tiny_models.py makes the tiny Qwen3 target
and DFlash drafter the scheduler test builds its config from, on the spot
(random weights, a byte-level tokenizer; nothing downloaded). vLLM's own
tests/v1/core/test_scheduler.py gives the same results with and without the
series.""",
        files=(
            "vllm/v1/spec_decode/ddtree_grammar.py",
            "tests/models/tiny_models.py",
            "tests/v1/core/test_ddtree_scheduler.py",
            "tests/v1/spec_decode/test_ddtree_grammar.py",
        ),
        edits=True,
    ),
    Patch(
        "0007-ddtree-speculator-mrv2",
        "[Spec Decode][MRv2] DDTree speculator and tree verification",
        """\
* ddtree.py: DDTreeSpeculator subclasses MRv2's DFlashSpeculator and
  overrides two of the steps patch 1 splits propose into, the context
  (_prepare_draft_context: root + accepted path) and the graph body
  (_generate_draft: logits -> build_ddtree), runs DFlash's forward
  (_run_drafter) as it is, and overrides propose (the walk before the
  steps, the trees' storage after) and init_cudagraph_manager.
  It owns the per-request trees (DraftTrees, reset in add_request as
  RequestState resets its draft tokens) and their verification:
  init_rejection_sampler returns the TreeRejectionSampler that walks them,
  and propose takes the walk (sampler_output), moves the accepted paths'
  KV into place and starts the drafter's context from them. Upstream it
  would move to vllm/v1/worker/gpu/spec_decode/ddtree/; it keeps the
  overlay's path here.
* spec_decode/speculator.py: two BaseSpeculator hooks whose defaults keep
  every other speculator as it is, init_rejection_sampler (vLLM's
  RejectionSampler) and add_request (nothing), and a sampler_output=None
  keyword on propose (the base, DFlash and the autoregressive speculators
  take it and ignore it). model_runner.py calls them: load_model builds the
  rejection sampler through the speculator, add_requests calls its
  add_request after the model state's, and sample_tokens passes the step's
  sampler output to propose.
* ddtree_verify.py: DDTreeModelState (a DefaultModelState) writes tree
  positions and masks in place after MRv2's slot mapping, from the
  speculator's trees (handed over in set_attn); ddtree_inputs.py: the GPU
  writers of those inputs, of the drafter's context and of stored trees.
* ddtree_adaptive.py: the adaptive budget's planner. DDTreeSpeculator
  builds it; the scheduler and model-runner hooks that drive it are patch 8
  (the config refuses adaptive budgets until then, so it stays idle).
* triton_utils/parallel_compile.py: both start-up warm-ups (TREE_ATTN's
  variants, the adaptive budget's kernels) run once with each new Triton
  variant compiled on a thread pool instead of launched (Triton's
  AsyncCompileMode), then as they are, every variant compiled.
* init_speculator picks DDTreeSpeculator for method "ddtree", and
  init_model_state DDTreeModelState for it too; once the KV caches
  exist, the model runner compiles every TREE_ATTN variant a step can pick
  (warm_up_tree_attention), so none is first compiled in a user's step.
* load_model: the structured-output bitmask of a DDTree runner is sized by
  the step's token limit, not max_num_reqs x (1 + tree_budget) logit rows
  (about 10 GiB at 512 requests, budget 1024 and a 152K vocabulary); a step
  has no more logit rows than tokens. (Prompt logprobs of a padded join need
  nothing of DDTree's own: patch 2 fixed them for every speculator.)

Tests: tests/v1/spec_decode/test_ddtree.py (the speculator and model state
through these hooks on the CPU: tree inputs, the walk, propose given the
walk with the KV compaction against its torch reference and the drafter's
context, and request slots that are joined, finished and reused),
test_ddtree_inputs.py (tree positions, masks and slots),
test_ddtree_adaptive.py and test_ddtree_tp.py (kernels on sharded heads).
test_ddtree.py builds its tiny target and drafter with
tests/models/tiny_models.py (patch 6). The speculator's end-to-end tests
(greedy output equal to no speculation on every serving path) need a GPU
and the overlay's engine fixtures, which are not in this patch.""",
        files=(
            "vllm/v1/spec_decode/ddtree_inputs.py",
            "vllm/v1/spec_decode/ddtree_adaptive.py",
            "vllm/v1/spec_decode/ddtree.py",
            "vllm/v1/spec_decode/ddtree_verify.py",
            "vllm/triton_utils/parallel_compile.py",
            "tests/v1/spec_decode/test_ddtree.py",
            "tests/v1/spec_decode/test_ddtree_inputs.py",
            "tests/v1/spec_decode/test_ddtree_adaptive.py",
            "tests/v1/spec_decode/test_ddtree_tp.py",
        ),
        edits=True,
    ),
    Patch(
        "0008-ddtree-adaptive-budget",
        "[Spec Decode][Core][MRv2] DDTree adaptive tree budget",
        """\
With "adaptive_budget": true (the default) tree_budget is a per-request cap
and each step's trees are sized on the worker, from a step-cost model seeded
by timing the captured CUDA graphs and from the measured acceptance
(ddtree_adaptive.py, patch 7). This patch wires it into vLLM and lifts the
config's refusal of adaptive budgets (patch 5):

* arg_utils.py: the refusal goes; without async scheduling a warning says
  the slots per batch size do not apply. (An adaptive config's ladder of
  budgets a step may choose and its per-batch-size caps are DDTreeConfig's,
  from the SpeculativeConfig fields of patch 5.)
* scheduler.py: the draft slots per batch size (dynamic_sd_lookup) are a
  TreeSlots (ddtree_slots.py, added here): the engine's caps
  (engine_tree_slots), lowered per batch size to a few times the budget the
  worker last reported (slot_ladder). When the async scheduler's slots drop,
  each running request's blocks past its computed tokens and the drafter's
  lookahead go back to the pool (trim_dropped_slots, which schedule calls
  first; in this schedule and the next, as the step in flight still uses
  the old tree's), and the blocks kept go to the worker in
  SchedulerOutput.ddtree_kept_blocks.
  update_from_output reads the worker's ModelRunnerOutput.ddtree_budget (a
  BudgetReport): the slots follow its next budget and the spec-decode
  counters count the step's nodes per request, not the slots
  (ddtree_metrics.verified_draft_tokens, added here).
* model_runner.py (MRv2): execute_model cuts the block table rows the
  scheduler cut (truncate_block_tables) and plans the step's budget before
  the batch is padded and dispatched; prepare_inputs applies the
  batch-wide split of the step's nodes; sample_tokens attaches the budget
  report to the step's output; initialize_kv_cache compiles the budget's
  kernels for every tree width and cap; capture_model times the captured
  graphs for the step-cost prior.
* outputs.py / sched/output.py: the two new fields, None for every other
  engine.

Tests: tests/v1/spec_decode/test_ddtree_slots.py (slots per budget against
brute force, TreeSlots following the reported budget per batch-size bucket,
tail blocks freed past the computed tokens and lookahead, in the schedule the
slots drop and the next, block-table rows cut), test_ddtree_metrics.py (the draft tokens counted for the step's
budget). The config, slots,
advice and block freeing are checked on the CPU against the patched tree by
the overlay's tests/upstream/applied_wiring.py (vLLM's async scheduler over
four requests: each request holds exactly the blocks its tokens need, and a
worker's block table rebuilt from the scheduler outputs matches). The
model-runner hooks need a GPU: they are checked to import and to call
functions that exist, not run.""",
        files=(
            "vllm/v1/spec_decode/ddtree_slots.py",
            "vllm/v1/spec_decode/ddtree_metrics.py",
            "tests/v1/spec_decode/test_ddtree_slots.py",
            "tests/v1/spec_decode/test_ddtree_metrics.py",
        ),
        edits=True,
    ),
    Patch(
        "0009-docs",
        "[Docs] DDTree speculative decoding",
        """\
* docs/features/speculative_decoding/ddtree.md: DDTree's page beside the
  other speculative decoding methods: what it does, how to run it online
  and offline, every setting of its speculative config with its default,
  the budgets, requirements and what is refused, how vLLM's spec-decode
  metrics read for trees, and a short performance note.
* docs/features/speculative_decoding/README.md: DDTree in the list of
  methods.""",
        files=("upstream/docs/ddtree.md",),
        edits=True,
    ),
)

# Where a repository file lands upstream, when not at the same path.
UPSTREAM_PATHS = {
    # The upstream-only page, written for vLLM's docs; the overlay's own user
    # guide (docs/ddtree.md) covers the plugin and is not part of the series.
    "upstream/docs/ddtree.md": "docs/features/speculative_decoding/ddtree.md",
}


# Paths that exist only in this repository: a file the series adds must not
# point a vLLM reader at them.
OVERLAY_ONLY = (
    "tests/upstream",
    "tests/plugins",
    "tests/e2e",
    "benchmarks/",
    "docs/ddtree.md",
    "docs/upstream.md",
)


def upstream_path(repo_path: str) -> str:
    return UPSTREAM_PATHS.get(repo_path, repo_path)


def check_coverage() -> None:
    """Every module under vllm/ in exactly one patch; every listed file
    present."""
    listed: dict[str, str] = {}
    for patch in PATCHES:
        for path in patch.files:
            if path in listed:
                raise SystemExit(f"{path} is in {listed[path]} and {patch.name}")
            listed[path] = patch.name
            if not (ROOT / path).is_file():
                raise SystemExit(f"{patch.name} lists {path}, which does not exist")
        if patch.edits and not (EDITS / f"{patch.name}.diff").is_file():
            raise SystemExit(f"{patch.name}: upstream/edits/{patch.name}.diff missing")
        for path in patch.files:
            text = (ROOT / path).read_text()
            for name in OVERLAY_ONLY:
                if name in text:
                    raise SystemExit(
                        f"{path} ({patch.name}) names {name!r}, which vLLM's tree "
                        "does not have: say it without the path"
                    )
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "vllm").rglob("*.py"))
    missing = [m for m in modules if m not in listed]
    if missing:
        raise SystemExit(
            "modules in no patch (place them in PATCHES in upstream/make_series.py): "
            + ", ".join(missing)
        )


def new_file_diff(repo_path: str) -> str:
    dest = upstream_path(repo_path)
    text = (ROOT / repo_path).read_text()
    lines = text.splitlines(keepends=True)
    out = [
        f"diff --git a/{dest} b/{dest}\n",
        "new file mode 100644\n",
        "--- /dev/null\n",
        f"+++ b/{dest}\n",
        f"@@ -0,0 +1,{len(lines)} @@\n" if len(lines) != 1 else "@@ -0,0 +1 @@\n",
    ]
    for line in lines:
        if line.endswith("\n"):
            out.append("+" + line)
        else:
            out.append("+" + line + "\n\\ No newline at end of file\n")
    return "".join(out)


def diffstat(diff_text: str) -> str:
    """``git apply --stat``'s summary of a diff."""
    proc = subprocess.run(
        ["git", "apply", "--stat", "-"],
        input=diff_text,
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout


def render(index: int, patch: Patch) -> str:
    diffs = [new_file_diff(path) for path in patch.files]
    if patch.edits:
        diffs.append((EDITS / f"{patch.name}.diff").read_text())
    diff_text = "".join(diffs)
    return (
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        f"From: {AUTHOR}\n"
        f"Subject: [PATCH {index}/{len(PATCHES)}] {patch.title}\n"
        "\n"
        f"{patch.body}\n"
        "\n"
        f"Base: vLLM {BASE}. Generated by upstream/make_series.py.\n"
        "---\n"
        f"{diffstat(diff_text)}\n"
        f"{diff_text}"
        "-- \n"
        "vllm-ddtree upstream/make_series.py\n"
    )


def build(out_dir: Path) -> list[str]:
    check_coverage()
    out_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for index, patch in enumerate(PATCHES, 1):
        (out_dir / f"{patch.name}.patch").write_text(render(index, patch))
        names.append(f"{patch.name}.patch")
    (out_dir / "series").write_text("".join(n + "\n" for n in names))
    return names


def check(series: Path = SERIES) -> int:
    """0 if ``series`` is what the generator writes now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        build(fresh)
        want = {p.name: p.read_text() for p in fresh.iterdir()}
    have = (
        {p.name: p.read_text() for p in series.iterdir() if p.is_file()}
        if series.is_dir()
        else {}
    )
    stale = sorted(n for n in want.keys() | have.keys() if want.get(n) != have.get(n))
    for name in stale:
        diff = difflib.unified_diff(
            have.get(name, "").splitlines(keepends=True),
            want.get(name, "").splitlines(keepends=True),
            f"committed/{name}",
            f"generated/{name}",
            n=1,
        )
        sys.stderr.write("".join(list(diff)[:40]))
    if stale:
        sys.stderr.write(
            f"{series} is stale ({', '.join(stale)}); "
            "run python upstream/make_series.py\n"
        )
        return 1
    print(f"{series} is up to date ({len(want) - 1} patches)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=SERIES, help="where to write the series"
    )
    parser.add_argument(
        "--check", action="store_true", help="fail if the series in --out is stale"
    )
    args = parser.parse_args()
    if args.check:
        return check(args.out)
    if args.out.is_dir():
        for old in args.out.glob("*"):
            if old.is_file():
                old.unlink()
    names = build(args.out)
    print(f"wrote {len(names)} patches to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
