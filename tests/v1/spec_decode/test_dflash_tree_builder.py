# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests of the batched DDTree builder against the paper's best-first heap."""

import itertools
import math

import pytest
import torch

from tests.v1.ddtree_reference import build_ddtree_reference, tree_from_parents
from tests.v1.spec_decode.top_search_spy import (
    lower_survivor_cap,
    lower_top_search,
    ranked_top_with_counts,
    top_search_plan,
)
from vllm.v1.attention.ops.tree_mask import num_mask_words
from vllm.v1.spec_decode.dflash_tree_builder import (
    DDTree,
    _ranked_top_tokens,
    build_ddtree,
    top_sort_max,
)

HAS_GPU = torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
DEVICE = "cuda" if HAS_GPU else "cpu"

# (num_reqs, depth, vocab, budget). The CPU runs Triton in the interpreter, where a
# sort of 1024 keys takes minutes, so budgets above 32 run only on the GPU.
CPU_CASES = [
    (1, 1, 3, 1),
    (1, 1, 3, 16),
    (3, 1, 50, 2),
    (2, 15, 3, 16),
    (3, 4, 50, 16),
    (2, 15, 50, 2),
    (1, 15, 1000, 32),
    (2, 3, 111, 24),
    # Full vocabulary: few positions (the interpreter runs ~75 chunk programs each).
    (2, 2, 151936, 2),
]
GPU_CASES = [
    (r, d, v, b)
    for (r, d), v, b in itertools.product(
        [(1, 1), (4, 15), (3, 1)], [3, 50, 1000, 151936], [1, 2, 16, 128, 1024]
    )
]


