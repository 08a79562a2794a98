# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The series' first patch (DFlash's ``propose`` in steps) changes nothing
DFlash does (CPU).

vLLM 0.26.0's ``DFlashSpeculator`` and the same module with
``upstream/edits/0001-dflash-propose-steps.diff`` applied, imported side by
side, each run ``propose`` on the same batch with the same stand-ins for what
needs a GPU (the drafter network, the CUDA-graph manager, the draft attention
metadata, EPLB): the draft tokens, every buffer the speculator writes, and the
calls it makes (the drafter's context K/V, the graph dispatch, the attention
metadata and its max sequence length, the slot mappings, EPLB, the eager
forward or the FULL graph's replay) are the same, in the same order. The one
reordering the patch states, the request inputs copied before the hidden
states, is checked as such.

The real drafter, its attention backends and CUDA graphs, and data-parallel
padding (``dp_size > 1``) are not run here; DFlash's end-to-end tests on a GPU
cover them.
"""

import importlib
import importlib.util
import inspect
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

from tests.models.tiny_models import make_tiny_dflash, make_tiny_qwen3

ROOT = Path(__file__).resolve().parents[2]
EDIT = ROOT / "upstream" / "edits" / "0001-dflash-propose-steps.diff"
DFLASH = "vllm.v1.worker.gpu.spec_decode.dflash.speculator"
PATCHED = "ddtree_test_patched_dflash_speculator"
DEPTH, BLOCK = 3, 16
MAX_REQS, MAX_TOKENS = 4, 128
# (request state, tokens scheduled, tokens rejected, committed length p0): two
# decodes verifying drafts, one prefill chunk.
BATCH = [(2, 4, 1, 40), (0, 4, 3, 17), (3, 5, 0, 10)]


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    root = tmp_path_factory.mktemp("dflash_steps")
    target = make_tiny_qwen3(root / "target", num_hidden_layers=4)
    drafter = make_tiny_dflash(root / "drafter", target, block_size=DEPTH + 1)
    with pytest.MonkeyPatch.context() as mp:
        # EngineArgs asks the platform for a device type; a CPU-only box has none.
        mp.setattr(type(current_platform), "device_type", "cuda", raising=False)
        return EngineArgs(
            model=str(target),
            speculative_config={
                "method": "dflash",
                "model": str(drafter),
                "num_speculative_tokens": DEPTH,
            },
            max_model_len=256,
            max_num_seqs=MAX_REQS,
            max_num_batched_tokens=MAX_TOKENS,
        ).create_engine_config()


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    """(vLLM's DFlash speculator module, the same with the patch applied)."""
    stock = importlib.import_module(DFLASH)
    source = Path(inspect.getsourcefile(stock))
    root = tmp_path_factory.mktemp("patched_dflash")
    rel = Path(*DFLASH.split(".")).with_suffix(".py")
    (root / rel).parent.mkdir(parents=True)
    shutil.copyfile(source, root / rel)
    # Inside a git work tree, ``git apply`` would take paths from its root.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(root.parent))
    subprocess.run(["git", "apply", str(EDIT)], cwd=root, env=env, check=True)
    spec = importlib.util.spec_from_file_location(PATCHED, root / rel)
    patched = importlib.util.module_from_spec(spec)
    sys.modules[PATCHED] = patched
    try:
        spec.loader.exec_module(patched)
        yield stock, patched
    finally:
        del sys.modules[PATCHED]


def test_the_patch_splits_propose(modules):
    stock, patched = modules
    for name in ("_prepare_draft_context", "_store_context_kv", "_run_drafter"):
        assert name in vars(patched.DFlashSpeculator)
        # vLLM's own class lacks it (the plugin, if loaded, added its copy).
        step = vars(stock.DFlashSpeculator).get(name)
        assert step is None or getattr(step, "__ddtree_patched__", False)
    assert "dispatch_cg_and_sync_dp" not in inspect.getsource(
        patched.DFlashSpeculator.propose
    )


class _Drafter(torch.nn.Module):
    """The DFlash drafter's interface; hidden states depend on (token,
    position) only, and every call is logged."""

    def __init__(self, hidden: int, vocab: int, log: list):
        super().__init__()
        self.hidden, self.vocab, self.log = hidden, vocab, log

    def combine_hidden_states(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, : self.hidden] + x[:, self.hidden :].sum(-1, keepdim=True)

    def precompute_and_store_context_kv(self, states, positions, slots=None):
        self.log.append(_snapshot(("context_kv", states, positions, slots)))

    def forward(self, input_ids, positions, inputs_embeds=None):
        self.log.append(_snapshot(("forward", input_ids, positions)))
        x = (input_ids.float() * 0.37 + positions.float() * 1.3)[:, None]
        return torch.sin(x * torch.arange(1, self.hidden + 1).float())

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        proj = torch.cos(torch.arange(self.hidden * self.vocab).float())
        return hidden.float() @ proj.view(self.hidden, self.vocab)


def _speculator(cls, vllm_config, case, log: list, copies: list):
    """A DFlash speculator of ``cls`` whose drafter network, attention set-up,
    graph manager and EPLB state are logging stand-ins."""
    spec = cls(vllm_config, torch.device("cpu"))
    spec.model = _Drafter(spec.hidden_size, spec.vocab_size, log)
    groups = case.get("groups", 1)
    spec.draft_kv_cache_group_ids = list(range(groups))
    spec.draft_kv_cache_group_id = 0
    spec._context_slot_mappings = torch.zeros(groups, MAX_TOKENS, dtype=torch.int64)
    spec._layer_group_idx = case.get("layer_group_idx")
    spec._group_causal = False
    spec.kv_cache_config = types.SimpleNamespace(
        kv_cache_groups=[
            types.SimpleNamespace(layer_names=[f"draft.{g}"]) for g in range(groups)
        ]
    )
    table = (torch.arange(len(BATCH) * 8).view(len(BATCH), 8) * 3 + 1).int()
    spec.block_tables = types.SimpleNamespace(
        slot_mappings=torch.zeros(groups, MAX_TOKENS, dtype=torch.int64),
        input_block_tables=[table + g for g in range(groups)],
        kernel_block_sizes=[BLOCK] * groups,
    )
    mode, num_reqs_padded = case.get("dispatch", (CUDAGraphMode.NONE, None))

    def dispatch(num_reqs, num_tokens, uniform, num_active_loras=0):
        log.append(("dispatch", num_reqs, num_tokens, uniform))
        padded = num_reqs_padded or num_reqs
        return BatchExecutionDescriptor(mode, padded * uniform, padded)

    spec.query_cudagraph_manager = types.SimpleNamespace(
        dispatch=dispatch,
        run_fullgraph=lambda desc: log.append(("run_fullgraph", desc)),
    )
    spec.eplb_state = types.SimpleNamespace(
        prepare_forward=lambda config, n: log.append(("eplb", n))
    )

    def attn_metadata(**kwargs):
        log.append(("attn_metadata", kwargs, spec.draft_max_seq_len))

    spec._build_draft_attn_metadata = attn_metadata
    generate = spec._generate_draft

    def logged_generate(*args, **kwargs):
        log.append(_snapshot(("generate_draft", args, kwargs)))
        return generate(*args, **kwargs)

    spec._generate_draft = logged_generate
    copy = spec._copy_request_inputs

    def logged_copy(*args):
        copies.append(_snapshot(args))
        log.append(("copy_request_inputs",))
        return copy(*args)

    spec._copy_request_inputs = logged_copy
    return spec


def _input_batch():
    """The fields of MRv2's InputBatch that DFlash's propose reads."""
    q_lens = np.array([q for _, q, _, _ in BATCH], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    positions = torch.cat([torch.arange(p0, p0 + q) for _, q, _, p0 in BATCH])
    seq_lens = torch.tensor([p0 + q for _, q, _, p0 in BATCH], dtype=torch.int32)
    return types.SimpleNamespace(
        num_reqs=len(BATCH),
        num_tokens=int(q_lens.sum()),
        num_scheduled_tokens=q_lens,
        idx_mapping=torch.tensor([s for s, *_ in BATCH], dtype=torch.int32),
        query_start_loc=torch.from_numpy(qsl),
        positions=positions,
        seq_lens_cpu_upper_bound=seq_lens,
    )


def _propose(spec, case):
    batch = _input_batch()
    gen = torch.Generator().manual_seed(0)
    hidden = spec.vllm_config.model_config.get_hidden_size()
    aux = [torch.randn(batch.num_tokens, hidden, generator=gen) for _ in range(3)]
    num_sampled = torch.tensor([1, 1, 0], dtype=torch.int32)
    num_rejected = torch.tensor([r for _, _, r, _ in BATCH], dtype=torch.int32)
    return spec.propose(
        batch,
        {},
        {},
        torch.randn(batch.num_tokens, hidden, generator=gen),
        None if case.get("no_aux") else aux,
        num_sampled,
        num_rejected,
        torch.arange(100, 100 + MAX_REQS)[:, None],
        torch.arange(200, 200 + MAX_REQS, dtype=torch.int32),
        torch.full((MAX_REQS,), 0.5),
        torch.arange(MAX_REQS),
        dummy_run=case.get("dummy_run", False),
        skip_attn_for_dummy_run=case.get("skip_attn", False),
        is_profile=case.get("is_profile", False),
    )


# What the speculator writes: the drafter's inputs, the context positions and
# slots, the sampling indices, the request inputs and the draft tokens.
STATE = (
    "hidden_states",
    "context_positions",
    "_context_slot_mappings",
    "sample_indices",
    "sample_pos",
    "sample_idx_mapping",
    "temperature",
    "seeds",
    "idx_mapping",
    "draft_tokens",
)
BUFFERS = ("input_ids", "positions", "query_start_loc", "seq_lens")

CASES = {
    "eager": {},
    "full_graph": {"dispatch": (CUDAGraphMode.FULL, 4)},
    "padded_eager": {"dispatch": (CUDAGraphMode.NONE, 4)},
    "dummy_run": {"dummy_run": True},
    "memory_profile": {"dummy_run": True, "skip_attn": True, "is_profile": True},
    "is_profile": {"is_profile": True},
    "two_kv_groups": {"groups": 2, "layer_group_idx": [0, 1], "no_aux": True},
}


def _snapshot(x):
    """``x`` with every tensor in it copied: what a call saw, whatever later
    writes to the buffers it was given views of."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_snapshot(y) for y in x)
    if isinstance(x, dict):
        return {k: _snapshot(v) for k, v in x.items()}
    return x


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b))
        )
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("name", CASES)
def test_stepwise_propose_does_what_propose_did(modules, vllm_config, name):
    case = CASES[name]
    runs = {}
    for module in modules:
        log, copies = [], []
        spec = _speculator(module.DFlashSpeculator, vllm_config, case, log, copies)
        drafts = _propose(spec, case)
        state = {k: getattr(spec, k).clone() for k in STATE}
        state.update({k: getattr(spec.input_buffers, k).clone() for k in BUFFERS})
        state["query_slots"] = spec.block_tables.slot_mappings.clone()
        state["draft_max_seq_len"] = spec.draft_max_seq_len
        runs[module] = drafts.clone(), log, copies, state
    (stock_drafts, stock_log, stock_copies, stock_state) = runs[modules[0]]
    (drafts, log, copies, state) = runs[modules[1]]
    assert _same(drafts, stock_drafts)
    assert [e[0] for e in log] == ["copy_request_inputs"] + [
        e[0] for e in stock_log if e[0] != "copy_request_inputs"
    ]
    # The request inputs are copied first now, from the same arguments.
    assert _same(copies, stock_copies)
    assert _same(log[1:], [e for e in stock_log if e[0] != "copy_request_inputs"])
    for key in stock_state:
        assert _same(state[key], stock_state[key]), key
    # The run did what the case is about.
    events = {e[0] for e in log}
    assert ("run_fullgraph" in events) == (name == "full_graph")
    assert ("dispatch" in events) != (name in ("memory_profile", "is_profile"))
    assert ("attn_metadata" in events) != (name == "memory_profile")
    written = [e[3] for e in log if e[0] == "context_kv"]
    assert len(written) == 1
    assert (written[0] is None) == case.get("dummy_run", False)
