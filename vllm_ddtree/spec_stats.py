# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree's spec-decode stats on stock vLLM 0.26 (the plugin's side).

vLLM counts acceptance per draft position and sizes that vector by
``num_speculative_tokens``, which for DDTree is ``tree_budget`` (up to 1024 tree
nodes). Where vLLM has method "ddtree" (the upstream series),
``SpecDecodingStats.new`` and ``SpecDecodingProm`` are sized by
``SpeculativeConfig.num_draft_positions`` and ``observe_draft`` counts
positions up to that size. Stock vLLM has neither, so the plugin sizes the
stats by the same :func:`~vllm.v1.spec_decode.ddtree_config.num_draft_positions`
and counts a tree here: position ``i`` counts trees whose accepted path reached
depth ``i + 1``, directly comparable with a DFlash chain's position ``i``. The
scalar counters keep vLLM's meaning: one draft per verified tree, draft tokens
= tree nodes, accepted tokens = nodes on the accepted path, so the mean
acceptance length (1 + accepted / drafts) is tokens per step.
"""

import copy

from vllm.config import SpeculativeConfig
from vllm.logger import init_logger
from vllm.v1.spec_decode.ddtree_metrics import verified_draft_tokens
from vllm.v1.spec_decode.metrics import SpecDecodingStats

logger = init_logger(__name__)


def observe_tree(
    stats: SpecDecodingStats | None,
    num_positions: int,
    num_nodes: int,
    num_accepted: int,
) -> SpecDecodingStats:
    """Add one verified tree of ``num_nodes`` nodes whose accepted path has
    ``num_accepted`` nodes; starts stats of ``num_positions`` positions when
    ``stats`` is None.

    ``num_draft_tokens_per_pos[i]`` counts trees that could reach depth
    ``i + 1`` (more than ``i`` nodes): the scheduler knows a tree's size, not
    its shape. Called inside the scheduler's step: an impossible count is
    logged (once) and clamped, never raised, as a metric must not stop the
    engine."""
    if stats is None:
        stats = SpecDecodingStats.new(num_positions)
    num_nodes = max(num_nodes, 0)
    reachable = min(num_nodes, num_positions)
    if not 0 <= num_accepted <= reachable:
        logger.warning_once(
            "DDTree spec-decode stats: a tree of %d nodes from a drafter of depth "
            "%d cannot accept %d tokens; counted as %d",
            num_nodes,
            num_positions,
            num_accepted,
            min(max(num_accepted, 0), reachable),
        )
        num_accepted = min(max(num_accepted, 0), reachable)
    # vLLM 0.26's observe_draft indexes its vector by draft token: count the
    # depths a tree can reach there, and the nodes past them as draft tokens.
    stats.observe_draft(reachable, num_accepted)
    stats.num_draft_tokens += num_nodes - reachable
    return stats


def make_tree_spec_decoding_stats(
    scheduler,
    num_positions: int,
    spec_decoding_stats: SpecDecodingStats | None,
    num_draft_tokens: int,
    num_accepted_tokens: int,
    num_invalid_spec_tokens: dict[str, int] | None,
    request_id: str,
) -> SpecDecodingStats | None:
    """``Scheduler.make_spec_decoding_stats`` for trees (the same arguments
    after the scheduler and the stats' positions, ``num_draft_positions``).

    With an adaptive budget the step verified fewer nodes than the slots the
    scheduler gave: ``_ddtree_step_budget``, the worker's report, sets how
    many count (:func:`verified_draft_tokens`)."""
    budget = getattr(scheduler, "_ddtree_step_budget", None)
    if budget is not None:
        num_draft_tokens = verified_draft_tokens(
            num_draft_tokens, num_accepted_tokens, budget
        )
    if not scheduler.log_stats or not num_draft_tokens:
        return spec_decoding_stats
    if num_invalid_spec_tokens:
        num_draft_tokens -= num_invalid_spec_tokens.get(request_id, 0)
    return observe_tree(
        spec_decoding_stats, num_positions, num_draft_tokens, num_accepted_tokens
    )


def positions_sized(spec: SpeculativeConfig, num_positions: int) -> SpeculativeConfig:
    """A copy of ``spec`` for vLLM 0.26's Prometheus logger, which sizes its
    per-position counters by ``num_speculative_tokens``."""
    sized = copy.copy(spec)
    sized.num_speculative_tokens = num_positions
    return sized
