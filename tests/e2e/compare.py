# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Greedy outputs of two engines, compared token for token up to numerical ties.

Two engines that run different attention kernels (TREE_ATTN and FlashAttention
here), or the same kernels on differently shaped batches (vLLM's own DFlash
against no speculation), do not produce bitwise equal logits: half-precision
logits of magnitude ~4 are quantized in steps of 2^-8 (float16) or 2^-5
(bfloat16), so two tokens whose logits round to the same or neighbouring values
can swap places. On the H200 with bfloat16 tiny models, every first difference
between DDTree and no speculation was such a swap: reference gaps of 0 to 3 bf16
steps (0-0.094 nats), and vLLM's DFlash parted from no speculation the same way.
vLLM's own backend comparisons
(``check_logprobs_close`` in vLLM's test utilities) accept such a swap when each
engine's token is among the other's top logprobs, and stop comparing that
sequence there, since everything after it legitimately differs.

:func:`compare_greedy` applies the same rule with a bound on the gap: at the first
differing position the reference must rate the other engine's token within
``tie_tol`` nats of its own choice. A token with a clear margin that differs is a
bug, and fails.
"""

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# Top logprobs per position both engines return (SamplingParams(logprobs=...));
# more than 2, since three tokens can tie.
NUM_LOGPROBS = 5
# Largest reference logprob gap accepted as a numerical tie, in nats: a dozen
# float16 steps (three bfloat16 steps) at the tiny test models' logit magnitudes.
# A random model's top-2 gap is larger than this at ~88 % of positions, so a
# wrong token caused by a bug is very unlikely to pass as a tie.
TIE_TOL = 0.1

# One position's top logprobs: [[token_id, logprob], ...].
TopLogprobs = list[list[float]]


@dataclass
class Comparison:
    """Result of :func:`compare_greedy` over a batch of requests."""

    num_requests: int = 0
    num_identical: int = 0
    # Requests whose tokens differ first at a numerical tie:
    # (request, position, reference logprob gap).
    ties: list[tuple[int, int, float]] = field(default_factory=list)
    # Differences that are not ties, as messages.
    errors: list[str] = field(default_factory=list)
    # Differences that cannot be judged (compare_seeded with allow_unchecked):
    # a token missing from the other engine's returned logprobs, as messages.
    unchecked: list[str] = field(default_factory=list)
    # Positions compared (up to and including the first difference).
    num_compared: int = 0
    num_total: int = 0

    def summary(self) -> str:
        return (
            f"{self.num_identical}/{self.num_requests} requests identical, "
            f"{len(self.ties)} diverged at a tie "
            f"({', '.join(f'r{r}@{p} gap {g:.3f}' for r, p, g in self.ties[:20])}"
            f"{', ...' if len(self.ties) > 20 else ''}), "
            f"{len(self.unchecked)} could not be judged, "
            f"{self.num_compared}/{self.num_total} positions compared"
        )


def _top(position: TopLogprobs) -> dict[int, float]:
    return {int(tok): float(lp) for tok, lp in position}


# Judges the first differing position of one request: (request, position, got
# token, reference token, got's top logprobs, reference's) -> (error, tie value),
# at most one of them set; neither: the position cannot be judged.
Judge = Callable[[int, int, int, int, dict, dict], tuple[str | None, float | None]]


def _compare(
    got_tokens, got_logprobs, want_tokens, want_logprobs, judge: Judge
) -> Comparison:
    """Request by request (None entries, e.g. aborted requests, must be None in
    both): identical, or parted at a position ``judge`` accepts as a tie."""
    result = Comparison()
    if len(got_tokens) != len(want_tokens):
        result.errors.append(
            f"{len(got_tokens)} requests, reference has {len(want_tokens)}"
        )
        return result
    for r, (got, want) in enumerate(zip(got_tokens, want_tokens)):
        if got is None or want is None:
            if (got is None) != (want is None):
                result.errors.append(f"request {r}: only one of the two is None")
            continue
        result.num_requests += 1
        result.num_total += len(want)
        diff = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
        if diff is None:
            if len(got) != len(want):
                # Same tokens, one stopped earlier: never a tie.
                result.errors.append(
                    f"request {r}: {len(got)} tokens, reference has {len(want)}"
                )
                continue
            result.num_identical += 1
            result.num_compared += len(want)
            continue
        # After a tie the two may stop at different lengths (a stop token).
        result.num_compared += diff + 1
        error, tie = judge(
            r,
            diff,
            got[diff],
            want[diff],
            _top(got_logprobs[r][diff]),
            _top(want_logprobs[r][diff]),
        )
        if error is not None:
            result.errors.append(error)
        elif tie is not None:
            result.ties.append((r, diff, tie))
        else:
            result.unchecked.append(
                f"request {r}, position {diff}: token "
                f"{got[diff]}, reference {want[diff]}"
            )
    return result


def compare_greedy(
    got_tokens: list[list[int] | None],
    got_logprobs: list[list[TopLogprobs] | None],
    want_tokens: list[list[int] | None],
    want_logprobs: list[list[TopLogprobs] | None],
    tie_tol: float = TIE_TOL,
) -> Comparison:
    """Compare greedy ``got`` with the reference ``want`` (module docstring)."""

    def judge(r, diff, g, w, got_top, ref_top):
        if g not in ref_top or w not in got_top:
            return (
                f"request {r}, position {diff}: token {g}, reference {w}, not among "
                f"each other's top {NUM_LOGPROBS} (reference {ref_top}, got "
                f"{got_top})",
                None,
            )
        gap = ref_top[w] - ref_top[g]
        if gap > tie_tol:
            return (
                f"request {r}, position {diff}: token {g}, reference {w} leads it "
                f"by {gap:.3f} nats (> {tie_tol}: not a numerical tie)",
                None,
            )
        return None, gap

    return _compare(got_tokens, got_logprobs, want_tokens, want_logprobs, judge)


def compare_seeded(
    got_tokens: list[list[int] | None],
    got_logprobs: list[list[TopLogprobs] | None],
    want_tokens: list[list[int] | None],
    want_logprobs: list[list[TopLogprobs] | None],
    tie_tol: float = TIE_TOL,
    allow_unchecked: bool = False,
) -> Comparison:
    """Compare seeded samples (temperature 1, no top-k/top-p) of two engines
    that draw the same Gumbel noise per (seed, position), as MRv2's sampler and
    the tree walk do.

    With equal noise g, engine A picks a over b only if l_a + g_a >= l_b + g_b
    under its logits, and engine B picks b only if the opposite holds under its
    own. Adding the two: ``delta = (want_b - want_a) - (got_b - got_a) >= 0``,
    in logprobs (log-softmax keeps logit differences). So at the first
    differing position the logit gap of the two tokens must have moved between
    the engines, by a numerical amount: ``0 < delta <= tie_tol`` (equal gaps
    and equal noise give equal tokens). Different noise, or a verifier that does
    not sample each node from the target, parts the outputs at positions where
    the gap did not move: ``delta`` near 0 with either sign, and early. The
    sampled token is always in vLLM's returned logprobs; the other engine's
    token must be among them too (ask for enough logprobs), else the position
    cannot be checked: an error, or with ``allow_unchecked`` a count in
    ``unchecked`` that the caller bounds (a sampled token can be far down the
    distribution, where two engines' perturbed scores can still be near-equal).
    """

    def judge(r, diff, a, b, got_top, ref_top):
        if not {a, b} <= got_top.keys() or not {a, b} <= ref_top.keys():
            if allow_unchecked:
                return None, None
            return (
                f"request {r}, position {diff}: token {a}, reference {b}; one of "
                "them is missing from the returned logprobs, cannot check",
                None,
            )
        delta = (ref_top[b] - ref_top[a]) - (got_top[b] - got_top[a])
        if not 0 < delta <= tie_tol:
            return (
                f"request {r}, position {diff}: token {a}, reference {b}, their "
                f"logit gap moved by {delta:.4f} between the engines (a tie needs "
                f"0 < delta <= {tie_tol}): not explained by numerics",
                None,
            )
        return None, delta

    return _compare(got_tokens, got_logprobs, want_tokens, want_logprobs, judge)


def chi_square_two_sample(a: list, b: list, min_expected: float = 5.0):
    """Two-sample chi-square homogeneity test on categorical samples; rare
    categories (expected count < min_expected in either sample) are pooled.
    Returns (statistic, degrees of freedom, p-value)."""
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    cells, other = [], [0, 0]
    for key in set(ca) | set(cb):
        xa, xb = ca.get(key, 0), cb.get(key, 0)
        total = xa + xb
        if min(total * na, total * nb) / (na + nb) < min_expected:
            other[0] += xa
            other[1] += xb
        else:
            cells.append((xa, xb))
    if sum(other):
        cells.append(tuple(other))
    stat = 0.0
    for xa, xb in cells:
        total = xa + xb
        for x, n in ((xa, na), (xb, nb)):
            expected = total * n / (na + nb)
            stat += (x - expected) ** 2 / expected
    dof = len(cells) - 1
    p = float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64),
            torch.tensor(stat / 2, dtype=torch.float64),
        )
    )
    return stat, dof, p
