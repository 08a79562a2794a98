# SPDX-License-Identifier: Apache-2.0
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

from dataclasses import dataclass, field

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
    # Positions compared (up to and including the first difference).
    num_compared: int = 0
    num_total: int = 0

    def summary(self) -> str:
        return (
            f"{self.num_identical}/{self.num_requests} requests identical, "
            f"{len(self.ties)} diverged at a tie "
            f"({', '.join(f'r{r}@{p} gap {g:.3f}' for r, p, g in self.ties)}), "
            f"{self.num_compared}/{self.num_total} positions compared"
        )


def _top(position: TopLogprobs) -> dict[int, float]:
    return {int(tok): float(lp) for tok, lp in position}


def compare_greedy(
    got_tokens: list[list[int] | None],
    got_logprobs: list[list[TopLogprobs] | None],
    want_tokens: list[list[int] | None],
    want_logprobs: list[list[TopLogprobs] | None],
    tie_tol: float = TIE_TOL,
) -> Comparison:
    """Compare ``got`` with the reference ``want``, request by request (None
    entries, e.g. aborted requests, must be None in both)."""
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
        if len(got) != len(want):
            result.errors.append(
                f"request {r}: {len(got)} tokens, reference has {len(want)}"
            )
            continue
        diff = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
        if diff is None:
            result.num_identical += 1
            result.num_compared += len(want)
            continue
        result.num_compared += diff + 1
        ref_top = _top(want_logprobs[r][diff])
        got_top = _top(got_logprobs[r][diff])
        g, w = got[diff], want[diff]
        if g not in ref_top or w not in got_top:
            result.errors.append(
                f"request {r}, position {diff}: token {g}, reference {w}, not among "
                f"each other's top {NUM_LOGPROBS} (reference {ref_top}, got {got_top})"
            )
            continue
        gap = ref_top[w] - ref_top[g]
        if gap > tie_tol:
            result.errors.append(
                f"request {r}, position {diff}: token {g}, reference {w} leads it by "
                f"{gap:.3f} nats (> {tie_tol}: not a numerical tie)"
            )
            continue
        result.ties.append((r, diff, gap))
    return result
