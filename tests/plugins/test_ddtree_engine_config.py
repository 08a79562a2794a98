# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree through ``EngineArgs`` with the plugin's wrappers: the mapping onto
vLLM's DFlash config, batch limits and CUDA-graph sizes, warnings and errors,
the adaptive budget's config, and vLLM's scheduler, KV manager and Prometheus
logger driven without a model (CPU only: engine configs are built, no engine is
started). ``ddtree_config``'s own functions are tested in
tests/v1/spec_decode/test_ddtree_config.py."""

import itertools
import pickle
import types

import pytest
from vllm.sampling_params import SamplingParams, StructuredOutputsParams

from tests.log_records import log_records
from tests.models.tiny_models import make_tiny_dflash, make_tiny_qwen3
from tests.v1.core.test_ddtree_scheduler import (
    _request,
    _stub_grammar,
    _StubBackend,
)
from tests.v1.spec_decode.test_ddtree_config import SCHEDULE, VLLM_LADDER
from vllm.v1.spec_decode import ddtree_config as ddt
from vllm.v1.spec_decode.ddtree_config import DDTreeConfig, engine_tree_slots

ADAPTIVE = {"adaptive_budget": True}
FIXED = {"adaptive_budget": False}


# ---------------------------------------------------------------------------
# Through EngineArgs (the plugin's wrappers), tiny checkpoints made here.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import vllm_ddtree

    vllm_ddtree.register()
    root = tmp_path_factory.mktemp("ddtree_config")
    target = make_tiny_qwen3(root / "target")
    drafter = make_tiny_dflash(root / "drafter", target)
    return str(target), str(drafter)


@pytest.fixture
def cuda_platform(monkeypatch):
    """EngineArgs asks the platform for a device type; a CPU-only box has none."""
    from vllm.platforms import current_platform

    if current_platform.device_type == "":
        monkeypatch.setattr(
            type(current_platform), "device_type", "cuda", raising=False
        )


def _engine_config(models, spec=None, **kwargs):
    """An engine config; fixed budgets unless ``spec`` says otherwise (the
    adaptive mode's own tests below set ``adaptive_budget``)."""
    from vllm.engine.arg_utils import EngineArgs

    target, drafter = models
    if spec is None:
        spec = {"method": "ddtree", "model": drafter, "tree_budget": 128}
    if isinstance(spec, dict) and spec.get("method") == "ddtree":
        spec = {"adaptive_budget": False, **spec}
    args = EngineArgs(
        model=target, speculative_config=spec, max_model_len=2048, **kwargs
    )
    return args, args.create_engine_config()


def test_engine_config_maps_ddtree_onto_dflash(models, cuda_platform):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    args, config = _engine_config(models, max_num_batched_tokens=4096)
    spec = config.speculative_config
    assert spec.method == "dflash"
    assert spec.num_speculative_tokens == 128
    assert config.num_speculative_tokens == 128
    assert DDTreeConfig.from_vllm_config(config) == DDTreeConfig(128, 15)
    assert config.attention_config.backend == AttentionBackendEnum.CUSTOM
    assert spec.attention_backend is None  # the drafter picks a non-causal one
    sched = config.scheduler_config
    # The 0.26 DFlash slot reservation does not shrink DDTree's step budget.
    assert spec.max_num_new_slots_for_drafting == 0
    assert sched.max_num_scheduled_tokens == sched.max_num_batched_tokens == 4096
    assert sched.max_num_seqs == 4096 // 129
    sizes = config.compilation_config.cudagraph_capture_sizes
    assert len(sizes) > 50 and sizes[-1] == 512
    assert {129, 258} <= set(sizes) and set(VLLM_LADDER) <= set(sizes)
    # Spawned engine cores and workers get it by pickling.
    assert DDTreeConfig.from_vllm_config(pickle.loads(pickle.dumps(config))) == (
        DDTreeConfig(128, 15)
    )
    # The user's dict is left as given; a second build gives the same config.
    assert args.speculative_config["method"] == "ddtree"
    again = args.create_engine_config()
    assert again.scheduler_config.max_num_seqs == sched.max_num_seqs
    assert again.compilation_config.cudagraph_capture_sizes == sizes


@pytest.fixture
def static_graphs(cuda_platform, monkeypatch):
    """vLLM's own CUDA-graph size step (VllmConfig._set_cudagraph_sizes), which a
    CPU-only platform skips, and the warnings it logs about the sizes."""
    import vllm.config.vllm as vllm_config_module
    from vllm.platforms import current_platform

    monkeypatch.setattr(
        type(current_platform),
        "support_static_graph_mode",
        classmethod(lambda cls: True),
        raising=False,
    )
    warnings: list[str] = []
    logger = vllm_config_module.logger
    original = logger.warning

    def record(msg, *args, **kwargs):
        warnings.append(str(msg) % args if args else str(msg))
        return original(msg, *args, **kwargs)

    monkeypatch.setattr(logger, "warning", record)
    return warnings


def _size_warnings(warnings: list[str]) -> list[str]:
    return [w for w in warnings if "capture" in w or "cudagraph" in w.lower()]


def test_engine_config_default_capture_sizes_pass_vllms_step(models, static_graphs):
    args, config = _engine_config(models, max_num_batched_tokens=4096)
    comp = config.compilation_config
    assert comp.cudagraph_mode != comp.cudagraph_mode.NONE
    assert comp.max_cudagraph_capture_size == comp.cudagraph_capture_sizes[-1] == 512
    assert {129, 258} <= set(comp.cudagraph_capture_sizes)
    assert set(VLLM_LADDER) <= set(comp.cudagraph_capture_sizes)
    assert _size_warnings(static_graphs) == []
    again = args.create_engine_config().compilation_config
    assert again.cudagraph_capture_sizes == comp.cudagraph_capture_sizes


@pytest.mark.parametrize(
    "where", ["engine_args", "compilation_config"], ids=["flag", "compilation"]
)
def test_engine_config_capture_sizes_up_to_users_maximum(models, static_graphs, where):
    """--max-cudagraph-capture-size (or the compilation config's) raises the
    largest graph; the sizes keep DDTree's shapes and vLLM accepts them
    without a warning, also above max_num_batched_tokens and on a second
    build."""
    for asked, largest in ((2048, 2048), (65536, 4096)):
        if where == "engine_args":
            kwargs = {"max_cudagraph_capture_size": asked}
        else:
            kwargs = {"compilation_config": {"max_cudagraph_capture_size": asked}}
        args, config = _engine_config(models, max_num_batched_tokens=4096, **kwargs)
        comp = config.compilation_config
        sizes = comp.cudagraph_capture_sizes
        assert comp.max_cudagraph_capture_size == sizes[-1] == largest
        verify = {s // 129 for s in sizes if s % 129 == 0}
        assert {1, 2, 4, 8} <= verify
        # Above vLLM's 512 only full batches: a size per tree batch, not one
        # every 16 tokens.
        assert len([s for s in sizes if s > 512]) <= 2 * 31 + 1
        again = args.create_engine_config().compilation_config
        assert again.cudagraph_capture_sizes == sizes
    assert _size_warnings(static_graphs) == []


def test_engine_config_refuses_two_maxima_as_vllm_does(models, static_graphs):
    with pytest.raises(ValueError, match="mutually exclusive"):
        _engine_config(
            models,
            max_num_batched_tokens=4096,
            max_cudagraph_capture_size=2048,
            compilation_config={"max_cudagraph_capture_size": 1024},
        )


def test_engine_config_keeps_users_capture_sizes(models, static_graphs):
    _, config = _engine_config(
        models, max_num_batched_tokens=4096, cudagraph_capture_sizes=[1, 129, 258]
    )
    assert config.compilation_config.cudagraph_capture_sizes == [1, 129, 258]
    assert _size_warnings(static_graphs) == []


def test_engine_config_eager_has_no_graphs(models, static_graphs):
    _, config = _engine_config(models, max_num_batched_tokens=4096, enforce_eager=True)
    comp = config.compilation_config
    assert comp.cudagraph_capture_sizes == [] and comp.max_cudagraph_capture_size == 0


def test_engine_config_interactivity_sizes(models, static_graphs):
    _, config = _engine_config(
        models, max_num_batched_tokens=4096, performance_mode="interactivity"
    )
    sizes = config.compilation_config.cudagraph_capture_sizes
    assert set(range(1, 33)) <= set(sizes) and 129 in sizes


def test_engine_config_with_budget_schedule(models, cuda_platform):
    """tree_budget_per_batch_size -> vLLM's dynamic speculative decoding: the
    scheduler's dense lookup gives each batch size its budget, and CUDA graphs
    are captured for every verify length."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    _, drafter = models
    _, config = _engine_config(
        models,
        {"method": "ddtree", "model": drafter, "tree_budget_per_batch_size": SCHEDULE},
        max_num_batched_tokens=4096,
        max_num_seqs=32,
    )
    spec = config.speculative_config
    assert spec.uses_dynamic_speculative_decoding()
    assert spec.num_speculative_tokens == 64
    assert DDTreeConfig.from_vllm_config(config) == DDTreeConfig(64, 15, (4, 16))
    lookup = build_dynamic_sd_schedule_lookup(
        spec.num_speculative_tokens_per_batch_size, 32, spec.num_speculative_tokens
    )
    assert lookup[1] == 64 and lookup[2] == lookup[8] == 16
    assert lookup[9] == lookup[32] == 4
    sizes = config.compilation_config.cudagraph_capture_sizes
    if sizes:
        assert {5, 17, 65} <= set(sizes)
    assert DDTreeConfig.from_vllm_config(pickle.loads(pickle.dumps(config))) == (
        DDTreeConfig(64, 15, (4, 16))
    )


@pytest.mark.parametrize(
    "budget", [{"tree_budget": "auto"}, {}], ids=["auto", "default"]
)
def test_engine_config_with_auto_budget(models, cuda_platform, budget):
    """tree_budget='auto', also when left out -> the measured schedule through
    vLLM's dynamic speculative decoding, graphs for each of its budgets."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    _, drafter = models
    _, config = _engine_config(
        models,
        {"method": "ddtree", "model": drafter, **budget},
        max_num_batched_tokens=4096,
        max_num_seqs=32,
    )
    spec = config.speculative_config
    auto = ddt.AUTO_TREE_BUDGET_PER_BATCH_SIZE
    budgets = sorted({b for *_, b in auto})
    assert spec.uses_dynamic_speculative_decoding()
    assert DDTreeConfig.from_vllm_config(config) == DDTreeConfig(
        budgets[-1], 15, tuple(budgets[:-1])
    )
    lookup = build_dynamic_sd_schedule_lookup(
        spec.num_speculative_tokens_per_batch_size, 32, spec.num_speculative_tokens
    )
    for first, last, want in auto:
        for batch in range(first, min(last, 32) + 1):
            assert lookup[batch] == want, batch
    sizes = config.compilation_config.cudagraph_capture_sizes
    if sizes:
        assert {b + 1 for b in budgets} <= set(sizes)


@pytest.mark.parametrize(
    "budgets", [{"tree_budget": "auto"}, {"tree_budget_per_batch_size": SCHEDULE}]
)
def test_drafter_graphs_keep_one_query_length(
    models, cuda_platform, monkeypatch, budgets
):
    """With a budget per batch size the drafter still runs depth + 1 tokens per
    request: its graphs are planned for that one length. vLLM's manager plans
    one length per scheduled budget (budget + 16 - max budget), which is zero or
    negative for the small budgets and failed the capture on the H200."""
    import torch
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu import cudagraph_utils
    from vllm.v1.worker.gpu.spec_decode.dflash.cudagraph import DFlashCudaGraphManager

    from vllm.v1.spec_decode.ddtree import fixed_draft_len_config

    _, drafter = models
    _, config = _engine_config(
        models,
        {"method": "ddtree", "model": drafter, **budgets},
        max_num_batched_tokens=4096,
        max_num_seqs=32,
    )
    # A CPU build captures no graphs: give it the sizes a GPU build would get.
    compilation = config.compilation_config
    compilation.cudagraph_capture_sizes = [
        1,
        2,
        4,
        5,
        8,
        16,
        17,
        32,
        33,
        64,
        65,
        128,
        256,
        512,
    ]
    compilation.max_cudagraph_capture_size = 512
    monkeypatch.setattr(
        cudagraph_utils,
        "get_pp_group",
        lambda: types.SimpleNamespace(is_first_rank=True, is_last_rank=True),
    )
    monkeypatch.setattr(
        cudagraph_utils.current_platform,
        "get_global_graph_pool",
        lambda: None,
        raising=False,
    )
    block = DDTreeConfig.from_vllm_config(config).draft_len

    def planned(vllm_config):
        manager = DFlashCudaGraphManager(
            vllm_config,
            torch.device("cpu"),
            CUDAGraphMode.FULL_DECODE_ONLY,
            decode_query_len=block,
        )
        return [d for descs in manager._capture_descs.values() for d in descs]

    fixed = fixed_draft_len_config(config)
    descs = planned(fixed)
    num_reqs = {d.num_reqs for d in descs}
    assert {1, 2, 4, 8, 16, 32} <= num_reqs and max(num_reqs) == 32
    for d in descs:
        assert d.uniform_token_count == block and d.num_tokens == block * d.num_reqs
    # Everything but the schedule is the engine's own.
    assert fixed.compilation_config is config.compilation_config
    assert fixed.speculative_config.num_speculative_tokens == (
        config.speculative_config.num_speculative_tokens
    )
    # The engine's config as is: lengths other than the drafter's, or a zero
    # length vLLM's manager cannot plan at all (max budget 31: 15 + 16 - 31).
    try:
        stock = planned(config)
    except ZeroDivisionError:
        stock = None
    assert stock is None or any(d.uniform_token_count != block for d in stock)
    # Without a schedule the config is used as is.
    _, plain = _engine_config(models, max_num_batched_tokens=4096)
    assert fixed_draft_len_config(plain) is plain

    # The speculator's hook: DFlash's graph-mode choice, the fixed plan, and the
    # speculator keeps the engine's config.
    from vllm.v1.attention.backend import AttentionCGSupport

    from vllm.v1.spec_decode.ddtree import DDTreeSpeculator

    spec = object.__new__(DDTreeSpeculator)  # only what the hook reads
    spec.vllm_config, spec.device, spec.num_query_per_req = config, "cpu", block
    spec.attn_cg_support = types.SimpleNamespace(
        min_cg_support=AttentionCGSupport.UNIFORM_BATCH, min_cg_attn_backend="x"
    )
    spec.init_cudagraph_manager(CUDAGraphMode.FULL_AND_PIECEWISE)
    assert spec.vllm_config is config
    manager = spec.query_cudagraph_manager
    assert manager.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    hooked = [d for descs in manager._capture_descs.values() for d in descs]
    assert hooked == descs
    # The engine's own config still carries the schedule.
    assert config.speculative_config.uses_dynamic_speculative_decoding()


def test_budget_schedule_without_async_scheduling_warns(
    models, cuda_platform, monkeypatch
):
    from vllm_ddtree import glue

    warnings = []
    monkeypatch.setattr(
        glue.logger, "warning", lambda msg, *a: warnings.append(msg % a)
    )
    _, drafter = models
    spec = {
        "method": "ddtree",
        "model": drafter,
        "tree_budget_per_batch_size": SCHEDULE,
    }
    _engine_config(models, spec, max_num_batched_tokens=4096, async_scheduling=False)
    assert any(
        "takes effect with async scheduling only" in w and "tree_budget=64" in w
        for w in warnings
    ), warnings
    warnings.clear()
    spec = {"method": "ddtree", "model": drafter, "tree_budget": "auto"}
    _engine_config(models, spec, max_num_batched_tokens=4096, async_scheduling=False)
    assert any(
        "tree_budget 'auto') takes effect with async scheduling only" in w
        for w in warnings
    ), warnings
    warnings.clear()
    # The adaptive budget's slots too (it would schedule tree_budget slots).
    spec = {"method": "ddtree", "model": drafter, "adaptive_budget": True}
    _engine_config(models, spec, max_num_batched_tokens=4096, async_scheduling=False)
    assert any(
        "adaptive budget's draft slots per batch size take effect with async "
        "scheduling only"
        in w
        # "auto"'s cap (ddtree_config.AUTO_TREE_BUDGET_CAP).
        and "tree_budget=128 slots" in w
        for w in warnings
    ), warnings
    warnings.clear()
    _engine_config(models, spec, max_num_batched_tokens=4096)
    assert not any("async scheduling" in w for w in warnings)
    _engine_config(models, max_num_batched_tokens=4096, async_scheduling=False)
    assert not any("async scheduling" in w for w in warnings)


def test_large_fixed_budget_warns_of_steps_without_graphs(
    models, static_graphs, monkeypatch
):
    """Judged on the finished config: vLLM's graph mode and its capture sizes
    within the step's token limit."""
    from vllm_ddtree import glue

    warnings = []
    monkeypatch.setattr(
        glue.logger, "warning", lambda msg, *a: warnings.append(msg % a)
    )

    def ungraphed(**kwargs):
        warnings.clear()
        _engine_config(models, **{"max_num_batched_tokens": 4096, **kwargs})
        return [w for w in warnings if "run without graphs" in w]

    (w,) = ungraphed()
    assert "tree_budget=128 verifies 129 tokens" in w and "steps of 4 or more" in w
    assert "max_num_seqs=31" in w and "largest CUDA graph (512 tokens)" in w
    (w,) = ungraphed(cudagraph_capture_sizes=[1, 129, 258])
    assert "steps of 3 or more" in w and "(258 tokens)" in w
    # vLLM drops sizes above the step's token limit.
    (w,) = ungraphed(cudagraph_capture_sizes=[1, 129, 258, 8192])
    assert "steps of 3 or more" in w and "(258 tokens)" in w
    for kwargs in (
        {"enforce_eager": True},
        {"compilation_config": {"cudagraph_mode": "NONE"}},
        {"optimization_level": 0},
        {"max_cudagraph_capture_size": 4096},
        {"max_num_seqs": 3},
        {"max_num_seqs": 8, "max_num_batched_tokens": 512},  # trimmed trees
    ):
        assert ungraphed(**kwargs) == [], kwargs
    _, drafter = models
    for budget in ("auto", 15):
        spec = {"method": "ddtree", "model": drafter, "tree_budget": budget}
        assert ungraphed(spec=spec) == [], budget


def _adaptive(models, **spec):
    return {"method": "ddtree", "model": models[1], "adaptive_budget": True, **spec}


@pytest.mark.parametrize("tokens", [8192, 2048])
def test_adaptive_engine_config(models, cuda_platform, tokens):
    """An adaptive engine: tree_budget is a cap; the step limits fit the
    drafter's block per request; the scheduler's draft slots by batch size
    are DDTree's (within the trees a step can choose and half the step's
    tokens), vLLM's schedule lists every ladder budget for the graphs, and the
    capture sizes are vLLM's own (rounded per budget by its graph manager)."""
    from tests.plugins.engine_summary import build_scheduler

    _, config = _engine_config(
        models, _adaptive(models, tree_budget=128), max_num_batched_tokens=tokens
    )
    cfg = DDTreeConfig.from_vllm_config(config)
    assert cfg.adaptive and cfg.tree_budget == 128
    assert cfg.ladder == (0, 1, 3, 7, 15, 31, 63, 127, 128)
    sched = config.scheduler_config
    assert sched.max_num_batched_tokens == tokens
    from vllm.config import SchedulerConfig

    # vLLM's default number of sequences, as far as the drafter's blocks fit.
    assert sched.max_num_seqs == min(SchedulerConfig.DEFAULT_MAX_NUM_SEQS, tokens // 16)
    listed = {
        b for *_, b in config.speculative_config.num_speculative_tokens_per_batch_size
    }
    assert listed == set(cfg.ladder)
    sizes = config.compilation_config.cudagraph_capture_sizes
    assert set(VLLM_LADDER) <= set(sizes) and sizes[-1] == 512
    assert not {129, 258} & set(sizes)  # no multiples of the cap's tree
    scheduler = build_scheduler(config)
    lookup = scheduler.dynamic_sd_lookup
    want = ddt.scheduled_tree_budgets(cfg, sched.max_num_seqs, tokens, 512)
    assert lookup.caps == want and len(lookup) == sched.max_num_seqs + 1
    span = min(tokens // 2, 1024)
    for r in range(1, sched.max_num_seqs + 1):
        assert lookup[r] in cfg.ladder and r * (1 + lookup[r]) <= max(span, r)
        assert lookup[r] <= lookup[r - 1] or r == 1
    assert lookup[1] == (128 if span > 129 else 127)
    # The scheduler keeps the drafter's lookahead.
    assert scheduler.num_lookahead_tokens == 16


def test_no_cuda_gpu_fails_at_once_with_one_line(models, monkeypatch):
    """Without a CUDA GPU a DDTree engine stops at its config with a message
    that says so, not later in vLLM's device inference."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "device_type", "", raising=False)
    target, drafter = models
    args = EngineArgs(
        model=target,
        speculative_config={"method": "ddtree", "model": drafter},
        max_model_len=2048,
    )
    with pytest.raises(
        ValueError, match=r"needs a CUDA GPU .*platform here is none\. Run on a"
    ):
        args.create_engine_config()


def test_auto_is_adaptive_up_to_128_nodes(models, cuda_platform):
    from vllm.config import SchedulerConfig
    from vllm.engine.arg_utils import EngineArgs

    target, drafter = models

    def build(**spec):
        # 4096 fits the start-up warm-up of a 1024-node tree (2051 tokens).
        return EngineArgs(
            model=target,
            speculative_config={"method": "ddtree", "model": drafter, **spec},
            max_model_len=4096,
        ).create_engine_config()

    config = build(**ADAPTIVE)
    cfg = DDTreeConfig.from_vllm_config(config)
    assert cfg.adaptive and cfg.tree_budget == 128
    assert cfg.ladder == (0, 1, 3, 7, 15, 31, 63, 127, 128)
    sched = config.scheduler_config
    assert sched.max_num_seqs == min(
        SchedulerConfig.DEFAULT_MAX_NUM_SEQS, sched.max_num_batched_tokens // 16
    )
    # The builder's largest tree is a setting away.
    cfg = DDTreeConfig.from_vllm_config(build(tree_budget=1024, **ADAPTIVE))
    assert cfg.adaptive and cfg.tree_budget == 1024
    assert cfg.ladder == (0, 1, 3, 7, 15, 31, 63, 127, 255, 511, 1023, 1024)


def test_tree_budget_fits_the_start_up_warm_up(models, cuda_platform):
    """vLLM's warm-up prefills B + 2 prompt tokens, then decodes a B + 1 token
    step per request: at max_model_len 200 "auto" caps trees at 98 nodes, and
    at 2048 a budget of 1024 is refused before the engine starts, naming the
    length it needs (without the bound the warm-up wrote past a block-table
    row)."""
    from vllm.engine.arg_utils import EngineArgs

    target, drafter = models

    def build(max_model_len, **spec):
        return EngineArgs(
            model=target,
            speculative_config={"method": "ddtree", "model": drafter, **spec},
            max_model_len=max_model_len,
        ).create_engine_config()

    cfg = DDTreeConfig.from_vllm_config(build(200, **ADAPTIVE))
    assert cfg.adaptive and cfg.tree_budget == 98
    assert cfg.ladder == (0, 1, 3, 7, 15, 31, 63, 98)
    cfg = DDTreeConfig.from_vllm_config(build(2048, tree_budget=1022, **ADAPTIVE))
    assert cfg.adaptive and cfg.tree_budget == 1022
    assert cfg.ladder == (0, 1, 3, 7, 15, 31, 63, 127, 255, 511, 1022)
    with pytest.raises(
        ValueError,
        match=r"tree_budget 1024 needs --max-model-len >= 2051 .*max_model_len=2048: "
        r"raise it, or set tree_budget to at most 1022$",
    ):
        build(2048, tree_budget=1024, adaptive_budget=False)


def test_engine_start_names_ddtree_in_vllms_log(models, cuda_platform):
    """vLLM's own config line prints the DFlash config DDTree runs on: DDTree's
    start-up line, in vLLM's logger tree, names the method, the budget mode
    and what that line will show."""
    import logging

    from vllm.engine.arg_utils import EngineArgs

    target, drafter = models
    with log_records("vllm.ddtree.glue", logging.INFO) as records:
        config = EngineArgs(
            model=target,
            speculative_config={
                "method": "ddtree",
                "model": drafter,
                "tree_budget": 8,
                **FIXED,
            },
            max_model_len=2048,
        ).create_engine_config()
    lines = [r.getMessage() for r in records if r.getMessage().startswith("DDTree:")]
    assert len(lines) == 1, lines
    assert lines[0].startswith("DDTree: fixed tree_budget=8, drafter ")
    # Quoted as vLLM prints it, so a search for vLLM's text finds DDTree's line.
    shown = repr(config.speculative_config)
    assert shown.startswith("SpeculativeConfig(method='dflash', model=")
    assert shown.endswith("num_spec_tokens=8)") and shown in lines[0]
    from vllm_ddtree import glue

    assert glue.logger.name == "vllm.ddtree.glue"


def test_engine_config_spec_flags(models, cuda_platform):
    from vllm.engine.arg_utils import EngineArgs

    target, drafter = models
    args = EngineArgs(
        model=target,
        spec_method="ddtree",
        spec_model=drafter,
        speculative_config={"tree_budget": 8, **ADAPTIVE},
        max_model_len=2048,
    )
    config = args.create_engine_config()
    assert DDTreeConfig.from_vllm_config(config) == DDTreeConfig(
        8, 15, (1, 3, 7), adaptive=True
    )
    with pytest.raises(ValueError, match="drop --spec-tokens"):
        EngineArgs(
            model=target, spec_method="ddtree", spec_model=drafter, spec_tokens=4
        ).create_engine_config()


def test_plain_dflash_is_untouched(models, cuda_platform):
    _target, drafter = models
    _, config = _engine_config(
        models,
        {"method": "dflash", "model": drafter, "num_speculative_tokens": 15},
        max_num_batched_tokens=4096,
        max_num_seqs=64,
    )
    assert DDTreeConfig.from_vllm_config(config) is None
    assert config.speculative_config.parallel_drafting
    assert config.scheduler_config.max_num_scheduled_tokens == 4096 - 14 * 64
    assert config.attention_config.backend is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_num_batched_tokens": 100}, "cannot hold one DDTree step"),
        ({"attention_backend": "FLASH_ATTN"}, "backend is set to FLASH_ATTN"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype='fp8'"),
        ({"enable_lora": True}, "LoRA adapters"),
        (
            {
                "kv_transfer_config": {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                }
            },
            "drop --kv-transfer-config",
        ),
        ({"data_parallel_size": 2}, "drop --data-parallel-size"),
        # vLLM builds the offloading connector after --kv-transfer-config's check.
        ({"kv_offloading_size": 2.0}, "drop --kv-offloading-size"),
    ],
)
def test_engine_config_errors(models, cuda_platform, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _engine_config(models, **kwargs)


def test_engine_config_rejects_non_dflash_drafter(models, cuda_platform):
    target, _ = models
    with pytest.raises(ValueError, match="could not load .* as a DFlash drafter"):
        _engine_config(models, {"method": "ddtree", "model": target})


def test_engine_config_rejects_model_runner_v1(models, cuda_platform, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(ValueError, match="unset VLLM_USE_V2_MODEL_RUNNER=0"):
        _engine_config(models)


# ---------------------------------------------------------------------------
# vLLM's scheduler, KV manager and Prometheus logger for DDTree engines
# ---------------------------------------------------------------------------


def _scheduler(vllm_config):
    from tests.plugins.engine_summary import build_scheduler

    return build_scheduler(vllm_config, log_stats=True)


def _observe(sched, trees, invalid=None):
    stats = None
    for i, (nodes, accepted) in enumerate(trees):
        stats = sched.make_spec_decoding_stats(
            stats,
            num_draft_tokens=nodes,
            num_accepted_tokens=accepted,
            num_invalid_spec_tokens=invalid,
            request_id=str(i),
        )
    return stats


def _sampled(sched, scheduler_output, token=7):
    """A model output that samples one token for every scheduled request."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[token] for _ in req_ids],
    )


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_structured_output_requests_decode_without_drafts(
    models, cuda_platform, async_scheduling
):
    """A structured-output request is scheduled with no draft slots or drafts
    (one token, one grammar row), next to requests that keep their trees;
    the grammar bitmask holds one row per request, not 1 + tree_budget."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import DraftTokenIds

    from tests.plugins.engine_summary import build_scheduler

    _, config = _engine_config(
        models, max_num_batched_tokens=4096, async_scheduling=async_scheduling
    )
    sched = build_scheduler(
        config, scheduler_cls=AsyncScheduler if async_scheduling else Scheduler
    )
    backend = _StubBackend(config.model_config.get_vocab_size())
    sched.structured_output_manager.backend = backend
    kinds = {"plain0": None, "json": {"json": {}}, "plain1": None, "choice": None}
    kinds["choice"] = {"choice": ["a", "b"]}
    for i, (req_id, so) in enumerate(kinds.items()):
        params = SamplingParams(
            max_tokens=20,
            structured_outputs=None if so is None else StructuredOutputsParams(**so),
        )
        request = _request(req_id, [5 + i, 6, 7, 8], params)
        if so is not None:
            request.structured_output_request.grammar = _stub_grammar()
        sched.add_request(request)
    grammar = {"json", "choice"}
    out = sched.schedule()
    assert out.num_scheduled_tokens == dict.fromkeys(kinds, 4)
    if not async_scheduling:
        sched.update_from_output(out, _sampled(sched, out))
        # The worker drafts a tree for every request; the grammar's are dropped.
        drafts = [[3] * 128 for _ in kinds]
        sched.update_draft_token_ids(DraftTokenIds(list(kinds), drafts))
    num_checked = 0
    for _ in range(3):
        out = sched.schedule()
        spec = out.scheduled_spec_decode_tokens
        assert set(spec) == set(kinds) - grammar
        for req_id in kinds:
            want = 1 if req_id in grammar else 1 + 128
            assert out.num_scheduled_tokens[req_id] == want
            num_checked += 1
        bitmask = sched.get_grammar_bitmask(out)
        assert bitmask is not None
        assert bitmask.structured_output_request_ids == ["json", "choice"]
        assert bitmask.grammar_bitmask.shape[0] == 2  # one row each
        sched.update_from_output(out, _sampled(sched, out))
        if not async_scheduling:
            sched.update_draft_token_ids(DraftTokenIds(list(kinds), drafts))
    assert backend.allocated == [config.scheduler_config.max_num_seqs]
    print(f"requests x steps checked: {num_checked}")
    assert num_checked >= 12


# Draft tokens accepted per step and request in the KV test below (the bonus
# token comes on top), cycling.
KV_TEST_ACCEPTED = [3, 0, 7, 1, 2]


def _kv_blocks_run(config, num_drafts: int, steps: int = 12):
    """vLLM's sync scheduler and KV manager over ``steps`` steps of four
    requests whose drafts are accepted as KV_TEST_ACCEPTED says: per request and
    step, (blocks held after scheduling, tokens the step needs slots for); and
    the mean blocks held per request at the end, and for its computed tokens."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.utils.math_utils import cdiv
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    from tests.plugins.engine_summary import build_scheduler

    sched = build_scheduler(config, num_blocks=1024)
    # Prefix caching on (vLLM's default): blocks are hashed as the engine does.
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    block_hasher = get_request_block_hasher(16, hash_fn)
    req_ids = [f"r{i}" for i in range(4)]
    for i, req_id in enumerate(req_ids):
        params = SamplingParams(max_tokens=10_000, ignore_eos=True)
        sched.add_request(
            _request(req_id, [5 + i] * (20 + 7 * i), params, block_hasher)
        )
    manager, lookahead = sched.kv_cache_manager, sched.num_lookahead_tokens
    records = []
    for step in range(steps):
        out = sched.schedule()
        for req_id in req_ids:
            # The scheduler has already counted the step's tokens as computed.
            need = sched.requests[req_id].num_computed_tokens + lookahead
            records.append((len(manager.get_block_ids(req_id)[0]), need))
        accepted = KV_TEST_ACCEPTED[step % len(KV_TEST_ACCEPTED)]
        sampled = []
        for req_id in req_ids:
            drafts = len(out.scheduled_spec_decode_tokens.get(req_id, []))
            sampled.append([7] * (1 + min(accepted, drafts)))
        sched.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled,
            ),
        )
        if num_drafts:
            sched.update_draft_token_ids(
                DraftTokenIds(req_ids, [[3] * num_drafts for _ in req_ids])
            )
    committed = [cdiv(sched.requests[r].num_computed_tokens, 16) for r in req_ids]
    held = [len(manager.get_block_ids(r)[0]) for r in req_ids]
    return records, sum(held) / len(held), sum(committed) / len(committed)


def test_kv_blocks_follow_the_next_tree(models, cuda_platform):
    """In every step a request holds exactly the blocks of its computed tokens,
    the step's tree and the drafter's lookahead, prefix caching on: the blocks
    of a step's rejected nodes are the next tree's, and nothing is held past
    what a step needs (with one budget per request). Prints the blocks held per
    running request."""
    from vllm.utils.math_utils import cdiv

    _, drafter = models
    configs = {
        "none": (None, 0),
        "dflash": (
            {"method": "dflash", "model": drafter, "num_speculative_tokens": 15},
            15,
        ),
        "ddtree-15": ({"method": "ddtree", "model": drafter, "tree_budget": 15}, 15),
        "ddtree-128": ({"method": "ddtree", "model": drafter, "tree_budget": 128}, 128),
        # The adaptive budget: the scheduler gives its slots for 4 requests (the
        # worker verifies at most that many nodes per request, often fewer).
        "ddtree-adaptive-128": (
            {
                "method": "ddtree",
                "model": drafter,
                "tree_budget": 128,
                "adaptive_budget": True,
            },
            None,
        ),
    }
    report, checked = {}, 0
    for name, (spec, drafts) in configs.items():
        if spec is None:
            from vllm.engine.arg_utils import EngineArgs

            args = EngineArgs(
                model=models[0], max_model_len=2048, max_num_batched_tokens=4096
            )
            config = args.create_engine_config()
            assert config.speculative_config is None
        else:
            _, config = _engine_config(models, spec, max_num_batched_tokens=4096)
        if drafts is None:
            cfg = DDTreeConfig.from_vllm_config(config)
            drafts = engine_tree_slots(cfg, config)[4]
            report["adaptive slots at 4 requests"] = drafts
        records, held, committed = _kv_blocks_run(config, drafts)
        for held_now, slots in records:
            assert held_now == cdiv(slots, 16), (name, held_now, slots)
            checked += 1
        report[name] = (held, committed)
    slots = report.pop("adaptive slots at 4 requests")
    print(
        "blocks per running request after 12 steps (held / committed tokens'): "
        + ", ".join(f"{n} {h:.2f} / {c:.2f}" for n, (h, c) in report.items())
        + f"; adaptive slots per request at 4 requests: {slots}"
    )
    assert checked >= 4 * 12 * 5
    # Blocks past the computed tokens': a tree of 15 holds what DFlash's chain
    # of 15 holds, one of 128 more; no speculation none. The adaptive budget
    # holds its slots' worth, whatever budget the worker then verifies.
    over = {n: h - c for n, (h, c) in report.items()}
    assert over["ddtree-128"] > over["ddtree-15"] == over["dflash"] > over["none"]
    assert slots == 128
    assert over["ddtree-adaptive-128"] == over["ddtree-128"]


def _adaptive_async_run(models, reports):
    """vLLM's async scheduler (its default) for an adaptive ``"tree_budget":
    128`` engine over four requests, the worker's budget reports given by
    ``reports`` (step -> next budget), drafts accepted as KV_TEST_ACCEPTED says.
    Checks at every schedule that a worker's block table rebuilt from the
    scheduler outputs (new blocks appended, cut rows cut) is the scheduler's;
    returns per schedule (slots given, blocks held, tokens needing a slot per
    request, free blocks), and the spec-decode counters' draft tokens and the
    nodes the steps verified by the reports."""
    from vllm.utils.math_utils import cdiv
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.outputs import ModelRunnerOutput

    from tests.plugins.engine_summary import build_scheduler
    from vllm.v1.spec_decode.ddtree_adaptive import BudgetReport

    _, config = _engine_config(
        models,
        _adaptive(models, tree_budget=128),
        max_num_batched_tokens=4096,
        async_scheduling=True,
    )
    sched = build_scheduler(
        config, log_stats=True, scheduler_cls=AsyncScheduler, num_blocks=1024
    )
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    # Prefix caching on (vLLM's default): blocks are hashed as the engine does.
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    block_hasher = get_request_block_hasher(16, hash_fn)
    req_ids = [f"r{i}" for i in range(4)]
    for i, req_id in enumerate(req_ids):
        params = SamplingParams(max_tokens=10_000, ignore_eos=True)
        prompt = [5 + i] * (20 + 7 * i)
        sched.add_request(_request(req_id, prompt, params, block_hasher))
    manager, lookahead = sched.kv_cache_manager, sched.num_lookahead_tokens
    pool = manager.block_pool
    worker: dict[str, list[int]] = {}
    records, counted, verified, num_compared = [], 0, 0, 0
    pending = None  # the step in flight: (scheduler output, its budget)
    budget = None
    for step in range(len(reports) + 1):
        out = sched.schedule()
        for req_id, kept in (getattr(out, "ddtree_kept_blocks", None) or {}).items():
            del worker[req_id][kept[0] :]
        for new in out.scheduled_new_reqs:
            worker[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for req_id, ids in zip(cached.req_ids, cached.new_block_ids):
            if ids is not None:
                worker[req_id].extend(ids[0])
        for req_id in req_ids:
            assert worker[req_id] == manager.get_block_ids(req_id)[0], step
            num_compared += 1
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
            )
            output.ddtree_budget = BudgetReport(prev_budget, 4, reports[step - 1])
            result = sched.update_from_output(prev, output)
            stats = result[0].scheduler_stats.spec_decoding_stats
            counted += stats.num_draft_tokens if stats is not None else 0
        # The worker verifies the report's budget of a step with drafts.
        budget = reports[step - 1] if step else None
        pending = (out, budget if out.scheduled_spec_decode_tokens else None)
    assert num_compared >= 4 * len(records)
    return records, counted, verified, num_compared, cdiv


def test_adaptive_slots_follow_the_budget_and_free_rejected_blocks(
    models, cuda_platform, monkeypatch
):
    """Async scheduling, an adaptive ``"tree_budget": 128``, four requests:
    while the worker reports budgets that need the cap, requests get 128
    draft slots; once it reports budget 3 they get 15 (room for the
    batch-wide split), the blocks past each request's computed tokens and
    the drafter's lookahead go back to the pool, and at every schedule each
    request holds exactly the blocks its tokens need (and the worker's block
    table matches the scheduler's). Without the freeing, the requests keep
    their larger trees' blocks. The spec-decode counters count the verified
    budget's nodes, not the slots."""
    reports = [127] * 4 + [3] * 10
    records, counted, verified, compared, cdiv = _adaptive_async_run(models, reports)
    given = [slots for slots, *_ in records]
    assert given[0] == set()  # the prompts
    assert 128 in set().union(*given[:5]) and given[-1] == {15}
    checked = 0
    for slots, held, need, _ in records:
        for h, n in zip(held, need):
            assert h == cdiv(n, 16), (slots, held, need)
            checked += 1
    freed = [b - a for (*_, a), (*_, b) in itertools.pairwise(records)]
    assert max(freed) > 0  # the drop returned blocks to the pool
    over = sum(records[-1][1]) - sum(cdiv(n - 16, 16) for n in records[-1][2])
    print(
        f"schedules {len(records)}, blocks checked {checked}, block tables "
        f"compared {compared}; slots given {[sorted(g) for g in given]}; most "
        f"blocks freed by one schedule {max(freed)}; blocks past the computed "
        f"tokens at the end {over / 4:.2f} per request; draft tokens counted "
        f"{counted} of {verified} verified"
    )
    assert checked >= 4 * 15
    assert counted == verified > 0
    # The same reports without freeing: the cap's blocks stay held.
    from vllm.v1.spec_decode import ddtree_slots

    monkeypatch.setattr(ddtree_slots, "trim_dropped_slots", lambda sched: None)
    records, *_ = _adaptive_async_run(models, reports)
    assert any(
        h > cdiv(n, 16) for _, held, need, _ in records for h, n in zip(held, need)
    )


def test_scheduler_stats_sized_by_drafter_depth(models, cuda_platform):
    _, config = _engine_config(models, max_num_batched_tokens=4096)
    sched = _scheduler(config)
    assert sched.num_spec_tokens == 128  # vLLM's size for the stats
    stats = _observe(sched, [(128, 15), (128, 2), (0, 0), (128, 0)], invalid={"3": 120})
    assert len(stats.num_accepted_tokens_per_pos) == 15
    assert stats.num_drafts == 3  # a request with no draft tokens is no draft
    assert stats.num_draft_tokens == 128 + 128 + 8
    assert stats.num_accepted_tokens_per_pos == [2, 2] + [1] * 13
    assert stats.num_draft_tokens_per_pos == [3] * 8 + [2] * 7


def test_scheduler_stats_of_dflash_are_vllms(models, cuda_platform):
    _, drafter = models
    _, config = _engine_config(
        models,
        {"method": "dflash", "model": drafter, "num_speculative_tokens": 15},
        max_num_batched_tokens=4096,
    )
    sched = _scheduler(config)
    assert "make_spec_decoding_stats" not in vars(sched)
    stats = _observe(sched, [(15, 15), (15, 2)])
    assert stats.num_accepted_tokens_per_pos == [2, 2] + [1] * 13


def _per_position_series(vllm_config, stats=None) -> dict[str, float]:
    """Position -> accepted count of vLLM's Prometheus logger, after ``stats``."""
    import prometheus_client
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    logger = PrometheusStatLogger(vllm_config, engine_indexes=[0])
    if stats is not None:
        logger.spec_decoding_prom.observe(stats)
    series = {}
    for metric in prometheus_client.REGISTRY.collect():
        if metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            series.update(
                (s.labels["position"], s.value)
                for s in metric.samples
                if s.name.endswith("_total")
            )
    return series


def test_prometheus_series_per_drafter_position(models, cuda_platform):
    _, drafter = models
    _, ddtree = _engine_config(models, max_num_batched_tokens=4096)
    stats = _observe(_scheduler(ddtree), [(128, 15), (128, 2)])
    series = _per_position_series(ddtree, stats)
    assert series == {str(p): (2.0 if p < 2 else 1.0) for p in range(15)}
    assert ddtree.speculative_config.num_speculative_tokens == 128  # unchanged
    # A chain keeps vLLM's series, one per draft token.
    _, dflash = _engine_config(
        models,
        {"method": "dflash", "model": drafter, "num_speculative_tokens": 7},
        max_num_batched_tokens=4096,
    )
    assert list(_per_position_series(dflash)) == [str(p) for p in range(7)]
