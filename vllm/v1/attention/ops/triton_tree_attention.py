# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Paged attention with a per-request tree (ancestor) mask, in Triton.

Every request of a batch owns its last ``q_len`` tokens as query rows. Query row
``i`` of a request with ``seq_len`` tokens in the KV cache and
``ctx_len = seq_len - q_len`` committed tokens sees

* every committed token (KV positions ``0 .. ctx_len - 1``), and
* among the request's own new tokens (KV positions ``ctx_len + j``):
  - causal rows (decodes, chains, prefills): every ``j <= i``;
  - tree rows: every ``j <= i`` before the tree's root, and every later ``j``
    whose bit is set in the row's ancestor mask.

This is tree verification for speculative decoding (DDTree, SpecInfer): the new
tokens are ``[root, node_1, ..., node_B]`` flattened parent-before-child, with KV
slots following the flattened index, and a node must see only its ancestors.

Mask layout (``vllm/v1/attention/ops/tree_mask.py``):
``tree_mask[r, i, j // 32]`` bit ``j % 32`` is set iff tree token ``j`` is an
ancestor of tree token ``i`` or ``i`` itself. ``is_tree[r] = 0`` makes request
``r`` causal; ``is_tree[r] = 1 + s`` puts its tree's root at query row ``s``:
rows ``0 .. s - 1`` (prompt tokens scheduled in the same step) are causal, and
row ``s + t`` is tree token ``t``, using mask row ``t`` and bits ``0 .. t`` for
new tokens ``s .. s + t`` (a prefix of a parent-before-child node list is a
tree, so a request may verify fewer rows than its mask holds).

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
one request times the query heads of one KV head (GQA packed, ``BLOCK_M`` rows),
and streams the paged KV once with an online softmax (FlashAttention-2, exp2 of
log2(e)-prescaled scores) on the tensor cores. The grid is
``(num_tokens // BLOCK_Q + num_reqs, num_kv_heads, num_splits)``, which depends
only on the token and request counts, so uniform batches can be captured in
CUDA graphs; each program finds its request by binary search over
``query_start_loc``. Committed keys in whole ``BLOCK_N`` blocks need no mask;
only the last partial block and the request's new keys (the tree) are masked.
The KV loop is software-pipelined: each key's page comes from the block table,
an indirect load, so Triton's pipeliner needs ``num_stages = 2 * depth + 1`` for
``depth`` K/V blocks in flight (5 stages: loads two blocks ahead).
When the batch has too few tiles to fill the GPU, the keys a tile sees (the
committed context and the new keys up to its last row) are cut into equal runs of
whole key blocks, one per ``min_split_keys`` keys and at most ``num_splits``
(flash-decoding), and a second kernel merges the partial results by their
log-sum-exp, one program per (token, query head). Masked lanes are ``-inf``; all
offsets into the KV cache and the activations are int64. ``TreeAttentionConfig``
overrides the tile shape.

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

import functools
import math
from dataclasses import dataclass

import torch

from vllm.triton_utils import tl, triton
from vllm.utils.math_utils import cdiv, next_power_of_2

# Split the keys of a tile only when the batch has too few tiles to fill the
# GPU, into at most this many chunks.
_MAX_SPLITS = 32
# Cost model for the split count (_num_splits): fixed cost of one program
# and of the merge, as fractions of one unsplit tile at a few thousand keys.
_PROGRAM_OVERHEAD = 0.05
_MERGE_OVERHEAD = 0.05
# Number of SMs assumed when the tensors are not on a GPU (interpreter runs).
_CPU_NUM_SMS = 1
_LOG2_E = math.log2(math.e)
# Shared memory per SM on Hopper and per program beyond Q and K/V (block-table
# and mask-word buffers, the 1 KB the driver reserves), for the occupancy estimate.
_SMEM_PER_SM = 228 * 1024
_SMEM_EXTRA = 5 * 1024


@dataclass(frozen=True)
class TreeAttentionConfig:
    """Tile shape and launch parameters of the attention kernel.

    ``block_m`` query rows (tokens x query heads of one KV head) per program and
    ``block_n`` keys per step; ``num_stages`` is Triton's pipelining depth: the
    paged K/V loads sit behind a block-table load, so ``2 * d + 1`` stages keep
    ``d`` blocks in flight. ``min_split_keys`` is the smallest run of keys
    a split takes (flash-decoding).
    """

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 5
    min_split_keys: int = 64

    def __post_init__(self):
        def pow2(x: int) -> bool:
            return x > 0 and x & (x - 1) == 0

        if not (
            pow2(self.block_m)
            and pow2(self.block_n)
            and self.block_n >= 32
            and pow2(self.num_warps)
            and self.num_stages >= 1
            and self.min_split_keys >= 1
        ):
            raise ValueError(
                f"bad TreeAttentionConfig {self!r}: block_m, block_n (>= 32) and "
                "num_warps must be powers of 2, num_stages and min_split_keys >= 1"
            )

    def __str__(self) -> str:
        return (
            f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"
            f"k{self.min_split_keys}"
        )


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
    config: TreeAttentionConfig | None = None,
) -> torch.Tensor:
    """Tree/causal attention of the batch's new tokens over the paged KV cache.

    Writes ``out`` (rows past ``query_start_loc[-1]`` are left untouched) and
    returns it. ``num_splits`` overrides the split-KV heuristic (the warm-up
    compiles each variant with its own); it may
    depend only on static sizes if the call is to be captured in a CUDA graph.
    ``config`` overrides the tile shape chosen from the static sizes.
    """
    check_tree_attention_inputs(
        q,
        key_cache,
        value_cache,
        out,
        query_start_loc,
        seq_lens,
        block_table,
        tree_mask,
        is_tree,
    )
    num_tokens, num_q_heads, head_size = q.shape
    num_reqs = query_start_loc.shape[0] - 1
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if num_tokens == 0 or num_reqs == 0:
        return out

    plan = plan_tree_attention(
        num_tokens,
        num_reqs,
        num_q_heads,
        num_kv_heads,
        head_size,
        num_sms(q.device),
        config,
        num_splits,
        q.element_size(),
    )
    cfg, num_splits = plan.config, plan.num_splits
    num_tiles = num_tokens // plan.block_q + num_reqs
    has_tree = tree_mask is not None
    if has_tree:
        mask_strides = tree_mask.stride()[:2]
        mask_shape = tree_mask.shape[1:]
    else:
        tree_mask = is_tree = query_start_loc  # never read
        mask_strides = mask_shape = (0, 0)
    part_out, part_lse = _partial_buffers(q, num_splits, plan.head_size_padded)
    # One stride() call per tensor: the launch runs from Python in every layer
    # of a step outside CUDA graphs.
    q_strides, out_strides = q.stride(), out.stride()
    k_strides, v_strides = key_cache.stride(), value_cache.stride()
    part_out_strides, part_lse_strides = part_out.stride(), part_lse.stride()

    _tree_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        out,
        q,
        key_cache,
        value_cache,
        part_out,
        part_lse,
        query_start_loc,
        seq_lens,
        block_table,
        tree_mask,
        is_tree,
        num_reqs,
        num_splits,
        softmax_scale * _LOG2_E,
        q_strides[0],
        q_strides[1],
        out_strides[0],
        out_strides[1],
        k_strides[0],
        k_strides[1],
        k_strides[2],
        v_strides[0],
        v_strides[1],
        v_strides[2],
        block_table.stride(0),
        mask_strides[0],
        mask_strides[1],
        mask_shape[0],
        mask_shape[1],
        part_out_strides[0],
        part_out_strides[1],
        part_out_strides[2],
        part_lse_strides[0],
        part_lse_strides[1],
        NUM_QUERIES_PER_KV=num_q_heads // num_kv_heads,
        HEADS_PADDED=plan.heads_padded,
        BLOCK_Q=plan.block_q,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=plan.head_size_padded,
        PAGE_SIZE=block_size,
        MIN_SPLIT_KEYS=cfg.min_split_keys,
        HAS_TREE=has_tree,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        splits_padded = next_power_of_2(num_splits)
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            out,
            part_out,
            part_lse,
            query_start_loc,
            num_reqs,
            num_splits,
            out_strides[0],
            out_strides[1],
            part_out_strides[0],
            part_out_strides[1],
            part_out_strides[2],
            part_lse_strides[0],
            part_lse_strides[1],
            HEAD_SIZE=head_size,
            HEAD_SIZE_PADDED=plan.head_size_padded,
            SPLITS_PADDED=splits_padded,
            num_warps=4 if splits_padded * plan.head_size_padded >= 4096 else 2,
        )
    return out


