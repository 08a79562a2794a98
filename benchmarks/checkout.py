# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Running from a source checkout, for the benchmarks and the tests.

:func:`use_checkout` makes this process import the new ``vllm/...`` modules from the
checkout (each vLLM subpackage this repo adds modules to gets the checkout's
directory first on its ``__path__``), so a benchmark runs the code beside it
whether or not the package is installed, and without a GPU points vLLM's
``triton_utils`` at Triton's interpreter, so the Triton kernels run on the CPU.

vLLM loads plugins through the ``vllm.general_plugins`` entry point. An installed
package (``pip install .``) has one; a checkout on ``PYTHONPATH`` does not, so
:func:`plugin_site` writes a ``.dist-info`` that advertises it, to be put on the
``PYTHONPATH`` of the processes vLLM starts itself (``vllm serve``, a multiprocess
engine core).
"""

import importlib
import os
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def use_checkout() -> None:
    """Import this checkout's ``vllm/`` modules first; interpret Triton without
    a GPU (call before importing any kernel module)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        _use_interpreted_triton()
    for init_dir in sorted({p.parent for p in (ROOT / "vllm").rglob("*.py")}):
        package = ".".join(init_dir.relative_to(ROOT).parts)
        module = importlib.import_module(package)
        if str(init_dir) not in module.__path__:
            module.__path__.insert(0, str(init_dir))


def _use_interpreted_triton() -> None:
    # vLLM swaps Triton for a placeholder when no GPU driver is active.
    from vllm import triton_utils

    if triton_utils.HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, tl, tldevice
    triton_utils.HAS_TRITON = True
    triton_utils.importing.HAS_TRITON = True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plugin_site(path: Path) -> Path:
    """A directory whose dist-info advertises the plugin's entry point."""
    info = path / "vllm_ddtree-0.1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-ddtree\nVersion: 0.1.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nddtree = vllm_ddtree:register\n"
    )
    return path
