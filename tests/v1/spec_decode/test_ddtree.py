# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The DDTree speculator on Model Runner V2: one step through its hooks and
the model state's, and the per-request trees' life cycle, without a model
runner.

A real engine config (tiny Qwen3 target, tiny DFlash drafter with block size 4),
real TREE_ATTN metadata builders and the real DDTree classes; the target's logits,
the KV caches and the drafter network are stand-ins. On the CPU every kernel runs
in the Triton interpreter. The model runner's calls are made as MRv2 makes them
(with the series' hooks): ``set_attn``, then per step ``add_request`` for joining
requests, ``DDTreeModelState.prepare_attn``, the speculator's rejection sampler
(``init_rejection_sampler``) and ``propose(..., sampler_output=<the walk>)``.

Batch: request state 2 verifies a full tree, state 0 a tree the scheduler trimmed
to 4 nodes, state 3 runs a chunk of its prefill (5 tokens, no drafts).

Joining requests (vLLM 0.26's scheduler, "Pad new decode requests" in
``vllm/v1/core/sched/scheduler.py``): a waiting request with one new token is
padded with placeholder drafts while others decode; MRv2's
``RequestState.add_request`` zeroes the slot's draft tokens, so the target is fed
token 0 at every node. Such a request must verify as a root-only tree, whatever
tree its slot held before.
"""

import types

import numpy as np
import pytest
import torch

from tests.models.tiny_models import VOCAB_SIZE, make_tiny_dflash, make_tiny_qwen3
from tests.v1.ddtree_reference import (
    build_ddtree_reference,
    compact_tree_kv_reference,
)
from tests.v1.sample.mrv2_stubs import StubSampler, interpreter_shims
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.attention.backends.tree_attn import (
    TreeAttentionBackend,
    kv_cache_as_kv_first,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.sample.tree_rejection_sampler import (
    TreeRejectionSampler,
    TreeSamplerOutput,
)
from vllm.v1.spec_decode.ddtree_config import DDTreeConfig
from vllm.v1.spec_decode.ddtree_inputs import draft_context_size
from vllm.v1.spec_decode.dflash_tree_builder import build_ddtree
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.sample.output import SamplerOutput
from vllm.v1.worker.utils import AttentionGroup

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BUDGET, BLOCK, DEPTH = 6, 16, 3
NUM_KV_HEADS, HEAD_SIZE = 2, 64
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
# (request state, tokens scheduled, draft tokens, committed length p0); a row
# without drafts is a prefill chunk.
BATCH = [(2, 7, 6, 40), (0, 5, 4, 17), (3, 5, 0, 10)]
NUM_STATES = 4
# Prompt lengths by request state (state 1 is never used).
PREFILL_LEN = [5, 0, 5, 100]
TREE_FIELDS = ("token_ids", "parent_ids", "depths", "attn_mask", "log_probs")


@pytest.fixture(scope="module", autouse=True)
def _interpreter_shims():
    with interpreter_shims():
        yield


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    root = tmp_path_factory.mktemp("ddtree_step")
    target = make_tiny_qwen3(root / "target", num_hidden_layers=2)
    drafter = make_tiny_dflash(root / "drafter", target, block_size=DEPTH + 1)
    with pytest.MonkeyPatch.context() as mp:
        # EngineArgs asks the platform for a device type; a CPU-only box has none.
        mp.setattr(type(current_platform), "device_type", "cuda", raising=False)
        # "ddtree" is one of vLLM's methods; where a plugin provides it instead,
        # vLLM loads the plugin (its entry point) as EngineArgs is built.
        args = EngineArgs(
            model=str(target),
            speculative_config={
                "method": "ddtree",
                "model": str(drafter),
                "tree_budget": BUDGET,
                # Every step verifies the scheduler's slots (the adaptive
                # budget's split: tests/v1/spec_decode/test_ddtree_adaptive.py).
                "adaptive_budget": False,
            },
            max_model_len=256,
            max_num_seqs=NUM_STATES,
            max_num_batched_tokens=128,
        )
        return args.create_engine_config()


def test_config_carries_ddtree(vllm_config):
    assert DDTreeConfig.from_vllm_config(vllm_config) == DDTreeConfig(BUDGET, DEPTH)


# ---------------------------------------------------------------------------
# Batch and cache stand-ins.
# ---------------------------------------------------------------------------


def _input_batch(positions: torch.Tensor, input_ids=None, batch=BATCH) -> InputBatch:
    num_reqs = len(batch)
    q_lens = np.array([q for _, q, _, _ in batch], dtype=np.int32)
    drafts = np.array([b for _, _, b, _ in batch], dtype=np.int32)
    prefill = drafts == 0
    qsl_np = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_np = np.concatenate([[0], np.cumsum(np.where(drafts > 0, drafts + 1, 1))])
    cu_np = cu_np.astype(np.int32)
    seq_lens = np.array([p0 + q for _, q, _, p0 in batch], dtype=np.int32)
    num_tokens = int(q_lens.sum())
    logits_indices = torch.cat(
        [
            torch.arange(
                int(qsl_np[r + 1]) - (int(cu_np[r + 1] - cu_np[r])), int(qsl_np[r + 1])
            )
            for r in range(num_reqs)
        ]
    )
    cu = torch.from_numpy(cu_np)
    counts = (cu[1:] - cu[:-1]).long()
    expanded_local_pos = torch.cat([torch.arange(int(c)) for c in counts])
    idx_mapping = torch.tensor([s for s, _, _, _ in batch], dtype=torch.int32)
    prefill_len = np.array([PREFILL_LEN[s] for s, *_ in batch], dtype=np.int32)
    computed_prefill = np.where(prefill, [p0 for *_, p0 in batch], prefill_len).astype(
        np.int32
    )
    return InputBatch(
        req_ids=[f"req{r}" for r in range(num_reqs)],
        num_reqs=num_reqs,
        num_reqs_after_padding=num_reqs,
        idx_mapping=idx_mapping.to(DEVICE),
        idx_mapping_np=idx_mapping.numpy(),
        expanded_idx_mapping=torch.repeat_interleave(idx_mapping, counts).to(DEVICE),
        expanded_local_pos=expanded_local_pos.to(torch.int32).to(DEVICE),
        num_scheduled_tokens=q_lens,
        num_tokens=num_tokens,
        num_tokens_after_padding=num_tokens,
        num_draft_tokens=int(drafts.sum()),
        num_draft_tokens_per_req=drafts,
        query_start_loc=torch.from_numpy(qsl_np).to(DEVICE),
        query_start_loc_np=qsl_np,
        seq_lens=torch.from_numpy(seq_lens).to(DEVICE),
        seq_lens_cpu_upper_bound=torch.from_numpy(seq_lens),
        dcp_local_seq_lens=None,
        num_computed_tokens_np=np.array([p0 for *_, p0 in batch], dtype=np.int32),
        prefill_len_np=prefill_len,
        num_computed_prefill_tokens_np=computed_prefill,
        is_prefilling_np=prefill,
        max_seq_len_np=None,
        input_ids=(
            torch.zeros(num_tokens, dtype=torch.int32)
            if input_ids is None
            else input_ids.to(torch.int32)
        ).to(DEVICE),
        positions=positions.to(DEVICE),
        is_padding=torch.zeros(num_tokens, dtype=torch.bool, device=DEVICE),
        logits_indices=logits_indices.to(DEVICE),
        cu_num_logits=cu.to(DEVICE),
        cu_num_logits_np=cu_np,
        has_structured_output_reqs=False,
        prompt_lens=None,
    )


def _flat_positions(batch=BATCH) -> torch.Tensor:
    """What MRv2 writes before the DDTree hooks: p0, p0 + 1, ... per request."""
    return torch.cat([torch.arange(p0, p0 + q) for _, q, _, p0 in batch])


def _block_table(gen, batch=BATCH) -> torch.Tensor:
    """[num_reqs, 8] distinct random blocks per request (batch order)."""
    blocks = torch.randperm(64, generator=gen)[: len(batch) * 8] + 1
    return blocks.view(len(batch), 8).to(torch.int32)


def _slot_mapping(
    block_table: torch.Tensor, positions: torch.Tensor, batch=BATCH
) -> torch.Tensor:
    slots, start = [], 0
    for r, (_, q, _, _) in enumerate(batch):
        for p in positions[start : start + q].tolist():
            slots.append(int(block_table[r, p // BLOCK]) * BLOCK + p % BLOCK)
        start += q
    return torch.tensor(slots, dtype=torch.int64)


def _trees(gen):
    logits = torch.randn(NUM_STATES, DEPTH, VOCAB_SIZE, generator=gen) * 3
    return build_ddtree_reference(logits, BUDGET)


def _store(trees, src) -> None:
    """Every slot of the speculator's trees <- ``src`` (trees drafted before)."""
    for name in TREE_FIELDS:
        getattr(trees, name).copy_(getattr(src, name))


def _trees_on_cpu(spec):
    """A copy of the speculator's trees, as the reference helpers take them."""
    return types.SimpleNamespace(
        **{name: getattr(spec.trees, name).cpu() for name in TREE_FIELDS}
    )


def _fed_ids(trees, gen, zero_slots=(), batch=BATCH) -> torch.Tensor:
    """The step's input ids as MRv2 writes them: per tree row the root (last
    sampled token) then the slot's draft tokens (padding nodes as 0; all zeros
    for a slot MRv2 reset on add), random prompt tokens for a prefill chunk."""
    ids = []
    for s, q, b, _ in batch:
        if b:
            drafts = trees.token_ids[s, :b].clamp(min=0)
            if s in zero_slots:
                drafts = torch.zeros_like(drafts)
            root = torch.randint(0, VOCAB_SIZE, (1,), generator=gen)
            ids.append(torch.cat([root, drafts]))
        else:
            ids.append(torch.randint(0, VOCAB_SIZE, (q,), generator=gen))
    return torch.cat(ids)


def _new_request(slot_prompt_len: int = 5):
    """The fields of MRv2's NewRequestData that DefaultModelState reads."""
    return types.SimpleNamespace(
        prefill_token_ids=list(range(slot_prompt_len)), mm_features=None
    )


def _model_state(vllm_config):
    from vllm.v1.spec_decode.ddtree_verify import DDTreeModelState

    return DDTreeModelState(vllm_config, torch.nn.Module(), None, torch.device(DEVICE))


def _attn_groups(vllm_config):
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=DTYPE
    )
    group = AttentionGroup(TreeAttentionBackend, list(LAYERS), spec, 0)
    group.create_metadata_builders(vllm_config, torch.device(DEVICE), BLOCK)
    return [[group]]


