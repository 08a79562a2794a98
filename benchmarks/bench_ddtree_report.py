# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Results of ``benchmarks/bench_ddtree.py``: metric arithmetic, result rows, resume
bookkeeping and the markdown report. Pure Python (no torch, no vLLM), so the CPU
tests cover all of it.

A result row is one (engine config, batch, temperature) measurement, one JSON line
in ``<out>/results.jsonl``. Its key fields:

* ``config``: ``none`` (no speculation), ``dflash`` (DFlash chain, 15 draft tokens)
  , ``ddtree-<B>`` (tree_budget B), ``ddtree-auto`` (tree_budget "auto") or
  ``ddtree-schedule`` (a budget per batch
  size, ``tree_budget_per_batch_size``); ``batch``; ``temperature``;
* ``tok_s``: output tokens / wall time of the whole generation (prefill included);
* ``decode_ms_per_step``: (wall - prefill-only wall) / (steps - prefill-only steps),
  the time of one decode step (verify + draft + tree ops); ``ms_per_step`` = wall /
  steps of the whole generation;
* ``acceptance_length`` = 1 + accepted / drafts (tokens emitted per verified draft
  or tree) and ``per_depth``: the fraction of drafts whose accepted path reached
  depth d, d = 1..15, from vLLM's ``vllm:spec_decode_*`` counters;
* ``run_id``: the GPU command that measured it (ratios between rows of different
  runs are marked in the report).
