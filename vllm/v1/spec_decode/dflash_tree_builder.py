# SPDX-License-Identifier: Apache-2.0
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

import torch

from vllm.triton_utils import tl, triton

# Tree layout (shared with the tree attention backend and the tree sampler):
# tree token 0 is the root (the previous step's bonus token) and tree token i >= 1 is
# node i. Row i of the attention mask has bit (j % 32) of word (j // 32) set iff tree
# token j is an ancestor of tree token i or i itself.
MASK_WORD_BITS = 32


def num_mask_words(budget: int) -> int:
    """int32 words per mask row for a tree of ``budget`` nodes plus the root."""
    return (budget + 1 + MASK_WORD_BITS - 1) // MASK_WORD_BITS


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
    # ancestor-or-self mask over [root, node_1, ..., node_budget].
    attn_mask: torch.Tensor
    # [num_reqs] int32; number of real (non-padding) nodes.
    num_nodes: torch.Tensor

    @property
    def budget(self) -> int:
        return self.token_ids.shape[1]


MAX_BUDGET = 1024
MAX_DEPTH = 16
_LSE_CHUNK = 8192
# Bits of a candidate's tie-break field: depth (5) | parent rank (10) | token rank (10).
_RANK_BITS = 10
_INVALID_KEY = -(2**63)


def build_ddtree(draft_logits: torch.Tensor, budget: int) -> DDTree:
    """Build the best DDTree of ``budget`` nodes for every request of a batch.

    Args:
        draft_logits: ``[num_reqs, depth, vocab]`` per-position drafter logits (any
            float dtype; not temperature-scaled), ``depth <= 16``.
        budget: number of tree nodes per request, ``1..1024`` (the root is extra).

    Returns:
        A :class:`DDTree` whose nodes are exactly the ``budget`` most probable
        prefixes under ``prod_i softmax(draft_logits[:, i])``. Ties are broken
        deterministically: shallower first, then by the parent's rank, then by the
        token's rank at its depth (logit descending, token id ascending).

    Runs as a few launches with fixed shapes and no host sync (log-normalisers,
    ``torch.topk`` of each position, token ranking, tree selection), so it can be
    captured in a CUDA graph once it has run outside the graph for this budget
    (the candidate table below is copied to the device on first use). Example::

        tree = build_ddtree(torch.randn(2, 15, 151936, device="cuda"), budget=128)
        tree.token_ids.shape  # (2, 128)
    """
    tree, _ = build_ddtree_with_lse(draft_logits, budget)
    return tree


def build_ddtree_with_lse(
    draft_logits: torch.Tensor, budget: int, survivor_cap: int | None = None
) -> tuple[DDTree, torch.Tensor]:
    """:func:`build_ddtree`, also returning the ``[num_reqs, depth]`` float32
    log-normaliser of every position, so references can use identical log-probs.

    ``survivor_cap`` (tests only) lowers the fast path's capacity so that the
    fallback that sorts every candidate of a depth is exercised."""
    _check_build_args(draft_logits, budget)
    num_reqs, depth, vocab = draft_logits.shape
    device = draft_logits.device
    num_top = min(budget, vocab)

    lse_max, lse_sum = _logsumexp_partials(draft_logits)
    top_logits, top_ids = _top_tokens(draft_logits, num_top)
    tok_lp, tok_id, lse = _rank_top_tokens(top_logits, top_ids, lse_max, lse_sum)
    pairs = _candidate_pairs(budget, device)

    num_words = num_mask_words(budget)
    tree = DDTree(
        token_ids=torch.empty(num_reqs, budget, dtype=torch.int64, device=device),
        parent_ids=torch.empty(num_reqs, budget, dtype=torch.int32, device=device),
        depths=torch.empty(num_reqs, budget, dtype=torch.int32, device=device),
        attn_mask=torch.empty(
            num_reqs, budget + 1, num_words, dtype=torch.int32, device=device
        ),
        num_nodes=torch.empty(num_reqs, dtype=torch.int32, device=device),
    )
    block_kept = triton.next_power_of_2(budget)
    cap = block_kept if survivor_cap is None else survivor_cap
    # Per-request scratch, private to the kernel: the kept keys followed by a
    # depth's surviving candidates; the kept nodes of the last depth by rank;
    # node index by (depth, rank); the ancestor jump pointers of the mask.
    keys = torch.empty(num_reqs, 2 * block_kept, dtype=torch.int64, device=device)
    par_score = torch.empty(num_reqs, budget, dtype=torch.float32, device=device)
    node_of_rank = torch.empty(
        num_reqs, depth, budget, dtype=torch.int32, device=device
    )
    jump = torch.empty(num_reqs, budget + 1, dtype=torch.int32, device=device)

    block_words = triton.next_power_of_2(num_words)
    block_rows = min(triton.next_power_of_2(budget + 1), max(4096 // block_words, 16))
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
        depth,
        num_top,
        RANK_BITS=_RANK_BITS,
        INVALID=_INVALID_KEY,
        BUDGET=budget,
        BLOCK_KEPT=block_kept,
        BLOCK_CAND=triton.next_power_of_2(pairs.shape[1]),
        CAP=cap,
        NUM_WORDS=num_words,
        BLOCK_WORDS=block_words,
        BLOCK_ROWS=block_rows,
        JUMP_STEPS=depth.bit_length(),  # 2**steps >= depth + 1 tree tokens
        num_warps=4 if block_kept <= 128 else 8,
    )
    return tree, lse


def _check_build_args(draft_logits: torch.Tensor, budget: int) -> None:
    if draft_logits.dim() != 3:
        raise ValueError(
            "draft_logits must be [num_reqs, depth, vocab], got shape "
            f"{tuple(draft_logits.shape)}"
        )
    if not draft_logits.is_floating_point():
        raise ValueError(f"draft_logits must be floating point, got {draft_logits.dtype}")
    num_reqs, depth, vocab = draft_logits.shape
    if not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"draft depth must be in 1..{MAX_DEPTH}, got {depth}")
    if vocab < 1 or vocab >= 2**31:
        raise ValueError(f"vocab size must be in 1..2**31-1, got {vocab}")
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(f"budget must be an int, got {budget!r}")
    if not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget must be in 1..{MAX_BUDGET}, got {budget}")


