# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM plugin that wires the DDTree modules into an unmodified vLLM 0.26.0."""

import importlib
from pathlib import Path


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; safe to call repeatedly.

    vLLM calls it in every process (API server before argument parsing, engine
    core, workers). It installs the wrappers of :mod:`vllm_ddtree.glue`, each when
    its vLLM module is imported, which enable
    ``--speculative-config '{"method": "ddtree", ...}'``; engines that do not ask
    for DDTree run as if the plugin were absent (TREE_ATTN is registered only for
    DDTree engines). Loading imports none of vLLM's or DDTree's heavy modules.
    """
    _use_source_checkout()
    from vllm_ddtree import glue

    glue.apply()


def _use_source_checkout() -> None:
    """Run from a source checkout: ``pip install .`` puts the new ``vllm/v1/...``
    modules into vLLM's packages; when this package is imported from a checkout
    (on ``PYTHONPATH``), the checkout's modules are found first instead, by
    putting its directories at the front of those packages' search paths (in
    this process only). No-op for an installed package."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "setup.py").is_file() or not (root / "vllm").is_dir():
        return
    for init_dir in sorted({p.parent for p in (root / "vllm").rglob("*.py")}):
        package = importlib.import_module(".".join(init_dir.relative_to(root).parts))
        if str(init_dir) not in package.__path__:
            package.__path__.insert(0, str(init_dir))
