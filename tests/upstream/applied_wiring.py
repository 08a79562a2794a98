# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The series' edits to vLLM's own files, checked in a patched vLLM 0.26.0 with
the DDTree plugin disabled (CPU).

Not collected by the overlay's own test run (the name does not start with
``test_``): ``tests/upstream/test_series.py`` copies it into a patched copy of
vLLM and runs it there. Every check here would fail on stock vLLM (method
"ddtree" is unknown there) and none goes through ``vllm_ddtree``.
"""

import ast
import inspect
import itertools
import json
import pickle
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.models.tiny_models import make_tiny_dflash, make_tiny_qwen3
from tests.v1.core.test_ddtree_scheduler import _grammar_bitmask_rows

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


def _dflash_engine_config(models, num_speculative_tokens, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    target, drafter = models
    spec = {
        "method": "dflash",
        "model": drafter,
        "num_speculative_tokens": num_speculative_tokens,
    }
    return EngineArgs(
        model=target, speculative_config=spec, max_model_len=2048, **kwargs
    ).create_engine_config()


def test_engine_config_is_a_ddtree_speculative_config(models):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm.v1.spec_decode.ddtree_config import ADDITIONAL_CONFIG_KEY, DDTreeConfig

    args, config = _engine_config(models, max_num_batched_tokens=4096)
    spec = config.speculative_config
    assert spec.method == "ddtree"
    assert (spec.tree_budget, spec.adaptive_budget) == (128, False)
    assert spec.tree_budget_per_batch_size is None
    assert spec.num_speculative_tokens == 128
    assert spec.num_speculative_tokens_per_batch_size is None
    # The settings live in the speculative config, not in additional_config.
    assert ADDITIONAL_CONFIG_KEY not in config.additional_config
    assert DDTreeConfig.from_vllm_config(config) == DDTreeConfig(128, 15)
    # DFlash's drafter and its branches (hidden states, async scheduling,
    # Model Runner V2).
    assert spec.use_dflash() and spec.use_eagle()
    assert spec.draft_model_config.architecture.startswith("DFlash")
    assert config.scheduler_config.async_scheduling
    assert config.use_v2_model_runner
    assert config.attention_config.backend == AttentionBackendEnum.TREE_ATTN
    assert AttentionBackendEnum.TREE_ATTN.get_path() == TREE_ATTN_PATH
    # The drafter picks its own (non-causal) backend.
    assert spec.attention_backend is None
    # The drafter drafts its block in parallel, in its own batch: no step slots
    # reserved for it in the target's.
    assert spec.parallel_drafting
    assert spec.max_num_new_slots_for_drafting == 0
    sched = config.scheduler_config
    assert sched.max_num_scheduled_tokens == sched.max_num_batched_tokens == 4096
    assert sched.max_num_seqs == 4096 // 129
    # The user's dict is left as given; a second build gives the same config.
    assert args.speculative_config["method"] == "ddtree"
    again = args.create_engine_config()
    assert again.scheduler_config.max_num_seqs == sched.max_num_seqs
    assert DDTreeConfig.from_vllm_config(again) == DDTreeConfig(128, 15)
    # Spawned engine cores and workers unpickle the config before any plugin
    # could load.
    assert DDTreeConfig.from_vllm_config(pickle.loads(pickle.dumps(config))) == (
        DDTreeConfig(128, 15)
    )


def test_serve_cli_builds_a_ddtree_config(models):
    """`vllm serve --speculative-config '{"method": "ddtree", ...}'`, parsed as
    the CLI parses it."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm.v1.spec_decode.ddtree_config import ADDITIONAL_CONFIG_KEY, DDTreeConfig

    target, drafter = models
    spec = {
        "method": "ddtree",
        "model": drafter,
        "tree_budget_per_batch_size": [[1, 4, 63], [5, 64, 15]],
        "adaptive_budget": False,
    }
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    cli = ["--model", target, "--max-model-len", "2048"]
    args = parser.parse_args([*cli, "--speculative-config", json.dumps(spec)])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    spec = config.speculative_config
    assert spec.method == "ddtree"
    assert spec.tree_budget == spec.num_speculative_tokens == 63
    assert spec.tree_budget_per_batch_size == [(1, 4, 63), (5, 64, 15)]
    assert spec.num_speculative_tokens_per_batch_size == [[1, 4, 63], [5, 64, 15]]
    assert ADDITIONAL_CONFIG_KEY not in config.additional_config
    assert DDTreeConfig.from_vllm_config(config) == DDTreeConfig(63, 15, (15,))
    # --spec-method takes the method among SpeculativeMethod's choices.
    flags = ["--spec-method", "ddtree", "--spec-model", drafter]
    settings = json.dumps({"tree_budget": 8, "adaptive_budget": False})
    args = parser.parse_args([*cli, *flags, "--speculative-config", settings])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.speculative_config.method == "ddtree"
    assert DDTreeConfig.from_vllm_config(config) == DDTreeConfig(8, 15)


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


def test_tree_attn_is_its_own_backend():
    """The registry lists TREE_ATTN, and the name the backend gives the
    attention layer maps back to that member, with no registration."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm.v1.attention.backends.tree_attn import (
        TREE_ATTN_NAME,
        TreeAttentionBackend,
    )

    assert TREE_ATTN_NAME == "TREE_ATTN"
    member = AttentionBackendEnum[TreeAttentionBackend.get_name()]
    assert member is AttentionBackendEnum.TREE_ATTN
    assert not member.is_overridden()
    assert member.get_class() is TreeAttentionBackend


def test_ddtree_engine_leaves_custom_alone(models):
    """A DDTree engine verifies with TREE_ATTN and leaves the CUSTOM slot as
    it was: another backend registered there stays (no DDTree error)."""
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    custom = AttentionBackendEnum.CUSTOM
    custom.clear_override()
    _, config = _engine_config(models, budget=8)
    assert config.attention_config.backend == AttentionBackendEnum.TREE_ATTN
    assert not custom.is_overridden()
    register_backend(custom, "some.other.Backend")
    try:
        _, config = _engine_config(models, budget=8)
        assert config.attention_config.backend == AttentionBackendEnum.TREE_ATTN
        assert custom.get_path() == "some.other.Backend"
    finally:
        custom.clear_override()


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
    assert config.speculative_config.method == "ddtree"
    assert config.speculative_config.num_speculative_tokens == 32
    with pytest.raises(ValueError, match="remove 'num_speculative_tokens'"):
        EngineArgs(
            model=target, spec_method="ddtree", spec_model=drafter, spec_tokens=4
        ).create_engine_config()


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"tree_budget": 0, "adaptive_budget": False}, r"in \[1, 1024\], got 0"),
        ({"tree_budget": 2048, "adaptive_budget": False}, r"in \[1, 1024\], got 2048"),
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


def test_engine_config_names_an_unknown_key(models):
    """SpeculativeConfig knows DDTree's keys: only the unknown one is named."""
    from pydantic import ValidationError
    from vllm.engine.arg_utils import EngineArgs

    target, drafter = models
    spec = {
        "method": "ddtree",
        "model": drafter,
        "tree_budget": 8,
        "adaptive_budget": False,
        "bogus": 1,
    }
    with pytest.raises(ValidationError) as info:
        EngineArgs(
            model=target, speculative_config=spec, max_model_len=2048
        ).create_engine_config()
    assert {e["loc"][0] for e in info.value.errors()} == {"bogus"}


