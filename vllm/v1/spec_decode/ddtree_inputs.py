# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-step inputs of a DDTree step on Model Runner V2, written on the GPU.

Two writers, each a small Triton kernel:

* :func:`write_tree_verify_inputs` (target side). Model Runner V2 lays out a
  decoding request as ``[root, node_1..node_b]`` (root = last sampled token,
  nodes = the draft tokens the scheduler kept, a prefix of the request's tree) at
  positions ``p0, p0 + 1, ..., p0 + b`` and computes KV slots from those flattened
  positions. This writer then, in place, sets node i's position to ``p0 +
  depth_i`` (RoPE sees the tree position; the KV slot keeps the flattened index)
  and copies the request's ancestor masks into TREE_ATTN's batch-ordered buffers.
  Padding nodes (token -1: the drafter had fewer prefixes, or no tree was
  drafted for the request since it joined) verify at the root's position with
  mask ``{root, self}``, and the root row is always ``{root}``, so a request
  padded with placeholder drafts verifies as a root-only tree. ``p0`` is read
  from the positions MRv2 computed from its GPU request state, so it is right
  under async scheduling.

* :func:`prepare_draft_inputs` (drafter side). After the walk, the DFlash
  drafter's next context is the request's committed rows only: any rows before
  the tree (prefill chunks), the root, then the accepted nodes in path order;
  rejected nodes never reach the drafter's KV cache. Each request gets a context
  region of ``q_len - b + path_len`` entries (``path_len``: the longest path the
  step can accept, :func:`draft_path_len`; path entries past the accepted length
  are padding with slot ``PAD_SLOT_ID``), so region offsets and the total follow
  from the batch's CPU counts without a host sync. The drafter's query block
  (bonus token + ``depth`` mask tokens after the last committed position) is laid
  out as in vLLM's DFlash speculator.

Both launches have a grid fixed by the request count and loop inside, and neither
reads anything back to the host.
"""

import torch

from vllm.triton_utils import tl, triton
from vllm.utils.math_utils import next_power_of_2
from vllm.v1.attention.backends.utils import PAD_SLOT_ID


def write_tree_verify_inputs(
    # [num_tokens] int64, rewritten in place for tree rows
    positions: torch.Tensor,
    # [max_num_reqs, max_tree_len, num_words] int32, batch order (TREE_ATTN's)
    attn_mask: torch.Tensor,
    # [max_num_reqs] int32, batch order (TREE_ATTN's)
    is_tree: torch.Tensor,
    # [max_num_reqs, budget] int64, request-state order; -1 on padding nodes
    tree_token_ids: torch.Tensor,
    # [max_num_reqs, budget] int32, request-state order
    tree_depths: torch.Tensor,
    # [max_num_reqs, budget + 1, num_words] int32, request-state order
    tree_masks: torch.Tensor,
    # [num_reqs]
    idx_mapping: torch.Tensor,
    # [num_reqs + 1]
    query_start_loc: torch.Tensor,
    # [num_reqs + 1]
    cu_num_logits: torch.Tensor,
    num_reqs_padded: int,
) -> None:
    """Tree positions, masks and ``is_tree`` for a batch whose request r verifies
    ``cu_num_logits[r + 1] - cu_num_logits[r] - 1`` tree nodes (0: causal rows)
    in its last rows, after any prompt rows scheduled in the same step.
    ``is_tree`` is cleared for the CUDA-graph padding requests up to
    ``num_reqs_padded``."""
    num_reqs = idx_mapping.shape[0]
    budget = tree_depths.shape[1]
    num_words = tree_masks.shape[2]
    assert tree_token_ids.stride(0) == tree_depths.stride(0)
    _write_tree_verify_inputs_kernel[(max(num_reqs, num_reqs_padded),)](
        positions,
        attn_mask,
        attn_mask.stride(0),
        attn_mask.stride(1),
        is_tree,
        tree_token_ids,
        tree_depths,
        tree_depths.stride(0),
        tree_masks,
        tree_masks.stride(0),
        tree_masks.stride(1),
        idx_mapping,
        query_start_loc,
        cu_num_logits,
        num_reqs,
        NUM_WORDS=num_words,
        NODE_BLOCK=next_power_of_2(budget),
        MASK_BLOCK=min(1024, next_power_of_2((budget + 1) * num_words)),
    )


@triton.jit(do_not_specialize=["num_reqs"])
def _write_tree_verify_inputs_kernel(
    # [num_tokens]
    positions_ptr,
    # [max_num_reqs, max_tree_len, num_words]
    attn_mask_ptr,
    attn_mask_stride_req,
    attn_mask_stride_row,
    # [max_num_reqs]
    is_tree_ptr,
    # [max_num_reqs, budget], both with stride tree_depths_stride
    tree_token_ids_ptr,
    tree_depths_ptr,
    tree_depths_stride,
    # [max_num_reqs, budget + 1, num_words]
    tree_masks_ptr,
    tree_masks_stride_req,
    tree_masks_stride_row,
    # [num_reqs]
    idx_mapping_ptr,
    # [num_reqs + 1]
    query_start_loc_ptr,
    # [num_reqs + 1]
    cu_num_logits_ptr,
    num_reqs,
    NUM_WORDS: tl.constexpr,
    NODE_BLOCK: tl.constexpr,
    MASK_BLOCK: tl.constexpr,
):
    batch_idx = tl.program_id(0)
    if batch_idx >= num_reqs:
        # CUDA-graph padding request: causal.
        tl.store(is_tree_ptr + batch_idx, 0)
        return
    num_logits = tl.load(cu_num_logits_ptr + batch_idx + 1) - tl.load(
        cu_num_logits_ptr + batch_idx
    )
    num_nodes = num_logits - 1
    q_start = tl.load(query_start_loc_ptr + batch_idx)
    q_end = tl.load(query_start_loc_ptr + batch_idx + 1)
    # TREE_ATTN's encoding: 1 + the root's query row (prompt rows scheduled
    # before it in the same step stay causal), 0 for a causal request.
    tl.store(
        is_tree_ptr + batch_idx,
        tl.where(num_nodes > 0, 1 + q_end - num_logits - q_start, 0),
    )
    if num_nodes <= 0:
        return

    req_state_idx = tl.load(idx_mapping_ptr + batch_idx).to(tl.int64)
    root = (q_end - num_logits).to(tl.int64)
    root_pos = tl.load(positions_ptr + root)
    node = tl.arange(0, NODE_BLOCK)
    is_node = node < num_nodes
    node_row = req_state_idx * tree_depths_stride + node
    token = tl.load(tree_token_ids_ptr + node_row, mask=is_node, other=-1)
    depth = tl.load(tree_depths_ptr + node_row, mask=is_node, other=0)
    # Padding nodes sit at the root's position (depth 0).
    depth = tl.where(token >= 0, depth, 0)
    tl.store(positions_ptr + root + 1 + node, root_pos + depth, mask=is_node)

    # Mask rows 0..num_nodes (root and kept nodes), NUM_WORDS words each: the
    # root row is {root}; a real node's row is its tree's; a padding node's row
    # is {root, self}, whatever the slot holds (a tree never drafted, or one
    # drafted for the slot's previous request).
    src = tree_masks_ptr + req_state_idx * tree_masks_stride_req
    dst = attn_mask_ptr + batch_idx.to(tl.int64) * attn_mask_stride_req
    num_elems = (num_nodes + 1) * NUM_WORDS
    for start in range(0, num_elems, MASK_BLOCK):
        elem = start + tl.arange(0, MASK_BLOCK)
        row = (elem // NUM_WORDS).to(tl.int64)
        word = elem % NUM_WORDS
        in_range = elem < num_elems
        row_token = tl.load(
            tree_token_ids_ptr + req_state_idx * tree_depths_stride + row - 1,
            mask=in_range & (row >= 1),
            other=-1,
        )
        copy = in_range & (row_token >= 0)
        words = tl.load(src + row * tree_masks_stride_row + word, mask=copy, other=0)
        own = tl.where(word == row // 32, 1 << (row % 32), 0)
        root_bit = tl.where(word == 0, 1, 0)
        words = tl.where(copy, words, (own | root_bit).to(tl.int32))
        tl.store(dst + row * attn_mask_stride_row + word, words, mask=in_range)


def store_draft_trees(
    # [max_num_reqs, budget] int64 / int32 / int32 / float32, request-state order
    state_token_ids: torch.Tensor,
    state_parent_ids: torch.Tensor,
    state_depths: torch.Tensor,
    state_log_probs: torch.Tensor,
    # [max_num_reqs, budget + 1, num_words(budget)] int32, request-state order
    state_attn_mask: torch.Tensor,
    # [>= num_reqs, budget] int64: the draft tokens MRv2 reads (batch order)
    draft_tokens: torch.Tensor,
    # the drafter's trees, batch order: [>= num_reqs, width] with width <= budget
    # (masks [>= num_reqs, width + 1, num_words(width)])
    token_ids: torch.Tensor,
    parent_ids: torch.Tensor,
    depths: torch.Tensor,
    log_probs: torch.Tensor,
    attn_mask: torch.Tensor,
    # [num_reqs] request-state row of each batch row
    idx_mapping: torch.Tensor,
    num_reqs: int,
) -> None:
    """One launch for what a drafted step keeps: each batch row's tree into its
    request's state row, and the draft tokens MRv2 schedules (padding nodes,
    token -1, as token 0: any valid id enters the target batch, none is
    accepted). In place of five indexed copies and a clamp.

    A tree narrower than the state rows (the drafter builds fewer nodes for
    larger batches) fills the rest with padding nodes (token -1, log-prob
    -inf); its mask words past its own width are zeroed, so a verified row
    never reads another tree's bits. Padding rows' parents, depths and masks
    are left as they are: the verify writer and the walk read only their
    token."""
    budget, width = state_token_ids.shape[1], token_ids.shape[1]
    state_words, words = state_attn_mask.shape[2], attn_mask.shape[2]
    # The kernel trusts the shapes: a wider row would write into its neighbour.
    if width > budget or draft_tokens.shape[1] != budget:
        raise ValueError(
            f"trees of {width} nodes do not fit state rows of {budget} nodes "
            f"(draft tokens {tuple(draft_tokens.shape)})"
        )
    for state, src in (
        (state_token_ids, token_ids),
        (state_parent_ids, parent_ids),
        (state_depths, depths),
        (state_log_probs, log_probs),
        (state_attn_mask, attn_mask),
        (draft_tokens, token_ids),
    ):
        if state.dtype != src.dtype or src.shape[1] != width + (src is attn_mask):
            raise ValueError(
                f"tree rows differ: {tuple(state.shape)} {state.dtype} vs "
                f"{tuple(src.shape)} {src.dtype}"
            )
        if state.shape[1] != budget + (state is state_attn_mask):
            raise ValueError(f"state rows of {tuple(state.shape)}, budget {budget}")
    for t, num_words in ((state_attn_mask, state_words), (attn_mask, words)):
        if t.stride(2) != 1 or t.stride(1) != num_words:
            raise ValueError("tree masks must be contiguous per request")
    if num_reqs == 0:
        return
    _store_draft_trees_kernel[(num_reqs,)](
        state_token_ids,
        state_token_ids.stride(0),
        state_parent_ids,
        state_parent_ids.stride(0),
        state_depths,
        state_depths.stride(0),
        state_log_probs,
        state_log_probs.stride(0),
        state_attn_mask,
        state_attn_mask.stride(0),
        draft_tokens,
        draft_tokens.stride(0),
        token_ids,
        token_ids.stride(0),
        parent_ids,
        parent_ids.stride(0),
        depths,
        depths.stride(0),
        log_probs,
        log_probs.stride(0),
        attn_mask,
        attn_mask.stride(0),
        idx_mapping,
        budget,
        width,
        STATE_WORDS=state_words,
        WORDS=words,
        NODE_BLOCK=next_power_of_2(budget),
        WORD_BLOCK=next_power_of_2(state_words),
        # Tiles of at most 1024 words, whole rows of a power-of-2 count.
        ROW_BLOCK=min(
            next_power_of_2(width + 1),
            1 << ((1024 // next_power_of_2(state_words)).bit_length() - 1),
        ),
    )


@triton.jit
def _store_draft_trees_kernel(
    state_token_ids_ptr,
    state_token_ids_stride,
    state_parent_ids_ptr,
    state_parent_ids_stride,
    state_depths_ptr,
    state_depths_stride,
    state_log_probs_ptr,
    state_log_probs_stride,
    state_attn_mask_ptr,
    state_attn_mask_stride,
    draft_tokens_ptr,
    draft_tokens_stride,
    token_ids_ptr,
    token_ids_stride,
    parent_ids_ptr,
    parent_ids_stride,
    depths_ptr,
    depths_stride,
    log_probs_ptr,
    log_probs_stride,
    attn_mask_ptr,
    attn_mask_stride,
    idx_mapping_ptr,
    budget,
    width,
    STATE_WORDS: tl.constexpr,
    WORDS: tl.constexpr,
    NODE_BLOCK: tl.constexpr,
    WORD_BLOCK: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    slot = tl.load(idx_mapping_ptr + r).to(tl.int64)
    nodes = tl.arange(0, NODE_BLOCK)
    valid = nodes < budget
    built = nodes < width
    tokens = tl.load(token_ids_ptr + r * token_ids_stride + nodes, mask=built, other=-1)
    tl.store(state_token_ids_ptr + slot * state_token_ids_stride + nodes, tokens, valid)
    tl.store(
        draft_tokens_ptr + r * draft_tokens_stride + nodes,
        tl.maximum(tokens, 0),
        valid,
    )
    lp = tl.load(
        log_probs_ptr + r * log_probs_stride + nodes, mask=built, other=float("-inf")
    )
    tl.store(state_log_probs_ptr + slot * state_log_probs_stride + nodes, lp, valid)
    parents = tl.load(parent_ids_ptr + r * parent_ids_stride + nodes, mask=built)
    tl.store(
        state_parent_ids_ptr + slot * state_parent_ids_stride + nodes, parents, built
    )
    depth = tl.load(depths_ptr + r * depths_stride + nodes, mask=built)
    tl.store(state_depths_ptr + slot * state_depths_stride + nodes, depth, built)
    # Mask rows of the root and the built nodes; words past the tree's own are 0.
    word = tl.arange(0, WORD_BLOCK)
    for start in range(0, width + 1, ROW_BLOCK):
        row = start + tl.arange(0, ROW_BLOCK)
        in_rows = (row <= width)[:, None]
        src = attn_mask_ptr + r * attn_mask_stride + row[:, None] * WORDS
        w = tl.load(
            src + word[None, :], mask=in_rows & (word < WORDS)[None, :], other=0
        )
        dst = state_attn_mask_ptr + slot * state_attn_mask_stride
        tl.store(
            dst + row[:, None] * STATE_WORDS + word[None, :],
            w,
            mask=in_rows & (word < STATE_WORDS)[None, :],
        )


def draft_context_size(
    num_tokens: int, num_draft_tokens: int, num_reqs: int, path_len: int
) -> int:
    """Context entries of :func:`prepare_draft_inputs` for a batch: every row
    that is not a draft token, plus ``path_len`` path entries per request."""
    return num_tokens - num_draft_tokens + path_len * num_reqs


def draft_path_len(depth: int, max_tree_nodes: int) -> int:
    """Path entries per request in the drafter's context: the longest path a
    step can accept, at most the drafter's depth and at most the nodes of the
    largest tree the step verified (0 when it verified none). Each entry is a
    row of the drafter's context projections whether a node fills it or not,
    so a plain step of 64 requests with 15 entries each would project 1024
    rows for 64 committed ones."""
    return max(0, min(depth, max_tree_nodes))


def prepare_draft_inputs(
    # Drafter query outputs: [max_num_tokens] input ids (int32) and positions.
    query_input_ids: torch.Tensor,
    query_positions: torch.Tensor,
    # [max_num_reqs + 1] int32 and [max_num_reqs] int32, padded for CUDA graphs.
    query_start_loc_out: torch.Tensor,
    seq_lens_out: torch.Tensor,
    # [max_num_tokens] int64: the drafter KV group's slot mapping.
    query_slot_mapping: torch.Tensor,
    # [max_num_tokens] int64 context outputs: target row, position, drafter slot.
    context_rows: torch.Tensor,
    context_positions: torch.Tensor,
    context_slot_mapping: torch.Tensor,
    # [max_num_reqs * depth] int64: drafter rows whose logits are kept.
    sample_indices: torch.Tensor,
    # [num_tokens] target positions (tree positions for tree rows)
    target_positions: torch.Tensor,
    # [num_reqs + 1]
    target_query_start_loc: torch.Tensor,
    # [num_reqs + 1]
    cu_num_logits: torch.Tensor,
    # [num_reqs]
    idx_mapping: torch.Tensor,
    # [num_reqs] tokens emitted this step (0 for a chunked prefill)
    num_sampled: torch.Tensor,
    # [max_num_reqs, 1] / [max_num_reqs]
    last_sampled: torch.Tensor,
    next_prefill_tokens: torch.Tensor,
    # [num_reqs, depth] int32 accepted node per depth, [num_reqs] int32 count;
    # read only for requests that verified a tree.
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
    # [num_reqs, max_num_blocks] batch-ordered block table of the drafter group
    block_table: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    depth: int,
    max_num_reqs: int,
    max_num_tokens: int,
    max_model_len: int,
    path_len: int | None = None,
) -> None:
    """Drafter context and query inputs for the next DDTree step (see module doc).

    Context entries of request r start at ``q_start[r] - (cu_num_logits[r] - r) +
    path_len * r`` (``path_len``: :func:`draft_path_len`, default ``depth``);
    the query block of request r is rows ``r * (depth + 1) ..``.
    """
    num_reqs = idx_mapping.shape[0]
    if path_len is None:
        path_len = depth
    if not 0 <= path_len <= depth:
        raise ValueError(f"path_len must be in [0, {depth}], got {path_len}")
    _prepare_draft_inputs_kernel[(num_reqs,)](
        query_input_ids,
        query_positions,
        query_start_loc_out,
        seq_lens_out,
        query_slot_mapping,
        context_rows,
        context_positions,
        context_slot_mapping,
        sample_indices,
        target_positions,
        target_query_start_loc,
        cu_num_logits,
        idx_mapping,
        num_sampled,
        last_sampled,
        next_prefill_tokens,
        accepted_nodes,
        accepted_nodes.stride(0),
        num_accepted,
        block_table,
        block_table.stride(0),
        block_table.shape[1],
        block_size,
        mask_token_id,
        max_num_reqs,
        max_num_tokens,
        max_model_len,
        path_len,
        DEPTH=depth,
        PATH_BLOCK=next_power_of_2(depth),
        QUERY_BLOCK=next_power_of_2(depth + 1),
        PAD_SLOT=PAD_SLOT_ID,
        BLOCK=256,
    )


@triton.jit
def _slot_of(block_table_row_ptr, pos, block_size, max_num_blocks):
    block = tl.minimum(pos // block_size, max_num_blocks - 1)
    block_id = tl.load(block_table_row_ptr + block).to(tl.int64)
    return block_id * block_size + pos % block_size


@triton.jit(
    do_not_specialize=["max_num_reqs", "max_num_tokens", "max_model_len", "path_len"]
)
def _prepare_draft_inputs_kernel(
    # [max_num_tokens]
    query_input_ids_ptr,
    query_positions_ptr,
    # [max_num_reqs + 1], [max_num_reqs]
    query_start_loc_out_ptr,
    seq_lens_out_ptr,
    # [max_num_tokens]
    query_slot_mapping_ptr,
    # [max_num_tokens]
    context_rows_ptr,
    context_positions_ptr,
    context_slot_mapping_ptr,
    # [max_num_reqs * DEPTH]
    sample_indices_ptr,
    # [num_tokens]
    target_positions_ptr,
    # [num_reqs + 1]
    target_query_start_loc_ptr,
    # [num_reqs + 1]
    cu_num_logits_ptr,
    # [num_reqs]
    idx_mapping_ptr,
    # [num_reqs]
    num_sampled_ptr,
    # [max_num_reqs]
    last_sampled_ptr,
    next_prefill_tokens_ptr,
    # [num_reqs, DEPTH]
    accepted_nodes_ptr,
    accepted_nodes_stride,
    # [num_reqs]
    num_accepted_ptr,
    # [num_reqs, max_num_blocks]
    block_table_ptr,
    block_table_stride,
    max_num_blocks,
    block_size,
    mask_token_id,
    max_num_reqs,
    max_num_tokens,
    max_model_len,
    # Context path entries per request (<= DEPTH).
    path_len,
    DEPTH: tl.constexpr,
    PATH_BLOCK: tl.constexpr,
    QUERY_BLOCK: tl.constexpr,
    PAD_SLOT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    req_idx = tl.program_id(0)
    num_reqs = tl.num_programs(0)
    draft_len = DEPTH + 1
    req_state_idx = tl.load(idx_mapping_ptr + req_idx)
    block_row = block_table_ptr + req_idx.to(tl.int64) * block_table_stride

    q_start = tl.load(target_query_start_loc_ptr + req_idx)
    q_end = tl.load(target_query_start_loc_ptr + req_idx + 1)
    logits_start = tl.load(cu_num_logits_ptr + req_idx)
    num_logits = tl.load(cu_num_logits_ptr + req_idx + 1) - logits_start
    tree_start = q_end - num_logits
    num_prefix = tree_start - q_start
    num_accepted = tl.load(num_accepted_ptr + req_idx)
    num_accepted = tl.where(num_logits > 1, num_accepted, 0)

    # --- Context: rows before the root, the root, then the accepted path ---
    ctx_start = q_start - (logits_start - req_idx) + path_len * req_idx
    num_ctx = num_prefix + 1 + path_len
    # No tree accepts more nodes than it has, so path_len holds every path;
    # the bound keeps a request's entries inside its region regardless.
    num_path = tl.minimum(num_accepted, path_len)
    path_offs = tl.arange(0, PATH_BLOCK)
    path = tl.load(
        accepted_nodes_ptr + req_idx * accepted_nodes_stride + path_offs,
        mask=path_offs < num_path,
        other=0,
    )
    for i in range(0, num_ctx, BLOCK):
        c = i + tl.arange(0, BLOCK)
        is_ctx = c < num_ctx
        d = c - num_prefix  # depth on the path; <= 0 before and at the root
        # Path entry d holds node path[d - 1]; pick it out of the loaded path.
        node = tl.sum(
            tl.where(path_offs[None, :] == (d - 1)[:, None], path[None, :], 0), axis=1
        )
        keep = is_ctx & (d <= num_path)
        row = tl.where(d >= 1, tree_start + node, q_start + c)
        pos = tl.load(target_positions_ptr + row, mask=is_ctx, other=0)
        slot = _slot_of(block_row, pos, block_size, max_num_blocks)
        slot = tl.where(keep, slot, PAD_SLOT)
        tl.store(context_rows_ptr + ctx_start + c, row.to(tl.int64), mask=is_ctx)
        tl.store(context_positions_ptr + ctx_start + c, pos, mask=is_ctx)
        tl.store(context_slot_mapping_ptr + ctx_start + c, slot, mask=is_ctx)

    # --- Query block: bonus token at the next position, then DEPTH masks ---
    if tl.load(num_sampled_ptr + req_idx) > 0:
        bonus = tl.load(last_sampled_ptr + req_state_idx).to(tl.int32)
    else:
        # Chunked prefill: the drafter starts from the next prompt token.
        bonus = tl.load(next_prefill_tokens_ptr + req_state_idx).to(tl.int32)
    last_pos = tl.load(target_positions_ptr + tree_start) + num_accepted
    off = tl.arange(0, QUERY_BLOCK)
    is_query = off < draft_len
    query_idx = req_idx * draft_len + off
    query_pos = last_pos + 1 + off
    input_id = tl.where(off == 0, bonus, mask_token_id)
    q_slot = _slot_of(block_row, query_pos, block_size, max_num_blocks)
    q_slot = tl.where(query_pos < max_model_len, q_slot, PAD_SLOT)
    tl.store(query_input_ids_ptr + query_idx, input_id, mask=is_query)
    tl.store(
        query_positions_ptr + query_idx,
        tl.minimum(query_pos, max_model_len - 1),
        mask=is_query,
    )
    tl.store(query_slot_mapping_ptr + query_idx, q_slot, mask=is_query)
    is_sample = is_query & (off >= 1)
    tl.store(
        sample_indices_ptr + req_idx * DEPTH + off - 1,
        query_idx.to(tl.int64),
        mask=is_sample,
    )
    tl.store(query_start_loc_out_ptr + req_idx, req_idx * draft_len)
    tl.store(seq_lens_out_ptr + req_idx, (last_pos + 1 + draft_len).to(tl.int32))

    if req_idx == num_reqs - 1:
        # Pad for CUDA graphs sized past num_reqs: empty requests, PAD query
        # slots (no KV writes), sample rows pointing at row 0.
        end = num_reqs * draft_len
        for i in range(num_reqs, max_num_reqs + 1, BLOCK):
            r = i + tl.arange(0, BLOCK)
            tl.store(query_start_loc_out_ptr + r, end, mask=r < max_num_reqs + 1)
            tl.store(seq_lens_out_ptr + r, 0, mask=r < max_num_reqs)
        for i in range(num_reqs * DEPTH, max_num_reqs * DEPTH, BLOCK):
            s = i + tl.arange(0, BLOCK)
            tl.store(sample_indices_ptr + s, 0, mask=s < max_num_reqs * DEPTH)
        for i in range(end, max_num_tokens, BLOCK):
            t = i + tl.arange(0, BLOCK)
            tl.store(query_slot_mapping_ptr + t, PAD_SLOT, mask=t < max_num_tokens)
