# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Batch-wide DDTree node budgets from an online acceptance calibration.

Each step a request offers a tree of up to ``cap`` nodes in best-first order,
with the drafter's path log-probability ``log q`` of every node. The step
verifies ``N`` nodes in all, and which ones is decided batch-wide: every
request's nodes are ranked by their estimated probability of acceptance, and the
best ``N`` are taken. The drafter's own ``q`` need not match what the target
accepts, and sampled requests accept differently from greedy ones, so the
estimate is a calibration map learned from what the tree walk accepted:

* :class:`TreeAcceptanceCalibration`: per class (0 = greedy, temperature 0;
  1 = sampled) and per bin of ``log q`` (64 bins over ``[-16, 0]``), decayed
  counts of verified and accepted nodes, and ``rate`` = P(accepted | class,
  bin): their ratio pulled towards the prior ``q`` at the bin centre, then made
  non-decreasing in ``log q`` by a weighted isotonic fit (bins out of order are
  pooled, each weighted by its nodes). A node's value is ``rate`` interpolated
  linearly between bin centres.
  :meth:`~TreeAcceptanceCalibration.update` (two launches after the walk) adds
  the step's nodes and refits.
* :func:`assign_tree_nodes` (one launch): the first ``N`` nodes of the batch
  ranked by value (ties: lower batch index, then lower node index), as per
  request counts and the step's ``query_start_loc`` / ``cu_num_logits``.
* :func:`expected_accepted_nodes` (one launch): the expected accepted nodes of
  the best ``N`` for a few ``N`` at once, from a histogram of the values, for a
  host-side cost model that picks the next steps' ``N``.

