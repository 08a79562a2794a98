# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The series' edits to vLLM's own files, checked in a patched vLLM 0.26.0 with
the DDTree plugin disabled (CPU).

Not collected by the overlay's own test run (the name does not start with
``test_``): ``tests/upstream/test_series.py`` copies it into a patched copy of
vLLM and runs it there. Every check here would fail on stock vLLM (method
"ddtree" is unknown there) and none goes through ``vllm_ddtree``.
"""

import sys
import types
from pathlib import Path

import pytest
import torch

from tests.models.tiny_models import make_tiny_dflash, make_tiny_qwen3

TREE_ATTN_PATH = "vllm.v1.attention.backends.tree_attn.TreeAttentionBackend"


@pytest.fixture(autouse=True)
def no_plugin():
    """Whatever a test does, the overlay's plugin never loads."""
    yield
    assert "vllm_ddtree" not in sys.modules


def test_runs_against_the_patched_tree():
    import vllm
    from vllm.v1.spec_decode import ddtree_config

    here = Path(__file__).resolve().parents[2]
    for module in (vllm, ddtree_config):
        assert Path(module.__file__).resolve().is_relative_to(here), module.__file__


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("applied_models")
    target = make_tiny_qwen3(root / "target")
    drafter = make_tiny_dflash(root / "drafter", target)
    return str(target), str(drafter)


@pytest.fixture(autouse=True)
def cuda_platform(monkeypatch):
    """EngineArgs asks the platform for a device type; a CPU-only box has none."""
    from vllm.platforms import current_platform

    if current_platform.device_type == "":
        monkeypatch.setattr(
            type(current_platform), "device_type", "cuda", raising=False
        )


