# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/step_recorder.py: every engine step of a server, any config,
recorded from outside and summarized by cell next to the other configs."""

import json
import os
import textwrap
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

from benchmarks import step_recorder as sr
from benchmarks.bench_ddtree_serve import budget_trace_env
from tests.benchmarks.test_budget_recorder import run_like_a_server

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "benchmarks" / "serve_trace"


def _scheduler_output(tokens: dict, spec: dict, new: int = 0):
    return SimpleNamespace(
        num_scheduled_tokens=tokens,
        total_num_scheduled_tokens=sum(tokens.values()),
        scheduled_spec_decode_tokens=spec,
        scheduled_new_reqs=[object()] * new,
    )


def test_each_step_is_recorded_with_its_prompt_tokens(monkeypatch):
    from vllm.v1.worker.gpu import model_runner as mr

    calls = []
    monkeypatch.setattr(
        mr.GPUModelRunner,
        "execute_model",
        lambda self, so, *a, **k: calls.append(so) or "out",
    )
    records = []
    uninstall = sr.install(records)
    try:
        runner = object.__new__(mr.GPUModelRunner)
        # Two decodes with three draft slots each and a 100-token prompt chunk.
        mixed = _scheduler_output(
            {"a": 4, "b": 4, "c": 100}, {"a": [1] * 3, "b": [1] * 3}, 1
        )
        assert mr.GPUModelRunner.execute_model(runner, mixed) == "out"
        plain = _scheduler_output({"a": 1, "b": 1}, {})
        mr.GPUModelRunner.execute_model(runner, plain)
        # Neither a dummy run nor an empty step is a step of the batch.
        mr.GPUModelRunner.execute_model(runner, plain, dummy_run=True)
        mr.GPUModelRunner.execute_model(runner, _scheduler_output({}, {}))
    finally:
        uninstall()
    assert len(calls) == 4
    assert [(r["n"], r["tokens"], r["prompt"], r["new"]) for r in records] == [
        (3, 108, 99, 1),
        (2, 2, 0, 0),
    ]
    assert mr.GPUModelRunner.execute_model(runner, plain) == "out"
    assert len(records) == 2  # the wrapper is off again


def _write_steps(folder: Path, pid: int, steps: list[tuple[float, int, int]]):
    """Steps (start in s, requests, prompt tokens), one wall clock for all."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / f"step_trace.{pid}.jsonl").open("w") as f:
        for t, n, prompt in steps:
            r = {"t": t, "wall": 1000.0 + t, "n": n, "tokens": n + prompt}
            f.write(json.dumps({**r, "prompt": prompt, "new": int(prompt > 0)}) + "\n")


def test_configs_steps_side_by_side_by_cell(tmp_path):
    """Periods run to the next step of the same process; steps outside a
    config's timed slices are left out; decode steps are compared with the
    first config's."""
    logs = tmp_path / "logs"
    # none: decode steps of 10 ms, one prompt step of 30 ms, then an idle gap
    # outside the slice (its period is not in the cell).
    _write_steps(
        logs / "step_trace_none",
        1,
        [
            (0.0, 8, 0),
            (0.01, 8, 0),
            (0.02, 8, 50),
            (0.05, 8, 0),
            (0.06, 8, 0),
            (5.0, 8, 0),
        ],
    )
    # ddtree: decode steps of 11 and 13 ms, two processes.
    _write_steps(
        logs / "step_trace_ddtree", 2, [(0.0, 8, 0), (0.011, 8, 0), (0.024, 8, 0)]
    )
    _write_steps(logs / "step_trace_ddtree", 3, [(0.1, 8, 0), (0.111, 8, 0)])
    windows = [
        {
            "config": "none",
            "batch": 8,
            "temperature": 1.0,
            "slice": 0,
            "start": 1000.0,
            "end": 1000.065,
        },
        {
            "config": "ddtree",
            "batch": 8,
            "temperature": 1.0,
            "slice": 0,
            "start": 999.0,
            "end": 1001.0,
        },
    ]
    (logs / "slice_windows.jsonl").write_text(
        "".join(json.dumps(w) + "\n" for w in windows)
    )
    steps = sr.read_steps(logs / "step_trace_ddtree")
    assert [round(r.get("period", -1), 3) for r in steps] == [11.0, 13.0, -1, 11.0, -1]
    lines = sr.summarize(logs, ["none", "ddtree"])
    assert lines[1] == "concurrency 8, T=1:"
    assert (
        lines[5]
        == "| none | 4 | 0.06 | 8.0 | 10.00 | 10.00 | 1 (25 %) | 30.00 | 50 % |"
    )
    assert lines[6] == (
        "| ddtree | 3 | 0.04 | 8.0 | 11.00 (1.100x) | 11.67 (1.167x) | 0 (0 %) | - | 0 % |"
    )
    # ddtree's 0.035 s against none's 0.060 s. none's prompt step (30 ms) and
    # the period after it (10 ms, which holds part of its work) count as
    # prompt periods: ddtree's decode steps cost 3 x 1.67 ms more, it ran
    # one decode period more and neither prompt period.
    assert lines[8] == "ddtree against none, seconds by step kind:"
    assert lines[12:] == [
        "| decode | 3 | 2 | 11.67 | 10.00 | +0.005 | +0.010 |",
        "| prompt 1-128 | 0 | 2 | - | 20.00 | +0.000 | -0.040 |",
        "| all | 3 | 4 | | | +0.005 | -0.030 |",
    ]


