# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/top_sort_compile.py: the builder's candidate sort compiles for an
H100 (sm_90) on a machine without a GPU, with the constexprs the builder's own
launch passes; Triton's CPU interpreter, which runs the kernel tests here,
never checks that."""

import json

import pytest

from benchmarks import top_sort_compile

pytest.importorskip("triton.backends.nvidia")


def test_the_sort_compiles_for_sm90_per_warp_class(tmp_path):
    argv = ["--out", str(tmp_path), "--arch", "90", "--cases", "4096:15", "4096:255"]
    assert top_sort_compile.main(argv) == 0
    rows = json.loads((tmp_path / "top_sort_compile.json").read_text())["checkout"]
    assert [(r["vocab"], r["num_top"]) for r in rows] == [(4096, 15), (4096, 255)]
    for r in rows:
        assert r["cubin_bytes"] > 0 and r["compile_s"] > 0
    # The builder's launch, recorded: the narrow class sorts at most 256 keys,
    # the wide one half its spill buffer.
    assert rows[0]["constexprs"]["SORT_MAX"] == 256
    assert rows[1]["constexprs"]["SORT_MAX"] == rows[1]["constexprs"]["SPILL"] // 2
    print({(r["vocab"], r["num_top"]): r["compile_s"] for r in rows})
