# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler's draft slots and KV blocks of an adaptive DDTree engine
(``vllm/v1/spec_decode/ddtree_slots.py``) and the worker's block-table cut
(CPU, on stand-ins); the spec-decode counters of a step's budget are in
test_ddtree_metrics.py."""

import types

import numpy as np
import pytest

from vllm.v1.spec_decode.ddtree_cost import request_bucket
from vllm.v1.spec_decode.ddtree_slots import (
    TreeSlots,
    slots_for_budget,
    trim_dropped_slots,
    trim_tail_blocks,
    truncate_block_tables,
)

SLOT_LADDER = (0, 3, 15, 63, 128)


def test_slots_for_budget_against_brute_force():
    checked = 0
    for ladder in [SLOT_LADDER, (0, 3, 15, 63, 255, 1023), (0, 1), (0, 3, 15, 16)]:
        for budget in range(0, ladder[-1] + 2):
            above = [s for s in ladder if s > budget]
            want = min(above) if above else max(ladder)
            assert slots_for_budget(ladder, budget) == want
            checked += 1
    print(f"budgets checked: {checked}")
    assert checked > 1000


def test_tree_slots_follow_the_reported_budget_per_bucket():
    caps = [0] + [128] * 4 + [63] * 12 + [15] * 48
    slots = TreeSlots(caps, SLOT_LADDER)
    assert len(slots) == len(caps)
    # No report yet: the caps.
    assert [slots[n] for n in range(1, len(caps))] == caps[1:]
    slots.advise(8, 3)  # budget 3 at 8 requests: 15 slots for bucket 8
    checked = 0
    for n in range(1, len(caps)):
        want = min(caps[n], 15) if request_bucket(n) == request_bucket(8) else caps[n]
        assert slots[n] == want, n
        checked += 1
    # Never above the cap, and a larger budget raises them again.
    slots.advise(8, 127)
    assert slots[8] == 63 and slots[1] == 128
    slots.advise(1, 0)
    assert slots[1] == 3
    # Out-of-range batch sizes are ignored, not raised (a report inside the
    # scheduler's step must not stop the engine).
    slots.advise(0, 5)
    slots.advise(len(caps), 5)
    print(f"batch sizes checked: {checked}")
    assert checked == len(caps) - 1
    with pytest.raises(ValueError, match="caps"):
        TreeSlots([5, 5], SLOT_LADDER)


class _Block:
    def __init__(self, block_id):
        self.block_id = block_id


class _Pool:
    def __init__(self):
        self.freed = []

    def free_blocks(self, blocks):
        self.freed.extend(b.block_id for b in blocks)


def _manager(block_size, blocks, cached=0, partial=False):
    pool = _Pool()
    single = types.SimpleNamespace(
        block_size=block_size,
        req_to_blocks={"r": [_Block(i) for i in blocks]},
        num_cached_block={"r": cached},
        _partial_hit_reqs={"r": None} if partial else {},
        block_pool=pool,
    )
    kv = types.SimpleNamespace(
        coordinator=types.SimpleNamespace(single_type_managers=(single,))
    )
    return kv, single, pool


def _request(num_computed):
    return types.SimpleNamespace(request_id="r", num_computed_tokens=num_computed)


def test_trim_tail_blocks_frees_past_computed_and_lookahead():
    # 100 computed + 16 lookahead = 116 tokens: 8 blocks of 16 kept of 12.
    kv, single, pool = _manager(16, range(12))
    assert trim_tail_blocks(kv, _request(100), 16, 2048) == (8,)
    assert [b.block_id for b in single.req_to_blocks["r"]] == list(range(8))
    assert pool.freed == [11, 10, 9, 8]  # tail first, as vLLM frees
    # Nothing past the bound: nothing freed, None.
    assert trim_tail_blocks(kv, _request(100), 16, 2048) is None
    # max_model_len bounds what is kept.
    kv, single, pool = _manager(16, range(12))
    assert trim_tail_blocks(kv, _request(100), 16, 64) == (4,)
    # Cached blocks are never freed, a pending copy-on-write or an unknown
    # request leaves everything as it is.
    kv, single, pool = _manager(16, range(12), cached=10)
    assert trim_tail_blocks(kv, _request(100), 16, 2048) == (10,)
    kv, single, pool = _manager(16, range(12), partial=True)
    assert trim_tail_blocks(kv, _request(10), 16, 2048) is None and not pool.freed
    kv, single, pool = _manager(16, range(12))
    other = types.SimpleNamespace(request_id="x", num_computed_tokens=10)
    assert trim_tail_blocks(kv, other, 16, 2048) is None and not pool.freed


def _scheduler(kv, num_computed, placeholders=(), connector=None):
    # The async scheduler's state trim_dropped_slots reads; a sync scheduler
    # has no _spec_token_placeholders.
    return types.SimpleNamespace(
        _spec_token_placeholders=list(placeholders),
        _ddtree_slots_given=None,
        _ddtree_trims_left=0,
        connector=connector,
        running=[_request(num_computed), _request(0)],
        kv_cache_manager=kv,
        num_lookahead_tokens=16,
        max_model_len=2048,
    )


def test_trim_dropped_slots_frees_in_the_drop_and_the_next_schedule():
    kv, single, pool = _manager(16, range(12))
    sched = _scheduler(kv, 100, placeholders=[0] * 63)
    # The first schedule and one at the same slots free nothing.
    assert trim_dropped_slots(sched) is None
    assert trim_dropped_slots(sched) is None and not pool.freed
    assert sched._ddtree_slots_given == 63
    # The slots drop: this schedule frees past 100 + 16 tokens (a request not
    # computed yet is skipped), the next one past its new computed tokens.
    sched._spec_token_placeholders = [0] * 15
    assert trim_dropped_slots(sched) == {"r": (8,)}
    assert pool.freed == [11, 10, 9, 8] and sched._ddtree_trims_left == 1
    sched.running[0].num_computed_tokens = 50
    assert trim_dropped_slots(sched) == {"r": (5,)}
    assert sched._ddtree_trims_left == 0
    sched.running[0].num_computed_tokens = 20
    assert trim_dropped_slots(sched) is None and len(pool.freed) == 7
    # A sync scheduler's slots never drop; with a KV connector nothing is
    # freed.
    del sched._spec_token_placeholders
    assert trim_dropped_slots(sched) is None
    kv, single, pool = _manager(16, range(12))
    sched = _scheduler(kv, 100, placeholders=[0] * 63, connector=object())
    trim_dropped_slots(sched)
    sched._spec_token_placeholders = [0] * 15
    assert trim_dropped_slots(sched) is None and not pool.freed


class _Uva:
    def __init__(self, array):
        self.np = array
        self.copies = 0

    def copy_to_uva(self):
        self.copies += 1


def test_truncate_block_tables_cuts_rows_in_kernel_blocks():
    num_blocks = _Uva(np.array([[9, 9, 9], [18, 18, 18]], dtype=np.int32))
    tables = types.SimpleNamespace(num_blocks=num_blocks, blocks_per_kv_block=[1, 2])
    cut = truncate_block_tables(tables, {"a": 0, "c": 2}, {"a": (4, 4), "b": (1, 1)})
    assert cut == 1 and num_blocks.copies == 1
    assert num_blocks.np.tolist() == [[4, 9, 9], [8, 18, 18]]
    # A row is never lengthened; nothing to cut, no copy.
    assert truncate_block_tables(tables, {"a": 0}, {"a": (7, 7)}) == 1
    assert num_blocks.np.tolist() == [[4, 9, 9], [8, 18, 18]]
    assert truncate_block_tables(tables, {}, {"a": (1, 1)}) == 0
    assert num_blocks.copies == 2
