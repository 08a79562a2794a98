# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The adaptive budget's controller at real size, simulated on the CPU.

The product's :class:`~vllm.v1.spec_decode.ddtree_cost.TreeBudgetController`
chooses each step of an engine whose step periods follow a table for Qwen3-8B's
shapes on one H100 (:class:`StepCosts`: weights, GEMM rows, attention over
contexts of about 1.1K tokens, the drafter, host) and whose trees accept
``e(b)`` nodes per request. What the controller does not see is simulated as
vLLM serves: its start-up prior is the GPU time of the CUDA graphs over
one-token contexts; a period is measured between step starts, one step late
(async scheduling); a fifth of the steps carry a prompt (untimed, 6 ms more,
or more next to trees: ``--costs h100-prompts``);
the batch drifts between 44 and 54 requests; the scheduler's slots follow the
controller's advice two steps late; each acceptance estimate is one batch's
(within +-25 % of the mean) and arrives two steps late.

Near break-even the controller of commit 8c473bf alternated between plain
steps and small trees there, serving less than a steady small tree; the
results and the command that ran both are in ``benchmarks/results/budget_sim``::

    python benchmarks/budget_sim.py --strengths 1.0 0.35 0.33 0.3 0.25
"""

import argparse
import math
import random
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.checkout import use_checkout  # noqa: E402

use_checkout()

from vllm.v1.spec_decode.ddtree_cost import (  # noqa: E402
    AcceptanceCurve,
    StepCostModel,
    TreeBudgetController,
    budget_ladder,
)
from vllm.v1.spec_decode.ddtree_slots import slots_for_budget  # noqa: E402

LADDER = budget_ladder(63)
SLOT_LADDER = (0, 3, 15, 63)
# Accepted nodes per request by budget; ``strength`` scales it.
ACCEPTANCE = {0: 0.0, 1: 0.8, 3: 1.6, 7: 2.2, 15: 2.6, 31: 2.8, 63: 2.9}


@dataclass(frozen=True)
class StepCosts:
    """Milliseconds of a decode step of ``n`` requests verifying ``b`` nodes
    each (Qwen3-8B shapes, one H100, contexts of about 1.1K tokens): 7.8 ms
    without speculation at 64 requests."""

    weights: float = 5.3  # the weights read once
    per_row: float = 0.0135  # GEMM rows past the first 64 tokens
    attn_per_req: float = 0.035  # FlashAttention over one request's context
    tree_attn: float = 1.1  # TREE_ATTN's kernel on tree rows, x FlashAttention
    host: float = 0.3
    context: float = 0.15  # the drafter's context KV on a step it skips
    drafter: float = 0.6
    drafter_per_req: float = 0.02
    prompt: float = 6.0  # a prompt chunk's time next to plain decodes
    prompt_tree: float = 6.0  # next to trees

    def prompt_ms(self, b: int) -> float:
        return self.prompt_tree if b else self.prompt

    def period(self, n: int, b: int, drafted: bool) -> float:
        attn = self.attn_per_req * n * (self.tree_attn if b else 1.0)
        ms = self.target_gpu(n * (1 + b)) + attn + self.host
        ms += self.drafter + self.drafter_per_req * n if drafted else self.context
        return ms

    def target_gpu(self, tokens: int) -> float:
        return self.weights + self.per_row * max(0, tokens - 64)

    def prior(self) -> StepCostModel:
        """What start-up measures: graph replays over one-token contexts, the
        drafter's graphs up to 32 requests (16 tokens each, 512 in all)."""
        sizes = (1, 2, 4, 8, 16, 32, 48, 64, 128, 256, 384, 512)
        target = {t: 1e-3 * self.target_gpu(t) for t in sizes}
        drafter = {
            n: 1e-3 * (self.drafter + self.drafter_per_req * n) for n in (1, 8, 32)
        }
        # A decode step of n requests and b nodes each replays a graph up to
        # the largest capture size (vLLM's 512).
        graphed = [()] + [
            tuple(b for b in LADDER if n * (1 + b) <= max(sizes)) for n in range(1, 257)
        ]
        return StepCostModel(target, drafter, graphed_budgets=graphed)


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


# Step-cost tables by GPU. h200: fitted to the periods the real-size record's
# DDTree servers learned on one H200 (benchmarks/results/real_size_record): a
# plain step 5.86-6.23 ms and a 3-node step with the drafter 10.2-10.5 ms at
# 33-64 requests.
# h100-prompts: h100 with a prompt chunk costing 3.5x as much next to trees as
# next to plain decodes, as traced at real size on one H100
# (benchmarks/results/real_size_diagnosis/after: prompt steps 19.8-37.8 ms over
# a 3-node tree step, 5.3-10.5 ms over a plain one, at 64 requests, T=1).
COST_TABLES = {
    "h100": StepCosts(),
    "h100-prompts": StepCosts(prompt_tree=21.0),
    "h200": StepCosts(weights=4.0, per_row=0.0225, attn_per_req=0.025),
}


def simulate(strength, steps=3000, seed=0, costs=StepCosts(), switch=None):
    """Runs ``steps`` steps; returns the share of steps by budget, the share
    of steps whose drafted trees were not verified, and output tokens per ms
    after the first 300 steps. ``switch``: (step, strength) from which the
    trees accept as at that strength (the traffic changed)."""
    return _simulate(strength, steps, seed, costs, switch)[:3]


