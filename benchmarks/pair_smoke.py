# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A quick check of DDTree configurations on the trained pair, on a GPU.

Each configuration runs in its own ``vllm.LLM`` process, side by side (a fixed
KV cache, so engines can share the GPU): greedy batches of 1, 8 and 32 prompts
of ``benchmarks/models/pycode`` twice each (the second pass after the adaptive
budget has timed its steps), then 8 seeded prompts at temperature 1. Prints,
per configuration, the start-up time, tokens per second of each pass (not a
benchmark: the engines share the GPU and host, and start at different times)
and how many outputs equal the reference configuration's token for token (a
differing one may be a numerical tie; ``tests/e2e`` judges those), then the
DDTree lines of each engine's log.

    python benchmarks/pair_smoke.py none,auto,b128,fixed64 --out DIR
    python benchmarks/pair_smoke.py auto --out DIR --reference DIR0/none.json
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAIR = ROOT / "benchmarks" / "models" / "pycode"
DRAFTER = str(PAIR / "drafter")
CONFIGS = {
    "none": None,
    "auto": {"method": "ddtree", "model": DRAFTER, "adaptive_budget": True},
    "b128": {
        "method": "ddtree",
        "model": DRAFTER,
        "tree_budget": 128,
        "adaptive_budget": True,
    },
    "fixed64": {
        "method": "ddtree",
        "model": DRAFTER,
        "tree_budget": 64,
        "adaptive_budget": False,
    },
}
BATCHES = (1, 8, 32)


def run_one(name: str, out: Path) -> None:
    from vllm import LLM, SamplingParams

    prompts = json.loads((PAIR / "eval_prompts.json").read_text())["prompts"][:32]
    start = time.time()
    llm = LLM(
        str(PAIR / "target"),
        speculative_config=CONFIGS[name],
        max_model_len=2048,
        # A fixed KV cache skips vLLM's memory profiling, which fails when
        # another engine on the GPU frees memory meanwhile.
        kv_cache_memory_bytes=2 << 30,
        seed=0,
    )
    result = {"start_s": time.time() - start}
    greedy = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    for batch in BATCHES:
        for rep in range(2):
            t = time.time()
            outs = llm.generate(prompts[:batch], greedy, use_tqdm=False)
            result[f"b{batch}_{rep}"] = {
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "s": time.time() - t,
            }
    seeded = SamplingParams(temperature=1.0, max_tokens=64, seed=7, ignore_eos=True)
    outs = llm.generate(prompts[:8], seeded, use_tqdm=False)
    result["t1"] = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "s": 0}
    (out / f"{name}.json").write_text(json.dumps(result))


def report(results: dict, reference: dict | None) -> None:
    for name, res in results.items():
        rates = ", ".join(
            f"{k}: {sum(map(len, v['tokens'])) / v['s']:.0f}"
            for k, v in res.items()
            if k not in ("start_s", "t1")
        )
        print(f"== {name}: start {res['start_s']:.0f} s; tokens/s {rates}")
        if reference is None or res is reference:
            continue
        for key, run in res.items():
            if key == "start_s":
                continue
            got, want = run["tokens"], reference[key]["tokens"]
            same = sum(g == w for g, w in zip(got, want))
            first = [
                next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), -1)
                for g, w in zip(got, want)
            ]
            print(f"   {key}: {same}/{len(want)} equal; first difference {first}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("configs", help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reference", type=Path, help="a none.json of an earlier run")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one:
        run_one(args.one, args.out)
        return
    names = args.configs.split(",")
    sys.path.insert(0, str(ROOT))
    from benchmarks.checkout import plugin_site

    env = dict(os.environ)
    # The engines' own processes load the plugin from this checkout.
    env["PYTHONPATH"] = os.pathsep.join(
        [
            str(plugin_site(args.out / "plugin_site")),
            str(ROOT),
            env.get("PYTHONPATH", ""),
        ]
    )
    procs = {
        name: subprocess.Popen(
            [
                sys.executable,
                __file__,
                args.configs,
                "--out",
                str(args.out),
                "--one",
                name,
            ],
            env=env,
            stdout=open(args.out / f"{name}.log", "w"),
            stderr=subprocess.STDOUT,
        )
        for name in names
    }
    for name, proc in procs.items():
        print(f"{name}: exit {proc.wait()}", flush=True)
    results = {
        n: json.loads((args.out / f"{n}.json").read_text())
        for n in names
        if (args.out / f"{n}.json").exists()
    }
    reference = results.get("none")
    if reference is None and args.reference is not None:
        reference = json.loads(args.reference.read_text())
    report(results, reference)
    for name in names:
        lines = (args.out / f"{name}.log").read_text().splitlines()
        keep = [line for line in lines if "DDTree" in line or "Error" in line]
        print(f"-- {name}: {len(lines)} log lines")
        print("\n".join(keep[-20:]))


if __name__ == "__main__":
    main()
