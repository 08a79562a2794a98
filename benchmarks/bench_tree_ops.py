# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Time the DDTree core ops on the GPU: tree build, tree walk, KV compaction.

For every (num_reqs, budget), with vocab 151936 (``--vocab``), drafter depth 15 and
a Qwen3-8B KV cache (36 layers x 8 KV heads x 128 dims, bf16, vLLM 0.26 FLASH_ATTN
layout):

* build: ``build_ddtree`` on bf16 drafter logits ``[num_reqs, 15, vocab]``; and,
  side by side, its top-token search (``top_tokens``: log-normalisers and ranked top
  ``min(budget, vocab)`` tokens of every position) and ``torch.topk`` of the same
  logits, which the search replaced;
* walk: ``tree_rejection_sample`` on float32 target logits ``[num_reqs*(B+1), vocab]``
  (Gumbel/argmax sampling of every tree token plus the walk), temperature 0 and 1;
  ``walk_only`` is the walk kernel alone;
* compact: ``TreeKVCompactor`` moving a 15-deep accepted path in all 36 layers;
* total: the three in one CUDA graph (temperature 0).

``--logits crowded`` gives the drafter rows a trained model's shape over a BPE
vocabulary instead of plain random logits: the best tokens crowd into the lowest
ids (frequent tokens get low ids), which sends most positions down the top-token
search's spill path (random logits almost never take it).

Each op is captured in a CUDA graph and replayed after warmup; times come from CUDA
events, in microseconds per call. Configurations whose target logits exceed
``--max-logits-gb`` skip the sampling columns (the walk kernel is still timed).

    python benchmarks/bench_tree_ops.py [--out benchmarks/results]
"""

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.checkout import use_checkout  # noqa: E402

use_checkout()

from vllm.v1.attention.backends.tree_attn import kv_cache_as_kv_first  # noqa: E402
from vllm.v1.attention.ops.tree_kv_compaction import TreeKVCompactor  # noqa: E402
from vllm.v1.sample.tree_rejection_sampler import (  # noqa: E402
    tree_rejection_sample,
    walk_trees,
)
from vllm.v1.spec_decode.dflash_tree_builder import (  # noqa: E402
    _ranked_top_tokens,
    build_ddtree,
)

DEPTH = 15
QWEN3_VOCAB = 151936
NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 36, 8, 128, 16


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-reqs", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument(
        "--budgets", type=int, nargs="+", default=[16, 64, 128, 256, 512, 1024]
    )
    p.add_argument(
        "--logits",
        choices=["randn", "crowded"],
        default="randn",
        help="drafter logits: random, or crowded into the lowest ids "
        "like a trained model's over a BPE vocabulary",
    )
    p.add_argument(
        "--vocab",
        type=int,
        default=QWEN3_VOCAB,
        help="vocabulary size (Qwen3's by default; the trained pair's is 4096)",
    )
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--max-logits-gb", type=float, default=12.0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    return p.parse_args()


def time_graph(fn, iters: int) -> float:
    """Microseconds per call of ``fn`` captured in a CUDA graph."""
    fn()  # compile and warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


class KVCaches:
    """36 layer caches with room for every request's tree."""

    def __init__(self, num_reqs: int, budget: int):
        blocks_per_req = (budget + 1 + BLOCK_SIZE - 1) // BLOCK_SIZE
        num_blocks = num_reqs * blocks_per_req
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, 2 * HEAD_SIZE)  # NHD memory
        self.layers = [
            kv_cache_as_kv_first(
                torch.randn(shape, dtype=torch.bfloat16, device="cuda").transpose(1, 2),
                HEAD_SIZE,
            )
            for _ in range(NUM_LAYERS)
        ]
        q = budget + 1
        self.query_start_loc = torch.arange(
            0, (num_reqs + 1) * q, q, dtype=torch.int32, device="cuda"
        )
        per_req = torch.arange(q, device="cuda")
        base = torch.arange(num_reqs, device="cuda")[:, None] * blocks_per_req
        self.slot_mapping = (base * BLOCK_SIZE + per_req).flatten().to(torch.int64)


def accepted_path(num_reqs: int, budget: int):
    """A 15-deep (or budget-deep) path of increasing node indices per request."""
    k = min(DEPTH, budget)
    nodes = torch.linspace(1, budget, k).round().to(torch.int32)
    nodes = torch.maximum(nodes, torch.arange(1, k + 1, dtype=torch.int32))
    accepted = torch.full((num_reqs, DEPTH), -1, dtype=torch.int32)
    accepted[:, :k] = nodes
    num_accepted = torch.full((num_reqs,), k, dtype=torch.int32)
    return accepted.cuda(), num_accepted.cuda()


def crowded_logits(
    logits: torch.Tensor, scale: float = 8.0, decay: float = 400.0
) -> torch.Tensor:
    """Random logits plus ``scale * exp(-id / decay)``: each position's best
    tokens crowd into the first few hundred ids, as a trained model's do over a
    BPE vocabulary, whose frequent tokens were merged (numbered) first."""
    ids = torch.arange(logits.shape[-1], device=logits.device, dtype=logits.dtype)
    return logits + scale * torch.exp(-ids / decay)


