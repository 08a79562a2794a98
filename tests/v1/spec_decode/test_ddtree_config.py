# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree's speculative config (``vllm/v1/spec_decode/ddtree_config.py``):
parsing, every error message, the engine checks, the batch limits and CUDA-graph
sizes, the adaptive budget's caps and slots, and the config's round trip (CPU,
no engine built); the ``SpeculativeConfig`` fields that call these functions
are tested in test_ddtree_method_config.py."""

import types

import pytest

from vllm.v1.attention.backends.tree_attn import TREE_ATTN_NAME
from vllm.v1.spec_decode import ddtree_config as ddt
from vllm.v1.spec_decode.ddtree_config import DDTreeConfig

CFG = DDTreeConfig(tree_budget=128, draft_depth=15)


# ---------------------------------------------------------------------------
# parse_speculative_config
# ---------------------------------------------------------------------------


ADAPTIVE = {"adaptive_budget": True}
FIXED = {"adaptive_budget": False}


def test_parse_maps_onto_dflash():
    parsed = ddt.parse_speculative_config(
        {
            "method": "ddtree",
            "model": "d",
            "tree-budget": 32,
            "revision": "main",
            **ADAPTIVE,
        }
    )
    assert parsed.tree_budget == 32 and parsed.adaptive and parsed.schedule == ()
    # Adaptive: vLLM's schedule lists every ladder budget (one CUDA graph set
    # each); the scheduler's own draft slots replace its lookup.
    assert parsed.dflash == {
        "model": "d",
        "revision": "main",
        "method": "dflash",
        "num_speculative_tokens": 32,
        "num_speculative_tokens_per_batch_size": [
            [1, 1, 32],
            [2, 2, 31],
            [3, 3, 15],
            [4, 4, 7],
            [5, 5, 3],
            [6, 6, 1],
            [7, 7, 0],
        ],
    }
    budget, dflash, adaptive, schedule = ddt.parse_speculative_config(
        {"method": "ddtree", "model": "d", "tree-budget": 32, **FIXED}
    )
    assert (budget, adaptive, schedule) == (32, False, ())
    assert dflash == {"model": "d", "method": "dflash", "num_speculative_tokens": 32}
    # The adaptive budget is the default.
    assert (
        ddt.parse_speculative_config(
            {"method": "ddtree", "model": "d", "tree-budget": 32, "revision": "main"}
        )
        == parsed
    )


def test_parse_default_budget_is_auto():
    """No tree_budget: 'auto'. Adaptive (the default): the cost model decides,
    up to AUTO_TREE_BUDGET_CAP (128) nodes per request; fixed budgets: the
    measured per-batch-size schedule."""
    assert ddt.DEFAULT_TREE_BUDGET == ddt.AUTO_TREE_BUDGET == "auto"
    adaptive = ddt.parse_speculative_config({"method": "ddtree", "model": "d"})
    assert adaptive == ddt.parse_speculative_config(
        {"method": "ddtree", "model": "d", "tree_budget": "auto", **ADAPTIVE}
    )
    default = ddt.parse_speculative_config(
        {"method": "ddtree", "model": "d", "tree_budget": "auto", **FIXED}
    )
    assert not default.adaptive
    assert adaptive.tree_budget == ddt.AUTO_TREE_BUDGET_CAP == 128
    assert adaptive.adaptive and adaptive.schedule == ()
    listed = [b for *_, b in adaptive.dflash["num_speculative_tokens_per_batch_size"]]
    assert listed == [128, 127, 63, 31, 15, 7, 3, 1, 0]
    budget, dflash, _, _ = default
    schedule = [list(e) for e in ddt.AUTO_TREE_BUDGET_PER_BATCH_SIZE]
    assert dflash["num_speculative_tokens_per_batch_size"] == schedule
    assert budget == dflash["num_speculative_tokens"] == 31
    # A schedule of the user's own replaces the default.
    budget, dflash, _, _ = ddt.parse_speculative_config(
        {
            "method": "ddtree",
            "model": "d",
            "tree_budget_per_batch_size": [[1, 8, 7]],
            **FIXED,
        }
    )
    assert budget == 7 and dflash["num_speculative_tokens_per_batch_size"] == [
        [1, 8, 7]
    ]


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_parse_bad_adaptive_flag(value):
    with pytest.raises(ValueError, match="adaptive_budget must be true .* or false"):
        ddt.parse_speculative_config(
            {"method": "ddtree", "model": "d", "adaptive_budget": value}
        )


@pytest.mark.parametrize("budget", [1, 7, 1024])
def test_parse_budget_range(budget):
    assert (
        ddt.parse_speculative_config(
            {"method": "ddtree", "model": "d", "tree_budget": budget}
        )[0]
        == budget
    )


@pytest.mark.parametrize(
    "budget, match",
    [
        (0, r"tree_budget must be in \[1, 1024\], got 0"),
        (1025, r"tree_budget must be in \[1, 1024\], got 1025"),
        (-3, r"got -3"),
        (12.5, r"tree_budget must be an integer in \[1, 1024\] or 'auto', got 12.5"),
        ("Auto", r"or 'auto', got 'Auto'"),
        ("128", r"must be an integer .* got '128'"),
        (True, r"must be an integer .* got True"),
        (None, r"must be an integer .* got None"),
    ],
)
def test_parse_bad_budget(budget, match):
    with pytest.raises(ValueError, match=match):
        ddt.parse_speculative_config(
            {"method": "ddtree", "model": "d", "tree_budget": budget}
        )


@pytest.mark.parametrize(
    "raw, match",
    [
        (
            {"method": "ddtree", "model": "d", "num_speculative_tokens": 15},
            "sizes its trees with 'tree_budget' .*; remove 'num_speculative_tokens'",
        ),
        ({"method": "ddtree"}, "needs 'model': the path or Hugging Face name"),
        ({"method": "ddtree", "model": ""}, "needs 'model'"),
        (
            {"method": "ddtree", "model": "d", "draft_sample_method": "greedy"},
            "does not take 'draft_sample_method'",
        ),
        (
            {"method": "ddtree", "model": "d", "parallel_drafting": True, "x": 1},
            "does not take 'parallel_drafting', 'x'",
        ),
        (
            {"method": "ddtree", "model": "d", "attention_backend": TREE_ATTN_NAME},
            f"cannot use TREE_ATTN \\({TREE_ATTN_NAME}\\), which is causal-only",
        ),
    ],
)
def test_parse_errors(raw, match):
    with pytest.raises(ValueError, match=match):
        ddt.parse_speculative_config(raw)


SCHEDULE = [[1, 1, 64], [2, 8, 16], [9, 64, 4]]


def test_parse_budget_schedule_maps_onto_dynamic_sd():
    parsed = ddt.parse_speculative_config(
        {
            "method": "ddtree",
            "model": "d",
            "tree_budget_per_batch_size": SCHEDULE,
            **FIXED,
        }
    )
    budget, dflash = parsed.tree_budget, parsed.dflash
    assert budget == 64
    assert dflash["num_speculative_tokens"] == 64
    assert dflash["num_speculative_tokens_per_batch_size"] == [
        [1, 1, 64],
        [2, 8, 16],
        [9, 64, 4],
    ]
    # tree_budget may repeat the largest budget; ranges may come unsorted.
    assert (
        ddt.parse_speculative_config(
            {
                "method": "ddtree",
                "model": "d",
                "tree_budget": 64,
                "tree-budget-per-batch-size": SCHEDULE[::-1],
                **FIXED,
            }
        )
        == parsed
    )
    # Adaptive: the schedule's budgets are per-request caps by batch size,
    # and each is a budget a step may choose.
    adaptive = ddt.parse_speculative_config(
        {
            "method": "ddtree",
            "model": "d",
            "tree_budget_per_batch_size": SCHEDULE,
            **ADAPTIVE,
        }
    )
    assert adaptive.adaptive and adaptive.schedule == (
        (1, 1, 64),
        (2, 8, 16),
        (9, 64, 4),
    )
    listed = [b for *_, b in adaptive.dflash["num_speculative_tokens_per_batch_size"]]
    assert listed == [64, 63, 31, 16, 15, 7, 4, 3, 1, 0]


def test_adaptive_ladder_of_at_most_sixteen_budgets():
    """The budget kernels estimate up to 16 budgets at once: a schedule whose
    caps make more is refused when the config is parsed, not at start-up."""
    caps = [1000, 900, 800, 700, 600, 500, 400]
    schedule = [[i + 1, i + 1, c] for i, c in enumerate(caps)]
    raw = {"method": "ddtree", "model": "d", "tree_budget_per_batch_size": schedule}
    with pytest.raises(ValueError, match=r"17 budgets to choose from .*at most 16"):
        ddt.parse_speculative_config({**raw, **ADAPTIVE})
    # Fixed budgets have no ladder; six caps fit.
    assert not ddt.parse_speculative_config({**raw, **FIXED}).adaptive
    six = [[i + 1, i + 1, c] for i, c in enumerate(caps[1:])]
    ok = {**raw, "tree_budget_per_batch_size": six, **ADAPTIVE}
    listed = ddt.parse_speculative_config(ok).dflash[
        "num_speculative_tokens_per_batch_size"
    ]
    assert len(listed) == 16


@pytest.mark.parametrize(
    "schedule, match",
    [
        ([], "must not be empty"),
        ("auto", "must be a non-empty list"),
        ([[1, 4]], "3-item sequence"),
        ([[2, 8, 16]], "first batch-size range must start at 1"),
        ([[1, 8, 16], [4, 9, 8]], "non-overlapping"),
        ([[1, 8, 0]], r"batch sizes 1-8 must be in \[1, 1024\], got 0"),
        ([[1, 8, 2048]], r"must be in \[1, 1024\], got 2048"),
        ([[1, 8, 1.5]], r"of integers, got \[1, 8, 1.5\]"),
        ([[1, 8, "16"]], "of integers"),
    ],
)
def test_parse_bad_budget_schedule(schedule, match):
    with pytest.raises(ValueError, match=match) as info:
        ddt.parse_speculative_config(
            {"method": "ddtree", "model": "d", "tree_budget_per_batch_size": schedule}
        )
    # Errors speak of the ddtree key, not of vLLM's underlying one.
    assert "num_speculative_tokens" not in str(info.value)


def test_parse_budget_schedule_conflicts():
    with pytest.raises(
        ValueError,
        match=r"tree_budget=128 must equal the largest "
        r"budget of tree_budget_per_batch_size \(64\)",
    ):
        ddt.parse_speculative_config(
            {
                "method": "ddtree",
                "model": "d",
                "tree_budget": 128,
                "tree_budget_per_batch_size": SCHEDULE,
            }
        )
    with pytest.raises(
        ValueError,
        match="remove 'num_speculative_tokens' and "
        "'num_speculative_tokens_per_batch_size'",
    ):
        ddt.parse_speculative_config(
            {
                "method": "ddtree",
                "model": "d",
                "num_speculative_tokens_per_batch_size": SCHEDULE,
            }
        )


def test_parse_auto_budget_is_the_measured_schedule():
    budget, dflash, _, _ = ddt.parse_speculative_config(
        {"method": "ddtree", "model": "d", "tree_budget": "auto", **FIXED}
    )
    auto = [tuple(e) for e in ddt.AUTO_TREE_BUDGET_PER_BATCH_SIZE]
    assert [tuple(e) for e in dflash["num_speculative_tokens_per_batch_size"]] == auto
    assert budget == dflash["num_speculative_tokens"] == max(b for *_, b in auto)
    assert "tree_budget" not in dflash
    # The table itself passes the schedule checks a user's schedule passes.
    assert ddt.parse_budget_schedule([list(e) for e in auto]) == auto
    # Small batches get the deepest trees; budgets never grow with the batch.
    budgets = [b for *_, b in auto]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]


def test_parse_auto_budget_conflicts_with_a_schedule():
    with pytest.raises(
        ValueError,
        match="tree_budget='auto' picks the budget itself; drop "
        "tree_budget_per_batch_size",
    ):
        ddt.parse_speculative_config(
            {
                "method": "ddtree",
                "model": "d",
                "tree_budget": "auto",
                "tree_budget_per_batch_size": SCHEDULE,
            }
        )


def _sized_target(max_model_len, vocab_size=151936):
    return types.SimpleNamespace(
        model="t", max_model_len=max_model_len, get_vocab_size=lambda: vocab_size
    )


@pytest.mark.parametrize(
    "max_model_len, vocab_size, limit, want",
    [
        # A Qwen3-8B default: auto's cap.
        (40960, 151936, 20478, 128),
        # 128 + 2 prompt tokens, then a 129-token step.
        (259, 151936, 128, 128),
        (258, 151936, 127, 127),
        (256, 151936, 126, 126),
        (2048, 151936, 1022, 128),
        (64, 151936, 30, 30),
        (5, 151936, 1, 1),
        # Token ids 0 .. B + 1 must be in the vocabulary.
        (40960, 130, 128, 128),
        (40960, 129, 127, 127),
    ],
)
def test_auto_cap_fits_the_start_up_warm_up(max_model_len, vocab_size, limit, want):
    """vLLM's warm-up prefills B + 2 prompt tokens with ids 0 .. B + 1, then
    decodes B + 1 tokens per request: "auto" (an adaptive budget's cap of 128)
    takes the largest budget that fits the target where 128 does not, and so
    does every budget of auto's fixed schedule."""
    target = _sized_target(max_model_len, vocab_size)
    assert ddt.max_warmup_budget(target) == limit
    parsed = ddt.parse_speculative_config({"method": "ddtree", "model": "d"}, target)
    assert parsed.tree_budget == parsed.dflash["num_speculative_tokens"] == want
    listed = [b for *_, b in parsed.dflash["num_speculative_tokens_per_batch_size"]]
    assert listed[0] == want and max(listed) == want
    assert ddt.tree_budget_of(target_model_config=target).tree_budget == want
    fixed = ddt.tree_budget_of("auto", None, False, target)
    auto = ddt.AUTO_TREE_BUDGET_PER_BATCH_SIZE
    assert fixed.schedule == tuple((f, l, min(b, want)) for f, l, b in auto)
    ddt.check_warmup_budget(limit, target)
    with pytest.raises(ValueError, match=f"at most {limit}$"):
        ddt.check_warmup_budget(limit + 1, target)


def _run_vllms_warm_up(monkeypatch, tree_budget, max_model_len, vocab_size):
    """vLLM's own ``warmup_kernels`` on a stand-in runner for trees of
    ``tree_budget`` nodes (decode_query_len B + 1): the largest prompt token
    id it feeds, and the most blocks it gives one request, against the
    block-table row ``GPUModelRunner.initialize_kv_cache`` sizes."""
    import torch

    from vllm.utils.math_utils import cdiv
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.gpu import warmup

    block = 16
    spec = FullAttentionSpec(
        block_size=block, num_kv_heads=1, head_size=64, dtype=torch.float16
    )
    runner = types.SimpleNamespace(
        num_speculative_steps=tree_budget,
        decode_query_len=tree_budget + 1,
        kv_cache_config=types.SimpleNamespace(
            kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=spec)],
            num_blocks=1 << 20,
        ),
        model_state=types.SimpleNamespace(),
        is_encoder_decoder=False,
        scheduler_config=types.SimpleNamespace(
            max_num_seqs=4, max_num_batched_tokens=1 << 20
        ),
        is_pooling_model=False,
        is_last_pp_rank=True,
        model_config=types.SimpleNamespace(get_vocab_size=lambda: vocab_size),
        kv_connector=types.SimpleNamespace(set_disabled=lambda disabled: None),
    )
    steps = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda: None)
    warmup.warmup_kernels(runner, steps.append, lambda grammar_output: None)
    prefill, decode = steps[0], steps[1]
    max_id = max(max(r.prompt_token_ids) for r in prefill.scheduled_new_reqs)
    blocks = [len(r.block_ids[0]) for r in prefill.scheduled_new_reqs]
    added = decode.scheduled_cached_reqs.new_block_ids
    blocks = [n + len(b[0]) if b else n for n, b in zip(blocks, added)]
    # initialize_kv_cache: the row holds max_model_len, in whole groups of
    # 128 tokens.
    align = 128 // block
    row = cdiv(cdiv(max_model_len, block), align) * align
    return max_id, max(blocks), row


