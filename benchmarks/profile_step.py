# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where the time of one decode step goes: the GPU kernels of one decode step,
by category, for a few engine configs (no speculation, DFlash, DDTree budgets),
measured with ``torch.profiler`` on the engines of ``bench_ddtree.py cost``.

Engines: the Qwen3-8B-shaped target and DFlash-8B-shaped drafter of
``benchmarks/model_configs`` (``load_format="dummy"``, no tokenizer), random
prompts of ``--input-len`` tokens, ``ignore_eos``, CUDA graphs on, the engine
arguments and speculative configs of ``bench_ddtree.py`` (its functions). Each
config runs in its own process, one after another, with the engine in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the profiler of that process sees the
worker's kernels, those replayed from CUDA graphs included (CUPTI records every
kernel node of a graph launch).

Per config: start the engine; warm up (one generation); time the ``--batch``
requests unprofiled, prefill only (``max_tokens=1``) and whole
(``--max-tokens``); then profile the same two generations. The decode phase is
their difference, as in ``bench_ddtree.py``: per category, kernel time of the
whole generation minus that of the prefill-only one, divided by the difference of
their step counts (observations of ``vllm:iteration_tokens_total``).

Two variants: ``--pair DIR`` profiles a trained pair (``benchmarks/train_pair``'s
directory: real weights, its held-out prompts, stop at EOS) instead of the 8B
shapes; ``--requests N`` (> ``--batch``) sends N requests at once into an engine
of ``max_num_seqs = --batch``, output lengths staggered, so new prefills keep
joining the running trees as behind ``vllm serve``. Its per-step numbers are then
the average step of such a run, with the work of the same prefills run alone
subtracted (what mixing costs on top stays in).

Outputs in ``--out``:

* ``<config>.json``: microseconds of kernel time per decode step per category,
  GPU-busy time (union of kernel intervals), wall time per decode step (unprofiled
  and profiled), kernel and launch counts, whether graph-replayed kernels were
  recorded, the top ``--top`` kernels by time, and the GPU's SM clock and power
  over the unprofiled whole generation (NVML, every 50 ms, from a thread that
  holds the GIL only between samples);
* ``profile.md``: the host table (CPU time per decode step in the engine's and
  the speculator's methods, from ``torch.profiler.record_function`` scopes the
  worker wraps around them while it profiles: ``HOST_SCOPES``), then the kernel
  table (rows: categories, columns: configs, us per decode step, with
  kernel-total and wall ratios to DFlash), printed last;
* ``profile.log``: the configs' engine logs;
* ``<config>.trace.json.gz``: the Chrome trace of the profiled generation, only
  with ``--trace`` (large).

