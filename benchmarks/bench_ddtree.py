# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End-to-end DDTree benchmark through vLLM: no speculation, DFlash (15 draft
tokens) and DDTree at several tree budgets, measured side by side.

Modes:

* ``e2e``: a trained target/drafter pair (``--target``, ``--drafter``) on held-out
  prompts (``--prompts``: JSON or JSONL of texts or token-id lists), offline
  ``vllm.LLM``. Batches 1, 8, 32; temperatures 0 and 1. Requests come in waves
  of ``batch`` that start together, or with ``--arrivals continuous`` all at once
  into an engine that runs ``batch`` of them at a time (mixed prefill and decode
  steps, as behind a server).
* ``cost``: a Qwen3-8B-shaped target and a DFlash-8B-shaped drafter from
  ``benchmarks/model_configs`` (config.json only, ``load_format="dummy"``, no
  tokenizer), random prompts, ``ignore_eos``, fixed output length. With random
  weights nothing is accepted beyond chance, so the decode step time is the cost
  of verify + draft + tree ops. Batches 1, 4, 16, 64; temperature 0.
* ``serve``: like ``e2e`` through ``vllm serve`` and vLLM's own ``vllm bench
  serve`` (text prompts only).
* ``report``: merge the results of one or more ``--out`` directories into one
  markdown table.

Every engine configuration (``none``, ``dflash``, ``ddtree-<B>``) runs in its own
process, one after another (vLLM's memory profiler fails when engines share a GPU
concurrently), and measures all its batches and temperatures: a warm-up, the same
requests with max_tokens=1 (prefill), then the timed generation. Each measurement
is appended at once to ``<out>/results.jsonl``; a rerun with the same ``--out`` (or
``--resume-from`` earlier output directories) skips what is already measured, so
a long sweep splits into GPU commands that each fit a time limit
(``--limit-seconds``). ``<out>/results.md`` holds the table with ratios to DFlash
and to no speculation of the same batch and temperature, per-depth acceptance and
issue 5's targets. See docs/bench_ddtree.md for the H200 commands.

    python benchmarks/bench_ddtree.py cost --out OUT [--configs none,dflash,ddtree-128]
    python benchmarks/bench_ddtree.py e2e --target T --drafter D --prompts P --out OUT
    python benchmarks/bench_ddtree.py report OUT [OUT2 ...]
