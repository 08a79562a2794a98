# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``bench_ddtree.py``'s run options, engine configurations, prompts and setup:
what a run measures, decided before any engine starts."""

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from benchmarks.bench_ddtree_report import (
    ADAPTIVE_SUFFIX,
    AUTO_CONFIG,
    DFLASH_SCHEDULE_CONFIG,
    SCHEDULE_CONFIG,
    base_config,
    budget_of,
    config_order,
    is_adaptive,
    schedule_budget,
)
from benchmarks.host_usage import (
    format_cpu_list,
    parse_cpu_list,
    pin_process_tree,
)

MODEL_CONFIGS = ROOT / "benchmarks" / "model_configs"
DFLASH_TOKENS = 15  # DFlash's chain: a block of 16 minus the root
# `vllm serve` on a GPU of >= 70 GiB defaults to 8192 batched tokens and 1024
# sequences, and vLLM then refuses DFlash's 14 new slots per sequence for
# drafting (8192 - 1024 * 14 < 0); a DFlash user must lower max_num_seqs. 256,
# vLLM's default on smaller GPUs, is what the benchmark sets, and says so.
DFLASH_SERVE_MAX_NUM_SEQS = 256
DRAFT_LEN = DFLASH_TOKENS + 1
# dflash-schedule's default draft lengths by running requests: the whole block
# alone, shorter chains as the batch grows (--dflash-schedule overrides it).
DFLASH_SCHEDULE = [[1, 8, 15], [9, 32, 7], [33, 1024, 3]]
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
            if len(base) != 1 or not base[0].startswith("ddtree"):
                raise ValueError(f"{raw}: only a DDTree config takes -adaptive")
            names.add(raw)
        elif raw in ("none", "dflash", DFLASH_SCHEDULE_CONFIG, AUTO_CONFIG):
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
                f"unknown config {raw!r}; use none, dflash, {DFLASH_SCHEDULE_CONFIG}, "
                f"ddtree (every --budgets), ddtree-<budget>, {AUTO_CONFIG} or "
                f"{SCHEDULE_CONFIG}, "
                f"each DDTree one also with {ADAPTIVE_SUFFIX}"
            )
    return sorted(names, key=config_order)


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """Parse the list options in place; ``ValueError`` names the bad option."""
    budgets = parse_int_list(args.budgets, "--budgets", 1, MAX_BUDGET)
    args.schedule = parse_schedule(getattr(args, "schedule", None))
    args.dflash_schedule = parse_dflash_schedule(getattr(args, "dflash_schedule", None))
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


def traced_configs(args) -> list[str]:
    """The configs whose servers record the adaptive budget's decisions
    (``--budget-trace``, as :func:`parse_budget_trace` left it)."""
    return getattr(args, "budget_trace", None) or []


def parse_budget_trace(value: str, configs: list[str]) -> list[str]:
    """``--budget-trace`` alone (``all``) means every DDTree config, a comma
    list those."""
    ddtree = [c for c in configs if c.startswith("ddtree")]
    if value == "all":
        return ddtree
    names = [c.strip() for c in value.split(",") if c.strip()]
    bad = [c for c in names if c not in ddtree]
    if bad or not names:
        raise ValueError(
            f"--budget-trace {value}: each must be one of the DDTree configs {ddtree}"
        )
    return names


def check_interleave(args) -> None:
    """``--interleave``: an even slice count, at least two configs, vLLM's
    defaults, and memory shares that fit on one GPU together."""
    slices = interleave_of(args)
    if slices < 0:
        raise ValueError("--interleave must be >= 0 (0: one server at a time)")
    if getattr(args, "budget_trace", None) and not slices:
        raise ValueError(
            "--budget-trace labels a server's decisions by the windows of the "
            "timed slices, which --interleave runs: give --interleave"
        )
    if getattr(args, "step_trace", False) and not slices:
        raise ValueError(
            "--step-trace labels a server's steps by the windows of the timed "
            "slices, which --interleave runs: give --interleave"
        )
    if getattr(args, "budget_trace", None):
        args.budget_trace = parse_budget_trace(args.budget_trace, args.configs)
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
    if config == DFLASH_SCHEDULE_CONFIG:
        return {"num_speculative_tokens_per_batch_size": args.dflash_schedule}
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


def parse_dflash_schedule(text: str | None) -> list[list[int]]:
    """``--dflash-schedule``: JSON ``[[first, last, tokens], ...]`` (vLLM's
    ``num_speculative_tokens_per_batch_size``), at most DFlash's 15 tokens."""
    if text is None:
        return DFLASH_SCHEDULE
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--dflash-schedule must be JSON like {DFLASH_SCHEDULE}: {e}")
    ok = (
        isinstance(value, list)
        and value
        and all(
            isinstance(e, list)
            and len(e) == 3
            and all(isinstance(v, int) for v in e)
            and 1 <= e[0] <= e[1]
            and 1 <= e[2] <= DFLASH_TOKENS
            for e in value
        )
    )
    if not ok:
        raise ValueError(
            f"--dflash-schedule: entries [first, last, tokens] with 1 <= first "
            f"<= last and 1 <= tokens <= {DFLASH_TOKENS}, got {text}"
        )
    return value


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
    dflash_schedule=None,
) -> dict | None:
    """A config's speculative config; ``fixed``: every DDTree step verifies its
    budget (``adaptive_budget`` false), as the cost mode measures one tree size;
    ``adaptive``: each step's trees sized by DDTree's cost model, the config's
    budget a per-request cap (``--adaptive-budget``); else DDTree's default."""
    spec = _speculative_config(base_config(config), drafter, schedule)
    if base_config(config) == DFLASH_SCHEDULE_CONFIG:
        spec["num_speculative_tokens_per_batch_size"] = (
            dflash_schedule or DFLASH_SCHEDULE
        )
    if spec is not None and spec["method"] == "ddtree":
        # Said in every DDTree config, whatever the product's default.
        spec["adaptive_budget"] = not fixed and (adaptive or is_adaptive(config))
    return spec


def _speculative_config(config: str, drafter: Path, schedule=None) -> dict | None:
    if config == "none":
        return None
    if config in ("dflash", DFLASH_SCHEDULE_CONFIG):
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
    if config in ("dflash", DFLASH_SCHEDULE_CONFIG):
        return batch * DRAFT_LEN  # a schedule's longest chain: an upper bound
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
        dflash_schedule=getattr(args, "dflash_schedule", None),
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
    if getattr(args, "budget_trace", None):
        # Recording every decision costs the recorded servers host time: such
        # rows never merge with unrecorded ones.
        setup["budget_trace"] = traced_configs(args)
    if getattr(args, "step_trace", False):
        setup["step_trace"] = True
    return setup
