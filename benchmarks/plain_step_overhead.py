# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a DDTree engine's plain decode step costs next to no speculation.

The adaptive budget's ``b = 0`` step verifies no tree and skips the drafter's
forward, keeping only the drafter's context KV up to date. This diagnostic
forces every step of an adaptive DDTree engine to be such a step and times
engine steps at fixed batches (T=1, in-process engine; the trained pair by
default, the embedded 8B-shaped pair with ``--target/--drafter``), next to an
engine without speculation. At the first batch of ``--profile-batch`` requests
it also records a torch profiler table: host time per op, kernel launches per
step, and the GPU's kernel time per step with the kernels that take most
(graph-replayed kernels included).

Configs: ``none``; ``plain`` (DDTree, every step plain); ``plain_noctx``
(``plain`` without the drafter's context KV computation: not a usable engine,
it isolates that part's cost); ``tree`` (DDTree, every request verifies a
``--tree-budget``-node tree and the drafter runs at every step: what a tree
step costs next to the other two). ``--joins J`` makes every timed step a
mixed one: before it, J running requests end and J new prompts join, so the
step carries J prompt chunks next to the decodes, as under continuous
arrivals. At the profiled batch the same number of steps
then runs under ``cProfile`` too (``pyprofile_<config>_<tag>.txt``, and the
top functions' host microseconds per step in the row): where the Python
between the ops goes, the scheduler and the plugin included.
One config per process, e.g.::

    for c in none plain plain_noctx none plain; do
        python benchmarks/plain_step_overhead.py $c benchmarks/results/plain_step_host_overhead R1
    done
    # real size (embed_pair.py's output D), batches of 64 and 32:
    python benchmarks/plain_step_overhead.py plain OUT R1 --target D/target \
        --drafter D/drafter --kv-gib 6 --batches 64,32,64,32 --profile-batch 64
    # steps with a prompt chunk: none / plain / 3-node trees, one join a step
    python benchmarks/plain_step_overhead.py tree OUT R1 --tree-budget 3 --joins 1
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
PAIR = os.path.join(os.path.dirname(__file__), "models", "pycode")
BATCHES = (1, 32, 1, 32)
WARM_STEPS, TIMED_STEPS, PROFILED_STEPS = 30, 150, 20
# Kernels listed per config (by GPU time over the profiled steps).
TOP_KERNELS = 25


def force_plain_steps(without_context: bool) -> None:
    from vllm.v1.spec_decode import ddtree_adaptive, ddtree_cost

    controller = ddtree_cost.TreeBudgetController
    controller.best_budget = lambda self, num_reqs, most, drafted=False, **_: 0
    controller.should_draft = lambda self, num_reqs, most: False
    # Neither the budget kernels nor the start-up step times are ever used.
    ddtree_adaptive.AdaptiveTreeBudget.warm_up = lambda self, runner: 0
    ddtree_adaptive.AdaptiveTreeBudget.profile = lambda self, runner: None
    if without_context:
        from vllm.model_executor.models import qwen3_dflash

        for value in vars(qwen3_dflash).values():
            if isinstance(value, type) and hasattr(
                value, "precompute_and_store_context_kv"
            ):
                value.precompute_and_store_context_kv = lambda self, *a, **k: None


def force_tree_steps(budget: int) -> None:
    """Every step verifies ``budget``-node trees (at most the step's cap) and
    the drafter runs after it, whatever the cost model would choose."""
    from vllm.v1.spec_decode import ddtree_cost

    controller = ddtree_cost.TreeBudgetController
    controller.best_budget = lambda self, num_reqs, most, drafted=False, **_: min(
        budget, most
    )
    controller.should_draft = lambda self, num_reqs, most: True


def python_host_profile(step, num_steps: int, top: int = 20) -> tuple[str, list]:
    """The engine's Python functions over ``num_steps`` calls of ``step``
    (``cProfile``: every call timed, so the steps run slower, but where their
    host time goes by function is kept): the report sorted by own time, and
    the ``top`` functions' own and cumulative microseconds per step. The
    torch profiler's table times ops and launches, not the Python between
    them (the scheduler, the plugin's wrappers, the budget's host work)."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        for _ in range(num_steps):
            step()
    finally:
        profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
    stats.print_stats(top)
    rows = sorted(
        (
            (f"{os.path.basename(path)}:{line}({name})", own, cum)
            for (path, line, name), (_, _, own, cum, _) in stats.stats.items()
        ),
        key=lambda r: -r[1],
    )
    per_step = [
        [where, round(1e6 * own / num_steps, 1), round(1e6 * cum / num_steps, 1)]
        for where, own, cum in rows[:top]
    ]
    return text.getvalue(), per_step


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", choices=("none", "plain", "plain_noctx", "tree"))
    p.add_argument("out")
    p.add_argument("tag", help="a round's name, also in the request ids")
    p.add_argument("--target", default=f"{PAIR}/target")
    p.add_argument("--drafter", default=f"{PAIR}/drafter")
    p.add_argument("--prompts", default=f"{PAIR}/eval_prompts.json")
    p.add_argument("--kv-gib", type=float, default=2.0)
    p.add_argument(
        "--batches",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=BATCHES,
        help="requests per timed batch, in order (default 1,32,1,32)",
    )
    p.add_argument("--profile-batch", type=int, default=32)
    p.add_argument(
        "--tree-budget",
        type=int,
        default=3,
        help="nodes per request of the tree config (a budget of the ladder)",
    )
    p.add_argument(
        "--joins",
        type=int,
        default=0,
        help="requests that end and new prompts that join before each timed step",
    )
    args = p.parse_args(argv)
    if not args.batches or min(args.batches) < 1:
        p.error("--batches needs request counts >= 1")
    if not 0 <= args.joins <= min(args.batches):
        p.error("--joins must be between 0 and the smallest batch")
    if args.tree_budget < 1:
        p.error("--tree-budget must be at least 1")
    return args


def kernel_summary(events, num_steps: int) -> dict:
    """GPU kernel time per step and the kernels that take most of it, from a
    profiler's ``key_averages()`` (device time of CUDA kernels only)."""
    kernels = [
        e
        for e in events
        if getattr(e, "device_type", None) is not None
        and str(e.device_type).endswith("CUDA")
        and e.self_device_time_total > 0
    ]
    total_us = sum(e.self_device_time_total for e in kernels)
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:TOP_KERNELS]
    return {
        "gpu_ms_per_step": round(total_us / 1e3 / num_steps, 4),
        "top_kernels_us_per_step": [
            [e.key[:120], round(e.self_device_time_total / num_steps, 2), e.count]
            for e in top
        ],
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    config, out, tag = args.config, args.out, args.tag
    os.makedirs(out, exist_ok=True)
    # The checkout's plugin, run as a script from its root.
    sys.path.insert(0, os.getcwd())
    import vllm_ddtree

    vllm_ddtree.register()
    from torch.profiler import ProfilerActivity, profile

    from vllm import LLM, SamplingParams

    spec = None
    if config == "tree":
        force_tree_steps(args.tree_budget)
    elif config != "none":
        force_plain_steps(config == "plain_noctx")
    if config != "none":
        spec = {
            "method": "ddtree",
            "model": args.drafter,
            "tree_budget": "auto",
            "adaptive_budget": True,
        }
    start = time.perf_counter()
    llm = LLM(
        model=args.target,
        speculative_config=spec,
        kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)),
        max_num_seqs=256,
    )
    result = {"config": config, "tag": tag, "target": args.target}
    if config == "tree":
        result["tree_budget"] = args.tree_budget
    if args.joins:
        result["joins"] = args.joins
    result["startup_s"] = round(time.perf_counter() - start, 1)
    engine = llm.llm_engine
    with open(args.prompts) as f:
        texts = [p["text"] for p in json.load(f)["prompts"]]
    params = SamplingParams(temperature=1.0, max_tokens=600, ignore_eos=True)
    k = 0
    ids = []

    def join(n: int) -> None:
        nonlocal k
        for _ in range(n):
            k += 1
            ids.append(f"{tag}-{k}")
            # A fresh first line: no prefix-cache hit across requests.
            prompt = f"# request {tag} {k}\n" + texts[k % len(texts)]
            engine.add_request(ids[-1], prompt, params)

    def step() -> float:
        if args.joins:
            # The oldest end, new prompts take their place: the step carries
            # their prompt chunks next to the running requests' decodes.
            engine.abort_request(ids[: args.joins])
            del ids[: args.joins]
            join(args.joins)
        t = time.perf_counter()
        engine.step()
        return time.perf_counter() - t

    for batch in args.batches:
        join(batch)
        for _ in range(WARM_STEPS):
            step()
        times = [step() for _ in range(TIMED_STEPS)]
        median_ms = round(1e3 * statistics.median(times), 3)
        result.setdefault(f"step_ms_b{batch}", []).append(median_ms)
        if batch == args.profile_batch and "launches_per_step" not in result:
            activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            with profile(activities=activities) as prof:
                for _ in range(PROFILED_STEPS):
                    step()
            table = prof.key_averages()
            launch_ops = ("cudaLaunchKernel", "cuLaunchKernelEx")
            launches = sum(e.count for e in table if e.key in launch_ops)
            host_us = sum(e.self_cpu_time_total for e in table)
            result["launches_per_step"] = launches / PROFILED_STEPS
            result["op_host_ms_per_step"] = round(host_us / 1e3 / PROFILED_STEPS, 3)
            result.update(kernel_summary(table, PROFILED_STEPS))
            with open(f"{out}/profile_{config}_{tag}.txt", "w") as f:
                f.write(table.table(sort_by="self_cpu_time_total", row_limit=30))
            report, per_step = python_host_profile(step, PROFILED_STEPS)
            result["python_top_us_per_step"] = per_step
            with open(f"{out}/pyprofile_{config}_{tag}.txt", "w") as f:
                f.write(report)
        engine.abort_request(ids)
        ids.clear()
        for _ in range(3):
            engine.step()
    print(json.dumps(result), flush=True)
    with open(f"{out}/steps.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
