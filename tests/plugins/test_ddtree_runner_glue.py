# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plugin's wrappers of vLLM 0.26's MRv2 model runner that make tree
verification the speculator's (CPU, stand-ins for the runner).

vLLM 0.26's runner has no speculator hooks for verification, so the glue does at
run time what the upstream series' patch 7 writes into ``GPUModelRunner``:
``load_model`` puts the speculator's tree sampler in the rejection-sampler
slot, ``add_requests`` resets a joining request's tree, and ``sample_tokens``
hands the step's sampler output (the walk) to ``propose``, for that call only.
The speculator side of these seams is tested without the plugin in
tests/v1/spec_decode/test_ddtree.py.
"""

import ast
import inspect
import textwrap
import types

import pytest

from vllm.v1.spec_decode.ddtree import DDTreeSpeculator
from vllm.v1.worker.gpu import model_runner
from vllm_ddtree import glue


@pytest.fixture(scope="module", autouse=True)
def _plugin():
    import vllm_ddtree

    vllm_ddtree.register()


class _Speculator(DDTreeSpeculator):
    """A DDTree speculator that records the runner's calls (no drafter)."""

    def __init__(self):
        self.calls = []

    def init_rejection_sampler(self, sampler, speculative_config, device):
        return ("tree sampler", sampler, speculative_config, device)

    def add_request(self, req_index, new_req_data):
        self.calls.append(("add_request", req_index, new_req_data.req_id))

    def propose(self, *args, sampler_output=None, **kwargs):
        self.calls.append(("propose", args, kwargs, sampler_output))
        return "drafts"


def test_the_runner_points_are_wrapped():
    runner_cls = model_runner.GPUModelRunner
    for name in ("load_model", "add_requests", "sample_tokens"):
        assert getattr(getattr(runner_cls, name), "__ddtree_patched__", False), name


# ---------------------------------------------------------------------------
# load_model: the speculator's tree sampler in the rejection-sampler slot.
# ---------------------------------------------------------------------------


def _runner_for_load(monkeypatch, speculator):
    """A GPUModelRunner object (its module names the structured-output worker
    the wrapper sizes) with only what ``load_model``'s wrapper reads."""
    monkeypatch.setattr(glue, "_ddtree_of", lambda vllm_config: object())
    runner = object.__new__(model_runner.GPUModelRunner)
    runner.vllm_config = types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=64)
    )
    runner.speculator = speculator
    runner.speculative_config = "spec config"
    runner.device = "cpu"
    return runner


def test_load_model_installs_the_speculators_tree_sampler(monkeypatch):
    speculator = _Speculator()
    runner = _runner_for_load(monkeypatch, speculator)

    def vllm_load_model(self):
        # vLLM 0.26 builds its chain rejection sampler for a speculative config.
        self.sampler = "sampler"
        self.rejection_sampler = "vLLM's RejectionSampler"
        self.prompt_logprobs_worker = None

    glue._load_model(vllm_load_model, runner)
    assert runner.rejection_sampler == ("tree sampler", "sampler", "spec config", "cpu")


def test_load_model_warms_the_adaptive_budget_before_the_profile_run(monkeypatch):
    """An adaptive budget compiles its kernels in ``load_model``, after vLLM
    loaded the models and built the sampler its warm-up reads, so that vLLM's
    profile run (next) finds every tree width compiled; a fixed budget has no
    such kernels."""
    speculator = _Speculator()
    order = []
    speculator.adaptive = types.SimpleNamespace(
        warm_up=lambda runner: order.append(("warm_up", runner.sampler))
    )
    runner = _runner_for_load(monkeypatch, speculator)

    def vllm_load_model(self):
        order.append(("vllm", None))
        self.sampler = "sampler"
        self.rejection_sampler = "vLLM's RejectionSampler"
        self.prompt_logprobs_worker = None

    glue._load_model(vllm_load_model, runner)
    assert order == [("vllm", None), ("warm_up", "sampler")]
    speculator.adaptive = None
    glue._load_model(vllm_load_model, runner)
    assert order[2:] == [("vllm", None)]