"""

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_ddtree_report import (  # noqa: E402
    ADAPTIVE_SUFFIX,
    AUTO_CONFIG,
    REPORT_FILE,
    RESULTS_FILE,
    SCHEDULE_CONFIG,
    SETUP_FILE,
    append_row,
    base_config,
    budget_of,
    check_setup,
    config_order,
    is_adaptive,
    load_rows,
    markdown_report,
    merge_rows,
    metric_delta,
    metric_totals,
    pending,
    row_key,
    schedule_budget,
    spec_stats,
    timing_stats,
    write_rounds_report,
)
from benchmarks.kv_usage import KvSampler  # noqa: E402
from benchmarks.host_usage import (  # noqa: E402
    HostUsage,
    format_cpu_list,
    parse_cpu_list,
    pin_process_tree,
    process_tree,
    thread_info,
)
from tests.e2e.servers import free_port, plugin_site  # noqa: E402

MODEL_CONFIGS = ROOT / "benchmarks" / "model_configs"
DFLASH_TOKENS = 15  # DFlash's chain: a block of 16 minus the root
# `vllm serve` on a GPU of >= 70 GiB defaults to 8192 batched tokens and 1024
# sequences, and vLLM then refuses DFlash's 14 new slots per sequence for
# drafting (8192 - 1024 * 14 < 0); a DFlash user must lower max_num_seqs. 256,
# vLLM's default on smaller GPUs, is what the benchmark sets, and says so.
DFLASH_SERVE_MAX_NUM_SEQS = 256
DRAFT_LEN = DFLASH_TOKENS + 1
MAX_BUDGET = 1024
ALL_BUDGETS = (16, 32, 64, 128, 256, 512, 1024)
# Qwen3's vocabulary below its special tokens, for random prompts.
RANDOM_VOCAB = 151643
SERVED_NAME = "bench"
# How e2e requests reach the engine (--arrivals).
ARRIVALS = ("waves", "continuous")
# --settings: "defaults" is what a user runs (vLLM's engine defaults, prompts the
# engine has not seen); "tuned" the earlier benchmark settings, labelled as such.
SETTINGS = ("defaults", "tuned")
# Prompt tags one (batch, temperature) run may use: 3 phases x its requests.
TAGS_PER_RUN = 1_000_000
TUNED_GPU_MEMORY_UTILIZATION = 0.85

MODE_DEFAULTS = {
    "e2e": {
        "batches": (1, 8, 32),
        "temperatures": (0.0, 1.0),
        "max_tokens": 256,
        "num_prompts": 32,
        "min_waves": 1,
        "config_seconds": 120,
    },
    "serve": {
        "batches": (1, 8, 32),
        "temperatures": (0.0, 1.0),
        "max_tokens": 256,
        # A cell of the trained pair's at concurrency 8 with four waves (32
        # requests) lasted about a second, and rounds of it ranged 0.80-1.21x
        # DFlash: 32 waves (at most max_prompts requests) time each cell over
        # several seconds at every concurrency.
        "num_prompts": 32,
        "min_waves": 32,
        "max_prompts": 512,
        "config_seconds": 210,
    },
    "cost": {
        "batches": (1, 4, 16, 64),
        "temperatures": (0.0,),
        "max_tokens": 128,
        "waves": 2,
        "config_seconds": 120,
    },
}


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    for mode, text in (
        ("e2e", "a trained target/drafter pair through vllm.LLM"),
        ("cost", "Qwen3-8B / DFlash-8B shapes, dummy weights: time per step"),
        ("serve", "a trained pair through vllm serve + vllm bench serve"),
    ):
        p = sub.add_parser(mode, help=text, description=text)
        _add_run_args(p, mode)
    p = sub.add_parser("report", help="merge result directories into one table")
    p.add_argument("dirs", type=Path, nargs="+", help="--out directories, later wins")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the merged results.jsonl and results.md here",
    )
    p.add_argument(
        "--rounds",
        action="store_true",
        help="each directory is one round of the same sweep (e.g. one per GPU "
        "command): write rounds.md and rounds.json (median and range over the "
        "rounds) to --out instead of merging",
    )
    return parser


def _add_run_args(p: argparse.ArgumentParser, mode: str) -> None:
    d = MODE_DEFAULTS[mode]
    paired = mode != "cost"
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="results directory (created; reused to resume)",
    )
    p.add_argument(
        "--resume-from",
        type=Path,
        nargs="*",
        default=[],
        help="earlier --out directories whose results count as done",
    )
    p.add_argument(
        "--target",
        type=Path,
        required=paired,
        default=None if paired else MODEL_CONFIGS / "qwen3_8b",
        help="target model directory",
    )
    p.add_argument(
        "--drafter",
        type=Path,
        required=paired,
        default=None if paired else MODEL_CONFIGS / "dflash_qwen3_8b",
        help="DFlash drafter directory",
    )
    if paired:
        p.add_argument(
            "--prompts",
            type=Path,
            required=True,
            help="JSON list / JSONL of texts or token-id lists (held out)",
        )
        p.add_argument(
            "--ignore-eos",
            action="store_true",
            help="generate max-tokens tokens whatever the model says",
        )
    else:
        p.add_argument(
            "--input-len", type=int, default=1024, help="random prompt length in tokens"
        )
    p.add_argument(
        "--configs",
        default="none,dflash,ddtree",
        help="comma list of none, dflash, ddtree (= every --budgets), "
        f'ddtree-<B>, {AUTO_CONFIG} (tree_budget "auto"), '
        f"{SCHEDULE_CONFIG} (needs --schedule); a DDTree config with "
        f"{ADAPTIVE_SUFFIX} runs with adaptive_budget true (e.g. "
        f"{AUTO_CONFIG}{ADAPTIVE_SUFFIX})",
    )
    p.add_argument(
        "--budgets",
        default=",".join(map(str, ALL_BUDGETS)),
        help="tree budgets that 'ddtree' in --configs expands to",
    )
    p.add_argument(
        "--schedule",
        default=None,
        help=f"{SCHEDULE_CONFIG}'s tree_budget_per_batch_size: JSON "
        "([[first, last, budget], ...]) or a file holding it, e.g. "
        "what benchmarks/project_8b.py prints",
    )
    p.add_argument("--batches", default=",".join(map(str, d["batches"])))
    p.add_argument("--temperatures", default=",".join(map(str, d["temperatures"])))
    p.add_argument("--max-tokens", type=int, default=d["max_tokens"])
    if paired:
        p.add_argument(
            "--num-prompts",
            type=int,
            default=d["num_prompts"],
            help="requests per (batch, temperature): waves of batch "
            "requests (e2e), at most batch at once (serve)",
        )
        p.add_argument(
            "--min-waves",
            type=int,
            default=d["min_waves"],
            help="at least this many waves of batch requests per "
            "(batch, temperature), cycling the prompts, so large "
            "batches are timed over more steps than one wave",
        )
        if mode == "serve":
            p.add_argument(
                "--max-prompts",
                type=int,
                default=d["max_prompts"],
                help="at most this many requests from --min-waves per "
                "(concurrency, temperature) (--num-prompts is kept), so that "
                "high concurrencies do not take minutes per cell",
            )
    else:
        p.add_argument(
            "--waves",
            type=int,
            default=d["waves"],
            help="timed waves of batch random prompts per batch",
        )
    if mode == "serve":
        p.add_argument(
            "--interleave",
            type=int,
            default=0,
            metavar="SLICES",
            help="start every config's server at once (each with an equal "
            "share of GPU memory) and time each (concurrency, temperature) "
            "as SLICES alternating runs per config (ABBA order), so that "
            "the host's speed, which drifts over seconds on a shared "
            "machine, is the same for every config; 0: one server after "
            "another (the rows are labelled with the setting)",
        )
        p.add_argument(
            "--pin-cpus",
            default=None,
            metavar="CPUS",
            help="a measurement control, not a vLLM setting: once a server is "
            "up, confine every thread of it to these CPUs (taskset syntax, "
            "e.g. 2-4), the same CPUs for every config's server, and run this "
            "script and its load clients on the others, so that configs are "
            "not compared on cores of different speed (recorded in the setup)",
        )
        p.add_argument(
            "--request-rate",
            default="inf",
            help="vllm bench serve's --request-rate (requests/s, Poisson "
            "arrivals; inf: all at once, bounded by the concurrency = batch)",
        )
    if mode == "e2e":
        p.add_argument(
            "--arrivals",
            choices=ARRIVALS,
            default="waves",
            help="waves: batch requests start together, the next wave "
            "when all are done; continuous: all requests at once "
            "with max_num_seqs = batch, a new one joining as one "
            "finishes (steps mix prefill and decode, as behind "
            "vllm serve); one --batches value per command",
        )
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument(
        "--max-step-tokens",
        type=int,
        default=33000,
        help="skip DDTree batches whose batch x (B + 1) verified "
        "tokens per step exceed this (logits memory)",
    )
    p.add_argument(
        "--settings",
        choices=SETTINGS,
        default="defaults",
        help="defaults: vLLM's engine defaults (prefix caching on, each "
        "method's own CUDA-graph sizes, vLLM's max_num_seqs except as the "
        "concurrency of --arrivals continuous, vLLM's memory share) and "
        "prompts the engine has not seen: the warm-up, the prefill-only pass "
        "and every timed (batch, temperature) get their own tagged copies; "
        "tuned: prefix caching off, capture sizes on DDTree's request "
        "ladder for every method, max_num_seqs = batch, warm-up and prefill "
        "over the timed prompts (results are labelled with the setting)",
    )
    if paired:
        p.add_argument(
            "--adaptive-budget",
            action="store_true",
            help="DDTree configs with adaptive_budget true: each step's trees "
            "sized by the cost model, the config's budget a per-request cap "
            "(recorded in the setup)",
        )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="one engine setting on top of --settings, for every config, e.g. "
        "max_num_seqs=1 or enable_prefix_caching=false (a JSON value; a bare "
        "word is a string); repeatable; recorded in the setup, so the rows are "
        "labelled with it",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help=f"default: vLLM's ({TUNED_GPU_MEMORY_UTILIZATION} with --settings tuned)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--limit-seconds",
        type=float,
        default=0,
        help="stop before starting a config that would not finish in "
        "this many seconds from the start (0: no limit)",
    )
    p.add_argument(
        "--config-seconds",
        type=float,
        default=d["config_seconds"],
        help="expected seconds per config before one was measured",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the whole sweep this many times, each round in "
        "<out>/round<k> with fresh engine processes and the config order "
        "reversed every other round; <out>/rounds.md gives each result's "
        "median and range over rounds (a host-bound step's speed varies from "
        "one engine process to the next)",
    )


def parse_int_list(text: str, name: str, lo: int, hi: int | None = None) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} must be a comma list of integers, got {text!r}")
    if not values:
        raise ValueError(f"{name} is empty")
    bad = [v for v in values if v < lo or (hi is not None and v > hi)]
    if bad:
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be {bound}, got {bad}")
    return sorted(set(values))


def parse_float_list(text: str, name: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} must be a comma list of numbers, got {text!r}")
    if not values:
        raise ValueError(f"{name} is empty")
    if any(v < 0 or math.isnan(v) for v in values):
        raise ValueError(f"{name} must be >= 0, got {values}")
    return sorted(set(values))


def parse_configs(text: str, budgets: list[int], schedule=None) -> list[str]:
    """``none,dflash,ddtree,ddtree-128`` -> config names, none and dflash first,
    then DDTree by budget; ``ddtree`` expands to every budget; ``ddtree-schedule``
    needs a schedule."""
    names: set[str] = set()
    for raw in (t.strip() for t in text.split(",")):
        if is_adaptive(raw):
            base = parse_configs(base_config(raw), budgets, schedule)
            if len(base) != 1 or base[0] in ("none", "dflash"):
                raise ValueError(f"{raw}: only a DDTree config takes -adaptive")
            names.add(raw)
        elif raw in ("none", "dflash", AUTO_CONFIG):
            names.add(raw)
        elif raw == SCHEDULE_CONFIG:
            if schedule is None:
                raise ValueError(f"{SCHEDULE_CONFIG} needs --schedule")
            names.add(raw)
        elif raw == "ddtree":
            names.update(f"ddtree-{b}" for b in budgets)
        elif budget_of(raw) is not None:
            if not 1 <= budget_of(raw) <= MAX_BUDGET:
                raise ValueError(f"{raw}: tree_budget must be in [1, {MAX_BUDGET}]")
            names.add(raw)
        else:
            raise ValueError(
                f"unknown config {raw!r}; use none, dflash, ddtree (every "
                f"--budgets), ddtree-<budget>, {AUTO_CONFIG} or {SCHEDULE_CONFIG}, "
                f"each DDTree one also with {ADAPTIVE_SUFFIX}"
            )
    return sorted(names, key=config_order)


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """Parse the list options in place; ``ValueError`` names the bad option."""
    budgets = parse_int_list(args.budgets, "--budgets", 1, MAX_BUDGET)
    args.schedule = parse_schedule(getattr(args, "schedule", None))
    args.configs = parse_configs(args.configs, budgets, args.schedule)
    args.batches = parse_int_list(args.batches, "--batches", 1)
    args.temperatures = parse_float_list(args.temperatures, "--temperatures")
    if args.max_tokens < 2:
        raise ValueError(
            "--max-tokens must be >= 2 (the decode phase is the "
            "difference to a max_tokens=1 run)"
        )
    for key in ("num_prompts", "waves", "min_waves", "max_prompts", "rounds"):
        if getattr(args, key, 1) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1")
    if arrivals_of(args) == "continuous" and len(args.batches) != 1:
        raise ValueError(
            "--arrivals continuous runs one batch per command (the engine's "
            f"max_num_seqs is the concurrency); got --batches {args.batches}"
        )
    parse_engine_args(getattr(args, "engine_arg", []))  # errors name the item
    check_run_options(args)
    check_interleave(args)
    check_pin_cpus(args)
    if getattr(args, "prompts", None) is not None and not args.prompts.is_file():
        raise ValueError(f"--prompts {args.prompts}: no such file")
    if getattr(args, "input_len", 1) < 1:
        raise ValueError("--input-len must be >= 1")
    if args.mode == "cost" and args.input_len + args.max_tokens > args.max_model_len:
        raise ValueError(
            f"--input-len {args.input_len} + --max-tokens {args.max_tokens} exceed "
            f"--max-model-len {args.max_model_len}"
        )
    return args


def arrivals_of(args) -> str:
    return getattr(args, "arrivals", "waves")


def check_run_options(args: argparse.Namespace) -> None:
    """Checks this script shares with profile_step.py: the time budget, the GPU
    memory share and the two model directories."""
    if args.limit_seconds < 0 or args.config_seconds <= 0:
        raise ValueError("--limit-seconds must be >= 0, --config-seconds > 0")
    gpu_mem = getattr(args, "gpu_memory_utilization", None)
    if gpu_mem is not None and not 0 < gpu_mem <= 1:
        raise ValueError("--gpu-memory-utilization must be in (0, 1]")
    for flag in ("target", "drafter"):
        path = getattr(args, flag)
        if not (path / "config.json").is_file():
            raise ValueError(f"--{flag} {path}: no config.json there")


# GPU memory the servers of --interleave share between them by default (vLLM's
# own default for one server).
INTERLEAVE_GPU_MEMORY = 0.9


def interleave_of(args) -> int:
    return getattr(args, "interleave", 0)


def check_interleave(args) -> None:
    """``--interleave``: an even slice count, at least two configs, vLLM's
    defaults, and memory shares that fit on one GPU together."""
    slices = interleave_of(args)
    if slices < 0:
        raise ValueError("--interleave must be >= 0 (0: one server at a time)")
    if not slices:
        return
    if slices < 2 or slices % 2:
        raise ValueError(
            "--interleave must be an even number of slices >= 2 (ABBA order "
            "balances a drift of the host's speed only over pairs of slices)"
        )
    if len(args.configs) < 2:
        raise ValueError("--interleave compares configs: give --configs two or more")
    if settings_of(args) != "defaults":
        raise ValueError(
            "--interleave runs the defaults' warm-up and fresh prompts per cell; "
            "it does not take --settings tuned"
        )
    if "gpu_memory_utilization" in parse_engine_args(getattr(args, "engine_arg", [])):
        raise ValueError(
            "--interleave shares GPU memory between its servers: set the share "
            "with --gpu-memory-utilization, not --engine-arg"
        )
    share = args.gpu_memory_utilization
    if share is not None and share * len(args.configs) > INTERLEAVE_GPU_MEMORY:
        raise ValueError(
            f"--interleave runs {len(args.configs)} servers at once: "
            f"--gpu-memory-utilization {share} each does not fit (at most "
            f"{INTERLEAVE_GPU_MEMORY / len(args.configs):.2f}; unset, they "
            "share that equally)"
        )


def check_pin_cpus(args) -> None:
    """``--pin-cpus``: a CPU list of this machine that leaves CPUs for the
    script and its load clients; parsed in place into a set."""
    text = getattr(args, "pin_cpus", None)
    if text is None:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("--pin-cpus needs Linux (os.sched_setaffinity)")
    try:
        cpus = parse_cpu_list(text, limit=(os.cpu_count() or 1) - 1)
    except ValueError as e:
        raise ValueError(f"--pin-cpus: {e}") from None
    mine = os.sched_getaffinity(0)
    if not cpus <= mine:
        raise ValueError(
            f"--pin-cpus {text}: CPUs {format_cpu_list(cpus - mine)} are not "
            f"available here (this process may use {format_cpu_list(mine)})"
        )
    if not mine - cpus:
        raise ValueError(
            f"--pin-cpus {text} leaves no CPU for this script and its load "
            f"clients (available: {format_cpu_list(mine)})"
        )
    args.pin_cpus = cpus


def pin_cpus_of(args) -> set[int] | None:
    return getattr(args, "pin_cpus", None)


def pin_cpus_field(args) -> dict:
    """``{"pin_cpus": LIST}`` with ``--pin-cpus``, else empty: in the setup
    (pinned rows never merge with unpinned ones) and on every row (a
    ``rounds.md`` shows no setup)."""
    cpus = pin_cpus_of(args)
    return {"pin_cpus": format_cpu_list(cpus)} if cpus else {}


@contextlib.contextmanager
def clients_off_pinned_cpus(args):
    """With ``--pin-cpus``: this process (and the servers and load clients it
    starts meanwhile) on the CPUs the servers are not pinned to, restored on
    exit."""
    cpus = pin_cpus_of(args)
    if not cpus:
        yield
        return
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, saved - cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def pin_server(args, server: subprocess.Popen, log) -> bool:
    """With ``--pin-cpus``: every thread of a server that is up onto those
    CPUs, said in its log. False (said there too) if that failed: the server
    is then a failed one."""
    import psutil

    cpus = pin_cpus_of(args)
    if not cpus:
        return True
    try:
        threads = pin_process_tree(server.pid, cpus)
        why = None if threads else "no thread found"
    except (OSError, RuntimeError, psutil.Error) as e:
        why = f"{type(e).__name__}: {e}"
    if why is not None:
        log.write(f"bench_ddtree: could not pin this server to CPUs: {why}\n")
        log.flush()
        return False
    log.write(
        f"bench_ddtree: pinned {threads} threads of this server to CPUs "
        f"{format_cpu_list(cpus)}\n"
    )
    log.flush()
    return True


def interleave_memory(args) -> float:
    """Each interleaved server's ``gpu_memory_utilization``."""
    if args.gpu_memory_utilization is not None:
        return args.gpu_memory_utilization
    return math.floor(100 * INTERLEAVE_GPU_MEMORY / len(args.configs)) / 100


