# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Records every Triton kernel variant a process meets for the first time.

Put this directory first on ``PYTHONPATH`` of a process (and of the processes it
spawns) and set ``DDTREE_TRITON_COMPILE_LOG`` to a file: Python imports
``sitecustomize`` at start-up, which installs Triton's ``jit_cache_hook``. The
hook runs whenever a ``@triton.jit`` kernel is launched with a specialization this
process has not compiled or loaded yet, i.e. exactly when a launch would stall
on the compiler (or on the on-disk cache), and appends one JSON line: wall time,
process id, the kernel's module and name, and its specialization. Used by
``tests/e2e/test_ddtree_compiles.py``; nothing of the product imports it.
"""

import json
import os
import time

_LOG = os.environ.get("DDTREE_TRITON_COMPILE_LOG")


def _install(path: str) -> None:
    try:
        from triton import knobs
    except ImportError:  # no Triton in this process: nothing can compile
        return

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        line = {
            "time": time.time(),
            "pid": os.getpid(),
            "module": fn.module,
            "name": fn.name,
            "repr": repr[:400],
        }
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
        return None  # compile (or load) as usual

    knobs.runtime.jit_cache_hook = hook


if _LOG:
    _install(_LOG)
