# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# The diagnostic as it ran (code 36a9303), from the repo root with the plugin's
# entry point on PYTHONPATH and VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine in
# this process, so that the wrappers below are the ones it calls):
#     python3 start_up_probe.py OUT_DIR > OUT_DIR/engine.log
# It stopped after the lines it was written for (its generate call passed the
# prompts in a form LLM.generate refuses).
"""Where the drafter graphs' profile replays spend GPU time: per-replay times and a torch profile."""
import faulthandler, json, os, sys, time
from pathlib import Path
ROOT = Path.cwd(); PAIR = ROOT / "benchmarks/models/pycode"
OUT = Path(sys.argv[1]); OUT.mkdir(parents=True, exist_ok=True)
faulthandler.dump_traceback_later(int(os.environ.get("T", "400")) - 20, exit=False)

def main():
    import torch
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm.v1.spec_decode import ddtree_adaptive as da
    from vllm.config import CUDAGraphMode
    calls = []
    def patched(manager, prepare=None, keep=None):
        calls.append(1); group = len(calls)
        rows = []
        if manager is not None:
            for desc in list(manager.graphs):
                if desc.cg_mode != CUDAGraphMode.FULL or (keep is not None and not keep(desc.num_tokens)):
                    continue
                if prepare is not None:
                    prepare(desc)
                ms = []
                for r in range(3):
                    torch.cuda.synchronize(); t = time.perf_counter()
                    if group == 2 and r == 0 and len(rows) < 2:
                        from torch.profiler import profile, ProfilerActivity
                        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                            manager.run_fullgraph(desc); torch.cuda.synchronize()
                        (OUT / f"prof_g{group}_{desc.num_tokens}.txt").write_text(
                            p.key_averages().table(sort_by="cuda_time_total", row_limit=25))
                    else:
                        manager.run_fullgraph(desc); torch.cuda.synchronize()
                    ms.append(1e3 * (time.perf_counter() - t))
                rows.append((desc.num_tokens, getattr(desc, "num_reqs", None), [round(x, 3) for x in ms]))
                print(f"GROUP {group} tokens {desc.num_tokens} reqs {getattr(desc,'num_reqs',None)} ms {rows[-1][2]}", flush=True)
        return {n: min(m) / 1e3 for n, _, m in rows}, sum(sum(m) for _, _, m in rows) / 1e3
    da._time_graphs = patched
    def twice(name):
        fn = getattr(da, name)
        def wrapper(*a, **k):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            fn(*a, **k); torch.cuda.synchronize(); t1 = time.perf_counter()
            r = fn(*a, **k); torch.cuda.synchronize(); t2 = time.perf_counter()
            print(f"WARM {name} first {1e3*(t1-t0):.1f} ms second {1e3*(t2-t1):.1f} ms", flush=True)
            return r
        setattr(da, name, wrapper)
    for name in ("build_ddtree", "expected_accepted_nodes", "assign_tree_nodes"):
        twice(name)
    print("TRITON_CACHE_DIR", os.environ.get("TRITON_CACHE_DIR"), flush=True)
    from vllm import LLM, SamplingParams
    t = time.time()
    llm = LLM(str(PAIR / "target"), speculative_config={"method": "ddtree", "model": str(PAIR / "drafter"),
              "tree_budget": 128, "adaptive_budget": True}, max_model_len=4096,
              kv_cache_memory_bytes=2 << 30)
    d = os.environ.get("TRITON_CACHE_DIR"); print("TRITON_CACHE_DIR", d, sum(len(f) for _, _, f in os.walk(d)) if d else None, flush=True)
    print(f"READY after {time.time() - t:.1f} s", flush=True)
    prompts = json.loads((PAIR / "eval_prompts.json").read_text())["prompts"][:8]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)
    print("PASS", sum(len(o.outputs[0].token_ids) for o in outs), flush=True)

if __name__ == "__main__":
    main()
