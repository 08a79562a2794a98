# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Lossless verification of DDTree draft trees for Model Runner V2.

The target model scores every token of a request's flattened tree
``[root, node_1, ..., node_b]`` in one forward pass. For every tree token v we
sample y_v from the target's processed distribution at v with vLLM's own
``gumbel_sample``, keyed by (request seed, position of v). Then we walk from the
root: while the current node has a child whose token equals y_current, we move to
that child. The k nodes passed are accepted and the request emits
``[y_root, y_idx1, ..., y_idxk]``: the accepted nodes' tokens followed by the bonus
token sampled at the last accepted node.

This is exactly lossless. Siblings share a position and therefore share Gumbel
noise, but only one node per depth lies on the accepted path, and the node at
depth d sees exactly the context that non-speculative decoding would see at
position p0 + d, so the emitted tokens are token for token what non-speculative
MRv2 sampling with the same seed emits. The drafter's probabilities are never
used: the usual min(1, p/q) test is biased when siblings are a deterministic
top-k set rather than independent draws from q.

Reference: Ringel & Romano, "Accelerating Speculative Decoding with Block
Diffusion Draft Trees" (DDTree), 2026.

Example (one request, root and two children of the root, greedy)::

    out = tree_rejection_sample(
        processed_logits,                    # [3, vocab_size]
        torch.tensor([[5, 7]]),              # node tokens
        torch.tensor([[0, 0]], dtype=torch.int32),  # both children of the root
        torch.tensor([0, 3], dtype=torch.int32),
        pos, expanded_idx_mapping, temperature, seeds, max_depth=1,
    )
    # If argmax(processed_logits[0]) == 7: out.sampled_token_ids[0, :2] is
    # [7, argmax(processed_logits[2])] and out.accepted_nodes[0, 0] == 2.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm.triton_utils import tl, triton
from vllm.utils.math_utils import cdiv, next_power_of_2
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.worker.gpu.input_batch import InputBatch, get_num_sampled_and_rejected
from vllm.v1.worker.gpu.metrics.logits import get_num_nans
from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample
from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores
from vllm.v1.worker.gpu.sample.output import SamplerOutput
from vllm.v1.worker.gpu.sample.sampler import Sampler
from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS


@dataclass
class TreeSampleOutput:
    """Result of verifying one tree per request. All tensors stay on the device."""

    # [num_reqs, budget + 1] int64: emitted tokens, -1 padded (vLLM's layout).
    sampled_token_ids: torch.Tensor
    # [num_reqs] int32: k + 1 (0 for a request with no logits).
    num_sampled: torch.Tensor
    # [num_reqs, max_depth] int32: flattened tree indices (1..b) of the accepted
    # nodes in depth order, -1 padded.
    accepted_nodes: torch.Tensor
    # [num_reqs] int32: k.
    num_accepted: torch.Tensor


@dataclass
class TreeSamplerOutput(SamplerOutput):
    """vLLM's ``SamplerOutput`` plus the accepted path, for KV compaction and the
    drafter's hidden-state gathering."""

    # [num_reqs, max_depth] int32, as in ``TreeSampleOutput``.
    accepted_nodes: torch.Tensor | None = None
    # [num_reqs] int32, as in ``TreeSampleOutput``.
    num_accepted: torch.Tensor | None = None