The kernel categories are a pure function of the kernel names
(``categorize``), tested on the CPU. See docs/bench_ddtree.md ("Profile of one
step").

    python benchmarks/profile_step.py --out OUT --configs dflash,ddtree-32,ddtree-128
    python benchmarks/profile_step.py --out OUT --report-only   # rebuild profile.md
"""

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bench_ddtree_config as bdc
from benchmarks import bench_ddtree_offline as bdo
from benchmarks import bench_ddtree_procs as bdp
from benchmarks import bench_ddtree_report as rep

REPORT_FILE = "profile.md"
LOG_FILE = "profile.log"
TRACE_SUFFIX = ".trace.json.gz"
DEFAULT_CONFIGS = "dflash,ddtree-32,ddtree-128"
DEFAULT_TARGET = bdc.MODEL_CONFIGS / "qwen3_8b"
DEFAULT_DRAFTER = bdc.MODEL_CONFIGS / "dflash_qwen3_8b"

# ---------------------------------------------------------------------------
# Kernel categories (pure functions of the kernel names)
# ---------------------------------------------------------------------------

# (key, label), in table order.
CATEGORIES = (
    ("gemm", "GEMM (cuBLAS / CUTLASS / nvjet; target + drafter)"),
    ("flash_attn", "FlashAttention"),
    ("tree_attn", "TREE_ATTN (Triton tree kernel, merges)"),
    ("tree_ops", "DDTree tree ops (build, walk, compaction, inputs)"),
    ("input_prep", "vLLM input prep (slot mapping, spec-decode inputs)"),
    ("sampling", "sampling / rejection (top-k, softmax, argmax, sort, rng)"),
    ("kv_cache", "KV-cache write"),
    ("elementwise", "norm / act / rope / elementwise (Triton, inductor, ATen)"),
    ("memcpy", "memcpy / memset"),
    ("other", "other"),
)
CATEGORY_KEYS = tuple(key for key, _ in CATEGORIES)

# The Triton kernels of this repo's DDTree modules (function names, which are
# the kernel names CUPTI reports). tests/benchmarks/test_profile_step.py checks
# that every @triton.jit ``*_kernel`` of those files is listed here.
TREE_OPS_KERNELS = (
    # vllm/v1/spec_decode/dflash_tree_builder.py
    "_rank_row_kernel",
    "_chunk_stats_kernel",
    "_top_threshold_kernel",
    "_gather_top_kernel",
    "_sort_top_kernel",
    "_ddtree_select_kernel",
    # vllm/v1/sample/tree_rejection_sampler.py
    "_tree_walk_kernel",
    "_tree_penalties_kernel",
    "_tree_bad_words_kernel",
    # vllm/v1/attention/ops/tree_kv_compaction.py
    "_tree_kv_compaction_kernel",
    # vllm/v1/spec_decode/ddtree_inputs.py
    "_write_tree_verify_inputs_kernel",
    "_prepare_draft_inputs_kernel",
    "_store_draft_trees_kernel",
)
# vllm/v1/attention/ops/triton_tree_attention.py
TREE_ATTN_KERNELS = (
    "_tree_attention_kernel",
    "_merge_splits_kernel",
)
# vLLM's merge_attn_states (CUDA or Triton) joins FlashAttention's cascade over a
# shared prefix (prefix caching).
FLASH_ATTN_MARKS = ("flash::", "flash_fwd", "FlashAttn", "merge_attn_states")
# Lower-case substrings.
GEMM_MARKS = (
    "gemm",
    "gemv",
    "nvjet",
    "cutlass",
    "cublas",
    "xmma",
    "splitkreduce",
    "matmul",
)
INPUT_PREP_MARKS = (
    "slot_mapping",
    "eagle_",
    "copy_and_expand",
    "prepare_inputs",
    "prepare_next_token",
    "_prepare_",
    "block_table",
)
SAMPLING_MARKS = (
    "rejection_",
    "sample_recovered_tokens",
    "expand_kernel",
    "topk",
    "top_k",
    "softmax",
    "argmax",
    "sort",
    "exponential",
    "multinomial",
    "gumbel",
    "sampl",
    "distribution_",
)
KV_CACHE_MARKS = ("reshape_and_cache", "concat_and_cache")
ELEMENTWISE_MARKS = (
    "rms_norm",
    "rmsnorm",
    "layer_norm",
    "layernorm",
    "rotary",
    "rope",
    "act_and_mul",
    "silu",
    "gelu",
    "elementwise",
    "reduce_kernel",
    "fill",
    "copy",
    "index",
    "gather",
    "scatter",
    "catarray",
    "where",
    "arange",
    "cumsum",
    "scan",
)
# CUPTI synchronization records (kineto's cuda_sync): waiting, not kernels.
SYNC_NAMES = frozenset(
    {"Event Sync", "Stream Wait Event", "Stream Sync", "Context Sync", "Unknown"}
)
# CUDA runtime calls (CPU side) that launch work.
GRAPH_LAUNCH_MARK = "GraphLaunch"  # cudaGraphLaunch, cuGraphLaunch, ..._v10000
KERNEL_LAUNCH_MARKS = ("LaunchKernel", "LaunchCooperativeKernel")
# CUDA runtime calls where the CPU waits for the GPU.
HOST_SYNC_NAMES = frozenset(
    {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"}
)

# Host (CPU) scopes of one engine step: methods of vLLM's engine and of the
# speculators that the worker wraps in torch.profiler.record_function while it
# profiles (instrument_host_scopes), so a profile also says where the host's time
# goes when the GPU waits for it (a small model's step). Rows of the host table:
# (label, indent, module, class, method); a scope's time contains the scopes
# indented under it. One label may name several classes' methods (DFlash's and
# DDTree's counterparts; a config runs one of them, or a subclass's calls its
# parent's, which then records nothing of its own).
_MR = "vllm.v1.worker.gpu.model_runner"
_ATTN = "attention metadata (model state prepare_attn)"
_WALK = "rejection sampler / tree walk"
_PROPOSE = "propose (KV compaction, drafter, tree build)"
_EAGER_ATTN = "attention layers run outside full graphs (in execute_model / propose)"
HOST_SCOPES = (
    (
        "engine step (LLMEngine.step)",
        0,
        "vllm.v1.engine.llm_engine",
        "LLMEngine",
        "step",
    ),
    ("schedule", 1, "vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    (
        "execute_model (inputs, target forward launch)",
        1,
        _MR,
        "GPUModelRunner",
        "execute_model",
    ),
    ("prepare_inputs", 2, _MR, "GPUModelRunner", "prepare_inputs"),
    (
        "block tables, slot mappings (runner prepare_attn)",
        2,
        _MR,
        "GPUModelRunner",
        "prepare_attn",
    ),
    (
        _ATTN,
        2,
        "vllm.v1.worker.gpu.model_states.default",
        "DefaultModelState",
        "prepare_attn",
    ),
    (_ATTN, 2, "vllm.v1.spec_decode.ddtree_verify", "DDTreeModelState", "prepare_attn"),
    (
        "sample_tokens (sampling / walk, drafting)",
        1,
        _MR,
        "GPUModelRunner",
        "sample_tokens",
    ),
    ("sample (logits to tokens)", 2, _MR, "GPUModelRunner", "sample"),
    (
        _WALK,
        3,
        "vllm.v1.worker.gpu.spec_decode.rejection_sampler",
        "RejectionSampler",
        "__call__",
    ),
    (
        _WALK,
        3,
        "vllm.v1.sample.tree_rejection_sampler",
        "TreeRejectionSampler",
        "__call__",
    ),
    (
        "postprocess_sampled (request state)",
        2,
        _MR,
        "GPUModelRunner",
        "postprocess_sampled",
    ),
    (
        _PROPOSE,
        2,
        "vllm.v1.worker.gpu.spec_decode.dflash.speculator",
        "DFlashSpeculator",
        "propose",
    ),
    (_PROPOSE, 2, "vllm.v1.spec_decode.ddtree", "DDTreeSpeculator", "propose"),
    (
        "wait for the step's tokens (AsyncOutput.get_output)",
        1,
        "vllm.v1.worker.gpu.async_utils",
        "AsyncOutput",
        "get_output",
    ),
    (
        "update_from_output",
        1,
        "vllm.v1.core.sched.scheduler",
        "Scheduler",
        "update_from_output",
    ),
    (
        "process_outputs (detokenize, request outputs)",
        1,
        "vllm.v1.engine.output_processor",
        "OutputProcessor",
        "process_outputs",
    ),
    # Attention layers that run outside a full CUDA graph (piecewise or eager
    # steps, target or drafter): a replayed graph calls no Python, so the calls
    # per step say how many layers ran eagerly.
    (
        _EAGER_ATTN,
        1,
        "vllm.v1.attention.backends.flash_attn",
        "FlashAttentionImpl",
        "forward",
    ),
    (
        _EAGER_ATTN,
        1,
        "vllm.v1.attention.backends.tree_attn",
        "TreeAttentionImpl",
        "forward",
    ),
)
# Scopes record only while this is set (the profiled generations), so the
# unprofiled timing runs the methods as they are.
_HOST_SCOPES_ON = threading.Event()


def categorize(name: str) -> str:
    """The category key of one GPU activity (kernel, memcpy or memset) by name;
    the first rule that matches wins."""
    low = name.lower()
    if low.startswith(("memcpy", "memset")):
        return "memcpy"
    if any(k in name for k in TREE_OPS_KERNELS):
        return "tree_ops"
    if any(k in name for k in TREE_ATTN_KERNELS):
        return "tree_attn"
    if any(k in name for k in FLASH_ATTN_MARKS):
        return "flash_attn"
    if low.startswith("triton_tem_"):  # inductor's GEMM templates
        return "gemm"
    if low.startswith("triton_"):  # inductor's pointwise / reduction / persistent
        return "elementwise"
    if any(k in low for k in GEMM_MARKS):
        return "gemm"
    if any(k in low for k in INPUT_PREP_MARKS):
        return "input_prep"
    if any(k in low for k in KV_CACHE_MARKS):
        return "kv_cache"
    if any(k in low for k in SAMPLING_MARKS):
        return "sampling"
    if any(k in low for k in ELEMENTWISE_MARKS):
        return "elementwise"
    return "other"


def is_sync(name: str) -> bool:
    return name in SYNC_NAMES


def aggregate(events: Iterable[Sequence]) -> dict:
    """``(name, duration_us, ...)`` GPU events -> totals per category and per
    kernel name. Synchronization records are left out (counted in
    ``sync_count``)."""
    categories = dict.fromkeys(CATEGORY_KEYS, 0.0)
    kernels: dict[str, list] = {}
    total, count, sync, copies = 0.0, 0, 0, 0
    for event in events:
        name, dur = str(event[0]), float(event[1])
        if is_sync(name):
            sync += 1
            continue
        category = categorize(name)
        categories[category] += dur
        copies += category == "memcpy"
        entry = kernels.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += dur
        total += dur
        count += 1
    return {
        "categories": categories,
        "kernels": kernels,
        "total_us": total,
        "count": count,
        "memcpy_count": copies,
        "sync_count": sync,
    }


def busy_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: time the GPU ran
    something (overlapping streams count once)."""
    busy, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy


def make_window(
    events: Sequence[Sequence],
    *,
    steps: int,
    wall_s: float,
    graph_launches: int = 0,
    kernel_launches: int = 0,
    graph_kernels: int = 0,
    linked_kernels: int = 0,
    host_syncs: int = 0,
    host_sync_us: float = 0.0,
    host_scopes: Mapping[str, float] | None = None,
    host_scope_calls: Mapping[str, int] | None = None,
    eager_kernels: Mapping[str, int] | None = None,
) -> dict:
    """One profiled generation: ``events`` are ``(name, duration_us[, start_us])``;
    ``steps`` its engine steps (from vLLM's metrics); ``host_scopes`` the CPU
    time (us) of each host scope and ``host_scope_calls`` its calls,
    ``host_sync_us`` the CPU time spent in synchronizing CUDA calls,
    ``eager_kernels`` the kernels launched one by one from the host (not from a
    CUDA graph), by name."""
    window = aggregate(events)
    spans = [
        (float(e[2]), float(e[2]) + float(e[1]))
        for e in events
        if len(e) > 2 and not is_sync(str(e[0]))
    ]
    window.update(
        steps=int(steps),
        wall_s=float(wall_s),
        busy_us=busy_us(spans) if spans else window["total_us"],
        graph_launches=int(graph_launches),
        kernel_launches=int(kernel_launches),
        graph_kernels=int(graph_kernels),
        linked_kernels=int(linked_kernels),
        host_syncs=int(host_syncs),
        host_sync_us=float(host_sync_us),
        host_scopes={str(k): float(v) for k, v in (host_scopes or {}).items()},
        host_scope_calls={str(k): int(v) for k, v in (host_scope_calls or {}).items()},
        eager_kernels={str(k): int(v) for k, v in (eager_kernels or {}).items()},
    )
    return window


def graph_status(
    graph_launches: float,
    graph_kernels: float,
    linked_kernels: float,
    kernels: float,
    kernel_launches: float,
) -> str:
    """Did the profiler see the kernels replayed from CUDA graphs?

    Arguments are counts (or per-step counts) of one window: graph launches,
    kernels correlated with a graph launch, kernels correlated with an eager
    launch, kernels (memcpy/memset excluded) and eager kernel launches.

    ``recorded``: kernels correlated with a graph launch were seen;
    ``missing``: graphs were launched but none of their kernels was recorded, so
    the categories cover eager kernels only (vLLM's ``compute_logits`` GEMMs
    among them); ``unlinked``: no kernel could be correlated with any launch, but
    there are more kernels than eager launches, so the graphs' kernels are most
    likely there; ``no graphs``: nothing was launched from a graph."""
    if graph_launches <= 0:
        return "no graphs"
    if graph_kernels > 0:
        return "recorded"
    if linked_kernels > 0:  # correlation works for eager launches, not graphs
        return "missing"
    return "unlinked" if kernels - kernel_launches >= graph_launches else "missing"


def decode_breakdown(
    full: Mapping, prefill: Mapping, *, wall_us: float | None = None, top: int = 25
) -> dict:
    """Per decode step numbers: (``full`` - ``prefill``) / (their step difference).

    ``full`` and ``prefill`` are ``make_window`` dicts of the whole generation and
    of the same requests with max_tokens=1; ``wall_us`` the unprofiled wall time
    per decode step (``busy_fraction`` is GPU-busy time over it; the profiled
    wall when None)."""
    steps = int(full["steps"]) - int(prefill["steps"])
    if steps <= 0:
        raise ValueError(
            f"no decode steps: {full['steps']} steps in the whole generation, "
            f"{prefill['steps']} prefill-only"
        )

    def per_step(key: str) -> float:
        return (float(full[key]) - float(prefill[key])) / steps

    categories = {
        k: (full["categories"].get(k, 0.0) - prefill["categories"].get(k, 0.0)) / steps
        for k in CATEGORY_KEYS
    }
    kernels = []
    for name, (count, us) in full["kernels"].items():
        p_count, p_us = prefill["kernels"].get(name, (0, 0.0))
        kernels.append(
            {
                "name": name,
                "category": categorize(name),
                "us_per_step": (us - p_us) / steps,
                "count_per_step": (count - p_count) / steps,
            }
        )
    kernels.sort(key=lambda k: -k["us_per_step"])
    wall_profiled = 1e6 * (float(full["wall_s"]) - float(prefill["wall_s"])) / steps
    busy = per_step("busy_us")
    out = {
        "steps": steps,
        "categories_us": categories,
        "kernel_us": per_step("total_us"),
        "busy_us": busy,
        "wall_us": wall_us,
        "wall_us_profiled": wall_profiled,
        "kernels": per_step("count") - per_step("memcpy_count"),
        "memcpys": per_step("memcpy_count"),
        "kernel_launches": per_step("kernel_launches"),
        "graph_launches": per_step("graph_launches"),
        "graph_kernels": per_step("graph_kernels"),
        "linked_kernels": per_step("linked_kernels"),
        "host_syncs": per_step("host_syncs"),
        "host_sync_us": per_step("host_sync_us"),
        "host_scopes_us": host_scope_breakdown(full, prefill, steps),
        "host_scope_calls": host_scope_breakdown(
            full, prefill, steps, "host_scope_calls"
        ),
        "top_kernels": kernels[:top],
        "eager_kernels_per_step": eager_kernels_per_step(full, prefill, steps),
    }
    base = wall_us if wall_us else wall_profiled
    out["busy_fraction"] = busy / base if base > 0 else None
    out["graph_kernels_status"] = graph_status(
        out["graph_launches"],
        out["graph_kernels"],
        out["linked_kernels"],
        out["kernels"],
        out["kernel_launches"],
    )
    return out


def eager_kernels_per_step(full: Mapping, prefill: Mapping, steps: int) -> dict:
    """Kernels launched from the host per decode step, by name, most first (the
    whole generation's less the prefill-only pass's; windows without the
    record, from older results, give {})."""
    per = host_scope_breakdown(full, prefill, steps, "eager_kernels")
    return dict(sorted(((n, c) for n, c in per.items() if c > 0), key=lambda x: -x[1]))


def repeated_timing(repeats: Sequence[Mapping]) -> dict:
    """The first timing, with ``decode_ms_per_step`` the median over all repeats
    and ``decode_ms_per_step_runs`` each repeat's (one repeat: as it is)."""
    timing = dict(repeats[0])
    if len(repeats) > 1:
        runs = [r["decode_ms_per_step"] for r in repeats]
        valid = [v for v in runs if v is not None]
        timing["decode_ms_per_step_runs"] = runs
        timing["decode_ms_per_step"] = statistics.median(valid) if valid else None
    return timing


def host_scope_breakdown(
    full: Mapping, prefill: Mapping, steps: int, key: str = "host_scopes"
) -> dict:
    """Per decode step, every name either window recorded under ``key``: a host
    scope's time (us), with ``key="host_scope_calls"`` its calls, with
    ``"eager_kernels"`` a kernel's launches from the host."""
    f, p = full.get(key) or {}, prefill.get(key) or {}
    return {
        name: (f.get(name, 0.0) - p.get(name, 0.0)) / steps
        for name in sorted(set(f) | set(p))
    }


# ---------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------

GRAPH_WARNING = (
    "CUDA-graph kernels were NOT recorded for {configs} (graphs were launched, "
    "none of their kernels was seen): their category rows, kernel total and GPU "
    "busy cover eager kernels only; their wall times and launch counts still "
    "hold. Try again with --init-profiler-early, or use nsys."
)


# ---------------------------------------------------------------------------
# GPU clocks and power while the unprofiled generation runs (NVML through vLLM's
# vendored pynvml): a kernel slower per call in one config than in another may
# be the same work at a lower clock (power limit), not more work.
# ---------------------------------------------------------------------------

# NVML clock event reasons (nvmlClocksEventReason*): software power cap and
# hardware power brake; software / hardware thermal slowdown and hardware
# slowdown.
POWER_REASONS = 0x4 | 0x80
THERMAL_REASONS = 0x8 | 0x20 | 0x40
SAMPLE_INTERVAL_S = 0.05


def summarize_samples(samples: Sequence[tuple]) -> dict | None:
    """(SM clock MHz, power W, event-reason bits or None) samples -> means,
    extremes and the share of samples held back by power or heat; None
    without samples."""
    if not samples:
        return None
    clocks = [c for c, _, _ in samples]
    power = [w for _, w, _ in samples]
    reasons = [r for _, _, r in samples if r is not None]

    def share(bits: int) -> float | None:
        return sum(1 for r in reasons if r & bits) / len(reasons) if reasons else None

    return {
        "samples": len(samples),
        "sm_clock_mhz_mean": sum(clocks) / len(clocks),
        "sm_clock_mhz_min": min(clocks),
        "sm_clock_mhz_max": max(clocks),
        "power_w_mean": sum(power) / len(power),
        "power_w_max": max(power),
        "power_limited_share": share(POWER_REASONS),
        "thermal_limited_share": share(THERMAL_REASONS),
    }


class GpuSampler:
    """``with GpuSampler(read): ...`` calls ``read()`` (-> one sample) every
    ``interval_s`` in a thread while the block runs; ``summary()`` after it.
    Errors of ``read`` end the sampling, never the run."""

    def __init__(self, read, interval_s: float = SAMPLE_INTERVAL_S):
        self._read, self._interval = read, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.samples: list[tuple] = []
        self.error: str | None = None

    def _loop(self) -> None:
        while True:
            try:
                self.samples.append(tuple(self._read()))
            except Exception as e:  # NVML can fail mid-run (driver, permissions)
                self.error = f"{type(e).__name__}: {e}"
                return
            if self._stop.wait(self._interval):
                return

    def __enter__(self) -> "GpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict | None:
        out = summarize_samples(self.samples)
        if out is not None and self.error:
            out["error"] = self.error
        return out


def nvml_reader(visible_index: int = 0):
    """A ``read()`` for :class:`GpuSampler` on the process's GPU
    ``visible_index`` (CUDA_VISIBLE_DEVICES mapped to NVML's physical index),
    or None where NVML is not available."""
    try:
        from vllm.platforms import current_platform
        from vllm.third_party import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(
            current_platform.visible_device_id_to_physical_device_id(visible_index)
        )
    except Exception as e:
        print(f"profile_step worker: GPU clocks not sampled ({e})", flush=True)
        return None

    # The clock event reasons under their current name, else the older one
    # (drivers before 535), else none; chosen once, not per sample.
    reasons = None
    for name in (
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
    ):
        try:
            getattr(pynvml, name)(handle)
        except Exception:
            continue
        reasons = getattr(pynvml, name)
        break

    def read():
        return (
            pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
            pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            None if reasons is None else reasons(handle),
        )

    return read


def _us(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def short_name(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def markdown_report(results: Sequence[Mapping], top: int = 5) -> str:
    """``<config>.json`` dicts -> ``profile.md``: setup, the top kernels of each
    config, then the table (rows: categories and totals, columns: configs)."""
    results = sorted(results, key=lambda r: rep.config_order(r["config"]))
    if not results:
        return "# Profile of one decode step\n\nNo profiled config.\n"
    configs = [r["config"] for r in results]
    decode = [r["decode"] for r in results]
    setup = results[0].get("setup", {})
    info = setup.get("info", {})
    gpus = sorted({str(r.get("info", {}).get("gpu", "?")) for r in results})
    models = (
        f"{Path(str(info.get('target', 'target'))).name} / "
        f"{Path(str(info.get('drafter', 'drafter'))).name}"
    )
    if "prompts" in info:
        inputs = (
            f"held-out prompts of {info['prompts']}, stop at EOS, {models} "
            "(trained weights)"
        )
    else:
        inputs = (
            f"{setup.get('input_len')}-token random prompts, {models} (dummy weights)"
        )
    requests = setup.get("requests")
    arrivals = (
        ""
        if requests is None
        else f", {requests} requests arriving as others finish (output lengths "
        "staggered)"
    )
    settings = (
        "vLLM's engine defaults (prefix caching on, each method's capture sizes)"
        if setup.get("settings") == "defaults"
        else "tuned engine settings (prefix caching off, the request ladder's "
        "capture sizes)"
    )
    lines = [
        "# Profile of one decode step",
        "",
        (
            f"`benchmarks/profile_step.py`: batch {setup.get('batch')}{arrivals}, "
            f"{setup.get('max_tokens')} output tokens, {inputs}, {settings}, CUDA "
            f"graphs on; GPU: {', '.join(gpus)}."
        ),
        "",
        (
            "Microseconds per decode step = (whole generation - the same requests "
            "with max_tokens=1) / (their step difference), from torch.profiler "
            "(CUPTI) kernel durations. Kernel total is the sum of kernel durations, "
            "GPU busy the union of their intervals; GPU-busy fraction = GPU busy / "
            "unprofiled wall, so 1 - it is CPU, launch and synchronisation time the "
            "GPU waited on."
        ),
        "",
    ]
    missing = [
        c for c, d in zip(configs, decode) if d.get("graph_kernels_status") == "missing"
    ]
    if missing:
        lines += ["**" + GRAPH_WARNING.format(configs=", ".join(missing)) + "**", ""]
    for config, d in zip(configs, decode):
        lines.append(f"Top kernels, {config} (us / step, calls / step):")
        lines.append("")
        for k in d.get("top_kernels", [])[:top]:
            lines.append(
                f"* {k['us_per_step']:.1f} us, {k['count_per_step']:.2f}x "
                f"[{k['category']}] `{short_name(k['name'])}`"
            )
        lines.append("")
    base = decode[configs.index("dflash")] if "dflash" in configs else None
    rows = [
        [label] + [_us(d["categories_us"].get(key)) for d in decode]
        for key, label in CATEGORIES
    ]
    rows += [
        ["**kernel total**"] + [f"**{_us(d['kernel_us'])}**" for d in decode],
        ["x DFlash (kernel total)"]
        + [_ratio(d["kernel_us"], base and base["kernel_us"]) for d in decode],
        ["GPU busy (union of kernels)"] + [_us(d["busy_us"]) for d in decode],
        ["wall / decode step, unprofiled"] + [_us(d.get("wall_us")) for d in decode],
        ["x DFlash (wall)"]
        + [_ratio(d.get("wall_us"), base and base.get("wall_us")) for d in decode],
    ]
    runs = [(r.get("unprofiled") or {}).get("decode_ms_per_step_runs") for r in results]
    if any(runs):
        rows.append(
            ["wall / decode step, unprofiled: runs (min - max)"]
            + [
                "-"
                if not x or None in x
                else f"{len(x)}: {1000 * min(x):.1f} - {1000 * max(x):.1f}"
                for x in runs
            ]
        )
    rows += [
        ["wall / decode step, profiled"] + [_us(d["wall_us_profiled"]) for d in decode],
        ["GPU-busy fraction"]
        + [
            "-"
            if d.get("busy_fraction") is None
            else f"{100 * d['busy_fraction']:.0f}%"
            for d in decode
        ],
        ["decode steps profiled"] + [str(d["steps"]) for d in decode],
        ["kernels / step"] + [f"{d['kernels']:.0f}" for d in decode],
        ["eager kernel launches / step"]
        + [f"{d['kernel_launches']:.0f}" for d in decode],
        ["graph launches / step"] + [f"{d['graph_launches']:.1f}" for d in decode],
        ["host syncs / step"] + [f"{d.get('host_syncs', 0):.1f}" for d in decode],
        ["graph kernels recorded"]
        + [str(d.get("graph_kernels_status")) for d in decode],
        ["accept len"] + [rep.fmt(r.get("acceptance_length")) for r in results],
    ]
    clocks = [r.get("gpu_clocks") for r in results]
    if any(clocks):
        rows += [
            ["SM clock, unprofiled run (MHz, mean / min)"]
            + [
                "-"
                if c is None
                else f"{c['sm_clock_mhz_mean']:.0f} / {c['sm_clock_mhz_min']:.0f}"
                for c in clocks
            ],
            ["power, unprofiled run (W, mean / max)"]
            + [
                "-"
                if c is None
                else f"{c['power_w_mean']:.0f} / {c['power_w_max']:.0f}"
                for c in clocks
            ],
            ["samples held back by power (by heat)"]
            + [
                "-"
                if c is None or c.get("power_limited_share") is None
                else f"{100 * c['power_limited_share']:.0f}% "
                f"({100 * c['thermal_limited_share']:.0f}%)"
                for c in clocks
            ],
        ]
    places = [r.get("info", {}).get("host") for r in results]
    if any(places):
        rows.append(
            ["host: CPU / NUMA node at the end, resident memory per node, GPU's node"]
            + [placement_cell(p) for p in places]
        )
    host = host_table(configs, decode)
    if host:
        lines += [host, ""]
    eager = eager_table(configs, decode)
    if eager:
        lines += [eager, ""]
    lines.append(rep.markdown_table(["us / decode step"] + configs, rows))
    return "\n".join(lines) + "\n"


def eager_table(
    configs: Sequence[str], decode: Sequence[Mapping], most: int = 40
) -> str | None:
    """Kernels launched from the host per decode step, side by side (the host
    cost a CUDA graph does not hide), or None where no config recorded them."""
    per = [d.get("eager_kernels_per_step") or {} for d in decode]
    if not any(per):
        return None
    names = sorted(
        {n for p in per for n in p}, key=lambda n: -max(p.get(n, 0) for p in per)
    )
    rows = [
        [f"`{short_name(n)}`"] + [f"{p[n]:.2f}" if n in p else "-" for p in per]
        for n in names[:most]
    ]
    rows.append(["**all**"] + [f"**{sum(p.values()):.1f}**" for p in per])
    text = rep.markdown_table(["eager launches / decode step"] + list(configs), rows)
    left = len(names) - most
    more = f" ({left} more kernels not listed)" if left > 0 else ""
    return (
        "Kernels launched from the host, one by one, per decode step (not from a "
        f"CUDA graph){more}:\n\n" + text
    )


def placement_cell(place: Mapping | None) -> str:
    """One table cell from ``bdo.host_placement()``: the profiled process's last
    CPU and its node, its resident memory per node, and the GPU's node."""
    if not place or not place.get("processes"):
        return "-"
    me = place["processes"][0]
    memory = ", ".join(
        f"N{n}: {int(c) / 1024:.0f} MiB"
        for n, c in sorted(me.get("kib_per_node", {}).items())
    )
    text = (
        f"CPU {me['last_cpu']} / node {me['cpu_node']}; {memory or '-'}; "
        f"GPU node {place.get('gpu_numa_node')}"
    )
    # The busiest thread besides the main one, and whether it ran on the main
    # thread's core (an SMT sibling or the same CPU) when sampled.
    threads = me.get("threads") or []
    main = next((t for t in threads if t["tid"] == me["pid"]), None)
    other = next((t for t in threads if t["tid"] != me["pid"]), None)
    if other is not None:
        core = None if main is None else main.get("core")
        shared = core is not None and other.get("core") == core
        text += f"; next thread `{other['name']}` {other['cpu_s']:.1f} s CPU" + (
            ", on the main thread's core" if shared else ""
        )
    return text


def host_table(configs: Sequence[str], decode: Sequence[Mapping]) -> str | None:
    """The host (CPU) scopes per decode step, or None where no config recorded
    any (results of an older profile_step)."""
    scopes = [d.get("host_scopes_us") or {} for d in decode]
    calls = [d.get("host_scope_calls") or {} for d in decode]
    if not any(scopes):
        return None
    rows, seen = [], set()
    for label, indent, *_ in HOST_SCOPES:
        if label in seen:
            continue
        seen.add(label)
        rows.append(
            ["&nbsp;&nbsp;" * indent + label]
            + [_scope_cell(s, c, label) for s, c in zip(scopes, calls)]
        )
    rows += [
        ["CUDA synchronize calls (host waits for the GPU)"]
        + [_us(d.get("host_sync_us")) for d in decode],
        ["wall / decode step, profiled"] + [_us(d["wall_us_profiled"]) for d in decode],
        ["GPU busy (union of kernels)"] + [_us(d["busy_us"]) for d in decode],
    ]
    text = rep.markdown_table(["host us / decode step (calls)"] + configs, rows)
    return (
        "Host (CPU) time per decode step in vLLM's engine and the "
        "speculator, from record_function scopes around their methods "
        "(profiled run; a scope's time contains the scopes indented under "
        "it; calls per step in parentheses):\n\n" + text
    )


def _scope_cell(us: Mapping, calls: Mapping, label: str) -> str:
    if label not in us:
        return "-"
    n = calls.get(label)
    return _us(us[label]) + ("" if n is None else f" ({n:.1f})")


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(mode="cost")  # what bench_ddtree's engine_kwargs reads
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="output directory (created; reused to resume)",
    )
    p.add_argument(
        "--resume-from",
        type=Path,
        nargs="*",
        default=[],
        help="earlier --out directories whose configs count as done",
    )
    p.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help="comma list of none, dflash, ddtree-<B>, ddtree (every "
        f"budget of bench_ddtree), {rep.AUTO_CONFIG}, "
        f"{rep.SCHEDULE_CONFIG} (needs --schedule)",
    )
    p.add_argument(
        "--schedule",
        default=None,
        help=f"{rep.SCHEDULE_CONFIG}'s tree_budget_per_batch_size "
        "(JSON or a file), as in bench_ddtree.py",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=1,
        help="requests generated at once (the decode batch)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per generation (default: --batch). More than "
        "--batch: all go in at once and the engine (max_num_seqs "
        "= --batch) admits one as one finishes, so steps mix "
        "prefill and decode as behind vllm serve; their output "
        "lengths are staggered over [max-tokens / 2, max-tokens]",
    )
    p.add_argument(
        "--pair",
        type=Path,
        default=None,
        help="a trained pair's directory (benchmarks/train_pair: "
        "target/, drafter/, eval_prompts.json): real weights, its "
        "held-out prompts, stop at EOS, instead of the 8B shapes' "
        "dummy weights and random prompts",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=64,
        help="output tokens per request (ignore_eos)",
    )
    p.add_argument(
        "--input-len", type=int, default=1024, help="random prompt length in tokens"
    )
    p.add_argument(
        "--target",
        type=Path,
        default=DEFAULT_TARGET,
        help="target model directory (config.json; dummy weights)",
    )
    p.add_argument(
        "--drafter",
        type=Path,
        default=DEFAULT_DRAFTER,
        help="DFlash drafter directory (config.json; dummy weights)",
    )
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="engine max_num_seqs and CUDA-graph ladder (default: "
        "--batch; bench_ddtree cost used 64, its largest batch, "
        "at the price of a longer start-up)",
    )
    p.add_argument(
        "--settings",
        choices=bdc.SETTINGS,
        default="tuned",
        help="bench_ddtree's engine settings: tuned (the default here: "
        "max_num_seqs = --max-num-seqs, prefix caching off, the request "
        "ladder's capture sizes, as every profile so far) or defaults "
        "(vLLM's engine defaults: its own max_num_seqs, or --batch with "
        "--requests > --batch)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timing-repeats",
        type=int,
        default=1,
        help="time the unprofiled whole generation this many times in "
        "the config's process; the wall per decode step is their "
        "median, their range is reported (a host-bound step "
        "moves from run to run)",
    )
    p.add_argument(
        "--top", type=int, default=25, help="kernels listed per config in its JSON"
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="also write <config>" + TRACE_SUFFIX + " (Chrome trace of "
        "the profiled generation; large)",
    )
    p.add_argument(
        "--init-profiler-early",
        action="store_true",
        help="start and stop an empty profiler before the engine "
        "captures its CUDA graphs (torch's workaround for "
        "profiling graphs; off by default)",
    )
    p.add_argument(
        "--limit-seconds",
        type=float,
        default=0,
        help="stop before starting a config that would not finish in "
        "this many seconds from the start, kill one still running "
        "then (0: no limit)",
    )
    p.add_argument(
        "--config-seconds",
        type=float,
        default=120,
        help="expected seconds per config before one was measured",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="no GPU: rebuild profile.md from the JSONs in --out and --resume-from",
    )
    return p


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """Check and normalise the options in place; ``ValueError`` names the bad
    one."""
    if args.pair is not None:
        if (args.target, args.drafter) != (DEFAULT_TARGET, DEFAULT_DRAFTER):
            raise ValueError("give --pair or --target / --drafter, not both")
        args.target, args.drafter = args.pair / "target", args.pair / "drafter"
        args.prompts = args.pair / "eval_prompts.json"
        if not args.prompts.is_file():
            raise ValueError(f"--pair {args.pair}: no eval_prompts.json there")
        args.mode = "e2e"  # bench_ddtree.engine_kwargs: real weights, tokenizer
    args.schedule = bdc.parse_schedule(args.schedule)
    args.configs = bdc.parse_configs(args.configs, list(bdc.ALL_BUDGETS), args.schedule)
    if args.batch < 1:
        raise ValueError("--batch must be >= 1")
    if (
        args.settings == "defaults"
        and args.max_num_seqs not in (None, args.batch)
        and args.requests in (None, args.batch)
    ):
        raise ValueError(
            "--max-num-seqs has no effect under --settings defaults (the engine "
            "keeps vLLM's own max_num_seqs); drop it, or use --settings tuned"
        )
    if args.max_num_seqs is None:
        args.max_num_seqs = args.batch
    if args.max_num_seqs < args.batch:
        raise ValueError(
            f"--max-num-seqs {args.max_num_seqs} is below --batch {args.batch}"
        )
    if args.requests is None:
        args.requests = args.batch
    if args.requests < args.batch:
        raise ValueError(f"--requests {args.requests} is below --batch {args.batch}")
    if args.requests > args.batch and args.max_num_seqs != args.batch:
        raise ValueError(
            f"--requests {args.requests} > --batch {args.batch} runs them "
            f"{args.batch} at a time (max_num_seqs = --batch); drop --max-num-seqs"
        )
    # bench_ddtree's engine settings read this: under --settings defaults
    # continuous arrivals still keep max_num_seqs = --batch (the measured
    # concurrency), as bench_ddtree's continuous mode does.
    args.arrivals = "continuous" if args.requests > args.batch else "waves"
    if args.max_tokens < 2:
        raise ValueError(
            "--max-tokens must be >= 2 (the decode phase is the "
            "difference to a max_tokens=1 generation)"
        )
    if args.input_len < 1:
        raise ValueError("--input-len must be >= 1")
    if args.input_len + args.max_tokens > args.max_model_len:
        raise ValueError(
            f"--input-len {args.input_len} + --max-tokens {args.max_tokens} exceed "
            f"--max-model-len {args.max_model_len}"
        )
    if args.top < 1:
        raise ValueError("--top must be >= 1")
    if args.timing_repeats < 1:
        raise ValueError("--timing-repeats must be >= 1")
    bdc.check_run_options(args)
    return args


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        validate(args)
    except ValueError as e:
        parser.error(str(e))
    return args


