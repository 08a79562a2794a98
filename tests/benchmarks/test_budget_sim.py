# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/budget_sim.py: the adaptive budget's controller on a real-size
step-cost table (Qwen3-8B shapes, one H100, about 50 requests). Near break-even
it holds a steady small tree where that serves more than plain steps (the
controller of 8c473bf alternated, about half of the steps plain), and plain
steps where those serve more."""

import pytest

from benchmarks import budget_sim


@pytest.mark.parametrize("seed", [0, 1])
def test_a_steady_small_tree_where_it_serves_more(seed):
    """Mostly 3-node trees, none thrown away, within 3 % of a steady 3-node
    tree's rate. The plain steps left (7-11 % over seeds 0-5) are the stale
    plain estimate's retakes and, since prompt time is learned per kind of
    step, runs that learn the plain steps' own (04625ba: 7-10 %, rates within
    0.5 % of now's)."""
    strength = 0.33  # a 3-node tree accepts 0.53 nodes per request
    steady = {b: budget_sim.steady_rate(strength, b) for b in (0, 1, 3, 7)}
    assert max(steady, key=steady.get) == 3 and steady[3] > 1.05 * steady[0]
    shares, discarded, rate = budget_sim.simulate(strength, seed=seed)
    print(f"budgets {shares}, {rate:.2f} tokens/ms, steady {steady}")
    assert shares.get(3, 0.0) >= 0.85
    assert discarded == 0.0
    assert rate >= 0.97 * steady[3]


@pytest.mark.parametrize("strength, best", [(1.0, (3, 7)), (0.2, (0,))])
def test_the_better_steady_choice_elsewhere(strength, best):
    steady = {b: budget_sim.steady_rate(strength, b) for b in (0, 1, 3, 7)}
    assert max(steady, key=steady.get) in best
    shares, _, rate = budget_sim.simulate(strength, seed=0)
    assert sum(shares.get(b, 0.0) for b in best) >= 0.9
    assert rate >= 0.97 * max(steady.values())


@pytest.mark.parametrize("seed", [0, 1])
def test_plain_steps_on_the_h200_record_periods(seed):
    """The real-size record's T=1, concurrency 64 case on the H200 table (a
    plain step 5.7 ms, a 3-node step with the drafter 10.2 ms; a 3-node tree
    accepting 0.45 nodes per request): the controller keeps plain steps."""
    costs = budget_sim.COST_TABLES["h200"]
    assert costs.period(49, 0, False) == pytest.approx(5.67, abs=0.01)
    assert costs.period(49, 3, True) == pytest.approx(10.2, abs=0.01)
    strength = 0.28
    steady = {b: budget_sim.steady_rate(strength, b, costs=costs) for b in (0, 1, 3)}
    assert max(steady, key=steady.get) == 0
    shares, discarded, rate = budget_sim.simulate(strength, seed=seed, costs=costs)
    print(f"budgets {shares}, {rate:.2f} tokens/ms, steady {steady}")
    assert shares.get(0, 0.0) >= 0.9
    assert discarded == 0.0
    assert rate >= 0.97 * steady[0]


def test_cost_table_option(capsys):
    budget_sim.main(["--costs", "h200", "--strengths", "1.0", "--seeds", "1"])
    out = capsys.readouterr().out
    assert "costs h200: at 49 requests a plain step 5.67 ms" in out
    assert "seed 0: budgets {" in out


def test_speculation_resumes_when_the_traffic_changes():
    """A batch that stopped speculating (the h100-prompts table, where a
    3-node tree accepting 0.24 nodes a request serves less than plain steps)
    meets traffic where trees pay (1.6): a probe finds it within the probes'
    back-off (a probe at most 8 x 32 steps after the last one, its estimate
    two steps later, then a step to verify), and the batch then verifies
    trees."""
    costs = budget_sim.COST_TABLES["h100-prompts"]
    shares, _, _ = budget_sim.simulate(0.15, steps=1500, costs=costs)
    assert shares.get(0, 0.0) >= 0.95  # plain steps before the switch
    lag, rate = budget_sim.switch_lag(0.15, 1.0, seed=0, costs=costs)
    assert lag is not None and 0 < lag <= 8 * 32 + 4
    low = budget_sim.steady_rate(0.15, 0, costs=costs)
    assert rate > 1.2 * low  # the second half ran trees