KV_CACHE_CONFIG = types.SimpleNamespace(
    kv_cache_groups=[types.SimpleNamespace(layer_names=list(LAYERS))]
)


def _sampler():
    return StubSampler(
        temperature=torch.zeros(NUM_STATES, device=DEVICE),
        seeds=torch.arange(NUM_STATES, device=DEVICE),
        prefill_len=torch.tensor(PREFILL_LEN, dtype=torch.int32, device=DEVICE),
    )


def _steer(logits, cu, r, tokens, path) -> None:
    """Greedy target choices of batch row r follow ``path`` (1-based nodes)
    through a tree whose node tokens are ``tokens``."""
    cur = 0
    for node in path:
        row = int(cu[r]) + cur
        logits[row, int(tokens[node - 1])] = logits[row].max() + 1
        cur = node


def _kv_caches(gen, monkeypatch, vllm_config) -> list[torch.Tensor]:
    """Random KV caches of the target's TREE_ATTN layers, where MRv2's KV init
    binds them (the layers in the static forward context)."""
    caches = [
        torch.randn(64 + 1, NUM_KV_HEADS, BLOCK, 2 * HEAD_SIZE, generator=gen)
        .to(DTYPE)
        .to(DEVICE)
        for _ in LAYERS
    ]
    forward_context = vllm_config.compilation_config.static_forward_context
    for name, cache in zip(LAYERS, caches):
        layer = types.SimpleNamespace(kv_cache=cache)
        monkeypatch.setitem(forward_context, name, layer)
    return caches


# ---------------------------------------------------------------------------
# The speculator, with a stand-in drafter network.
# ---------------------------------------------------------------------------