class NoGPUError(RuntimeError):
    """No CUDA device: nothing to profile."""


def require_gpu() -> str:
    """The GPU's name; ``NoGPUError`` without one."""
    import torch

    if not torch.cuda.is_available():
        raise NoGPUError(
            "no CUDA GPU visible (torch.cuda.is_available() is False): this script "
            "profiles the GPU kernels of vLLM engines and runs on the GPU machine "
            "only (docs/bench_ddtree.md, 'Profile of one step'); --report-only "
            "rebuilds profile.md from earlier JSONs without one"
        )
    return torch.cuda.get_device_name()


# ---------------------------------------------------------------------------
# Orchestration: one process per engine config
# ---------------------------------------------------------------------------


def setup_of(args) -> dict:
    """What makes profiles comparable; a resumed run must match it."""
    setup = {
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "input_len": args.input_len,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "seed": args.seed,
        "target_config": bdc._sha(args.target / "config.json"),
        "drafter_config": bdc._sha(args.drafter / "config.json"),
        "info": {"target": str(args.target), "drafter": str(args.drafter)},
    }
    if args.schedule is not None:
        setup["schedule"] = args.schedule
    # Absent at their defaults: older profiles still match.
    if args.requests != args.batch:
        setup["requests"] = args.requests
    if args.settings != "tuned":
        setup["settings"] = args.settings
    if args.pair is not None:
        setup["prompts"] = bdc._sha(args.prompts)
        setup["info"]["prompts"] = str(args.prompts)
    return setup


def request_prompts(args) -> list:
    """The generation's prompts: the pair's held-out prompts in order (cycled), or
    bench_ddtree cost's random prompts of this batch (its seed)."""
    if args.pair is None:
        return bdc.random_prompts(args.requests, args.input_len, args.seed + args.batch)
    prompts = bdc.load_prompts(args.prompts)
    return [prompts[i % len(prompts)] for i in range(args.requests)]


def output_lengths(max_tokens: int, requests: int, batch: int) -> list[int]:
    """max_tokens per request: all ``max_tokens`` for one wave; staggered over
    [max_tokens / 2, max_tokens] (a fixed spread, no randomness) when more
    requests than ``batch`` run continuously, so they finish at different steps
    and the batch keeps taking new prefills (equal lengths would keep whole
    waves in step)."""
    if requests == batch:
        return [max_tokens] * requests
    low = max(2, max_tokens // 2)
    return [low + (i * 37) % (max_tokens - low + 1) for i in range(requests)]


def result_path(out: Path, config: str) -> Path:
    return Path(out) / f"{config}.json"


def load_results(dirs: Iterable[Path], setup: Mapping | None = None) -> dict:
    """config -> its result JSON from ``dirs`` (a later directory wins). Every
    result must share one setup: ``setup`` if given, else the first one found
    (``ValueError`` otherwise)."""
    found: dict[str, dict] = {}
    for d in dirs:
        for path in sorted(Path(d).glob("*.json")):
            try:
                result = json.loads(path.read_text())
            except json.JSONDecodeError:
                continue
            if not isinstance(result, dict) or "decode" not in result:
                continue
            if setup is None:
                setup = result.get("setup", {})
            rep.check_setup(setup, result.get("setup", {}), str(path))
            found[result["config"]] = result
    return found


def prepare_out(args, setup: Mapping) -> dict:
    """Results already there (own or ``--resume-from``, copied in so that
    ``--out`` is complete on its own)."""
    for d in args.resume_from:
        if not d.is_dir():
            raise ValueError(f"--resume-from {d}: no such directory")
    args.out.mkdir(parents=True, exist_ok=True)
    own = load_results([args.out], setup)
    earlier = load_results(args.resume_from, setup)
    for config, result in earlier.items():
        if config not in own:
            result_path(args.out, config).write_text(json.dumps(result, indent=1))
            own[config] = result
    return own


def worker_spec(args, config: str, gpu: str) -> dict:
    """What the worker process of one config needs (JSON)."""
    trace = str(args.out / f"{config}{TRACE_SUFFIX}") if args.trace else None
    return {
        "config": config,
        "llm": bdc.engine_kwargs(args, config, args.max_num_seqs),
        "prompts": request_prompts(args),
        "max_tokens": args.max_tokens,
        "output_lengths": output_lengths(args.max_tokens, args.requests, args.batch),
        "ignore_eos": args.pair is None,
        "top": args.top,
        "timing_repeats": args.timing_repeats,
        "trace": trace,
        "init_profiler_early": args.init_profiler_early,
        "out_json": str(result_path(args.out, config)),
        "setup": setup_of(args),
        "gpu": gpu,
    }


def _child_env() -> dict:
    env = bdp._worker_env()
    # The engine must live in the worker's process for its profiler to see it.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


class ConfigCut(Exception):
    """A config's worker was stopped because --limit-seconds ran out."""


def run_config(args, config: str, gpu: str, time_left: float) -> bool:
    """One config in a fresh process; True if it exited 0 and wrote its JSON.
    On failure the end of its log is printed; raises ``ConfigCut`` when the
    worker was killed at the end of ``time_left``."""
    log_path = args.out / LOG_FILE
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="profile_step_") as tmp:
        spec_path = Path(tmp) / f"{config}.spec.json"
        spec_path.write_text(json.dumps(worker_spec(args, config, gpu)))
        with log_path.open("a") as log:
            log.write(
                f"\n===== {config} ({time.strftime('%Y-%m-%dT%H:%M:%S')}) =====\n"
            )
            log.flush()
            offset = log.tell()
            ok = bdp._run_logged(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "_worker",
                    str(spec_path),
                ],
                log,
                time_left,
                _child_env(),
            )
    ok = ok and result_path(args.out, config).is_file()
    if not ok and time_left <= 1.0 + (time.monotonic() - start):
        # Killed when --limit-seconds ran out (bdp._run_logged): a cut, not a
        # failure; the worker writes its JSON at the end, so nothing is kept.
        print(
            f"    {config}: --limit-seconds ran out before it finished (not "
            "kept); rerun with --resume-from this --out",
            flush=True,
        )
        raise ConfigCut(config)
    if not ok:
        with log_path.open() as log:
            log.seek(offset)
            tail = log.read().splitlines()[-60:]
        print(f"    {config} failed; the end of its log ({log_path}):")
        print("\n".join("      " + line for line in tail), flush=True)
    return ok


