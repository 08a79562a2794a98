# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree's per-step budget on the host: the cost model and the controller.

The controller is checked against a brute-force argmax over the ladder, and in a
closed loop against a simulated engine whose true step periods and acceptance
it does not know: it must settle on the best budget (speculating or not) and
deliver at least 0.97x the tokens per second of the best fixed choice.
"""

import math

import pytest

from tests.log_records import log_records

from vllm.v1.spec_decode.ddtree_cost import (
    AcceptanceCurve,
    StepCostModel,
    TreeBudgetController,
    budget_ladder,
    prior_acceptance,
    request_bucket,
)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_budget_ladder():
    assert budget_ladder(1) == (0, 1)
    assert budget_ladder(15) == (0, 1, 3, 7, 15)
    assert budget_ladder(128) == (0, 1, 3, 7, 15, 31, 63, 127, 128)
    assert budget_ladder(1024)[-3:] == (511, 1023, 1024)
    with pytest.raises(ValueError, match="cap"):
        budget_ladder(0)


def test_request_buckets_are_monotone_and_cover_every_size():
    buckets = [request_bucket(n) for n in range(1, 1025)]
    assert buckets[:4] == [1, 2, 3, 4]
    assert all(b >= n for n, b in zip(range(1, 1025), buckets))
    assert buckets == sorted(buckets)
    # About 1.5x apart: few distinct periods to learn.
    assert len(set(buckets)) <= 22
    assert all(b <= 1.5 * n + 1 for n, b in zip(range(1, 1025), buckets))


def test_prior_interpolates_and_extrapolates():
    cost = StepCostModel({16: 1.0, 32: 2.0, 64: 3.0}, {1: 0.5, 4: 1.1})
    assert cost.prior(1, 0, False) == 1.0  # 1 token: flat below 16
    assert cost.prior(3, 7, False) == pytest.approx(1.5)  # 24 tokens
    assert cost.prior(16, 7, False) == pytest.approx(5.0)  # 128: past the last
    assert cost.prior(2, 15, True) == pytest.approx(2.0 + 0.7)  # drafter at 2 reqs
    assert cost.prior(8, 3, True) == pytest.approx(2.0 + 1.1 + 0.2 * 4)


def test_observed_periods_replace_the_prior_and_bound_larger_trees():
    cost = StepCostModel({1: 1e-3, 1024: 2e-3}, {1: 1e-4, 64: 1e-4})
    for _ in range(2):
        assert cost.observe(4, 7, True, 5e-3)
    # Two observations: still the prior.
    assert cost.predict(4, 7, True) == pytest.approx(cost.prior(4, 7, True))
    assert cost.observe(4, 7, True, 5e-3)
    assert cost.predict(4, 7, True) == pytest.approx(5e-3)
    assert cost.num_observed(4, 7, True) == 3
    # A larger tree of the same kind never runs faster; a smaller one may.
    assert cost.predict(4, 15, True) == pytest.approx(5e-3)
    assert cost.predict(4, 3, True) == pytest.approx(cost.prior(4, 3, True))
    # Its GPU time alone can rule a shape out.
    assert cost.predict(4, 1023, True) == pytest.approx(cost.prior(4, 1023, True))
    assert cost.prior(4, 1023, True) > 5e-3
    # Plain steps and other batch sizes are their own shapes.
    assert cost.predict(4, 0, False) == pytest.approx(cost.prior(4, 0, False))
    assert cost.predict(64, 15, True) == pytest.approx(cost.prior(64, 15, True))
    # An idle gap is not a step's cost.
    assert not cost.observe(4, 7, True, 0.1)
    assert cost.predict(4, 7, True) == pytest.approx(5e-3)
    assert not cost.observe(4, 7, True, 0.0)


def test_a_seen_larger_shape_bounds_an_unseen_one_from_above():
    # The drafter's start-up time at 4 requests came out absurd (a replay over
    # stale buffers): the shapes of 4 requests must still be tried once 8
    # requests' steps have taught their periods (a smaller batch or tree never
    # runs slower).
    cost = StepCostModel({1: 1e-3, 1024: 2e-3}, {1: 1e-4, 4: 5.0, 8: 1e-4, 16: 2e-4})
    assert cost.predict(4, 63, True) > 5.0
    for _ in range(3):
        assert cost.observe(8, 63, True, 6e-3)
        assert cost.observe(8, 15, True, 5e-3)
        assert cost.observe(8, 0, False, 4e-3)
    checked = 0
    for b, want in ((63, 6e-3), (31, 6e-3), (15, 5e-3), (1, 5e-3)):
        assert cost.predict(4, b, True) == pytest.approx(want)
        checked += 1
    # Not from a smaller tree or a smaller batch.
    assert cost.predict(4, 127, True) > 5.0
    assert cost.predict(16, 7, True) == pytest.approx(cost.prior(16, 7, True))
    # Each kind of step from its own kind: a probe (drafter, no tree) from the
    # drafted steps, a plain step (prior 1 ms) from the plain ones.
    assert cost.prior(2, 0, True) > 5.0 / 4
    assert cost.predict(2, 0, True) == pytest.approx(5e-3)
    assert cost.prior(2, 0, False) < 4e-3
    assert cost.predict(2, 0, False) == pytest.approx(cost.prior(2, 0, False))
    # The shape's own periods win once it has them.
    for _ in range(3):
        cost.observe(4, 63, True, 7e-3)
    assert cost.predict(4, 63, True) == pytest.approx(7e-3)
    assert checked == 4


def test_best_budget_is_the_argmax_over_the_ladder():
    ladder = budget_ladder(127)
    cost = StepCostModel({n: 1e-3 + 2e-6 * n for n in (1, 64, 512, 4096)}, {1: 5e-4})
    controller = TreeBudgetController(ladder, 15, cost)
    compared = 0
    for num_reqs in (1, 2, 5, 16, 33, 64):
        for shape in (0.3, 1.0, 2.0):
            per_req = tuple(
                0.0 if b == 0 else min(15.0, shape * math.log2(1 + b)) for b in ladder
            )
            controller.set_curve(AcceptanceCurve(num_reqs, per_req))
            for max_budget in (0, 3, 40, 127):
                rates = {
                    b: (1 + per_req[i]) / cost.predict(num_reqs, b, b > 0)
                    for i, b in enumerate(ladder)
                    if b <= max_budget
                }
                want = max(rates, key=lambda b: (rates[b], -b))
                assert controller.best_budget(num_reqs, max_budget) == want
                compared += 1
    assert compared == 6 * 3 * 4


def test_no_trees_no_speculation_and_the_drafter_probes():
    cost = StepCostModel({1: 1.0}, {1: 10.0})  # the drafter costs 10 steps
    controller = TreeBudgetController(budget_ladder(15), 15, cost, probe_interval=5)
    controller.set_curve(AcceptanceCurve(1, (0.0, 0.5, 1.0, 1.5, 2.0)))
    assert controller.best_budget(1, 15) == 0
    assert controller.choose(1, 15, has_trees=True, timed=True) == 0
    # The 5th step without speculation probes; while probes find that it
    # does not pay, each waits twice as long, up to 8 x 5 steps.
    drafted = [controller.should_draft(1, 15) for _ in range(160)]
    assert [i for i, d in enumerate(drafted) if d] == [4, 14, 34, 74, 114, 154]
    # Speculation pays: draft every step, and without trees verify none.
    controller.set_curve(AcceptanceCurve(1, (0.0, 5.0, 9.0, 12.0, 14.0)))
    cheap = StepCostModel({1: 1.0}, {1: 0.1})
    controller.cost = cheap
    assert all(controller.should_draft(1, 15) for _ in range(3))
    assert controller.choose(1, 15, has_trees=False, timed=True) == 0
    assert controller.choose(1, 15, has_trees=True, timed=True) > 0
    # Once it stops paying again, probes start over from 5 steps.
    controller.cost = cost
    controller.set_curve(AcceptanceCurve(1, (0.0, 0.5, 1.0, 1.5, 2.0)))
    drafted = [controller.should_draft(1, 15) for _ in range(20)]
    assert [i for i, d in enumerate(drafted) if d] == [4, 14]


def test_the_prior_acceptance_is_used_until_a_curve_arrives():
    controller = TreeBudgetController(
        budget_ladder(31), 15, StepCostModel({1: 1.0}, {1: 0.0})
    )
    assert controller.expected_accepted(31) == pytest.approx(prior_acceptance(31, 15))
    assert prior_acceptance(1023, 3) == 3.0
    with pytest.raises(ValueError, match="ladder"):
        controller.set_curve(AcceptanceCurve(1, (0.0, 1.0)))


class SimulatedEngine:
    """True step periods and acceptance the controller must discover.

    Period of a step: host work (per request, more when the drafter runs) or
    GPU work (per verified token, plus the drafter's), whichever is larger, as
    with async scheduling. Acceptance: ``strength * log2(1 + b)`` per request,
    at most ``depth``.
    """

    def __init__(self, num_reqs, strength, host, drafter, per_token, depth=15):
        self.num_reqs = num_reqs
        self.strength = strength
        self.host = host
        self.drafter = drafter
        self.per_token = per_token
        self.depth = depth

    def accepted(self, b):
        return 0.0 if b == 0 else min(self.depth, self.strength * math.log2(1 + b))

    def period(self, b, drafted):
        tokens = self.num_reqs * (1 + b)
        gpu = 1e-3 + self.per_token * tokens + (self.drafter if drafted else 0.0)
        host = self.host * (1.5 if drafted else 1.0)
        return max(gpu, host)

    def rate(self, b):
        return self.num_reqs * (1 + self.accepted(b)) / self.period(b, b > 0)


def _run(controller, engine, clock, ladder, steps, idle_every=0):
    """``steps`` steps as vLLM's async scheduling times them: the host starts a
    step while the GPU still runs the one before, so the period between two
    step starts is the earlier step's (the controller must not take it for
    the later one's). Every ``idle_every`` steps the engine then waits a
    second for the next request (not a step's cost). Returns tokens per
    second of work, idle time left out."""
    tokens = 0.0
    elapsed = 0.0
    drafted = True
    last_period = 0.0
    for k in range(steps):
        controller.step_started()
        b = controller.choose(engine.num_reqs, ladder[-1], drafted, timed=True)
        next_drafted = controller.should_draft(engine.num_reqs, ladder[-1])
        controller.drafted(next_drafted)
        if next_drafted:
            curve = tuple(engine.accepted(x) for x in ladder)
            controller.set_curve(AcceptanceCurve(engine.num_reqs, curve))
        period = engine.period(b, next_drafted)
        clock.now += last_period
        if idle_every and k % idle_every == idle_every - 1:
            clock.now += 1.0
        last_period = period
        elapsed += period
        tokens += engine.num_reqs * (1 + engine.accepted(b))
        drafted = next_drafted
    return tokens / elapsed


@pytest.mark.parametrize(
    "num_reqs,strength,host,drafter,per_token",
    [
        (1, 2.0, 2e-3, 5e-4, 1e-6),  # batch 1, strong drafter: big trees
        (64, 2.0, 4e-3, 8e-4, 2e-6),  # large batch: GPU-bound, small trees
        (32, 0.2, 6e-3, 3e-3, 1e-6),  # weak drafter (T=1), host-bound: trees free
        (32, 0.05, 6e-3, 3e-3, 1e-6),  # weaker still: no speculation wins
        (8, 1.0, 1e-3, 1e-4, 4e-5),  # GEMM-heavy target
    ],
)
@pytest.mark.parametrize("idle_every", [0, 10])
def test_closed_loop_beats_097_of_the_best_fixed_budget(
    num_reqs, strength, host, drafter, per_token, idle_every
):
    """The controller starts from a GPU-only prior (no host work, drafter at
    a tenth of its cost) and learns the rest from timed steps, whose periods
    are shifted by one step (async scheduling) and now and then include the
    engine's idle time (as behind a server whose clients pause)."""
    ladder = budget_ladder(255)
    engine = SimulatedEngine(num_reqs, strength, host, drafter, per_token)
    clock = FakeClock()
    target = {n: 1e-3 + per_token * n for n in (1, 16, 256, 4096, 65536)}
    cost = StepCostModel(target, {1: drafter / 10, 1024: drafter / 10})
    controller = TreeBudgetController(
        ladder, 15, cost, clock=clock, log_interval=math.inf
    )
    _run(controller, engine, clock, ladder, 400, idle_every)  # learning
    achieved = _run(controller, engine, clock, ladder, 400, idle_every)
    best = max(engine.rate(b) for b in ladder)
    print(f"achieved {achieved:.1f} tokens/s, best fixed {best:.1f}")
    assert achieved >= 0.97 * best
    chosen = controller.best_budget(num_reqs, ladder[-1])
    assert engine.rate(chosen) >= 0.97 * best
    assert (chosen == 0) == (max(ladder, key=engine.rate) == 0)


def test_step_periods_are_learned_within_runs_of_one_shape():
    """Under async scheduling the period between two step starts mixes two
    steps' work: it is learned only when both steps had the same shape."""
    clock = FakeClock()
    cost = StepCostModel({1: 1e-3}, {1: 1e-4})
    controller = TreeBudgetController(budget_ladder(7), 7, cost, clock=clock)
    controller.set_curve(AcceptanceCurve(4, (0.0, 0.5, 1.0, 2.0)))

    def step(num_reqs=4, timed=True, drafted=True, seconds=0.25):
        controller.step_started()
        b = controller.choose(num_reqs, 7, True, timed=timed)
        if drafted is not None:
            controller.drafted(drafted)
        clock.now += seconds
        return b

    def seen():
        return cost.num_observed(4, b, True)

    b = step()
    assert step() == b  # its start closes the first step: nothing before it
    assert seen() == 0
    step()  # closes a step whose predecessor had its shape
    assert seen() == 1
    # Another batch size (bucket) or drafter decision breaks the run: of the
    # steps below only the first start (closing the run above) and the last
    # one (closing the second of two alike) teach.
    for kwargs in ({"num_reqs": 16}, {}, {"drafted": False}, {}, {}):
        step(**kwargs)
    assert seen() == 2
    step()
    assert seen() == 3
    # A step start without a tree step (no drafts scheduled) breaks it too.
    controller.step_started()  # closes the last step (its predecessor alike)
    assert seen() == 4
    step()
    step()
    assert seen() == 4
    # An untimed step (prompts in it) teaches nothing, nor the step after it.
    step(timed=False, seconds=9.0)  # closes a timed pair
    assert seen() == 5
    step()
    step()
    assert seen() == 5
    # Nor a step whose drafter decision never came (e.g. a dummy run).
    step(drafted=None, seconds=9.0)  # closes the pair above
    assert seen() == 6
    step()
    step()
    assert seen() == 6
    # With learning off (tensor parallelism), nothing is learned.
    controller.learn = False
    for _ in range(3):
        step()
    assert seen() == 6


def test_median_period_ignores_idle_gaps():
    cost = StepCostModel({1: 1e-3}, {1: 1e-4})
    # Idle gaps among the first periods, before the shape has an estimate: too
    # long for a decode step, not kept.
    kept = [cost.observe(4, 7, True, s) for s in (2.0, 0.005, 3.0, 0.005, 0.006)]
    assert kept == [False, True, False, True, True]
    assert cost.predict(4, 7, True) == pytest.approx(0.005)
    # Shorter gaps the median outvotes (the ratio test is off below three).
    cost = StepCostModel({1: 1e-3}, {1: 1e-4})
    for seconds in (0.3, 0.005, 0.4, 0.005, 0.006, 0.005, 0.004):
        cost.observe(4, 7, True, seconds)
    assert cost.predict(4, 7, True) == pytest.approx(0.005)
    # The median follows a lasting change within the window.
    for _ in range(15):
        cost.observe(4, 7, True, 0.009)
    assert cost.predict(4, 7, True) == pytest.approx(0.009)
    # What the log shows of it (5 requests share a bucket with 6, not 4).
    for _ in range(3):
        cost.observe(4, 0, False, 0.002)
    assert cost.learned(4) == "b=0 2.00 ms (3), b=7+ 9.00 ms (22)"
    assert cost.learned(5) == "none yet"


def test_log_reports_budgets_and_calibration():
    clock = FakeClock()
    controller = TreeBudgetController(
        budget_ladder(7),
        7,
        StepCostModel({1: 1e-3}, {1: 1e-4}),
        clock=clock,
        log_interval=1.0,
    )
    controller.set_curve(
        AcceptanceCurve(2, (0.0, 0.5, 1.0, 2.0), (10.0, 12.0, 4.0, 20.0))
    )
    controller.step_started()
    controller.choose(2, 7, True, timed=True)
    controller.drafted(True)
    controller.set_curve(
        AcceptanceCurve(2, (0.0, 0.5, 1.0, 2.0), (19.0, 22.0, 8.0, 40.0))
    )
    clock.now += 2.0
    with log_records("vllm.v1.spec_decode.ddtree_cost") as records:
        controller.step_started()
    text = "\n".join(r.getMessage() for r in records)
    # Every DDTree line starts so (the e2e tests pick DDTree's lines by it).
    assert text.startswith("DDTree: budget over ")
    assert "1 decode steps" in text and "drafter ran in 100%" in text
    # Since start-up: 19 predicted vs 22 accepted nodes over 8 trees.
    assert "accepted 2.75 per tree, predicted 2.38 (-13.6%)" in text
    assert "step periods learned for batches of up to 2: none yet" in text
    assert text.endswith(
        "steps took 0.00 ms (plain) and 0.00 ms (trees) more than those periods "
        "(prompt chunks), a step with a prompt chunk none yet (plain) and none "
        "yet (trees) more"
    )
    # Once a step with a prompt chunk was timed (its work shows in the
    # period of the step after it): what it took beyond its shape.
    for timed in (False, True, True):
        assert controller.choose(2, 7, True, timed=timed) == 0  # trees lose
        controller.drafted(True)
        clock.now += 0.005
        controller.step_started()
    controller.choose(2, 7, True, timed=True)
    controller.drafted(True)
    clock.now += 2.0
    with log_records("vllm.v1.spec_decode.ddtree_cost") as records:
        controller.step_started()
    text = "\n".join(r.getMessage() for r in records)
    plain = controller.prompt_step_seconds(False)
    assert plain is not None and plain > 0.0
    assert controller.prompt_step_seconds(True) is None
    assert text.endswith(
        f"a step with a prompt chunk {1e3 * plain:.2f} ms (plain) and none yet "
        "(trees) more"
    )


def test_probes_start_over_after_an_idle_gap():
    """Once probes have backed off, an idle engine's next traffic is probed
    at the first interval again, unless periods are not learned (tensor
    parallelism: no rank's clock may steer a choice)."""
    for learn in (True, False):
        clock = FakeClock()
        controller = TreeBudgetController(
            budget_ladder(15),
            15,
            StepCostModel({1: 1.0}, {1: 10.0}),
            probe_interval=5,
            clock=clock,
            learn=learn,
        )
        controller.set_curve(AcceptanceCurve(1, (0.0, 0.5, 1.0, 1.5, 2.0)))

        def steps(count, gap=0.01):
            drafted = []
            for _ in range(count):
                clock.now += gap
                controller.step_started()
                drafted.append(controller.should_draft(1, 15))
            return [i for i, d in enumerate(drafted) if d]

        assert steps(40) == [4, 14, 34]  # backed off to 40 steps
        clock.now += 5.0  # idle
        # 5 + 1 steps since the last probe: with learning a probe at once,
        # then 10 steps later; without, none before 40 steps since the last.
        assert steps(12) == ([0, 10] if learn else [])


@pytest.mark.parametrize("speculating", [False, True])
def test_a_probes_trees_skip_a_step_with_a_prompt(speculating):
    """A probe's trees are verified on a pure decode step where that pays for
    the target's extra work (their drafter is paid), but not on a step that
    carries a prompt chunk, which next to trees costs several times what it
    costs next to plain decodes (a plain batch's prompt time does not include
    that). A speculating batch weighs its prompt steps' trees as before."""
    # 3-node trees cost the target 0.5 ms over a 5 ms plain step and accept
    # one node a request; the drafter costs 10 ms (speculating does not pay)
    # or 0.1 ms (it does).
    drafter = 0.1e-3 if speculating else 10e-3
    cost = StepCostModel({8: 5e-3, 16: 5.2e-3, 32: 5.5e-3}, {8: drafter})
    controller = TreeBudgetController(budget_ladder(3), 3, cost)
    controller.set_curve(AcceptanceCurve(8, (0.0, 0.5, 1.0)))
    assert controller.should_draft(8, 3) is speculating  # False: a probe's
    assert controller.choose(8, 3, has_trees=True, timed=True) == 3
    got = controller.choose(8, 3, has_trees=True, timed=False)
    assert got == (3 if speculating else 0)


def test_no_probe_where_the_scheduler_gives_no_slots():
    controller = TreeBudgetController(
        budget_ladder(15), 15, StepCostModel({1: 1.0}, {1: 10.0}), probe_interval=2
    )
    assert not any(controller.should_draft(600, 0) for _ in range(6))


def test_drafted_trees_are_weighed_without_their_drafter():
    """A step's trees cost their drafter's forward whatever it verifies: they
    are verified where that pays for the target's extra work, even where
    drafting for the next step does not pay (it would throw away the forward
    paid for them)."""
    # A 4 ms target step at 8 requests for any size below 64 tokens, a 3 ms
    # drafter: verifying 3 nodes costs the target 1 ms more.
    cost = StepCostModel({8: 4e-3, 32: 5e-3, 64: 6e-3}, {1: 3e-3, 8: 3e-3})
    controller = TreeBudgetController(budget_ladder(7), 7, cost)
    controller.set_curve(AcceptanceCurve(8, (0.0, 0.2, 0.5, 0.6)))
    # Steady: 1.5 tokens per 8 ms against 1 per 4 ms: do not draft.
    assert controller.best_budget(8, 7) == 0
    assert not controller.should_draft(8, 7)
    # Trees drafted already: 1.5 tokens per 5 ms against 1 per 4 ms.
    assert controller.best_budget(8, 7, drafted=True) == 3
    assert controller.choose(8, 7, has_trees=True, timed=True) == 3
    # Verification alone must pay: not where the trees accept too little.
    controller.set_curve(AcceptanceCurve(8, (0.0, 0.05, 0.1, 0.2)))
    assert controller.choose(8, 7, has_trees=True, timed=True) == 0


def test_estimates_are_averaged_over_batches():
    """Each estimate is one batch's and arrives late: the controller weighs a
    running average, so one batch's swing near break-even does not flip it."""
    controller = TreeBudgetController(
        budget_ladder(3), 3, StepCostModel({1: 1.0}, {1: 0.1})
    )
    controller.update_curve(AcceptanceCurve(4, (0.0, 1.0, 2.0), (1.0, 2.0, 3.0, 4.0)))
    assert controller.expected_accepted(3) == pytest.approx(2.0)
    controller.update_curve(AcceptanceCurve(6, (0.0, 3.0, 6.0), (5.0, 6.0, 7.0, 8.0)))
    assert controller.expected_accepted(1) == pytest.approx(1.5)
    assert controller.expected_accepted(3) == pytest.approx(3.0)
    # The calibration totals (for the log) are the newest, not averaged.
    assert controller._curve.calibration == (5.0, 6.0, 7.0, 8.0)
    for _ in range(30):
        controller.update_curve(AcceptanceCurve(6, (0.0, 3.0, 6.0)))
    assert controller.expected_accepted(3) == pytest.approx(6.0, rel=1e-3)


def test_periods_follow_the_batch_size_within_a_bucket():
    """A bucket spans batch sizes (49 to 64 requests) whose tree steps differ
    more than their plain steps: a shape's periods are scaled by its GPU time
    at the batch size asked for, so that a tree step of 49 requests is not
    charged what one of 64 costs."""
    assert request_bucket(49) == request_bucket(64)
    cost = StepCostModel({64: 5e-3, 1024: 15e-3}, {1: 1e-3, 64: 1e-3})
    for _ in range(5):
        assert cost.observe(64, 3, True, 1.2 * cost.prior(64, 3, True))
        assert cost.observe(64, 0, False, 1.2 * cost.prior(64, 0, False))
    assert cost.predict(64, 3, True) == pytest.approx(1.2 * cost.prior(64, 3, True))
    assert cost.predict(49, 3, True) == pytest.approx(1.2 * cost.prior(49, 3, True))
    assert cost.predict(49, 3, True) < 0.95 * cost.predict(64, 3, True)
    # The GPU time of a plain step barely moves between them; nor does its
    # prediction.
    assert cost.predict(49, 0, False) == pytest.approx(cost.predict(64, 0, False))
    assert cost.learned(49) == "b=0 6.00 ms (5), b=3+ 9.60 ms (5)"


def _run_with_prompts(controller, clock, curve, steps, is_prompt, seconds):
    """Drives ``controller`` as an engine does for ``steps`` steps of 8
    requests (cap 3), a step carrying a prompt chunk where ``is_prompt(k)``
    and taking ``seconds(b, drafted, prompt)``, its period measured one step
    late as under async scheduling; returns each step's budget."""
    drafted, last = True, 0.0
    budgets = []
    for k in range(steps):
        controller.step_started()
        prompt = is_prompt(k)
        b = controller.choose(8, 3, drafted, timed=not prompt)
        next_drafted = controller.should_draft(8, 3)
        controller.drafted(next_drafted)
        if next_drafted:
            controller.update_curve(curve)
        clock.now += last  # the period measured is the step before's
        last = seconds(b, next_drafted, prompt)
        drafted = next_drafted
        budgets.append(b)
    return budgets


# Plain steps 5 ms, 3-node steps 7 ms, the drafter 2 ms: start-up times equal
# to the true periods, so that only the prompts are unknown.
_PROMPT_TARGET = {8: 5e-3, 16: 6e-3, 32: 7e-3}


def _prompt_controller():
    clock = FakeClock()
    cost = StepCostModel(_PROMPT_TARGET, {8: 2e-3})
    controller = TreeBudgetController(budget_ladder(3), 3, cost, clock=clock)
    curve = AcceptanceCurve(8, (0.0, 0.3, 0.7))
    controller.set_curve(curve)
    return controller, clock, curve


def _decode_seconds(b, drafted):
    return _PROMPT_TARGET[8 * (1 + b)] + (2e-3 if drafted else 0.0)


@pytest.mark.parametrize("prompt_every", [0, 3])
def test_prompt_time_counts_for_every_budget(prompt_every):
    """Steps that carry a prompt chunk take its time whatever the budget: the
    controller learns that time per step (from every step's period against
    its shape's estimate, shifted by one step as under async scheduling) and
    weighs trees by tokens over all the time, so a tree that does not pay
    against bare decode steps pays once prompts take a share of every step.
    Plain steps 5 ms, 3-node steps with the drafter 9 ms, 0.7 nodes
    accepted: 1 token per 5 ms against 1.7 per 9 ms without prompts, 1 per
    7 ms against 1.7 per 11 ms with a 6 ms prompt every third step."""
    controller, clock, curve = _prompt_controller()
    budgets = _run_with_prompts(
        controller,
        clock,
        curve,
        600,
        lambda k: bool(prompt_every) and k % prompt_every == 0,
        lambda b, drafted, prompt: (
            _decode_seconds(b, drafted) + (6e-3 if prompt else 0.0)
        ),
    )
    late = budgets[300:]
    if prompt_every:
        assert controller.prompt_seconds(trees=True) == pytest.approx(2e-3, rel=0.2)
        assert late.count(3) >= 0.9 * len(late)
    else:
        assert abs(controller.prompt_seconds(trees=True)) < 1e-4
        assert late.count(0) >= 0.9 * len(late)


@pytest.mark.parametrize("tree_prompt_ms", [6.0, 20.0])
def test_prompt_time_is_learned_apart_for_tree_steps(tree_prompt_ms):
    """A prompt chunk next to trees costs more than next to plain decodes (at
    real size, one H100, 64 requests: prompt steps verifying trees took a
    median 32-50 ms against 13-18 ms for plain ones). Decode steps as in
    test_prompt_time_counts_for_every_budget (plain 5 ms, a 3-node tree with
    the drafter 9 ms, 0.7 nodes accepted), a prompt in a third of the steps
    (at random) taking 6 ms next to plain steps. Taking tree_prompt_ms next
    to trees too, trees pay (1.7 per 11 ms against 1 per 7 ms) and the batch
    keeps them, after trying plain steps (not yet seen, they are charged no
    prompt time); taking 20 ms (1.7 per 15.7 ms), plain steps serve more and
    the batch settles on them, retrying trees only when their estimate goes
    stale. With one prompt time for both kinds (the rule before), the batch
    would keep the trees: 1 per 9.7 ms against 1.7 per 13.7 ms. What a
    prompt step takes beyond a decode step is learned per kind too (6 ms
    plain, tree_prompt_ms with trees)."""
    import random

    rng = random.Random(0)
    controller, clock, curve = _prompt_controller()
    budgets = _run_with_prompts(
        controller,
        clock,
        curve,
        3000,
        lambda k: rng.random() < 1 / 3,
        lambda b, drafted, prompt: (
            _decode_seconds(b, drafted)
            + (1e-3 * (tree_prompt_ms if b else 6.0) if prompt else 0.0)
        ),
    )
    late = budgets[1000:]
    trees, plain = (controller.prompt_seconds(trees=t) for t in (True, False))
    print(
        f"tree prompt {tree_prompt_ms} ms: {late.count(3)} of {len(late)} late "
        f"steps verified trees; prompt time per step {1e3 * trees:.2f} ms "
        f"(trees), {1e3 * plain:.2f} ms (plain)"
    )
    # Each kind's own: a third of 6 ms next to plain steps.
    assert plain == pytest.approx(2e-3, rel=0.3)
    assert controller.prompt_step_seconds(False) == pytest.approx(6e-3, rel=0.2)
    step_trees = controller.prompt_step_seconds(True)
    assert step_trees == pytest.approx(1e-3 * tree_prompt_ms, rel=0.2)
    if tree_prompt_ms == 6.0:
        assert trees == pytest.approx(2e-3, rel=0.3)
        assert late.count(3) >= 0.9 * len(late)
    else:
        assert late.count(0) >= 0.9 * len(late)


@pytest.mark.parametrize("weighed", [True, False])
def test_a_step_with_a_prompt_is_weighed_on_its_own(monkeypatch, weighed):
    """Trees that pay on decode steps (plain 5 ms, a 3-node tree with the
    drafter 9 ms, 1.5 nodes accepted: 2.5 per 9 ms against 1 per 5 ms) but
    not next to a prompt chunk, which costs 6 ms next to plain decodes and
    40 ms next to trees (a third of the steps, at random). A speculating
    batch verifies its trees on decode steps and leaves them on the prompt
    steps, which then take 6 ms more instead of 40: 6 tokens per 31 ms over
    three steps (0.19 per ms) against plain steps' 3 per 21 ms (0.14). With
    every prompt step weighed as a decode step (the rule before), trees
    next to prompts make speculating lose (7.5 per 67 ms), and the batch
    settles on plain steps."""
    import random

    if not weighed:
        monkeypatch.setattr(
            TreeBudgetController, "prompt_step_budget", lambda self, n, b: None
        )
    rng = random.Random(0)
    controller, clock, _ = _prompt_controller()
    curve = AcceptanceCurve(8, (0.0, 0.7, 1.5))
    controller.set_curve(curve)
    prompts = [rng.random() < 1 / 3 for _ in range(3000)]
    taken = []

    def seconds(b, drafted, prompt):
        taken.append(
            _decode_seconds(b, drafted) + (1e-3 * (40 if b else 6) if prompt else 0)
        )
        return taken[-1]

    budgets = _run_with_prompts(
        controller, clock, curve, 3000, lambda k: prompts[k], seconds
    )
    late = list(zip(budgets, prompts, taken))[1000:]
    decode = [b for b, p, _ in late if not p]
    prompt = [b for b, p, _ in late if p]
    tokens = sum(1 + (1.5 if b == 3 else 0.7 if b == 1 else 0.0) for b, _, _ in late)
    rate = tokens / (1e3 * sum(t for _, _, t in late))
    print(
        f"weighed={weighed}: trees on {decode.count(3)} of {len(decode)} decode "
        f"steps and {prompt.count(3)} of {len(prompt)} prompt steps, "
        f"{rate:.3f} tokens per ms"
    )
    if weighed:
        assert decode.count(3) >= 0.9 * len(decode)
        assert prompt.count(0) >= 0.9 * len(prompt)
        assert rate > 0.18
    else:
        assert decode.count(0) >= 0.9 * len(decode)
        assert rate < 0.15


def test_a_prompt_steps_cost_with_trees_is_retaken():
    """Once a speculating batch leaves its trees on prompt steps nothing
    renews what such a step costs with trees: the estimate goes stale and is
    retaken, so when prompt chunks become cheap next to trees (40 ms, then 6
    ms as next to plain decodes) the batch verifies trees there again."""
    import random

    rng = random.Random(1)
    controller, clock, _ = _prompt_controller()
    curve = AcceptanceCurve(8, (0.0, 0.7, 1.5))
    controller.set_curve(curve)
    prompts = [rng.random() < 1 / 3 for _ in range(4000)]
    count = [0]

    def seconds(b, drafted, prompt):
        count[0] += 1
        tree_ms = 40 if count[0] <= 1500 else 6
        return _decode_seconds(b, drafted) + (
            1e-3 * (tree_ms if b else 6) if prompt else 0
        )

    budgets = _run_with_prompts(
        controller, clock, curve, 4000, lambda k: prompts[k], seconds
    )
    before = [b for b, p in zip(budgets[500:1500], prompts[500:1500]) if p]
    after = [b for b, p in zip(budgets[3000:], prompts[3000:]) if p]
    print(
        f"trees on {before.count(3)} of {len(before)} prompt steps, then "
        f"{after.count(3)} of {len(after)}"
    )
    assert before.count(0) >= 0.9 * len(before)
    assert after.count(3) >= 0.9 * len(after)


@pytest.mark.parametrize("stale", [True, False])
def test_a_plain_estimate_taken_too_high_is_retaken(monkeypatch, stale):
    """After a run of trees, plain steps still carry the trees' work for a
    few steps (as traced at real size: 12.3, 9.8, 9.8, 9.1 ms between step
    starts against 8.2 ms steady, the first being the last tree's). Plain
    steps learned from those look worse than 3-node trees that accept 0.35
    nodes (12.3 ms), and nothing times a plain step while the batch drafts.
    Plain periods are learned only once such a run has settled, and a plain
    estimate goes stale and is retaken, so the controller settles on plain
    steps, which serve 1 token per 8.2 ms against 1.35 per 12.3 ms. The
    ablation shows the check can fail: both rules off, the batch drafts."""
    from vllm.v1.spec_decode import ddtree_cost

    if not stale:
        monkeypatch.setattr(ddtree_cost, "_STALE_STEPS", 10**9)
        monkeypatch.setattr(ddtree_cost, "_PLAIN_SETTLE_STEPS", 0)
    ladder = budget_ladder(3)
    clock = FakeClock()
    # GPU times at start-up: 6.6 ms plain at 64 requests, a 3-node tree 10 ms.
    cost = StepCostModel({64: 6.6e-3, 128: 8e-3, 256: 10e-3}, {64: 1e-3})
    controller = TreeBudgetController(ladder, 3, cost, clock=clock)
    strong = AcceptanceCurve(64, (0.0, 1.0, 2.3))
    weak = AcceptanceCurve(64, (0.0, 0.2, 0.35))
    # What plain steps take after a run of at least 8 tree steps.
    draining = [9.8e-3, 9.8e-3, 9.1e-3]

    drafted, last, plain_run, tree_run, drains = True, 0.0, 0, 0, False
    budgets, tokens, seconds = [], 0.0, 0.0
    for k in range(1600):
        curve = strong if k < 60 else weak
        controller.step_started()
        b = controller.choose(64, 3, drafted, timed=True)
        next_drafted = controller.should_draft(64, 3)
        controller.drafted(next_drafted)
        if next_drafted:
            controller.update_curve(curve)
        if b == 0 and not next_drafted:
            if plain_run == 0:
                drains = tree_run >= 8
            slow = drains and plain_run < len(draining)
            period = draining[plain_run] if slow else 8.2e-3
            plain_run, tree_run = plain_run + 1, 0
        else:
            period, plain_run, tree_run = 12.3e-3, 0, tree_run + 1
        # The period between two step starts is the step before's.
        clock.now += last
        last = period
        drafted = next_drafted
        if k >= 400:
            budgets.append(b)
            tokens += 1 + curve.per_request[ladder.index(b)]
            seconds += period
    share = budgets.count(0) / len(budgets)
    rate = tokens / seconds
    print(f"plain steps {share:.2f}, {rate * 8.2e-3:.3f} x plain's rate")
    if stale:
        assert share >= 0.9
        assert rate >= 0.97 / 8.2e-3
    else:
        assert share < 0.5


def test_plain_estimates_go_stale():
    """Only a plain step's estimate goes stale: past _STALE_STEPS steps
    without a plain period it is dropped (the start-up time predicts it
    again) and relearned from new periods only; tree shapes keep theirs."""
    from vllm.v1.spec_decode.ddtree_cost import _MIN_OBSERVATIONS, _STALE_STEPS

    cost = StepCostModel({8: 5e-3, 32: 6e-3}, {8: 1e-3})
    for _ in range(_MIN_OBSERVATIONS):
        cost.observe(8, 0, False, 9e-3)
        cost.observe(8, 3, True, 12e-3)
    assert cost.predict(8, 0, False) == pytest.approx(9e-3)
    for _ in range(_STALE_STEPS):
        cost.tick()
    assert cost.estimated(8, 0, False)
    cost.tick()
    assert not cost.estimated(8, 0, False)
    assert cost.predict(8, 0, False) == pytest.approx(5e-3)
    assert cost.predict(8, 3, True) == pytest.approx(12e-3)
    cost.observe(8, 0, False, 7e-3)
    assert cost.num_observed(8, 0, False) == 1
    for _ in range(_MIN_OBSERVATIONS - 1):
        cost.observe(8, 0, False, 7e-3)
    assert cost.predict(8, 0, False) == pytest.approx(7e-3)


def test_should_draft_keeps_its_mode_near_break_even():
    """Switching between speculating and plain steps costs steps that no
    shape's period shows: should_draft switches only for a margin
    (_SWITCH_MARGIN), so a batch near break-even keeps its mode."""
    from vllm.v1.spec_decode.ddtree_cost import _SWITCH_MARGIN

    cost = StepCostModel({4: 5e-3, 16: 10e-3}, {4: 1e-9})
    controller = TreeBudgetController(budget_ladder(3), 3, cost)

    def with_gain(gain):
        # A 3-node tree (20 tokens of target work) at 10 ms: 1 + e tokens.
        e = 2.0 * gain - 1.0
        controller.set_curve(AcceptanceCurve(4, (0.0, -1.0, e)))

    half = 1.0 + _SWITCH_MARGIN / 2
    with_gain(half)  # trees 1.5 % better
    assert controller.should_draft(4, 3)  # an engine starts speculating
    with_gain(1 / half)  # plain steps 1.5 % better: not enough to stop
    assert controller.should_draft(4, 3)
    with_gain(1 / (1.0 + 2 * _SWITCH_MARGIN))
    assert not controller.should_draft(4, 3)
    with_gain(half)  # not enough to start again
    assert not controller.should_draft(4, 3)
    with_gain(1.0 + 2 * _SWITCH_MARGIN)
    assert controller.should_draft(4, 3)


def _graphed(largest: int, max_reqs: int = 700, ladder=budget_ladder(15)):
    """The budgets each batch size replays a FULL graph for, with graphs up to
    ``largest`` tokens (no gaps)."""
    return [()] + [
        tuple(b for b in ladder if n * (1 + b) <= largest)
        for n in range(1, max_reqs + 1)
    ]


def _graph_bound_controller(graphed_budgets):
    """A ladder up to 15, start-up graphs up to 512 tokens whose extrapolation
    makes every budget look nearly free (the optimistic prior of an unseen
    shape), trees that accept a lot: on that prior the largest budget wins."""
    target = {64: 6e-3, 256: 7e-3, 512: 8e-3}
    cost = StepCostModel(target, {1: 1e-3, 64: 1e-3}, graphed_budgets=graphed_budgets)
    controller = TreeBudgetController(budget_ladder(15), 15, cost, clock=FakeClock())
    controller.set_curve(AcceptanceCurve(64, (0.0, 0.9, 2.5, 4.0, 6.0)))
    return controller


def test_a_decode_step_stays_within_the_cuda_graphs():
    """At 64 requests a budget of 15 verifies 1024 tokens, twice the largest
    graph: that step runs without one (several times a graph's step, which
    the prior does not know), so it is never chosen there; 7 (512 tokens) is."""
    controller = _graph_bound_controller(_graphed(512))
    assert controller.cost.graphed(64, 7) and not controller.cost.graphed(64, 15)
    assert controller.best_budget(64, 15) == 7
    assert controller.best_budget(64, 15, drafted=True) == 7
    assert controller.choose(64, 15, has_trees=True, timed=True) == 7
    assert controller.should_draft(64, 15) and controller.last_best == 7
    # Fewer requests: the same budget fits a graph again.
    assert controller.cost.graphed(32, 15)
    assert controller.best_budget(32, 15) == 15
    # Where even the plain step has no graph, a tree step loses none: every
    # budget stays open, chosen as without a table (3 here, on cost).
    assert not controller.cost.graphed(600, 0)
    unbounded = _graph_bound_controller(None).best_budget(600, 15)
    assert controller.best_budget(600, 15) == unbounded
    assert not controller.cost.graphed(600, unbounded)


def test_a_gap_in_the_graphs_skips_only_its_budget():
    """Capture sizes a user set may leave a budget without a graph between
    two that have one: only that budget is left out."""
    table = _graphed(512)
    table[64] = (0, 1, 7)
    controller = _graph_bound_controller(table)
    assert controller.best_budget(64, 7) == 7
    table[64] = (0, 1)
    assert controller.best_budget(64, 7) == 1


def test_without_a_graph_table_every_budget_stays_open():
    controller = _graph_bound_controller(None)
    assert controller.cost.graphed(64, 15)
    assert controller.best_budget(64, 15) == 15
