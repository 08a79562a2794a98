# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Test-session setup shared by every test under tests/: this checkout's new
``vllm/...`` modules are imported before an installed copy, and without a GPU
the Triton kernels run in the interpreter (``benchmarks/checkout.py``, which
the benchmarks use the same way)."""

from benchmarks.checkout import use_checkout

use_checkout()
