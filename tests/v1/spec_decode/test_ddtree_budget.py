# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree's batch-wide node budget against slow references.

:func:`assign_tree_nodes` is compared exactly with a sort of every candidate of
the batch; the calibration's update exactly (counts), its refit to the
rounding of the fit's sums (rate, against pool-adjacent-violators in float64)
and the predicted total to float32 rounding, with a per-request Python loop;
:func:`expected_accepted_nodes` with the exact top-N sum, within its documented
bound. Batches have odd sizes, padding rows, all-padding requests, duplicated
rows, mixed classes and a request-state order that is a random permutation into
a larger table. The references below but the fit work in float32 NumPy with the
kernels' operation order, so keys agree to the bit. Small cases run on the CPU in the
Triton interpreter; large ones only on a GPU.
"""

import numpy as np
import pytest
import torch

from vllm.v1.spec_decode.ddtree_budget import (
    LOGQ_MIN,
    NUM_BINS,
    TreeAcceptanceCalibration,
    assign_tree_nodes,
    expected_accepted_nodes,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")
F32 = np.float32
NEG_INF = F32(-np.inf)
# The ranking's tilt over the whole [LOGQ_MIN, 0] range of log q.
TILT = 1e-4


def _host(t: torch.Tensor) -> np.ndarray:
    """A copy on the host: on the CPU ``.numpy()`` would alias the state that
    the kernels update in place."""
    return t.cpu().clone().numpy()


# --- Slow references ---------------------------------------------------------


def _clamped(log_q: np.ndarray) -> np.ndarray:
    return np.minimum(np.maximum(log_q, F32(LOGQ_MIN)), F32(0.0))


def log_q_bin_reference(log_q: np.ndarray) -> np.ndarray:
    scale = F32(NUM_BINS / -LOGQ_MIN)
    pos = (_clamped(log_q) - F32(LOGQ_MIN)) * scale
    return np.minimum(pos.astype(np.int32), NUM_BINS - 1)


def calibrated_value_reference(
    log_q: np.ndarray, cls: np.ndarray, rate: np.ndarray
) -> np.ndarray:
    """``rate[cls]`` interpolated linearly in log q between bin centres, clamped
    at the first and last centre; 0 for padding. ``cls`` broadcasts to
    ``log_q``."""
    scale = F32(NUM_BINS / -LOGQ_MIN)
    pos = (_clamped(log_q) - F32(LOGQ_MIN)) * scale - F32(0.5)
    pos = np.minimum(np.maximum(pos, F32(0.0)), F32(NUM_BINS - 1))
    lo = np.minimum(pos.astype(np.int32), NUM_BINS - 2)
    frac = pos - lo.astype(np.float32)
    r0, r1 = rate[cls, lo], rate[cls, lo + 1]
    value = np.minimum(np.maximum(r0 + frac * (r1 - r0), r0), r1)
    return np.where(log_q > NEG_INF, value, F32(0.0)).astype(np.float32)


def ranking_keys_reference(
    log_q: np.ndarray, cls: np.ndarray, rate: np.ndarray
) -> np.ndarray:
    """Value plus the tilt for real nodes, -1 for padding."""
    tilt = (_clamped(log_q) - F32(LOGQ_MIN)) * F32(TILT / -LOGQ_MIN)
    key = calibrated_value_reference(log_q, cls, rate) + tilt
    return np.where(log_q > NEG_INF, key, F32(-1.0))


def _batch_keys(log_probs, rows, temperature, rate, cap):
    cls = (temperature[rows] > 0).astype(np.int64)[:, None]
    return ranking_keys_reference(log_probs[rows, :cap], cls, rate)


def assign_tree_nodes_reference(log_probs, idx_mapping, temperature, rate, cap, n):
    """counts, query_start_loc: the first n candidates by (key descending,
    batch index, node index), checked to be a prefix of every request."""
    keys = _batch_keys(log_probs, idx_mapping, temperature, rate, cap)
    num_reqs = keys.shape[0]
    r, i = np.meshgrid(np.arange(num_reqs), np.arange(cap), indexing="ij")
    order = np.lexsort((i.ravel(), r.ravel(), -keys.ravel()))
    chosen = np.zeros(num_reqs * cap, dtype=bool)
    chosen[order[:n]] = True
    chosen = chosen.reshape(num_reqs, cap)
    counts = chosen.sum(axis=1)
    for row, c in zip(chosen, counts):
        assert row[:c].all(), "the selection is not a prefix"
    qsl = np.concatenate([[0], np.cumsum(1 + counts)])
    return counts, qsl


def calibration_step_reference(
    state,
    log_probs,
    idx_mapping,
    temperature,
    cu_num_logits,
    accepted_nodes,
    num_accepted,
    decay,
    prior_strength,
):
    """One :meth:`TreeAcceptanceCalibration.update` on a dict of NumPy arrays
    (counts, rate, prior float32; totals float64), in place."""
    counts, rate, prior, totals = (
        state[k] for k in ("counts", "rate", "prior", "totals")
    )
    pending = np.zeros_like(counts)
    width, depth = log_probs.shape[1], accepted_nodes.shape[1]
    for r, row in enumerate(idx_mapping):
        c = min(max(int(cu_num_logits[r + 1] - cu_num_logits[r]) - 1, 0), width)
        cls = int(temperature[row] > 0)
        log_q = log_probs[row, :c]
        real = log_q > NEG_INF
        totals[0] += calibrated_value_reference(log_q, cls, rate)[real].sum(
            dtype=np.float64
        )
        totals[3] += real.sum()
        np.add.at(pending[cls, :, 0], log_q_bin_reference(log_q[real]), 1)
        if c == 0:
            continue
        totals[1] += num_accepted[r]
        totals[2] += 1
        for node in accepted_nodes[r, : min(int(num_accepted[r]), depth)]:
            if 1 <= node <= c and log_q[node - 1] > NEG_INF:
                pending[cls, log_q_bin_reference(log_q[node - 1]), 1] += 1
    counts[:] = F32(decay) * counts + pending
    s = F32(prior_strength)
    num = counts[..., 1] + s * prior
    den = counts[..., 0] + s
    rate[:] = np.clip([isotonic_fit_reference(n, d) for n, d in zip(num, den)], 0, 1)


def isotonic_fit_reference(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """The non-decreasing fit of ``num / den`` with weights ``den``, closest in
    weighted squares: pool adjacent violators, in float64."""
    blocks: list[list[float]] = []  # [sum num, sum den, bins]
    for n, d in zip(num.astype(np.float64), den.astype(np.float64)):
        blocks.append([n, d, 1])
        while len(blocks) > 1 and (
            blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]
        ):
            n2, d2, k2 = blocks.pop()
            blocks[-1][0] += n2
            blocks[-1][1] += d2
            blocks[-1][2] += k2
    return np.concatenate([np.full(k, n / d) for n, d, k in blocks])


def expected_accepted_nodes_reference(
    log_probs, temperature, idx_mapping, rate, cap, n
):
    """(exact E(N) by the ranking, the number of nodes the best N by value
    alone exchanges with it)."""
    cls = (temperature[idx_mapping] > 0).astype(np.int64)[:, None]
    log_q = log_probs[: len(idx_mapping), :cap]
    values = calibrated_value_reference(log_q, cls, rate).ravel().astype(np.float64)
    keys = ranking_keys_reference(log_q, cls, rate).ravel()
    by_key = np.argsort(-keys, kind="stable")[:n]
    by_value = np.argsort(-values, kind="stable")[:n]
    exchanged = len(np.setdiff1d(by_value, by_key))
    return values[by_key].sum(), exchanged


# --- Random batches ----------------------------------------------------------


def _tree_rows(rng, num_rows, width, num_real=None):
    """[num_rows, width] non-increasing log q, -inf padding at the end. Rows are
    all padding, full, or partly real; steps between nodes are small (ties and
    plateaus) to large (past LOGQ_MIN)."""
    log_probs = np.full((num_rows, width), NEG_INF, dtype=np.float32)
    for row in range(num_rows):
        if num_real is not None:
            n = num_real
        else:
            kind = rng.integers(0, 4)
            n = (0, width, rng.integers(1, width + 1), rng.integers(1, width + 1))[kind]
        scale = rng.choice([0.02, 0.2, 1.0, 3.0])
        steps = rng.exponential(scale, n)
        steps[rng.random(n) < 0.05] = 0.0  # equal log q on consecutive nodes
        log_probs[row, :n] = -np.cumsum(steps)
    return log_probs


def _random_rate(rng):
    """Per class a non-decreasing rate with a plateau, sampled below greedy,
    and greedy 0 in its lowest bins (nodes below LOGQ_MIN there key exactly
    0.0, the lowest real key, still above padding)."""
    rate = np.sort(rng.uniform(0.0, 1.0, (2, NUM_BINS)), axis=1).astype(np.float32)
    for c in range(2):
        a, b = np.sort(rng.integers(0, NUM_BINS, 2))
        rate[c, a:b] = rate[c, a]
    rate[0, : rng.integers(1, 8)] = 0.0
    rate[1] *= F32(0.6)
    return rate


def _calibration(rate=None):
    calib = TreeAcceptanceCalibration(torch.device(DEVICE))
    if rate is not None:
        calib.rate.copy_(torch.from_numpy(rate))
    return calib


def _batch(rng, num_reqs, cap, extra_rows=5, extra_cols=3):
    """log_probs in request-state order (columns past ``cap`` hold log q 0, the
    best value, which the kernels must never read), batch -> state mapping,
    temperatures, and the rate, or None for the prior."""
    max_num_reqs = num_reqs + extra_rows
    log_probs = _tree_rows(rng, max_num_reqs, cap + extra_cols)
    log_probs[:, cap:] = 0.0
    idx_mapping = rng.permutation(max_num_reqs)[:num_reqs]
    # Ties: some requests get another request's row.
    for _ in range(num_reqs // 3):
        a, b = rng.choice(idx_mapping, 2)
        log_probs[b] = log_probs[a]
    temperature = np.where(rng.random(max_num_reqs) < 0.5, 0.0, 0.7).astype(F32)
    rate = _random_rate(rng) if rng.random() < 0.7 else None
    return log_probs, idx_mapping, temperature, rate


def _budget_points(rng, num_reqs, cap, num_real):
    total = num_reqs * cap
    points = {1, total, int(rng.integers(1, total + 1))}
    if 0 < num_real < total:
        points |= {num_real, num_real + 1}
    return sorted(points)


def _run_assign(log_probs, idx_mapping, temperature, calib, cap, n, idx_dtype):
    num_reqs = len(idx_mapping)
    sentinel = -7
    counts = torch.full((num_reqs + 2,), sentinel, dtype=torch.int32, device=DEVICE)
    qsl = torch.full((num_reqs + 3,), sentinel, dtype=torch.int32, device=DEVICE)
    cu = torch.full((num_reqs + 3,), sentinel, dtype=torch.int32, device=DEVICE)
    assign_tree_nodes(
        torch.from_numpy(log_probs).to(DEVICE),
        torch.from_numpy(idx_mapping).to(idx_dtype).to(DEVICE),
        torch.from_numpy(temperature).to(DEVICE),
        calib,
        cap,
        n,
        counts,
        qsl,
        cu,
    )
    counts, qsl, cu = _host(counts), _host(qsl), _host(cu)
    # Entries past the batch are not written.
    assert (counts[num_reqs:] == sentinel).all()
    assert (qsl[num_reqs + 1 :] == sentinel).all()
    assert (cu[num_reqs + 1 :] == sentinel).all()
    assert np.array_equal(qsl, cu)
    return counts[:num_reqs], qsl[: num_reqs + 1]


# --- assign_tree_nodes ----------------------------------------------------------


def _compare_assign(num_reqs, cap, seeds):
    """Every budget point of random batches; returns (launches, candidates)
    compared."""
    launches = compared = 0
    for seed in seeds:
        rng = np.random.default_rng(seed)
        log_probs, idx_mapping, temperature, rate = _batch(rng, num_reqs, cap)
        calib = _calibration(rate)
        rate_np = _host(calib.rate)
        num_real = int((log_probs[idx_mapping, :cap] > NEG_INF).sum())
        idx_dtype = torch.int32 if seed % 2 else torch.int64
        for n in _budget_points(rng, num_reqs, cap, num_real):
            got = _run_assign(
                log_probs, idx_mapping, temperature, calib, cap, n, idx_dtype
            )
            want = assign_tree_nodes_reference(
                log_probs, idx_mapping, temperature, rate_np, cap, n
            )
            assert np.array_equal(got[0], want[0]), (seed, n, got[0], want[0])
            assert np.array_equal(got[1], want[1]), (seed, n)
            assert got[0].sum() == n
            launches += 1
            compared += num_reqs * cap
    return launches, compared


@pytest.mark.parametrize("cap", [1, 2, 15, 31, 127, 128])
@pytest.mark.parametrize("num_reqs", [1, 3, 7, 33])
def test_assign_matches_reference(num_reqs, cap):
    seeds = range(1000 * num_reqs + cap, 1000 * num_reqs + cap + 3)
    launches, compared = _compare_assign(num_reqs, cap, seeds)
    print(f"{launches} batches, {compared} candidates compared")
    assert launches >= 3 * min(num_reqs * cap, 2)
    assert compared >= launches * num_reqs * cap


@gpu_only
@pytest.mark.parametrize(
    "num_reqs, cap", [(1024, 16), (128, 128), (16, 1024), (5, 1000)]
)
def test_assign_matches_reference_full_size(num_reqs, cap):
    launches, compared = _compare_assign(num_reqs, cap, range(4))
    assert launches >= 4 * 3 and compared >= launches * num_reqs * cap


def test_assign_tie_rule_lower_batch_index_first():
    """Identical rows: the extra node goes to the lower batch index (not the
    lower request-state row); padding fills the lowest batch index first."""
    cap = 4
    row = np.array([-0.1, -0.5, -2.0, -3.0, 0.0], dtype=F32)  # column 4: past cap
    log_probs = np.stack([row] * 3 + [np.full(5, NEG_INF, dtype=F32)] * 2)
    temperature = np.zeros(5, dtype=F32)
    idx_mapping = np.array([2, 0, 1], dtype=np.int64)  # state order reversed
    calib = _calibration()
    cases = {1: [1, 0, 0], 5: [2, 2, 1], 7: [3, 2, 2], 12: [4, 4, 4]}
    for n, want in cases.items():
        counts, qsl = _run_assign(
            log_probs, idx_mapping, temperature, calib, cap, n, torch.int64
        )
        assert counts.tolist() == want, n
        assert qsl.tolist() == [0, *np.cumsum(np.add(want, 1)).tolist()]
    # Two all-padding requests after one real one: padding after every real
    # node, then in batch order.
    idx_mapping = np.array([3, 0, 4], dtype=np.int64)
    counts, _ = _run_assign(
        log_probs, idx_mapping, temperature, calib, cap, 7, torch.int64
    )
    assert counts.tolist() == [3, 4, 0]
    print(f"{len(cases) + 1} tie cases checked")


def test_assign_ranks_by_calibrated_value():
    """The same tree verifies more nodes for a greedy request than for a
    sampled one whose class accepts less, and a plateau of the map is broken
    by the drafter's probability."""
    cap = 8
    rows = np.tile(-np.arange(1, cap + 1, dtype=F32) * F32(0.5), (2, 1))
    temperature = np.array([1.0, 0.0], dtype=F32)  # state 0 sampled, 1 greedy
    rate = np.tile(np.linspace(0.0, 1.0, NUM_BINS, dtype=F32), (2, 1))
    rate[1] *= F32(0.25)
    calib = _calibration(rate)
    idx_mapping = np.array([0, 1], dtype=np.int64)
    counts, _ = _run_assign(
        rows, idx_mapping, temperature, calib, cap, cap, torch.int64
    )
    assert counts[1] > counts[0]
    # A flat map: every key differs only by the tilt, so each request's nodes
    # still rank by log q and ties go by batch index.
    calib = _calibration(np.full((2, NUM_BINS), 0.5, dtype=F32))
    counts, _ = _run_assign(rows, idx_mapping, temperature, calib, cap, 9, torch.int64)
    assert counts.tolist() == [5, 4]