class TreeRejectionSampler:
    """MRv2 rejection sampler for DDTree: the tree counterpart of vLLM's MRv2
    ``RejectionSampler``.

    The verified tokens of request r are ``[root, node_1, ..., node_b]`` at logit
    rows ``cu_num_logits[r] .. cu_num_logits[r + 1] - 1``, with ``b <= budget``
    (the scheduler may trim a tree to a prefix of its node list, which is still a
    tree because nodes are ordered parent-before-child). The trees are per-request
    state, allocated once by their owner and handed over at construction: request
    r of a step reads row ``input_batch.idx_mapping[r]`` in place, like MRv2's
    ``RequestState``, and its first b tokens are the draft tokens scheduled for
    it. Called in MRv2's rejection-sampler slot (``rejection_sampler(logits,
    input_batch, draft_logits)``; the walk never reads the drafter's
    probabilities). Outputs use vLLM's chain layout, so vLLM's post-update code
    consumes them unchanged; ``accepted_nodes`` feeds ``TreeKVCompactor``.
    A node is accepted only if its tree token is also the token the target was
    fed at its row (``input_batch.input_ids``): a tree that does not match the
    step's input (e.g. a slot whose request joined without a drafted tree, fed
    MRv2's placeholder zeros) can cost acceptance, never correctness.

    Presence, frequency and repetition penalties count, for each node's row, the
    request's output so far plus the tokens on the node's own path
    (:func:`apply_tree_penalties`): what the target would have seen had it
    decoded that path. ``Sampler.apply_sampling_params`` would count the
    preceding rows in chain order, so its penalty step is left out here.
    Bad words are matched the same way, against the output and the path
    (:func:`apply_tree_bad_words`).
    """

    def __init__(
        self,
        sampler: Sampler,
        max_depth: int,
        # [max_num_reqs, budget] int64, request-state order; -1 on padding nodes
        tree_token_ids: torch.Tensor,
        # [max_num_reqs, budget] int32, request-state order; 0 = root
        tree_parent_ids: torch.Tensor,
    ):
        self.sampler = sampler
        self.max_depth = max_depth
        self.tree_token_ids = tree_token_ids
        self.tree_parent_ids = tree_parent_ids

    def __call__(
        self,
        # [num_logits, vocab_size]
        logits: torch.Tensor,
        input_batch: InputBatch,
        draft_logits: torch.Tensor | None = None,
    ) -> TreeSamplerOutput:
        # Count NaNs before any processing, as vLLM's samplers do.
        num_nans = get_num_nans(logits) if self.sampler.compute_nans else None

        pos = input_batch.positions[input_batch.logits_indices]
        input_ids = input_batch.input_ids[input_batch.logits_indices]
        use_penalties, max_bad_words = self._path_rules(input_batch.idx_mapping_np)
        if not (use_penalties or max_bad_words):
            processed_logits = self.sampler.apply_sampling_params(
                logits,
                input_batch.expanded_idx_mapping,
                input_batch.idx_mapping_np,
                pos,
                input_ids,
                input_batch.expanded_local_pos,
            )
        else:
            processed_logits = self._apply_sampling_params_on_paths(
                logits, input_batch, pos, input_ids, use_penalties, max_bad_words
            )
        out = tree_rejection_sample(
            processed_logits,
            self.tree_token_ids,
            self.tree_parent_ids,
            input_batch.cu_num_logits,
            pos,
            input_batch.expanded_idx_mapping,
            self.sampler.sampling_states.temperature.gpu,
            self.sampler.sampling_states.seeds.gpu,
            self.max_depth,
            use_fp64=self.sampler.use_fp64_gumbel,
            fed_token_ids=input_ids,
            tree_rows=input_batch.idx_mapping,
        )
        use_processed = self.sampler.logprobs_mode in (
            "processed_logprobs",
            "processed_logits",
        )
        logprobs_tensors = self._get_logprobs_tensors(
            input_batch, out, processed_logits if use_processed else logits
        )
        # Chunked-prefill rows emit nothing; num_rejected = b - k.
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            out.num_sampled,
            input_batch.seq_lens,
            input_batch.cu_num_logits,
            input_batch.idx_mapping,
            self.sampler.req_states.prefill_len.gpu,
        )
        return TreeSamplerOutput(
            sampled_token_ids=out.sampled_token_ids,
            logprobs_tensors=logprobs_tensors,
            num_nans=num_nans,
            num_sampled=num_sampled,
            num_rejected=num_rejected,
            accepted_nodes=out.accepted_nodes,
            num_accepted=out.num_accepted,
        )

    def _path_rules(self, idx_mapping_np) -> tuple[bool, int]:
        """Whether a request of the batch has penalties, and the most bad words
        a request has (host state: no sync)."""
        penalties = getattr(self.sampler, "penalties_state", None)
        bad_words = getattr(self.sampler, "bad_words_state", None)
        use_penalties = penalties is not None and bool(
            penalties.use_penalty[idx_mapping_np].any()
        )
        max_bad_words = (
            0
            if bad_words is None
            else int(bad_words.num_bad_words.np[idx_mapping_np].max())
        )
        return use_penalties, max_bad_words

    def _apply_sampling_params_on_paths(
        self,
        logits: torch.Tensor,
        input_batch: InputBatch,
        pos: torch.Tensor,
        input_ids: torch.Tensor,
        use_penalties: bool,
        max_bad_words: int,
    ) -> torch.Tensor:
        """``Sampler.apply_sampling_params`` with each row's penalties and bad
        words read along its node's path: for the call, the sampler's penalties
        and bad-words states are replaced by steps that run the path kernels
        where the sampler runs its own (in its order, on its copy of the
        logits when raw logprobs need the originals)."""
        sampler = self.sampler
        rows = (
            input_batch.expanded_idx_mapping,
            input_batch.expanded_local_pos,
            # Each logit row's tree: its request's state row.
            input_batch.expanded_idx_mapping,
            self.tree_parent_ids,
            input_ids,
        )

        # The states themselves, read before their stand-ins take their place
        # (a sampler without one never calls it).
        saved = {
            name: getattr(sampler, name)
            for name in ("penalties_state", "bad_words_state")
            if hasattr(sampler, name)
        }
        penalties, bad_words = (
            saved.get("penalties_state"),
            saved.get("bad_words_state"),
        )

        def penalize(logits: torch.Tensor) -> None:
            apply_tree_penalties(
                logits,
                *rows,
                penalties.repetition_penalty.gpu,
                penalties.frequency_penalty.gpu,
                penalties.presence_penalty.gpu,
                penalties.prompt_bin_mask,
                penalties.output_bin_counts,
                self.max_depth,
            )

        def mask_bad_words(logits: torch.Tensor) -> None:
            req_states = bad_words.req_states
            apply_tree_bad_words(
                logits,
                *rows,
                bad_words.bad_word_token_ids.gpu,
                bad_words.bad_word_offsets.gpu,
                bad_words.num_bad_words.gpu,
                req_states.all_token_ids.gpu,
                req_states.prompt_len.gpu,
                req_states.total_len.gpu,
                max_bad_words,
                self.max_depth,
            )

        steps = {
            "penalties_state": _PathStep(penalize if use_penalties else None),
            "bad_words_state": _PathStep(mask_bad_words if max_bad_words else None),
        }
        for name in saved:
            setattr(sampler, name, steps[name])
        try:
            return sampler.apply_sampling_params(
                logits,
                input_batch.expanded_idx_mapping,
                input_batch.idx_mapping_np,
                pos,
                input_ids,
                input_batch.expanded_local_pos,
            )
        finally:
            for name, state in saved.items():
                setattr(sampler, name, state)

    def _get_logprobs_tensors(
        self,
        input_batch: InputBatch,
        out: TreeSampleOutput,
        # [num_logits, vocab_size]
        logits: torch.Tensor,
    ) -> LogprobsTensors | None:
        sampler = self.sampler
        idx_mapping_np = input_batch.idx_mapping_np
        max_num_logprobs = sampler.sampling_states.max_num_logprobs(idx_mapping_np)
        # Requests may name the token ids whose logprobs they want
        # (``logprob_token_ids``), with or without top-``logprobs`` ones.
        token_ids_state = sampler.logprob_token_ids_state
        max_per_req_token_ids = token_ids_state.max_num_token_ids(idx_mapping_np)
        if max_num_logprobs == NO_LOGPROBS and max_per_req_token_ids == 0:
            return None
        # vLLM reads the first num_sampled logprob entries of each request from
        # where the host says its entries start; the accepted path's rows are
        # gathered there, a fixed number per request, as the batch-wide budget
        # splits the step's rows on the GPU. The scores are computed in place
        # over all rows, as vLLM's own rejection sampler does: gathering the
        # logits first would copy a [num_logits, vocab] tensor.
        rows, row_tokens, stride = _path_logit_rows(
            out, input_batch.cu_num_logits, logits.shape[0]
        )
        scores = compute_topk_scores(
            logits,
            0 if max_num_logprobs == NO_LOGPROBS else max_num_logprobs,
            row_tokens,
            logprob_token_ids_state=token_ids_state,
            expanded_idx_mapping=input_batch.expanded_idx_mapping,
            max_per_req_token_ids=max_per_req_token_ids,
            logits_mode=sampler.logprobs_mode in ("raw_logits", "processed_logits"),
        )
        num_reqs = input_batch.idx_mapping.shape[0]
        return LogprobsTensors(
            logprob_token_ids=scores.logprob_token_ids[rows],
            logprobs=scores.logprobs[rows],
            selected_token_ranks=scores.selected_token_ranks[rows],
            cu_num_generated_tokens=list(range(0, num_reqs * stride, stride)),
        )


