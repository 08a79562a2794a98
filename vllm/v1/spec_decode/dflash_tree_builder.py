# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Batched GPU construction of DDTree draft trees from DFlash per-position logits.

DDTree (Ringel & Romano, "Accelerating Speculative Decoding with Block Diffusion Draft
Trees", 2026) drafts one block with a DFlash block-diffusion drafter, which yields
independent per-position distributions q_1..q_D. The surrogate probability of a prefix
y_1..y_d is prod_i q_i(y_i), and the expected acceptance length of a tree is the sum
of its nodes' probabilities, so the best tree of ``budget`` nodes is the set of the
``budget`` most probable prefixes. The paper pops a heap on the CPU; here the same
node set is found on the GPU with fixed shapes and no host sync.
"""

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vllm.triton_utils import tl, triton
from vllm.utils.math_utils import cdiv, next_power_of_2
from vllm.v1.attention.ops.tree_mask import num_mask_words


@dataclass
class DDTree:
    """Draft trees of a batch, one per request, nodes in best-first order.

    Node order is canonical: higher surrogate probability first, parents before
    children, so the first b nodes of a tree form the best tree of budget b. A
    request whose drafter offers fewer than ``budget`` prefixes of nonzero
    probability gets padding nodes: token -1, parent 0 (root), depth 0.
    """

    # [num_reqs, budget] int64; -1 on padding nodes.
    token_ids: torch.Tensor
    # [num_reqs, budget] int32; 0 = root, i = node i (1-based), always < own index.
    parent_ids: torch.Tensor
    # [num_reqs, budget] int32; 1..depth, 0 on padding nodes.
    depths: torch.Tensor
    # [num_reqs, budget + 1, num_mask_words(budget)] int32, bit-packed
    # ancestor-or-self mask over [root, node_1, ..., node_budget]; layout in
    # vllm/v1/attention/ops/tree_mask.py.
    attn_mask: torch.Tensor
    # [num_reqs] int32; number of real (non-padding) nodes.
    num_nodes: torch.Tensor
    # [num_reqs, budget] float32: each node's surrogate log-probability (the sum
    # of its path's per-position log-probs), non-increasing along the nodes; -inf
    # on padding nodes. The batch-wide budget ranks nodes by it. None on trees
    # made by hand.
    log_probs: torch.Tensor | None = None

    @property
    def budget(self) -> int:
        return self.token_ids.shape[1]

    @classmethod
    def empty(cls, num_reqs: int, budget: int, device: torch.device) -> "DDTree":
        """Uninitialised trees of ``num_reqs`` requests (a builder output)."""
        return cls(
            token_ids=torch.empty(num_reqs, budget, dtype=torch.int64, device=device),
            parent_ids=torch.empty(num_reqs, budget, dtype=torch.int32, device=device),
            depths=torch.empty(num_reqs, budget, dtype=torch.int32, device=device),
            attn_mask=torch.empty(
                num_reqs,
                budget + 1,
                num_mask_words(budget),
                dtype=torch.int32,
                device=device,
            ),
            num_nodes=torch.empty(num_reqs, dtype=torch.int32, device=device),
            log_probs=torch.empty(num_reqs, budget, dtype=torch.float32, device=device),
        )

    def prefix(self, num_reqs: int) -> "DDTree":
        """The first ``num_reqs`` requests' trees (views)."""
        return DDTree(
            *(None if t is None else t[:num_reqs] for t in vars(self).values())
        )


MAX_BUDGET = 1024
MAX_DEPTH = 16
# Top-token search: vocab chunk per program, and most values a chunk reports.
_TOP_CHUNK = 2048
_TOP_MAX_PER_CHUNK = 64
# Candidate keys kept per position when more than ``cap`` reach the threshold.
# Crowded rows (a trained drafter's best tokens at low BPE ids) bring a few
# hundred: at most 362 on the trained pair's drafter (vocabulary 4096, budgets
# 15-127) and 558 on bench_tree_ops' crowded rows (151936 ids, 128 tokens).
_TOP_MIN_SPILL = 2048
# The candidate sort's classes, each one compile for every num_top in it: 4
# warps and sorts of 16 to _TOP_NARROW_CAP keys while ``cap`` is at most
# _TOP_NARROW_CAP (num_top <= 128); above, 8 warps and sorts of a quarter to
# half of ``spill`` keys. A position with more candidates keeps its num_top
# best by a radix select first.
_TOP_NARROW_CAP = 256
_TOP_NARROW_BLOCK = 16
# Widest candidate block the tree selection sorts whole when more candidates
# enter a depth than it keeps; wider blocks (budgets above 256) find the kept
# ones by a radix select, as a sort that wide is slow to compile.
_SELECT_SORT_MAX_CAND = 2048
_INT32_MIN = -(2**31)
# Bits of a candidate's tie-break field: depth (5) | parent rank (10) | token rank (10).
_RANK_BITS = 10
_INVALID_KEY = -(2**63)


def build_ddtree(
    draft_logits: torch.Tensor, budget: int, out: DDTree | None = None
) -> DDTree:
    """Build the best DDTree of ``budget`` nodes for every request of a batch.

    Args:
        draft_logits: ``[num_reqs, depth, vocab]`` per-position drafter logits (any
            float dtype; not temperature-scaled), ``depth <= 16``.
        budget: number of tree nodes per request, ``1..1024`` (the root is extra).
        out: where to write the trees (e.g. persistent buffers' first
            ``num_reqs`` rows, :meth:`DDTree.prefix`); new tensors if None.

    Returns:
        A :class:`DDTree` whose nodes are exactly the ``budget`` most probable
        prefixes under ``prod_i softmax(draft_logits[:, i])``. Ties are broken
        deterministically: shallower first, then by the parent's rank, then by the
        token's rank at its depth (logit descending, token id ascending).

    Runs as a few launches with fixed shapes and no host sync (each position's
    log-normaliser and ranked top tokens, see :func:`_ranked_top_tokens`; tree
    selection), so it can be
    captured in a CUDA graph once it has run outside the graph for this budget
    (the candidate table below is copied to the device on first use). Example::

        tree = build_ddtree(torch.randn(2, 15, 151936, device="cuda"), budget=128)
        tree.token_ids.shape  # (2, 128)
    """
    _check_build_args(draft_logits, budget)
    num_reqs, depth, vocab = draft_logits.shape
    device = draft_logits.device
    num_top = min(budget, vocab)

    tok_lp, tok_id, _ = _ranked_top_tokens(draft_logits, num_top)
    pairs = _candidate_pairs(budget, device)
    # The selection's blocks are those of the widest budget of its bucket,
    # which are this budget's own but for the candidate block; the budget and
    # its sizes are runtime arguments, so a bucket's budgets share one compile.
    top = select_bucket(budget)
    block_cand = next_power_of_2(_num_candidate_pairs(top))

    num_words = num_mask_words(budget)
    if out is None:
        tree = DDTree.empty(num_reqs, budget, device)
    else:
        _check_out(out, num_reqs, budget)
        tree = out
    block_kept = next_power_of_2(top)
    # Per-request scratch, private to the kernel: the kept keys followed by a
    # depth's surviving candidates; the kept nodes of the last depth by rank;
    # node index by (depth, rank); the ancestor jump pointers of the mask.
    keys = torch.empty(num_reqs, 2 * block_kept, dtype=torch.int64, device=device)
    par_score = torch.empty(num_reqs, budget, dtype=torch.float32, device=device)
    node_of_rank = torch.empty(
        num_reqs, depth, budget, dtype=torch.int32, device=device
    )
    jump = torch.empty(num_reqs, budget + 1, dtype=torch.int32, device=device)

    block_words = next_power_of_2(num_mask_words(top))
    block_rows = min(next_power_of_2(top + 1), max(4096 // block_words, 16))
    _ddtree_select_kernel[(num_reqs,)](
        tok_lp,
        tok_id,
        pairs,
        pairs.shape[1],
        keys,
        par_score,
        node_of_rank,
        jump,
        tree.token_ids,
        tree.parent_ids,
        tree.depths,
        tree.attn_mask,
        tree.num_nodes,
        tree.log_probs,
        depth,
        num_top,
        budget,
        num_words,
        RANK_BITS=_RANK_BITS,
        INVALID=_INVALID_KEY,
        BLOCK_KEPT=block_kept,
        BLOCK_CAND=block_cand,
        # Candidates a depth may bring before the kernel keeps only the best
        # BLOCK_KEPT of them; every one fits in the kept-key scratch. Apart
        # from BLOCK_KEPT so that a lower cap can reach that path with small
        # trees.
        CAP=block_kept,
        SORT_ALL=block_cand <= _SELECT_SORT_MAX_CAND,
        BLOCK_WORDS=block_words,
        BLOCK_ROWS=block_rows,
        JUMP_STEPS=depth.bit_length(),  # 2**steps >= depth + 1 tree tokens
        num_warps=4 if block_kept <= 128 else 8,
    )
    return tree


# One entry per (batch size, budget) an eager step meets.
@functools.lru_cache(maxsize=4096)
def _out_layout(
    num_reqs: int, budget: int
) -> tuple[tuple[str, torch.Size, torch.dtype], ...]:
    """(field, shape, dtype) of ``DDTree.empty(num_reqs, budget)``."""
    want = DDTree.empty(num_reqs, budget, torch.device("meta"))
    return tuple((name, t.shape, t.dtype) for name, t in vars(want).items())


def _check_out(out: DDTree, num_reqs: int, budget: int) -> None:
    """``out`` must look like ``DDTree.empty(num_reqs, budget)``: the kernel
    writes whole contiguous rows. (Runs on every eager step: the layout is
    cached per size.)"""
    for name, shape, dtype in _out_layout(num_reqs, budget):
        t = getattr(out, name)
        if t is None or t.shape != shape or t.dtype != dtype or not t.is_contiguous():
            got = "None" if t is None else f"{t.dtype} {tuple(t.shape)}"
            raise ValueError(
                f"out.{name} must be a contiguous {dtype} tensor of shape "
                f"{tuple(shape)}, got {got}"
            )


def _check_build_args(draft_logits: torch.Tensor, budget: int) -> None:
    if draft_logits.dim() != 3:
        raise ValueError(
            "draft_logits must be [num_reqs, depth, vocab], got shape "
            f"{tuple(draft_logits.shape)}"
        )
    if not draft_logits.is_floating_point():
        raise ValueError(
            f"draft_logits must be floating point, got {draft_logits.dtype}"
        )
    num_reqs, depth, vocab = draft_logits.shape
    if not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"draft depth must be in 1..{MAX_DEPTH}, got {depth}")
    if vocab < 1 or vocab >= 2**31:
        raise ValueError(f"vocab size must be in 1..2**31-1, got {vocab}")
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(f"budget must be an int, got {budget!r}")
    if not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget must be in 1..{MAX_BUDGET}, got {budget}")


@functools.lru_cache(maxsize=16)
def _candidate_pairs(budget: int, device: torch.device) -> torch.Tensor:
    """[2, num_pairs] int32 (parent rank i, token rank j) worth scoring at a depth.

    Parents of a depth are ranked best first and so are tokens, so the prefix (i, j)
    is beaten by the (i+1)(j+1)-1 pairs (i'<=i, j'<=j) and by the i+1 parents of
    rank <= i: if (i+1)(j+2) > budget it cannot make the top ``budget``. At depth 1
    the root is the only parent and all ``budget`` tokens can be children, hence
    the extra pair (0, budget-1). This table is built on the host once per
    (budget, device); the copy cannot happen inside a CUDA-graph capture.
    """
    pairs = [(0, budget - 1)] + [
        (i, j) for i in range(budget) for j in range(budget // (i + 1) - 1)
    ]
    return torch.tensor(pairs, dtype=torch.int32).T.contiguous().to(device)


def _num_candidate_pairs(budget: int) -> int:
    """``_candidate_pairs(budget).shape[1]``, without the table."""
    return 1 + sum(budget // (i + 1) - 1 for i in range(budget // 2))


def select_bucket(budget: int) -> int:
    """The widest budget whose tree selection compiles to the same kernel as
    ``budget``'s: budgets ``2**(k-1) + 1 .. 2**k - 1`` share one, each power of
    2 has its own (its mask rows take one more word, and its mask pass one
    more row). Within a bucket the candidate block is the widest budget's, at
    most twice a smaller budget's own; at the ``4**k - 1`` widths the
    scheduler's slots take, it is theirs."""
    if budget & (budget - 1) == 0:
        return budget
    return next_power_of_2(budget) - 1


@triton.jit
def _orderable(x):
    """float32 -> int32 whose signed order is the float order (an involution)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _from_orderable(bits):
    bits = bits.to(tl.int32)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _sort_key(score, tie):
    """Descending sort key: score first, then the smaller ``tie`` (< 2**31)."""
    hi = _orderable(score).to(tl.int64) << 32
    return hi | (0x7FFFFFFF - tie).to(tl.int64)


@triton.jit
def _key_tie(key):
    return 0x7FFFFFFF - (key & 0xFFFFFFFF)


class TopSearchPlan(NamedTuple):
    """The top-token search's sizes for one vocabulary and ``num_top``."""

    cap: int  # candidate keys sorted per position on the fast path
    spill: int  # candidate keys buffered per position (>= cap)
    chunk: int  # vocabulary entries per chunk program
    num_chunks: int
    per_chunk: int  # largest distinct values each chunk reports


def top_search_plan(vocab: int, num_top: int) -> TopSearchPlan:
    """Sizes of ``_ranked_top_tokens``' search: ``cap`` is twice ``num_top``
    rounded up to a power of 2 (at least 16), ``spill`` ``max(2 * cap, 2048)``
    (both powers of 2, ``num_top <= cap <= spill``; ``spill == cap`` would mean
    no spill sort)."""
    cap = max(2 * next_power_of_2(num_top), 16)
    spill = max(2 * cap, _TOP_MIN_SPILL)
    chunk = min(_TOP_CHUNK, max(16, next_power_of_2(cdiv(vocab, 8))))
    num_chunks = cdiv(vocab, chunk)
    per_chunk = min(
        _TOP_MAX_PER_CHUNK,
        next_power_of_2(cdiv(2 * num_top, num_chunks)),
    )
    return TopSearchPlan(cap, spill, chunk, num_chunks, per_chunk)


def top_sort_max(plan: TopSearchPlan) -> int:
    """The widest candidate sort of ``plan``'s search (one per warp class, not
    per ``cap``): a position with more candidates, at most ``spill``, keeps its
    ``num_top`` best by a radix select before it sorts."""
    narrow = plan.cap <= _TOP_NARROW_CAP
    return min(_TOP_NARROW_CAP if narrow else plan.spill // 2, plan.spill)


def _ranked_top_tokens(
    draft_logits: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each position's ``num_top`` best tokens in rank order (logit descending, id
    ascending) as float32 log-probs and ids, and the position's log-normaliser.

    Exact, deterministic, no host sync. For a vocabulary of at most ``cap``
    tokens one program per position sorts the whole row. Otherwise four
    launches, each reading the logits at most once:

    1. per vocab chunk: max and sum(exp) for the log-normaliser, and the chunk's
       ``per_chunk`` largest distinct values;
    2. per position: the log-normaliser, and a threshold: the ``num_top``-th
       largest of the reported values. At least ``num_top`` tokens reach it, and
       when no chunk holds more than ``per_chunk`` of the true top tokens it is
       the exact cut;
    3. per vocab chunk: tokens at or above the threshold are appended (atomic
       counter) to a buffer of ``spill`` keys per position;
    4. per position: the buffered keys are sorted, in the smallest power of 2
       that holds them all, from 16 (``spill / 4`` past ``num_top`` 128, at
       most ``cap``) up to 256 (``spill / 2`` past 128). Usually about
       ``num_top`` reach the threshold; more than ``cap`` reach it when a
       position's best tokens crowd into few chunks, as a trained model's
       do: a BPE vocabulary gives frequent tokens low ids (a small trained
       drafter: 68 % of positions at 15 tokens, with at most a few hundred
       candidates). Positions with more candidates than
       the widest sort first keep their ``num_top`` best buffered keys by a
       radix select over the buffer.
       If even ``spill`` overflow (many tokens tied at the cut), the program
       finds the exact cut over the row instead: a radix select (four passes,
       one byte of the cut each), then one pass for the tokens above it and
       the ties at it. Slow (one program streams the row five times), but
       exact.

    ``cap`` and ``spill`` come from :func:`top_search_plan`.
    """
    num_reqs, depth, vocab = draft_logits.shape
    rows = num_reqs * depth
    device = draft_logits.device
    logits = draft_logits.reshape(rows, vocab)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    plan = top_search_plan(vocab, num_top)
    cap, spill, chunk, num_chunks, per_chunk = plan
    tok_lp = torch.empty(num_reqs, depth, num_top, dtype=torch.float32, device=device)
    tok_id = torch.empty(num_reqs, depth, num_top, dtype=torch.int64, device=device)
    lse = torch.empty(num_reqs, depth, dtype=torch.float32, device=device)
    if vocab <= cap:
        block = next_power_of_2(vocab)
        _rank_row_kernel[(rows,)](
            logits,
            logits.stride(0),
            tok_lp,
            tok_id,
            lse,
            vocab,
            num_top,
            BLOCK=block,
            INVALID=_INVALID_KEY,
            INT32_MIN=_INT32_MIN,
            num_warps=4 if block <= 256 else 8,
        )
        return tok_lp, tok_id, lse

    chunk_max = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    chunk_sum = torch.empty_like(chunk_max)
    chunk_top = torch.empty(
        rows, num_chunks * per_chunk, dtype=torch.int32, device=device
    )
    _chunk_stats_kernel[(rows, num_chunks)](
        logits,
        logits.stride(0),
        chunk_max,
        chunk_sum,
        chunk_top,
        vocab,
        num_chunks,
        CHUNK=chunk,
        PER_CHUNK=per_chunk,
        INT32_MIN=_INT32_MIN,
    )
    threshold = torch.empty(rows, dtype=torch.int32, device=device)
    count = torch.empty(rows, dtype=torch.int32, device=device)
    _top_threshold_kernel[(rows,)](
        chunk_max,
        chunk_sum,
        chunk_top,
        num_chunks,
        num_chunks * per_chunk,
        lse,
        threshold,
        count,
        num_top,
        BLOCK_CHUNKS=next_power_of_2(num_chunks),
        BLOCK_TOPS=next_power_of_2(num_chunks * per_chunk),
        INT32_MIN=_INT32_MIN,
    )
    cand = torch.empty(rows, spill, dtype=torch.int64, device=device)
    _gather_top_kernel[(rows, num_chunks)](
        logits,
        logits.stride(0),
        threshold,
        count,
        cand,
        vocab,
        SPILL=spill,
        CHUNK=chunk,
        INT32_MIN=_INT32_MIN,
    )
    narrow = cap <= _TOP_NARROW_CAP
    sort_max = top_sort_max(plan)
    min_block = min(_TOP_NARROW_BLOCK if narrow else spill // 4, sort_max)
    _sort_top_kernel[(rows,)](
        logits,
        logits.stride(0),
        count,
        cand,
        lse,
        tok_lp,
        tok_id,
        vocab,
        num_top,
        MIN_BLOCK=min_block,
        SORT_MAX=sort_max,
        SPILL=spill,
        NUM_MID_BLOCKS=(sort_max // min_block).bit_length() - 2
        if sort_max > min_block
        else 0,
        CHUNK=chunk,
        INVALID=_INVALID_KEY,
        INT32_MIN=_INT32_MIN,
        num_warps=4 if narrow else 8,
    )
    return tok_lp, tok_id, lse


@triton.jit(do_not_specialize=["num_top"])
def _rank_row_kernel(
    logits_ptr,  # [num_rows, vocab]
    logits_stride,
    tok_lp_ptr,  # [num_rows, num_top] out
    tok_id_ptr,  # [num_rows, num_top] out
    lse_ptr,  # [num_rows] out
    vocab,
    num_top,
    BLOCK: tl.constexpr,
    INVALID: tl.constexpr,
    INT32_MIN: tl.constexpr,
):
    """Small vocabulary: sort the whole row."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x, _ = _load_values(logits_ptr + row * logits_stride, offs, vocab, INT32_MIN)
    lse = _row_logsumexp(x)
    tl.store(lse_ptr + row, lse)
    key = tl.where(offs < vocab, _sort_key(x, offs.to(tl.int64)), INVALID)
    _store_ranked(
        tl.sort(key, descending=True), lse, tok_lp_ptr, tok_id_ptr, row, num_top, offs
    )


@triton.jit
def _store_ranked(key, lse, tok_lp_ptr, tok_id_ptr, row, num_top, offs):
    """The first num_top of a row's keys, sorted best first, as log-probs and ids."""
    out = offs < num_top
    tl.store(tok_lp_ptr + row * num_top + offs, _score(key) - lse, mask=out)
    tl.store(tok_id_ptr + row * num_top + offs, _key_tie(key), mask=out)


@triton.jit
def _row_logsumexp(x):
    m = tl.max(x, axis=0)
    safe = tl.where(m == float("-inf"), 0.0, m)
    return safe + tl.log(tl.sum(tl.exp(x - safe), axis=0))


@triton.jit
def _load_values(row_ptr, offs, vocab, INT32_MIN: tl.constexpr):
    """Logits at ``offs`` of one row as float32 (-inf past the vocabulary) and as
    orderable int32 (INT32_MIN past the vocabulary, below every real value)."""
    valid = offs < vocab
    x = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
    return x, tl.where(valid, _orderable(x), INT32_MIN)


@triton.jit
def _chunk_stats_kernel(
    logits_ptr,  # [num_rows, vocab]
    logits_stride,
    chunk_max_ptr,  # [num_rows, num_chunks] out
    chunk_sum_ptr,  # [num_rows, num_chunks] out
    chunk_top_ptr,  # [num_rows, num_chunks * PER_CHUNK] out, orderable int32
    vocab,
    num_chunks,
    CHUNK: tl.constexpr,
    PER_CHUNK: tl.constexpr,
    INT32_MIN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x, vals = _load_values(logits_ptr + row * logits_stride, offs, vocab, INT32_MIN)
    cmax = tl.max(x, axis=0)
    safe = tl.where(cmax == float("-inf"), 0.0, cmax)
    tl.store(chunk_max_ptr + row * num_chunks + chunk, cmax)
    tl.store(chunk_sum_ptr + row * num_chunks + chunk, tl.sum(tl.exp(x - safe)))
    # The chunk's PER_CHUNK largest distinct values (INT32_MIN once exhausted);
    # each stands for at least one token of the chunk.
    top_ptr = chunk_top_ptr + (row * num_chunks + chunk) * PER_CHUNK
    for t in tl.static_range(PER_CHUNK):
        m = tl.max(vals, axis=0)
        tl.store(top_ptr + t, m)
        vals = tl.where(vals == m, INT32_MIN, vals)


@triton.jit(do_not_specialize=["num_top"])
def _top_threshold_kernel(
    chunk_max_ptr,  # [num_rows, num_chunks]
    chunk_sum_ptr,  # [num_rows, num_chunks]
    chunk_top_ptr,  # [num_rows, num_tops] orderable int32, INT32_MIN = none
    num_chunks,
    num_tops,
    lse_ptr,  # [num_rows] out
    threshold_ptr,  # [num_rows] out, orderable int32
    count_ptr,  # [num_rows] out, zeroed for the gather
    num_top,
    BLOCK_CHUNKS: tl.constexpr,
    BLOCK_TOPS: tl.constexpr,
    INT32_MIN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK_CHUNKS)
    in_row = chunks < num_chunks
    cmax = tl.load(
        chunk_max_ptr + row * num_chunks + chunks, mask=in_row, other=float("-inf")
    )
    csum = tl.load(chunk_sum_ptr + row * num_chunks + chunks, mask=in_row, other=0.0)
    gmax = tl.max(cmax, axis=0)
    safe = tl.where(gmax == float("-inf"), 0.0, gmax)
    tl.store(lse_ptr + row, safe + tl.log(tl.sum(csum * tl.exp(cmax - safe), axis=0)))

    offs = tl.arange(0, BLOCK_TOPS)
    tops = tl.load(
        chunk_top_ptr + row * num_tops + offs, mask=offs < num_tops, other=INT32_MIN
    ).to(tl.int64)
    # The num_top-th largest reported value: the largest v with
    # count(tops >= v) >= num_top, by bisection on [lo, hi). With fewer than
    # num_top reported values every token is a candidate (lo = INT32_MIN + 1).
    lo = tl.min(tl.full([BLOCK_TOPS], INT32_MIN + 1, tl.int64), axis=0)
    hi = tl.max(tops, axis=0) + 1
    for _ in tl.static_range(33):
        active = hi - lo > 1
        mid = (lo + hi) >> 1
        ok = tl.sum((tops >= mid).to(tl.int32), axis=0) >= num_top
        lo = tl.where(active & ok, mid, lo)
        hi = tl.where(active & ~ok, mid, hi)
    tl.store(threshold_ptr + row, lo.to(tl.int32))
    tl.store(count_ptr + row, 0)


@triton.jit
def _gather_top_kernel(
    logits_ptr,  # [num_rows, vocab]
    logits_stride,
    threshold_ptr,  # [num_rows] orderable int32
    count_ptr,  # [num_rows] tokens at or above the threshold (atomic)
    cand_ptr,  # [num_rows, SPILL] out: their keys, first SPILL of them
    vocab,
    SPILL: tl.constexpr,
    CHUNK: tl.constexpr,
    INT32_MIN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x, vals = _load_values(logits_ptr + row * logits_stride, offs, vocab, INT32_MIN)
    # Past the vocabulary vals is INT32_MIN, below every threshold.
    sel = vals >= tl.load(threshold_ptr + row)
    num_sel = tl.sum(sel.to(tl.int32), axis=0)
    if num_sel > 0:
        base = tl.atomic_add(count_ptr + row, num_sel)
        pos = base + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(
            cand_ptr + row * SPILL + pos,
            _sort_key(x, offs.to(tl.int64)),
            mask=sel & (pos < SPILL),
        )


@triton.jit(do_not_specialize=["num_top"])
def _sort_top_kernel(
    logits_ptr,  # [num_rows, vocab]
    logits_stride,
    count_ptr,  # [num_rows] tokens that reached the threshold
    cand_ptr,  # [num_rows, SPILL] keys (rewritten on the exact path)
    lse_ptr,  # [num_rows]
    tok_lp_ptr,  # [num_rows, num_top] out
    tok_id_ptr,  # [num_rows, num_top] out
    vocab,
    num_top,  # <= SORT_MAX
    MIN_BLOCK: tl.constexpr,
    SORT_MAX: tl.constexpr,  # widest sort
    SPILL: tl.constexpr,
    # sizes MIN_BLOCK * 2**t, 0 < t <= this, below SORT_MAX
    NUM_MID_BLOCKS: tl.constexpr,
    CHUNK: tl.constexpr,
    INVALID: tl.constexpr,
    INT32_MIN: tl.constexpr,
):
    tl.static_assert(SORT_MAX >= MIN_BLOCK << NUM_MID_BLOCKS)
    tl.static_assert(SPILL >= SORT_MAX)
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * logits_stride
    cand_ptr += row * SPILL
    lse = tl.load(lse_ptr + row)
    num_cand = tl.load(count_ptr + row)
    if num_cand > SPILL:
        # Exact path: the cut value v = the num_top-th largest of the row
        # (the largest v with count(>= v) >= num_top), by a radix select: four
        # passes over the row, each fixing one byte of v (as an unsigned
        # 32-bit key, most significant byte first) from a 256-bin histogram of
        # the tokens matching the bytes fixed so far. A fifth pass takes every
        # token above v and the lowest-id ties at v, in id order.
        bins = tl.arange(0, 256)
        need = num_top + num_cand * 0  # v's rank among the matching tokens
        prefix = num_cand.to(tl.int64) * 0  # v's bytes fixed so far (unsigned)
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            hist = tl.zeros([256], dtype=tl.int32)
            for start in range(0, vocab, CHUNK):
                offs = start + tl.arange(0, CHUNK)
                x, vals = _load_values(logits_ptr, offs, vocab, INT32_MIN)
                key = vals.to(tl.int64) + 2**31  # unsigned order, [0, 2**32)
                match = (offs < vocab) & (
                    (key >> (shift + 8)) == (prefix >> (shift + 8))
                )
                digit = ((key >> shift) & 0xFF).to(tl.int32)
                hist += tl.histogram(digit, 256, mask=match)
            # The byte b with count(> b) < need <= count(>= b) among the matches.
            above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)
            pick = (above < need) & (above + hist >= need)
            prefix += tl.sum(tl.where(pick, bins, 0), axis=0).to(tl.int64) << shift
            need -= tl.sum(tl.where(pick, above, 0), axis=0)
        cut = (prefix - 2**31).to(tl.int32)
        # need is now v's rank among the tokens equal to v: the num_top - need
        # tokens above v are all taken, and the first need ties.
        num_ties = need
        seen_ties = cut * 0
        taken = cut * 0
        for start in range(0, vocab, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            x, vals = _load_values(logits_ptr, offs, vocab, INT32_MIN)
            tie = vals == cut
            tie_rank = seen_ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1
            take = (vals > cut) | (tie & (tie_rank < num_ties))
            pos = taken + tl.cumsum(take.to(tl.int32), axis=0) - 1
            # Exactly num_top are taken; the bound only guards the buffer.
            tl.store(
                cand_ptr + pos,
                _sort_key(x, offs.to(tl.int64)),
                mask=take & (pos < SPILL),
            )
            seen_ties += tl.sum(tie.to(tl.int32), axis=0)
            taken += tl.sum(take.to(tl.int32), axis=0)
        num_cand = taken
    elif num_cand > SORT_MAX:
        # Keep the num_top best of the buffered keys (distinct: the id is in
        # the low bits) by a radix select, in buffer order, so that no sort is
        # wider than SORT_MAX (sorts of thousands of keys are what made this
        # kernel slow to compile).
        offs = tl.arange(0, SPILL)
        valid = offs < num_cand
        key = tl.load(cand_ptr + offs, mask=valid, other=INVALID)
        keep = valid & (key >= _kth_largest(key, valid, num_top, INVALID))
        pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.debug_barrier()
        tl.store(cand_ptr + pos, key, mask=keep)
        num_cand = num_top + num_cand * 0
    tl.debug_barrier()
    # Sort the smallest block that holds every candidate: MIN_BLOCK, twice that,
    # ... below SORT_MAX, then SORT_MAX (a sort's cost grows as n log^2 n). The block
    # follows the candidates found, not num_top, so every num_top of a warp
    # class runs this one kernel.
    if num_cand <= MIN_BLOCK:
        _store_ranked_buffer(
            cand_ptr,
            num_cand,
            lse,
            tok_lp_ptr,
            tok_id_ptr,
            row,
            num_top,
            MIN_BLOCK,
            INVALID,
        )
    for t in tl.static_range(NUM_MID_BLOCKS):
        if (num_cand > (MIN_BLOCK << t)) & (num_cand <= (MIN_BLOCK << (t + 1))):
            _store_ranked_buffer(
                cand_ptr,
                num_cand,
                lse,
                tok_lp_ptr,
                tok_id_ptr,
                row,
                num_top,
                MIN_BLOCK << (t + 1),
                INVALID,
            )
    if num_cand > (MIN_BLOCK << NUM_MID_BLOCKS):
        _store_ranked_buffer(
            cand_ptr,
            num_cand,
            lse,
            tok_lp_ptr,
            tok_id_ptr,
            row,
            num_top,
            SORT_MAX,
            INVALID,
        )


@triton.jit
def _store_ranked_buffer(
    cand_ptr,
    num_cand,
    lse,
    tok_lp_ptr,
    tok_id_ptr,
    row,
    num_top,
    BLOCK: tl.constexpr,
    INVALID: tl.constexpr,
):
    """Sort the first ``num_cand <= BLOCK`` buffered keys and store the best."""
    offs = tl.arange(0, BLOCK)
    key = tl.load(cand_ptr + offs, mask=offs < num_cand, other=INVALID)
    _store_ranked(
        tl.sort(key, descending=True), lse, tok_lp_ptr, tok_id_ptr, row, num_top, offs
    )


@triton.jit
def _score(key):
    return _from_orderable(key >> 32)


@triton.jit
def _kth_largest(key, valid, k, SIGN: tl.constexpr):
    """The ``k``-th largest of the distinct int64 ``key`` lanes where ``valid``
    (``1 <= k <=`` their count), by a radix select: eight passes, each fixing
    one byte of it (in unsigned order: the keys with their ``SIGN`` bit
    flipped) from a 256-bin histogram of the lanes matching the bytes fixed so
    far."""
    u = key ^ SIGN
    bins = tl.arange(0, 256)
    need = k  # the answer's rank among the matching lanes
    prefix = (k * 0).to(tl.int64)  # the answer's bytes fixed so far
    for p in range(8):
        shift = 56 - 8 * p
        # Shifts stay below 64: the first pass matches every valid lane.
        high = tl.minimum(shift + 8, 63)
        match = valid & ((p == 0) | ((u >> high) == (prefix >> high)))
        digit = ((u >> shift) & 0xFF).to(tl.int32)
        hist = tl.histogram(digit, 256, mask=match)
        # The byte b with count(> b) < need <= count(>= b) among the matches.
        above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)
        pick = (above < need) & (above + hist >= need)
        prefix |= tl.sum(tl.where(pick, bins, 0), axis=0).to(tl.int64) << shift
        need -= tl.sum(tl.where(pick, above, 0), axis=0)
    return prefix ^ SIGN


@triton.jit(do_not_specialize=["num_pairs", "num_top", "budget", "num_words"])
def _ddtree_select_kernel(
    # [num_reqs, depth, num_top] each depth's ranked token log-probs and ids
    tok_lp_ptr,
    tok_id_ptr,
    # [2, num_pairs] candidate (parent rank, token rank) pairs
    pairs_ptr,
    num_pairs,
    # Scratch: [num_reqs, 2 * BLOCK_KEPT] kept keys, then a depth's survivors;
    # [num_reqs, budget] scores of the last depth's kept nodes by rank;
    # [num_reqs, depth, budget] node index of each (depth, rank);
    # [num_reqs, budget + 1] ancestor jump pointers.
    keys_ptr,
    par_score_ptr,
    node_of_rank_ptr,
    jump_ptr,
    # Outputs, see DDTree.
    token_ids_ptr,
    parent_ids_ptr,
    depths_ptr,
    mask_ptr,
    num_nodes_ptr,
    log_probs_ptr,
    depth,
    num_top,
    budget,  # <= BLOCK_KEPT
    num_words,  # mask words per row, <= BLOCK_WORDS
    RANK_BITS: tl.constexpr,
    INVALID: tl.constexpr,
    BLOCK_KEPT: tl.constexpr,
    BLOCK_CAND: tl.constexpr,
    CAP: tl.constexpr,
    SORT_ALL: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    JUMP_STEPS: tl.constexpr,
):
    tl.static_assert(BLOCK_KEPT <= (1 << RANK_BITS))
    tl.static_assert(CAP <= BLOCK_KEPT)
    req = tl.program_id(0).to(tl.int64)
    keys_ptr += req * 2 * BLOCK_KEPT
    par_score_ptr += req * budget
    tok_lp_ptr += req * depth * num_top
    tok_id_ptr += req * depth * num_top
    node_of_rank_ptr += req * depth * budget

    # 1. Depth by depth, keep the best budget prefixes of all depths so far. The
    # candidates of depth d extend the kept depth d-1 nodes (by rank) with the
    # depth's ranked tokens; keys order them best first, then by (depth, parent
    # rank, token rank), which also puts parents before children. Only
    # candidates that beat the current budget-th key can enter; when at most CAP
    # do, they alone are merged with the kept keys, else the best BLOCK_KEPT of
    # them. Keys are distinct, so the nodes kept do not depend on how.
    kept_offs = tl.arange(0, BLOCK_KEPT)
    tl.store(keys_ptr + kept_offs, tl.full([BLOCK_KEPT], INVALID, tl.int64))
    tl.store(par_score_ptr, 0.0)  # the root
    num_parents = tl.sum((kept_offs == 0).to(tl.int32), axis=0)  # the root
    cutoff = tl.min(tl.full([BLOCK_KEPT], INVALID, tl.int64), axis=0)
    cand = tl.arange(0, BLOCK_CAND)
    is_pair = cand < num_pairs
    pi = tl.load(pairs_ptr + cand, mask=is_pair, other=0)
    pj = tl.load(pairs_ptr + num_pairs + cand, mask=is_pair, other=0)
    tie = (pi << RANK_BITS) | pj
    merge_offs = tl.arange(0, 2 * BLOCK_KEPT)
    for d in range(1, depth + 1):
        tl.debug_barrier()
        ok = is_pair & (pi < num_parents) & (pj < num_top)
        score = tl.load(par_score_ptr + pi, mask=ok, other=float("-inf")) + tl.load(
            tok_lp_ptr + (d - 1) * num_top + pj, mask=ok, other=float("-inf")
        )
        ok = ok & (score > float("-inf"))
        key = tl.where(
            ok, _sort_key(score, (tie | (d << (2 * RANK_BITS))).to(tl.int64)), INVALID
        )
        enters = key > cutoff
        num_enter = tl.sum(enters.to(tl.int32), axis=0)
        # Nothing entered: no node at depth d, so none deeper either; the
        # remaining depths find no parents and skip their merges.
        if num_enter == 0:
            num_parents = num_parents * 0
        else:
            if num_enter > CAP:
                # The best BLOCK_KEPT (>= budget) are merged: a depth whose
                # parents were kept well above the cut brings more (not rare
                # on flat drafter rows).
                num_enter = tl.minimum(num_enter, BLOCK_KEPT)
                if SORT_ALL:
                    key = tl.sort(key, descending=True)
                    enters = cand < num_enter
                    slot = cand
                else:
                    enters = enters & (
                        key >= _kth_largest(key, enters, num_enter, INVALID)
                    )
                    slot = tl.cumsum(enters.to(tl.int32), axis=0) - 1
            else:
                slot = tl.cumsum(enters.to(tl.int32), axis=0) - 1
            tl.store(keys_ptr + BLOCK_KEPT + slot, key, mask=enters)
            tl.debug_barrier()
            merged = tl.load(
                keys_ptr + merge_offs,
                mask=merge_offs < BLOCK_KEPT + num_enter,
                other=INVALID,
            )
            merged = tl.sort(merged, descending=True)
            tl.debug_barrier()
            tl.store(keys_ptr + merge_offs, merged, mask=merge_offs < budget)
            tl.debug_barrier()

            # The kept nodes of depth d, in rank order, are the next depth's parents.
            kept = tl.load(keys_ptr + kept_offs)
            cutoff = tl.sum(tl.where(kept_offs == budget - 1, kept, 0), axis=0)
            at_d = (kept != INVALID) & ((_key_tie(kept) >> (2 * RANK_BITS)) == d)
            rank = tl.cumsum(at_d.to(tl.int32), axis=0) - 1
            tl.store(par_score_ptr + rank, _score(kept), mask=at_d)
            num_parents = tl.sum(at_d.to(tl.int32), axis=0)

    # 2. Decode the kept keys into nodes; node n is kept entry n-1.
    in_budget = kept_offs < budget
    kept = tl.load(keys_ptr + kept_offs)
    real = kept != INVALID
    node_tie = _key_tie(kept)
    node_depth = tl.where(real, node_tie >> (2 * RANK_BITS), 0).to(tl.int32)
    parent_rank = (node_tie >> RANK_BITS) & ((1 << RANK_BITS) - 1)
    tok_rank = node_tie & ((1 << RANK_BITS) - 1)
    for d in range(1, depth + 1):
        at_d = real & (node_depth == d)
        rank = tl.cumsum(at_d.to(tl.int32), axis=0) - 1
        tl.store(node_of_rank_ptr + (d - 1) * budget + rank, kept_offs + 1, mask=at_d)
    tl.debug_barrier()
    parent = tl.load(
        node_of_rank_ptr + (node_depth - 2) * budget + parent_rank,
        mask=real & (node_depth > 1),
        other=0,
    )
    token = tl.load(
        tok_id_ptr + (node_depth - 1) * num_top + tok_rank, mask=real, other=-1
    )
    out = req * budget + kept_offs
    tl.store(token_ids_ptr + out, token, mask=in_budget)
    tl.store(parent_ids_ptr + out, parent, mask=in_budget)
    tl.store(depths_ptr + out, node_depth, mask=in_budget)
    tl.store(
        log_probs_ptr + out,
        tl.where(real, _score(kept), float("-inf")),
        mask=in_budget,
    )
    tl.store(num_nodes_ptr + req, tl.sum(real.to(tl.int32), axis=0))
    # Node n's first jump is its parent; the root jumps to itself.
    tl.store(jump_ptr + req * (budget + 1) + kept_offs + 1, parent, mask=in_budget)
    tl.store(jump_ptr + req * (budget + 1), 0)

    # 3. Ancestor-or-self mask rows by pointer doubling: a row covers its
    # ancestors nearer than its jump target; each step ORs in the target's row and
    # doubles the jump. Rows are updated in place, block by block; reading a row
    # already updated in this step only covers more of the same ancestors.
    words = tl.arange(0, BLOCK_WORDS)
    word_ok = words < num_words
    row_base = mask_ptr + req * (budget + 1) * num_words
    for row_start in range(0, budget + 1, BLOCK_ROWS):
        rows = row_start + tl.arange(0, BLOCK_ROWS)
        bit = tl.where(
            words[None, :] == (rows >> 5)[:, None], (1 << (rows & 31))[:, None], 0
        )
        tl.store(
            row_base + rows[:, None] * num_words + words[None, :],
            bit.to(tl.int32),
            mask=(rows <= budget)[:, None] & word_ok[None, :],
        )
    for _ in range(JUMP_STEPS):
        for row_start in range(0, budget + 1, BLOCK_ROWS):
            tl.debug_barrier()
            rows = row_start + tl.arange(0, BLOCK_ROWS)
            in_rows = rows <= budget
            tile = in_rows[:, None] & word_ok[None, :]
            target = tl.load(
                jump_ptr + req * (budget + 1) + rows, mask=in_rows, other=0
            )
            row_bits = tl.load(
                row_base + rows[:, None] * num_words + words[None, :], mask=tile
            )
            target_bits = tl.load(
                row_base + target[:, None] * num_words + words[None, :], mask=tile
            )
            next_target = tl.load(
                jump_ptr + req * (budget + 1) + target, mask=in_rows, other=0
            )
            tl.debug_barrier()
            tl.store(
                row_base + rows[:, None] * num_words + words[None, :],
                row_bits | target_bits,
                mask=tile,
            )
            tl.store(jump_ptr + req * (budget + 1) + rows, next_target, mask=in_rows)