"""

import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
# One observation per engine step that returned outputs.
STEPS = "vllm:iteration_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens"
# The DFlash drafter's depth: blocks of 16 give 15 draft positions.
MAX_DEPTH = 15
RESULTS_FILE = "results.jsonl"
SETUP_FILE = "setup.json"
REPORT_FILE = "results.md"
ROUNDS_FILE = "rounds.json"
ROUNDS_REPORT = "rounds.md"
# The benchmark's targets.
E2E_TARGET = 0.95  # DDTree/DFlash throughput >= 0.95 x their acceptance ratio
# ddtree-auto's throughput vs DFlash's: at batch 1, T=0, and everywhere else.
AUTO_B1_TARGET, AUTO_TARGET = 1.2, 1.0
# 8B shape, batch 1: step time vs DFlash's (budgets 127 / 255: the step-cost
# targets; 128 / 512: the design's).
STEP_TARGETS = {127: 1.05, 128: 1.10, 255: 1.25, 512: 1.30}


# ---------------------------------------------------------------------------
# Metrics: vllm.LLM.get_metrics() snapshots -> per-measurement numbers
# ---------------------------------------------------------------------------


def metric_totals(metrics: Iterable) -> dict[str, float | list[int]]:
    """Sum every metric of a ``get_metrics()`` snapshot over its label sets:
    counters and gauges by value, the per-position vector element-wise,
    histograms by observation count."""
    totals: dict[str, float | list[int]] = {}
    for m in metrics:
        if hasattr(m, "values"):
            totals[m.name] = _add_lists(totals.get(m.name, []), list(m.values))
        elif hasattr(m, "count"):
            totals[m.name] = totals.get(m.name, 0) + m.count
        elif hasattr(m, "value"):
            totals[m.name] = totals.get(m.name, 0) + m.value
    return totals


def metric_delta(before: Mapping, after: Mapping) -> dict[str, float | list[int]]:
    """``after - before`` for every metric in ``after`` (lists element-wise)."""
    delta: dict[str, float | list[int]] = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, list):
            delta[name] = _add_lists(value, [-v for v in (old or [])])
        else:
            delta[name] = value - (old or 0)
    return delta


def _add_lists(a: Sequence[int], b: Sequence[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def spec_stats(delta: Mapping, max_depth: int = MAX_DEPTH) -> dict:
    """Acceptance numbers of one measurement from its metric delta.

    ``acceptance_length`` = 1 + accepted / drafts; ``per_depth[d - 1]`` = drafts
    whose accepted path reached depth d / drafts. DDTree sizes vLLM's per-position
    vector by tree_budget, but no path is deeper than the drafter's 15 positions,
    so the vector is cut at ``max_depth``. None without drafts (no speculation)."""
    drafts = int(delta.get(DRAFTS, 0))
    accepted = int(delta.get(ACCEPTED, 0))
    draft_tokens = int(delta.get(DRAFT_TOKENS, 0))
    per_pos = list(delta.get(ACCEPTED_PER_POS, []))[:max_depth]
    stats = {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "accepted_per_pos": per_pos,
        "acceptance_length": None,
        "draft_acceptance_rate": None,
        "per_depth": [],
    }
    if drafts > 0:
        stats["acceptance_length"] = 1 + accepted / drafts
        stats["per_depth"] = [n / drafts for n in per_pos]
    if draft_tokens > 0:
        stats["draft_acceptance_rate"] = accepted / draft_tokens
    return stats


def timing_stats(
    full: Mapping,
    prefill: Mapping,
    wall_s: float,
    prefill_wall_s: float,
    output_tokens: int,
) -> dict:
    """Throughput and step times of one measurement.

    ``full`` / ``prefill`` are the metric deltas of the timed generation and of the
    same requests with max_tokens=1 (prefill plus one sampled token): the
    difference is the decode phase."""
    steps = int(full.get(STEPS, 0))
    prefill_steps = int(prefill.get(STEPS, 0))
    decode_steps = steps - prefill_steps
    decode_s = wall_s - prefill_wall_s
    return {
        "output_tokens": output_tokens,
        "wall_s": wall_s,
        "tok_s": output_tokens / wall_s if wall_s > 0 else None,
        "steps": steps,
        "ms_per_step": 1000 * wall_s / steps if steps > 0 else None,
        "prefill_wall_s": prefill_wall_s,
        "prefill_steps": prefill_steps,
        "decode_steps": decode_steps,
        "decode_ms_per_step": (
            1000 * decode_s / decode_steps
            if decode_steps > 0 and decode_s > 0
            else None
        ),
    }


# ---------------------------------------------------------------------------
# Rows: keys, files, resume
# ---------------------------------------------------------------------------


def row_key(row: Mapping) -> tuple[str, int, float]:
    return (str(row["config"]), int(row["batch"]), float(row["temperature"]))


def load_rows(dirs: Iterable[Path]) -> list[dict]:
    """Rows of ``results.jsonl`` in each directory, in order. A line cut short (a
    process killed mid-write) is skipped."""
    rows = []
    for d in dirs:
        path = Path(d) / RESULTS_FILE
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                print(f"bench_ddtree: skipping a truncated line in {path}")
    return rows


def merge_rows(rows: Iterable[Mapping]) -> list[dict]:
    """One row per (config, batch, temperature), the last one seen winning;
    sorted by batch, temperature, config."""
    merged = {row_key(r): dict(r) for r in rows}
    return [merged[k] for k in sorted(merged, key=_sort_key)]


def _sort_key(key: tuple[str, int, float]):
    config, batch, temperature = key
    return (batch, temperature, config_order(config))


# DDTree with a tree_budget_per_batch_size schedule (bench_ddtree.py --schedule).
SCHEDULE_CONFIG = "ddtree-schedule"
# DFlash with vLLM's batch-size schedule of draft lengths
# (num_speculative_tokens_per_batch_size, --dflash-schedule).
DFLASH_SCHEDULE_CONFIG = "dflash-schedule"
AUTO_CONFIG = "ddtree-auto"
# A DDTree config with this suffix runs with adaptive_budget true, its budget
# the per-request cap: e.g. ddtree-auto-adaptive next to ddtree-auto.
ADAPTIVE_SUFFIX = "-adaptive"


def base_config(config: str) -> str:
    """``config`` without the adaptive suffix."""
    return config.removesuffix(ADAPTIVE_SUFFIX)


def is_adaptive(config: str) -> bool:
    return config.startswith("ddtree-") and config.endswith(ADAPTIVE_SUFFIX)


def config_order(config: str) -> tuple[int, int, int]:
    """none, dflash, ddtree by budget, then ddtree with a schedule, then auto;
    each adaptive config after its fixed one."""
    adaptive = int(is_adaptive(config))
    config = base_config(config)
    if config == "none":
        return (0, 0, 0)
    if config == "dflash":
        return (1, 0, 0)
    if config == DFLASH_SCHEDULE_CONFIG:
        return (1, 1, 0)
    if config == SCHEDULE_CONFIG:
        return (3, 0, adaptive)
    if config == AUTO_CONFIG:
        return (3, 1, adaptive)
    return (2, budget_of(config) or 0, adaptive)


def schedule_budget(schedule: list[list[int]], batch: int) -> int:
    """The budget the scheduler uses at ``batch`` running requests (vLLM carries
    a range's budget over gaps and past the last range)."""
    budget = schedule[0][2]
    for first, _, b in schedule:
        if first <= batch:
            budget = b
    return budget


def budget_of(config: str) -> int | None:
    if config.startswith("ddtree-") and config[7:].isdigit():
        return int(config[7:])
    return None


def append_row(out_dir: Path, row: Mapping) -> None:
    """One JSON line, flushed to disk at once (a later kill keeps it)."""
    path = Path(out_dir) / RESULTS_FILE
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()


def pending(
    config: str,
    batches: Sequence[int],
    temperatures: Sequence[float],
    done: set[tuple[str, int, float]],
) -> list[tuple[int, float]]:
    """(batch, temperature) pairs of ``config`` not measured yet."""
    return [
        (b, float(t))
        for b in batches
        for t in temperatures
        if (config, int(b), float(t)) not in done
    ]


def check_setup(current: Mapping, existing: Mapping, where: str) -> None:
    """Results measured under another setup must not be mixed in: raise
    ``ValueError`` naming the settings that differ. ``info`` is not compared."""
    keys = (set(current) | set(existing)) - {"info"}
    differ = sorted(k for k in keys if current.get(k) != existing.get(k))
    if differ:
        details = ", ".join(
            f"{k}: {existing.get(k)!r} there, {current.get(k)!r} now" for k in differ
        )
        raise ValueError(
            f"{where} holds results of a different setup ({details}); use a new "
            "--out directory or the same settings"
        )


# ---------------------------------------------------------------------------
# Ratios and targets
# ---------------------------------------------------------------------------


def _ratio(a, b) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def with_ratios(rows: Sequence[Mapping]) -> list[dict]:
    """Each row plus its ratios to DFlash's and no speculation's rows of the same
    batch and temperature: ``tok_s_vs_dflash``, ``tok_s_vs_none``,
    ``tau_vs_dflash``, ``step_vs_dflash``, ``step_vs_none`` (decode step times),
    and ``same_run`` (False when a baseline came from another GPU command)."""
    by_key = {row_key(r): r for r in rows}
    out = []
    for r in rows:
        _, batch, temperature = row_key(r)
        dflash = by_key.get(("dflash", batch, temperature))
        none = by_key.get(("none", batch, temperature))
        row = dict(r)
        row["tok_s_vs_dflash"] = _ratio(r.get("tok_s"), dflash and dflash.get("tok_s"))
        row["tok_s_vs_none"] = _ratio(r.get("tok_s"), none and none.get("tok_s"))
        row["tau_vs_dflash"] = _ratio(
            r.get("acceptance_length"), dflash and dflash.get("acceptance_length")
        )
        row["step_vs_dflash"] = _ratio(
            r.get("decode_ms_per_step"), dflash and dflash.get("decode_ms_per_step")
        )
        row["step_vs_none"] = _ratio(
            r.get("decode_ms_per_step"), none and none.get("decode_ms_per_step")
        )
        row["itl_vs_dflash"] = _ratio(
            r.get("median_itl_ms"), dflash and dflash.get("median_itl_ms")
        )
        # Throughput over acceptance, both vs DFlash: the batch-1 target's score.
        row["score_vs_dflash"] = _ratio(row["tok_s_vs_dflash"], row["tau_vs_dflash"])
        baselines = [b for b in (dflash, none) if b is not None]
        row["same_run"] = all(b.get("run_id") == r.get("run_id") for b in baselines)
        out.append(row)
    return out


def target_checks(rows: Sequence[Mapping], mode: str) -> list[str]:
    """The targets, one line each, from rows that carry ratios.

    e2e/serve: batch 1, T=0: DDTree throughput / DFlash throughput >= 0.95 x
    (acceptance-length ratio), ``auto`` included; ddtree-auto's throughput >=
    1.2 x DFlash's at batch 1, T=0 and >= DFlash's at every other batch and
    temperature. cost: batch 1: decode step time vs DFlash's at the budgets of
    ``STEP_TARGETS``."""
    lines = []
    for r in rows:
        config, batch, temperature = row_key(r)
        b1 = batch == 1 and temperature == 0.0
        config_base = base_config(config)
        if config_base == AUTO_CONFIG and mode != "cost":
            tput = r.get("tok_s_vs_dflash")
            if tput is not None:
                want = AUTO_B1_TARGET if b1 else AUTO_TARGET
                verdict = "met" if tput >= want else "NOT met"
                lines.append(
                    f"{config}, batch {batch}, T={temperature:g}: throughput "
                    f"{tput:.3f} x DFlash's (target >= {want:g}): {verdict}"
                    f"{_range_note(r, 'tok_s_vs_dflash', want, True)}{_run_note(r)}"
                )
        budget = budget_of(config_base)
        if (budget is None and config_base != AUTO_CONFIG) or not b1:
            continue
        if mode == "cost":
            limit = STEP_TARGETS.get(budget)
            ratio = r.get("step_vs_dflash")
            if limit is None or ratio is None:
                continue
            verdict = "met" if ratio <= limit else "NOT met"
            lines.append(
                f"{config}, batch 1: step time {ratio:.3f} x DFlash's "
                f"(target <= {limit:.2f}): {verdict}"
                f"{_range_note(r, 'step_vs_dflash', limit, False)}{_run_note(r)}"
            )
        else:
            tput, tau = r.get("tok_s_vs_dflash"), r.get("tau_vs_dflash")
            # Over rounds: the median of each round's own score, not a ratio of
            # two medians.
            score = r.get("score_vs_dflash")
            if tput is None or not tau or score is None:
                continue
            verdict = "met" if score >= E2E_TARGET else "NOT met"
            lines.append(
                f"{config}, batch 1, T=0: throughput {tput:.3f} x DFlash's at "
                f"acceptance {tau:.3f} x: {score:.3f} of the acceptance ratio "
                f"(target >= {E2E_TARGET}): {verdict}"
                f"{_range_note(r, 'score_vs_dflash', E2E_TARGET, True)}{_run_note(r)}"
            )
    return lines


def _run_note(row: Mapping) -> str:
    return "" if row.get("same_run", True) else " (baseline from another GPU command)"


def _range_note(row: Mapping, field: str, limit: float, at_least: bool) -> str:
    """For a median over rounds: how many rounds, the range, and whether some
    round missed the target the median meets (or met one it misses)."""
    if row.get(field + "_n") is None:
        return ""
    lo, hi = row[field + "_min"], row[field + "_max"]
    worst, best = (lo, hi) if at_least else (hi, lo)
    passes = (lambda v: v >= limit) if at_least else (lambda v: v <= limit)
    text = f" (median of {row[field + '_n']} rounds, {lo:.3f} - {hi:.3f}"
    if passes(row[field]) and not passes(worst):
        text += "; not met in every round"
    elif not passes(row[field]) and passes(best):
        text += "; met in some rounds"
    return text + ")"


# ---------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------


def fmt(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(header: Sequence[str], body: Iterable[Sequence]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, cells)) + " |" for cells in body]
    return "\n".join(lines)


