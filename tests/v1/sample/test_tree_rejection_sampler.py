# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for the DDTree tree rejection sampler.

Small shapes run on the CPU through the Triton interpreter; the full-size cases
(vocab 151936, budgets up to 1024, many seeds) run only on a GPU.
"""

import types
from collections import Counter

import numpy as np
import pytest
import torch

from tests.v1.ddtree_reference import build_ddtree_reference, walk_trees_reference
from tests.v1.sample.mrv2_stubs import (
    StubSampler,
    apply_sampling_params,
    interpreter_shims,
)
from vllm.v1.sample.tree_rejection_sampler import (
    TreeRejectionSampler,
    TreeSampleOutput,
    tree_rejection_sample,
    walk_trees,
)
from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample
from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores
from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS
from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")


@pytest.fixture(scope="module", autouse=True)
def _interpreter_shims():
    with interpreter_shims():
        yield


# ---------------------------------------------------------------------------
# Helpers: batch layout, trees, references.
# ---------------------------------------------------------------------------


def _layout(num_nodes: list[int]):
    """cu_num_logits, row -> request, row -> local index for trees of b_r nodes."""
    counts = torch.tensor(num_nodes, dtype=torch.int64) + 1
    cu = torch.zeros(len(num_nodes) + 1, dtype=torch.int32)
    cu[1:] = counts.cumsum(0)
    req = torch.repeat_interleave(torch.arange(len(num_nodes)), counts)
    local = torch.cat([torch.arange(int(c)) for c in counts])
    return cu, req.to(torch.int32), local.to(torch.int32)


def _depths(parent_ids: list[int], num_nodes: int) -> list[int]:
    """Depth of tree tokens 0..num_nodes (root = 0)."""
    depth = [0]
    for i in range(num_nodes):
        depth.append(depth[parent_ids[i]] + 1)
    return depth


def _positions(parent_ids: torch.Tensor, num_nodes: list[int], p0: list[int]):
    parents = parent_ids.tolist()
    pos = []
    for r, b in enumerate(num_nodes):
        pos += [p0[r] + d for d in _depths(parents[r], b)]
    return torch.tensor(pos, dtype=torch.int64)


def _path(parents: list[int], node: int) -> list[int]:
    """Nodes from the root's child down to ``node`` (1-based)."""
    path = []
    while node != 0:
        path.append(node)
        node = parents[node - 1]
    return path[::-1]


def _steer(rows: torch.Tensor, tokens, parents, cu, num_nodes, gen) -> None:
    """Make the target's choices follow a random path of each tree, in place.

    ``rows`` is [num_logits] samples (set directly) or [num_logits, V] logits
    (argmax raised). Each request gets a random target node (or none), so
    acceptance lengths cover 0..depth.
    """
    tokens, parents = tokens.tolist(), parents.tolist()
    for r, b in enumerate(num_nodes):
        target = int(torch.randint(0, b + 1, (1,), generator=gen)) if b else 0
        cur = 0
        for node in _path(parents[r], target):
            tok = tokens[r][node - 1]
            if tok < 0:
                break
            row = int(cu[r]) + cur
            if rows.dim() == 1:
                rows[row] = tok
            else:
                rows[row, tok] = rows[row].max() + 1.0
            cur = node


def _assert_same(out: TreeSampleOutput, ref: TreeSampleOutput) -> None:
    for name in ("sampled_token_ids", "num_sampled", "accepted_nodes", "num_accepted"):
        got, want = getattr(out, name).cpu(), getattr(ref, name)
        assert got.dtype == want.dtype, name
        assert torch.equal(got, want), f"{name}:\n{got}\nvs\n{want}"


def _chain(draft: list[list[int]], budget: int):
    """Chain-shaped trees: node i's parent is node i - 1, -1 tokens past b."""
    tokens = torch.full((len(draft), budget), -1, dtype=torch.int64)
    for r, d in enumerate(draft):
        tokens[r, : len(d)] = torch.tensor(d, dtype=torch.int64)
    parents = torch.arange(budget, dtype=torch.int32).expand(len(draft), -1)
    return tokens, parents.contiguous()


