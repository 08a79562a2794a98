# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How many Triton variants DDTree's start-up kernels compile: tree widths and
caps of one bucket share a compiled kernel.

Triton keys a compile by the constexpr arguments, the launch options and the
specialisations of the other arguments. The CPU interpreter has no compile
cache, so a subprocess (interpreter off) points Triton at an sm90 target and
counts, with ``benchmarks/start_up_variants.py``'s recorder, the distinct keys
Triton's own binder gives the launches (nothing is compiled or run).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

PROBE = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from benchmarks import start_up_variants as suv
    suv.use_sm90_compiler()
    import torch
    from vllm.v1.spec_decode.ddtree_budget import (
        TreeAcceptanceCalibration, assign_tree_nodes, expected_accepted_nodes)
    from vllm.v1.spec_decode.dflash_tree_builder import build_ddtree

    def variants(launch):
        with suv.VariantRecorder() as recorder:
            launch()
        return recorder.counts()

    def builds(*budgets, vocab=151936):
        logits = torch.zeros(2, 15, vocab, dtype=torch.bfloat16)
        return lambda: [build_ddtree(logits, b) for b in budgets]

    calib = TreeAcceptanceCalibration(torch.device("cpu"))
    lp = torch.zeros(4, 1024)
    i32 = lambda n: torch.zeros(n, dtype=torch.int32)

    def splits(*caps):
        return lambda: [assign_tree_nodes(lp, i32(2), torch.zeros(4), calib, c, 2,
                                          i32(4), i32(5), i32(5)) for c in caps]

    def estimates(*widths):
        flat = torch.zeros(4 * 1024)
        return lambda: [expected_accepted_nodes(
            flat[:2 * w].view(2, w), torch.zeros(4), i32(2), calib, w, i32(9),
            torch.zeros(16)) for w in widths]

    print(json.dumps({
        "bucket": variants(builds(65, 100, 127)),
        "bucket_and_power": variants(builds(127, 128)),
        "narrow": variants(builds(1, 3, 15, 63, 128)),
        "wide": variants(builds(129, 255, 512)),
        "pair_vocab": variants(builds(3, 15, 63, 128, vocab=4096)),
        "split_block": variants(splits(17, 40, 64)),
        "split_blocks": variants(splits(3, 15, 63, 64, 65, 255, 1023)),
        "estimate": variants(estimates(1, 3, 16, 100, 1023)),
        "server": suv.count_variants(151936, 1024),
        "server_128_pair": suv.count_variants(4096, 128),
    }))
