# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Test-session setup shared by every test under tests/.

1. Import the new ``vllm/...`` modules from this working tree, not from an installed
   copy: each of vLLM's subpackages that this repo adds modules to gets the
   working-tree directory put first on its ``__path__``.
2. Without a GPU, run Triton kernels in the interpreter. vLLM's ``vllm.triton_utils``
   swaps Triton for a placeholder when no GPU driver is active; the shim below points
   it back at real Triton (``TRITON_INTERPRET=1``) before any kernel module is
   imported, so our kernels and the vLLM kernels they are compared with both run.
"""

import importlib
import os
from pathlib import Path

import torch

ROOT = Path(__file__).parent

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _use_interpreted_triton() -> None:
    import vllm.triton_utils as triton_utils

    if triton_utils.HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, tl, tldevice
    triton_utils.HAS_TRITON = True
    triton_utils.importing.HAS_TRITON = True


def _prefer_working_tree() -> None:
    for init_dir in sorted({p.parent for p in (ROOT / "vllm").rglob("*.py")}):
        package = ".".join(init_dir.relative_to(ROOT).parts)
        module = importlib.import_module(package)
        if str(init_dir) not in module.__path__:
            module.__path__.insert(0, str(init_dir))


_use_interpreted_triton()
_prefer_working_tree()
