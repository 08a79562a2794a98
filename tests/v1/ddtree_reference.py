# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Slow CPU references for the DDTree ops, used by the tests and benchmarks.

``build_ddtree_reference`` is the DDTree paper's best-first heap, run one request at a
time in Python. ``walk_trees_reference``, ``compact_tree_kv_reference``,
``write_tree_verify_inputs_reference`` and ``prepare_draft_inputs_reference`` are
per-request Python versions of the GPU walk, KV compaction and step-input writers
with the same contracts. ``tree_from_parents`` turns any parent array (chains, hand-made
trees) into a ``DDTree`` so the attention, walk and compaction tests can use trees
the builder would never produce.
"""

import heapq

import numpy as np
import torch

from vllm.v1.attention.backends.utils import PAD_SLOT_ID
from vllm.v1.attention.ops.tree_kv_compaction import _unique_caches
from vllm.v1.sample.tree_rejection_sampler import TreeSampleOutput
from vllm.v1.attention.ops.tree_mask import num_mask_words
from vllm.v1.spec_decode.dflash_tree_builder import DDTree


def _ancestor_mask(parent_ids: torch.Tensor) -> torch.Tensor:
    """[budget] parents (0 = root) -> [budget + 1, num_words] int32 packed mask."""
    budget = parent_ids.numel()
    bits = np.zeros((budget + 1, num_mask_words(budget) * 32), dtype=np.uint8)
    parents = [0] + parent_ids.tolist()
    for node in range(budget + 1):
        cur = node
        bits[node, 0] = 1
        while cur != 0:
            bits[node, cur] = 1
            cur = parents[cur]
    words = np.packbits(bits, axis=1, bitorder="little").view(np.uint32)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def tree_from_parents(token_ids, parent_ids) -> DDTree:
    """Build a DDTree from per-request token and parent lists (CPU tensors).

    token_ids, parent_ids: [num_reqs, budget]; parent_ids are 0 (root) or the 1-based
    index of an earlier node. Depths and masks are derived.
    """
    token_ids = torch.as_tensor(token_ids, dtype=torch.int64)
    parent_ids = torch.as_tensor(parent_ids, dtype=torch.int32)
    num_reqs, budget = parent_ids.shape
    depths = torch.zeros(num_reqs, budget, dtype=torch.int32)
    for r in range(num_reqs):
        for n in range(budget):
            p = int(parent_ids[r, n])
            assert 0 <= p <= n, "parent must come before child"
            depths[r, n] = 1 if p == 0 else depths[r, p - 1] + 1
    mask = torch.stack([_ancestor_mask(parent_ids[r]) for r in range(num_reqs)])
    num_nodes = torch.full((num_reqs,), budget, dtype=torch.int32)
    return DDTree(token_ids, parent_ids, depths, mask, num_nodes)


def build_ddtree_reference(
    draft_logits: torch.Tensor, budget: int, lse: torch.Tensor | None = None
) -> DDTree:
    """The best-first heap of the DDTree paper, with the builder's exact tie rules.

    Nodes come out in canonical order: score (sum of fp32 per-depth log-probs)
    descending, then depth, then the parent's rank among the nodes of its depth,
    then the token's rank at its depth (logit descending, token id ascending).
    Prefixes of probability zero are never nodes; missing nodes are padding.
    ``lse`` ([num_reqs, depth]) overrides the log-normalisers, so the builder's own
    can be used and log-probs agree to the last bit.
    """
    num_reqs, depth, vocab = draft_logits.shape
    logits = draft_logits.float()
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1)
    logp = (logits - lse.to(logits.device)[..., None]).cpu().numpy()
    # Token rank: logit descending, token id ascending (stable sort).
    order = torch.sort(logits.cpu(), dim=-1, descending=True, stable=True).indices
    order = order.numpy()

    token_ids = torch.full((num_reqs, budget), -1, dtype=torch.int64)
    parent_ids = torch.zeros((num_reqs, budget), dtype=torch.int32)
    depths = torch.zeros((num_reqs, budget), dtype=torch.int32)
    num_nodes = torch.zeros(num_reqs, dtype=torch.int32)
    log_probs = torch.full((num_reqs, budget), -torch.inf, dtype=torch.float32)
    for r in range(num_reqs):
        lp = [logp[r, d, order[r, d]] for d in range(depth)]  # sorted per depth
        node_score = [np.float32(0.0)]  # by node index; the root scores 0
        heap: list = []

        def push(parent_node, d, parent_rank, tok_rank):
            if tok_rank >= vocab:
                return
            score = np.float32(node_score[parent_node] + lp[d - 1][tok_rank])
            if score > -np.inf:
                key = (-float(score), d, parent_rank, tok_rank)
                heapq.heappush(heap, (key, parent_node, score))

        push(0, 1, 0, 0)
        rank_at_depth = [0] * (depth + 1)
        n = 0
        while n < budget and heap:
            (_, d, prank, trank), parent_node, score = heapq.heappop(heap)
            token_ids[r, n] = int(order[r, d - 1, trank])
            parent_ids[r, n] = parent_node
            depths[r, n] = d
            log_probs[r, n] = float(score)
            n += 1
            node_score.append(score)
            own_rank = rank_at_depth[d]
            rank_at_depth[d] += 1
            push(parent_node, d, prank, trank + 1)  # next sibling
            if d < depth:
                push(n, d + 1, own_rank, 0)  # first child
        num_nodes[r] = n
    mask = torch.stack([_ancestor_mask(parent_ids[r]) for r in range(num_reqs)])
    return DDTree(token_ids, parent_ids, depths, mask, num_nodes, log_probs)


def compact_tree_kv_reference(
    kv_caches: list[torch.Tensor],
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Slow torch version of ``TreeKVCompactor.__call__``, for tests: slot d of
    each request receives the original KV of slot idx_d, padding slots skipped."""
    slots = slot_mapping.tolist()
    starts = query_start_loc.tolist()
    src, dst = [], []
    for r, k in enumerate(num_accepted.tolist()):
        for d, node in enumerate(accepted_nodes[r, :k].tolist(), start=1):
            s, t = slots[starts[r] + node], slots[starts[r] + d]
            if s >= 0 and t >= 0:
                src.append(s)
                dst.append(t)
    if not src:
        return
    for cache in _unique_caches(kv_caches):
        block_size = cache.shape[2]
        s = torch.tensor(src, device=cache.device)
        t = torch.tensor(dst, device=cache.device)
        moved = cache[:, s // block_size, s % block_size].clone()
        cache[:, t // block_size, t % block_size] = moved


def prepare_draft_inputs_reference(
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
    num_accepted,
    block_table,
    block_size,
    mask_token_id,
    depth,
    max_num_reqs,
    max_num_tokens,
    max_model_len,
    path_len=None,
) -> None:
    """Slow torch version of :func:`prepare_draft_inputs`, for tests."""
    num_reqs = idx_mapping.shape[0]
    path_len = depth if path_len is None else path_len
    qsl, cu = target_query_start_loc.tolist(), cu_num_logits.tolist()
    pos = target_positions.tolist()
    last_sampled = last_sampled.reshape(-1)

    def slot(r: int, p: int) -> int:
        block = min(p // block_size, block_table.shape[1] - 1)
        return int(block_table[r, block]) * block_size + p % block_size

    draft_len = depth + 1
    for r in range(num_reqs):
        req = int(idx_mapping[r])
        num_logits = cu[r + 1] - cu[r]
        tree_start = qsl[r + 1] - num_logits
        k = int(num_accepted[r]) if num_logits > 1 else 0
        path = [tree_start + int(n) for n in accepted_nodes[r, : min(k, path_len)]]
        ctx = list(range(qsl[r], tree_start + 1)) + path
        ctx_start = qsl[r] - (cu[r] - r) + path_len * r
        num_ctx = tree_start + 1 - qsl[r] + path_len
        for c in range(num_ctx):
            row = ctx[c] if c < len(ctx) else tree_start
            context_rows[ctx_start + c] = row
            context_positions[ctx_start + c] = pos[row]
            keep = c < len(ctx)
            context_slot_mapping[ctx_start + c] = (
                slot(r, pos[row]) if keep else (PAD_SLOT_ID)
            )
        last_pos = pos[tree_start] + k
        if int(num_sampled[r]) > 0:
            bonus = int(last_sampled[req])
        else:
            bonus = int(next_prefill_tokens[req])
        for off in range(draft_len):
            q = r * draft_len + off
            p = last_pos + 1 + off
            query_input_ids[q] = bonus if off == 0 else mask_token_id
            query_positions[q] = min(p, max_model_len - 1)
            query_slot_mapping[q] = slot(r, p) if p < max_model_len else PAD_SLOT_ID
            if off > 0:
                sample_indices[r * depth + off - 1] = q
        query_start_loc_out[r] = r * draft_len
        seq_lens_out[r] = last_pos + 1 + draft_len
    query_start_loc_out[num_reqs:] = num_reqs * draft_len
    seq_lens_out[num_reqs:] = 0
    sample_indices[num_reqs * depth : max_num_reqs * depth] = 0
    query_slot_mapping[num_reqs * draft_len : max_num_tokens] = PAD_SLOT_ID


def walk_trees_reference(
    node_sampled: torch.Tensor,
    tree_token_ids: torch.Tensor,
    tree_parent_ids: torch.Tensor,
    cu_num_logits: torch.Tensor,
    max_depth: int,
    fed_token_ids: torch.Tensor | None = None,
) -> TreeSampleOutput:
    """Slow Python walk with ``walk_trees``'s contract, for tests."""
    # sync-ok: reference only, never on the step path.
    fed = None if fed_token_ids is None else fed_token_ids.cpu().tolist()  # sync-ok
    node_sampled = node_sampled.cpu().tolist()  # sync-ok
    tokens = tree_token_ids.cpu().tolist()  # sync-ok
    parents = tree_parent_ids.cpu().tolist()  # sync-ok
    cu = cu_num_logits.cpu().tolist()  # sync-ok
    num_reqs, budget = tree_token_ids.shape
    sampled = torch.full((num_reqs, budget + 1), -1, dtype=torch.int64)
    accepted = torch.full((num_reqs, max_depth), -1, dtype=torch.int32)
    num_accepted = torch.zeros(num_reqs, dtype=torch.int32)
    num_sampled = torch.zeros(num_reqs, dtype=torch.int32)
    for r in range(num_reqs):
        start, num_nodes = cu[r], cu[r + 1] - cu[r] - 1
        if num_nodes < 0:
            continue
        children: dict[tuple[int, int], int] = {}
        for i in range(1, num_nodes + 1):
            token = tokens[r][i - 1]
            if token >= 0 and (fed is None or fed[start + i] == token):
                children[(parents[r][i - 1], tokens[r][i - 1])] = i
        cur, y = 0, node_sampled[start]
        path_tokens = [y]
        while len(path_tokens) <= max_depth and (cur, y) in children:
            cur = children[(cur, y)]
            accepted[r, len(path_tokens) - 1] = cur
            y = node_sampled[start + cur]
            path_tokens.append(y)
        sampled[r, : len(path_tokens)] = torch.tensor(path_tokens)
        num_sampled[r] = len(path_tokens)
        num_accepted[r] = len(path_tokens) - 1
    return TreeSampleOutput(sampled, num_sampled, accepted, num_accepted)


def write_tree_verify_inputs_reference(
    positions: torch.Tensor,
    attn_mask: torch.Tensor,
    is_tree: torch.Tensor,
    tree_token_ids: torch.Tensor,
    tree_depths: torch.Tensor,
    tree_masks: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    cu_num_logits: torch.Tensor,
    num_reqs_padded: int,
) -> None:
    """Slow torch version of :func:`write_tree_verify_inputs`, for tests."""
    num_reqs = idx_mapping.shape[0]
    num_words = tree_masks.shape[2]
    qsl, cu = query_start_loc.tolist(), cu_num_logits.tolist()
    is_tree[num_reqs:num_reqs_padded] = 0
    for r in range(num_reqs):
        num_logits = cu[r + 1] - cu[r]
        b = num_logits - 1
        root = qsl[r + 1] - num_logits
        # 1 + the root's query row: the rows before it are causal.
        is_tree[r] = 1 + root - qsl[r] if b > 0 else 0
        if b <= 0:
            continue
        req = int(idx_mapping[r])
        real = tree_token_ids[req, :b] >= 0
        depths = torch.where(real, tree_depths[req, :b], 0)
        positions[root + 1 : root + 1 + b] = positions[root] + depths
        attn_mask[r, 0] = 0
        attn_mask[r, 0, 0] = 1
        for j in range(1, b + 1):
            if real[j - 1]:
                attn_mask[r, j] = tree_masks[req, j]
            else:
                row = torch.zeros(num_words, dtype=torch.int64)
                row[0] |= 1
                row[j // 32] |= 1 << (j % 32)
                attn_mask[r, j] = row.to(torch.int32)