def _schedule_field(args, config: str) -> dict:
    """Rows of ddtree-schedule and ddtree-auto carry their schedule (resumed runs
    may differ; the auto table may change between commits)."""
    config = base_config(config)
    if config == AUTO_CONFIG:
        return {"tree_budget_per_batch_size": auto_schedule()}
    if config != SCHEDULE_CONFIG:
        return {}
    return {"tree_budget_per_batch_size": args.schedule}


def auto_schedule() -> list[list[int]]:
    """The schedule ``tree_budget: "auto"`` stands for in this checkout."""
    # The checkout's modules join the installed vllm package once the plugin
    # registers (engines load it themselves; this process does not).
    import vllm_ddtree

    vllm_ddtree.register()
    from vllm.v1.spec_decode.ddtree_config import AUTO_TREE_BUDGET_PER_BATCH_SIZE

    return [list(entry) for entry in AUTO_TREE_BUDGET_PER_BATCH_SIZE]


def parse_schedule(text: str | None) -> list[list[int]] | None:
    """``--schedule``: JSON or a JSON file -> a checked schedule (ddtree's own
    parser), as lists."""
    if text is None:
        return None
    source = Path(text)
    raw = source.read_text() if source.is_file() else text
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--schedule must be JSON like [[1, 1, 256], [2, 8, 64]] or a file "
            f"holding it: {e}"
        ) from e
    from vllm.v1.spec_decode.ddtree_config import parse_budget_schedule

    return [list(entry) for entry in parse_budget_schedule(value)]


# ---------------------------------------------------------------------------
# Engine configurations
# ---------------------------------------------------------------------------


def speculative_config(
    config: str,
    drafter: Path,
    schedule=None,
    fixed: bool = False,
    adaptive: bool = False,
) -> dict | None:
    """A config's speculative config; ``fixed``: every DDTree step verifies its
    budget (``adaptive_budget`` false), as the cost mode measures one tree size;
    ``adaptive``: each step's trees sized by DDTree's cost model, the config's
    budget a per-request cap (``--adaptive-budget``); else DDTree's default."""
    spec = _speculative_config(base_config(config), drafter, schedule)
    if spec is not None and spec["method"] == "ddtree":
        # Said in every DDTree config, whatever the product's default.
        spec["adaptive_budget"] = not fixed and (adaptive or is_adaptive(config))
    return spec


def _speculative_config(config: str, drafter: Path, schedule=None) -> dict | None:
    if config == "none":
        return None
    if config == "dflash":
        return {
            "method": "dflash",
            "model": str(drafter),
            "num_speculative_tokens": DFLASH_TOKENS,
        }
    if config == SCHEDULE_CONFIG:
        return {
            "method": "ddtree",
            "model": str(drafter),
            "tree_budget_per_batch_size": schedule,
        }
    if config == AUTO_CONFIG:
        return {"method": "ddtree", "model": str(drafter), "tree_budget": "auto"}
    return {"method": "ddtree", "model": str(drafter), "tree_budget": budget_of(config)}


def step_tokens(config: str, batch: int, schedule=None) -> int:
    """Target tokens one uniform decode step verifies (with the adaptive
    budget: at most)."""
    config = base_config(config)
    if config == "none":
        return batch
    if config == "dflash":
        return batch * DRAFT_LEN
    if config == SCHEDULE_CONFIG:
        return batch * (schedule_budget(schedule, batch) + 1)
    if config == AUTO_CONFIG:
        return batch * (schedule_budget(auto_schedule(), batch) + 1)
    return batch * (budget_of(config) + 1)


def fitting_batches(
    config: str, batches: list[int], max_step_tokens: int, schedule=None
):
    """(batches to run, batches skipped because a step would exceed the limit)."""
    fit = [b for b in batches if step_tokens(config, b, schedule) <= max_step_tokens]
    return fit, [b for b in batches if b not in fit]


def request_ladder(max_batch: int) -> list[int]:
    """Batch sizes given CUDA graphs: 1, 2, 4, 8, 16, 24, ..., max_batch, the
    ladder DDTree's own default uses (ddtree_config.cudagraph_capture_sizes)."""
    sizes = [n for n in (1, 2, 4) if n < max_batch]
    return sizes + list(range(8, max_batch, 8)) + [max_batch]


def capture_sizes(config: str, max_batch: int) -> list[int] | None:
    """Tuned CUDA-graph sizes for no-spec and DFlash: every batch of the request
    ladder up to ``max_batch`` (vLLM's own default stops at 512 tokens, which
    would leave a DFlash batch of 64 = 1024 tokens without a graph). None for
    DDTree: its plugin picks multiples of B + 1 up to
    :func:`tuned_max_capture_size`."""
    if config.startswith("ddtree"):
        return None
    per_request = 1 if config == "none" else DRAFT_LEN
    return [n * per_request for n in request_ladder(max_batch)]


def tuned_max_capture_size(config: str, max_batch: int, schedule=None) -> int:
    """DDTree's largest graph under ``--settings tuned``: the largest step of the
    request ladder (target verify or drafter), so that DDTree gets graphs for
    the batches :func:`capture_sizes` gives DFlash."""
    steps = [step_tokens(config, n, schedule) for n in request_ladder(max_batch)]
    return max(*steps, max_batch * DRAFT_LEN)


def settings_of(args) -> str:
    return getattr(args, "settings", "defaults")


