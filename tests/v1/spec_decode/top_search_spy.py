# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Run the builder's top-token search and see how many candidates each position
brought to its last kernel, which decides the path (tests only)."""

import torch

from vllm.v1.spec_decode import dflash_tree_builder as builder


def ranked_top_with_counts(monkeypatch, logits, k, cap=None, spill=None):
    """``_ranked_top_tokens(logits, k, cap, spill)`` and the ``[rows]`` candidate
    counts handed to ``_sort_top_kernel`` (None on the whole-row path)."""
    seen = {}
    kernel = builder._sort_top_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen["count"] = args[2].clone()  # (logits, stride, count, ...)
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(builder, "_sort_top_kernel", Spy())
    out = builder._ranked_top_tokens(logits, k, cap, spill)
    count = seen.get("count")
    return out, None if count is None else count.cpu()
