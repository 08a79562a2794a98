# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/scheduler_host_cost.py: vLLM's scheduler over decode steps of
no speculation and of DDTree's plain steps, with and without draft slots."""

import pytest

from benchmarks import scheduler_host_cost as shc


@pytest.fixture(autouse=True)
def cuda_platform(monkeypatch):
    """EngineArgs asks the platform for a device type; a CPU-only box has none."""
    from vllm.platforms import current_platform

    if current_platform.device_type == "":
        monkeypatch.setattr(
            type(current_platform), "device_type", "cuda", raising=False
        )


def test_plain_ddtree_steps_schedule_their_slots_and_none_without_them(tmp_path):
    import vllm_ddtree

    vllm_ddtree.register()
    target, drafter = shc.tiny_pair(str(tmp_path))
    rows = {c: shc.measure(target, drafter, c, 4, 5) for c in shc.CONFIGS}
    assert rows["none"]["tokens_per_step"] == 4
    # A plain step's slots: 3 per request (slots_for_budget(0) on the
    # adaptive engine's slot ladder 0, 3, 15, 63, 128).
    assert rows["ddtree"]["tokens_per_step"] == 4 * (1 + 3)
    assert rows["ddtree-no-slots"]["tokens_per_step"] == 4
    for r in rows.values():
        assert r["async_scheduling"] and r["schedule_us"] > 0 and r["update_us"] > 0
    lines = shc.summarize(list(rows.values()))
    assert len(lines) == 2 + len(shc.CONFIGS)
    assert lines[2].startswith("| 4 | none | 4 |") and lines[2].endswith("| 1.00 |")
    print("\n".join(lines))
