# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Draft slots and KV blocks of an adaptive DDTree engine: the scheduler's side.

Each draft slot the scheduler gives a request is a token of its step and a KV
slot it holds. The worker chooses each step's tree budget after the step was
scheduled (``ddtree_adaptive.py``), so the slots are an upper bound of it; this
module keeps that bound near what the worker chooses:

- :class:`TreeSlots` replaces the scheduler's draft slots per batch size: the
  engine's caps (``scheduled_tree_budgets``), lowered per batch size to a few
  times the budget the worker last chose for a batch of that size (which the
  worker reports with every step's output), so that the batch-wide split of a
  step's nodes keeps room to move nodes between requests.
- :func:`trim_dropped_slots` (through :func:`trim_tail_blocks`) returns a
  request's blocks past its computed tokens and the drafter's lookahead to the
  pool when the slots it gets drop: the blocks that held only the rejected
  nodes of its larger trees. The worker cuts its block table to the same
  length (:func:`truncate_block_tables`) before it appends the blocks of the
  next step.

Where the slots stay (they never drop) no block is freed: a step's rejected
nodes sit in blocks its next tree writes.
"""

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from vllm.utils.math_utils import cdiv
from vllm.v1.spec_decode.ddtree_cost import request_bucket

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler


def slots_for_budget(slot_ladder: Sequence[int], budget: int) -> int:
    """The fewest slots of ``slot_ladder`` (rising, from 0) above ``budget``,
    or its largest: a request then holds up to about four times the nodes of
    an average request, which the batch-wide ranking may hand it."""
    for slots in slot_ladder:
        if slots > budget:
            return slots
    return slot_ladder[-1]


class TreeSlots:
    """The scheduler's draft slots per request by number of scheduled
    requests (``Scheduler.dynamic_sd_lookup``; index 0 unused).

    ``caps[n]`` is the most a request may get at ``n`` requests. Until the
    worker reports a budget for a batch of ``n``'s size bucket, ``n``
    requests get ``caps[n]``; after, ``slots_for_budget`` of the reported
    budget, at most the cap. The worker reports the budget it would choose
    without the slots' bound, so lowered slots rise again as soon as larger
    trees pay."""

    def __init__(self, caps: Sequence[int], slot_ladder: Sequence[int]):
        if not caps or caps[0] != 0:
            raise ValueError("caps[0] stands for no requests and must be 0")
        self.caps = list(caps)
        self.slot_ladder = tuple(sorted(set(slot_ladder) | {0}))
        # request bucket -> slots from the worker's last budget for it
        self._advised: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.caps)

    def __getitem__(self, num_reqs: int) -> int:
        cap = self.caps[num_reqs]
        advised = self._advised.get(request_bucket(num_reqs))
        return cap if advised is None else min(cap, advised)

    def advise(self, num_reqs: int, budget: int) -> None:
        """The worker's budget for ``num_reqs`` requests (from its last step's
        output)."""
        if 0 < num_reqs < len(self.caps):
            self._advised[request_bucket(num_reqs)] = slots_for_budget(
                self.slot_ladder, budget
            )


def trim_tail_blocks(
    kv_cache_manager, request, num_lookahead_tokens: int, max_model_len: int
) -> tuple[int, ...] | None:
    """Free ``request``'s blocks past its computed tokens plus the drafter's
    lookahead; returns the blocks it keeps per KV cache group, or None when
    none was freed.

    With async scheduling the computed tokens include the step in flight
    (counted as if all its drafts were accepted): what that step's target and
    drafter write lies below them plus the lookahead, so no block in use is
    freed. The freed blocks hold only rejected nodes; none is in the prefix
    cache (only committed tokens' full blocks are, all below the bound)."""
    need = min(request.num_computed_tokens + num_lookahead_tokens, max_model_len)
    req_id = request.request_id
    kept: list[int] = []
    freed = False
    for manager in kv_cache_manager.coordinator.single_type_managers:
        blocks = manager.req_to_blocks.get(req_id)
        if blocks is None or req_id in manager._partial_hit_reqs:
            return None  # not allocated yet, or a copy-on-write still pending
        keep = max(
            cdiv(need, manager.block_size), manager.num_cached_block.get(req_id, 0)
        )
        if len(blocks) > keep:
            tail = blocks[keep:]
            del blocks[keep:]
            # Tail first, as vLLM frees a request's blocks.
            manager.block_pool.free_blocks(reversed(tail))
            freed = True
        kept.append(len(blocks))
    return tuple(kept) if freed else None


def trim_dropped_slots(scheduler: "Scheduler") -> dict[str, tuple[int, ...]] | None:
    """An adaptive budget with async scheduling: when the slots the running
    requests get now (their placeholders) are fewer than the last schedule
    gave, free each one's blocks past its computed tokens and the drafter's
    lookahead (:func:`trim_tail_blocks`) before this schedule allocates, and
    again in the next one (the step in flight verifies a tree of the old
    slots, whose blocks it uses until then). Returns the blocks kept per
    request cut, which the worker cuts from its block table too.

    Called by ``scheduler.schedule`` before it schedules or allocates
    anything, after the structured-output requests' drafts are dropped; the
    scheduler's ``_ddtree_slots_given`` (None before the first schedule) and
    ``_ddtree_trims_left`` (0 at first) carry the slots and the trims left
    from one schedule to the next."""
    slots = getattr(scheduler, "_spec_token_placeholders", None)
    if slots is None:
        return None  # a sync scheduler: the slots never drop
    given, scheduler._ddtree_slots_given = scheduler._ddtree_slots_given, len(slots)
    if given is not None and len(slots) < given:
        scheduler._ddtree_trims_left = 2
    if not scheduler._ddtree_trims_left or scheduler.connector is not None:
        return None
    scheduler._ddtree_trims_left -= 1
    kept = {}
    for request in scheduler.running:
        if request.num_computed_tokens > 0:
            blocks = trim_tail_blocks(
                scheduler.kv_cache_manager,
                request,
                scheduler.num_lookahead_tokens,
                scheduler.max_model_len,
            )
            if blocks is not None:
                kept[request.request_id] = blocks
    return kept


def truncate_block_tables(
    block_tables, req_id_to_index: Mapping[str, int], kept: Mapping[str, Sequence[int]]
) -> int:
    """Cut the worker's block table rows of the requests in ``kept`` (request
    id -> blocks kept per KV cache group, as :func:`trim_tail_blocks` returned)
    before the step appends its new blocks; returns the rows cut. A request
    the worker no longer holds is skipped."""
    num_cut = 0
    num_blocks = block_tables.num_blocks.np
    for req_id, per_group in kept.items():
        index = req_id_to_index.get(req_id)
        if index is None:
            continue
        for group, n in enumerate(per_group):
            # The worker's table may split each KV block into kernel blocks.
            n *= block_tables.blocks_per_kv_block[group]
            num_blocks[group, index] = min(int(num_blocks[group, index]), n)
        num_cut += 1
    if num_cut:
        block_tables.num_blocks.copy_to_uva()
    return num_cut
