# SPDX-License-Identifier: Apache-2.0
"""Paged attention with a per-request tree (ancestor) mask, in Triton.

Every request of a batch owns its last ``q_len`` tokens as query rows. Query row
``i`` of a request with ``seq_len`` tokens in the KV cache and
``ctx_len = seq_len - q_len`` committed tokens sees

* every committed token (KV positions ``0 .. ctx_len - 1``), and
* among the request's own new tokens (KV positions ``ctx_len + j``):
  - causal rows (decodes, chains, prefills): every ``j <= i``;
  - tree rows: every ``j <= i`` whose bit is set in row ``i`` of the request's
    ancestor mask.

This is tree verification for speculative decoding (DDTree, SpecInfer): the new
tokens are ``[root, node_1, ..., node_B]`` flattened parent-before-child, with KV
slots following the flattened index, and a node must see only its ancestors.

Mask layout (shared with ``vllm/v1/spec_decode/dflash_tree_builder.py``):
``tree_mask[r, i, j // 32]`` bit ``j % 32`` is set iff tree token ``j`` is an
ancestor of tree token ``i`` or ``i`` itself; ``is_tree[r] != 0`` marks the
requests whose rows use the mask. A request with ``q_len`` rows uses the first
``q_len`` rows and bits (a prefix of a parent-before-child node list is a tree).

Shapes::

    q, out             [num_tokens, num_q_heads, head_size]   fp16 / bf16 / fp32
    key_cache,
    value_cache        [num_blocks, block_size, num_kv_heads, head_size]  any strides,
                       last dim contiguous (FLASH_ATTN's paged layout: on vLLM 0.26
                       ``kv_cache.transpose(1, 2).split(head_size, -1)``)
    query_start_loc    [num_reqs + 1] int32
    seq_lens           [num_reqs] int32  (committed + new tokens, new ones cached)
    block_table        [num_reqs, max_num_blocks] int32
    tree_mask          [>= num_reqs, max_tree_len, num_words] int32  (optional)
    is_tree            [>= num_reqs] int32                           (optional)

Kernel design. A program owns one query tile: ``BLOCK_Q`` consecutive tokens of
one request times the query heads of one KV head (GQA packed), and streams the
paged KV once with an online softmax (FlashAttention-2). The grid is
``(num_tokens // BLOCK_Q + num_reqs, num_kv_heads, num_splits)``, which depends
only on the token and request counts, so uniform batches can be captured in
CUDA graphs; each program finds its request by binary search over
``query_start_loc``. When the batch has too few tiles to fill the GPU, the
committed context of each request is cut into up to ``num_splits`` chunks of at
least ``_MIN_SPLIT_KEYS`` keys (flash-decoding); a second kernel merges the
partial results by their log-sum-exp. Masked lanes are ``-inf``; all offsets
into the KV cache and the activations are int64.

Example::

    import torch
    from vllm.v1.attention.ops.triton_tree_attention import tree_attention

    nb, bs, hq, hkv, d = 8, 16, 8, 2, 64
    kv = torch.randn(nb, bs, hkv, 2 * d, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = kv.split(d, dim=-1)
    # One request: 40 committed tokens and a 3-node tree [root, a, b], a and b
    # both children of the root.
    q = torch.randn(3, hq, d, device="cuda", dtype=torch.bfloat16)
    qsl = torch.tensor([0, 3], device="cuda", dtype=torch.int32)
    seq_lens = torch.tensor([43], device="cuda", dtype=torch.int32)
    block_table = torch.arange(nb, device="cuda", dtype=torch.int32)[None]
    mask = torch.tensor([[[0b001], [0b011], [0b101]]], device="cuda",
                        dtype=torch.int32)
    is_tree = torch.ones(1, device="cuda", dtype=torch.int32)
    out = tree_attention(q, k_cache, v_cache, torch.empty_like(q), qsl, seq_lens,
                         block_table, d**-0.5, tree_mask=mask, is_tree=is_tree)
"""

import math
from dataclasses import dataclass

import torch

from vllm.triton_utils import tl, triton

