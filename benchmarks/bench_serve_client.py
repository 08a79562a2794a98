# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One long-lived ``vllm bench serve`` process per server.

``bench_ddtree.py serve`` runs two ``vllm bench serve`` commands per (batch,
temperature): a warm-up and the timed run. Started as commands, each one imports
vLLM again, which takes tens of seconds, longer than most timed runs at
concurrency 8 and above. Here one process imports vLLM's
benchmark once and runs the same command lines one after another, each through
vLLM's own ``vllm.benchmarks.serve.main_async`` with the arguments vLLM's CLI
would parse, so the measurements are those of ``vllm bench serve``.

Protocol: the parent writes one JSON list (the command line, as
``bench_ddtree.bench_command`` builds it) per line to stdin; the client answers
each with one JSON line ``{"rc": N, "host_usage": {...} | null}`` on its
original stdout. ``host_usage`` (``benchmarks/host_usage.py``) covers vLLM's
``benchmark()`` call alone, not the argument parsing, tokenizer and dataset
loading around it, for the process tree of ``--root-pid`` (the server).
Everything the benchmark prints goes to stderr, which the parent points at the
server's log.
"""

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# What precedes the benchmark's own arguments in a command line.
BENCH_SERVE = ("-m", "vllm.entrypoints.cli.main", "bench", "serve")


def bench_args(cmd: list[str]) -> list[str]:
    """The ``vllm bench serve`` arguments of ``cmd`` (the interpreter and
    ``-m vllm.entrypoints.cli.main bench serve`` dropped)."""
    head = tuple(cmd[1 : 1 + len(BENCH_SERVE)])
    if head != BENCH_SERVE:
        raise ValueError(f"not a vllm bench serve command line: {cmd[:6]}")
    return cmd[1 + len(BENCH_SERVE) :]


def parse_bench_args(argv: list[str]):
    """``argv`` parsed by ``vllm bench serve``'s own argument parser."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    return parser.parse_args(argv)


def run_vllm_bench(argv: list[str], root_pid: int | None = None) -> dict | None:
    """One ``vllm bench serve`` run in this process; with ``root_pid``, the
    host usage of that process tree over the benchmark's requests."""
    import asyncio

    import vllm.benchmarks.serve as serve

    from benchmarks.host_usage import HostUsage

    args = parse_bench_args(argv)
    usage: dict = {}
    benchmark = serve.benchmark

    async def measured(*a, **kw):
        meter = HostUsage(root_pid)
        result = await benchmark(*a, **kw)
        usage.update(meter.stop(result.get("duration"), kw.get("num_warmups", 0)))
        return result

    # main_async looks the name up at call time: the same call, bracketed.
    serve.benchmark = measured if root_pid else benchmark
    try:
        asyncio.run(serve.main_async(args))
    finally:
        serve.benchmark = benchmark
    return usage or None


def serve_loop(
    lines: Iterable[str], reply: IO[str], run: Callable[[list[str]], dict | None]
) -> int:
    """Run each command line read from ``lines`` with ``run`` and answer it on
    ``reply`` with its rc and what ``run`` returned; a failed run answers a
    non-zero rc and the loop goes on."""
    for line in lines:
        if not line.strip():
            continue
        usage = None
        try:
            usage = run(bench_args(json.loads(line)))
            rc = 0
        except SystemExit as e:  # argparse errors exit
            rc = e.code if isinstance(e.code, int) else 1
        except Exception:
            traceback.print_exc()
            rc = 1
        sys.stdout.flush()
        sys.stderr.flush()
        reply.write(json.dumps({"rc": rc, "host_usage": usage}) + "\n")
        reply.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root-pid", type=int, default=None)
    root_pid = parser.parse_args(argv).root_pid
    # Answers go out on the original stdout; the benchmark's prints join stderr.
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import vllm.benchmarks.serve  # noqa: F401  (once, before the first command)

    return serve_loop(sys.stdin, reply, lambda argv: run_vllm_bench(argv, root_pid))


if __name__ == "__main__":
    sys.exit(main())