def _engine_config(models, budget=128, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    target, drafter = models
    spec = {
        "method": "ddtree",
        "model": drafter,
        "tree_budget": budget,
        "adaptive_budget": False,
    }
    args = EngineArgs(
        model=target, speculative_config=spec, max_model_len=2048, **kwargs
    )
    return args, args.create_engine_config()


def test_engine_config_maps_ddtree_onto_dflash(models):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm.v1.spec_decode.ddtree_config import DDTreeConfig

    args, config = _engine_config(models, max_num_batched_tokens=4096)
    spec = config.speculative_config
    assert spec.method == "dflash"
    assert spec.num_speculative_tokens == 128
    assert DDTreeConfig.from_vllm_config(config) == DDTreeConfig(128, 15)
    assert config.attention_config.backend == AttentionBackendEnum.CUSTOM
    assert AttentionBackendEnum.CUSTOM.get_path() == TREE_ATTN_PATH
    # The drafter picks its own (non-causal) backend.
    assert spec.attention_backend is None
    # No DFlash slot reservation cuts DDTree's step budget.
    assert spec.max_num_new_slots_for_drafting == 0
    sched = config.scheduler_config
    assert sched.max_num_scheduled_tokens == sched.max_num_batched_tokens == 4096
    assert sched.max_num_seqs == 4096 // 129
    # The user's dict is left as given; a second build gives the same config.
    assert args.speculative_config["method"] == "ddtree"
    again = args.create_engine_config()
    assert again.scheduler_config.max_num_seqs == sched.max_num_seqs
    assert DDTreeConfig.from_vllm_config(again) == DDTreeConfig(128, 15)


def test_capture_sizes_in_multiples_of_the_tree(models, monkeypatch):
    from vllm.platforms import current_platform

    # vLLM's own capture-size step, which a CPU-only platform skips.
    monkeypatch.setattr(
        type(current_platform),
        "support_static_graph_mode",
        classmethod(lambda cls: True),
        raising=False,
    )
    _, config = _engine_config(models, max_num_batched_tokens=4096)
    sizes = config.compilation_config.cudagraph_capture_sizes
    assert {129, 258} <= set(sizes)
    assert sizes[-1] == 512


def test_spec_flags(models):
    from vllm.engine.arg_utils import EngineArgs

    target, drafter = models
    args = EngineArgs(
        model=target,
        spec_method="ddtree",
        spec_model=drafter,
        speculative_config={"tree_budget": 32, "adaptive_budget": False},
        max_model_len=2048,
    )
    config = args.create_engine_config()
    assert config.speculative_config.num_speculative_tokens == 32
    with pytest.raises(ValueError, match="drop --spec-tokens"):
        EngineArgs(
            model=target, spec_method="ddtree", spec_model=drafter, spec_tokens=4
        ).create_engine_config()


@pytest.mark.parametrize(
    "spec, match",
    [
        # The adaptive budget's hooks are not in the series yet.
        ({}, "adaptive budget is not supported yet"),
        ({"tree_budget": 0, "adaptive_budget": False}, r"in \[1, 1024\], got 0"),
        ({"tree_budget": 2048, "adaptive_budget": False}, r"got 2048"),
        (
            {"tree_budget": 8, "adaptive_budget": False, "bogus": 1},
            "method 'ddtree' does not take 'bogus'",
        ),
    ],
)
def test_engine_config_errors(models, spec, match):
    from vllm.engine.arg_utils import EngineArgs

    target, drafter = models
    spec = {"method": "ddtree", "model": drafter, **spec}
    with pytest.raises(ValueError, match=match):
        EngineArgs(
            model=target, speculative_config=spec, max_model_len=2048
        ).create_engine_config()


def test_engine_config_refuses_a_non_dflash_drafter(models):
    from vllm.engine.arg_utils import EngineArgs

    target, _ = models
    spec = {
        "method": "ddtree",
        "model": target,
        "tree_budget": 8,
        "adaptive_budget": False,
    }
    with pytest.raises(
        ValueError,
        match="method 'ddtree' (could not load|drafts with a DFlash drafter)",
    ):
        EngineArgs(
            model=target, speculative_config=spec, max_model_len=2048
        ).create_engine_config()


def test_plain_dflash_is_untouched(models):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm.v1.spec_decode.ddtree_config import DDTreeConfig

    target, drafter = models
    spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": 15}
    config = EngineArgs(
        model=target, speculative_config=spec, max_model_len=2048
    ).create_engine_config()
    assert DDTreeConfig.from_vllm_config(config) is None
    assert config.attention_config.backend != AttentionBackendEnum.CUSTOM
    assert config.speculative_config.max_num_new_slots_for_drafting == 14
    assert _scheduler(config).num_lookahead_tokens == 16


def _scheduler(vllm_config, log_stats=False):
    """vLLM's Scheduler over a one-group KV cache stand-in (no GPU)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
    )
    kv = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    vllm_config.cache_config.num_gpu_blocks = 64
    return Scheduler(
        vllm_config,
        kv,
        StructuredOutputManager(vllm_config),
        block_size=16,
        log_stats=log_stats,
    )


def test_scheduler_lookahead_is_the_drafter_block(models):
    # Budget 4: DFlash's rule (num_speculative_tokens + 1) would give 5.
    _, config = _engine_config(models, budget=4)
    sched = _scheduler(config)
    assert sched.num_lookahead_tokens == 16
    assert sched.ddtree_draft_depth == 15


def test_scheduler_stats_are_per_depth(models):
    _, config = _engine_config(models, budget=64)
    sched = _scheduler(config, log_stats=True)
    stats = sched.make_spec_decoding_stats(None, 64, 3, None, "r")
    assert len(stats.num_accepted_tokens_per_pos) == 15
    assert stats.num_accepted_tokens_per_pos[:4] == [1, 1, 1, 0]
    assert stats.num_draft_tokens == 64


def _request(req_id, params):
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request

    return Request.from_engine_core_request(
        EngineCoreRequest(
            request_id=req_id,
            prompt_token_ids=[1, 2, 3],
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        ),
        block_hasher=None,
    )


def test_structured_output_requests_get_no_drafts(models):
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    _, config = _engine_config(models, budget=8)
    sched = _scheduler(config)
    grammar = _request(
        "g",
        SamplingParams(
            max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[ab]+")
        ),
    )
    plain = _request("p", SamplingParams(max_tokens=8))
    sched.add_request(grammar)
    sched.add_request(plain)
    assert sched.ddtree_grammar_reqs == {"g"}
    grammar.spec_token_ids = [5, 6]
    plain.spec_token_ids = [5, 6]
    sched._drop_ddtree_grammar_drafts()
    assert grammar.spec_token_ids == []
    assert plain.spec_token_ids == [5, 6]


def test_prometheus_counters_per_depth(models):
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    _, config = _engine_config(models, budget=64)
    seen = []

    class Recording(PrometheusStatLogger):
        def _spec_decoding_cls(self, spec, *args, **kwargs):
            seen.append(spec.num_speculative_tokens)
            return types.SimpleNamespace()

    unregister_vllm_metrics()
    try:
        Recording(config, engine_indexes=[0])
    finally:
        unregister_vllm_metrics()
    assert seen == [15]
    # The engine's own config keeps the tree's draft slots.
    assert config.speculative_config.num_speculative_tokens == 64


def test_runner_picks_ddtree_speculator_and_model_state(models, monkeypatch):
    from vllm.v1.worker.gpu import model_states, spec_decode

    from vllm.v1.spec_decode import ddtree, ddtree_verify

    _, config = _engine_config(models, budget=8)
    made = []

    def recorder(name):
        return lambda *args: made.append((name, args)) or name

    monkeypatch.setattr(ddtree, "DDTreeSpeculator", recorder("speculator"))
    monkeypatch.setattr(ddtree_verify, "DDTreeModelState", recorder("state"))
    assert spec_decode.init_speculator(config, "cpu") == "speculator"
    model = torch.nn.Linear(2, 2)
    assert model_states.init_model_state(config, model, None, "cpu") == "state"
    assert [m[0] for m in made] == ["speculator", "state"]
    assert made[1][1][1] is model
