# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Time ``vllm serve`` from launch to ready, for no speculation, DFlash and
DDTree, one server at a time, with cold caches (GPU).

Each server gets an empty vLLM cache root and Triton cache (``--rounds 2``
starts each again on its own warm caches), vLLM's defaults but for the
arguments given (DFlash also gets ``--max-num-seqs 256``, which it needs at
``vllm serve``'s H100/H200 defaults). Ready is the first answer of
``/health``; then one request is served. Every process records the Triton
variants it meets first (``tests/e2e/triton_compile_log``). Per server and
round, ``results.jsonl`` gets: seconds to ready, vLLM's ``init engine`` line,
DDTree's start-up lines (TREE_ATTN warm-up, the adaptive budget's warm-up and
its step-cost profile), and the variants compiled before ready and after
(DDTree's modules, and all). ``results.md`` tabulates them.

    python benchmarks/start_up_time.py --out OUT \\
        --target benchmarks/model_configs/qwen3_8b \\
        --drafter benchmarks/model_configs/dflash_qwen3_8b --load-format dummy
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.checkout import free_port, plugin_site  # noqa: E402

RECORDER = ROOT / "tests" / "e2e" / "triton_compile_log"
DDTREE_MODULES = (
    "vllm.v1.spec_decode.",
    "vllm.v1.sample.tree_rejection_sampler",
    "vllm.v1.attention.ops.tree_kv_compaction",
    "vllm.v1.attention.ops.triton_tree_attention",
    "vllm.v1.attention.backends.tree_attn",
)
# The start-up lines DDTree and vLLM log, by what they time.
LOG_LINES = {
    "tree_attn_warm_up": r"DDTree: TREE_ATTN warmed up over .*",
    "budget_warm_up": r"DDTree: adaptive budget kernels warmed up .*",
    "cost_prior": r"DDTree: adaptive tree budget over .*",
    "init_engine": r"init engine \(profile, create kv cache, warmup model\) took .*",
}
DFLASH_SERVE_MAX_NUM_SEQS = 256


def specs(drafter: str, configs: list[str]) -> dict[str, dict | None]:
    """The speculative config of each named server."""
    known = {
        "none": None,
        "dflash": {"method": "dflash", "model": drafter, "num_speculative_tokens": 15},
        "ddtree": {"method": "ddtree", "model": drafter},
        "ddtree-128": {"method": "ddtree", "model": drafter, "tree_budget": 128},
    }
    unknown = [c for c in configs if c not in known]
    if unknown:
        raise ValueError(f"unknown configs {unknown}; known: {list(known)}")
    return {c: known[c] for c in configs}


def log_lines(text: str) -> dict[str, str]:
    """The last of each start-up line (LOG_LINES) in a server's log."""
    out = {}
    for name, pattern in LOG_LINES.items():
        found = re.findall(pattern, text)
        if found:
            out[name] = found[-1].strip()
    return out


def compiles(log: Path, ready: float) -> dict[str, int]:
    """Variants first met before and after ``ready`` (DDTree's and all)."""
    counts = dict.fromkeys(
        ("before_ready", "ddtree_before_ready", "after_ready", "ddtree_after_ready"),
        0,
    )
    if not log.exists():
        return counts
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        when = "after_ready" if rec["time"] > ready else "before_ready"
        counts[when] += 1
        if rec["module"].startswith(DDTREE_MODULES):
            counts["ddtree_" + when] += 1
    return counts


def serve_once(args, name: str, spec: dict | None, run_dir: Path) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    caches = args.out / "caches" / name
    compile_log = run_dir / f"{name}_compiles.jsonl"
    env = dict(os.environ)
    env.update(
        VLLM_CACHE_ROOT=str(caches / "vllm"),
        TRITON_CACHE_DIR=str(caches / "triton"),
        DDTREE_TRITON_COMPILE_LOG=str(compile_log),
        PYTHONPATH=os.pathsep.join(
            p
            for p in (
                str(RECORDER),
                str(plugin_site(args.out / "site")),
                str(ROOT),
                env.get("PYTHONPATH", ""),
            )
            if p
        ),
    )
    for key, value in (
        ("VLLM_WORKER_MULTIPROC_METHOD", "spawn"),
        ("VLLM_USE_FLASHINFER_SAMPLER", "0"),
        ("VLLM_HOST_IP", "127.0.0.1"),
    ):
        env.setdefault(key, value)
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        args.target,
        "--served-model-name",
        "bench",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        *args.serve_args,
    ]
    if args.load_format == "dummy":
        cmd += ["--load-format", "dummy", "--skip-tokenizer-init"]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    if name == "dflash":
        cmd += ["--max-num-seqs", str(DFLASH_SERVE_MAX_NUM_SEQS)]
    log_path = run_dir / f"{name}.log"
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        error = None
        try:
            ready = _wait_ready(proc, port, start + args.timeout)
            if ready is not None:
                try:
                    _post(port, {"model": "bench", "prompt": list(range(100, 164))})
                except OSError as e:  # reported, not fatal: ready was timed
                    error = repr(e)
                time.sleep(2)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    text = log_path.read_text()
    return {
        "config": name,
        "ready_seconds": None if ready is None else round(ready - start, 1),
        **log_lines(text),
        "compiles": compiles(compile_log, ready or float("inf")),
        "request_error": error,
    }


def _wait_ready(proc, port: int, deadline: float) -> float | None:
    while time.time() < deadline:
        if proc.poll() is not None:
            return None
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return time.time()
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(0.5)
    return None


def _post(port: int, body: dict) -> None:
    body = {**body, "max_tokens": 32, "temperature": 0.0}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    urllib.request.urlopen(request, timeout=300).read()


def table(rows: list[dict]) -> str:
    lines = [
        (
            "| round | config | ready s | TREE_ATTN warm-up | budget warm-up | "
            "cost prior | DDTree variants before / after ready |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        c = row["compiles"]
        cells = [
            str(row["round"]),
            row["config"],
            str(row["ready_seconds"]),
            *(
                _seconds(row.get(k, ""))
                for k in ("tree_attn_warm_up", "budget_warm_up", "cost_prior")
            ),
            f"{c['ddtree_before_ready']} / {c['ddtree_after_ready']}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _seconds(line: str) -> str:
    """The first ``in X s`` of a log line ('' without one)."""
    found = re.search(r"in ([0-9.]+) s", line)
    return found.group(1) if found else ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--configs", default="none,dflash,ddtree")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    p.add_argument("--rounds", type=int, default=1, help="2: again, caches warm")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument(
        "--serve-arg",
        dest="serve_args",
        action="append",
        default=[],
        help="extra vllm serve argument (repeat; e.g. --serve-arg=--max-model-len)",
    )
    args = p.parse_args(argv)
    servers = specs(args.drafter, args.configs.split(","))
    if (args.out / "caches").exists():
        p.error(f"{args.out}/caches exists: the first round must start cold")
    rows = []
    for r in range(1, args.rounds + 1):
        for name, spec in servers.items():
            row = {"round": r, **serve_once(args, name, spec, args.out / f"round{r}")}
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(args.out / "results.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
    (args.out / "results.md").write_text(table(rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