def check_tree_attention_inputs(
    q,
    key_cache,
    value_cache,
    out,
    query_start_loc,
    seq_lens,
    block_table,
    tree_mask,
    is_tree,
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
        1,
        1,
        1,
        1,
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
class TreeAttentionPlan:
    """How ``tree_attention`` launches for given static sizes."""

    config: TreeAttentionConfig  # block_m as launched
    num_splits: int
    heads_padded: int  # query heads per KV head, padded to a power of 2
    head_size_padded: int

    @property
    def block_q(self) -> int:  # query tokens per tile
        return self.config.block_m // self.heads_padded


# Memoised: an eager or piecewise step calls this once per attention layer with
# the same sizes.
@functools.lru_cache(maxsize=1024)
def plan_tree_attention(
    num_tokens: int,
    num_reqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    num_sms: int,
    config: TreeAttentionConfig | None = None,
    num_splits: int | None = None,
    itemsize: int = 2,
) -> TreeAttentionPlan:
    """Tile shape and split count from static sizes only (token and request
    counts, heads, dtype size), so that a captured CUDA graph stays valid."""
    heads_padded = next_power_of_2(num_q_heads // num_kv_heads)
    head_size_padded = max(16, next_power_of_2(head_size))
    user_config = config
    if config is None:
        config = _default_config(
            num_tokens, num_reqs, heads_padded, head_size_padded, itemsize
        )
    # A tile holds whole tokens (all heads of a KV head) and >= 16 rows (tl.dot).
    block_m = max(config.block_m, heads_padded, 16)
    if block_m != config.block_m:
        config = TreeAttentionConfig(**{**config.__dict__, "block_m": block_m})
    chosen_splits = num_splits
    if num_splits is None:
        num_splits = _plan_splits(
            num_sms,
            num_tokens,
            num_reqs,
            num_kv_heads,
            config,
            heads_padded,
            head_size_padded,
            itemsize,
        )
    if user_config is None and config.num_warps == 4 and config.block_m >= 64:
        # Half-size tiles get 4 warps so that two programs share an SM; when the
        # whole grid fits on the SMs one program each anyway, 8 warps are faster
        # (measured over tile and split configurations on Hopper).
        wide = TreeAttentionConfig(**{**config.__dict__, "num_warps": 8})
        wide_splits = chosen_splits or _plan_splits(
            num_sms,
            num_tokens,
            num_reqs,
            num_kv_heads,
            wide,
            heads_padded,
            head_size_padded,
            itemsize,
        )
        tiles = cdiv(cdiv(num_tokens, num_reqs), block_m // heads_padded)
        if num_reqs * tiles * num_kv_heads * wide_splits <= num_sms:
            config, num_splits = wide, wide_splits
    return TreeAttentionPlan(config, num_splits, heads_padded, head_size_padded)


@dataclass(frozen=True)
class TreeAttentionVariant:
    """One compiled form of :func:`tree_attention`'s kernels: the tile shape,
    and whether (and into how many padded splits) a tile's keys are split, which
    adds the merge kernel and gives the split buffers token-dependent strides."""

    config: TreeAttentionConfig
    num_splits: int  # a representative of its padded class; 1 = no split

    @property
    def splits_padded(self) -> int:
        return next_power_of_2(self.num_splits) if self.num_splits > 1 else 1


def tree_attention_variants(
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    num_sms: int,
    max_num_reqs: int,
    max_num_tokens: int,
    itemsize: int = 2,
) -> list[TreeAttentionVariant]:
    """Every variant :func:`plan_tree_attention` picks for some step of up to
    ``max_num_reqs`` requests and ``max_num_tokens`` tokens.

    The plan depends on the sizes only through the average query length's tile
    shape, the tiles per request and the request count, so one query length
    per (tile shape, tiles) class stands for all of them; past the program
    count at which the split model always picks one split and the wide-warp
    rule cannot hold, larger batches add nothing (see ``_num_splits``: a split
    saves less than its per-program overhead once the grid fills
    ``(1 + overhead) / overhead`` waves)."""
    plan = plan_tree_attention.__wrapped__  # not the launch-time cache
    heads_padded = next_power_of_2(num_q_heads // num_kv_heads)
    head_size_padded = max(16, next_power_of_2(head_size))
    # Programs beyond which nothing changes: one split, never 8 wide warps.
    max_programs = num_sms * 2 * math.ceil((1 + _PROGRAM_OVERHEAD) / _PROGRAM_OVERHEAD)
    max_programs = max(max_programs, num_sms) + num_sms
    out: dict[tuple, TreeAttentionVariant] = {}
    reps: dict[tuple[TreeAttentionConfig, int], int] = {}
    for avg in range(1, max(1, max_num_tokens) + 1):
        cfg = _default_config(avg, 1, heads_padded, head_size_padded, itemsize)
        block_q = max(cfg.block_m, heads_padded, 16) // heads_padded
        reps.setdefault((cfg, cdiv(avg, block_q)), avg)
    for (_, tiles), avg in reps.items():
        per_req = tiles * num_kv_heads
        # A step of n requests averages avg tokens with as few as
        # (avg - 1) * n + 1 of them.
        fit = max_num_tokens if avg == 1 else (max_num_tokens - 1) // (avg - 1)
        last = min(max_num_reqs, max(1, fit))
        cap = max_programs // per_req + 1
        for num_reqs in range(1, min(last, cap) + 1):
            p = plan(
                num_reqs * avg,
                num_reqs,
                num_q_heads,
                num_kv_heads,
                head_size,
                num_sms,
                itemsize=itemsize,
            )
            v = TreeAttentionVariant(p.config, p.num_splits)
            out.setdefault((v.config, v.splits_padded), v)
    return sorted(out.values(), key=lambda v: (str(v.config), v.splits_padded))


def warm_up_tree_attention(
    variants: list[TreeAttentionVariant],
    q_like: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table_width: int,
    tree_mask: torch.Tensor | None,
    is_tree: torch.Tensor | None,
    softmax_scale: float,
) -> int:
    """Compile ``variants`` with the argument properties of real steps (the
    same KV cache and tree-mask tensors, dtypes, head layout and block-table
    width; Triton also specializes on integer arguments, and no argument left
    specialized depends on the step's token or request count): one request of
    16 tokens over block 0, whose contents do not matter. Returns the number
    of launches."""
    num_q_heads, head_size = q_like.shape[1], q_like.shape[2]
    device = q_like.device
    num_tokens = 16
    q = torch.zeros(
        (num_tokens, num_q_heads, head_size), dtype=q_like.dtype, device=device
    )
    out = torch.empty_like(q)
    qsl = torch.tensor([0, num_tokens], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([num_tokens], dtype=torch.int32, device=device)
    block_table = torch.zeros((1, block_table_width), dtype=torch.int32, device=device)
    for v in variants:
        tree_attention(
            q,
            key_cache,
            value_cache,
            out,
            qsl,
            seq_lens,
            block_table,
            softmax_scale,
            tree_mask=None if tree_mask is None else tree_mask[:1],
            is_tree=None if is_tree is None else is_tree[:1],
            num_splits=v.num_splits,
            config=v.config,
        )
    return len(variants)


def _plan_splits(
    num_sms: int,
    num_tokens: int,
    num_reqs: int,
    num_kv_heads: int,
    config: TreeAttentionConfig,
    heads_padded: int,
    head_size_padded: int,
    itemsize: int,
) -> int:
    return _num_splits(
        num_sms,
        num_tokens,
        num_reqs,
        num_kv_heads,
        config,
        config.block_m // heads_padded,
        _shared_bytes(config, head_size_padded) * itemsize // 2,
    )


def _default_config(
    num_tokens: int,
    num_reqs: int,
    heads_padded: int,
    head_size_padded: int,
    itemsize: int,
) -> TreeAttentionConfig:
    """Rows per tile: about the average query length, at most 128 (64 for rows
    wider than 256 bytes: head size 256, or fp32); 8 warps for 128-row tiles."""
    width = head_size_padded * itemsize // 2  # the head size in 16-bit units
    max_block_m = 128 if width <= 128 else 64
    avg_q_len = cdiv(num_tokens, num_reqs)
    block_m = min(max_block_m, heads_padded * next_power_of_2(avg_q_len))
    block_n = 64 if width <= 128 else 32
    return TreeAttentionConfig(
        block_m=block_m,
        block_n=block_n,
        num_warps=8 if block_m * width >= 128 * 128 else 4,
        num_stages=5,
    )


def _shared_bytes(config: TreeAttentionConfig, head_size_padded: int) -> int:
    """Shared memory of the KV loop in 16-bit types: Q and the K/V buffers in
    flight (an indirect load takes half the pipeline stages)."""
    kv_buffers = (config.num_stages - 1) // 2 + 1
    q_tile = config.block_m * head_size_padded
    kv_block = 2 * config.block_n * head_size_padded
    return 2 * (q_tile + kv_buffers * kv_block)


def _num_splits(
    num_sms: int,
    num_tokens: int,
    num_reqs: int,
    num_kv_heads: int,
    config: TreeAttentionConfig,
    block_q: int,
    shared_bytes: int,
) -> int:
    """Split count with the least modelled time: programs run in waves of
    ``capacity``; a split program costs 1 / splits of a tile plus a fixed
    overhead, and splitting adds a merge."""
    per_sm = min(
        _SMEM_PER_SM // (shared_bytes + _SMEM_EXTRA), 2 if config.num_warps <= 4 else 1
    )
    capacity = num_sms * max(1, per_sm)
    # Tiles of requests of the average query length; a partial tile costs a
    # whole one.
    tiles_per_req = cdiv(cdiv(num_tokens, num_reqs), block_q)
    programs = num_reqs * tiles_per_req * num_kv_heads

    def cost(splits: int) -> float:
        waves = cdiv(programs * splits, capacity)
        return waves * (1 / splits + _PROGRAM_OVERHEAD) + _MERGE_OVERHEAD * (splits > 1)

    return min(range(1, _MAX_SPLITS + 1), key=cost)


@functools.lru_cache(maxsize=64)
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _CPU_NUM_SMS


@functools.lru_cache(maxsize=64)
def _unused_partial_buffers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' split-buffer arguments when there are no splits (never
    read or written), allocated once per device."""
    dummy = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=device)
    return dummy, dummy[0]


def _partial_buffers(
    q: torch.Tensor, num_splits: int, head_size_padded: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 per-split outputs and log2-sum-exps (unused without splits)."""
    num_tokens, num_q_heads = q.shape[0], q.shape[1]
    if num_splits == 1:
        return _unused_partial_buffers(q.device)
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
def _load(ptrs, mask, other, USE_MASK: tl.constexpr):
    if USE_MASK:
        x = tl.load(ptrs, mask=mask, other=other)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _load_kv_block(
    k_head_ptr,
    v_head_ptr,  # the caches at this KV head
    block_table_row_ptr,
    key_pos,  # [BLOCK_N] KV positions of this block
    key_valid,  # [BLOCK_N]; read only if MASKED
    stride_k_blk: tl.int64,
    stride_k_tok: tl.int64,
    stride_v_blk: tl.int64,
    stride_v_tok: tl.int64,
    PAGE_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    MASKED: tl.constexpr,
):
    """K and V [BLOCK_N, HEAD_SIZE_PADDED] of BLOCK_N keys of the paged cache:
    one block-table entry per key gives the key's page, its slot the row."""
    PAD_D: tl.constexpr = HEAD_SIZE != HEAD_SIZE_PADDED
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    block = _load(block_table_row_ptr + key_pos // PAGE_SIZE, key_valid, 0, MASKED).to(
        tl.int64
    )
    slot = (key_pos % PAGE_SIZE).to(tl.int64)
    kv_mask = key_valid[:, None] & (offs_d < HEAD_SIZE)[None, :]
    k = _load(
        k_head_ptr
        + (block * stride_k_blk + slot * stride_k_tok)[:, None]
        + offs_d[None, :],
        kv_mask,
        0.0,
        MASKED or PAD_D,
    )
    v = _load(
        v_head_ptr
        + (block * stride_v_blk + slot * stride_v_tok)[:, None]
        + offs_d[None, :],
        kv_mask,
        0.0,
        MASKED or PAD_D,
    )
    return k, v


@triton.jit
def _softmax_step(
    acc,
    l_i,
    m_i,
    s,  # [BLOCK_M, BLOCK_N] raw scores, -inf where masked
    v,  # [BLOCK_N, HEAD_SIZE_PADDED]
    qk_scale,
    DOT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Online-softmax update of (acc, l, m) with one block of scores.

    MASKED=False is the fast path for blocks that every row sees: every row
    has a finite running max.
    """
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    if MASKED:
        # A row that has seen no visible key yet keeps m = -inf; shift it by 0
        # so that exp2 gives 0 instead of NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new
    p = tl.math.exp2(s * qk_scale - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _mask_scores(
    s,  # [BLOCK_M, BLOCK_N]
    row,  # [BLOCK_M] query row within the request
    j,  # [BLOCK_N] new-token index of each key (negative: committed key)
    key_valid,  # [BLOCK_N]
    mask_row_ptr,  # [BLOCK_M] pointers to the rows' first mask word
    tree_row,  # [BLOCK_M] rows that read the mask
    tree_start,  # the request's query row of the tree's root
    w_first,  # mask word of the block's first key with j >= tree_start
    num_words,
    HAS_TREE: tl.constexpr,
):
    """-inf where key j is not visible to the row: j > row or, on a tree row,
    bit j - tree_start of the row's ancestor mask is clear. Committed keys
    (j < 0) and the new keys before the root are visible to every later row.
    The block's keys span at most BLOCK_N // 32 + 1 mask words; each row
    loads those words, not one word per key."""
    s = tl.where((j[None, :] <= row[:, None]) & key_valid[None, :], s, float("-inf"))
    if HAS_TREE:
        jt = j - tree_start  # the key's tree token, negative before the root
        jc = tl.maximum(jt, 0)
        # Keys before the root match no word. Masking s word by word keeps no
        # [BLOCK_M, BLOCK_N] temporaries alive (registers).
        word_of_key = tl.where(jt < 0, -1, jc // 32 - w_first)
        for w in tl.static_range(s.shape[1] // 32 + 1):
            word = tl.load(
                mask_row_ptr + w_first + w,
                mask=tree_row & (w_first + w < num_words),
                other=0,
            )
            hidden = ((word[:, None] >> (jc % 32)[None, :]) & 1) == 0
            s = tl.where(
                (word_of_key == w)[None, :] & tree_row[:, None] & hidden,
                float("-inf"),
                s,
            )
    return s


# Sizes that change from step to step or between batch shapes stay out of
# the kernels' specialisation (fewer compiles; one binary per tile shape).
# The split buffers' log-sum-exp stride is num_tokens * num_q_heads:
# unspecialized, so that a step's token count never selects a variant of its
# own (it addresses scalars, no vector loads).
_MAIN_UNSPECIALIZED = ("num_reqs", "num_splits", "stride_pl_split")
_MERGE_UNSPECIALIZED = ("num_reqs", "num_splits", "stride_pl_split")


@triton.jit(do_not_specialize=_MAIN_UNSPECIALIZED)
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
    num_splits,
    qk_scale,  # softmax scale * log2(e)
    stride_q_tok: tl.int64,
    stride_q_head: tl.int64,
    stride_o_tok: tl.int64,
    stride_o_head: tl.int64,
    stride_k_blk: tl.int64,
    stride_k_tok: tl.int64,
    stride_k_head: tl.int64,
    stride_v_blk: tl.int64,
    stride_v_tok: tl.int64,
    stride_v_head: tl.int64,
    stride_bt_req: tl.int64,
    stride_mask_req: tl.int64,
    stride_mask_row: tl.int64,
    max_tree_len,
    num_words,
    stride_po_split: tl.int64,
    stride_po_tok: tl.int64,
    stride_po_head: tl.int64,
    stride_pl_split: tl.int64,
    stride_pl_tok: tl.int64,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MIN_SPLIT_KEYS: tl.constexpr,
    HAS_TREE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tl.static_assert(BLOCK_M == BLOCK_Q * HEADS_PADDED)
    tl.static_assert(BLOCK_M >= 16)
    tl.static_assert(BLOCK_N % 32 == 0)
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = _find_request(query_start_loc_ptr, num_reqs, tile_idx, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    row_start = (tile_idx - q_start // BLOCK_Q - req) * BLOCK_Q
    if row_start >= q_len:
        return

    # Row m of the tile is query row row_start + m // HEADS_PADDED (within the
    # request) for query head kv_head * NUM_QUERIES_PER_KV + m % HEADS_PADDED.
    offs_m = tl.arange(0, BLOCK_M)
    row = row_start + offs_m // HEADS_PADDED
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % HEADS_PADDED
    row_valid = (row < q_len) & (offs_m % HEADS_PADDED < NUM_QUERIES_PER_KV)
    tok = (q_start + row).to(tl.int64)

    ctx_len = tl.load(seq_lens_ptr + req) - q_len
    # The tile's keys: the committed ones, then the new ones up to its last
    # row. Splits take equal runs of whole BLOCK_N blocks of them, so that the
    # masked new keys spread over the splits instead of lengthening the last.
    kv_end = ctx_len + tl.minimum(q_len, row_start + BLOCK_Q)
    # At least one block (and one active split) even for a malformed seq_len.
    num_kv_blocks = tl.maximum(tl.cdiv(kv_end, BLOCK_N), 1)
    split_blocks = tl.cdiv(
        num_kv_blocks,
        tl.minimum(num_splits, tl.maximum(1, tl.cdiv(kv_end, MIN_SPLIT_KEYS))),
    )
    num_active_splits = tl.cdiv(num_kv_blocks, split_blocks)
    if split >= num_active_splits:
        # Nothing to attend: an empty partial that the merge skips.
        tl.store(
            part_lse_ptr + split * stride_pl_split + tok * stride_pl_tok + head,
            tl.full([BLOCK_M], float("-inf"), dtype=tl.float32),
            mask=row_valid,
        )
        return

    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    io_mask = row_valid[:, None] & (offs_d < HEAD_SIZE)[None, :]
    q = tl.load(
        q_ptr
        + tok[:, None] * stride_q_tok
        + head[:, None] * stride_q_head
        + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )

    block_table_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt_req
    k_head_ptr = k_cache_ptr + kv_head.to(tl.int64) * stride_k_head
    v_head_ptr = v_cache_ptr + kv_head.to(tl.int64) * stride_v_head
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)

    kv_lo = split * split_blocks * BLOCK_N
    kv_hi = tl.minimum(kv_end, kv_lo + split_blocks * BLOCK_N)
    # Committed keys of this split in whole blocks: visible to every row.
    full_end = (
        kv_lo + tl.maximum(tl.minimum(kv_hi, ctx_len) - kv_lo, 0) // BLOCK_N * BLOCK_N
    )
    all_keys = tl.full([BLOCK_N], 1, dtype=tl.int1)  # masks only padded dims
    for start in range(kv_lo, full_end, BLOCK_N):
        k, v = _load_kv_block(
            k_head_ptr,
            v_head_ptr,
            block_table_row_ptr,
            start + offs_n,
            all_keys,
            stride_k_blk,
            stride_k_tok,
            stride_v_blk,
            stride_v_tok,
            PAGE_SIZE,
            HEAD_SIZE,
            HEAD_SIZE_PADDED,
            MASKED=False,
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        acc, l_i, m_i = _softmax_step(
            acc, l_i, m_i, s, v, qk_scale, DOT_PRECISION, MASKED=False
        )

    # Masked blocks: the rest of the split, a partial block of committed keys
    # and new keys (key j visible to row i iff j <= i and, on tree rows, bit j
    # of mask row i is set). A row may see none of a split's keys: its partial
    # log-sum-exp is then -inf, which the merge skips.
    mask_row_ptr = tree_mask_ptr
    tree_row = row_valid
    tree_start = 0
    if HAS_TREE:
        # is_tree[req] - 1: the query row of the root (rows before it, prompt
        # tokens of the same step, are causal).
        tree_flag = tl.load(is_tree_ptr + req)
        tree_start = tl.maximum(tree_flag - 1, 0)
        tree_idx = row - tree_start
        mask_row_ptr = (
            tree_mask_ptr
            + req.to(tl.int64) * stride_mask_req
            + tl.maximum(tree_idx, 0).to(tl.int64) * stride_mask_row
        )
        tree_row = (
            (tree_flag != 0) & row_valid & (tree_idx >= 0) & (tree_idx < max_tree_len)
        )
    for start in range(full_end, kv_hi, BLOCK_N):
        key_pos = start + offs_n
        key_valid = key_pos < kv_hi
        k, v = _load_kv_block(
            k_head_ptr,
            v_head_ptr,
            block_table_row_ptr,
            key_pos,
            key_valid,
            stride_k_blk,
            stride_k_tok,
            stride_v_blk,
            stride_v_tok,
            PAGE_SIZE,
            HEAD_SIZE,
            HEAD_SIZE_PADDED,
            MASKED=True,
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s = _mask_scores(
            s,
            row,
            key_pos - ctx_len,
            key_valid,
            mask_row_ptr,
            tree_row,
            tree_start,
            tl.maximum(start - ctx_len - tree_start, 0) // 32,
            num_words,
            HAS_TREE,
        )
        acc, l_i, m_i = _softmax_step(
            acc, l_i, m_i, s, v, qk_scale, DOT_PRECISION, MASKED=True
        )

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if num_splits == 1:
        tl.store(
            out_ptr
            + tok[:, None] * stride_o_tok
            + head[:, None] * stride_o_head
            + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )
    else:
        tl.store(
            part_out_ptr
            + split * stride_po_split
            + tok[:, None] * stride_po_tok
            + head[:, None] * stride_po_head
            + offs_d[None, :],
            o,
            mask=io_mask,
        )
        tl.store(
            part_lse_ptr + split * stride_pl_split + tok * stride_pl_tok + head,
            m_i + tl.math.log2(l_i),
            mask=row_valid,
        )


@triton.jit(do_not_specialize=_MERGE_UNSPECIALIZED)
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_size]
    part_out_ptr,  # [num_splits, num_tokens, num_q_heads, HEAD_SIZE_PADDED] fp32
    part_lse_ptr,  # [num_splits, num_tokens, num_q_heads] fp32
    query_start_loc_ptr,  # [num_reqs + 1]
    num_reqs,
    num_splits,
    stride_o_tok: tl.int64,
    stride_o_head: tl.int64,
    stride_po_split: tl.int64,
    stride_po_tok: tl.int64,
    stride_po_head: tl.int64,
    stride_pl_split: tl.int64,
    stride_pl_tok: tl.int64,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,
):
    """Merge one (token, query head)'s split partial outputs by log-sum-exp.

    Every split wrote a log2-sum-exp for the row (-inf when it saw no key); the
    split holding the row's own key has a finite one.
    """
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if tok >= tl.load(query_start_loc_ptr + num_reqs):
        return
    offs_s = tl.arange(0, SPLITS_PADDED)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    lse = tl.load(
        part_lse_ptr + offs_s * stride_pl_split + tok * stride_pl_tok + head,
        mask=offs_s < num_splits,
        other=float("-inf"),
    )
    w = tl.math.exp2(lse - tl.max(lse, axis=0))
    # [SPLITS_PADDED, HEAD_SIZE_PADDED]
    o = tl.load(
        part_out_ptr
        + offs_s[:, None] * stride_po_split
        + tok * stride_po_tok
        + head * stride_po_head
        + offs_d[None, :],
        mask=(lse > float("-inf"))[:, None] & (offs_d < HEAD_SIZE)[None, :],
        other=0.0,
    )
    o = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
    tl.store(
        out_ptr + tok * stride_o_tok + head * stride_o_head + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_SIZE,
    )
