# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/plain_step_overhead.py forces what it says: the controller never
verifies a tree nor drafts, whatever acceptance it is told, and the context-free
variant leaves the drafter's context KV alone."""

import pytest

from benchmarks import plain_step_overhead as pso
from vllm.model_executor.models import qwen3_dflash
from vllm.v1.spec_decode import ddtree_adaptive, ddtree_cost
from vllm.v1.spec_decode.ddtree_cost import (
    AcceptanceCurve,
    StepCostModel,
    TreeBudgetController,
)

LADDER = (0, 1, 3, 7, 15)


def _keep(monkeypatch, owner, *names):
    """Register the current attributes for restoring after the test."""
    for name in names:
        monkeypatch.setattr(owner, name, getattr(owner, name))


def _eager_controller():
    # Cheap steps and every node accepted: a real controller drafts.
    cost = StepCostModel({1: 1e-3, 64: 1e-3}, {1: 1e-5, 4: 1e-5})
    controller = TreeBudgetController(LADDER, 8, cost)
    controller.set_curve(AcceptanceCurve(4, (0.0, 1.0, 3.0, 7.0, 8.0), ()))
    return controller


@pytest.mark.parametrize("without_context", [False, True])
def test_every_step_plain(monkeypatch, without_context):
    _keep(monkeypatch, ddtree_cost.TreeBudgetController, "best_budget", "should_draft")
    _keep(monkeypatch, ddtree_adaptive.AdaptiveTreeBudget, "warm_up", "profile")
    drafters = [
        c
        for c in vars(qwen3_dflash).values()
        if isinstance(c, type) and hasattr(c, "precompute_and_store_context_kv")
    ]
    assert drafters
    for c in drafters:
        _keep(monkeypatch, c, "precompute_and_store_context_kv")
    before = {c: c.precompute_and_store_context_kv for c in drafters}

    assert _eager_controller().choose(4, 15, has_trees=True, timed=True) > 0
    pso.force_plain_steps(without_context)
    controller = _eager_controller()
    assert controller.choose(4, 15, has_trees=True, timed=True) == 0
    assert not controller.should_draft(4, 15)
    assert ddtree_adaptive.AdaptiveTreeBudget.warm_up(None, None) == 0
    changed = [
        c for c in drafters if c.precompute_and_store_context_kv is not before[c]
    ]
    assert changed == (drafters if without_context else [])
    if without_context:
        assert drafters[0].precompute_and_store_context_kv(None, 1, 2) is None


def test_kernel_summary_counts_gpu_kernels_only():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(key, device_type, us, count=20):
        return SimpleNamespace(
            key=key, device_type=device_type, self_device_time_total=us, count=count
        )

    events = [
        event("cudaLaunchKernel", DeviceType.CPU, 0.0),
        event("flash_fwd_kernel", DeviceType.CUDA, 4000.0),
        event("_tree_walk_kernel", DeviceType.CUDA, 1000.0),
        event("aten::mm", DeviceType.CPU, 0.0),
        event("idle", DeviceType.CUDA, 0.0),
    ]
    summary = pso.kernel_summary(events, num_steps=20)
    assert summary["gpu_ms_per_step"] == pytest.approx(0.25)
    top = summary["top_kernels_us_per_step"]
    assert [row[0] for row in top] == ["flash_fwd_kernel", "_tree_walk_kernel"]
    assert top[0][1] == pytest.approx(200.0)


def test_real_size_arguments():
    args = pso.parse_args(
        ["plain", "out", "R1", "--target", "D/target", "--batches", "64,32"]
    )
    assert (args.target, args.batches, args.profile_batch) == ("D/target", (64, 32), 32)
    with pytest.raises(SystemExit):
        pso.parse_args(["plain", "out", "R1", "--batches", "0"])


def test_every_step_verifies_the_forced_tree(monkeypatch):
    """The tree config: every step verifies the forced budget (never above
    the step's cap) and drafts, where a real controller told that nothing is
    accepted would choose plain steps."""
    _keep(monkeypatch, ddtree_cost.TreeBudgetController, "best_budget", "should_draft")
    cost = StepCostModel({1: 1e-3, 64: 1e-3}, {1: 1e-5, 4: 1e-5})
    idle = TreeBudgetController(LADDER, 8, cost)
    idle.set_curve(AcceptanceCurve(4, (0.0, 0.0, 0.0, 0.0, 0.0), ()))
    assert idle.choose(4, 15, has_trees=True, timed=True) == 0
    pso.force_tree_steps(3)
    controller = TreeBudgetController(LADDER, 8, cost)
    controller.set_curve(AcceptanceCurve(4, (0.0, 0.0, 0.0, 0.0, 0.0), ()))
    assert controller.choose(4, 15, has_trees=True, timed=True) == 3
    assert controller.choose(4, 1, has_trees=True, timed=True) == 1
    assert controller.should_draft(4, 15)


def test_join_arguments():
    args = pso.parse_args(["tree", "out", "J1", "--joins", "1", "--batches", "64"])
    assert (args.config, args.joins, args.tree_budget) == ("tree", 1, 3)
    assert pso.parse_args(["none", "out", "R1"]).joins == 0
    for bad in (["--joins", "65", "--batches", "64"], ["--tree-budget", "0"]):
        with pytest.raises(SystemExit):
            pso.parse_args(["tree", "out", "J1", *bad])


def test_joins_keep_the_batch_and_add_prompts_before_each_step(monkeypatch, tmp_path):
    """With --joins J, every step after the batch's first sees J requests
    end and J new prompts join, the batch size staying the same; the result
    row says so."""
    import json

    import vllm

    log = []

    class Engine:
        running: set = set()

        def add_request(self, req_id, prompt, params):
            assert req_id not in self.running and prompt.startswith("# request J1 ")
            self.running.add(req_id)
            log.append(("add", req_id))

        def abort_request(self, ids):
            self.running.difference_update(ids)
            log.append(("abort", len(ids)))

        def step(self):
            log.append(("step", len(self.running)))

    class FakeLLM:
        def __init__(self, **kwargs):
            self.llm_engine = Engine()

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(pso, "WARM_STEPS", 2)
    monkeypatch.setattr(pso, "TIMED_STEPS", 3)
    pso.main(["none", str(tmp_path), "J1", "--batches", "4", "--joins", "1"])
    steps = [n for kind, n in log if kind == "step"]
    # 5 steps of the batch, each after one request ended and one joined,
    # then the 3 steps after every request ended.
    assert steps == [4] * 5 + [0] * 3
    first_step = log.index(("step", 4))
    assert [e[0] for e in log[:first_step]] == ["add"] * 4 + ["abort", "add"]
    row = json.loads((tmp_path / "steps.jsonl").read_text())
    assert row["joins"] == 1 and len(row["step_ms_b4"]) == 1


def test_python_host_profile_times_each_function_per_step():
    def busy(n):
        return sum(i * i for i in range(n))

    calls = []

    def step():
        calls.append(busy(20000) + busy(200))

    report, per_step = pso.python_host_profile(step, 5, top=50)
    assert len(calls) == 5
    assert "busy" in report
    rows = {
        where.split("(")[-1].rstrip(")"): (own, cum) for where, own, cum in per_step
    }
    # step() calls busy(), whose generator does the work: its cumulative time
    # per step covers busy()'s, and each is positive.
    assert rows["step"][1] >= rows["busy"][1] > 0
    assert all(own >= 0 and cum >= own for own, cum in rows.values())
    print(per_step[:3])
