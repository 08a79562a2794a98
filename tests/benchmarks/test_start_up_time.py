# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/start_up_time.py's parts that need no GPU: the configs, the log
lines it reads, the compile counts and the table."""

import json

import pytest

from benchmarks import start_up_time as sut

LOG = """\
(EngineCore pid=1) INFO 12-03 11:12:01 [ddtree_verify.py:299] DDTree: TREE_ATTN warmed up over 32 kernel variants in 17.7 s
(EngineCore pid=1) INFO 12-03 11:12:57 [ddtree_adaptive.py:247] DDTree: adaptive budget kernels warmed up for tree widths [1, 3, 15, 63, 128] in 55.8 s
(EngineCore pid=1) INFO 12-03 11:15:00 [ddtree_adaptive.py:173] DDTree: adaptive tree budget over [0, 1, 3, 7, 15, 31, 63, 127, 128] nodes per request; step-cost prior from 54 target graph shapes (0.16 ms at 1 to 0.20 ms at 512 tokens) and 6 drafter graph shapes (0.11 ms at 1 to 0.15 ms at 32 requests), timed in 9.2 s
(EngineCore pid=1) INFO 12-03 11:15:01 [core.py:340] init engine (profile, create kv cache, warmup model) took 190.24 s (compilation: 24.02 s)
"""


def test_start_up_lines_and_table(tmp_path):
    lines = sut.log_lines(LOG)
    assert set(lines) == set(sut.LOG_LINES)
    log = tmp_path / "compiles.jsonl"
    records = [
        (1.0, "vllm.v1.spec_decode.dflash_tree_builder"),
        (2.0, "vllm.model_executor.layers.x"),
        (5.0, "vllm.v1.attention.ops.triton_tree_attention"),
    ]
    log.write_text(
        "".join(json.dumps({"time": t, "module": m}) + "\n" for t, m in records)
    )
    counts = sut.compiles(log, ready=3.0)
    assert counts == {
        "before_ready": 2,
        "ddtree_before_ready": 1,
        "after_ready": 1,
        "ddtree_after_ready": 1,
    }
    row = {"round": 1, "config": "ddtree", "ready_seconds": 99.0, **lines}
    md = sut.table([{**row, "compiles": counts}])
    assert "| 1 | ddtree | 99.0 | 17.7 | 55.8 | 9.2 | 1 / 1 |" in md


def test_configs():
    got = sut.specs("D", ["none", "dflash", "ddtree"])
    assert got["none"] is None and got["ddtree"] == {"method": "ddtree", "model": "D"}
    assert got["dflash"]["num_speculative_tokens"] == 15
    with pytest.raises(ValueError, match="unknown configs"):
        sut.specs("D", ["eagle"])