# Split the committed context only when the batch has fewer tiles than the GPU
# runs at once, into at most this many chunks of at least this many keys.
_MAX_SPLITS = 32
_MIN_SPLIT_KEYS = 256
# Number of SMs assumed when the tensors are not on a GPU (interpreter runs).
_CPU_NUM_SMS = 1


def tree_attention(
    # [num_tokens, num_q_heads, head_size]
    q: torch.Tensor,
    # [num_blocks, block_size, num_kv_heads, head_size]
    key_cache: torch.Tensor,
    # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,
    # [num_tokens, num_q_heads, head_size]
    out: torch.Tensor,
    # [num_reqs + 1] int32
    query_start_loc: torch.Tensor,
    # [num_reqs] int32
    seq_lens: torch.Tensor,
    # [num_reqs, max_num_blocks] int32
    block_table: torch.Tensor,
    softmax_scale: float,
    # [>= num_reqs, max_tree_len, num_words] int32, or None: every row causal.
    tree_mask: torch.Tensor | None = None,
    # [>= num_reqs] int32, nonzero where the request's rows use tree_mask.
    is_tree: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Tree/causal attention of the batch's new tokens over the paged KV cache.

    Writes ``out`` (rows past ``query_start_loc[-1]`` are left untouched) and
    returns it. ``num_splits`` overrides the split-KV heuristic (tests); it may
    depend only on static sizes if the call is to be captured in a CUDA graph.
    """
    check_tree_attention_inputs(
        q, key_cache, value_cache, out, query_start_loc, seq_lens, block_table,
        tree_mask, is_tree,
    )
    num_tokens, num_q_heads, head_size = q.shape
    num_reqs = query_start_loc.shape[0] - 1
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if num_tokens == 0 or num_reqs == 0:
        return out

    cfg = _launch_config(q, num_reqs, num_q_heads // num_kv_heads, head_size)
    if num_splits is None:
        num_splits = _num_splits(q.device, num_tokens, num_reqs, num_kv_heads, cfg)
    num_tiles = num_tokens // cfg.block_q + num_reqs
    has_tree = tree_mask is not None
    if not has_tree:
        tree_mask = is_tree = query_start_loc  # never read
    part_out, part_lse = _partial_buffers(q, num_splits, cfg.head_size_padded)

    common = dict(
        NUM_QUERIES_PER_KV=num_q_heads // num_kv_heads,
        HEADS_PADDED=cfg.heads_padded,
        BLOCK_Q=cfg.block_q,
        BLOCK_M=cfg.block_m,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=cfg.head_size_padded,
        NUM_SPLITS=num_splits,
        MIN_SPLIT_KEYS=_MIN_SPLIT_KEYS,
    )
    _tree_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        out, q, key_cache, value_cache, part_out, part_lse,
        query_start_loc, seq_lens, block_table, tree_mask, is_tree,
        num_reqs, softmax_scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0),
        tree_mask.stride(0) if has_tree else 0,
        tree_mask.stride(1) if has_tree else 0,
        tree_mask.shape[1] if has_tree else 0,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        PAGE_SIZE=block_size,
        BLOCK_N=cfg.block_n,
        HAS_TREE=has_tree,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **common,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tiles, num_kv_heads)](
            out, part_out, part_lse, query_start_loc, seq_lens, num_reqs,
            out.stride(0), out.stride(1),
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            num_warps=4,
            **common,
        )
    return out


def check_tree_attention_inputs(
    q, key_cache, value_cache, out, query_start_loc, seq_lens, block_table,
    tree_mask, is_tree,
) -> None:
    """Raise ValueError on inputs ``tree_attention`` cannot serve."""
    if q.dim() != 3 or out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(
            "q and out must both be [num_tokens, num_q_heads, head_size] of one "
            f"dtype, got {tuple(q.shape)} {q.dtype} and {tuple(out.shape)} "
            f"{out.dtype}"
        )
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, "
            f"num_kv_heads, head_size], got {tuple(key_cache.shape)} and "
            f"{tuple(value_cache.shape)}"
        )
    if key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        raise ValueError(
            f"KV cache dtype {key_cache.dtype} must equal the query dtype "
            f"{q.dtype} (quantized KV caches are not supported)"
        )
    num_q_heads, head_size = q.shape[1], q.shape[2]
    if key_cache.shape[3] != head_size or num_q_heads % key_cache.shape[2]:
        raise ValueError(
            f"{num_q_heads} query heads of size {head_size} do not fit "
            f"{key_cache.shape[2]} KV heads of size {key_cache.shape[3]}"
        )
    if (q.stride(2), out.stride(2), key_cache.stride(3), value_cache.stride(3)) != (
        1, 1, 1, 1,
    ):
        raise ValueError("the head_size dimension must be contiguous")
    num_reqs = query_start_loc.shape[0] - 1
    if seq_lens.shape[0] < num_reqs or block_table.shape[0] < num_reqs:
        raise ValueError(
            f"seq_lens and block_table need {num_reqs} requests, got "
            f"{seq_lens.shape[0]} and {block_table.shape[0]}"
        )
    if (tree_mask is None) != (is_tree is None):
        raise ValueError("tree_mask and is_tree must be given together")
    if tree_mask is not None and (
        tree_mask.dim() != 3
        or tree_mask.dtype != torch.int32
        or tree_mask.shape[0] < num_reqs
        or is_tree.shape[0] < num_reqs
        or tree_mask.stride(2) != 1
    ):
        raise ValueError(
            "tree_mask must be int32 [>= num_reqs, max_tree_len, num_words] with "
            f"contiguous words and is_tree [>= num_reqs]; got {tuple(tree_mask.shape)}"
            f" {tree_mask.dtype} and {tuple(is_tree.shape)} for {num_reqs} requests"
        )


@dataclass(frozen=True)
class _LaunchConfig:
    heads_padded: int  # query heads per KV head, padded to a power of 2
    block_q: int  # query tokens per tile
    head_size_padded: int
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int

    @property
    def block_m(self) -> int:
        return self.block_q * self.heads_padded


def _launch_config(
    q: torch.Tensor, num_reqs: int, num_queries_per_kv: int, head_size: int
) -> _LaunchConfig:
    """Tile sizes from static sizes only (token and request counts, heads)."""
    heads_padded = triton.next_power_of_2(num_queries_per_kv)
    head_size_padded = max(16, triton.next_power_of_2(head_size))
    max_block_m = 128 if head_size_padded <= 128 else 64
    # Rows per tile: the average query length, at least 16 rows for tl.dot.
    avg_q_len = triton.cdiv(q.shape[0], num_reqs)
    block_q = min(
        max(1, max_block_m // heads_padded), triton.next_power_of_2(avg_q_len)
    )
    block_q = max(block_q, triton.cdiv(16, heads_padded))
    block_m = block_q * heads_padded
    block_n = 64 if head_size_padded <= 128 else 32
    num_warps = 8 if block_m * head_size_padded >= 128 * 128 else 4
    num_stages = 3 if head_size_padded <= 128 and block_m <= 64 else 2
    return _LaunchConfig(
        heads_padded, block_q, head_size_padded, block_n, num_warps, num_stages
    )


def _num_splits(
    device: torch.device, num_tokens: int, num_reqs: int, num_kv_heads: int,
    cfg: _LaunchConfig,
) -> int:
    """Most splits whose programs still fit in one wave of the GPU."""
    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        num_sms = _CPU_NUM_SMS
    capacity = num_sms * (2 if cfg.num_warps <= 4 else 1)
    programs = max(num_reqs, triton.cdiv(num_tokens, cfg.block_q)) * num_kv_heads
    return max(1, min(_MAX_SPLITS, capacity // programs))


def _partial_buffers(
    q: torch.Tensor, num_splits: int, head_size_padded: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 per-split outputs and log2-sum-exps (unused without splits)."""
    num_tokens, num_q_heads = q.shape[0], q.shape[1]
    if num_splits == 1:
        dummy = q.new_empty((1, 1, 1, 1), dtype=torch.float32)
        return dummy, dummy[0]
    part_out = q.new_empty(
        (num_splits, num_tokens, num_q_heads, head_size_padded), dtype=torch.float32
    )
    part_lse = q.new_empty((num_splits, num_tokens, num_q_heads), dtype=torch.float32)
    return part_out, part_lse


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, tile_idx, BLOCK_Q: tl.constexpr):
    """Largest request r with query_start_loc[r] // BLOCK_Q + r <= tile_idx.

    Request r owns tiles [qsl[r] // BLOCK_Q + r, qsl[r + 1] // BLOCK_Q + r + 1),
    which is at least cdiv(q_len, BLOCK_Q) tiles.
    """
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_idx:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _tile_rows(
    query_start_loc_ptr, seq_lens_ptr, num_reqs, tile_idx, BLOCK_Q: tl.constexpr,
    MIN_SPLIT_KEYS: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """The tile's request, its first query row, and the request's sizes."""
    req = _find_request(query_start_loc_ptr, num_reqs, tile_idx, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    row_start = (tile_idx - q_start // BLOCK_Q - req) * BLOCK_Q
    ctx_len = tl.load(seq_lens_ptr + req) - q_len
    num_active_splits = tl.minimum(
        NUM_SPLITS, tl.maximum(1, tl.cdiv(ctx_len, MIN_SPLIT_KEYS))
    )
    return req, q_start, q_len, row_start, ctx_len, num_active_splits


@triton.jit
def _load(ptrs, mask, other, USE_MASK: tl.constexpr):
    if USE_MASK:
        x = tl.load(ptrs, mask=mask, other=other)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _attend_tile(
    acc, l_i, m_i,
    q,  # [BLOCK_M, HEAD_SIZE_PADDED]
    k_cache_ptr, v_cache_ptr, block_table_row_ptr,
    key_pos,  # [BLOCK_N] KV positions of this tile
    key_valid,  # [BLOCK_N]; read only if MASKED
    visible,  # [BLOCK_M, BLOCK_N]; read only if MASKED
    kv_head_offset_k, kv_head_offset_v, qk_scale,
    stride_k_blk: tl.int64, stride_k_tok: tl.int64,
    stride_v_blk: tl.int64, stride_v_tok: tl.int64,
    PAGE_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One online-softmax step over BLOCK_N keys gathered from the paged cache.

    MASKED=False is the fast path for tiles of committed keys that every row
    sees: no key masks, and every row has a finite running max.
    """
    PAD_D: tl.constexpr = HEAD_SIZE != HEAD_SIZE_PADDED
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    d_valid = offs_d < HEAD_SIZE
    block = _load(
        block_table_row_ptr + key_pos // PAGE_SIZE, key_valid, 0, MASKED
    ).to(tl.int64)
    slot = (key_pos % PAGE_SIZE).to(tl.int64)
    # [HEAD_SIZE_PADDED, BLOCK_N]
    k = _load(
        k_cache_ptr + kv_head_offset_k + block[None, :] * stride_k_blk
        + slot[None, :] * stride_k_tok + offs_d[:, None],
        d_valid[:, None] & key_valid[None, :],
        0.0,
        MASKED or PAD_D,
    )
    # [BLOCK_N, HEAD_SIZE_PADDED]
    v = _load(
        v_cache_ptr + kv_head_offset_v + block[:, None] * stride_v_blk
        + slot[:, None] * stride_v_tok + offs_d[None, :],
        key_valid[:, None] & d_valid[None, :],
        0.0,
        MASKED or PAD_D,
    )
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        s = tl.where(visible & key_valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MASKED:
        # A row that has seen no visible key yet keeps m = -inf; shift it by 0
        # so that exp2 gives 0 instead of NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new
    p = tl.math.exp2(s - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(
        p.to(v.dtype), v, input_precision=DOT_PRECISION
    )
    return acc, l_i, m_new


@triton.jit
def _tree_attention_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_size]
    q_ptr,  # [num_tokens, num_q_heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    part_out_ptr,  # [num_splits, num_tokens, num_q_heads, HEAD_SIZE_PADDED] fp32
    part_lse_ptr,  # [num_splits, num_tokens, num_q_heads] fp32
    query_start_loc_ptr,  # [num_reqs + 1]
    seq_lens_ptr,  # [num_reqs]
    block_table_ptr,  # [num_reqs, max_num_blocks]
    tree_mask_ptr,  # [>= num_reqs, max_tree_len, num_words]
    is_tree_ptr,  # [>= num_reqs]
    num_reqs,
    qk_scale,  # softmax scale * log2(e)
    stride_q_tok: tl.int64, stride_q_head: tl.int64,
    stride_o_tok: tl.int64, stride_o_head: tl.int64,
    stride_k_blk: tl.int64, stride_k_tok: tl.int64, stride_k_head: tl.int64,
    stride_v_blk: tl.int64, stride_v_tok: tl.int64, stride_v_head: tl.int64,
    stride_bt_req: tl.int64,
    stride_mask_req: tl.int64, stride_mask_row: tl.int64,
    max_tree_len,
    stride_po_split: tl.int64, stride_po_tok: tl.int64, stride_po_head: tl.int64,
    stride_pl_split: tl.int64, stride_pl_tok: tl.int64,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MIN_SPLIT_KEYS: tl.constexpr,
    HAS_TREE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tl.static_assert(BLOCK_M == BLOCK_Q * HEADS_PADDED)
    tl.static_assert(BLOCK_M >= 16)
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req, q_start, q_len, row_start, ctx_len, num_active_splits = _tile_rows(
        query_start_loc_ptr, seq_lens_ptr, num_reqs, tile_idx, BLOCK_Q,
        MIN_SPLIT_KEYS, NUM_SPLITS,
    )
    if (row_start >= q_len) | (split >= num_active_splits):
        return

    # Row m of the tile is query row row_start + m // HEADS_PADDED (within the
    # request) for query head kv_head * NUM_QUERIES_PER_KV + m % HEADS_PADDED.
    offs_m = tl.arange(0, BLOCK_M)
    row = row_start + offs_m // HEADS_PADDED
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % HEADS_PADDED
    row_valid = (row < q_len) & (offs_m % HEADS_PADDED < NUM_QUERIES_PER_KV)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    d_valid = offs_d < HEAD_SIZE
    tok = (q_start + row).to(tl.int64)
    io_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(
        q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head
        + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )

    block_table_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt_req
    kv_head_offset_k = kv_head.to(tl.int64) * stride_k_head
    kv_head_offset_v = kv_head.to(tl.int64) * stride_v_head
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)

    # Committed keys of this split: visible to every row.
    chunk = tl.cdiv(tl.cdiv(ctx_len, num_active_splits), BLOCK_N) * BLOCK_N
    kv_lo = split * chunk
    kv_hi = tl.minimum(ctx_len, kv_lo + chunk)
    full_end = kv_lo + tl.maximum(kv_hi - kv_lo, 0) // BLOCK_N * BLOCK_N
    all_keys = tl.full([BLOCK_N], 1, dtype=tl.int1)
    all_rows = tl.full([BLOCK_M, BLOCK_N], 1, dtype=tl.int1)
    for start in range(kv_lo, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, block_table_row_ptr,
            start + offs_n, all_keys, all_rows,
            kv_head_offset_k, kv_head_offset_v, qk_scale,
            stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
            PAGE_SIZE, HEAD_SIZE, HEAD_SIZE_PADDED, DOT_PRECISION, MASKED=False,
        )
    if full_end < kv_hi:
        key_pos = full_end + offs_n
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, block_table_row_ptr,
            key_pos, key_pos < kv_hi, all_rows,
            kv_head_offset_k, kv_head_offset_v, qk_scale,
            stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
            PAGE_SIZE, HEAD_SIZE, HEAD_SIZE_PADDED, DOT_PRECISION, MASKED=True,
        )

    # The request's new tokens, on split 0: key j is visible to row i iff
    # j <= i and, on tree rows, bit j of mask row i is set.
    if split == 0:
        if HAS_TREE:
            tree_flag = tl.load(is_tree_ptr + req)
            mask_row_ptr = (
                tree_mask_ptr + req.to(tl.int64) * stride_mask_req
                + row.to(tl.int64)[:, None] * stride_mask_row
            )
            mask_rows = (tree_flag != 0) & row_valid & (row < max_tree_len)
        num_new_keys = tl.minimum(q_len, row_start + BLOCK_Q)
        for start in range(0, num_new_keys, BLOCK_N):
            j = start + offs_n
            visible = j[None, :] <= row[:, None]
            if HAS_TREE:
                words = tl.load(
                    mask_row_ptr + (j // 32)[None, :],
                    mask=mask_rows[:, None] & visible,
                    other=0,
                )
                bit = (words >> (j % 32)[None, :]) & 1
                visible = visible & ((bit != 0) | (tree_flag == 0))
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, block_table_row_ptr,
                ctx_len + j, j < q_len, visible,
                kv_head_offset_k, kv_head_offset_v, qk_scale,
                stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
                PAGE_SIZE, HEAD_SIZE, HEAD_SIZE_PADDED, DOT_PRECISION, MASKED=True,
            )

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_ptrs = (
        out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head
        + offs_d[None, :]
    )
    if NUM_SPLITS == 1:
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=io_mask)
    elif num_active_splits == 1:
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        tl.store(
            part_out_ptr + split * stride_po_split + tok[:, None] * stride_po_tok
            + head[:, None] * stride_po_head + offs_d[None, :],
            o,
            mask=io_mask,
        )
        tl.store(
            part_lse_ptr + split * stride_pl_split + tok * stride_pl_tok + head,
            m_i + tl.math.log2(l_i),
            mask=row_valid,
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_size]
    part_out_ptr,  # [num_splits, num_tokens, num_q_heads, HEAD_SIZE_PADDED] fp32
    part_lse_ptr,  # [num_splits, num_tokens, num_q_heads] fp32
    query_start_loc_ptr,  # [num_reqs + 1]
    seq_lens_ptr,  # [num_reqs]
    num_reqs,
    stride_o_tok: tl.int64, stride_o_head: tl.int64,
    stride_po_split: tl.int64, stride_po_tok: tl.int64, stride_po_head: tl.int64,
    stride_pl_split: tl.int64, stride_pl_tok: tl.int64,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MIN_SPLIT_KEYS: tl.constexpr,
):
    """Merge the split partial outputs of one query tile by log-sum-exp."""
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    req, q_start, q_len, row_start, ctx_len, num_active_splits = _tile_rows(
        query_start_loc_ptr, seq_lens_ptr, num_reqs, tile_idx, BLOCK_Q,
        MIN_SPLIT_KEYS, NUM_SPLITS,
    )
    # With one active split the main kernel wrote the output directly.
    if (row_start >= q_len) | (num_active_splits == 1):
        return

    offs_m = tl.arange(0, BLOCK_M)
    row = row_start + offs_m // HEADS_PADDED
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % HEADS_PADDED
    row_valid = (row < q_len) & (offs_m % HEADS_PADDED < NUM_QUERIES_PER_KV)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    io_mask = row_valid[:, None] & (offs_d < HEAD_SIZE)[None, :]
    tok = (q_start + row).to(tl.int64)
    lse_ptr = part_lse_ptr + tok * stride_pl_tok + head
    po_ptr = (
        part_out_ptr + tok[:, None] * stride_po_tok + head[:, None] * stride_po_head
        + offs_d[None, :]
    )

    # Split 0 holds every row's own token, so its lse is finite on valid rows.
    lse_max = tl.load(lse_ptr, mask=row_valid, other=0.0)
    for s in range(1, num_active_splits):
        lse_s = tl.load(lse_ptr + s * stride_pl_split, mask=row_valid, other=0.0)
        lse_max = tl.maximum(lse_max, lse_s)
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)
    for s in range(0, num_active_splits):
        lse_s = tl.load(lse_ptr + s * stride_pl_split, mask=row_valid, other=0.0)
        w = tl.math.exp2(lse_s - lse_max)
        o_s = tl.load(po_ptr + s * stride_po_split, mask=io_mask, other=0.0)
        denom += w
        acc += w[:, None] * o_s
    o = acc / denom[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head
        + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )
