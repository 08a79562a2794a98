# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host code of the DDTree modules sizes its launches with vLLM's plain
``vllm.utils.math_utils`` helpers, not Triton's ``triton.cdiv`` /
``triton.next_power_of_2``: in the Triton that vLLM 0.26 brings those are
constexpr functions whose call from Python goes through Triton's JIT machinery
(about 9 us per call on the CI CPU against 0.2 us), and these modules run on
every step, in every layer of eager and piecewise steps. Inside ``@triton.jit``
kernels the Triton forms are right and allowed."""

import ast
from pathlib import Path

import pytest
import triton

from vllm.utils.math_utils import cdiv, next_power_of_2

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(
    p
    for package in ("vllm", "vllm_ddtree")
    for p in (ROOT / package).rglob("*.py")
    if p.name != "__init__.py"
)
# Per-step modules the scan must cover (a renamed module fails here first).
PER_STEP = (
    "vllm/v1/attention/ops/triton_tree_attention.py",
    "vllm/v1/attention/ops/tree_kv_compaction.py",
    "vllm/v1/sample/tree_rejection_sampler.py",
    "vllm/v1/spec_decode/ddtree_inputs.py",
    "vllm/v1/spec_decode/dflash_tree_builder.py",
)
SLOW = {"cdiv", "next_power_of_2"}


def _is_jit(node: ast.AST) -> bool:
    """Decorated ``@triton.jit`` / ``@jit`` (with or without arguments)."""
    for d in getattr(node, "decorator_list", []):
        target = d.func if isinstance(d, ast.Call) else d
        if ast.unparse(target) in ("triton.jit", "jit"):
            return True
    return False


def _host_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, code) of ``triton.<slow>(...)`` outside @triton.jit functions, and
    of imports that bring the helpers in bare (callable under any name)."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, in_jit: bool) -> None:
        in_jit = in_jit or (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_jit(node)
        )
        if (
            not in_jit
            and isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in SLOW
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "triton"
        ):
            found.append((node.lineno, ast.unparse(node)))
        if (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("triton")
            and any(alias.name in SLOW for alias in node.names)
        ):
            found.append((node.lineno, ast.unparse(node)))
        for child in ast.iter_child_nodes(node):
            visit(child, in_jit)

    visit(tree, False)
    return found


def test_the_scan_sees_the_modules_and_flags_a_host_call():
    scanned = {str(p.relative_to(ROOT)) for p in MODULES}
    assert set(PER_STEP) <= scanned, set(PER_STEP) - scanned
    sample = (
        "import triton\n"
        "from triton import cdiv\n"
        "@triton.jit\n"
        "def k(n):\n"
        "    return triton.cdiv(n, 2)\n"
        "@triton.jit(do_not_specialize=['n'])\n"
        "def k2(n):\n"
        "    return triton.cdiv(n, 2)\n"
        "def host(n):\n"
        "    return triton.next_power_of_2(n)\n"
    )
    assert _host_calls(ast.parse(sample)) == [
        (2, "from triton import cdiv"),
        (10, "triton.next_power_of_2(n)"),
    ]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_triton_constexpr_helpers_in_host_code(path):
    calls = _host_calls(ast.parse(path.read_text()))
    assert not calls, (
        f"{path.relative_to(ROOT)} calls Triton's constexpr helpers from host code "
        f"(use vllm.utils.math_utils): {calls}"
    )


@pytest.mark.parametrize("n", [1, 2, 3, 15, 16, 17, 127, 128, 129, 1025])
def test_vllm_helpers_agree_with_triton_on_positive_sizes(n):
    assert next_power_of_2(n) == triton.next_power_of_2(n)
    for d in (1, 7, 16, 128):
        assert cdiv(n, d) == triton.cdiv(n, d)
