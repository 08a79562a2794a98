# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM plugin that wires the DDTree modules into an unmodified vLLM 0.26.0."""

import importlib
import logging
from pathlib import Path

# Under vLLM's logger, so that its format and level apply.
logger = logging.getLogger("vllm.ddtree")


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; safe to call repeatedly.

    vLLM calls it in every process (API server before argument parsing, engine
    core, workers). It installs the wrappers of :mod:`vllm_ddtree.glue`, each when
    its vLLM module is imported, which enable
    ``--speculative-config '{"method": "ddtree", ...}'``; engines that do not ask
    for DDTree run as if the plugin were absent (TREE_ATTN is registered only for
    DDTree engines). Loading imports none of vLLM's or DDTree's heavy modules.

    vLLM calls plugins without a ``try``: a failure here is logged, never
    raised, so that it cannot stop engines that do not use DDTree.
    """
    try:
        _use_source_checkout()
        from vllm_ddtree import glue

        glue.apply()
    except Exception:
        logger.exception(
            "the DDTree plugin failed to load: method 'ddtree' is unavailable in "
            "this process (engines without it are unaffected)"
        )


def _use_source_checkout() -> None:
    """Run from a source checkout: ``pip install .`` puts the new ``vllm/v1/...``
    modules into vLLM's packages; when this package is imported from a checkout
    (on ``PYTHONPATH``), the checkout's modules are found first instead, by
    putting its directories at the front of those packages' search paths (in
    this process only). No-op for an installed package."""
    root = Path(__file__).resolve().parents[1]
    # A checkout's vllm/ holds only the overlay's modules; installed next to
    # vLLM (site-packages) the folder above is vLLM's own package, which has
    # an __init__.py whatever else lies there (a stray setup.py, say).
    if (
        not (root / "setup.py").is_file()
        or not (root / "vllm" / "v1").is_dir()
        or (root / "vllm" / "__init__.py").exists()
    ):
        return
    for init_dir in sorted({p.parent for p in (root / "vllm").rglob("*.py")}):
        package = importlib.import_module(".".join(init_dir.relative_to(root).parts))
        if str(init_dir) not in package.__path__:
            package.__path__.insert(0, str(init_dir))
