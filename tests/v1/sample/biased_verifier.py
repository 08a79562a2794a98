# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A deliberately biased tree verifier, to show that a distribution test of
tree verification can fail.

It is the textbook speculative-sampling test ``accept x with min(1, p(x) /
q(x))`` applied to DDTree's trees, whose siblings are the drafter's
deterministic top tokens, so q is a point mass (q(x) = 1) at each child: walk
from the root, try the current node's children in node order, accept child x
with probability min(1, p(x)); when every child is rejected, emit a fresh sample
of p as the bonus (instead of a sample of the residual). Tokens that are
children get probability above p: biased. Test-only: an engine-level test
installs it in the engine's process with ``install_biased_verifier``.
"""

import torch

from vllm.v1.sample import tree_rejection_sampler as trs


def biased_tree_rejection_sample(
    processed_logits,
    tree_token_ids,
    tree_parent_ids,
    cu_num_logits,
    pos,
    expanded_idx_mapping,
    temperature,
    seeds,
    max_depth,
    use_fp64=False,
    fed_token_ids=None,
    tree_rows=None,
):
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    node_sampled = gumbel_sample(
        processed_logits,
        expanded_idx_mapping,
        temperature,
        seeds,
        pos,
        apply_temperature=False,
        use_fp64=use_fp64,
    )
    probs = torch.softmax(processed_logits.float(), dim=-1)
    budget = tree_token_ids.shape[1]
    # Request r's tree is row tree_rows[r] of the tree tensors (MRv2 slot order).
    if tree_rows is None:
        rows = list(range(tree_token_ids.shape[0]))
    else:
        rows = tree_rows.tolist()
    num_reqs = len(rows)
    tokens = [tree_token_ids[t].tolist() for t in rows]
    parents = [tree_parent_ids[t].tolist() for t in rows]
    cu, ys = cu_num_logits.tolist(), node_sampled.tolist()
    fed = None if fed_token_ids is None else fed_token_ids.tolist()
    sampled = torch.full((num_reqs, budget + 1), -1, dtype=torch.int64)
    accepted = torch.full((num_reqs, max_depth), -1, dtype=torch.int32)
    num_accepted = torch.zeros(num_reqs, dtype=torch.int32)
    num_sampled = torch.zeros(num_reqs, dtype=torch.int32)
    for r in range(num_reqs):
        start, b = cu[r], cu[r + 1] - cu[r] - 1
        if b < 0:
            continue
        children: dict[int, list[int]] = {}
        for i in range(1, b + 1):
            tok = tokens[r][i - 1]
            if tok >= 0 and (fed is None or fed[start + i] == tok):
                children.setdefault(parents[r][i - 1], []).append(i)
        cur, emitted = 0, []
        while len(emitted) < max_depth:
            row = probs[start + cur]
            nxt = next(
                (
                    c
                    for c in children.get(cur, ())
                    if float(torch.rand(())) < float(row[tokens[r][c - 1]])
                ),
                None,
            )
            if nxt is None:
                break
            emitted.append(tokens[r][nxt - 1])
            accepted[r, len(emitted) - 1] = nxt
            cur = nxt
        emitted.append(ys[start + cur])
        sampled[r, : len(emitted)] = torch.tensor(emitted)
        num_sampled[r] = len(emitted)
        num_accepted[r] = len(emitted) - 1
    device = processed_logits.device
    return trs.TreeSampleOutput(
        sampled.to(device),
        num_sampled.to(device),
        accepted.to(device),
        num_accepted.to(device),
    )


def install_biased_verifier() -> None:
    trs.tree_rejection_sample = biased_tree_rejection_sample
