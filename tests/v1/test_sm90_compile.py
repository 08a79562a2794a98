# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every DDTree Triton kernel compiles for Hopper (sm90) as its wrapper launches it.

The CPU runs kernels in Triton's interpreter, which accepts code the GPU compiler
rejects (e.g. a kernel reading a plain module-level int). Triton can compile for a
GPU target without a GPU, so this test runs each wrapper on CPU tensors in a
subprocess with the interpreter off, records the launches instead of running them,
and compiles every recorded launch for sm90.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

PROBE = textwrap.dedent("""
    import json, sys
    import torch, triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction
    import vllm.triton_utils as tu
    tu.triton, tu.tl, tu.HAS_TRITON = triton, tl, True
    sys.path.insert(0, sys.argv[1])
    import conftest  # noqa: F401  (working tree first)

    launches = []
    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))
    JITFunction.run = record

    from vllm.v1.attention.ops.tree_kv_compaction import TreeKVCompactor
    from vllm.v1.sample.tree_rejection_sampler import walk_trees
    from vllm.v1.spec_decode.dflash_tree_builder import build_ddtree
    from vllm.v1.spec_decode.ddtree_inputs import (
        prepare_draft_inputs, store_draft_trees, write_tree_verify_inputs)
    from vllm.v1.attention.ops.triton_tree_attention import (
        TreeAttentionConfig, TreeAttentionVariant, warm_up_tree_attention)

    build_ddtree(torch.zeros(2, 15, 100, dtype=torch.bfloat16), 64)  # whole rows
    for budget in (16, 128):
        tree = build_ddtree(torch.zeros(2, 15, 151936, dtype=torch.bfloat16), budget)
    # As DDTree's sampler runs it: node tokens checked against the fed ids.
    walk_trees(torch.zeros(2 * 129, dtype=torch.int64), tree.token_ids,
               tree.parent_ids, torch.zeros(3, dtype=torch.int32), 15,
               torch.zeros(2 * 129, dtype=torch.int32))
    # ... and as DDTree runs it: trees read in place from request-state rows.
    walk_trees(torch.zeros(2 * 129, dtype=torch.int64), tree.token_ids,
               tree.parent_ids, torch.zeros(3, dtype=torch.int32), 15,
               torch.zeros(2 * 129, dtype=torch.int32),
               tree_rows=torch.zeros(1, dtype=torch.int32))
    store_draft_trees(tree.token_ids, tree.parent_ids, tree.depths,
                      tree.log_probs, tree.attn_mask,
                      torch.zeros(2, 128, dtype=torch.int64),
                      tree.token_ids, tree.parent_ids, tree.depths,
                      tree.log_probs, tree.attn_mask,
                      torch.zeros(2, dtype=torch.int32), 2)
    # TREE_ATTN's start-up warm-up, unsplit and split (the merge kernel too).
    kv = torch.zeros(4, 16, 8, 256, dtype=torch.bfloat16)
    cfg = TreeAttentionConfig(block_m=64, block_n=64, num_warps=4)
    warm_up_tree_attention(
        [TreeAttentionVariant(cfg, 1), TreeAttentionVariant(cfg, 4)],
        torch.zeros(1, 32, 128, dtype=torch.bfloat16), kv[..., :128],
        kv[..., 128:], 64, torch.zeros(4, 129, 5, dtype=torch.int32),
        torch.zeros(4, dtype=torch.int32), 0.088)
    caches = [torch.zeros(8, 16, 8, 256, dtype=torch.bfloat16).transpose(1, 2)
              .unflatten(-1, (2, 128)).permute(3, 0, 1, 2, 4) for _ in range(2)]
    TreeKVCompactor(caches)(torch.zeros(258, dtype=torch.int64),
                            torch.zeros(3, dtype=torch.int32),
                            torch.zeros(2, 15, dtype=torch.int32),
                            torch.zeros(2, dtype=torch.int32),
                            torch.zeros(3, dtype=torch.int32))

    i32 = lambda *shape: torch.zeros(*shape, dtype=torch.int32)
    i64 = lambda *shape: torch.zeros(*shape, dtype=torch.int64)
    write_tree_verify_inputs(i64(258), i32(4, 129, 5), i32(4), i64(4, 128),
                             i32(4, 128), i32(4, 129, 5), i32(2), i32(3), i32(3),
                             4)
    prepare_draft_inputs(i32(256), i64(256), i32(5), i32(4), i64(256), i64(256),
                         i64(256), i64(256), i64(60), i64(258), i32(3), i32(3),
                         i32(2), i32(2), i64(4, 1), i32(4), i32(2, 15), i32(2),
                         i32(2, 64), 16, 259, 15, 4, 256, 1024)
    # The adaptive budget's kernels at the widest trees and the narrowest.
    from vllm.v1.spec_decode.ddtree_budget import (
        TreeAcceptanceCalibration, assign_tree_nodes, expected_accepted_nodes)
    calib = TreeAcceptanceCalibration(torch.device("cpu"))
    lp = torch.zeros(4, 1024)
    for cap in (1024, 16, 1):
        assign_tree_nodes(lp, i32(2), torch.zeros(4), calib, cap, 2, i32(4), i32(5),
                          i32(5))
        expected_accepted_nodes(lp, torch.zeros(4), i32(2), calib, cap, i32(12),
                                torch.zeros(16))
    calib.update(lp, i32(2), torch.zeros(4), i32(3), i32(2, 15), i32(2))

    TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
             torch.int64: "i64", torch.int32: "i32", torch.int16: "i16",
             torch.int8: "i8", torch.bool: "i1"}
    compiled = []
    for fn, args, kwargs in launches:
        bound = fn.signature.bind_partial(*args, **{
            k: v for k, v in kwargs.items() if k in fn.arg_names})
        sig, consts = {}, {}
        for i, name in enumerate(fn.arg_names):
            value = bound.arguments.get(name, fn.params[i].default)
            if fn.params[i].is_constexpr or value is None:
                sig[name], consts[(i,)] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                sig[name] = "*" + TYPES[value.dtype]
            elif isinstance(value, bool):
                sig[name] = "i1"
            elif isinstance(value, int):
                sig[name] = "i64" if abs(value) >= 2**31 else "i32"
            else:
                sig[name] = "fp32"
        options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        compiled.append(fn.__name__)
    print(json.dumps(compiled))
""")


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="on a GPU machine the kernel tests compile and run these kernels",
)
def test_ddtree_kernels_compile_for_sm90():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    compiled = set(json.loads(result.stdout.strip().splitlines()[-1]))
    assert compiled >= {
        "_rank_row_kernel",
        "_chunk_stats_kernel",
        "_top_threshold_kernel",
        "_gather_top_kernel",
        "_sort_top_kernel",
        "_ddtree_select_kernel",
        "_tree_walk_kernel",
        "_tree_kv_compaction_kernel",
        "_write_tree_verify_inputs_kernel",
        "_prepare_draft_inputs_kernel",
        "_store_draft_trees_kernel",
        "_tree_attention_kernel",
        "_merge_splits_kernel",
        "_assign_tree_nodes_kernel",
        "_expected_accepted_nodes_kernel",
        "_update_calibration_kernel",
        "_finalize_calibration_kernel",
    }
