# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The embedded pair checked the way a user would (GPU): under vLLM, the
embedded target's greedy output equals the trained pair's, and DFlash is
accepted on it as often as on the pair.

Four offline engines, side by side on one GPU (each in its own process): the
pair and the embedded target, each without speculation and with DFlash (15
draft tokens). Each generates the pair's held-out prompts at T=0; the summary
gives the sequences identical to the pair's, the first differing position of
the others, and each DFlash engine's mean acceptance length.

    python3 benchmarks/embed_pair_check.py --embedded /data/pycode-8b --out OUT
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from benchmarks.embed_pair import PAIR

# name -> (which model, DFlash or not, gpu_memory_utilization)
ENGINES = {
    "pair-none": ("pair", False, 0.06),
    "pair-dflash": ("pair", True, 0.06),
    "embedded-none": ("embedded", False, 0.36),
    "embedded-dflash": ("embedded", True, 0.4),
}
KV_BYTES = 2 << 30


def prompts_of(num: int, max_len: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(PAIR / "target")
    items = json.loads((PAIR / "eval_prompts.json").read_text())["prompts"]
    return [tok(item["text"])["input_ids"][:max_len] for item in items[:num]]


def worker(args) -> None:
    """One engine: its outputs and acceptance as JSON in ``args.result``."""
    from vllm.inputs import TokensPrompt

    from vllm import LLM, SamplingParams

    which, dflash, memory = ENGINES[args.worker]
    root = PAIR if which == "pair" else args.embedded
    spec = None
    if dflash:
        spec = {
            "method": "dflash",
            "model": str(root / "drafter"),
            "num_speculative_tokens": 15,
        }
    llm = LLM(
        model=str(root / "target"),
        speculative_config=spec,
        max_model_len=2048,
        gpu_memory_utilization=memory,
        kv_cache_memory_bytes=KV_BYTES,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
    )
    prompts = prompts_of(args.num_prompts, args.prompt_tokens)
    params = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True
    )
    start = time.monotonic()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    drafts = metrics.get("vllm:spec_decode_num_drafts")
    accepted = metrics.get("vllm:spec_decode_num_accepted_tokens")
    result = {
        "engine": args.worker,
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "seconds": time.monotonic() - start,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
    }
    Path(args.result).write_text(json.dumps(result))


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(results: dict[str, dict]) -> dict:
    """Sequences identical to the pair's (no speculation), per engine."""
    ref = results["pair-none"]["outputs"]
    summary = {}
    for name, res in results.items():
        diffs = [first_difference(r, o) for r, o in zip(ref, res["outputs"])]
        summary[name] = {
            "identical": sum(d is None for d in diffs),
            "compared": len(ref),
            "tokens": sum(len(o) for o in res["outputs"]),
            "first_difference": [d for d in diffs if d is not None],
            "acceptance_length": res["acceptance_length"],
        }
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--embedded", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--worker", choices=sorted(ENGINES), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if not (args.embedded / "target" / "config.json").is_file():
        p.error(f"--embedded {args.embedded}: no target/ (benchmarks/embed_pair.py)")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    procs = {}
    for name in ENGINES:
        cmd = [sys.executable, __file__, "--worker", name]
        cmd += ["--result", str(args.out / f"{name}.json")]
        cmd += ["--embedded", str(args.embedded), "--out", str(args.out)]
        cmd += ["--num-prompts", str(args.num_prompts)]
        cmd += ["--prompt-tokens", str(args.prompt_tokens)]
        cmd += ["--max-tokens", str(args.max_tokens)]
        log = (args.out / f"{name}.log").open("w")
        procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env
        )
    failed = [name for name, proc in procs.items() if proc.wait() != 0]
    if failed:
        print(
            f"embed_pair_check: {', '.join(failed)} failed "
            f"(see their logs in {args.out})"
        )
        return 1
    results = {
        name: json.loads((args.out / f"{name}.json").read_text()) for name in ENGINES
    }
    summary = compare(results)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for name, s in summary.items():
        acc = s["acceptance_length"]
        print(
            f"{name:>16}: {s['identical']}/{s['compared']} sequences identical to "
            f"the pair's, {s['tokens']} tokens"
            + (f", acceptance length {acc:.2f}" if acc else "")
            + (
                f"; first differences at {s['first_difference'][:8]}"
                if s["first_difference"]
                else ""
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