def test_engine_config_refuses_a_non_dflash_drafter(models):
    from vllm.engine.arg_utils import EngineArgs

    target, _ = models
    spec = {
        "method": "ddtree",
        "model": target,
        "tree_budget": 8,
        "adaptive_budget": False,
    }
    # vLLM loads a DFlash drafter as DFlash<architecture>, which a target is not.
    with pytest.raises(
        ValueError,
        match=r"architectures \['DFlashQwen3ForCausalLM'\] are not supported"
        "|drafts with a DFlash drafter",
    ):
        EngineArgs(
            model=target, speculative_config=spec, max_model_len=2048
        ).create_engine_config()


def _speculative_config(models, max_model_len=4096, **fields):
    from vllm.config import ParallelConfig, SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    target, drafter = models
    fields.setdefault("model", drafter)
    return SpeculativeConfig(
        method="ddtree",
        # 4096 fits the warm-up of the largest tree (ddtree_config.
        # max_warmup_budget): no default below is cut by it.
        target_model_config=EngineArgs(
            model=target, max_model_len=max_model_len
        ).create_model_config(),
        target_parallel_config=ParallelConfig(),
        **fields,
    )


def test_speculative_config_fits_the_start_up_warm_up(models):
    """SpeculativeConfig(method="ddtree") bounds the tree budget by its target:
    vLLM's warm-up runs a B + 2 token prompt, then a B + 1 token step, so at
    max_model_len 200 "auto" caps trees at 98 nodes (and every process
    reading the config back gets 98), and at 2048 an explicit 1024 is
    refused, naming the length it needs."""
    from vllm.v1.spec_decode.ddtree_config import DDTreeConfig

    spec = _speculative_config(models, max_model_len=200)
    assert (spec.tree_budget, spec.num_speculative_tokens) == (98, 98)
    listed = [b for *_, b in spec.num_speculative_tokens_per_batch_size]
    assert listed == [98, 63, 31, 15, 7, 3, 1, 0]
    assert DDTreeConfig.from_speculative_config(spec).tree_budget == 98
    assert _speculative_config(models, max_model_len=259).tree_budget == 128
    with pytest.raises(ValueError, match=r"needs --max-model-len >= 2051 "):
        _speculative_config(models, max_model_len=2048, tree_budget=1024)
    with pytest.raises(ValueError, match=r"to at most 1022\b"):
        _speculative_config(
            models,
            max_model_len=2048,
            tree_budget_per_batch_size=[[1, 4, 1023], [5, 64, 15]],
            adaptive_budget=False,
        )
    spec = _speculative_config(models, max_model_len=2048, tree_budget=1022)
    assert spec.num_speculative_tokens == 1022


def test_speculative_config_takes_ddtree(models):
    """SpeculativeConfig(method="ddtree") checks and expands its tree settings
    with DDTree's parser and sets the draft slots from them."""
    from vllm.v1.spec_decode.ddtree_config import (
        AUTO_TREE_BUDGET_PER_BATCH_SIZE,
        DDTreeConfig,
    )

    spec = _speculative_config(models, tree_budget=64, adaptive_budget=False)
    assert (spec.tree_budget, spec.num_speculative_tokens) == (64, 64)
    assert spec.num_speculative_tokens_per_batch_size is None
    assert DDTreeConfig.from_speculative_config(spec) == DDTreeConfig(64, 15)
    # The default: an adaptive budget capped at 128 nodes, with vLLM's
    # schedule listing every budget a step may verify (one graph set each).
    spec = _speculative_config(models)
    assert (spec.tree_budget, spec.adaptive_budget) == (128, True)
    listed = [b for *_, b in spec.num_speculative_tokens_per_batch_size]
    assert listed == [128, 127, 63, 31, 15, 7, 3, 1, 0]
    # "auto" with fixed budgets: the measured schedule.
    spec = _speculative_config(models, tree_budget="auto", adaptive_budget=False)
    auto = [tuple(r) for r in AUTO_TREE_BUDGET_PER_BATCH_SIZE]
    assert spec.tree_budget_per_batch_size == auto
    assert spec.tree_budget == max(b for *_, b in auto)
    assert [tuple(r) for r in spec.num_speculative_tokens_per_batch_size] == auto


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"tree_budget": 0}, r"tree_budget must be in \[1, 1024\], got 0"),
        ({"tree_budget": 1025}, r"tree_budget must be in \[1, 1024\], got 1025"),
        (
            {"tree_budget_per_batch_size": [[2, 8, 16]]},
            "tree_budget_per_batch_size: The first batch-size range must start at 1",
        ),
        (
            {"tree_budget": 128, "tree_budget_per_batch_size": [[1, 8, 64]]},
            (
                r"tree_budget=128 must equal the largest budget of "
                r"tree_budget_per_batch_size \(64\)"
            ),
        ),
        (
            {"tree_budget": "auto", "tree_budget_per_batch_size": [[1, 8, 64]]},
            "tree_budget='auto' picks the budget itself",
        ),
        (
            {"num_speculative_tokens": 15},
            "method 'ddtree' sizes its trees with 'tree_budget'",
        ),
        ({"model": None}, "method 'ddtree' needs 'model'"),
        (
            {"tree_budget_per_batch_size": [[i, i, 1000 - i] for i in range(1, 8)]},
            "adaptive_budget.*at most 16",
        ),
    ],
)
def test_speculative_config_ddtree_errors(models, fields, match):
    with pytest.raises(ValueError, match=match):
        _speculative_config(models, **fields)


