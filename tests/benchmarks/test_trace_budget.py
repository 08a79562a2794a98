# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/trace_budget.py's summary of recorded controller decisions."""

import pytest

from benchmarks import trace_budget as tb


def _record(phase, n, b, drafted, period):
    return {
        "ph": phase,
        "n": n,
        "cap": 15,
        "has": b > 0,
        "timed": True,
        "b": b,
        "pred": {0: 1.0, 15: 2.0},
        "pred0d": 1.5,
        "e": {0: 0.0, 15: 0.7},
        "drafted": drafted,
        "period": period,
    }


def test_summary_reports_each_phase_and_shape(capsys):
    records = [_record("c8T1", 8, 0, False, 2.0 + i / 10) for i in range(5)]
    records += [_record("c8T1", 8, 15, True, 4.0) for _ in range(3)]
    records += [_record("c1T0", 1, 15, True, 3.0) for _ in range(2)]
    tb.summarize(records)
    out = capsys.readouterr().out
    assert "== c8T1: 8 steps, drafted 3, b shares {0: 5, 15: 3}" in out
    assert "shape n=8 b=0 drafted=False: 5 periods, median 2.20 ms" in out
    assert "shape n=8 b=15 drafted=True: 3 periods, median 4.00 ms" in out
    assert "== c1T0: 2 steps, drafted 2" in out
    assert "of 8 steps at n=8: has_trees 3" in out


def test_draft_decisions_are_summarized(capsys):
    records = [_record("c64T1", 40, 3, True, 10.0) for _ in range(4)]
    for i, r in enumerate(records):
        r["draft"] = {"did": i < 3, "best": 3 if i < 3 else 0, "cap": 15, "plain": 6.0}
    tb.summarize(records)
    out = capsys.readouterr().out
    assert "draft decisions: drafted 3 of 4, best budgets [(3, 3), (0, 1)]" in out
    assert "plain step predicted 6.00 ms" in out


def test_phases_and_model_paths_parse():
    args = tb.parse_args(["adaptive", "/tmp/o", "--phases", "64:1:256,8:0:32"])
    assert args.phases == [(64, 1.0, 256), (8, 0.0, 32)]
    assert args.target.endswith("pycode/target") and args.kv_gib == 2.0
    assert tb.parse_args(["none", "/tmp/o"]).phases == tb.PHASES
    for bad in ("64:1", "0:1:4", "8:0:4", "a:b:c"):
        with pytest.raises(ValueError, match="--phases"):
            tb.parse_phases(bad)
