# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a DDTree engine's plain decode step costs next to no speculation.

The adaptive budget's ``b = 0`` step verifies no tree and skips the drafter's
forward, keeping only the drafter's context KV up to date. This diagnostic
forces every step of an adaptive DDTree engine to be such a step and times
engine steps at fixed batches (T=1, in-process engine, the trained pair), next
to an engine without speculation; at batch 32 it also records a torch profiler
table (host time per op, kernel launches per step).

Configs: ``none``; ``plain`` (DDTree, every step plain); ``plain_noctx``
(``plain`` without the drafter's context KV computation: not a usable engine,
it isolates that part's cost). One config per process, e.g.::

    for c in none plain plain_noctx none plain; do
        python benchmarks/plain_step_overhead.py $c benchmarks/results/plain_step_host_overhead R1
    done
"""

import json
import os
import statistics
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
PAIR = os.path.join(os.path.dirname(__file__), "models", "pycode")
BATCHES = (1, 32, 1, 32)
WARM_STEPS, TIMED_STEPS, PROFILED_STEPS = 30, 150, 20


def force_plain_steps(without_context: bool) -> None:
    from vllm.v1.spec_decode import ddtree_adaptive, ddtree_cost

    controller = ddtree_cost.TreeBudgetController
    controller.best_budget = lambda self, num_reqs, most, drafted=False: 0
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


def main() -> None:
    config, out, tag = sys.argv[1:4]
    os.makedirs(out, exist_ok=True)
    import vllm_ddtree

    vllm_ddtree.register()
    from torch.profiler import ProfilerActivity, profile

    from vllm import LLM, SamplingParams

    spec = None
    if config != "none":
        force_plain_steps(config == "plain_noctx")
        spec = {
            "method": "ddtree",
            "model": f"{PAIR}/drafter",
            "tree_budget": "auto",
            "adaptive_budget": True,
        }
    start = time.perf_counter()
    llm = LLM(
        model=f"{PAIR}/target",
        speculative_config=spec,
        kv_cache_memory_bytes=2 << 30,
        max_num_seqs=256,
    )
    result = {"config": config, "tag": tag}
    result["startup_s"] = round(time.perf_counter() - start, 1)
    engine = llm.llm_engine
    with open(f"{PAIR}/eval_prompts.json") as f:
        texts = [p["text"] for p in json.load(f)["prompts"]]
    params = SamplingParams(temperature=1.0, max_tokens=600, ignore_eos=True)
    k = 0
    for batch in BATCHES:
        ids = []
        for _ in range(batch):
            k += 1
            ids.append(f"{tag}-{k}")
            # A fresh first line: no prefix-cache hit across requests.
            prompt = f"# request {tag} {k}\n" + texts[k % len(texts)]
            engine.add_request(ids[-1], prompt, params)
        for _ in range(WARM_STEPS):
            engine.step()
        times = []
        for _ in range(TIMED_STEPS):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        median_ms = round(1e3 * statistics.median(times), 3)
        result.setdefault(f"step_ms_b{batch}", []).append(median_ms)
        if batch == 32 and "launches_per_step" not in result:
            activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            with profile(activities=activities) as prof:
                for _ in range(PROFILED_STEPS):
                    engine.step()
            table = prof.key_averages()
            launch_ops = ("cudaLaunchKernel", "cuLaunchKernelEx")
            launches = sum(e.count for e in table if e.key in launch_ops)
            host_us = sum(e.self_cpu_time_total for e in table)
            result["launches_per_step"] = launches / PROFILED_STEPS
            result["op_host_ms_per_step"] = round(host_us / 1e3 / PROFILED_STEPS, 3)
            with open(f"{out}/profile_{config}_{tag}.txt", "w") as f:
                f.write(table.table(sort_by="self_cpu_time_total", row_limit=30))
        engine.abort_request(ids)
        for _ in range(3):
            engine.step()
    print(json.dumps(result), flush=True)
    with open(f"{out}/steps.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
