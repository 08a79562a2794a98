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

import argparse
import json
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
    from benchmarks.train_pair.dflash import draft_logits, load_pair, target_features

    tok, target, drafter = load_pair(pair)
    block = drafter.shape.block_size
    if any(not 2 <= r <= block for r in rows_list):
        raise ValueError(f"rows must lie in [2, {block}]")
    prompts = json.loads((pair / "eval_prompts.json").read_text())["prompts"]
    depth = block - 1
    top1 = {r: torch.zeros(depth) for r in rows_list}
    top4 = {r: torch.zeros(depth) for r in rows_list}
    chain = dict.fromkeys(rows_list, 0.0)
    anchors_total, start = 0, time.monotonic()
    with torch.no_grad():
        for n, p in enumerate(prompts[:num_prompts], 1):
            ids = tok(p["text"], return_tensors="pt").input_ids
            seq = target.generate(
                ids,
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id or 0,
            )
            first, last = ids.shape[1] - 1, seq.shape[1] - block
            if last < first:  # ended within one block of the prompt
                continue
            anchors = torch.arange(first, last + 1)[None]
            feats = target_features(target, seq, drafter.shape.target_layer_ids)
            for r in rows_list:
                logits, labels = draft_logits(
                    drafter,
                    target.model.embed_tokens,
                    target.lm_head.weight,
                    seq,
                    feats,
                    anchors,
                    None if r == block else r,
                )
                lg, lb = logits[0, :, 1:r].float(), labels[0, :, 1:r]
                hit = lg.argmax(-1) == lb
                top1[r][: r - 1] += hit.float().sum(0)
                in4 = (lg.topk(4, -1).indices == lb[..., None]).any(-1)
                top4[r][: r - 1] += in4.float().sum(0)
                chain[r] += float(hit.long().cumprod(-1).sum())
            anchors_total += anchors.shape[1]
            print(
                f"drafter_rows: prompt {n}/{num_prompts}, {anchors_total} "
                f"anchors, {time.monotonic() - start:.0f} s",
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--pair", type=Path, default=PAIR)
    p.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args(argv)
    result = measure(
        args.pair, sorted(set(args.rows)), args.num_prompts, args.max_tokens
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "drafter_rows.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (args.out / "drafter_rows.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