def test_assign_is_deterministic():
    rng = np.random.default_rng(5)
    log_probs, idx_mapping, temperature, _ = _batch(rng, 33, 31)
    calib = _calibration(_random_rate(rng))
    runs = [
        _run_assign(log_probs, idx_mapping, temperature, calib, 31, 500, torch.int32)
        for _ in range(3)
    ]
    for counts, qsl in runs[1:]:
        assert np.array_equal(counts, runs[0][0]) and np.array_equal(qsl, runs[0][1])


def test_assign_rejects_bad_arguments():
    calib = _calibration()
    log_probs = torch.zeros(4, 8, device=DEVICE)
    idx = torch.arange(3, device=DEVICE)
    temp = torch.zeros(4, device=DEVICE)
    out = [torch.zeros(4, dtype=torch.int32, device=DEVICE) for _ in range(3)]
    with pytest.raises(ValueError, match="num_nodes must be in 1..num_reqs"):
        assign_tree_nodes(log_probs, idx, temp, calib, 8, 25, *out)
    with pytest.raises(ValueError, match="num_nodes must be in 1..num_reqs"):
        assign_tree_nodes(log_probs, idx, temp, calib, 8, 0, *out)
    with pytest.raises(ValueError, match="cap must be in"):
        assign_tree_nodes(log_probs, idx, temp, calib, 9, 4, *out)
    with pytest.raises(ValueError, match="query_start_loc must be int32"):
        assign_tree_nodes(log_probs, idx, temp, calib, 8, 4, out[0], out[1][:3], out[2])
    with pytest.raises(ValueError, match="counts must be int32"):
        assign_tree_nodes(log_probs, idx, temp, calib, 8, 4, out[0].long(), *out[1:])
    with pytest.raises(ValueError, match="float32"):
        assign_tree_nodes(log_probs.double(), idx, temp, calib, 8, 4, *out)


