# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/bench_ddtree.py and benchmarks/project_8b.py on the CPU: arguments,
engine configs, prompts, metric arithmetic, resume, ratio tables, projections.
The GPU parts (engines) are replaced by fakes; the 8B model configs go through
vLLM's own config checks (no weights, no tokenizer)."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from benchmarks import bench_ddtree as bd
from benchmarks import bench_ddtree_config as bdc
from benchmarks import bench_ddtree_offline as bdo
from benchmarks import bench_ddtree_procs as bdp
from benchmarks import bench_ddtree_report as rep
from benchmarks import bench_ddtree_serve as bds
from benchmarks import host_usage as hu
from benchmarks import project_8b as proj

MODEL_CONFIGS = Path(bd.__file__).parent / "model_configs"
PAIR = Path(bd.__file__).parent / "models" / "pycode"


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------


def test_configs_expand_and_sort():
    assert bdc.parse_configs("ddtree,dflash,none", [128, 16]) == [
        "none",
        "dflash",
        "ddtree-16",
        "ddtree-128",
    ]
    assert bdc.parse_configs("ddtree-512, none,ddtree-512", [16]) == [
        "none",
        "ddtree-512",
    ]


@pytest.mark.parametrize(
    "text, match",
    [
        ("eagle", "unknown config 'eagle'"),
        ("ddtree-0", r"tree_budget must be in \[1, 1024\]"),
        ("ddtree-2048", r"tree_budget must be in \[1, 1024\]"),
        ("ddtree-x", "unknown config"),
    ],
)
def test_bad_configs(text, match):
    with pytest.raises(ValueError, match=match):
        bdc.parse_configs(text, [16])


def test_number_lists():
    assert bdc.parse_int_list("8,1,8", "--batches", 1) == [1, 8]
    assert bdc.parse_float_list("1,0", "--temperatures") == [0.0, 1.0]
    with pytest.raises(ValueError, match="--batches must be >= 1"):
        bdc.parse_int_list("0,1", "--batches", 1)
    with pytest.raises(ValueError, match=r"--budgets must be in \[1, 1024\]"):
        bdc.parse_int_list("16,4096", "--budgets", 1, 1024)
    with pytest.raises(ValueError, match="comma list of integers"):
        bdc.parse_int_list("1,two", "--batches", 1)
    with pytest.raises(ValueError, match="is empty"):
        bdc.parse_int_list(",", "--batches", 1)
    with pytest.raises(ValueError, match="must be >= 0"):
        bdc.parse_float_list("-1", "--temperatures")
    with pytest.raises(ValueError, match="must be >= 0"):
        bdc.parse_float_list("nan", "--temperatures")


def test_cost_defaults(tmp_path):
    args = bd.parse_args(["cost", "--out", str(tmp_path)])
    assert args.configs == ["none", "dflash"] + [f"ddtree-{b}" for b in bdc.ALL_BUDGETS]
    assert args.batches == [1, 4, 16, 64] and args.temperatures == [0.0]
    assert args.target == MODEL_CONFIGS / "qwen3_8b"
    assert args.drafter == MODEL_CONFIGS / "dflash_qwen3_8b"
    assert args.waves == 2 and args.max_tokens == 128


def _pair(tmp_path):
    for name in ("target", "drafter"):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "config.json").write_text("{}")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["a b c", "d e"]))
    return [
        "--target",
        str(tmp_path / "target"),
        "--drafter",
        str(tmp_path / "drafter"),
        "--prompts",
        str(prompts),
    ]


def test_e2e_defaults(tmp_path):
    args = bd.parse_args(["e2e", "--out", str(tmp_path / "out"), *_pair(tmp_path)])
    assert args.batches == [1, 8, 32] and args.temperatures == [0.0, 1.0]
    assert args.num_prompts == 32 and not args.ignore_eos


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--max-tokens", "1"], "--max-tokens must be >= 2"),
        (["--batches", "1,-8"], "--batches must be >= 1"),
        (["--budgets", "0"], r"--budgets must be in \[1, 1024\]"),
        (["--temperatures", "0,hot"], "--temperatures must be a comma list"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--limit-seconds", "-1"], "--limit-seconds must be >= 0"),
        (["--waves", "0"], "--waves must be >= 1"),
        (["--input-len", "4000", "--max-model-len", "4096"], "exceed --max-model-len"),
        (["--target", "/nonexistent"], "--target /nonexistent: no config.json"),
    ],
)
def test_bad_cost_args(tmp_path, capsys, extra, match):
    with pytest.raises(SystemExit) as err:
        bd.parse_args(["cost", "--out", str(tmp_path), *extra])
    assert err.value.code == 2
    assert re.search(match, capsys.readouterr().err)


def test_e2e_needs_a_pair(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bd.parse_args(["e2e", "--out", str(tmp_path)])
    assert "--target" in capsys.readouterr().err
    pair = _pair(tmp_path)
    pair[-1] = str(tmp_path / "missing.json")
    with pytest.raises(SystemExit):
        bd.parse_args(["e2e", "--out", str(tmp_path), *pair])
    assert "missing.json: no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bd.parse_args(
            [
                "e2e",
                "--out",
                str(tmp_path),
                *pair[:-1],
                str(tmp_path / "prompts.json"),
                "--min-waves",
                "0",
            ]
        )
    assert "--min-waves must be >= 1" in capsys.readouterr().err


def test_min_waves_in_setup_only_when_set(tmp_path):
    base = ["e2e", "--out", str(tmp_path / "o"), *_pair(tmp_path)]
    assert "min_waves" not in bdc.setup_of(bd.parse_args(base))
    args = bd.parse_args([*base, "--min-waves", "4", "--batches", "8"])
    assert bdc.setup_of(args)["min_waves"] == 4
    spec = bdo.worker_spec(args, "dflash", 8, [(8, 0.0)], ["p"] * 3, "r")
    assert len(spec["requests"]["8"]) == 4 * 8


def test_budget_trace_is_part_of_the_serve_setup(tmp_path, capsys):
    """Recorded servers pay host time for it: their rows are set apart."""
    base = ["serve", "--out", str(tmp_path / "o"), *_pair(tmp_path)]
    base += ["--configs", "none,ddtree-auto-adaptive,ddtree-128-adaptive"]
    assert "budget_trace" not in bdc.setup_of(bd.parse_args(base))
    args = bd.parse_args([*base, "--budget-trace", "--interleave", "2"])
    both = ["ddtree-128-adaptive", "ddtree-auto-adaptive"]
    assert sorted(bdc.setup_of(args)["budget_trace"]) == both
    # One recorded server next to an unrecorded copy of its config.
    one = [*base, "--interleave", "2", "--budget-trace", "ddtree-128-adaptive"]
    assert bdc.setup_of(bd.parse_args(one))["budget_trace"] == [both[0]]
    with pytest.raises(SystemExit):
        bd.parse_args([*base, "--interleave", "2", "--budget-trace", "dflash"])
    assert "each must be one of the DDTree configs" in capsys.readouterr().err
    # Its records are labelled by the interleaved slices' windows.
    with pytest.raises(SystemExit):
        bd.parse_args([*base, "--budget-trace"])
    assert "--budget-trace labels" in capsys.readouterr().err


def test_serve_cells_are_long_enough(tmp_path, capsys):
    """Serve cells: 32 waves of the concurrency, at most --max-prompts requests,
    never fewer than --num-prompts; the cap is part of the setup."""
    base = ["serve", "--out", str(tmp_path / "o"), *_pair(tmp_path)]
    args = bd.parse_args(base)
    counts = {c: bds.serve_num_prompts(args, c) for c in (1, 8, 32, 64)}
    assert counts == {1: 32, 8: 256, 32: 512, 64: 512}
    assert bdc.setup_of(args)["max_prompts"] == 512
    capped = bd.parse_args([*base, "--max-prompts", "128"])
    assert [bds.serve_num_prompts(capped, c) for c in (1, 8, 64)] == [32, 128, 128]
    assert bdc.setup_of(capped)["max_prompts"] == 128
    more = bd.parse_args([*base, "--num-prompts", "1000", "--max-prompts", "128"])
    assert bds.serve_num_prompts(more, 64) == 1000  # --num-prompts is kept
    assert "max_prompts" not in bdc.setup_of(
        bd.parse_args(["e2e", "--out", str(tmp_path / "e"), *_pair(tmp_path)])
    )
    with pytest.raises(SystemExit):
        bd.parse_args([*base, "--max-prompts", "0"])
    assert "--max-prompts must be >= 1" in capsys.readouterr().err


def test_continuous_arrivals_option(tmp_path, capsys):
    """--arrivals continuous: e2e only, one batch per command, in the setup (so
    its rows never merge with waves' rows) and in the worker's spec."""
    base = ["e2e", "--out", str(tmp_path / "o"), *_pair(tmp_path)]
    waves = bd.parse_args(base)
    assert waves.arrivals == "waves" and "arrivals" not in bdc.setup_of(waves)
    args = bd.parse_args([*base, "--arrivals", "continuous", "--batches", "8"])
    assert bdc.setup_of(args)["arrivals"] == "continuous"
    with pytest.raises(ValueError, match="differ"):
        rep.check_setup(bdc.setup_of(waves), bdc.setup_of(args), "o")
    spec = bdo.worker_spec(args, "dflash", 8, [(8, 0.0)], ["p"] * 3, "r")
    assert spec["arrivals"] == "continuous" and spec["llm"]["max_num_seqs"] == 8
    with pytest.raises(SystemExit):
        bd.parse_args([*base, "--arrivals", "continuous", "--batches", "1,8"])
    assert "one batch per command" in capsys.readouterr().err
    (tmp_path / "serve_pair").mkdir()
    pair = _pair(tmp_path / "serve_pair")
    for mode in ("cost", "serve"):
        extra = [] if mode == "cost" else pair
        with pytest.raises(SystemExit):
            bd.parse_args(
                [
                    mode,
                    "--out",
                    str(tmp_path / mode),
                    *extra,
                    "--arrivals",
                    "continuous",
                ]
            )
        assert "unrecognized arguments: --arrivals" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# Engine configurations
# ---------------------------------------------------------------------------


def test_speculative_configs():
    drafter = Path("/d")
    assert bdc.speculative_config("none", drafter) is None
    assert bdc.speculative_config("dflash", drafter) == {
        "method": "dflash",
        "model": "/d",
        "num_speculative_tokens": 15,
    }
    # Every DDTree config says which budget it runs, whatever the default.
    assert bdc.speculative_config("ddtree-128", drafter) == {
        "method": "ddtree",
        "model": "/d",
        "tree_budget": 128,
        "adaptive_budget": False,
    }
    assert bdc.speculative_config("ddtree-auto", drafter, adaptive=True) == {
        "method": "ddtree",
        "model": "/d",
        "tree_budget": "auto",
        "adaptive_budget": True,
    }
    assert bdc.speculative_config("dflash", drafter, adaptive=True) == {
        "method": "dflash",
        "model": "/d",
        "num_speculative_tokens": 15,
    }
    # One command can run a config with and without the adaptive budget.
    assert bdc.speculative_config("ddtree-128-adaptive", drafter) == {
        "method": "ddtree",
        "model": "/d",
        "tree_budget": 128,
        "adaptive_budget": True,
    }
    assert bdc.speculative_config("ddtree-128-adaptive", drafter, fixed=True) == {
        "method": "ddtree",
        "model": "/d",
        "tree_budget": 128,
        "adaptive_budget": False,
    }