class _Drafter(torch.nn.Module):
    """DFlash drafter interface; logits depend on (token, position) only."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.context: list[tuple] = []

    def combine_hidden_states(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, : self.hidden] + x[:, self.hidden :].sum(-1, keepdim=True)

    def precompute_and_store_context_kv(self, states, positions, slots=None):
        self.context.append(
            (
                states.clone(),
                positions.clone(),
                None if slots is None else slots.clone(),
            )
        )

    def forward(self, input_ids, positions, inputs_embeds=None):
        x = (input_ids.float() * 0.37 + positions.float() * 1.3)[:, None]
        return torch.sin(x * torch.arange(1, 9, device=x.device).float())

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        proj = torch.cos(torch.arange(8 * VOCAB_SIZE, device=hidden.device).float())
        return hidden @ proj.view(8, VOCAB_SIZE) * 4


def _speculator(vllm_config):
    """A DDTreeSpeculator whose drafter network, drafter KV-cache groups and
    CUDA-graph manager are stand-ins (loading the drafter and DFlash's
    attention set-up need a GPU)."""
    from vllm.v1.spec_decode.ddtree import DDTreeSpeculator

    spec = DDTreeSpeculator(vllm_config, torch.device(DEVICE))
    spec.model = _Drafter(hidden=vllm_config.model_config.get_hidden_size())
    spec.draft_attn_layer_names = set()
    spec.kv_cache_config = types.SimpleNamespace(kv_cache_groups=[])
    spec.draft_kv_cache_group_ids = [0]
    spec._layer_group_idx = None
    spec._group_causal = False
    spec._context_slot_mappings = torch.zeros(
        1, spec.max_num_context, dtype=torch.int64, device=DEVICE
    )
    spec.query_cudagraph_manager = types.SimpleNamespace(
        dispatch=lambda num_reqs, num_tokens, uniform, num_active_loras=0: (
            BatchExecutionDescriptor(CUDAGraphMode.NONE, num_tokens, num_reqs)
        )
    )
    return spec


def _attach(spec, model_state, attn_groups, monkeypatch) -> None:
    """The speculator's ``set_attn`` as the model runner calls it; DFlash's
    part (the drafter's own attention backends) is left out."""
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    monkeypatch.setattr(DFlashSpeculator, "set_attn", lambda self, *args: None)
    spec.set_attn(model_state, None, None, None, attn_groups)


def _attached(vllm_config, monkeypatch):
    """A speculator and the target's model state, wired as in the model runner."""
    spec, model_state = _speculator(vllm_config), _model_state(vllm_config)
    attn_groups = _attn_groups(vllm_config)
    _attach(spec, model_state, attn_groups, monkeypatch)
    return spec, model_state, attn_groups


def _draft_block_tables(block_table: torch.Tensor):
    """The drafter's view of MRv2's block tables: one KV-cache group, whose
    slot-mapping row the target step's slot mappings are views of."""
    return types.SimpleNamespace(
        slot_mappings=torch.zeros(1, 128, dtype=torch.int64, device=DEVICE),
        input_block_tables=[block_table.to(DEVICE)],
        kernel_block_sizes=[BLOCK],
    )


def _target_slots(spec, block_table, positions, batch=BATCH):
    """The target step's slot mappings by layer as MRv2 hands them to
    ``propose``: views of the block tables' slot-mapping buffer, which the
    drafter's inputs reuse."""
    slots = _slot_mapping(block_table, positions, batch).to(DEVICE)
    row = spec.block_tables.slot_mappings[0, : slots.shape[0]]
    row.copy_(slots)
    return {name: row for name in LAYERS}


def _verify(spec, model_state, attn_groups, batch, logits, block_table=None):
    """One target step: the model state's ``prepare_attn``, then the
    speculator's rejection sampler, as MRv2 runs them; returns the walk."""
    if block_table is None:
        block_table = _block_table(torch.Generator().manual_seed(7), _rows_of(batch))
    slot_mapping = _slot_mapping(block_table, batch.positions.cpu(), _rows_of(batch))
    model_state.prepare_attn(
        batch,
        CUDAGraphMode.NONE,
        (block_table.to(DEVICE),),
        slot_mapping[None].to(DEVICE),
        attn_groups,
        KV_CACHE_CONFIG,
    )
    sampler = spec.init_rejection_sampler(
        _sampler(), spec.speculative_config, torch.device(DEVICE)
    )
    return sampler(logits.to(DEVICE), batch, None)


def _rows_of(batch: InputBatch) -> list[tuple[int, int, int, int]]:
    """The (state, tokens, drafts, p0) rows an input batch was built from."""
    return [
        (int(s), int(q), int(b), int(p0))
        for s, q, b, p0 in zip(
            batch.idx_mapping_np,
            batch.num_scheduled_tokens,
            batch.num_draft_tokens_per_req,
            batch.num_computed_tokens_np,
        )
    ]


def _propose(spec, batch, gen, num_sampled, sampler_output=None, slot_mappings=None):
    """The speculator's ``propose`` as ``sample_tokens`` calls it (random aux
    hidden states; last sampled tokens 100 + state, next prefill tokens
    200 + state); returns the draft tokens and the aux hidden states."""
    hidden = spec.vllm_config.model_config.get_hidden_size()
    aux = [
        torch.randn(batch.num_tokens, hidden, generator=gen).to(DEVICE)
        for _ in range(2)
    ]
    draft = spec.propose(
        batch,
        {},
        {} if slot_mappings is None else slot_mappings,
        aux[0],
        aux,
        num_sampled.to(DEVICE),
        torch.zeros(batch.num_reqs, dtype=torch.int32, device=DEVICE),
        torch.arange(100, 100 + NUM_STATES, device=DEVICE)[:, None],
        torch.arange(200, 200 + NUM_STATES, dtype=torch.int32, device=DEVICE),
        torch.zeros(NUM_STATES, device=DEVICE),
        torch.zeros(NUM_STATES, device=DEVICE),
        sampler_output=sampler_output,
    )
    return draft, aux


def _drafter_trees(spec, num_reqs: int):
    """The trees the stand-in drafter's logits give for the last ``propose``
    (its query rows are still in the drafter's input buffers)."""
    n = num_reqs * (DEPTH + 1)
    hidden_q = spec.model.forward(
        spec.input_buffers.input_ids[:n].long(), spec.input_buffers.positions[:n]
    ).view(num_reqs, DEPTH + 1, -1)[:, 1:]
    logits = spec.model.compute_logits(hidden_q.reshape(-1, 8))
    return build_ddtree(logits.view(num_reqs, DEPTH, -1), BUDGET)


def test_speculator_builds_the_tree_sampler_over_its_trees(vllm_config):
    """The rejection-sampler slot gets the one tree sampler, reading the
    speculator's per-request trees in place."""
    spec = _speculator(vllm_config)
    sampler = _sampler()
    tree_sampler = spec.init_rejection_sampler(
        sampler, vllm_config.speculative_config, torch.device(DEVICE)
    )
    assert type(tree_sampler) is TreeRejectionSampler
    assert tree_sampler.sampler is sampler and tree_sampler.max_depth == DEPTH
    assert tree_sampler.tree_token_ids is spec.trees.token_ids
    assert tree_sampler.tree_parent_ids is spec.trees.parent_ids
    # A fresh speculator holds no tree: every slot verifies root-only.
    assert (spec.trees.token_ids == -1).all()


# ---------------------------------------------------------------------------
# One step: verify inputs, walk, then propose with the walk.
# ---------------------------------------------------------------------------


def test_walk_output_drives_compaction_and_drafting(vllm_config, monkeypatch):
    """A step end to end on the speculator's seams: tree inputs from its trees,
    the walk by its sampler, and ``propose`` given the walk, which moves the
    accepted paths' KV (against the torch reference) before the drafter's
    inputs reuse the slot-mapping buffer, and starts the drafter's context
    from the root and the accepted path."""
    gen = torch.Generator().manual_seed(0)
    spec, state_ms, attn_groups = _attached(vllm_config, monkeypatch)
    trees = _trees(gen)
    _store(spec.trees, trees)

    positions = _flat_positions()
    batch = _input_batch(positions, _fed_ids(trees, gen))
    block_table = _block_table(gen)
    spec.block_tables = _draft_block_tables(block_table)
    slots_by_layer = _target_slots(spec, block_table, positions)
    slot_mapping = slots_by_layer[LAYERS[0]].clone()
    metadata = state_ms.prepare_attn(
        batch,
        CUDAGraphMode.NONE,
        (block_table.to(DEVICE),),
        slot_mapping[None],
        attn_groups,
        KV_CACHE_CONFIG,
    )

    # Tree rows: node i at p0 + depth_i; the trimmed tree keeps its prefix; the
    # prefill chunk is untouched. Masks are the trees' rows, in batch order.
    start = 0
    for r, (s, q, b, p0) in enumerate(BATCH):
        got = batch.positions[start : start + q].cpu()
        if b:
            want = torch.cat([torch.tensor([p0]), p0 + trees.depths[s, :b].long()])
            assert torch.equal(
                state_ms.tree_inputs.attn_mask[r, : b + 1].cpu(),
                trees.attn_mask[s, : b + 1],
            )
        else:
            want = torch.arange(p0, p0 + q)
        assert torch.equal(got, want), r
        start += q
    assert state_ms.tree_inputs.is_tree[:3].tolist() == [1, 1, 0]
    rows = metadata[LAYERS[0]].kernel_rows
    assert rows.tree_mask.data_ptr() == state_ms.tree_inputs.attn_mask.data_ptr()
    assert rows.is_tree.data_ptr() == state_ms.tree_inputs.is_tree.data_ptr()

    # Walk: the target's greedy choices follow a random path of each tree.
    # Request 0 accepts the path to its last node; request 1 the path to its
    # deepest kept node (paths skip indices, so the KV really moves).
    cu = batch.cu_num_logits.cpu()
    logits = torch.randn(int(cu[-1]), VOCAB_SIZE, generator=gen)
    paths = []
    for r, num_nodes in ((0, 6), (1, 4)):
        s = BATCH[r][0]
        paths.append(
            _path_to(trees.parent_ids[s], _deepest(trees.depths[s], num_nodes))
        )
        _steer(logits, cu, r, trees.token_ids[s], paths[-1])
    sampler = spec.init_rejection_sampler(
        _sampler(), spec.speculative_config, torch.device(DEVICE)
    )
    out = sampler(logits.to(DEVICE), batch, None)
    assert isinstance(out, TreeSamplerOutput)
    k = out.num_accepted.tolist()
    assert k[:2] == [len(p) for p in paths] and k[2] == 0
    for r, path in enumerate(paths):
        assert out.accepted_nodes[r, : k[r]].tolist() == path
    assert out.num_sampled.tolist() == [k[0] + 1, k[1] + 1, 0]
    assert out.num_rejected.tolist() == [6 - k[0], 4 - k[1], 0]

    # Compaction moves each accepted node's KV to slot p0 + d in both layers:
    # the whole caches equal the reference's, which moved the KV of at least
    # two nodes (the comparison is not of untouched caches).
    caches = _kv_caches(gen, monkeypatch, vllm_config)
    before = [kv_cache_as_kv_first(c.clone(), HEAD_SIZE).cpu() for c in caches]
    want = [c.clone() for c in before]
    compact_tree_kv_reference(
        want,
        slot_mapping.cpu(),
        torch.tensor([0, 7, 16, 21]),
        out.accepted_nodes.cpu(),
        out.num_accepted.cpu(),
    )
    # K and V slots the reference changed: two per node off its depth's slot.
    moved = (want[0] != before[0]).flatten(3).any(-1).sum().item()
    off = sum(node != d + 1 for path in paths for d, node in enumerate(path))
    assert moved == 2 * off and off >= 2
    _propose(spec, batch, gen, out.num_sampled, out, slots_by_layer)
    for cache, ref in zip(caches, want):
        assert torch.equal(kv_cache_as_kv_first(cache, HEAD_SIZE).cpu(), ref)

    # The drafter's context: root + accepted path of each tree request, at
    # its committed positions p0 .. p0 + k.
    _, ctx_pos, _ = spec.model.context[-1]
    for r, (s, q, b, p0) in enumerate(BATCH[:2]):
        begin = r * (1 + DEPTH)
        assert ctx_pos[begin : begin + k[r] + 1].tolist() == list(
            range(p0, p0 + k[r] + 1)
        )
    # The next trees are stored in the batch's slots.
    drafted = _drafter_trees(spec, len(BATCH))
    for r, (s, *_rest) in enumerate(BATCH):
        assert torch.equal(spec.trees.token_ids[s].cpu(), drafted.token_ids[r].cpu())
    # State 1 holds no request of the batch: its tree is left alone.
    assert torch.equal(spec.trees.token_ids[1].cpu(), trees.token_ids[1])


@pytest.mark.parametrize("output", ["none", "plain_sampler"])
def test_propose_without_a_walk_moves_no_kv(vllm_config, monkeypatch, output):
    """A step that verified no tree (MRv2 ran its plain sampler, or a dummy
    run passes nothing): no KV moves, and the drafter's context of each
    decoding request is its root alone, with no path entries (a plain step
    projects only the rows it committed)."""
    gen = torch.Generator().manual_seed(4)
    spec, _, _ = _attached(vllm_config, monkeypatch)
    batch = _input_batch(_flat_positions())
    block_table = _block_table(gen)
    spec.block_tables = _draft_block_tables(block_table)
    slots_by_layer = _target_slots(spec, block_table, _flat_positions())
    caches = _kv_caches(gen, monkeypatch, vllm_config)
    before = [c.clone() for c in caches]
    num_sampled = torch.tensor([1, 1, 0], dtype=torch.int32)
    sampler_output = None
    if output == "plain_sampler":
        sampler_output = SamplerOutput(
            sampled_token_ids=torch.zeros(3, 1, dtype=torch.int64, device=DEVICE),
            logprobs_tensors=None,
            num_nans=None,
            num_sampled=num_sampled.to(DEVICE),
        )
    _propose(spec, batch, gen, num_sampled, sampler_output, slots_by_layer)
    for cache, old in zip(caches, before):
        assert torch.equal(cache, old)
    _, ctx_pos, ctx_slots = spec.model.context[-1]
    # Roots of the two decoding requests, then the prefill chunk's rows.
    assert ctx_pos.shape[0] == 2 + BATCH[2][1]
    for r, (_, _, _, p0) in enumerate(BATCH[:2]):
        assert ctx_pos[r].item() == p0
        assert ctx_slots[r] >= 0


def test_propose_shows_the_adaptive_budget_the_verified_trees(vllm_config, monkeypatch):
    """With an adaptive budget, ``propose`` first hands it the walk over the
    trees that were verified, then asks whether to draft, then shows it the
    new trees: the calibration never sees a tree the step did not verify."""
    gen = torch.Generator().manual_seed(6)
    spec, state_ms, attn_groups = _attached(vllm_config, monkeypatch)
    _kv_caches(gen, monkeypatch, vllm_config)
    trees = _trees(gen)
    _store(spec.trees, trees)
    batch = _input_batch(_flat_positions(), _fed_ids(trees, gen))
    logits = torch.randn(int(batch.cu_num_logits[-1]), VOCAB_SIZE, generator=gen)
    block_table = _block_table(gen)
    out = _verify(spec, state_ms, attn_groups, batch, logits, block_table)
    calls = []
    spec.adaptive = types.SimpleNamespace(
        slots=[BUDGET] * (NUM_STATES + 1),
        step_max_nodes=BUDGET,
        observe_walk=lambda log_probs, b, t, nodes, n: calls.append(
            ("walk", log_probs.clone().cpu(), b, nodes, n)
        ),
        should_draft=lambda num_reqs: calls.append(("draft?", num_reqs)) or True,
        observe_trees=lambda log_probs, t, idx: calls.append(("trees",)),
    )
    spec.block_tables = _draft_block_tables(block_table)
    slots_by_layer = _target_slots(spec, block_table, _flat_positions())
    _propose(spec, batch, gen, out.num_sampled, out, slots_by_layer)
    assert [c[0] for c in calls] == ["walk", "draft?", "trees"]
    _, log_probs, walked_batch, nodes, num = calls[0]
    torch.testing.assert_close(log_probs, trees.log_probs, rtol=0, atol=0)
    assert walked_batch is batch
    assert nodes is out.accepted_nodes and num is out.num_accepted
    assert calls[1][1] == len(BATCH)


# ---------------------------------------------------------------------------
# Per-request trees: joining requests, finished requests, reused slots, what
# the target was fed.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("history", ["never_used", "previous_request"])
@pytest.mark.parametrize("target", ["old_tree_path", "zeros"])
def test_joining_request_verifies_root_only(vllm_config, monkeypatch, history, target):
    """Batch row 0 (slot 2) joined this step with placeholder drafts: MRv2 fed
    zeros at its 6 nodes and no tree was drafted for it. Whatever the target
    samples (the path of the tree the slot's previous request left, or the
    placeholder token 0 everywhere) it emits exactly one token, the target's
    choice at the root, and every placeholder is rejected. Row 1 (slot 0), a
    running request, keeps its tree and accepts its path."""
    gen = torch.Generator().manual_seed(11)
    spec, state_ms, attn_groups = _attached(vllm_config, monkeypatch)
    trees = _trees(gen)
    if history == "previous_request":
        _store(spec.trees, trees)
    else:
        # Slot 0 runs a drafted tree; slot 2 was never used.
        for name in TREE_FIELDS:
            getattr(spec.trees, name)[0].copy_(getattr(trees, name)[0])
    # The model runner adds the request to the model state and the speculator.
    state_ms.add_request(2, _new_request())
    spec.add_request(2, _new_request())

    batch = _input_batch(_flat_positions(), _fed_ids(trees, gen, zero_slots={2}))
    cu = batch.cu_num_logits.cpu()
    logits = torch.randn(int(cu[-1]), VOCAB_SIZE, generator=gen)
    old_path = _path_to(trees.parent_ids[2], _deepest(trees.depths[2], 6))
    if target == "old_tree_path":
        _steer(logits, cu, 0, trees.token_ids[2], old_path)
    else:
        logits[int(cu[0]) : int(cu[1]), 0] = logits.max() + 1
    path1 = _path_to(trees.parent_ids[0], _deepest(trees.depths[0], 4))
    _steer(logits, cu, 1, trees.token_ids[0], path1)

    out = _verify(spec, state_ms, attn_groups, batch, logits)

    # Row 0: every node at the root's position, masks {root} / {root, self}.
    p0 = BATCH[0][3]
    assert batch.positions[:7].tolist() == [p0] * 7
    mask = state_ms.tree_inputs.attn_mask[0, :7, 0].cpu()
    assert mask.tolist() == [1] + [1 | (1 << j) for j in range(1, 7)]
    _assert_root_only(out, 0, logits, int(cu[0]), num_nodes=6)
    # Row 1 is untouched by slot 2's reset.
    assert out.num_accepted[1].item() == len(path1) > 0
    assert out.accepted_nodes[1, : len(path1)].tolist() == path1
    assert len(old_path) >= 1


def _assert_root_only(out, r: int, logits, root_row: int, num_nodes: int) -> None:
    """Batch row r emitted the target's choice at its root and nothing else."""
    assert out.num_accepted[r].item() == 0
    assert out.num_sampled[r].item() == 1
    assert out.num_rejected[r].item() == num_nodes
    assert out.sampled_token_ids[r, 0].item() == logits[root_row].argmax().item()
    assert (out.sampled_token_ids[r, 1:] == -1).all()


def test_finished_request_slot_is_left_then_reset_for_the_next(
    vllm_config, monkeypatch
):
    """A slot's life cycle over three steps. Step 1 drafts trees for the
    batch's slots 2, 0 and 3. The request in slot 0 finishes: step 2's batch
    (slots 2 and 3) replaces only their trees, and slot 0's stays as it was,
    read by no one. A new request joins slot 0 with placeholder drafts: its
    tree is reset, so although the target's samples follow the path of the
    finished request's tree, it verifies root-only, while slot 2 accepts the
    path of the tree step 2 drafted for it."""
    gen = torch.Generator().manual_seed(21)
    spec, state_ms, attn_groups = _attached(vllm_config, monkeypatch)
    spec.block_tables = _draft_block_tables(_block_table(gen))

    # Step 1: trees drafted for every row of BATCH.
    step_1 = _input_batch(_flat_positions())
    _propose(spec, step_1, gen, torch.tensor([1, 1, 0], dtype=torch.int32))
    after_1 = {name: getattr(spec.trees, name).clone() for name in TREE_FIELDS}
    assert (after_1["token_ids"][[2, 0, 3]] >= 0).any(-1).all()

    # Step 2: slot 0's request finished; slots 2 and 3 decode.
    step_2 = [(2, 7, 6, 50), (3, 7, 6, 15)]
    batch_2 = _input_batch(_flat_positions(step_2), batch=step_2)
    _propose(spec, batch_2, gen, torch.ones(2, dtype=torch.int32))
    drafted_2 = _drafter_trees(spec, 2)
    for r, (s, *_rest) in enumerate(step_2):
        assert torch.equal(spec.trees.token_ids[s].cpu(), drafted_2.token_ids[r].cpu())
    assert not torch.equal(spec.trees.token_ids[2], after_1["token_ids"][2])
    for name in TREE_FIELDS:
        assert torch.equal(getattr(spec.trees, name)[0], after_1[name][0]), name

    # Step 3: a new request joins slot 0, next to slot 2's running request.
    state_ms.add_request(0, _new_request())
    spec.add_request(0, _new_request())
    assert (spec.trees.token_ids[0] == -1).all()
    # The other slots keep their trees (slot 1 never held a request).
    others = {1: after_1["token_ids"][1].cpu(), 2: drafted_2.token_ids[0].cpu()}
    others[3] = drafted_2.token_ids[1].cpu()
    for s, want in others.items():
        assert torch.equal(spec.trees.token_ids[s].cpu(), want), s
    step_3 = [(0, 7, 6, 5), (2, 7, 6, 58)]
    old = types.SimpleNamespace(**{n: after_1[n].cpu() for n in TREE_FIELDS})
    fed = _fed_ids(_trees_on_cpu(spec), gen, zero_slots={0}, batch=step_3)
    batch_3 = _input_batch(_flat_positions(step_3), fed, batch=step_3)
    cu = batch_3.cu_num_logits.cpu()
    logits = torch.randn(int(cu[-1]), VOCAB_SIZE, generator=gen)
    old_path = _path_to(old.parent_ids[0], _deepest(old.depths[0], 6))
    _steer(logits, cu, 0, old.token_ids[0], old_path)
    live = _trees_on_cpu(spec)
    path2 = _path_to(live.parent_ids[2], _deepest(live.depths[2], 6))
    _steer(logits, cu, 1, live.token_ids[2], path2)
    out = _verify(spec, state_ms, attn_groups, batch_3, logits)
    _assert_root_only(out, 0, logits, int(cu[0]), num_nodes=6)
    assert len(old_path) >= 1
    assert out.accepted_nodes[1, : len(path2)].tolist() == path2 != []


def test_walk_accepts_only_what_the_target_was_fed(vllm_config, monkeypatch):
    """A slot's stored tree and the step's input ids disagree from one node on
    (any drift between the two copies): the walk stops before that node even
    though the target's samples follow the stored tree's path."""
    gen = torch.Generator().manual_seed(12)
    spec, state_ms, attn_groups = _attached(vllm_config, monkeypatch)
    logits = torch.randn(NUM_STATES, DEPTH, VOCAB_SIZE, generator=gen) * 3
    # One likely token at every depth, so that slot 2's tree has a path of
    # two nodes or more whatever the vocabulary's size.
    logits[2, :, 7] += 12
    trees = build_ddtree_reference(logits, BUDGET)
    _store(spec.trees, trees)
    path = _path_to(trees.parent_ids[2], _deepest(trees.depths[2], 6))
    assert len(path) >= 2
    fed = _fed_ids(trees, gen)
    # Node path[1] was fed another token than the stored tree says.
    fed[path[1]] = (int(trees.token_ids[2, path[1] - 1]) + 1) % VOCAB_SIZE
    batch = _input_batch(_flat_positions(), fed)
    cu = batch.cu_num_logits.cpu()
    logits = torch.randn(int(cu[-1]), VOCAB_SIZE, generator=gen)
    _steer(logits, cu, 0, trees.token_ids[2], path)

    out = _verify(spec, state_ms, attn_groups, batch, logits)
    assert out.num_accepted[0].item() == 1
    assert out.accepted_nodes[0, 0].item() == path[0]
    assert out.sampled_token_ids[0, 1].item() == int(trees.token_ids[2, path[1] - 1])


def test_add_request_resets_only_its_slot(vllm_config):
    """``add_request`` clears the slot's tree (as MRv2 zeroes its draft
    tokens) and no other; the speculator's next scatter fills it again."""
    gen = torch.Generator().manual_seed(13)
    spec = _speculator(vllm_config)
    stored = spec.trees
    trees = _trees(gen)
    assert (stored.token_ids == -1).all()  # a fresh speculator holds no tree
    _store(stored, trees)
    spec.add_request(1, _new_request())
    for s in range(NUM_STATES):
        want = torch.full((BUDGET,), -1) if s == 1 else trees.token_ids[s]
        assert torch.equal(stored.token_ids[s].cpu(), want), s
        want = torch.full((BUDGET,), float("-inf")) if s == 1 else trees.log_probs[s]
        assert torch.equal(stored.log_probs[s].cpu(), want), s
    batch_trees = _trees(gen)
    draft_tokens = torch.zeros(NUM_STATES, BUDGET, dtype=torch.int64, device=DEVICE)
    stored.scatter_(
        torch.tensor([1], device=DEVICE),
        type(trees)(*(t.to(DEVICE) for t in vars(batch_trees).values())),
        1,
        draft_tokens,
    )
    assert torch.equal(stored.token_ids[1].cpu(), batch_trees.token_ids[0])
    assert torch.equal(draft_tokens[0].cpu(), batch_trees.token_ids[0].clamp(min=0))


def test_capture_and_draft_free_batches_are_causal(vllm_config):
    state_ms = _model_state(vllm_config)
    state_ms.tree_inputs.is_tree.fill_(1)
    batch = _input_batch(_flat_positions())
    batch.num_draft_tokens = 0
    block_table = _block_table(torch.Generator().manual_seed(1)).to(DEVICE)
    slot_mapping = _slot_mapping(block_table.cpu(), _flat_positions())[None]
    state_ms.prepare_attn(
        batch,
        CUDAGraphMode.NONE,
        (block_table,),
        slot_mapping.to(DEVICE),
        _attn_groups(vllm_config),
        KV_CACHE_CONFIG,
    )
    assert not state_ms.tree_inputs.is_tree.any()
    assert torch.equal(batch.positions.cpu(), _flat_positions())


def test_plain_steps_tell_tree_attn_they_hold_no_tree(vllm_config):
    """A step verifying no drafts marks the tree inputs draft-free (TREE_ATTN
    may then hand the batch to FlashAttention), except under a full CUDA graph
    or a capture, which run the path they were captured with; ``is_tree`` is
    cleared once after a tree step, not again in every plain step after it."""
    from vllm.v1.spec_decode.ddtree import DraftTrees

    gen = torch.Generator().manual_seed(1)
    state_ms = _model_state(vllm_config)
    trees = DraftTrees(NUM_STATES, BUDGET, torch.device(DEVICE))
    _store(trees, _trees(gen))
    state_ms.set_draft_trees(trees, set())
    inputs = state_ms.tree_inputs
    block_table = _block_table(gen).to(DEVICE)
    slot_mapping = _slot_mapping(block_table.cpu(), _flat_positions())[None]

    def step(num_draft_tokens, mode=CUDAGraphMode.NONE, for_capture=False):
        batch = _input_batch(_flat_positions())
        if not num_draft_tokens:
            batch.num_draft_tokens = 0
        state_ms.prepare_attn(
            batch,
            mode,
            (block_table,),
            slot_mapping.to(DEVICE),
            _attn_groups(vllm_config),
            KV_CACHE_CONFIG,
            for_capture=for_capture,
        )

    step(num_draft_tokens=True)
    assert inputs.has_tree_rows and inputs.is_tree.any()
    step(num_draft_tokens=False)
    assert not inputs.has_tree_rows and not inputs.is_tree.any()
    # A later plain step launches no clearing: a marker left in the buffer
    # stays (nothing but prepare_attn writes it in a real step).
    inputs.is_tree[-1] = 5
    step(num_draft_tokens=False)
    assert inputs.is_tree[-1].item() == 5 and not inputs.has_tree_rows
    step(num_draft_tokens=False, mode=CUDAGraphMode.FULL)
    assert inputs.has_tree_rows
    step(num_draft_tokens=False, for_capture=True)
    assert inputs.has_tree_rows
    inputs.is_tree[-1] = 0
    step(num_draft_tokens=True)
    step(num_draft_tokens=False, for_capture=True)
    assert not inputs.is_tree.any()


def test_context_features_either_way(vllm_config, monkeypatch):
    """The drafter's context features are the same whether the aux layers are
    concatenated over every row first (small steps: fewer launches) or gathered
    per layer first (large trees: fewer bytes)."""
    from vllm.v1.spec_decode import ddtree

    spec = _speculator(vllm_config)
    gen = torch.Generator().manual_seed(5)
    hidden = vllm_config.model_config.get_hidden_size()
    aux = [torch.randn(40, hidden, generator=gen).to(DEVICE) for _ in range(3)]
    rows = torch.tensor([3, 0, 7, 7, 39, 12], device=DEVICE)
    want = spec.model.combine_hidden_states(torch.cat(aux, -1)[rows[:5]])
    got = {}
    for name, limit in (("concat first", 1 << 30), ("gather first", 0)):
        monkeypatch.setattr(ddtree, "_CONCAT_ALL_ROWS_BYTES", limit)
        got[name] = spec._context_hidden_states(aux[0], aux, rows, 5)
        torch.testing.assert_close(got[name], want, rtol=0, atol=0)
    # Without explicit rows: the first num_context rows.
    first = spec._context_hidden_states(aux[0], aux, None, 4)
    torch.testing.assert_close(
        first, spec.model.combine_hidden_states(torch.cat(aux, -1)[:4])
    )


def test_target_steps_skip_drafter_only_attention_groups(vllm_config, monkeypatch):
    """The model runner's attention groups hold the drafter's layers too; under
    DDTree they are a group of their own (FLASH_ATTN next to TREE_ATTN), whose
    metadata the target step need not build: the drafter builds its own. A
    group holding target layers is kept, and the speculator's ``set_attn``
    hands the model state the drafter's layers with its trees; its own KV
    compaction covers the TREE_ATTN groups only."""
    from vllm.v1.worker.gpu.model_states import default

    draft_layers = ["model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn"]
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=DTYPE
    )
    target = _attn_groups(vllm_config)[0][0]

    class FlashLike:  # the drafter's FLASH_ATTN groups: never tree groups
        pass

    drafter = AttentionGroup(FlashLike, list(draft_layers), spec, 0)
    mixed = AttentionGroup(TreeAttentionBackend, [LAYERS[0], draft_layers[0]], spec, 0)
    second = AttentionGroup(FlashLike, [draft_layers[1]], spec, 1)
    attn_groups = [[target, drafter, mixed], [second]]
    built = []
    monkeypatch.setattr(
        default,
        "build_attn_metadata",
        lambda attn_groups, **kwargs: built.append(attn_groups) or {},
    )
    state_ms = _model_state(vllm_config)
    block_table = _block_table(torch.Generator().manual_seed(2)).to(DEVICE)
    slot_mapping = _slot_mapping(block_table.cpu(), _flat_positions())[None]

    def prepare():
        batch = _input_batch(_flat_positions())
        batch.num_draft_tokens = 0
        state_ms.prepare_attn(
            batch,
            CUDAGraphMode.NONE,
            (block_table, block_table),
            slot_mapping.to(DEVICE).expand(2, -1),
            attn_groups,
            types.SimpleNamespace(kv_cache_groups=[None, None]),
        )
        return built[-1]

    assert prepare() == attn_groups  # no drafter layers known yet: all of them

    speculator = _speculator(vllm_config)
    speculator.draft_attn_layer_names = set(draft_layers)
    _attach(speculator, state_ms, attn_groups, monkeypatch)
    kept = prepare()
    assert kept == [[target, mixed], []]
    assert prepare() is kept  # filtered once, not per step
    assert speculator._tree_groups == [target, mixed]


