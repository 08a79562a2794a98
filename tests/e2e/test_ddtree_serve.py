# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm serve`` with ``--speculative-config '{"method": "ddtree", ...}'`` on a GPU.

The server runs as vLLM's own CLI (``tests.e2e.servers``), CUDA graphs and async
scheduling on. Checks: /v1/completions and
/v1/chat/completions, with and without streaming (greedy: the streamed text
equals the non-streamed text), chat logprobs of the token ids a request asks for,
DDTree's lines in the server's log in vLLM's format, and /metrics reports
spec-decode counters. About 90 s on an H200.
"""

import json

import pytest
import torch

from tests.e2e.engines import KV_CACHE_BYTES, gpu_share
from tests.e2e.servers import ddtree_log_lines, metric, metrics, serving
from tests.e2e.servers import post as _post
from tests.models.tiny_models import make_tiny_dflash, make_tiny_qwen3

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"
)

MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddtree_serve")
    target = make_tiny_qwen3(tmp / "target")
    drafter = make_tiny_dflash(tmp / "drafter", target)
    spec = {
        "method": "ddtree",
        "model": str(drafter),
        "tree_budget": 32,
        "adaptive_budget": False,
    }
    args = [
        "--served-model-name",
        MODEL,
        "--speculative-config",
        json.dumps(spec),
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "8",
        # A fixed KV cache, no memory profiling: the server may start next
        # to other engines on the GPU (tests/e2e/engines.py).
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
        "--gpu-memory-utilization",
        "0.1",
    ]
    try:
        with (
            gpu_share(exclusive=False),
            serving(tmp, {"ddtree_serve": (str(target), args)}) as servers,
        ):
            yield servers["ddtree_serve"]
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def server(served):
    return served.base


def test_completions(server):
    body = {
        "model": MODEL,
        "prompt": "The quick brown fox",
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    }
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
        c["choices"][0]["delta"].get("content") or "" for c in streamed if c["choices"]
    ]
    assert "".join(deltas) == text


def test_batch_of_sampled_requests(server):
    body = {
        "model": MODEL,
        "prompt": ["a", "bb", "ccc", "dddd"],
        "max_tokens": 24,
        "temperature": 1.0,
        "seed": 3,
        "ignore_eos": True,
    }
    out = _post(f"{server}/v1/completions", body)
    assert len(out["choices"]) == 4
    assert out["usage"]["completion_tokens"] == 4 * 24


def test_chat_logprob_token_ids(server):
    """The logprobs of the ids asked for at every position (vLLM's OpenAI
    server takes ``logprob_token_ids`` on chat completions)."""
    asked = [5, 6, 7]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "logprob_token_ids": asked,
        "return_tokens_as_token_ids": True,
    }
    out = _post(f"{server}/v1/chat/completions", body)
    positions = out["choices"][0]["logprobs"]["content"]
    assert len(positions) == 16
    # Each position lists its emitted token and the ids asked for (vLLM's
    # layout), each with a logprob (vLLM writes -inf as -9999).
    for pos in positions:
        listed = {t["token"]: t["logprob"] for t in pos["top_logprobs"]}
        assert set(listed) - {pos["token"]} <= {f"token_id:{i}" for i in asked}
        assert {f"token_id:{i}" for i in asked} <= set(listed), listed
        assert all(-9999 < v <= 0 for v in listed.values()), listed


def test_ddtree_lines_in_vllm_log_format(served):
    """DDTree's start-up lines reach the server's log at INFO, in vLLM's format,
    from the front end (the budget) and the engine core (TREE_ATTN's warm-up)."""
    lines, bare = ddtree_log_lines(served.log_text())
    print("\n".join(f"{level} {message}" for level, message in lines))
    assert not bare, bare
    infos = [message for level, message in lines if level == "INFO"]
    assert any(m.startswith("DDTree: fixed tree_budget=32,") for m in infos)
    assert any(m.startswith("DDTree: TREE_ATTN warmed up over") for m in infos)


def test_metrics_report_spec_decode(server):
    values = metrics(server)
    drafts = metric(values, "vllm:spec_decode_num_drafts_total")
    assert drafts and drafts[0] > 0
    # One per-position series per drafter position, not per tree node (32).
    per_pos = metric(values, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert len(per_pos) == 15
    assert per_pos[0] > 0
