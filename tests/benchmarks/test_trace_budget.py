# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/trace_budget.py's summary of recorded controller decisions."""

import json

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


def test_estimate_updates_count_drafted_steps_on_an_unchanged_estimate(capsys):
    """A step drafted right after a drafted step and planned on the same
    estimate as the decision before it is counted (the trace's check that the
    estimate follows the steps); the longest run of unchanged decisions too."""
    records = [_record("c64T1", 64, 3, True, 10.0) for _ in range(7)]
    for i, e in enumerate([0.5, 0.5, 0.6, 0.6, 0.6, 0.6, 0.7]):
        records[i]["e"] = {0: 0.0, 3: e}
    records[3]["drafted"] = False
    tb.summarize(records)
    out = capsys.readouterr().out
    # Drafted after a drafted step: 1, 2, 5, 6 (4 follows the plain step 3).
    # Of those, 1 and 5 kept the estimate of the decision before; 3-5 are
    # the longest run of unchanged decisions.
    assert (
        "estimate unchanged from the decision before: 2 of 4 steps drafted after "
        "a drafted step; longest run of unchanged decisions 3" in out
    )


def test_time_by_kind_splits_a_phase_by_step_kinds_and_their_predictions():
    """Each step's period goes to its kind and the kind before it (a period
    holds two steps' work), split by whether the batch changed; a period's
    median and mean (a tail shows in the mean only) next to the median
    prediction for the chosen shape (the drafter's for D). Keys come back as
    strings from a JSON trace."""
    plain = [_record("p", 8, 0, False, x) for x in (20.0, 10.0, 10.0, 40.0)]
    probe = _record("p", 8, 0, True, 50.0)
    tree = _record("p", 8, 15, True, 40.0)
    joined = {**_record("p", 9, 0, False, 120.0), "timed": False}
    rs = json.loads(json.dumps(plain + [probe, tree, joined]))
    lines = tb._time_by_kind(rs)
    assert lines[0].startswith("   time by kind (0.27 s over 6 steps;")
    assert lines[1:] == [
        "     T -> prompt P, batch changed: 1, 0.12 s, 44 %, 120.00 / 120.00 / 1.00",
        "     P -> P, same batch: 3, 0.06 s, 22 %, 10.00 / 20.00 / 1.00",
        "     P -> D, same batch: 1, 0.05 s, 19 %, 50.00 / 50.00 / 1.50",
        "     D -> T, same batch: 1, 0.04 s, 15 %, 40.00 / 40.00 / 2.00",
    ]
    # Beyond ``top`` groups, the rest in one line.
    assert tb._time_by_kind(rs, top=2)[-1] == "     2 other groups: 2, 0.09 s, 33 %"


def test_throughput_sets_what_was_predicted_against_what_was_traced():
    """Expected tokens (a tree step's requests times 1 + e(b)) over the
    predicted and the traced periods, and requests over the plain
    predictions; every step, then pure decode steps alone."""
    plain = _record("p", 8, 0, False, 2.0)  # 8 tokens, predicted 1.0 ms
    tree = _record("p", 8, 15, True, 4.0)  # 8 x 1.7 tokens, predicted 2.0 ms
    joined = {**_record("p", 8, 0, False, 10.0), "timed": False}
    line = tb._throughput(json.loads(json.dumps([plain, tree, joined])))
    assert line == (
        "   expected tokens per ms: 7.40 predicted, 1.85 traced, 8.00 plain "
        "predicted over every step; 7.20 predicted, 3.60 traced, 8.00 plain "
        "predicted over pure decode steps"
    )


def test_phases_and_model_paths_parse():
    args = tb.parse_args(["adaptive", "/tmp/o", "--phases", "64:1:256,8:0:32"])
    assert args.phases == [(64, 1.0, 256), (8, 0.0, 32)]
    assert args.target.endswith("pycode/target") and args.kv_gib == 2.0
    assert tb.parse_args(["none", "/tmp/o"]).phases == tb.PHASES
    for bad in ("64:1", "0:1:4", "8:0:4", "a:b:c"):
        with pytest.raises(ValueError, match="--phases"):
            tb.parse_phases(bad)


