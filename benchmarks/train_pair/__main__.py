# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Command line: ``python -m benchmarks.train_pair STEP [--scale S] [--out DIR]``.

Exit status 0 when the step is done, 75 when it stopped at ``--time-limit`` after
saving its state (run the same command again to continue), 2 for a missing step.
"""

import argparse
import sys
import time
from pathlib import Path

from . import continuations, corpus, drafter, target, tokenizer
from .config import SCALES, MissingStepError, Paths
from .runlog import TimeLimitReached, log, read_summary, setup_logging, update_summary

STEPS = ("corpus", "tokenizer", "target", "continuations", "drafter")
EXIT_TIME_LIMIT = 75


def run_step(step: str, paths: Paths, scale, time_limit: float, device) -> None:
    if step == "corpus":
        corpus.run(paths, scale.corpus)
    elif step == "tokenizer":
        tokenizer.run(paths, scale.tokenizer)
    elif step == "target":
        target.run(paths, scale.target, time_limit, device)
    elif step == "continuations":
        continuations.run(paths, scale.continuations, time_limit, device)
    else:
        drafter.run(paths, scale.drafter, scale.continuations, time_limit, device)


def check_scale(paths: Paths, scale_name: str) -> None:
    """Every step of one output directory uses the same scale."""
    recorded = read_summary(paths).get("run", {}).get("scale")
    if recorded not in (None, scale_name):
        raise ValueError(
            f"{paths.out} holds a --scale {recorded} run, not {scale_name}"
        )
    update_summary(paths, "run", {"scale": scale_name})


def record_command(paths: Paths, step: str, argv: list[str], seconds: float) -> None:
    summary = read_summary(paths)
    commands = summary.get("commands", [])
    commands.append({"step": step, "argv": argv, "seconds": round(seconds, 1)})
    update_summary(paths, "commands", commands)


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.train_pair", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("step", choices=(*STEPS, "all"))
    p.add_argument("--scale", choices=sorted(SCALES), default="full")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: build/train_pair/SCALE)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds a training step runs before it saves and stops "
        "(default: the scale's)",
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if any)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    scale = SCALES[args.scale]
    out = args.out or Path("build") / "train_pair" / args.scale
    paths = Paths(out)
    paths.out.mkdir(parents=True, exist_ok=True)
    check_scale(paths, args.scale)
    time_limit = args.time_limit if args.time_limit is not None else scale.time_limit
    for step in STEPS if args.step == "all" else (args.step,):
        setup_logging(paths, step)
        t0 = time.perf_counter()
        try:
            run_step(step, paths, scale, time_limit, args.device)
        except MissingStepError as e:
            log.error("%s", e)
            return 2
        except TimeLimitReached as e:
            log.warning("%s; run the same command again to continue", e)
            return EXIT_TIME_LIMIT
        finally:
            record_command(paths, step, argv, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