def main_table(rows: Sequence[Mapping]) -> str:
    header = [
        "batch",
        "T",
        "config",
        "tok/s",
        "ms/step (decode)",
        "accept len",
        "tok/s / DFlash",
        "tok/s / no-spec",
        "accept / DFlash",
        "step / DFlash",
    ]
    body = [
        [
            r["batch"],
            fmt(float(r["temperature"]), 1),
            r["config"] + ("" if r.get("same_run", True) else " *"),
            fmt(r.get("tok_s"), 1),
            fmt(r.get("decode_ms_per_step")),
            fmt(r.get("acceptance_length")),
            fmt(r.get("tok_s_vs_dflash"), 3),
            fmt(r.get("tok_s_vs_none"), 3),
            fmt(r.get("tau_vs_dflash"), 3),
            fmt(r.get("step_vs_dflash"), 3),
        ]
        for r in rows
    ]
    return markdown_table(header, body)


def depth_table(rows: Sequence[Mapping]) -> str:
    """Per-depth acceptance: fraction of drafts whose path reached depth d."""
    spec_rows = [r for r in rows if r.get("per_depth")]
    header = ["batch", "T", "config"] + [f"d{d}" for d in range(1, MAX_DEPTH + 1)]
    body = [
        [r["batch"], fmt(float(r["temperature"]), 1), r["config"]]
        + [fmt(p) for p in r["per_depth"]]
        + ["-"] * (MAX_DEPTH - len(r["per_depth"]))
        for r in spec_rows
    ]
    return markdown_table(header, body)


