# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Compile time and speed of the tree builder's top-token search, for one or
more copies of the builder module side by side.

``_ranked_top_tokens`` (vllm/v1/spec_decode/dflash_tree_builder.py) runs at
every drafting step; its candidate sort was the slowest kernel of the adaptive
budget's start-up warm-up. For each ``--builder TAG=PATH`` (default: this
checkout's module) a fresh process with an empty Triton cache times the first
call per budget (its compiles) and then the mean of later calls, over
``[rows, depth, vocab]`` float16 logits of three kinds: random, crowded (the
``4 * budget`` best tokens at the lowest ids, as a trained drafter over a BPE
vocabulary puts them) and crowded400 (at least 400 such tokens: more candidates
than the widest sort). Every output is checked against a stable sort.

    git show 5e3e1fa:vllm/v1/spec_decode/dflash_tree_builder.py > /tmp/old_builder.py
    python benchmarks/bench_top_search.py --out $OUT/top_search \\
        --builder old=/tmp/old_builder.py --builder new=vllm/v1/spec_decode/dflash_tree_builder.py
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CHECKOUT_BUILDER = ROOT / "vllm" / "v1" / "spec_decode" / "dflash_tree_builder.py"
KINDS = ("randn", "crowded", "crowded400")


def logits_of(kind: str, rows: int, depth: int, vocab: int, k: int, device):
    import torch

    gen = torch.Generator().manual_seed(k)
    x = torch.randn(rows, depth, vocab, generator=gen)
    if kind != "randn":
        n = min(vocab, 4 * k if kind == "crowded" else max(400, 4 * k))
        x[..., :n] = torch.sort(torch.rand(n, generator=gen) * 14 + 3).values
    return x.half().to(device)


def time_builder(path: Path, rows: int, depth: int, vocab: int, budgets, iters):
    """One builder module's rows (runs in the process it is called in)."""
    import torch

    from benchmarks.checkout import use_checkout

    use_checkout()
    spec = importlib.util.spec_from_file_location("builder_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = []
    for k in budgets:
        for kind in KINDS:
            x = logits_of(kind, rows, depth, vocab, k, device)
            sync()
            start = time.perf_counter()
            _, ids, _ = module._ranked_top_tokens(x, k)
            sync()
            first = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(iters):
                module._ranked_top_tokens(x, k)
            sync()
            us = (time.perf_counter() - start) / iters * 1e6
            want = torch.sort(x.float(), dim=-1, descending=True, stable=True)
            out.append(
                {
                    "budget": k,
                    "kind": kind,
                    "first_call_s": round(first, 3),
                    "us_per_call": round(us, 1),
                    "equal_to_stable_sort": bool(
                        torch.equal(ids.cpu(), want.indices[..., :k].cpu())
                    ),
                }
            )
    return out


def run_per_builder(
    parser, script, builders, out: Path, child_args, interpret: bool = True
) -> dict:
    """``script --child PATH child_args`` for each ``TAG=PATH`` of ``builders``
    (default: this checkout's builder), each in its own process with an empty
    Triton cache (every kernel compiles), and without Triton's interpreter
    unless ``interpret``; returns each child's last stdout line, parsed as
    JSON, by tag."""
    results = {}
    for spec in builders or [f"checkout={CHECKOUT_BUILDER}"]:
        tag, sep, path = spec.partition("=")
        if not sep or not Path(path).is_file():
            parser.error(f"--builder wants TAG=PATH of an existing file, got {spec!r}")
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache}
            if not interpret:
                env.pop("TRITON_INTERPRET", None)
            cmd = [sys.executable, script, "--out", str(out), "--child", path]
            print(f"{Path(script).stem}: {tag} ({path})", flush=True)
            done = subprocess.run(
                cmd + child_args, env=env, capture_output=True, text=True, check=False
            )
            if done.returncode:
                sys.stderr.write(done.stderr[-4000:])
                raise SystemExit(done.returncode)
            results[tag] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


def builder_table(title: str, columns, results: dict) -> str:
    """``results`` (rows by builder tag) as a markdown table under ``title``:
    ``columns`` are (header, the row's cell) pairs after the builder's tag."""
    lines = [
        title,
        "",
        "| builder | " + " | ".join(h for h, _ in columns) + " |",
        "|---" * (1 + len(columns)) + "|",
    ]
    for tag, rows in results.items():
        lines += [
            f"| {tag} | " + " | ".join(str(cell(r)) for _, cell in columns) + " |"
            for r in rows
        ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from benchmarks.tree_acceptance import write_result

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--builder",
        action="append",
        default=None,
        help="TAG=PATH of a dflash_tree_builder.py copy (repeatable; default: "
        "this checkout's)",
    )
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--depth", type=int, default=15)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--budgets", type=int, nargs="+", default=[15, 127, 255])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    shape = (args.rows, args.depth, args.vocab, args.budgets, args.iters)
    if args.child is not None:
        print(json.dumps(time_builder(args.child, *shape)))
        return 0
    child_args = ["--rows", str(args.rows), "--depth", str(args.depth)]
    child_args += ["--vocab", str(args.vocab), "--iters", str(args.iters)]
    child_args += ["--budgets", *map(str, args.budgets)]
    results = run_per_builder(p, __file__, args.builder, args.out, child_args)
    table = builder_table(
        f"[{args.rows}, {args.depth}, {args.vocab}] float16 logits; first call "
        "(compiles, cold Triton cache) and mean of later calls",
        [
            ("budget", lambda r: r["budget"]),
            ("kind", lambda r: r["kind"]),
            ("first call (s)", lambda r: r["first_call_s"]),
            ("per call (us)", lambda r: r["us_per_call"]),
            ("equal to a stable sort", lambda r: r["equal_to_stable_sort"]),
        ],
        results,
    )
    write_result(args.out, "top_search", results, table)
    ok = all(r["equal_to_stable_sort"] for rows in results.values() for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
