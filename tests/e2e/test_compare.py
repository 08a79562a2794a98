# SPDX-License-Identifier: Apache-2.0
"""The end-to-end tests' greedy comparison (CPU): ties pass, real differences fail."""

from tests.e2e.compare import compare_greedy


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
    cmp = compare_greedy(got, [_lps({6: -0.5, 8: -0.6})], want,
                         [_lps({5: -0.5, 6: -0.55})])
    assert len(cmp.errors) == 1 and "top" in cmp.errors[0]


def test_lengths_and_aborted_requests():
    lps = [_lps({1: 0}), None]
    cmp = compare_greedy([[1], None], lps, [[1], None], lps)
    assert not cmp.errors and cmp.num_requests == 1
    assert compare_greedy([[1], [2]], lps, [[1], None], lps).errors
    assert compare_greedy([[1, 1]], [_lps({1: 0}, {1: 0})], [[1]], lps).errors
    assert compare_greedy([[1]], lps, [[1], [2]], lps).errors
