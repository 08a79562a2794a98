# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/budget_oracle.py: the constant budgets it forces on the product's
controller, its run plan, its summary, and trace_budget.py's arrival loop."""

from types import SimpleNamespace

import pytest

from benchmarks import budget_oracle as bo
from benchmarks import trace_budget as tb
from vllm.v1.spec_decode.ddtree_cost import (
    StepCostModel,
    TreeBudgetController,
    budget_ladder,
)


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _controller(clock):
    # Trees cheap enough that the controller drafts on its own.
    cost = StepCostModel({1: 2e-3, 1024: 3e-3}, {1: 1e-4, 64: 2e-4})
    return TreeBudgetController(budget_ladder(15), 15, cost, clock=clock)


@pytest.fixture
def forced():
    f = bo.ForcedBudget()
    uninstall = f.install()
    yield f
    uninstall()


def _step(ctrl, clock, seconds, budget_cap=15, has_trees=True):
    """One engine step as AdaptiveTreeBudget drives the controller."""
    ctrl.step_started()
    b = ctrl.choose(64, budget_cap, has_trees, True)
    did = ctrl.should_draft(64, budget_cap)
    ctrl.drafted(did)
    clock.t += seconds
    return b, did


def test_a_forced_budget_replaces_the_choice_and_the_draft_decision(forced):
    clock = _Clock()
    ctrl = _controller(clock)
    forced.budget = 7
    checked = 0
    for cap, has in ((15, True), (3, True), (15, False), (7, True)):
        ctrl.step_started()
        assert ctrl.choose(64, cap, has, True) == (min(7, cap) if has else 0)
        assert ctrl.should_draft(64, cap) is True
        assert ctrl.last_best == min(7, cap)
        checked += 1
    forced.budget = 0
    ctrl.step_started()
    assert ctrl.choose(64, 15, True, True) == 0
    assert ctrl.should_draft(64, 15) is False and ctrl.last_best == 0
    checked += 1
    assert checked == 5


def test_forced_steps_teach_the_cost_model_nothing(forced):
    clock = _Clock()
    ctrl = _controller(clock)
    forced.budget = 3
    for _ in range(20):
        _step(ctrl, clock, 0.05)
    forced.budget = 0
    for _ in range(20):
        _step(ctrl, clock, 0.05)
    observed = sum(
        ctrl.cost.num_observed(64, b, d) for b in budget_ladder(15) for d in (0, 1)
    )
    assert observed == 0
    assert ctrl.cost.steps == 0


def test_without_a_forced_budget_the_controller_decides_and_learns():
    # The same steps on the product's own methods, then patched but unforced.
    twin_clock = _Clock()
    twin = _controller(twin_clock)
    twin_choices = [_step(twin, twin_clock, 0.004) for _ in range(30)]
    uninstall = bo.ForcedBudget().install()
    try:
        clock = _Clock()
        ctrl = _controller(clock)
        choices = [_step(ctrl, clock, 0.004) for _ in range(30)]
    finally:
        uninstall()
    assert choices == twin_choices
    assert len(choices) == 30
    assert ctrl.cost.steps == twin.cost.steps > 0
    assert any(did for _, did in choices)


def test_cell_runs_keep_distinct_budgets_under_the_cap():
    ladder = budget_ladder(128)
    assert bo.cell_runs(ladder, 128) == ["default", *ladder]
    assert bo.cell_runs(ladder, 15) == ["default", 0, 1, 3, 7, 15]
    assert bo.cell_runs([0, 7, 63], 3) == ["default", 0, 3]


def test_rounds_alternate_their_order():
    runs = ["default", 0, 3, 7]
    assert bo.round_order(runs, 0) == runs
    assert bo.round_order(runs, 1) == ["default", 0, 3, 7][::-1]
    assert bo.round_order(runs, 2) == runs


def test_budgets_parse_and_reject_bad_lists():
    assert bo.parse_budgets("7,0,3,3") == [0, 3, 7]
    for bad in ("", "a,1", "-1,3"):
        with pytest.raises(ValueError):
            bo.parse_budgets(bad)


def _row(phase, run, rnd, tok_s):
    return {"phase": phase, "run": run, "round": rnd, "tok_s": tok_s}


