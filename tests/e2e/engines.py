# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Engine configurations shared by the end-to-end tests, and how they are run.

Each configuration runs in its own process (``tests.e2e.generate``). An engine
start costs ~50-80 s on the H200 (compile and CUDA graph capture, mostly CPU), so
``DDTREE_E2E_PARALLEL`` (default 1; ``benchmarks/run_gpu.sh`` sets 5) runs that
many configurations at once on the one GPU. That is safe because every engine
gets a fixed KV cache (``kv_cache_memory_bytes``, which skips vLLM's memory
profiling: that profile fails when another process frees GPU memory meanwhile)
and its own compile cache folder. The reference engines (no speculation, DFlash)
are shared by the test modules that compare against them.

``DDTREE_E2E_CACHE_DIR`` (set by ``benchmarks/run_gpu.sh``) makes that sharing
span pytest runs: the tiny checkpoints are made there once
(deterministic seeds), and each finished configuration's result is stored under
a key of its configuration and of every source file it runs (this checkout's
``vllm/``, ``vllm_ddtree/`` and the e2e helpers), so a changed file never reuses
a stale result.

Test modules may also run side by side (``benchmarks/run_gpu.sh patched``). A
configuration without a fixed KV cache runs vLLM's memory profiling, so it
waits for the GPU to itself: every engine holds ``gpu_share`` while it runs,
shared, and a profiling one holds it alone.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tests.e2e.compare import NUM_LOGPROBS
from tests.e2e.generate import patched_vllm, save_log
from tests.models.tiny_models import make_tiny_dflash, make_tiny_qwen3

ROOT = Path(__file__).resolve().parents[2]
CACHE_ENV = "DDTREE_E2E_CACHE_DIR"
PARALLEL_ENV = "DDTREE_E2E_PARALLEL"
# The lock file test processes on one GPU share (default: in the temp folder).
GPU_LOCK_ENV = "DDTREE_E2E_GPU_LOCK"
ENGINE_TIMEOUT_S = 600
# Far more than the tiny models need (2 KiB of KV per token and layer group).
KV_CACHE_BYTES = 1 << 30

BATCHES = (1, 7, 32)
MAX_TOKENS = 64
DEPTH = 15
GREEDY = {
    "temperature": 0.0,
    "max_tokens": MAX_TOKENS,
    "ignore_eos": True,
    "logprobs": NUM_LOGPROBS,
}
SEEDED = {
    "temperature": 1.0,
    "seed": 1234,
    "max_tokens": MAX_TOKENS,
    "ignore_eos": True,
}


def prompts() -> dict[int, list[list[int]]]:
    """Batches of 1, 7 and 32 prompts of different lengths. The 32 include the
    7 (and so the 1) and four prompts sharing a 300-token prefix."""
    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, 256, (n,), generator=gen).tolist()

    seven = [prompt(n) for n in (3, 17, 64, 150, 299, 511, 700)]
    shared = prompt(300)
    prefix_sharing = [shared + prompt(n) for n in (5, 40, 120, 333)]
    rest = [prompt(int(n)) for n in torch.randint(3, 700, (21,), generator=gen)]
    return {1: seven[:1], 7: seven, 32: seven + prefix_sharing + rest}


def llm_kwargs(target: Path, spec: dict | None = None, **extra) -> dict:
    kwargs = {
        "model": str(target),
        "max_model_len": 2048,
        # A fixed KV cache: no memory profiling, so engines may run side by side.
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "gpu_memory_utilization": 0.1,
        "seed": 0,
        "max_num_seqs": 32,
    }
    if spec is not None:
        kwargs["speculative_config"] = spec
    kwargs.update(extra)
    return kwargs


def greedy_runs() -> list[dict]:
    batches = prompts()
    return [
        {"name": f"b{n}", "prompts": batches[n], "sampling": GREEDY} for n in BATCHES
    ]


def dflash_spec(drafter: Path) -> dict:
    return {"method": "dflash", "model": str(drafter), "num_speculative_tokens": DEPTH}


def reference_configs(target: Path, drafter: Path) -> dict[str, dict]:
    """``ref``: no speculation (FlashAttention), greedy batches plus a seeded
    batch of 7; ``dflash``: vLLM's DFlash chain of 15, greedy batches."""
    return {
        "ref": {
            "llm": llm_kwargs(target),
            "runs": greedy_runs()
            + [{"name": "seeded", "prompts": prompts()[7], "sampling": SEEDED}],
        },
        "dflash": {
            "llm": llm_kwargs(target, dflash_spec(drafter)),
            "runs": greedy_runs(),
        },
    }