# --- Calibration -------------------------------------------------------------


def test_prior_is_exp_of_bin_centre():
    calib = _calibration()
    width = -LOGQ_MIN / NUM_BINS
    centres = LOGQ_MIN + (np.arange(NUM_BINS) + 0.5) * width
    want = np.exp(centres)
    rate = _host(calib.rate)
    assert rate.shape == (2, NUM_BINS)
    for c in range(2):
        np.testing.assert_allclose(rate[c], want, rtol=1e-6)
    for t in (calib.counts, calib.pending, calib.totals):
        assert not t.any()
    # Values at the centres are the prior; padding is worth 0.
    rows = np.array([list(centres.astype(F32)) + [-np.inf]], dtype=F32)
    values = calibrated_value_reference(rows, np.array([[0]]), rate)
    np.testing.assert_allclose(values[0, :-1], want, rtol=1e-6)
    assert values[0, -1] == 0.0


def _random_step(rng, num_reqs, max_num_reqs, width, depth):
    """A walked step: verified counts (some 0), accepted paths with garbage
    past their length, garbage lengths for requests that verified nothing."""
    log_probs = _tree_rows(rng, max_num_reqs, width)
    idx_mapping = rng.permutation(max_num_reqs)[:num_reqs]
    temperature = np.where(rng.random(max_num_reqs) < 0.5, 0.0, 1.0).astype(F32)
    verified = rng.integers(0, width + 1, num_reqs)
    verified[rng.random(num_reqs) < 0.2] = 0
    cu = np.concatenate([[0], np.cumsum(1 + verified)]).astype(np.int32)
    accepted = rng.integers(-3, width + 4, (num_reqs, depth)).astype(np.int32)
    num_accepted = rng.integers(0, depth + 1, num_reqs).astype(np.int32)
    for r, c in enumerate(verified):
        if c == 0:
            continue
        real = int((log_probs[idx_mapping[r], :c] > NEG_INF).sum())
        k = int(rng.integers(0, min(real, depth) + 1))
        num_accepted[r] = k
        accepted[r, :k] = np.sort(rng.choice(np.arange(1, real + 1), k, replace=False))
        if k and rng.random() < 0.3:
            # Malformed entries, ignored: a padding or unverified node, or 0.
            accepted[r, rng.integers(0, k)] = rng.choice([c + 1, width, 0, real + 1])
    return log_probs, idx_mapping, temperature, cu, accepted, num_accepted