def run_profiles(args, gpu: str) -> int:
    setup = setup_of(args)
    done = prepare_out(args, setup)
    clock, failed, cut = bdp.Clock(args.limit_seconds, args.config_seconds), [], []
    for i, config in enumerate(args.configs, 1):
        tag = f"[{i}/{len(args.configs)}] {config}"
        if config in done:
            print(f"{tag}: profiled already ({result_path(args.out, config)})")
            continue
        if not clock.can_start():
            left = [c for c in args.configs[i - 1 :] if c not in done]
            print(
                f"{tag}: stopping, {clock.remaining():.0f} s left of "
                f"--limit-seconds, a config takes ~{max(clock.config_s):.0f} s; "
                f"not started: {', '.join(left)}. Rerun with --resume-from "
                "this --out to continue.",
                flush=True,
            )
            break
        print(
            f"{tag}: starting (batch {args.batch}, {args.max_tokens} tokens)",
            flush=True,
        )
        start = time.monotonic()
        try:
            ok = run_config(args, config, gpu, clock.remaining())
        except ConfigCut:
            cut.append(config)
            break  # no time is left for the next config either
        clock.record(time.monotonic() - start)
        if not ok:
            failed.append(config)
            continue
        d = json.loads(result_path(args.out, config).read_text())["decode"]
        print(
            f"    {config}: {time.monotonic() - start:.0f} s; {d['steps']} decode "
            f"steps, kernels {d['kernel_us']:.0f} us/step, wall "
            f"{_us(d.get('wall_us'))} us/step, graph kernels "
            f"{d['graph_kernels_status']}",
            flush=True,
        )
    if cut:
        print(
            f"profile_step: --limit-seconds ran out while profiling {cut}; "
            f"rerun with --resume-from {args.out} to profile it"
        )
    if failed:
        print(f"profile_step: failed configs (see {args.out / LOG_FILE}): {failed}")
    write_report(args.out, load_results([args.out]), args.configs)
    return 1 if failed else 0


def write_report(
    out: Path, results: Mapping[str, dict], configs: Sequence[str] | None = None
) -> str:
    """Write and print ``profile.md`` (the configs asked for, or all)."""
    chosen = [r for c, r in results.items() if configs is None or c in configs]
    text = markdown_report(chosen)
    (Path(out) / REPORT_FILE).write_text(text)
    print(text)
    return text


def report_only(args) -> int:
    dirs = [*args.resume_from, args.out]
    missing = [d for d in dirs if not Path(d).is_dir()]
    if missing:
        raise ValueError(f"no such directory: {', '.join(map(str, missing))}")
    results = load_results(dirs)
    if not results:
        raise ValueError(f"no <config>.json in {', '.join(map(str, dirs))}")
    write_report(args.out, results)
    return 0


# ---------------------------------------------------------------------------
# Worker: one engine, profiled
# ---------------------------------------------------------------------------


def worker_main(spec_path: Path) -> None:
    import faulthandler

    # Must precede the first vllm import: the engine core in this process.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    faulthandler.dump_traceback_later(600, exit=False)
    try:
        run_worker(json.loads(Path(spec_path).read_text()))
    finally:
        faulthandler.cancel_dump_traceback_later()


def window_from_profiler(prof, *, steps: int, wall_s: float) -> dict:
    """A ``make_window`` dict from a stopped ``torch.profiler.profile``: its GPU
    activities (kernels, memcpy, memset; not user annotations or
    synchronisation records) and the CUDA runtime calls of the CPU side that
    launch work or wait for the GPU. A kernel whose CUPTI correlation id is a
    graph launch's came from a CUDA graph."""
    from torch.autograd import DeviceType

    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None:
        raise RuntimeError(
            "torch.profiler kept no kineto results (was CUDA "
            "activity profiling available?)"
        )
    events, correlations = [], []
    graph_ids, launch_ids, graph_launches, launches, syncs = set(), set(), 0, 0, 0
    sync_us, scopes, scope_calls = 0.0, {}, {}
    for e in results.events():
        hidden = getattr(e, "is_hidden_event", None)
        if hidden is not None and hidden():
            continue
        name = e.name()
        if e.device_type() == DeviceType.CUDA:
            if e.is_user_annotation() or is_sync(name):
                continue
            events.append((name, e.duration_ns() / 1e3, e.start_ns() / 1e3))
            correlations.append(e.correlation_id())
        elif e.is_user_annotation():  # a host scope (record_function)
            scopes[name] = scopes.get(name, 0.0) + e.duration_ns() / 1e3
            scope_calls[name] = scope_calls.get(name, 0) + 1
        elif GRAPH_LAUNCH_MARK in name:
            graph_launches += 1
            graph_ids.add(e.correlation_id())
        elif any(m in name for m in KERNEL_LAUNCH_MARKS):
            launches += 1
            launch_ids.add(e.correlation_id())
        elif name in HOST_SYNC_NAMES:
            syncs += 1
            sync_us += e.duration_ns() / 1e3
    return make_window(
        events,
        steps=steps,
        wall_s=wall_s,
        graph_launches=graph_launches,
        kernel_launches=launches,
        graph_kernels=sum(1 for c in correlations if c in graph_ids),
        linked_kernels=sum(1 for c in correlations if c in launch_ids),
        eager_kernels=collections.Counter(
            e[0] for e, c in zip(events, correlations) if c in launch_ids
        ),
        host_syncs=syncs,
        host_sync_us=sync_us,
        host_scopes=scopes,
        host_scope_calls=scope_calls,
    )