def latency_table(rows: Sequence[Mapping]) -> str | None:
    """Serve rows' latencies from ``vllm bench serve`` (None without any)."""
    served = [r for r in rows if r.get("median_itl_ms") is not None]
    if not served:
        return None
    header = [
        "batch",
        "T",
        "config",
        "median ITL ms",
        "p99 ITL ms",
        "mean TPOT ms",
        "median TTFT ms",
        "median ITL / DFlash",
    ]
    body = [
        [
            r["batch"],
            fmt(float(r["temperature"]), 1),
            r["config"] + ("" if r.get("same_run", True) else " *"),
            fmt(r.get("median_itl_ms")),
            fmt(r.get("p99_itl_ms")),
            fmt(r.get("mean_tpot_ms")),
            fmt(r.get("median_ttft_ms")),
            fmt(r.get("itl_vs_dflash"), 3),
        ]
        for r in served
    ]
    return markdown_table(header, body)


def slices_table(rows: Sequence[Mapping]) -> str | None:
    """Interleaved serve rows (``bench_ddtree.py serve --interleave``): each
    slice's throughput and its ratio to DFlash's slice of the same index, run
    next to it in time (None without such rows)."""
    sliced = [r for r in rows if r.get("slices_tok_s")]
    if not sliced:
        return None
    by_key = {row_key(r): r for r in sliced}
    header = ["batch", "T", "config", "slices", "tok/s per slice", "x DFlash per slice"]
    body = []
    for r in sliced:
        _, batch, temperature = row_key(r)
        base = by_key.get(("dflash", batch, temperature))
        ratios = "-"
        if base is not None and r is not base:
            pairs = zip(r["slices_tok_s"], base.get("slices_tok_s") or [])
            ratios = ", ".join(fmt(_ratio(a, b), 3) for a, b in pairs)
        body.append(
            [
                batch,
                fmt(float(temperature), 1),
                r["config"],
                r.get("slices", len(r["slices_tok_s"])),
                ", ".join(fmt(v, 1) for v in r["slices_tok_s"]),
                ratios,
            ]
        )
    return markdown_table(header, body)


