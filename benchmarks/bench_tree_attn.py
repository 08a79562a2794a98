# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark the Triton tree attention kernel against vLLM's FlashAttention 3.

Qwen3-8B attention shape (32 query heads, 8 KV heads, head size 128), bf16, paged
KV cache in vLLM 0.26's FLASH_ATTN layout. For every (batch, budget, context):

* ours: ``tree_attention`` verifying a tree of ``budget`` nodes per request
  (q_len = budget + 1, per-request ancestor masks), or, for budget 15, a causal
  chain of 16 tokens (what DFlash verifies), or, for budget 0, one causal
  token per request (a plain decode step: what the kernel would cost there,
  where TREE_ATTN hands such a batch to FA3), once per ``--configs`` entry
  ("default" = the kernel's own choice, else a ``TreeAttentionConfig`` string
  such as ``m128n64w8s5``: block_m, block_n, num_warps, num_stages);
* FA3: ``flash_attn_varlen_func(..., causal=True, fa_version=3)`` on the same
  queries and pages, as vLLM calls it under full CUDA graphs (AOT scheduler
  metadata, up to 32 splits), and with its default heuristics; the faster counts;
* the device-to-device copy bandwidth of the GPU, measured first (read + write
  bytes, the faster of cudaMemcpy and a copy kernel, after a warmup).

Each kernel is captured in a CUDA graph (several launches on different KV pages,
so that the KV is read from HBM, not L2) and replayed after warmup; times are
per launch. KV bandwidth = bytes of committed KV read / time. The first config's
results are printed as a table and written to ``--out`` as JSON and markdown;
with several configs, a comparison table and a per-config summary follow.

    python benchmarks/bench_tree_attn.py            # full grid, about 3 minutes
    python benchmarks/bench_tree_attn.py --quick    # a few points
    python benchmarks/bench_tree_attn.py --sweep    # the default configs against
                                                    # candidates, about 3 minutes
    python benchmarks/bench_tree_attn.py --sweep --configs default m64n64w4s5
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.checkout import use_checkout  # noqa: E402

use_checkout()

# isort: split
from vllm.triton_utils import tl, triton  # noqa: E402

from benchmarks.tree_attn_config import parse_config  # noqa: E402
from vllm.v1.attention.ops.triton_tree_attention import (  # noqa: E402
    TreeAttentionConfig,
    plan_tree_attention,
    tree_attention,
)
from vllm.v1.spec_decode.dflash_tree_builder import build_ddtree  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE = 32, 8, 128
DTYPE = torch.bfloat16
CHAIN_BUDGET = 15
KV_BYTES_PER_TOKEN = NUM_KV_HEADS * HEAD_SIZE * 2 * DTYPE.itemsize
PEAK_BF16_TFLOPS = 989.0  # H200 dense, for the compute-bound column only
# Candidates --sweep compares with the kernel's default choice (keep in sync with
# GPU_CONFIGS in tests/v1/attention/test_tree_attention.py).
SWEEP_CONFIGS = [
    "default",
    "m128n64w8s5",
    "m128n64w8s7",
    "m128n64w8s3",
    "m128n32w8s5",
    "m64n64w4s5",
    "m64n64w8s5",
    "m64n32w4s5",
    "m128n128w8s3",
]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--budgets", type=int, nargs="+", default=[15, 64, 128, 256, 512])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--configs",
        nargs="+",
        default=None,
        help="'default' and/or TreeAttentionConfig strings; the first "
        "one fills the main table",
    )
    p.add_argument("--quick", action="store_true", help="batch 1/8, budget 15/128, 4K")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="compare SWEEP_CONFIGS (or --configs) at batch 1/8/64, "
        "budget 15/64/128/512, 4K, and batch 1 at 16K",
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()
    args.points = [
        (c, b, B) for c in args.contexts for b in args.batches for B in args.budgets
    ]
    if args.quick:
        args.points = [(4096, b, B) for b in (1, 8) for B in (15, 128)]
    if args.sweep:
        args.points = [(4096, b, B) for b in (1, 8, 64) for B in (15, 64, 128, 512)]
        args.points += [(16384, 1, 15), (16384, 1, 128)]
        if args.configs is None:
            args.configs = SWEEP_CONFIGS
    args.configs = args.configs or ["default"]
    for name in args.configs:
        if name != "default":
            parse_config(name)  # fail before any GPU work
    return args


