# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plugin's wrappers, called directly on stand-ins (CPU): registering
twice wraps once, the scheduler's lookahead, the runner's speculator and
model-state choice, the worker's budget report and block-table cut, and the
prompt-logprob trim hooked onto the runner's worker. The module functions they
call are tested without the plugin (tests/v1/spec_decode/test_ddtree_slots.py,
tests/v1/worker/test_gpu_prompt_logprobs_padded_join.py)."""

import ast
import inspect
import textwrap
import types

import numpy as np
import pytest

import vllm_ddtree
from tests.v1.spec_decode.test_ddtree_slots import _Uva
from tests.v1.worker.test_gpu_prompt_logprobs_padded_join import (
    PROMPTS,
    Engine,
    assert_no_speculation,
    join_step,
    rows_of,
)
from vllm.v1.spec_decode.ddtree_config import DDTreeConfig
from vllm_ddtree import glue

CFG = DDTreeConfig(tree_budget=128, draft_depth=15)


@pytest.fixture(scope="module", autouse=True)
def registered():
    vllm_ddtree.register()


def test_register_is_idempotent():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from vllm.v1.worker.gpu import model_runner

    def wrapped():
        return [
            EngineArgs.create_speculative_config,
            EngineArgs.create_engine_config,
            Scheduler.__init__,
            model_runner.init_speculator,
            model_runner.init_model_state,
            model_runner.GPUModelRunner.__init__,
            PrometheusStatLogger.__init__,
        ]

    before = wrapped()
    assert all(getattr(f, "__ddtree_patched__", False) for f in before)
    vllm_ddtree.register()
    vllm_ddtree.register()
    after = wrapped()
    assert before == after
    # One layer of wrapping, around vLLM's own function.
    original = EngineArgs.create_speculative_config.__wrapped__
    assert not hasattr(original, "__wrapped__")


def test_plugin_stands_aside_where_vllm_has_ddtree(monkeypatch):
    """On a vLLM that takes method "ddtree" itself (the series applied) the
    wrappers are not installed: they would hand that vLLM a DFlash config and
    the plugin's key, which its reader ignores. Elsewhere they are."""

    def engine_args_module():
        class EngineArgs:
            @staticmethod
            def add_cli_args(parser):
                return parser

            def create_speculative_config(self, *args):
                return "vllm's"

            def _set_default_max_num_seqs_and_batched_tokens_args(self, *args):
                return None

            def create_engine_config(self, *args):
                return None

        return types.SimpleNamespace(EngineArgs=EngineArgs)

    patch = glue._unless_vllm_has_ddtree(glue._PATCHES["vllm.engine.arg_utils"])
    original = engine_args_module()
    method = original.EngineArgs.create_speculative_config
    monkeypatch.setattr(glue, "_vllm_has_ddtree_method", lambda: True)
    patch(original)
    assert original.EngineArgs.create_speculative_config is method
    stock = engine_args_module()
    method = stock.EngineArgs.create_speculative_config
    monkeypatch.setattr(glue, "_vllm_has_ddtree_method", lambda: False)
    patch(stock)
    assert stock.EngineArgs.create_speculative_config is not method
    assert getattr(stock.EngineArgs.create_speculative_config, glue._PATCHED)
    # The plugin's check agrees with the package's on this (stock) vLLM.
    from vllm.v1.spec_decode.ddtree_config import vllm_has_ddtree_method

    assert glue._vllm_has_ddtree_method() is vllm_has_ddtree_method() is False
    # apply() installs every wrapper through this guard.
    assert "_unless_vllm_has_ddtree(patch)" in inspect.getsource(glue.apply)


def test_dflash_gets_the_steps_it_lacks():
    """Stock DFlash gains the steps of ``propose`` that DDTree runs: the
    series' first patch's code (``glue._DFlashSteps``), run with the globals of
    DFlash's module; its own ``propose``, which never calls them, stays vLLM's.
    A class that has a step keeps its own."""
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash

    cls = dflash.DFlashSpeculator
    steps = {"_store_context_kv", "_run_drafter"}
    assert {n for n, f in vars(glue._DFlashSteps).items() if callable(f)} == steps
    for name in steps:
        step = vars(cls)[name]
        assert getattr(step, "__ddtree_patched__", False), name
        assert step.__code__ is vars(glue._DFlashSteps)[name].__code__
        assert step.__globals__ is vars(dflash)
    assert not getattr(cls.propose, "__ddtree_patched__", False)
    calls = {
        node.func.attr
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls.propose))))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    assert not calls & steps
    before = {name: vars(cls)[name] for name in steps}
    vllm_ddtree.register()
    assert {name: vars(cls)[name] for name in steps} == before

    class WithSteps:
        def _run_drafter(self):
            pass

    own = WithSteps._run_drafter
    glue._add_missing_methods(WithSteps, glue._DFlashSteps, dflash)
    assert WithSteps._run_drafter is own
    assert WithSteps._store_context_kv.__globals__ is vars(dflash)


def _ddtree_vllm_config():
    return types.SimpleNamespace(
        additional_config={"vllm_ddtree": CFG.to_dict()},
        speculative_config=types.SimpleNamespace(
            method="dflash", num_speculative_tokens=CFG.tree_budget
        ),
    )


def test_scheduler_lookahead_is_the_drafter_block():
    def original(self, *args, **kwargs):
        self.vllm_config = kwargs["vllm_config"]
        self.num_lookahead_tokens = 129  # DFlash's num_speculative_tokens + 1
        self.structured_output_manager = types.SimpleNamespace(
            grammar_bitmask=lambda *a: None
        )
        self.max_num_running_reqs = 4

    sched = types.SimpleNamespace()
    glue._scheduler_init(original, sched, vllm_config=_ddtree_vllm_config())
    assert sched.num_lookahead_tokens == 16