def test_in_process_steps_side_by_side_by_phase(tmp_path, monkeypatch):
    """trace_budget.py's records: the phase comes from the callable, and a
    period never spans two phases."""
    from vllm.v1.worker.gpu import model_runner as mr

    monkeypatch.setattr(mr.GPUModelRunner, "execute_model", lambda *a, **k: None)
    runner = object.__new__(mr.GPUModelRunner)
    plain = _scheduler_output({"a": 1, "b": 1}, {})
    for config, phases in (("none", ("c2T1",) * 3), ("adaptive", ("c2T1",) * 3)):
        records, ph = [], ["warmup"]
        uninstall = sr.install(records, lambda: ph[0])
        try:
            for name in ("warmup", *phases):
                ph[0] = name
                mr.GPUModelRunner.execute_model(runner, plain)
        finally:
            uninstall()
        assert [r["ph"] for r in records] == ["warmup", *phases]
        # Steps 10 ms apart for none, 12 ms for adaptive, whatever was timed.
        gap = 0.010 if config == "none" else 0.012
        for i, r in enumerate(records):
            r["t"] = i * gap
        with (tmp_path / f"{config}_steps.jsonl").open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    lines = sr.summarize_phases(tmp_path, ["none", "adaptive"])
    # The warm-up step's period would run into the phase: not kept.
    assert lines[1] == "phase c2T1:"
    assert lines[5] == "| none | 2 | 0.02 | 2.0 | 10.00 | 10.00 | 0 (0 %) | - | 0 % |"
    assert lines[6] == (
        "| adaptive | 2 | 0.02 | 2.0 | 12.00 (1.200x) | 12.00 (1.200x) | 0 (0 %) | - "
        "| 0 % |"
    )
    assert lines[-2:] == [
        "| decode | 2 | 2 | 12.00 | 10.00 | +0.004 | +0.000 |",
        "| all | 2 | 2 | | | +0.004 | +0.000 |",
    ]
    assert len(lines) == 14


def test_attribution_splits_the_difference_by_prompt_size():
    """Per kind, the per-step and step-count columns sum to the difference of
    the kind's seconds; a kind only one config ran is all step count."""

    def steps(*pairs):
        return [{"prompt": p, "period": ms} for p, ms in pairs]

    ref = steps((0, 10.0), (0, 10.0), (100, 20.0), (600, 40.0))
    # The period after a prompt step counts with it (prompt_before, which
    # with_periods sets): here each step's own kind is the one meant.
    mine = steps((0, 11.0), (0, 11.0), (0, 11.0), (100, 26.0), (3000, 90.0))
    lines = sr.attribution("ddtree", mine, "none", ref)
    rows = lines[5:]
    assert rows == [
        "| decode | 3 | 2 | 11.00 | 10.00 | +0.003 | +0.010 |",
        "| prompt 1-128 | 1 | 1 | 26.00 | 20.00 | +0.006 | +0.000 |",
        "| prompt 513-2048 | 0 | 1 | - | 40.00 | +0.000 | -0.040 |",
        "| prompt 2049+ | 1 | 0 | 90.00 | - | +0.000 | +0.090 |",
        "| all | 5 | 4 | | | +0.009 | +0.060 |",
    ]
    diff = (sum(r["period"] for r in mine) - sum(r["period"] for r in ref)) / 1e3
    assert abs(diff - (0.009 + 0.060)) < 1e-9


