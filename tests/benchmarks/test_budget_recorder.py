# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/budget_recorder.py and serve_trace/sitecustomize.py: the adaptive
budget's decisions recorded from outside, in process and inside a server."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from benchmarks import budget_recorder as br
from vllm.v1.spec_decode import ddtree_cost as dc

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "benchmarks" / "serve_trace"


def _decide(controller, steps: int) -> None:
    """What the runner calls per step: the period starts, the budget is
    chosen, and at the step's end whether the drafter runs next."""
    for _ in range(steps):
        controller.step_started()
        controller.choose(8, 15, has_trees=True, timed=True)
        controller.drafted(controller.should_draft(8, 15))


def _controller():
    cost = dc.StepCostModel({8: 4e-3}, {8: 1e-3})
    return dc.TreeBudgetController(dc.budget_ladder(15), 15, cost)


def test_install_records_each_decision_and_uninstall_restores():
    originals = (
        dc.TreeBudgetController.choose,
        dc.TreeBudgetController.step_started,
        dc.TreeBudgetController.should_draft,
        dc.StepCostModel.observe,
    )
    records = []
    uninstall = br.install(records, lambda: "c8T0")
    try:
        _decide(_controller(), 5)
    finally:
        uninstall()
    assert len(records) == 5
    first = records[0]
    assert first["ph"] == "c8T0" and first["n"] == 8 and first["cap"] == 15
    assert set(first["pred"]) == set(first["e"]) == {0, 1, 3, 7, 15}
    assert first["draft"]["cap"] == 15
    # A record's period and drafted flag arrive when the next step starts;
    # the flag is what the record's own draft decision chose.
    assert all("period" in r and "drafted" in r for r in records[:-1])
    assert all(r["drafted"] == r["draft"]["did"] for r in records[:-1])
    assert "period" not in records[-1]
    assert records[0]["wall"] <= records[-1]["wall"]
    after = (
        dc.TreeBudgetController.choose,
        dc.TreeBudgetController.step_started,
        dc.TreeBudgetController.should_draft,
        dc.StepCostModel.observe,
    )
    assert after == originals
    _decide(_controller(), 2)
    assert len(records) == 5  # nothing recorded once taken off


def test_trace_file_writes_complete_records_in_batches(tmp_path):
    trace = br.TraceFile(tmp_path / "t", every=3, seconds=3600.0)
    assert not trace.folder.exists()  # nothing written before a record
    for i in range(5):
        trace.append({"i": i})
    # After 4 records the first 3 were complete: written, and out of the list;
    # the 4th and 5th wait.
    lines = trace.path.read_text().splitlines()
    assert [json.loads(x)["i"] for x in lines] == [0, 1, 2]
    assert [r["i"] for r in trace] == [3, 4]
    trace.flush()
    trace.flush()  # nothing twice
    lines = trace.path.read_text().splitlines()
    assert [json.loads(x)["i"] for x in lines] == [0, 1, 2, 3, 4]
    assert trace.path.name == f"budget_trace.{os.getpid()}.jsonl"
    assert not trace


def test_trace_file_writes_after_its_interval(tmp_path):
    """A slow trickle of records still reaches the file: all but the newest
    once the interval has passed."""
    trace = br.TraceFile(tmp_path / "t", every=1000, seconds=0.0)
    trace.append({"i": 0})
    assert not trace.path.exists()  # the newest waits for its period
    trace.append({"i": 1})
    trace.append({"i": 2})
    lines = trace.path.read_text().splitlines()
    assert [json.loads(x)["i"] for x in lines] == [0, 1]
    assert [r["i"] for r in trace] == [2]


SERVER_SCRIPT = textwrap.dedent(
    """
    from benchmarks.checkout import use_checkout
    use_checkout()
    from vllm.v1.spec_decode import ddtree_cost as dc
    cost = dc.StepCostModel({8: 4e-3}, {8: 1e-3})
    c = dc.TreeBudgetController(dc.budget_ladder(15), 15, cost)
    for _ in range(7):
        c.step_started()
        c.choose(8, 15, has_trees=True, timed=True)
        c.should_draft(8, 15)
    """
)


def run_like_a_server(tmp_path, script: str, traces: dict[str, Path]) -> Path:
    """``script`` in a process started as bench_ddtree.py starts a server:
    the hook first on PYTHONPATH, ``traces`` (variable -> folder) set and the
    hook's other variables unset, and an environment ``sitecustomize`` after
    the hook that must still run (the file it leaves is returned)."""
    other = tmp_path / "env_site"
    other.mkdir(exist_ok=True)
    marker = tmp_path / "env_sitecustomize_ran"
    (other / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HOOK), str(other), str(ROOT)])
    for var in ("DDTREE_BUDGET_TRACE", "DDTREE_STEP_TRACE"):
        env.pop(var, None)
    env.update({var: str(folder) for var, folder in traces.items()})
    subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tmp_path, check=True, timeout=300
    )
    return marker


def _run_like_a_server(tmp_path, trace_dir):
    traces = {} if trace_dir is None else {br.TRACE_ENV: trace_dir}
    return run_like_a_server(tmp_path, SERVER_SCRIPT, traces)


def test_a_server_process_writes_its_decisions(tmp_path):
    trace_dir = tmp_path / "budget_trace_ddtree"
    marker = _run_like_a_server(tmp_path, trace_dir)
    files = list(trace_dir.glob("budget_trace.*.jsonl"))
    assert len(files) == 1
    records = [json.loads(x) for x in files[0].read_text().splitlines()]
    # Every decision, the last one flushed at exit.
    assert len(records) == 7
    assert {r["ph"] for r in records} == {"serve"}
    assert all(r["n"] == 8 for r in records)
    assert marker.exists()


def test_without_the_variable_the_hook_does_nothing(tmp_path):
    marker = _run_like_a_server(tmp_path, None)
    assert not list(tmp_path.rglob("budget_trace.*.jsonl"))
    assert marker.exists()


def test_only_ddtree_servers_get_the_hook(tmp_path):
    from argparse import Namespace

    from benchmarks.bench_ddtree_serve import budget_trace_env, record_slice_window

    args = Namespace(out=tmp_path, budget_trace=["ddtree-auto-adaptive"])
    env = {"PYTHONPATH": "/plugin:/repo", "X": "1"}
    got = budget_trace_env(args, "ddtree-auto-adaptive", env)
    assert got["PYTHONPATH"] == os.pathsep.join([str(HOOK), "/plugin:/repo"])
    assert got[br.TRACE_ENV] == str(
        tmp_path / "logs" / "budget_trace_ddtree-auto-adaptive"
    )
    assert got["X"] == "1" and env == {"PYTHONPATH": "/plugin:/repo", "X": "1"}
    assert budget_trace_env(args, "dflash", env) is env
    assert budget_trace_env(Namespace(out=tmp_path), "ddtree-63", env) is env
    # A DDTree server left out of the list is not recorded.
    assert budget_trace_env(args, "ddtree-128-adaptive", env) is env
    (tmp_path / "logs").mkdir()
    record_slice_window(tmp_path, "dflash", 32, 1, 0, 10.0, 14.5)
    record_slice_window(tmp_path, "dflash", 32, 1, 1, 20.0, 24.0)
    lines = (tmp_path / "logs" / "slice_windows.jsonl").read_text().splitlines()
    assert [json.loads(x)["slice"] for x in lines] == [0, 1]
    assert json.loads(lines[0]) == {
        "config": "dflash",
        "batch": 32,
        "temperature": 1.0,
        "slice": 0,
        "start": 10.0,
        "end": 14.5,
    }
