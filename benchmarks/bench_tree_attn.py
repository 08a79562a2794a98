# SPDX-License-Identifier: Apache-2.0
"""Benchmark the Triton tree attention kernel against vLLM's FlashAttention 3.

Qwen3-8B attention shape (32 query heads, 8 KV heads, head size 128), bf16, paged
KV cache in vLLM 0.26's FLASH_ATTN layout. For every (batch, budget, context):

* ours: ``tree_attention`` verifying a tree of ``budget`` nodes per request
  (q_len = budget + 1, per-request ancestor masks), or, for budget 15, a causal
  chain of 16 tokens (what DFlash verifies);
* FA3: ``flash_attn_varlen_func(..., causal=True, fa_version=3)`` on the same
  queries and pages, as vLLM calls it under full CUDA graphs (AOT scheduler
  metadata, up to 32 splits), and with its default heuristics; the faster counts;
* the device-to-device copy bandwidth of the GPU, measured first.

Each kernel is captured in a CUDA graph (several launches on different KV pages,
so that the KV is read from HBM, not L2) and replayed after warmup; times are
per launch. KV bandwidth = bytes of committed KV read / time. Results are printed
as a table and written to ``--out`` as JSON and markdown.

    python benchmarks/bench_tree_attn.py            # full grid, about 3 minutes
    python benchmarks/bench_tree_attn.py --quick    # a few points
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
import conftest  # noqa: E402,F401  (this working tree's vllm/ modules first)

from tests.v1.ddtree_reference import build_ddtree_reference  # noqa: E402
from vllm.v1.attention.ops.triton_tree_attention import tree_attention  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE = 32, 8, 128
DTYPE = torch.bfloat16
CHAIN_BUDGET = 15
KV_BYTES_PER_TOKEN = NUM_KV_HEADS * HEAD_SIZE * 2 * DTYPE.itemsize
PEAK_BF16_TFLOPS = 989.0  # H200 dense, for the compute-bound column only


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--budgets", type=int, nargs="+", default=[15, 64, 128, 256, 512])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="batch 1/8, budget 15/128, 4K")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()
    if args.quick:
        args.batches, args.budgets, args.contexts = [1, 8], [15, 128], [4096]
    return args


# ----------------------------------------------------------------- timing


def time_graph(launch, num_rotations: int, iters: int) -> float:
    """Seconds per launch: ``launch(i)`` for i in rotations, captured in one
    CUDA graph and replayed ``iters`` times after warmup."""
    launches = max(num_rotations, 8)
    for i in range(num_rotations):  # compile, autotune, allocate
        launch(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            launch(i % num_rotations)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
        enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) / 1e3 / (iters * launches)


def copy_bandwidth(num_bytes: int = 2**30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = time_graph(lambda i: dst.copy_(src), 1, iters)
    return 2 * num_bytes / seconds


# ----------------------------------------------------------------- problem


class Problem:
    """One (batch, budget, context) point: queries, trees and rotated KV pages."""

    def __init__(self, batch, budget, context, block_size, l2_bytes, gen):
        self.batch, self.budget, self.context = batch, budget, context
        self.is_chain = budget == CHAIN_BUDGET
        self.q_len = budget + 1
        seq_len = context + self.q_len
        blocks_per_req = math.ceil(seq_len / block_size)
        kv_bytes = batch * seq_len * KV_BYTES_PER_TOKEN
        # Enough page sets that one graph replay streams > 3x L2 from HBM.
        self.num_rotations = max(1, min(64, math.ceil(3 * l2_bytes / kv_bytes)))
        num_blocks = self.num_rotations * batch * blocks_per_req
        kv = torch.empty(num_blocks, block_size, NUM_KV_HEADS, 2 * HEAD_SIZE,
                         dtype=DTYPE, device="cuda").normal_()
        self.key_cache, self.value_cache = kv.split(HEAD_SIZE, -1)
        perm = torch.randperm(num_blocks, generator=gen).to(torch.int32).cuda()
        self.block_tables = perm.view(self.num_rotations, batch, blocks_per_req)
        self.seq_lens = torch.full((batch,), seq_len, dtype=torch.int32,
                                   device="cuda")
        self.query_start_loc = torch.arange(0, (batch + 1) * self.q_len, self.q_len,
                                            dtype=torch.int32, device="cuda")
        num_tokens = batch * self.q_len
        self.q = torch.randn(num_tokens, NUM_Q_HEADS, HEAD_SIZE, generator=gen
                             ).to("cuda", DTYPE)
        self.out = torch.empty_like(self.q)
        self.tree_mask = self.is_tree = None
        if not self.is_chain:
            self.tree_mask, self.is_tree = random_tree_masks(batch, budget, gen)
        self.committed_kv_bytes = batch * context * KV_BYTES_PER_TOKEN
        self.committed_flops = 4 * num_tokens * NUM_Q_HEADS * context * HEAD_SIZE

    def ours(self, i):
        tree_attention(self.q, self.key_cache, self.value_cache, self.out,
                       self.query_start_loc, self.seq_lens, self.block_tables[i],
                       HEAD_SIZE**-0.5, tree_mask=self.tree_mask, is_tree=self.is_tree)

    def fa3_launchers(self):
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

        out = torch.empty_like(self.q)
        common = dict(
            q=self.q, k=self.key_cache, v=self.value_cache, out=out,
            max_seqlen_q=self.q_len, cu_seqlens_q=self.query_start_loc,
            max_seqlen_k=int(self.seq_lens[0]), seqused_k=self.seq_lens,
            softmax_scale=HEAD_SIZE**-0.5, causal=True, fa_version=3,
        )
        default = lambda i: flash_attn_varlen_func(  # noqa: E731
            **common, block_table=self.block_tables[i])
        try:
            metadata = get_scheduler_metadata(
                batch_size=self.batch, max_seqlen_q=self.q_len,
                max_seqlen_k=int(self.seq_lens[0]), num_heads_q=NUM_Q_HEADS,
                num_heads_kv=NUM_KV_HEADS, headdim=HEAD_SIZE,
                cache_seqlens=self.seq_lens, qkv_dtype=DTYPE,
                cu_seqlens_q=self.query_start_loc,
                page_size=self.key_cache.shape[1], causal=True, num_splits=32,
            )
        except Exception as e:  # keep the run going on FA3 builds without it
            print(f"FA3 scheduler metadata unavailable ({e}); default heuristics")
            return out, [default]
        as_vllm = lambda i: flash_attn_varlen_func(  # noqa: E731
            **common, block_table=self.block_tables[i], scheduler_metadata=metadata,
            num_splits=32)
        return out, [as_vllm, default]


def random_tree_masks(batch, budget, gen, distinct=8):
    """DDTree heap trees from random draft logits, a few distinct ones tiled."""
    logits = 3 * torch.randn(min(batch, distinct), 15, 64, generator=gen)
    masks = build_ddtree_reference(logits, budget).attn_mask
    mask = masks.repeat(math.ceil(batch / masks.shape[0]), 1, 1)[:batch]
    return mask.contiguous().cuda(), torch.ones(batch, dtype=torch.int32,
                                                device="cuda")


# ----------------------------------------------------------------- run


def run_point(batch, budget, context, args, l2_bytes, copy_bw, gen):
    p = Problem(batch, budget, context, args.block_size, l2_bytes, gen)
    t_ours = time_graph(p.ours, p.num_rotations, args.iters)
    fa_out, fa_launchers = p.fa3_launchers()
    t_fa3 = min(time_graph(f, p.num_rotations, args.iters) for f in fa_launchers)
    row = dict(
        batch=batch, budget=budget, context=context,
        kind="chain" if p.is_chain else "tree", q_len=p.q_len,
        ours_us=t_ours * 1e6, fa3_us=t_fa3 * 1e6, ratio=t_ours / t_fa3,
        ours_kv_tbps=p.committed_kv_bytes / t_ours / 1e12,
        fa3_kv_tbps=p.committed_kv_bytes / t_fa3 / 1e12,
        ours_pct_copy=100 * p.committed_kv_bytes / t_ours / copy_bw,
        ours_tflops=p.committed_flops / t_ours / 1e12,
        # Bandwidth reachable if the committed-KV FLOPs ran at tensor-core peak.
        roofline_pct_copy=100 * min(1.0, p.committed_kv_bytes / copy_bw / (
            p.committed_flops / (PEAK_BF16_TFLOPS * 1e12))),
    )
    if p.is_chain:  # same semantics as FA3: check the numbers agree
        p.ours(0)
        fa_launchers[0](0)
        row["max_abs_diff_vs_fa3"] = (p.out.float() - fa_out.float()).abs().max().item()
    del p
    torch.cuda.empty_cache()
    return row


def write_results(rows, copy_bw, out_dir: Path):
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), copy_tbps=copy_bw / 1e12,
                heads=[NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE], dtype=str(DTYPE))
    (out_dir / "bench_tree_attn.json").write_text(
        json.dumps(dict(meta=meta, rows=rows), indent=1))
    (out_dir / "bench_tree_attn.md").write_text(markdown_table(rows, meta))


COLUMNS = [("batch", "{}"), ("context", "{}"), ("budget", "{}"), ("kind", "{}"),
           ("ours_us", "{:.1f}"), ("fa3_us", "{:.1f}"), ("ratio", "{:.2f}"),
           ("ours_kv_tbps", "{:.2f}"), ("ours_pct_copy", "{:.0f}"),
           ("roofline_pct_copy", "{:.0f}"), ("ours_tflops", "{:.0f}")]


def markdown_table(rows, meta) -> str:
    head = (f"Tree attention vs FA3 on {meta['device']}, heads "
            f"{meta['heads']}, {meta['dtype']}; copy bandwidth "
            f"{meta['copy_tbps']:.2f} TB/s. ratio = ours / FA3 time; "
            "pct_copy = committed-KV bandwidth / copy bandwidth; roofline = the "
            "same at tensor-core peak.\n\n")
    names = [c for c, _ in COLUMNS]
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    for row in rows:
        lines.append("| " + " | ".join(f.format(row[c]) for c, f in COLUMNS) + " |")
    return head + "\n".join(lines) + "\n"


def print_table(rows):
    names = [c for c, _ in COLUMNS]
    widths = [max(len(n), 8) for n in names]
    print("  ".join(n.rjust(w) for n, w in zip(names, widths)))
    for row in rows:
        print("  ".join(f.format(row[c]).rjust(w)
                        for (c, f), w in zip(COLUMNS, widths)))


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_tree_attn.py needs a CUDA GPU")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    started = time.time()
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    copy_bw = copy_bandwidth()
    print(f"device-to-device copy: {copy_bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            for budget in args.budgets:
                row = run_point(batch, budget, context, args, l2_bytes, copy_bw, gen)
                rows.append(row)
                print(f"[{time.time() - started:6.1f}s] b={batch} ctx={context} "
                      f"B={budget}: ours {row['ours_us']:.1f} us, "
                      f"FA3 {row['fa3_us']:.1f} us", flush=True)
    write_results(rows, copy_bw, args.out)
    print(f"\ncopy bandwidth {copy_bw / 1e12:.2f} TB/s; total "
          f"{time.time() - started:.0f} s; results in {args.out}")
    print_table(rows)
    chain = [r for r in rows if r["kind"] == "chain"]
    if chain:
        worst = max(chain, key=lambda r: r["ratio"])
        print(f"chain: worst ours/FA3 = {worst['ratio']:.2f} (target <= 1.15) at "
              f"batch {worst['batch']}, context {worst['context']}; max |diff| vs "
              f"FA3 {max(r['max_abs_diff_vs_fa3'] for r in chain):.3g}")
    for r in rows:
        if r["budget"] == 128 and r["context"] == 4096:
            print(f"B=128 ctx=4K batch {r['batch']}: {r['ours_pct_copy']:.0f}% of "
                  f"copy bandwidth (target >= 70; roofline "
                  f"{r['roofline_pct_copy']:.0f}%)")


if __name__ == "__main__":
    main()