def test_set_attn_needs_the_ddtree_model_state(vllm_config, monkeypatch):
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    state = DefaultModelState(
        vllm_config, torch.nn.Module(), None, torch.device(DEVICE)
    )
    with pytest.raises(TypeError, match="needs the target's DDTreeModelState"):
        _attach(_speculator(vllm_config), state, _attn_groups(vllm_config), monkeypatch)


def test_speculator_drafts_trees_from_the_accepted_path(vllm_config, monkeypatch):
    """``propose`` given a walk (a valid accepted path per tree request):
    the drafter's context is the root and that path, in path order, at the
    committed positions; the query is the bonus token then masks right after
    the path; the trees built from the drafter's logits go to the batch's
    request slots and are the returned draft tokens."""
    gen = torch.Generator().manual_seed(3)
    spec, model_state, _ = _attached(vllm_config, monkeypatch)
    assert spec.num_query_per_req == DEPTH + 1
    positions = _flat_positions()
    batch = _input_batch(positions)
    spec.block_tables = _draft_block_tables(_block_table(gen))
    # Tree positions as the verify writer leaves them, and a walk result.
    trees = _trees(gen)
    _store(spec.trees, trees)
    from vllm.v1.spec_decode.ddtree_inputs import write_tree_verify_inputs

    write_tree_verify_inputs(
        batch.positions,
        model_state.tree_inputs.attn_mask,
        model_state.tree_inputs.is_tree,
        trees.token_ids.to(DEVICE),
        trees.depths.to(DEVICE),
        trees.attn_mask.to(DEVICE),
        batch.idx_mapping,
        batch.query_start_loc,
        batch.cu_num_logits,
        3,
    )
    accepted = _accepted_path(trees)
    num_sampled = torch.tensor([3, 2, 0], dtype=torch.int32)
    walk = TreeSamplerOutput(
        sampled_token_ids=torch.zeros(3, BUDGET + 1, dtype=torch.int64),
        logprobs_tensors=None,
        num_nans=None,
        num_sampled=num_sampled.to(DEVICE),
        accepted_nodes=accepted[0].to(DEVICE),
        num_accepted=accepted[1].to(DEVICE),
    )
    # No TREE_ATTN groups here, so no KV to compact.
    spec._tree_groups = []
    draft, aux = _propose(spec, batch, gen, num_sampled, walk)

    # Context: root + accepted path (in path order) of the tree requests, all
    # rows of the prefill chunk; padding entries write no KV.
    num_tokens = batch.num_tokens
    states, ctx_pos, ctx_slots = spec.model.context[-1]
    n = draft_context_size(num_tokens, batch.num_draft_tokens, 3, DEPTH)
    assert states.shape[0] == ctx_pos.shape[0] == n
    k = accepted[1].tolist()
    assert k[:2] == [2, 2]
    want_rows, want_keep = [], []
    for r, (s, q, b, p0) in enumerate(BATCH):
        start = int(batch.query_start_loc[r])
        if b:
            path = [start] + [start + int(x) for x in accepted[0][r, : k[r]]]
            want_rows += path + [start] * (1 + DEPTH - len(path))
            # The committed path sits at p0, p0 + 1, ..., p0 + k.
            assert batch.positions[path].tolist() == list(range(p0, p0 + len(path)))
        else:
            path = list(range(start, start + q))
            want_rows += path + [start + q - 1] * DEPTH
        want_keep += [True] * len(path) + [False] * (
            len(want_rows) - len(want_keep) - len(path)
        )
    assert ctx_pos.tolist() == batch.positions[want_rows].tolist()
    assert (ctx_slots >= 0).tolist() == want_keep
    x = torch.cat(aux, -1)[torch.tensor(want_rows, device=DEVICE)]
    torch.testing.assert_close(states, spec.model.combine_hidden_states(x))

    # Query: bonus token then masks right after the committed path.
    ids = spec.input_buffers.input_ids[: 3 * (DEPTH + 1)].view(3, DEPTH + 1).cpu()
    pos = spec.input_buffers.positions[: 3 * (DEPTH + 1)].view(3, DEPTH + 1).cpu()
    mask = spec.parallel_drafting_token_id
    assert ids[:, 0].tolist() == [102, 100, 203]
    assert (ids[:, 1:] == mask).all()
    first = [40 + k[0] + 1, 17 + k[1] + 1, 15]
    assert pos[:, 0].tolist() == first

    # Trees: built from the drafter's logits at the mask rows, stored per state.
    want = _drafter_trees(spec, 3)
    for r, (s, *_rest) in enumerate(BATCH):
        assert torch.equal(spec.trees.token_ids[s].cpu(), want.token_ids[r].cpu())
        assert torch.equal(spec.trees.attn_mask[s].cpu(), want.attn_mask[r].cpu())
    assert torch.equal(draft.cpu(), want.token_ids.clamp(min=0).cpu())