def _randn(*shape, seed: int) -> torch.Tensor:
    """Random logits made on the test device (full-vocab batches are large)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=DEVICE)


def _to(device, *tensors):
    return [t.to(device) for t in tensors]


def _on_cpu(out: TreeSampleOutput) -> TreeSampleOutput:
    return TreeSampleOutput(*(t.cpu() for t in vars(out).values()))


# ---------------------------------------------------------------------------
# Exactness of the walk kernel.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_reqs,budget,depth,vocab",
    [
        (5, 1, 3, 50),
        (7, 24, 6, 11),
        (3, 33, 4, 100),
        pytest.param(64, 1024, 15, 64, marks=gpu_only),
        pytest.param(257, 128, 15, 32, marks=gpu_only),
    ],
)
def test_walk_matches_reference(num_reqs, budget, depth, vocab):
    gen = torch.Generator().manual_seed(num_reqs * 1000 + budget)
    tree = build_ddtree_reference(
        torch.randn(num_reqs, depth, vocab, generator=gen) * 2, budget
    )
    # Trim some trees (b < budget); the last request has no drafts at all.
    num_nodes = [budget - (r % 3) * (budget // 3) for r in range(num_reqs)]
    num_nodes[-1] = 0
    cu, _, _ = _layout(num_nodes)
    node_sampled = torch.randint(0, vocab, (int(cu[-1]),), generator=gen)
    _steer(node_sampled, tree.token_ids, tree.parent_ids, cu, num_nodes, gen)

    ref = walk_trees_reference(node_sampled, tree.token_ids, tree.parent_ids, cu, depth)
    out = walk_trees(
        *_to(DEVICE, node_sampled, tree.token_ids, tree.parent_ids, cu), depth
    )
    _assert_same(out, ref)
    assert ref.num_accepted.max() > 0


@pytest.mark.parametrize("num_reqs,num_slots,budget,depth,vocab", [(5, 8, 24, 6, 11)])
def test_walk_reads_request_state_rows_in_place(
    num_reqs, num_slots, budget, depth, vocab
):
    """``tree_rows``: request r's tree is row tree_rows[r] of slot-order tensors
    (as DDTree keeps them), read in place; the same result as walking the rows
    gathered into batch order, and as the reference."""
    gen = torch.Generator().manual_seed(7)
    slots = build_ddtree_reference(
        torch.randn(num_slots, depth, vocab, generator=gen) * 2, budget
    )
    rows = torch.randperm(num_slots, generator=gen)[:num_reqs].to(torch.int32)
    tokens, parents = slots.token_ids[rows.long()], slots.parent_ids[rows.long()]
    num_nodes = [budget - (r % 3) * (budget // 3) for r in range(num_reqs)]
    cu, _, _ = _layout(num_nodes)
    node_sampled = torch.randint(0, vocab, (int(cu[-1]),), generator=gen)
    _steer(node_sampled, tokens, parents, cu, num_nodes, gen)
    ref = walk_trees_reference(node_sampled, tokens, parents, cu, depth)
    gathered = walk_trees(*_to(DEVICE, node_sampled, tokens, parents, cu), depth)
    in_place = walk_trees(
        *_to(DEVICE, node_sampled, slots.token_ids, slots.parent_ids, cu),
        depth,
        tree_rows=rows.to(DEVICE),
    )
    _assert_same(gathered, ref)
    _assert_same(in_place, ref)
    assert ref.num_accepted.sum() >= num_reqs  # paths were accepted


def _fed_tokens(tokens: torch.Tensor, cu: torch.Tensor, num_nodes, gen, flips):
    """[num_logits] input ids as the target was fed them: a random root token,
    then the tree's tokens (padding as 0), with ``flips`` random nodes fed
    another token than the tree holds."""
    fed = torch.zeros(int(cu[-1]), dtype=torch.int64)
    for r, b in enumerate(num_nodes):
        fed[int(cu[r]) + 1 : int(cu[r]) + 1 + b] = tokens[r, :b].clamp(min=0)
    nodes = [int(cu[r]) + 1 + i for r, b in enumerate(num_nodes) for i in range(b)]
    for j in torch.randperm(len(nodes), generator=gen)[:flips].tolist():
        fed[nodes[j]] += 1
    return fed


@pytest.mark.parametrize("num_reqs,budget,depth,vocab", [(7, 24, 6, 11), (4, 9, 3, 5)])
def test_walk_checks_fed_tokens(num_reqs, budget, depth, vocab):
    """With the fed input ids, a node whose token differs from what the target
    was fed at its row is never entered: kernel equals reference, and the
    mismatches cut paths that the tree tokens alone would accept."""
    gen = torch.Generator().manual_seed(budget)
    tree = build_ddtree_reference(
        torch.randn(num_reqs, depth, vocab, generator=gen) * 2, budget
    )
    num_nodes = [budget] * num_reqs
    cu, _, _ = _layout(num_nodes)
    node_sampled = torch.randint(0, vocab, (int(cu[-1]),), generator=gen)
    _steer(node_sampled, tree.token_ids, tree.parent_ids, cu, num_nodes, gen)
    fed = _fed_tokens(tree.token_ids, cu, num_nodes, gen, flips=num_reqs * 3)
    ref = walk_trees_reference(
        node_sampled, tree.token_ids, tree.parent_ids, cu, depth, fed
    )
    out = walk_trees(
        *_to(DEVICE, node_sampled, tree.token_ids, tree.parent_ids, cu),
        depth,
        fed.to(DEVICE),
    )
    _assert_same(out, ref)
    unchecked = walk_trees_reference(
        node_sampled, tree.token_ids, tree.parent_ids, cu, depth
    )
    assert ref.num_accepted.sum() < unchecked.num_accepted.sum()
    # Fed exactly as the trees say: the check changes nothing.
    same = _fed_tokens(tree.token_ids, cu, num_nodes, gen, flips=0)
    out = walk_trees(
        *_to(DEVICE, node_sampled, tree.token_ids, tree.parent_ids, cu),
        depth,
        same.to(DEVICE),
    )
    _assert_same(out, unchecked)


def test_walk_padding_and_max_depth():
    # Node 3 is a padding node (token -1); the chain 1 -> 2 is cut at max_depth 1.
    tokens = torch.tensor([[4, 5, -1]])
    parents = torch.tensor([[0, 1, 0]], dtype=torch.int32)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    node_sampled = torch.tensor([4, 5, 6, 7])
    out = walk_trees(*_to(DEVICE, node_sampled, tokens, parents, cu), 1)
    assert out.sampled_token_ids.cpu().tolist() == [[4, 5, -1, -1]]
    assert out.accepted_nodes.cpu().tolist() == [[1]]
    # A padding node never matches, not even a sample of -1.
    out = walk_trees(*_to(DEVICE, torch.tensor([-1, 0, 0, 0]), tokens, parents, cu), 2)
    assert out.num_accepted.cpu().tolist() == [0]
    # A row with no logits (a padded request) emits nothing.
    cu = torch.tensor([0, 4, 4], dtype=torch.int32)
    out = walk_trees(
        *_to(DEVICE, node_sampled, tokens.repeat(2, 1), parents.repeat(2, 1), cu), 2
    )
    assert out.num_sampled.cpu().tolist() == [3, 0]
    assert out.sampled_token_ids[1].cpu().tolist() == [-1] * 4


# ---------------------------------------------------------------------------
# Greedy: a chain equals vLLM's own MRv2 rejection sampler; trees equal argmax walk.
# ---------------------------------------------------------------------------


def _chain_drafts(case, logits, cu, num_nodes, vocab, gen):
    argmax = logits.argmax(-1).tolist()
    drafts = []
    for r, b in enumerate(num_nodes):
        start = int(cu[r])
        greedy = [argmax[start + i] for i in range(b)]
        random = torch.randint(0, vocab, (b,), generator=gen).tolist()
        coins = (torch.rand(b, generator=gen) < 0.7).tolist()
        if case == "all":
            d = greedy
        elif case == "none":
            d = [(g + 1) % vocab for g in greedy]
        elif case == "partial":
            m = b // 2
            d = greedy[:m] + [(g + 1) % vocab for g in greedy[m:]]
        else:
            d = [g if c else x for g, x, c in zip(greedy, random, coins)]
        drafts.append(d)
    return drafts


@pytest.mark.parametrize("case", ["random", "all", "none", "partial"])
@pytest.mark.parametrize(
    "budget,vocab",
    [
        (1, 111),
        (6, 100),
        pytest.param(15, 151936, marks=gpu_only),
        pytest.param(1024, 151936, marks=gpu_only),
    ],
)
def test_chain_matches_vllm_greedy(case, budget, vocab):
    gen = torch.Generator().manual_seed(budget + vocab)
    # Full, trimmed and draft-less requests in one batch.
    num_nodes = [budget, max(budget - 2, 1), 0, budget]
    num_reqs = len(num_nodes)
    cu, req, local = _layout(num_nodes)
    logits = _randn(int(cu[-1]), vocab, seed=budget)
    drafts = _chain_drafts(case, logits, cu, num_nodes, vocab, gen)
    tokens, parents = _chain(drafts, budget)
    pos = _positions(parents, num_nodes, [10 * r + 3 for r in range(num_reqs)])
    temperature = torch.zeros(num_reqs)
    seeds = torch.arange(num_reqs, dtype=torch.int64)
    # vLLM reads draft token i of request r at row cu[r] + i + 1.
    draft_sampled = torch.cat(
        [torch.tensor([7] + d, dtype=torch.int64) for d in drafts]
    )

    logits, cu, req, local, pos, temperature, seeds, draft_sampled = _to(
        DEVICE, logits, cu, req, local, pos, temperature, seeds, draft_sampled
    )
    want, want_num = rejection_sample(
        logits.clone(),
        None,
        draft_sampled,
        cu,
        pos,
        torch.arange(num_reqs, dtype=torch.int32, device=DEVICE),
        req,
        local,
        temperature,
        seeds,
        budget,
    )
    out = tree_rejection_sample(
        logits,
        *_to(DEVICE, tokens, parents),
        cu,
        pos,
        req,
        temperature,
        seeds,
        max_depth=budget,
    )
    assert torch.equal(out.num_sampled, want_num)
    for r in range(num_reqs):
        n = int(want_num[r])
        assert torch.equal(out.sampled_token_ids[r, :n], want[r, :n])
        assert (out.sampled_token_ids[r, n:] == -1).all()
        k = n - 1
        assert out.accepted_nodes[r, :k].tolist() == list(range(1, k + 1))
        assert (out.accepted_nodes[r, k:] == -1).all()
    if case == "all":
        assert out.num_accepted.tolist() == num_nodes
    if case == "none":
        assert out.num_accepted.tolist() == [0] * num_reqs


@pytest.mark.parametrize(
    "num_reqs,budget,depth,vocab,sparse",
    [
        (3, 12, 4, 111, False),
        (2, 1, 3, 100, False),
        (3, 12, 2, 111, True),
        pytest.param(8, 1024, 15, 151936, False, marks=gpu_only),
        pytest.param(64, 128, 15, 151936, False, marks=gpu_only),
    ],
)
def test_tree_greedy_matches_reference(num_reqs, budget, depth, vocab, sparse):
    gen = torch.Generator().manual_seed(budget * 7 + num_reqs)
    draft_logits = torch.randn(num_reqs, depth, vocab, generator=gen) * 3
    if sparse:
        # Two live tokens per depth: fewer than budget prefixes, so padding nodes.
        draft_logits[..., 2:] = float("-inf")
    tree = build_ddtree_reference(draft_logits, budget)
    num_nodes = [budget if r % 2 == 0 else max(budget // 2, 1) for r in range(num_reqs)]
    cu, req, _ = _layout(num_nodes)
    logits = _randn(int(cu[-1]), vocab, seed=budget)
    _steer(logits, tree.token_ids, tree.parent_ids, cu, num_nodes, gen)
    pos = _positions(tree.parent_ids, num_nodes, [5] * num_reqs)

    ref = walk_trees_reference(
        logits.argmax(-1).cpu(), tree.token_ids, tree.parent_ids, cu, depth
    )
    out = tree_rejection_sample(
        *_to(DEVICE, logits, tree.token_ids, tree.parent_ids, cu, pos, req),
        torch.zeros(num_reqs, device=DEVICE),
        torch.arange(num_reqs, dtype=torch.int64, device=DEVICE),
        max_depth=depth,
    )
    _assert_same(out, ref)
    if sparse:
        assert (tree.token_ids == -1).any()


@gpu_only
def test_cuda_graph_replay():
    """Captured once, sampling and walk serve new logits and trees in place."""
    num_reqs, budget, depth, vocab = 8, 128, 15, 151936
    gen = torch.Generator().manual_seed(4)

    def make_inputs():
        tree = build_ddtree_reference(
            torch.randn(num_reqs, depth, 64, generator=gen) * 2, budget
        )
        cu, req, _ = _layout([budget] * num_reqs)
        seed = int(torch.randint(1 << 30, (1,), generator=gen))
        logits = _randn(int(cu[-1]), vocab, seed=seed)
        _steer(logits, tree.token_ids, tree.parent_ids, cu, [budget] * num_reqs, gen)
        pos = _positions(tree.parent_ids, [budget] * num_reqs, [9] * num_reqs)
        return _to(DEVICE, logits, tree.token_ids, tree.parent_ids, cu, pos, req)

    temperature = torch.tensor([0.0, 1.0] * (num_reqs // 2), device=DEVICE)
    seeds = torch.arange(num_reqs, dtype=torch.int64, device=DEVICE)
    static = make_inputs()
    tree_rejection_sample(*static, temperature, seeds, depth)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = tree_rejection_sample(*static, temperature, seeds, depth)
    for _ in range(2):
        fresh = make_inputs()
        for buf, new in zip(static, fresh):
            buf.copy_(new)
        graph.replay()
        want = tree_rejection_sample(*fresh, temperature, seeds, depth)
        _assert_same(graph_out, _on_cpu(want))


# ---------------------------------------------------------------------------
# Sampling: seeded determinism and equality with non-speculative decoding.
# ---------------------------------------------------------------------------


def _small_tree_batch(num_reqs, vocab, gen):
    tree = build_ddtree_reference(torch.randn(1, 3, vocab, generator=gen) * 4, 6)
    tokens = tree.token_ids.expand(num_reqs, -1).contiguous()
    parents = tree.parent_ids.expand(num_reqs, -1).contiguous()
    num_nodes = [6] * num_reqs
    cu, req, _ = _layout(num_nodes)
    pos = _positions(parents, num_nodes, list(range(num_reqs)))
    return tokens, parents, cu, req, pos


def test_same_seed_same_output():
    num_reqs, vocab = 4, 111
    gen = torch.Generator().manual_seed(0)
    tokens, parents, cu, req, pos = _small_tree_batch(num_reqs, vocab, gen)
    logits = torch.randn(int(cu[-1]), vocab, generator=gen)
    args = _to(DEVICE, logits, tokens, parents, cu, pos, req)
    temperature = torch.ones(num_reqs, device=DEVICE)
    seeds = torch.tensor([11, 12, 13, 14], device=DEVICE)

    first = tree_rejection_sample(*args, temperature, seeds, max_depth=3)
    again = tree_rejection_sample(*args, temperature, seeds, max_depth=3)
    _assert_same(again, _on_cpu(first))
    other = tree_rejection_sample(*args, temperature, seeds + 100, max_depth=3)
    assert not torch.equal(other.sampled_token_ids, first.sampled_token_ids)


def _target_logits(context: tuple[int, ...], vocab: int) -> torch.Tensor:
    """A deterministic 'target model': peaked logits that depend on the context."""
    gen = torch.Generator().manual_seed(hash(context) % (1 << 62))
    return torch.randn(vocab, generator=gen) * 4


def _sample_sequentially(prompts, num_tokens, vocab, temperature, min_p, seeds):
    """Non-speculative MRv2 sampling, one token per request per step."""
    num_reqs = len(prompts)
    contexts = [list(p) for p in prompts]
    rows = torch.arange(num_reqs, dtype=torch.int32, device=DEVICE)
    for _ in range(num_tokens):
        logits = torch.stack([_target_logits(tuple(c), vocab) for c in contexts])
        pos = torch.tensor([len(c) - 1 for c in contexts], device=DEVICE)
        logits = apply_sampling_params(
            logits.to(DEVICE), rows, temperature, min_p=min_p
        )
        sampled = gumbel_sample(
            logits, rows, temperature, seeds, pos, apply_temperature=False
        )
        for c, y in zip(contexts, sampled.tolist()):
            c.append(y)
    return [c[len(p) :] for c, p in zip(contexts, prompts)]


def _sample_with_trees(prompts, num_tokens, vocab, temperature, min_p, seeds, budget):
    """DDTree decoding with a drafter that knows the target's greedy path."""
    num_reqs, depth = len(prompts), 4
    contexts = [list(p) for p in prompts]
    total_accepted = 0
    while min(len(c) - len(p) for c, p in zip(contexts, prompts)) < num_tokens:
        draft_logits = torch.empty(num_reqs, depth, vocab)
        for r, c in enumerate(contexts):
            greedy = list(c)
            for d in range(depth):
                draft_logits[r, d] = _target_logits(tuple(greedy), vocab)
                greedy.append(int(draft_logits[r, d].argmax()))
        tree = build_ddtree_reference(draft_logits, budget)
        parents, tokens = tree.parent_ids.tolist(), tree.token_ids.tolist()
        rows, pos = [], []
        for r, c in enumerate(contexts):
            for node in range(budget + 1):
                path = [tokens[r][n - 1] for n in _path(parents[r], node)]
                rows.append(_target_logits(tuple(c + path), vocab))
                pos.append(len(c) - 1 + len(path))
        cu, req, _ = _layout([budget] * num_reqs)
        req, cu = _to(DEVICE, req, cu)
        logits = apply_sampling_params(
            torch.stack(rows).to(DEVICE), req, temperature, min_p=min_p
        )
        out = tree_rejection_sample(
            logits,
            *_to(DEVICE, tree.token_ids, tree.parent_ids),
            cu,
            torch.tensor(pos, device=DEVICE),
            req,
            temperature,
            seeds,
            max_depth=depth,
        )
        total_accepted += int(out.num_accepted.sum())
        for r, c in enumerate(contexts):
            c += out.sampled_token_ids[r, : int(out.num_sampled[r])].tolist()
    emitted = [c[len(p) : len(p) + num_tokens] for c, p in zip(contexts, prompts)]
    return emitted, total_accepted