def test_tree_settings_belong_to_ddtree(models):
    from vllm.config import ParallelConfig, SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    target, drafter = models
    with pytest.raises(ValueError, match="settings of method 'ddtree', not of"):
        SpeculativeConfig(
            method="dflash",
            model=drafter,
            num_speculative_tokens=15,
            tree_budget=8,
            target_model_config=EngineArgs(
                model=target, max_model_len=2048
            ).create_model_config(),
            target_parallel_config=ParallelConfig(),
        )


# Values pydantic's lax mode would coerce into a field's type (true -> 1,
# "12" -> 12, 1 -> True); DDTree's parser refuses each, naming the first key.
COERCIBLE_TREE_SETTINGS = [
    {"tree_budget": True},
    {"tree_budget": "12"},
    {"tree_budget": 12.0},
    {"tree_budget": True, "tree_budget_per_batch_size": [[1, 4, 1]]},
    {"adaptive_budget": "yes"},
    {"adaptive_budget": 1},
    {"adaptive_budget": "false"},
    {"tree_budget_per_batch_size": [[1, True, 8]]},
    {"tree_budget_per_batch_size": [["1", 4, 8]]},
    {"tree_budget_per_batch_size": [[1, 4, 8.0]]},
    {"tree_budget_per_batch_size": [[1, 4, 8], [5, 8, "2"]]},
]


def _plugin_error(fields) -> str:
    """The message of the plugin's parser (stock vLLM) for the same keys."""
    from vllm.v1.spec_decode.ddtree_config import parse_speculative_config

    with pytest.raises(ValueError) as error:
        parse_speculative_config({"method": "ddtree", "model": "d", **fields})
    return str(error.value)


@pytest.mark.parametrize("fields", COERCIBLE_TREE_SETTINGS)
def test_speculative_config_takes_tree_settings_as_given(models, fields):
    """The tree fields reach DDTree's parser as the user gave them: an error
    naming the key, the plugin's message, never a coerced budget."""
    message = _plugin_error(fields)
    assert next(iter(fields)) in message
    with pytest.raises(ValueError) as error:
        _speculative_config(models, **fields)
    assert message in str(error.value)


