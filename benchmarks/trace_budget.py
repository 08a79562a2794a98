# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the adaptive budget's controller sees and chooses, step by step, in an
in-process engine under continuous arrivals (a client loop that keeps C requests
in flight; by default phases of concurrency 1 / 8 / 32 at T=0 and T=1, 256
output tokens), next to the same loop on other configs. A diagnostic, not a
user-facing figure. Each decision records the cost model's predictions and
the acceptance estimate it weighed, the budget, whether the drafter ran (and
what ``should_draft`` found best), and the step's period. Every Triton compile
of the process is logged too (``<config>_compiles.jsonl``: kernel, seconds, seconds
since the engine's construction began), with a table of those before the
engine was ready: where a cold start's compile time goes. Every config's
engine steps go to ``<config>_steps.jsonl`` (``step_recorder.py --phases OUT
CONFIG...`` sets them side by side by phase).

    python benchmarks/trace_budget.py CONFIG OUTDIR   # adaptive | auto | none | dflash
    # at real size (the embedded pair, embed_pair.py), concurrency 64 at T=1:
    python benchmarks/trace_budget.py adaptive OUTDIR --target D/target \
        --drafter D/drafter --phases 64:1:256 --kv-gib 6
    # the summary of a recorded trace again:
    python benchmarks/trace_budget.py --summarize OUTDIR/trace.jsonl.gz
    # a server's decisions (bench_ddtree.py serve --budget-trace), by cell:
    python benchmarks/trace_budget.py --summarize OUT/logs/budget_trace_CONFIG \
        OUT/logs/slice_windows.jsonl CONFIG
"""

import argparse
import glob
import gzip
import json
import os
import statistics
import sys
import time
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.budget_recorder import install as install_recorder  # noqa: E402
from benchmarks.step_recorder import install as install_steps  # noqa: E402

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

P = os.path.join(os.path.dirname(__file__), "models", "pycode")
PHASES = [
    (1, 0.0, 8),
    (8, 0.0, 40),
    (32, 0.0, 96),
    (1, 1.0, 8),
    (8, 1.0, 40),
    (32, 1.0, 96),
]
MAX_TOKENS = 256


def parse_phases(text: str) -> list[tuple[int, float, int]]:
    """``C:T:N,...`` (concurrency, temperature, requests) -> phases."""
    phases = []
    for part in text.split(","):
        try:
            c, t, n = part.split(":")
            phase = (int(c), float(t), int(n))
        except ValueError:
            raise ValueError(f"--phases: {part!r} is not C:T:N") from None
        if phase[0] < 1 or phase[2] < phase[0] or phase[1] < 0:
            raise ValueError(f"--phases: {part!r} needs C >= 1, N >= C, T >= 0")
        phases.append(phase)
    return phases


def phase_names(phases) -> list[str]:
    """``c<C>T<T>`` per phase; a phase repeated later in the list is told
    apart (``c64T1``, ``c64T1#2``)."""
    seen: Counter[str] = Counter()
    names = []
    for c, temp, _ in phases:
        name = f"c{c}T{temp:g}"
        seen[name] += 1
        names.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return names


class CompileLog:
    """Triton compiles of this process, timed through Triton's JIT hooks
    (chained to hooks set before; a compile is never skipped by them)."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.records: list[dict] = []
        self._started: dict[tuple[str, str], float] = {}

    @staticmethod
    def _id(kwargs) -> tuple[str, str]:
        fn = kwargs.get("fn")
        return (getattr(fn, "name", repr(fn)), str(kwargs.get("key")))

    def before(self, **kwargs) -> None:
        self._started[self._id(kwargs)] = self.clock()

    def after(self, **kwargs) -> None:
        ident = self._id(kwargs)
        now = self.clock()
        start = self._started.pop(ident, now)
        self.records.append({"kernel": ident[0], "t": now, "seconds": now - start})

    def install(self) -> None:
        from vllm.triton_utils import HAS_TRITON, triton

        if not HAS_TRITON:
            return
        runtime = triton.knobs.runtime
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

        def cache_hook(**kwargs):
            self.before(**kwargs)
            return before(**kwargs) if before is not None else None

        def post_hook(**kwargs):
            self.after(**kwargs)
            return after(**kwargs) if after is not None else None

        runtime.jit_cache_hook = cache_hook
        runtime.jit_post_compile_hook = post_hook

    def table(self, t0: float, ready: float, top: int = 12) -> list[str]:
        """Compiles between ``t0`` and ``ready``, by kernel: the lines to print."""
        during = [r for r in self.records if t0 <= r["t"] <= ready]
        by_kernel: dict[str, list[float]] = defaultdict(list)
        for r in during:
            by_kernel[r["kernel"]].append(r["seconds"])
        total = sum(r["seconds"] for r in during)
        head = (
            f"== start-up compiles: {len(during)} in {ready - t0:.1f} s of start-up, "
            f"{total:.1f} s of compile time (overlapping where on a pool)"
        )
        lines = [head]
        ranked = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))
        for name, secs in ranked[:top]:
            lines.append(f"   {name}: {len(secs)} variants, {sum(secs):.1f} s")
        return lines


class ArrivalLoop:
    """A client loop over an in-process engine (``LLMEngine``) that keeps C
    requests in flight until N have finished: continuous arrivals, as
    ``vllm bench serve`` at a concurrency. Every request is new to the engine
    (its number leads the prompt, so no prefix-cache block matches another's);
    ``ignore_eos`` holds each to ``max_tokens``."""

    def __init__(
        self, engine, texts: list[str], max_tokens: int = MAX_TOKENS, clock=None
    ):
        self.engine = engine
        self.texts = texts
        self.max_tokens = max_tokens
        self.clock = clock or time.perf_counter
        # Requests sent so far (over every run): the next one's number.
        self.sent = 0

    def run(
        self, c: int, temp: float, n: int, max_tokens: int | None = None
    ) -> tuple[int, float, float, int]:
        """(output tokens, seconds, median engine step in ms while C were in
        flight, such steps); ``max_tokens`` per request, default the loop's."""
        from vllm import SamplingParams

        sp = SamplingParams(
            temperature=temp,
            max_tokens=max_tokens or self.max_tokens,
            ignore_eos=True,
            seed=None,
        )
        done = inflight = submitted = toks = 0
        steps = []
        t = self.clock()
        while done < n:
            while inflight < c and submitted < n:
                i = self.sent
                self.sent += 1
                text = self.texts[i % len(self.texts)]
                self.engine.add_request(f"r{i}", f"# request {i}\n{text}", sp)
                inflight += 1
                submitted += 1
            s0 = self.clock()
            outs = self.engine.step()
            if inflight == c:
                steps.append(self.clock() - s0)
            for o in outs:
                if o.finished:
                    done += 1
                    inflight -= 1
                    toks += len(o.outputs[0].token_ids)
        secs = self.clock() - t
        step_ms = 1e3 * statistics.median(steps) if steps else 0.0
        return toks, secs, step_ms, len(steps)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", choices=("adaptive", "auto", "none", "dflash"))
    p.add_argument("out")
    p.add_argument("--target", default=f"{P}/target")
    p.add_argument("--drafter", default=f"{P}/drafter")
    p.add_argument(
        "--phases",
        type=parse_phases,
        default=PHASES,
        help="C:T:N,... (default: 1/8/32 requests in flight at T=0 and 1)",
    )
    p.add_argument("--kv-gib", type=float, default=2.0)
    return p.parse_args(argv)


def read_records(path: str) -> list[dict]:
    """A recorded ``trace.jsonl`` (or ``.jsonl.gz``), or a server's folder of
    ``budget_trace.<pid>.jsonl`` (``bench_ddtree.py serve --budget-trace``)."""
    paths = (
        sorted(glob.glob(os.path.join(path, "budget_trace.*.jsonl")))
        if os.path.isdir(path)
        else [path]
    )
    records = []
    for p in paths:
        opener = gzip.open if p.endswith(".gz") else open
        with opener(p, "rt") as f:
            records += [json.loads(line) for line in f]
    if len(paths) > 1:
        # Engine cores one after another (a server restarted into the same
        # folder), in time order. With tensor parallelism every rank decides
        # and writes its own file: summarize one of them.
        records.sort(key=lambda r: r.get("wall", 0.0))
    return records


def label_by_windows(records: list[dict], windows: list[dict], config: str) -> None:
    """Each record's phase from the serve cell whose timed slice of ``config``
    it fell in (``slice_windows.jsonl``): ``c<batch>T<temperature>``; records
    outside every slice (warm-up requests) are ``between slices``."""
    spans = [
        (w["start"], w["end"], f"c{w['batch']}T{w['temperature']:g}")
        for w in windows
        if w["config"] == config
    ]
    for r in records:
        wall = r.get("wall")
        r["ph"] = next(
            (name for a, b, name in spans if wall is not None and a <= wall <= b),
            "between slices",
        )


def summarize_file(path: str, windows: str | None = None, config: str = "") -> None:
    """The summary of recorded decisions, by phase; with ``windows`` (a serve
    run's ``slice_windows.jsonl``) by the cells of ``config``."""
    records = read_records(path)
    if windows is not None:
        with open(windows) as f:
            label_by_windows(records, [json.loads(line) for line in f], config)
    summarize(records)


def main(argv=None):
    args = parse_args(argv)
    config, out = args.config, args.out
    os.makedirs(out, exist_ok=True)
    sys.path.insert(0, os.getcwd())
    import vllm_ddtree

    vllm_ddtree.register()
    from vllm import LLM

    compiles = CompileLog()
    compiles.install()
    records = []
    phase_name = ["warmup"]
    if config == "adaptive":
        install_recorder(records, lambda: phase_name[0])
    # Every config's engine steps, for step_recorder.py --phases OUT CONFIG...
    engine_steps = []
    install_steps(engine_steps, lambda: phase_name[0])

    spec = None
    if config in ("adaptive", "auto"):
        spec = {
            "method": "ddtree",
            "model": args.drafter,
            "tree_budget": "auto",
            "adaptive_budget": config == "adaptive",
        }
    elif config == "dflash":
        spec = {
            "method": "dflash",
            "model": args.drafter,
            "num_speculative_tokens": 15,
        }
    t0 = time.perf_counter()
    llm = LLM(
        model=args.target,
        speculative_config=spec,
        kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)),
        max_num_seqs=256,
    )
    ready = time.perf_counter()
    startup = ready - t0
    print("\n".join(compiles.table(t0, ready)), flush=True)
    engine = llm.llm_engine
    with open(f"{P}/eval_prompts.json") as f:
        texts = [p["text"] for p in json.load(f)["prompts"]]
    loop = ArrivalLoop(engine, texts)

    phase_name[0] = "warmup"
    loop.run(4, 0.0, 8)
    rows = []
    for name, (c, temp, n) in zip(phase_names(args.phases), args.phases, strict=True):
        phase_name[0] = name
        toks, secs, step_ms, nsteps = loop.run(c, temp, n)
        rows.append(
            {
                "config": config,
                "phase": phase_name[0],
                "tok_s": round(toks / secs, 1),
                "secs": round(secs, 2),
                "step_ms": round(step_ms, 3),
                "full_steps": nsteps,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    with open(f"{out}/{config}_compiles.jsonl", "w") as f:
        f.writelines(
            json.dumps({**r, "t": round(r["t"] - t0, 3)}) + "\n"
            for r in compiles.records
        )
    with open(f"{out}/{config}_steps.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in engine_steps)
    with open(f"{out}/{config}_rows.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        f.write(json.dumps({"config": config, "startup_s": startup}) + "\n")
    if records:
        with open(f"{out}/trace.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        summarize(records)


def summarize(records):
    by_phase = defaultdict(list)
    for r in records:
        by_phase[r["ph"]].append(r)
    for ph, rs in by_phase.items():
        n = len(rs)
        bs = Counter(r["b"] for r in rs)
        dr = sum(1 for r in rs if r.get("drafted"))
        print(f"== {ph}: {n} steps, drafted {dr}, b shares {dict(sorted(bs.items()))}")
        # actual periods by shape (bucket n, b, drafted), and learned flag
        per = defaultdict(list)
        for r in rs:
            if "period" in r and r["timed"]:
                per[(r["n"], r["b"], r.get("drafted"))].append(r["period"])
        for k, v in sorted(per.items(), key=lambda kv: -len(kv[1]))[:8]:
            print(
                f"   shape n={k[0]} b={k[1]} drafted={k[2]}: {len(v)} periods, "
                f"median {statistics.median(v):.2f} ms"
            )
        # a typical decision: the commonest n
        common = Counter(r["n"] for r in rs).most_common(1)[0][0]
        sample = [r for r in rs if r["n"] == common]
        r = sample[len(sample) // 2]
        print(
            f"   mid decision at n={common}: b={r['b']} cap={r['cap']} has={r['has']}"
        )
        print(
            "     pred ms "
            + ", ".join(f"{k}:{v:.2f}" for k, v in r["pred"].items())
            + f", 0+drafter:{r['pred0d']:.2f}"
        )
        print("     e(b)    " + ", ".join(f"{k}:{v:.2f}" for k, v in r["e"].items()))
        drafts = [r["draft"] for r in rs if "draft" in r]
        if drafts:
            did = sum(d["did"] for d in drafts)
            best = Counter(d["best"] for d in drafts).most_common(3)
            plain = statistics.median(d["plain"] for d in drafts)
            print(
                f"   draft decisions: drafted {did} of {len(drafts)}, best budgets "
                f"{best}, plain step predicted {plain:.2f} ms (median)"
            )
        has = sum(1 for r in sample if r["has"])
        caps = Counter(r["cap"] for r in sample).most_common(3)
        print(
            f"     of {len(sample)} steps at n={common}: has_trees {has}, "
            f"cap values {caps}"
        )
        print(_prompt_steps(rs))
        print(_estimate_updates(rs))
        print(_throughput(rs))
        for line in _time_by_kind(rs):
            print(line)


def _estimate_updates(rs) -> str:
    """How often a step drafted right after a drafted step was planned on the
    same acceptance estimate as the decision before it. Each drafted step's
    trees send a new estimate, which lands a few steps later at most, so while
    the batch keeps drafting the estimate should move at nearly every
    decision; a step after plain steps has nothing new to read."""
    follow = [
        i
        for i in range(1, len(rs))
        if rs[i].get("drafted") and rs[i - 1].get("drafted")
    ]

    def unchanged(i):
        # On the budgets both decisions weighed (each stops at its cap).
        a, b = rs[i]["e"], rs[i - 1]["e"]
        return all(a[k] == b[k] for k in a.keys() & b.keys())

    same = sum(1 for i in follow if unchanged(i))
    run = longest = 0
    for i in range(1, len(rs)):
        run = run + 1 if unchanged(i) else 0
        longest = max(longest, run)
    return (
        f"   estimate unchanged from the decision before: {same} of {len(follow)} "
        f"steps drafted after a drafted step; longest run of unchanged decisions "
        f"{longest}"
    )


def _prompt_steps(rs) -> str:
    """The steps the cost model does not time (prompt chunks joined the
    batch), apart from the phase's first: with trees verified and without,
    since a tree step's extra over a plain one is what a budget pays there."""
    parts = []
    for has in (False, True):
        v = [
            r["period"]
            for r in rs[1:]
            if not r["timed"] and r["has"] is has and "period" in r
        ]
        if v:
            parts.append(
                f"{'with' if has else 'without'} trees {len(v)} "
                f"(median {statistics.median(v):.1f} ms, {sum(v) / 1e3:.2f} s)"
            )
    return "   prompt steps: " + ("; ".join(parts) or "none")


def _kind(r) -> str:
    """A step's work: trees verified (T), the drafter run for the next step
    without trees verified (D: a probe, or trees left for a prompt chunk), or
    neither (P); a prompt chunk's step gets a leading "prompt "."""
    k = "T" if r["b"] > 0 else ("D" if r.get("drafted") else "P")
    return k if r["timed"] else f"prompt {k}"


def _at(by_budget: dict, b: int, default: float) -> float:
    """A record's value for budget ``b`` (keys are strings once read back
    from JSON)."""
    return by_budget.get(str(b), by_budget.get(b, default))


def _predicted(r) -> float:
    """The cost model's period for the step's shape when it was chosen (ms)."""
    if r["b"] == 0 and r.get("drafted"):
        return r["pred0d"]
    return _at(r["pred"], r["b"], float("nan"))


def _tokens(r) -> float:
    """What a step is expected to emit: one token per request, and on a step
    that verifies trees the accepted nodes the controller expected."""
    if r["b"] == 0:
        return r["n"]
    return r["n"] * (1.0 + _at(r["e"], r["b"], 0.0))


def _throughput(rs) -> str:
    """Tokens per ms at the expected acceptance over the predicted periods of
    the chosen shapes (what the controller believed it would serve, prompt
    chunks' time left out), over the traced periods (what it served, as far
    as its acceptance estimate holds), and over the predicted plain periods
    of the same batches; for every step and for pure decode steps."""

    def rates(steps) -> str:
        tokens = sum(_tokens(r) for r in steps)
        plain = sum(_at(r["pred"], 0, 0.0) for r in steps)
        predicted = sum(_predicted(r) for r in steps)
        traced = sum(r["period"] for r in steps)
        return (
            f"{tokens / predicted:.2f} predicted, {tokens / traced:.2f} traced, "
            f"{sum(r['n'] for r in steps) / plain:.2f} plain predicted"
        )

    steps = [r for r in rs if "period" in r]
    decode = [r for r in steps if r["timed"]]
    if not decode:
        return "   expected tokens per ms: no timed steps"
    return (
        f"   expected tokens per ms: {rates(steps)} over every step; "
        f"{rates(decode)} over pure decode steps"
    )


def _time_by_kind(rs, top: int = 12) -> list[str]:
    """Where a phase's time went: steps by their kind and the kind before
    them (with async scheduling a period holds two steps' work), and whether
    the batch changed size since the step before; each with its steps, total
    time and share, median and mean period, and the median of what the cost
    model predicted for its shape. A kind whose periods run far past its
    predictions is what the budget misprices; a mean far above the median, a
    tail that a median estimate does not see."""
    timed = [(rs[i - 1], rs[i]) for i in range(1, len(rs)) if "period" in rs[i]]
    total = sum(r["period"] for _, r in timed)
    if not timed or total <= 0:
        return []
    groups = defaultdict(list)
    for prev, r in timed:
        moved = "batch changed" if r["n"] != prev["n"] else "same batch"
        groups[(f"{_kind(prev)} -> {_kind(r)}", moved)].append(r)
    lines = [
        f"   time by kind ({total / 1e3:.2f} s over {len(timed)} steps; "
        "kind before -> kind: steps, seconds, share, median / mean period, "
        "median predicted ms):"
    ]
    seconds = {k: sum(r["period"] for r in v) for k, v in groups.items()}
    ranked = sorted(groups.items(), key=lambda kv: -seconds[kv[0]])
    for (kinds, moved), v in ranked[:top]:
        sec = seconds[kinds, moved]
        lines.append(
            f"     {kinds}, {moved}: {len(v)}, {sec / 1e3:.2f} s, "
            f"{100 * sec / total:.0f} %, "
            f"{statistics.median(r['period'] for r in v):.2f} / "
            f"{sec / len(v):.2f} / "
            f"{statistics.median(_predicted(r) for r in v):.2f}"
        )
    rest = [r for _, v in ranked[top:] for r in v]
    if rest:
        sec = sum(r["period"] for r in rest)
        lines.append(
            f"     {len(ranked) - top} other groups: {len(rest)}, {sec / 1e3:.2f} s, "
            f"{100 * sec / total:.0f} %"
        )
    return lines


if __name__ == "__main__":
    if sys.argv[1:2] == ["--summarize"] and len(sys.argv) in (3, 5):
        summarize_file(*sys.argv[2:])
    else:
        main()