def host_table(rows: Sequence[Mapping]) -> str | None:
    """The host during each timed pass (rows' ``host_usage``, offline and
    serve; None without any): with a host-bound step, a process whose step
    thread was busy all the time on a slower core or under steal shows it
    here."""
    measured = [r for r in rows if r.get("host_usage")]
    if not measured:
        return None
    header = [
        "batch",
        "T",
        "config",
        "ms/step (serve: median ITL)",
        "calibration ms",
        "busiest thread, busy %",
        "next thread busy %",
        "steal %",
        "busy CPUs",
    ]
    body = [
        [
            r["batch"],
            fmt(float(r["temperature"]), 1),
            r["config"],
            fmt(r.get("decode_ms_per_step", r.get("median_itl_ms"))),
            fmt(u.get("calibration_ms")),
            f"{u.get('step_thread') or '-'}, {fmt(u.get('step_thread_busy_pct'), 1)}",
            fmt(u.get("next_thread_busy_pct"), 1),
            fmt(u.get("steal_pct")),
            fmt(u.get("busy_cpus")),
        ]
        for r in measured
        for u in [r["host_usage"]]
    ]
    return markdown_table(header, body)


def kv_table(rows: Sequence[Mapping]) -> str | None:
    """KV blocks held per running request during each timed pass (serve rows'
    ``kv_usage``, sampled from the server's /metrics; None without any)."""
    measured = [r for r in rows if r.get("kv_usage")]
    if not measured:
        return None
    header = [
        "batch",
        "T",
        "config",
        "KV blocks per running request",
        "KV usage %",
        "running requests",
        "samples",
    ]
    body = [
        [
            r["batch"],
            fmt(float(r["temperature"]), 1),
            r["config"],
            fmt(k["blocks_per_running_request"], 1),
            fmt(100 * k["usage_mean"], 1),
            fmt(k["running_mean"], 1),
            k["samples"],
        ]
        for r in measured
        for k in [r["kv_usage"]]
    ]
    return markdown_table(header, body)


