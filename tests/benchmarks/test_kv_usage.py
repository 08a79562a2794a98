# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/kv_usage.py: KV blocks per running request from /metrics."""

import http.server
import threading
import time

import pytest

from benchmarks.kv_usage import KvSampler, parse_metrics, summarize

# As vLLM 0.26's PrometheusStatLogger writes them (labels abridged).
PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 8.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.125
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="4096",prefix_caching_hash_algo="sha256"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
"""


def test_parse_metrics_reads_vllms_page():
    assert parse_metrics(PAGE) == {
        "usage": 0.125,
        "running": 8.0,
        "num_gpu_blocks": 4096,
    }
    assert parse_metrics("") == {"usage": None, "running": None, "num_gpu_blocks": None}


def test_summarize_averages_samples_with_requests_running():
    samples = [
        {"usage": 0.5, "running": 4.0, "num_gpu_blocks": 1000},  # 125 each
        {"usage": 0.1, "running": 0.0, "num_gpu_blocks": 1000},  # idle: skipped
        {"usage": 0.2, "running": 8.0, "num_gpu_blocks": 1000},  # 25 each
        {"usage": None, "running": 2.0, "num_gpu_blocks": 1000},  # no usage
    ]
    out = summarize(samples)
    assert out["samples"] == 2
    assert out["blocks_per_running_request"] == pytest.approx(75.0)
    assert out["usage_mean"] == pytest.approx(0.35)
    assert out["running_mean"] == pytest.approx(6.0)
    assert summarize(samples[1:2]) is None


def test_sampler_polls_a_server_between_start_and_stop():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = PAGE.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        sampler = KvSampler(f"http://127.0.0.1:{server.server_port}", 0.02)
        for _ in range(2):  # two runs accumulate
            sampler.start()
            time.sleep(0.15)
            sampler.stop()
        n = len(sampler.samples)
        time.sleep(0.1)
        assert len(sampler.samples) == n  # stopped means stopped
        out = sampler.summary()
        print(f"samples: {out['samples']}")
        assert out["samples"] >= 4 and out["errors"] == 0
        assert out["blocks_per_running_request"] == pytest.approx(0.125 * 4096 / 8)
    finally:
        server.shutdown()
    # A server that is gone counts errors, never raises.
    sampler = KvSampler(f"http://127.0.0.1:{server.server_port}", 0.02).start()
    time.sleep(0.1)
    sampler.stop()
    assert sampler.errors > 0 and sampler.summary() is None