@pytest.mark.parametrize("fields", COERCIBLE_TREE_SETTINGS[:3])
def test_serve_cli_takes_tree_settings_as_given(models, fields):
    """`--speculative-config` JSON goes through the same check (EngineArgs ->
    SpeculativeConfig)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    target, drafter = models
    spec = {"method": "ddtree", "model": drafter, **fields}
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        ["--model", target, "--max-model-len", "2048"]
        + ["--speculative-config", json.dumps(spec)]
    )
    with pytest.raises(ValueError) as error:
        EngineArgs.from_cli_args(args).create_engine_config()
    assert _plugin_error(fields) in str(error.value)


@pytest.mark.parametrize(
    "fields",
    [
        {"tree_budget": 1, "adaptive_budget": False},
        {"tree_budget": 1024},
        {"tree_budget": "auto", "adaptive_budget": False},
        {"tree_budget": None, "adaptive_budget": None},
        {"tree_budget_per_batch_size": [[1, 4, 63], [5, 64, 15]]},
        {
            "tree_budget": 64,
            "tree_budget_per_batch_size": ((9, 64, 4), (1, 8, 64)),
            "adaptive_budget": False,
        },
    ],
)
def test_speculative_config_keeps_valid_tree_settings(models, fields):
    """Valid settings expand as the plugin's parser expands them (None: not
    set)."""
    from vllm.v1.spec_decode.ddtree_config import parse_speculative_config

    spec = _speculative_config(models, **fields)
    given = {k: v for k, v in fields.items() if v is not None}
    parsed = parse_speculative_config({"method": "ddtree", "model": "d", **given})
    assert spec.tree_budget == parsed.tree_budget
    assert type(spec.tree_budget) is int
    assert spec.adaptive_budget is parsed.adaptive
    assert (spec.tree_budget_per_batch_size or []) == list(parsed.schedule)
    assert spec.num_speculative_tokens_per_batch_size == parsed.dflash.get(
        "num_speculative_tokens_per_batch_size"
    )


# Method-name tuples keyed on DFlash in these modules: DDTree drafts with
# DFlash's drafter, so each must name "ddtree" too (or go through use_dflash()).
DFLASH_KEYED_MODULES = (
    "vllm.config.speculative",
    "vllm.config.vllm",
    "vllm.v1.worker.gpu.model_runner",
)


@pytest.mark.parametrize("module_name", DFLASH_KEYED_MODULES)
def test_dflash_keyed_branches_take_ddtree(module_name):
    import importlib

    module = importlib.import_module(module_name)
    tree = ast.parse(inspect.getsource(module))
    keyed = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple):
            names = {e.value for e in node.elts if isinstance(e, ast.Constant)}
            if "dflash" in names:
                keyed.append((node.lineno, names))
    assert keyed, module_name
    assert [k for k in keyed if "ddtree" not in k[1]] == []


def test_plain_dflash_is_untouched(models):
    from vllm.engine.arg_utils import EngineArgs

    from vllm.v1.spec_decode.ddtree_config import DDTreeConfig

    target, drafter = models
    spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": 15}
    config = EngineArgs(
        model=target, speculative_config=spec, max_model_len=2048
    ).create_engine_config()
    assert DDTreeConfig.from_vllm_config(config) is None
    # Neither TREE_ATTN nor the CUSTOM slot (by name: stock vLLM has no
    # TREE_ATTN member, and this check must pass there too).
    assert getattr(config.attention_config.backend, "name", None) not in (
        "TREE_ATTN",
        "CUSTOM",
    )
    assert config.speculative_config.max_num_new_slots_for_drafting == 14
    assert _scheduler(config).num_lookahead_tokens == 16


def _adaptive_config(models, budget=128, **kwargs):
    """An adaptive DDTree engine (the overlay's default: no "adaptive_budget"
    key)."""
    from vllm.engine.arg_utils import EngineArgs

    target, drafter = models
    spec = {"method": "ddtree", "model": drafter, "tree_budget": budget}
    return EngineArgs(
        model=target, speculative_config=spec, max_model_len=2048, **kwargs
    ).create_engine_config()


def test_adaptive_engine_config_builds(models):
    """No refusal: the adaptive config carries the budgets a step may choose."""
    from vllm.v1.spec_decode.ddtree_config import DDTreeConfig

    config = _adaptive_config(models, max_num_batched_tokens=4096)
    assert config.speculative_config.adaptive_budget is True
    cfg = DDTreeConfig.from_vllm_config(config)
    assert cfg.adaptive and cfg.tree_budget == 128
    assert cfg.ladder == (0, 1, 3, 7, 15, 31, 63, 127, 128)
    assert config.speculative_config.num_speculative_tokens == 128


def test_fixed_budget_scheduler_keeps_vllms_slots(models):
    from vllm.v1.spec_decode.ddtree_slots import TreeSlots

    _, config = _engine_config(models, budget=8)
    sched = _scheduler(config)
    assert not sched.ddtree_adaptive
    assert not isinstance(sched.dynamic_sd_lookup, TreeSlots)


def test_adaptive_scheduler_slots_are_tree_slots(models):
    from vllm.v1.spec_decode.ddtree_config import (
        DDTreeConfig,
        engine_tree_slots,
        slot_ladder,
    )
    from vllm.v1.spec_decode.ddtree_slots import TreeSlots

    config = _adaptive_config(models, max_num_batched_tokens=4096)
    cfg = DDTreeConfig.from_vllm_config(config)
    sched = _scheduler(config)
    lookup = sched.dynamic_sd_lookup
    assert isinstance(lookup, TreeSlots)
    assert lookup.caps == engine_tree_slots(cfg, config)
    assert lookup.slot_ladder == tuple(sorted(set(slot_ladder(cfg)) | {0}))
    assert sched.num_lookahead_tokens == 16


KV_TEST_ACCEPTED = [3, 0, 7, 1, 2]


def _adaptive_async_run(models, reports):
    """vLLM's async scheduler for an adaptive ``"tree_budget": 128`` engine
    over four requests, the worker's budget reports given by ``reports``
    (step -> next budget), drafts accepted as KV_TEST_ACCEPTED says. At every
    schedule a worker's block table rebuilt from the scheduler outputs (new
    blocks appended, cut rows cut) must equal the scheduler's. Returns per
    schedule (slots given, blocks held, tokens needing a slot per request,
    free blocks), and the spec-decode counters' draft tokens and the nodes
    the steps verified by the reports (the port of the overlay's
    tests/plugins/test_ddtree_engine_config.py run, without the plugin)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.outputs import ModelRunnerOutput

    from vllm.v1.spec_decode.ddtree_adaptive import BudgetReport

    config = _adaptive_config(
        models, max_num_batched_tokens=4096, async_scheduling=True
    )
    sched = _scheduler(
        config, log_stats=True, scheduler_cls=AsyncScheduler, num_blocks=1024
    )
    # Prefix caching on (vLLM's default): blocks are hashed as the engine does.
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    block_hasher = get_request_block_hasher(16, hash_fn)
    req_ids = [f"r{i}" for i in range(4)]
    for i, req_id in enumerate(req_ids):
        params = SamplingParams(max_tokens=10_000, ignore_eos=True)
        prompt = [5 + i] * (20 + 7 * i)
        sched.add_request(_request(req_id, params, prompt, block_hasher))
    manager, lookahead = sched.kv_cache_manager, sched.num_lookahead_tokens
    pool = manager.block_pool
    worker: dict[str, list[int]] = {}
    records, counted, verified, num_cut = [], 0, 0, 0
    pending = None  # the step in flight: (scheduler output, its budget)
    for step in range(len(reports) + 1):
        out = sched.schedule()
        for req_id, kept in (out.ddtree_kept_blocks or {}).items():
            del worker[req_id][kept[0] :]
            num_cut += 1
        for new in out.scheduled_new_reqs:
            worker[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for req_id, ids in zip(cached.req_ids, cached.new_block_ids):
            if ids is not None:
                worker[req_id].extend(ids[0])
        for req_id in req_ids:
            assert worker[req_id] == manager.get_block_ids(req_id)[0], step
        slots = {len(v) for v in out.scheduled_spec_decode_tokens.values()}
        held = [len(manager.get_block_ids(r)[0]) for r in req_ids]
        need = [sched.requests[r].num_computed_tokens + lookahead for r in req_ids]
        records.append((slots, held, need, pool.get_num_free_blocks()))
        if pending is not None:
            prev, prev_budget = pending
            accepted = KV_TEST_ACCEPTED[step % len(KV_TEST_ACCEPTED)]
            sampled = []
            for req_id in req_ids:
                drafts = len(prev.scheduled_spec_decode_tokens.get(req_id, []))
                # Each request verifies the step's budget (no split here).
                nodes = drafts if prev_budget is None else min(drafts, prev_budget)
                sampled.append([7] * (1 + min(accepted, nodes, 15)))
                verified += nodes
            output = ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled,
                ddtree_budget=BudgetReport(prev_budget, 4, reports[step - 1]),
            )
            result = sched.update_from_output(prev, output)
            stats = result[0].scheduler_stats.spec_decoding_stats
            counted += stats.num_draft_tokens if stats is not None else 0
        # The worker verifies the report's budget of a step with drafts.
        budget = reports[step - 1] if step else None
        pending = (out, budget if out.scheduled_spec_decode_tokens else None)
    return records, counted, verified, num_cut


def test_adaptive_slots_follow_the_budget_and_free_rejected_blocks(models, monkeypatch):
    """While the worker reports budgets that need the cap, requests get 128
    draft slots; once it reports budget 3 they get 15, the blocks past each
    request's computed tokens and the drafter's lookahead go back to the pool
    (the worker's rows cut to match), and each request holds exactly the
    blocks its tokens need. The counters count the verified nodes, not the
    slots. Without the freeing, the larger trees' blocks stay held."""
    from vllm.utils.math_utils import cdiv
    from vllm.v1.core.sched import scheduler as scheduler_module

    reports = [127] * 4 + [3] * 10
    records, counted, verified, num_cut = _adaptive_async_run(models, reports)
    given = [slots for slots, *_ in records]
    assert given[0] == set()  # the prompts
    assert 128 in set().union(*given[:5]) and given[-1] == {15}
    checked = 0
    for slots, held, need, _ in records:
        for h, n in zip(held, need):
            assert h == cdiv(n, 16), (slots, held, need)
            checked += 1
    assert checked == 4 * len(records) >= 4 * 15
    freed = [b - a for (*_, a), (*_, b) in itertools.pairwise(records)]
    assert max(freed) > 0 and num_cut > 0
    assert counted == verified > 0
    print(
        f"slots given {[sorted(g) for g in given]}; most blocks freed by one "
        f"schedule {max(freed)}; rows cut {num_cut}; draft tokens counted "
        f"{counted} of {verified} verified"
    )
    # The same reports without freeing: the cap's blocks stay held.
    monkeypatch.setattr(scheduler_module, "trim_dropped_slots", lambda sched: None)
    records, *_ = _adaptive_async_run(models, reports)
    assert any(
        h > cdiv(n, 16) for _, held, need, _ in records for h, n in zip(held, need)
    )


