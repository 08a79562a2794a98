# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a DFlash drafter loses when it runs a shorter block, on the CPU.

At large batches the drafter's forward is ``num_reqs * block_size`` query
tokens whatever the tree budget (1024 at 64 requests for a block of 16), and a
3-node tree needs only the first three depths. This script asks whether the
drafter could run only its block's first ``rows`` positions (the anchor and
``rows - 1`` masks, which see only each other): it runs the trained pair's
drafter (``benchmarks/models/pycode``, PyTorch on the CPU, the training code's
own forward) over the target's greedy continuations of held-out prompts, once
per ``rows``, and reports per depth the share of positions whose top-1 and
top-4 tokens hold the target's token, and a chain's accepted drafts per block.

    python benchmarks/drafter_rows.py --out benchmarks/results/drafter_rows
"""

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.checkout import use_checkout  # noqa: E402

use_checkout()

PAIR = ROOT / "benchmarks" / "models" / "pycode"


def measure(pair: Path, rows_list, num_prompts: int, max_tokens: int) -> dict:
    from benchmarks.tree_acceptance import drafted_blocks

    depth = max(rows_list) - 1
    top1 = {r: torch.zeros(depth) for r in rows_list}
    top4 = {r: torch.zeros(depth) for r in rows_list}
    chain = dict.fromkeys(rows_list, 0.0)
    anchors_total, start = 0, time.monotonic()
    # One pass of the drafter per rows value (each generates the prompts'
    # continuations again: the target is small, the drafter's mask differs).
    for r in rows_list:
        for block in drafted_blocks(pair, num_prompts, max_tokens, r):
            if block is None:
                continue
            lg, lb = block
            hit = lg.argmax(-1) == lb
            top1[r][: r - 1] += hit.float().sum(0)
            in4 = (lg.topk(4, -1).indices == lb[..., None]).any(-1)
            top4[r][: r - 1] += in4.float().sum(0)
            chain[r] += float(hit.long().cumprod(-1).sum())
            if r == rows_list[0]:
                anchors_total += lg.shape[0]
        print(
            f"drafter_rows: rows {r}, {anchors_total} anchors, "
            f"{time.monotonic() - start:.0f} s",
            flush=True,
        )
    if anchors_total == 0:
        raise RuntimeError("no prompt left a full block to draft")
    return {
        "command": "python " + " ".join(sys.argv),
        "pair": str(pair),
        "anchors": anchors_total,
        "rows": {
            str(r): {
                "top1_by_depth": [
                    round(x / anchors_total, 4) for x in top1[r][: r - 1].tolist()
                ],
                "top4_by_depth": [
                    round(x / anchors_total, 4) for x in top4[r][: r - 1].tolist()
                ],
                "chain_accepted_per_block": round(chain[r] / anchors_total, 3),
            }
            for r in rows_list
        },
    }


def markdown(result: dict, shown: int = 7) -> str:
    lines = [
        f"{result['anchors']} drafted blocks; top-1 (top-4) holds the target's "
        "token, by depth",
        "",
        "| rows | chain accepted per block | "
        + " | ".join(f"depth {d}" for d in range(1, shown + 1))
        + " |",
        "|---" * (shown + 2) + "|",
    ]
    for r, v in result["rows"].items():
        cells = [
            f"{a:.3f} ({b:.3f})" for a, b in zip(v["top1_by_depth"], v["top4_by_depth"])
        ][:shown]
        cells += [""] * (shown - len(cells))
        lines.append(
            f"| {r} | {v['chain_accepted_per_block']:.3f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from benchmarks.tree_acceptance import pair_parser, write_result

    p = pair_parser(__doc__, budgets=None, num_prompts=12, max_tokens=128)
    p.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 16])
    args = p.parse_args(argv)
    if min(args.rows) < 2:
        p.error("--rows must be >= 2")
    rows = sorted(set(args.rows))
    result = measure(args.pair, rows, args.num_prompts, args.max_tokens)
    write_result(args.out, "drafter_rows", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
