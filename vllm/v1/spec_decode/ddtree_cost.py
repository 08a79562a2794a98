# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How many tree nodes a DDTree step verifies: the host side of the budget.

Each decode step verifies ``N = num_reqs * b`` tree nodes in total, ``b`` from a
ladder of per-request budgets (0 and ``2**k - 1`` up to the request cap
``tree_budget``), and the GPU hands the N nodes to the requests by one
batch-wide ranking (``vllm/v1/spec_decode/ddtree_budget.py``). This module
picks ``b``: the one that maximises expected tokens per second,

    num_reqs * (1 + e(b)) / cost(num_reqs, b),

where ``e(b)`` is the expected number of accepted nodes per request when the
batch verifies ``num_reqs * b`` nodes (summed calibrated acceptance
probabilities of the best nodes, read from the GPU a few steps late) and
``cost`` is the step's period: what one decode step of that shape takes, as
the user sees it (host and GPU together), plus the time per step that prompt
chunks add whatever the budget (a running average of how much longer steps
take than their shape's estimate). Leaving that time out would undervalue
every tree's tokens against its extra verification time, the more so the
more often requests arrive. ``b = 0`` is a plain decode step
that also skips the drafter when the next step is not expected to speculate
either (:meth:`TreeBudgetController.should_draft`).

:class:`StepCostModel` starts from GPU times measured at start-up (the CUDA
graphs of every step shape, replayed once the engine has captured them), which
are lower bounds of a step's period, and learns the real periods from timed
steps. Shapes it has not timed are predicted optimistically, so that any that
could pay gets tried and corrected; none is ruled out by a pessimistic guess.

A step that has trees weighs its budgets without the drafter's forward that
built them (paid whatever it verifies); whether the drafter runs again is
weighed with it (:meth:`TreeBudgetController.should_draft`). The acceptance
estimates are averaged over the last few drafted batches: each arrives a step
or two late and is one batch's, and a choice flipping on one batch's estimate
near break-even alternates plain steps with trees, which serves less than
either.

Everything here is host arithmetic on a few dozen numbers per step: no tensor,
no device sync, no loop over requests.
"""

import itertools
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from vllm.logger import init_logger

logger = init_logger(__name__)

# Observations of a step shape before its own estimate replaces the prior.
_MIN_OBSERVATIONS = 3
# Plain steps (no tree, no drafter) that must follow a step with a tree or
# the drafter, prompt-carrying ones included, before a plain step's period is
# learned: the first periods after trees still carry the trees' work (their
# last verification and drafter forward, queued behind the host), which would
# take plain steps for slower than they are.
_PLAIN_SETTLE_STEPS = 4
# Steps after which the estimate of a plain step (no tree, no drafter), if not
# observed again, is dropped. While a batch drafts, nothing times a plain step,
# so a plain estimate taken too high (plain steps timed just after a run of
# trees, while the trees' work still drains) would keep the batch drafting
# where plain steps serve more. Dropped, plain steps are predicted by their
# start-up time again, tried where that could pay, and re-learned. (A tree
# shape believed too slow is tried again as the acceptance moves, and unseen
# larger ones are bounded by the seen.)
_STALE_STEPS = 256
# A shape's estimate is the median of its last _WINDOW periods: it follows
# changes in context length and host load within tens of steps, and a period
# that is not the step's cost (the engine idle until the next request came, a
# pause of the host) moves it only while such periods are half the window.
_WINDOW = 15
# A period this many times the current estimate is an idle gap, not kept.
_OUTLIER = 4.0
# Nor is a period this long, before a shape has an estimate of its own (two
# idle gaps among its first three periods would hold its median up, and a shape
# believed slow is not chosen again to correct it): no decode step lasts so long.
_IDLE_SECONDS = 0.5
# Steps without drafting before one drafted step re-measures what the drafter
# would gain (the acceptance estimate does not move while nothing is drafted).
_PROBE_INTERVAL = 32
# While probes keep finding that speculation does not pay, each waits twice as
# long as the one before, up to this many times the interval: a probe's drafter
# forward is a plain step's extra work that verifies nothing, so a large batch
# sampling at high temperature would otherwise pay it every 32 steps.
_PROBE_BACKOFF = 8
# How much more tokens per second speculating (or not) must promise before
# should_draft switches to it: each switch costs steps that carry the other
# mode's work (the trees' last verification and drafter forward drain into
# the first plain steps), which no step shape's period includes, so near
# break-even the batch keeps its mode instead of alternating.
_SWITCH_MARGIN = 0.03
# Weight of a newly read acceptance estimate in the running one
# (update_curve): about the last four drafted batches count.
_CURVE_WEIGHT = 0.25
# Weight of one step in the running average of the time steps take beyond
# their shape's estimate (prompt chunks riding along): about the last hundred
# steps count, enough to span the arrivals of several requests.
_EXTRA_WEIGHT = 1 / 64
# Prompt time is averaged apart for steps that verify trees and plain steps: a
# prompt chunk next to trees costs several times what it costs next to plain
# decodes (both leave the FULL graphs, and trees add their verification and
# the drafter over the joined rows). A kind not yet seen is charged nothing,
# as an unseen step shape is optimistic until corrected: a batch that has
# only drafted tries plain steps where they would pay without prompt time, and
# learns theirs. A kind not seen for _STALE_STEPS steps while the other was
# is charged the lesser of the two (once arrivals stop, an average that no
# step renews would keep its prompts' time).
# A step period this many times its shape's estimate is an idle gap, not a
# prompt chunk's time (those reached 5.7x at real size, with trees).
_EXTRA_OUTLIER = 8.0
# A step that carries a prompt chunk is weighed on its own (choose): next to
# trees the chunk costs several times what it costs next to plain decodes, so
# a speculating batch may verify no trees there. What one such step takes
# beyond its shape's estimate is averaged per kind with this weight a step:
# about the last sixteen.
_PROMPT_STEP_WEIGHT = 1 / 16


def budget_ladder(cap: int) -> tuple[int, ...]:
    """Per-request budgets a step may verify: 0, 1, 3, 7, ..., below ``cap``,
    and ``cap``. ``2**k - 1`` nodes verify ``2**k`` tokens per request, which
    fill the tree kernel's query tiles and the GEMMs' row tiles."""
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    ladder = [0]
    b = 1
    while b < cap:
        ladder.append(b)
        b = 2 * b + 1
    ladder.append(cap)
    return tuple(ladder)


def request_bucket(num_reqs: int) -> int:
    """Batch sizes that share a learned step period: exact up to 4, then
    about 1.5x apart (8, 12, 16, 24, 32, 48, ...)."""
    if num_reqs <= 4:
        return max(num_reqs, 1)
    top = 1 << (num_reqs - 1).bit_length()
    return top * 3 // 4 if num_reqs <= top * 3 // 4 else top


def _is_plain(budget: int, drafted: bool | None) -> bool:
    """A plain step: no tree verified, no drafter run after it."""
    return budget == 0 and drafted is False


class _Median:
    """Median of the last ``_WINDOW`` values; ``n`` counts every value."""

    def __init__(self) -> None:
        self.n = 0
        self.value = 0.0
        self._recent: deque[float] = deque(maxlen=_WINDOW)

    def add(self, x: float) -> None:
        self._recent.append(x)
        self.n += 1
        self.value = statistics.median(self._recent)


class _Shape:
    """One step shape's recent periods, and each one over the GPU time (the
    prior) of the batch size it was timed at."""

    def __init__(self, plain: bool = False) -> None:
        self.periods = _Median()
        self.ratios = _Median()
        # A plain step without the drafter: the one shape whose estimate goes
        # stale (_STALE_STEPS); StepCostModel.steps at its last observation.
        self.plain = plain
        self.last_step = 0


class StepCostModel:
    """Step periods by shape: a start-up lower bound corrected by timed steps.

    ``target_seconds`` maps a token count of the target's forward to its GPU
    time (the captured graphs, or eager steps beyond them), ``drafter_seconds``
    a request count to the drafter's (its forward, logits and tree build); both
    are interpolated between the measured points and extrapolated linearly
    past the last one. Their sum is a shape's GPU time with short contexts: a
    lower bound of its period, which adds host work (launches, scheduling,
    sampling) and longer contexts. A shape seen a few times is predicted by
    its GPU time at the batch size asked for times the median of its recent
    periods over the GPU time at theirs: a request bucket spans batch sizes
    whose tree steps differ more than their plain steps do, and its periods'
    plain median would charge a tree step of the bucket's fewest requests
    what one of its most cost. An unseen shape is predicted by the largest of
    its GPU time and the periods of the seen shapes of the same kind with fewer
    nodes (a larger tree never runs faster), but never above the period of a seen
    shape of the same kind with as many nodes per request or more and as many
    requests or more (a start-up time that is not a step's cost, such as a
    replay slowed by whatever its buffers held, would otherwise keep a shape
    from being tried, and an untried shape is never corrected). That bound is
    optimistic, so an unseen shape that could pay is tried, and one whose GPU
    time alone rules it out is not.
    """

    def __init__(
        self,
        target_seconds: Mapping[int, float],
        drafter_seconds: Mapping[int, float],
        graphed_budgets: Sequence[Collection[int]] | None = None,
    ):
        if not target_seconds or not drafter_seconds:
            raise ValueError("the cost model needs measured target and drafter times")
        self._target = sorted(target_seconds.items())
        self._drafter = sorted(drafter_seconds.items())
        # Per number of requests n (the index), the budgets whose decode step
        # of n requests replays one of the target's FULL CUDA graphs (None:
        # not known, no bound). Where a plain step replays one, a tree step
        # that does not runs several times slower than its prior (the graphs'
        # times, extrapolated past the largest) says, and a tree step that
        # stays alone (a probe's) never teaches its period.
        self.graphed_budgets = graphed_budgets
        # (bucket, drafted) -> {budget: recent periods}
        self._shapes: dict[tuple[int, bool], dict[int, _Shape]] = {}
        # The shapes with an estimate of their own, (bucket, drafted, budget,
        # periods): what bounds an unseen shape from above.
        self._estimated: list[tuple[int, bool, int, _Shape]] = []
        # Decode steps so far (tick): how old each shape's estimate is.
        self.steps = 0

    def tick(self) -> None:
        """One more step (whether or not its period is learned)."""
        self.steps += 1

    def _fresh(self, shape: _Shape, stale_ok: bool = False) -> bool:
        return shape.periods.n >= _MIN_OBSERVATIONS and (
            stale_ok or not self._stale(shape)
        )

    def _stale(self, shape: _Shape) -> bool:
        return shape.plain and self.steps - shape.last_step > _STALE_STEPS

    def graphed(self, num_reqs: int, budget: int) -> bool:
        """Whether a decode step of ``num_reqs`` requests verifying ``budget``
        nodes each replays a FULL CUDA graph (True where not known)."""
        table = self.graphed_budgets
        if table is None or not 0 < num_reqs < len(table):
            return True
        return budget in table[num_reqs]

    def estimated(self, num_reqs: int, budget: int, drafted: bool) -> bool:
        """Whether the shape has a current estimate of its own."""
        shape = self._shapes.get((request_bucket(num_reqs), drafted), {}).get(budget)
        return shape is not None and self._fresh(shape)

    def prior(self, num_reqs: int, budget: int, drafted: bool) -> float:
        seconds = _interpolate(self._target, num_reqs * (1 + budget))
        if drafted:
            seconds += self.drafter_prior(num_reqs)
        return seconds

    def drafter_prior(self, num_reqs: int) -> float:
        """The drafter's start-up GPU time for ``num_reqs`` requests: a lower
        bound of what its forward adds to a step."""
        return _interpolate(self._drafter, num_reqs)

    def predict(
        self, num_reqs: int, budget: int, drafted: bool, stale_ok: bool = False
    ) -> float:
        """The shape's period; ``stale_ok``: from its own estimate even where
        that went stale (_STALE_STEPS)."""
        bucket = request_bucket(num_reqs)
        seen = self._shapes.get((bucket, drafted), {})
        own = seen.get(budget)
        if own is not None and self._fresh(own, stale_ok):
            return own.ratios.value * self.prior(num_reqs, budget, drafted)
        bound = self.prior(num_reqs, budget, drafted)
        for b, shape in seen.items():
            if b < budget and self._fresh(shape):
                bound = max(bound, shape.periods.value)
        for other, other_drafted, b, shape in self._estimated:
            if (
                other_drafted == drafted
                and other >= bucket
                and b >= budget
                and self._fresh(shape)
            ):
                bound = min(bound, shape.periods.value)
        return max(bound, 1e-9)

    def observe(
        self, num_reqs: int, budget: int, drafted: bool, seconds: float
    ) -> bool:
        """Learn from one timed step; False if the time was dropped as an
        idle gap."""
        if not seconds > 0:
            return False
        bucket = request_bucket(num_reqs)
        seen = self._shapes.setdefault((bucket, drafted), {})
        shape = seen.get(budget)
        if shape is not None and self._stale(shape):
            # Dropped as stale: learned afresh.
            self._estimated = [e for e in self._estimated if e[3] is not shape]
            shape = None
        if shape is None:
            shape = seen[budget] = _Shape(plain=_is_plain(budget, drafted))
        shape.last_step = self.steps
        periods = shape.periods
        if seconds > _IDLE_SECONDS or (
            periods.n >= _MIN_OBSERVATIONS and seconds > _OUTLIER * periods.value
        ):
            return False
        periods.add(seconds)
        shape.ratios.add(seconds / self.prior(num_reqs, budget, drafted))
        if periods.n == _MIN_OBSERVATIONS:
            self._estimated.append((bucket, drafted, budget, shape))
        return True

    def learned(self, num_reqs: int) -> str:
        """The periods learned for batches of ``num_reqs``'s bucket, for the
        log: ``b=0 2.31 ms (40), b=15+ 5.02 ms (96)`` (``+``: the drafter ran
        too; in parentheses how many periods taught it)."""
        bucket = request_bucket(num_reqs)
        parts = []
        for drafted in (False, True):
            seen = self._shapes.get((bucket, drafted), {})
            for b, shape in sorted(seen.items()):
                avg = shape.periods
                if self._fresh(shape):
                    mark = "+" if drafted else ""
                    parts.append(f"b={b}{mark} {1e3 * avg.value:.2f} ms ({avg.n})")
        return ", ".join(parts) or "none yet"

    def num_observed(self, num_reqs: int, budget: int, drafted: bool) -> int:
        seen = self._shapes.get((request_bucket(num_reqs), drafted), {})
        shape = seen.get(budget)
        return 0 if shape is None else shape.periods.n


def _ms_or_none(seconds: float | None) -> str:
    """``seconds`` for the log: ``1.23 ms``, or ``none yet``."""
    return "none yet" if seconds is None else f"{1e3 * seconds:.2f} ms"


def _interpolate(points: Sequence[tuple[int, float]], x: int) -> float:
    """Piecewise-linear through ``points`` (sorted by x): flat below the first,
    the last segment extended past the last (one point: proportional to x)."""
    x0, y0 = points[0]
    if x <= x0:
        return y0
    if len(points) == 1:
        return y0 * x / x0
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            break
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class AcceptanceCurve:
    """Expected accepted nodes per request at each ladder budget, as read from
    the GPU for one batch: ``per_request[i]`` for ``ladder[i]``."""

    num_reqs: int
    per_request: tuple[float, ...]
    # The calibration's running totals when the curve was read: predicted
    # accepted nodes, observed accepted nodes, verified trees, verified nodes.
    calibration: tuple[float, ...] = ()


def prior_acceptance(budget: int, draft_depth: int) -> float:
    """Accepted nodes per request assumed before any tree was measured: about
    half a token per doubling of the tree, at most the drafter's depth. Used
    for the first steps of an engine only."""
    return min(0.5 * math.log2(1 + budget), float(draft_depth))


@dataclass
class _StepLog:
    steps: int = 0
    drafted: int = 0
    reqs: int = 0
    nodes: int = 0
    by_budget: dict[int, int] = field(default_factory=dict)
    by_bucket: dict[int, int] = field(default_factory=dict)


@dataclass
class _Step:
    num_reqs: int
    budget: int
    timed: bool  # a pure decode step: its period may teach the cost model
    drafted: bool | None = None
    # Trees verified (a probe's too), or a speculating batch's left for a
    # prompt chunk: the kind its period's prompt time is averaged with.
    trees: bool = False

    def shape(self) -> tuple[int, int, bool] | None:
        """What the cost model keys a timed step's period by (None: untimed)."""
        if not self.timed or self.drafted is None:
            return None
        return (request_bucket(self.num_reqs), self.budget, self.drafted)


