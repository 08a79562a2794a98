# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Projected Qwen3-8B speedups of DDTree: measured 8B-shape step times combined
with acceptance lengths measured elsewhere. Every projected number is labelled
"projected": nothing here ran a trained 8B pair.

Inputs:

* ``--cost DIR``: ``bench_ddtree.py cost`` results (Qwen3-8B-shaped target,
  DFlash-8B-shaped drafter, dummy weights): decode step time per config and batch.
* ``--e2e DIR``: ``bench_ddtree.py e2e`` results of the trained pair: acceptance
  length per config and temperature, pooled over batches (1 + all accepted / all
  drafts; lossless decoding makes T=0 acceptance independent of the batch).
* the paper's Qwen3-8B numbers (``PAPER``), used unless ``--no-paper``.

A request emits ``tau`` tokens per step (tau = 1 without speculation), so at batch
b a config's projected throughput is ``b * tau / step_time``, and its projected
speedup over another config is the ratio of ``tau / step_time``. The auto-budget
table picks, per batch, the DDTree budget with the highest projected throughput
and compares it with DFlash: the evidence a ``tree_budget="auto"`` would stand on.

    python benchmarks/project_8b.py --cost OUT_COST [--e2e OUT_E2E] [--out FILE.md]
"""

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_ddtree_report import (  # noqa: E402
    RESULTS_FILE,
    budget_of,
    config_order,
    fmt,
    load_rows,
    markdown_table,
    merge_rows,
    row_key,
    schedule_budget,
)

# Ringel & Romano, "Accelerating Speculative Decoding with Block Diffusion Draft
# Trees" (2026), Qwen3-8B target, MATH-500, temperature 0, per-budget acceptance
# lengths as the project cites them. The paper's budgets are powers of two; budgets
# one below (15, 31: "auto") have no figure of their own here.
PAPER = {
    "label": "paper (Qwen3-8B, MATH-500, T=0, per budget)",
    "temperature": 0.0,
    "tau": {
        "none": 1.0,
        "dflash": 7.79,
        "ddtree-16": 8.61,
        "ddtree-32": 9.27,
        "ddtree-64": 9.75,
        "ddtree-128": 10.20,
        "ddtree-256": 10.43,
        "ddtree-512": 10.73,
        "ddtree-1024": 10.98,
    },
}


def step_times(rows: Sequence[Mapping], temperature: float) -> dict:
    """{(config, batch): decode ms per step} at ``temperature``."""
    out = {}
    for r in rows:
        config, batch, t = row_key(r)
        ms = r.get("decode_ms_per_step") or r.get("ms_per_step")
        if t == temperature and ms:
            out[(config, batch)] = float(ms)
    return out


def command_steps(
    dir_rows: Sequence[Sequence[Mapping]], temperature: float
) -> tuple[dict, dict]:
    """Step times of several cost commands (one row list per result directory):
    ``{(config, batch): ms}`` with a later command's number winning, and per
    ``(config, batch)`` the ``{"dflash": ms, "none": ms}`` steps measured by the
    same command (None where it measured none), so every ratio stays within one
    GPU command (DFlash's own step moves by a few percent between commands)."""
    steps, baselines = {}, {}
    for rows in dir_rows:
        own = step_times(rows, temperature)
        for (config, batch), ms in own.items():
            steps[(config, batch)] = ms
            baselines[(config, batch)] = {
                "dflash": own.get(("dflash", batch)),
                "none": own.get(("none", batch)),
            }
    return steps, baselines


def _baseline(
    steps: Mapping, baselines: Mapping | None, config: str, batch: int, which: str
) -> float | None:
    if baselines is None:
        return steps.get((which, batch))
    return baselines.get((config, batch), {}).get(which)


def schedules_of(rows: Sequence[Mapping]) -> dict[str, list]:
    """{config: tree_budget_per_batch_size} of ddtree-schedule / ddtree-auto rows."""
    return {
        r["config"]: r["tree_budget_per_batch_size"]
        for r in rows
        if r.get("tree_budget_per_batch_size")
    }


def pooled_tau(rows: Sequence[Mapping], temperature: float) -> dict[str, float]:
    """{config: 1 + accepted / drafts} over every batch at ``temperature``;
    no speculation is 1."""
    drafts: dict[str, int] = {}
    accepted: dict[str, int] = {}
    taus = {}
    for r in rows:
        config, _, t = row_key(r)
        if t != temperature:
            continue
        if config == "none":
            taus["none"] = 1.0
        elif r.get("num_drafts"):
            drafts[config] = drafts.get(config, 0) + int(r["num_drafts"])
            accepted[config] = accepted.get(config, 0) + int(r["num_accepted_tokens"])
    taus.update({c: 1 + accepted[c] / drafts[c] for c in drafts})
    return taus


def project(
    steps: Mapping,
    taus: Mapping[str, float],
    schedules: Mapping[str, list] | None = None,
    baselines: Mapping | None = None,
) -> list[dict]:
    """Projected throughput and speedups for every (config, batch) with both a
    step time and an acceptance length. A config with a budget schedule
    (``schedules``) takes at each batch the acceptance length of the fixed budget
    its schedule picks there (``ddtree-<b>``), its own varying with the batch.
    Ratios are to the DFlash / no-spec steps of ``baselines`` (``command_steps``:
    the same command's) when given, else to those of ``steps``."""
    rows = []
    for (config, batch), ms in steps.items():
        tau = taus.get(config)
        if schedules and config in schedules:
            tau = taus.get(f"ddtree-{schedule_budget(schedules[config], batch)}")
        if tau is None:
            continue
        per_s = tau / ms * 1000  # tokens per second per request
        none_ms = _baseline(steps, baselines, config, batch, "none")
        dflash_ms = _baseline(steps, baselines, config, batch, "dflash")
        rows.append(
            {
                "config": config,
                "batch": batch,
                "tau": tau,
                "step_ms": ms,
                "tok_s": batch * per_s,
                "vs_none": per_s / (1000 / none_ms) if none_ms else None,
                "vs_dflash": (
                    per_s / (taus["dflash"] / dflash_ms * 1000)
                    if dflash_ms and "dflash" in taus
                    else None
                ),
            }
        )
    return sorted(rows, key=lambda r: (r["batch"], config_order(r["config"])))


def auto_budget(projected: Sequence[Mapping]) -> list[dict]:
    """Per batch: the DDTree budget with the highest projected throughput, and its
    ratio to DFlash (>= 1 is what tree_budget="auto" must reach)."""
    best: dict[int, Mapping] = {}
    for r in projected:
        if budget_of(r["config"]) is None:
            continue
        if r["batch"] not in best or r["tok_s"] > best[r["batch"]]["tok_s"]:
            best[r["batch"]] = r
    return [
        {
            "batch": b,
            "budget": budget_of(r["config"]),
            "tok_s": r["tok_s"],
            "vs_dflash": r["vs_dflash"],
            "vs_none": r["vs_none"],
        }
        for b, r in sorted(best.items())
    ]


def budget_schedule(auto_rows: Sequence[Mapping]) -> list[list[int]]:
    """The auto table as a ``tree_budget_per_batch_size`` schedule. A batch size
    between two measured ones gets the budget of the larger (costs grow with the
    batch, so that is the cautious side); past the last one vLLM keeps its budget.
    """
    schedule, first = [], 1
    for r in sorted(auto_rows, key=lambda r: r["batch"]):
        schedule.append([first, r["batch"], r["budget"]])
        first = r["batch"] + 1
    return schedule


def step_table(steps: Mapping, baselines: Mapping | None = None) -> str:
    batches = sorted({b for _, b in steps})
    configs = sorted({c for c, _ in steps}, key=config_order)
    body = []
    for c in configs:
        cells = []
        for b in batches:
            ms, d = steps.get((c, b)), _baseline(steps, baselines, c, b, "dflash")
            cells.append(
                "-" if ms is None else f"{ms:.2f}" + (f" ({ms / d:.2f}x)" if d else "")
            )
        body.append([c] + cells)
    return markdown_table(
        ["config"] + [f"batch {b}: ms/step (x DFlash)" for b in batches], body
    )


def projection_table(projected: Sequence[Mapping]) -> str:
    body = [
        [
            r["batch"],
            r["config"],
            fmt(r["tau"]),
            fmt(r["step_ms"]),
            fmt(r["tok_s"], 0),
            fmt(r["vs_none"]),
            fmt(r["vs_dflash"], 3),
        ]
        for r in projected
    ]
    return markdown_table(
        [
            "batch",
            "config",
            "accept len",
            "ms/step (measured)",
            "projected tok/s",
            "projected x no-spec",
            "projected x DFlash",
        ],
        body,
    )


def schedule_verdicts(
    projected: Sequence[Mapping], schedules: Mapping[str, list]
) -> list[str]:
    """One line per (schedule config, batch): projected x DFlash, and whether it
    reaches DFlash (what ``tree_budget="auto"`` must do at every batch)."""
    lines = []
    for r in projected:
        if r["config"] not in schedules or r["vs_dflash"] is None:
            continue
        budget = schedule_budget(schedules[r["config"]], r["batch"])
        verdict = "yes" if r["vs_dflash"] >= 1.0 else "NO"
        lines.append(
            f"- {r['config']}, batch {r['batch']} (budget {budget}): "
            f"projected {r['vs_dflash']:.3f} x DFlash, >= DFlash: {verdict}"
        )
    return lines


def auto_table(rows: Sequence[Mapping]) -> str:
    body = [
        [
            r["batch"],
            r["budget"],
            fmt(r["tok_s"], 0),
            fmt(r["vs_dflash"], 3),
            "yes" if (r["vs_dflash"] or 0) >= 1.0 else "NO",
        ]
        for r in rows
    ]
    return markdown_table(
        [
            "batch",
            "best budget (projected)",
            "projected tok/s",
            "projected x DFlash",
            ">= DFlash",
        ],
        body,
    )


def dflash_spread(dir_rows: Sequence[Sequence[Mapping]], temperature: float) -> str:
    """DFlash's step per batch over the commands that measured it (min-max)."""
    by_batch: dict[int, list[float]] = {}
    for rows in dir_rows:
        for (config, batch), ms in step_times(rows, temperature).items():
            if config == "dflash":
                by_batch.setdefault(batch, []).append(ms)
    return "; ".join(
        f"batch {b}: {min(v):.2f}"
        + (f"-{max(v):.2f}" if len(v) > 1 else "")
        + f" ms ({len(v)} command{'s' if len(v) > 1 else ''})"
        for b, v in sorted(by_batch.items())
    )


def report(
    cost_dirs: Sequence[Sequence[Mapping]],
    sources: Sequence[tuple[str, dict]],
    temperature: float,
    command: str | None = None,
) -> str:
    """The markdown report. ``cost_dirs``: the rows of each cost command, oldest
    first; a later command's step of a (config, batch) replaces an older one's."""
    steps, baselines = command_steps(cost_dirs, temperature)
    schedules = schedules_of([r for rows in cost_dirs for r in rows])
    measured = (
        f"Measured: decode step times of the 8B shapes (dummy weights, "
        f"T={temperature}); where several commands measured a config at a batch "
        "the last one given is shown; `(x DFlash)` is the ratio to DFlash's step "
        "at the same batch **in the same command**, and so are the projected "
        "ratios below. DFlash's own step by command: "
        f"{dflash_spread(cost_dirs, temperature)}."
    )
    parts = ["# Projected Qwen3-8B speedups (projected, not measured end to end)", ""]
    if command:
        parts += [f"Command: `{command}`", ""]
    parts += [measured, "", step_table(steps, baselines), ""]
    for label, taus in sources:
        projected = project(steps, taus, schedules, baselines)
        parts += [f"## Projected with acceptance lengths from {label}", ""]
        if not projected:
            parts += ["(no config has both a step time and an acceptance length)", ""]
            continue
        auto = auto_budget(projected)
        parts += [
            projection_table(projected),
            "",
            "Projected auto budget (best DDTree budget per batch):",
            "",
            auto_table(auto),
            "",
            "As a speculative-config schedule (projected): "
            f'`"tree_budget_per_batch_size": {budget_schedule(auto)}`',
            "",
        ]
        verdicts = schedule_verdicts(projected, schedules)
        if verdicts:
            parts += [
                "Measured schedules (step times measured, acceptance of the "
                "budget each batch gets; projected):",
                "",
                *verdicts,
                "",
            ]
    return "\n".join(parts)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cost",
        type=Path,
        nargs="+",
        required=True,
        help="bench_ddtree.py cost --out directories",
    )
    p.add_argument(
        "--e2e",
        type=Path,
        nargs="*",
        default=[],
        help="bench_ddtree.py e2e --out directories (trained pair)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--no-paper",
        action="store_true",
        help="leave out the paper's acceptance lengths",
    )
    p.add_argument("--out", type=Path, default=None, help="write the markdown here")
    args = p.parse_args(argv)
    missing = [d for d in [*args.cost, *args.e2e] if not (d / RESULTS_FILE).is_file()]
    if missing:
        p.error(f"no {RESULTS_FILE} in {', '.join(map(str, missing))}")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    cost_dirs = [merge_rows(load_rows([d])) for d in args.cost]
    sources = []
    if args.e2e:
        taus = pooled_tau(merge_rows(load_rows(args.e2e)), args.temperature)
        label = f"the trained pair (e2e, T={args.temperature}, pooled over batches)"
        sources.append((label, taus))
    if not args.no_paper and args.temperature == PAPER["temperature"]:
        sources.append((PAPER["label"], PAPER["tau"]))
    command = " ".join(["python benchmarks/project_8b.py", *argv])
    text = report(cost_dirs, sources, args.temperature, command)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