def tree_rejection_sample(
    # [num_logits, vocab_size]
    processed_logits: torch.Tensor,
    # [num_reqs, budget]
    tree_token_ids: torch.Tensor,
    # [num_reqs, budget]
    tree_parent_ids: torch.Tensor,
    # [num_reqs + 1]
    cu_num_logits: torch.Tensor,
    # [num_logits]
    pos: torch.Tensor,
    # [num_logits]
    expanded_idx_mapping: torch.Tensor,
    # [max_num_reqs]
    temperature: torch.Tensor,
    # [max_num_reqs]
    seeds: torch.Tensor,
    max_depth: int,
    use_fp64: bool = False,
    # [num_logits] token fed to the target at each logit row, if known
    fed_token_ids: torch.Tensor | None = None,
    # [num_reqs] tree row of each request (see walk_trees)
    tree_rows: torch.Tensor | None = None,
) -> TreeSampleOutput:
    """Sample every tree token, then walk each tree to its accepted path.

    ``processed_logits`` are the target's logits after temperature, min-p and
    top-k/top-p (``Sampler.apply_sampling_params``); rows of requests at temperature 0
    are sampled greedily. ``pos`` holds the positions of the tree tokens (root
    position + depth), which key the Gumbel noise together with the seed.
    Allocations depend on shapes only and nothing syncs with the host, so the call
    can be captured in a CUDA graph.
    """
    # [num_logits]
    node_sampled = gumbel_sample(
        processed_logits,
        expanded_idx_mapping,
        temperature,
        seeds,
        pos,
        apply_temperature=False,
        use_fp64=use_fp64,
    )
    return walk_trees(
        node_sampled,
        tree_token_ids,
        tree_parent_ids,
        cu_num_logits,
        max_depth,
        fed_token_ids,
        tree_rows,
    )