No launch reads anything back to the host, and the state is allocated once, so
all of it can run inside a CUDA graph. The kernels are compiled without FMA
contraction so that values and keys match a float32 reference bit for bit; rates
agree with a float64 reference of the fit to the rounding of its sums.
"""

import torch

from vllm.triton_utils import tl, triton
from vllm.utils.math_utils import cdiv, next_power_of_2

NUM_CLASSES = 2  # 0: greedy (temperature 0), 1: sampled
NUM_BINS = 64
LOGQ_MIN = -16.0
# Bins per unit of log q, and the ranking's tilt per unit of log q: 1e-4 over
# the whole [LOGQ_MIN, 0] range, so that nodes on a plateau of the calibration
# map still rank by the drafter's own probability.
_BIN_SCALE = NUM_BINS / -LOGQ_MIN
_TILT = 1e-4 / -LOGQ_MIN
MAX_CAP = 1024
MAX_BUDGETS = 16
# Candidates per tile of the single-program kernels.
_TILE = 2048
# expected_accepted_nodes' value histogram: uniform in log(value) over
# [_LOG_VALUE_MIN, 0]; a bin spans a factor exp(24 / 1024) = 1.024.
_VALUE_BINS = 1024
_LOG_VALUE_MIN = -24.0
_NO_FMA = {"enable_fp_fusion": False}


class TreeAcceptanceCalibration:
    """Online map from (class, ``log q``) to P(node accepted), on the GPU.

    State (persistent tensors, updated in place):

    * ``counts`` ``[2, NUM_BINS, 2]`` float32: decayed (verified, accepted) node
      counts per class and bin;
    * ``rate`` ``[2, NUM_BINS]`` float32: the calibrated acceptance probability,
      non-decreasing in the bin, in ``[0, 1]``;
    * ``pending`` ``[2, NUM_BINS, 2]`` float32: the step's counts between the
      two launches of :meth:`update` (zero otherwise);
    * ``totals`` ``[4]`` float32, running sums for reporting: predicted
      accepted nodes (the verified nodes' values before the step's refit),
      observed accepted nodes, verified trees, verified nodes. The host reads
      and differences them; only :meth:`reset` clears them;
    * ``prior`` ``[NUM_BINS]`` float32: ``exp(bin centre)``, the rate of an
      empty bin.

    Bin b covers ``log q`` in ``[LOGQ_MIN + b w, LOGQ_MIN + (b + 1) w)``, ``w =
    -LOGQ_MIN / NUM_BINS``; lower values go to bin 0 and ``log q = 0`` to the
    last. Example::

        calib = TreeAcceptanceCalibration(torch.device("cuda"))
        # after each step's walk:
        calib.update(log_probs, idx_mapping, temperature, cu_num_logits,
                     accepted_nodes, num_accepted)
    """

    def __init__(
        self, device: torch.device, decay: float = 0.99, prior_strength: float = 2.0
    ):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if not prior_strength > 0.0:
            raise ValueError(f"prior_strength must be > 0, got {prior_strength}")
        self.decay = float(decay)
        self.prior_strength = float(prior_strength)
        width = -LOGQ_MIN / NUM_BINS
        centres = LOGQ_MIN + (torch.arange(NUM_BINS, dtype=torch.float32) + 0.5) * width
        self.prior = torch.exp(centres).to(device)
        self.counts = torch.zeros(NUM_CLASSES, NUM_BINS, 2, device=device)
        self.pending = torch.zeros_like(self.counts)
        self.rate = self.prior.repeat(NUM_CLASSES, 1)
        self.totals = torch.zeros(4, device=device)

    def reset(self) -> None:
        """Back to the prior: no counts, ``rate = prior``, totals zero."""
        self.counts.zero_()
        self.pending.zero_()
        self.totals.zero_()
        self.rate.copy_(self.prior.expand_as(self.rate))

    def update(
        self,
        # [max_num_reqs, >= max verified nodes] float32, request-state order
        log_probs: torch.Tensor,
        # [num_reqs]
        idx_mapping: torch.Tensor,
        # [max_num_reqs] float32, request-state order
        temperature: torch.Tensor,
        # [num_reqs + 1]: request r verified nodes 1..c_r,
        # c_r = cu_num_logits[r + 1] - cu_num_logits[r] - 1
        cu_num_logits: torch.Tensor,
        # [num_reqs, depth] int32: accepted node (1-based) per depth
        accepted_nodes: torch.Tensor,
        # [num_reqs] int32: accepted path length (read where c_r > 0)
        num_accepted: torch.Tensor,
    ) -> None:
        """Add a walked step's verified nodes and refit ``rate``.

        Every verified real node (``log q > -inf``) adds one verified count to
        its (class, bin), and one accepted count when it is on the accepted
        path; ``totals`` gain the nodes' values under the current ``rate``.
        Then ``counts = decay * counts + pending``, and per bin ``raw = (acc +
        s * prior) / (verified + s)`` (``s = prior_strength``); ``rate`` is
        the non-decreasing fit of ``raw`` with weights ``verified + s`` that is
        closest in weighted squares (what pooling adjacent violators gives),
        clamped to ``[0, 1]``.
        """
        num_reqs = idx_mapping.shape[0]
        if num_reqs == 0:
            return
        _check_rows(log_probs)
        width = log_probs.shape[1]
        depth = accepted_nodes.shape[1]
        node_block = min(next_power_of_2(width), MAX_CAP)
        req_block = max(1, _TILE // node_block)
        _update_calibration_kernel[(cdiv(num_reqs, req_block),)](
            log_probs,
            log_probs.stride(0),
            width,
            idx_mapping,
            temperature,
            cu_num_logits,
            accepted_nodes,
            accepted_nodes.stride(0),
            depth,
            num_accepted,
            self.rate,
            self.pending,
            self.totals,
            num_reqs,
            REQ_BLOCK=req_block,
            NODE_BLOCK=node_block,
            DEPTH_BLOCK=next_power_of_2(depth),
            NUM_BINS=NUM_BINS,
            LOGQ_MIN=LOGQ_MIN,
            BIN_SCALE=_BIN_SCALE,
            **_NO_FMA,
        )
        _finalize_calibration_kernel[(1,)](
            self.counts,
            self.pending,
            self.prior,
            self.rate,
            self.decay,
            self.prior_strength,
            NUM_CLASSES=NUM_CLASSES,
            NUM_BINS=NUM_BINS,
            **_NO_FMA,
        )


def assign_tree_nodes(
    # [max_num_reqs, >= cap] float32, request-state order; -inf on padding
    log_probs: torch.Tensor,
    # [num_reqs]
    idx_mapping: torch.Tensor,
    # [max_num_reqs] float32, request-state order
    temperature: torch.Tensor,
    calibration: TreeAcceptanceCalibration,
    cap: int,
    num_nodes: int,
    # [>= num_reqs] int32 out: nodes each request verifies
    counts: torch.Tensor,
    # [>= num_reqs + 1] int32 out: 0, then the cumsum of 1 + counts
    query_start_loc: torch.Tensor,
    # [>= num_reqs + 1] int32 out: the same values
    cu_num_logits: torch.Tensor,
) -> None:
    """Give the step's ``num_nodes`` verified nodes to the best nodes of the batch.

    Node i (0-based, ``i < cap``) of batch request r ranks by its key: for a
    real node ``value(log q) + 1e-4 * (clamp(log q, LOGQ_MIN, 0) - LOGQ_MIN) /
    -LOGQ_MIN`` (the calibrated value, tilted by the drafter's own probability),
    for a padding node a key below every real one. The first ``num_nodes``
    candidates by (key descending, r ascending, i ascending) are taken; keys do
    not increase along a request's nodes, so each request's share is a prefix
    of its tree and ``counts[r]`` describes it. Padding nodes are taken only
    once every real node is (they fill the rows of a batch with fewer real
    nodes than ``num_nodes``). Entries of the outputs past ``num_reqs`` are not
    written.

    One program, exact and deterministic: a radix select (four passes over the
    candidates, a byte of the ``num_nodes``-th key each, keys as the bits of
    non-negative float32) finds the cut, and a fifth pass counts each
    request's nodes above it and hands out the ties at it in batch order.
    ``num_reqs``, ``cap`` and ``num_nodes`` are not specialised on; the block
    size is :func:`cap_block`, so the caps of a block share one compile.
    Example::

        assign_tree_nodes(log_probs, idx_mapping, temperature, calib, cap=64,
                          num_nodes=256, counts=counts, query_start_loc=qsl,
                          cu_num_logits=cu)
    """
    num_reqs = idx_mapping.shape[0]
    _check_cap(log_probs, cap)
    if not 0 < num_nodes <= num_reqs * cap:
        raise ValueError(
            f"num_nodes must be in 1..num_reqs * cap = {num_reqs * cap}, "
            f"got {num_nodes}"
        )
    for name, t, size in (
        ("counts", counts, num_reqs),
        ("query_start_loc", query_start_loc, num_reqs + 1),
        ("cu_num_logits", cu_num_logits, num_reqs + 1),
    ):
        if t.shape[0] < size or t.dtype != torch.int32:
            raise ValueError(
                f"{name} must be int32 with >= {size} entries, got "
                f"{t.dtype} {tuple(t.shape)}"
            )
    block = cap_block(cap)
    _assign_tree_nodes_kernel[(1,)](
        log_probs,
        log_probs.stride(0),
        idx_mapping,
        temperature,
        calibration.rate,
        counts,
        query_start_loc,
        cu_num_logits,
        num_reqs,
        cap,
        num_nodes,
        REQ_BLOCK=max(1, _TILE // block),
        CAP_BLOCK=block,
        NUM_BINS=NUM_BINS,
        LOGQ_MIN=LOGQ_MIN,
        BIN_SCALE=_BIN_SCALE,
        TILT=_TILT,
        num_warps=8,
        **_NO_FMA,
    )


def cap_block(cap: int) -> int:
    """The node block :func:`assign_tree_nodes` tiles a cap of ``cap`` nodes
    with: the smallest power of 4 that holds it, at least 4. The scheduler's
    slot counts are ``4**k - 1`` (``ddtree_config.slot_ladder``), whose block
    is their own power of 2; other caps (a request trimmed near
    ``max_model_len``, a user's cap) take up to 4x the lanes they need in a
    kernel of at most a few tiles, and every block is one compile."""
    block = 4
    while block < cap:
        block *= 4
    return block


def expected_accepted_nodes(
    # [num_reqs, >= cap] float32, batch order; -inf on padding
    log_probs: torch.Tensor,
    # [max_num_reqs] float32, request-state order
    temperature: torch.Tensor,
    # [num_reqs]
    idx_mapping: torch.Tensor,
    calibration: TreeAcceptanceCalibration,
    cap: int,
    # [L] int32, L <= 16: node totals N
    budgets: torch.Tensor,
    # [>= L] float32 out
    out: torch.Tensor,
) -> None:
    """``out[l]`` = E(N), the sum of the calibrated values of the best
    ``N = budgets[l]`` nodes of the batch (the first ``cap`` of each request,
    ranked as in :func:`assign_tree_nodes`; padding nodes count 0).

    One program makes one pass over the nodes and counts the real nodes'
    values in 1024 bins uniform in log(value) over ``[-24, 0]`` (integer
    atomics into a private scratch, so the counts are exact); E(N) takes the
    bins from the top, each node at its bin's geometric midpoint, and the last
    bin in part. The error has three sources:

    * a node counted at its bin's midpoint is off by a factor of at most
      ``exp(±12 / 1024)``: 1.18 % of the value;
    * values below ``exp(-24)`` count as the lowest midpoint: at most 4e-11
      each;
    * the histogram orders nodes by value, the ranking by value plus a tilt
      below 1e-4, so the two best-N sets can differ, but only by nodes whose
      values lie within 1e-4 of each other: at most 1e-4 per exchanged node.

    So ``|out[l] - E(N)| <= 0.0118 * E(N) + 1.02e-4 * n_x + 4e-11 * N``, with
    ``n_x`` the number of nodes the two orders exchange. Those lie at the cut
    within 1e-4 of each other (ties of equal value cost nothing), so the term
    matters only when N falls in a crowd of nearly equal small values. Read on
    the host a step or two late, no sync on the step itself.
    """
    num_reqs = idx_mapping.shape[0]
    _check_cap(log_probs, cap)
    if log_probs.shape[0] < num_reqs:
        raise ValueError(
            f"log_probs has {log_probs.shape[0]} rows for {num_reqs} requests"
        )
    num_budgets = budgets.shape[0]
    if not 1 <= num_budgets <= MAX_BUDGETS:
        raise ValueError(f"1..{MAX_BUDGETS} budgets, got {num_budgets}")
    if out.shape[0] < num_budgets or out.dtype != torch.float32:
        raise ValueError(
            f"out must be float32 with >= {num_budgets} entries, got "
            f"{out.dtype} {tuple(out.shape)}"
        )
    # The kernel's private histogram (it zeroes it first).
    hist = torch.empty(_VALUE_BINS, dtype=torch.int32, device=log_probs.device)
    _expected_accepted_nodes_kernel[(1,)](
        log_probs,
        log_probs.stride(0),
        idx_mapping,
        temperature,
        calibration.rate,
        budgets,
        out,
        hist,
        num_reqs,
        cap,
        num_budgets,
        TILE=_TILE,
        NUM_BINS=NUM_BINS,
        LOGQ_MIN=LOGQ_MIN,
        BIN_SCALE=_BIN_SCALE,
        VALUE_BINS=_VALUE_BINS,
        LOG_VALUE_MIN=_LOG_VALUE_MIN,
        num_warps=8,
        **_NO_FMA,
    )


def _check_rows(log_probs: torch.Tensor) -> None:
    if log_probs.dim() != 2 or log_probs.dtype != torch.float32:
        raise ValueError(
            "log_probs must be a 2-D float32 tensor, got "
            f"{log_probs.dtype} {tuple(log_probs.shape)}"
        )
    if log_probs.stride(1) != 1:
        raise ValueError("log_probs rows must be contiguous")


def _check_cap(log_probs: torch.Tensor, cap: int) -> None:
    _check_rows(log_probs)
    if isinstance(cap, bool) or not isinstance(cap, int):
        raise TypeError(f"cap must be an int, got {cap!r}")
    if not 1 <= cap <= min(MAX_CAP, log_probs.shape[1]):
        raise ValueError(
            f"cap must be in 1..min({MAX_CAP}, log_probs.shape[1] = "
            f"{log_probs.shape[1]}), got {cap}"
        )


@triton.jit
def _clamped_log_q(log_q, LOGQ_MIN: tl.constexpr):
    return tl.minimum(tl.maximum(log_q, LOGQ_MIN), 0.0)


@triton.jit
def _log_q_bin(
    log_q, NUM_BINS: tl.constexpr, LOGQ_MIN: tl.constexpr, BIN_SCALE: tl.constexpr
):
    """Calibration bin of ``log q`` (clamped first: no -inf reaches the cast)."""
    pos = (_clamped_log_q(log_q, LOGQ_MIN) - LOGQ_MIN) * BIN_SCALE
    return tl.minimum(pos.to(tl.int32), NUM_BINS - 1)


@triton.jit
def _node_value(
    log_q,
    cls,
    rate_ptr,
    mask,
    NUM_BINS: tl.constexpr,
    LOGQ_MIN: tl.constexpr,
    BIN_SCALE: tl.constexpr,
):
    """``rate[cls]`` interpolated between bin centres at ``log q`` (clamped at
    the first and last centre); 0 for padding (-inf) and masked lanes. The
    result is kept between the two rates it interpolates, so the value is
    non-decreasing in ``log q`` whatever the rounding."""
    tl.static_assert(NUM_BINS >= 2)
    pos = (_clamped_log_q(log_q, LOGQ_MIN) - LOGQ_MIN) * BIN_SCALE - 0.5
    pos = tl.minimum(tl.maximum(pos, 0.0), NUM_BINS - 1.0)
    lo = tl.minimum(pos.to(tl.int32), NUM_BINS - 2)
    frac = pos - lo.to(tl.float32)
    row = rate_ptr + cls * NUM_BINS + lo
    r0 = tl.load(row, mask=mask, other=0.0)
    r1 = tl.load(row + 1, mask=mask, other=0.0)
    value = tl.minimum(tl.maximum(r0 + frac * (r1 - r0), r0), r1)
    return tl.where(mask & (log_q > float("-inf")), value, 0.0)


@triton.jit
def _request_class(temperature_ptr, req_state_idx, mask):
    return (tl.load(temperature_ptr + req_state_idx, mask=mask, other=0.0) > 0.0).to(
        tl.int32
    )


@triton.jit(do_not_specialize=["width", "depth", "num_reqs"])
def _update_calibration_kernel(
    # [max_num_reqs, width]
    log_probs_ptr,
    log_probs_stride,
    width,
    # [num_reqs]
    idx_mapping_ptr,
    # [max_num_reqs]
    temperature_ptr,
    # [num_reqs + 1]
    cu_num_logits_ptr,
    # [num_reqs, depth]
    accepted_nodes_ptr,
    accepted_nodes_stride,
    depth,
    # [num_reqs]
    num_accepted_ptr,
    # [NUM_CLASSES, NUM_BINS]
    rate_ptr,
    # [NUM_CLASSES, NUM_BINS, 2]
    pending_ptr,
    # [4]
    totals_ptr,
    num_reqs,
    REQ_BLOCK: tl.constexpr,
    NODE_BLOCK: tl.constexpr,
    DEPTH_BLOCK: tl.constexpr,
    NUM_BINS: tl.constexpr,
    LOGQ_MIN: tl.constexpr,
    BIN_SCALE: tl.constexpr,
):
    reqs = tl.program_id(0) * REQ_BLOCK + tl.arange(0, REQ_BLOCK)
    in_batch = reqs < num_reqs
    start = tl.load(cu_num_logits_ptr + reqs, mask=in_batch, other=0)
    end = tl.load(cu_num_logits_ptr + reqs + 1, mask=in_batch, other=1)
    # Verified nodes; the bound only guards the reads of a malformed batch.
    num_verified = tl.minimum(tl.maximum(end - start - 1, 0), width)
    req_state_idx = tl.load(idx_mapping_ptr + reqs, mask=in_batch, other=0).to(tl.int64)
    cls = _request_class(temperature_ptr, req_state_idx, in_batch)
    row_ptr = log_probs_ptr + req_state_idx * log_probs_stride
    # Histogram index of a node: class * NUM_BINS + bin.
    NUM_SLOTS: tl.constexpr = 2 * NUM_BINS
    TILE: tl.constexpr = REQ_BLOCK * NODE_BLOCK

    verified_hist = tl.zeros([NUM_SLOTS], dtype=tl.int32)
    predicted = tl.zeros([REQ_BLOCK], dtype=tl.float32)
    num_real = tl.zeros([REQ_BLOCK], dtype=tl.int32)
    for col in range(0, tl.max(num_verified, axis=0), NODE_BLOCK):
        nodes = col + tl.arange(0, NODE_BLOCK)
        verified = nodes[None, :] < num_verified[:, None]
        log_q = tl.load(
            row_ptr[:, None] + nodes[None, :], mask=verified, other=float("-inf")
        )
        real = verified & (log_q > float("-inf"))
        value = _node_value(
            log_q, cls[:, None], rate_ptr, real, NUM_BINS, LOGQ_MIN, BIN_SCALE
        )
        predicted += tl.sum(value, axis=1)
        num_real += tl.sum(real.to(tl.int32), axis=1)
        slot = cls[:, None] * NUM_BINS + _log_q_bin(
            log_q, NUM_BINS, LOGQ_MIN, BIN_SCALE
        )
        verified_hist += tl.histogram(
            tl.reshape(slot, [TILE]), NUM_SLOTS, mask=tl.reshape(real, [TILE])
        )

    # Accepted path: the node at each depth, read only for verified trees.
    tree = in_batch & (num_verified > 0)
    num_acc = tl.load(num_accepted_ptr + reqs, mask=tree, other=0)
    d = tl.arange(0, DEPTH_BLOCK)
    on_path = (d[None, :] < tl.minimum(num_acc, depth)[:, None]) & tree[:, None]
    node = tl.load(
        accepted_nodes_ptr
        + reqs.to(tl.int64)[:, None] * accepted_nodes_stride
        + d[None, :],
        mask=on_path,
        other=0,
    )
    on_path = on_path & (node >= 1) & (node <= num_verified[:, None])
    log_q = tl.load(row_ptr[:, None] + node - 1, mask=on_path, other=float("-inf"))
    accepted = on_path & (log_q > float("-inf"))
    slot = cls[:, None] * NUM_BINS + _log_q_bin(log_q, NUM_BINS, LOGQ_MIN, BIN_SCALE)
    PATH_TILE: tl.constexpr = REQ_BLOCK * DEPTH_BLOCK
    accepted_hist = tl.histogram(
        tl.reshape(slot, [PATH_TILE]), NUM_SLOTS, mask=tl.reshape(accepted, [PATH_TILE])
    )

    # Integer counts: float atomics add them exactly, in any order.
    slots = tl.arange(0, NUM_SLOTS)
    tl.atomic_add(
        pending_ptr + 2 * slots, verified_hist.to(tl.float32), mask=verified_hist > 0
    )
    tl.atomic_add(
        pending_ptr + 2 * slots + 1,
        accepted_hist.to(tl.float32),
        mask=accepted_hist > 0,
    )
    tl.atomic_add(totals_ptr, tl.sum(predicted, axis=0))
    tl.atomic_add(totals_ptr + 1, tl.sum(num_acc, axis=0).to(tl.float32))
    tl.atomic_add(totals_ptr + 2, tl.sum(tree.to(tl.float32), axis=0))
    tl.atomic_add(totals_ptr + 3, tl.sum(num_real, axis=0).to(tl.float32))


@triton.jit
def _minimum(a, b):
    return tl.minimum(a, b)


@triton.jit
def _finalize_calibration_kernel(
    # [NUM_CLASSES, NUM_BINS, 2]
    counts_ptr,
    pending_ptr,
    # [NUM_BINS]
    prior_ptr,
    # [NUM_CLASSES, NUM_BINS]
    rate_ptr,
    decay,
    prior_strength,
    NUM_CLASSES: tl.constexpr,
    NUM_BINS: tl.constexpr,
):
    bins = tl.arange(0, NUM_BINS)
    slot = tl.arange(0, NUM_CLASSES)[:, None] * NUM_BINS + bins[None, :]
    verified = decay * tl.load(counts_ptr + 2 * slot) + tl.load(pending_ptr + 2 * slot)
    accepted = decay * tl.load(counts_ptr + 2 * slot + 1) + tl.load(
        pending_ptr + 2 * slot + 1
    )
    tl.store(counts_ptr + 2 * slot, verified)
    tl.store(counts_ptr + 2 * slot + 1, accepted)
    zero = tl.zeros([NUM_CLASSES, NUM_BINS], dtype=tl.float32)
    tl.store(pending_ptr + 2 * slot, zero)
    tl.store(pending_ptr + 2 * slot + 1, zero)
    prior = tl.load(prior_ptr + bins)[None, :]
    # Each bin's estimate is (accepted + s * prior) / (verified + s); the rate
    # is their weighted isotonic (non-decreasing) fit, weights verified + s, by
    # the max-min formula rate[b] = max_{i <= b} min_{j >= b} mean(i..j). Bins
    # with few nodes are pooled with their neighbours instead of capped by the
    # lowest later estimate, whose noise would pull the rate down while the
    # counts are small (a fresh engine, a single request).
    num = accepted + prior_strength * prior
    den = verified + prior_strength
    # [class, i, j]: mean(i..j) for j >= i, from sums that start at bin i (no
    # differences of large running sums); j < i is 0 / prior_strength, unread.
    first = bins[None, :, None]
    last = bins[None, None, :]
    span = last >= first
    mean = tl.math.div_rn(
        tl.cumsum(tl.where(span, num[:, None, :], 0.0), axis=2),
        tl.maximum(
            tl.cumsum(tl.where(span, den[:, None, :], 0.0), axis=2), prior_strength
        ),
    )
    # min over j' >= j of mean(i..j'), then the max over i <= b at j = b.
    low = tl.associative_scan(
        tl.where(span, mean, float("inf")), 2, _minimum, reverse=True
    )
    rate = tl.max(tl.where(span, low, float("-inf")), axis=1)
    tl.store(rate_ptr + slot, tl.minimum(tl.maximum(rate, 0.0), 1.0))


@triton.jit
def _tile_keys(
    log_probs_ptr,
    log_probs_stride,
    idx_mapping_ptr,
    temperature_ptr,
    rate_ptr,
    start,
    num_reqs,
    cap,
    REQ_BLOCK: tl.constexpr,
    CAP_BLOCK: tl.constexpr,
    NUM_BINS: tl.constexpr,
    LOGQ_MIN: tl.constexpr,
    BIN_SCALE: tl.constexpr,
    TILT: tl.constexpr,
):
    """Ranking keys of requests ``start ..`` as int32 in ``[0, 2**31)``: 0 for a
    padding node, 1 + the float32 bits of a real node's key (non-negative, so
    the bits order as the values), -1 outside the batch or past ``cap``."""
    reqs = start + tl.arange(0, REQ_BLOCK)
    in_batch = reqs < num_reqs
    nodes = tl.arange(0, CAP_BLOCK)
    valid = in_batch[:, None] & (nodes < cap)[None, :]
    req_state_idx = tl.load(idx_mapping_ptr + reqs, mask=in_batch, other=0).to(tl.int64)
    cls = _request_class(temperature_ptr, req_state_idx, in_batch)
    log_q = tl.load(
        log_probs_ptr + req_state_idx[:, None] * log_probs_stride + nodes[None, :],
        mask=valid,
        other=float("-inf"),
    )
    real = valid & (log_q > float("-inf"))
    value = _node_value(
        log_q, cls[:, None], rate_ptr, real, NUM_BINS, LOGQ_MIN, BIN_SCALE
    )
    key = value + (_clamped_log_q(log_q, LOGQ_MIN) - LOGQ_MIN) * TILT
    bits = key.to(tl.int32, bitcast=True) + 1
    return tl.where(real, bits, tl.where(valid, 0, -1)), valid, reqs, in_batch


@triton.jit(do_not_specialize=["num_reqs", "cap", "num_nodes"])
def _assign_tree_nodes_kernel(
    # [max_num_reqs, >= cap]
    log_probs_ptr,
    log_probs_stride,
    # [num_reqs]
    idx_mapping_ptr,
    # [max_num_reqs]
    temperature_ptr,
    # [NUM_CLASSES, NUM_BINS]
    rate_ptr,
    # [>= num_reqs]
    counts_ptr,
    # [>= num_reqs + 1]
    query_start_loc_ptr,
    cu_num_logits_ptr,
    num_reqs,
    cap,
    num_nodes,
    REQ_BLOCK: tl.constexpr,
    CAP_BLOCK: tl.constexpr,
    NUM_BINS: tl.constexpr,
    LOGQ_MIN: tl.constexpr,
    BIN_SCALE: tl.constexpr,
    TILT: tl.constexpr,
):
    TILE: tl.constexpr = REQ_BLOCK * CAP_BLOCK
    # The cut: the num_nodes-th largest key, a byte per pass, most significant
    # first, from a histogram of the candidates matching the bytes found so
    # far. need is the cut's rank among the candidates that match.
    digits = tl.arange(0, 256)
    need = num_nodes
    cut = need * 0
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], dtype=tl.int32)
        for start in range(0, num_reqs, REQ_BLOCK):
            key, valid, _, _ = _tile_keys(
                log_probs_ptr,
                log_probs_stride,
                idx_mapping_ptr,
                temperature_ptr,
                rate_ptr,
                start,
                num_reqs,
                cap,
                REQ_BLOCK,
                CAP_BLOCK,
                NUM_BINS,
                LOGQ_MIN,
                BIN_SCALE,
                TILT,
            )
            # int64 so that the first pass's shift by 32 is defined.
            match = valid & (
                (key.to(tl.int64) >> (shift + 8)) == (cut.to(tl.int64) >> (shift + 8))
            )
            digit = (key >> shift) & 0xFF
            hist += tl.histogram(
                tl.reshape(digit, [TILE]), 256, mask=tl.reshape(match, [TILE])
            )
        # The digit b with count(> b) < need <= count(>= b) among the matches.
        above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)
        pick = (above < need) & (above + hist >= need)
        cut += tl.sum(tl.where(pick, digits, 0), axis=0) << shift
        need -= tl.sum(tl.where(pick, above, 0), axis=0)

    # Each request takes its candidates above the cut, and the need ties at the
    # cut go to the lowest batch indices (a request's ties are consecutive).
    tl.store(query_start_loc_ptr, 0)
    tl.store(cu_num_logits_ptr, 0)
    ties_before = need * 0
    tokens_before = need * 0
    for start in range(0, num_reqs, REQ_BLOCK):
        key, valid, reqs, in_batch = _tile_keys(
            log_probs_ptr,
            log_probs_stride,
            idx_mapping_ptr,
            temperature_ptr,
            rate_ptr,
            start,
            num_reqs,
            cap,
            REQ_BLOCK,
            CAP_BLOCK,
            NUM_BINS,
            LOGQ_MIN,
            BIN_SCALE,
            TILT,
        )
        num_above = tl.sum((valid & (key > cut)).to(tl.int32), axis=1)
        num_ties = tl.sum((valid & (key == cut)).to(tl.int32), axis=1)
        earlier_ties = ties_before + tl.cumsum(num_ties, axis=0) - num_ties
        taken = tl.minimum(tl.maximum(need - earlier_ties, 0), num_ties)
        count = num_above + taken
        tokens = tl.where(in_batch, 1 + count, 0)
        loc = tokens_before + tl.cumsum(tokens, axis=0)
        tl.store(counts_ptr + reqs, count, mask=in_batch)
        tl.store(query_start_loc_ptr + reqs + 1, loc, mask=in_batch)
        tl.store(cu_num_logits_ptr + reqs + 1, loc, mask=in_batch)
        ties_before += tl.sum(num_ties, axis=0)
        tokens_before += tl.sum(tokens, axis=0)


# The rows' stride is a tree width: not specialised either, so that trees of
# every width share one compile.
@triton.jit(do_not_specialize=["log_probs_stride", "num_reqs", "cap", "num_budgets"])
def _expected_accepted_nodes_kernel(
    # [num_reqs, >= cap], batch order
    log_probs_ptr,
    log_probs_stride,
    # [num_reqs]
    idx_mapping_ptr,
    # [max_num_reqs]
    temperature_ptr,
    # [NUM_CLASSES, NUM_BINS]
    rate_ptr,
    # [num_budgets]
    budgets_ptr,
    # [num_budgets]
    out_ptr,
    # [VALUE_BINS] int32 scratch
    hist_ptr,
    num_reqs,
    cap,
    num_budgets,
    TILE: tl.constexpr,
    NUM_BINS: tl.constexpr,
    LOGQ_MIN: tl.constexpr,
    BIN_SCALE: tl.constexpr,
    VALUE_BINS: tl.constexpr,
    LOG_VALUE_MIN: tl.constexpr,
):
    VALUE_SCALE: tl.constexpr = VALUE_BINS / -LOG_VALUE_MIN
    num_cand = num_reqs * cap
    # Counted with integer atomics in memory: a version with tl.histogram
    # (1024 bins) gave wrong sums on an H200 under Triton 3.6 (not
    # root-caused).
    bins = tl.arange(0, VALUE_BINS)
    tl.store(hist_ptr + bins, tl.zeros([VALUE_BINS], dtype=tl.int32))
    tl.debug_barrier()
    # Candidates in flat (request, node) order: no block padding of cap.
    for start in range(0, num_cand, TILE):
        cand = start + tl.arange(0, TILE)
        valid = cand < num_cand
        req = cand // cap
        node = cand - req * cap
        req_state_idx = tl.load(idx_mapping_ptr + req, mask=valid, other=0)
        cls = _request_class(temperature_ptr, req_state_idx.to(tl.int64), valid)
        log_q = tl.load(
            log_probs_ptr + req.to(tl.int64) * log_probs_stride + node,
            mask=valid,
            other=float("-inf"),
        )
        real = valid & (log_q > float("-inf"))
        value = _node_value(log_q, cls, rate_ptr, real, NUM_BINS, LOGQ_MIN, BIN_SCALE)
        # Values below exp(LOG_VALUE_MIN), 0 included, share the lowest bin.
        pos = (tl.log(tl.maximum(value, 1e-30)) - LOG_VALUE_MIN) * VALUE_SCALE
        b = tl.minimum(tl.maximum(pos, 0.0), VALUE_BINS - 1.0).to(tl.int32)
        tl.atomic_add(hist_ptr + b, real.to(tl.int32), mask=real, sem="relaxed")
    tl.debug_barrier()
    # Past L1: the counts were added in L2.
    hist = tl.load(hist_ptr + bins, cache_modifier=".cg")
    midpoint = tl.exp(LOG_VALUE_MIN + (bins + 0.5) / VALUE_SCALE)
    better = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)  # nodes in higher bins
    for i in range(num_budgets):
        n = tl.load(budgets_ptr + i)
        taken = tl.minimum(tl.maximum(n - better, 0), hist)
        tl.store(out_ptr + i, tl.sum(taken.to(tl.float32) * midpoint, axis=0))