def agreement_table(rows: Sequence[Mapping]) -> str | None:
    """T=0 serve rows' generated texts against the reference config's
    (``greedy_agreement``; None without any)."""
    measured = [r for r in rows if r.get("greedy_agreement")]
    if not measured:
        return None
    header = [
        "batch",
        "config",
        "against",
        "identical / compared",
        "characters compared",
        "first differences at character",
    ]
    body = [
        [
            r["batch"],
            r["config"],
            g["against"],
            f"{g['identical']} / {g['compared']}",
            g["chars_compared"],
            ", ".join(str(c) for c in g["first_difference_chars"]) or "-",
        ]
        for r in measured
        for g in [r["greedy_agreement"]]
    ]
    return markdown_table(header, body)


RATIO_NOTE = (
    "Ratios compare rows of the same batch and temperature; `*` marks a row "
    "whose DFlash or no-spec baseline was measured by another GPU command."
)
COST_NOTE = (
    "Dummy weights: acceptance is chance level, so `ms/step (decode)` is the "
    "cost of one verify + draft + tree-ops step."
)


def markdown_report(rows: Sequence[Mapping], mode: str, setup: Mapping | None) -> str:
    rows = with_ratios(merge_rows(rows))
    parts = [f"# bench_ddtree: {mode}", ""]
    if setup:
        parts += ["Setup: `" + json.dumps(setup, sort_keys=True) + "`", ""]
    gpus = sorted({str(r.get("gpu")) for r in rows if r.get("gpu")})
    runs = sorted({str(r.get("run_id")) for r in rows if r.get("run_id")})
    where = f"GPU: {', '.join(gpus) or '-'}; GPU commands (run ids): "
    parts += [where + (", ".join(runs) or "-"), "", RATIO_NOTE, ""]
    if mode == "cost":
        parts += [COST_NOTE, ""]
    parts += [main_table(rows), ""]
    checks = target_checks(rows, mode)
    if checks:
        parts += ["Targets:", ""] + [f"- {c}" for c in checks] + [""]
    latency = latency_table(rows)
    if latency:
        parts += [
            "Latency behind the server (`vllm bench serve`; one streamed chunk "
            "per engine step, so the median inter-token latency is the typical "
            "step):",
            "",
            latency,
            "",
        ]
    sliced = slices_table(rows)
    if sliced:
        parts += [
            "Interleaved servers (`--interleave`): each cell's timed requests ran "
            "as slices alternating between the servers (ABBA); a row's throughput "
            "is its slices' tokens over their summed durations, its latency "
            "medians and p99 the median over slices:",
            "",
            sliced,
            "",
        ]
    host = host_table(rows)
    if host:
        parts += [
            "Host during the timed pass (calibration: a fixed Python loop timed "
            "just before it, lower is a faster core; a thread's busy %: its CPU "
            "time over the pass's wall time, in the engine's process tree):",
            "",
            host,
            "",
        ]
    kv = kv_table(rows)
    if kv:
        parts += [
            "KV cache during the timed pass (vLLM's `kv_cache_usage_perc` x its "
            "blocks / `num_requests_running`, sampled every 0.25 s; a request's "
            "blocks include what its draft slots reserve, shared prefix blocks "
            "count once):",
            "",
            kv,
            "",
        ]
    agreement = agreement_table(rows)
    if agreement:
        parts += [
            "Greedy outputs (T=0): each config's generated texts against the "
            "reference config's, the same prompts in the same order (fp16 logit "
            "ties may break differently with the batch's shape):",
            "",
            agreement,
            "",
        ]
    if any(r.get("per_depth") for r in rows):
        parts += [
            "Per-depth acceptance (drafts whose accepted path reached depth d):",
            "",
            depth_table(rows),
            "",
        ]
    return "\n".join(parts)


