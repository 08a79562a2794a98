# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TREE_ATTN inside vLLM as the target's backend (``AttentionBackendEnum.CUSTOM``),
without speculation and with DFlash verifying 16-token chains, CUDA graphs on:
greedy tokens equal FlashAttention's (the no-speculation reference engine of
tests/e2e/engines.py, shared with test_ddtree_llm.py) up to numerical ties
(tests/e2e/compare.py). Tree rows are exercised by test_ddtree_llm.py."""

import pytest
import torch

from tests.e2e.compare import compare_greedy
from tests.e2e.engines import (
    BATCHES,
    dflash_spec,
    greedy_runs,
    llm_kwargs,
    reference_configs,
    run_engines,
    tiny_pair,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"
)

TREE_ATTN = {"backend": "CUSTOM"}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("tree_attn_llm")
    target, drafter = tiny_pair(tmp)
    configs = {"ref": reference_configs(target, drafter)["ref"]}
    # The plugin registers TREE_ATTN for DDTree engines only: these engines
    # name it without DDTree, so tests/e2e/generate.py registers it first.
    configs["tree_attn"] = {
        "llm": llm_kwargs(target, attention_config=TREE_ATTN),
        "runs": greedy_runs(),
        "register_tree_attn": True,
    }
    configs["tree_attn_dflash"] = {
        "llm": llm_kwargs(target, dflash_spec(drafter), attention_config=TREE_ATTN),
        "runs": greedy_runs(),
        "register_tree_attn": True,
    }
    return run_engines(configs, tmp, "tree_attn_llm")


@pytest.mark.parametrize("name", ["tree_attn", "tree_attn_dflash"])
def test_tree_attn_greedy_equals_flash_attn(results, name):
    for config in ("ref", name):
        if "error" in results[config]:
            pytest.fail(f"configuration {config} failed:\n{results[config]['error']}")
    ref, got = results["ref"]["runs"], results[name]["runs"]
    for n in BATCHES:
        want = ref[f"b{n}"]
        cmp = compare_greedy(
            got[f"b{n}"]["token_ids"],
            got[f"b{n}"]["logprobs"],
            want["token_ids"],
            want["logprobs"],
        )
        print(f"{name}, batch {n}: {cmp.summary()}")
        assert not cmp.errors, f"{name}, batch {n}: " + "; ".join(cmp.errors)
        assert cmp.num_requests == n
