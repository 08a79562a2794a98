# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Presence, frequency and repetition penalties along tree paths.

Each node's row must be penalized as the target would have been had it decoded
the node's path: the request's output so far plus the tokens fed on the path
(root excluded, node included). Checked against a torch reference that walks
the parent arrays, and, on chains, against vLLM's own MRv2 penalty kernel; the
tree sampler must apply them once, not vLLM's chain-order version on top.
"""

import types

import numpy as np
import pytest
import torch

from tests.v1.sample.mrv2_stubs import StubSampler, interpreter_shims
from vllm.v1.sample.tree_rejection_sampler import (
    TreeRejectionSampler,
    apply_tree_penalties,
)
from vllm.v1.worker.gpu.sample.penalties import apply_penalties

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module", autouse=True)
def _shims():
    with interpreter_shims():
        yield


def _random_parents(budget, gen):
    return [int(torch.randint(0, i + 1, (1,), generator=gen)) for i in range(budget)]


def _problem(num_nodes, vocab, seed, chain=False):
    """A batch of requests verifying ``num_nodes[r]`` nodes each, request-state
    rows permuted, random output counts, prompt masks and penalties."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs, budget = len(num_nodes), max(num_nodes) + 2
    max_num_reqs = num_reqs + 2
    states = torch.randperm(max_num_reqs, generator=gen)[:num_reqs]
    parents = torch.zeros(max_num_reqs, budget, dtype=torch.int32)
    for s in states.tolist():
        p = list(range(budget)) if chain else _random_parents(budget, gen)
        parents[s] = torch.tensor(p, dtype=torch.int32)
    rows, local = [], []
    for r, b in enumerate(num_nodes):
        rows += [int(states[r])] * (b + 1)
        local += list(range(b + 1))
    num_logits = len(rows)
    # Few distinct tokens: paths repeat tokens and hit the output counts.
    fed = torch.randint(0, 12, (num_logits,), generator=gen, dtype=torch.int32)
    counts = torch.randint(0, 3, (max_num_reqs, vocab), generator=gen)
    counts *= torch.rand(max_num_reqs, vocab, generator=gen) < 0.3
    prompt = torch.rand(max_num_reqs, vocab, generator=gen) < 0.2
    packed = torch.zeros(max_num_reqs, -(-vocab // 32), dtype=torch.int64)
    for t in range(vocab):
        packed[:, t // 32] |= prompt[:, t].long() << (t % 32)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    rep = 1.0 + torch.rand(max_num_reqs, generator=gen)
    freq = torch.rand(max_num_reqs, generator=gen) - 0.3
    pres = torch.rand(max_num_reqs, generator=gen) - 0.3
    # One request without any penalty: its rows stay as they are.
    rep[states[0]], freq[states[0]], pres[states[0]] = 1.0, 0.0, 0.0
    return types.SimpleNamespace(
        logits=3 * torch.randn(num_logits, vocab, generator=gen),
        rows=torch.tensor(rows, dtype=torch.int32),
        local=torch.tensor(local, dtype=torch.int32),
        parents=parents,
        fed=fed,
        rep=rep,
        freq=freq,
        pres=pres,
        packed=packed,
        prompt=prompt,
        counts=counts.to(torch.int32),
        depth=budget,
    )


def _reference(pb):
    """Row by row: counts = output so far + the fed tokens up the path."""
    out = pb.logits.clone()
    for j in range(out.shape[0]):
        req, node = int(pb.rows[j]), int(pb.local[j])
        counts = pb.counts[req].clone()
        first = j - node
        while node > 0:
            counts[int(pb.fed[first + node])] += 1
            node = int(pb.parents[req, node - 1])
        seen = counts > 0
        row = out[j]
        scale = torch.where(pb.prompt[req] | seen, pb.rep[req], 1.0)
        row *= torch.where(row > 0, 1.0 / scale, scale)
        row -= pb.freq[req] * counts
        row -= pb.pres[req] * seen
    return out


def _run(pb, fn=apply_tree_penalties):
    logits = pb.logits.clone().to(DEVICE)
    d = lambda t: t.to(DEVICE)  # noqa: E731
    fn(
        logits,
        d(pb.rows),
        d(pb.local),
        d(pb.rows),
        d(pb.parents),
        d(pb.fed),
        d(pb.rep),
        d(pb.freq),
        d(pb.pres),
        d(pb.packed),
        d(pb.counts),
        pb.depth,
    )
    return logits.cpu()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_penalties_match_path_reference(seed):
    pb = _problem([7, 0, 12, 3], vocab=300, seed=seed)
    got = _run(pb)
    want = _reference(pb)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # The paths changed something beyond the output counts (a chain-blind
    # version would differ), and the penalty-free request kept its rows.
    base = _reference(types.SimpleNamespace(**{**vars(pb), "local": 0 * pb.local}))
    differs = (got != base).any(dim=1)
    num_rows = int(differs.sum())
    print(f"rows whose path changed the penalties: {num_rows} of {len(differs)}")
    assert num_rows >= 10
    assert torch.equal(got[:8], pb.logits[:8])


def test_chain_equals_vllm_penalties():
    """On chains, MRv2's own kernel (which counts the preceding rows) and the
    path version agree bit for bit."""
    pb = _problem([5, 9, 0, 2], vocab=300, seed=4, chain=True)

    def vllm_kernel(logits, rows, local, _trees, _parents, fed, *args):
        rep, freq, pres, packed, counts, _depth = args
        apply_penalties(logits, rows, fed, local, rep, freq, pres, packed, counts)

    ours, theirs = _run(pb), _run(pb, vllm_kernel)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, pb.logits)


class _PenaltySampler(StubSampler):
    """A stub whose ``apply_sampling_params`` applies its penalties state's
    ``apply_penalties`` first, as vLLM's Sampler does."""

    def __init__(self, state, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.penalties_state = state
        self.chain_calls = 0

    def apply_sampling_params(self, logits, *args):
        self.penalties_state.apply_penalties(logits, *args)
        return super().apply_sampling_params(logits, *args)

    def returns_logprobs(self, idx_mapping_np):
        return False


def test_tree_sampler_applies_path_penalties_once():
    pb = _problem([6, 4], vocab=200, seed=7)
    num_reqs = 2
    req_rows = sorted(set(pb.rows.tolist()), key=pb.rows.tolist().index)
    chain_calls = []
    state = types.SimpleNamespace(
        use_penalty=np.ones(pb.parents.shape[0], dtype=bool),
        repetition_penalty=types.SimpleNamespace(gpu=pb.rep.to(DEVICE)),
        frequency_penalty=types.SimpleNamespace(gpu=pb.freq.to(DEVICE)),
        presence_penalty=types.SimpleNamespace(gpu=pb.pres.to(DEVICE)),
        prompt_bin_mask=pb.packed.to(DEVICE),
        output_bin_counts=pb.counts.to(DEVICE),
        apply_penalties=lambda *a: chain_calls.append(1),
    )
    temperature = torch.zeros(pb.parents.shape[0], device=DEVICE)
    sampler = _PenaltySampler(
        state,
        temperature=temperature,
        seeds=torch.zeros(pb.parents.shape[0], dtype=torch.int64, device=DEVICE),
        prefill_len=torch.zeros(pb.parents.shape[0], dtype=torch.int32, device=DEVICE),
    )
    cu = [0, 7, 12]
    idx = torch.tensor(req_rows, dtype=torch.int32, device=DEVICE)
    batch = types.SimpleNamespace(
        idx_mapping=idx,
        idx_mapping_np=np.array(req_rows, dtype=np.int32),
        expanded_idx_mapping=pb.rows.to(DEVICE),
        expanded_local_pos=pb.local.to(DEVICE),
        positions=torch.arange(12, device=DEVICE) + 40,
        input_ids=pb.fed.to(DEVICE),
        logits_indices=torch.arange(12, device=DEVICE),
        cu_num_logits=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        cu_num_logits_np=np.array(cu),
        seq_lens=torch.tensor([60, 60], dtype=torch.int32, device=DEVICE),
    )
    # Node tokens = the fed tokens: a path is accepted where greedy agrees.
    tokens = torch.full((pb.parents.shape[0], pb.parents.shape[1]), -1)
    for r in range(num_reqs):
        b = cu[r + 1] - cu[r] - 1
        tokens[req_rows[r], :b] = pb.fed[cu[r] + 1 : cu[r + 1]].long()
    want = _reference(pb)
    emitted = []
    # The trees are request-state rows, read through the batch's idx_mapping.
    tree_sampler = TreeRejectionSampler(
        sampler, pb.depth, tokens.to(DEVICE), pb.parents.to(DEVICE)
    )
    out = tree_sampler(pb.logits.clone().to(DEVICE), batch)
    assert chain_calls == []  # vLLM's chain-order penalties left out
    assert sampler.penalties_state is state  # and put back
    # Greedy: each emitted token is the argmax of its path row penalized
    # along that path.
    for r in range(num_reqs):
        path = [0] + out.accepted_nodes[r, : int(out.num_accepted[r])].tolist()
        for j, node in enumerate(path):
            token = int(out.sampled_token_ids[r, j])
            assert token == int(want[cu[r] + node].argmax())
            emitted.append(token)
    print(f"emitted tokens checked: {len(emitted)}")
    assert len(emitted) >= 2
    # Without penalties in the batch the sampler's own path runs.
    state.use_penalty[:] = False
    tree_sampler(pb.logits.clone().to(DEVICE), batch)
    assert chain_calls == [1]


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU (vLLM's Sampler)")
def test_tree_sampler_with_vllm_sampler_penalties():
    """With vLLM's MRv2 Sampler and its penalties state (filled by
    add_request and the prompt), greedy trees emit each path row's argmax
    penalized along that path."""
    from tests.v1.ddtree_reference import build_ddtree_reference
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.states import RequestState

    vocab, budget, num_reqs = 4096, 16, 3
    device = torch.device(DEVICE)
    req_states = RequestState(
        max_num_reqs=8,
        max_model_len=4096,
        max_num_batched_tokens=4096,
        num_speculative_steps=budget,
        vocab_size=vocab,
        device=device,
    )
    sampler = Sampler(8, vocab, device, req_states)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.4),
        SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.5),
        SamplingParams(temperature=0.0),
    ]
    gen = torch.Generator().manual_seed(3)
    for r, p in enumerate(params):
        prompt = torch.randint(0, 64, (30,), generator=gen).tolist()
        req_states.add_request(f"r{r}", 30, prompt, 0, 64)
        sampler.add_request(req_states.req_id_to_index[f"r{r}"], 30, p)
    req_states.apply_staged_writes()
    sampler.apply_staged_writes()
    idx = [req_states.req_id_to_index[f"r{r}"] for r in range(num_reqs)]
    state = sampler.penalties_state
    # Some output so far, on few tokens (paths repeat them).
    state.output_bin_counts[idx, :64] = torch.randint(
        0, 2, (num_reqs, 64), generator=gen, dtype=torch.int32
    ).to(device)
    tree = build_ddtree_reference(torch.randn(num_reqs, 15, 64, generator=gen), budget)
    cu = [0, budget + 1, 2 * budget + 2, 3 * budget + 3]
    rows = torch.tensor(
        [i for i in idx for _ in range(budget + 1)], dtype=torch.int32
    ).to(device)
    local = torch.arange(budget + 1, dtype=torch.int32).repeat(num_reqs).to(device)
    fed = torch.cat(
        [torch.cat([torch.tensor([1]), tree.token_ids[r]]) for r in range(num_reqs)]
    ).to(torch.int32)
    idx_t = torch.tensor(idx, dtype=torch.int32, device=device)
    parents = torch.zeros(8, budget, dtype=torch.int32)
    tokens = torch.full((8, budget), -1, dtype=torch.int64)
    parents[idx], tokens[idx] = tree.parent_ids, tree.token_ids
    batch = types.SimpleNamespace(
        idx_mapping=idx_t,
        idx_mapping_np=np.array(idx, dtype=np.int32),
        expanded_idx_mapping=rows,
        expanded_local_pos=local,
        positions=(torch.arange(3 * budget + 3) % (budget + 1) + 40).to(device),
        input_ids=fed.to(device),
        logits_indices=torch.arange(3 * budget + 3, device=device),
        cu_num_logits=torch.tensor(cu, dtype=torch.int32, device=device),
        cu_num_logits_np=np.array(cu),
        seq_lens=torch.full((num_reqs,), 60, dtype=torch.int32, device=device),
    )
    # Logits that favour the drafted tokens, so that paths are accepted.
    logits = torch.randn(3 * budget + 3, vocab, generator=gen)
    logits[:, :64] += 4
    logits = logits.to(device)
    out = TreeRejectionSampler(sampler, 15, tokens.to(device), parents.to(device))(
        logits.clone(), batch
    )
    want = logits.clone()
    apply_tree_penalties(
        want,
        rows,
        local,
        rows,
        parents.to(device),
        fed.to(device),
        state.repetition_penalty.gpu,
        state.frequency_penalty.gpu,
        state.presence_penalty.gpu,
        state.prompt_bin_mask,
        state.output_bin_counts,
        15,
    )
    checked = 0
    for r in range(num_reqs):
        path = [0] + out.accepted_nodes[r, : int(out.num_accepted[r])].tolist()
        for j, node in enumerate(path):
            row = cu[r] + node
            assert int(out.sampled_token_ids[r, j]) == int(want[row].argmax())
            checked += 1
    print(f"emitted tokens checked: {checked}")
    assert checked >= num_reqs


# ---------------------------------------------------------------- bad words


def _bad_words_problem(num_nodes, seed, chain=False):
    """Trees over few tokens, outputs ending in bad-word prefixes, and bad words
    of lengths 1-4 per request (some requests without)."""
    pb = _problem(num_nodes, vocab=64, seed=seed, chain=chain)
    gen = torch.Generator().manual_seed(100 + seed)
    max_num_reqs = pb.parents.shape[0]
    words = torch.zeros(max_num_reqs, 64, dtype=torch.int32)
    offsets = torch.zeros(max_num_reqs, 9, dtype=torch.int32)
    num_words = torch.zeros(max_num_reqs, dtype=torch.int32)
    all_tokens = torch.randint(0, 12, (max_num_reqs, 80), generator=gen)
    prompt_len = torch.randint(3, 10, (max_num_reqs,), generator=gen)
    output_len = torch.randint(0, 20, (max_num_reqs,), generator=gen)
    word_lists = {}
    for s in range(max_num_reqs):
        n = int(torch.randint(0, 7, (1,), generator=gen))
        ws = [
            torch.randint(
                0, 12, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen
            ).tolist()
            for _ in range(n)
        ]
        word_lists[s] = ws
        flat = [t for w in ws for t in w]
        words[s, : len(flat)] = torch.tensor(flat, dtype=torch.int32)
        offsets[s, : n + 1] = torch.tensor(
            [0] + np.cumsum([len(w) for w in ws]).tolist(), dtype=torch.int32
        )
        num_words[s] = n
    pb.words, pb.offsets, pb.num_words, pb.word_lists = (
        words,
        offsets,
        num_words,
        word_lists,
    )
    pb.all_tokens = all_tokens.to(torch.int32)
    pb.prompt_len = prompt_len.to(torch.int32)
    pb.total_len = (prompt_len + output_len).to(torch.int32)
    return pb


def _bad_words_reference(pb):
    out = pb.logits.clone()
    for j in range(out.shape[0]):
        req, node = int(pb.rows[j]), int(pb.local[j])
        first = j - node
        path = []
        while node > 0:
            path.append(int(pb.fed[first + node]))
            node = int(pb.parents[req, node - 1])
        p0, total = int(pb.prompt_len[req]), int(pb.total_len[req])
        # The output (ending with the root's token), then the path's nodes
        # from depth 1 to the row's own.
        seq = pb.all_tokens[req, p0:total].tolist() + path[::-1]
        for w in pb.word_lists[req]:
            prefix = w[:-1]
            if len(prefix) <= len(seq) and seq[len(seq) - len(prefix) :] == prefix:
                out[j, w[-1]] = float("-inf")
    return out


def _run_bad_words(pb, fn):
    logits = pb.logits.clone().to(DEVICE)
    d = lambda t: t.to(DEVICE)  # noqa: E731
    fn(
        logits,
        d(pb.rows),
        d(pb.local),
        d(pb.rows),
        d(pb.parents),
        d(pb.fed),
        d(pb.words),
        d(pb.offsets),
        d(pb.num_words),
        d(pb.all_tokens),
        d(pb.prompt_len),
        d(pb.total_len),
        int(pb.num_words.max()),
        pb.depth,
    )
    return logits.cpu()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_bad_words_match_path_reference(seed):
    from vllm.v1.sample.tree_rejection_sampler import apply_tree_bad_words

    pb = _bad_words_problem([7, 0, 12, 5], seed)
    got = _run_bad_words(pb, apply_tree_bad_words)
    want = _bad_words_reference(pb)
    assert torch.equal(got, want)
    num_masked = int((got == float("-inf")).sum())
    print(f"tokens masked: {num_masked}")
    assert num_masked >= 5


def test_chain_bad_words_read_one_row_past_vllms():
    """On a chain, MRv2's own kernel reads rows ``0 .. pos - 1`` where a
    non-speculative step reads ``1 .. pos`` (the root's token is already the
    output's last): fed a chain shifted by one row it gives this module's
    result, so the two differ by exactly that off-by-one."""
    from vllm.v1.sample.tree_rejection_sampler import apply_tree_bad_words
    from vllm.v1.worker.gpu.sample.bad_words import apply_bad_words

    def vllm_kernel_shifted(logits, rows, local, _trees, _parents, fed, *args):
        *state, max_words, _depth = args
        # Row j of the shifted chain holds row j + 1's token.
        shifted = torch.cat([fed[1:], fed[:1]])
        apply_bad_words(logits, rows, *state, shifted, local, max_words)

    masked = 0
    for seed in range(3):
        pb = _bad_words_problem([5, 9, 0, 3], seed, chain=True)
        ours = _run_bad_words(pb, apply_tree_bad_words)
        theirs = _run_bad_words(pb, vllm_kernel_shifted)
        assert torch.equal(ours, theirs)
        masked += int((ours == float("-inf")).sum())
    print(f"tokens masked: {masked}")
    assert masked >= 5


# ------------------------------------------ against non-speculative decoding

_VOCAB, _DEPTH = 48, 4


def _target(context):
    gen = torch.Generator().manual_seed(hash(tuple(context)) % (1 << 62))
    return torch.randn(_VOCAB, generator=gen) * 3


class _Requests:
    """Per-request sampling state as MRv2 keeps it (request-state rows 0..n-1)."""

    def __init__(self, prompts, words):
        n = len(prompts)
        self.prompts = prompts
        self.rep = torch.tensor([1.5, 1.0, 0.8, 1.2])[:n]
        self.freq = torch.tensor([0.0, 0.9, 0.3, -0.4])[:n]
        self.pres = torch.tensor([0.0, 0.6, 0.0, 0.8])[:n]
        self.temperature = torch.tensor([0.0, 1.0, 0.7, 1.0])[:n]
        self.seeds = torch.tensor([3, 1 << 40, -5, 77])[:n]
        packed = torch.zeros(n, -(-_VOCAB // 32), dtype=torch.int64)
        for r, p in enumerate(prompts):
            for t in set(p):
                packed[r, t // 32] |= 1 << (t % 32)
        self.packed = torch.where(packed >= 2**31, packed - 2**32, packed).int()
        self.words = words
        self.masked_on_paths = 0
        flat = torch.zeros(n, 16, dtype=torch.int32)
        offsets = torch.zeros(n, 5, dtype=torch.int32)
        for r, ws in enumerate(self.words):
            toks = [t for w in ws for t in w]
            flat[r, : len(toks)] = torch.tensor(toks, dtype=torch.int32)
            offsets[r] = torch.tensor(
                [0] + np.cumsum([len(w) for w in ws]).tolist(), dtype=torch.int32
            )
        self.flat, self.offsets = flat, offsets
        self.num_words = torch.full((n,), 4, dtype=torch.int32)

    def process(self, logits, rows, local, trees, parents, fed, contexts):
        """Penalties and bad words (the path versions; with local = 0 they
        are MRv2's own, checked above), then temperature."""
        from tests.v1.sample.mrv2_stubs import apply_sampling_params
        from vllm.v1.sample.tree_rejection_sampler import apply_tree_bad_words

        n = len(contexts)
        counts = torch.zeros(n, _VOCAB, dtype=torch.int32)
        all_tokens = torch.zeros(n, 256, dtype=torch.int32)
        for r, (c, p) in enumerate(zip(contexts, self.prompts)):
            for t in c[len(p) :]:
                counts[r, t] += 1
            all_tokens[r, : len(c)] = torch.tensor(c, dtype=torch.int32)
        d = lambda t: t.to(DEVICE)  # noqa: E731
        common = (d(rows), d(local), d(trees), d(parents), d(fed))
        apply_tree_penalties(
            logits,
            *common,
            d(self.rep),
            d(self.freq),
            d(self.pres),
            d(self.packed),
            d(counts),
            _DEPTH,
        )
        lens = [len(c) for c in contexts]
        before = torch.isinf(logits[local.to(DEVICE) > 0]).sum()
        apply_tree_bad_words(
            logits,
            *common,
            d(self.flat),
            d(self.offsets),
            d(self.num_words),
            d(all_tokens),
            d(torch.tensor([len(p) for p in self.prompts]).int()),
            d(torch.tensor(lens).int()),
            4,
            _DEPTH,
        )
        after = torch.isinf(logits[local.to(DEVICE) > 0]).sum()
        self.masked_on_paths += int(after - before)
        return apply_sampling_params(logits, d(rows), d(self.temperature))


def _decode_sequentially(reqs, num_tokens):
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    contexts = [list(p) for p in reqs.prompts]
    n = len(contexts)
    rows = torch.arange(n, dtype=torch.int32)
    zeros = torch.zeros(n, dtype=torch.int32)
    parents = torch.zeros(n, 1, dtype=torch.int32)
    for _ in range(num_tokens):
        logits = torch.stack([_target(c) for c in contexts]).to(DEVICE)
        fed = torch.tensor([c[-1] for c in contexts], dtype=torch.int32)
        logits = reqs.process(logits, rows, zeros, rows, parents, fed, contexts)
        pos = torch.tensor([len(c) - 1 for c in contexts], device=DEVICE)
        y = gumbel_sample(
            logits,
            rows.to(DEVICE),
            reqs.temperature.to(DEVICE),
            reqs.seeds.to(DEVICE),
            pos,
            apply_temperature=False,
        )
        for c, t in zip(contexts, y.tolist()):
            c.append(t)
    return contexts


def _decode_with_trees(reqs, num_tokens, first, budget=6):
    from tests.v1.ddtree_reference import build_ddtree_reference
    from vllm.v1.sample.tree_rejection_sampler import tree_rejection_sample

    # From the first output token on (a request's first step has no tree).
    contexts = [list(p) + [t] for p, t in zip(reqs.prompts, first)]
    n = len(contexts)
    accepted = 0
    while min(len(c) - len(p) for c, p in zip(contexts, reqs.prompts)) < num_tokens:
        draft = torch.empty(n, _DEPTH, _VOCAB)
        for r, c in enumerate(contexts):
            greedy = list(c)
            for k in range(_DEPTH):
                draft[r, k] = _target(greedy)
                greedy.append(int(draft[r, k].argmax()))
        tree = build_ddtree_reference(draft, budget)
        tok, par = tree.token_ids.tolist(), tree.parent_ids.tolist()
        logits, rows, local, fed, pos = [], [], [], [], []
        for r, c in enumerate(contexts):
            for node in range(budget + 1):
                path, k = [], node
                while k:
                    path.append(tok[r][k - 1])
                    k = par[r][k - 1]
                path.reverse()
                logits.append(_target(c + path))
                rows.append(r)
                local.append(node)
                fed.append(tok[r][node - 1] if node else c[-1])
                pos.append(len(c) - 1 + len(path))
        rows_t = torch.tensor(rows, dtype=torch.int32)
        local_t = torch.tensor(local, dtype=torch.int32)
        processed = reqs.process(
            torch.stack(logits).to(DEVICE),
            rows_t,
            local_t,
            rows_t,
            tree.parent_ids,
            torch.tensor(fed, dtype=torch.int32),
            contexts,
        )
        cu = torch.arange(n + 1, dtype=torch.int32) * (budget + 1)
        out = tree_rejection_sample(
            processed,
            tree.token_ids.to(DEVICE),
            tree.parent_ids.to(DEVICE),
            cu.to(DEVICE),
            torch.tensor(pos, device=DEVICE),
            rows_t.to(DEVICE),
            reqs.temperature.to(DEVICE),
            reqs.seeds.to(DEVICE),
            max_depth=_DEPTH,
        )
        accepted += int(out.num_accepted.sum())
        for r, c in enumerate(contexts):
            c += out.sampled_token_ids[r, : int(out.num_sampled[r])].tolist()
    return contexts, accepted


def test_penalties_and_bad_words_decode_like_no_speculation():
    """Seeded decoding (T = 0 and T > 0) with penalties and bad words: tree
    verification emits token for token what one-token-per-step decoding with
    vLLM's own penalty and bad-words kernels emits."""
    prompts = [[1, 2, 3, 1], [4, 5, 4], [6, 0], [7, 8, 7, 7]]
    num_tokens = 14
    # Bad words the target would emit: bigrams (and a token) of its output
    # under the penalties alone.
    plain = _decode_sequentially(_Requests(prompts, [[[47]] * 4] * 4), num_tokens)
    words = []
    for c, p in zip(plain, prompts):
        out = c[len(p) :]
        words.append([out[2:4], out[6:8], [out[10]], out[11:13]])
    reqs = _Requests(prompts, words)
    want = _decode_sequentially(reqs, num_tokens)
    first = [c[len(p)] for c, p in zip(want, prompts)]
    got, accepted = _decode_with_trees(reqs, num_tokens, first)
    for c, w, p in zip(got, want, prompts):
        assert c[: len(p) + num_tokens] == w[: len(p) + num_tokens]
    # Bad words changed the output, masked tokens on tree rows past the root
    # (prefixes read along paths), and trees were accepted.
    assert want != plain
    print(f"accepted nodes: {accepted}, masked on paths: {reqs.masked_on_paths}")
    assert accepted >= 8 and reqs.masked_on_paths >= 5
