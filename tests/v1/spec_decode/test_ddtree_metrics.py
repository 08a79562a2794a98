# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree's spec-decode stats (``vllm/v1/spec_decode/ddtree_metrics.py``): a
tree's accepted path counted per depth, sized by the drafter's depth, not by
``tree_budget`` (CPU). The scheduler's and Prometheus logger's use of them is
checked where they are wired (tests/plugins/test_ddtree_engine_config.py for the
plugin, the overlay's tests/upstream/applied_wiring.py for the series)."""


def test_observe_tree_counts_by_depth():
    from vllm.v1.spec_decode.ddtree_metrics import observe_tree

    stats = None
    # (tree nodes, accepted path length): a full tree, a short tree, a miss.
    for nodes, accepted in [(128, 15), (128, 3), (4, 4), (128, 0)]:
        stats = observe_tree(stats, 15, nodes, accepted)
    assert len(stats.num_accepted_tokens_per_pos) == 15
    assert stats.num_drafts == 4
    assert stats.num_draft_tokens == 128 * 3 + 4
    assert stats.num_accepted_tokens == 22
    assert stats.num_accepted_tokens_per_pos == [3, 3, 3, 2] + [1] * 11
    assert stats.num_draft_tokens_per_pos == [4] * 4 + [3] * 11
    # Impossible counts are clamped (and logged once), never raised: the stats
    # are made inside the scheduler's step.
    for nodes, accepted, counted in [(128, 16, 15), (3, 4, 3), (8, -1, 0)]:
        before = stats.num_accepted_tokens
        stats = observe_tree(stats, 15, nodes, accepted)
        assert stats.num_accepted_tokens - before == counted
    assert stats.num_drafts == 7
