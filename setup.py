# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vllm-ddtree: tree attention and the DDTree speculative-decoding proposer for vLLM.

The new modules live at the paths they would have upstream (``vllm/v1/...``) and are
installed into the existing ``vllm`` package as plain modules: no ``__init__.py`` and
no other file of vLLM's own is shipped or overwritten. The plugin package
``vllm_ddtree`` wires them into an unmodified vLLM through the
``vllm.general_plugins`` entry point.
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent

# Every module this project adds under vllm/, as a dotted name.
VLLM_MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for p in (ROOT / "vllm").rglob("*.py")
    if p.name != "__init__.py"
)

setup(
    name="vllm-ddtree",
    version="0.1.0",
    description="Tree attention and DDTree speculative decoding for vLLM 0.26",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    install_requires=["vllm==0.26.0"],
    extras_require={"test": ["pytest", "tblib"]},
    packages=["vllm_ddtree"],
    py_modules=VLLM_MODULES,
    entry_points={"vllm.general_plugins": ["ddtree = vllm_ddtree:register"]},
)