def _simulate(strength, steps, seed, costs, switch):
    """:func:`simulate`'s results, and the first step at or after the switch
    that verified trees (None: none did, or no switch)."""
    rng = random.Random(seed)
    clock = _Clock()
    controller = TreeBudgetController(
        LADDER, 15, costs.prior(), clock=clock, log_interval=math.inf
    )
    # As the engine hands estimates over (older controllers: set_curve).
    update_curve = getattr(controller, "update_curve", controller.set_curve)
    accept = {b: strength * e for b, e in ACCEPTANCE.items()}
    n, has_trees, last_ms = 49, True, 0.0
    advice, curves = [None, None], []
    budgets, discarded, tokens, ms = Counter(), 0, 0.0, 0.0
    resumed = None
    for k in range(steps):
        if switch is not None and k == switch[0]:
            accept = {b: switch[1] * e for b, e in ACCEPTANCE.items()}
        n = min(54, max(44, n + rng.choice((-1, 0, 0, 1))))
        prompt = rng.random() < 0.2
        slots = 15 if advice[-2] is None else slots_for_budget(SLOT_LADDER, advice[-2])
        controller.step_started()
        while curves and curves[0][0] <= k:
            update_curve(curves.pop(0)[1])
        b = controller.choose(n, slots, has_trees, timed=not prompt)
        drafted = controller.should_draft(n, 15)
        controller.drafted(drafted)
        advice.append(controller.last_best)
        if drafted:
            noise = rng.uniform(0.75, 1.25)
            curve = tuple(noise * accept[x] for x in LADDER)
            curves.append((k + 2, AcceptanceCurve(n, curve)))
        if switch is not None and resumed is None and k >= switch[0] and b > 0:
            resumed = k
        step_ms = costs.period(n, b, drafted) + (costs.prompt_ms(b) if prompt else 0.0)
        clock.now += 1e-3 * last_ms  # the period measured is the step before's
        last_ms = step_ms
        if k >= 300:
            budgets[b] += 1
            discarded += has_trees and b == 0
            tokens += n * (1 + accept[b])
            ms += step_ms
        has_trees = drafted
    total = sum(budgets.values())
    shares = {b: round(c / total, 2) for b, c in sorted(budgets.items())}
    return shares, round(discarded / total, 2), tokens / ms, resumed


def switch_lag(low, high, at=1500, steps=3000, seed=0, costs=StepCosts()):
    """After ``at`` steps at ``low`` strength (speculation does not pay), the
    trees accept as at ``high``: steps until a step verifies trees again, and
    tokens per ms over the run."""
    _, _, rate, resumed = _simulate(low, steps, seed, costs, (at, high))
    return (None if resumed is None else resumed - at), rate


def steady_rate(strength, b, n=49, costs=StepCosts()) -> float:
    """Tokens per ms of one budget at every step, prompts included."""
    step_ms = costs.period(n, b, b > 0) + 0.2 * costs.prompt_ms(b)
    return n * (1 + strength * ACCEPTANCE[b]) / step_ms


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--strengths", type=float, nargs="+", default=[1.0, 0.35, 0.33, 0.3, 0.25]
    )
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument(
        "--costs",
        choices=sorted(COST_TABLES),
        default="h100",
        help="the step-cost table: h100 (the default, StepCosts); h100-prompts "
        "(prompt chunks 3.5x as costly next to trees, as traced); or h200, "
        "fitted to the real-size record's learned periods at 33-64 requests "
        "(a plain step 5.7 ms, a 3-node step with the drafter 10.2 ms)",
    )
    p.add_argument(
        "--switch",
        type=float,
        nargs=2,
        metavar=("LOW", "HIGH"),
        default=None,
        help="also: LOW strength for 1500 steps, then HIGH (a batch that "
        "stopped speculating meets traffic where it pays): the steps until "
        "trees are verified again, per seed",
    )
    p.add_argument(
        "--probe-backoff",
        type=int,
        default=None,
        help="the controller's _PROBE_BACKOFF (1: a probe every 32 steps, "
        "as before the back-off)",
    )
    args = p.parse_args(argv)
    import vllm.v1.spec_decode.ddtree_cost as dc

    backoff = dc._PROBE_BACKOFF
    if args.probe_backoff is not None:
        dc._PROBE_BACKOFF = args.probe_backoff
    try:
        _report(args)
    finally:
        dc._PROBE_BACKOFF = backoff


def _report(args) -> None:
    costs = COST_TABLES[args.costs]
    print(
        f"costs {args.costs}: at 49 requests a plain step "
        f"{costs.period(49, 0, False):.2f} ms, a 3-node step with the drafter "
        f"{costs.period(49, 3, True):.2f} ms"
    )
    for strength in args.strengths:
        steady = {
            b: round(steady_rate(strength, b, costs=costs), 2) for b in (0, 1, 3, 7)
        }
        print(f"e(3) = {strength * ACCEPTANCE[3]:.2f}; steady tokens/ms {steady}")
        for seed in range(args.seeds):
            shares, discarded, rate = simulate(strength, seed=seed, costs=costs)
            print(
                f"  seed {seed}: budgets {shares}, drafted and not verified "
                f"{discarded:.2f}, {rate:.2f} tokens/ms"
            )
    if args.switch:
        low, high = args.switch
        for seed in range(args.seeds):
            lag, rate = switch_lag(low, high, seed=seed, costs=costs)
            print(
                f"switch {low} -> {high}, seed {seed}: trees verified again "
                f"{lag} steps after the switch, {rate:.2f} tokens/ms over the run"
            )


if __name__ == "__main__":
    main()
