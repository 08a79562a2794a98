# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where a greedy serving cell's outputs part, how close the two tokens were.

``bench_ddtree.py serve`` keeps each T=0 cell's generated texts (its
``logs/<config>_b<batch>_t0.0[.sliceN].json``, with the prompts beside them)
and reports which configs agree with no speculation. A speculative config is
lossless if it parts only where the target's two best tokens tie in the
serving dtype: fp16 GEMMs and attention of another batch shape may then break
the tie the other way. This script checks that for the embedded pair, whose
target computes the trained pair's logits exactly (``embed_pair.py``): for
every text that differs from no speculation's, it finds the first token where
the two part and scores both tokens with the trained pair's target in float32
on the CPU. A margin within ``--tolerance`` is a tie: a few fp16 spacings at
such logits (2**-7 from 8 to 16, 2**-6 from 16 to 32), as far as an fp16
forward strays from float32 (no speculation's own output parts from the
float32 argmax by as much). Compare the configs' largest margins: DFlash,
which vLLM ships as lossless, sets the bar for DDTree.

    python3 benchmarks/greedy_margins.py --logs OUT/record_1/logs \\
        [--logs OUT/record_2/logs] [--reference none] [--out margins.json]

No GPU and nothing downloaded: the pair is ``benchmarks/models/pycode``.
"""

import argparse
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAIR_TARGET = ROOT / "benchmarks" / "models" / "pycode" / "target"
# <config>_b<batch>_t0.0.slice<j>.json, or without the slice part.
_CELL = re.compile(
    r"^(?P<config>.+)_b(?P<batch>\d+)_t0\.0(?:\.slice(?P<slice>\d+))?\.json$"
)


def fp16_spacing(x: float) -> float:
    """The gap between adjacent float16 values near ``x`` (normal range)."""
    x = abs(x)
    if x < 2**-14:
        return 2**-24
    return 2.0 ** (math.floor(math.log2(x)) - 10)


def greedy_cells(logs: Path) -> dict[tuple[str, int, int], Path]:
    """(config, batch, slice) -> the result file that holds generated texts."""
    cells = {}
    for path in sorted(logs.glob("*_t0.0*.json")):
        m = _CELL.match(path.name)
        if m is None:
            continue
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not data.get("generated_texts"):
            continue
        cells[(m["config"], int(m["batch"]), int(m["slice"] or 0))] = path
    return cells


def prompt_texts(result: Path) -> list[str]:
    """The prompts a result file was generated from (its ``.prompts.json``:
    sharegpt-style rows, the first turn is the prompt)."""
    rows = json.loads(result.with_suffix(".prompts.json").read_text())
    return [row["conversations"][0]["value"] for row in rows]


def first_parting(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's end
    counts), or None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--logs", type=Path, action="append", required=True)
    p.add_argument("--reference", default="none")
    p.add_argument("--target", type=Path, default=PAIR_TARGET)
    p.add_argument("--tolerance", type=float, default=0.03)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    model.eval()
    eos = tok.eos_token_id

    # The reference texts may sit in another folder (one server group ran no
    # speculation, another group reused its prompts); a config in several
    # folders is named with its folder's position: "dflash#2".
    cells: dict[tuple[str, int, int], Path] = {}
    refs: dict[tuple[int, int], Path] = {}
    seen: set[str] = set()
    for n, logs in enumerate(args.logs, start=1):
        here = greedy_cells(logs)
        names = {c for c, _, _ in here}
        for (config, batch, j), path in here.items():
            if config == args.reference:
                refs.setdefault((batch, j), path)
                continue
            name = config if config not in seen else f"{config}#{n}"
            cells[(name, batch, j)] = path
        seen |= names
    rows, compared = [], 0
    for (config, batch, j), path in sorted(cells.items()):
        ref_path = refs.get((batch, j))
        if ref_path is None:
            continue
        prompts = prompt_texts(ref_path)
        if prompt_texts(path) != prompts:
            print(f"{path.name}: prompts differ from {ref_path.name}, skipped")
            continue
        ref = json.loads(ref_path.read_text())["generated_texts"]
        got = json.loads(path.read_text())["generated_texts"]
        for i, (x, y) in enumerate(zip(ref, got)):
            compared += 1
            if x == y:
                continue
            ix = tok(x, add_special_tokens=False)["input_ids"] + [eos]
            iy = tok(y, add_special_tokens=False)["input_ids"] + [eos]
            k = first_parting(ix, iy)
            if k is None or k >= min(len(ix), len(iy)):
                continue  # one text is the other's prefix: a length cut
            context = tok(prompts[i])["input_ids"] + ix[:k]
            with torch.inference_mode():
                logits = model(torch.tensor([context])).logits[0, -1].float()
            a, b = logits[ix[k]].item(), logits[iy[k]].item()
            top = logits.max().item()
            rows.append(
                {
                    "config": config,
                    "batch": batch,
                    "slice": j,
                    "prompt": i,
                    "token": k,
                    "reference_token": tok.decode([ix[k]]),
                    "config_token": tok.decode([iy[k]]),
                    "reference_logit": round(a, 5),
                    "config_logit": round(b, 5),
                    "best_logit": round(top, 5),
                    "margin": round(abs(a - b), 5),
                    "fp16_spacing": fp16_spacing(max(a, b)),
                    "tie": abs(a - b) <= args.tolerance
                    and max(a, b) >= top - args.tolerance,
                }
            )
            r = rows[-1]
            print(
                f"{config} batch {batch} slice {j} prompt {i} token {k}: "
                f"{r['reference_token']!r} {a:.4f} vs {r['config_token']!r} {b:.4f} "
                f"(margin {r['margin']:.4f}, fp16 spacing {r['fp16_spacing']:.4f})"
                f"{'' if r['tie'] else '  NOT A TIE'}",
                flush=True,
            )
    if compared == 0:
        print("greedy_margins: no greedy cell with a reference to compare")
        return 1
    ties = sum(r["tie"] for r in rows)
    largest: dict[str, float] = {}
    for r in rows:
        largest[r["config"]] = max(largest.get(r["config"], 0.0), r["margin"])
    print(
        f"greedy_margins: {compared} texts compared, {len(rows)} part from "
        f"{args.reference!r}, {ties} of them at ties (margin <= {args.tolerance}); "
        "largest margin by config: "
        + (", ".join(f"{c} {m:.4f}" for c, m in sorted(largest.items())) or "-")
    )
    if args.out is not None:
        summary = {"compared": compared, "tolerance": args.tolerance}
        summary["largest_margin"] = largest
        summary["partings"] = rows
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if ties == len(rows) else 2


if __name__ == "__main__":
    sys.exit(main())
