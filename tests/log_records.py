# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The records one of vLLM's loggers emits inside a ``with`` block.

vLLM's ``vllm`` logger does not propagate to the root logger, so pytest's
``caplog`` does not see its children's records: a handler goes on the logger
itself."""

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def log_records(name: str, level: int = logging.NOTSET) -> Iterator[list]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.emit = records.append
    log = logging.getLogger(name)
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)