def _deepest(depths: torch.Tensor, num_nodes: int) -> int:
    """The last of the deepest nodes among the first num_nodes (1-based)."""
    d = depths[:num_nodes].tolist()
    return max(range(num_nodes), key=lambda i: (d[i], i)) + 1


def _path_to(parents: torch.Tensor, node: int) -> list[int]:
    path = []
    while node:
        path.append(node)
        node = int(parents[node - 1])
    return path[::-1]


def _accepted_path(trees):
    """A valid accepted path per batch row: the first child chain of each tree,
    cut at 2 nodes; none for the prefill row."""
    nodes = torch.full((3, DEPTH), -1, dtype=torch.int32)
    counts = torch.zeros(3, dtype=torch.int32)
    for r, (s, _, b, _) in enumerate(BATCH):
        cur, path = 0, []
        while b and len(path) < 2:
            children = [i + 1 for i in range(b) if int(trees.parent_ids[s, i]) == cur]
            if not children:
                break
            cur = children[0]
            path.append(cur)
        nodes[r, : len(path)] = torch.tensor(path, dtype=torch.int32)
        counts[r] = len(path)
    return nodes, counts


# ---------------------------------------------------------------------------
# Start-up: every TREE_ATTN variant compiled before serving.
# ---------------------------------------------------------------------------