def test_every_server_gets_the_step_hook():
    env = {"PYTHONPATH": "/repo"}
    args = Namespace(out="/o", budget_trace=["ddtree-auto-adaptive"], step_trace=True)
    none = budget_trace_env(args, "none", env)
    assert none[sr.TRACE_ENV] == "/o/logs/step_trace_none"
    assert none["PYTHONPATH"] == os.pathsep.join([str(HOOK), "/repo"])
    assert "DDTREE_BUDGET_TRACE" not in none
    ddtree = budget_trace_env(args, "ddtree-auto-adaptive", env)
    assert ddtree[sr.TRACE_ENV] == "/o/logs/step_trace_ddtree-auto-adaptive"
    assert ddtree["DDTREE_BUDGET_TRACE"] == "/o/logs/budget_trace_ddtree-auto-adaptive"
    off = Namespace(out="/o", budget_trace=None, step_trace=False)
    assert budget_trace_env(off, "none", env) is env


SERVER_SCRIPT = textwrap.dedent(
    """
    from types import SimpleNamespace
    from benchmarks.checkout import use_checkout
    use_checkout()
    from vllm.v1.worker.gpu import model_runner as mr
    # The hook wrapped the class as its module was imported; what it wraps
    # stands in for a step here.
    runner = object.__new__(mr.GPUModelRunner)
    so = SimpleNamespace(num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1,
                         scheduled_spec_decode_tokens={}, scheduled_new_reqs=[])
    for _ in range(5):
        try:
            mr.GPUModelRunner.execute_model(runner, so)
        except Exception:
            pass  # the real runner has no state here; the record came first
    """
)


def test_a_server_process_writes_its_steps(tmp_path):
    """Started as bench_ddtree.py starts a server: the hook on PYTHONPATH and
    the variable set; the engine core's steps land in its folder at exit."""
    trace_dir = tmp_path / "step_trace_none"
    marker = run_like_a_server(tmp_path, SERVER_SCRIPT, {sr.TRACE_ENV: trace_dir})
    assert marker.exists()
    files = list(trace_dir.glob("step_trace.*.jsonl"))
    assert len(files) == 1
    records = [json.loads(x) for x in files[0].read_text().splitlines()]
    assert len(records) == 5
    assert all(r["n"] == 1 and r["prompt"] == 0 for r in records)


def test_the_period_after_a_prompt_step_counts_with_it():
    """With async scheduling a prompt chunk's work reaches into the next
    step's period: that period is a prompt period too, of the larger chunk."""
    rs = sr.with_periods(
        [
            {"t": 0.0, "prompt": 0},
            {"t": 0.010, "prompt": 700},
            {"t": 0.040, "prompt": 0},
            {"t": 0.055, "prompt": 50},
            {"t": 0.070, "prompt": 0},
        ]
    )
    kinds = [sr.KIND_LABELS[sr._kind(r)] for r in rs if "period" in r]
    assert kinds == ["decode", "prompt 513-2048", "prompt 513-2048", "prompt 1-128"]


def _budget_line(steps, learned):
    # The shape of ddtree_cost.py's log line, as a server writes it.
    return (
        "(EngineCore pid=1) INFO 12-07 23:37:40 [ddtree_cost.py:775] DDTree: "
        f"budget over 10 s: {steps} decode steps, 20.8 requests and 170.0 tree "
        "nodes per step, drafter ran in 50% of steps; nodes per request (share "
        "of steps) 3: 26%, 63: 74%; step periods learned for batches of up to "
        f"48: {learned}; steps took 0.00 ms (plain) and 0.00 ms (trees) more "
        "than those periods (prompt chunks), a step with a prompt chunk none "
        "yet (plain) and -8.26 ms (trees) more\n"
    )


def test_a_server_whose_budget_learned_nothing_is_flagged(tmp_path):
    """A server whose step planning ran twice per step (a tracer's wrapper
    doubled the plugin's) chose every budget on its start-up prior: its log
    says so, and the summary says it first."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "slice_windows.jsonl").write_text("")
    (logs / "broken.log").write_text(
        "".join(_budget_line(n, "none yet") for n in (1, 300, 250))
    )
    (logs / "fine.log").write_text(
        _budget_line(300, "none yet")
        + _budget_line(300, "b=0 7.32 ms (237), b=7+ 14.47 ms (50)")
    )
    (logs / "short.log").write_text(_budget_line(100, "none yet"))
    (logs / "none.log").write_text("no budget here\n")
    configs = ["none", "broken", "fine", "short", "absent"]
    warnings = sr.unlearned_servers(logs, configs)
    assert len(warnings) == 1
    assert warnings[0].startswith("**broken: ") and "551 decode steps" in warnings[0]
    assert sr.summarize(logs, configs)[:2] == [warnings[0], ""]
