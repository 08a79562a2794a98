# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``bench_ddtree.py serve``: each configuration behind ``vllm serve``, timed
by vLLM's own ``vllm bench serve``, one server after another or side by side
(``--interleave``)."""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from benchmarks.bench_ddtree_config import (
    DFLASH_TOKENS,
    SERVED_NAME,
    TAGS_PER_RUN,
    _schedule_field,
    clients_off_pinned_cpus,
    engine_kwargs,
    fresh_prompt,
    interleave_memory,
    interleave_of,
    parse_engine_args,
    pin_cpus_field,
    pin_server,
    settings_of,
    traced_configs,
)
from benchmarks.bench_ddtree_procs import (
    ServeClient,
    _kill_group,
    _kill_groups,
    _with_plugin,
    _worker_env,
)
from benchmarks.bench_ddtree_report import (
    append_row,
    base_config,
    budget_of,
    is_adaptive,
)
from benchmarks.checkout import free_port
from benchmarks.kv_usage import KvSampler

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
        env=budget_trace_env(args, config, env),
        cwd=ROOT,
        start_new_session=True,
    )
    return server, f"http://127.0.0.1:{port}"


def budget_trace_env(args, config, env: dict) -> dict:
    """``env`` for ``config``'s server; with ``--budget-trace`` a DDTree
    server's processes (each DDTree config's, or those it names) record the
    adaptive budget's decisions (``serve_trace/sitecustomize.py``) into
    ``OUT/logs/budget_trace_<config>``, and with ``--step-trace`` every
    server's its engine steps into ``OUT/logs/step_trace_<config>``."""
    from benchmarks import budget_recorder, step_recorder

    logs = Path(args.out) / "logs"
    traces = {}
    if config in traced_configs(args):
        traces[budget_recorder.TRACE_ENV] = str(logs / f"budget_trace_{config}")
    if getattr(args, "step_trace", False):
        traces[step_recorder.TRACE_ENV] = str(logs / f"step_trace_{config}")
    if not traces:
        return env
    hook = str(Path(__file__).resolve().parent / "serve_trace")
    path = [hook] + [p for p in [env.get("PYTHONPATH")] if p]
    return {**env, "PYTHONPATH": os.pathsep.join(path), **traces}


def record_slice_window(out, config, batch, temperature, j, start, end) -> None:
    """A timed slice's wall-clock window, in ``OUT/logs/slice_windows.jsonl``:
    what labels a server's budget records by cell."""
    window = {
        "config": config,
        "batch": batch,
        "temperature": float(temperature),
        "slice": j,
        "start": start,
        "end": end,
    }
    with (Path(out) / "logs" / "slice_windows.jsonl").open("a") as f:
        f.write(json.dumps(window) + "\n")


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


def record_start_up(out: Path, config: str, seconds: float) -> None:
    """Seconds from ``vllm serve``'s start to its first healthy answer, per
    config, in ``out/start_up.json`` (servers started at once share the host
    while they start)."""
    path = Path(out) / "start_up.json"
    times = json.loads(path.read_text()) if path.is_file() else {}
    times[config] = round(seconds, 1)
    path.write_text(json.dumps(times, indent=1) + "\n")
    print(f"    {config}: ready after {seconds:.0f} s", flush=True)


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
    if float(temperature) == 0.0:
        # generated_texts: a greedy cell compares its configs' outputs.
        cmd.append("--save-detailed")
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
        started: dict[str, float] = {}
        for config, max_batch in configs if at_once else ():
            log = server_logs[config]
            started[config] = time.monotonic()
            servers[config] = (*start_server(share, config, max_batch, log, env), None)
        for config, max_batch in configs:
            log = server_logs[config]
            if config not in servers:
                started[config] = time.monotonic()
                servers[config] = (
                    *start_server(share, config, max_batch, log, env),
                    None,
                )
            server, base, _ = servers[config]
            if _wait_healthy(base, server, deadline):
                record_start_up(args.out, config, time.monotonic() - started[config])
            else:
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


def greedy_agreement(results: dict[str, list[dict]]) -> dict[str, dict]:
    """At T=0, each config's generated texts against a reference config's over
    the same slices (the same prompts in the same order): no speculation where
    it ran, else the first config. A speculative config is lossless if it
    agrees as often as another does (fp16 logit ties break with the batch's
    shape, so two configs may part at a tie). Configs whose results hold no
    texts are left out."""
    texts = {
        c: [t for r in rs for t in (r.get("generated_texts") or [])]
        for c, rs in results.items()
    }
    texts = {c: t for c, t in texts.items() if t}
    if len(texts) < 2:
        return {}
    ref = "none" if "none" in texts else next(iter(texts))
    out = {}
    for config, got in texts.items():
        if config == ref:
            continue
        pairs = list(zip(got, texts[ref]))
        parted = [
            next(
                (i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))
            )
            for a, b in pairs
            if a != b
        ]
        out[config] = {
            "against": ref,
            "compared": len(pairs),
            "identical": len(pairs) - len(parted),
            "chars_compared": sum(min(len(a), len(b)) for a, b in pairs),
            "first_difference_chars": sorted(parted),
        }
    return out


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
    windows = []  # (config, slice, start, end) of each timed slice
    # KV blocks held, from each server's /metrics while its slices run.
    kv = {c: KvSampler(servers[c][1]) for c in who}
    for j in range(len(plans[who[0]][1])):
        for config in who if j % 2 == 0 else reversed(who):
            out, cmd = plans[config][1][j]
            client = servers[config][2]
            kv[config].start()
            start = time.time()
            try:
                ran = client.run(cmd, deadline - time.monotonic())
            finally:
                kv[config].stop()
            windows.append((config, j, start, time.time()))
            if not ran or not out.is_file():
                return [], config
            result = json.loads(out.read_text())
            if result.get("failed"):  # vllm bench serve exits 0 all the same
                return [], config
            results[config].append(result)
            usages[config].append(client.last_usage)
    if getattr(args, "budget_trace", False) or getattr(args, "step_trace", False):
        # The cell's, once all its slices ran (a failed attempt's are not).
        for config, j, start, end in windows:
            record_slice_window(args.out, config, batch, temperature, j, start, end)
    # Only greedy cells keep their texts (bench_command).
    same = greedy_agreement(results)
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
        if config in same:
            row["greedy_agreement"] = same[config]
        rows.append(row)
    return rows, None