def test_adaptive_configs_parse_and_sort():
    names = bdc.parse_configs(
        "ddtree-auto-adaptive,ddtree-128-adaptive,ddtree-auto,dflash,none,ddtree-128",
        [128],
    )
    assert names == [
        "none",
        "dflash",
        "ddtree-128",
        "ddtree-128-adaptive",
        "ddtree-auto",
        "ddtree-auto-adaptive",
    ]
    assert bdc.step_tokens("ddtree-128-adaptive", 8) == 8 * 129
    for bad in ("dflash-adaptive", "none-adaptive", "ddtree-2000-adaptive"):
        with pytest.raises(ValueError):
            bdc.parse_configs(bad, [128])


def test_step_tokens_and_skipped_batches():
    assert bdc.step_tokens("none", 64) == 64
    assert bdc.step_tokens("dflash", 64) == 1024
    assert bdc.step_tokens("ddtree-128", 8) == 8 * 129
    batches = [1, 4, 16, 32, 64]
    assert bdc.fitting_batches("ddtree-1024", batches, 33000) == ([1, 4, 16, 32], [64])
    assert bdc.fitting_batches("ddtree-512", batches, 33000) == (batches, [])
    assert bdc.fitting_batches("dflash", batches, 100) == ([1, 4], [16, 32, 64])


def test_capture_sizes_follow_the_ddtree_ladder():
    assert bdc.request_ladder(1) == [1]
    assert bdc.request_ladder(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert bdc.request_ladder(32) == [1, 2, 4, 8, 16, 24, 32]
    assert bdc.capture_sizes("none", 8) == [1, 2, 4, 8]
    assert bdc.capture_sizes("dflash", 64)[-1] == 64 * 16  # past vLLM's 512 default
    assert bdc.capture_sizes("ddtree-64", 64) is None
    # DDTree's tuned maximum covers the same ladder (its plugin fills in sizes).
    assert bdc.tuned_max_capture_size("ddtree-64", 64) == 64 * 65
    assert bdc.tuned_max_capture_size("ddtree-7", 64) == 64 * 16  # the drafter's
    auto = bdc.tuned_max_capture_size(bd.AUTO_CONFIG, 64)
    assert auto == max(
        n * (bdc.schedule_budget(bdc.auto_schedule(), n) + 1)
        for n in bdc.request_ladder(64)
    )


def test_engine_kwargs(tmp_path):
    """--settings defaults (the default) leaves every engine setting a user
    would not set to vLLM; tuned is the earlier benchmark's."""
    args = bd.parse_args(["cost", "--out", str(tmp_path)])
    assert args.settings == "defaults"
    kw = bdc.engine_kwargs(args, "dflash", 64)
    assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"]
    assert not kw["disable_log_stats"]
    for key in (
        "max_num_seqs",
        "enable_prefix_caching",
        "compilation_config",
        "gpu_memory_utilization",
    ):
        assert key not in kw, key
    args = bd.parse_args(["cost", "--out", str(tmp_path), "--settings", "tuned"])
    kw = bdc.engine_kwargs(args, "dflash", 64)
    assert kw["max_num_seqs"] == 64 and kw["gpu_memory_utilization"] == 0.85
    assert not kw["enable_prefix_caching"]
    assert kw["compilation_config"]["cudagraph_capture_sizes"][-1] == 1024
    kw = bdc.engine_kwargs(args, "ddtree-256", 16)
    assert kw["speculative_config"]["tree_budget"] == 256
    assert kw["compilation_config"] == {"max_cudagraph_capture_size": 16 * 257}
    assert "max_num_batched_tokens" not in kw


def test_defaults_continuous_arrivals_set_only_the_concurrency(tmp_path):
    args = bd.parse_args(
        [
            "e2e",
            "--out",
            str(tmp_path / "o"),
            *_pair(tmp_path),
            "--arrivals",
            "continuous",
            "--batches",
            "8",
        ]
    )
    kw = bdc.engine_kwargs(args, "dflash", 8)
    assert kw["max_num_seqs"] == 8
    assert "enable_prefix_caching" not in kw and "compilation_config" not in kw
    assert bdc.setup_of(args)["settings"] == "defaults"
    tuned = bd.parse_args(
        ["e2e", "--out", str(tmp_path / "t"), *_pair(tmp_path), "--settings", "tuned"]
    )
    assert "settings" not in bdc.setup_of(tuned)  # what earlier setups meant


def test_engine_args_on_top_of_the_settings(tmp_path, capsys):
    """--engine-arg sets one engine argument for every config, so one factor of
    the defaults can be changed at a time; the setup records it."""
    args = bd.parse_args(
        [
            "e2e",
            "--out",
            str(tmp_path / "o"),
            *_pair(tmp_path),
            "--engine-arg",
            "max_num_seqs=1",
            "--engine-arg",
            "enable_prefix_caching=false",
            "--engine-arg",
            "kv_cache_dtype=auto",
        ]
    )
    kw = bdc.engine_kwargs(args, "ddtree-auto", 1)
    assert kw["max_num_seqs"] == 1 and kw["enable_prefix_caching"] is False
    assert kw["kv_cache_dtype"] == "auto"
    assert bdc.setup_of(args)["engine_args"] == {
        "max_num_seqs": 1,
        "enable_prefix_caching": False,
        "kv_cache_dtype": "auto",
    }
    serve = bd.parse_args(
        [
            "serve",
            "--out",
            str(tmp_path / "s"),
            *_pair(tmp_path),
            "--engine-arg",
            "enable_prefix_caching=false",
            "--engine-arg",
            "max_num_batched_tokens=4096",
            "--engine-arg",
            "enforce_eager=true",
        ]
    )
    cmd = bds.serve_command(serve, "dflash", 8, 8000)
    assert "--no-enable-prefix-caching" in cmd and "--enforce-eager" in cmd
    assert cmd[cmd.index("--max-num-batched-tokens") + 1] == "4096"
    for bad in ("max_num_seqs", "=3", "model=x"):
        with pytest.raises(SystemExit):
            bd.parse_args(
                [
                    "e2e",
                    "--out",
                    str(tmp_path / "b"),
                    *_pair(tmp_path),
                    "--engine-arg",
                    bad,
                ]
            )
        assert "--engine-arg" in capsys.readouterr().err


def test_fresh_prompts_share_no_prefix_block():
    text = "def f(x):\n    return x\n"
    a, b = bdc.fresh_prompt(text, 1), bdc.fresh_prompt(text, 2)
    assert a != b and a.endswith(text) and a.startswith("# request 1\n")
    tokens = list(range(100, 140))
    tagged = [bdc.fresh_prompt(tokens, t) for t in (0, 1, 151643, 3_000_001)]
    assert len({tuple(t[:2]) for t in tagged}) == 4
    assert all(len(t) == 40 and t[2:] == tokens[2:] for t in tagged)
    assert bdc.fresh_prompt([7], 5) == [5]


def test_schedule_config(tmp_path):
    """ddtree-schedule: a tree_budget_per_batch_size from --schedule (JSON or a
    file), checked by ddtree's parser, carried into the engine, the rows and the
    setup; the step-token limit uses each batch's own budget."""
    schedule = [[1, 1, 512], [2, 16, 128], [17, 64, 32]]
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps(schedule))
    for given in (json.dumps(schedule), str(path)):
        args = bd.parse_args(
            [
                "cost",
                "--out",
                str(tmp_path / "o"),
                "--configs",
                "dflash,ddtree-schedule,ddtree-64",
                "--schedule",
                given,
            ]
        )
        assert args.schedule == schedule
        assert args.configs == ["dflash", "ddtree-64", "ddtree-schedule"]
    kw = bdc.engine_kwargs(args, "ddtree-schedule", 64)
    assert kw["speculative_config"]["tree_budget_per_batch_size"] == schedule
    assert "compilation_config" not in kw
    assert [bdc.schedule_budget(schedule, b) for b in (1, 2, 16, 17, 64, 100)] == [
        512,
        128,
        128,
        32,
        32,
        32,
    ]
    assert bdc.step_tokens("ddtree-schedule", 16, schedule) == 16 * 129
    assert bdc.fitting_batches(
        "ddtree-schedule", [1, 16, 64, 512], 10000, schedule
    ) == (
        [1, 16, 64],
        [512],
    )
    assert bdc.setup_of(args)["schedule"] == schedule
    assert "schedule" not in bdc.setup_of(
        bd.parse_args(["cost", "--out", str(tmp_path / "p")])
    )
    spec = bdo.worker_spec(args, "ddtree-schedule", 1, [(1, 0.0)], None, "r")
    assert spec["row"]["tree_budget_per_batch_size"] == schedule
    assert (
        "tree_budget_per_batch_size"
        not in bdo.worker_spec(args, "ddtree-64", 1, [(1, 0.0)], None, "r")["row"]
    )


def test_auto_config(tmp_path):
    """ddtree-auto asks the engine for tree_budget "auto"; its rows carry the
    schedule that stands for, and the step-token limit follows it."""
    from vllm.v1.spec_decode.ddtree_config import AUTO_TREE_BUDGET_PER_BATCH_SIZE

    auto = [list(e) for e in AUTO_TREE_BUDGET_PER_BATCH_SIZE]
    args = bd.parse_args(
        ["cost", "--out", str(tmp_path), "--configs", "ddtree-auto,dflash,ddtree-64"]
    )
    assert args.configs == ["dflash", "ddtree-64", "ddtree-auto"]
    kw = bdc.engine_kwargs(args, "ddtree-auto", 64)
    assert kw["speculative_config"]["tree_budget"] == "auto"
    assert "tree_budget_per_batch_size" not in kw["speculative_config"]
    assert "compilation_config" not in kw
    for batch in (1, 4, 5, 64):
        assert bdc.step_tokens("ddtree-auto", batch) == batch * (
            bdc.schedule_budget(auto, batch) + 1
        )
    assert "schedule" not in bdc.setup_of(args)
    row = bdo.worker_spec(args, "ddtree-auto", 1, [(1, 0.0)], None, "r")["row"]
    assert row["tree_budget_per_batch_size"] == auto


def test_auto_target_check():
    """auto: >= 1.2x DFlash at batch 1, T=0 (and >= 0.95 of the acceptance
    ratio there), >= 1.0x elsewhere."""
    rows = rep.with_ratios(
        [
            _row("dflash", 1, tok_s=400.0, acceptance_length=5.0),
            _row("ddtree-auto", 1, tok_s=476.0, acceptance_length=6.0),
            _row("dflash", 1, 1.0, tok_s=300.0, acceptance_length=1.5),
            _row("ddtree-auto", 1, 1.0, tok_s=330.0, acceptance_length=1.9),
            _row("dflash", 64, tok_s=4000.0, acceptance_length=5.0),
            _row("ddtree-auto", 64, tok_s=3960.0, acceptance_length=5.2),
        ]
    )
    assert rep.target_checks(rows, "e2e") == [
        "ddtree-auto, batch 1, T=0: throughput 1.190 x DFlash's (target >= 1.2): "
        "NOT met",
        "ddtree-auto, batch 1, T=0: throughput 1.190 x DFlash's at acceptance "
        "1.200 x: 0.992 of the acceptance ratio (target >= 0.95): met",
        "ddtree-auto, batch 1, T=1: throughput 1.100 x DFlash's (target >= 1): met",
        "ddtree-auto, batch 64, T=0: throughput 0.990 x DFlash's (target >= 1): "
        "NOT met",
    ]
    # Dummy weights accept nothing: no throughput target in cost mode.
    assert rep.target_checks(rows, "cost") == []


