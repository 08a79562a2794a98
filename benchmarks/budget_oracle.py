# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The oracle row: DDTree's default next to the best constant tree budget of
each cell, in one in-process engine.

The adaptive budget chooses each step's per-request budget ``b`` from its
ladder by measured cost and estimated acceptance. Its oracle, per cell
(concurrency and temperature), is the best it could have done with one ``b``
held for every step: the same engine (DDTree's default, ``"tree_budget":
"auto"``), with the controller's choice replaced by ``b`` (``b = 0``: plain
steps, the drafter never runs; ``b > 0``: ``b`` nodes per request on average
at every step, the drafter at every step; :class:`ForcedBudget`). What stays
the adaptive engine's: trees built as wide as its caps, the scheduler's
slots above ``b`` (3 at ``b = 0`` or 1, 15 at 7) and the batch-wide split of
the step's nodes. So this is the best constant budget of the controller, not
an engine with a fixed ``tree_budget`` (whose trees, slots and steps are
``b`` wide, with no split).

Each cell runs the default and every distinct constant budget of the ladder
under continuous arrivals (``trace_budget.ArrivalLoop``: C requests in flight,
each new to the engine, 256 output tokens), in rounds whose order alternates
(the second reversed). Before each measured run an unmeasured stretch of the
same setting lets what the previous run left drain: C requests of 32 tokens
before a forced budget (the scheduler's slots, which follow the budget
reported two steps back, and whether trees exist for the first step), two
waves of full-length requests before the default (its controller re-reads its
estimate and, after a cell where speculation did not pay, waits up to 256
plain steps for its next probe: :func:`settle`). Between runs of one engine,
what the default's controller learned (step periods, probes) stays as its own
runs left it (a forced step is neither timed nor counted); the acceptance
estimate and the walk's calibration are renewed by every drafted step, forced
or not, and the calibration only in the bins of the nodes verified, so a run
of small trees leaves the others' bins decayed toward the prior.

The oracle is the best budget by its mean over the rounds; since the same
rounds choose and score it, the default over it is biased low, so with two
rounds or more the table also gives the held-out ratio (the budget chosen on
the other rounds, scored on each round).

