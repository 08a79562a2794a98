# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Move the KV of a DDTree's accepted path into place, in every attention layer.

A request verifies its flattened tree ``[root, node_1, ..., node_b]`` and each tree
token's KV lands in the slot of its flattened index: ``slot_mapping[start_r + i]``.
The tree is the end of the request's query (rows before it are a chunked
prefill's): ``start_r = qsl[r + 1] - (cu_num_logits[r + 1] - cu_num_logits[r])``,
which is ``qsl[r]`` when every row is a tree row (``cu_num_logits = qsl``).
After the walk accepts nodes ``idx_1 < ... < idx_k`` (depth order, idx_d >= d),
the committed sequence continues root, idx_1, ..., idx_k, so the KV of idx_d must
move to the slot of flattened index d. Slots past k then hold garbage and are
overwritten by the next step or released by the scheduler.

The copy is in place. Reading slot idx_d never sees an earlier write (earlier
writes go to slots d' < d <= idx_d), but a later depth may overwrite a slot that
an earlier depth reads (path [2, 3]: depth 1 reads slot 2, depth 2 writes slot 2).
Each program therefore loads every depth's source before a barrier and stores
after it. One launch covers all layers, with a grid that does not depend on k,
so the call can be captured in a CUDA graph.

Example::

    compactor = TreeKVCompactor(kv_caches)   # once, at KV-cache init
    compactor(slot_mapping, query_start_loc, accepted_nodes, num_accepted,
              cu_num_logits)
"""

import torch

from vllm.triton_utils import tl, triton
from vllm.utils.math_utils import cdiv, next_power_of_2

# Raw-bit element types by itemsize: bf16/fp16/fp8/fp32 caches all copy as ints.
_RAW_TYPES = {1: tl.int8, 2: tl.int16, 4: tl.int32}


class TreeKVCompactor:
    """Compacts accepted tree paths in a set of same-layout KV caches.

    Each cache is one attention layer's ``[2, num_blocks, block_size,
    num_kv_heads, head_size]`` tensor (vLLM's FlashAttention layout, any
    strides). All caches must share shape, strides and dtype, as the layers of
    one KV-cache group do; build one compactor per group. Caches that alias the
    same memory (KV sharing between layers) are compacted once.
    """

    # Elements per program: max_depth rows of a chunk of a slot's
    # (num_kv_heads, head_size) plane, all held in registers between the loads
    # and the stores.
    TILE_ELEMS = 4096

    def __init__(self, kv_caches: list[torch.Tensor]):
        self.kv_caches = _unique_caches(kv_caches)
        first = self.kv_caches[0]
        _check_kv_caches(self.kv_caches)
        self.raw_type = _RAW_TYPES[first.element_size()]
        _, _, self.block_size, num_kv_heads, self.head_size = first.shape
        self.slot_elems = num_kv_heads * self.head_size
        self.strides = first.stride()
        # K and V are copied by separate programs, element by element...
        self.num_planes = 2
        words = _slot_words(self.kv_caches)
        if words is not None:
            # ...unless a slot's K and V form one contiguous span (vLLM's NHD
            # FLASH_ATTN layout): then the span is copied as 8-byte words.
            itemsize = first.element_size()
            _, block_stride, slot_stride, _, _ = self.strides
            self.raw_type, self.num_planes = tl.int64, 1
            self.head_size = self.slot_elems = words
            self.strides = (
                0,
                block_stride * itemsize // 8,
                slot_stride * itemsize // 8,
                0,
                1,
            )
        # [num_layers] base addresses, read by the kernel and cast to pointers.
        self.layer_ptrs = torch.tensor(
            [cache.data_ptr() for cache in self.kv_caches],
            dtype=torch.int64,
            device=first.device,
        )

    def __call__(
        self,
        # [num_tokens] int64
        slot_mapping: torch.Tensor,
        # [num_reqs + 1] int32
        query_start_loc: torch.Tensor,
        # [num_reqs, max_depth] int32
        accepted_nodes: torch.Tensor,
        # [num_reqs] int32
        num_accepted: torch.Tensor,
        # [num_reqs + 1] int32: each request's tree is the last
        # cu_num_logits[r + 1] - cu_num_logits[r] rows of its query; None: all of
        # them (query_start_loc). The kernel finds the root from these, so the
        # caller launches nothing for it.
        cu_num_logits: torch.Tensor | None = None,
    ) -> None:
        num_reqs, max_depth = accepted_nodes.shape
        kv_stride, block_stride, slot_stride, head_stride, dim_stride = self.strides
        depth_block = next_power_of_2(max(max_depth, 1))
        elem_block = min(
            max(self.TILE_ELEMS // depth_block, 16),
            next_power_of_2(self.slot_elems),
        )
        grid = (
            num_reqs,
            self.num_planes * self.layer_ptrs.shape[0],
            cdiv(self.slot_elems, elem_block),
        )
        _tree_kv_compaction_kernel[grid](
            self.layer_ptrs,
            slot_mapping,
            query_start_loc,
            query_start_loc if cu_num_logits is None else cu_num_logits,
            accepted_nodes,
            accepted_nodes.stride(0),
            num_accepted,
            max_depth,
            self.block_size,
            kv_stride,
            block_stride,
            slot_stride,
            head_stride,
            dim_stride,
            RAW_TYPE=self.raw_type,
            HEAD_SIZE=self.head_size,
            SLOT_ELEMS=self.slot_elems,
            DEPTH_BLOCK=depth_block,
            ELEM_BLOCK=elem_block,
            NUM_PLANES=self.num_planes,
            num_warps=4,
        )


def _unique_caches(kv_caches: list[torch.Tensor]) -> list[torch.Tensor]:
    if not kv_caches:
        raise ValueError("TreeKVCompactor needs at least one KV cache")
    seen: dict[tuple, torch.Tensor] = {}
    for cache in kv_caches:
        seen.setdefault((cache.data_ptr(), cache.stride()), cache)
    return list(seen.values())


def _slot_words(kv_caches: list[torch.Tensor]) -> int | None:
    """8-byte words of one slot's K and V if, in every cache, they form one
    contiguous 8-byte aligned span; else None."""
    first = kv_caches[0]
    _, _, _, num_heads, head_size = first.shape
    kv_stride, block_stride, slot_stride, head_stride, dim_stride = first.stride()
    plane = num_heads * head_size
    packed = dim_stride == 1 and (
        (kv_stride == head_size and head_stride == 2 * head_size)  # [H, 2, D]
        or (head_stride == head_size and kv_stride == plane)  # [2, H, D]
    )
    itemsize = first.element_size()
    aligned = all(
        (n * itemsize) % 8 == 0 for n in (2 * plane, block_stride, slot_stride)
    ) and all(cache.data_ptr() % 8 == 0 for cache in kv_caches)
    return 2 * plane * itemsize // 8 if packed and aligned else None


def _check_kv_caches(kv_caches: list[torch.Tensor]) -> None:
    first = kv_caches[0]
    if first.dim() != 5 or first.shape[0] != 2:
        raise ValueError(
            "expected KV caches of shape [2, num_blocks, block_size, num_kv_heads, "
            f"head_size], got {tuple(first.shape)}"
        )
    if first.element_size() not in _RAW_TYPES:
        raise ValueError(f"unsupported KV cache dtype {first.dtype}")
    for cache in kv_caches[1:]:
        if (cache.shape, cache.stride(), cache.dtype, cache.device) != (
            first.shape,
            first.stride(),
            first.dtype,
            first.device,
        ):
            raise ValueError(
                "all KV caches of a TreeKVCompactor must share shape, strides, "
                "dtype and device; build one compactor per KV-cache group"
            )


@triton.jit
def _tree_kv_compaction_kernel(
    # [num_layers] int64 base addresses of the layers' KV caches
    layer_ptrs_ptr,
    # [num_tokens]
    slot_mapping_ptr,
    # [num_reqs + 1]
    query_start_loc_ptr,
    # [num_reqs + 1]
    cu_num_logits_ptr,
    # [num_reqs, max_depth]
    accepted_nodes_ptr,
    accepted_nodes_stride,
    # [num_reqs]
    num_accepted_ptr,
    max_depth,
    block_size,
    kv_stride,
    block_stride,
    slot_stride,
    head_stride,
    dim_stride,
    RAW_TYPE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    SLOT_ELEMS: tl.constexpr,
    DEPTH_BLOCK: tl.constexpr,
    ELEM_BLOCK: tl.constexpr,
    NUM_PLANES: tl.constexpr,
):
    req_idx = tl.program_id(0).to(tl.int64)
    num_accepted = tl.minimum(tl.load(num_accepted_ptr + req_idx), max_depth)
    if num_accepted <= 0:
        return
    layer = tl.program_id(1) // NUM_PLANES
    kv = (tl.program_id(1) % NUM_PLANES).to(tl.int64)
    num_logits = tl.load(cu_num_logits_ptr + req_idx + 1) - tl.load(
        cu_num_logits_ptr + req_idx
    )
    start = (tl.load(query_start_loc_ptr + req_idx + 1) - num_logits).to(tl.int64)

    # Row d - 1 of the tile moves flattened index idx_d to flattened index d.
    depth = tl.arange(0, DEPTH_BLOCK)
    depth_mask = depth < num_accepted
    src_node = tl.load(
        accepted_nodes_ptr + req_idx * accepted_nodes_stride + depth,
        mask=depth_mask,
        other=0,
    ).to(tl.int64)
    dst_node = depth.to(tl.int64) + 1
    src_slot = tl.load(
        slot_mapping_ptr + start + src_node, mask=depth_mask, other=-1
    ).to(tl.int64)
    dst_slot = tl.load(
        slot_mapping_ptr + start + dst_node, mask=depth_mask, other=-1
    ).to(tl.int64)
    # Nodes already in place are skipped; padding slots are never touched.
    move = depth_mask & (src_node != dst_node) & (src_slot >= 0) & (dst_slot >= 0)
    src_off = (src_slot // block_size) * block_stride + (
        src_slot % block_size
    ) * slot_stride
    dst_off = (dst_slot // block_size) * block_stride + (
        dst_slot % block_size
    ) * slot_stride

    elem = tl.program_id(2) * ELEM_BLOCK + tl.arange(0, ELEM_BLOCK)
    elem_off = (elem // HEAD_SIZE).to(tl.int64) * head_stride + (elem % HEAD_SIZE).to(
        tl.int64
    ) * dim_stride
    mask = move[:, None] & (elem < SLOT_ELEMS)[None, :]

    base = tl.load(layer_ptrs_ptr + layer).to(tl.pointer_type(RAW_TYPE))
    base += kv * kv_stride
    values = tl.load(base + src_off[:, None] + elem_off[None, :], mask=mask)
    # Every source is read before any destination is written.
    tl.debug_barrier()
    tl.store(base + dst_off[:, None] + elem_off[None, :], values, mask=mask)