def test_step_targets_of_the_8b_budgets():
    """Cost mode checks budgets 127 / 255 (<= 1.05x / 1.25x DFlash's step) and
    128 / 512 (<= 1.10x / 1.30x), at batch 1 only."""
    rows = rep.with_ratios(
        [
            _row("dflash", 1, decode_ms_per_step=6.0),
            _row("ddtree-127", 1, decode_ms_per_step=6.6),
            _row("ddtree-255", 1, decode_ms_per_step=7.2),
            _row("ddtree-64", 1, decode_ms_per_step=6.3),
            _row("dflash", 4, decode_ms_per_step=7.0),
            _row("ddtree-127", 4, decode_ms_per_step=7.1),
        ]
    )
    assert rep.target_checks(rows, "cost") == [
        "ddtree-127, batch 1: step time 1.100 x DFlash's (target <= 1.05): NOT met",
        "ddtree-255, batch 1: step time 1.200 x DFlash's (target <= 1.25): met",
    ]


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--configs", "ddtree-schedule"], "ddtree-schedule needs --schedule"),
        (
            ["--configs", "ddtree-schedule", "--schedule", "[[2, 8, 16]]"],
            "first batch-size range must start at 1",
        ),
        (
            ["--configs", "ddtree-schedule", "--schedule", "[[1, 8, 0]]"],
            r"must be in \[1, 1024\], got 0",
        ),
        (["--schedule", "not json"], "--schedule must be JSON"),
    ],
)
def test_bad_schedule(tmp_path, capsys, extra, match):
    with pytest.raises(SystemExit):
        bd.parse_args(["cost", "--out", str(tmp_path), *extra])
    assert re.search(match, capsys.readouterr().err)


def test_8b_model_configs():
    target = json.loads((MODEL_CONFIGS / "qwen3_8b" / "config.json").read_text())
    drafter = json.loads(
        (MODEL_CONFIGS / "dflash_qwen3_8b" / "config.json").read_text()
    )
    assert target["architectures"] == ["Qwen3ForCausalLM"]
    assert (
        target["hidden_size"],
        target["num_hidden_layers"],
        target["num_attention_heads"],
        target["num_key_value_heads"],
        target["head_dim"],
        target["intermediate_size"],
        target["vocab_size"],
    ) == (4096, 36, 32, 8, 128, 12288, 151936)
    assert target["rope_theta"] == 1000000 and target["rms_norm_eps"] == 1e-6
    assert not target["tie_word_embeddings"]
    assert drafter["architectures"] == ["DFlashDraftModel"]
    assert drafter["block_size"] == 16 and drafter["num_hidden_layers"] == 5
    layers = drafter["dflash_config"]["target_layer_ids"]
    assert layers == [1, 9, 17, 25, 33] and max(layers) < target["num_hidden_layers"]
    assert target["vocab_size"] > drafter["dflash_config"]["mask_token_id"]
    assert drafter["target_hidden_size"] == target["hidden_size"]


@pytest.fixture
def cuda_platform(monkeypatch):
    """EngineArgs asks the platform for a device type; a CPU-only box has none."""
    from vllm.platforms import current_platform

    if current_platform.device_type == "":
        monkeypatch.setattr(
            type(current_platform), "device_type", "cuda", raising=False
        )


@pytest.mark.parametrize("config", ["dflash", "ddtree-128"])
def test_8b_configs_pass_vllms_checks(tmp_path, cuda_platform, config):
    """The benchmark's cost-mode engine arguments build a vLLM config from the
    config.json files alone (dummy weights, no tokenizer)."""
    from vllm.engine.arg_utils import EngineArgs

    import vllm_ddtree

    vllm_ddtree.register()
    args = bd.parse_args(["cost", "--out", str(tmp_path)])
    kw = bdc.engine_kwargs(args, config, 16)
    kw.pop("disable_log_stats")
    kw.pop("compilation_config", None)  # the CPU platform captures no graphs
    vllm_config = EngineArgs(**kw).create_engine_config()
    draft = vllm_config.speculative_config.draft_model_config
    assert draft.hf_config.num_hidden_layers == 5
    assert vllm_config.model_config.get_vocab_size() == 151936
    if config == "ddtree-128":
        # The cost mode measures one tree size: a fixed budget.
        assert vllm_config.additional_config["vllm_ddtree"] == {
            "method": "ddtree",
            "tree_budget": 128,
            "draft_depth": 15,
            "step_budgets": [],
            "adaptive": False,
            "caps": [],
        }
        # vLLM's default step budget (the platform's), with max_num_seqs fitted
        # to hold full trees.
        sched = vllm_config.scheduler_config
        assert sched.max_num_seqs * 129 <= sched.max_num_batched_tokens


# ---------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------


def test_load_prompts_formats(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps(
            {
                "about": "x",
                "prompts": [
                    {"source": "a.py", "text": "def f():"},
                    {"text": "import os"},
                ],
            }
        )
    )
    assert bdc.load_prompts(path) == ["def f():", "import os"]
    path.write_text(json.dumps([[1, 2, 3], [4]]))
    assert bdc.load_prompts(path) == [[1, 2, 3], [4]]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt_token_ids": [5, 6]}\n\n[7]\n')
    assert bdc.load_prompts(jsonl) == [[5, 6], [7]]


@pytest.mark.parametrize(
    "content, match",
    [
        ([], "non-empty list"),
        ({"other": []}, "non-empty list"),
        (["text", [1, 2]], "mixes texts and token-id lists"),
        (["ok", ""], "prompt 1 is neither"),
        ([[1, -2]], "prompt 0 is neither"),
        ([[True]], "prompt 0 is neither"),
    ],
)
def test_bad_prompt_files(tmp_path, content, match):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=match):
        bdc.load_prompts(path)


def test_requests_and_random_prompts():
    assert bdc.batch_requests(["a", "b", "c"], 2, 3) == ["a", "b", "c", "a"]
    assert bdc.batch_requests(["a"], 8, 1) == ["a"] * 8
    assert len(bdc.batch_requests(list("abcdefgh"), 1, 5)) == 5
    # --min-waves: at least that many waves, whatever --num-prompts says.
    assert bdc.batch_requests(["a", "b", "c"], 2, 3, min_waves=3) == list("abcabc")
    assert len(bdc.batch_requests(list("abcdefgh"), 1, 5, min_waves=3)) == 5
    a = bdc.random_prompts(3, 50, seed=7)
    assert a == bdc.random_prompts(3, 50, seed=7) != bdc.random_prompts(3, 50, seed=8)
    assert all(len(p) == 50 and 0 <= min(p) and max(p) < 151643 for p in a)
    bdc.check_prompt_lengths([[1] * 10, "text"], 6, 16)
    with pytest.raises(ValueError, match=r"prompts \[0\] plus --max-tokens 7"):
        bdc.check_prompt_lengths([[1] * 10], 7, 16)


# ---------------------------------------------------------------------------
# Metric arithmetic
# ---------------------------------------------------------------------------


def _counter(name, value, engine="0"):
    return types.SimpleNamespace(name=name, labels={"engine": engine}, value=value)


def _vector(name, values):
    return types.SimpleNamespace(name=name, labels={}, values=values)


def _histogram(name, count):
    return types.SimpleNamespace(name=name, labels={}, count=count, sum=0.0, buckets={})


def test_metric_totals_sum_label_sets():
    totals = rep.metric_totals(
        [
            _counter(rep.DRAFTS, 3, "0"),
            _counter(rep.DRAFTS, 4, "1"),
            _vector(rep.ACCEPTED_PER_POS, [3, 1]),
            _vector(rep.ACCEPTED_PER_POS, [1, 1, 1]),
            _histogram(rep.STEPS, 9),
        ]
    )
    assert totals == {rep.DRAFTS: 7, rep.ACCEPTED_PER_POS: [4, 2, 1], rep.STEPS: 9}


def test_metric_delta():
    before = {rep.DRAFTS: 10, rep.ACCEPTED_PER_POS: [5, 2], rep.STEPS: 3}
    after = {
        rep.DRAFTS: 14,
        rep.ACCEPTED_PER_POS: [8, 4, 1],
        rep.STEPS: 10,
        rep.ACCEPTED: 5,
    }
    assert rep.metric_delta(before, after) == {
        rep.DRAFTS: 4,
        rep.ACCEPTED_PER_POS: [3, 2, 1],
        rep.STEPS: 7,
        rep.ACCEPTED: 5,
    }


def test_spec_stats():
    # 4 trees of budget 32: paths of depth 3, 2, 0, 1 -> 6 accepted tokens.
    per_pos = [3, 2, 1] + [0] * 29  # vLLM sizes the vector by the budget
    stats = rep.spec_stats(
        {
            rep.DRAFTS: 4,
            rep.ACCEPTED: 6,
            rep.DRAFT_TOKENS: 128,
            rep.ACCEPTED_PER_POS: per_pos,
        }
    )
    assert stats["acceptance_length"] == 1 + 6 / 4
    assert stats["draft_acceptance_rate"] == 6 / 128
    assert stats["per_depth"] == [0.75, 0.5, 0.25] + [0.0] * 12
    assert len(stats["accepted_per_pos"]) == rep.MAX_DEPTH
    # The per-depth rates sum to the mean accepted length minus the bonus.
    assert math.isclose(sum(stats["per_depth"]) + 1, stats["acceptance_length"])
    none = rep.spec_stats({rep.STEPS: 100})
    assert none["acceptance_length"] is None and none["per_depth"] == []


def test_timing_stats():
    full = {rep.STEPS: 130}
    prefill = {rep.STEPS: 2}
    t = rep.timing_stats(
        full, prefill, wall_s=2.0, prefill_wall_s=0.72, output_tokens=400
    )
    assert t["tok_s"] == 200.0 and t["steps"] == 130
    assert math.isclose(t["decode_ms_per_step"], 1000 * 1.28 / 128)
    assert math.isclose(t["ms_per_step"], 2000 / 130)
    assert rep.timing_stats({}, {}, 0.0, 0.0, 0)["decode_ms_per_step"] is None


class FakeLLM:
    """Stands in for vllm.LLM: each request of a wave takes ``ceil((max_tokens - 1)
    / tau)`` decode steps after one prefill step, 10 ms each, and accepts
    ``tau - 1`` draft tokens per step."""

    def __init__(self, clock, tau=1, budget=0):
        self.clock, self.tau, self.budget = clock, tau, budget
        self.totals = {
            rep.STEPS: 0,
            rep.DRAFTS: 0,
            rep.ACCEPTED: 0,
            rep.DRAFT_TOKENS: 0,
            rep.ACCEPTED_PER_POS: [0] * max(budget, 1),
        }
        self.calls = []

    def get_metrics(self):
        return [
            _histogram(rep.STEPS, self.totals[rep.STEPS]),
            _counter(rep.DRAFTS, self.totals[rep.DRAFTS]),
            _counter(rep.ACCEPTED, self.totals[rep.ACCEPTED]),
            _counter(rep.DRAFT_TOKENS, self.totals[rep.DRAFT_TOKENS]),
            _vector(rep.ACCEPTED_PER_POS, list(self.totals[rep.ACCEPTED_PER_POS])),
        ]

    def generate(self, wave, params, use_tqdm=True):
        self.calls.append((len(wave), params.max_tokens, params.temperature))
        decode = math.ceil((params.max_tokens - 1) / self.tau)
        self.totals[rep.STEPS] += 1 + decode
        self.clock.now += 0.01 * (1 + decode)
        if self.budget:
            self.totals[rep.DRAFTS] += len(wave) * decode
            self.totals[rep.ACCEPTED] += len(wave) * decode * (self.tau - 1)
            self.totals[rep.DRAFT_TOKENS] += len(wave) * decode * self.budget
            for d in range(self.tau - 1):
                self.totals[rep.ACCEPTED_PER_POS][d] += len(wave) * decode
        out = types.SimpleNamespace(
            outputs=[types.SimpleNamespace(token_ids=[0] * params.max_tokens)]
        )
        return [out] * len(wave)


class Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def _params(**kw):
    return types.SimpleNamespace(**kw)


def test_measure_with_a_fake_engine(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(bdo, "time", clock)
    monkeypatch.setattr(hu, "time", clock)
    llm = FakeLLM(clock, tau=4, budget=64)
    spec = {"max_tokens": 33, "ignore_eos": True, "detokenize": False}
    row = bdo.measure(llm, _params, [[1, 2]] * 6, 2, 0.0, spec)
    # warm-up (16 tokens), prefill-only, then the timed run, each in 3 waves of 2
    assert llm.calls == [(2, 16, 0.0)] + [(2, 1, 0.0)] * 3 + [(2, 33, 0.0)] * 3
    assert row["num_requests"] == 6 and row["output_tokens"] == 6 * 33
    assert row["steps"] == 3 * 9 and row["prefill_steps"] == 3
    assert math.isclose(row["decode_ms_per_step"], 10.0)
    assert row["acceptance_length"] == 4.0
    assert row["per_depth"][:4] == [1.0, 1.0, 1.0, 0.0]
    assert math.isclose(row["tok_s"], 6 * 33 / 0.27)
    # The host over the timed pass only (HostUsage starts after prefill-only).
    assert math.isclose(row["host_usage"]["wall_s"], 0.27, rel_tol=0.05)
    assert {"calibration_ms", "steal_pct", "step_thread_busy_pct"} <= set(
        row["host_usage"]
    )


class RecordingLLM(FakeLLM):
    def generate(self, wave, params, use_tqdm=True):
        self.prompts = getattr(self, "prompts", []) + [r["prompt"] for r in wave]
        return super().generate(wave, params, use_tqdm)


def test_measure_under_defaults_never_repeats_a_prompt(monkeypatch):
    """Warm-up, prefill-only and timed passes, and two runs of one engine,
    each send prompts the engine has not seen (prefix caching is on)."""
    clock = Clock()
    monkeypatch.setattr(bdo, "time", clock)
    llm = RecordingLLM(clock, tau=4, budget=64)
    spec = {
        "max_tokens": 9,
        "ignore_eos": True,
        "detokenize": True,
        "settings": "defaults",
    }
    for k in range(2):
        bdo.measure(
            llm,
            _params,
            ["x = 1\n"] * 4,
            2,
            0.0,
            {**spec, "tag_base": k * bdc.TAGS_PER_RUN},
        )
    # Per run: 2 warm-up prompts (one wave) + 4 prefill-only + 4 timed.
    assert len(llm.prompts) == 2 * (2 + 4 + 4)
    assert len(set(llm.prompts)) == len(llm.prompts)
    assert all(p.endswith("x = 1\n") for p in llm.prompts)


def test_measure_continuous_arrivals(monkeypatch):
    """Under arrivals: continuous every timed generation is one call with all
    requests (the engine's max_num_seqs keeps batch of them running)."""
    clock = Clock()
    monkeypatch.setattr(bdo, "time", clock)
    llm = FakeLLM(clock, tau=4, budget=64)
    spec = {
        "max_tokens": 33,
        "ignore_eos": True,
        "detokenize": False,
        "arrivals": "continuous",
    }
    row = bdo.measure(llm, _params, [[1, 2]] * 6, 2, 0.0, spec)
    assert llm.calls == [(2, 16, 0.0), (6, 1, 0.0), (6, 33, 0.0)]
    assert row["num_requests"] == 6 and row["output_tokens"] == 6 * 33


def test_worker_with_a_fake_engine(tmp_path, monkeypatch):
    """The worker process's body: engine kwargs in, one row per run out."""
    import vllm

    built = {}

    class FakeEngineLLM(FakeLLM):
        def __init__(self, **kwargs):
            super().__init__(Clock(), tau=2, budget=16)
            built.update(kwargs)
            sched = types.SimpleNamespace(
                max_num_seqs=4, max_num_batched_tokens=68, async_scheduling=True
            )
            comp = types.SimpleNamespace(
                cudagraph_mode="FULL_AND_PIECEWISE", cudagraph_capture_sizes=[16, 17]
            )
            self.llm_engine = types.SimpleNamespace(
                vllm_config=types.SimpleNamespace(
                    scheduler_config=sched, compilation_config=comp
                )
            )

    monkeypatch.setattr(vllm, "LLM", FakeEngineLLM)
    monkeypatch.setattr(vllm, "SamplingParams", _params)
    args = bd.parse_args(
        [
            "cost",
            "--out",
            str(tmp_path),
            "--input-len",
            "8",
            "--max-tokens",
            "9",
            "--batches",
            "1,4",
        ]
    )
    tmp_path.mkdir(exist_ok=True)
    spec = bdo.worker_spec(args, "ddtree-16", 4, [(1, 0.0), (4, 0.0)], None, "rid")
    assert [len(p) for p in spec["requests"]["4"]] == [8] * 8  # 2 waves of 4
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    bd.main(["_worker", str(path)])
    assert built["speculative_config"]["tree_budget"] == 16
    assert built["load_format"] == "dummy"
    rows = rep.load_rows([tmp_path])
    assert [(r["config"], r["batch"], r["run_id"]) for r in rows] == [
        ("ddtree-16", 1, "rid"),
        ("ddtree-16", 4, "rid"),
    ]
    assert rows[0]["engine"]["max_num_seqs"] == 4
    assert rows[1]["acceptance_length"] == 2.0 and rows[1]["num_requests"] == 8


# ---------------------------------------------------------------------------
# Resume and orchestration
# ---------------------------------------------------------------------------


def _row(config, batch, temperature=0.0, run="r1", **kw):
    row = {"config": config, "batch": batch, "temperature": temperature, "run_id": run}
    row.update(kw)
    return row


def test_rows_files_and_merge(tmp_path, capsys):
    rep.append_row(tmp_path, _row("dflash", 1, tok_s=1.0))
    rep.append_row(tmp_path, _row("none", 1, tok_s=2.0))
    with (tmp_path / rep.RESULTS_FILE).open("a") as f:
        f.write('{"config": "ddtree-64", "bat')  # a killed writer
    rows = rep.load_rows([tmp_path, tmp_path / "missing"])
    assert [r["config"] for r in rows] == ["dflash", "none"]
    assert "truncated" in capsys.readouterr().out
    merged = rep.merge_rows(
        rows
        + [
            _row("dflash", 1, tok_s=3.0),
            _row("ddtree-16", 1),
            _row("ddtree-8", 1),
            _row("none", 1, 1),
        ]
    )
    assert [(r["config"], r["temperature"]) for r in merged] == [
        ("none", 0.0),
        ("dflash", 0.0),
        ("ddtree-8", 0.0),
        ("ddtree-16", 0.0),
        ("none", 1),
    ]
    assert merged[1]["tok_s"] == 3.0  # the later row wins


def test_pending_and_setup_check():
    done = {("dflash", 1, 0.0), ("dflash", 8, 1.0)}
    assert rep.pending("dflash", [1, 8], [0, 1], done) == [(1, 1.0), (8, 0.0)]
    assert rep.pending("none", [1], [0], done) == [(1, 0.0)]
    setup = {"mode": "cost", "max_tokens": 128, "info": {"target": "/a"}}
    rep.check_setup(setup, {**setup, "info": {"target": "/b"}}, "there")
    with pytest.raises(ValueError, match="max_tokens: 64 there, 128 now"):
        rep.check_setup(setup, {**setup, "max_tokens": 64}, "/old")


def _append_fake_rows(args, config, runs, rid, ms, tau=1.0) -> None:
    """What a worker appends for ``runs``: a step of ``ms`` milliseconds."""
    for batch, temperature in runs:
        rep.append_row(
            args.out,
            {
                "config": config,
                "batch": batch,
                "temperature": temperature,
                "run_id": rid,
                "tok_s": 100.0 / ms,
                "decode_ms_per_step": ms,
                "acceptance_length": tau,
            },
        )


@pytest.fixture
def fake_runs(monkeypatch):
    """run_offline_config without engines: writes one row per pending run."""
    calls = []

    def fake(args, config, max_batch, runs, prompts, rid, time_left):
        calls.append((config, max_batch, list(runs)))
        ms = 5.0 if config == "none" else 6.0 if config == "dflash" else 7.0
        _append_fake_rows(
            args, config, runs, rid, ms, None if config == "none" else 1.0
        )
        return True

    monkeypatch.setattr(bd, "run_offline_config", fake)
    return calls


def test_sweep_resumes_and_skips(tmp_path, fake_runs, capsys):
    out = tmp_path / "part1"
    argv = [
        "cost",
        "--out",
        str(out),
        "--configs",
        "none,ddtree-1024",
        "--batches",
        "1,64",
    ]
    assert bd.main(argv) == 0
    assert fake_runs == [
        ("none", 64, [(1, 0.0), (64, 0.0)]),
        ("ddtree-1024", 1, [(1, 0.0)]),
    ]
    assert "skipping batches [64]" in capsys.readouterr().out
    assert bd.main(argv) == 0  # everything measured: no engine started
    assert len(fake_runs) == 2
    assert "nothing to do" in capsys.readouterr().out
    # A second part on a fresh machine resumes from the first part's output,
    # which it copies so that its own output is complete.
    part2 = tmp_path / "part2"
    assert (
        bd.main(
            [
                "cost",
                "--out",
                str(part2),
                "--resume-from",
                str(out),
                "--configs",
                "none,dflash,ddtree-1024",
                "--batches",
                "1,64",
            ]
        )
        == 0
    )
    assert fake_runs[2:] == [("dflash", 64, [(1, 0.0), (64, 0.0)])]
    assert {rep.row_key(r) for r in rep.load_rows([part2])} == {
        ("none", 1, 0.0),
        ("none", 64, 0.0),
        ("ddtree-1024", 1, 0.0),
        ("dflash", 1, 0.0),
        ("dflash", 64, 0.0),
    }
    report = (part2 / rep.REPORT_FILE).read_text()
    assert "| 1 | 0.0 | ddtree-1024 * |" in report  # baselines from another run


def test_sweep_refuses_another_setup(tmp_path, fake_runs, capsys):
    out = tmp_path / "out"
    assert (
        bd.main(["cost", "--out", str(out), "--configs", "none", "--batches", "1"]) == 0
    )
    assert (
        bd.main(
            [
                "cost",
                "--out",
                str(out),
                "--configs",
                "none",
                "--batches",
                "1",
                "--max-tokens",
                "64",
            ]
        )
        == 2
    )
    assert "different setup (max_tokens: 128 there, 64 now)" in capsys.readouterr().err
    assert (
        bd.main(
            [
                "cost",
                "--out",
                str(tmp_path / "new"),
                "--resume-from",
                str(tmp_path / "nothing"),
            ]
        )
        == 2
    )
    assert "no results.jsonl there" in capsys.readouterr().err


def test_sweep_stops_at_the_time_limit(tmp_path, fake_runs, capsys):
    assert (
        bd.main(
            [
                "cost",
                "--out",
                str(tmp_path),
                "--configs",
                "none,dflash",
                "--batches",
                "1",
                "--limit-seconds",
                "50",
                "--config-seconds",
                "100",
            ]
        )
        == 0
    )
    assert fake_runs == []
    assert "stopping" in capsys.readouterr().out
    clock = bdp.Clock(limit_s=100, default_config_s=300)
    assert not clock.can_start()
    clock.record(30)  # a measured config replaces the guess
    assert clock.can_start()
    clock.record(150)  # the slowest config measured so far counts
    assert not clock.can_start()
    clock.record(10)  # a fast config later does not hide it
    assert not clock.can_start()
    assert bdp.Clock(0, 1e9).can_start()  # no limit


@pytest.mark.parametrize(
    "seconds, rc, message",
    [
        (200.0, 0, "--limit-seconds ran out while measuring ['dflash']"),
        (1.0, 1, "failed configs"),
    ],
)
def test_config_cut_by_the_time_limit_is_not_a_failure(
    tmp_path, monkeypatch, capsys, seconds, rc, message
):
    """A config whose engine ended without finishing: killed at --limit-seconds
    (rows so far kept, exit 0, resume hint), or a failure (exit 1)."""
    now = [0.0]
    monkeypatch.setattr(bd.time, "monotonic", lambda: now[0])

    def runner(args, config, max_batch, runs, prompts, rid, time_left):
        rep.append_row(
            args.out,
            {
                "config": config,
                "batch": 1,
                "temperature": 0.0,
                "run_id": rid,
                "decode_ms_per_step": 6.0,
            },
        )
        now[0] += seconds
        return False

    monkeypatch.setattr(bd, "run_offline_config", runner)
    assert (
        bd.main(
            [
                "cost",
                "--out",
                str(tmp_path),
                "--configs",
                "dflash",
                "--batches",
                "1,4",
                "--limit-seconds",
                "150",
                "--config-seconds",
                "10",
            ]
        )
        == rc
    )
    out = capsys.readouterr().out
    assert message in out and "dflash: 1/2 measured" in out
    assert (message == "failed configs") == ("failed configs" in out)


def test_report_merges_parts(tmp_path, fake_runs):
    part1, part2, merged = tmp_path / "a", tmp_path / "b", tmp_path / "m"
    bd.main(["cost", "--out", str(part1), "--configs", "none,dflash", "--batches", "1"])
    bd.main(["cost", "--out", str(part2), "--configs", "ddtree-128", "--batches", "1"])
    assert bd.main(["report", str(part1), str(part2), "--out", str(merged)]) == 0
    keys = {rep.row_key(r) for r in rep.load_rows([merged])}
    assert keys == {("none", 1, 0.0), ("dflash", 1, 0.0), ("ddtree-128", 1, 0.0)}
    text = (merged / rep.REPORT_FILE).read_text()
    assert (
        "ddtree-128, batch 1: step time 1.167 x DFlash's (target <= 1.10): "
        "NOT met (baseline from another GPU command)" in text
    )
    assert bd.main(["report", str(tmp_path / "none")]) == 2


def test_report_of_rounds_run_by_separate_commands(tmp_path, fake_runs):
    """Rounds run one per command (order reversed by hand) give the same
    rounds.md as ``--rounds``: the median over the rounds."""
    dirs = [tmp_path / "r1", tmp_path / "r2"]
    for d, configs in zip(dirs, ("none,dflash", "dflash,none")):
        bd.main(["cost", "--out", str(d), "--configs", configs, "--batches", "1"])
    out = tmp_path / "rounds"
    assert bd.main(["report", *map(str, dirs), "--rounds", "--out", str(out)]) == 0
    summary = json.loads((out / rep.ROUNDS_FILE).read_text())
    assert (
        (out / rep.ROUNDS_REPORT)
        .read_text()
        .startswith("# bench_ddtree: cost, 2 rounds")
    )
    assert {(r["config"], r["batch"]) for r in summary} == {("none", 1), ("dflash", 1)}
    assert bd.main(["report", *map(str, dirs), "--rounds"]) == 2


# ---------------------------------------------------------------------------
# Ratios, targets, tables
# ---------------------------------------------------------------------------


def test_ratios_and_e2e_target():
    rows = [
        _row("none", 1, tok_s=100.0, decode_ms_per_step=5.0),
        _row("dflash", 1, tok_s=400.0, decode_ms_per_step=6.5, acceptance_length=5.0),
        _row(
            "ddtree-128", 1, tok_s=480.0, decode_ms_per_step=7.0, acceptance_length=6.0
        ),
        _row(
            "ddtree-512", 1, tok_s=440.0, decode_ms_per_step=8.0, acceptance_length=6.5
        ),
        _row("ddtree-64", 8, run="r2", tok_s=1.0),
    ]
    with_r = {r["config"]: r for r in rep.with_ratios(rows)}
    r = with_r["ddtree-128"]
    assert math.isclose(r["tok_s_vs_dflash"], 1.2)
    assert math.isclose(r["tok_s_vs_none"], 4.8)
    assert math.isclose(r["tau_vs_dflash"], 1.2)
    assert math.isclose(r["step_vs_dflash"], 7.0 / 6.5)
    assert math.isclose(r["step_vs_none"], 1.4) and r["same_run"]
    assert with_r["ddtree-64"]["tok_s_vs_dflash"] is None  # no batch-8 baseline
    checks = rep.target_checks(rep.with_ratios(rows), "e2e")
    assert len(checks) == 2
    assert checks[0].startswith("ddtree-128") and checks[0].endswith(": met")
    assert "0.846 of the acceptance ratio" in checks[1]  # 1.1 / 1.3
    assert checks[1].endswith("NOT met")


def test_cost_targets():
    rows = rep.with_ratios(
        [
            _row("dflash", 1, decode_ms_per_step=6.46),
            _row("ddtree-128", 1, decode_ms_per_step=7.1),
            _row("ddtree-512", 1, decode_ms_per_step=8.5),
            _row("ddtree-64", 1, decode_ms_per_step=6.8),
        ]
    )
    checks = rep.target_checks(rows, "cost")
    assert checks == [
        "ddtree-128, batch 1: step time 1.099 x DFlash's (target <= 1.10): met",
        "ddtree-512, batch 1: step time 1.316 x DFlash's (target <= 1.30): NOT met",
    ]


def test_markdown_report():
    rows = [
        _row(
            "dflash",
            1,
            tok_s=400.0,
            acceptance_length=5.0,
            per_depth=[0.9, 0.8],
            gpu="NVIDIA H200",
        ),
        _row("none", 1, tok_s=100.0),
    ]
    text = rep.markdown_report(rows, "e2e", {"mode": "e2e"})
    assert "| 1 | 0.0 | none | 100.0 |" in text
    assert "| 1 | 0.0 | dflash | 400.0 | - | 5.00 | 1.000 | 4.000 |" in text
    assert "| 1 | 0.0 | dflash | 0.90 | 0.80 | - |" in text
    assert "GPU: NVIDIA H200" in text
    assert "Latency behind the server" not in text  # offline rows have none


def test_markdown_report_serve_latency():
    rows = [
        _row(
            "dflash",
            8,
            tok_s=5000.0,
            median_itl_ms=4.0,
            p99_itl_ms=13.0,
            mean_tpot_ms=1.5,
            median_ttft_ms=27.0,
        ),
        _row(
            "ddtree-auto",
            8,
            run="r2",
            tok_s=4500.0,
            median_itl_ms=5.0,
            p99_itl_ms=18.0,
            mean_tpot_ms=1.6,
            median_ttft_ms=32.0,
        ),
    ]
    text = rep.markdown_report(rows, "serve", {"mode": "serve"})
    assert "Latency behind the server" in text
    assert "| 8 | 0.0 | dflash | 4.00 | 13.00 | 1.50 | 27.00 | 1.000 |" in text
    # a baseline from another command is marked, as in the main table
    assert "| 8 | 0.0 | ddtree-auto * | 5.00 | 18.00 | 1.60 | 32.00 | 1.250 |" in text
    assert "Greedy outputs" not in text
    rows[1]["greedy_agreement"] = {
        "against": "dflash",
        "compared": 16,
        "identical": 15,
        "chars_compared": 9000,
        "first_difference_chars": [412],
    }
    text = rep.markdown_report(rows, "serve", {"mode": "serve"})
    assert "| 8 | ddtree-auto | dflash | 15 / 16 | 9000 | 412 |" in text


# ---------------------------------------------------------------------------
# Serve mode (command lines and result parsing only)
# ---------------------------------------------------------------------------


def test_serve_row_and_commands(tmp_path):
    row = bds.serve_row(
        {
            "duration": 10.0,
            "total_output_tokens": 2000,
            "output_throughput": 200.0,
            "mean_tpot_ms": 4.0,
            "completed": 8,
            "failed": 0,
            "median_itl_ms": 5.5,
            "p99_itl_ms": 17.0,
            "median_ttft_ms": 30.0,
            "spec_decode_num_drafts": 100,
            "spec_decode_accepted_tokens": 300,
            "spec_decode_draft_tokens": 12800,
            "spec_decode_acceptance_length": 4.0,
            "spec_decode_per_position_acceptance_rates": [0.9] * 128,
        }
    )
    assert row["tok_s"] == 200.0 and row["acceptance_length"] == 4.0
    assert len(row["per_depth"]) == 15
    assert (row["median_itl_ms"], row["p99_itl_ms"], row["median_ttft_ms"]) == (
        5.5,
        17.0,
        30.0,
    )
    assert bds.serve_row({"output_throughput": 50.0})["acceptance_length"] is None
    args = bd.parse_args(["serve", "--out", str(tmp_path / "o"), *_pair(tmp_path)])
    cmd = bds.serve_command(args, "ddtree-64", 32, 8000)
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {
        "method": "ddtree",
        "model": str(args.drafter),
        "tree_budget": 64,
        "adaptive_budget": False,
    }
    dflash = bds.serve_command(args, "dflash", 32, 8000)
    for flag in (
        "--max-num-seqs",
        "--compilation-config",
        "--no-enable-prefix-caching",
        "--gpu-memory-utilization",
    ):
        assert flag not in cmd
        # DFlash: the one setting vLLM's serve defaults make a user change.
        assert (flag in dflash) == (flag == "--max-num-seqs")
    assert dflash[dflash.index("--max-num-seqs") + 1] == str(
        bdc.DFLASH_SERVE_MAX_NUM_SEQS
    )
    tuned = bd.parse_args(
        ["serve", "--out", str(tmp_path / "t"), *_pair(tmp_path), "--settings", "tuned"]
    )
    cmd = bds.serve_command(tuned, "ddtree-64", 32, 8000)
    assert cmd[cmd.index("--max-num-seqs") + 1] == "32"
    assert "--no-enable-prefix-caching" in cmd
    assert "--compilation-config" in bds.serve_command(tuned, "dflash", 32, 8000)
    # Defaults: a warm-up over prompts of its own, then the timed run over
    # prompts no earlier request had, vLLM's warm-up (the first prompt) off.
    result = tmp_path / "r.json"
    warm, timed = bds.serve_run_commands(
        args, "http://h:1", ["a", "b", "c"], None, 2, 0.0, result, 1
    )
    assert warm[warm.index("--num-prompts") + 1] == "2"
    for cmd in (warm, timed):
        assert cmd[cmd.index("--num-warmups") + 1] == "0"
    sets = [
        json.loads(Path(c[c.index("--dataset-path") + 1]).read_text())
        for c in (warm, timed)
    ]
    texts = [t["conversations"][0]["value"] for d in sets for t in d]
    assert len(texts) == 2 + 64 and len(set(texts)) == len(texts)  # 32 waves of 2
    assert timed[timed.index("--num-prompts") + 1] == "64"
    assert timed[timed.index("--result-filename") + 1] == "r.json"
    (only,) = bds.serve_run_commands(
        tuned, "http://h:1", ["a"], tmp_path / "d.json", 2, 0.0, result, 0
    )
    assert only[only.index("--num-warmups") + 1] == "2"
    bench = bds.bench_command(
        args, "http://h:1", tmp_path / "d.jsonl", 8, 1.0, tmp_path / "r.json"
    )
    assert bench[bench.index("--max-concurrency") + 1] == "8"
    assert bench[bench.index("--temperature") + 1] == "1.0"
    assert "--ignore-eos" not in bench
    assert bench[bench.index("--dataset-name") + 1] == "sharegpt"
    assert bench[bench.index("--sharegpt-output-len") + 1] == str(args.max_tokens)


def test_greedy_agreement_against_no_speculation():
    # Two slices per config; texts are in the order of the slice's prompts.
    results = {
        "dflash": [
            {"generated_texts": ["abcd", "xyz"]},
            {"generated_texts": ["same"]},
        ],
        "none": [
            {"generated_texts": ["abcd", "xyQ"]},
            {"generated_texts": ["same"]},
        ],
        "ddtree-128": [
            {"generated_texts": ["abXd", "xyz"]},
            {"generated_texts": ["sam"]},
        ],
        "no-texts": [{"output_throughput": 1.0}],
    }
    got = bds.greedy_agreement(results)
    assert set(got) == {"dflash", "ddtree-128"}
    assert got["dflash"] == {
        "against": "none",
        "compared": 3,
        "identical": 2,
        "chars_compared": 4 + 3 + 4,
        "first_difference_chars": [2],
    }
    tree = got["ddtree-128"]
    # "sam" is a prefix of "same": it parts where the shorter text ends.
    assert (tree["identical"], tree["first_difference_chars"]) == (0, [2, 2, 3])
    assert tree["chars_compared"] == 4 + 3 + 3
    # Without no speculation, the first config is the reference.
    first = bds.greedy_agreement({k: results[k] for k in ("dflash", "ddtree-128")})
    assert first["ddtree-128"]["against"] == "dflash"
    assert first["ddtree-128"]["first_difference_chars"] == [2, 3]
    assert bds.greedy_agreement({"none": results["none"]}) == {}


def test_engine_env(monkeypatch):
    """Offline workers keep the engine in their process; vllm serve keeps
    vLLM's default (the first serve run inherited the offline setting)."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert bdp._worker_env()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    served = bdp._worker_env(engine_in_process=False)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in served
    assert served["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert bdp._worker_env()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_offline_engine_process_follows_the_settings(tmp_path, monkeypatch):
    """Under --settings defaults an offline worker's engine core runs in its own
    process (vLLM's default for LLM) and the plugin reaches it through its entry
    point; tuned keeps the engine in the worker's process; the caller's
    VLLM_ENABLE_V1_MULTIPROCESSING wins. The setup records multiprocess, so
    earlier in-process defaults results are not resumed into it."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    seen = []
    monkeypatch.setattr(
        bdo, "_run_logged", lambda cmd, log, left, env: seen.append(env)
    )
    defaults = bd.parse_args(["e2e", "--out", str(tmp_path / "d"), *_pair(tmp_path)])
    tuned = bd.parse_args(
        ["e2e", "--out", str(tmp_path / "t"), *_pair(tmp_path), "--settings", "tuned"]
    )
    assert bdc.engine_process_of(defaults) == "multiprocess"
    assert bdc.engine_process_of(tuned) == "in-process"
    assert bdc.setup_of(defaults)["engine_process"] == "multiprocess"
    assert "engine_process" not in bdc.setup_of(tuned)
    for args in (defaults, tuned):
        args.out.mkdir()
        bdo.run_offline_config(args, "dflash", 1, [(1, 0.0)], ["x"], "r", 10.0)
        spec = json.loads((args.out / "logs" / "dflash.spec.json").read_text())
        assert spec["row"]["engine_process"] == bdc.engine_process_of(args)
    multi, single = seen
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in multi
    site = Path(multi["PYTHONPATH"].split(os.pathsep)[0])
    entry = next(site.glob("*.dist-info")) / "entry_points.txt"
    assert "ddtree = vllm_ddtree:register" in entry.read_text()
    assert str(bd.ROOT) in multi["PYTHONPATH"].split(os.pathsep)
    assert single["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert bdc.engine_process_of(defaults) == "in-process"
    assert "engine_process" not in bdc.setup_of(defaults)


def test_gpu_numa_node_is_vllms(monkeypatch):
    """The placement's GPU node is what vLLM's platform reports (NVML); None
    without a GPU."""
    import torch
    from vllm.platforms import current_platform

    assert bdo._gpu_numa_node() is None  # CPU-only here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(
        current_platform, "get_device_numa_node", lambda d: {3: 1}[d], raising=False
    )
    assert bdo._gpu_numa_node() == 1


def test_host_placement_parsers():
    assert bdo.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert bdo.parse_cpulist("") == []
    maps = (
        "7f00 default file=/lib/x.so mapped=3 N0=2 N1=1 kernelpagesize_kB=4\n"
        "7f10 interleave:0-1 anon=10 dirty=10 N1=10 kernelpagesize_kB=4\n"
    )
    assert bdo.numa_kib(maps) == {0: 8, 1: 44}
    huge = "7f20 default file=/h huge dirty=2 N1=2 kernelpagesize_kB=2048\n"
    assert bdo.numa_kib(maps + huge) == {0: 8, 1: 44 + 4096}
    placement = bdo.host_placement()  # this machine: one process, no GPU
    me = placement["processes"][0]
    assert me["pid"] == os.getpid() and me["cpus_allowed"] >= 1
    assert os.getpid() in {t["tid"] for t in me["threads"]}  # the main thread
    assert all(t["cpu_s"] >= 0 and t["last_cpu"] >= 0 for t in me["threads"])
    assert placement["caller_torch_threads"] >= 1
    assert placement["cpus"] == os.cpu_count() and placement["numa_nodes"] >= 1
    json.dumps(placement)  # goes into a result row


def test_rounds_interleave_configs_and_summarize(tmp_path, monkeypatch, capsys):
    """--rounds 3: every config once per round in fresh processes, the order
    reversed in round 2, one directory per round; rounds.md gives the median
    over rounds of each ratio to the same round's DFlash, with its range."""
    calls = []
    # Steps per round: DFlash 6, 8, 9 ms, DDTree 7, 7, 9 ms. Paired in their
    # round the ratios are 7/6, 7/8, 9/9, median 1.0; the ratio of the medians
    # (7/8) is not what is reported.
    step_ms = {"dflash": iter([6.0, 8.0, 9.0]), "ddtree-128": iter([7.0, 7.0, 9.0])}

    def fake(args, config, max_batch, runs, prompts, rid, time_left):
        calls.append((args.out.name, config))
        _append_fake_rows(args, config, runs, rid, next(step_ms[config]))
        return True

    monkeypatch.setattr(bd, "run_offline_config", fake)
    out = tmp_path / "r"
    argv = [
        "cost",
        "--out",
        str(out),
        "--configs",
        "dflash,ddtree-128",
        "--batches",
        "1",
        "--rounds",
        "3",
    ]
    assert bd.main(argv) == 0
    assert calls == [
        ("round1", "dflash"),
        ("round1", "ddtree-128"),
        ("round2", "ddtree-128"),
        ("round2", "dflash"),
        ("round3", "dflash"),
        ("round3", "ddtree-128"),
    ]
    summary = {r["config"]: r for r in json.loads((out / rep.ROUNDS_FILE).read_text())}
    tree = summary["ddtree-128"]
    assert tree["rounds"] == 3
    assert tree["step_vs_dflash"] == pytest.approx(1.0)
    assert tree["step_vs_dflash_min"] == pytest.approx(7 / 8)
    assert tree["step_vs_dflash_max"] == pytest.approx(7 / 6)
    assert summary["dflash"]["decode_ms_per_step"] == 8.0
    text = (out / rep.ROUNDS_REPORT).read_text()
    assert "| ddtree-128 | 1 | 0.0 | 3 |" in text and "(0.875 - 1.167)" in text
    assert (
        "step time 1.000 x DFlash's (target <= 1.10): met (median of 3 rounds, "
        "0.875 - 1.167; not met in every round)" in text
    )
    for k in (1, 2, 3):
        assert (out / f"round{k}" / rep.RESULTS_FILE).is_file()
    # Measured rounds are skipped on a rerun with --resume-from.
    again = tmp_path / "again"
    assert bd.main([*argv[:2], str(again), *argv[3:], "--resume-from", str(out)]) == 0
    assert len(calls) == 6
    # A round's own folder is not what --rounds resumes from.
    wrong = [*argv[:2], str(tmp_path / "w"), *argv[3:], "--resume-from"]
    assert bd.main([*wrong, str(out / "round1")]) == 2
    assert "no round<k> folders there" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bd.parse_args([*argv[:-1], "0"])
    assert "--rounds must be >= 1" in capsys.readouterr().err


def test_rounds_summary_scores_within_rounds():
    """The batch-1 e2e target over rounds is the median of each round's own
    throughput / acceptance score; a round without DFlash counts in ``rounds``
    but not in a ratio's ``_n``; a baseline from another command is flagged."""

    def row(config, tok_s, tau, rid="a"):
        return {
            "config": config,
            "batch": 1,
            "temperature": 0.0,
            "tok_s": tok_s,
            "acceptance_length": tau,
            "run_id": rid,
        }

    rounds = [
        [row("dflash", 100.0, 5.0), row("ddtree-32", 130.0, 6.0)],  # 1.3 / 1.2
        [row("dflash", 140.0, 5.0), row("ddtree-32", 126.0, 6.5)],  # 0.9 / 1.3
        [row("dflash", 100.0, 5.0), row("ddtree-32", 125.0, 5.5, "b")],  # 1.25 / 1.1
        [row("ddtree-32", 125.0, 6.0)],  # no DFlash in this round
    ]
    tree = {r["config"]: r for r in rep.rounds_summary(rounds)}["ddtree-32"]
    assert tree["rounds"] == 4 and tree["tok_s_vs_dflash_n"] == 3
    scores = sorted([1.3 / 1.2, 0.9 / 1.3, 1.25 / 1.1])
    assert tree["score_vs_dflash"] == pytest.approx(scores[1])
    ratio_of_medians = tree["tok_s_vs_dflash"] / tree["tau_vs_dflash"]
    assert ratio_of_medians == pytest.approx(1.25 / 1.2)  # what is not reported
    assert tree["score_vs_dflash"] != pytest.approx(ratio_of_medians)
    assert tree["same_run"] is False
    (check,) = rep.target_checks([tree], "e2e")
    assert f"{scores[1]:.3f} of the acceptance ratio" in check
    assert ": met (median of 3 rounds" in check and "not met in every round" in check
    assert check.endswith("(baseline from another GPU command)")


def test_serve_dataset_reads_back_through_vllm_bench(tmp_path):
    """vLLM's own ShareGPT loader (no pandas needed) returns the held-out prompts
    as they are, in order, with the requested output length."""
    from vllm.benchmarks.datasets import ShareGPTDataset
    from vllm.tokenizers import get_tokenizer

    prompts = bdc.load_prompts(PAIR / "eval_prompts.json")[:4]
    path = bds.write_serve_dataset(prompts, tmp_path / "d.json")
    got = ShareGPTDataset(
        random_seed=0, dataset_path=str(path), disable_shuffle=True
    ).sample(
        tokenizer=get_tokenizer(str(PAIR / "target")), num_requests=4, output_len=96
    )
    assert [r.prompt for r in got] == prompts
    assert {r.expected_output_len for r in got} == {96}


# ---------------------------------------------------------------------------
# Projections
# ---------------------------------------------------------------------------


def _cost_rows():
    ms = {
        "none": (5.21, 5.71),
        "dflash": (6.46, 9.56),
        "ddtree-128": (7.0, 14.0),
        "ddtree-512": (8.0, 30.0),
    }
    return [
        _row(c, b, decode_ms_per_step=t[i])
        for c, t in ms.items()
        for i, b in enumerate((1, 16))
    ]


def test_projection_math():
    steps = proj.step_times(_cost_rows(), 0.0)
    assert steps[("dflash", 16)] == 9.56
    taus = {"none": 1.0, "dflash": 7.79, "ddtree-128": 9.0, "ddtree-512": 10.73}
    rows = {(r["config"], r["batch"]): r for r in proj.project(steps, taus)}
    r = rows[("ddtree-512", 1)]
    assert math.isclose(r["tok_s"], 10.73 / 8.0 * 1000)
    assert math.isclose(r["vs_none"], (10.73 / 8.0) / (1 / 5.21))
    assert math.isclose(r["vs_dflash"], (10.73 / 8.0) / (7.79 / 6.46))
    assert math.isclose(rows[("dflash", 16)]["tok_s"], 16 * 7.79 / 9.56 * 1000)
    assert math.isclose(rows[("none", 1)]["vs_none"], 1.0)
    auto = proj.auto_budget(proj.project(steps, taus))
    assert [(a["batch"], a["budget"]) for a in auto] == [(1, 512), (16, 128)]
    assert auto[1]["vs_dflash"] < 1.0  # at 16 even the best tree loses here
    assert proj.budget_schedule(auto) == [[1, 1, 512], [2, 16, 128]]
    # Unsorted rows; the schedule passes ddtree's own checks.
    rows = [
        {"batch": 64, "budget": 16},
        {"batch": 1, "budget": 256},
        {"batch": 4, "budget": 128},
    ]
    schedule = proj.budget_schedule(rows)
    assert schedule == [[1, 1, 256], [2, 4, 128], [5, 64, 16]]
    from vllm.v1.spec_decode.ddtree_config import parse_budget_schedule

    assert parse_budget_schedule(schedule) == [tuple(e) for e in schedule]
    assert proj.project(steps, {"none": 1.0})[0]["vs_dflash"] is None


def test_projection_of_a_schedule():
    """ddtree-auto / ddtree-schedule rows take, per batch, the acceptance of the
    budget their schedule picks there; the report says whether each reaches
    DFlash."""
    schedule = [[1, 4, 32], [5, 1024, 15]]
    cost = [
        _row("dflash", 1, decode_ms_per_step=6.4),
        _row("dflash", 16, decode_ms_per_step=9.6),
        _row(
            "ddtree-auto",
            1,
            decode_ms_per_step=6.7,
            tree_budget_per_batch_size=schedule,
        ),
        _row(
            "ddtree-auto",
            16,
            decode_ms_per_step=10.0,
            tree_budget_per_batch_size=schedule,
        ),
    ]
    steps, schedules = proj.step_times(cost, 0.0), proj.schedules_of(cost)
    assert schedules == {"ddtree-auto": schedule}
    taus = {"dflash": 4.1, "ddtree-32": 5.5, "ddtree-15": 4.0, "ddtree-auto": 99.0}
    rows = {(r["config"], r["batch"]): r for r in proj.project(steps, taus, schedules)}
    assert rows[("ddtree-auto", 1)]["tau"] == 5.5
    assert rows[("ddtree-auto", 16)]["tau"] == 4.0
    assert math.isclose(
        rows[("ddtree-auto", 16)]["vs_dflash"], (4.0 / 10.0) / (4.1 / 9.6)
    )
    lines = proj.schedule_verdicts(proj.project(steps, taus, schedules), schedules)
    assert lines == [
        "- ddtree-auto, batch 1 (budget 32): projected 1.281 x DFlash, >= DFlash: yes",
        "- ddtree-auto, batch 16 (budget 15): projected 0.937 x DFlash, >= DFlash: NO",
    ]
    # Without the budget's acceptance the batch is not projected.
    assert ("ddtree-auto", 16) not in {
        (r["config"], r["batch"])
        for r in proj.project(steps, {"dflash": 4.1, "ddtree-32": 5.5}, schedules)
    }
    # The auto-budget table only considers fixed budgets.
    assert all(
        a["budget"] is not None
        for a in proj.auto_budget(proj.project(steps, taus, schedules))
    )


def test_projection_ratios_stay_within_a_command(tmp_path):
    """Two cost commands with different DFlash steps: each config is compared with
    the DFlash of the command that measured it; the later command's step of a
    (config, batch) wins; the report names the command line and DFlash's spread."""
    older = [
        _row("dflash", 1, decode_ms_per_step=6.0),
        _row("ddtree-32", 1, decode_ms_per_step=6.6),
        _row("ddtree-64", 1, decode_ms_per_step=9.9),
    ]
    newer = [
        _row("dflash", 1, decode_ms_per_step=5.0),
        _row("ddtree-64", 1, decode_ms_per_step=7.5),
        _row("ddtree-128", 1, decode_ms_per_step=9.0),
    ]  # no none anywhere
    steps, baselines = proj.command_steps([older, newer], 0.0)
    assert steps == {
        ("dflash", 1): 5.0,
        ("ddtree-32", 1): 6.6,
        ("ddtree-64", 1): 7.5,
        ("ddtree-128", 1): 9.0,
    }
    taus = {"dflash": 4.0, "ddtree-32": 5.0, "ddtree-64": 6.0, "ddtree-128": 6.0}
    rows = {r["config"]: r for r in proj.project(steps, taus, None, baselines)}
    assert math.isclose(rows["ddtree-32"]["vs_dflash"], (5.0 / 6.6) / (4.0 / 6.0))
    assert math.isclose(rows["ddtree-64"]["vs_dflash"], (6.0 / 7.5) / (4.0 / 5.0))
    assert rows["ddtree-32"]["vs_none"] is None
    # Without baselines the merged DFlash (the newer command's) is the reference.
    merged = {r["config"]: r for r in proj.project(steps, taus)}
    assert math.isclose(merged["ddtree-32"]["vs_dflash"], (5.0 / 6.6) / (4.0 / 5.0))
    dirs = []
    for name, rows_ in (("old", older), ("new", newer)):
        d = tmp_path / name
        d.mkdir()
        for r in rows_:
            rep.append_row(d, r)
        dirs.append(str(d))
    out = tmp_path / "proj.md"
    assert proj.main(["--cost", *dirs, "--no-paper", "--out", str(out)]) == 0
    text = out.read_text()
    assert f"Command: `python benchmarks/project_8b.py --cost {' '.join(dirs)}" in text
    assert "batch 1: 5.00-6.00 ms (2 commands)" in text
    assert "| ddtree-32 | 6.60 (1.10x) |" in text
    assert "| ddtree-64 | 7.50 (1.50x) |" in text


def test_pooled_tau():
    rows = [
        _row("dflash", 1, num_drafts=10, num_accepted_tokens=50),
        _row("dflash", 8, num_drafts=30, num_accepted_tokens=70),
        _row("dflash", 1, 1.0, num_drafts=10, num_accepted_tokens=10),
        _row("none", 1),
        _row("ddtree-64", 1, num_drafts=0),
    ]
    assert proj.pooled_tau(rows, 0.0) == {"none": 1.0, "dflash": 1 + 120 / 40}


def test_projection_report_is_labelled(tmp_path, capsys):
    cost, e2e = tmp_path / "cost", tmp_path / "e2e"
    for d, rows in (
        (cost, _cost_rows()),
        (
            e2e,
            [
                _row("dflash", 1, num_drafts=10, num_accepted_tokens=60),
                _row("ddtree-128", 1, num_drafts=10, num_accepted_tokens=80),
            ],
        ),
    ):
        d.mkdir()
        for r in rows:
            rep.append_row(d, r)
    out = tmp_path / "proj.md"
    assert proj.main(["--cost", str(cost), "--e2e", str(e2e), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# Projected Qwen3-8B speedups (projected")
    assert "acceptance lengths from the trained pair" in text
    assert "acceptance lengths from paper (Qwen3-8B, MATH-500, T=0" in text
    assert "projected x DFlash" in text and "best budget (projected)" in text
    assert "| 1 | ddtree-512 | 10.73 | 8.00 |" in text
    with pytest.raises(SystemExit):
        proj.main(["--cost", str(tmp_path / "missing")])
    assert "no results.jsonl" in capsys.readouterr().err


def test_host_usage_sees_a_busy_thread_and_a_child(tmp_path):
    """The busiest thread over the pass is found among this process and its
    children (a multiprocess engine core runs in a child): a child spinning for
    the whole pass reads the CPU share it really got (its own counters over the
    same pass, so other jobs on the machine do not matter), this idle process
    does not; steal and busy CPUs come from the whole machine's counters."""
    import os
    import subprocess
    import sys
    import time

    def cpu_s(pid: int) -> float:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt=time.time()\nwhile time.time()-t<30: pass",
        ]
    )
    try:
        time.sleep(0.2)
        before, start = cpu_s(child.pid), time.monotonic()
        usage = bdo.HostUsage()
        time.sleep(1.0)
        got = usage.stop()
        share = 100 * (cpu_s(child.pid) - before) / (time.monotonic() - start)
    finally:
        child.kill()
        child.wait()
    assert got["wall_s"] >= 1.0
    assert got["calibration_ms"] > 0
    assert got["step_thread"].startswith("python")
    assert share >= 20.0, f"the child barely ran ({share:.0f} %): no test"
    assert abs(got["step_thread_busy_pct"] - share) <= 20.0, (got, share)
    assert got["busy_cpus"] >= 0.6 * share / 100, got
    assert got["steal_pct"] is None or 0.0 <= got["steal_pct"] <= 100.0
    # A pass with nobody busy: the busiest thread is far below 100 %.
    idle = bdo.HostUsage()
    time.sleep(0.5)
    assert idle.stop()["step_thread_busy_pct"] < 50.0


def test_host_table_in_the_report():
    rows = [
        _row(
            "dflash",
            1,
            decode_ms_per_step=3.9,
            host_usage={
                "calibration_ms": 15.9,
                "step_thread": "VLLM::EngineCore",
                "step_thread_busy_pct": 99.0,
                "next_thread_busy_pct": 4.0,
                "steal_pct": 0.5,
                "busy_cpus": 1.2,
            },
        ),
        _row("ddtree-auto", 1, decode_ms_per_step=3.4),
    ]
    text = rep.markdown_report(rows, "e2e", None)
    assert "Host during the timed pass" in text
    assert (
        "| 1 | 0.0 | dflash | 3.90 | 15.90 | VLLM::EngineCore, 99.0 | 4.0 | 0.50 | 1.20 |"
        in text
    )
    # Rows without the field (older results) are left out of the table.
    assert "| ddtree-auto | 3.40 | -" not in text
    assert rep.host_table([_row("dflash", 1)]) is None


def test_interleave_options(tmp_path, capsys):
    """--interleave: serve only, two configs or more, memory shares that fit
    together (unset: an equal share each), and in the setup (its rows never
    merge with those of one server at a time)."""
    base = ["serve", "--out", str(tmp_path / "o"), *_pair(tmp_path)]
    base += ["--configs", "dflash,ddtree-auto"]
    plain = bd.parse_args(base)
    assert bdc.interleave_of(plain) == 0 and "interleave" not in bdc.setup_of(plain)
    args = bd.parse_args([*base, "--interleave", "4"])
    assert bdc.setup_of(args)["interleave"] == 4
    assert bdc.setup_of(args)["interleave_gpu_memory"] == 0.45
    assert bdc.interleave_memory(args) == 0.45
    three = bd.parse_args(
        [*base, "--interleave", "4", "--configs", "none,dflash,ddtree-8"]
    )
    assert bdc.interleave_memory(three) == 0.3
    own = bd.parse_args([*base, "--interleave", "2", "--gpu-memory-utilization", "0.2"])
    assert bdc.interleave_memory(own) == 0.2
    with pytest.raises(ValueError, match="differ"):
        rep.check_setup(bdc.setup_of(plain), bdc.setup_of(args), "o")
    for extra, message in (
        (["--interleave", "2", "--configs", "dflash"], "two or more"),
        (["--interleave", "2", "--gpu-memory-utilization", "0.5"], "does not fit"),
        (["--interleave", "-1"], "--interleave must be >= 0"),
        (["--interleave", "3"], "even number of slices"),
        (
            ["--interleave", "2", "--settings", "tuned"],
            "does not take --settings tuned",
        ),
        (
            ["--interleave", "2", "--engine-arg", "gpu_memory_utilization=0.9"],
            "not --engine-arg",
        ),
    ):
        with pytest.raises(SystemExit):
            bd.parse_args([*base, *extra])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):  # offline modes have no servers to interleave
        bd.parse_args(
            ["e2e", "--out", str(tmp_path / "e"), *_pair(tmp_path), "--interleave", "2"]
        )


def test_slice_sizes():
    """An even count (ABBA pairs), at most one slice per two waves, never
    under two slices."""
    assert bds.slice_sizes(512, 32, 4) == [128] * 4
    assert bds.slice_sizes(512, 64, 4) == [128] * 4  # 8 waves: two per slice
    assert bds.slice_sizes(512, 64, 8) == [128] * 4  # not one wave per slice
    assert bds.slice_sizes(32, 1, 4) == [8] * 4
    assert bds.slice_sizes(17, 4, 4) == [9, 8]
    assert bds.slice_sizes(10, 8, 4) == [5, 5]  # under two waves: still a pair
    assert bds.slice_sizes(1, 1, 2) == [1]  # one request cannot be split
    for n, b, s in ((512, 64, 6), (33, 2, 10), (7, 1, 2)):
        sizes = bds.slice_sizes(n, b, s)
        assert sum(sizes) == n and len(sizes) % 2 == 0


def test_combine_slices():
    """Slices of one cell make one vllm bench serve result: throughput from
    the summed tokens over the summed durations (not the mean of the slices'
    throughputs), request-weighted means, draft-weighted acceptance, medians
    of the latency medians."""
    a = {
        "duration": 2.0,
        "total_output_tokens": 1000,
        "output_throughput": 500.0,
        "completed": 4,
        "failed": 0,
        "mean_tpot_ms": 4.0,
        "mean_ttft_ms": 10.0,
        "median_itl_ms": 3.0,
        "p99_itl_ms": 9.0,
        "median_ttft_ms": 11.0,
        "spec_decode_num_drafts": 100,
        "spec_decode_draft_tokens": 1500,
        "spec_decode_accepted_tokens": 300,
        "spec_decode_acceptance_length": 4.0,
        "spec_decode_per_position_acceptance_rates": [0.8, 0.4],
    }
    b = {
        **a,
        "duration": 6.0,
        "total_output_tokens": 1000,
        "output_throughput": 166.7,
        "completed": 12,
        "mean_tpot_ms": 8.0,
        "median_itl_ms": 5.0,
        "spec_decode_num_drafts": 300,
        "spec_decode_accepted_tokens": 300,
        "spec_decode_acceptance_length": 2.0,
        "spec_decode_per_position_acceptance_rates": [0.4, 0.0, 0.1],
    }
    c = bds.combine_slices([a, b])
    assert c["output_throughput"] == 250.0  # 2000 tokens in 8 s
    assert c["completed"] == 16 and c["slices"] == 2
    assert c["mean_tpot_ms"] == pytest.approx((4 * 4 + 12 * 8) / 16)
    assert c["median_itl_ms"] == 4.0 and c["p99_itl_ms"] == 9.0
    # 1 + 600 accepted / 400 drafts, as vLLM's own definition gives it.
    assert c["spec_decode_acceptance_length"] == pytest.approx(2.5)
    assert c["spec_decode_accepted_tokens"] == 600
    # b's third position counts as 0 accepted in a: (0 * 100 + 0.1 * 300) / 400.
    assert c["spec_decode_per_position_acceptance_rates"] == pytest.approx(
        [0.5, 0.1, 0.075]
    )
    row = bds.serve_row(c)
    assert row["tok_s"] == 250.0 and row["acceptance_length"] == pytest.approx(2.5)
    plain = bds.combine_slices([{k: v for k, v in a.items() if "spec" not in k}])
    assert "spec_decode_num_drafts" not in plain
    assert bds.serve_row(plain)["acceptance_length"] is None


def test_cpu_lists():
    """--pin-cpus' syntax is taskset's; the setup writes it back with ranges
    merged."""
    assert hu.parse_cpu_list("2-4,7") == {2, 3, 4, 7}
    assert hu.parse_cpu_list(" 0 ") == {0}
    assert hu.parse_cpu_list("3,1-2") == {1, 2, 3}
    assert hu.format_cpu_list({7, 2, 3, 4, 9}) == "2-4,7,9"
    assert hu.format_cpu_list({5}) == "5"
    for text in ("2-4,7", "0", "0-15", "1,3,5-6"):
        assert hu.format_cpu_list(hu.parse_cpu_list(text)) == text
    for bad, message in (
        ("", "bad CPU list"),
        ("a", "bad CPU list"),
        ("4-2", "runs backwards"),
        ("1-", "bad CPU list"),
        ("1,,2", "bad CPU list"),
        ("\u00b2", "bad CPU list"),  # a digit to str.isdigit, not a number
    ):
        with pytest.raises(ValueError, match=message):
            hu.parse_cpu_list(bad)


def test_pin_cpus_options(tmp_path, capsys):
    """--pin-cpus: serve only, CPUs this process may use, at least one left
    for the script and its clients; in the setup (pinned rows never merge with
    unpinned ones)."""
    base = ["serve", "--out", str(tmp_path / "o"), *_pair(tmp_path)]
    mine = sorted(os.sched_getaffinity(0))
    plain = bd.parse_args(base)
    assert bdc.pin_cpus_of(plain) is None and "pin_cpus" not in bdc.setup_of(plain)
    cases = [
        (["--pin-cpus", str(os.cpu_count())], "does not exist here"),
        (["--pin-cpus", "0-4000000000"], "does not exist here"),
        (["--pin-cpus", "x"], "--pin-cpus: bad CPU list"),
        (
            ["--pin-cpus", hu.format_cpu_list(mine)],
            "leaves no CPU for this script",
        ),
    ]
    for extra, message in cases:
        with pytest.raises(SystemExit):
            bd.parse_args([*base, *extra])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):  # offline engines run in this script's tree
        bd.parse_args(
            ["e2e", "--out", str(tmp_path / "e"), *_pair(tmp_path), "--pin-cpus", "0"]
        )
    capsys.readouterr()
    if len(mine) < 2:
        pytest.skip("one CPU here: nothing to pin a server to apart from clients")
    args = bd.parse_args([*base, "--pin-cpus", str(mine[-1])])
    assert bdc.pin_cpus_of(args) == {mine[-1]}
    assert bdc.setup_of(args)["pin_cpus"] == str(mine[-1])
    with pytest.raises(ValueError, match="differ"):
        rep.check_setup(bdc.setup_of(plain), bdc.setup_of(args), "o")


