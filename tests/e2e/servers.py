# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm serve`` in a subprocess for the end-to-end tests, and small HTTP helpers.

The server runs as vLLM's own CLI with the multiprocess engine core (spawned, as
the engines here need). The plugin is found the way an installed package is:
through its ``vllm.general_plugins`` entry point, from a ``.dist-info`` written
next to this checkout on ``PYTHONPATH``. Traffic goes to 127.0.0.1 only.
"""

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from benchmarks.checkout import free_port, plugin_site
from tests.e2e.generate import patched_vllm, save_log

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 420
# A line in vLLM's log format (``vllm/logger.py``: level, date, [file:line],
# message), after the "(EngineCore pid=N) " prefix of child processes.
_VLLM_LOG_LINE = re.compile(
    r"^(?:\(\S+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"\d\d-\d\d \d\d:\d\d:\d\d \[[^\]]+:\d+\] (.*)$"
)


def ddtree_log_lines(text: str) -> tuple[list[tuple[str, str]], list[str]]:
    """DDTree's lines of a server log: ``(level, message)`` for each in vLLM's
    format, and every other line that says ``DDTree:`` (printed bare)."""
    lines, bare = [], []
    for line in text.splitlines():
        if "DDTree:" not in line:
            continue
        m = _VLLM_LOG_LINE.match(line)
        if m and m.group(2).startswith("DDTree:"):
            lines.append((m.group(1), m.group(2)))
        else:
            bare.append(line)
    return lines, bare


def post(url: str, body: dict, stream: bool = False, timeout: float = 120):
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    response = urllib.request.urlopen(request, timeout=timeout)
    if not stream:
        return json.loads(response.read())
    chunks = []
    for line in response:
        line = line.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def metrics(base: str) -> dict[str, float]:
    """``/metrics`` as ``{"name{labels}": value}`` (comments dropped)."""
    text = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def metric(values: dict[str, float], name: str) -> list[float]:
    """Every sample of ``name`` (any labels)."""
    return [v for k, v in values.items() if k == name or k.startswith(name + "{")]


def server_env(tmp: Path, name: str, extra_env: dict | None = None) -> dict:
    """The server's environment; ``extra_env``'s ``PYTHONPATH`` goes first."""
    env = dict(os.environ)
    extra = dict(extra_env or {})
    # Servers started side by side must not share a compile cache folder.
    env["VLLM_CACHE_ROOT"] = str(tmp / "vllm_cache" / name)
    patched = patched_vllm()
    if patched is not None:
        # The patched vLLM's own code path (generate.PATCHED_VLLM_ENV).
        env["VLLM_PLUGINS"] = "none"
    env["PYTHONPATH"] = os.pathsep.join(
        p
        for p in [
            extra.pop("PYTHONPATH", ""),
            str(patched or plugin_site(tmp / "site")),
            str(ROOT),
            env.get("PYTHONPATH", ""),
        ]
        if p
    )
    env.update(extra)
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    return env


class Server:
    """One ``vllm serve`` process; ``base`` is its URL once :meth:`wait` returned."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        model: str,
        args: list[str],
        extra_env: dict | None = None,
    ):
        self.name = name
        self.log_path = tmp / f"{name}.log"
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        # Open for the server's lifetime; closed in stop().
        self._log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.cli.main",
                "serve",
                model,
                *args,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            cwd=tmp,
            env=server_env(tmp, name, extra_env),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def wait(self, timeout_s: float = STARTUP_TIMEOUT_S) -> str:
        """Block until ``/health`` answers; raises with the log tail otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log_text()[-6000:]}")
            try:
                urllib.request.urlopen(f"{self.base}/health", timeout=5)
                return self.base
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{self.name} not up:\n{self.log_text()[-6000:]}"
                    ) from None
                time.sleep(2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()
        save_log(self.name, self.log_path.read_text())


@contextlib.contextmanager
def serving(
    tmp: Path, specs: dict[str, tuple[str, list[str]]], extra_env: dict | None = None
) -> Iterator[dict]:
    """Start every ``name: (model, args)`` at once; yields ``name: Server`` once
    all answer, stops them all on exit."""
    servers = {}
    try:
        for name, (model, args) in specs.items():
            servers[name] = Server(tmp, name, model, args, extra_env)
        for server in servers.values():
            server.wait()
        yield servers
    finally:
        # All told at once: each takes seconds to shut its engine down.
        for server in servers.values():
            server.proc.terminate()
        for server in servers.values():
            server.stop()