@pytest.mark.parametrize(
    "vocab,budget,num_tokens",
    [(100, 6, 8), pytest.param(151936, 64, 24, marks=gpu_only)],
)
def test_matches_sequential_sampling(vocab, budget, num_tokens):
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8]]
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.0], device=DEVICE)
    # min-p rather than top-k: vLLM picks its top-k backend by batch size, and the
    # sequential and tree batches differ in size.
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.1], device=DEVICE)
    seeds = torch.tensor([3, 1 << 40, -5, 77], device=DEVICE)
    want = _sample_sequentially(prompts, num_tokens, vocab, temperature, min_p, seeds)
    got, total_accepted = _sample_with_trees(
        prompts, num_tokens, vocab, temperature, min_p, seeds, budget
    )
    assert got == want
    assert total_accepted > 0


# ---------------------------------------------------------------------------
# Statistics: emitted tokens follow the target's autoregressive distribution.
# ---------------------------------------------------------------------------

# A small tree over six live tokens: root -> {17, 42}, 17 -> {3, 64}, 3 -> {99}.
STAT_SUPPORT = [3, 17, 42, 64, 99, 105]
STAT_TOKENS = [17, 42, 3, 64, 99]
STAT_PARENTS = [0, 0, 1, 1, 3]
STAT_DEPTH = 3
# Target probabilities over STAT_SUPPORT at the root and nodes 1..5: distinct
# values (no top-k ties) that make every path of the tree likely enough to see.
STAT_P = [
    [0.09, 0.40, 0.26, 0.11, 0.10, 0.04],
    [0.45, 0.05, 0.09, 0.26, 0.11, 0.04],
    [0.21, 0.19, 0.23, 0.17, 0.12, 0.08],
    [0.06, 0.09, 0.10, 0.13, 0.50, 0.12],
    [0.31, 0.28, 0.11, 0.10, 0.12, 0.08],
    [0.35, 0.16, 0.14, 0.15, 0.09, 0.11],
]
# Drafter marginals per depth whose top-k sets are the tree's sibling sets.
STAT_Q = [
    {17: 0.5, 42: 0.3, 3: 0.1, 105: 0.1},
    {3: 0.45, 64: 0.35, 99: 0.2},
    {99: 0.6, 3: 0.4},
]