# ---------------------------------------------------------------------------
# Rounds (bench_ddtree.py --rounds): the same sweep in fresh processes
# ---------------------------------------------------------------------------

ROUND_FIELDS = (
    "tok_s",
    "decode_ms_per_step",
    "acceptance_length",
    "tok_s_vs_dflash",
    "step_vs_dflash",
    "tau_vs_dflash",
    "score_vs_dflash",
)


def rounds_summary(rounds: Sequence[Sequence[Mapping]]) -> list[dict]:
    """One row per (config, batch, temperature) over the rounds' rows: for each
    of ``ROUND_FIELDS`` the median and, as ``<field>_min`` / ``<field>_max``,
    the range, and as ``<field>_n`` how many rounds it covers; ratios are taken
    to the same round's DFlash row first (a round is one pass over every config,
    each in a fresh engine process), then the median over rounds. ``rounds``:
    how many rounds measured the key."""
    per_key: dict[tuple, list[dict]] = {}
    for rows in rounds:
        for row in with_ratios(merge_rows(rows)):
            per_key.setdefault(row_key(row), []).append(row)
    out = []
    for key in sorted(per_key, key=_sort_key):
        rows = per_key[key]
        config, batch, temperature = key
        summary = {
            "config": config,
            "batch": batch,
            "temperature": temperature,
            "rounds": len(rows),
            # False when some round's baseline came from another GPU command
            # (a resumed round).
            "same_run": all(r.get("same_run", True) for r in rows),
        }
        for field in ROUND_FIELDS:
            values = [r[field] for r in rows if r.get(field) is not None]
            if values:
                summary[field] = statistics.median(values)
                summary[field + "_min"] = min(values)
                summary[field + "_max"] = max(values)
                summary[field + "_n"] = len(values)  # rounds with a DFlash pair
        out.append(summary)
    return out


def _spread(row: Mapping, field: str, digits: int = 2) -> str:
    if row.get(field) is None:
        return "-"
    text = fmt(row[field], digits)
    lo, hi = row[field + "_min"], row[field + "_max"]
    if lo != hi:
        text += f" ({fmt(lo, digits)} - {fmt(hi, digits)})"
    return text


ROUNDS_NOTE = (
    "Median over rounds, (min - max) in parentheses. A round runs every config "
    "once, each in a fresh engine process, in the order given (reversed every "
    "other round); a ratio is taken to DFlash's row of the same round, then the "
    "median over rounds. Rows of each round: `round<k>/results.md`."
)


def rounds_markdown(summary: Sequence[Mapping], mode: str, num_rounds: int) -> str:
    header = [
        "config",
        "batch",
        "T",
        "rounds",
        "tok/s",
        "x DFlash tok/s",
        "ms / decode step",
        "x DFlash step",
        "accept len",
        "x DFlash accept",
    ]
    body = [
        [
            r["config"],
            r["batch"],
            fmt(r["temperature"], 1),
            r["rounds"],
            _spread(r, "tok_s", 1),
            _spread(r, "tok_s_vs_dflash", 3),
            _spread(r, "decode_ms_per_step"),
            _spread(r, "step_vs_dflash", 3),
            _spread(r, "acceptance_length"),
            _spread(r, "tau_vs_dflash", 3),
        ]
        for r in summary
    ]
    parts = [
        f"# bench_ddtree: {mode}, {num_rounds} rounds",
        "",
        ROUNDS_NOTE,
        "",
        markdown_table(header, body),
        "",
    ]
    checks = target_checks(summary, mode)
    if checks:
        parts += ["Targets (on the medians):", ""] + [f"- {c}" for c in checks] + [""]
    return "\n".join(parts)


def write_rounds_report(out: Path, round_dirs: Sequence[Path], mode: str) -> str:
    """``rounds.json`` and ``rounds.md`` in ``out`` from the rounds' results."""
    rounds = [load_rows([d]) for d in round_dirs]
    summary = rounds_summary([rows for rows in rounds if rows])
    Path(out, ROUNDS_FILE).write_text(json.dumps(summary, indent=1))
    text = rounds_markdown(summary, mode, sum(1 for rows in rounds if rows))
    Path(out, ROUNDS_REPORT).write_text(text)
    return text
