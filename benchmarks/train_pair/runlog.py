# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Progress lines, the per-step log file, the JSON summary and the time limit."""

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from .config import Paths

log = logging.getLogger("train_pair")


class TimeLimitReached(Exception):
    """A step saved its state before its time limit; the same command resumes it."""


def setup_logging(paths: Paths, step: str) -> None:
    paths.log(step).parent.mkdir(parents=True, exist_ok=True)
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    fmt = logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S")
    for handler in (
        logging.StreamHandler(sys.stdout),
        logging.FileHandler(paths.log(step)),
    ):
        handler.setFormatter(fmt)
        log.addHandler(handler)


def read_summary(paths: Paths) -> dict:
    if not paths.summary.exists():
        return {}
    return json.loads(paths.summary.read_text())


def update_summary(paths: Paths, section: str, values: dict) -> None:
    """Replace one section of ``summary.json`` (written atomically)."""
    summary = read_summary(paths)
    summary[section] = values
    write_json(paths.summary, summary)


def write_json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)


class Progress:
    """Logs ``step/total``, values, tokens per second and the time left."""

    def __init__(
        self,
        name: str,
        total: int,
        tokens_per_step: int,
        start: int = 0,
        lines: int = 80,
    ):
        self.name, self.total, self.start = name, total, start
        self.tokens_per_step = tokens_per_step
        self.every = max(1, total // lines)
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.total

    def log(self, step: int, **values: float) -> None:
        done, elapsed = step - self.start, self.elapsed()
        eta = elapsed / max(done, 1) * (self.total - step)
        rate = done * self.tokens_per_step / max(elapsed, 1e-9)
        shown = " ".join(f"{k} {v:.4g}" for k, v in values.items())
        log.info(
            "%s %d/%d %s tok/s %.0f elapsed %.0fs eta %.0fs",
            self.name,
            step,
            self.total,
            shown,
            rate,
            elapsed,
            eta,
        )


class History:
    """Per-step scalars kept on the device and read back in one go when logged, so
    training steps do not wait for the GPU."""

    def __init__(self, rows: list | None = None):
        self.rows = rows if rows is not None else []
        self.pending: list[tuple[int, torch.Tensor]] = []

    def add(self, step: int, *values: torch.Tensor) -> None:
        self.pending.append((step, torch.stack([v.detach().float() for v in values])))

    def flush(self) -> list:
        """Move pending values into ``rows``; the last row, or None if none."""
        if self.pending:
            values = torch.stack([v for _, v in self.pending]).tolist()
            for (step, _), row in zip(self.pending, values, strict=True):
                self.rows.append([step, *(round(v, 4) for v in row)])
            self.pending = []
        return self.rows[-1] if self.rows else None


def pick_device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def seeded(*parts: int) -> torch.Generator:
    """A CPU generator whose seed depends only on ``parts`` (e.g. seed and step)."""
    seed = 0
    for p in parts:
        seed = (seed * 1_000_003 + int(p)) % (1 << 62)
    return torch.Generator().manual_seed(seed)
