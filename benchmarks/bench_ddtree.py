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
the benchmark's targets. See docs/bench_ddtree.md for the commands.

This file is the command line and the sweep over configurations; the jobs live
beside it: ``bench_ddtree_config`` (run options, engine configurations, prompts,
setup), ``bench_ddtree_procs`` (time limit, child processes, the serve client),
``bench_ddtree_offline`` (``e2e`` and ``cost``: one engine per process),
``bench_ddtree_serve`` (``serve``) and ``bench_ddtree_report`` (rows and tables).

    python benchmarks/bench_ddtree.py cost --out OUT [--configs none,dflash,ddtree-128]
    python benchmarks/bench_ddtree.py e2e --target T --drafter D --prompts P --out OUT
    python benchmarks/bench_ddtree.py report OUT [OUT2 ...]
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_ddtree_config import (
    ALL_BUDGETS,
    ARRIVALS,
    MODE_DEFAULTS,
    MODEL_CONFIGS,
    SETTINGS,
    TUNED_GPU_MEMORY_UTILIZATION,
    check_prompt_lengths,
    fitting_batches,
    interleave_of,
    load_prompts,
    setup_of,
    validate,
)
from benchmarks.bench_ddtree_offline import (
    run_offline_config,
    worker_main,
)
from benchmarks.bench_ddtree_procs import (
    Clock,
    prepare_out,
    run_id,
)
from benchmarks.bench_ddtree_report import (
    ADAPTIVE_SUFFIX,
    AUTO_CONFIG,
    REPORT_FILE,
    RESULTS_FILE,
    SCHEDULE_CONFIG,
    SETUP_FILE,
    check_setup,
    load_rows,
    markdown_report,
    merge_rows,
    pending,
    row_key,
    write_rounds_report,
)
from benchmarks.bench_ddtree_serve import (
    run_serve_config,
    run_serve_interleaved,
)

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
        help="comma list of none, dflash, dflash-schedule (--dflash-schedule), "
        "ddtree (= every --budgets), "
        f'ddtree-<B>, {AUTO_CONFIG} (tree_budget "auto"), '
        f"{SCHEDULE_CONFIG} (needs --schedule); a DDTree config with "
        f"{ADAPTIVE_SUFFIX} runs with adaptive_budget true (e.g. "
        f"{AUTO_CONFIG}{ADAPTIVE_SUFFIX})",
    )
    p.add_argument(
        "--dflash-schedule",
        default=None,
        help="dflash-schedule's num_speculative_tokens_per_batch_size: JSON "
        "[[first, last, tokens], ...] (default: 15 up to 8 requests, 7 up to 32, "
        "then 3)",
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
            "--budget-trace",
            nargs="?",
            const="all",
            default=None,
            metavar="CONFIGS",
            help="a diagnostic, with --interleave: DDTree servers (all, or "
            "those of the comma list CONFIGS) record every decision of the "
            "adaptive budget (benchmarks/serve_trace/) into "
            "OUT/logs/budget_trace_<config>/, and each measured cell's slices' "
            "wall-clock windows go to OUT/logs/slice_windows.jsonl; read them "
            "with trace_budget.py --summarize TRACE WINDOWS CONFIG. The "
            "recording costs host time on every step: a recorded server next "
            "to an unrecorded copy of its config (e.g. ddtree-auto-adaptive "
            "and ddtree-128-adaptive) measures what it costs",
        )
        p.add_argument(
            "--step-trace",
            action="store_true",
            help="a diagnostic, with --interleave: every server records each "
            "engine step's start, batch and prompt tokens "
            "(benchmarks/step_recorder.py) into OUT/logs/step_trace_<config>/, "
            "and the slices' windows go to OUT/logs/slice_windows.jsonl; "
            "step_recorder.py OUT/logs CONFIG... sets the configs' step "
            "periods side by side per cell (a few dictionary writes per step, "
            "alike for every config)",
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


# ---------------------------------------------------------------------------
# Orchestration (one process per engine config)
# ---------------------------------------------------------------------------


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