def _update(calib, step):
    log_probs, idx_mapping, temperature, cu, accepted, num_accepted = step
    calib.update(
        torch.from_numpy(log_probs).to(DEVICE),
        torch.from_numpy(idx_mapping).to(DEVICE),
        torch.from_numpy(temperature).to(DEVICE),
        torch.from_numpy(cu).to(DEVICE),
        torch.from_numpy(accepted).to(DEVICE),
        torch.from_numpy(num_accepted).to(DEVICE),
    )


def _state(calib):
    return {
        "counts": _host(calib.counts),
        "rate": _host(calib.rate),
        "prior": _host(calib.prior),
        "totals": _host(calib.totals).astype(np.float64),
    }


def _compare_calibration(num_reqs, width, depth, num_steps, seed):
    rng = np.random.default_rng(seed)
    calib = TreeAcceptanceCalibration(torch.device(DEVICE), decay=0.9)
    want = _state(calib)
    nodes = 0
    for _ in range(num_steps):
        step = _random_step(rng, num_reqs, num_reqs + 4, width, depth)
        _update(calib, step)
        calibration_step_reference(want, *step, decay=0.9, prior_strength=2.0)
        got = _state(calib)
        assert np.array_equal(got["counts"], want["counts"])
        # The kernel's sums run in another order than the reference's.
        # (No rate is 0: every bin's sum holds prior_strength * prior.)
        np.testing.assert_allclose(got["rate"], want["rate"], rtol=2e-6, atol=0)
        assert not calib.pending.any()
        assert np.array_equal(got["totals"][1:], want["totals"][1:])
        np.testing.assert_allclose(got["totals"][0], want["totals"][0], rtol=1e-5)
        rate = got["rate"]
        assert (np.diff(rate, axis=1) >= 0).all() and (rate >= 0).all()
        assert (rate <= 1).all()
        nodes += int(step[3][-1]) - num_reqs
    return nodes


