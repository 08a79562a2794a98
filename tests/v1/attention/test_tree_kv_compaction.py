# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for moving the accepted DDTree path's KV into place.

Small shapes run on the CPU through the Triton interpreter; the Qwen3-8B-shaped
cases (36 layers, bf16, budget 128) run only on a GPU.
"""

import pytest
import torch

from tests.v1.ddtree_reference import compact_tree_kv_reference
from vllm.v1.attention.ops.tree_kv_compaction import TreeKVCompactor

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")
PAD_SLOT_ID = -1

# Physical dimension orders of a [2, num_blocks, block_size, heads, head_size]
# cache: K and V apart in NHD and HND, num-blocks-first, and vLLM 0.26's
# FLASH_ATTN layout, whose slots hold [heads, K|V, head_size] contiguously (the
# compactor copies such slots as 8-byte words).
LAYOUTS = {
    "nhd": (0, 1, 2, 3, 4),
    "hnd": (0, 1, 3, 2, 4),
    "blocks_first": (1, 0, 2, 3, 4),
    "packed_kv": (1, 2, 3, 0, 4),
}


def _kv_caches(num_layers, num_blocks, block_size, heads, head_size, dtype, layout):
    """Separately allocated caches (as vLLM does), viewed with the given order."""
    shape = (2, num_blocks, block_size, heads, head_size)
    order = LAYOUTS[layout]
    caches = []
    for _ in range(num_layers):
        physical = torch.randn([shape[i] for i in order], device=DEVICE)
        if dtype == torch.float8_e4m3fn:
            physical = physical.clamp(-200, 200)
        inverse = [order.index(i) for i in range(5)]
        caches.append(physical.to(dtype).permute(*inverse))
    return caches


def _batch(num_nodes, num_accepted, block_size, num_blocks, first_offsets, gen):
    """slot_mapping, query_start_loc and accepted paths for trees of b_r nodes.

    Request r's tree tokens sit at positions first_offsets[r] + j of its own
    random blocks, so a tree may cross block boundaries.
    """
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    slots, qsl = [], [0]
    max_depth = max(max(num_accepted), 1)
    accepted = torch.full((len(num_nodes), max_depth), -1, dtype=torch.int32)
    for r, (b, k) in enumerate(zip(num_nodes, num_accepted)):
        num_tokens = b + 1
        num_req_blocks = (first_offsets[r] + num_tokens + block_size - 1) // block_size
        table = [blocks.pop() for _ in range(num_req_blocks)]
        for j in range(num_tokens):
            pos = first_offsets[r] + j
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        qsl.append(qsl[-1] + num_tokens)
        path = torch.randperm(b, generator=gen)[:k].sort().values + 1
        accepted[r, :k] = path.to(torch.int32)
    return (
        torch.tensor(slots, dtype=torch.int64),
        torch.tensor(qsl, dtype=torch.int32),
        accepted,
        torch.tensor(num_accepted, dtype=torch.int32),
    )


def _run_both(caches, slot_mapping, qsl, accepted, num_accepted):
    want = [c.clone() for c in caches]
    compact_tree_kv_reference(want, slot_mapping, qsl, accepted, num_accepted)
    TreeKVCompactor(caches)(
        slot_mapping.to(DEVICE),
        qsl.to(DEVICE),
        accepted.to(DEVICE),
        num_accepted.to(DEVICE),
    )
    return want


def _assert_bits_equal(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


@pytest.mark.parametrize("layout", ["nhd", "packed_kv"])
def test_tree_at_end_of_query(layout):
    """With ``cu_num_logits`` the kernel finds each tree at the end of its
    request's query (a chunked prefill's rows come first, as in MRv2's step
    layout): the result equals the reference given explicit tree starts, and a
    wrong start (the query's first row) would move other slots."""
    gen = torch.Generator().manual_seed(7)
    block_size, num_blocks = 16, 32
    num_nodes, num_accepted = [9, 12, 6, 3], [4, 5, 0, 2]
    # Rows before each tree: none, a 5-token prefill chunk, 17, and 2.
    prefix = [0, 5, 17, 2]
    caches = _kv_caches(2, num_blocks, block_size, 2, 8, torch.float16, layout)
    slots, qsl, _, _ = _batch(
        [b + p for b, p in zip(num_nodes, prefix)],
        [0] * len(num_nodes),
        block_size,
        num_blocks,
        [3, 0, 7, 1],
        gen,
    )
    # The batch helper laid out b + p + 1 rows per request; its trees are the
    # last b + 1 of them.
    max_depth = max(num_accepted)
    accepted = torch.zeros(len(num_nodes), max_depth, dtype=torch.int32)
    for r, (b, n) in enumerate(zip(num_nodes, num_accepted)):
        path = torch.randperm(b, generator=gen)[:n].sort().values + 1
        accepted[r, :n] = path.to(torch.int32)
    k = torch.tensor(num_accepted, dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(num_nodes).add(1).cumsum(0).tolist()])
    cu = cu.to(torch.int32)
    starts = qsl[1:] - (cu[1:] - cu[:-1])
    assert starts.tolist() != qsl[:-1].tolist()
    want = [c.clone() for c in caches]
    compact_tree_kv_reference(want, slots, starts, accepted, k)
    before = [c.clone() for c in caches]
    TreeKVCompactor(caches)(
        slots.to(DEVICE),
        qsl.to(DEVICE),
        accepted.to(DEVICE),
        k.to(DEVICE),
        cu.to(DEVICE),
    )
    _assert_bits_equal(caches, want)
    moved = sum(int((c != b).any(dim=-1).sum()) for c, b in zip(caches, before))
    # Each accepted node off its place moves one slot's K and V in every layer.
    assert moved > 0
    wrong = [c.clone() for c in before]
    compact_tree_kv_reference(wrong, slots, qsl, accepted, k)
    assert any(not torch.equal(w, c) for w, c in zip(wrong, caches))