def _random_logits(num_reqs, depth, vocab, seed, device=DEVICE, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    # A spread of sharp and flat positions, as a drafter produces.
    scale = torch.rand(num_reqs, depth, 1, generator=gen) * 6 + 0.5
    logits = torch.randn(num_reqs, depth, vocab, generator=gen) * scale
    return logits.to(device=device, dtype=dtype)


def _assert_same_tree(tree: DDTree, ref: DDTree) -> None:
    fields = ("num_nodes", "token_ids", "parent_ids", "depths", "attn_mask")
    for field in (*fields, "log_probs"):
        got, want = getattr(tree, field).cpu(), getattr(ref, field)
        assert torch.equal(got, want), f"{field} differs:\n{got}\n{want}"


def _assert_valid_tree(tree: DDTree, depth: int) -> None:
    """Structure checks that do not depend on the reference."""
    tree = DDTree(*(t.cpu() for t in vars(tree).values()))
    num_reqs, budget = tree.token_ids.shape
    assert tree.attn_mask.shape == (num_reqs, budget + 1, num_mask_words(budget))
    for r in range(num_reqs):
        n_real = int(tree.num_nodes[r])
        tokens = tree.token_ids[r].tolist()
        parents = tree.parent_ids[r].tolist()
        depths = tree.depths[r].tolist()
        children = set()
        for n in range(budget):
            if n >= n_real:  # padding
                assert (tokens[n], parents[n], depths[n]) == (-1, 0, 0)
                continue
            p = parents[n]
            assert 0 <= p <= n, "parent must precede child"
            assert depths[n] == (1 if p == 0 else depths[p - 1] + 1)
            assert 1 <= depths[n] <= depth
            assert (p, tokens[n]) not in children, "sibling tokens must differ"
            children.add((p, tokens[n]))
    # Mask rows are exactly the ancestor-or-self sets.
    expected = tree_from_parents(tree.token_ids, tree.parent_ids).attn_mask
    assert torch.equal(tree.attn_mask, expected)


def _run_case(num_reqs, depth, vocab, budget, seed, dtype=torch.float32):
    logits = _random_logits(num_reqs, depth, vocab, seed, dtype=dtype)
    tree = build_ddtree(logits, budget)
    # The builder's own log-normalisers (same kernels, deterministic), so the
    # reference's log-probs agree to the last bit.
    _, _, lse = _ranked_top_tokens(logits, min(budget, vocab))
    torch.testing.assert_close(
        lse, torch.logsumexp(logits.float(), dim=-1), rtol=1e-5, atol=1e-5
    )
    _assert_valid_tree(tree, depth)
    _assert_same_tree(tree, build_ddtree_reference(logits, budget, lse=lse))
    return tree


@pytest.mark.parametrize("num_reqs,depth,vocab,budget", CPU_CASES)
def test_matches_heap_reference(num_reqs, depth, vocab, budget):
    for seed in range(2):
        _run_case(num_reqs, depth, vocab, budget, seed)


@pytest.mark.parametrize("sort_all", [True, False])
@pytest.mark.parametrize("cap", [1, 4])
def test_sort_all_fallback_matches_reference(monkeypatch, cap, sort_all):
    """Force the path that keeps the best of a depth's candidates (too many
    enter), by a sort of them all and by a radix select."""
    lower_survivor_cap(monkeypatch, cap, sort_all)
    for num_reqs, depth, vocab, budget in [(2, 15, 50, 16), (1, 4, 1000, 12)]:
        _run_case(num_reqs, depth, vocab, budget, seed=9)


@requires_gpu
@pytest.mark.parametrize("sort_all", [True, False])
@pytest.mark.parametrize("budget", [16, 128, 512])
def test_sort_all_fallback_full_size(monkeypatch, budget, sort_all):
    lower_survivor_cap(monkeypatch, 1, sort_all)
    _run_case(4, 15, 151936, budget, seed=4)


@requires_gpu
@pytest.mark.parametrize("num_reqs,depth,vocab,budget", GPU_CASES)
def test_matches_heap_reference_full_size(num_reqs, depth, vocab, budget):
    for seed in range(3):
        _run_case(num_reqs, depth, vocab, budget, seed)


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits(dtype):
    _run_case(4, 15, 151936, 128, seed=7, dtype=dtype)


def test_node_set_is_top_budget_prefixes():
    """Brute force over every prefix of a tiny drafter: the tree is the top set."""
    depth, vocab, budget = 3, 4, 11
    logits = _random_logits(1, depth, vocab, seed=3)
    tree = build_ddtree(logits, budget)
    logp = torch.log_softmax(logits[0].double().cpu(), dim=-1)
    scores = {}
    for d in range(1, depth + 1):
        for prefix in itertools.product(range(vocab), repeat=d):
            scores[prefix] = sum(logp[i, t].item() for i, t in enumerate(prefix))
    best = sorted(scores.values(), reverse=True)[:budget]
    # Map nodes back to prefixes.
    token_ids = tree.token_ids[0].tolist()
    parents = tree.parent_ids[0].tolist()
    prefixes = []
    for n in range(budget):
        p = parents[n]
        prefixes.append((prefixes[p - 1] if p else ()) + (token_ids[n],))
    got = sorted((scores[p] for p in prefixes), reverse=True)
    assert got == pytest.approx(best, rel=0, abs=1e-9)
    # Best-first order: node scores never increase.
    node_scores = [scores[p] for p in prefixes]
    assert all(a >= b - 1e-6 for a, b in itertools.pairwise(node_scores))


def test_ties_are_broken_by_rank():
    """Uniform logits: every prefix of a depth ties; shallower and lower ids win."""
    tree = build_ddtree(torch.zeros(2, 3, 5, device=DEVICE), 9)
    _assert_same_tree(tree, build_ddtree_reference(torch.zeros(2, 3, 5), 9))
    # All 5 depth-1 tokens in id order, then children of token 0 in id order.
    assert tree.token_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert tree.parent_ids[0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1]


def test_ties_at_the_top_k_cut():
    """More tied tokens than budget: the lowest token ids are kept."""
    logits = torch.zeros(1, 2, 40, device=DEVICE)
    logits[0, :, 30:] = 1.0  # ten winners, then thirty tied tokens
    tree = build_ddtree(logits, 12)
    _assert_same_tree(tree, build_ddtree_reference(logits.cpu(), 12))


def test_budget_larger_than_tree_space_pads():
    """Vocab 3, depth 1: only 3 prefixes exist; the rest of the budget is padding."""
    logits = _random_logits(2, 1, 3, seed=0)
    tree = build_ddtree(logits, 16)
    assert tree.num_nodes.tolist() == [3, 3]
    assert (tree.token_ids[:, 3:] == -1).all()
    assert (tree.parent_ids[:, 3:] == 0).all() and (tree.depths[:, 3:] == 0).all()
    _assert_valid_tree(tree, 1)
    # Padding rows see only the root and themselves.
    assert tree.attn_mask[0, 4:, 0].tolist() == [1 | (1 << n) for n in range(4, 17)]


def test_zero_probability_tokens_are_never_nodes():
    logits = _random_logits(1, 2, 50, seed=1)
    logits[0, 0, 5:] = float("-inf")  # only 5 live tokens at depth 1
    logits[0, 1, 2:] = float("-inf")  # and 2 at depth 2
    tree = build_ddtree(logits, 32)
    assert int(tree.num_nodes[0]) == 5 + 5 * 2
    _assert_same_tree(tree, build_ddtree_reference(logits.cpu(), 32))


def test_chain_when_drafter_is_certain():
    """One token per position carries all the mass: the tree is a chain."""
    depth, vocab = 6, 30
    logits = torch.full((1, depth, vocab), -30.0, device=DEVICE)
    chain = [7, 3, 9, 1, 4, 2]
    for d, t in enumerate(chain):
        logits[0, d, t] = 30.0
    tree = build_ddtree(logits, depth)
    assert tree.token_ids[0].tolist() == chain
    assert tree.parent_ids[0].tolist() == list(range(depth))
    assert tree.depths[0].tolist() == list(range(1, depth + 1))


def test_requests_are_independent():
    logits = _random_logits(3, 4, 50, seed=5)
    batched = build_ddtree(logits, 20)
    for r in range(3):
        single = build_ddtree(logits[r : r + 1], 20)
        for field in ("token_ids", "parent_ids", "depths", "attn_mask", "num_nodes"):
            assert torch.equal(getattr(batched, field)[r], getattr(single, field)[0])


@pytest.mark.parametrize(
    "shape,budget,match",
    [
        ((2, 15), 8, "must be \\[num_reqs, depth, vocab\\]"),
        ((1, 17, 10), 8, "depth must be in 1..16"),
        ((1, 3, 10), 0, "budget must be in 1..1024"),
        ((1, 3, 10), 1025, "budget must be in 1..1024"),
        ((1, 3, 10), 8.0, "budget must be an int"),
    ],
)
def test_bad_arguments(shape, budget, match):
    with pytest.raises(ValueError, match=match):
        build_ddtree(torch.zeros(shape), budget)


def test_integer_logits_rejected():
    with pytest.raises(ValueError, match="floating point"):
        build_ddtree(torch.zeros(1, 2, 5, dtype=torch.int64), 4)


@requires_gpu
def test_cuda_graph_capture_and_no_host_sync():
    logits = _random_logits(8, 15, 151936, seed=11, dtype=torch.bfloat16)
    eager = build_ddtree(logits, 128)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        build_ddtree(logits, 128)  # raises on any host sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static_in = logits.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = build_ddtree(static_in, 128)
    static_in.copy_(_random_logits(8, 15, 151936, seed=12, dtype=torch.bfloat16))
    graph.replay()
    static_in.copy_(logits)
    graph.replay()
    torch.cuda.synchronize()
    for field in ("token_ids", "parent_ids", "depths", "attn_mask", "num_nodes"):
        assert torch.equal(getattr(captured, field), getattr(eager, field))


def _ranked_reference(logits, k):
    values, ids = torch.sort(logits.float(), dim=-1, descending=True, stable=True)
    lse = torch.logsumexp(logits.float(), dim=-1)
    return values[..., :k] - lse[..., None], ids[..., :k], lse


def _tied_logits(num_rows, vocab, dtype=torch.float32):
    """Winners, then more tied tokens than fit, then losers."""
    x = torch.full((1, num_rows, vocab), -1.0, dtype=dtype)
    x[..., math.floor(vocab * 0.5) :] = 0.0
    x[..., math.floor(vocab * 0.9) :] = 1.0
    return x


# (shape, k, cap, spill, kind, path): each case runs ``path`` on at least one
# position (other positions may take others). "row": whole-row sort (vocab <=
# cap); "sort": at most cap tokens reach the chunk threshold; "spill": more, but
# at most the widest sort (crowded rows); "select": more, but at most spill,
# the radix select over the buffer; "exact": more than spill, the radix select
# over the row. The interpreter sorts 2048 keys in ~15 s, so the CPU cases lower spill.
TOP_CASES_CPU = [
    ((2, 3, 7), 3, None, None, "randn", "row"),
    ((2, 3, 1000), 32, None, 64, "randn", "sort"),
    ((1, 2, 40), 12, None, 64, "tied", "spill"),
    ((1, 2, 40), 4, None, 256, "tied", "spill"),  # all 40 tokens; sorts 64 of 256
    ((1, 2, 1000), 16, 16, 256, "randn", "spill"),  # sorts 64 of 256
    ((1, 2, 1000), 16, 16, 16, "randn", "exact"),
    ((1, 2, 1000), 8, 8, 64, "tied", "exact"),
    ((1, 2, 5000), 64, None, 128, "randn_bf16", "sort"),
    ((1, 1, 151936), 2, None, None, "randn", "sort"),
    ((2, 2, 5000), 16, None, 512, "crowded", "spill"),  # sorts 128 of 512
    ((2, 2, 5000), 16, None, 32, "crowded", "exact"),
    ((1, 2, 5000), 31, None, 128, "crowded", "spill"),
    # More candidates than the widest sort (256 keys, 512 in the wide class):
    # the radix select keeps the best of the buffer first.
    ((1, 2, 1000), 16, None, 512, "plateau300", "select"),  # 300 tied at the top
    ((2, 2, 1000), 16, None, 512, "spread300", "select"),
    ((1, 1, 2000), 200, None, 1024, "spread700", "select"),  # wide class
]
TOP_CASES_GPU = (
    [
        ((r, d, 151936), k, cap, None, kind, "sort")
        for (r, d) in [(1, 15), (4, 15)]
        for k in [1, 16, 128, 1024]
        for cap, kind in [(None, "randn"), (None, "randn_bf16")]
    ]
    + [
        ((r, d, 151936), k, None, None, "tied", "exact")
        for (r, d) in [(1, 15), (4, 15)]
        for k in [1, 16, 128, 1024]
    ]
    + [
        ((2, 15, 151936), 128, 128, None, "randn", "spill"),
        ((2, 15, 151936), 128, 128, 128, "randn", "exact"),
        ((1, 15, 151936), 1024, 1024, None, "tied", "exact"),
    ]
    + [
        ((4, 15, 151936), k, None, spill, "crowded", path)
        for k in (15, 31, 127)
        for spill, path in [
            # A crowded row's 4 * k best tokens are its candidates here; at
            # k = 127 they are more than the widest sort takes (top_sort_max):
            # the radix select keeps the best first.
            (
                None,
                "spill"
                if 4 * k <= top_sort_max(top_search_plan(151936, k, None, None))
                else "select",
            ),
            (2 * 2 ** (k - 1).bit_length(), "exact"),
        ]
    ]
)


def _crowded_logits(shape, k, seed=0):
    """A trained model's rows over a BPE vocabulary: the best tokens crowd into
    the lowest ids (frequent tokens are merged first), so one vocab chunk holds
    more of them than the chunk search reports and the exact path runs. The
    crowded tokens rise with their id over several powers of two (every byte
    of the radix select matters), in runs of three equal values (the cut falls
    among ties), so the best ones are not the first ids above a wrong cut."""
    gen = torch.Generator().manual_seed(seed)
    logits = _random_logits(*shape, seed=seed, device="cpu")
    n = 4 * k
    rising = torch.sort(torch.rand(n, generator=gen) * 14.0 + 3.0).values
    logits[..., :n] = rising[torch.arange(n) // 3 * 3]
    return logits


def _plateau_logits(shape, n, tied, seed=0):
    """Low random logits but for the ``n`` lowest ids far above them, all
    equal (``tied``) or distinct: crowded into few vocab chunks, so the chunk
    search's threshold falls below all ``n`` and every one is a candidate."""
    gen = torch.Generator().manual_seed(seed)
    logits = 0.01 * _random_logits(*shape, seed=seed, device="cpu") - 8.0
    high = 1.0 if tied else 1.0 + torch.rand(*shape[:-1], n, generator=gen)
    logits[..., :n] = high
    return logits


def _top_case_logits(shape, kind, seed=0, k=1):
    for prefix, tied in (("plateau", True), ("spread", False)):
        if kind.startswith(prefix):
            return _plateau_logits(shape, int(kind[len(prefix) :]), tied, seed)
    if kind == "tied":
        return _tied_logits(shape[0] * shape[1], shape[2]).reshape(shape)
    if kind == "crowded":
        return _crowded_logits(shape, k, seed=seed)
    logits = _random_logits(*shape, seed=seed, device="cpu")
    return logits.to(torch.bfloat16) if kind == "randn_bf16" else logits


def _search_paths(monkeypatch, logits, k, cap, spill):
    """Run the search; return its outputs and the paths its positions took."""
    out, count = ranked_top_with_counts(monkeypatch, logits, k, cap, spill)
    if count is None:
        return out, {"row"}
    plan = top_search_plan(logits.shape[-1], k, cap, spill)
    paths = {"sort": count <= plan.cap, "exact": count > plan.spill}
    paths["select"] = (count > top_sort_max(plan)) & ~paths["exact"]
    paths["spill"] = ~(paths["sort"] | paths["exact"] | paths["select"])
    return out, {name for name, rows in paths.items() if rows.any()}


def _check_ranked_top(monkeypatch, shape, k, cap, spill, kind, path):
    logits = _top_case_logits(shape, kind, k=k)
    (lp, ids, lse), paths = _search_paths(monkeypatch, logits.to(DEVICE), k, cap, spill)
    assert path in paths, paths
    want_lp, want_ids, want_lse = _ranked_reference(logits, k)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp.cpu(), want_lp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,k,cap,spill,kind,path", TOP_CASES_CPU)
def test_ranked_top_tokens(monkeypatch, shape, k, cap, spill, kind, path):
    """Each position's top tokens equal a stable descending sort's, ties at the
    cut going to the lowest ids, on every path of the search."""
    _check_ranked_top(monkeypatch, shape, k, cap, spill, kind, path)


@requires_gpu
@pytest.mark.parametrize("shape,k,cap,spill,kind,path", TOP_CASES_GPU)
def test_ranked_top_tokens_full_size(monkeypatch, shape, k, cap, spill, kind, path):
    _check_ranked_top(monkeypatch, shape, k, cap, spill, kind, path)


def test_ranked_top_tokens_random_cases():
    """Random vocabularies, budgets, caps and logit kinds (ties, -inf entries,
    bf16 duplicates) against a stable sort."""
    gen = torch.Generator().manual_seed(0)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    for _ in range(24):
        vocab = pick([2, 5, 17, 33, 100, 257, 1000, 3001])
        k = int(torch.randint(1, min(vocab, 64) + 1, (1,), generator=gen))
        kind = pick(["randn", "bf16", "ints", "neginf"])
        x = torch.randn(1, 2, vocab, generator=gen)
        if kind == "bf16":
            x = (x * 3).to(torch.bfloat16)
        elif kind == "ints":
            x = torch.randint(-3, 3, (1, 2, vocab), generator=gen).float()
        elif kind == "neginf":
            x[..., ::3] = float("-inf")
        cap = pick([None, 1 << (k - 1).bit_length(), 2 << (k - 1).bit_length()])
        spill = top_search_plan(vocab, k, cap).cap * pick([1, 2])
        with pytest.MonkeyPatch.context() as mp:
            lower_top_search(mp, cap, spill)
            lp, ids, lse = _ranked_top_tokens(x.to(DEVICE), k)
        want_lp, want_ids, want_lse = _ranked_reference(x, k)
        case = (vocab, k, cap, spill, kind)
        assert torch.equal(ids.cpu(), want_ids), case
        torch.testing.assert_close(lse.cpu(), want_lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lp.cpu(), want_lp, rtol=1e-5, atol=1e-5)


def test_out_buffers_are_written_in_place():
    """``out=`` (the speculator's persistent buffers) gets the same trees."""
    logits = _random_logits(2, 3, 50, seed=3)
    buffers = DDTree.empty(4, 8, torch.device(DEVICE))
    tree = build_ddtree(logits, 8, out=buffers.prefix(2))
    fresh = build_ddtree(logits, 8)
    _assert_same_tree(tree, DDTree(*(t.cpu() for t in vars(fresh).values())))
    assert tree.token_ids.data_ptr() == buffers.token_ids.data_ptr()
    with pytest.raises(ValueError, match="out.token_ids"):
        build_ddtree(logits, 8, out=DDTree.empty(2, 16, torch.device(DEVICE)))
    # The layout is cached per size; every field is still checked on each call.
    wrong_dtype = DDTree.empty(2, 8, torch.device(DEVICE))
    wrong_dtype.depths = wrong_dtype.depths.long()
    with pytest.raises(ValueError, match="out.depths must be a contiguous torch.int32"):
        build_ddtree(logits, 8, out=wrong_dtype)
    strided = DDTree.empty(2, 8, torch.device(DEVICE))
    wide = strided.attn_mask.new_empty(
        *strided.attn_mask.shape[:2], 2 * num_mask_words(8)
    )
    strided.attn_mask = wide[:, :, : num_mask_words(8)]  # right shape, not contiguous
    with pytest.raises(ValueError, match="out.attn_mask"):
        build_ddtree(logits, 8, out=strided)
