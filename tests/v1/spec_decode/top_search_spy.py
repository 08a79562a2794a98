# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Reach the tree builder's fallback paths with small inputs, and see which path
each position of the top-token search took (tests only).

The builder sizes its fast paths for real vocabularies and budgets; on the small
shapes the CPU interpreter can run, the fallbacks (sort every candidate of a
depth; the top-token search's spill sort and exact radix select) are reached by
lowering those capacities here, never through the product's arguments."""

from vllm.v1.spec_decode import dflash_tree_builder as builder

_top_search_plan = builder.top_search_plan


def top_search_plan(
    vocab: int, num_top: int, cap: int | None = None, spill: int | None = None
) -> builder.TopSearchPlan:
    """The builder's plan with ``cap`` and/or ``spill`` lowered (powers of 2,
    ``num_top <= cap <= spill``; ``spill`` defaults to the builder's rule,
    ``max(2 * cap, 2048)``)."""
    plan = _top_search_plan(vocab, num_top)
    cap = plan.cap if cap is None else cap
    spill = max(2 * cap, builder._TOP_MIN_SPILL) if spill is None else spill
    if cap < num_top or cap & (cap - 1):
        raise ValueError(f"cap must be a power of 2 >= {num_top}, got {cap}")
    if spill < cap or spill & (spill - 1):
        raise ValueError(f"spill must be a power of 2 >= cap={cap}, got {spill}")
    return plan._replace(cap=cap, spill=spill)


def lower_top_search(monkeypatch, cap: int | None = None, spill: int | None = None):
    """Make the builder's top-token search use ``cap`` and ``spill``."""
    if cap is None and spill is None:
        return
    monkeypatch.setattr(
        builder,
        "top_search_plan",
        lambda vocab, num_top: top_search_plan(vocab, num_top, cap, spill),
    )


def lower_survivor_cap(monkeypatch, cap: int, sort_all: bool | None = None) -> None:
    """Make the tree selection keep only the best of a depth's candidates once
    more than ``cap`` of them enter (the builder passes its kept-key
    capacity), by sorting them all (``sort_all``) or by a radix select (None:
    the builder's choice for the budget)."""
    kernel = builder._ddtree_select_kernel
    force = {"CAP": cap} if sort_all is None else {"CAP": cap, "SORT_ALL": sort_all}

    class Launch:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                return kernel[grid](*args, **{**kwargs, **force})

            return launch

    monkeypatch.setattr(builder, "_ddtree_select_kernel", Launch())


def ranked_top_with_counts(monkeypatch, logits, k, cap=None, spill=None):
    """``_ranked_top_tokens(logits, k)`` under ``lower_top_search(cap, spill)``
    and the ``[rows]`` candidate counts handed to ``_sort_top_kernel`` (None on
    the whole-row path). The builder is patched for this call only."""
    with monkeypatch.context() as mp:
        return _ranked_top_with_counts(mp, logits, k, cap, spill)


def _ranked_top_with_counts(monkeypatch, logits, k, cap, spill):
    seen = {}
    kernel = builder._sort_top_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen["count"] = args[2].clone()  # (logits, stride, count, ...)
                return kernel[grid](*args, **kwargs)

            return launch

    lower_top_search(monkeypatch, cap, spill)
    monkeypatch.setattr(builder, "_sort_top_kernel", Spy())
    out = builder._ranked_top_tokens(logits, k)
    count = seen.get("count")
    return out, None if count is None else count.cpu()
