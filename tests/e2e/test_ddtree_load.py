# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm serve`` with DDTree under load and faults, against no speculation.

Three servers of the trained pair (``benchmarks/models/pycode``) run side by side
on the GPU with vLLM's defaults (prefix caching, CUDA graphs, async scheduling,
default ``max_num_seqs`` and capture sizes) and a fixed KV cache, so that they
can share the GPU without memory profiling:

* ``ddtree``: ``tree_budget`` 128 (the README's), 1 GiB of KV;
* ``ddtree_preempt``: the same with 48 MiB of KV (~12k tokens for ~60 running
  requests of up to 2048): vLLM preempts and recomputes all the time. (On this
  tiny model a low ``gpu_memory_utilization`` would still leave gigabytes of
  KV; a fixed small KV is what makes the scheduler preempt.)
* ``ref``: no speculation, 1 GiB of KV.

For ``DDTREE_LOAD_SECONDS`` (default 300) each DDTree server gets 200 concurrent
streaming completions (``tests.e2e.load_client``: fresh prompts of 4-1400
tokens, 16-512 output tokens, greedy and seeded temperature 1 alternating, half
stopping at end-of-sequence, every fifth aborted after a few chunks). Halfway,
a request with a penalty and one with structured outputs must get a 400 that
names the setting, and the server must keep serving. ``ref`` replays every
request without streaming or aborts. Checks: no request failed; every finished
output, and every aborted request's received prefix, equals no speculation up
to numerical ties (``tests.e2e.compare``); at the end nothing runs or waits and
the KV usage is back to its start value (0: every block free); the preempting
server preempted; Prometheus has one per-position series per drafter position.
About 7 minutes on one H200 (servers start in ~1.5 min).
"""

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
from pathlib import Path

import pytest
import torch

from tests.e2e import load_client
from tests.e2e.compare import compare_greedy, compare_seeded
from tests.e2e.generate import save_log
from tests.e2e.servers import ROOT, metric, metrics, post, serving

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"
)

PAIR = ROOT / "benchmarks" / "models" / "pycode"
SECONDS = float(os.environ.get("DDTREE_LOAD_SECONDS", "300"))
CONCURRENCY = 200
KV_BYTES = 1 << 30
PREEMPT_KV_BYTES = 48 << 20
DDTREE = ("ddtree", "ddtree_preempt")
DEPTH = 15
# Fraction of the reference's tokens the comparisons must cover (each request's
# comparison stops at its first numerical tie).
COMPARED_FLOOR = 0.6
# Finished requests per DDTree server the comparison needs at least.
REQUESTS_FLOOR = 200
REFUSED = [
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "structured outputs"),
]


def _args(kv_bytes: int, spec: dict | None = None) -> list[str]:
    args = [
        "--served-model-name",
        load_client.MODEL,
        "--max-model-len",
        str(load_client.MAX_MODEL_LEN),
        "--kv-cache-memory-bytes",
        str(kv_bytes),
        "--gpu-memory-utilization",
        "0.1",
    ]
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec)]
    return args


def _probe(base: str) -> None:
    """One finished request: the scheduler publishes its stats after a step."""
    post(
        f"{base}/v1/completions",
        {
            "model": load_client.MODEL,
            "prompt": [5, 6, 7],
            "max_tokens": 4,
            "temperature": 0,
        },
    )
    time.sleep(3)


def _state(base: str) -> dict:
    _probe(base)
    values = metrics(base)

    def one(name):
        return sum(metric(values, name))

    drafts = one("vllm:spec_decode_num_drafts_total")
    accepted = one("vllm:spec_decode_num_accepted_tokens_total")
    return {
        "kv_usage": one("vllm:kv_cache_usage_perc"),
        "running": one("vllm:num_requests_running"),
        "waiting": one("vllm:num_requests_waiting"),
        "preemptions": one("vllm:num_preemptions_total"),
        "per_pos_series": len(
            metric(values, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
        ),
        "acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def _refusals(base: str) -> list[dict]:
    out = []
    for extra, words in REFUSED:
        body = {
            "model": load_client.MODEL,
            "prompt": [5, 6, 7],
            "max_tokens": 4,
            **extra,
        }
        try:
            post(f"{base}/v1/completions", body)
            out.append({"words": words, "status": 200, "message": ""})
        except urllib.error.HTTPError as e:
            out.append(
                {"words": words, "status": e.code, "message": e.read().decode()[:500]}
            )
    # ... and the server still serves.
    after = post(
        f"{base}/v1/completions",
        {
            "model": load_client.MODEL,
            "prompt": [8, 9],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    out.append(
        {
            "words": "served after",
            "status": 200,
            "message": str(after["usage"]["completion_tokens"]),
        }
    )
    return out


def _client(mode: str, base: str, out: Path, seconds: float, limit_file=None):
    cmd = [
        sys.executable,
        "-m",
        "tests.e2e.load_client",
        mode,
        base,
        str(out),
        "--seconds",
        str(seconds),
        "--concurrency",
        str(CONCURRENCY),
    ]
    if limit_file is not None:
        cmd += ["--limit-file", str(limit_file)]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        },
    )


def _read(path: Path) -> dict[int, dict]:
    return {r["i"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddtree_load")
    target, drafter = str(PAIR / "target"), str(PAIR / "drafter")
    spec = {"method": "ddtree", "model": drafter, "tree_budget": 128}
    specs = {
        "ddtree": (target, _args(KV_BYTES, spec)),
        "ddtree_preempt": (target, _args(PREEMPT_KV_BYTES, spec)),
        "ref": (target, _args(KV_BYTES)),
    }
    result = {"seconds": SECONDS, "concurrency": CONCURRENCY}
    with serving(tmp, specs) as servers:
        start = {n: _state(servers[n].base) for n in DDTREE}
        limit_file = tmp / "limit"
        clients = {
            n: _client("stream", servers[n].base, tmp / f"{n}.jsonl", SECONDS)
            for n in DDTREE
        }
        ref_client = _client(
            "replay", servers["ref"].base, tmp / "ref.jsonl", SECONDS + 300, limit_file
        )
        refusals = {}

        def refuse():
            time.sleep(SECONDS / 2)
            for n in DDTREE:
                refusals[n] = _refusals(servers[n].base)

        refuser = threading.Thread(target=refuse)
        refuser.start()
        for proc in clients.values():
            proc.wait(timeout=SECONDS + 400)
        refuser.join()
        got = {n: _read(tmp / f"{n}.jsonl") for n in DDTREE}
        limit_file.write_text(str(max(max(g) for g in got.values()) + 1))
        ref_client.wait(timeout=SECONDS + 400)
        end = {n: _state(servers[n].base) for n in DDTREE}
        alive = {n: s.proc.poll() is None for n, s in servers.items()}
        logs = {n: s.log_text() for n, s in servers.items()}
    result.update(start=start, end=end, refusals=refusals, alive=alive)
    return {
        "got": got,
        "ref": _read(tmp / "ref.jsonl"),
        "result": result,
        "logs": logs,
        "clients_rc": {n: p.returncode for n, p in clients.items()},
    }


def _record(load, name: str, entry: dict) -> None:
    load["result"][name] = entry
    save_log("ddtree_load_summary", json.dumps(load["result"], indent=1))


@pytest.mark.parametrize("name", DDTREE)
def test_served_without_errors(load, name):
    runs = load["got"][name].values()
    errors = [r for r in runs if r["error"]]
    finished = [r for r in runs if not r["error"] and not r["aborted"]]
    aborted = [r for r in runs if r["aborted"]]
    counts = {
        "requests": len(runs),
        "finished": len(finished),
        "aborted": len(aborted),
        "errors": len(errors),
        "tokens": sum(len(r["tokens"]) for r in runs),
    }
    _record(load, f"{name}_counts", counts)
    print(f"{name}: {counts}")
    assert load["clients_rc"][name] == 0
    assert not errors, errors[:5]
    assert load["result"]["alive"][name]
    assert "Traceback" not in load["logs"][name]
    assert len(finished) >= REQUESTS_FLOOR
    assert len(aborted) >= REQUESTS_FLOOR // 10


@pytest.mark.parametrize("name", DDTREE)
def test_outputs_equal_no_speculation(load, name):
    got, ref = load["got"][name], load["ref"]
    report = {}
    for greedy in (True, False):
        ids = sorted(
            i for i, r in got.items() if r["greedy"] == greedy and not r["error"]
        )
        missing = [i for i in ids if i not in ref or ref[i]["error"]]
        assert not missing, f"no reference for requests {missing[:10]}"
        got_tokens = [got[i]["tokens"] for i in ids]
        # An aborted request is compared over the tokens it received.
        want = [ref[i] for i in ids]
        cut = [len(g) if got[i]["aborted"] else None for i, g in zip(ids, got_tokens)]
        want_tokens = [w["tokens"][:c] for w, c in zip(want, cut)]
        want_top = [w["top"][:c] for w, c in zip(want, cut)]
        compare = compare_greedy if greedy else compare_seeded
        cmp = compare(got_tokens, [got[i]["top"] for i in ids], want_tokens, want_top)
        kind = "greedy" if greedy else "seeded"
        report[kind] = {
            "requests": cmp.num_requests,
            "identical": cmp.num_identical,
            "ties": len(cmp.ties),
            "compared": cmp.num_compared,
            "total": cmp.num_total,
            "errors": cmp.errors[:5],
        }
        print(f"{name}, {kind}: {cmp.summary()}")
    _record(load, f"{name}_comparison", report)
    for kind, r in report.items():
        assert not r["errors"], (kind, r["errors"])
        assert r["requests"] >= REQUESTS_FLOOR // 2, (kind, r)
        assert r["compared"] >= COMPARED_FLOOR * r["total"], (kind, r)


@pytest.mark.parametrize("name", DDTREE)
def test_idle_and_every_block_back(load, name):
    start, end = load["result"]["start"][name], load["result"]["end"][name]
    print(f"{name}: start {start}, end {end}")
    assert end["running"] == end["waiting"] == 0
    assert start["kv_usage"] == end["kv_usage"] == 0.0


def test_preempting_server_preempted(load):
    end = load["result"]["end"]
    print(
        f"preemptions: {end['ddtree_preempt']['preemptions']} (1 GiB KV: "
        f"{end['ddtree']['preemptions']})"
    )
    assert end["ddtree_preempt"]["preemptions"] >= 10


@pytest.mark.parametrize("name", DDTREE)
def test_unsupported_requests_refused_while_serving(load, name):
    refusals = load["result"]["refusals"][name]
    print(f"{name}: {refusals}")
    *refused, after = refusals
    for r in refused:
        assert r["status"] == 400, r
        assert "DDTree does not support" in r["message"], r
        assert r["words"] in r["message"], r
    assert after["message"] == "8"


@pytest.mark.parametrize("name", DDTREE)
def test_metrics_sized_by_drafter_depth(load, name):
    end = load["result"]["end"][name]
    assert end["per_pos_series"] == DEPTH
    assert end["acceptance_length"] > 1.5