def test_compile_log_times_each_compile_and_tables_the_start_up():
    """Triton's JIT hooks time each compile (chained, never skipping one);
    the table counts only the compiles before the engine was ready."""
    import types

    now = [0.0]
    log = tb.CompileLog(clock=lambda: now[0])

    def compile_(name, key, start, seconds):
        fn = types.SimpleNamespace(name=name)
        now[0] = start
        log.before(fn=fn, key=key)
        now[0] = start + seconds
        log.after(fn=fn, key=key)

    compile_("_tree_walk_kernel", "k1", 1.0, 2.0)
    compile_("_tree_walk_kernel", "k2", 3.0, 1.5)
    compile_("_rank_row_kernel", "k1", 5.0, 0.5)
    compile_("_late_kernel", "k1", 20.0, 1.0)  # after ready
    assert [round(r["seconds"], 3) for r in log.records] == [2.0, 1.5, 0.5, 1.0]
    lines = log.table(t0=0.0, ready=10.0)
    assert lines[0].startswith("== start-up compiles: 3 in 10.0 s of start-up, 4.0 s")
    assert lines[1] == "   _tree_walk_kernel: 2 variants, 3.5 s"
    assert lines[2] == "   _rank_row_kernel: 1 variants, 0.5 s"
    assert len(lines) == 3


def test_compile_log_chains_the_hooks_it_finds(monkeypatch):
    from vllm.triton_utils import HAS_TRITON, triton

    if not HAS_TRITON:
        pytest.skip("no Triton")
    runtime = triton.knobs.runtime
    seen = []
    monkeypatch.setattr(runtime, "jit_cache_hook", lambda **kw: seen.append("pre"))
    monkeypatch.setattr(
        runtime, "jit_post_compile_hook", lambda **kw: seen.append("post")
    )
    log = tb.CompileLog()
    log.install()
    assert runtime.jit_cache_hook(fn=None, key="k") is None  # never skips
    runtime.jit_post_compile_hook(fn=None, key="k")
    assert seen == ["pre", "post"] and len(log.records) == 1


def test_prompt_steps_are_split_by_trees(capsys, tmp_path):
    """Steps the cost model does not time (prompt chunks joined) are summed
    with and without trees, the phase's first step (its whole prompt batch)
    left out; a recorded trace summarizes the same from its file."""
    import gzip
    import json

    records = [_record("c64T1", 64, 0, False, 7.0) for _ in range(3)]
    records[0].update(timed=False, period=140.0)  # the phase's first step
    for has, period in ((False, 17.0), (False, 19.0), (True, 50.0)):
        r = _record("c64T1", 63, 3 if has else 0, has, period)
        r["timed"] = False
        records.append(r)
    tb.summarize(records)
    want = (
        "   prompt steps: without trees 2 (median 18.0 ms, 0.04 s); "
        "with trees 1 (median 50.0 ms, 0.05 s)"
    )
    assert want in capsys.readouterr().out.splitlines()
    path = tmp_path / "trace.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    tb.summarize_file(str(path))
    assert want in capsys.readouterr().out.splitlines()


def test_server_records_are_labelled_by_the_cells_of_their_config(tmp_path, capsys):
    """A server's records (a folder of budget_trace.<pid>.jsonl) take the
    phase of the timed slice of their config they fell in; the two slices of
    one cell are one phase, and what ran between slices is set apart."""
    folder = tmp_path / "budget_trace_ddtree"
    folder.mkdir()
    walls = [1.0, 10.5, 11.0, 20.5, 30.2, 40.0]
    records = [_record("serve", 32, 3, True, 7.0) for _ in walls]
    for r, wall in zip(records, walls):
        r["wall"] = wall
    with (folder / "budget_trace.123.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records[:4])
    with (folder / "budget_trace.456.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records[4:])
    windows = [
        {
            "config": "ddtree",
            "batch": 32,
            "temperature": 1.0,
            "slice": 0,
            "start": 10.0,
            "end": 12.0,
        },
        {
            "config": "none",
            "batch": 32,
            "temperature": 1.0,
            "slice": 0,
            "start": 12.0,
            "end": 20.0,
        },
        {
            "config": "ddtree",
            "batch": 32,
            "temperature": 1.0,
            "slice": 1,
            "start": 20.0,
            "end": 21.0,
        },
        {
            "config": "ddtree",
            "batch": 64,
            "temperature": 0.0,
            "slice": 0,
            "start": 30.0,
            "end": 31.0,
        },
    ]
    path = tmp_path / "slice_windows.jsonl"
    path.write_text("".join(json.dumps(w) + "\n" for w in windows))
    got = tb.read_records(str(folder))
    assert [r["wall"] for r in got] == walls
    tb.label_by_windows(got, windows, "ddtree")
    assert [r["ph"] for r in got] == [
        "between slices",
        "c32T1",
        "c32T1",
        "c32T1",
        "c64T0",
        "between slices",
    ]
    tb.summarize_file(str(folder), str(path), "ddtree")
    out = capsys.readouterr().out
    assert "== c32T1: 3 steps" in out and "== c64T0: 1 steps" in out
    assert "== between slices: 2 steps" in out