def run_point(num_reqs: int, budget: int, args) -> dict:
    vocab = args.vocab
    gen = torch.Generator(device="cuda").manual_seed(0)
    draft_logits = torch.randn(num_reqs, DEPTH, vocab, device="cuda", generator=gen)
    if args.logits == "crowded":
        draft_logits = crowded_logits(draft_logits)
    draft_logits = draft_logits.to(torch.bfloat16)
    row = {"num_reqs": num_reqs, "budget": budget, "logits": args.logits}
    row["build_us"] = time_graph(lambda: build_ddtree(draft_logits, budget), args.iters)
    # The builder's top-token search against torch.topk (unsorted) on the same
    # logits: what the search replaced.
    k = min(budget, vocab)
    row["top_tokens_us"] = time_graph(
        lambda: _ranked_top_tokens(draft_logits, k), args.iters
    )
    row["torch_topk_us"] = time_graph(
        lambda: torch.topk(draft_logits, k, dim=-1, sorted=False), args.iters
    )
    tree = build_ddtree(draft_logits, budget)

    num_logits = num_reqs * (budget + 1)
    cu = torch.arange(0, num_logits + 1, budget + 1, dtype=torch.int32, device="cuda")
    node_sampled = torch.randint(0, vocab, (num_logits,), device="cuda")
    # The step's input ids, which DDTree's sampler checks node tokens against.
    fed = torch.cat(
        [node_sampled.new_zeros(num_reqs, 1), tree.token_ids.clamp(min=0)], dim=1
    ).flatten()
    row["walk_only_us"] = time_graph(
        lambda: walk_trees(
            node_sampled, tree.token_ids, tree.parent_ids, cu, DEPTH, fed
        ),
        args.iters,
    )

    kv = KVCaches(num_reqs, budget)
    compactor = TreeKVCompactor(kv.layers)
    accepted, num_accepted = accepted_path(num_reqs, budget)
    compact = lambda: compactor(  # noqa: E731
        kv.slot_mapping, kv.query_start_loc, accepted, num_accepted
    )
    row["compact_us"] = time_graph(compact, args.iters)

    logits_gb = num_logits * vocab * 4 / 1e9
    if logits_gb <= args.max_logits_gb:
        logits = torch.randn(num_logits, vocab, device="cuda", generator=gen)
        pos = torch.arange(num_logits, device="cuda") % (budget + 1)
        idx_mapping = torch.arange(num_logits, device="cuda", dtype=torch.int32) // (
            budget + 1
        )
        seeds = torch.arange(num_reqs, device="cuda", dtype=torch.int64)

        def walk(temperature):
            return lambda: tree_rejection_sample(
                logits,
                tree.token_ids,
                tree.parent_ids,
                cu,
                pos,
                idx_mapping,
                temperature,
                seeds,
                DEPTH,
                fed_token_ids=fed,
            )

        t0 = torch.zeros(num_reqs, device="cuda")
        row["walk_t0_us"] = time_graph(walk(t0), args.iters)
        row["walk_t1_us"] = time_graph(
            walk(torch.ones(num_reqs, device="cuda")), args.iters
        )

        def total():
            t = build_ddtree(draft_logits, budget)
            out = tree_rejection_sample(
                logits,
                t.token_ids,
                t.parent_ids,
                cu,
                pos,
                idx_mapping,
                t0,
                seeds,
                DEPTH,
                fed_token_ids=fed,
            )
            compactor(
                kv.slot_mapping,
                kv.query_start_loc,
                out.accepted_nodes,
                out.num_accepted,
            )

        row["total_t0_us"] = time_graph(total, args.iters)
        del logits
    torch.cuda.empty_cache()
    return row


COLUMNS = [
    "num_reqs",
    "budget",
    "build_us",
    "top_tokens_us",
    "torch_topk_us",
    "walk_only_us",
    "walk_t0_us",
    "walk_t1_us",
    "compact_us",
    "total_t0_us",
]


def markdown(rows) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [
            f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r.get(c, "-"))
            for c in COLUMNS
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    args = parse_args()
    rows = []
    for num_reqs in args.num_reqs:
        for budget in args.budgets:
            rows.append(run_point(num_reqs, budget, args))
            print(json.dumps(rows[-1]), flush=True)
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": "python " + " ".join(sys.argv),
        "vocab": args.vocab,
        "depth": DEPTH,
        "logits": args.logits,
        "kv": f"{NUM_LAYERS} layers x {NUM_KV_HEADS} heads x {HEAD_SIZE}, bf16",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_tree_ops.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1)
    )
    table = markdown(rows)
    (args.out / "bench_tree_ops.md").write_text(
        f"GPU: {meta['gpu']}, command: `{meta['command']}`\n\n{table}\n"
    )
    print(table)


if __name__ == "__main__":
    main()
