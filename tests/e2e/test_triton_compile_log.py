# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The compile recorder of tests/e2e/triton_compile_log (CPU: the hook is
called by hand; on a GPU Triton calls it, tests/e2e/test_ddtree_compiles.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent / "triton_compile_log"

CHECK = """
import types
from triton import knobs
hook = knobs.runtime.jit_cache_hook
assert hook is not None
fn = types.SimpleNamespace(module="vllm.v1.x", name="_k")
assert hook(key=1, repr="_k[num_warps=4](a: *fp16)", fn=fn, compile={},
            is_manual_warmup=False, already_compiled=False) is None
"""


def test_recorder_logs_each_first_launch(tmp_path):
    log = tmp_path / "compiles.jsonl"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "DDTREE_TRITON_COMPILE_LOG": str(log),
    }
    subprocess.run([sys.executable, "-c", CHECK], env=env, check=True)
    (line,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert (line["module"], line["name"]) == ("vllm.v1.x", "_k")
    assert line["time"] > 0 and line["pid"] > 0 and "num_warps=4" in line["repr"]


def test_recorder_is_off_without_its_variable(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("DDTREE_TRITON_COMPILE_LOG", None)
    code = "from triton import knobs; assert knobs.runtime.jit_cache_hook is None"
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