def test_warm_up_refuses_a_length_fitted_below_the_tree(vllm_config, monkeypatch):
    """--max-model-len -1 fits the length to GPU memory after the engine
    config (and its budget check) is built; the model state checks again
    before vLLM's start-up warm-up, which runs 2 * B + 3 tokens per request,
    and names the fitted length. At 2 * B + 3 tokens it goes on."""
    state_ms = _model_state(vllm_config)
    model_config = vllm_config.model_config
    monkeypatch.setattr(model_config, "original_max_model_len", -1)
    monkeypatch.setattr(model_config, "max_model_len", 2 * BUDGET + 2)
    with pytest.raises(
        ValueError,
        match=rf"tree_budget {BUDGET} needs --max-model-len >= {2 * BUDGET + 3} "
        r".*\(fitted to GPU memory for --max-model-len -1\): raise it, or set "
        rf"tree_budget to at most {BUDGET - 1}",
    ):
        state_ms.warm_up_tree_attention(None, [])
    monkeypatch.setattr(model_config, "max_model_len", 2 * BUDGET + 3)
    # Past the check, the warm-up looks for the target's TREE_ATTN layers
    # among the runner's attention groups (none given here).
    with pytest.raises(ValueError, match="DDTree needs TREE_ATTN"):
        state_ms.warm_up_tree_attention(None, [])


