# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Records the adaptive budget's decisions inside a server.

With this folder first on ``PYTHONPATH`` and ``DDTREE_BUDGET_TRACE`` naming a
folder, every Python process started so (``vllm serve`` and the engine core it
spawns) wraps ``TreeBudgetController`` once ``vllm.v1.spec_decode.ddtree_cost``
is imported (``benchmarks/budget_recorder.py``); the process that decides (the
engine core) writes ``budget_trace.<pid>.jsonl`` there. Without the variable
nothing happens. A ``sitecustomize`` further along ``sys.path`` (the
environment's own) still runs. Should the recorder fail to install, the server
runs unrecorded and says so on stderr. With tensor parallelism every rank
decides, and each writes its own file. ``bench_ddtree.py serve --budget-trace``
sets both for its DDTree servers; ``trace_budget.py --summarize`` reads them.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.realpath(__file__))
_TARGET = "vllm.v1.spec_decode.ddtree_cost"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Installs the recorder right after ``_TARGET`` has been executed."""

    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_record(module):
            exec_module(module)
            try:
                _install()
            except Exception as e:  # noqa: BLE001 - a diagnostic never stops a server
                print(f"budget trace: not recording ({e!r})", file=sys.stderr)

        loader.exec_module = exec_and_record
        return spec


def _install() -> None:
    root = os.path.dirname(os.path.dirname(_HERE))
    if root not in sys.path:
        sys.path.append(root)
    from benchmarks.budget_recorder import TRACE_ENV, TraceFile, install

    records = TraceFile(os.environ[TRACE_ENV])
    install(records, lambda: "serve")
    import atexit

    atexit.register(records.flush)


def _chain() -> None:
    """Run the ``sitecustomize`` further along ``sys.path``, which this one
    hides (a module, a package or bytecode alike)."""
    path = [p for p in sys.path if os.path.realpath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if os.environ.get("DDTREE_BUDGET_TRACE"):
    sys.meta_path.insert(0, _AfterImport())
_chain()