def test_pin_process_tree_pins_every_thread(tmp_path):
    """Every thread of a process and of its child, started before the pinning,
    ends up on the CPUs asked for (Linux affinity is per thread)."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("one CPU here: a pinned set would equal the whole machine")
    code = textwrap.dedent(
        """
        import os, subprocess, sys, threading, time
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        grandchild = "import time; time.sleep(60)"
        child = subprocess.Popen([sys.executable, "-c",
            "import subprocess, sys, time; "
            f"subprocess.Popen([sys.executable, '-c', {grandchild!r}]); "
            "time.sleep(60)"])
        print(child.pid, flush=True)
        sys.stdin.readline()  # pinned meanwhile: a thread started now inherits
        late = threading.Thread(target=time.sleep, args=(60,), daemon=True)
        late.start()
        time.sleep(0.2)
        print(sorted(os.sched_getaffinity(late.native_id)), flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = None
    try:
        child = int(proc.stdout.readline())
        import psutil

        deadline = time.monotonic() + 30
        while not psutil.Process(child).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        (grandchild,) = psutil.Process(child).children()
        tree = (proc.pid, child, grandchild.pid)
        tids = [t.id for p in tree for t in psutil.Process(p).threads()]
        assert len(tids) >= 4  # main + sleeper thread, the child's, the grandchild's
        assert all(os.sched_getaffinity(t) == set(mine) for t in tids)
        target = {mine[-1]}
        assert hu.pin_process_tree(proc.pid, target) == len(tids)
        assert [os.sched_getaffinity(t) for t in tids] == [target] * len(tids)
        assert hu.pin_process_tree(proc.pid, target) == len(tids)  # settled
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline()) == sorted(target)
    finally:
        if child is not None:
            import psutil

            for p in psutil.Process(child).children():
                p.kill()
            os.kill(child, signal.SIGKILL)
        proc.kill()
        proc.wait()