def _stat_logits(vocab: int) -> torch.Tensor:
    """[num_tree_tokens, vocab] target logits, -inf outside STAT_SUPPORT."""
    logits = torch.full((len(STAT_P), vocab), float("-inf"))
    logits[:, STAT_SUPPORT] = torch.tensor(STAT_P).log()
    return logits


def _top_k_top_p_reference(logits, top_k, top_p):
    """Keep the top_k most likely tokens, then the smallest nucleus of the
    renormalized top-k distribution with mass >= top_p."""
    kth = logits.topk(top_k, dim=-1).values[:, -1:]
    logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = torch.zeros_like(probs, dtype=torch.bool)
    drop.scatter_(-1, order, mass_before >= top_p)
    return logits.masked_fill(drop, float("-inf"))


def _expected_sequences(probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Exact law of the emitted sequence under autoregressive target sampling:
    keep sampling while the sample is a child of the current tree node."""
    edges = zip(STAT_PARENTS, STAT_TOKENS)
    children = {(p, t): i + 1 for i, (p, t) in enumerate(edges)}
    law: dict[tuple[int, ...], float] = {}

    def visit(node, prefix, mass):
        for tok in STAT_SUPPORT:
            m = mass * float(probs[node, tok])
            if m == 0.0:
                continue
            child = children.get((node, tok))
            if child is not None and len(prefix) < STAT_DEPTH:
                visit(child, prefix + (tok,), m)
            else:
                law[prefix + (tok,)] = m

    visit(0, (), 1.0)
    return law


def _chi_square_pvalue(samples: list[tuple[int, ...]], law) -> float:
    """Chi-square goodness of fit, pooling bins expected below 5 counts."""
    counts = Counter(samples)
    assert set(counts) <= set(law), set(counts) - set(law)
    n = len(samples)
    observed, expected = [], []
    pooled_obs, pooled_exp = 0, 0.0
    for seq, p in law.items():
        if n * p >= 5:
            observed.append(counts[seq])
            expected.append(n * p)
        else:
            pooled_obs += counts[seq]
            pooled_exp += n * p
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    obs, exp = np.array(observed, float), np.array(expected, float)
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


# Penalties for the distribution test: the request's output so far, its
# prompt's tokens and the penalties (MRv2's arithmetic, per tree path).
STAT_OUTPUT = {3: 1, 64: 2, 17: 1}
STAT_PROMPT = [99, 105]
STAT_PENALTIES = (1.3, 0.4, 0.3)  # repetition, frequency, presence


def _stat_penalized_reference(raw: torch.Tensor, paths: bool = True) -> torch.Tensor:
    """Each tree token's logits penalized with the output so far plus the
    tokens on its root-to-node path (the root excluded, the node included;
    with ``paths=False`` the output alone, a verifier that ignores paths)."""
    rep, freq, pres = STAT_PENALTIES
    out = raw.clone()
    for node in range(out.shape[0]):
        counts = torch.zeros(raw.shape[1])
        for tok, n in STAT_OUTPUT.items():
            counts[tok] += n
        k = node if paths else 0
        while k:
            counts[STAT_TOKENS[k - 1]] += 1
            k = STAT_PARENTS[k - 1]
        seen = counts > 0
        in_prompt = torch.zeros(raw.shape[1], dtype=torch.bool)
        in_prompt[STAT_PROMPT] = True
        row = out[node]
        scale = torch.where(in_prompt | seen, rep, 1.0)
        row *= torch.where(row > 0, 1.0 / scale, scale)
        row -= freq * counts
        row -= pres * seen
    return out


def _stat_penalized(raw: torch.Tensor) -> torch.Tensor:
    """One request's tree rows penalized by ``apply_tree_penalties``."""
    from vllm.v1.sample.tree_rejection_sampler import apply_tree_penalties

    num_rows, vocab = raw.shape
    rep, freq, pres = STAT_PENALTIES
    counts = torch.zeros(1, vocab, dtype=torch.int32)
    for tok, n in STAT_OUTPUT.items():
        counts[0, tok] = n
    packed = torch.zeros(1, -(-vocab // 32), dtype=torch.int64)
    for t in STAT_PROMPT:
        packed[0, t // 32] |= 1 << (t % 32)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).int()
    zeros = torch.zeros(num_rows, dtype=torch.int32)
    logits = raw.clone().to(DEVICE)
    apply_tree_penalties(
        logits,
        *_to(
            DEVICE,
            zeros,
            torch.arange(num_rows, dtype=torch.int32),
            zeros,
            torch.tensor([STAT_PARENTS], dtype=torch.int32),
            torch.tensor([64] + STAT_TOKENS, dtype=torch.int32),  # root: last output
            torch.tensor([rep]),
            torch.tensor([freq]),
            torch.tensor([pres]),
            packed,
            counts,
        ),
        STAT_DEPTH,
    )
    return logits


def _stat_problem(num_reqs, vocab, processing):
    """Tree, processed logits for num_reqs copies, and the expected law."""
    raw = _stat_logits(vocab)
    if processing == "plain":
        temp, top_k, top_p = 1.0, None, None
        expected_logits = raw
    elif processing == "penalties":
        temp, top_k, top_p = 1.0, None, None
        expected_logits = _stat_penalized_reference(raw)
    else:
        temp, top_k, top_p = 0.8, 4, 0.87
        expected_logits = _top_k_top_p_reference(raw / temp, top_k, top_p)
    law = _expected_sequences(torch.softmax(expected_logits, dim=-1))

    num_nodes = [len(STAT_TOKENS)] * num_reqs
    cu, req, _ = _layout(num_nodes)
    tokens = torch.tensor([STAT_TOKENS] * num_reqs)
    parents = torch.tensor([STAT_PARENTS] * num_reqs, dtype=torch.int32)
    pos = _positions(parents, num_nodes, [100] * num_reqs)
    cu, req, pos, tokens, parents = _to(DEVICE, cu, req, pos, tokens, parents)
    temperature = torch.full((num_reqs,), temp, device=DEVICE)
    logits = raw.to(DEVICE).repeat(num_reqs, 1)
    if processing == "penalties":
        # Every request's rows penalized alike: one request's rows repeated.
        logits = _stat_penalized(raw).repeat(num_reqs, 1)
    elif processing != "plain":
        logits = apply_sampling_params(
            logits,
            req,
            temperature,
            top_k=torch.full((num_reqs,), top_k, dtype=torch.int32, device=DEVICE),
            top_p=torch.full((num_reqs,), top_p, device=DEVICE),
        )
    return logits, tokens, parents, cu, req, pos, temperature, law


def _emitted(out: TreeSampleOutput) -> list[tuple[int, ...]]:
    sampled, num = out.sampled_token_ids.cpu().tolist(), out.num_sampled.tolist()
    return [tuple(s[:n]) for s, n in zip(sampled, num)]


def _torch_gumbel_samples(logits, num_reqs, gen):
    """y_v = argmax(logits_v + g), with g drawn per (request, depth) so that
    siblings share noise, as vLLM's (seed, position)-keyed noise does."""
    depths = torch.tensor(_depths(STAT_PARENTS, len(STAT_TOKENS)))
    u = torch.rand(num_reqs, STAT_DEPTH + 1, logits.shape[1], generator=gen)
    noise = -torch.log(-torch.log(u.clamp(min=1e-20)))[:, depths].flatten(0, 1)
    return (logits.cpu() + noise).argmax(dim=-1)


NUM_STAT_REQS = 100_000 if ON_GPU else 400


@pytest.mark.parametrize("processing", ["plain", "top_k_top_p", "penalties"])
def test_distribution_with_walk_kernel(processing):
    logits, tokens, parents, cu, _, _, _, law = _stat_problem(
        NUM_STAT_REQS, 111, processing
    )
    gen = torch.Generator().manual_seed(99)
    node_sampled = _torch_gumbel_samples(logits, NUM_STAT_REQS, gen).to(DEVICE)
    out = walk_trees(node_sampled, tokens, parents, cu, STAT_DEPTH)
    emitted = _emitted(out)
    assert max(len(s) for s in emitted) == STAT_DEPTH + 1
    assert _chi_square_pvalue(emitted, law) > 1e-4
    if processing == "penalties":
        # The statistic tells path penalties from the output's alone.
        raw = _stat_logits(111)
        output_only = _stat_penalized_reference(raw, paths=False)
        law = _expected_sequences(torch.softmax(output_only, dim=-1))
        assert _chi_square_pvalue(emitted, law) < 1e-6


@gpu_only
@pytest.mark.parametrize("processing", ["plain", "top_k_top_p", "penalties"])
def test_distribution_with_vllm_gumbel(processing):
    num_reqs = 32768
    logits, tokens, parents, cu, req, pos, temperature, law = _stat_problem(
        num_reqs, 8193, processing
    )
    seeds = torch.randint(
        -(1 << 62), 1 << 62, (num_reqs,), generator=torch.Generator().manual_seed(5)
    ).to(DEVICE)
    out = tree_rejection_sample(
        logits, tokens, parents, cu, pos, req, temperature, seeds, STAT_DEPTH
    )
    assert _chi_square_pvalue(_emitted(out), law) > 1e-4


def _biased_walk(probs: torch.Tensor, num_reqs: int, gen) -> list[tuple[int, ...]]:
    """A plausible but biased verifier: try each sibling in turn with the
    min(1, p/q) test, then draw the bonus from the residual max(p - q, 0)."""
    rng = np.random.default_rng(int(torch.randint(0, 1 << 30, (1,), generator=gen)))
    probs = probs.double().numpy()
    kids = {v: [i + 1 for i, p in enumerate(STAT_PARENTS) if p == v] for v in range(6)}
    samples = []
    for _ in range(num_reqs):
        node, seq = 0, []
        while True:
            q = STAT_Q[len(seq)] if len(seq) < STAT_DEPTH else {}
            moved = False
            for child in kids[node] if len(seq) < STAT_DEPTH else []:
                tok = STAT_TOKENS[child - 1]
                if rng.random() < min(1.0, probs[node, tok] / q[tok]):
                    node, moved = child, True
                    seq.append(tok)
                    break
            if moved:
                continue
            residual = probs[node].copy()
            for tok, qt in q.items():
                residual[tok] = max(residual[tok] - qt, 0.0)
            if residual.sum() == 0.0:
                residual = probs[node]
            seq.append(int(rng.choice(len(residual), p=residual / residual.sum())))
            break
        samples.append(tuple(seq))
    return samples


def test_biased_verifier_is_detected():
    """The statistic has power: the min(1, p/q) rule with a top-k sibling set
    fails the same test at the same sample size."""
    probs = torch.softmax(_stat_logits(111), dim=-1)
    law = _expected_sequences(probs)
    samples = _biased_walk(probs, NUM_STAT_REQS, torch.Generator().manual_seed(3))
    assert _chi_square_pvalue(samples, law) < 1e-8


def test_e2e_biased_verifier_takes_the_samplers_arguments():
    """tests/v1/sample/biased_verifier.py replaces tree_rejection_sample inside an
    engine (the serving module's distribution test); an argument added to the
    sampler and not to it fails that engine on the GPU only, so check here."""
    import inspect

    from tests.v1.sample.biased_verifier import biased_tree_rejection_sample
    from vllm.v1.sample import tree_rejection_sampler as trs

    want = inspect.signature(trs.tree_rejection_sample).parameters
    got = inspect.signature(biased_tree_rejection_sample).parameters
    assert list(got) == list(want)
    assert len(want) >= 12
    # One call in MRv2's slot order: request r walks tree row tree_rows[r]; each
    # row's logits put all their mass on the row's chain, so every node passes.
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]], device=DEVICE)
    parents = torch.tensor([[0, 1, 2]] * 3, device=DEVICE)
    rows = [2, 0]
    logits = torch.full((8, 16), -1e4, device=DEVICE)
    for r, t in enumerate(rows):
        for i, nxt in enumerate([*tokens[t].tolist(), 11]):
            logits[4 * r + i, nxt] = 0.0
    out = biased_tree_rejection_sample(
        logits,
        tokens,
        parents,
        torch.tensor([0, 4, 8], device=DEVICE),
        torch.arange(8, device=DEVICE),
        torch.tensor([0] * 4 + [1] * 4, dtype=torch.int32, device=DEVICE),
        torch.ones(2, device=DEVICE),
        torch.zeros(2, dtype=torch.int64, device=DEVICE),
        3,
        tree_rows=torch.tensor(rows, dtype=torch.int32, device=DEVICE),
    )
    assert out.sampled_token_ids[:, :4].tolist() == [[7, 8, 9, 11], [1, 2, 3, 11]]


# ---------------------------------------------------------------------------
# The MRv2 sampler class.
# ---------------------------------------------------------------------------


def _input_batch(tokens, parents, num_nodes, seq_lens, p0):
    """An MRv2 InputBatch's fields for decode rows that verify whole trees."""
    num_reqs = len(num_nodes)
    cu, req, local = _layout(num_nodes)
    pos = _positions(parents, num_nodes, p0)
    input_ids = torch.cat(
        [torch.cat([torch.tensor([1]), tokens[r, :b]]) for r, b in enumerate(num_nodes)]
    )
    return types.SimpleNamespace(
        idx_mapping=torch.arange(num_reqs, dtype=torch.int32, device=DEVICE),
        idx_mapping_np=np.arange(num_reqs, dtype=np.int32),
        expanded_idx_mapping=req.to(DEVICE),
        expanded_local_pos=local.to(DEVICE),
        positions=pos.to(DEVICE),
        input_ids=input_ids.to(torch.int32).to(DEVICE),
        logits_indices=torch.arange(int(cu[-1]), device=DEVICE),
        cu_num_logits=cu.to(DEVICE),
        cu_num_logits_np=cu.numpy(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
    )


# Requests 0 and 1 name the token ids whose logprobs they want (1 fewer than
# the batch's widest, so its row ends in unused -inf columns); 2 is prefilling.
CUSTOM_LOGPROB_TOKEN_IDS = {0: [5, 7, 11], 1: [3]}


@pytest.mark.parametrize("custom", [False, True])
@pytest.mark.parametrize("num_logprobs", [NO_LOGPROBS, 0, 3])
def test_tree_rejection_sampler_class(num_logprobs, custom):
    vocab, num_reqs = 111, 3
    gen = torch.Generator().manual_seed(8)
    tree = build_ddtree_reference(torch.randn(num_reqs, 3, vocab, generator=gen), 6)
    # Request 2 is still prefilling (seq_len < prefill_len): one row, emits nothing.
    num_nodes = [6, 4, 0]
    batch = _input_batch(
        tree.token_ids, tree.parent_ids, num_nodes, [20, 30, 8], [19, 29, 7]
    )
    cu = batch.cu_num_logits.cpu()
    logits = torch.randn(int(cu[-1]), vocab, generator=gen)
    _steer(logits, tree.token_ids, tree.parent_ids, cu, num_nodes, gen)
    logits = logits.to(DEVICE)
    sampler = StubSampler(
        temperature=torch.tensor([0.0, 1.0, 1.0], device=DEVICE),
        seeds=torch.tensor([1, 2, 3], device=DEVICE),
        prefill_len=torch.tensor([5, 5, 50], dtype=torch.int32, device=DEVICE),
        num_logprobs=num_logprobs,
        logprob_token_ids=CUSTOM_LOGPROB_TOKEN_IDS if custom else None,
    )
    token_ids, parent_ids = _to(DEVICE, tree.token_ids, tree.parent_ids)
    # idx_mapping is the identity here: batch order is request-state order.
    tree_sampler = TreeRejectionSampler(sampler, 3, token_ids, parent_ids)

    out = tree_sampler(logits, batch)

    core = tree_rejection_sample(
        sampler.apply_sampling_params(
            logits, batch.expanded_idx_mapping, None, None, None, None
        ),
        token_ids,
        parent_ids,
        batch.cu_num_logits,
        batch.positions,
        batch.expanded_idx_mapping,
        sampler.sampling_states.temperature.gpu,
        sampler.sampling_states.seeds.gpu,
        max_depth=3,
    )
    assert torch.equal(out.sampled_token_ids, core.sampled_token_ids)
    assert torch.equal(out.accepted_nodes, core.accepted_nodes)
    assert torch.equal(out.num_accepted, core.num_accepted)
    k = core.num_accepted.tolist()
    assert out.num_sampled.tolist() == [k[0] + 1, k[1] + 1, 0]
    assert out.num_rejected.tolist() == [6 - k[0], 4 - k[1], 0]
    assert k[2] == 0

    if num_logprobs == NO_LOGPROBS and not custom:
        assert out.logprobs_tensors is None
        return
    # Emitted token j of request r was sampled at the path node of depth j;
    # its entry is r * stride + j, stride = the most a request emits (the host
    # knows where each request's entries start, whatever the rows' split).
    lp = out.logprobs_tensors
    stride = 3 + 1
    assert lp.cu_num_generated_tokens == [0, stride, 2 * stride]
    assert lp.logprobs.shape[0] == num_reqs * stride
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    checked = moved = tails = 0
    for r in range(2):
        path = [0] + core.accepted_nodes[r, : k[r]].tolist()
        for j, node in enumerate(path):
            row, src = r * stride + j, int(cu[r]) + node
            token = int(out.sampled_token_ids[r, j])
            assert int(lp.logprob_token_ids[row, 0]) == token
            torch.testing.assert_close(lp.logprobs[row, 0], log_probs[src, token])
            # vLLM's rank: logits of the row at least the emitted token's.
            rank = int((logits[src] >= logits[src, token]).sum())
            assert int(lp.selected_token_ranks[row]) == rank
            asked = CUSTOM_LOGPROB_TOKEN_IDS.get(r, []) if custom else []
            ids = lp.logprob_token_ids[row, 1:].tolist()
            if asked:
                # The ids asked for, then -inf columns (vLLM's layout).
                n = len(asked)
                assert ids[:n] == asked
                torch.testing.assert_close(
                    lp.logprobs[row, 1 : n + 1], log_probs[src, asked]
                )
                assert torch.isneginf(lp.logprobs[row, n + 1 :]).all()
                tails += lp.logprobs.shape[1] > n + 1
            elif num_logprobs > 0:
                top = log_probs[src].topk(num_logprobs).indices
                assert ids[:num_logprobs] == top.tolist()
            # What vLLM's one-token sampler returns for that row: the logits
            # a request sees at the node's position without speculation.
            one = compute_topk_scores(
                logits[src : src + 1],
                max(num_logprobs, 0),
                out.sampled_token_ids[r, j : j + 1],
                logprob_token_ids_state=sampler.logprob_token_ids_state,
                expanded_idx_mapping=batch.idx_mapping[r : r + 1],
                max_per_req_token_ids=3 if custom else 0,
            )
            width = one.logprob_token_ids.shape[1]
            assert lp.logprob_token_ids.shape[1] == width
            assert torch.equal(lp.logprob_token_ids[row], one.logprob_token_ids[0])
            assert torch.equal(lp.logprobs[row], one.logprobs[0])
            checked += 1
            moved += src != int(cu[r]) + j
    # Emitted past the root from a row other than its own, and entries past a
    # request's path that name its root row (the case the scatter of emitted
    # tokens must not mix up: the root's token stays the one emitted there).
    shared = sum(stride - (k[r] + 1) for r in range(2))
    assert checked >= 3 and moved >= 1 and shared >= 1, (checked, moved, shared)
    assert tails >= 1 or not custom, tails
    if DEVICE == "cuda":
        # No host sync in the logprobs path (async scheduling).
        torch.cuda.set_sync_debug_mode("error")
        try:
            tree_sampler._get_logprobs_tensors(batch, core, logits)
        finally:
            torch.cuda.set_sync_debug_mode(0)


ASKED = [9, 99, 999]


@gpu_only
def test_tree_rejection_sampler_with_vllm_sampler():
    """The class against vLLM's real MRv2 Sampler (UVA-backed states)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.states import RequestState

    vocab, budget, num_reqs = 151936, 32, 3
    req_states = RequestState(
        max_num_reqs=8,
        max_model_len=4096,
        max_num_batched_tokens=4096,
        num_speculative_steps=budget,
        vocab_size=vocab,
        device=torch.device(DEVICE),
    )
    sampler = Sampler(8, vocab, torch.device(DEVICE), req_states)
    temps = [0.0, 1.0, 0.6]
    prompt_lens = [10, 20, 100]
    for r in range(num_reqs):
        prompt = list(range(prompt_lens[r]))
        req_states.add_request(f"r{r}", prompt_lens[r], prompt, 0, 64)
        req_idx = req_states.req_id_to_index[f"r{r}"]
        # Request 0 asks for top-2 logprobs, request 1 for three given ids'.
        logprob_args = [{"logprobs": 2}, {"logprob_token_ids": ASKED}, {}][r]
        sampler.add_request(
            req_idx,
            prompt_lens[r],
            SamplingParams(temperature=temps[r], seed=r + 1, **logprob_args),
        )
    req_states.apply_staged_writes()
    sampler.apply_staged_writes()
    idx = [req_states.req_id_to_index[f"r{r}"] for r in range(num_reqs)]

    gen = torch.Generator().manual_seed(2)
    draft_logits = torch.randn(num_reqs, 15, vocab, generator=gen)
    tree = build_ddtree_reference(draft_logits, budget)
    # Requests 0 and 1 decode past their prompts; request 2 is mid-prefill.
    num_nodes = [budget, budget // 2, 0]
    batch = _input_batch(
        tree.token_ids, tree.parent_ids, num_nodes, [40, 50, 64], [39, 49, 63]
    )
    batch.idx_mapping = torch.tensor(idx, dtype=torch.int32, device=DEVICE)
    batch.idx_mapping_np = np.array(idx, dtype=np.int32)
    batch.expanded_idx_mapping = batch.idx_mapping[batch.expanded_idx_mapping.long()]
    cu = batch.cu_num_logits.cpu()
    logits = torch.randn(int(cu[-1]), vocab, generator=gen)
    _steer(logits, tree.token_ids, tree.parent_ids, cu, num_nodes, gen)
    logits = logits.to(DEVICE)
    token_ids, parent_ids = _to(DEVICE, tree.token_ids, tree.parent_ids)
    # The sampler reads the trees as request-state rows (idx_mapping).
    state_token_ids = token_ids.new_full((8, budget), -1)
    state_parent_ids = parent_ids.new_zeros((8, budget))
    state_token_ids[idx], state_parent_ids[idx] = token_ids, parent_ids

    out = TreeRejectionSampler(sampler, 15, state_token_ids, state_parent_ids)(
        logits.clone(), batch
    )
    temperature = sampler.sampling_states.temperature.gpu
    processed = apply_sampling_params(
        logits.clone(), batch.expanded_idx_mapping, temperature
    )
    core = tree_rejection_sample(
        processed,
        token_ids,
        parent_ids,
        batch.cu_num_logits,
        batch.positions,
        batch.expanded_idx_mapping,
        temperature,
        sampler.sampling_states.seeds.gpu,
        max_depth=15,
    )
    assert torch.equal(out.sampled_token_ids, core.sampled_token_ids)
    k = core.num_accepted.tolist()
    assert out.num_sampled.tolist() == [k[0] + 1, k[1] + 1, 0]
    assert out.num_rejected.tolist() == [budget - k[0], budget // 2 - k[1], 0]

    # Logprobs of each emitted token from its path row, as vLLM's one-token
    # sampler returns them (raw logprobs; unused columns -inf).
    lp = out.logprobs_tensors
    stride = lp.cu_num_generated_tokens[1]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    checked = 0
    for r in range(2):
        path = [0] + core.accepted_nodes[r, : k[r]].tolist()
        for j, node in enumerate(path):
            row, src = r * stride + j, int(cu[r]) + node
            ids = lp.logprob_token_ids[row].tolist()
            assert ids[0] == int(out.sampled_token_ids[r, j])
            asked = log_probs[src].topk(2).indices.tolist() if r == 0 else ASKED
            assert ids[1 : 1 + len(asked)] == asked
            torch.testing.assert_close(
                lp.logprobs[row, : 1 + len(asked)],
                log_probs[src, ids[: 1 + len(asked)]],
            )
            assert torch.isneginf(lp.logprobs[row, 1 + len(asked) :]).all()
            checked += 1
    # The root rows of both requests and at least one accepted node's row.
    assert sum(k[:2]) >= 1, (checked, k)