def parse_engine_args(items: list[str]) -> dict:
    """``["max_num_seqs=1", "enable_prefix_caching=false"]`` -> a dict of
    ``LLM`` keyword arguments."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--engine-arg {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    for key in ("model", "speculative_config"):
        if key in out:
            raise ValueError(f"--engine-arg {key}: set by the benchmark per config")
    return out


def engine_kwargs(args, config: str, max_batch: int) -> dict:
    """``LLM`` / ``vllm serve`` settings of one config. Under ``--settings
    defaults`` only what a user sets: the models, ``max_model_len``, the
    speculative config, and ``max_num_seqs`` where it is the measured
    concurrency (offline continuous arrivals)."""
    kwargs = {
        "model": str(args.target),
        "max_model_len": args.max_model_len,
        "seed": args.seed,
        "disable_log_stats": False,
    }
    if args.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.mode == "cost":
        kwargs.update(load_format="dummy", skip_tokenizer_init=True)
    spec = speculative_config(
        config,
        args.drafter,
        args.schedule,
        fixed=args.mode == "cost",
        adaptive=getattr(args, "adaptive_budget", False),
    )
    if spec is not None:
        kwargs["speculative_config"] = spec
    if settings_of(args) == "defaults":
        if arrivals_of(args) == "continuous":
            kwargs["max_num_seqs"] = max_batch
        elif args.mode == "serve" and spec is not None and spec["method"] == "dflash":
            kwargs["max_num_seqs"] = DFLASH_SERVE_MAX_NUM_SEQS
    else:
        kwargs.update(max_num_seqs=max_batch, enable_prefix_caching=False)
        kwargs.setdefault("gpu_memory_utilization", TUNED_GPU_MEMORY_UTILIZATION)
        sizes = capture_sizes(config, max_batch)
        if sizes is not None:
            kwargs["compilation_config"] = {"cudagraph_capture_sizes": sizes}
        else:
            max_size = tuned_max_capture_size(config, max_batch, args.schedule)
            kwargs["compilation_config"] = {"max_cudagraph_capture_size": max_size}
    kwargs.update(parse_engine_args(getattr(args, "engine_arg", [])))
    return kwargs


def fresh_prompt(prompt, tag: int):
    """``prompt`` as a request the engine has not seen: a text gets a first line
    naming ``tag`` (the pair's prompts are Python, so a comment); a token list
    gets two leading tokens from ``tag`` in place of its first two. Either way
    no prefix-cache block matches another tag's."""
    if isinstance(prompt, str):
        return f"# request {tag}\n{prompt}"
    head = [tag // RANDOM_VOCAB % RANDOM_VOCAB, tag % RANDOM_VOCAB]
    return head + list(prompt[2:]) if len(prompt) > 2 else head[-len(prompt) :]


# ---------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------


def load_prompts(path: Path) -> list:
    """Texts or token-id lists from a JSON list (or ``{"prompts": [...]}``, as
    ``benchmarks/train_pair`` writes its held-out prompts) or a JSONL file; an item
    may also be ``{"prompt_token_ids": [...]}``, ``{"prompt": ...}`` or
    ``{"text": ...}``."""
    text = Path(path).read_text()
    if path.suffix == ".jsonl":
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        items = json.loads(text)
        if isinstance(items, dict):
            items = items.get("prompts")
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected a non-empty list of prompts")
    prompts = [_prompt_item(item, path, i) for i, item in enumerate(items)]
    if len({type(p) for p in prompts}) > 1:
        raise ValueError(f"{path}: mixes texts and token-id lists")
    return prompts


def _prompt_item(item, path: Path, index: int):
    if isinstance(item, dict):
        item = next(
            (item[k] for k in ("prompt_token_ids", "prompt", "text") if k in item), None
        )
    if isinstance(item, str) and item:
        return item
    if (
        isinstance(item, list)
        and item
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in item)
    ):
        return item
    raise ValueError(
        f"{path}: prompt {index} is neither a non-empty text nor a list of token ids"
    )


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(RANDOM_VOCAB) for _ in range(length)] for _ in range(count)]


def batch_requests(
    prompts: list, batch: int, num_prompts: int, min_waves: int = 1
) -> list:
    """Requests for one (batch, temperature) measurement: ``num_prompts`` rounded
    up to whole waves of ``batch``, at least ``min_waves`` of them, taken from the
    prompts in order (cycling)."""
    n = max(1, min_waves, math.ceil(num_prompts / batch)) * batch
    return [prompts[i % len(prompts)] for i in range(n)]


def check_prompt_lengths(prompts: list, max_tokens: int, max_model_len: int) -> None:
    too_long = [
        i
        for i, p in enumerate(prompts)
        if isinstance(p, list) and len(p) + max_tokens > max_model_len
    ]
    if too_long:
        raise ValueError(
            f"prompts {too_long[:5]} plus --max-tokens {max_tokens} exceed "
            f"--max-model-len {max_model_len}"
        )


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def setup_of(args) -> dict:
    """What makes results comparable; a resumed run must match it."""
    setup = {
        "mode": args.mode,
        "target_config": _sha(args.target / "config.json"),
        "drafter_config": _sha(args.drafter / "config.json"),
        "max_tokens": args.max_tokens,
        "max_model_len": args.max_model_len,
        "seed": args.seed,
        "info": {"target": str(args.target), "drafter": str(args.drafter)},
    }
    if args.mode == "cost":
        setup.update(input_len=args.input_len, waves=args.waves)
    else:
        setup["num_prompts"] = args.num_prompts
        # Absent at 1 (e2e's default), so older e2e setups still match; serve's
        # default 4 is recorded (serve folders of 64 prompts, one wave, do not
        # resume into it).
        if args.min_waves != 1:
            setup["min_waves"] = args.min_waves
        if args.mode == "serve":
            setup["max_prompts"] = args.max_prompts
        if arrivals_of(args) != "waves":  # likewise
            setup["arrivals"] = arrivals_of(args)
        setup["prompts"] = _sha(args.prompts)
        setup["ignore_eos"] = args.ignore_eos
        setup["info"]["prompts"] = str(args.prompts)
    if settings_of(args) == "defaults":
        # Absent for tuned, the settings every earlier setup was measured with.
        setup["settings"] = "defaults"
    if args.mode != "serve" and engine_process_of(args) == "multiprocess":
        # Absent when in-process, as every earlier offline setup ran.
        setup["engine_process"] = "multiprocess"
    if getattr(args, "engine_arg", []):
        setup["engine_args"] = parse_engine_args(args.engine_arg)
    if args.mode != "cost":
        # Rows of the two budget modes never merge (result folders from before
        # the flag lack the key, and resuming from them is refused).
        setup["adaptive_budget"] = bool(getattr(args, "adaptive_budget", False))
    if getattr(args, "request_rate", "inf") != "inf":
        setup["request_rate"] = args.request_rate
    if interleave_of(args):
        # Servers side by side, each with a share of GPU memory: rows never
        # merge with those of one server at a time.
        setup["interleave"] = interleave_of(args)
        setup["interleave_gpu_memory"] = interleave_memory(args)
    if args.schedule is not None:
        # ddtree-schedule rows mean this schedule; another one needs another --out.
        setup["schedule"] = args.schedule
    setup.update(pin_cpus_field(args))
    return setup


# ---------------------------------------------------------------------------
# Orchestration (one process per engine config)
# ---------------------------------------------------------------------------


def prepare_out(args, setup: dict) -> set:
    """Check every earlier setup, copy earlier rows into ``--out`` (so it is
    complete on its own) and return the keys already measured."""
    args.out.mkdir(parents=True, exist_ok=True)
    for d in [*args.resume_from, args.out]:
        path = d / SETUP_FILE
        if path.is_file():
            check_setup(setup, json.loads(path.read_text()), str(d))
        elif d != args.out and not (d / RESULTS_FILE).is_file():
            raise ValueError(f"--resume-from {d}: no {RESULTS_FILE} there")
    (args.out / SETUP_FILE).write_text(json.dumps(setup, indent=1))
    own = {row_key(r) for r in load_rows([args.out])}
    for row in merge_rows(load_rows(args.resume_from)):
        if row_key(row) not in own:
            append_row(args.out, row)
            own.add(row_key(row))
    return own


