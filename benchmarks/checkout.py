# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Processes started from a source checkout, for the benchmarks and the tests.

vLLM loads plugins through the ``vllm.general_plugins`` entry point. An installed
package (``pip install .``) has one; a checkout on ``PYTHONPATH`` does not, so
:func:`plugin_site` writes a ``.dist-info`` that advertises it, to be put on the
``PYTHONPATH`` of the processes vLLM starts itself (``vllm serve``, a multiprocess
engine core).
"""

import socket
from pathlib import Path


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