def _scheduler(vllm_config, log_stats=False, scheduler_cls=None, num_blocks=64):
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
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return (scheduler_cls or Scheduler)(
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
    assert sched.num_draft_positions == 15


def _dflash_with_the_plugins_key(models):
    """A DFlash engine config carrying the plugin's additional_config key for
    the same slots, which DDTree's reader takes for DDTree on stock vLLM."""
    from vllm.v1.spec_decode.ddtree_config import ADDITIONAL_CONFIG_KEY, DDTreeConfig

    return _dflash_engine_config(
        models,
        4,
        additional_config={ADDITIONAL_CONFIG_KEY: DDTreeConfig(4, 15).to_dict()},
    )


def test_scheduler_finds_ddtree_by_its_method(models):
    """The scheduler's and the grammar bitmask's hunks read method "ddtree"
    and draft_depth: a DFlash engine carrying the plugin's additional_config
    key keeps DFlash's lookahead, drafts and bitmask rows."""
    _, config = _engine_config(models, budget=4)
    spec = config.speculative_config
    assert _scheduler(config).num_lookahead_tokens == spec.draft_depth + 1 == 16
    dflash = _dflash_with_the_plugins_key(models)
    sched = _scheduler(dflash)
    assert sched.num_lookahead_tokens == 5
    assert sched.ddtree_grammar_reqs is None
    assert _grammar_bitmask_rows(sched) == dflash.scheduler_config.max_num_seqs * 5


def test_scheduler_stats_are_per_depth(models):
    _, config = _engine_config(models, budget=64)
    sched = _scheduler(config, log_stats=True)
    # vLLM's own method, with no tree branch: sized by num_draft_positions.
    assert "make_spec_decoding_stats" not in vars(sched)
    stats = sched.make_spec_decoding_stats(None, 64, 3, None, "r")
    stats = sched.make_spec_decoding_stats(stats, 8, 8, None, "r")
    assert len(stats.num_accepted_tokens_per_pos) == 15
    assert stats.num_accepted_tokens_per_pos == [2, 2, 2] + [1] * 5 + [0] * 7
    # Position i counts the trees that could reach depth i + 1.
    assert stats.num_draft_tokens_per_pos == [2] * 8 + [1] * 7
    assert stats.num_draft_tokens == 64 + 8
    assert stats.num_drafts == 2


def test_speculative_config_draft_positions(models):
    """SpeculativeConfig.draft_depth and num_draft_positions: the drafter's
    depth for "ddtree" (whatever the budget), the draft tokens for a chain;
    both through ddtree_config's functions, as the plugin's stats."""
    from vllm.v1.spec_decode.ddtree_config import num_draft_positions

    for budget in (4, 64):
        spec = _speculative_config(models, tree_budget=budget, adaptive_budget=False)
        assert (spec.draft_depth, spec.num_draft_positions) == (15, 15)
        assert spec.num_speculative_tokens == budget
        assert num_draft_positions(budget, spec.draft_depth) == 15
    config = _dflash_engine_config(models, 7)
    spec = config.speculative_config
    assert (spec.draft_depth, spec.num_draft_positions) == (None, 7)
    sched = _scheduler(config, log_stats=True)
    assert sched.num_draft_positions == 7
    stats = sched.make_spec_decoding_stats(None, 7, 7, None, "r")
    assert stats.num_draft_tokens_per_pos == [1] * 7


def _request(req_id, params, prompt=(1, 2, 3), block_hasher=None):
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request

    return Request.from_engine_core_request(
        EngineCoreRequest(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        ),
        block_hasher=block_hasher,
    )


def test_structured_output_requests_get_no_drafts(models):
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.spec_decode.ddtree_grammar import drop_grammar_drafts

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
    drop_grammar_drafts(sched.ddtree_grammar_reqs, sched.requests)
    assert grammar.spec_token_ids == []
    assert plain.spec_token_ids == [5, 6]


def test_grammar_bitmask_has_one_row_per_request(models):
    """DDTree's structured-output requests verify no drafts: the scheduler's
    grammar bitmask has max_num_seqs rows, not max_num_seqs x (1 + budget)."""
    _, config = _engine_config(models, budget=64)
    sched = _scheduler(config)
    assert _grammar_bitmask_rows(sched) == config.scheduler_config.max_num_seqs


def test_prometheus_counters_per_depth(models):
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    _, config = _engine_config(models, budget=64)
    seen = []

    class Recording(PrometheusStatLogger):
        def _spec_decoding_cls(self, spec, *args, **kwargs):
            prom = super()._spec_decoding_cls(spec, *args, **kwargs)
            seen.append((spec, prom.counter_spec_decode_num_accepted_tokens_per_pos))
            return prom

    unregister_vllm_metrics()
    try:
        Recording(config, engine_indexes=[0])
    finally:
        unregister_vllm_metrics()
    ((spec, per_pos),) = seen
    # The engine's own config, no copy: SpecDecodingProm reads its
    # num_draft_positions, one series per depth, not per tree node.
    assert spec is config.speculative_config
    assert len(per_pos[0]) == 15
    assert config.speculative_config.num_speculative_tokens == 64


def test_runner_picks_ddtree_speculator_and_model_state(models, monkeypatch):
    from vllm.v1.spec_decode import ddtree, ddtree_verify
    from vllm.v1.worker.gpu import model_states, spec_decode

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


def test_only_method_ddtree_is_ddtree(models, monkeypatch):
    """Where vLLM takes method "ddtree", the model-state hunk keys on the
    method and DDTree's reader answers for that method alone: a DFlash engine
    carrying the plugin's additional_config key stays DFlash, with DFlash's
    speculator and the default model state."""
    from vllm.v1.spec_decode import ddtree, ddtree_verify
    from vllm.v1.spec_decode.ddtree_config import DDTreeConfig, vllm_has_ddtree_method
    from vllm.v1.worker.gpu import model_states, spec_decode
    from vllm.v1.worker.gpu.model_states import default
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator

    assert vllm_has_ddtree_method()
    dflash = _dflash_with_the_plugins_key(models)
    assert DDTreeConfig.from_vllm_config(dflash) is None
    for module, name in [
        (ddtree, "DDTreeSpeculator"),
        (ddtree_verify, "DDTreeModelState"),
        (speculator, "DFlashSpeculator"),
        (default, "DefaultModelState"),
    ]:
        monkeypatch.setattr(module, name, lambda *args, name=name: name)
    assert spec_decode.init_speculator(dflash, "cpu") == "DFlashSpeculator"
    model = torch.nn.Linear(2, 2)
    assert model_states.init_model_state(dflash, model, None, "cpu") == (
        "DefaultModelState"
    )
    # The DDTree engine's own config is still read.
    _, config = _engine_config(models, budget=4)
    assert DDTreeConfig.from_vllm_config(config) == DDTreeConfig(4, 15)


# The model runner's hooks (MRv2) need a GPU to run: what follows checks, on
# the CPU, that the patched model_runner.py imports, that every call it makes
# on the adaptive budget names a method of AdaptiveTreeBudget with arguments
# its signature takes, from the runner method that glue wraps for it, and
# runs the two hooks whose runner code ends before any GPU work
# (execute_model's cut and plan, capture_model without graphs). The hooks are
# not run on a GPU here.

# runner method -> the AdaptiveTreeBudget method it calls (vllm_ddtree/glue.py)
ADAPTIVE_HOOKS = {
    ("execute_model", "plan"),
    ("prepare_inputs", "reallocate"),
    ("sample_tokens", "report"),
    ("load_model", "warm_up"),
    ("capture_model", "profile"),
}


def _runner_calls(name_of_call):
    """(runner method, what name_of_call(call) returns) for every call in
    GPUModelRunner's source where it returns something."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    tree = ast.parse(inspect.getsource(GPUModelRunner))
    found = []
    for method in ast.walk(tree):
        if isinstance(method, ast.FunctionDef):
            for node in ast.walk(method):
                if isinstance(node, ast.Call):
                    got = name_of_call(node)
                    if got is not None:
                        found.append((method.name, got, node))
    return found


def _adaptive_method(call):
    func = call.func
    if (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Attribute)
        and func.value.attr == "ddtree_adaptive"
    ):
        return func.attr
    return None


def test_model_runner_calls_the_adaptive_budget():
    from vllm.v1.spec_decode.ddtree_adaptive import AdaptiveTreeBudget

    calls = _runner_calls(_adaptive_method)
    assert {(m, name) for m, name, _ in calls} == ADAPTIVE_HOOKS
    for method, name, call in calls:
        signature = inspect.signature(getattr(AdaptiveTreeBudget, name))
        # Arguments as placeholders: the call's count and keywords must bind.
        signature.bind(
            object(), *call.args, **{k.arg: None for k in call.keywords if k.arg}
        )
    # The step's budget report travels on the output's declared field.
    from vllm.v1.outputs import ModelRunnerOutput

    assert ModelRunnerOutput(req_ids=[], req_id_to_index={}).ddtree_budget is None


def test_model_runner_adaptive_budget_is_the_speculators():
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    get = GPUModelRunner.ddtree_adaptive.fget
    budget = object()
    spec = types.SimpleNamespace(adaptive=budget)
    assert get(types.SimpleNamespace(speculator=spec)) is budget
    assert get(types.SimpleNamespace(speculator=None)) is None
    # A DFlash speculator has no budget.
    assert get(types.SimpleNamespace(speculator=types.SimpleNamespace())) is None


class _StepStarted(Exception):
    pass


class _Uva:
    def __init__(self, array):
        self.np = array
        self.copies = 0

    def copy_to_uva(self):
        self.copies += 1


def test_execute_model_cuts_rows_and_plans_before_the_step():
    """The runner's own execute_model, up to its first request-state update
    (stand-ins for the runner): the scheduler's cut rows are cut and the
    step planned before it, and the planned output is what the step uses."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    seen = []
    planned = types.SimpleNamespace(name="planned")
    adaptive = types.SimpleNamespace(
        plan=lambda out: seen.append(("plan", out)) or planned
    )
    num_blocks = _Uva(np.array([[9, 9]], dtype=np.int32))

    def first_update(out=None):
        seen.append(("step", num_blocks.np.tolist()))
        raise _StepStarted

    runner = types.SimpleNamespace(
        ddtree_adaptive=adaptive,
        block_tables=types.SimpleNamespace(
            num_blocks=num_blocks, blocks_per_kv_block=[1]
        ),
        req_states=types.SimpleNamespace(req_id_to_index={"a": 1}),
        update_pp_decode_requests=first_update,
        finish_requests=lambda out: seen.append(("finish", out)),
    )
    out = types.SimpleNamespace(ddtree_kept_blocks={"a": (5,), "gone": (1,)})
    with pytest.raises(_StepStarted):
        GPUModelRunner.execute_model(runner, out)
    assert seen == [("plan", out), ("step", [[9, 5]])]
    assert num_blocks.copies == 1
    # A dummy run is never planned.
    seen.clear()
    with pytest.raises(AttributeError):
        GPUModelRunner.execute_model(runner, types.SimpleNamespace(), dummy_run=True)
    assert not seen


def test_capture_model_profiles_without_graphs():
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    profiled = []
    runner = types.SimpleNamespace(
        cudagraph_manager=types.SimpleNamespace(needs_capture=lambda: False),
        ddtree_adaptive=types.SimpleNamespace(profile=profiled.append),
    )
    assert GPUModelRunner.capture_model(runner) == 0
    assert profiled == [runner]


def test_model_runner_sizes_ddtree_outputs():
    """load_model's structured-output rows bounded by the step's tokens."""

    def named(call):
        func = call.func
        return func.id if isinstance(func, ast.Name) else None

    calls = [(m, n, c) for m, n, c in _runner_calls(named) if n in ("min",)]
    assert any(
        m == "load_model" and "max_num_batched_tokens" in ast.unparse(c)
        for m, _, c in calls
    )


# Prompt logprobs of padded joins (patch 2): MRv2's own worker leaves out a
# padded join's placeholder rows for every speculator, so the runner trims
# nothing of DDTree's own.


def test_prompt_logprob_worker_counts_the_prompt_tokens():
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm.v1.worker.gpu.sample import prompt_logprob, prompt_logprob_rows

    assert (
        prompt_logprob.num_prompt_tokens_scheduled
        is prompt_logprob_rows.num_prompt_tokens_scheduled
    )
    source = inspect.getsource(prompt_logprob.PromptLogprobsWorker)
    assert "num_prompt_tokens_scheduled(" in source
    assert "trim_prompt_logprobs" not in inspect.getsource(GPUModelRunner)


@pytest.mark.parametrize("num_spec_tokens", [1, 15])
def test_padded_join_has_the_prompt_logprobs_of_no_speculation(num_spec_tokens):
    """The series' test of patch 2, not marked as an expected failure here:
    the patched worker's prompt logprobs of a padded join equal those of the
    step without speculation."""
    from tests.v1.worker.test_gpu_prompt_logprobs_padded_join import (
        PROMPTS,
        Engine,
        assert_no_speculation,
        join_step,
    )

    out = join_step(Engine(PROMPTS), num_spec_tokens, padded=True)
    assert_no_speculation(out, num_spec_tokens)


# Tree verification as a property of the speculator (patch 7): BaseSpeculator's
# hooks, their defaults for chain speculators, and the model runner's calls,
# the last two run with stand-ins for the runner up to the speculator.

# runner method -> the speculator hook it calls on self.speculator
SPECULATOR_HOOKS = {
    ("load_model", "init_rejection_sampler"),
    ("add_requests", "add_request"),
}


def _speculator_method(call):
    func = call.func
    if (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Attribute)
        and func.value.attr == "speculator"
    ):
        return func.attr
    return None