class _ExtraTime:
    """A running average (``weight`` a sample) of the seconds steps of one kind
    took beyond their shapes' estimates. Without a bias to its start: a kind
    seen in few steps (tree steps among plain ones) is averaged over those.
    ``value``: None until one was seen."""

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self._sum = 0.0
        self._weight = 0.0
        # The cost model's step count at the last observation.
        self.last = 0

    @property
    def value(self) -> float | None:
        return self._sum / self._weight if self._weight else None

    @property
    def seconds(self) -> float:
        """``value``, 0 for a kind not yet seen."""
        return self.value or 0.0

    def observe(self, seconds: float, now: int) -> None:
        keep = 1.0 - self.weight
        self._sum = keep * self._sum + self.weight * seconds
        self._weight = keep * self._weight + self.weight
        self.last = now

    def stale(self, other: "_ExtraTime", now: int) -> bool:
        """Not renewed for _STALE_STEPS steps while ``other`` was."""
        return now - self.last > _STALE_STEPS and now - other.last <= _STALE_STEPS


class TreeBudgetController:
    """Chooses each step's per-request budget and whether the drafter runs.

    Per-step calls, in a step's order: :meth:`step_started` (closes the
    previous step's period), :meth:`choose` (host preparation of the target's
    batch), then at the end of the step :meth:`should_draft`,
    :meth:`drafted` and, when the GPU's estimate for an earlier batch has
    arrived, :meth:`set_curve`.
    """

    def __init__(
        self,
        ladder: Sequence[int],
        draft_depth: int,
        cost: StepCostModel,
        probe_interval: int = _PROBE_INTERVAL,
        clock: Callable[[], float] = time.perf_counter,
        log_interval: float = 10.0,
        learn: bool = True,
    ):
        if list(ladder) != sorted(set(ladder)) or ladder[0] != 0:
            raise ValueError(f"ladder must rise from 0, got {list(ladder)}")
        self.ladder = tuple(ladder)
        self.draft_depth = draft_depth
        self.cost = cost
        self.probe_interval = probe_interval
        self._clock = clock
        self._log_interval = log_interval
        self._curve: AcceptanceCurve | None = None
        self._undrafted_steps = 0
        # Undrafted steps before the next probe (probe_interval, doubled after
        # each probe that did not bring speculation back).
        self._probe_wait = probe_interval
        # Whether should_draft last chose to speculate (probes aside).
        self._speculating = True
        # The budget should_draft found best for its batch: what the
        # scheduler's slots follow (ddtree_slots.py).
        self.last_best = 0
        self._step: _Step | None = None
        # The shape of the step before ``_step`` (None: untimed or none).
        self._last_shape: tuple[int, int, bool] | None = None
        # Plain steps in a row (prompt-carrying ones too) up to ``_step``.
        self._plain_run = 0
        self._step_start = clock()
        self._log = _StepLog()
        self._log_start = self._step_start
        # Timed periods refine the cost model (off where every tensor-parallel
        # rank must choose alike: host clocks differ between them).
        self.learn = learn
        self._logged_totals: tuple[float, ...] = ()
        # Seconds per step beyond the step shapes' estimates (the prompt
        # chunks' time), for plain steps [False] and tree steps [True].
        self._prompt_time = {k: _ExtraTime(_EXTRA_WEIGHT) for k in (False, True)}
        # What one step carrying a prompt chunk took beyond its shape's
        # estimate, plain [False] and verifying trees [True].
        self._prompt_step = {k: _ExtraTime(_PROMPT_STEP_WEIGHT) for k in (False, True)}
        # Share of a speculating batch's steps whose trees were left for a
        # prompt chunk (they serve one token a request): a running average.
        self._left_share = 0.0
        # Whether the last step was a speculating batch's.
        self._last_kind = False
        # The step before ``_step`` (its work shows in ``_step``'s period).
        self._prev_step: _Step | None = None

    # -- acceptance -----------------------------------------------------------

    def set_curve(self, curve: AcceptanceCurve) -> None:
        if len(curve.per_request) != len(self.ladder):
            raise ValueError(
                f"curve of {len(curve.per_request)} values for a ladder of "
                f"{len(self.ladder)}"
            )
        self._curve = curve

    def update_curve(self, curve: AcceptanceCurve) -> None:
        """A newly read estimate, blended into the running one (its weight
        ``_CURVE_WEIGHT``); the calibration totals are the newest."""
        old = self._curve
        if old is not None and len(old.per_request) == len(curve.per_request):
            blended = tuple(
                a + _CURVE_WEIGHT * (b - a)
                for a, b in zip(old.per_request, curve.per_request)
            )
            curve = AcceptanceCurve(curve.num_reqs, blended, curve.calibration)
        self.set_curve(curve)

    def expected_accepted(self, budget: int) -> float:
        """Accepted nodes per request at ``budget`` (a ladder value)."""
        if budget == 0:
            return 0.0
        if self._curve is None:
            return prior_acceptance(budget, self.draft_depth)
        return self._curve.per_request[self.ladder.index(budget)]

    # -- decisions ------------------------------------------------------------

    def best_budget(
        self,
        num_reqs: int,
        max_budget: int,
        drafted: bool = False,
        plain_weight: float = 1.0,
    ) -> int:
        """The ladder budget <= ``max_budget`` with the most expected tokens per
        second for ``num_reqs`` requests (ties: the smaller budget), of those
        whose decode step replays a FULL CUDA graph where a plain step does
        (:meth:`StepCostModel.graphed`), every
        step charged its kind's prompt time too (:meth:`prompt_seconds`); a
        plain step's rate counts ``plain_weight`` times (should_draft's
        switching margin).

        ``drafted``: the trees exist already, so the drafter's forward that
        built them is paid whichever budget is verified; it is left out of
        every tree step's cost (at most its start-up time, so that a tree step
        is charged at least its own verification). Otherwise a tree step costs
        its drafter too: the steady choice between speculating and not."""
        return self._best(num_reqs, max_budget, drafted, plain_weight)[0]

    def _best(
        self, num_reqs: int, max_budget: int, drafted: bool, plain_weight: float
    ) -> tuple[int, float]:
        """best_budget's choice and its rate (tokens per request per second).
        Steady (not ``drafted``), a speculating batch's steps whose trees were
        left for a prompt chunk serve one token a request."""
        # A stale plain estimate is retaken by not drafting (should_draft),
        # never by throwing away trees already drafted.
        plain = self.cost.predict(num_reqs, 0, False, stale_ok=drafted)
        paid = self.cost.drafter_prior(num_reqs) if drafted else 0.0
        extra = max(self.prompt_seconds(trees=True), 0.0)
        kept = 1.0 if drafted else 1.0 - self._left_share
        # Where a plain step replays a FULL graph, tree steps that do not are
        # left out (StepCostModel.graphed).
        graphed_plain = self.cost.graphed(num_reqs, 0)
        best = 0
        best_rate = plain_weight / (plain + max(self.prompt_seconds(trees=False), 0.0))
        for b in self.ladder[1:]:
            if b > max_budget:
                break
            if graphed_plain and not self.cost.graphed(num_reqs, b):
                continue
            seconds = max(plain, self.cost.predict(num_reqs, b, True) - paid)
            rate = (1.0 + kept * self.expected_accepted(b)) / (seconds + extra)
            if rate > best_rate:
                best, best_rate = b, rate
        return best, best_rate

    def prompt_step_seconds(self, trees: bool) -> float | None:
        """What one step carrying a prompt chunk took beyond its shape's
        estimate, verifying trees or plain (None: not yet timed)."""
        return self._prompt_step[trees].value

    def prompt_step_budget(self, num_reqs: int, budget: int) -> int | None:
        """At most ``budget``: what a step that carries a prompt chunk
        verifies of trees already drafted, or None before such a step with
        trees was timed.

        A step is weighed by what it takes from the others: the nodes a
        budget is expected to accept against what its extra time (the
        target's over a plain step's, and the prompt chunk's next to trees
        over next to plain decodes) would serve at the batch's steady rate."""
        if self.cost.steps - self._prompt_step[True].last > _STALE_STEPS:
            # Once prompt steps leave their trees nothing renews what such a
            # step costs with them: learned afresh, as a stale plain shape.
            self._prompt_step[True] = _ExtraTime(_PROMPT_STEP_WEIGHT)
        tree_extra = self._prompt_step[True].value
        if tree_extra is None:
            return None
        # Until a plain one was timed, the trees are charged all of theirs.
        plain_extra = self._prompt_step[False].seconds
        _, rate = self._best(num_reqs, budget, drafted=False, plain_weight=1.0)
        plain = self.cost.predict(num_reqs, 0, False, stale_ok=True)
        paid = self.cost.drafter_prior(num_reqs)
        best, best_gain = 0, 0.0
        for b in self.ladder[1:]:
            if b > budget:
                break
            seconds = max(plain, self.cost.predict(num_reqs, b, True) - paid)
            more = seconds - plain + max(tree_extra - plain_extra, 0.0)
            gain = self.expected_accepted(b) - rate * more
            if gain > best_gain:
                best, best_gain = b, gain
        return best

    def prompt_seconds(self, trees: bool) -> float:
        """Seconds a step verifying trees (or a plain step) takes on average
        beyond its shape's estimate: the prompt chunks' time (0 for a kind not
        yet seen; the lesser of the two kinds' for one gone stale)."""
        own, other = self._prompt_time[trees], self._prompt_time[not trees]
        if own.stale(other, self.cost.steps):
            return min(own.seconds, other.seconds)
        return own.seconds

    def choose(
        self, num_reqs: int, max_budget: int, has_trees: bool, timed: bool
    ) -> int:
        """This step's per-request budget (0 without trees to verify).
        ``timed``: a pure decode step, whose period may teach the cost model.
        The trees' drafter is paid: verifying them pays unless the target's
        extra work outweighs what they are expected to accept (a tree thrown
        away here wasted the drafter's forward). On a step that carries a
        prompt chunk a probe's trees are not verified, and a speculating
        batch's as :meth:`prompt_step_budget` weighs them."""
        # A probe's trees (the batch is not speculating) ride on a step that
        # carries a prompt chunk unverified: next to trees a prompt chunk costs
        # several times what it costs next to plain decodes, which a plain
        # batch's prompt time does not include, and the estimate the probe is
        # for came with its drafting.
        verify = has_trees and (timed or self._speculating)
        b = self.best_budget(num_reqs, max_budget, drafted=True) if verify else 0
        left = False
        if b and not timed:
            weighed = self.prompt_step_budget(num_reqs, b)
            if weighed is not None:
                b, left = weighed, weighed == 0
        if verify and self._speculating:
            keep = 1.0 - _EXTRA_WEIGHT
            self._left_share = keep * self._left_share + _EXTRA_WEIGHT * left
        self._step = _Step(num_reqs, b, timed, trees=b > 0 or left)
        log = self._log
        log.steps += 1
        log.reqs += num_reqs
        log.nodes += num_reqs * b
        log.by_budget[b] = log.by_budget.get(b, 0) + 1
        bucket = request_bucket(num_reqs)
        log.by_bucket[bucket] = log.by_bucket.get(bucket, 0) + 1
        return b

    def should_draft(self, num_reqs: int, max_budget: int) -> bool:
        """At the end of a step: whether the drafter runs for the next one.
        False while speculation would not pay, except for probes, which
        refresh the acceptance estimate (none where the scheduler gives no
        draft slots): the first ``probe_interval`` steps after the batch
        stopped speculating, each later one twice as many steps after the one
        before, up to ``_PROBE_BACKOFF`` times the interval (back to the
        interval after an idle gap). Switching between
        speculating and not takes a margin (_SWITCH_MARGIN)."""
        margin = 1.0 + _SWITCH_MARGIN
        weight = 1.0 / margin if self._speculating else margin
        self.last_best = (
            self.best_budget(num_reqs, max_budget, plain_weight=weight)
            if max_budget
            else 0
        )
        if max_budget == 0:
            return False
        self._speculating = self.last_best > 0
        if self.last_best > 0:
            self._undrafted_steps = 0
            self._probe_wait = self.probe_interval
            return True
        self._undrafted_steps += 1
        if self._undrafted_steps >= self._probe_wait:
            self._undrafted_steps = 0
            self._probe_wait = min(
                2 * self._probe_wait, _PROBE_BACKOFF * self.probe_interval
            )
            return True
        return False

    def drafted(self, did: bool) -> None:
        """Whether the drafter ran at the end of the current step."""
        if self._step is not None:
            self._step.drafted = did
            self._log.drafted += did

    # -- timing ---------------------------------------------------------------

    def step_started(self) -> None:
        """A step's host preparation starts: the previous step's period ends.

        With async scheduling the engine core launches a step while the GPU
        runs the one before, and waits for that one's output before it
        schedules the next: the period between two step starts mixes the work
        of two consecutive steps. So it is learned only when both had the
        same shape."""
        now = self._clock()
        step = self._step
        shape = step.shape() if step is not None else None
        seconds = now - self._step_start
        plain = step is not None and _is_plain(step.budget, step.drafted)
        self._plain_run = self._plain_run + 1 if plain else 0
        if (
            self.learn
            and shape is not None
            and shape == self._last_shape
            and (not plain or self._plain_run > _PLAIN_SETTLE_STEPS)
        ):
            self.cost.observe(step.num_reqs, step.budget, step.drafted, seconds)
        kind = step is not None and step.trees
        if (
            self.learn
            and step is not None
            and step.drafted is not None
            and kind == self._last_kind
        ):
            # Between steps of one kind only: the period mixes two steps' work.
            self._observe_extra(step, kind, seconds)
        prev = self._prev_step
        if self.learn and step is not None and prev is not None and not prev.timed:
            self._observe_prompt_step(prev, seconds)
        self._prev_step = step
        self._last_kind = kind
        if step is not None:
            self.cost.tick()
        if self.learn and seconds > _IDLE_SECONDS:
            # New traffic after an idle engine: probes start over (not with
            # tensor parallelism, where no rank's clock may steer a choice).
            self._probe_wait = self.probe_interval
        self._last_shape = shape
        self._step = None
        self._step_start = now
        self._maybe_log(now)

    def _observe_prompt_step(self, step: _Step, seconds: float) -> None:
        """What ``step``, which carried a prompt chunk, took beyond its
        shape's estimate as a pure decode step: with async scheduling its
        work shows in the period of the step after it, ``seconds``. Idle gaps
        and periods past _EXTRA_OUTLIER times the estimate are left out."""
        if step.drafted is None or seconds > _IDLE_SECONDS:
            return
        n, b, drafted = step.num_reqs, step.budget, step.drafted
        if b == 0 and drafted and not self.cost.estimated(n, 0, True):
            # Trees left for the chunk (a shape no pure decode step has): a
            # plain step and the drafter, not the start-up prior of the shape.
            expected = self.cost.predict(n, 0, False, stale_ok=True)
            expected += self.cost.drafter_prior(n)
        else:
            expected = self.cost.predict(n, b, drafted)
        if seconds > _EXTRA_OUTLIER * expected:
            return
        self._prompt_step[b > 0].observe(seconds - expected, self.cost.steps)

    def _observe_extra(self, step: _Step, trees: bool, seconds: float) -> None:
        """Running average, per kind of step (trees verified or not), of how
        much longer a step took than its shape's estimate as a pure decode
        step: the prompt chunks' time (with async scheduling it shows in the
        period of the step after theirs, which is why every step after one of
        its kind counts, not only those that carried a chunk). Steps of a
        shape without an estimate of its own (optimistic until corrected) and
        idle gaps are left out."""
        if seconds > _IDLE_SECONDS or not self.cost.estimated(
            step.num_reqs, step.budget, step.drafted
        ):
            return
        expected = self.cost.predict(step.num_reqs, step.budget, step.drafted)
        if seconds > _EXTRA_OUTLIER * expected:
            return
        self._prompt_time[trees].observe(seconds - expected, self.cost.steps)

    # -- logging --------------------------------------------------------------

    def _maybe_log(self, now: float) -> None:
        if now - self._log_start < self._log_interval or self._log.steps == 0:
            return
        log = self._log
        shares = ", ".join(
            f"{b}: {100 * n / log.steps:.0f}%" for b, n in sorted(log.by_budget.items())
        )
        # The batch size most steps had, with what the cost model believes of
        # its step shapes: what a budget chosen there was weighed against.
        common = max(log.by_bucket, key=log.by_bucket.__getitem__)
        logger.info(
            "DDTree: budget over %.0f s: %d decode steps, %.1f requests and %.1f "
            "tree nodes per step, drafter ran in %.0f%% of steps; nodes per "
            "request (share of steps) %s%s; step periods learned for batches "
            "of up to %d: %s; steps took %.2f ms (plain) and %.2f ms (trees) "
            "more than those periods (prompt chunks), a step with a prompt chunk "
            "%s (plain) and %s (trees) more",
            now - self._log_start,
            log.steps,
            log.reqs / log.steps,
            log.nodes / log.steps,
            100 * log.drafted / log.steps,
            shares,
            self._calibration_report(),
            common,
            self.cost.learned(common),
            1e3 * self.prompt_seconds(trees=False),
            1e3 * self.prompt_seconds(trees=True),
            _ms_or_none(self.prompt_step_seconds(False)),
            _ms_or_none(self.prompt_step_seconds(True)),
        )
        self._log = _StepLog()
        self._log_start = now

    def _calibration_report(self) -> str:
        """Predicted vs observed accepted nodes since the last report."""
        totals = self._curve.calibration if self._curve is not None else ()
        last, self._logged_totals = self._logged_totals, totals
        if len(totals) < 4:
            return ""
        if len(last) < 4:
            last = (0.0,) * 4
        predicted, observed, trees, nodes = (t - u for t, u in zip(totals, last))
        if trees <= 0:
            return ""
        return (
            f"; verified {nodes / trees:.1f} nodes per tree, accepted "
            f"{observed / trees:.2f} per tree, predicted {predicted / trees:.2f} "
            f"({100 * (predicted - observed) / max(observed, 1e-9):+.1f}%)"
        )
