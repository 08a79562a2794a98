# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Records the adaptive budget's decisions, or every engine step, inside a
server.

With this folder first on ``PYTHONPATH`` and ``DDTREE_BUDGET_TRACE`` naming a
folder, every Python process started so (``vllm serve`` and the engine core it
spawns) wraps ``TreeBudgetController`` once ``vllm.v1.spec_decode.ddtree_cost``
is imported (``benchmarks/budget_recorder.py``); the process that decides (the
engine core) writes ``budget_trace.<pid>.jsonl`` there. With
``DDTREE_STEP_TRACE`` naming a folder, MRv2's model runner is wrapped once
``vllm.v1.worker.gpu.model_runner`` is imported
(``benchmarks/step_recorder.py``: any config, one record per step) and the
engine core writes ``step_trace.<pid>.jsonl`` there. Without either variable
nothing happens. A ``sitecustomize`` further along ``sys.path`` (the
environment's own) still runs. Should a recorder fail to install, the server
runs unrecorded and says so on stderr. With tensor parallelism every rank
writes its own file. ``bench_ddtree.py serve --budget-trace`` / ``--step-trace``
set them; ``trace_budget.py --summarize`` and ``step_recorder.py`` read them.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.realpath(__file__))
_BUDGET_ENV = "DDTREE_BUDGET_TRACE"
_STEP_ENV = "DDTREE_STEP_TRACE"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Installs a recorder right after its module has been executed."""

    def __init__(self, target: str, install):
        self.target = target
        self.install = install

    def find_spec(self, name, path=None, target=None):
        if name != self.target:
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
                self.install()
            except Exception as e:  # noqa: BLE001 - a diagnostic never stops a server
                print(f"{name} trace: not recording ({e!r})", file=sys.stderr)

        loader.exec_module = exec_and_record
        return spec


def _trace_file(env: str, prefix: str):
    root = os.path.dirname(os.path.dirname(_HERE))
    if root not in sys.path:
        sys.path.append(root)
    import atexit

    from benchmarks.budget_recorder import TraceFile

    records = TraceFile(os.environ[env], prefix=prefix)
    atexit.register(records.flush)
    return records


def _install_budget() -> None:
    records = _trace_file(_BUDGET_ENV, "budget_trace")
    from benchmarks.budget_recorder import install

    install(records, lambda: "serve")


def _install_steps() -> None:
    records = _trace_file(_STEP_ENV, "step_trace")
    from benchmarks.step_recorder import install

    install(records)


def _chain() -> None:
    """Run the ``sitecustomize`` further along ``sys.path``, which this one
    hides (a module, a package or bytecode alike)."""
    path = [p for p in sys.path if os.path.realpath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if os.environ.get(_BUDGET_ENV):
    sys.meta_path.insert(
        0, _AfterImport("vllm.v1.spec_decode.ddtree_cost", _install_budget)
    )
if os.environ.get(_STEP_ENV):
    sys.meta_path.insert(
        0, _AfterImport("vllm.v1.worker.gpu.model_runner", _install_steps)
    )
_chain()
