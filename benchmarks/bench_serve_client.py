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
each with one JSON line ``{"rc": N}`` on its original stdout. Everything the
benchmark prints goes to stderr, which the parent points at the server's log.
"""

import json
import os
import sys
import traceback
from collections.abc import Callable, Iterable
from typing import IO

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


def run_vllm_bench(argv: list[str]) -> None:
    """One ``vllm bench serve`` run in this process."""
    import asyncio

    from vllm.benchmarks.serve import main_async

    asyncio.run(main_async(parse_bench_args(argv)))


def serve_loop(
    lines: Iterable[str], reply: IO[str], run: Callable[[list[str]], None]
) -> int:
    """Run each command line read from ``lines`` with ``run`` and answer it on
    ``reply``; a failed run answers a non-zero rc and the loop goes on."""
    for line in lines:
        if not line.strip():
            continue
        try:
            run(bench_args(json.loads(line)))
            rc = 0
        except SystemExit as e:  # argparse errors exit
            rc = e.code if isinstance(e.code, int) else 1
        except Exception:
            traceback.print_exc()
            rc = 1
        sys.stdout.flush()
        sys.stderr.flush()
        reply.write(json.dumps({"rc": rc}) + "\n")
        reply.flush()
    return 0


def main() -> int:
    # Answers go out on the original stdout; the benchmark's prints join stderr.
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return serve_loop(sys.stdin, reply, run_vllm_bench)


if __name__ == "__main__":
    sys.exit(main())
