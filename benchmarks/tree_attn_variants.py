# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which Triton variants of TREE_ATTN a serving step can meet, and which of them
start-up compiles (CPU only: it runs the kernel planner, no kernel).

A CUDA-graph capture compiles the variants of the captured steps: uniform
tree-verify batches of ``n x (b + 1)`` tokens for the capture ladder's ``n`` and
every budget ``b``. Steps that mix a prefill with trees run attention outside
the graphs, with the actual request count: trees of any number of requests up
to ``max_num_seqs``, and, when a prompt (or a prompt's last chunk) is no longer
than a tree, its causal rows in the same kernel call (a step of short prompts
alone runs there too). Each variant the planner
picks there that no capture compiled is compiled the first time a user's step
needs it. Variants are the kernel's compile-time parameters: the tile shape and
warps of ``_tree_attention_kernel``, the padded split count of
``_merge_splits_kernel``.

    python benchmarks/tree_attn_variants.py                 # Qwen3-8B heads
    python benchmarks/tree_attn_variants.py --heads 4 2 --head-size 64   # the pair
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.checkout import use_checkout  # noqa: E402

use_checkout()


# Requests per step up to which every mix of trees and short prompts is planned.
SHORT_ROW_REQS = 64


def _variants(plan) -> tuple[tuple, tuple | None]:
    """(main kernel, merge kernel or None) compile-time parameters of a plan."""
    from vllm.triton_utils import triton

    c = plan.config
    main = (c.block_m, c.block_n, c.num_warps, c.num_stages, plan.block_q)
    merge = None
    if plan.num_splits > 1:
        merge = (triton.next_power_of_2(plan.num_splits),)
    return main, merge


def analyse(
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    budgets: list[int],
    max_num_seqs: int,
    num_sms: int = 132,
) -> dict:
    """Variants compiled by captures, and those only eager steps meet (with the
    first step met: (budget, requests, tokens))."""
    from vllm.v1.attention.ops.triton_tree_attention import plan_tree_attention

    def plan(num_tokens, num_reqs):
        return plan_tree_attention(
            num_tokens, num_reqs, num_q_heads, num_kv_heads, head_size, num_sms
        )

    ladder = [n for n in (1, 2, 4) if n < max_num_seqs]
    ladder += list(range(8, max_num_seqs, 8)) + [max_num_seqs]
    captured: set = set()
    for b in budgets:
        for n in ladder:
            captured.update(_variants(plan(n * (b + 1), n)))
    captured.discard(None)
    eager: dict = {}
    for b in budgets:
        for num_reqs in range(1, max_num_seqs + 1):
            # The planner sees only totals: any mix of trees (b + 1 rows each)
            # and short causal rows (1..b + 1 each) of num_reqs requests has
            # num_reqs..num_reqs * (b + 1) tokens. Past SHORT_ROW_REQS requests,
            # only all-tree steps and steps with one short row are enumerated.
            full = num_reqs * (b + 1)
            if num_reqs <= SHORT_ROW_REQS:
                totals = range(num_reqs, full + 1)
            else:
                totals = [full, *range(full - b, full)]
            for num_tokens in totals:
                for v in _variants(plan(num_tokens, num_reqs)):
                    if v is not None and v not in captured:
                        eager.setdefault(v, (b, num_reqs, num_tokens))
    return {"captured": sorted(captured, key=str), "eager_only": eager}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("Q", "KV"))
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--budgets", default="31,15", help="every budget a step verifies")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--sms", type=int, default=132, help="the GPU's SMs (H200: 132)")
    args = p.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    result = analyse(*args.heads, args.head_size, budgets, args.max_num_seqs, args.sms)
    print(
        f"heads {args.heads[0]}/{args.heads[1]} x {args.head_size}, budgets "
        f"{budgets}, max_num_seqs {args.max_num_seqs}, {args.sms} SMs: "
        f"{len(result['captured'])} variants compiled by captures, "
        f"{len(result['eager_only'])} met only by mixed steps"
    )
    print("variant (main: block_m, block_n, warps, stages, block_q | merge: splits)")
    for v, (b, k, q) in sorted(result["eager_only"].items(), key=str):
        kind = "merge" if len(v) == 1 else "main"
        print(f"  {kind} {v}: first at budget {b}, {k} requests, {q} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