def run_id() -> str:
    """Names the GPU command that measured a row (ratios across commands are
    marked in the report)."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"


class Clock:
    """The --limit-seconds budget of this command."""

    def __init__(self, limit_s: float, default_config_s: float):
        self.start = time.monotonic()
        self.limit_s = limit_s
        self.config_s = [default_config_s]
        self.measured = False

    def remaining(self) -> float:
        if not self.limit_s:
            return math.inf
        return self.limit_s - (time.monotonic() - self.start)

    def can_start(self) -> bool:
        return self.remaining() >= max(self.config_s)

    def record(self, seconds: float) -> None:
        if not self.measured:
            self.config_s = [seconds]  # the first measured replaces the guess
            self.measured = True
        else:
            self.config_s.append(seconds)


def plan(args, done: set) -> list[tuple[str, list[int], list]]:
    """(config, batches it runs, pending (batch, temperature) pairs) per config."""
    out = []
    for config in args.configs:
        fit, skipped = fitting_batches(
            config, args.batches, args.max_step_tokens, args.schedule
        )
        if skipped:
            print(
                f"bench_ddtree: {config}: skipping batches {skipped} "
                f"(> --max-step-tokens {args.max_step_tokens} per step)"
            )
        out.append((config, fit, pending(config, fit, args.temperatures, done)))
    return out


def run_rounds(args) -> int:
    """``--rounds N``: the sweep N times, round k in ``<out>/round<k>`` (resumed
    from ``<dir>/round<k>`` of each ``--resume-from``), one time budget for all,
    then ``<out>/rounds.md`` and ``rounds.json``."""
    for d in args.resume_from:
        if not any(d.glob("round[0-9]*")):
            raise ValueError(
                f"--resume-from {d}: no round<k> folders there (--rounds resumes "
                "from the --out of an earlier --rounds command)"
            )
    clock, rid = Clock(args.limit_seconds, args.config_seconds), run_id()
    args.out.mkdir(parents=True, exist_ok=True)
    dirs, rc = [], 0
    for k in range(1, args.rounds + 1):
        sub = argparse.Namespace(**vars(args))
        sub.out = args.out / f"round{k}"
        sub.resume_from = [
            d / f"round{k}" for d in args.resume_from if (d / f"round{k}").is_dir()
        ]
        sub.resume_hint = args.out  # what a cut round says to resume from
        # Reversed every other round: the first engine on a machine can run
        # differently from later ones.
        sub.configs = list(args.configs if k % 2 else reversed(args.configs))
        print(f"bench_ddtree: round {k}/{args.rounds}: {', '.join(sub.configs)}")
        rc = max(rc, run_sweep(sub, clock, rid))
        dirs.append(sub.out)
        if not clock.can_start():
            if k < args.rounds:
                print(
                    f"bench_ddtree: stopping after round {k} of {args.rounds} "
                    f"(--limit-seconds); rerun with --resume-from {args.out}"
                )
            break
    print(write_rounds_report(args.out, dirs, args.mode))
    return rc


def run_sweep(args, clock: Clock | None = None, rid: str | None = None) -> int:
    setup = setup_of(args)
    done = prepare_out(args, setup)
    prompts = None
    if args.mode != "cost":
        prompts = load_prompts(args.prompts)
        check_prompt_lengths(prompts, args.max_tokens, args.max_model_len)
        if args.mode == "serve" and not isinstance(prompts[0], str):
            raise ValueError(
                "serve mode needs text prompts (vllm bench serve's "
                "ShareGPT-style dataset); --prompts holds token ids"
            )
    clock = clock or Clock(args.limit_seconds, args.config_seconds)
    rid = rid or run_id()
    hint = getattr(args, "resume_hint", args.out)
    failed, cut = [], []
    todo = plan(args, done)
    if args.mode == "serve" and interleave_of(args):
        failed, cut = run_serve_interleaved(args, todo, prompts, rid, clock)
        todo = []
    for i, (config, fit, runs) in enumerate(todo, 1):
        tag = f"[{i}/{len(todo)}] {config}"
        if not runs:
            print(f"{tag}: nothing to do (measured already or no batch fits)")
            continue
        if not clock.can_start():
            left = [c for c, _, r in todo[i - 1 :] if r]
            print(
                f"{tag}: stopping, {clock.remaining():.0f} s left of "
                f"--limit-seconds, a config takes ~{max(clock.config_s):.0f} s; "
                f"not started: {', '.join(left)}. Rerun with --resume-from "
                f"{hint} to continue."
            )
            break
        print(
            f"{tag}: starting {len(runs)} measurements (batch, T) = {runs}", flush=True
        )
        start = time.monotonic()
        runner = run_serve_config if args.mode == "serve" else run_offline_config
        ok = runner(args, config, max(fit), runs, prompts, rid, clock.remaining())
        clock.record(time.monotonic() - start)
        if not ok:
            # Killed when --limit-seconds ran out (_run_logged) is not a failure.
            (cut if clock.remaining() <= 1.0 else failed).append(config)
        _print_new_rows(args.out, config, runs, time.monotonic() - start)
    write_report(args.out, args.mode, setup)
    if cut:
        print(
            f"bench_ddtree: --limit-seconds ran out while measuring {cut}; their "
            f"finished rows are kept, rerun with --resume-from {hint} to "
            "finish them"
        )
    if failed:
        print(f"bench_ddtree: failed configs (see {args.out}/logs): {failed}")
    return 1 if failed else 0


def _print_new_rows(out: Path, config: str, runs: list, seconds: float) -> None:
    wanted = {(config, b, t) for b, t in runs}
    rows = [r for r in merge_rows(load_rows([out])) if row_key(r) in wanted]
    print(f"    {config}: {len(rows)}/{len(runs)} measured in {seconds:.0f} s")
    for r in rows:
        tau = r.get("acceptance_length")
        print(
            f"    batch {r['batch']:>3} T={r['temperature']}: "
            f"{r.get('tok_s') or 0:9.1f} tok/s, "
            f"{r.get('decode_ms_per_step') or float('nan'):7.2f} ms/step, "
            f"accept len {tau if tau is None else round(tau, 2)}",
            flush=True,
        )


def run_offline_config(args, config, max_batch, runs, prompts, rid, time_left) -> bool:
    """One engine config in a fresh process (``_worker``); True if it exited 0."""
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    spec_path = logs / f"{config}.spec.json"
    spec_path.write_text(
        json.dumps(worker_spec(args, config, max_batch, runs, prompts, rid))
    )
    in_process = engine_process_of(args) == "in-process"
    env = _worker_env(engine_in_process=in_process)
    if not in_process:
        env = _with_plugin(env, logs)
    with (logs / f"{config}.log").open("a") as log:
        return _run_logged(
            [sys.executable, str(Path(__file__).resolve()), "_worker", str(spec_path)],
            log,
            time_left,
            env,
        )


def worker_spec(args, config, max_batch, runs, prompts, rid) -> dict:
    """What the worker process of one engine config needs (JSON)."""
    requests = {}
    for batch in sorted({b for b, _ in runs}):
        if args.mode == "cost":
            requests[str(batch)] = random_prompts(
                args.waves * batch, args.input_len, args.seed + batch
            )
        else:
            requests[str(batch)] = batch_requests(
                prompts, batch, args.num_prompts, args.min_waves
            )
    return {
        "llm": engine_kwargs(args, config, max_batch),
        "runs": runs,
        "requests": requests,
        "max_tokens": args.max_tokens,
        "ignore_eos": args.mode == "cost" or args.ignore_eos,
        "arrivals": arrivals_of(args),
        "settings": settings_of(args),
        "detokenize": args.mode != "cost",
        "out": str(args.out),
        "row": {
            "mode": args.mode,
            "settings": settings_of(args),
            "config": config,
            "run_id": rid,
            "tree_budget": budget_of(base_config(config)),
            "max_tokens": args.max_tokens,
            "engine_process": engine_process_of(args),
            **_schedule_field(args, config),
        },
    }


def engine_process_of(args) -> str:
    """Where an offline worker's engine core runs: ``multiprocess`` (vLLM's
    default, a process of its own, as a user's ``LLM`` has it) under ``--settings
    defaults``, ``in-process`` under ``tuned``. ``VLLM_ENABLE_V1_MULTIPROCESSING``
    in the caller's environment wins."""
    value = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "").strip()
    if value:
        # vLLM reads it as bool(int(value)).
        return "in-process" if value == "0" else "multiprocess"
    return "multiprocess" if settings_of(args) == "defaults" else "in-process"


def _with_plugin(env: dict, logs: Path) -> dict:
    """Let processes that vLLM starts itself (``vllm serve``, a multiprocess
    engine core) load the plugin: its entry point and this checkout on
    ``PYTHONPATH``."""
    env["PYTHONPATH"] = os.pathsep.join(
        [str(plugin_site(logs / "plugin_site")), str(ROOT), env.get("PYTHONPATH", "")]
    )
    return env


def _worker_env(engine_in_process: bool = True) -> dict:
    """The environment of an engine process. ``engine_in_process``: the engine
    core in the worker's own process (unless the caller's environment says
    otherwise); else vLLM's default."""
    env = dict(os.environ)
    if engine_in_process:
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _run_logged(cmd: list[str], log, time_left: float, env: dict) -> bool:
    """Run ``cmd`` in its own session with output to ``log``; kill its process
    group when ``time_left`` runs out."""
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        return proc.wait(timeout=None if math.isinf(time_left) else time_left) == 0
    except subprocess.TimeoutExpired:
        print(f"    time limit: killing {cmd[-1]} (finished rows are kept)")
        _kill_group(proc)
        return False


class ServeClient:
    """One ``vllm bench serve`` process per server (``bench_serve_client.py``),
    fed one command line at a time: vLLM is imported once per server instead of
    twice per (batch, temperature). ``run`` says whether the command exited 0
    and keeps the client's ``host_usage`` of it (of ``root_pid``'s process
    tree) in ``last_usage``; when ``time_left`` runs out, or the client dies,
    the client is gone (finished runs keep their result files) and every later
    ``run`` is False."""

    SCRIPT = Path(__file__).resolve().parent / "bench_serve_client.py"

    def __init__(
        self,
        log,
        env: dict,
        root_pid: int | None = None,
        argv: list[str] | None = None,
    ):
        self.last_usage: dict | None = None
        root = [] if root_pid is None else ["--root-pid", str(root_pid)]
        self.proc = subprocess.Popen(
            argv or [sys.executable, str(self.SCRIPT), *root],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            cwd=ROOT,
            text=True,
            start_new_session=True,
        )

    def run(self, cmd: list[str], time_left: float) -> bool:
        self.last_usage = None
        if self.proc.poll() is not None:
            return False
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return False
        deadline = time.monotonic() + min(time_left, 1e9)
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 5.0))
            if ready:
                line = self.proc.stdout.readline()
                if not line:  # the client died (its traceback is in the log)
                    self.close()
                    return False
                reply = json.loads(line)
                self.last_usage = reply.get("host_usage")
                return reply.get("rc") == 0
        name = (
            cmd[cmd.index("--result-filename") + 1]
            if "--result-filename" in cmd
            else ""
        )
        print(f"    time limit: killing the run of {name} (finished rows are kept)")
        self.close()
        return False

    def close(self) -> None:
        if self.proc.poll() is None:
            _kill_group(self.proc)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------------
# Worker: one engine, every (batch, temperature) of one config
# ---------------------------------------------------------------------------


def worker_main(spec_path: Path) -> None:
    import faulthandler

    # A hung engine shows where it sits in the log before the time limit kills it.
    faulthandler.dump_traceback_later(600, exit=False)
    try:
        run_worker(json.loads(Path(spec_path).read_text()))
    finally:
        faulthandler.cancel_dump_traceback_later()