def instrument_host_scopes(
    scopes: Sequence[tuple] = HOST_SCOPES, on: threading.Event = _HOST_SCOPES_ON
) -> list[str]:
    """Wrap each scope's method (where its class defines it) in
    ``torch.profiler.record_function(label)``, recording while ``on`` is set;
    returns ``module.Class.method`` of the scopes this vLLM lacks (their rows
    stay empty). Only in the profile worker: the engine is never changed."""
    import functools
    import importlib

    from torch.profiler import record_function

    active: set[str] = set()  # labels recording now (the engine's one thread)

    def wrap(label: str, fn):
        @functools.wraps(fn)
        def scoped(*args, **kwargs):
            if not on.is_set() or label in active:  # nested: the outer counts
                return fn(*args, **kwargs)
            active.add(label)
            try:
                with record_function(label):
                    return fn(*args, **kwargs)
            finally:
                active.discard(label)

        scoped.__profile_step_scope__ = label
        return scoped

    missing = []
    for label, _indent, module, cls_name, method in scopes:
        where = f"{module}.{cls_name}.{method}"
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except (ImportError, AttributeError):
            missing.append(where)
            continue
        fn = cls.__dict__.get(method)
        if fn is None or not callable(fn):
            missing.append(where)
        elif getattr(fn, "__profile_step_scope__", None) is None:
            setattr(cls, method, wrap(label, fn))
    return missing


