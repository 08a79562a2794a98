# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Child processes of ``bench_ddtree.py``: the time limit, engine and server
processes with their environment and logs, and the ``vllm bench serve`` client."""

import json
import math
import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from benchmarks.bench_ddtree_report import (
    RESULTS_FILE,
    SETUP_FILE,
    append_row,
    check_setup,
    load_rows,
    merge_rows,
    row_key,
)
from benchmarks.checkout import plugin_site


def prepare_out(args, setup: dict) -> set:
    """Check every earlier setup, copy earlier rows into ``--out`` (so it is
    complete on its own) and return the keys already measured."""
    args.out.mkdir(parents=True, exist_ok=True)
    for d in [*args.resume_from, args.out]:
        path = d / SETUP_FILE
        if path.is_file():
            check_setup(setup, json.loads(path.read_text()), str(d))
        elif d != args.out and not (d / RESULTS_FILE).is_file():
            raise ValueError(f"--resume-from {d}: no {RESULTS_FILE} there")
    (args.out / SETUP_FILE).write_text(json.dumps(setup, indent=1))
    own = {row_key(r) for r in load_rows([args.out])}
    for row in merge_rows(load_rows(args.resume_from)):
        if row_key(row) not in own:
            append_row(args.out, row)
            own.add(row_key(row))
    return own


def run_id() -> str:
    """Names the GPU command that measured a row (ratios across commands are
    marked in the report)."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"


class Clock:
    """The --limit-seconds budget of this command."""

    def __init__(self, limit_s: float, default_config_s: float):
        self.start = time.monotonic()
        self.limit_s = limit_s
        self.config_s = [default_config_s]
        self.measured = False

    def remaining(self) -> float:
        if not self.limit_s:
            return math.inf
        return self.limit_s - (time.monotonic() - self.start)

    def can_start(self) -> bool:
        return self.remaining() >= max(self.config_s)

    def record(self, seconds: float) -> None:
        if not self.measured:
            self.config_s = [seconds]  # the first measured replaces the guess
            self.measured = True
        else:
            self.config_s.append(seconds)


def _with_plugin(env: dict, logs: Path) -> dict:
    """Let processes that vLLM starts itself (``vllm serve``, a multiprocess
    engine core) load the plugin: its entry point and this checkout on
    ``PYTHONPATH``."""
    env["PYTHONPATH"] = os.pathsep.join(
        [str(plugin_site(logs / "plugin_site")), str(ROOT), env.get("PYTHONPATH", "")]
    )
    return env


def _worker_env(engine_in_process: bool = True) -> dict:
    """The environment of an engine process. ``engine_in_process``: the engine
    core in the worker's own process (unless the caller's environment says
    otherwise); else vLLM's default."""
    env = dict(os.environ)
    if engine_in_process:
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _run_logged(cmd: list[str], log, time_left: float, env: dict) -> bool:
    """Run ``cmd`` in its own session with output to ``log``; kill its process
    group when ``time_left`` runs out."""
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        return proc.wait(timeout=None if math.isinf(time_left) else time_left) == 0
    except subprocess.TimeoutExpired:
        print(f"    time limit: killing {cmd[-1]} (finished rows are kept)")
        _kill_group(proc)
        return False


class ServeClient:
    """One ``vllm bench serve`` process per server (``bench_serve_client.py``),
    fed one command line at a time: vLLM is imported once per server instead of
    twice per (batch, temperature). ``run`` says whether the command exited 0
    and keeps the client's ``host_usage`` of it (of ``root_pid``'s process
    tree) in ``last_usage``; when ``time_left`` runs out, or the client dies,
    the client is gone (finished runs keep their result files) and every later
    ``run`` is False."""

    SCRIPT = Path(__file__).resolve().parent / "bench_serve_client.py"

    def __init__(
        self,
        log,
        env: dict,
        root_pid: int | None = None,
        argv: list[str] | None = None,
    ):
        self.last_usage: dict | None = None
        root = [] if root_pid is None else ["--root-pid", str(root_pid)]
        self.proc = subprocess.Popen(
            argv or [sys.executable, str(self.SCRIPT), *root],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            cwd=ROOT,
            text=True,
            start_new_session=True,
        )

    def run(self, cmd: list[str], time_left: float) -> bool:
        self.last_usage = None
        if self.proc.poll() is not None:
            return False
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return False
        deadline = time.monotonic() + min(time_left, 1e9)
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 5.0))
            if ready:
                line = self.proc.stdout.readline()
                if not line:  # the client died (its traceback is in the log)
                    self.close()
                    return False
                reply = json.loads(line)
                self.last_usage = reply.get("host_usage")
                return reply.get("rc") == 0
        name = (
            cmd[cmd.index("--result-filename") + 1]
            if "--result-filename" in cmd
            else ""
        )
        print(f"    time limit: killing the run of {name} (finished rows are kept)")
        self.close()
        return False

    def close(self) -> None:
        if self.proc.poll() is None:
            _kill_group(self.proc)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def _kill_groups(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process group first, then wait for them together (a
    server at a time would spend up to 30 s each)."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    end = time.monotonic() + 30
    for p in live:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
