# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How often a trained drafter sends the builder's top-token search down its exact
path, on the CPU.

``_ranked_top_tokens`` (vllm/v1/spec_decode/dflash_tree_builder.py) buffers the
tokens at or above a threshold taken from each vocabulary chunk's few largest
values and sorts ``cap`` of them; when more than ``cap`` tokens reach it,
because a position's best tokens crowd into few chunks, the position sorts a
wider block of its ``spill`` buffer (the spill path; past the widest sort,
``top_sort_max``, it first keeps its best by a radix select over the buffer:
the select share), and past ``spill`` it takes the exact path (a full-row
radix select, slow). Random logits spread the best
tokens over the vocabulary and almost never leave the fast path; a trained
model over a BPE vocabulary gives frequent tokens low ids. This script runs the
trained pair's drafter (``benchmarks/models/pycode``, PyTorch on the CPU, the
training code's own forward) on held-out prompts, applies the search's
threshold rule with its sizes (``top_search_plan``) to every draft position's
logits (float16, as vLLM computes them), and reports per budget the share of
positions on each path, the most candidates a position had, and where the best
tokens sit.

    python benchmarks/top_token_crowding.py --out benchmarks/results/top_token_crowding
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

from vllm.v1.spec_decode.dflash_tree_builder import (  # noqa: E402
    top_search_plan,
    top_sort_max,
)

PAIR = ROOT / "benchmarks" / "models" / "pycode"


def candidate_counts(logits: torch.Tensor, num_top: int) -> torch.Tensor:
    """Per row of ``logits [rows, vocab]``: how many tokens reach the chunk
    search's threshold, the ``num_top``-th largest of the values the chunks
    report (each chunk its ``per_chunk`` largest distinct values)."""
    rows, vocab = logits.shape
    plan = top_search_plan(vocab, num_top)
    padded = torch.nn.functional.pad(
        logits.float(), (0, plan.num_chunks * plan.chunk - vocab), value=float("-inf")
    )
    chunks = padded.view(rows, plan.num_chunks, plan.chunk)
    # Distinct values: sort each chunk, blank repeats, take the largest.
    ordered = chunks.sort(dim=-1, descending=True).values
    repeat = torch.zeros_like(ordered, dtype=torch.bool)
    repeat[..., 1:] = ordered[..., 1:] == ordered[..., :-1]
    ordered = (
        ordered.masked_fill(repeat, float("-inf")).sort(dim=-1, descending=True).values
    )
    reported = ordered[..., : plan.per_chunk].flatten(1)
    # Fewer than num_top reported values: -inf, every token is a candidate.
    threshold = reported.sort(dim=-1, descending=True).values[:, num_top - 1 : num_top]
    return (logits.float() >= threshold).sum(dim=-1)


def search_paths(logits: torch.Tensor, num_top: int) -> dict[str, torch.Tensor]:
    """Per row of ``logits``: which path its search takes past the fast one,
    ``spill`` (more than cap candidates), of which ``select`` (more than the
    widest sort), or ``exact`` (more than spill)."""
    vocab = logits.shape[-1]
    plan = top_search_plan(vocab, num_top)
    if vocab <= plan.cap:  # whole-row sort
        none = torch.zeros(logits.shape[0], dtype=torch.bool)
        return {"spill": none, "select": none, "exact": none}
    count = candidate_counts(logits, num_top)
    spill = (count > plan.cap) & (count <= plan.spill)
    return {
        "spill": spill,
        "select": spill & (count > top_sort_max(plan)),
        "exact": count > plan.spill,
    }


def drafter_logits(pair: Path, num_prompts: int, max_len: int, stride: int):
    """[positions, vocab] float16 logits of the drafter's 15 draft positions at
    every ``stride``-th anchor of the first ``num_prompts`` held-out prompts."""
    from benchmarks.train_pair.dflash import (
        draft_logits,
        load_pair,
        target_features,
    )

    tok, target, drafter = load_pair(pair)
    block = drafter.shape.block_size
    prompts = json.loads((pair / "eval_prompts.json").read_text())["prompts"]
    rows = []
    with torch.no_grad():
        for p in prompts[:num_prompts]:
            ids = tok(p["text"], return_tensors="pt").input_ids[:, :max_len]
            if ids.shape[1] < 2 * block:
                continue
            anchors = torch.arange(stride, ids.shape[1] - block, stride)[None]
            feats = target_features(target, ids, drafter.shape.target_layer_ids)
            logits, _ = draft_logits(
                drafter,
                target.model.embed_tokens,
                target.lm_head.weight,
                ids,
                feats,
                anchors,
            )
            rows.append(logits[0, :, 1:].flatten(0, 1).half())
    return torch.cat(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--pair", type=Path, default=PAIR)
    p.add_argument("--budgets", type=int, nargs="+", default=[15, 31, 63, 127])
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--max-len", type=int, default=200)
    p.add_argument("--stride", type=int, default=8)
    args = p.parse_args(argv)
    start = time.monotonic()
    logits = drafter_logits(args.pair, args.num_prompts, args.max_len, args.stride)
    vocab = logits.shape[-1]
    rows = []
    for budget in args.budgets:
        num_top = min(budget, vocab)
        plan = top_search_plan(vocab, num_top)
        paths = search_paths(logits, num_top)
        rows.append(
            {
                "budget": budget,
                "cap": plan.cap,
                "spill": plan.spill,
                "spill_path_share": round(float(paths["spill"].float().mean()), 4),
                "select_share": round(float(paths["select"].float().mean()), 4),
                "exact_path_share": round(float(paths["exact"].float().mean()), 4),
                "max_candidates": int(candidate_counts(logits, num_top).max()),
            }
        )
    top = logits.float().topk(15, dim=-1).indices
    result = {
        "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        "pair": str(args.pair),
        "positions": int(logits.shape[0]),
        "vocab": vocab,
        "top15_ids_below_512": round(float((top < 512).float().mean()), 4),
        "rows": rows,
        "seconds": round(time.monotonic() - start, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "top_token_crowding.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"`{result['command']}`: {result['positions']} draft positions of "
        f"{args.pair.name}'s drafter, vocabulary {vocab}; "
        f"{100 * result['top15_ids_below_512']:.1f} % of their top-15 ids are < 512.",
        "",
        "| budget | cap | spill | positions on the spill path | of which "
        "select first | on the exact path | most candidates of a position |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['budget']} | {r['cap']} | {r['spill']} | "
        f"{100 * r['spill_path_share']:.1f} % | "
        f"{100 * r['select_share']:.1f} % | "
        f"{100 * r['exact_path_share']:.1f} % | {r['max_candidates']} |"
        for r in rows
    ]
    text = "\n".join(lines) + "\n"
    (args.out / "top_token_crowding.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