""")


def _run_compiled(script: str) -> subprocess.CompletedProcess:
    """``script`` in a child process compiling for sm90 (no interpreter)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [sys.executable, "-c", script, str(ROOT)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def counts():
    return json.loads(_run_compiled(PROBE).stdout.strip().splitlines()[-1])


def test_budgets_of_a_bucket_share_the_tree_selection(counts):
    # 65..127 share one selection and one candidate sort; a power of 2 has
    # its own selection (one more mask word).
    assert counts["bucket"]["_ddtree_select_kernel"] == 1
    assert counts["bucket"]["_sort_top_kernel"] == 1
    assert counts["bucket_and_power"]["_ddtree_select_kernel"] == 2


def test_the_candidate_sort_compiles_once_per_warp_class(counts):
    for case in ("narrow", "wide", "pair_vocab"):
        assert counts[case]["_sort_top_kernel"] == 1, case
    assert counts["narrow"]["_ddtree_select_kernel"] == 5


def test_the_split_compiles_per_power_of_4_block(counts):
    assert counts["split_block"] == {"_assign_tree_nodes_kernel": 1}
    # Blocks 4, 16, 64, 256, 1024.
    assert counts["split_blocks"] == {"_assign_tree_nodes_kernel": 5}


def test_the_estimate_compiles_once_for_every_width(counts):
    assert counts["estimate"] == {"_expected_accepted_nodes_kernel": 1}


def test_a_default_servers_start_up_variants(counts):
    """vllm serve's H100 defaults and the largest adaptive cap (1024):
    the scheduler's widths and caps, and the variants their warm-up meets."""
    server = counts["server"]
    print(json.dumps(server))
    assert server["widths"] == [1, 3, 15, 63, 255, 1023]
    assert server["caps"] == [4, 16, 64, 256, 1023]
    assert server["variants"] == {
        "_assign_tree_nodes_kernel": 5,
        "_chunk_stats_kernel": 4,
        "_ddtree_select_kernel": 6,
        "_expected_accepted_nodes_kernel": 1,
        "_gather_top_kernel": 2,
        "_sort_top_kernel": 3,
        "_store_draft_trees_kernel": 6,
        "_top_threshold_kernel": 4,
    }
    pair = counts["server_128_pair"]
    print(json.dumps(pair))
    assert pair["widths"] == [1, 3, 15, 63, 128]
    assert pair["variants"]["_sort_top_kernel"] == 1
    assert sum(pair["variants"].values()) == 25


PARALLEL = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from benchmarks import start_up_variants as suv
    suv.use_sm90_compiler()
    import torch
    from triton import knobs
    from vllm.triton_utils.parallel_compile import compile_in_parallel
    from vllm.v1.spec_decode import ddtree_budget as db

    calib = db.TreeAcceptanceCalibration(torch.device("cpu"))
    lp = torch.zeros(4, 1024)
    i32 = lambda n: torch.zeros(n, dtype=torch.int32)
    kernels = (db._assign_tree_nodes_kernel, db._expected_accepted_nodes_kernel)
    met = []

    def recorder(*, key, fn, **kwargs):  # a hook already installed
        met.append(fn.name)

    knobs.runtime.jit_cache_hook = recorder
    passes = []

    def warm_up():
        passes.append(1)
        if len(passes) == 2:
            # The real pass: every variant is compiled (on a GPU the launches
            # would run now; this fake sm90 driver cannot launch).
            return {k.fn.__name__: len(k.device_caches[0][0]) for k in kernels}
        # The compile-only pass: a launch here would fail on this driver.
        for cap in (3, 15, 63, 40):  # blocks 4, 16, 64, 64
            db.assign_tree_nodes(lp, i32(2), torch.zeros(4), calib, cap, 2,
                                 i32(4), i32(5), i32(5))
        db.expected_accepted_nodes(lp, torch.zeros(4), i32(2), calib, 8, i32(9),
                                   torch.zeros(16))

    compiled = compile_in_parallel(warm_up, max_workers=2)
    restored = knobs.runtime.jit_cache_hook is recorder

    def failing():
        passes.append(1)
        if len(passes) == 3:
            raise RuntimeError("the first pass fails")
        return "second pass"

    print(json.dumps({
        "compiled": compiled, "met": sorted(met), "restored": restored,
        "after_failure": compile_in_parallel(failing, max_workers=2),
        "passes": len(passes),
        "hook_after_failure": knobs.runtime.jit_cache_hook is recorder,
    }))
""")


def test_compile_in_parallel_compiles_first_then_launches():
    """The compile-only pass compiles each new variant (for sm90, on two
    threads) without launching it, passes each to a hook already installed,
    and restores it; the real pass then finds every variant compiled. A
    failing first pass leaves the second to run as usual."""
    result = _run_compiled(PARALLEL)
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["compiled"] == {
        "_assign_tree_nodes_kernel": 3,
        "_expected_accepted_nodes_kernel": 1,
    }
    assert out["met"] == ["_assign_tree_nodes_kernel"] * 3 + [
        "_expected_accepted_nodes_kernel"
    ]
    assert out["restored"] and out["hook_after_failure"]
    assert out["after_failure"] == "second pass" and out["passes"] == 4
    assert "the parallel compile failed" in result.stdout + result.stderr
