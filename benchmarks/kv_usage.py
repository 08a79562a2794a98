# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV blocks a server's running requests hold, sampled from its ``/metrics``
while a timed run goes on.

vLLM exports the fraction of KV blocks in use (``vllm:kv_cache_usage_perc``),
the running requests (``vllm:num_requests_running``) and the KV cache's size
(``num_gpu_blocks``, a label of ``vllm:cache_config_info``). A sample's blocks
per running request is usage x blocks / running; the summary averages the
samples with requests running. Blocks held include what a request's draft
slots reserve (its tree or chain and the drafter's lookahead) and, with prefix
caching, blocks shared with other requests count once.
"""

import re
import threading
import urllib.request

_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*$")
_NUM_GPU_BLOCKS = re.compile(r'num_gpu_blocks="(\d+)"')


def parse_metrics(text: str) -> dict[str, float | None]:
    """Usage, running requests and KV blocks from a ``/metrics`` page (the
    sums over engines; None where the page lacks a metric)."""
    usage = running = None
    blocks = None
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        if name == "vllm:kv_cache_usage_perc":
            usage = (usage or 0.0) + float(value)
        elif name == "vllm:num_requests_running":
            running = (running or 0.0) + float(value)
        elif name == "vllm:cache_config_info":
            found = _NUM_GPU_BLOCKS.search(labels)
            if found and int(found.group(1)) > 0:
                blocks = int(found.group(1))
    return {"usage": usage, "running": running, "num_gpu_blocks": blocks}


def summarize(samples: list[dict]) -> dict | None:
    """Means over the samples with requests running (None without any)."""
    live = [
        s
        for s in samples
        if s.get("running") and s.get("usage") is not None and s.get("num_gpu_blocks")
    ]
    if not live:
        return None
    per_req = [s["usage"] * s["num_gpu_blocks"] / s["running"] for s in live]
    return {
        "samples": len(live),
        "num_gpu_blocks": live[-1]["num_gpu_blocks"],
        "usage_mean": sum(s["usage"] for s in live) / len(live),
        "running_mean": sum(s["running"] for s in live) / len(live),
        "blocks_per_running_request": sum(per_req) / len(per_req),
    }


class KvSampler:
    """Polls ``base``'s ``/metrics`` every ``interval_s`` in a thread between
    :meth:`start` and :meth:`stop`; samples accumulate over several runs."""

    def __init__(self, base: str, interval_s: float = 0.25):
        self.url = base.rstrip("/") + "/metrics"
        self.interval_s = interval_s
        self.samples: list[dict] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "KvSampler":
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def summary(self) -> dict | None:
        out = summarize(self.samples)
        if out is not None:
            out["errors"] = self.errors
        return out

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=2) as resp:
                    self.samples.append(parse_metrics(resp.read().decode()))
            except OSError:
                self.errors += 1
            self._stop.wait(self.interval_s)