@pytest.mark.parametrize(
    "max_model_len, vocab_size", [(2048, 151936), (40960, 1024), (4000, 151936)]
)
def test_bound_holds_vllms_own_warm_up(monkeypatch, max_model_len, vocab_size):
    """At the budget max_warmup_budget allows, vLLM's warm-up feeds only token
    ids of the vocabulary and fits every request in its block-table row; where
    the bound is tight (max_model_len a multiple of 128, or the vocabulary),
    one node more breaks one of the two."""
    target = _sized_target(max_model_len, vocab_size)
    limit = ddt.max_warmup_budget(target)
    max_id, blocks, row = _run_vllms_warm_up(
        monkeypatch, limit, max_model_len, vocab_size
    )
    assert max_id < vocab_size and blocks <= row, (max_id, blocks, row)
    if max_model_len % 128 == 0 or vocab_size - 2 == limit:
        max_id, blocks, row = _run_vllms_warm_up(
            monkeypatch, limit + 1, max_model_len, vocab_size
        )
        assert max_id >= vocab_size or blocks > row, (max_id, blocks, row)


def test_no_target_no_bound():
    assert ddt.max_warmup_budget(None) is None
    assert ddt.tree_budget_of().tree_budget == ddt.AUTO_TREE_BUDGET_CAP
    ddt.check_warmup_budget(ddt.AUTO_TREE_BUDGET_CAP, None)