def _top_tokens(
    draft_logits: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``num_top`` highest logits of each position (in any order) and their ids.

    Where logits tie at the cut, the lowest token ids are kept: CUDA's radix-select
    top-k does so (checked by the GPU tests); on the CPU a stable sort is used.
    """
    if draft_logits.is_cuda:
        return torch.topk(draft_logits, num_top, dim=-1, sorted=False)
    values, ids = torch.sort(draft_logits, dim=-1, descending=True, stable=True)
    return values[..., :num_top].contiguous(), ids[..., :num_top].contiguous()


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
        (i, j)
        for i in range(budget)
        for j in range(budget // (i + 1) - 1)
    ]
    return torch.tensor(pairs, dtype=torch.int32).T.contiguous().to(device)


def _logsumexp_partials(
    draft_logits: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per vocab chunk max and sum(exp(x - max)), combined inside the build kernel."""
    num_reqs, depth, vocab = draft_logits.shape
    logits = draft_logits.reshape(num_reqs * depth, vocab)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_chunks = triton.cdiv(vocab, _LSE_CHUNK)
    shape = (num_reqs, depth, num_chunks)
    chunk_max = torch.empty(shape, dtype=torch.float32, device=logits.device)
    chunk_sum = torch.empty(shape, dtype=torch.float32, device=logits.device)
    _logsumexp_partials_kernel[(num_reqs * depth, num_chunks)](
        logits,
        logits.stride(0),
        chunk_max,
        chunk_sum,
        vocab,
        num_chunks,
        BLOCK=min(_LSE_CHUNK, triton.next_power_of_2(vocab)),
        CHUNK=_LSE_CHUNK,
    )
    return chunk_max, chunk_sum


@triton.jit
def _logsumexp_partials_kernel(
    # [num_rows, vocab]
    logits_ptr,
    logits_stride,
    # [num_rows, num_chunks]
    chunk_max_ptr,
    chunk_sum_ptr,
    vocab,
    num_chunks,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    run_max = float("-inf")
    run_sum = 0.0
    for start in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, vocab), BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(
            logits_ptr + row * logits_stride + offs,
            mask=offs < vocab,
            other=float("-inf"),
        ).to(tl.float32)
        new_max = tl.maximum(run_max, tl.max(x, axis=0))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - safe_max) + tl.sum(tl.exp(x - safe_max))
        run_max = new_max
    tl.store(chunk_max_ptr + row * num_chunks + chunk, run_max)
    tl.store(chunk_sum_ptr + row * num_chunks + chunk, run_sum)


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


