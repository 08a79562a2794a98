# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every engine step of a server, for any config, recorded from outside.

:func:`install` wraps MRv2's ``GPUModelRunner.execute_model`` so that each
step appends a record when it starts: the batch's requests, its scheduled
tokens, how many of them are prompt tokens (beyond one per request and its
draft slots) and how many requests joined. A step's period is the time to the
next step's start: what no speculation, DFlash and DDTree servers spend per
step, by kind, side by side (the budget trace, ``budget_recorder.py``, sees
DDTree's decisions only). ``serve_trace/sitecustomize.py`` installs it inside a
server when ``DDTREE_STEP_TRACE`` names a folder (``bench_ddtree.py serve
--step-trace``); the recording is a few dictionary writes per step, the same
for every config. Summarized by cell, with each config's time set against
the first config's by step kind (decode steps, and steps carrying a prompt
chunk by its size: what its steps cost more each, what it ran more of), after
a warning for any DDTree server whose log shows its adaptive budget learned no
step period (its figures would not be the default's):

    python benchmarks/step_recorder.py OUT/logs none dflash ddtree-auto-adaptive

``trace_budget.py`` records every config's steps in process too
(``OUT/<config>_steps.jsonl``), summarized by phase:

    python benchmarks/step_recorder.py --phases OUT adaptive none
"""

import json
import math
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

# Environment variable naming the folder a server's engine core writes its
# step records to (serve_trace/sitecustomize.py).
TRACE_ENV = "DDTREE_STEP_TRACE"
PREFIX = "step_trace"


def install(records: list, phase: Callable[[], str] | None = None):
    """Record the start of every step of every MRv2 model runner into
    ``records`` (``phase()``, if given, names the part of the run a step
    belongs to); returns the function that takes the wrapper off again."""
    from vllm.v1.worker.gpu import model_runner as mr

    C = mr.GPUModelRunner
    orig = C.execute_model

    def execute_model(self, scheduler_output, *args, **kwargs):
        tokens = scheduler_output.num_scheduled_tokens
        if tokens and not kwargs.get("dummy_run", False):
            n = len(tokens)
            total = scheduler_output.total_num_scheduled_tokens
            slots = sum(
                map(len, scheduler_output.scheduled_spec_decode_tokens.values())
            )
            records.append(
                {
                    "t": time.perf_counter(),
                    "wall": time.time(),
                    "n": n,
                    "tokens": total,
                    "prompt": max(total - n - slots, 0),
                    "new": len(scheduler_output.scheduled_new_reqs),
                    **({"ph": phase()} if phase is not None else {}),
                }
            )
        return orig(self, scheduler_output, *args, **kwargs)

    C.execute_model = execute_model

    def uninstall() -> None:
        C.execute_model = orig

    return uninstall


def with_periods(rs: list[dict]) -> list[dict]:
    """One process's steps in order, each given its ``period`` (ms) to the
    next step of the same phase (the last step of a phase has none) and the
    prompt tokens of the step before it in that phase (``prompt_before``)."""
    for a, b in zip(rs, rs[1:], strict=False):
        if a.get("ph") == b.get("ph"):
            a["period"] = (b["t"] - a["t"]) * 1e3
            b["prompt_before"] = a["prompt"]
    return rs


def _read_jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f]


def read_steps(folder: str | os.PathLike) -> list[dict]:
    """A server's step records (``step_trace.<pid>.jsonl``), each with its
    ``period`` (ms, to the next step of the same process; the last step of a
    process has none), in time order."""
    steps = []
    for path in sorted(Path(folder).glob(f"{PREFIX}.*.jsonl")):
        steps += with_periods(_read_jsonl(path))
    steps.sort(key=lambda r: r["wall"])
    return steps


def _cells(steps: list[dict], windows: list[dict], config: str) -> dict:
    """Steps by the timed cell of ``config`` whose slice holds their whole
    period (the last step of a slice runs into the idle time after it)."""
    spans = [
        (w["start"], w["end"], (w["batch"], w["temperature"]))
        for w in windows
        if w["config"] == config
    ]
    cells = defaultdict(list)
    for r in steps:
        if "period" not in r:
            continue
        for a, b, cell in spans:
            if a <= r["wall"] and r["wall"] + r["period"] / 1e3 <= b:
                cells[cell].append(r)
                break
    return cells


def _row(config: str, rs: list[dict], ref: dict | None) -> tuple[str, dict]:
    decode = [r["period"] for r in rs if r["prompt"] == 0]
    prompt = [r["period"] for r in rs if r["prompt"] > 0]
    total = sum(r["period"] for r in rs)
    stats = {
        "decode_median": statistics.median(decode) if decode else float("nan"),
        "decode_mean": statistics.mean(decode) if decode else float("nan"),
    }

    def vs(key: str) -> str:
        if ref is None or math.isnan(ref[key]) or math.isnan(stats[key]):
            return ""
        return f" ({stats[key] / ref[key]:.3f}x)"

    cells = [
        config,
        str(len(rs)),
        f"{total / 1e3:.2f}",
        f"{statistics.mean(r['n'] for r in rs):.1f}",
        f"{stats['decode_median']:.2f}{vs('decode_median')}",
        f"{stats['decode_mean']:.2f}{vs('decode_mean')}",
        f"{len(prompt)} ({100 * len(prompt) / len(rs):.0f} %)",
        f"{statistics.mean(prompt):.2f}" if prompt else "-",
        f"{100 * sum(prompt) / total:.0f} %" if total else "-",
    ]
    return "| " + " | ".join(cells) + " |", stats


# Step kinds of the attribution: decode steps, then steps carrying a prompt
# chunk of at most this many prompt tokens.
PROMPT_BINS = (128, 512, 2048, math.inf)
KIND_LABELS = ["decode"] + [
    f"prompt {low}+" if high == math.inf else f"prompt {low}-{high}"
    for low, high in zip(
        (1, *(b + 1 for b in PROMPT_BINS[:-1])), PROMPT_BINS, strict=True
    )
]


def _kind(r: dict) -> int:
    """A period's kind (an index of KIND_LABELS): a prompt chunk's when its
    step or the step before carried one (with async scheduling a step's
    period holds part of the previous step's work), by the larger chunk;
    else a decode step's."""
    prompt = max(r["prompt"], r.get("prompt_before", 0))
    if prompt == 0:
        return 0
    return 1 + next(i for i, high in enumerate(PROMPT_BINS) if prompt <= high)


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def attribution(config: str, rs: list[dict], ref: str, ref_rs: list[dict]) -> list[str]:
    """Where ``config``'s time in a cell differs from ``ref``'s, by step kind
    (decode steps; periods touching a prompt chunk, by its size,
    :func:`_kind`): what its steps
    cost more each (its steps x the difference of the kinds' mean periods) and
    what it ran more or fewer of them (the difference of the counts x
    ``ref``'s mean period). The two columns sum to the difference of the
    kind's seconds; a kind ``ref`` never ran counts wholly as steps."""

    def by_kind(steps):
        kinds = defaultdict(list)
        for r in steps:
            kinds[_kind(r)].append(r["period"])
        return kinds

    mine, theirs = by_kind(rs), by_kind(ref_rs)
    lines = [
        "",
        f"{config} against {ref}, seconds by step kind:",
        "",
        "| kind | steps | ref steps | mean ms | ref mean ms | cost per step s "
        "| step count s |",
        "|---|---|---|---|---|---|---|",
    ]
    totals = [0.0, 0.0]
    for k in sorted({*mine, *theirs}):
        a, b = mine.get(k, []), theirs.get(k, [])
        mean_a = statistics.mean(a) if a else float("nan")
        mean_b = statistics.mean(b) if b else float("nan")
        if b:
            per_step = len(a) * (mean_a - mean_b) / 1e3 if a else 0.0
            count = (len(a) - len(b)) * mean_b / 1e3
        else:
            per_step, count = 0.0, sum(a) / 1e3
        totals[0] += per_step
        totals[1] += count
        lines.append(
            f"| {KIND_LABELS[k]} | {len(a)} | {len(b)} | {_ms(mean_a)} | {_ms(mean_b)} "
            f"| {per_step:+.3f} | {count:+.3f} |"
        )
    lines.append(
        f"| all | {len(rs)} | {len(ref_rs)} | | | {totals[0]:+.3f} | {totals[1]:+.3f} |"
    )
    return lines


def _tables(by_config: dict[str, dict], title) -> list[str]:
    lines = []
    for cell in sorted({k for cells in by_config.values() for k in cells}):
        lines += [
            "",
            f"{title(cell)}:",
            "",
            "| config | steps | seconds | requests per step | decode step median ms "
            "| decode step mean ms | steps with a prompt chunk | their mean ms "
            "| share of the time |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        ref = None
        present = [
            (c, cells[cell]) for c, cells in by_config.items() if cells.get(cell)
        ]
        for c, rs in present:
            line, stats = _row(c, rs, ref)
            ref = ref or stats
            lines.append(line)
        for c, rs in present[1:]:
            lines += attribution(c, rs, *present[0])
    return lines


def summarize_phases(out: str | os.PathLike, configs: list[str]) -> list[str]:
    """In-process runs (``trace_budget.py``'s ``OUT/<config>_steps.jsonl``):
    the tables of :func:`summarize` by phase instead of by cell."""
    by_config = {}
    for c in configs:
        phases = defaultdict(list)
        for r in with_periods(_read_jsonl(Path(out) / f"{c}_steps.jsonl")):
            if "period" in r:
                phases[r["ph"]].append(r)
        by_config[c] = phases
    return _tables(by_config, lambda ph: f"phase {ph}")


# A DDTree server's budget line (ddtree_cost.py's log) and the part of it that
# names the step periods its cost model learned.
_BUDGET_LINE = re.compile(r"DDTree: budget over [\d.]+ s: (\d+) decode steps")
_LEARNED = re.compile(r"step periods learned for batches of up to \d+: ([^;]*)")
# Decode steps after which an adaptive budget that learned no period is broken.
_MIN_STEPS_TO_LEARN = 500


def unlearned_servers(logs: Path, configs: list[str]) -> list[str]:
    """Warnings for the servers whose adaptive budget learned no step period
    over at least _MIN_STEPS_TO_LEARN decode steps (their log's budget lines
    all say ``none yet``): such a server chose every budget on its start-up
    prior alone, as when a wrapper ran its step planning twice, so its
    figures are not the default's."""
    warnings = []
    for config in configs:
        path = logs / f"{config}.log"
        if not path.is_file():
            continue
        steps, learned = 0, False
        for line in path.read_text(errors="replace").splitlines():
            budget, periods = _BUDGET_LINE.search(line), _LEARNED.search(line)
            if budget is None or periods is None:
                continue
            steps += int(budget.group(1))
            learned = learned or periods.group(1).strip() != "none yet"
        if not learned and steps >= _MIN_STEPS_TO_LEARN:
            warnings.append(
                f"**{config}: its adaptive budget learned no step period over "
                f"{steps} decode steps** (every budget line of {path.name} says "
                "`none yet`): it chose on its start-up prior alone, and its "
                "figures are not the default's."
            )
    return warnings


def summarize(logs: str | os.PathLike, configs: list[str]) -> list[str]:
    """A table per cell: each config's steps, seconds, mean batch, decode
    steps' median and mean period (and their ratio to the first config's),
    the steps carrying a prompt chunk, their mean period and share of the
    time; first, a warning for each DDTree server whose budget learned
    nothing (:func:`unlearned_servers`)."""
    logs = Path(logs)
    windows = _read_jsonl(logs / "slice_windows.jsonl")
    by_config = {
        c: _cells(read_steps(logs / f"{PREFIX}_{c}"), windows, c) for c in configs
    }
    tables = _tables(by_config, lambda cell: f"concurrency {cell[0]}, T={cell[1]:g}")
    warnings = unlearned_servers(logs, configs)
    return [*warnings, *([""] if warnings else []), *tables]


if __name__ == "__main__":
    args = sys.argv[1:]
    by_phase = args[:1] == ["--phases"]
    if by_phase:
        args = args[1:]
    if len(args) < 2:
        sys.exit(
            f"usage: {sys.argv[0]} OUT/logs CONFIG [CONFIG ...]  (servers)\n"
            f"       {sys.argv[0]} --phases OUT CONFIG [CONFIG ...]  (trace_budget.py)"
        )
    print("\n".join((summarize_phases if by_phase else summarize)(args[0], args[1:])))