@pytest.mark.parametrize(
    "raw, target, match",
    [
        (
            {"tree_budget": 1024},
            _sized_target(2048),
            r"^DDTree: tree_budget 1024 needs --max-model-len >= 2051 \(vLLM's "
            r"start-up warm-up runs a 1026-token prompt, then a 1025-token tree "
            r"step per request\); 't' runs at max_model_len=2048: raise it, or "
            r"set tree_budget to at most 1022$",
        ),
        ({"tree_budget": 600, **FIXED}, _sized_target(1024), r"at most 510$"),
        (
            {"tree_budget_per_batch_size": [[1, 4, 1023], [5, 64, 15]], **FIXED},
            _sized_target(2048),
            r"^DDTree: the largest budget of tree_budget_per_batch_size 1023 "
            r"needs --max-model-len >= 2049 .*to at most 1022$",
        ),
        (
            {},
            _sized_target(4),
            r"^DDTree cannot run on 't' at max_model_len=4: .*needs max_model_len "
            r">= 5",
        ),
        (
            {"tree_budget": 1024},
            _sized_target(40960, 1024),
            r"^DDTree: tree_budget 1024 is too large for 't': vLLM's start-up "
            r"warm-up feeds token ids up to 1025, and its vocabulary has 1024 "
            r"tokens; set tree_budget to at most 1022$",
        ),
    ],
)
def test_budget_too_large_for_the_warm_up(raw, target, match):
    with pytest.raises(ValueError, match=match):
        ddt.parse_speculative_config({"method": "ddtree", "model": "d", **raw}, target)


