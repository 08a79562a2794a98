# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Greedy tokens per step of DDTree at every budget, and of the DFlash chain,
simulated on the CPU from a trained pair (a projection input, not a
measurement of vLLM).

The target (``benchmarks/models/pycode`` by default, PyTorch on the CPU)
continues each held-out prompt greedily; the drafter (the training code's own
forward) drafts a block at every position of the continuation; each block's
DDTree is built once at the largest budget by the DDTree paper's best-first
search as vLLM runs it (``build_ddtree``; its Triton kernels run in the
interpreter without a GPU), and since its nodes come out best first, the tree of
budget ``b`` is its first ``b`` nodes. A step anchored at a position commits 1 + the depth of the deepest
node on the target's own continuation; greedy decoding is then walked from the
first anchor on, each step starting where the last one's tokens end, and
tokens / steps is what vLLM reports as the mean acceptance length. The DFlash
chain is the drafter's top-1 token at each depth.

Budgets without an engine measurement (3, 7 at large batch, where a verify of
fewer rows costs less than DFlash's 16) get their acceptance here; the engine's
measured budgets check the simulation (``benchmarks/README.md``).

    python benchmarks/tree_acceptance.py --out benchmarks/results/tree_acceptance
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
from vllm.v1.spec_decode.dflash_tree_builder import build_ddtree  # noqa: E402

PAIR = ROOT / "benchmarks" / "models" / "pycode"
BUDGETS = (1, 3, 7, 15, 31, 63, 127, 255, 511)


def tree_on_path(block_logits: torch.Tensor, labels: torch.Tensor, budget: int):
    """Each node's depth ``[anchors, budget]`` in the best-first tree of
    ``budget`` nodes per anchor, and ``on_path [anchors, budget]``: node i's token is the label at its depth and its
    parent is on the label path (the root always is). ``block_logits
    [anchors, depth, vocab]``: the drafter's logits at depths 1..depth;
    ``labels [anchors, depth]``: the target's tokens there."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tree = build_ddtree(block_logits.to(device), budget)
    tokens, parents, depths = (
        t.cpu() for t in (tree.token_ids, tree.parent_ids, tree.depths)
    )
    anchors = tokens.shape[0]
    on_path = torch.zeros(anchors, budget + 1, dtype=torch.bool)
    on_path[:, 0] = True
    rows = torch.arange(anchors)
    for i in range(budget):  # parents come before their children
        d = depths[:, i].long()
        valid = tokens[:, i] >= 0
        label = labels.gather(1, (d - 1).clamp(min=0)[:, None])[:, 0]
        ok = valid & (tokens[:, i] == label) & on_path[rows, parents[:, i].long()]
        on_path[:, i + 1] = ok
    return depths, on_path[:, 1:]


def accepted_depths(
    block_logits: torch.Tensor, labels: torch.Tensor, budgets
) -> torch.Tensor:
    """``[anchors, len(budgets)]``: per anchor and budget, the depth of the
    deepest tree node on the label path (arguments as :func:`tree_on_path`)."""
    depths, on_path = tree_on_path(block_logits, labels, max(budgets))
    depth_of = torch.where(on_path, depths.long(), 0)
    # The deepest on-path node among the first b nodes, per budget.
    best = depth_of.cummax(dim=1).values
    return torch.stack([best[:, b - 1] for b in budgets], dim=1)


def chain_depths(block_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[anchors]``: leading depths where the drafter's top-1 is the label."""
    correct = block_logits.argmax(-1) == labels
    return correct.long().cumprod(-1).sum(-1)


def walk(commits: torch.Tensor) -> tuple[int, int]:
    """(tokens, steps) of greedy decoding over ``commits [anchors]``, the
    tokens a step anchored at each consecutive position commits."""
    pos = tokens = steps = 0
    while pos < commits.shape[0]:
        took = int(commits[pos])
        tokens, steps, pos = tokens + took, steps + 1, pos + took
    return tokens, steps


def drafted_blocks(
    pair: Path, num_prompts: int, max_tokens: int, rows: int | None = None
):
    """Per held-out prompt, ``(logits [anchors, depth, vocab], labels [anchors,
    depth])`` over its greedy continuation, or None for a prompt that ended
    within one block. With ``rows``, the drafter runs each block's first
    ``rows`` positions only and ``depth = rows - 1``."""
    from benchmarks.train_pair.dflash import (
        draft_logits,
        load_pair,
        target_features,
    )

    tok, target, drafter = load_pair(pair)
    block = drafter.shape.block_size
    r = block if rows is None else rows
    prompts = json.loads((pair / "eval_prompts.json").read_text())["prompts"]
    with torch.no_grad():
        for p in prompts[:num_prompts]:
            ids = tok(p["text"], return_tensors="pt").input_ids
            seq = target.generate(
                ids,
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id or 0,
            )
            # Anchors: the last prompt token on, each with a full block after it
            # (generation stops at EOS, as the engine's does, so the last
            # positions of a sequence are not drafted).
            first, last = ids.shape[1] - 1, seq.shape[1] - block
            if last < first:  # ended within one block of the prompt
                yield None
                continue
            anchors = torch.arange(first, last + 1)[None]
            feats = target_features(target, seq, drafter.shape.target_layer_ids)
            logits, labels = draft_logits(
                drafter,
                target.model.embed_tokens,
                target.lm_head.weight,
                seq,
                feats,
                anchors,
                None if r == block else r,
            )
            yield logits[0, :, 1:r].float(), labels[0, :, 1:r]


def write_result(out: Path, name: str, result: dict, text: str) -> None:
    """``out/<name>.json`` and ``out/<name>.md``, and the table printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(text)
    print(text)


def simulate(args) -> dict:
    budgets = sorted(set(args.budgets))
    tree_tokens = [0] * len(budgets)
    tree_steps = [0] * len(budgets)
    chain = [0, 0]
    anchors_total, read, skipped, start = 0, 0, 0, time.monotonic()
    blocks = drafted_blocks(args.pair, args.num_prompts, args.max_tokens)
    for n, drafted in enumerate(blocks, 1):
        read = n
        if drafted is None:
            skipped += 1
            continue
        logits, labels = drafted
        depths = accepted_depths(logits, labels, budgets)
        for j in range(len(budgets)):
            t, s = walk(1 + depths[:, j])
            tree_tokens[j] += t
            tree_steps[j] += s
        t, s = walk(1 + chain_depths(logits, labels))
        chain[0] += t
        chain[1] += s
        anchors_total += logits.shape[0]
        print(
            f"tree_acceptance: prompt {n}/{args.num_prompts}, "
            f"{anchors_total} anchors, {time.monotonic() - start:.0f} s",
            flush=True,
        )
    return {
        "command": "python " + " ".join([sys.argv[0], *(args.argv or sys.argv[1:])]),
        "pair": str(args.pair),
        "prompts": read - skipped,
        "skipped_prompts": skipped,
        "anchors": anchors_total,
        "max_tokens": args.max_tokens,
        "dflash_chain": round(chain[0] / chain[1], 3),
        "budgets": {
            str(b): round(t / s, 3) for b, t, s in zip(budgets, tree_tokens, tree_steps)
        },
    }


def markdown(result: dict) -> str:
    chain = result["dflash_chain"]
    lines = [
        "# DDTree acceptance by budget, simulated (CPU, greedy; a projection input)",
        "",
        f"`{result['command']}`: {result['prompts']} held-out prompts of "
        f"{result['pair']}, {result['max_tokens']} greedy tokens each, "
        f"{result['anchors']} drafted blocks"
        + (
            f" ({result['skipped_prompts']} prompts ended within one block and "
            "were left out)."
            if result.get("skipped_prompts")
            else "."
        ),
        "",
        "| budget | tokens per step | x DFlash chain |",
        "|---|---|---|",
        f"| DFlash chain (15) | {chain:.3f} | 1.000 |",
    ]
    for budget, tau in result["budgets"].items():
        lines.append(f"| {budget} | {tau:.3f} | {tau / chain:.3f} |")
    return "\n".join(lines) + "\n"


def pair_parser(
    doc: str, budgets, num_prompts: int, max_tokens: int = 256
) -> argparse.ArgumentParser:
    """The options of a simulation over the pair's held-out prompts
    (``--budgets`` unless ``budgets`` is None)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--pair", type=Path, default=PAIR)
    if budgets is not None:
        p.add_argument("--budgets", type=int, nargs="+", default=list(budgets))
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    return p


def main(argv=None) -> int:
    p = pair_parser(__doc__, BUDGETS, 24)
    args = p.parse_args(argv)
    if min(args.budgets) < 1:
        p.error("--budgets must be >= 1")
    args.argv = argv
    result = simulate(args)
    write_result(args.out, "tree_acceptance", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