@pytest.mark.parametrize(
    "num_reqs, width, depth, seed", [(1, 1, 1, 0), (7, 15, 4, 1), (33, 64, 15, 2)]
)
def test_calibration_update_matches_reference(num_reqs, width, depth, seed):
    nodes = _compare_calibration(num_reqs, width, depth, num_steps=12, seed=seed)
    print(f"{nodes} verified nodes compared over 12 steps")
    assert nodes >= 12 * num_reqs * width // 4


@gpu_only
@pytest.mark.parametrize("num_reqs, width, depth", [(1024, 16, 15), (64, 1024, 16)])
def test_calibration_update_matches_reference_full_size(num_reqs, width, depth):
    nodes = _compare_calibration(num_reqs, width, depth, num_steps=4, seed=num_reqs)
    assert nodes >= num_reqs * width


def test_rate_is_isotonic_fit():
    """Low bins accepted, high bins rejected: the bins in between are pooled
    into one rate, the nodes' weighted mean, where a suffix minimum would cap
    the accepted bin at the empty bin above it (its prior, about 2e-6) and the
    bins below the rejected one at its estimate."""
    calib = _calibration()
    # Bin 10 (log q about -13.4) always accepted, bin 60 (about -0.9) never.
    log_probs = np.array([[-0.9] * 50 + [-13.4] * 50], dtype=F32)
    cu = np.array([0, 101], dtype=np.int32)
    accepted = np.arange(51, 101, dtype=np.int32)[None, :]
    step = (log_probs, np.array([0]), np.zeros(1, F32), cu, accepted, np.array([50]))
    _update(calib, step)
    rate = _host(calib.rate)[0]
    prior = _host(calib.prior)
    counts = _host(calib.counts)[0].astype(np.float64)
    num, den = counts[:, 1] + 2 * prior, counts[:, 0] + 2
    assert (np.diff(rate) >= 0).all()
    # One block from the accepted bin to the rejected one, at its weighted mean.
    block = np.flatnonzero(np.isclose(rate, rate[10], rtol=1e-6))
    assert block[0] == 10 and block[-1] == 60, block
    np.testing.assert_allclose(rate[10], num[10:61].sum() / den[10:61].sum(), rtol=1e-6)
    # Bins below and above the block keep their prior (nothing was seen there).
    np.testing.assert_array_equal(rate[:10], prior[:10])
    np.testing.assert_array_equal(rate[61:], prior[61:])
    # Closer to the estimates, in weighted squares, than the suffix minimum.
    raw = num / den
    suffix_min = np.minimum.accumulate(raw[::-1])[::-1]
    assert suffix_min[10] < 0.05 and rate[10] > 0.25

    def error(fit):
        return (den * (fit - raw) ** 2).sum()

    assert error(rate) < 0.75 * error(suffix_min)
    # The sampled class saw nothing and keeps its prior.
    np.testing.assert_array_equal(_host(calib.rate)[1], prior)
    calib.reset()
    np.testing.assert_array_equal(calib.rate[0].cpu(), calib.prior.cpu())
    assert not calib.counts.any() and not calib.totals.any()


