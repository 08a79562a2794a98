# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/calibration_replay.py on hand-made trees: the walk commits from
where the last step ended, the observation is the accepted paths' length, the
prediction the nodes' values under the rate before each step, and the windows
difference the running totals."""

import itertools
import math

import pytest
import torch

from benchmarks import calibration_replay as cr
from vllm.v1.spec_decode.ddtree_budget import TreeAcceptanceCalibration


def _trees():
    # One prompt of 6 anchors, trees of 3 nodes: node 1 at depth 1, nodes 2
    # and 3 its children. on_path: anchor 0 accepts nodes 1 and 3 (commits 3
    # tokens, so the next step is anchor 3), anchor 3 accepts nothing, anchor 4
    # node 1 only (the walk ends past anchor 5).
    log_probs = torch.tensor([[-0.1, -0.5, -1.0]] * 6)
    on_path = torch.zeros(6, 3, dtype=torch.bool)
    on_path[0, [0, 2]] = True
    on_path[4, 0] = True
    return [(log_probs, on_path)]


def test_replay_walks_and_feeds_the_calibration():
    history = cr.replay(_trees(), budget=3, depth=4)
    # Steps at anchors 0, 3, 4: observed 2, 0, 1 accepted nodes.
    assert [round(o) for _, o in history] == [2, 2, 3]
    # Each step's prediction is its tree's values under the rate the earlier
    # steps left: the same calibration fed the same steps says so.
    calib = TreeAcceptanceCalibration(torch.device("cpu"))
    want = []
    for accepted in ([1, 3], [], [1]):
        want.append(_values(calib, accepted))
    got = [history[0][0]] + [b[0] - a[0] for a, b in itertools.pairwise(history)]
    for g, w in zip(got, want):
        assert math.isclose(g, w, rel_tol=1e-5), (got, want)
    # The rate moved: the node on no accepted path (node 2) now counts less.
    assert not math.isclose(want[0], want[2], rel_tol=1e-3)


def _values(calib, accepted) -> float:
    """Feed one step of the hand-made tree (``accepted`` 1-based nodes); return
    the prediction it adds."""
    before = calib.totals[0].item()
    nodes = torch.zeros(1, 4, dtype=torch.int32)
    nodes[0, : len(accepted)] = torch.tensor(accepted, dtype=torch.int32)
    calib.update(
        torch.tensor([[-0.1, -0.5, -1.0]]),
        torch.zeros(1, dtype=torch.int64),
        torch.zeros(1),
        torch.tensor([0, 4], dtype=torch.int32),
        nodes,
        torch.tensor([len(accepted)], dtype=torch.int32),
    )
    return calib.totals[0].item() - before


def test_summarize_windows():
    # Predicted 1 per step, observed 2 per step for 150 steps, then 1.
    history, p, o = [], 0.0, 0.0
    for step in range(250):
        p, o = p + 1, o + (2 if step < 150 else 1)
        history.append((p, o))
    s = cr.summarize(history)
    assert s["steps"] == 250
    # Windows of 100 steps; the last 50 are no window of their own.
    assert s["error_by_window"] == [-0.5, round(100 / 150 - 1, 4)]
    assert s["error_over_run"] == pytest.approx(250 / 400 - 1, abs=1e-4)