def test_warm_up_covers_the_engines_tree_attention_variants(vllm_config, monkeypatch):
    """After capture the model state warms TREE_ATTN once per distinct layer
    shape, over the variants of every step the scheduler's limits allow, on
    the real KV cache, block-table width and tree buffers."""
    from vllm.v1.attention.backends.tree_attn import split_kv_cache
    from vllm.v1.attention.ops.triton_tree_attention import tree_attention_variants
    from vllm.v1.spec_decode import ddtree_verify

    state_ms = _model_state(vllm_config)
    num_heads = 4
    impl = types.SimpleNamespace(
        num_heads=num_heads,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        scale=HEAD_SIZE**-0.5,
    )
    caches = [
        torch.zeros(9, NUM_KV_HEADS, BLOCK, 2 * HEAD_SIZE, dtype=DTYPE, device=DEVICE)
        for _ in LAYERS
    ]
    forward_context = vllm_config.compilation_config.static_forward_context
    for name, cache in zip(LAYERS, caches):
        layer = types.SimpleNamespace(kv_cache=cache, impl=impl)
        monkeypatch.setitem(forward_context, name, layer)
    calls = []

    def record(variants, q_like, key_cache, value_cache, width, mask, is_tree, scale):
        calls.append((variants, q_like, key_cache, width, mask, is_tree, scale))
        return len(variants)

    monkeypatch.setattr(ddtree_verify, "warm_up_tree_attention", record)
    # On a GPU host compile_in_parallel runs the warm-up twice (a compile-only
    # pass, then the launches; test_ddtree_compile_variants.py tests it): count
    # the variants of one pass.
    monkeypatch.setattr(
        ddtree_verify, "compile_in_parallel", lambda warm_up, **kw: warm_up()
    )
    table = torch.zeros(NUM_STATES, 16, dtype=torch.int32, device=DEVICE)
    tables = types.SimpleNamespace(block_tables=[types.SimpleNamespace(gpu=table)])
    launches = state_ms.warm_up_tree_attention(tables, _attn_groups(vllm_config))

    assert len(calls) == 1  # both layers have one shape
    variants, q_like, key_cache, width, mask, is_tree, scale = calls[0]
    sched = vllm_config.scheduler_config
    dtype = DTYPE  # the KV cache's
    want = tree_attention_variants(
        num_heads,
        NUM_KV_HEADS,
        HEAD_SIZE,
        1
        if DEVICE == "cpu"
        else torch.cuda.get_device_properties(0).multi_processor_count,
        sched.max_num_seqs,
        sched.max_num_batched_tokens,
        itemsize=torch.empty((), dtype=dtype).element_size(),
    )
    assert variants == want and launches == len(want) >= 2
    assert q_like.dtype == dtype and tuple(q_like.shape[1:]) == (num_heads, HEAD_SIZE)
    assert key_cache.data_ptr() == split_kv_cache(caches[0], HEAD_SIZE)[0].data_ptr()
    assert key_cache.stride() == split_kv_cache(caches[0], HEAD_SIZE)[0].stride()
    assert width == 16 and scale == impl.scale
    assert mask is state_ms.tree_inputs.attn_mask
    assert is_tree is state_ms.tree_inputs.is_tree
