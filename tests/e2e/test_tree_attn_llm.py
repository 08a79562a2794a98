# SPDX-License-Identifier: Apache-2.0
"""TREE_ATTN inside vLLM: as the target's backend, greedy tokens equal FLASH_ATTN's,
without speculation and with DFlash verifying 16-token chains (CUDA graphs on), up
to numerical ties (tests/e2e/compare.py)."""

import json
import subprocess
import sys

import pytest
import torch

from tests.e2e.compare import NUM_LOGPROBS, compare_greedy
from tests.e2e.generate import save_log
from tests.models.tiny_models import make_tiny_dflash, make_tiny_qwen3

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"
)


def run_configs(tmp_path, configs: dict[str, dict]) -> dict[str, dict]:
    """Run every configuration in a fresh process, one after another (vLLM's
    memory profiling fails when another process frees GPU memory meanwhile)."""
    results = {}
    for name, config in configs.items():
        cfg, out = tmp_path / f"{name}.json", tmp_path / f"{name}.out.json"
        cfg.write_text(json.dumps(config))
        proc = subprocess.run(
            [sys.executable, "-m", "tests.e2e.generate", str(cfg), str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
        )
        save_log(f"tree_attn_llm_{name}", proc.stdout)
        if proc.returncode != 0:
            pytest.fail(f"configuration {name} failed:\n{proc.stdout[-4000:]}")
        results[name] = json.loads(out.read_text())
    return results


def prompts(num: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 300, (num,), generator=gen).tolist()
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def llm_kwargs(target, backend, spec=None, **extra):
    kwargs = dict(
        model=str(target),
        attention_config={"backend": backend},
        max_model_len=2048,
        gpu_memory_utilization=0.3,
        seed=0,
        max_num_seqs=32,
    )
    if spec is not None:
        kwargs["speculative_config"] = spec
    kwargs.update(extra)
    return kwargs


def test_tree_attn_greedy_equals_flash_attn(tmp_path):
    target = make_tiny_qwen3(tmp_path / "target")
    drafter = make_tiny_dflash(tmp_path / "drafter", target)
    dflash = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 15}
    common = {
        "prompts": prompts(12),
        "sampling": {"temperature": 0.0, "max_tokens": 96, "ignore_eos": True,
                     "logprobs": NUM_LOGPROBS},
    }
    results = run_configs(
        tmp_path,
        {
            name: dict(common, llm=llm_kwargs(target, backend, spec))
            for name, backend, spec in [
                ("fa", "FLASH_ATTN", None),
                ("tree", "CUSTOM", None),
                ("fa_dflash", "FLASH_ATTN", dflash),
                ("tree_dflash", "CUSTOM", dflash),
            ]
        },
    )
    reference = results["fa"]
    assert all(len(t) == 96 for t in reference["token_ids"])
    for name in ("tree", "fa_dflash", "tree_dflash"):
        got = results[name]
        cmp = compare_greedy(
            got["token_ids"], got["logprobs"],
            reference["token_ids"], reference["logprobs"],
        )
        print(f"{name}: {cmp.summary()}")
        assert not cmp.errors, f"{name}: " + "; ".join(cmp.errors)
        assert cmp.num_requests == 12
