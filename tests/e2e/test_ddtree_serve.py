# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm serve`` with ``--speculative-config '{"method": "ddtree", ...}'`` on a GPU.

The server runs as vLLM's own CLI in a subprocess with the multiprocess engine
core (spawned, as the H200 machine needs), CUDA graphs and async scheduling on.
The plugin is found the way an installed package is: through its
``vllm.general_plugins`` entry point, here from a ``.dist-info`` written next to
this checkout on ``PYTHONPATH``. Checks: /v1/completions and
/v1/chat/completions, with and without streaming (greedy: the streamed text
equals the non-streamed text), a request DDTree cannot serve is refused with a
clear message, and /metrics reports spec-decode counters. About 90 s on an H200.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.e2e.engines import KV_CACHE_BYTES
from tests.e2e.generate import save_log
from tests.models.tiny_models import make_tiny_dflash, make_tiny_qwen3

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"
)

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-qwen3"
STARTUP_TIMEOUT_S = 420


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plugin_site(path: Path) -> Path:
    """A directory whose dist-info advertises the plugin's entry point."""
    info = path / "vllm_ddtree-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-ddtree\nVersion: 0.1.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nddtree = vllm_ddtree:register\n"
    )
    return path


def _post(url: str, body: dict, stream: bool = False):
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    response = urllib.request.urlopen(request, timeout=120)
    if not stream:
        return json.loads(response.read())
    chunks = []
    for line in response:
        line = line.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[len("data: "):]))
    return chunks


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddtree_serve")
    target = make_tiny_qwen3(tmp / "target")
    drafter = make_tiny_dflash(tmp / "drafter", target)
    port = _free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(_plugin_site(tmp / "site")), str(ROOT), env.get("PYTHONPATH", "")]
    )
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    spec = {"method": "ddtree", "model": str(drafter), "tree_budget": 32}
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(target),
            "--served-model-name", MODEL,
            "--speculative-config", json.dumps(spec),
            "--max-model-len", "1024",
            "--max-num-seqs", "8",
            # A fixed KV cache, no memory profiling: the server may start next
            # to other engines on the GPU (tests/e2e/engines.py).
            "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
            "--gpu-memory-utilization", "0.1",
            "--host", "127.0.0.1", "--port", str(port),
        ],
        cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                log_tail = (tmp / 'server.log').read_text()[-6000:]
                pytest.fail(f"server exited:\n{log_tail}")
            try:
                urllib.request.urlopen(f"{base}/health", timeout=5)
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"server not up:\n{(tmp / 'server.log').read_text()[-6000:]}"
                    )
                time.sleep(2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        save_log("ddtree_serve", (tmp / "server.log").read_text())


def test_completions(server):
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 40,
            "temperature": 0, "ignore_eos": True}
    out = _post(f"{server}/v1/completions", body)
    assert out["usage"]["completion_tokens"] == 40
    text = out["choices"][0]["text"]
    streamed = _post(f"{server}/v1/completions", {**body, "stream": True}, True)
    assert "".join(c["choices"][0]["text"] for c in streamed if c["choices"]) == text


def test_chat_completions(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 32,
        "temperature": 0,
        "ignore_eos": True,
    }
    out = _post(f"{server}/v1/chat/completions", body)
    assert out["usage"]["completion_tokens"] == 32
    text = out["choices"][0]["message"]["content"]
    streamed = _post(f"{server}/v1/chat/completions", {**body, "stream": True}, True)
    deltas = [
        c["choices"][0]["delta"].get("content") or ""
        for c in streamed
        if c["choices"]
    ]
    assert "".join(deltas) == text


def test_batch_of_sampled_requests(server):
    body = {"model": MODEL, "prompt": ["a", "bb", "ccc", "dddd"], "max_tokens": 24,
            "temperature": 1.0, "seed": 3, "ignore_eos": True}
    out = _post(f"{server}/v1/completions", body)
    assert len(out["choices"]) == 4
    assert out["usage"]["completion_tokens"] == 4 * 24


def test_unsupported_request_is_refused(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4,
            "repetition_penalty": 1.3}
    with pytest.raises(urllib.error.HTTPError) as err:
        _post(f"{server}/v1/completions", body)
    assert err.value.code == 400
    assert "repetition_penalty" in err.value.read().decode()


def test_metrics_report_spec_decode(server):
    metrics = urllib.request.urlopen(f"{server}/metrics", timeout=30).read().decode()
    drafts = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("vllm:spec_decode_num_drafts_total")
    ]
    assert drafts and drafts[0] > 0