def walk_trees(
    # [num_logits]
    node_sampled: torch.Tensor,
    # [num_reqs, budget]
    tree_token_ids: torch.Tensor,
    # [num_reqs, budget]
    tree_parent_ids: torch.Tensor,
    # [num_reqs + 1]
    cu_num_logits: torch.Tensor,
    max_depth: int,
    # [num_logits]
    fed_token_ids: torch.Tensor | None = None,
    # [num_reqs] int32: request r's tree is row tree_rows[r] of the tree tensors
    # (request-state order, read in place); None: row r
    tree_rows: torch.Tensor | None = None,
) -> TreeSampleOutput:
    """Walk each request's tree along the target's samples ``node_sampled``.

    Request r's tree tokens are rows ``cu_num_logits[r] .. cu_num_logits[r+1]-1``
    of ``node_sampled``: the root, then nodes 1..b. Node i's token and parent
    (0 = root) are ``tree_token_ids[t, i-1]`` and ``tree_parent_ids[t, i-1]``
    with t = ``tree_rows[r]`` (r without ``tree_rows``);
    nodes beyond b are ignored, padding nodes (token -1) never match. With
    ``fed_token_ids`` (the target's input at each logit row), a node whose tree
    token differs from the token fed at its row never matches either, so only
    what the target actually scored can be accepted. Paths longer than
    ``max_depth`` are cut at ``max_depth`` accepted nodes.
    """
    num_reqs, budget = tree_token_ids.shape
    if tree_rows is not None:
        num_reqs = tree_rows.shape[0]
    device = node_sampled.device
    sampled = torch.empty(num_reqs, budget + 1, dtype=torch.int64, device=device)
    num_sampled = torch.empty(num_reqs, dtype=torch.int32, device=device)
    accepted_nodes = torch.empty(num_reqs, max_depth, dtype=torch.int32, device=device)
    num_accepted = torch.empty(num_reqs, dtype=torch.int32, device=device)
    _tree_walk_kernel[(num_reqs,)](
        sampled,
        sampled.stride(0),
        num_sampled,
        accepted_nodes,
        accepted_nodes.stride(0),
        num_accepted,
        node_sampled,
        tree_token_ids,
        tree_token_ids.stride(0),
        tree_parent_ids,
        tree_parent_ids.stride(0),
        cu_num_logits,
        node_sampled if fed_token_ids is None else fed_token_ids,
        cu_num_logits if tree_rows is None else tree_rows,
        budget,
        max_depth,
        CHECK_FED=fed_token_ids is not None,
        HAS_ROWS=tree_rows is not None,
        NODE_BLOCK=next_power_of_2(budget),
        OUT_BLOCK=next_power_of_2(budget + 1),
        PATH_BLOCK=next_power_of_2(max_depth + 1),
        num_warps=4,
    )
    return TreeSampleOutput(sampled, num_sampled, accepted_nodes, num_accepted)