# Copied as raw bits, so bf16 and fp8 also run under the CPU interpreter.
DTYPES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_reference(dtype, layout, block_size):
    gen = torch.Generator().manual_seed(block_size)
    max_depth = 5
    # k = 0, k = max depth, a partial path, a budget-1 tree.
    num_nodes = [9, 12, 20, 1]
    num_accepted = [0, max_depth, 3, 1]
    # The third tree starts 3 slots before a block boundary.
    offsets = [0, 5, block_size - 3, block_size + 1]
    caches = _kv_caches(3, 16, block_size, 2, 8, dtype, layout)
    batch = _batch(num_nodes, num_accepted, block_size, 16, offsets, gen)
    want = _run_both(caches, *batch)
    _assert_bits_equal(caches, want)


def test_packed_slots_are_copied_as_words():
    caches = _kv_caches(2, 4, 16, 2, 8, torch.float16, "packed_kv")
    assert TreeKVCompactor(caches).num_planes == 1
    for layout in ("nhd", "hnd", "blocks_first"):
        caches = _kv_caches(2, 4, 16, 2, 8, torch.float16, layout)
        assert TreeKVCompactor(caches).num_planes == 2


def test_overlapping_path_in_place():
    """Path [2, 3]: depth 1 reads slot 2 which depth 2 overwrites."""
    caches = _kv_caches(2, 4, 16, 1, 4, torch.float16, "nhd")
    before = [c.clone() for c in caches]
    slot_mapping = torch.arange(16, 20, dtype=torch.int64)  # block 1, slots 0..3
    qsl = torch.tensor([0, 4], dtype=torch.int32)
    accepted = torch.tensor([[2, 3, -1]], dtype=torch.int32)
    want = _run_both(caches, slot_mapping, qsl, accepted, torch.tensor([2]))
    _assert_bits_equal(caches, want)
    for cache, old in zip(caches, before):
        assert torch.equal(cache[:, 1, 1], old[:, 1, 2])
        assert torch.equal(cache[:, 1, 2], old[:, 1, 3])
        assert torch.equal(cache[:, 1, 3], old[:, 1, 3])
        assert torch.equal(cache[:, 1, 0], old[:, 1, 0])


def test_chained_overlaps():
    """Every depth reads the slot the next depth writes: path [2, 3, 4, 5]."""
    caches = _kv_caches(1, 2, 16, 2, 4, torch.float16, "nhd")
    before = caches[0].clone()
    slot_mapping = torch.arange(0, 6, dtype=torch.int64)
    qsl = torch.tensor([0, 6], dtype=torch.int32)
    accepted = torch.tensor([[2, 3, 4, 5]], dtype=torch.int32)
    _run_both(caches, slot_mapping, qsl, accepted, torch.tensor([4]))
    for d in range(1, 5):
        assert torch.equal(caches[0][:, 0, d], before[:, 0, d + 1])