# The methods the series' patch 1 splits out of DFlash's propose.
DFLASH_STEPS = ("_prepare_draft_context", "_store_context_kv", "_run_drafter")
# The plugin's source (vllm_ddtree/glue.py), put beside this file as text by
# tests/upstream/test_series.py: read, never imported.
PLUGIN_GLUE = Path(__file__).with_name("ddtree_plugin_glue.py.txt")


def _methods(cls_node: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls_node.body if isinstance(n, ast.FunctionDef)}


def _class_node(cls) -> ast.ClassDef:
    (node,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    return node


def _self_calls(fn_node: ast.FunctionDef) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(fn_node)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "self"
    ]


def test_dflash_propose_runs_in_steps():
    """DFlash's propose calls its steps and no longer does their work itself;
    DDTree overrides the context step and the graph body, inherits the
    forward, and its context step takes DFlash's call."""
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    from vllm.v1.spec_decode.ddtree import DDTreeSpeculator

    dflash = _methods(_class_node(DFlashSpeculator))
    assert set(DFLASH_STEPS) <= dflash.keys()
    calls = {c.func.attr: c for c in _self_calls(dflash["propose"])}
    assert {"_prepare_draft_context", "_run_drafter"} <= calls.keys()
    names = {n.id for n in ast.walk(dflash["propose"]) if isinstance(n, ast.Name)}
    assert not names & {"dispatch_cg_and_sync_dp", "prepare_dflash_inputs"}
    context_calls = {c.func.attr for c in _self_calls(dflash["_prepare_draft_context"])}
    assert "_store_context_kv" in context_calls
    for name in ("_prepare_draft_context", "_generate_draft", "propose"):
        assert name in vars(DDTreeSpeculator), name
    for name in ("_store_context_kv", "_run_drafter"):
        assert name not in vars(DDTreeSpeculator), name
    call = calls["_prepare_draft_context"]
    inspect.signature(DDTreeSpeculator._prepare_draft_context).bind(
        object(), *call.args, **{k.arg: None for k in call.keywords}
    )


