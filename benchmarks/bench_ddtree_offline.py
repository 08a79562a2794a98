# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``bench_ddtree.py e2e`` and ``cost``: one engine configuration in its own
process through ``vllm.LLM`` (the parent's side, then the worker's)."""

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from benchmarks.bench_ddtree_config import (
    TAGS_PER_RUN,
    _schedule_field,
    arrivals_of,
    batch_requests,
    engine_kwargs,
    engine_process_of,
    fresh_prompt,
    random_prompts,
    settings_of,
)
from benchmarks.bench_ddtree_procs import (
    _run_logged,
    _with_plugin,
    _worker_env,
)
from benchmarks.bench_ddtree_report import (
    append_row,
    base_config,
    budget_of,
    metric_delta,
    metric_totals,
    spec_stats,
    timing_stats,
)
from benchmarks.host_usage import (
    HostUsage,
    parse_cpu_list,
    process_tree,
    thread_info,
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
            [
                sys.executable,
                str(ROOT / "benchmarks" / "bench_ddtree.py"),
                "_worker",
                str(spec_path),
            ],
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

    from benchmarks.checkout import use_checkout

    use_checkout()
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