@pytest.mark.parametrize(
    "budget,max_depth", [(70, 64), pytest.param(1024, 1024, marks=gpu_only)]
)
def test_deep_paths(budget, max_depth):
    """Paths far deeper than DFlash's 15, up to a chain of the whole budget."""
    gen = torch.Generator().manual_seed(budget)
    caches = _kv_caches(2, 3 * (budget // 16 + 2), 16, 2, 64, torch.bfloat16, "nhd")
    num_accepted = [max_depth, max_depth // 2, 0]
    batch = _batch([budget] * 3, num_accepted, 16, caches[0].shape[1], [7, 0, 3], gen)
    want = _run_both(caches, *batch)
    _assert_bits_equal(caches, want)


def test_padded_requests_and_slots():
    """CUDA-graph padding: trailing requests with no tokens, and padding slots."""
    gen = torch.Generator().manual_seed(1)
    caches = _kv_caches(2, 8, 16, 2, 8, torch.float16, "nhd")
    slot_mapping, qsl, accepted, num_accepted = _batch(
        [6, 6], [3, 2], 16, 8, [2, 20], gen
    )
    # Request 1's flattened index 1 is a padding slot: that move is skipped.
    slot_mapping[int(qsl[1]) + 1] = PAD_SLOT_ID
    # Two padded requests after the real ones, and padded slot-mapping entries.
    slot_mapping = torch.cat([slot_mapping, torch.full((5,), PAD_SLOT_ID)])
    qsl = torch.cat([qsl, qsl[-1:].repeat(2)])
    accepted = torch.cat([accepted, torch.full((2, 3), -1, dtype=torch.int32)])
    num_accepted = torch.cat([num_accepted, torch.zeros(2, dtype=torch.int32)])
    want = _run_both(caches, slot_mapping, qsl, accepted, num_accepted)
    _assert_bits_equal(caches, want)


def test_aliased_layers_compact_once():
    """Layers that share one cache (KV sharing) must not be compacted twice."""
    caches = _kv_caches(1, 2, 16, 1, 4, torch.float16, "nhd")
    want = [caches[0].clone()]
    slot_mapping = torch.arange(0, 4, dtype=torch.int64)
    qsl = torch.tensor([0, 4], dtype=torch.int32)
    accepted = torch.tensor([[2, 3]], dtype=torch.int32)
    compact_tree_kv_reference(want, slot_mapping, qsl, accepted, torch.tensor([2]))
    shared = [caches[0], caches[0]]
    TreeKVCompactor(shared)(
        *(t.to(DEVICE) for t in (slot_mapping, qsl, accepted, torch.tensor([2])))
    )
    _assert_bits_equal(caches, want)


def test_rejects_bad_caches():
    good = _kv_caches(2, 4, 16, 1, 4, torch.float16, "nhd")
    with pytest.raises(ValueError, match="at least one"):
        TreeKVCompactor([])
    with pytest.raises(ValueError, match="expected KV caches of shape"):
        TreeKVCompactor([good[0][0]])
    other = _kv_caches(1, 4, 32, 1, 4, torch.float16, "nhd")
    with pytest.raises(ValueError, match="one compactor per KV-cache group"):
        TreeKVCompactor([good[0], other[0]])
    with pytest.raises(ValueError, match="one compactor per KV-cache group"):
        TreeKVCompactor([good[0], good[1].float()])


@gpu_only
@pytest.mark.parametrize("layout", ["packed_kv", "nhd"])
@pytest.mark.parametrize("num_reqs,budget", [(1, 128), (64, 128), (4, 1024)])
def test_qwen3_8b_shape(num_reqs, budget, layout):
    """36 layers, 8 KV heads of 128, bf16, block 16, paths of up to 15 nodes."""
    gen = torch.Generator().manual_seed(num_reqs)
    max_depth = 15
    num_blocks = num_reqs * ((budget + 1 + 40) // 16 + 2) + 8
    caches = _kv_caches(36, num_blocks, 16, 8, 128, torch.bfloat16, layout)
    num_accepted = torch.randint(0, max_depth + 1, (num_reqs,), generator=gen)
    num_accepted[0] = max_depth
    offsets = torch.randint(0, 40, (num_reqs,), generator=gen).tolist()
    batch = _batch(
        [budget] * num_reqs, num_accepted.tolist(), 16, num_blocks, offsets, gen
    )
    want = _run_both(caches, *batch)
    _assert_bits_equal(caches, want)


@gpu_only
def test_cuda_graph_replay():
    """Captured once, the launch serves any accepted paths of the same shapes."""
    gen = torch.Generator().manual_seed(0)
    caches = _kv_caches(4, 64, 16, 8, 128, torch.bfloat16, "packed_kv")
    compactor = TreeKVCompactor(caches)
    first = _batch([32] * 4, [15, 0, 7, 3], 16, 64, [0, 3, 14, 30], gen)
    buffers = [t.to(DEVICE) for t in first]
    compactor(*buffers)  # warm up (compile) outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compactor(*buffers)
    for num_accepted in ([2, 15, 0, 9], [15, 15, 15, 15]):
        batch = _batch([32] * 4, num_accepted, 16, 64, [1, 2, 3, 4], gen)
        for buf, new in zip(buffers, batch):
            buf.copy_(new.to(DEVICE))
        want = [c.clone() for c in caches]
        compact_tree_kv_reference(want, *batch)
        graph.replay()
        torch.cuda.synchronize()
        _assert_bits_equal(caches, want)
