# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Compile time of the tree builder's candidate sort for a GPU, without one.

``_sort_top_kernel`` (vllm/v1/spec_decode/dflash_tree_builder.py) was the
slowest compile of the adaptive budget's start-up warm-up. Triton compiles
ahead of time for a GPU architecture on any machine (LLVM and the bundled
``ptxas`` are host work), so this script times it on the CPU: for each
``--builder TAG=PATH`` copy, in its own process with an empty Triton cache, the
host part of ``_ranked_top_tokens`` runs with every kernel stubbed to record
its launch, and the recorded ``_sort_top_kernel`` launch (its constexprs and
argument types, as the builder makes them) is compiled for ``--arch``. It also
shows that the kernel compiles for that architecture at all, which Triton's
CPU interpreter never checks.

    git show 5e3e1fa:vllm/v1/spec_decode/dflash_tree_builder.py > /tmp/old_builder.py
    python benchmarks/top_sort_compile.py --out OUT \\
        --builder old=/tmp/old_builder.py --builder new=vllm/v1/spec_decode/dflash_tree_builder.py
"""

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CHECKOUT_BUILDER = ROOT / "vllm" / "v1" / "spec_decode" / "dflash_tree_builder.py"
_TRITON_IMPORT = "from vllm.triton_utils import tl, triton"
_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
_DTYPES.update({"int32": "i32", "int64": "i64"})


def load_builder(path: Path):
    """The builder module at ``path`` with Triton itself (vLLM's import gives a
    placeholder on a machine without a GPU driver)."""
    src = path.read_text()
    if _TRITON_IMPORT not in src:
        raise ValueError(f"{path}: no {_TRITON_IMPORT!r} line to replace")
    src = src.replace(_TRITON_IMPORT, "import triton\nimport triton.language as tl")
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("builder_under_test", f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sort_launch(module, vocab: int, num_top: int):
    """The ``_sort_top_kernel`` launch ``_ranked_top_tokens`` makes for
    ``[1, 1, vocab]`` float16 logits: (positional args, keyword args)."""
    import torch

    launches = {}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches[self.name] = (args, kwargs)

            return launch

    real = module._sort_top_kernel
    names = [n for n in dir(module) if n.endswith("_kernel")]
    saved = {n: getattr(module, n) for n in names}
    try:
        for n in names:
            setattr(module, n, Recorder(n))
        module._ranked_top_tokens(
            torch.zeros(1, 1, vocab, dtype=torch.float16), num_top
        )
    finally:
        for n, v in saved.items():
            setattr(module, n, v)
    if "_sort_top_kernel" not in launches:
        raise RuntimeError(f"vocab {vocab}, num_top {num_top}: no candidate sort")
    return real, *launches["_sort_top_kernel"]


def compile_sort(module, vocab: int, num_top: int, arch: int) -> dict:
    import inspect

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, args, kwargs = sort_launch(module, vocab, num_top)
    params = list(inspect.signature(kernel.fn).parameters)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    signature, constexprs = {}, {}
    for name, value in zip(params, args):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _DTYPES[str(value.dtype).removeprefix("torch.")]
        else:
            signature[name] = "i32" if abs(int(value)) < 2**31 else "i64"
    for name, value in kwargs.items():
        signature[name] = "constexpr"
        constexprs[(params.index(name),)] = value
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    start = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    return {
        "vocab": vocab,
        "num_top": num_top,
        "constexprs": {k: v for k, v in kwargs.items() if k != "INVALID"},
        "compile_s": round(time.perf_counter() - start, 2),
        "cubin_bytes": len(compiled.asm["cubin"]),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--builder", action="append", default=None, help="TAG=PATH")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability")
    p.add_argument(
        "--cases",
        nargs="+",
        default=["4096:15", "4096:255", "151936:127"],
        help="VOCAB:NUM_TOP launches to compile",
    )
    p.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cases = [tuple(map(int, c.split(":"))) for c in args.cases]
    if args.child is not None:
        module = load_builder(args.child)
        rows = [compile_sort(module, v, k, args.arch) for v, k in cases]
        print(json.dumps(rows))
        return 0
    # Not in the child: these set Triton's interpreter up without a GPU.
    from benchmarks.bench_top_search import builder_table, run_per_builder
    from benchmarks.tree_acceptance import write_result

    child_args = ["--arch", str(args.arch), "--cases", *args.cases]
    results = run_per_builder(
        p, __file__, args.builder, args.out, child_args, interpret=False
    )
    table = builder_table(
        f"`_sort_top_kernel` compiled for sm_{args.arch} on this host "
        "(cold Triton cache, one process per builder)",
        [
            ("vocab", lambda r: r["vocab"]),
            ("num_top", lambda r: r["num_top"]),
            ("compile (s)", lambda r: r["compile_s"]),
            ("cubin (KB)", lambda r: r["cubin_bytes"] // 1024),
            ("constexprs", lambda r: r["constexprs"]),
        ],
        results,
    )
    write_result(args.out, "top_sort_compile", results, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