class _PathStep:
    """The sampler's penalties or bad-words state while it processes a tree
    step's logits: its step runs ``fn`` on the logits (the path version of
    the state's chain-order step), or nothing."""

    def __init__(self, fn: Callable[[torch.Tensor], None] | None):
        self._fn = fn

    def apply_penalties(self, logits: torch.Tensor, *args, **kwargs) -> None:
        if self._fn is not None:
            self._fn(logits)

    apply_bad_words = apply_penalties


def apply_tree_penalties(
    # [num_logits, vocab_size], penalized in place
    logits: torch.Tensor,
    # [num_logits] request-state index of each row
    expanded_idx_mapping: torch.Tensor,
    # [num_logits] node index of each row within its request (0: the root)
    local_pos: torch.Tensor,
    # [num_logits] row of each row's tree in tree_parent_ids
    row_trees: torch.Tensor,
    # [num_trees, budget] parent of node i + 1 (0: the root)
    tree_parent_ids: torch.Tensor,
    # [num_logits] the token each row was fed
    fed_token_ids: torch.Tensor,
    # [max_num_reqs] float32
    repetition_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    # [max_num_reqs, cdiv(vocab_size, 32)] int32: bit t set if the prompt has t
    prompt_bin_mask: torch.Tensor,
    # [max_num_reqs, vocab_size] int32: the request's output tokens so far
    output_bin_counts: torch.Tensor,
    max_depth: int,
) -> None:
    """vLLM's presence, frequency and repetition penalties with each row's
    output counted as the request's output so far plus the tokens fed at the
    nodes of its root-to-node path, the root excluded (it is the last output
    token) and the node included: what the target would have counted had it
    decoded that path. For a chain this is MRv2's ``apply_penalties``."""
    num_logits, vocab_size = logits.shape
    if num_logits == 0:
        return
    block_size = 8192
    _tree_penalties_kernel[(num_logits, cdiv(vocab_size, block_size))](
        logits,
        logits.stride(0),
        expanded_idx_mapping,
        local_pos,
        row_trees,
        tree_parent_ids,
        tree_parent_ids.stride(0),
        fed_token_ids,
        repetition_penalty,
        frequency_penalty,
        presence_penalty,
        prompt_bin_mask,
        prompt_bin_mask.stride(0),
        output_bin_counts,
        output_bin_counts.stride(0),
        vocab_size,
        max_depth,
        BLOCK_SIZE=block_size,
    )


