# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/trace_budget.py's summary of recorded controller decisions."""

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
