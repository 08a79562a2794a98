# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's spec-decode metrics for DDTree trees.

vLLM counts acceptance per draft position and sizes that vector by
``num_speculative_tokens``, which for DDTree is ``tree_budget`` (up to 1024 tree
nodes). A tree's accepted path is at most the drafter's depth long, so DDTree
sizes the vector by ``draft_depth``: position ``i`` counts trees whose accepted
path reached depth ``i + 1``, directly comparable with a DFlash chain's position
``i``. The scalar counters keep vLLM's meaning: one draft per verified tree,
draft tokens = tree nodes, accepted tokens = nodes on the accepted path, so the
mean acceptance length (1 + accepted / drafts) is tokens per step.
"""

import copy

from vllm.config import SpeculativeConfig
from vllm.logger import init_logger
from vllm.v1.spec_decode.metrics import SpecDecodingStats

logger = init_logger(__name__)


def observe_tree(
    stats: SpecDecodingStats | None,
    draft_depth: int,
    num_nodes: int,
    num_accepted: int,
) -> SpecDecodingStats:
    """Add one verified tree of ``num_nodes`` nodes whose accepted path has
    ``num_accepted`` nodes; starts depth-sized stats when ``stats`` is None.

    ``num_draft_tokens_per_pos[i]`` counts trees that could reach depth
    ``i + 1`` (more than ``i`` nodes): the scheduler knows a tree's size, not
    its shape. Called inside the scheduler's step: an impossible count is
    logged (once) and clamped, never raised, as a metric must not stop the
    engine."""
    if stats is None:
        stats = SpecDecodingStats.new(draft_depth)
    num_nodes = max(num_nodes, 0)
    reachable = min(num_nodes, draft_depth)
    if not 0 <= num_accepted <= reachable:
        logger.warning_once(
            "DDTree spec-decode stats: a tree of %d nodes from a drafter of depth "
            "%d cannot accept %d tokens; counted as %d",
            num_nodes,
            draft_depth,
            num_accepted,
            min(max(num_accepted, 0), reachable),
        )
        num_accepted = min(max(num_accepted, 0), reachable)
    # vLLM's own per-position counting, over the depths a tree can reach; the
    # nodes past them still count as draft tokens.
    stats.observe_draft(reachable, num_accepted)
    stats.num_draft_tokens += num_nodes - reachable
    return stats


def make_tree_spec_decoding_stats(
    scheduler,
    draft_depth: int,
    spec_decoding_stats: SpecDecodingStats | None,
    num_draft_tokens: int,
    num_accepted_tokens: int,
    num_invalid_spec_tokens: dict[str, int] | None,
    request_id: str,
) -> SpecDecodingStats | None:
    """``Scheduler.make_spec_decoding_stats`` for trees (the same arguments
    after the scheduler and the drafter's depth).

    ``num_draft_tokens`` is the slots the scheduler gave; with an adaptive
    budget the step verified fewer, ``_ddtree_step_budget`` per request on
    average (the worker's report, ``ddtree_slots.py``): that many are
    counted, or the accepted path's length where the batch-wide split gave
    the request more, so the draft-token counter sums about the nodes
    verified and every accepted token counts."""
    budget = getattr(scheduler, "_ddtree_step_budget", None)
    if budget is not None:
        num_draft_tokens = min(num_draft_tokens, max(budget, num_accepted_tokens))
    if not scheduler.log_stats or not num_draft_tokens:
        return spec_decoding_stats
    if num_invalid_spec_tokens:
        num_draft_tokens -= num_invalid_spec_tokens.get(request_id, 0)
    return observe_tree(
        spec_decoding_stats, draft_depth, num_draft_tokens, num_accepted_tokens
    )


def depth_sized(spec: SpeculativeConfig, draft_depth: int) -> SpeculativeConfig:
    """A copy of ``spec`` for vLLM's Prometheus logger, which sizes its
    per-position counters by ``num_speculative_tokens``."""
    sized = copy.copy(spec)
    sized.num_speculative_tokens = draft_depth
    return sized