# ----------------------------------------------------------------- timing


def time_graph(launch, num_rotations: int, iters: int, warmup: int = 1) -> float:
    """Seconds per launch: ``launch(i)`` for i in rotations, captured in one
    CUDA graph and replayed ``iters`` times after ``warmup`` replays."""
    launches = max(num_rotations, 8)
    for i in range(num_rotations):  # compile, autotune, allocate
        launch(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            launch(i % num_rotations)
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) / 1e3 / (iters * launches)


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def copy_bandwidth(num_bytes: int = 2**31, iters: int = 20) -> dict[str, float]:
    """Device-to-device copy bandwidth in bytes/s (read + write), by
    cudaMemcpy (a graph memcpy node; copy engines) and by a copy kernel on the
    SMs, each after ~1 s of warmup replays so the clocks settle."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    block = 8192
    grid = (triton.cdiv(src.numel(), block),)

    def kernel(i):
        _copy_kernel[grid](src, dst, src.numel(), BLOCK=block, num_warps=8)

    def memcpy(i):
        dst.copy_(src)

    result = {}
    for name, fn in [("kernel", kernel), ("memcpy", memcpy)]:
        seconds = time_graph(fn, 1, iters, warmup=100)
        result[name] = 2 * num_bytes / seconds
    assert torch.equal(src, dst)
    del src, dst
    torch.cuda.empty_cache()
    return result


# ----------------------------------------------------------------- problem


class Problem:
    """One (batch, budget, context) point: queries, trees and rotated KV pages."""

    def __init__(self, batch, budget, context, block_size, l2_bytes, gen):
        self.batch, self.budget, self.context = batch, budget, context
        self.is_chain = budget in (0, CHAIN_BUDGET)
        self.q_len = budget + 1
        seq_len = context + self.q_len
        blocks_per_req = math.ceil(seq_len / block_size)
        kv_bytes = batch * seq_len * KV_BYTES_PER_TOKEN
        # Enough page sets that one graph replay streams > 3x L2 from HBM.
        self.num_rotations = max(1, min(64, math.ceil(3 * l2_bytes / kv_bytes)))
        num_blocks = self.num_rotations * batch * blocks_per_req
        kv = torch.empty(
            num_blocks,
            block_size,
            NUM_KV_HEADS,
            2 * HEAD_SIZE,
            dtype=DTYPE,
            device="cuda",
        ).normal_()
        self.key_cache, self.value_cache = kv.split(HEAD_SIZE, -1)
        perm = torch.randperm(num_blocks, generator=gen).to(torch.int32).cuda()
        self.block_tables = perm.view(self.num_rotations, batch, blocks_per_req)
        # Host copy: a launch timed in a CUDA graph must not read the device.
        self.seq_len = seq_len
        self.seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
        self.query_start_loc = torch.arange(
            0, (batch + 1) * self.q_len, self.q_len, dtype=torch.int32, device="cuda"
        )
        num_tokens = batch * self.q_len
        self.q = torch.randn(num_tokens, NUM_Q_HEADS, HEAD_SIZE, generator=gen).to(
            "cuda", DTYPE
        )
        self.out = torch.empty_like(self.q)
        self.tree_mask = self.is_tree = None
        if not self.is_chain:
            self.tree_mask, self.is_tree = random_tree_masks(batch, budget, gen)
        self.committed_kv_bytes = batch * context * KV_BYTES_PER_TOKEN
        self.committed_flops = 4 * num_tokens * NUM_Q_HEADS * context * HEAD_SIZE

    def ours(self, config: TreeAttentionConfig | None):
        def launch(i):
            tree_attention(
                self.q,
                self.key_cache,
                self.value_cache,
                self.out,
                self.query_start_loc,
                self.seq_lens,
                self.block_tables[i],
                HEAD_SIZE**-0.5,
                tree_mask=self.tree_mask,
                is_tree=self.is_tree,
                config=config,
            )

        return launch

    def plan(self, config: TreeAttentionConfig | None) -> str:
        plan = plan_tree_attention(
            self.q.shape[0],
            self.batch,
            NUM_Q_HEADS,
            NUM_KV_HEADS,
            HEAD_SIZE,
            torch.cuda.get_device_properties(0).multi_processor_count,
            config,
        )
        return f"{plan.config}x{plan.num_splits}"

    def fa3_launchers(self):
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

        out = torch.empty_like(self.q)
        common = dict(
            q=self.q,
            k=self.key_cache,
            v=self.value_cache,
            out=out,
            max_seqlen_q=self.q_len,
            cu_seqlens_q=self.query_start_loc,
            max_seqlen_k=self.seq_len,
            seqused_k=self.seq_lens,
            softmax_scale=HEAD_SIZE**-0.5,
            causal=True,
            fa_version=3,
        )
        default = lambda i: flash_attn_varlen_func(  # noqa: E731
            **common, block_table=self.block_tables[i]
        )
        try:
            metadata = get_scheduler_metadata(
                batch_size=self.batch,
                max_seqlen_q=self.q_len,
                max_seqlen_k=self.seq_len,
                num_heads_q=NUM_Q_HEADS,
                num_heads_kv=NUM_KV_HEADS,
                headdim=HEAD_SIZE,
                cache_seqlens=self.seq_lens,
                qkv_dtype=DTYPE,
                cu_seqlens_q=self.query_start_loc,
                page_size=self.key_cache.shape[1],
                causal=True,
                num_splits=32,
            )
        except Exception as e:  # keep the run going on FA3 builds without it
            print(f"FA3 scheduler metadata unavailable ({e}); default heuristics")
            return out, [default]
        as_vllm = lambda i: flash_attn_varlen_func(  # noqa: E731
            **common,
            block_table=self.block_tables[i],
            scheduler_metadata=metadata,
            num_splits=32,
        )
        return out, [as_vllm, default]


def random_tree_masks(batch, budget, gen, distinct=8):
    """DDTree trees from random draft logits, a few distinct ones tiled."""
    logits = 3 * torch.randn(min(batch, distinct), 15, 64, generator=gen)
    masks = build_ddtree(logits.cuda(), budget).attn_mask
    mask = masks.repeat(math.ceil(batch / masks.shape[0]), 1, 1)[:batch]
    return mask.contiguous().cuda(), torch.ones(batch, dtype=torch.int32, device="cuda")


# ----------------------------------------------------------------- run


def run_point(batch, budget, context, args, l2_bytes, copy_bw, gen):
    """Rows (one per config) of one point, the first config's first."""
    p = Problem(batch, budget, context, args.block_size, l2_bytes, gen)
    fa_out, fa_launchers = p.fa3_launchers()
    t_fa3 = min(time_graph(f, p.num_rotations, args.iters) for f in fa_launchers)
    fa_launchers[0](0)
    rows, first_out = [], None
    for name in args.configs:
        config = None if name == "default" else parse_config(name)
        t_ours = time_graph(p.ours(config), p.num_rotations, args.iters)
        p.ours(config)(0)
        if first_out is None:
            first_out = p.out.clone()
        row = dict(
            config=name,
            plan=p.plan(config),
            batch=batch,
            budget=budget,
            context=context,
            kind="chain" if p.is_chain else "tree",
            q_len=p.q_len,
            ours_us=t_ours * 1e6,
            fa3_us=t_fa3 * 1e6,
            ratio=t_ours / t_fa3,
            ours_kv_tbps=p.committed_kv_bytes / t_ours / 1e12,
            fa3_kv_tbps=p.committed_kv_bytes / t_fa3 / 1e12,
            ours_pct_copy=100 * p.committed_kv_bytes / t_ours / copy_bw,
            ours_tflops=p.committed_flops / t_ours / 1e12,
            # Bandwidth reachable if the committed-KV FLOPs ran at tensor-core
            # peak.
            roofline_pct_copy=100
            * min(
                1.0,
                p.committed_kv_bytes
                / copy_bw
                / (p.committed_flops / (PEAK_BF16_TFLOPS * 1e12)),
            ),
            # Every config computes the same attention.
            max_abs_diff_vs_first=(p.out.float() - first_out.float())
            .abs()
            .max()
            .item(),
        )
        if p.is_chain:  # same semantics as FA3: check the numbers agree
            row["max_abs_diff_vs_fa3"] = (
                (p.out.float() - fa_out.float()).abs().max().item()
            )
        rows.append(row)
    del p
    torch.cuda.empty_cache()
    return rows


