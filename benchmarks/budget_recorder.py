# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The adaptive budget's decisions, step by step, recorded from outside.

:func:`install` wraps ``TreeBudgetController`` (``vllm/v1/spec_decode/
ddtree_cost.py``) so that each decision appends a record: the batch, the cap,
the cost model's predictions and the acceptance estimate it weighed, the budget,
whether the drafter ran (and what ``should_draft`` found best) and the step's
period. ``trace_budget.py`` uses it in process; inside a server
(``vllm serve``'s engine core) ``serve_trace/sitecustomize.py`` installs it with
a :class:`TraceFile` when ``DDTREE_BUDGET_TRACE`` names a folder. A diagnostic:
the wrappers cost host time on every step.
"""

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

# Environment variable naming the folder a server's engine core writes its
# records to (serve_trace/sitecustomize.py).
TRACE_ENV = "DDTREE_BUDGET_TRACE"


def install(records: list, phase: Callable[[], str]) -> Callable[[], None]:
    """Record every decision of every ``TreeBudgetController`` into
    ``records`` (``phase()`` names the part of the run a record belongs to);
    returns the function that takes the wrappers off again."""
    from vllm.v1.spec_decode import ddtree_cost as dc

    C = dc.TreeBudgetController
    orig = (C.choose, C.step_started, C.should_draft, dc.StepCostModel.observe)
    orig_choose, orig_started, orig_should_draft, orig_observe = orig

    def choose(self, num_reqs, max_budget, has_trees, timed):
        b = orig_choose(self, num_reqs, max_budget, has_trees, timed)
        lad = [x for x in self.ladder if x <= max_budget]
        records.append(
            {
                "t": time.perf_counter(),
                "wall": time.time(),
                "ph": phase(),
                "n": num_reqs,
                "cap": max_budget,
                "has": has_trees,
                "timed": timed,
                "b": b,
                "pred": {x: self.cost.predict(num_reqs, x, x > 0) * 1e3 for x in lad},
                "pred0d": self.cost.predict(num_reqs, 0, True) * 1e3,
                "e": {x: self.expected_accepted(x) for x in lad},
            }
        )
        return b

    def step_started(self):
        step = self._step
        if records and step is not None:
            records[-1]["drafted"] = step.drafted
            records[-1]["period"] = (self._clock() - self._step_start) * 1e3
        orig_started(self)

    def observe(self, num_reqs, budget, drafted, seconds):
        ok = orig_observe(self, num_reqs, budget, drafted, seconds)
        if records:
            records[-1]["learned"] = ok
        return ok

    def should_draft(self, num_reqs, max_budget):
        did = orig_should_draft(self, num_reqs, max_budget)
        if records:
            # What the draft decision weighed: every budget's cost with the
            # drafter, and the plain step's without.
            records[-1]["draft"] = {
                "did": did,
                "best": self.last_best,
                "cap": max_budget,
                "plain": self.cost.predict(num_reqs, 0, False) * 1e3,
            }
        return did

    C.choose, C.step_started, C.should_draft = choose, step_started, should_draft
    dc.StepCostModel.observe = observe

    def uninstall() -> None:
        C.choose, C.step_started, C.should_draft = orig[:3]
        dc.StepCostModel.observe = orig_observe

    return uninstall


class TraceFile(list):
    """Records appended as to a list and written to
    ``folder/<prefix>.<pid>.jsonl``: all but the newest (whose step's
    period is not known yet) once ``every`` have gathered or ``seconds`` have
    passed since the last write, the rest by :meth:`flush` (at the process's
    exit). Written records leave the list. A server stopped without its exit
    handlers loses what was not written yet. Nothing is written before the
    first record: a process that never decides (a server's front end) leaves
    no file."""

    def __init__(
        self,
        folder: str | os.PathLike,
        every: int = 256,
        seconds=1.0,
        prefix: str = "budget_trace",
    ):
        super().__init__()
        self.folder = Path(folder)
        self.prefix = prefix
        self.every = every
        self.seconds = seconds
        self._last_write = time.monotonic()

    @property
    def path(self) -> Path:
        # The writing process's: a forked child writes its own file.
        return self.folder / f"{self.prefix}.{os.getpid()}.jsonl"

    def append(self, record: dict) -> None:
        super().append(record)
        due = time.monotonic() - self._last_write >= self.seconds
        if len(self) - 1 >= self.every or (due and len(self) > 1):
            self._write(len(self) - 1)

    def flush(self) -> None:
        self._write(len(self))

    def _write(self, upto: int) -> None:
        if upto <= 0:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in self[:upto])
        del self[:upto]
        self._last_write = time.monotonic()