def test_runner_hooks_dispatch_on_config():
    plain = types.SimpleNamespace(additional_config={}, speculative_config=object())
    assert glue._init_speculator(lambda c, d: "dflash", plain, "cpu") == "dflash"
    assert glue._init_model_state(lambda *a: "default", plain, None, None, "cpu") == (
        "default"
    )
    with pytest.raises(ValueError, match="DefaultModelState"):
        glue._init_model_state(
            lambda *a: types.SimpleNamespace(),
            _ddtree_vllm_config(),
            torch_module(),
            None,
            "cpu",
        )


def torch_module():
    import torch

    return torch.nn.Linear(1, 1)


def test_glue_reports_the_budget_and_cuts_rows_before_the_step():
    """The worker's two glue points: the step's output carries the budget
    report, and the scheduler's cut rows are cut before vLLM's step runs."""
    report = ("budget", 4, 3)
    adaptive = types.SimpleNamespace(report=lambda: report)
    seen = []

    def plan(out):
        seen.append(("plan", out))
        return out

    adaptive.plan = plan
    num_blocks = _Uva(np.array([[9, 9]], dtype=np.int32))
    runner = types.SimpleNamespace(
        speculator=types.SimpleNamespace(adaptive=adaptive),
        block_tables=types.SimpleNamespace(
            num_blocks=num_blocks, blocks_per_kv_block=[1]
        ),
        req_states=types.SimpleNamespace(req_id_to_index={"a": 1}),
    )
    output = types.SimpleNamespace(model_runner_output=types.SimpleNamespace())
    assert glue._sample_tokens(lambda self: output, runner) is output
    assert output.model_runner_output.ddtree_budget == report
    # No output object (a failed step): nothing to attach, nothing raised.
    assert glue._sample_tokens(lambda self: None, runner) is None

    scheduler_output = types.SimpleNamespace(ddtree_kept_blocks={"a": (5,)})

    def step(self, out):
        seen.append(("step", num_blocks.np.tolist()))
        return "ran"

    assert glue._execute_model(step, runner, scheduler_output) == "ran"
    assert seen == [("plan", scheduler_output), ("step", [[9, 5]])]


def _runner_of(engine, vllm_config=None):
    return types.SimpleNamespace(
        vllm_config=vllm_config,
        prompt_logprobs_worker=engine.worker,
        req_states=types.SimpleNamespace(
            prompt_len=types.SimpleNamespace(np=engine.prompt_lens)
        ),
    )


@pytest.mark.parametrize("num_spec_tokens", [3, 15])
def test_plugin_trims_a_padded_join_on_vllm_0_26(num_spec_tokens):
    """On vLLM 0.26.0, whose worker returns a padded join's placeholder rows,
    the plugin's hook (DDTree runners, after load_model) makes the runner's own
    worker give the prompt logprobs of no speculation."""
    engine = Engine(PROMPTS)
    glue._trim_prompt_logprobs_of(_runner_of(engine))
    out = join_step(engine, num_spec_tokens, padded=True)
    assert_no_speculation(out, num_spec_tokens)
    # A step without placeholders keeps its rows.
    engine = Engine({"p": [1, 2, 3, 4, 5]})
    glue._trim_prompt_logprobs_of(_runner_of(engine))
    assert len(rows_of(engine.step([("p", 0, 5, 5)])["p"])) == 4


def test_plugin_trims_the_runners_worker_once():
    """Hooking again changes nothing; a one-token prompt's padded join has no
    prompt logprobs left."""
    engine = Engine({"running": [5] * 10, "one": [7]})
    runner = _runner_of(engine)
    glue._trim_prompt_logprobs_of(runner)
    wrapped = engine.worker.compute_prompt_logprobs
    glue._trim_prompt_logprobs_of(runner)
    assert engine.worker.compute_prompt_logprobs is wrapped
    out = engine.step([("running", 9, 4, 10), ("one", 0, 4, 1)])
    assert out == {}


def test_plugin_leaves_a_worker_that_counts_prompt_tokens(monkeypatch):
    """Where vLLM's worker counts the prompt tokens itself (the series' fix),
    the plugin adds no trim, which would drop real rows."""
    from vllm.v1.worker.gpu.sample import prompt_logprob, prompt_logprob_rows

    monkeypatch.setattr(
        prompt_logprob,
        "num_prompt_tokens_scheduled",
        prompt_logprob_rows.num_prompt_tokens_scheduled,
        raising=False,
    )
    engine = Engine(PROMPTS)
    compute = engine.worker.compute_prompt_logprobs
    glue._trim_prompt_logprobs_of(_runner_of(engine))
    assert engine.worker.compute_prompt_logprobs == compute


def test_dflash_runner_keeps_vllms_prompt_logprobs():
    """A DFlash (or EAGLE) engine's runner is not hooked: on vLLM 0.26.0 its
    padded joins keep the placeholders' rows, as without the plugin."""
    plain = types.SimpleNamespace(additional_config={}, speculative_config=object())
    engine = Engine(PROMPTS)
    compute = engine.worker.compute_prompt_logprobs
    assert glue._load_model(lambda self: "loaded", _runner_of(engine, plain)) == (
        "loaded"
    )
    assert engine.worker.compute_prompt_logprobs == compute
    out = join_step(engine, 3, padded=True)
    assert len(rows_of(out["chunked"])) == 3 + 3