def test_budget_that_fits_the_warm_up_is_kept():
    target = _sized_target(2048)
    for raw, want in [
        ({"tree_budget": 1022}, 1022),
        ({"tree_budget": 64, **FIXED}, 64),
        ({"tree_budget": "auto", **FIXED}, 31),
    ]:
        parsed = ddt.parse_speculative_config(
            {"method": "ddtree", "model": "d", **raw}, target
        )
        assert parsed.tree_budget == want, raw


def test_cudagraph_sizes_cover_every_scheduled_budget():
    cfg = DDTreeConfig(64, 15, (4, 16))
    assert cfg.all_budgets == (4, 16, 64)
    # Up to a maximum the user raised, every budget and the drafter get
    # graphs for every batch.
    sizes = ddt.cudagraph_capture_sizes(cfg, 32, 8192, max_size=4096)
    for verify_len in (5, 17, 65, 16):
        counts = {s // verify_len for s in sizes if s % verify_len == 0}
        assert {1, 2, 4, 8, 16, 24, 32} <= counts, verify_len
    # Under vLLM's default maximum (512 tokens), the batches that fit.
    sizes = ddt.cudagraph_capture_sizes(cfg, 32, 8192)
    assert sizes[-1] == 512
    for verify_len, most in ((5, 32), (17, 24), (65, 4), (16, 32)):
        counts = {s // verify_len for s in sizes if s % verify_len == 0}
        want = {n for n in (1, 2, 4, 8, 16, 24, 32) if n <= most}
        assert want <= counts, verify_len
    assert DDTreeConfig.from_dict(cfg.to_dict()) == cfg
    # Configs written before step_budgets existed still read.
    assert DDTreeConfig.from_dict({"tree_budget": 8, "draft_depth": 15}) == (
        DDTreeConfig(8, 15)
    )


def test_is_ddtree_method():
    assert ddt.is_ddtree_method({"method": "ddtree"})
    assert not ddt.is_ddtree_method({"method": "dflash"})
    assert not ddt.is_ddtree_method(None)


# ---------------------------------------------------------------------------
# Drafter, engine and request checks
# ---------------------------------------------------------------------------


def _draft_config(arch="DFlashDraftModel", block_size=16):
    return types.SimpleNamespace(
        architecture=arch,
        model="drafter",
        hf_config=types.SimpleNamespace(block_size=block_size),
    )


def test_draft_depth_is_block_size_minus_one():
    assert ddt.draft_depth_of(_draft_config(block_size=16)) == 15
    assert ddt.draft_depth_of(_draft_config(block_size=2)) == 1
    assert ddt.draft_depth_of(_draft_config(block_size=17)) == 16


def test_draft_depth_rejects_non_dflash():
    with pytest.raises(
        ValueError,
        match="drafts with a DFlash drafter, but 'drafter' is a Eagle3LlamaForCausalLM",
    ):
        ddt.draft_depth_of(_draft_config(arch="Eagle3LlamaForCausalLM"))


@pytest.mark.parametrize("block_size", [None, 1, 18, "16"])
def test_draft_depth_rejects_bad_block_size(block_size):
    with pytest.raises(ValueError, match=r"integer 'block_size' in \[2, 17\]"):
        ddt.draft_depth_of(_draft_config(block_size=block_size))


@pytest.mark.parametrize(
    "backend", [None, TREE_ATTN_NAME, TREE_ATTN_NAME.lower(), "auto"]
)
def test_target_backend_is_tree_attn(backend):
    # TREE_ATTN's enum member: its own, or CUSTOM where vLLM has none.
    assert ddt.target_attention_backend(backend) == TREE_ATTN_NAME


def test_target_backend_conflict():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    with pytest.raises(
        ValueError, match="backend is set to FLASH_ATTN; drop --attention-backend"
    ):
        ddt.target_attention_backend(AttentionBackendEnum.FLASH_ATTN)


def _args(**overrides):
    args = dict(
        pipeline_parallel_size=1,
        decode_context_parallel_size=1,
        prefill_context_parallel_size=1,
        enable_lora=False,
        kv_cache_dtype="auto",
        kv_transfer_config=None,
        data_parallel_size=1,
    )
    args.update(overrides)
    return types.SimpleNamespace(**args)


def _target(**overrides):
    model = dict(
        model="target",
        runner_type="generate",
        is_multimodal_model=False,
        uses_mrope=False,
        uses_xdrope_dim=0,
        is_hybrid=False,
        is_attention_free=False,
        is_encoder_decoder=False,
    )
    sliding_window = overrides.pop("sliding_window", None)
    model.update(overrides)
    return types.SimpleNamespace(**model, get_sliding_window=lambda: sliding_window)


@pytest.mark.parametrize(
    "args, target, match",
    [
        (_args(pipeline_parallel_size=2), _target(), "pipeline parallelism"),
        (
            _args(decode_context_parallel_size=2),
            _target(),
            "decode context parallelism",
        ),
        (
            _args(prefill_context_parallel_size=2),
            _target(),
            "prefill context parallelism",
        ),
        (_args(enable_lora=True), _target(), "LoRA adapters; drop --enable-lora"),
        (
            _args(kv_transfer_config={"kv_connector": "LMCacheConnectorV1"}),
            _target(),
            "KV connectors .* drop --kv-transfer-config",
        ),
        (
            _args(kv_offloading_size=4.0),
            _target(),
            "KV offloading .* drop --kv-offloading-size",
        ),
        (
            _args(data_parallel_size=2),
            _target(),
            "data parallelism .* drop --data-parallel-size",
        ),
        (
            _args(kv_cache_dtype="fp8"),
            _target(),
            "kv_cache_dtype='fp8' .* use --kv-cache-dtype auto",
        ),
        (_args(), _target(uses_mrope=True), "multi-dimensional RoPE"),
        (_args(), _target(is_multimodal_model=True), "multimodal inputs"),
        (_args(), _target(sliding_window=4096), "sliding-window attention"),
        (_args(), _target(is_hybrid=True), "hybrid"),
        (_args(), _target(is_encoder_decoder=True), "encoder-decoder"),
        (_args(), _target(runner_type="pooling"), "text-generation models"),
    ],
)
def test_engine_checks(args, target, match):
    with pytest.raises(
        ValueError, match="DDTree speculative decoding does not support .*" + match
    ):
        ddt.check_engine_args(args, target)


def test_engine_checks_pass():
    ddt.check_engine_args(_args(kv_cache_dtype="bfloat16"), _target())


# ---------------------------------------------------------------------------
# Batch limits and CUDA-graph sizes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg, seqs, tokens, user, want",
    [
        # Defaults fitted: fewer sequences at large budgets, tokens kept.
        (CFG, 1024, 8192, (False, False), (63, 8192)),
        (CFG, 1024, 16384, (False, False), (127, 16384)),
        (DDTreeConfig(1024, 15), 1024, 8192, (False, False), (7, 8192)),
        (DDTreeConfig(1024, 15), 1024, 1000, (False, False), (1, 1025)),
        # Small budgets: the drafter's 16 tokens per request bound the batch.
        (DDTreeConfig(1, 15), 1024, 8192, (False, False), (512, 8192)),
        # User's max_num_seqs kept, tokens raised to fit full trees.
        (CFG, 80, 8192, (True, False), (80, 80 * 129)),
        (CFG, 8, 8192, (True, False), (8, 8192)),
        # User's tokens kept, sequences fitted.
        (CFG, 1024, 1000, (False, True), (7, 1000)),
        # Both from the user and consistent.
        (CFG, 4, 1000, (True, True), (4, 1000)),
        # Both from the user, trees trimmed at full batches (a warning).
        (CFG, 32, 1000, (True, True), (32, 1000)),
    ],
)
def test_batch_limits(cfg, seqs, tokens, user, want):
    assert ddt.batch_limits(cfg, seqs, tokens, *user) == want


def test_batch_limits_too_few_tokens():
    with pytest.raises(
        ValueError,
        match=r"max_num_batched_tokens=100 cannot hold "
        r"one DDTree step \(129 tokens per request for "
        r"tree_budget=128\); raise --max-num-batched-tokens to at "
        r"least 129 or lower tree_budget",
    ):
        ddt.batch_limits(CFG, 8, 100, False, True)


def test_batch_limits_drafter_does_not_fit():
    with pytest.raises(
        ValueError,
        match="max_num_seqs=100 requests need 16 drafter "
        "tokens each, more than max_num_batched_tokens=1000; raise "
        "--max-num-batched-tokens to at least 1600 or lower "
        "--max-num-seqs",
    ):
        ddt.batch_limits(DDTreeConfig(8, 15), 100, 1000, True, True)


# vLLM's default sizes up to 512 tokens (VllmConfig._set_cudagraph_sizes).
VLLM_LADDER = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]


