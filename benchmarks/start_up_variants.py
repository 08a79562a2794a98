# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Triton kernel variants an adaptive DDTree server compiles at start-up,
counted (and, with ``--compile``, compiled for Hopper and timed) without a GPU.

Triton compiles a kernel once per distinct cache key: its constexpr arguments,
launch options, and the specialisations of its other arguments (an integer
equal to 1 or divisible by 16, a pointer's alignment). Here Triton's driver is
replaced by one that reports an sm90 target, and the launches of
``AdaptiveTreeBudget.warm_up`` (for every tree width the drafter builds:
``build_ddtree``, the trees' store into the request state and the acceptance
estimate; for one cap of every block: the batch-wide split) are made on CPU
tensors of the server's shapes. Each launch goes through Triton's own binder
and cache key; a ``jit_cache_hook`` records each new key instead of launching.
With ``--compile`` each recorded variant is compiled for sm90 (``ptxas`` from
Triton's wheel) into a fresh on-disk cache, and its seconds on this host are
printed: a cold start's compile work, not a GPU server's wall time; with
``--workers N`` as well, the variants compile on N threads as
``compile_in_parallel`` runs them, and the wall time is printed.

The widths and caps are the scheduler's (``scheduled_tree_budgets``) for
``vllm serve`` on an H100/H200 (1024 sequences, 8192 batched tokens, which
DDTree fits to 512 sequences; vLLM's capture sizes), or for the limits given.

    python benchmarks/start_up_variants.py [--vocab 151936] [--tree-budget 128]
        [--max-num-seqs 1024] [--max-num-batched-tokens 8192] [--compile]
        [--workers N]
"""

import argparse
import collections
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEPTH = 15
QWEN3_VOCAB = 151936
# vllm serve's defaults on GPUs of 70 GiB or more (vLLM's EngineArgs).
SERVE_MAX_NUM_SEQS = 1024
SERVE_MAX_NUM_BATCHED_TOKENS = 8192


def use_sm90_compiler() -> None:
    """Make this process's Triton compile for sm90 without a GPU (call before
    importing any kernel module, with TRITON_INTERPRET unset)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 runs kernels, nothing is compiled")
    os.environ["TRITON_INTERPRET"] = "0"  # use_checkout would set it
    import torch
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime.driver import driver

    class SM90Driver(DriverBase):
        def __init__(self):
            pass

        @classmethod
        def is_active(cls):
            return True

        def map_python_to_cpp_type(self, ty):
            return ty

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_benchmarker(self):
            raise NotImplementedError

        def get_device_interface(self):
            raise NotImplementedError

    driver.set_active(SM90Driver())
    from benchmarks.checkout import use_checkout

    use_checkout()
    from vllm import triton_utils

    triton_utils.triton, triton_utils.tl = triton, tl
    triton_utils.HAS_TRITON = triton_utils.importing.HAS_TRITON = True


class VariantRecorder:
    """Triton's ``jit_cache_hook``: records each new variant (kernel name, cache
    key) and skips its launch; with ``compile_variants`` compiles it for the
    active target first and keeps the seconds."""

    def __init__(self, compile_variants: bool = False):
        self.compile_variants = compile_variants
        # kernel name -> [(cache key, compile seconds or None)]
        self.variants: dict[str, list[tuple[object, float | None]]] = (
            collections.defaultdict(list)
        )
        self._seen: set[tuple[str, object]] = set()
        # (JIT function, specialization data) of each variant, to compile later.
        self.specializations: list[tuple[object, str]] = []

    def __enter__(self) -> Self:
        from triton import knobs

        self._previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self
        return self

    def __exit__(self, *exc) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook = self._previous

    def __call__(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):
        from triton import knobs

        if (fn.name, key) not in self._seen:
            self._seen.add((fn.name, key))
            self.specializations.append(
                (fn.jit_function, compile["specialization_data"])
            )
            seconds = None
            if self.compile_variants:
                jit_fn = fn.jit_function
                knobs.runtime.jit_cache_hook = None
                start = time.perf_counter()
                try:
                    jit_fn.preload(compile["specialization_data"])
                finally:
                    knobs.runtime.jit_cache_hook = self
                seconds = time.perf_counter() - start
                # The compiled kernel cannot launch here: forget it, so that the
                # next launch of this key comes back to the hook.
                for kernel_cache, *_ in jit_fn.device_caches.values():
                    kernel_cache.pop(key, None)
            self.variants[fn.name].append((key, seconds))
        return True  # no launch

    def counts(self) -> dict[str, int]:
        return {name: len(v) for name, v in sorted(self.variants.items())}

    def seconds(self) -> dict[str, float]:
        return {
            name: sum(s or 0.0 for _, s in v)
            for name, v in sorted(self.variants.items())
        }


def server_slots(
    tree_budget: int,
    max_num_seqs: int = SERVE_MAX_NUM_SEQS,
    max_num_batched_tokens: int = SERVE_MAX_NUM_BATCHED_TOKENS,
    depth: int = DEPTH,
) -> tuple[list[int], list[int]]:
    """(tree widths, split caps) an adaptive server's warm-up launches, with
    the limits DDTree fits from vLLM's (the user set neither)."""
    from vllm.v1.spec_decode.ddtree_budget import cap_block
    from vllm.v1.spec_decode.ddtree_config import (
        DDTreeConfig,
        adaptive_ladder,
        batch_limits,
        default_max_capture_size,
        scheduled_tree_budgets,
    )

    cfg = DDTreeConfig(
        tree_budget, depth, adaptive_ladder(tree_budget)[1:-1], adaptive=True
    )
    seqs, tokens = batch_limits(cfg, max_num_seqs, max_num_batched_tokens, False, False)
    slots = scheduled_tree_budgets(
        cfg, seqs, tokens, default_max_capture_size(cfg, seqs, tokens)
    )
    widths = sorted({max(1, k) for k in slots[1:]})
    most = max(slots[1:])
    caps = sorted({min(cap_block(c), most) for c in range(1, most + 1)})
    return widths, caps


def start_up_launches(
    vocab: int, tree_budget: int, widths: list[int], caps: list[int]
) -> None:
    """The tree builder's and the adaptive budget's launches of
    ``AdaptiveTreeBudget.warm_up``, on CPU tensors of one request."""
    import torch

    from vllm.v1.attention.ops.tree_mask import num_mask_words
    from vllm.v1.spec_decode.ddtree_budget import (
        TreeAcceptanceCalibration,
        assign_tree_nodes,
        expected_accepted_nodes,
    )
    from vllm.v1.spec_decode.ddtree_inputs import store_draft_trees
    from vllm.v1.spec_decode.dflash_tree_builder import DDTree, build_ddtree

    cpu = torch.device("cpu")
    max_num_reqs = 2
    state = DDTree.empty(max_num_reqs, tree_budget, cpu)
    draft_tokens = torch.zeros(max_num_reqs, tree_budget, dtype=torch.int64)
    flat = DDTree.empty(max_num_reqs, tree_budget, cpu)
    idx = torch.zeros(1, dtype=torch.int32)
    temperature = torch.zeros(max_num_reqs)
    calib = TreeAcceptanceCalibration(cpu)
    ladder = torch.zeros(16, dtype=torch.int32)[:10]
    estimate = torch.zeros(16)
    for width in widths:
        logits = torch.zeros(1, DEPTH, vocab, dtype=torch.bfloat16)
        # As the speculator's _batch_trees: views of its flat storage.
        trees = DDTree(
            token_ids=_rows(flat.token_ids, width),
            parent_ids=_rows(flat.parent_ids, width),
            depths=_rows(flat.depths, width),
            attn_mask=_rows(flat.attn_mask, width + 1, num_mask_words(width)),
            num_nodes=flat.num_nodes[:1],
            log_probs=_rows(flat.log_probs, width),
        )
        build_ddtree(logits, width, out=trees)
        store_draft_trees(
            state.token_ids,
            state.parent_ids,
            state.depths,
            state.log_probs,
            state.attn_mask,
            draft_tokens,
            trees.token_ids,
            trees.parent_ids,
            trees.depths,
            trees.log_probs,
            trees.attn_mask,
            idx,
            1,
        )
        expected_accepted_nodes(
            trees.log_probs, temperature, idx, calib, width, ladder, estimate
        )
    counts = torch.zeros(max_num_reqs, dtype=torch.int32)
    qsl = torch.zeros(max_num_reqs + 1, dtype=torch.int32)
    for cap in caps:
        assign_tree_nodes(
            state.log_probs, idx, temperature, calib, cap, 1, counts, qsl, qsl
        )


def compile_on_threads(recorder: VariantRecorder, workers: int) -> float:
    """Compile the recorded variants on ``workers`` threads (Triton's
    AsyncCompileMode, as ``compile_in_parallel``); returns the wall seconds."""
    from concurrent.futures import ThreadPoolExecutor

    import triton

    start = time.perf_counter()
    with (
        ThreadPoolExecutor(workers) as pool,
        triton.AsyncCompileMode(pool),
    ):
        for jit_fn, data in recorder.specializations:
            jit_fn.preload(data)
    return time.perf_counter() - start


def _rows(t, *shape: int):
    """One request's rows of ``shape`` at the start of ``t``'s storage."""
    return t.view(-1)[: math.prod(shape)].view(1, *shape)


def count_variants(
    vocab: int,
    tree_budget: int,
    max_num_seqs: int = SERVE_MAX_NUM_SEQS,
    max_num_batched_tokens: int = SERVE_MAX_NUM_BATCHED_TOKENS,
    compile_variants: bool = False,
    workers: int = 1,
) -> dict:
    """Variants per kernel (and compile seconds) of one server's start-up; in a
    process set up by :func:`use_sm90_compiler`."""
    widths, caps = server_slots(tree_budget, max_num_seqs, max_num_batched_tokens)
    parallel = compile_variants and workers > 1
    with VariantRecorder(compile_variants and not parallel) as recorder:
        start_up_launches(vocab, tree_budget, widths, caps)
    out = {"widths": widths, "caps": caps, "variants": recorder.counts()}
    if parallel:
        out["workers"] = workers
        out["compile_wall_seconds"] = round(compile_on_threads(recorder, workers), 1)
    elif compile_variants:
        out["compile_seconds"] = {k: round(v, 1) for k, v in recorder.seconds().items()}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=QWEN3_VOCAB)
    p.add_argument(
        "--tree-budget",
        type=int,
        default=None,
        help='the adaptive cap (default: tree_budget "auto"\'s)',
    )
    p.add_argument("--max-num-seqs", type=int, default=SERVE_MAX_NUM_SEQS)
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=SERVE_MAX_NUM_BATCHED_TOKENS
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile every variant for sm90 (cold cache) and time it",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="with --compile: compile on this many threads, print the wall time",
    )
    args = p.parse_args(argv)
    if args.compile:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_cold_")
    use_sm90_compiler()
    if args.tree_budget is None:
        from vllm.v1.spec_decode.ddtree_config import AUTO_TREE_BUDGET_CAP

        args.tree_budget = AUTO_TREE_BUDGET_CAP
    result = count_variants(
        args.vocab,
        args.tree_budget,
        args.max_num_seqs,
        args.max_num_batched_tokens,
        args.compile,
        args.workers,
    )
    result["total_variants"] = sum(result["variants"].values())
    if "compile_seconds" in result:
        result["total_compile_seconds"] = round(
            sum(result["compile_seconds"].values()), 1
        )
    print(json.dumps({"vocab": args.vocab, "tree_budget": args.tree_budget, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