def run_worker(spec: dict) -> None:
    import torch

    import conftest  # noqa: F401  (this working tree's vllm/ modules first)
    import vllm_ddtree

    vllm_ddtree.register()
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(**spec["llm"])
    engine = _engine_info(llm, time.perf_counter() - start)
    print("bench_ddtree worker: engine " + json.dumps(engine), flush=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    for k, (batch, temperature) in enumerate(spec["runs"]):
        # Under --settings defaults every run tags its prompts from its own range.
        run_spec = {**spec, "tag_base": k * TAGS_PER_RUN}
        row = measure(
            llm,
            SamplingParams,
            spec["requests"][str(batch)],
            batch,
            temperature,
            run_spec,
        )
        row.update(
            spec["row"],
            engine=engine,
            gpu=gpu,
            host=host_placement(),
            time=time.strftime("%Y-%m-%dT%H:%M:%S"),
        )
        append_row(Path(spec["out"]), row)
        print("bench_ddtree worker: row " + json.dumps(row), flush=True)


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` (Linux's cpulist format) -> ``[0, 1, 2, 3, 8, 10, 11]``
    (a node without CPUs has an empty list)."""
    return sorted(parse_cpu_list(text)) if text.strip() else []


def numa_kib(numa_maps: str) -> dict[int, int]:
    """Resident KiB per NUMA node over a ``/proc/<pid>/numa_maps`` text (each
    mapping's ``N<node>=<pages>`` times its ``kernelpagesize_kB``: huge pages
    count as what they hold)."""
    kib: dict[int, int] = {}
    for line in numa_maps.splitlines():
        tokens = line.split()
        size = next(
            (int(t[18:]) for t in tokens if t.startswith("kernelpagesize_kB=")), 4
        )
        for token in tokens:
            node, _, count = token[1:].partition("=")
            if token.startswith("N") and node.isdigit() and count.isdigit():
                kib[int(node)] = kib.get(int(node), 0) + int(count) * size
    return kib


def _read(path) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def busy_threads(proc, top: int = 6) -> list[dict]:
    """The ``top`` threads of a ``psutil.Process`` by CPU time: name, CPU
    seconds, the CPU each last ran on. A thread that spins next to the one
    running the step (on the same core) slows the step; this shows whether one
    did."""
    threads = []
    for t in sorted(proc.threads(), key=lambda t: -(t.user_time + t.system_time)):
        name, last_cpu = thread_info(t.id)
        if name is None:  # the thread ended meanwhile
            continue
        threads.append(
            {
                "tid": t.id,
                "name": name,
                "cpu_s": round(t.user_time + t.system_time, 2),
                "last_cpu": last_cpu,
            }
        )
        if len(threads) == top:
            break
    return threads


def _core_of(cpu: int) -> str | None:
    """``"<package>/<core>"`` of a CPU: two CPUs with the same value are SMT
    siblings."""
    topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    package, core = _read(topo / "physical_package_id"), _read(topo / "core_id")
    if package is None or core is None:
        return None
    return f"{package.strip()}/{core.strip()}"


def _gpu_numa_node() -> int | None:
    """vLLM's own answer (NVML) for this process's GPU; None without one."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        from vllm.platforms import current_platform
        from vllm.third_party.pynvml import NVMLError

        return current_platform.get_device_numa_node(torch.cuda.current_device())
    except (AttributeError, RuntimeError, NVMLError):  # another platform
        return None


def host_placement() -> dict:
    """Where this process and its children (a multiprocess engine core) run:
    CPU affinity, the CPU each last ran on and its NUMA node, resident memory
    per NUMA node, the busiest threads, and the GPU's NUMA node. A host-bound
    step (batch 1) runs at the speed of the cores and memory it lands on, and
    engine processes of one machine can land differently, so every row records
    it."""
    import psutil

    node_of = {}
    for path in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        for cpu in parse_cpulist(_read(path / "cpulist") or ""):
            node_of[cpu] = int(path.name[4:])
    procs = []
    for proc in process_tree(psutil.Process()):
        try:
            cpu = proc.cpu_num()
            threads = busy_threads(proc)
            for t in threads:
                t["core"] = _core_of(t["last_cpu"])
            procs.append(
                {
                    "pid": proc.pid,
                    "name": proc.name(),
                    "cpus_allowed": len(proc.cpu_affinity()),
                    "last_cpu": cpu,
                    "cpu_node": node_of.get(cpu),
                    "kib_per_node": numa_kib(
                        _read(f"/proc/{proc.pid}/numa_maps") or ""
                    ),
                    "threads": threads,
                }
            )
        except (psutil.Error, OSError):
            continue
    torch = sys.modules.get("torch")
    return {
        "cpus": os.cpu_count(),
        "numa_nodes": len(set(node_of.values())),
        "gpu_numa_node": _gpu_numa_node(),
        "load_1min": round(os.getloadavg()[0], 2),
        # Of this (the calling) process only, not of a multiprocess engine core
        # (vLLM lowers intra-op threads to 1 only for its multiprocess executor,
        # i.e. tensor parallelism); OMP_NUM_THREADS is inherited by children.
        "caller_torch_threads": None if torch is None else torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "processes": procs,
    }


def _engine_info(llm, startup_s: float) -> dict:
    cfg = llm.llm_engine.vllm_config
    return {
        "startup_s": round(startup_s, 1),
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
        "cudagraph_capture_sizes": cfg.compilation_config.cudagraph_capture_sizes,
        "async_scheduling": cfg.scheduler_config.async_scheduling,
    }


def _as_input(prompt) -> dict:
    return (
        {"prompt_token_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
    )


def measure(
    llm, sampling_cls, requests: list, batch: int, temperature: float, spec: dict
) -> dict:
    """Warm-up, prefill-only (max_tokens=1) and timed generation of ``requests``
    in waves of ``batch``, or all in one call under ``arrivals: continuous`` (the
    engine's max_num_seqs = batch admits a new request as one finishes); one
    result row."""
    fresh = spec.get("settings", "tuned") == "defaults"

    def waves_of(phase: int) -> list:
        """Phase 0 warm-up, 1 prefill-only, 2 timed: under defaults each phase
        of each (batch, temperature) sends prompts the engine has not seen."""
        tags = spec.get("tag_base", 0) + phase * len(requests)
        prompts = [
            fresh_prompt(p, tags + i) if fresh else p for i, p in enumerate(requests)
        ]
        return [
            [_as_input(p) for p in prompts[i : i + batch]]
            for i in range(0, len(prompts), batch)
        ]

    def calls_of(phase: int) -> list:
        waves = waves_of(phase)
        if spec.get("arrivals", "waves") == "continuous":
            return [[r for wave in waves for r in wave]]
        return waves

    def params(max_tokens: int):
        return sampling_cls(
            temperature=temperature,
            max_tokens=max_tokens,
            ignore_eos=spec["ignore_eos"],
            detokenize=spec["detokenize"],
        )

    def timed(max_tokens: int, phase: int):
        calls = calls_of(phase)
        before = metric_totals(llm.get_metrics())
        start = time.perf_counter()
        outputs = [
            o
            for call in calls
            for o in llm.generate(call, params(max_tokens), use_tqdm=False)
        ]
        wall = time.perf_counter() - start
        delta = metric_delta(before, metric_totals(llm.get_metrics()))
        return wall, delta, sum(len(o.outputs[0].token_ids) for o in outputs)

    llm.generate(waves_of(0)[0], params(min(16, spec["max_tokens"])), use_tqdm=False)
    prefill_wall, prefill, _ = timed(1, 1)
    usage = HostUsage()
    wall, full, tokens = timed(spec["max_tokens"], 2)
    return {
        "batch": batch,
        "temperature": float(temperature),
        "num_requests": len(requests),
        **timing_stats(full, prefill, wall, prefill_wall, tokens),
        **spec_stats(full),
        "host_usage": usage.stop(),
    }


# ---------------------------------------------------------------------------
# Serve mode: vllm serve + vllm bench serve
# ---------------------------------------------------------------------------


def serve_row(result: dict) -> dict:
    """A ``vllm bench serve --save-result`` JSON -> the numbers of a result row
    (no step counts: the server's steps are not seen from outside)."""
    per_depth = list(result.get("spec_decode_per_position_acceptance_rates") or [])
    drafts = result.get("spec_decode_num_drafts")
    return {
        "output_tokens": result.get("total_output_tokens"),
        "wall_s": result.get("duration"),
        "tok_s": result.get("output_throughput"),
        "mean_tpot_ms": result.get("mean_tpot_ms"),
        "mean_ttft_ms": result.get("mean_ttft_ms"),
        "median_ttft_ms": result.get("median_ttft_ms"),
        # Inter-token latency: one streamed chunk per engine step, so the median
        # is the server's typical step and the tail its mixed prefill steps.
        "median_itl_ms": result.get("median_itl_ms"),
        "p99_itl_ms": result.get("p99_itl_ms"),
        "completed": result.get("completed"),
        "failed": result.get("failed"),
        "num_drafts": drafts,
        "num_draft_tokens": result.get("spec_decode_draft_tokens"),
        "num_accepted_tokens": result.get("spec_decode_accepted_tokens"),
        "acceptance_length": result.get("spec_decode_acceptance_length")
        if drafts
        else None,
        "per_depth": per_depth[:DFLASH_TOKENS],
    }


def start_server(args, config, max_batch, log, env) -> tuple[subprocess.Popen, str]:
    """``vllm serve`` of one config on a free port, its output in ``log``:
    (the process, its base URL); the caller waits for it to be healthy."""
    port = free_port()
    server = subprocess.Popen(
        serve_command(args, config, max_batch, port),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    return server, f"http://127.0.0.1:{port}"


def serve_row_labels(args, config, rid, batch, temperature) -> dict:
    """What a serve row says about where it came from, beside serve_row's
    numbers."""
    return dict(
        mode="serve",
        settings=settings_of(args),
        config=config,
        run_id=rid,
        batch=batch,
        temperature=float(temperature),
        max_tokens=args.max_tokens,
        tree_budget=budget_of(base_config(config)),
        adaptive_budget=is_adaptive(config)
        or bool(getattr(args, "adaptive_budget", False)),
        **_schedule_field(args, config),
        **pin_cpus_field(args),
        time=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )


def _wait_healthy(base: str, proc: subprocess.Popen, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            urllib.request.urlopen(f"{base}/health", timeout=5)
            return True
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(2)
    return False


# engine_kwargs keys that serve_command passes otherwise (or not at all: the
# server logs its stats anyway).
_NOT_SERVE_FLAGS = ("model", "disable_log_stats")


def serve_command(args, config: str, max_batch: int, port: int) -> list[str]:
    """``vllm serve`` with this config's ``engine_kwargs`` as CLI flags."""
    kw = engine_kwargs(args, config, max_batch)
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        kw["model"],
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    for key, value in kw.items():
        if key in _NOT_SERVE_FLAGS:
            continue
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            cmd.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            cmd += [f"--{flag}", text]
    return cmd


def write_serve_dataset(prompts: list[str], path: Path) -> Path:
    """The prompts as a ShareGPT-style JSON file for ``vllm bench serve``.

    ShareGPT, not vLLM's ``custom`` JSONL: the custom loader needs pandas, which
    vLLM does not depend on, while ShareGPT's is plain ``json`` and sends the text
    as it is (no chat template). The empty second turn only satisfies the loader;
    ``--sharegpt-output-len`` sets the output length."""
    path.write_text(
        json.dumps(
            [
                {
                    "id": str(i),
                    "conversations": [
                        {"from": "human", "value": p},
                        {"from": "gpt", "value": ""},
                    ],
                }
                for i, p in enumerate(prompts)
            ]
        )
    )
    return path


def bench_command(
    args,
    base: str,
    dataset: Path,
    batch: int,
    temperature: float,
    result: Path,
    num_prompts: int | None = None,
    num_warmups: int | None = None,
) -> list[str]:
    """``vllm bench serve`` at concurrency ``batch`` (and ``--request-rate``).
    vLLM's warm-up requests repeat the dataset's first prompt: under
    ``--settings defaults`` the caller warms up with a dataset of its own and
    passes ``num_warmups=0``."""
    if num_prompts is None:
        num_prompts = serve_num_prompts(args, batch)
    if num_warmups is None:
        num_warmups = batch
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        base,
        "--model",
        str(args.target),
        "--served-model-name",
        SERVED_NAME,
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        str(dataset),
        "--sharegpt-output-len",
        str(args.max_tokens),
        "--disable-shuffle",
        "--seed",
        str(args.seed),
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(batch),
        "--request-rate",
        str(getattr(args, "request_rate", "inf")),
        "--num-warmups",
        str(num_warmups),
        "--temperature",
        str(temperature),
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
    ]
    return cmd + (["--ignore-eos"] if args.ignore_eos else [])


def serve_num_prompts(args, batch: int) -> int:
    """Timed requests of one serve cell at concurrency ``batch``: ``--min-waves``
    waves, at most ``--max-prompts`` of them, and never fewer than
    ``--num-prompts``."""
    return max(args.num_prompts, min(batch * args.min_waves, args.max_prompts))


def serve_run_commands(
    args, base, prompts, dataset, batch, temperature, result, k
) -> list[list[str]]:
    """The ``vllm bench serve`` commands of run ``k``: tuned, one over the shared
    dataset with vLLM's warm-up; defaults, a warm-up over ``batch`` tagged
    prompts, then the timed run over prompts tagged for it alone (prefix
    caching is on: nothing timed may hit a block an earlier request wrote)."""
    if settings_of(args) == "tuned":
        return [bench_command(args, base, dataset, batch, temperature, result)]
    warm, [(_, timed)] = fresh_serve_commands(
        args, base, prompts, batch, temperature, result, k
    )
    return [warm, timed]


def run_serve_config(args, config, max_batch, runs, prompts, rid, time_left) -> bool:
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    dataset = write_serve_dataset(prompts, logs / "prompts_sharegpt.json")
    env = _with_plugin(_worker_env(engine_in_process=False), logs)
    deadline = time.monotonic() + min(time_left, 1e9)
    ok = True
    with (
        clients_off_pinned_cpus(args),
        (logs / f"{config}.log").open("a") as log,
    ):
        server, base = start_server(args, config, max_batch, log, env)
        client = None
        try:
            if not _wait_healthy(base, server, deadline):
                print(f"    {config}: server did not come up (see its log)")
                return False
            if not pin_server(args, server, log):
                print(f"    {config}: could not pin the server (see its log)")
                return False
            client = ServeClient(log, env, root_pid=server.pid)
            for k, (batch, temperature) in enumerate(runs):
                result = logs / f"{config}_b{batch}_t{temperature}.json"
                commands = serve_run_commands(
                    args, base, prompts, dataset, batch, temperature, result, k
                )
                good = all(
                    client.run(cmd, deadline - time.monotonic()) for cmd in commands
                )
                if not good or not result.is_file():
                    ok = False
                    break
                row = serve_row(json.loads(result.read_text()))
                row.update(
                    **serve_row_labels(args, config, rid, batch, temperature),
                    host_usage=client.last_usage,  # of the timed run (the last)
                )
                append_row(args.out, row)
        finally:
            if client is not None:
                client.close()
            _kill_group(server)
    return ok


def slice_sizes(num_prompts: int, batch: int, slices: int) -> list[int]:
    """Timed requests of each of a cell's ``--interleave`` slices: near-equal
    parts of ``num_prompts``. The count is even, so that ABBA order balances a
    drift that is linear in time, and at most one slice per two waves of
    ``batch`` (a slice's last requests run at a lower concurrency, and that
    tail should stay a small part of it), but never under two."""
    count = min(slices, num_prompts // (2 * batch))
    count = max(2, count - count % 2)
    count = min(count, num_prompts)
    return [num_prompts // count + (j < num_prompts % count) for j in range(count)]


def fresh_serve_commands(
    args, base, prompts, batch, temperature, result, k, slices: int = 0
) -> tuple[list[str], list[tuple[Path, list[str]]]]:
    """Run ``k``'s commands under prompts new to the server (prefix caching is
    on by default): the warm-up over ``batch`` prompts of its own, then (result
    file, timed command) for the timed requests, one run into ``result``, or
    with ``slices`` (``--interleave``) one per slice. The prompts depend only
    on ``k`` and the slice, so interleaved servers get the same texts."""
    tag = k * TAGS_PER_RUN
    warm = [fresh_prompt(prompts[i % len(prompts)], tag + i) for i in range(batch)]
    warm_result = result.with_suffix(".warmup.json")
    warm_set = write_serve_dataset(warm, result.with_suffix(".warmup_prompts.json"))
    warm_cmd = bench_command(
        args, base, warm_set, batch, temperature, warm_result, batch, 0
    )
    n = serve_num_prompts(args, batch)
    sizes = slice_sizes(n, batch, slices) if slices else [n]
    runs, done = [], 0
    for j, size in enumerate(sizes):
        timed = [
            fresh_prompt(prompts[(done + i) % len(prompts)], tag + batch + done + i)
            for i in range(size)
        ]
        done += size
        out = result.with_suffix(f".slice{j}.json") if slices else result
        dataset = write_serve_dataset(timed, out.with_suffix(".prompts.json"))
        cmd = bench_command(args, base, dataset, batch, temperature, out, size, 0)
        runs.append((out, cmd))
    return warm_cmd, runs


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def combine_slices(results: list[dict]) -> dict:
    """The ``vllm bench serve`` results of one config's slices of a cell as one
    result of the same form: tokens and durations add up (throughput is their
    ratio), means are weighted by completed requests, acceptance by drafts,
    and the latency medians and p99s are the median over slices."""

    def total(key: str) -> float:
        return sum(r.get(key) or 0 for r in results)

    def weighted(key: str, weight: str) -> float | None:
        pairs = [(r.get(key), r.get(weight) or 0) for r in results]
        pairs = [(v, w) for v, w in pairs if v is not None and w]
        den = sum(w for _, w in pairs)
        return sum(v * w for v, w in pairs) / den if den else None

    tokens, duration = total("total_output_tokens"), total("duration")
    combined = {
        "duration": duration,
        "total_output_tokens": tokens,
        "output_throughput": tokens / duration if duration else None,
        "completed": total("completed"),
        "failed": total("failed"),
        "mean_tpot_ms": weighted("mean_tpot_ms", "completed"),
        "mean_ttft_ms": weighted("mean_ttft_ms", "completed"),
        "slices": len(results),
    }
    for key in ("median_ttft_ms", "median_itl_ms", "p99_itl_ms"):
        combined[key] = _median([r.get(key) for r in results])
    drafts = total("spec_decode_num_drafts")
    if drafts:
        combined.update(
            spec_decode_num_drafts=drafts,
            spec_decode_draft_tokens=total("spec_decode_draft_tokens"),
            spec_decode_accepted_tokens=total("spec_decode_accepted_tokens"),
            spec_decode_acceptance_length=weighted(
                "spec_decode_acceptance_length", "spec_decode_num_drafts"
            ),
        )
        rates = [
            (r.get("spec_decode_per_position_acceptance_rates") or [], d)
            for r in results
            if (d := r.get("spec_decode_num_drafts"))
        ]
        # A position a slice's list stops before had nothing accepted there.
        width = max((len(v) for v, _ in rates), default=0)
        combined["spec_decode_per_position_acceptance_rates"] = [
            sum((v[i] if i < len(v) else 0.0) * d for v, d in rates) / drafts
            for i in range(width)
        ]
    return combined


def combine_usage(usages: list[dict | None]) -> dict | None:
    """Host usage of a cell's slices: the first slice's threads, with the
    calibration, busy shares and busy CPUs as medians over slices."""
    usages = [u for u in usages if u]
    if not usages:
        return None
    out = dict(usages[0])
    for key in (
        "calibration_ms",
        "step_thread_busy_pct",
        "next_thread_busy_pct",
        "steal_pct",
        "busy_cpus",
    ):
        out[key] = _median([u.get(key) for u in usages])
    for key in ("wall_s", "timed_s", "step_thread_cpu_s"):
        out[key] = sum(u.get(key) or 0 for u in usages)
    out["slices"] = len(usages)
    return out


def run_serve_interleaved(args, todo, prompts, rid, clock) -> tuple[list, list]:
    """``--interleave``: every config's server up at once, then each pending
    (concurrency, temperature) cell: a warm-up per server, then its timed
    requests as slices run on one server at a time, alternating ABBA, so that
    every config meets the same drift of the host's speed. A cell's rows are
    written when all its slices are done (a cut cell is measured again on
    resume); a config whose server or run fails is dropped and the others go
    on. Returns (failed configs, configs cut by --limit-seconds)."""
    cells = []
    for _, _, runs in todo:
        cells += [c for c in runs if c not in cells]
    configs = [(c, max(fit)) for c, fit, runs in todo if runs]
    if not cells:
        print("bench_ddtree: nothing to do (measured already or no batch fits)")
        return [], []
    hint = getattr(args, "resume_hint", args.out)
    if clock.remaining() < max(clock.config_s):
        print(
            f"bench_ddtree: not started: {clock.remaining():.0f} s left of "
            f"--limit-seconds, interleaved servers and their cells take "
            f"~{max(clock.config_s):.0f} s; rerun with --resume-from {hint}"
        )
        return [], []
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    env = _with_plugin(_worker_env(engine_in_process=False), logs)
    began = time.monotonic()
    deadline = began + min(clock.remaining(), 1e9)
    share = argparse.Namespace(**vars(args))
    share.gpu_memory_utilization = interleave_memory(args)
    servers: dict[str, tuple] = {}  # config -> (server, base, client)
    failed: list[str] = []
    print(
        f"bench_ddtree: interleaved servers {', '.join(c for c, _ in configs)} "
        f"(gpu_memory_utilization {share.gpu_memory_utilization} each), "
        f"{len(cells)} cells (batch, T) = {cells}",
        flush=True,
    )

    def drop(config: str) -> None:
        server, _, client = servers.pop(config)
        if client is not None:
            client.close()
        _kill_groups([server])
        failed.append(config)

    def stop_all() -> None:
        for _, _, client in servers.values():
            if client is not None:
                client.close()
        _kill_groups([server for server, _, _ in servers.values()])

    with contextlib.ExitStack() as stack:
        stack.enter_context(clients_off_pinned_cpus(args))
        stack.callback(stop_all)
        # A server sizes its KV cache from the memory free while it starts,
        # which another one starting would change: one after another, unless
        # the KV cache has a fixed size (kv_cache_memory_bytes), then all at once.
        at_once = "kv_cache_memory_bytes" in parse_engine_args(
            getattr(args, "engine_arg", [])
        )
        server_logs = {
            config: stack.enter_context((logs / f"{config}.log").open("a"))
            for config, _ in configs
        }
        for config, max_batch in configs if at_once else ():
            log = server_logs[config]
            servers[config] = (*start_server(share, config, max_batch, log, env), None)
        for config, max_batch in configs:
            log = server_logs[config]
            if config not in servers:
                servers[config] = (
                    *start_server(share, config, max_batch, log, env),
                    None,
                )
            server, base, _ = servers[config]
            if not _wait_healthy(base, server, deadline):
                if time.monotonic() >= deadline:
                    print(f"    {config}: --limit-seconds ran out while it started")
                    return failed, [c for c, _ in configs if c not in failed]
                print(f"    {config}: server did not come up (see its log)")
                drop(config)
                continue
            if not pin_server(args, server, log):
                print(f"    {config}: could not pin the server (see its log)")
                drop(config)
                continue
            servers[config] = (server, base, ServeClient(log, env, root_pid=server.pid))
        took: dict[tuple, float] = {}
        for k, (batch, temperature) in enumerate(cells):
            who = [c for c, _, runs in todo if (batch, temperature) in runs]
            who = [c for c in who if c in servers]
            if not who:
                continue
            # The slowest cell of this concurrency so far (or of any): a cell
            # cut by the limit loses every config's slices.
            same = [t for (b, _), t in took.items() if b == batch]
            guess = max(same or list(took.values()) or [0.0])
            if deadline - time.monotonic() < guess:
                print(
                    f"    not started: cells {cells[k:]} (~{guess:.0f} s each, "
                    f"{deadline - time.monotonic():.0f} s left); rerun with "
                    f"--resume-from {hint}"
                )
                break
            if len(who) < 2:
                print(
                    f"    batch {batch} T={temperature}: only {who[0]} to measure "
                    "(the others failed or have it): its row is not interleaved"
                )
            start = time.monotonic()
            attempt = 0
            while who:
                # A cell measured again (a config dropped) gets prompts none of
                # the servers has seen: the first attempt's are in their caches.
                tag = k + attempt * len(cells)
                attempt += 1
                rows, bad = _measure_interleaved_cell(
                    args, servers, who, prompts, rid, tag, batch, temperature, deadline
                )
                if bad is None:
                    break
                if time.monotonic() >= deadline - 1.0:
                    print(f"    batch {batch} T={temperature}: cut by --limit-seconds")
                    clock.record(time.monotonic() - began)
                    return failed, list(who)
                print(
                    f"    {bad}: a run of batch {batch} T={temperature} failed (see "
                    "its log); dropped, the cell runs again without it"
                )
                drop(bad)
                who = [c for c in who if c != bad]
            if not who:
                continue
            took[(batch, temperature)] = time.monotonic() - start
            for row in rows:
                append_row(args.out, row)
            print(
                f"    batch {batch:>3} T={temperature} in "
                f"{took[(batch, temperature)]:.0f} s: "
                + ", ".join(
                    f"{r['config']} {r.get('tok_s') or 0:.1f} tok/s" for r in rows
                ),
                flush=True,
            )
    clock.record(time.monotonic() - began)
    return failed, []


def _kill_groups(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process group first, then wait for them together (a
    server at a time would spend up to 30 s each)."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    end = time.monotonic() + 30
    for p in live:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _measure_interleaved_cell(
    args, servers, who, prompts, rid, k, batch, temperature, deadline
) -> tuple[list[dict], str | None]:
    """One cell on the servers of ``who``, prompts tagged from ``k``: (its
    rows, None), or ([], the config whose run failed or lost requests)."""
    logs = args.out / "logs"
    plans = {}
    for config in who:
        _, base, client = servers[config]
        result = logs / f"{config}_b{batch}_t{temperature}.json"
        warm, slices = fresh_serve_commands(
            args, base, prompts, batch, temperature, result, k, interleave_of(args)
        )
        if not client.run(warm, deadline - time.monotonic()):
            return [], config
        plans[config] = (result, slices)
    results = {c: [] for c in who}
    usages = {c: [] for c in who}
    # KV blocks held, from each server's /metrics while its slices run.
    kv = {c: KvSampler(servers[c][1]) for c in who}
    for j in range(len(plans[who[0]][1])):
        for config in who if j % 2 == 0 else reversed(who):
            out, cmd = plans[config][1][j]
            client = servers[config][2]
            kv[config].start()
            try:
                ran = client.run(cmd, deadline - time.monotonic())
            finally:
                kv[config].stop()
            if not ran or not out.is_file():
                return [], config
            result = json.loads(out.read_text())
            if result.get("failed"):  # vllm bench serve exits 0 all the same
                return [], config
            results[config].append(result)
            usages[config].append(client.last_usage)
    rows = []
    for config in who:
        result = plans[config][0]
        combined = combine_slices(results[config])
        result.write_text(json.dumps(combined, indent=1))
        row = serve_row(combined)
        row.update(
            **serve_row_labels(args, config, rid, batch, temperature),
            slices=len(results[config]),
            interleaved_with=[c for c in who if c != config],
            slices_tok_s=[r.get("output_throughput") for r in results[config]],
            host_usage=combine_usage(usages[config]),
            kv_usage=kv[config].summary(),
        )
        rows.append(row)
    return rows, None


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def write_report(out: Path, mode: str, setup: dict | None) -> str:
    text = markdown_report(load_rows([out]), mode, setup)
    (out / REPORT_FILE).write_text(text)
    print(text)
    return text


def report_main(args) -> int:
    missing = [d for d in args.dirs if not (d / RESULTS_FILE).is_file()]
    if missing:
        raise ValueError(f"no {RESULTS_FILE} in {', '.join(map(str, missing))}")
    setups = [
        json.loads((d / SETUP_FILE).read_text())
        for d in args.dirs
        if (d / SETUP_FILE).is_file()
    ]
    for other, d in zip(setups[1:], args.dirs[1:]):
        check_setup(setups[0], other, str(d))
    if getattr(args, "rounds", False):
        if args.out is None:
            raise ValueError("report --rounds needs --out")
        args.out.mkdir(parents=True, exist_ok=True)
        mode = setups[0]["mode"] if setups else "serve"
        print(write_rounds_report(args.out, args.dirs, mode))
        return 0
    rows = merge_rows(load_rows(args.dirs))
    mode = setups[0]["mode"] if setups else str(rows[0].get("mode", "e2e"))
    text = markdown_report(rows, mode, setups[0] if setups else None)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / RESULTS_FILE).write_text(
            "".join(json.dumps(r) + "\n" for r in rows)
        )
        if setups:
            (args.out / SETUP_FILE).write_text(json.dumps(setups[0], indent=1))
        (args.out / REPORT_FILE).write_text(text)
    print(text)
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.mode in MODE_DEFAULTS:
        try:
            validate(args)
        except ValueError as e:
            parser.error(str(e))
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:  # internal: one engine config (run_offline_config)
        worker_main(Path(argv[1]))
        return 0
    args = parse_args(argv)
    try:
        if args.mode == "report":
            return report_main(args)
        return run_rounds(args) if args.rounds > 1 else run_sweep(args)
    except ValueError as e:
        print(f"bench_ddtree: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