Real size (the embedded pair, ``embed_pair.py``'s output ``D``)::

    python benchmarks/budget_oracle.py OUT --target D/target --drafter D/drafter \\
        --kv-gib 6 --phases 64:0:256,64:1:256 --rounds 2

Outputs in ``OUT``: ``oracle_rows.jsonl`` (one row per run, written as it
ends) and ``oracle.md`` (rewritten after every run: per cell, every run's
tokens per second by round, the best constant budget, and the default over
it). The summary of a rows file again: ``python benchmarks/budget_oracle.py
--summarize OUT/oracle_rows.jsonl``.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections import defaultdict

# The engine in this process: the forced budget reaches its controller only
# there (a caller's setting is overridden).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_ddtree_config import speculative_config  # noqa: E402
from benchmarks.trace_budget import (  # noqa: E402
    P,
    ArrivalLoop,
    parse_phases,
    phase_names,
)

# The record's cells (concurrency 1 / 8 / 32 / 64 at T=0 and T=1), with
# enough requests for several waves at the larger concurrencies.
PHASES = "1:0:4,8:0:32,32:0:128,64:0:256,1:1:4,8:1:32,32:1:128,64:1:256"
DEFAULT = "default"


class ForcedBudget:
    """While ``budget`` is set, every ``TreeBudgetController`` of the process
    verifies ``min(budget, cap)`` nodes per request on average on every step
    that has trees (``cap``: the step's fewest slots; the batch-wide split
    moves nodes between requests), has the drafter run after every step when
    that is above 0 (``min(budget, slots)``, ``slots`` the engine's cap for
    the batch size: never where it is 0), and reports it as its choice, which
    the scheduler's slots follow. Its cost model and probes stay as its own
    steps left them: a forced step is neither timed nor counted in its log.
    ``None``: the controller decides. ``forced_steps`` counts the steps
    forced, so that a run whose steps never reached the patch (an engine in
    another process) is caught."""

    def __init__(self) -> None:
        self.budget: int | None = None
        self.forced_steps = 0

    def install(self):
        from vllm.v1.spec_decode import ddtree_cost as dc

        C = dc.TreeBudgetController
        orig_choose, orig_should_draft = C.choose, C.should_draft
        forced = self

        def choose(self, num_reqs, max_budget, has_trees, timed):
            if forced.budget is None:
                return orig_choose(self, num_reqs, max_budget, has_trees, timed)
            forced.forced_steps += 1
            # Untimed: its period teaches the cost model nothing.
            self._step = None
            return min(forced.budget, max_budget) if has_trees else 0

        def should_draft(self, num_reqs, max_budget):
            if forced.budget is None:
                return orig_should_draft(self, num_reqs, max_budget)
            self.last_best = min(forced.budget, max_budget)
            return self.last_best > 0

        C.choose, C.should_draft = choose, should_draft

        def uninstall() -> None:
            C.choose, C.should_draft = orig_choose, orig_should_draft

        return uninstall


def cell_runs(budgets, cap: int) -> list:
    """The default, then each distinct constant budget a cell can verify with
    ``cap`` slots per request (larger ones verify the cap)."""
    return [DEFAULT, *sorted({min(b, cap) for b in budgets})]


def round_order(runs: list, round_index: int) -> list:
    """Every other round reversed."""
    return list(runs) if round_index % 2 == 0 else list(reversed(runs))


def parse_budgets(text: str) -> list[int]:
    try:
        budgets = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(
            f"--budgets: {text!r} is not a comma list of integers"
        ) from None
    if not budgets or budgets[0] < 0:
        raise ValueError(f"--budgets: {text!r} needs budgets >= 0")
    return budgets


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--target", default=f"{P}/target")
    p.add_argument("--drafter", default=f"{P}/drafter")
    p.add_argument("--prompts", default=f"{P}/eval_prompts.json")
    p.add_argument(
        "--phases",
        type=parse_phases,
        default=parse_phases(PHASES),
        help=f"C:T:N,... cells (default {PHASES})",
    )
    p.add_argument(
        "--budgets",
        type=parse_budgets,
        default=None,
        help="constant budgets to try (default: the engine's ladder)",
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kv-gib", type=float, default=6.0)
    p.add_argument(
        "--limit-seconds",
        type=float,
        default=None,
        help="start no run after this many seconds (rows so far are kept)",
    )
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def _best(means: dict):
    """The run with the most tokens per second; ties to the smaller budget."""
    return max(sorted(means), key=lambda run: means[run])


def summarize(rows: list[dict]) -> list[str]:
    """Per cell: every run's tokens per second by round and their mean, the
    best constant budget by mean (the oracle), and the default over it, by
    round and of the means; with two rounds or more the held-out ratio too:
    for each round, the budget best over the other rounds, scored there."""
    cells = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        cells[r["phase"]][r["run"]][r["round"]] = r["tok_s"]
    lines = [
        "| cell | default tok/s | oracle b | oracle tok/s | default / oracle "
        "(rounds) | held out | every run: mean tok/s (rounds) |",
        "|---|---|---|---|---|---|---|",
    ]
    for phase, runs in cells.items():
        means = {run: statistics.fmean(v.values()) for run, v in runs.items()}
        constant = {run: m for run, m in means.items() if run != DEFAULT}
        if DEFAULT not in means or not constant or max(constant.values()) <= 0:
            lines.append(f"| {phase} | incomplete: {sorted(map(str, means))} |")
            continue
        best = _best(constant)
        paired = [
            runs[DEFAULT][k] / runs[best][k]
            for k in sorted(runs[DEFAULT])
            if runs[best].get(k, 0) > 0
        ]
        held_out = []
        for k in sorted(runs[DEFAULT]):
            others = {
                run: statistics.fmean(v for j, v in runs[run].items() if j != k)
                for run in constant
                if any(j != k for j in runs[run])
            }
            if others:
                choice = _best(others)
                if runs[choice].get(k, 0) > 0:
                    held_out.append(runs[DEFAULT][k] / runs[choice][k])
        every = "; ".join(
            f"{run}: {means[run]:.0f} ("
            + ", ".join(f"{v:.0f}" for _, v in sorted(runs[run].items()))
            + ")"
            for run in [DEFAULT, *sorted(constant)]
        )
        lines.append(
            f"| {phase} | {means[DEFAULT]:.0f} | {best} | {constant[best]:.0f} | "
            f"{means[DEFAULT] / constant[best]:.3f} ("
            + ", ".join(f"{x:.3f}" for x in paired)
            + ") | "
            + (
                f"{statistics.fmean(held_out):.3f} ("
                + ", ".join(f"{x:.3f}" for x in held_out)
                + ")"
                if held_out
                else "-"
            )
            + f" | {every} |"
        )
    return lines


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# Output tokens per request of the unmeasured stretch before a forced run.
SETTLE_TOKENS = 32


def default_settle_waves(max_tokens: int) -> int:
    """Waves of full-length requests before a default run: at least twice the
    controller's longest wait for a probe in plain steps. After a cell where
    speculation did not pay it probes again only every _PROBE_BACKOFF x
    _PROBE_INTERVAL plain steps; a shorter stretch would leave that wait, and
    the estimate it refreshes, to the measured run, which would then time how
    the default meets a change of traffic, not the cell."""
    from vllm.v1.spec_decode.ddtree_cost import _PROBE_BACKOFF, _PROBE_INTERVAL

    return max(1, math.ceil(2 * _PROBE_BACKOFF * _PROBE_INTERVAL / max_tokens))


def settle(loop, run, c: int, temp: float) -> None:
    """The unmeasured stretch before ``run``: C requests of SETTLE_TOKENS
    before a forced budget (the previous run's slots and trees drain), waves
    of full-length requests before the default (:func:`default_settle_waves`:
    its controller meets the cell first)."""
    if run == DEFAULT:
        loop.run(c, temp, default_settle_waves(loop.max_tokens) * c)
    else:
        loop.run(c, temp, c, max_tokens=SETTLE_TOKENS)


def main(argv=None) -> None:
    started = time.perf_counter()
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, os.getcwd())
    import vllm_ddtree

    vllm_ddtree.register()
    from vllm import LLM
    from vllm.v1.spec_decode.ddtree_config import DDTreeConfig, engine_tree_slots

    forced = ForcedBudget()
    forced.install()
    t0 = time.perf_counter()
    llm = LLM(
        model=args.target,
        speculative_config=speculative_config("ddtree-auto-adaptive", args.drafter),
        kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)),
        max_num_seqs=256,
    )
    print(f"engine ready in {time.perf_counter() - t0:.0f} s", flush=True)
    engine = llm.llm_engine
    cfg = DDTreeConfig.from_vllm_config(engine.vllm_config)
    if cfg is None or not cfg.adaptive:
        sys.exit(f"the engine's DDTree config is not adaptive: {cfg}")
    slots = engine_tree_slots(cfg, engine.vllm_config)
    budgets = args.budgets if args.budgets is not None else list(cfg.ladder)
    off_ladder = sorted(set(budgets) - set(cfg.ladder))
    if off_ladder:
        # A step of such a budget has no CUDA graph of its own.
        sys.exit(f"--budgets {off_ladder} are not on the ladder {list(cfg.ladder)}")
    with open(args.prompts) as f:
        texts = [p["text"] for p in json.load(f)["prompts"]]
    loop = ArrivalLoop(engine, texts)
    loop.run(4, 0.0, 8)  # warm-up: the default's controller starts learning

    rows_path = os.path.join(args.out, "oracle_rows.jsonl")
    rows = []
    names = phase_names(args.phases)
    plan = [
        (name, c, temp, n, k, run)
        for name, (c, temp, n) in zip(names, args.phases, strict=True)
        for k in range(args.rounds)
        for run in round_order(cell_runs(budgets, slots[min(c, len(slots) - 1)]), k)
    ]
    print(f"{len(plan)} runs over {len(args.phases)} cells", flush=True)
    longest = 0.0
    with open(rows_path, "w") as out:
        for i, (name, c, temp, n, k, run) in enumerate(plan):
            t = time.perf_counter()
            if (
                args.limit_seconds is not None
                and t - started + longest > args.limit_seconds
            ):
                print(f"stopped at the time limit: {len(plan) - i} runs left")
                break
            forced.budget = None if run == DEFAULT else run
            before = forced.forced_steps
            settle(loop, run, c, temp)
            toks, secs, step_ms, nsteps = loop.run(c, temp, n)
            forced.budget = None
            if run != DEFAULT and forced.forced_steps == before:
                sys.exit(f"run b={run}: no step reached the forced budget")
            longest = max(longest, time.perf_counter() - t)
            row = {
                "phase": name,
                "run": run,
                "round": k,
                "tok_s": round(toks / secs, 1),
                "secs": round(secs, 2),
                "step_ms": round(step_ms, 3),
                "full_steps": nsteps,
            }
            rows.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(f"[{i + 1}/{len(plan)}] {json.dumps(row)}", flush=True)
            with open(os.path.join(args.out, "oracle.md"), "w") as f:
                f.write("\n".join(summarize(rows)) + "\n")
    print("\n".join(summarize(rows)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--summarize"] and len(sys.argv) == 3:
        print("\n".join(summarize(read_rows(sys.argv[2]))))
    else:
        main()