def tiny_pair(tmp_dir: Path) -> tuple[Path, Path]:
    """The tiny target and drafter: in the cache folder if set (one per version of
    tests/models/tiny_models.py), else in tmp_dir."""
    cache = os.environ.get(CACHE_ENV)
    if cache:
        maker = ROOT / "tests" / "models" / "tiny_models.py"
        version = hashlib.sha256(maker.read_bytes()).hexdigest()[:16]
        base = Path(cache) / f"models-{version}"
    else:
        base = Path(tmp_dir)
    target, drafter = base / "target", base / "drafter"
    done = base / "complete"
    if not done.exists():
        make_tiny_qwen3(target)
        make_tiny_dflash(drafter, target)
        done.write_text("")
    return target, drafter


def _source_digest() -> str:
    digest = hashlib.sha256()
    # A patched vLLM (generate.PATCHED_VLLM_ENV) is this checkout's series.
    digest.update(str(patched_vllm()).encode())
    files = [
        *sorted((ROOT / "vllm").rglob("*.py")),
        *sorted((ROOT / "vllm_ddtree").rglob("*.py")),
        *sorted((ROOT / "upstream").rglob("*.py")),
        *sorted((ROOT / "upstream" / "edits").glob("*.diff")),
        ROOT / "conftest.py",
        ROOT / "tests" / "e2e" / "generate.py",
        ROOT / "tests" / "models" / "tiny_models.py",
    ]
    for path in files:
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _parallel() -> int:
    value = os.environ.get(PARALLEL_ENV, "1")
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"{PARALLEL_ENV} must be a positive integer, got {value!r}")
    return count


@contextlib.contextmanager
def gpu_share(exclusive: bool) -> Iterator[None]:
    """Hold the GPU with the other test processes on this host (``exclusive``:
    alone, for vLLM's memory profiling, which fails when another process frees
    GPU memory meanwhile). A waiting exclusive holder does not stop new shared
    ones, so it runs once every engine started before it has finished."""
    path = os.environ.get(GPU_LOCK_ENV) or os.path.join(
        tempfile.gettempdir(), "vllm-ddtree-e2e-gpu.lock"
    )
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run_one(name: str, text: str, tmp_dir: Path, log_prefix: str) -> dict:
    cfg, out = tmp_dir / f"{name}.json", tmp_dir / f"{name}.out.json"
    cfg.write_text(text)
    env = dict(os.environ)
    # Engines started side by side must not write the same compile artifacts.
    env["VLLM_CACHE_ROOT"] = str(tmp_dir / "vllm_cache" / name)
    profiled = "kv_cache_memory_bytes" not in json.loads(text)["llm"]
    with gpu_share(exclusive=profiled):
        proc = subprocess.run(
            [sys.executable, "-m", "tests.e2e.generate", str(cfg), str(out)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=ENGINE_TIMEOUT_S,
            check=False,
        )
    save_log(f"{log_prefix}_{name}", proc.stdout)
    if proc.returncode != 0:
        return {"error": proc.stdout[-6000:]}
    return json.loads(out.read_text())


def run_engines(
    configs: dict[str, dict], tmp_dir: Path, log_prefix: str
) -> dict[str, dict]:
    """Run every configuration in a fresh process, ``DDTREE_E2E_PARALLEL`` at a
    time. A failed one is recorded as ``{"error": <output tail>}``, not raised,
    so that the other tests still report."""
    cache = os.environ.get(CACHE_ENV)
    results_dir = Path(cache) / "results" if cache else None
    digest = _source_digest() if cache else ""
    results: dict[str, dict] = {}
    pending: dict[str, tuple[str, Path | None]] = {}
    for name, config in configs.items():
        text = json.dumps(config, sort_keys=True)
        key = hashlib.sha256((digest + text).encode()).hexdigest()[:24]
        cached = results_dir / f"{key}.json" if results_dir else None
        if cached is not None and cached.exists():
            results[name] = json.loads(cached.read_text())
            print(f"{name}: result reused from {cached}")
        else:
            pending[name] = (text, cached)
    with ThreadPoolExecutor(max_workers=_parallel()) as pool:
        futures = {
            name: pool.submit(_run_one, name, text, Path(tmp_dir), log_prefix)
            for name, (text, _) in pending.items()
        }
        for name, future in futures.items():
            result = future.result()
            results[name] = result
            cached = pending[name][1]
            if cached is not None and "error" not in result:
                cached.parent.mkdir(parents=True, exist_ok=True)
                cached.write_text(json.dumps(result))
            print(f"{name}: {'failed' if 'error' in result else 'done'}")
    # In the order given, cached or not.
    return {name: results[name] for name in configs}