@triton.jit(do_not_specialize=["max_depth"])
def _tree_penalties_kernel(
    logits_ptr,
    logits_stride,
    expanded_idx_mapping_ptr,
    local_pos_ptr,
    row_trees_ptr,
    parent_ptr,
    parent_stride,
    fed_ptr,
    repetition_penalty_ptr,
    frequency_penalty_ptr,
    presence_penalty_ptr,
    prompt_bin_mask_ptr,
    prompt_bin_mask_stride,
    output_bin_counts_ptr,
    output_bin_counts_stride,
    vocab_size,
    max_depth,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    req = tl.load(expanded_idx_mapping_ptr + row)
    rep_penalty = tl.load(repetition_penalty_ptr + req)
    freq_penalty = tl.load(frequency_penalty_ptr + req)
    pres_penalty = tl.load(presence_penalty_ptr + req)
    use_rep_penalty = rep_penalty != 1.0
    if not (use_rep_penalty or freq_penalty != 0.0 or pres_penalty != 0.0):
        return

    block_idx = tl.program_id(1)
    block = block_idx * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = block < vocab_size
    logits = tl.load(logits_ptr + row * logits_stride + block, mask=mask)
    logits = logits.to(tl.float32)
    counts = tl.load(
        output_bin_counts_ptr + req * output_bin_counts_stride + block,
        mask=mask,
        other=0,
    )
    # Up the node's path to the root: each node's fed token counts once.
    node = tl.load(local_pos_ptr + row)
    first = row - node  # the request's root row
    tree = tl.load(row_trees_ptr + row).to(tl.int64)
    for _ in range(max_depth):
        if node > 0:
            token = tl.load(fed_ptr + first + node)
            counts += (block == token).to(tl.int32)
            node = tl.load(parent_ptr + tree * parent_stride + node - 1)
    seen = counts > 0

    # The rest is vLLM's penalty arithmetic, in its order.
    if use_rep_penalty:
        packed_block = block_idx * BLOCK_SIZE // 32 + tl.arange(0, BLOCK_SIZE // 32)
        packed_mask = tl.load(
            prompt_bin_mask_ptr + req * prompt_bin_mask_stride + packed_block,
            mask=packed_block < tl.cdiv(vocab_size, 32),
            other=0,
        )
        in_prompt = (packed_mask[:, None] >> (tl.arange(0, 32)[None, :])) & 1
        in_prompt = in_prompt.to(tl.int1).reshape(BLOCK_SIZE)
        scale = tl.where(in_prompt | seen, rep_penalty, 1.0)
        logits *= tl.where(logits > 0, 1.0 / scale, scale)
    logits -= freq_penalty * counts
    logits -= pres_penalty * seen
    tl.store(logits_ptr + row * logits_stride + block, logits, mask=mask)


def apply_tree_bad_words(
    # [num_logits, vocab_size], masked in place
    logits: torch.Tensor,
    # [num_logits] request-state index of each row
    expanded_idx_mapping: torch.Tensor,
    # [num_logits] node index of each row within its request (0: the root)
    local_pos: torch.Tensor,
    # [num_logits] row of each row's tree in tree_parent_ids
    row_trees: torch.Tensor,
    # [num_trees, budget] parent of node i + 1 (0: the root)
    tree_parent_ids: torch.Tensor,
    # [num_logits] the token each row was fed
    fed_token_ids: torch.Tensor,
    # vLLM's BadWordsState buffers, request-state rows
    bad_word_token_ids: torch.Tensor,
    bad_word_offsets: torch.Tensor,
    num_bad_words: torch.Tensor,
    # vLLM's RequestState buffers
    all_token_ids: torch.Tensor,
    prompt_len: torch.Tensor,
    total_len: torch.Tensor,
    max_num_bad_words: int,
    max_depth: int,
) -> None:
    """vLLM's bad-words masking with each row's preceding tokens read along
    its node's path: the request's output (its last token is the root's), then
    the tokens fed at the path's nodes at depths ``1 .. depth``, the node
    included, as a non-speculative step after that path would read them.

    (MRv2's ``apply_bad_words`` reads a chain's rows ``0 .. pos - 1`` after the
    output instead: the root twice and never the row's own token.)"""
    num_logits = logits.shape[0]
    if num_logits == 0 or max_num_bad_words == 0:
        return
    _tree_bad_words_kernel[(num_logits, max_num_bad_words)](
        logits,
        logits.stride(0),
        expanded_idx_mapping,
        local_pos,
        row_trees,
        tree_parent_ids,
        tree_parent_ids.stride(0),
        fed_token_ids,
        bad_word_token_ids,
        bad_word_token_ids.stride(0),
        bad_word_offsets,
        bad_word_offsets.stride(0),
        num_bad_words,
        all_token_ids,
        all_token_ids.stride(0),
        prompt_len,
        total_len,
        max_depth,
        PATH_BLOCK=next_power_of_2(max_depth + 1),
    )


@triton.jit(do_not_specialize=["max_depth"])
def _tree_bad_words_kernel(
    logits_ptr,
    logits_stride,
    expanded_idx_mapping_ptr,
    local_pos_ptr,
    row_trees_ptr,
    parent_ptr,
    parent_stride,
    fed_ptr,
    bad_word_token_ids_ptr,
    bad_word_token_ids_stride,
    bad_word_offsets_ptr,
    bad_word_offsets_stride,
    num_bad_words_ptr,
    all_token_ids_ptr,
    all_token_ids_stride,
    prompt_len_ptr,
    total_len_ptr,
    max_depth,
    PATH_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    bad_word = tl.program_id(1)
    req = tl.load(expanded_idx_mapping_ptr + row)
    if bad_word >= tl.load(num_bad_words_ptr + req):
        return

    # The path's fed tokens by steps up from the node (step 0: the node
    # itself), and the node's depth: the node at depth s is step depth - s.
    node = tl.load(local_pos_ptr + row)
    first = row - node  # the request's root row
    tree = tl.load(row_trees_ptr + row).to(tl.int64)
    steps = tl.arange(0, PATH_BLOCK)
    path = tl.zeros([PATH_BLOCK], dtype=tl.int64)
    depth = 0
    for _ in range(max_depth):
        if node > 0:
            token = tl.load(fed_ptr + first + node).to(tl.int64)
            path = tl.where(steps == depth, token, path)
            depth += 1
            node = tl.load(parent_ptr + tree * parent_stride + node - 1)

    prompt_len = tl.load(prompt_len_ptr + req)
    output_len = tl.load(total_len_ptr + req) - prompt_len
    effective_len = output_len + depth
    offsets = bad_word_offsets_ptr + req * bad_word_offsets_stride
    words = bad_word_token_ids_ptr + req * bad_word_token_ids_stride
    output = all_token_ids_ptr + req * all_token_ids_stride + prompt_len
    start = tl.load(offsets + bad_word)
    end = tl.load(offsets + bad_word + 1)
    prefix_len = end - start - 1
    if prefix_len > effective_len:
        return
    match = 1
    for i in range(prefix_len):
        expected = tl.load(words + start + i).to(tl.int64)
        at = effective_len - prefix_len + i
        if at >= output_len:
            # The path's node at depth at - output_len + 1.
            step = depth - 1 - (at - output_len)
            actual = tl.sum(tl.where(steps == step, path, 0))
        else:
            actual = tl.load(output + at).to(tl.int64)
        match = match & (expected == actual)
    if match:
        last = tl.load(words + end - 1)
        tl.store(logits_ptr + row * logits_stride + last, -float("inf"))


def _path_logit_rows(
    out: TreeSampleOutput,
    # [num_reqs + 1]
    cu_num_logits: torch.Tensor,
    num_logits: int,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The accepted paths' logit rows in emission order, ``stride`` entries per
    request (entry ``r * stride + j`` is the row of request r's j-th emitted
    token for j < num_sampled; later entries name the request's root row),
    the token each of the ``num_logits`` rows emitted (0 on rows off the
    accepted path), and ``stride``, the most tokens a request can emit. Only
    for logprobs."""
    num_reqs = cu_num_logits.shape[0] - 1
    stride = min(out.accepted_nodes.shape[1] + 1, out.sampled_token_ids.shape[1])
    # [num_reqs, stride]: the root (0) then the accepted nodes.
    path = torch.cat(
        [out.accepted_nodes.new_zeros(num_reqs, 1), out.accepted_nodes.clamp(min=0)],
        dim=1,
    )[:, :stride].long()
    start = cu_num_logits[:-1].long()[:, None]
    on_path = (
        torch.arange(stride, device=start.device)[None, :]
        < out.num_sampled.long()[:, None]
    )
    rows = torch.where(on_path, start + path, start)
    tokens = out.sampled_token_ids[:, :stride].clamp(min=0)
    # Off-path entries name a path row (the root): they write to a spare slot
    # past the end instead (a boolean-mask index would sync with the host).
    target = torch.where(on_path, rows, num_logits)
    row_tokens = tokens.new_zeros(num_logits + 1)
    row_tokens.index_put_((target.flatten(),), tokens.flatten())
    return rows.flatten(), row_tokens[:num_logits], stride


@triton.jit
def _tree_walk_kernel(
    # [num_reqs, budget + 1]
    sampled_ptr,
    sampled_stride,
    # [num_reqs]
    num_sampled_ptr,
    # [num_reqs, max_depth]
    accepted_nodes_ptr,
    accepted_nodes_stride,
    # [num_reqs]
    num_accepted_ptr,
    # [num_logits]
    node_sampled_ptr,
    # [num_reqs, budget]
    token_ids_ptr,
    token_ids_stride,
    # [num_reqs, budget]
    parent_ids_ptr,
    parent_ids_stride,
    # [num_reqs + 1]
    cu_num_logits_ptr,
    # [num_logits]
    fed_token_ids_ptr,
    # [num_reqs] tree row of each request (HAS_ROWS)
    tree_rows_ptr,
    budget,
    max_depth,
    CHECK_FED: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    NODE_BLOCK: tl.constexpr,
    OUT_BLOCK: tl.constexpr,
    PATH_BLOCK: tl.constexpr,
):
    req_idx = tl.program_id(0).to(tl.int64)
    start = tl.load(cu_num_logits_ptr + req_idx).to(tl.int64)
    end = tl.load(cu_num_logits_ptr + req_idx + 1).to(tl.int64)
    has_root = end > start
    num_nodes = tl.minimum(end - start - 1, budget)
    if HAS_ROWS:
        tree_row = tl.load(tree_rows_ptr + req_idx).to(tl.int64)
    else:
        tree_row = req_idx

    # Column i holds node i + 1. Nodes past num_nodes and padding nodes
    # (token -1) never match.
    node_offs = tl.arange(0, NODE_BLOCK)
    node_mask = node_offs < num_nodes
    parents = tl.load(
        parent_ids_ptr + tree_row * parent_ids_stride + node_offs,
        mask=node_mask,
        other=-1,
    )
    tokens = tl.load(
        token_ids_ptr + tree_row * token_ids_stride + node_offs,
        mask=node_mask,
        other=-1,
    ).to(tl.int64)
    live = node_mask & (tokens >= 0)
    if CHECK_FED:
        fed = tl.load(
            fed_token_ids_ptr + start + 1 + node_offs, mask=node_mask, other=-1
        ).to(tl.int64)
        live = live & (fed == tokens)
    # A node can be entered iff the target's sample at its parent is its token.
    parent_sampled = tl.load(
        node_sampled_ptr + start + parents, mask=live, other=-1
    ).to(tl.int64)
    enterable = live & (tokens == parent_sampled)

    # path[d] = flattened index of the accepted node at depth d (path[0] = root).
    path_offs = tl.arange(0, PATH_BLOCK)
    path = tl.zeros((PATH_BLOCK,), dtype=tl.int32)
    cur = tl.zeros((), dtype=tl.int32)
    num_accepted = tl.zeros((), dtype=tl.int32)
    active = has_root
    for depth in range(max_depth):
        # Sibling tokens are distinct, so at most one child is enterable.
        child = tl.max(
            tl.where(enterable & (parents == cur), node_offs + 1, 0), axis=0
        ).to(tl.int32)
        found = active & (child > 0)
        cur = tl.where(found, child, cur)
        path = tl.where((path_offs == depth + 1) & found, child, path)
        num_accepted += found.to(tl.int32)
        active = found

    # Emitted token d is the sample at path[d]: the accepted tokens, then the bonus.
    on_path = has_root & (path_offs <= num_accepted)
    emitted = tl.load(node_sampled_ptr + start + path, mask=on_path, other=-1)
    sampled_row = sampled_ptr + req_idx * sampled_stride
    tl.store(sampled_row + path_offs, emitted, mask=path_offs <= budget)
    out_offs = tl.arange(0, OUT_BLOCK)
    tl.store(
        sampled_row + out_offs,
        tl.full((OUT_BLOCK,), -1, dtype=tl.int64),
        mask=(out_offs >= PATH_BLOCK) & (out_offs <= budget),
    )
    tl.store(
        accepted_nodes_ptr + req_idx * accepted_nodes_stride + path_offs - 1,
        tl.where(on_path, path, -1),
        mask=(path_offs >= 1) & (path_offs <= max_depth),
    )
    tl.store(num_accepted_ptr + req_idx, num_accepted)
    tl.store(num_sampled_ptr + req_idx, tl.where(has_root, num_accepted + 1, 0))