def test_dflash_steps_are_the_plugins():
    """The steps the DDTree plugin adds to vLLM 0.26's DFlash
    (``glue._DFlashSteps``) are the patched DFlash's methods: the same syntax
    trees, so plugin and series run one code. Every step DDTree calls and
    does not override is among them."""
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    from vllm.v1.spec_decode.ddtree import DDTreeSpeculator

    (glue_steps,) = [
        n
        for n in ast.parse(PLUGIN_GLUE.read_text()).body
        if isinstance(n, ast.ClassDef) and n.name == "_DFlashSteps"
    ]
    plugin = _methods(glue_steps)
    assert plugin and set(plugin) <= set(DFLASH_STEPS)
    dflash = _methods(_class_node(DFlashSpeculator))
    for name, node in plugin.items():
        assert name in dflash, f"the patched DFlashSpeculator has no {name}"
        assert ast.dump(node) == ast.dump(dflash[name]), name
    ddtree = _methods(_class_node(DDTreeSpeculator))
    called = {c.func.attr for fn in ddtree.values() for c in _self_calls(fn)}
    inherited = called & set(DFLASH_STEPS) - ddtree.keys()
    assert inherited and inherited <= plugin.keys()


def test_base_speculator_hooks_keep_chains_as_they_are():
    """``init_rejection_sampler`` gives a chain speculator vLLM's own
    rejection sampler, ``add_request`` does nothing, and every ``propose``
    the runner can call takes ``sampler_output`` (None by default); DDTree
    overrides the two hooks."""
    from vllm.v1.worker.gpu.spec_decode.autoregressive.speculator import (
        AutoRegressiveSpeculator,
    )
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler
    from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

    from vllm.v1.spec_decode.ddtree import DDTreeSpeculator

    for cls in (
        BaseSpeculator,
        DFlashSpeculator,
        AutoRegressiveSpeculator,
        DDTreeSpeculator,
    ):
        param = inspect.signature(cls.propose).parameters["sampler_output"]
        assert param.default is None, cls
    chain = object.__new__(DFlashSpeculator)  # no attribute is read
    sampler = object()
    spec_config = types.SimpleNamespace(
        num_speculative_tokens=3, rejection_sample_method="strict"
    )
    verifier = chain.init_rejection_sampler(sampler, spec_config, "cpu")
    assert type(verifier) is RejectionSampler and verifier.sampler is sampler
    assert chain.add_request(0, object()) is None
    for hook in ("init_rejection_sampler", "add_request"):
        assert getattr(DDTreeSpeculator, hook) is not getattr(BaseSpeculator, hook)


