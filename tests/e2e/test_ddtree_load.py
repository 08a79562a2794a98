# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm serve`` with DDTree under load and faults, against no speculation.

Three servers of the trained pair (``benchmarks/models/pycode``) run side by side
on the GPU with vLLM's defaults (prefix caching, CUDA graphs, async scheduling,
default ``max_num_seqs`` and capture sizes) and a fixed KV cache, so that they
can share the GPU without memory profiling:

* ``ddtree``: ``tree_budget`` 128 (the README's), 1 GiB of KV;
* ``ddtree_preempt``: the same with 12 MiB of KV (~3k tokens for ~60 running
  requests of up to 2048): vLLM preempts and recomputes. (On this tiny model a
  low ``gpu_memory_utilization`` would still leave gigabytes of KV; a fixed
  small KV is what makes the scheduler preempt. With 48 MiB it never did.)
* ``ref``: no speculation, 1 GiB of KV.

For ``DDTREE_LOAD_SECONDS`` (default 300) each DDTree server gets 200 concurrent
streaming completions (``tests.e2e.load_client``: fresh prompts of 4-1400
tokens, 16-512 output tokens, greedy and seeded temperature 1 alternating, half
stopping at end-of-sequence, every fifth aborted after a few chunks). Halfway,
a request with a penalty and one with structured outputs must get a 400 that
names the setting, and the server must keep serving. ``ref`` replays every
request without streaming or aborts, at a higher concurrency (no speculation is
slower), for at most ``REF_CATCH_UP_S`` after the streams end. Checks: no
request failed; every finished output, and every aborted request's received
prefix, equals no speculation up to numerical ties (``tests.e2e.compare``; a
seeded difference whose tokens are not among the returned logprobs cannot be
judged and is counted, at most ``UNCHECKED_MAX`` of the requests); at least
``COVERED_FLOOR`` of the requests have a reference; at the end nothing runs or
waits and
the KV usage is back to its start value (0: every block free); the preempting
server preempted; Prometheus has one per-position series per drafter position.
About 8.5 minutes on one H200 (servers start in ~1.5 min).
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
REF_CONCURRENCY = 512
REF_CATCH_UP_S = 90
KV_BYTES = 1 << 30
PREEMPT_KV_BYTES = 12 << 20
DDTREE = ("ddtree", "ddtree_preempt")
DEPTH = 15
# Fraction of the reference's tokens the comparisons must cover (each request's
# comparison stops at its first numerical tie).
COMPARED_FLOOR = 0.6
# Finished requests per DDTree server the comparison needs at least.
REQUESTS_FLOOR = 200
# Fraction of a DDTree server's requests that must have a reference output.
COVERED_FLOOR = 0.9
# Fraction of seeded requests whose first difference may be unjudgeable.
UNCHECKED_MAX = 0.05
REFUSED = [
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "structured outputs"),
]


def _args(kv_bytes: int, spec: dict | None = None) -> list[str]:
    return load_client.server_args(
        kv_bytes, spec, max_logprobs=load_client.SEEDED_LOGPROBS
    )


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


def _client(
    mode: str, base: str, out: Path, seconds: float, concurrency: int, limit_file=None
):
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
        str(concurrency),
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
    out = {}
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # the last line of a client killed mid-write
            continue
        out[r["i"]] = r
    return out


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
    t0 = time.monotonic()

    def phase(what: str) -> None:
        print(f"[load {time.monotonic() - t0:6.0f} s] {what}", flush=True)

    with serving(tmp, specs) as servers:
        phase("servers up")
        start = {n: _state(servers[n].base) for n in DDTREE}
        limit_file = tmp / "limit"
        clients = {
            n: _client(
                "stream", servers[n].base, tmp / f"{n}.jsonl", SECONDS, CONCURRENCY
            )
            for n in DDTREE
        }
        ref_client = _client(
            "replay",
            servers["ref"].base,
            tmp / "ref.jsonl",
            SECONDS + REF_CATCH_UP_S,
            REF_CONCURRENCY,
            limit_file,
        )
        refusals = {}

        def refuse():
            time.sleep(SECONDS / 2)
            for n in DDTREE:
                refusals[n] = _refusals(servers[n].base)

        refuser = threading.Thread(target=refuse)
        refuser.start()
        for proc in clients.values():
            proc.wait(timeout=SECONDS + 120)
        refuser.join()
        phase("streams done")
        got = {n: _read(tmp / f"{n}.jsonl") for n in DDTREE}
        limit_file.write_text(str(max(max(g) for g in got.values()) + 1))
        end = {n: _state(servers[n].base) for n in DDTREE}
        try:
            ref_client.wait(timeout=REF_CATCH_UP_S + 10)
        except subprocess.TimeoutExpired:
            ref_client.kill()
        phase("reference done")
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
    log = load["logs"][name].splitlines()
    tracebacks = [
        "\n".join(log[i : i + 12]) for i, line in enumerate(log) if "Traceback" in line
    ]
    assert not tracebacks, f"{len(tracebacks)} tracebacks, first:\n{tracebacks[0]}"
    assert len(finished) >= REQUESTS_FLOOR
    assert len(aborted) >= REQUESTS_FLOOR // 10


@pytest.mark.parametrize("name", DDTREE)
def test_outputs_equal_no_speculation(load, name):
    got, ref = load["got"][name], load["ref"]
    served = [i for i, r in got.items() if not r["error"]]
    covered = [i for i in served if i in ref and not ref[i]["error"]]
    report = {"requests": len(served), "with_reference": len(covered)}
    for greedy in (True, False):
        ids = sorted(i for i in covered if got[i]["greedy"] == greedy)
        got_tokens = [got[i]["tokens"] for i in ids]
        # An aborted request is compared over the tokens it received.
        cut = [len(got[i]["tokens"]) if got[i]["aborted"] else None for i in ids]
        want_tokens = [ref[i]["tokens"][:c] for i, c in zip(ids, cut)]
        want_top = [ref[i]["top"][:c] for i, c in zip(ids, cut)]
        got_top = [got[i]["top"] for i in ids]
        if greedy:
            cmp = compare_greedy(got_tokens, got_top, want_tokens, want_top)
        else:
            cmp = compare_seeded(
                got_tokens, got_top, want_tokens, want_top, allow_unchecked=True
            )
        kind = "greedy" if greedy else "seeded"
        report[kind] = {
            "requests": cmp.num_requests,
            "identical": cmp.num_identical,
            "ties": len(cmp.ties),
            "unchecked": len(cmp.unchecked),
            "compared": cmp.num_compared,
            "total": cmp.num_total,
            "errors": cmp.errors[:5],
        }
        print(f"{name}, {kind}: {cmp.summary()}")
    _record(load, f"{name}_comparison", report)
    assert len(covered) >= COVERED_FLOOR * len(served), report
    for kind in ("greedy", "seeded"):
        r = report[kind]
        assert not r["errors"], (kind, r["errors"])
        assert r["requests"] >= REQUESTS_FLOOR // 2, (kind, r)
        assert r["compared"] >= COMPARED_FLOOR * r["total"], (kind, r)
        assert r["unchecked"] <= UNCHECKED_MAX * r["requests"], (kind, r)


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
