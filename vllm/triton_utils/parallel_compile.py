# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Compile the Triton kernel variants of a start-up warm-up on a thread pool.

A warm-up launches every kernel variant a step can pick, so that none is first
compiled inside a user's step; Triton compiles each at its first launch, one
after another, on one core. :func:`compile_in_parallel` runs the warm-up
twice: first with every launch of a variant this process has not compiled
turned into a compile submitted to a thread pool (Triton's
``AsyncCompileMode``; the launch itself is skipped), then, once every compile
has finished, as it is, with each variant compiled. Triton's compiler and
``ptxas`` release the GIL for most of a compile, so the compiles overlap.
Example::

    compile_in_parallel(lambda: [build_ddtree(logits, w) for w in widths])
"""

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from vllm import triton_utils
from vllm.logger import init_logger

logger = init_logger(__name__)

T = TypeVar("T")

# Each compile holds MLIR and a ptxas process; every tensor-parallel rank of a
# large host compiles at once, so the pool stays small.
_MAX_WORKERS = 8


def compile_in_parallel(warm_up: Callable[[], T], max_workers: int | None = None) -> T:
    """``warm_up()`` after a compile-only pass over it; returns what the real
    pass returns.

    In the compile-only pass, kernel variants new to this process compile on
    ``max_workers`` threads (default: the CPUs this process may run on, at
    most ``_MAX_WORKERS``) and are not launched, so their outputs keep what
    the buffers held: the warm-up must not read results back to the host or
    index by them outside Triton kernels, nor run an autotuned kernel (it would
    time skipped launches). Variants compiled before launch as usual. Launches
    from other threads meanwhile compile and run as always.
    Where the pass cannot run (no Triton, Triton's interpreter, one CPU) or
    fails, the real pass compiles as it would have.
    """
    workers = max_workers or min(len(os.sched_getaffinity(0)), _MAX_WORKERS)
    if (
        triton_utils.HAS_TRITON
        and workers > 1
        and not triton_utils.triton.knobs.runtime.interpret
    ):
        try:
            _compile_only(warm_up, workers)
        except Exception:
            logger.warning(
                "Compiling the warm-up's Triton kernels one after another: "
                "the parallel compile failed",
                exc_info=True,
            )
    return warm_up()


def _compile_only(warm_up: Callable[[], object], workers: int) -> None:
    triton = triton_utils.triton
    knobs = triton.knobs
    previous = knobs.runtime.jit_cache_hook
    submitted: set[tuple[int, object]] = set()
    preloading = False

    owner = threading.get_ident()

    def submit(*, key, fn, compile, **kwargs):
        nonlocal preloading
        if threading.get_ident() != owner:
            # Another thread's launch (an in-process engine's host program):
            # compiled and launched as always.
            return (
                previous(key=key, fn=fn, compile=compile, **kwargs)
                if previous
                else None
            )
        if preloading:
            return None  # preload's own compile: let it be submitted
        jit_fn = fn.jit_function
        if (id(jit_fn), key) not in submitted:
            submitted.add((id(jit_fn), key))
            if previous is not None:
                previous(key=key, fn=fn, compile=compile, **kwargs)
            preloading = True
            try:
                # Under AsyncCompileMode: queued on the pool, not waited for.
                jit_fn.preload(compile["specialization_data"])
            finally:
                preloading = False
        return True  # not launched

    with (
        ThreadPoolExecutor(workers, thread_name_prefix="triton-compile") as pool,
        triton.AsyncCompileMode(pool),
    ):
        knobs.runtime.jit_cache_hook = submit
        try:
            warm_up()
        finally:
            knobs.runtime.jit_cache_hook = previous
    logger.debug(
        "Compiled %d Triton kernel variants on %d threads", len(submitted), workers
    )
