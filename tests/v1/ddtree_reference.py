# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Slow CPU references for the DDTree ops, used by the tests and benchmarks.

``build_ddtree_reference`` is the DDTree paper's best-first heap, run one request at a
time in Python. ``tree_from_parents`` turns any parent array (chains, hand-made
trees) into a ``DDTree`` so the attention, walk and compaction tests can use trees
the builder would never produce.
"""

import heapq

import numpy as np
import torch

from vllm.v1.spec_decode.dflash_tree_builder import DDTree, num_mask_words


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
            n += 1
            node_score.append(score)
            own_rank = rank_at_depth[d]
            rank_at_depth[d] += 1
            push(parent_node, d, prank, trank + 1)  # next sibling
            if d < depth:
                push(n, d + 1, own_rank, 0)  # first child
        num_nodes[r] = n
    mask = torch.stack([_ancestor_mask(parent_ids[r]) for r in range(num_reqs)])
    return DDTree(token_ids, parent_ids, depths, mask, num_nodes)