def test_report_shows_interleaved_slices():
    """Interleaved rows get a table of their slices' throughputs and each
    slice's ratio to DFlash's slice of the same index; other rows none."""
    base = {"mode": "serve", "batch": 8, "temperature": 0.0, "run_id": "r"}
    rows = [
        {
            **base,
            "config": "dflash",
            "tok_s": 100.0,
            "slices": 2,
            "slices_tok_s": [100.0, 80.0],
        },
        {
            **base,
            "config": "ddtree-auto",
            "tok_s": 110.0,
            "slices": 2,
            "slices_tok_s": [120.0, 80.0],
        },
    ]
    text = rep.markdown_report(rows, "serve", None)
    assert "Interleaved servers" in text
    (line,) = [
        x for x in text.splitlines() if x.startswith("| 8 | 0.0 | ddtree-auto | 2 |")
    ]
    assert "120.0, 80.0" in line and "1.200, 1.000" in line
    plain = [{k: v for k, v in r.items() if "slices" not in k} for r in rows]
    assert "Interleaved servers" not in rep.markdown_report(plain, "serve", None)


def test_dflash_schedule_config():
    drafter = Path("/d")
    assert bdc.speculative_config("dflash-schedule", drafter) == {
        "method": "dflash",
        "model": "/d",
        "num_speculative_tokens": 15,
        "num_speculative_tokens_per_batch_size": [
            [1, 8, 15],
            [9, 32, 7],
            [33, 1024, 3],
        ],
    }
    mine = [[1, 4, 15], [5, 1024, 5]]
    spec = bdc.speculative_config("dflash-schedule", drafter, dflash_schedule=mine)
    assert spec["num_speculative_tokens_per_batch_size"] == mine
    assert bdc.parse_configs("ddtree-16,dflash-schedule,none", [16]) == [
        "none",
        "dflash-schedule",
        "ddtree-16",
    ]
    with pytest.raises(ValueError, match="unknown config 'dflash-schedule-adaptive'"):
        bdc.parse_configs("dflash-schedule-adaptive", [16])
    assert bdc.parse_dflash_schedule(json.dumps(mine)) == mine
    for bad in ("[[1, 4, 16]]", "[[4, 1, 3]]", "[]", "{"):
        with pytest.raises(ValueError, match="--dflash-schedule"):
            bdc.parse_dflash_schedule(bad)


def test_start_up_is_recorded_per_config(tmp_path, capsys):
    from benchmarks.bench_ddtree_serve import record_start_up

    record_start_up(tmp_path, "none", 44.96)
    record_start_up(tmp_path, "ddtree-auto-adaptive", 231.04)
    record_start_up(tmp_path, "none", 45.5)  # a later start of the same config
    times = json.loads((tmp_path / "start_up.json").read_text())
    assert times == {"none": 45.5, "ddtree-auto-adaptive": 231.0}
    assert "ddtree-auto-adaptive: ready after 231 s" in capsys.readouterr().out