def test_model_runner_calls_the_speculator_hooks():
    """Where the runner calls each hook, with arguments the DDTree
    speculator's signatures take; ``load_model`` builds no rejection sampler
    itself, and ``sample_tokens`` passes its sampler output to ``propose``."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm.v1.spec_decode.ddtree import DDTreeSpeculator

    calls = _runner_calls(_speculator_method)
    hooks = {"init_rejection_sampler", "add_request"}
    assert {(m, n) for m, n, _ in calls if n in hooks} == SPECULATOR_HOOKS
    proposes = [(m, c) for m, n, c in calls if n == "propose"]
    assert sorted(m for m, _ in proposes) == ["_dummy_run", "sample_tokens"]
    for method, name, call in calls:
        if name in hooks | {"propose"}:
            signature = inspect.signature(getattr(DDTreeSpeculator, name))
            signature.bind(
                object(), *call.args, **{k.arg: None for k in call.keywords if k.arg}
            )
    (step_propose,) = [c for m, c in proposes if m == "sample_tokens"]
    keywords = {k.arg: ast.unparse(k.value) for k in step_propose.keywords}
    assert keywords["sampler_output"] == "sampler_output"
    load_source = inspect.getsource(GPUModelRunner.load_model)
    assert "RejectionSampler(" not in load_source


def _new_request(req_id):
    """The fields of MRv2's NewRequestData that add_requests reads."""
    return types.SimpleNamespace(
        req_id=req_id,
        prompt_token_ids=[1, 2, 3],
        prefill_token_ids=[1, 2, 3],
        sampling_params=None,
        num_computed_tokens=0,
        block_ids=([1],),
        lora_request=None,
        mm_features=None,
    )


def test_add_requests_tells_the_speculator_of_each_joining_request():
    """The runner's own add_requests over two joining requests, on stand-ins:
    the speculator's ``add_request`` gets each one's slot and data, after the
    model state's (so a tree speculator resets the slot as ``RequestState``
    resets its draft tokens; tests/v1/spec_decode/test_ddtree.py checks the
    reset itself)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    order = []
    slots = iter((2, 0))
    index = {}

    def add_request(req_id, **kwargs):
        index[req_id] = next(slots)

    def record(owner):
        return lambda req_index, data: order.append((owner, req_index, data.req_id))

    runner = types.SimpleNamespace(
        _remove_request=lambda req_id: None,
        req_states=types.SimpleNamespace(
            add_request=add_request,
            req_id_to_index=index,
            apply_staged_writes=lambda: None,
        ),
        encoder_cache=None,
        model_state=types.SimpleNamespace(
            add_request=record("model_state"), apply_staged_writes=lambda: None
        ),
        speculator=types.SimpleNamespace(add_request=record("speculator")),
        block_tables=types.SimpleNamespace(append_block_ids=lambda *a, **k: None),
        lora_state=types.SimpleNamespace(add_request=lambda *a: None),
        is_last_pp_rank=False,
        sampler=None,
    )
    requests = [_new_request("a"), _new_request("b")]
    GPUModelRunner.add_requests(
        runner, types.SimpleNamespace(scheduled_new_reqs=requests)
    )
    assert order == [
        ("model_state", 2, "a"),
        ("speculator", 2, "a"),
        ("model_state", 0, "b"),
        ("speculator", 0, "b"),
    ]


def test_sample_tokens_hands_the_step_walk_to_propose(monkeypatch):
    """The runner's own sample_tokens, on stand-ins up to the speculator: the
    object its ``sample`` returned reaches ``propose`` as ``sampler_output``,
    after the request states were updated (``postprocess_sampled``)."""
    from vllm.v1.worker.gpu import model_runner

    # The step's sampler output: the runner reads its sampled tokens only.
    walk = types.SimpleNamespace(sampled_token_ids="sampled")
    order = []

    def propose(*args, sampler_output=None, **kwargs):
        order.append(("propose", sampler_output))
        return torch.ones(1, 2, dtype=torch.int64)

    monkeypatch.setattr(model_runner, "AsyncOutput", lambda **kwargs: "async")
    batch = types.SimpleNamespace(
        req_ids=["a"], idx_mapping=torch.tensor([1]), query_start_loc=None
    )
    runner = types.SimpleNamespace(
        execute_model_state=types.SimpleNamespace(
            input_batch=batch,
            attn_metadata={},
            slot_mappings_by_layer={},
            hidden_states=torch.zeros(3, 4),
            aux_hidden_states=None,
            finished_req_ids=set(),
        ),
        is_last_pp_rank=True,
        pcp_manager=None,
        sample=lambda hidden, input_batch, grammar: (walk, "num_sampled", "num_rej"),
        pp_handler=None,
        prompt_logprobs_worker=types.SimpleNamespace(
            compute_prompt_logprobs=lambda *args: {}
        ),
        model=types.SimpleNamespace(compute_logits=None),
        req_states=types.SimpleNamespace(
            all_token_ids=types.SimpleNamespace(gpu=None),
            num_computed_tokens=types.SimpleNamespace(gpu=None),
            prompt_len=types.SimpleNamespace(np=None),
            last_sampled_tokens=None,
            next_prefill_tokens=None,
            draft_tokens=torch.zeros(2, 2, dtype=torch.int64),
        ),
        main_stream=None,
        output_copy_stream=None,
        speculator=types.SimpleNamespace(supports_mm_inputs=False, propose=propose),
        postprocess_sampled=lambda *args: order.append(("postprocess", args[1])),
        sampler=types.SimpleNamespace(
            sampling_states=types.SimpleNamespace(
                temperature=types.SimpleNamespace(gpu=None),
                seeds=types.SimpleNamespace(gpu=None),
            )
        ),
        num_speculative_steps=2,
        draft_tokens_handler=types.SimpleNamespace(set_draft_tokens=lambda *a: None),
        kv_connector=types.SimpleNamespace(post_forward=lambda ids: None),
        ddtree_adaptive=None,
        eplb=types.SimpleNamespace(step=lambda **kwargs: None),
    )
    assert model_runner.GPUModelRunner.sample_tokens(runner, None) == "async"
    assert order == [("postprocess", "sampled"), ("propose", walk)]
    assert runner.req_states.draft_tokens[1].tolist() == [1, 1]