def _acceptance(log_q, cls):
    """The synthetic walk's P(accept): greedy exp(log q / 4), sampled half that
    at exp(log q / 2)."""
    return np.where(cls == 0, np.exp(log_q / 4), 0.5 * np.exp(log_q / 2))


def test_calibration_converges():
    """Nodes accepted independently with a known P(accept | class, log q): the
    learned rate approaches it per bin, and predicted accepted nodes approach
    the observed ones."""
    rng = np.random.default_rng(7)
    num_reqs, cap, num_steps = 32, 128, 80
    calib = _calibration()
    temperature = np.where(np.arange(num_reqs) % 2, 1.0, 0.0).astype(F32)
    idx_mapping = np.arange(num_reqs)
    cu = np.arange(num_reqs + 1, dtype=np.int32) * (cap + 1)
    history = []
    for _ in range(num_steps):
        log_probs = -np.sort(rng.uniform(0, -LOGQ_MIN, (num_reqs, cap)), axis=1)
        log_probs = log_probs.astype(F32)
        cls = (temperature > 0)[:, None].astype(np.int64)
        hit = rng.random((num_reqs, cap)) < _acceptance(log_probs, cls)
        accepted = np.zeros((num_reqs, cap), dtype=np.int32)
        for r in range(num_reqs):
            nodes = np.flatnonzero(hit[r]) + 1
            accepted[r, : len(nodes)] = nodes
        step = (log_probs, idx_mapping, temperature, cu, accepted, hit.sum(1))
        _update(calib, step)
        history.append(_host(calib.totals).astype(np.float64))
    centres = LOGQ_MIN + (np.arange(NUM_BINS) + 0.5) * (-LOGQ_MIN / NUM_BINS)
    rate = _host(calib.rate)
    counts = _host(calib.counts)
    for c in range(2):
        err = np.abs(rate[c] - _acceptance(centres, c))
        assert err.max() < 0.06, (c, err.max())
        assert counts[c, :, 0].min() > 500  # every bin learned from many nodes
    last = history[-1] - history[num_steps // 2]
    predicted, observed = last[0], last[1]
    assert abs(predicted / observed - 1) < 0.03, (predicted, observed)
    print(
        f"{int(history[-1][3])} nodes over {num_steps} steps; rate error "
        f"{np.abs(rate - _acceptance(centres, np.arange(2)[:, None])).max():.3f}"
    )


def test_update_is_deterministic():
    rng = np.random.default_rng(3)
    steps = [_random_step(rng, 9, 12, 31, 8) for _ in range(3)]
    states = []
    for _ in range(2):
        calib = _calibration()
        for step in steps:
            _update(calib, step)
        states.append((calib.counts.cpu(), calib.rate.cpu()))
    assert torch.equal(states[0][0], states[1][0])
    assert torch.equal(states[0][1], states[1][1])


# --- expected_accepted_nodes -------------------------------------------------


def _compare_expected(num_reqs, cap, seeds):
    compared = 0
    worst = 0.0
    for seed in seeds:
        rng = np.random.default_rng(seed)
        log_probs, idx_mapping, temperature, rate = _batch(rng, num_reqs, cap)
        # Batch order: row r belongs to batch request r.
        batch_rows = log_probs[idx_mapping]
        calib = _calibration(rate)
        rate_np = _host(calib.rate)
        num_real = int((batch_rows[:, :cap] > NEG_INF).sum())
        budgets = _budget_points(rng, num_reqs, cap, num_real)
        budgets += [int(b) for b in rng.integers(1, num_reqs * cap + 1, 16)]
        budgets = budgets[:16]
        out = torch.full((17,), -1.0, device=DEVICE)
        expected_accepted_nodes(
            torch.from_numpy(batch_rows).to(DEVICE),
            torch.from_numpy(temperature).to(DEVICE),
            torch.from_numpy(idx_mapping).to(DEVICE),
            calib,
            cap,
            torch.tensor(budgets, dtype=torch.int32, device=DEVICE),
            out,
        )
        got = _host(out).astype(np.float64)
        assert got[len(budgets) :].tolist() == [-1.0] * (17 - len(budgets))
        for n, e in zip(budgets, got):
            exact, exchanged = expected_accepted_nodes_reference(
                batch_rows, temperature, idx_mapping, rate_np, cap, n
            )
            err = abs(e - exact)
            # The documented bound, plus float32 summation.
            bound = 0.0118 * exact + 1.02e-4 * exchanged + 4e-11 * n
            assert err <= bound + 1e-6 * exact + 1e-6, (seed, n, e, exact, exchanged)
            assert err <= max(0.015 * exact, 1e-3), (seed, n, e, exact)
            worst = max(worst, err / max(exact, 1e-3))
            compared += 1
    return compared, worst


@pytest.mark.parametrize("num_reqs, cap", [(1, 1), (3, 127), (7, 15), (33, 128)])
def test_expected_accepted_nodes_within_bound(num_reqs, cap):
    compared, worst = _compare_expected(num_reqs, cap, range(cap, cap + 4))
    print(f"{compared} budgets compared, worst relative error {worst:.4f}")
    assert compared >= 4 * 5


@gpu_only
@pytest.mark.parametrize("num_reqs, cap", [(1024, 16), (16, 1024)])
def test_expected_accepted_nodes_full_size(num_reqs, cap):
    compared, _ = _compare_expected(num_reqs, cap, range(3))
    assert compared >= 3 * 16


def test_expected_accepted_nodes_rejects_bad_arguments():
    calib = _calibration()
    log_probs = torch.zeros(3, 8, device=DEVICE)
    temp = torch.zeros(3, device=DEVICE)
    idx = torch.arange(3, device=DEVICE)
    out = torch.zeros(17, device=DEVICE)
    budgets = torch.ones(17, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="1..16 budgets"):
        expected_accepted_nodes(log_probs, temp, idx, calib, 8, budgets, out)
    with pytest.raises(ValueError, match="out must be float32"):
        expected_accepted_nodes(log_probs, temp, idx, calib, 8, budgets[:4], out[:3])
    with pytest.raises(ValueError, match="rows for 4 requests"):
        expected_accepted_nodes(
            log_probs, temp, torch.arange(4, device=DEVICE), calib, 8, budgets[:4], out
        )