def write_results(rows, comparison, meta, out_dir: Path):
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_tree_attn.json").write_text(
        json.dumps(dict(meta=meta, rows=rows, configs=comparison), indent=1)
    )
    text = markdown_table(rows, meta)
    if len(meta["configs"]) > 1:
        text += "\n" + comparison_markdown(comparison, meta["configs"])
    (out_dir / "bench_tree_attn.md").write_text(text)


COLUMNS = [
    ("batch", "{}"),
    ("context", "{}"),
    ("budget", "{}"),
    ("kind", "{}"),
    ("ours_us", "{:.1f}"),
    ("fa3_us", "{:.1f}"),
    ("ratio", "{:.2f}"),
    ("ours_kv_tbps", "{:.2f}"),
    ("ours_pct_copy", "{:.0f}"),
    ("roofline_pct_copy", "{:.0f}"),
    ("ours_tflops", "{:.0f}"),
]


def markdown_table(rows, meta) -> str:
    head = (
        f"Tree attention ({meta['configs'][0]} config) vs FA3 on "
        f"{meta['device']}, heads {meta['heads']}, {meta['dtype']}; copy "
        f"bandwidth {meta['copy_tbps']:.2f} TB/s. ratio = ours / FA3 time; "
        "pct_copy = committed-KV bandwidth / copy bandwidth; roofline = the "
        "same at tensor-core peak.\n\n"
    )
    names = [c for c, _ in COLUMNS]
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    for row in rows:
        lines.append("| " + " | ".join(f.format(row[c]) for c, f in COLUMNS) + " |")
    return head + "\n".join(lines) + "\n"