def test_load_model_leaves_a_runner_without_sampler(monkeypatch):
    """A runner that samples nothing (not the last pipeline rank) keeps
    whatever vLLM set."""
    runner = _runner_for_load(monkeypatch, _Speculator())

    def vllm_load_model(self):
        self.sampler = None
        self.rejection_sampler = None

    glue._load_model(vllm_load_model, runner)
    assert runner.rejection_sampler is None


# ---------------------------------------------------------------------------
# add_requests: each joining request's slot reset by the speculator.
# ---------------------------------------------------------------------------


def _scheduler_output(*req_ids):
    return types.SimpleNamespace(
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r) for r in req_ids]
    )


def test_add_requests_resets_each_joining_requests_slot():
    """After vLLM's own loop (which assigns the slots), the speculator's
    ``add_request`` runs for every new request with its slot."""
    speculator = _Speculator()
    runner = types.SimpleNamespace(
        speculator=speculator,
        req_states=types.SimpleNamespace(req_id_to_index={"old": 1}),
    )

    def vllm_add_requests(self, scheduler_output):
        for slot, new in zip((3, 0), scheduler_output.scheduled_new_reqs):
            self.req_states.req_id_to_index[new.req_id] = slot

    glue._add_requests(vllm_add_requests, runner, _scheduler_output("a", "b"))
    assert speculator.calls == [("add_request", 3, "a"), ("add_request", 0, "b")]
    glue._add_requests(vllm_add_requests, runner, _scheduler_output())
    assert len(speculator.calls) == 2


def test_add_requests_of_other_speculators_are_left_alone():
    seen = []
    other = types.SimpleNamespace(add_request=lambda *a: seen.append(a))
    runner = types.SimpleNamespace(speculator=other)
    glue._add_requests(
        lambda self, out: seen.append("vllm"), runner, _scheduler_output("a")
    )
    assert seen == ["vllm"]


# ---------------------------------------------------------------------------
# sample_tokens: the step's sampler output to propose, for that call only.
# ---------------------------------------------------------------------------


def _vllm_sample_tokens(self, grammar_output):
    """vLLM 0.26's ``sample_tokens`` as far as the wrapper relies on it: one
    ``self.sample`` call whose first result is the sampler output, then one
    ``self.speculator.propose`` call without it
    (test_vllm_sample_tokens_calls_as_the_wrapper_expects checks the real one)."""
    sampler_output, num_sampled, num_rejected = self.sample(
        "hidden", "batch", grammar_output
    )
    draft = self.speculator.propose(
        "batch",
        "metadata",
        "slots",
        "hidden",
        None,
        num_sampled,
        num_rejected,
        "last",
        "next",
        "temperature",
        "seeds",
        mm_inputs=None,
    )
    return ("async output", sampler_output, draft)


class _Runner:
    def __init__(self, speculator):
        self.speculator = speculator
        self.step = 0

    def sample(self, hidden_states, input_batch, grammar_output):
        self.step += 1
        return (f"walk {self.step}", "num_sampled", "num_rejected")


def test_sample_tokens_hands_the_walk_to_propose():
    speculator = _Speculator()
    runner = _Runner(speculator)
    for step in (1, 2):
        out = glue._sample_tokens(_vllm_sample_tokens, runner, None)
        assert out == ("async output", f"walk {step}", "drafts")
        (_, args, kwargs, sampler_output) = speculator.calls[-1]
        # Each step's own output, and vLLM's arguments unchanged.
        assert sampler_output == f"walk {step}"
        assert args[5:7] == ("num_sampled", "num_rejected")
        assert kwargs == {"mm_inputs": None}
        # Nothing of the call survives it.
        assert "sample" not in vars(runner) and "propose" not in vars(speculator)


