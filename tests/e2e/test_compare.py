# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The end-to-end tests' greedy comparison (CPU): ties pass, real differences fail."""

import random

from tests.e2e.compare import chi_square_two_sample, compare_greedy, compare_seeded


def _lps(*positions):
    """Top logprobs per position from ``{token: logprob}`` dicts."""
    return [[[t, lp] for t, lp in pos.items()] for pos in positions]


def test_identical_requests():
    tokens = [[1, 2, 3], [4, 5]]
    lps = [_lps({1: -0.1}, {2: -0.1}, {3: -0.1}), _lps({4: -0.1}, {5: -0.1})]
    cmp = compare_greedy(tokens, lps, tokens, lps)
    assert not cmp.errors and not cmp.ties
    assert cmp.num_identical == cmp.num_requests == 2
    assert cmp.num_compared == cmp.num_total == 5


def test_tie_is_accepted_and_stops_the_comparison():
    want = [[1, 2, 3, 4]]
    got = [[1, 7, 9, 9]]  # after the tie everything may differ
    want_lps = [_lps({1: 0}, {2: -0.70, 7: -0.72}, {3: 0}, {4: 0})]
    got_lps = [_lps({1: 0}, {7: -0.69, 2: -0.70}, {9: 0}, {9: 0})]
    cmp = compare_greedy(got, got_lps, want, want_lps)
    assert not cmp.errors
    assert cmp.ties == [(0, 1, cmp.ties[0][2])]
    assert abs(cmp.ties[0][2] - 0.02) < 1e-9
    assert cmp.num_compared == 2 and cmp.num_identical == 0


def test_clear_margin_difference_fails():
    want, got = [[1, 2]], [[1, 7]]
    want_lps = [_lps({1: 0}, {2: -0.1, 7: -2.5})]
    got_lps = [_lps({1: 0}, {7: -0.1, 2: -2.0})]
    cmp = compare_greedy(got, got_lps, want, want_lps)
    assert len(cmp.errors) == 1 and "not a numerical tie" in cmp.errors[0]


def test_token_outside_the_other_top_fails():
    want, got = [[5]], [[6]]
    cmp = compare_greedy(
        got, [_lps({6: -0.5, 8: -0.6})], want, [_lps({5: -0.5, 6: -0.55})]
    )
    assert len(cmp.errors) == 1 and "top" in cmp.errors[0]


def test_lengths_and_aborted_requests():
    lps = [_lps({1: 0}), None]
    cmp = compare_greedy([[1], None], lps, [[1], None], lps)
    assert not cmp.errors and cmp.num_requests == 1
    assert compare_greedy([[1], [2]], lps, [[1], None], lps).errors
    assert compare_greedy([[1, 1]], [_lps({1: 0}, {1: 0})], [[1]], lps).errors
    # After a tie, the two may stop at different lengths.
    cmp = compare_greedy(
        [[1, 7]],
        [_lps({1: 0}, {7: -0.69, 2: -0.70})],
        [[1, 2, 3]],
        [_lps({1: 0}, {2: -0.70, 7: -0.72}, {3: 0})],
    )
    assert not cmp.errors and len(cmp.ties) == 1 and cmp.num_total == 3
    assert compare_greedy([[1]], lps, [[1], [2]], lps).errors


def test_seeded_tie_needs_the_gap_to_move():
    want, got = [[1, 2, 3]], [[1, 7, 9]]
    # The reference preferred 2 by 0.03 nats more than the other engine did.
    want_lps = [_lps({1: 0}, {2: -1.00, 7: -1.50}, {3: 0})]
    got_lps = [_lps({1: 0}, {7: -1.48, 2: -1.01}, {9: 0})]
    cmp = compare_seeded(got, got_lps, want, want_lps)
    assert not cmp.errors and len(cmp.ties) == 1
    assert abs(cmp.ties[0][2] - 0.03) < 1e-9 and cmp.num_compared == 2


def test_seeded_difference_without_a_moved_gap_fails():
    want, got = [[2]], [[7]]
    # Same logits in both engines: the same noise must give the same token.
    lps = [_lps({2: -1.0, 7: -1.5})]
    cmp = compare_seeded(got, lps, want, lps)
    assert len(cmp.errors) == 1 and "not explained" in cmp.errors[0]
    assert not cmp.ties
    # The gap moved the wrong way: the other engine favoured b more.
    got_lps = [_lps({2: -0.9, 7: -1.6})]
    cmp = compare_seeded(got, got_lps, want, lps)
    assert len(cmp.errors) == 1 and "not explained" in cmp.errors[0]
    # A token missing from the logprobs cannot be checked.
    cmp = compare_seeded(got, [_lps({7: -1.0})], want, lps)
    assert len(cmp.errors) == 1 and "missing" in cmp.errors[0]
    # ... unless the caller counts such positions (and bounds them).
    cmp = compare_seeded(got, [_lps({7: -1.0})], want, lps, allow_unchecked=True)
    assert not cmp.errors and not cmp.ties and len(cmp.unchecked) == 1
    assert cmp.num_compared == 1
    # A judgeable wrong difference is still an error.
    cmp = compare_seeded(got, lps, want, lps, allow_unchecked=True)
    assert len(cmp.errors) == 1 and not cmp.unchecked


def test_chi_square_two_sample():
    """Same law: p-values are not small; a shifted law at the engine test's
    sample size: tiny p-values. Rare categories are pooled."""
    rng = random.Random(0)
    law = [0.4, 0.2, 0.15, 0.1, 0.08, 0.04, 0.02, 0.01]
    shifted = [0.55, 0.15, 0.1, 0.08, 0.06, 0.03, 0.02, 0.01]

    def draw(weights, n):
        return rng.choices(range(len(weights)), weights, k=n)

    pvalues = [
        chi_square_two_sample(draw(law, 1200), draw(law, 1200))[2] for _ in range(20)
    ]
    assert min(pvalues) > 1e-3 and sum(p > 0.5 for p in pvalues) >= 5
    stat, dof, p = chi_square_two_sample(draw(shifted, 1200), draw(law, 1200))
    assert dof == 7 and p < 1e-4
    # A category seen twice in all is pooled with the other rare ones.
    _, dof, _ = chi_square_two_sample([0] * 100 + [9, 9], [0] * 100 + [1] * 50)
    assert dof == 2