def test_cudagraph_sizes_default_to_vllms_maximum():
    """Graphs up to vLLM's 512 tokens: its own ladder (mixed steps) plus the
    multiples of B + 1 and D + 1 below it. Sizes up to max_num_batched_tokens
    cost the 8B target on the H200 more graph memory than vLLM leaves free
    (MRv2 sizes the KV cache before capturing)."""
    sizes = ddt.cudagraph_capture_sizes(CFG, 63, 8192)
    assert sizes == sorted(set(sizes)) and sizes[-1] == 512
    assert set(VLLM_LADDER) <= set(sizes)
    assert [s // 129 for s in sizes if s % 129 == 0] == [1, 2]
    draft = {s // 16 for s in sizes if s % 16 == 0}
    assert {1, 2, 4, 8, 16, 24, 32} <= draft
    assert set(sizes) - set(VLLM_LADDER) == {129, 258}
    assert ddt.default_max_capture_size(CFG, 63, 8192) == 512
    # A batch too small for 512 tokens: twice a full batch, as vLLM's rule.
    small = DDTreeConfig(4, 15)
    assert ddt.cudagraph_capture_sizes(small, 1, 8192) == [1, 2, 4, 5, 8, 16, 24, 32]
    # One request's tree is always captured, even past 512 tokens.
    big = DDTreeConfig(512, 15)
    assert ddt.cudagraph_capture_sizes(big, 32, 16416)[-1] == 513
    # Never above the step limit.
    assert ddt.cudagraph_capture_sizes(CFG, 63, 300)[-1] == 300


def test_cudagraph_sizes_up_to_a_users_maximum():
    sizes = ddt.cudagraph_capture_sizes(CFG, 63, 8192, max_size=8192)
    assert sizes[-1] == 8192
    verify = [s // 129 for s in sizes if s % 129 == 0]
    assert verify == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 63]
    draft = [s // 16 for s in sizes if s % 16 == 0]
    assert {1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 63} <= set(draft)
    above = [s for s in sizes if s > 512]
    assert above and all(s % 129 == 0 or s % 16 == 0 for s in above[:-1])
    assert ddt.cudagraph_capture_sizes(CFG, 63, 1000, max_size=4096)[-1] == 1000
    # performance_mode="interactivity": every size up to 32, as vLLM's.
    fine = ddt.cudagraph_capture_sizes(CFG, 63, 8192, interactivity=True)
    assert set(range(1, 33)) <= set(fine)


@pytest.mark.parametrize(
    "cfg,seqs,tokens,largest,want",
    [
        (DDTreeConfig(128, 15), 63, 8192, 512, 4),  # 3 trees of 129 fit 512
        (DDTreeConfig(127, 15), 63, 8192, 512, 5),
        (DDTreeConfig(31, 15), 256, 8192, 512, 17),
        (DDTreeConfig(128, 15), 3, 8192, 512, None),  # every batch fits a graph
        (DDTreeConfig(128, 15), 8, 512, 512, None),  # trimmed to the graph
        (DDTreeConfig(128, 15), 63, 8192, 8192, None),  # a raised maximum
        (DDTreeConfig(15, 15), 256, 8192, 512, None),  # DFlash's rows
        (DDTreeConfig(7, 15), 256, 8192, 512, None),
        (DDTreeConfig(16, 15), 256, 8192, 20, None),  # DFlash's chains miss it too
        (DDTreeConfig(128, 15, (15, 31)), 63, 8192, 512, None),  # a schedule
        (DDTreeConfig(128, 15), 63, 8192, 0, None),  # no graphs
    ],
)
def test_first_ungraphed_batch(cfg, seqs, tokens, largest, want):
    assert ddt.first_ungraphed_batch(cfg, seqs, tokens, largest) == want


def test_config_roundtrip():
    vllm_config = types.SimpleNamespace(
        additional_config={"vllm_ddtree": CFG.to_dict()},
        speculative_config=types.SimpleNamespace(
            method="dflash", num_speculative_tokens=CFG.tree_budget
        ),
    )
    # The plugin's home for the settings; a vLLM that takes method "ddtree"
    # (the series applied) never reads it.
    want = None if ddt.vllm_has_ddtree_method() else CFG
    assert DDTreeConfig.from_vllm_config(vllm_config) == want
    assert DDTreeConfig.from_dict(CFG.to_dict()) == CFG
    assert CFG.verify_len == 129 and CFG.draft_len == 16
    assert CFG.tokens_per_request == 129
    assert DDTreeConfig(4, 15).tokens_per_request == 16
    vllm_config.speculative_config = None
    assert DDTreeConfig.from_vllm_config(vllm_config) is None
    assert DDTreeConfig.from_vllm_config(types.SimpleNamespace()) is None


# ---------------------------------------------------------------------------
# The adaptive budget's per-request caps and the scheduler's slots
# ---------------------------------------------------------------------------


def test_scheduled_tree_budgets_follow_the_users_caps():
    cfg = DDTreeConfig(
        64, 15, (1, 3, 7, 15, 16, 31, 63), adaptive=True, caps=((1, 1, 64), (2, 8, 16))
    )
    lookup = ddt.scheduled_tree_budgets(cfg, 64, 8192, 512)
    assert lookup[1] == 64 and lookup[2:9] == [16] * 7
    # Past the last range its cap carries on, within the step's span.
    assert lookup[9] == 16 and lookup[40] == 16 and lookup[64] == 15
    assert cfg.cap_for(100) == 16 and DDTreeConfig(8, 15).cap_for(3) == 8
    assert ddt.ladder_floor((0, 1, 3, 7), 6) == 3
    assert ddt.ladder_floor((0, 1, 3, 7), 0) == 0
    assert DDTreeConfig.from_dict(cfg.to_dict()) == cfg


def test_slot_counts_are_few():
    """The scheduler's slot counts (the drafter's tree widths and the budget's
    compiled kernel variants follow them): 0, 4**k - 1, the caps."""
    cfg = DDTreeConfig(1024, 15, ddt.adaptive_ladder(1024)[1:-1], adaptive=True)
    assert ddt.slot_ladder(cfg) == (0, 3, 15, 63, 255, 1023, 1024)
    lookup = ddt.scheduled_tree_budgets(cfg, 512, 8192, 512)
    assert sorted(set(lookup)) == [0, 3, 15, 63, 255, 1023]
    capped = DDTreeConfig(
        64, 15, (1, 3, 7, 15, 16, 31, 63), adaptive=True, caps=((1, 1, 64), (2, 8, 16))
    )
    assert ddt.slot_ladder(capped) == (0, 3, 15, 16, 63, 64)
