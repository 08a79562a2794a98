# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The adaptive budget's acceptance calibration on one request's trees,
replayed on the CPU from a trained pair (a check of the estimator, not a
measurement of vLLM).

One request decoding greedily is the calibration's hardest case: a step adds
one tree, so a fresh engine (or one serving a single user) learns from few
nodes. The trees and their accepted paths are those of
``benchmarks/tree_acceptance.py`` (the pair's greedy continuation of each
held-out prompt, best-first trees of every budget); the walk commits one step
after another, and each step's tree goes through the product's
:class:`~vllm.v1.spec_decode.ddtree_budget.TreeAcceptanceCalibration` (its
Triton kernels, interpreted on the CPU) exactly as the engine feeds it after a
walk: the nodes' values under the current rate are the prediction, the accepted
path's length the observation. The prompts run one after another through one
calibration, from its prior, as a server's requests do.

    python benchmarks/calibration_replay.py --out benchmarks/results/calibration_replay
"""

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.tree_acceptance import (  # noqa: E402
    drafted_blocks,
    pair_parser,
    tree_on_path,
)
from vllm.v1.spec_decode.ddtree_budget import TreeAcceptanceCalibration  # noqa: E402

BUDGETS = (15, 127, 511)
WINDOW = 100  # steps per reported window


def replay(trees, budget: int, depth: int) -> list[tuple[float, float]]:
    """Per step, cumulative (predicted, observed) accepted nodes."""
    calib = TreeAcceptanceCalibration(torch.device("cpu"))
    idx = torch.zeros(1, dtype=torch.int64)
    temperature = torch.zeros(1)
    cu = torch.tensor([0, budget + 1], dtype=torch.int32)
    out = []
    for log_probs, on_path in trees:
        log_probs, on_path = log_probs[:, :budget], on_path[:, :budget]
        pos = 0
        while pos < log_probs.shape[0]:
            nodes = torch.nonzero(on_path[pos])[:, 0].to(torch.int32) + 1
            accepted = torch.zeros(1, depth, dtype=torch.int32)
            accepted[0, : nodes.numel()] = nodes
            calib.update(
                log_probs[pos : pos + 1].contiguous(),
                idx,
                temperature,
                cu,
                accepted,
                torch.tensor([nodes.numel()], dtype=torch.int32),
            )
            totals = calib.totals.tolist()
            out.append((totals[0], totals[1]))
            pos += 1 + nodes.numel()
    return out


def summarize(history: list[tuple[float, float]]) -> dict:
    def ratio(a: int, b: int) -> float:
        (p0, o0), (p1, o1) = history[a - 1] if a else (0.0, 0.0), history[b - 1]
        return round((p1 - p0) / max(o1 - o0, 1e-9) - 1, 4)

    n = len(history)
    return {
        "steps": n,
        "predicted": round(history[-1][0], 1),
        "observed": round(history[-1][1], 1),
        "error_over_run": ratio(0, n),
        "error_by_window": [
            ratio(a, min(a + WINDOW, n)) for a in range(0, n - WINDOW // 2, WINDOW)
        ],
    }


def main(argv=None) -> int:
    p = pair_parser(__doc__, BUDGETS, 16)
    args = p.parse_args(argv)
    if min(args.budgets) < 1 or max(args.budgets) > 1024:
        p.error("--budgets must be in 1..1024")
    start = time.monotonic()
    trees, depth = [], 0
    blocks = drafted_blocks(args.pair, args.num_prompts, args.max_tokens)
    for n, drafted in enumerate(blocks, 1):
        if drafted is not None:
            logits, labels = drafted
            depth = logits.shape[1]
            tree, on_path = tree_on_path(logits, labels, max(args.budgets))
            trees.append((tree.log_probs, on_path))
        print(f"calibration_replay: prompt {n}, {time.monotonic() - start:.0f} s")
    if not trees:
        p.error("no prompt was long enough to draft a block")
    result = {
        "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        "prompts": len(trees),
        "window_steps": WINDOW,
        "budgets": {},
    }
    for budget in sorted(set(args.budgets)):
        result["budgets"][str(budget)] = summarize(replay(trees, budget, depth))
        print(f"budget {budget}: {result['budgets'][str(budget)]}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration_replay.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