def run_worker(spec: dict) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.checkout import use_checkout

    use_checkout()
    import vllm
    import vllm_ddtree
    from vllm import LLM, SamplingParams

    require_gpu()
    vllm_ddtree.register()
    missing_scopes = instrument_host_scopes()
    if missing_scopes:
        print(
            "profile_step worker: host scopes not in this vLLM (rows left "
            "empty): " + ", ".join(missing_scopes),
            flush=True,
        )
    if spec["init_profiler_early"]:
        from torch.profiler._utils import _init_for_cuda_graphs

        _init_for_cuda_graphs()
    start = time.perf_counter()
    llm = LLM(**spec["llm"])
    engine = bdo._engine_info(llm, time.perf_counter() - start)
    print("profile_step worker: engine " + json.dumps(engine), flush=True)
    prompts = [bdo._as_input(p) for p in spec["prompts"]]
    lengths = spec.get("output_lengths") or [spec["max_tokens"]] * len(prompts)

    def params(max_tokens: int):
        """One SamplingParams per request: max_tokens caps each staggered
        length (1: prefill only)."""
        return [
            SamplingParams(
                temperature=0.0,
                max_tokens=min(max_tokens, n),
                ignore_eos=spec.get("ignore_eos", True),
                detokenize=False,
            )
            for n in lengths
        ]

    def generate(max_tokens: int, prof=None):
        """(wall seconds, metric delta, output tokens) of one generation."""
        before = rep.metric_totals(llm.get_metrics())
        torch.cuda.synchronize()
        if prof is not None:
            _HOST_SCOPES_ON.set()
            prof.start()
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params(max_tokens), use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        if prof is not None:
            prof.stop()
            _HOST_SCOPES_ON.clear()
        delta = rep.metric_delta(before, rep.metric_totals(llm.get_metrics()))
        return wall, delta, sum(len(o.outputs[0].token_ids) for o in outputs)

    def profiler():
        return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

    max_tokens = spec["max_tokens"]
    generate(min(16, max_tokens))  # warm-up
    pre_wall, pre_delta, _ = generate(1)
    read = nvml_reader(torch.cuda.current_device())
    if read is None:
        wall, delta, tokens = generate(max_tokens)
        clocks = None
    else:
        with GpuSampler(read) as sampler:
            wall, delta, tokens = generate(max_tokens)
        clocks = sampler.summary()
        print("profile_step worker: GPU clocks " + json.dumps(clocks), flush=True)
    timing = rep.timing_stats(delta, pre_delta, wall, pre_wall, tokens)
    repeats = [timing]
    for _ in range(spec.get("timing_repeats", 1) - 1):
        r_wall, r_delta, r_tokens = generate(max_tokens)
        repeats.append(rep.timing_stats(r_delta, pre_delta, r_wall, pre_wall, r_tokens))
    timing = repeated_timing(repeats)
    print("profile_step worker: unprofiled " + json.dumps(timing), flush=True)
    generate(1, profiler())  # the profiler's own start-up, outside the windows
    windows = {}
    for name, n in (("prefill", 1), ("full", max_tokens)):
        prof = profiler()
        w_wall, w_delta, _ = generate(n, prof)
        windows[name] = window_from_profiler(
            prof, steps=int(w_delta.get(rep.STEPS, 0)), wall_s=w_wall
        )
        if name == "full" and spec["trace"]:
            prof.export_chrome_trace(spec["trace"])
        del prof
    wall_us = (
        None
        if timing["decode_ms_per_step"] is None
        else 1000 * timing["decode_ms_per_step"]
    )
    decode = decode_breakdown(
        windows["full"], windows["prefill"], wall_us=wall_us, top=spec["top"]
    )
    spec_numbers = rep.spec_stats(delta)
    result = {
        "config": spec["config"],
        "setup": spec["setup"],
        "decode": decode,
        "acceptance_length": spec_numbers["acceptance_length"],
        "unprofiled": timing,
        # SM clock and power over the unprofiled generation (None: no NVML).
        "gpu_clocks": clocks,
        "windows": {
            k: {key: v for key, v in w.items() if key != "kernels"}
            for k, w in windows.items()
        },
        "info": {
            "gpu": spec["gpu"],
            "torch": torch.__version__,
            "vllm": vllm.__version__,
            "engine": engine,
            "trace": spec["trace"],
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "init_profiler_early": spec["init_profiler_early"],
            "host_scopes_missing": missing_scopes,
            # The step is host-bound at small batches: where this process ran.
            "host": bdo.host_placement(),
        },
    }
    Path(spec["out_json"]).write_text(json.dumps(result, indent=1))
    print(f"profile_step worker: wrote {spec['out_json']}", flush=True)


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:  # internal: one engine config (run_config)
        worker_main(Path(argv[1]))
        return 0
    args = parse_args(argv)
    try:
        if args.report_only:
            return report_only(args)
        gpu = require_gpu()
        return run_profiles(args, gpu)
    except (ValueError, NoGPUError) as e:
        print(f"profile_step: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