def comparison_markdown(comparison, configs) -> str:
    """Per point: FA3 and every config's time (us) and ratio; the best config."""
    names = ["batch", "context", "budget", "fa3_us"] + configs + ["best"]
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    for point in comparison:
        cells = [str(point[k]) for k in ("batch", "context", "budget")]
        cells.append(f"{point['fa3_us']:.1f}")
        for name in configs:
            us = point["us"][name]
            cells.append(f"{us:.1f} ({us / point['fa3_us']:.2f})")
        cells.append(point["best"])
        lines.append("| " + " | ".join(cells) + " |")
    return (
        "Configs: time in us (ours / FA3); plans are in the JSON.\n\n"
        + "\n".join(lines)
        + "\n"
    )


def print_table(rows):
    names = [c for c, _ in COLUMNS]
    widths = [max(len(n), 8) for n in names]
    print("  ".join(n.rjust(w) for n, w in zip(names, widths)))
    for row in rows:
        print(
            "  ".join(f.format(row[c]).rjust(w) for (c, f), w in zip(COLUMNS, widths))
        )


def summarize_configs(comparison, configs):
    """Geometric-mean ours/FA3 per config over chain and tree points, and how
    often each config is the fastest."""
    print(
        f"\n{'config':>14}  {'chain_vs_fa3':>12}  {'tree_vs_fa3':>11}  "
        f"{'all_vs_fa3':>10}  {'best_at':>7}  worst_vs_first"
    )
    for name in configs:
        ratios = {
            kind: [
                p["us"][name] / p["fa3_us"]
                for p in comparison
                if kind in ("all", p["kind"])
            ]
            for kind in ("chain", "tree", "all")
        }
        geo = {
            k: math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan")
            for k, v in ratios.items()
        }
        wins = sum(p["best"] == name for p in comparison)
        worst = max(p["us"][name] / p["us"][configs[0]] for p in comparison)
        print(
            f"{name:>14}  {geo['chain']:12.3f}  {geo['tree']:11.3f}  "
            f"{geo['all']:10.3f}  {wins:7d}  {worst:.2f}"
        )


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_tree_attn.py needs a CUDA GPU")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    started = time.time()
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    copy = copy_bandwidth()
    copy_bw = max(copy.values())
    print(
        "device-to-device copy (read + write): "
        + ", ".join(f"{k} {v / 1e12:.2f} TB/s" for k, v in copy.items()),
        flush=True,
    )
    rows, comparison = [], []
    for context, batch, budget in args.points:
        point_rows = run_point(batch, budget, context, args, l2_bytes, copy_bw, gen)
        rows.append(point_rows[0])
        us = {r["config"]: r["ours_us"] for r in point_rows}
        comparison.append(
            dict(
                batch=batch,
                context=context,
                budget=budget,
                kind=point_rows[0]["kind"],
                fa3_us=point_rows[0]["fa3_us"],
                us=us,
                best=min(us, key=us.get),
                plans={r["config"]: r["plan"] for r in point_rows},
                max_abs_diff_vs_first={
                    r["config"]: r["max_abs_diff_vs_first"] for r in point_rows
                },
            )
        )
        bad = [r["config"] for r in point_rows if r["max_abs_diff_vs_first"] > 0.05]
        print(
            f"[{time.time() - started:6.1f}s] b={batch} ctx={context} "
            f"B={budget}: FA3 {point_rows[0]['fa3_us']:.1f} us; "
            + ", ".join(f"{r['config']} {r['ours_us']:.1f}" for r in point_rows)
            + (f"; MISMATCH {bad}" if bad else ""),
            flush=True,
        )
    meta = dict(
        device=torch.cuda.get_device_name(),
        copy_tbps=copy_bw / 1e12,
        copy_tbps_by_method={k: v / 1e12 for k, v in copy.items()},
        heads=[NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE],
        dtype=str(DTYPE),
        configs=args.configs,
    )
    write_results(rows, comparison, meta, args.out)
    print(
        f"\ncopy bandwidth {copy_bw / 1e12:.2f} TB/s; total "
        f"{time.time() - started:.0f} s; results in {args.out}"
    )
    if len(args.configs) > 1:
        print(comparison_markdown(comparison, args.configs))
        summarize_configs(comparison, args.configs)
        print(f"\nmain table below: config {args.configs[0]}")
    print_table(rows)
    chain = [r for r in rows if r["kind"] == "chain"]
    if chain:
        worst = max(chain, key=lambda r: r["ratio"])
        print(
            f"chain: worst ours/FA3 = {worst['ratio']:.2f} (target <= 1.15) at "
            f"batch {worst['batch']}, context {worst['context']}; max |diff| vs "
            f"FA3 {max(r['max_abs_diff_vs_fa3'] for r in chain):.3g}"
        )
    for r in rows:
        if r["budget"] == 128 and r["context"] == 4096:
            print(
                f"B=128 ctx=4K batch {r['batch']}: {r['ours_pct_copy']:.0f}% of "
                f"copy bandwidth (target >= 70; roofline "
                f"{r['roofline_pct_copy']:.0f}%)"
            )


if __name__ == "__main__":
    main()