def _rank_top_tokens(
    top_logits: torch.Tensor,
    top_ids: torch.Tensor,
    lse_max: torch.Tensor,
    lse_sum: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each depth's top tokens in rank order (logit descending, id ascending), as
    log-probs and ids, plus the depth's log-normaliser; one program per depth."""
    num_reqs, depth, num_top = top_logits.shape
    device = top_logits.device
    tok_lp = torch.empty(num_reqs, depth, num_top, dtype=torch.float32, device=device)
    tok_id = torch.empty(num_reqs, depth, num_top, dtype=torch.int64, device=device)
    lse = torch.empty(num_reqs, depth, dtype=torch.float32, device=device)
    num_chunks = lse_max.shape[-1]
    block_top = triton.next_power_of_2(num_top)
    _rank_top_tokens_kernel[(num_reqs * depth,)](
        top_logits,
        top_ids,
        lse_max,
        lse_sum,
        num_chunks,
        tok_lp,
        tok_id,
        lse,
        num_top,
        BLOCK_TOP=block_top,
        BLOCK_CHUNKS=triton.next_power_of_2(num_chunks),
        INVALID=_INVALID_KEY,
        num_warps=4 if block_top <= 256 else 8,
    )
    return tok_lp, tok_id, lse


@triton.jit
def _rank_top_tokens_kernel(
    # [num_rows, num_top] logits and ids of a position's top tokens, any order
    top_logits_ptr,
    top_ids_ptr,
    # [num_rows, num_chunks] logsumexp partials
    chunk_max_ptr,
    chunk_sum_ptr,
    num_chunks,
    # [num_rows, num_top] ranked log-probs and ids; [num_rows] log-normalisers
    tok_lp_ptr,
    tok_id_ptr,
    lse_ptr,
    num_top,
    BLOCK_TOP: tl.constexpr,
    BLOCK_CHUNKS: tl.constexpr,
    INVALID: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK_CHUNKS)
    cmax = tl.load(
        chunk_max_ptr + row * num_chunks + chunks,
        mask=chunks < num_chunks,
        other=float("-inf"),
    )
    csum = tl.load(
        chunk_sum_ptr + row * num_chunks + chunks, mask=chunks < num_chunks, other=0.0
    )
    gmax = tl.max(cmax, axis=0)
    lse = gmax + tl.log(tl.sum(csum * tl.exp(cmax - gmax), axis=0))
    tl.store(lse_ptr + row, lse)

    top = tl.arange(0, BLOCK_TOP)
    valid = top < num_top
    logit = tl.load(
        top_logits_ptr + row * num_top + top, mask=valid, other=float("-inf")
    ).to(tl.float32)
    tok = tl.load(top_ids_ptr + row * num_top + top, mask=valid, other=0)
    key = tl.where(valid, _sort_key(logit, tok.to(tl.int64)), INVALID)
    key = tl.sort(key, descending=True)
    tl.store(tok_lp_ptr + row * num_top + top, _score(key) - lse, mask=valid)
    tl.store(tok_id_ptr + row * num_top + top, _key_tie(key), mask=valid)


@triton.jit
def _score(key):
    return _from_orderable(key >> 32)


@triton.jit
def _ddtree_select_kernel(
    # [num_reqs, depth, num_top] each depth's ranked token log-probs and ids
    tok_lp_ptr,
    tok_id_ptr,
    # [2, num_pairs] candidate (parent rank, token rank) pairs
    pairs_ptr,
    num_pairs,
    # Scratch: [num_reqs, 2 * BLOCK_KEPT] kept keys, then a depth's survivors;
    # [num_reqs, BUDGET] scores of the last depth's kept nodes by rank;
    # [num_reqs, depth, BUDGET] node index of each (depth, rank);
    # [num_reqs, BUDGET + 1] ancestor jump pointers.
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
    depth,
    num_top,
    RANK_BITS: tl.constexpr,
    INVALID: tl.constexpr,
    BUDGET: tl.constexpr,
    BLOCK_KEPT: tl.constexpr,
    BLOCK_CAND: tl.constexpr,
    CAP: tl.constexpr,
    NUM_WORDS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    JUMP_STEPS: tl.constexpr,
):
    tl.static_assert(BUDGET <= (1 << RANK_BITS))
    tl.static_assert(CAP <= BLOCK_KEPT)
    req = tl.program_id(0).to(tl.int64)
    keys_ptr += req * 2 * BLOCK_KEPT
    par_score_ptr += req * BUDGET
    tok_lp_ptr += req * depth * num_top
    tok_id_ptr += req * depth * num_top
    node_of_rank_ptr += req * depth * BUDGET

    # 1. Depth by depth, keep the best BUDGET prefixes of all depths so far. The
    # candidates of depth d extend the kept depth d-1 nodes (by rank) with the
    # depth's ranked tokens; keys order them best first, then by (depth, parent
    # rank, token rank), which also puts parents before children. Only
    # candidates that beat the current BUDGET-th key can enter; when at most CAP
    # do, they alone are merged with the kept keys, else all are sorted first.
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
        if num_enter > CAP:
            # Rare: sort them all and merge the best BLOCK_KEPT (>= BUDGET).
            key = tl.sort(key, descending=True)
            enters = cand < BLOCK_KEPT
            slot = cand
            num_enter = tl.minimum(num_enter, BLOCK_KEPT)
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
        tl.store(keys_ptr + merge_offs, merged, mask=merge_offs < BUDGET)
        tl.debug_barrier()

        # The kept nodes of depth d, in rank order, are the next depth's parents.
        kept = tl.load(keys_ptr + kept_offs)
        cutoff = tl.sum(tl.where(kept_offs == BUDGET - 1, kept, 0), axis=0)
        at_d = (kept != INVALID) & ((_key_tie(kept) >> (2 * RANK_BITS)) == d)
        rank = tl.cumsum(at_d.to(tl.int32), axis=0) - 1
        tl.store(par_score_ptr + rank, _score(kept), mask=at_d)
        num_parents = tl.sum(at_d.to(tl.int32), axis=0)

    # 2. Decode the kept keys into nodes; node n is kept entry n-1.
    in_budget = kept_offs < BUDGET
    kept = tl.load(keys_ptr + kept_offs)
    real = kept != INVALID
    node_tie = _key_tie(kept)
    node_depth = tl.where(real, node_tie >> (2 * RANK_BITS), 0).to(tl.int32)
    parent_rank = (node_tie >> RANK_BITS) & ((1 << RANK_BITS) - 1)
    tok_rank = node_tie & ((1 << RANK_BITS) - 1)
    for d in range(1, depth + 1):
        at_d = real & (node_depth == d)
        rank = tl.cumsum(at_d.to(tl.int32), axis=0) - 1
        tl.store(node_of_rank_ptr + (d - 1) * BUDGET + rank, kept_offs + 1, mask=at_d)
    tl.debug_barrier()
    parent = tl.load(
        node_of_rank_ptr + (node_depth - 2) * BUDGET + parent_rank,
        mask=real & (node_depth > 1),
        other=0,
    )
    token = tl.load(
        tok_id_ptr + (node_depth - 1) * num_top + tok_rank, mask=real, other=-1
    )
    out = req * BUDGET + kept_offs
    tl.store(token_ids_ptr + out, token, mask=in_budget)
    tl.store(parent_ids_ptr + out, parent, mask=in_budget)
    tl.store(depths_ptr + out, node_depth, mask=in_budget)
    tl.store(num_nodes_ptr + req, tl.sum(real.to(tl.int32), axis=0))
    # Node n's first jump is its parent; the root jumps to itself.
    tl.store(jump_ptr + req * (BUDGET + 1) + kept_offs + 1, parent, mask=in_budget)
    tl.store(jump_ptr + req * (BUDGET + 1), 0)

    # 3. Ancestor-or-self mask rows by pointer doubling: a row covers its
    # ancestors nearer than its jump target; each step ORs in the target's row and
    # doubles the jump. Rows are updated in place, block by block; reading a row
    # already updated in this step only covers more of the same ancestors.
    words = tl.arange(0, BLOCK_WORDS)
    word_ok = words < NUM_WORDS
    row_base = mask_ptr + req * (BUDGET + 1) * NUM_WORDS
    for row_start in range(0, BUDGET + 1, BLOCK_ROWS):
        rows = row_start + tl.arange(0, BLOCK_ROWS)
        bit = tl.where(
            words[None, :] == (rows >> 5)[:, None], (1 << (rows & 31))[:, None], 0
        )
        tl.store(
            row_base + rows[:, None] * NUM_WORDS + words[None, :],
            bit.to(tl.int32),
            mask=(rows <= BUDGET)[:, None] & word_ok[None, :],
        )
    for _ in range(JUMP_STEPS):
        for row_start in range(0, BUDGET + 1, BLOCK_ROWS):
            tl.debug_barrier()
            rows = row_start + tl.arange(0, BLOCK_ROWS)
            in_rows = rows <= BUDGET
            tile = in_rows[:, None] & word_ok[None, :]
            target = tl.load(jump_ptr + req * (BUDGET + 1) + rows, mask=in_rows, other=0)
            row_bits = tl.load(
                row_base + rows[:, None] * NUM_WORDS + words[None, :], mask=tile
            )
            target_bits = tl.load(
                row_base + target[:, None] * NUM_WORDS + words[None, :], mask=tile
            )
            next_target = tl.load(
                jump_ptr + req * (BUDGET + 1) + target, mask=in_rows, other=0
            )
            tl.debug_barrier()
            tl.store(
                row_base + rows[:, None] * NUM_WORDS + words[None, :],
                row_bits | target_bits,
                mask=tile,
            )
            tl.store(jump_ptr + req * (BUDGET + 1) + rows, next_target, mask=in_rows)
