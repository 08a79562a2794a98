# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/top_token_crowding.py: its threshold rule counts the candidates the
builder's kernels count (run in Triton's interpreter), so its shares say which
positions take the spill and exact paths."""

import pytest
import torch

from benchmarks import top_token_crowding as ttc
from tests.v1.spec_decode.top_search_spy import ranked_top_with_counts
from vllm.v1.spec_decode import dflash_tree_builder as builder


def _kernel_counts(monkeypatch, logits, k):
    """The candidate counts the search's kernels hand to ``_sort_top_kernel``
    (they do not depend on spill; a small one keeps the interpreter quick)."""
    spill = 2 * builder.top_search_plan(logits.shape[-1], k).cap
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _, count = ranked_top_with_counts(
        monkeypatch, logits[None].to(device), k, spill=spill
    )
    return count


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
    plan = builder.top_search_plan(5000, k)
    paths = ttc.search_paths(logits, k)
    assert torch.equal(paths["spill"], (want > plan.cap) & (want <= plan.spill))
    widest = builder.top_sort_max(plan)
    assert torch.equal(paths["select"], paths["spill"] & (want > widest))
    assert torch.equal(paths["exact"], want > plan.spill)
    if kind == "crowded":
        assert bool(paths["spill"].any())  # the case does exercise the path


def test_small_vocabulary_sorts_whole_rows():
    paths = ttc.search_paths(torch.randn(3, 20), 15)
    assert not (paths["spill"].any() or paths["exact"].any())
