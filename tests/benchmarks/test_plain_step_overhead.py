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
