# SPDX-License-Identifier: Apache-2.0
"""benchmarks/top_token_crowding.py: its threshold rule counts the candidates the
builder's kernels count (run in Triton's interpreter), so its shares say which
positions take the exact path."""

import pytest
import torch

from benchmarks import top_token_crowding as ttc
from vllm.v1.spec_decode import dflash_tree_builder as builder


def _kernel_counts(monkeypatch, logits, k):
    """The candidate counts the search's kernels hand to ``_sort_top_kernel``."""
    seen = {}
    kernel = builder._sort_top_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen["count"] = args[2].clone()  # (logits, stride, count, ...)
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(builder, "_sort_top_kernel", Spy())
    builder._ranked_top_tokens(logits[None], k)
    return seen["count"]


@pytest.mark.parametrize("kind", ["randn", "crowded"])
@pytest.mark.parametrize("k", [16, 31])
def test_counts_match_the_kernels(monkeypatch, kind, k):
    gen = torch.Generator().manual_seed(k)
    logits = torch.randn(6, 5000, generator=gen)
    if kind == "crowded":  # best tokens at low ids, as over a BPE vocabulary
        logits[:, : 4 * k] += torch.linspace(6, 9, 4 * k)
    logits = logits.half().float()
    want = _kernel_counts(monkeypatch, logits, k)
    assert torch.equal(ttc.candidate_counts(logits, k), want.to(torch.int64))
    cap = builder.top_search_plan(5000, k).cap
    assert torch.equal(ttc.takes_exact_path(logits, k), want > cap)
    if kind == "crowded":
        assert bool((want > cap).any())  # the case does exercise the path


def test_small_vocabulary_sorts_whole_rows():
    assert not ttc.takes_exact_path(torch.randn(3, 20), 15).any()