def test_sample_tokens_restores_the_runner_when_the_step_fails():
    speculator = _Speculator()
    runner = _Runner(speculator)
    profiled = runner.sample  # e.g. a profiler's instance wrapper
    runner.sample = profiled

    def failing(self, grammar_output):
        self.sample("hidden", "batch", grammar_output)
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        glue._sample_tokens(failing, runner, None)
    assert vars(runner)["sample"] is profiled
    assert "propose" not in vars(speculator) and speculator.calls == []


def test_sample_tokens_of_other_speculators_are_left_alone():
    other = types.SimpleNamespace(propose=lambda *a, **k: "chain")
    runner = _Runner(other)
    assert glue._sample_tokens(_vllm_sample_tokens, runner, None)[2] == "chain"
    assert "sample" not in vars(runner)


def _vllm_tree(method) -> ast.AST:
    """The installed vLLM's source of a runner method the plugin wraps."""
    return ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(method))))


def _calls_in(tree: ast.AST, owner: str, name: str) -> list[ast.Call]:
    """Calls ``<owner>.<name>(...)`` (owner: ``self`` or ``self.<attr>``)."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == name
        and ast.unparse(node.func.value) == owner
    ]


def test_vllm_sample_tokens_calls_as_the_wrapper_expects():
    """The installed vLLM's ``sample_tokens`` (unwrapped) calls ``self.sample``
    once, the sampler output first in what it returns, and
    ``self.speculator.propose`` once with arguments that bind to
    ``DDTreeSpeculator.propose`` together with ``sampler_output``."""
    tree = _vllm_tree(model_runner.GPUModelRunner.sample_tokens)
    (sample,) = _calls_in(tree, "self", "sample")
    (assign,) = [
        n for n in ast.walk(tree) if isinstance(n, ast.Assign) and n.value is sample
    ]
    (target,) = assign.targets
    assert isinstance(target, ast.Tuple) and len(target.elts) == 3
    assert ast.unparse(target.elts[0]) == "sampler_output"
    (propose,) = _calls_in(tree, "self.speculator", "propose")
    keywords = {k.arg: None for k in propose.keywords}
    assert "sampler_output" not in keywords
    inspect.signature(DDTreeSpeculator.propose).bind(
        object(), *propose.args, **keywords, sampler_output=None
    )


def test_vllm_add_requests_knows_the_slot_before_the_wrapper_runs():
    """vLLM's ``add_requests`` puts each new request in
    ``req_states.req_id_to_index`` (the slot the wrapper reads afterwards)."""
    source = inspect.getsource(inspect.unwrap(model_runner.GPUModelRunner.add_requests))
    assert "self.req_states.add_request(" in source
    assert "req_index = self.req_states.req_id_to_index[req_id]" in source


# ---------------------------------------------------------------------------
# initialize_kv_cache: TREE_ATTN warmed once the KV caches exist.
# ---------------------------------------------------------------------------


def test_kv_cache_init_warms_tree_attention_in_every_graph_mode():
    """The glue's ``GPUModelRunner.initialize_kv_cache`` wrapper: after vLLM's
    own KV-cache set-up, a DDTree model state warms TREE_ATTN with the runner's
    block tables and attention groups (eager engines and cudagraph_mode NONE
    included: no capture is needed); another model state is left alone."""
    runner_cls = model_runner.GPUModelRunner
    assert getattr(runner_cls.initialize_kv_cache, "__ddtree_patched__", False)
    order = []

    def fake_original(self, kv_cache_config):
        order.append(("vllm", kv_cache_config))

    calls = []
    warmed = types.SimpleNamespace(
        warm_up_tree_attention=lambda tables, groups: calls.append((tables, groups))
    )
    runner = types.SimpleNamespace(
        model_state=warmed, block_tables="tables", attn_groups="groups"
    )
    glue._initialize_kv_cache(fake_original, runner, "config")
    assert order == [("vllm", "config")] and calls == [("tables", "groups")]
    runner.model_state = types.SimpleNamespace()  # not DDTree's
    glue._initialize_kv_cache(fake_original, runner, "config")
    assert calls == [("tables", "groups")] and len(order) == 2
