# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plugin's spec-decode stats on stock vLLM 0.26 (``vllm_ddtree/spec_stats.py``):
a tree's accepted path counted per depth, in stats sized by the same
``num_draft_positions`` as the series' ``SpeculativeConfig`` property (CPU).
The scheduler and Prometheus logger wired through them are checked in
test_ddtree_engine_config.py."""

import types

from vllm.v1.spec_decode.ddtree_config import DDTreeConfig
from vllm_ddtree import glue
from vllm_ddtree.spec_stats import (
    make_tree_spec_decoding_stats,
    observe_tree,
    positions_sized,
)


def test_observe_tree_counts_by_depth():
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


def test_counters_count_the_step_budget():
    """The scheduler's counters: the reported budget's nodes per request, or
    the accepted path where the split gave a request more (never an accepted
    token lost, never more than the slots)."""
    sched = types.SimpleNamespace(log_stats=True, _ddtree_step_budget=3)
    # (slots, accepted) -> draft tokens counted
    cases = {(15, 2): 3, (15, 7): 7, (2, 2): 2, (15, 0): 3}
    stats = None
    for (slots, accepted), want in cases.items():
        before = 0 if stats is None else stats.num_draft_tokens
        stats = make_tree_spec_decoding_stats(
            sched, 15, stats, slots, accepted, None, "r"
        )
        assert stats.num_draft_tokens - before == want, (slots, accepted)
    assert stats.num_accepted_tokens == 11 and stats.num_drafts == 4
    # A plain step (budget 0) verified no tree: nothing counted, and the
    # step's stats so far are kept.
    sched._ddtree_step_budget = 0
    assert make_tree_spec_decoding_stats(sched, 15, None, 15, 0, None, "r") is None
    assert make_tree_spec_decoding_stats(sched, 15, stats, 15, 0, None, "r") is stats
    # No report: the slots, as before.
    sched._ddtree_step_budget = None
    stats = make_tree_spec_decoding_stats(sched, 15, None, 15, 2, None, "r")
    assert stats.num_draft_tokens == 15


def test_positions_are_the_series_function():
    """The plugin sizes its stats by ddtree_config.num_draft_positions, as
    SpeculativeConfig.num_draft_positions does in the series: the drafter's
    depth, whatever the DFlash config's draft slots."""
    for budget, depth in [(128, 15), (4, 15), (1024, 7), (1, 1)]:
        vllm_config = types.SimpleNamespace(
            speculative_config=types.SimpleNamespace(
                method="dflash", num_speculative_tokens=budget
            )
        )
        assert glue._num_draft_positions(vllm_config, DDTreeConfig(budget, depth)) == (
            depth
        )


def test_positions_sized_copy_leaves_the_config():
    spec = types.SimpleNamespace(method="dflash", num_speculative_tokens=128)
    sized = positions_sized(spec, 15)
    assert (sized.num_speculative_tokens, spec.num_speculative_tokens) == (15, 128)
