# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The acceptance simulation of benchmarks/tree_acceptance.py on hand-made
drafts: the accepted depth per budget follows the best-first tree's first b
nodes, the chain its top-1 tokens, and the greedy walk commits from where the
last step ended."""

import torch

from benchmarks import tree_acceptance as ta


def _logits(prefs, vocab=5):
    """[1, depth, vocab] logits whose per-depth log-probs favour ``prefs``
    (one list of (token, logit) per depth; the rest get -10)."""
    out = torch.full((1, len(prefs), vocab), -10.0)
    for d, pairs in enumerate(prefs):
        for token, value in pairs:
            out[0, d, token] = value
    return out


def test_accepted_depth_grows_with_the_budget():
    # Depth 1: token 1 ahead of token 2; depth 2: token 3 ahead of token 4;
    # depth 3: token 0 only. The target's path is 2, 3, 0: the drafter's
    # second choice at depth 1, so the chain accepts nothing.
    logits = _logits([[(1, 2.0), (2, 1.5)], [(3, 2.0), (4, 0.0)], [(0, 3.0)]])
    labels = torch.tensor([[2, 3, 0]])
    depths = ta.accepted_depths(logits, labels, [1, 2, 3, 4, 5, 6, 8])
    # Log-probs: depth 1: -0.47 (1), -0.97 (2); depth 2: -0.13 (3), -2.13 (4);
    # depth 3: ~0 (0). Best first: (1) -0.47, (1,3) -0.60, (1,3,0) -0.60 (the
    # shallower first on a tie), (2) -0.97, (2,3) -1.10, (2,3,0) -1.10, ...
    assert depths[0].tolist() == [0, 0, 0, 1, 2, 3, 3]
    assert ta.chain_depths(logits[0], labels[0]) == 0


def test_chain_is_the_top1_prefix():
    logits = _logits([[(1, 2.0)], [(3, 2.0)], [(4, 2.0)]])[0]
    assert ta.chain_depths(logits, torch.tensor([1, 3, 0])) == 2
    assert ta.chain_depths(logits, torch.tensor([1, 3, 4])) == 3


def test_walk_starts_each_step_where_the_last_ended():
    # Steps at positions 0 (commits 3), 3 (commits 1), 4 (commits 2): 6 tokens.
    commits = torch.tensor([3, 9, 9, 1, 2, 9])
    assert ta.walk(commits) == (6, 3)
    assert ta.walk(torch.ones(5, dtype=torch.long)) == (5, 5)


def test_drafted_blocks_on_fewer_rows():
    """The trained pair's drafter on its whole block (``rows`` None or the
    block size: the same logits) and on its first 4 rows (depths 1-3 only,
    drafted without the later masks, so other logits)."""
    blocks = [
        [b for b in ta.drafted_blocks(ta.PAIR, 2, 40, rows) if b is not None]
        for rows in (None, 16, 4)
    ]
    whole, sixteen, four = blocks
    assert len(whole) == len(sixteen) == len(four) >= 1
    compared = 0
    for (lw, bw), (l16, b16), (l4, b4) in zip(whole, sixteen, four):
        assert lw.shape[1] == 15 and l4.shape[1] == 3
        assert torch.equal(lw, l16) and torch.equal(bw, b16)
        assert torch.equal(b4, bw[:, :3])
        assert not torch.allclose(l4, lw[:, :3])
        compared += lw.shape[0]
    print(f"{compared} anchors compared")
    assert compared >= 20
