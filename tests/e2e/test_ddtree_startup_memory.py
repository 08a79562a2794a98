# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A DDTree engine on Qwen3-8B shapes starts and serves under vLLM's defaults.

vLLM's memory profile (Model Runner V2) sizes the KV cache before the CUDA graphs
are captured and reserves nothing for them, so graphs and the first real steps
must fit in what ``gpu_memory_utilization`` leaves free. With capture sizes up
to ``max_num_batched_tokens`` they did not: on the H200, budgets 7, 15 and 127
ran out of memory at start-up while DFlash started (a cost run of 2026-12-02,
in git history). Here each engine gets nothing but the model, dummy weights,
``max_model_len`` and the speculative config (vLLM's memory profiling, its
``max_num_seqs`` and capture sizes, multiprocess off as in every e2e engine),
one at a time (the profile needs the GPU to itself), and then decodes a full
batch of 64 requests and a single one. About 2 minutes per engine on one H200.
"""

import pytest
import torch

from tests.e2e.engines import ROOT, run_engines

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"
)

CONFIGS = ROOT / "benchmarks" / "model_configs"
# The drafter's graphs (budget 7: 1024 requests' logits), the target's graphs
# and the warm-up step (budget 127), and what a user gets by default.
BUDGETS = ("7", "127", "auto")
MAX_TOKENS = 16
BATCH = 64


def _config(budget: str) -> dict:
    gen = torch.Generator().manual_seed(int(budget) if budget.isdigit() else 0)
    prompts = [
        torch.randint(0, 151000, (int(n),), generator=gen).tolist()
        for n in torch.randint(16, 600, (BATCH,), generator=gen)
    ]
    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    spec = {
        "method": "ddtree",
        "model": str(CONFIGS / "dflash_qwen3_8b"),
        "adaptive_budget": False,
    }
    spec["tree_budget"] = budget if budget == "auto" else int(budget)
    return {
        "llm": {
            "model": str(CONFIGS / "qwen3_8b"),
            "load_format": "dummy",
            "skip_tokenizer_init": True,
            "max_model_len": 4096,
            "seed": 0,
            "speculative_config": spec,
        },
        "runs": [
            {
                "name": name,
                "requests": [{"prompt": p, "sampling": greedy} for p in batch],
            }
            for name, batch in (("full", prompts), ("single", prompts[:1]))
        ],
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("ddtree_startup_memory")
    out = {}
    for budget in BUDGETS:  # one engine at a time: vLLM's memory profile
        out.update(run_engines({budget: _config(budget)}, tmp, "ddtree_startup_memory"))
    return out


@pytest.mark.parametrize("budget", BUDGETS)
def test_starts_and_decodes_under_vllm_defaults(results, budget):
    got = results[budget]
    assert "error" not in got, got.get("error", "")[-3000:]
    facts = got["engine"]
    print(f"ddtree-{budget}: {facts}")
    # vLLM's own limits, fitted to DDTree (not set by the test).
    assert facts["enable_prefix_caching"] and "FULL" in facts["cudagraph_mode"]
    assert facts["max_num_seqs"] >= BATCH
    # vLLM's largest graph (512 tokens), or one request's tree if larger.
    one_tree = int(budget) + 1 if budget.isdigit() else 32
    assert one_tree <= facts["max_cudagraph_capture_size"] <= max(512, one_tree)
    assert facts["num_cudagraph_capture_sizes"] >= 50
    for name, size in (("full", BATCH), ("single", 1)):
        run = got["runs"][name]
        tokens = run["token_ids"]
        assert len(tokens) == size
        assert all(t is not None and len(t) == MAX_TOKENS for t in tokens), name
        assert run["paths"]["tree_steps"] > 0, run["paths"]
