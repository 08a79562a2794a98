# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree's per-step input writers against their torch references, exactly.

Random batches mix full trees, trimmed trees, plain decodes and prefill chunks
in random request-state order, with odd sizes. Small cases run on the CPU in the
Triton interpreter; large budgets and batches only on a GPU.
"""

import pytest
import torch

from tests.v1.ddtree_reference import (
    build_ddtree_reference,
    prepare_draft_inputs_reference,
    write_tree_verify_inputs_reference,
)
from vllm.v1.spec_decode.ddtree_inputs import (
    store_draft_trees,
    draft_context_size,
    prepare_draft_inputs,
    write_tree_verify_inputs,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")
PAD_SLOT_ID = -1


def _batch(num_reqs, max_num_reqs, budget, gen, max_prefill=40, max_before_root=0):
    """Per request: (state index, tokens scheduled, tree nodes b, p0).

    Kinds: full tree, trimmed tree, decode without drafts, prefill chunk. With
    ``max_before_root``, every other tree follows up to that many prompt rows
    of the same step (its root is not the request's first row).
    """
    states = torch.randperm(max_num_reqs, generator=gen)[:num_reqs].tolist()
    reqs = []
    for s in states:
        kind = int(torch.randint(0, 4, (1,), generator=gen))
        p0 = int(torch.randint(0, 200, (1,), generator=gen))
        if kind == 0:
            b = budget
        elif kind == 1:
            b = int(torch.randint(1, budget + 1, (1,), generator=gen))
        else:
            b = 0
        if kind < 3:
            q = b + 1
        else:
            q = int(torch.randint(2, max_prefill, (1,), generator=gen))
        if b and max_before_root and len(reqs) % 2 == 0:
            q += int(torch.randint(1, max_before_root + 1, (1,), generator=gen))
        reqs.append((s, q, b, p0))
    return reqs


def _layout(reqs):
    qsl, cu = [0], [0]
    for _, q, b, _ in reqs:
        qsl.append(qsl[-1] + q)
        cu.append(cu[-1] + b + 1)
    return (torch.tensor(qsl, dtype=torch.int32), torch.tensor(cu, dtype=torch.int32))


def _trees(max_num_reqs, depth, budget, gen, vocab=50):
    logits = torch.randn(max_num_reqs, depth, vocab, generator=gen) * 2
    return build_ddtree_reference(logits, budget)


def _reset_slots(trees, slots, gen):
    """Slots as a request that joined without a drafted tree finds them
    (``DraftTrees.reset_``): tokens -1 over whatever depths and masks the slot
    held before (zeros if never used, a previous request's tree, or garbage)."""
    for i, s in enumerate(slots):
        trees.token_ids[s] = -1
        if i % 2:
            trees.depths[s] = 0
            trees.attn_mask[s] = 0
        else:
            trees.depths[s] = torch.randint(
                0, 16, trees.depths[s].shape, generator=gen, dtype=torch.int32
            )
            trees.attn_mask[s] = torch.randint(
                -(2**31),
                2**31 - 1,
                trees.attn_mask[s].shape,
                generator=gen,
                dtype=torch.int32,
            )


def _run_verify_writer(
    num_reqs, budget, depth, seed, pad=0, num_reset=0, max_before_root=0
):
    gen = torch.Generator().manual_seed(seed)
    max_num_reqs = num_reqs + pad + 3
    trees = _trees(max_num_reqs, depth, budget, gen)
    reqs = _batch(num_reqs, max_num_reqs, budget, gen, max_before_root=max_before_root)
    tree_slots = [s for s, _, b, _ in reqs if b]
    _reset_slots(trees, tree_slots[:num_reset], gen)
    qsl, cu = _layout(reqs)
    positions = torch.cat([torch.arange(p0, p0 + q) for _, q, _, p0 in reqs])
    idx = torch.tensor([s for s, *_ in reqs], dtype=torch.int32)
    num_words = trees.attn_mask.shape[2]
    outputs = []
    for fn, dev in (
        (write_tree_verify_inputs, DEVICE),
        (write_tree_verify_inputs_reference, "cpu"),
    ):
        pos = positions.clone().to(dev)
        mask = torch.full(
            (max_num_reqs, budget + 1, num_words), -5, dtype=torch.int32, device=dev
        )
        is_tree = torch.full((max_num_reqs,), 7, dtype=torch.int32, device=dev)
        fn(
            pos,
            mask,
            is_tree,
            trees.token_ids.to(dev),
            trees.depths.to(dev),
            trees.attn_mask.to(dev),
            idx.to(dev),
            qsl.to(dev),
            cu.to(dev),
            num_reqs + pad,
        )
        outputs.append([t.cpu() for t in (pos, mask, is_tree)])
    for got, want in zip(*outputs):
        assert torch.equal(got, want)
    return reqs, trees, outputs[0]


@pytest.mark.parametrize(
    "num_reqs, budget, depth, pad",
    [(1, 1, 1, 0), (3, 5, 3, 2), (7, 33, 15, 1), (5, 64, 16, 0)],
)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("num_reset", [0, 2])
def test_verify_writer_matches_reference(num_reqs, budget, depth, pad, seed, num_reset):
    _run_verify_writer(num_reqs, budget, depth, seed, pad, num_reset)


@gpu_only
@pytest.mark.parametrize("num_reqs, budget", [(64, 128), (7, 1024), (257, 8)])
def test_verify_writer_full_size(num_reqs, budget):
    _run_verify_writer(num_reqs, budget, 15, seed=num_reqs, pad=3, num_reset=5)


def _root_only_rows(b: int, num_words: int) -> torch.Tensor:
    """Mask rows of a tree of b padding nodes: {root}, then {root, self}."""
    rows = torch.zeros(b + 1, num_words, dtype=torch.int64)
    rows[:, 0] = 1
    for j in range(1, b + 1):
        rows[j, j // 32] |= 1 << (j % 32)
    return rows.to(torch.int32)


@pytest.mark.parametrize("budget", [6, 40])
def test_reset_slot_verifies_as_root_only(budget):
    """A request padded with placeholder drafts in a slot with no tree (never
    used, or left by the previous request): every node sits at the root's
    position, the root attends to itself only and each placeholder to the root
    and itself, whatever the slot held."""
    num_checked = 0
    for seed in range(4):
        reqs, _, (pos, mask, _) = _run_verify_writer(
            5, budget, 4, seed=seed, num_reset=5
        )
        start = 0
        for r, (_, q, b, p0) in enumerate(reqs):
            if b:
                assert pos[start : start + q].tolist() == [p0] * q
                want = _root_only_rows(b, mask.shape[2])
                assert torch.equal(mask[r, : b + 1], want)
                num_checked += b + 1
            start += q
    print(f"root-only rows checked: {num_checked}")
    assert num_checked >= 40


def test_verify_writer_semantics():
    """Node i at p0 + depth_i (siblings share positions), masks copied, causal
    rows and graph padding flagged 0."""
    reqs, trees, (pos, mask, is_tree) = _run_verify_writer(6, 9, 4, seed=5, pad=2)
    start = 0
    for r, (s, q, b, p0) in enumerate(reqs):
        if b:
            assert pos[start] == p0
            assert (
                pos[start + 1 : start + q].tolist()
                == (p0 + trees.depths[s, :b]).tolist()
            )
            assert torch.equal(mask[r, : b + 1], trees.attn_mask[s, : b + 1])
        else:
            assert pos[start : start + q].tolist() == list(range(p0, p0 + q))
        assert is_tree[r] == int(b > 0)
        start += q
    assert is_tree[6:8].tolist() == [0, 0]


def test_verify_writer_prompt_rows_before_root():
    """Prompt rows scheduled before a request's root in the same step (a
    ``num_computed_tokens`` rollback could build such a step): they keep
    their causal positions, the tree sits after them, and ``is_tree`` tells
    TREE_ATTN the root's row."""
    num_shifted = 0
    for seed in range(3):
        reqs, trees, (pos, mask, is_tree) = _run_verify_writer(
            8, 9, 4, seed=seed, pad=1, max_before_root=5
        )
        start = 0
        for r, (s, q, b, p0) in enumerate(reqs):
            before = q - b - 1 if b else q
            assert pos[start : start + before].tolist() == list(range(p0, p0 + before))
            if b:
                root = start + before
                assert pos[root] == p0 + before
                assert (
                    pos[root + 1 : root + 1 + b].tolist()
                    == (p0 + before + trees.depths[s, :b]).tolist()
                )
                assert torch.equal(mask[r, : b + 1], trees.attn_mask[s, : b + 1])
                assert is_tree[r] == 1 + before
                num_shifted += before > 0
            else:
                assert is_tree[r] == 0
            start += q
    print(f"trees after prompt rows: {num_shifted}")
    assert num_shifted >= 4


def _run_draft_writer(
    num_reqs,
    budget,
    depth,
    seed,
    block_size=16,
    max_model_len=4096,
    path_len=lambda depth, reqs: depth,
):
    gen = torch.Generator().manual_seed(seed)
    max_num_reqs = num_reqs + 3
    trees = _trees(max_num_reqs, depth, budget, gen)
    reqs = _batch(num_reqs, max_num_reqs, budget, gen)
    qsl, cu = _layout(reqs)
    idx = torch.tensor([s for s, *_ in reqs], dtype=torch.int32)
    # Tree positions, as the verify writer leaves them.
    positions = torch.cat(
        [
            torch.cat([torch.tensor([p0]), p0 + trees.depths[s, :b].long()])
            if b
            else torch.arange(p0, p0 + q)
            for s, q, b, p0 in reqs
        ]
    )
    # Accepted paths: a random root-to-node path of each tree.
    accepted = torch.full((num_reqs, depth), -1, dtype=torch.int32)
    num_accepted = torch.zeros(num_reqs, dtype=torch.int32)
    for r, (s, _, b, _) in enumerate(reqs):
        if not b:
            num_accepted[r] = int(torch.randint(0, depth + 1, (1,), generator=gen))
            continue  # garbage that must be ignored
        node = int(torch.randint(0, b + 1, (1,), generator=gen))
        path = []
        while node:
            path.append(node)
            node = int(trees.parent_ids[s, node - 1])
        accepted[r, : len(path)] = torch.tensor(path[::-1], dtype=torch.int32)
        num_accepted[r] = len(path)
    num_sampled = torch.tensor(
        [
            0 if q > b + 1 and int(torch.randint(0, 2, (1,), generator=gen)) else 1 + b
            for _, q, b, _ in reqs
        ],
        dtype=torch.int32,
    )
    last_sampled = torch.randint(0, 1000, (max_num_reqs, 1), generator=gen)
    next_prefill = torch.randint(
        0, 1000, (max_num_reqs,), generator=gen, dtype=torch.int32
    )
    num_blocks = max_model_len // block_size
    block_table = torch.randint(
        1, 10_000, (num_reqs, num_blocks), generator=gen, dtype=torch.int32
    )
    num_tokens = int(qsl[-1])
    num_draft = sum(b for _, _, b, _ in reqs)
    max_num_tokens = num_tokens + depth * max_num_reqs + 8
    path_len = path_len(depth, reqs)
    num_context = draft_context_size(num_tokens, num_draft, num_reqs, path_len)
    assert num_context <= max_num_tokens

    outputs = []
    for fn, dev in (
        (prepare_draft_inputs, DEVICE),
        (prepare_draft_inputs_reference, "cpu"),
    ):

        def full(n, dtype):
            return torch.full((n,), -9, dtype=dtype, device=dev)

        outs = [
            full(max_num_tokens, torch.int32),  # query input ids
            full(max_num_tokens, torch.int64),  # query positions
            full(max_num_reqs + 1, torch.int32),  # query start loc
            full(max_num_reqs, torch.int32),  # seq lens
            full(max_num_tokens, torch.int64),  # query slots
            full(max_num_tokens, torch.int64),  # context rows
            full(max_num_tokens, torch.int64),  # context positions
            full(max_num_tokens, torch.int64),  # context slots
            full(max_num_reqs * depth, torch.int64),  # sample indices
        ]
        ins = [
            t.to(dev)
            for t in (
                positions,
                qsl,
                cu,
                idx,
                num_sampled,
                last_sampled,
                next_prefill,
                accepted,
                num_accepted,
                block_table,
            )
        ]
        fn(
            *outs,
            *ins,
            block_size,
            7777,
            depth,
            max_num_reqs,
            max_num_tokens,
            max_model_len,
            path_len=path_len,
        )
        # Context entries past num_context are not written.
        for i in (5, 6, 7):
            outs[i] = outs[i][:num_context]
        outputs.append([t.cpu() for t in outs])
    for i, (got, want) in enumerate(zip(*outputs)):
        assert torch.equal(got, want), i
    return reqs, accepted, num_accepted, positions, outputs[0]


@pytest.mark.parametrize(
    "num_reqs, budget, depth",
    [(1, 1, 1), (3, 5, 3), (7, 33, 15), (4, 64, 16)],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_draft_writer_matches_reference(num_reqs, budget, depth, seed):
    _run_draft_writer(num_reqs, budget, depth, seed)


@pytest.mark.parametrize(
    "num_reqs, budget, depth",
    [(1, 1, 1), (3, 5, 3), (7, 33, 15), (5, 3, 15)],
)
def test_draft_writer_short_paths(num_reqs, budget, depth):
    """A step's largest tree bounds the accepted paths: the context keeps
    min(depth, most nodes) path entries per request (draft_path_len), every
    accepted path whole; 0 entries where no request verified a tree."""
    from vllm.v1.spec_decode.ddtree_inputs import draft_path_len

    def most_nodes(depth, reqs):
        return draft_path_len(depth, max(b for _, _, b, _ in reqs))

    for seed in range(4):
        reqs, accepted, num_accepted, _, out = _run_draft_writer(
            num_reqs, budget, depth, seed, path_len=most_nodes
        )
        path_len = most_nodes(depth, reqs)
        # Trees smaller than the depth: fewer entries than DEPTH per request.
        assert path_len <= min(depth, budget)
        # Every tree request's accepted nodes are in its context, with slots.
        rows, slots = out[5], out[7]
        kept = int((slots != PAD_SLOT_ID).sum())
        committed = sum(
            q - b + (int(num_accepted[r]) if b else 0)
            for r, (_, q, b, _) in enumerate(reqs)
        )
        assert kept == committed
        assert rows.shape[0] == sum(q - b for _, q, b, _ in reqs) + path_len * len(reqs)


@gpu_only
@pytest.mark.parametrize("num_reqs, budget", [(64, 128), (9, 1024), (257, 8)])
def test_draft_writer_full_size(num_reqs, budget):
    _run_draft_writer(num_reqs, budget, 15, seed=num_reqs)


def _last_committed(reqs, num_accepted, positions):
    """Position of each request's last committed token after the walk."""
    last, start = [], 0
    for r, (_, q, b, _) in enumerate(reqs):
        root = start + q - (b + 1)
        last.append(int(positions[root]) + (int(num_accepted[r]) if b else 0))
        start += q
    return last


def test_draft_writer_near_max_model_len():
    """Query positions at or past max_model_len are clamped and write no KV."""
    depth, max_model_len = 5, 120
    reqs, _, num_accepted, positions, outs = _run_draft_writer(
        5, 6, depth, seed=2, max_model_len=max_model_len
    )
    qpos, qslots = outs[1], outs[4]
    clipped = 0
    for r, last in enumerate(_last_committed(reqs, num_accepted, positions)):
        for off in range(depth + 1):
            q, p = r * (depth + 1) + off, last + 1 + off
            assert qpos[q] == min(p, max_model_len - 1)
            assert (qslots[q] == PAD_SLOT_ID) == (p >= max_model_len)
            clipped += p >= max_model_len
    assert clipped > 0


def test_draft_writer_semantics():
    """Context = rows before the root, root, accepted path in order; query =
    bonus token then masks right after the committed path."""
    depth = 4
    reqs, accepted, num_accepted, positions, outs = _run_draft_writer(
        6, 9, depth, seed=11
    )
    ids, qpos, qsl_out, seq_lens, _, rows, cpos, cslots, sample = outs
    start = ctx = 0
    for r, (s, q, b, p0) in enumerate(reqs):
        k = int(num_accepted[r]) if b else 0
        root = start + q - (b + 1)
        want = list(range(start, root + 1)) + [root + int(n) for n in accepted[r, :k]]
        n_ctx = q - b + depth
        assert rows[ctx : ctx + len(want)].tolist() == want
        assert (cslots[ctx : ctx + len(want)] >= 0).all()
        assert (cslots[ctx + len(want) : ctx + n_ctx] == PAD_SLOT_ID).all()
        if b:
            # The committed path is contiguous in position: p0, ..., p0 + k.
            assert cpos[ctx + q - b - 1 : ctx + len(want)].tolist() == list(
                range(p0, p0 + k + 1)
            )
        last = _last_committed(reqs, num_accepted, positions)[r]
        assert qpos[r * (depth + 1) : (r + 1) * (depth + 1)].tolist() == list(
            range(last + 1, last + depth + 2)
        )
        assert (ids[r * (depth + 1) + 1 : (r + 1) * (depth + 1)] == 7777).all()
        assert sample[r * depth : (r + 1) * depth].tolist() == list(
            range(r * (depth + 1) + 1, (r + 1) * (depth + 1))
        )
        assert qsl_out[r] == r * (depth + 1)
        assert seq_lens[r] == last + 1 + depth + 1
        start += q
        ctx += n_ctx
    num_reqs = len(reqs)
    assert (qsl_out[num_reqs:] == num_reqs * (depth + 1)).all()
    assert (seq_lens[num_reqs:] == 0).all()


@pytest.mark.parametrize(
    "budget,width,num_reqs,max_reqs",
    [(6, 6, 3, 5), (64, 64, 4, 4), (1024, 1024, 2, 3), (40, 7, 3, 4), (64, 31, 2, 3)],
)
def test_store_draft_trees_is_indexed_copies_and_a_clamp(
    budget, width, num_reqs, max_reqs
):
    """One launch equals the indexed copies into request-state rows and the
    clamp of the draft tokens it replaces; other state rows and batch rows past
    num_reqs stay untouched (budget 1024: the mask copy loops). A tree narrower
    than the state rows pads them: token -1, log-prob -inf, draft token 0, and
    its mask rows' extra words zeroed; padding rows' parents, depths and masks
    keep what they held (nothing reads them)."""
    from vllm.v1.attention.ops.tree_mask import num_mask_words

    gen = torch.Generator().manual_seed(budget + width)
    words, src_words = num_mask_words(budget), num_mask_words(width)
    rows = max_reqs + 1  # the drafter's buffers hold more rows than run

    def rand(shape, dtype, low=-1, high=1000):
        if dtype == torch.float32:
            return -torch.rand(shape, generator=gen) * 20
        return torch.randint(low, high, shape, generator=gen, dtype=dtype)

    src = [
        rand((rows, width), torch.int64),
        rand((rows, width), torch.int32, 0, width),
        rand((rows, width), torch.int32, 0, 16),
        rand((rows, width), torch.float32),
        rand((rows, width + 1, src_words), torch.int32, -(2**31), 2**31 - 1),
    ]
    state = [
        rand((max_reqs, budget), torch.int64),
        rand((max_reqs, budget), torch.int32),
        rand((max_reqs, budget), torch.int32),
        rand((max_reqs, budget), torch.float32),
        rand((max_reqs, budget + 1, words), torch.int32),
    ]
    src[0][:, width // 2 :] = -1  # padding nodes
    src[3][:, width // 2 :] = -torch.inf
    draft = rand((max_reqs, budget), torch.int64)
    idx = torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32)
    want_state = [t.clone() for t in state]
    rows_of = idx.long()
    for field in range(4):
        want_state[field][rows_of, :width] = src[field][:num_reqs]
    want_state[0][rows_of, width:] = -1
    want_state[3][rows_of, width:] = -torch.inf
    want_mask = want_state[4][rows_of]
    want_mask[:, : width + 1, :src_words] = src[4][:num_reqs]
    want_mask[:, : width + 1, src_words:] = 0
    want_state[4][rows_of] = want_mask
    want_draft = draft.clone()
    want_draft[:num_reqs] = want_state[0][rows_of].clamp(min=0)
    assert (src[0][:num_reqs] == -1).any()  # padding nodes are exercised

    dev = [t.to(DEVICE) for t in state]
    d_draft = draft.to(DEVICE)
    store_draft_trees(
        *dev, d_draft, *(t.to(DEVICE) for t in src), idx.to(DEVICE), num_reqs
    )
    compared = 0
    for got, want in zip(dev, want_state):
        assert torch.equal(got.cpu(), want)
        compared += want.numel()
    assert torch.equal(d_draft.cpu(), want_draft)
    compared += want_draft.numel()
    print(f"{compared} elements compared")
    assert compared >= max_reqs * budget * 5
