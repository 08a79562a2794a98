# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``tests.e2e.servers.ddtree_log_lines`` on lines of real ``vllm serve`` logs
(the GPU tests read a live server's log with it)."""

import logging

from tests.e2e.servers import ddtree_log_lines

LOG = """\
(APIServer pid=2711) INFO 12-02 22:21:09 [glue.py:284] DDTree: fixed tree_budget=64, drafter /m/drafter drafts 15 positions per step
(APIServer pid=2711) WARNING 12-02 22:21:09 [glue.py:451] DDTree: tree_budget=64 verifies 65 tokens per request and step
DDTree: tree_budget=64 verifies 65 tokens per request and step, so steps of 8 or more
(EngineCore pid=2744) INFO 12-02 22:22:47 [ddtree_verify.py:299] DDTree: TREE_ATTN warmed up over 32 kernel variants in 19.1 s
INFO 12-02 06:12:26 [ddtree_verify.py:280] DDTree: TREE_ATTN warmed up over 24 kernel variants in 15.2 s
(EngineCore pid=2744) DEBUG 12-02 22:24:40 [v1/spec_decode/ddtree_verify.py:310] DDTree: debug line
(EngineCore pid=2744) INFO 12-02 22:24:47 [speculator.py:127] Capturing model for DDTree speculator...
(APIServer pid=2711) INFO 12-02 22:26:40 [loggers.py:259] Engine 000: Avg prompt throughput: 0.0 tokens/s
"""


def test_vllm_format_and_bare_lines_told_apart():
    lines, bare = ddtree_log_lines(LOG)
    assert lines == [
        (
            "INFO",
            (
                "DDTree: fixed tree_budget=64, drafter /m/drafter drafts 15 "
                "positions per step"
            ),
        ),
        ("WARNING", "DDTree: tree_budget=64 verifies 65 tokens per request and step"),
        ("INFO", "DDTree: TREE_ATTN warmed up over 32 kernel variants in 19.1 s"),
        ("INFO", "DDTree: TREE_ATTN warmed up over 24 kernel variants in 15.2 s"),
        ("DEBUG", "DDTree: debug line"),
    ]
    assert bare == [LOG.splitlines()[2]]


def test_vllm_formatter_output_is_recognized():
    """What vLLM's own formatter writes for the plugin's logger parses."""
    from vllm.logger import _DATE_FORMAT, _FORMAT
    from vllm.logging_utils import NewLineFormatter

    record = logging.LogRecord(
        "vllm.ddtree.glue",
        logging.WARNING,
        "/x/vllm_ddtree/glue.py",
        451,
        "DDTree: tree_budget=%d verifies",
        (128,),
        None,
    )
    line = NewLineFormatter(_FORMAT, datefmt=_DATE_FORMAT).format(record)
    assert ddtree_log_lines(line) == (
        [("WARNING", "DDTree: tree_budget=128 verifies")],
        [],
    )