def test_summary_names_the_best_constant_budget_and_the_default_over_it():
    rows = [
        _row("c64T0", "default", 0, 900.0),
        _row("c64T0", 0, 0, 700.0),
        _row("c64T0", 3, 0, 1000.0),
        _row("c64T0", 7, 0, 950.0),
        _row("c64T0", 7, 1, 1010.0),
        _row("c64T0", 3, 1, 1000.0),
        _row("c64T0", 0, 1, 700.0),
        _row("c64T0", "default", 1, 980.0),
        _row("c1T1", "default", 0, 100.0),
    ]
    lines = bo.summarize(rows)
    assert len(lines) == 4
    c64 = next(line for line in lines if line.startswith("| c64T0"))
    cells = [c.strip() for c in c64.split("|")[1:-1]]
    # b=3 averages 1000, b=7 980: the oracle is b=3.
    assert cells[1:4] == ["940", "3", "1000"]
    assert cells[4] == "0.940 (0.900, 0.980)"
    # Held out: round 0 scores b=7 (best on round 1: 1010), 900 / 950; round
    # 1 scores b=3 (best on round 0: 1000), 980 / 1000.
    assert cells[5] == "0.964 (0.947, 0.980)"
    assert "0: 700 (700, 700)" in cells[6]
    incomplete = next(line for line in lines if line.startswith("| c1T1"))
    assert "incomplete" in incomplete


class _FakeEngine:
    """Finishes each request ``steps_per_request`` steps after it arrived,
    with ``tokens`` output tokens."""

    def __init__(self, steps_per_request=3, tokens=5):
        self.steps_per_request = steps_per_request
        self.tokens = tokens
        self.live = {}
        self.prompts = {}
        self.most_in_flight = 0

    def add_request(self, rid, prompt, params):
        assert rid not in self.prompts
        self.prompts[rid] = (prompt, params.temperature, params.ignore_eos)
        self.live[rid] = self.steps_per_request

    def step(self):
        self.most_in_flight = max(self.most_in_flight, len(self.live))
        outs = []
        for rid in list(self.live):
            self.live[rid] -= 1
            if self.live[rid] == 0:
                del self.live[rid]
                outs.append(
                    SimpleNamespace(
                        finished=True,
                        outputs=[SimpleNamespace(token_ids=[1] * self.tokens)],
                    )
                )
        return outs


def test_arrival_loop_keeps_c_in_flight_with_prompts_new_to_the_engine():
    engine = _FakeEngine()
    loop = tb.ArrivalLoop(engine, ["a", "b"], clock=_Clock())
    toks, _, _, steps = loop.run(4, 1.0, 10)
    assert toks == 50
    assert engine.most_in_flight == 4
    assert steps > 0
    toks, _, _, _ = loop.run(2, 0.0, 3)
    assert toks == 15
    assert len(engine.prompts) == 13
    assert engine.prompts["r0"] == ("# request 0\na", 1.0, True)
    assert engine.prompts["r11"][0] == "# request 11\nb"
    assert engine.prompts["r12"][1] == 0.0


def test_a_repeated_cell_is_told_apart():
    phases = [(64, 1.0, 256), (32, 1.0, 128), (64, 1.0, 256), (64, 0.0, 256)]
    assert bo.phase_names(phases) == ["c64T1", "c32T1", "c64T1#2", "c64T0"]


def test_ties_go_to_the_smaller_budget_and_a_zero_row_is_incomplete():
    rows = [
        _row("c8T1", "default", 0, 500.0),
        _row("c8T1", 7, 0, 600.0),
        _row("c8T1", 3, 0, 600.0),
        _row("c1T0", "default", 0, 100.0),
        _row("c1T0", 0, 0, 0.0),
    ]
    lines = bo.summarize(rows)
    c8 = [c.strip() for c in lines[2].split("|")[1:-1]]
    assert c8[2] == "3" and c8[5] == "-"
    assert "incomplete" in lines[3]


class _PlainEngine(_FakeEngine):
    """One token per request and step, as a batch that does not speculate."""

    def __init__(self):
        super().__init__()
        self.steps = 0

    def add_request(self, rid, prompt, params):
        super().add_request(rid, prompt, params)
        self.live[rid] = params.max_tokens

    def step(self):
        self.steps += 1
        return super().step()


def test_the_default_meets_the_cell_before_it_is_timed():
    # After a cell where speculation did not pay, the default's next probe may
    # be the controller's longest wait away: its settle must outlast it.
    from vllm.v1.spec_decode import ddtree_cost as dc

    longest_wait = dc._PROBE_BACKOFF * dc._PROBE_INTERVAL
    engine = _PlainEngine()
    loop = tb.ArrivalLoop(engine, ["a"], clock=_Clock())
    bo.settle(loop, bo.DEFAULT, 4, 0.0)
    assert engine.steps >= 2 * longest_wait
    # A forced run's settle only drains the previous run's slots and trees.
    before = engine.steps
    bo.settle(loop, 7, 4, 0.0)
    assert engine.steps - before == bo.SETTLE_TOKENS
