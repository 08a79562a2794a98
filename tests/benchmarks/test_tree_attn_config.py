# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The tile-shape strings of ``bench_tree_attn.py --configs``."""

import pytest

from benchmarks.tree_attn_config import parse_config
from vllm.v1.attention.ops.triton_tree_attention import TreeAttentionConfig


def test_config_strings():
    cfg = parse_config("m64n32w4s3k128")
    assert cfg == TreeAttentionConfig(64, 32, 4, 3, 128)
    # The inverse of the product's str(), which names the warm-up's variants.
    assert parse_config(str(cfg)) == cfg
    assert parse_config("m64") == TreeAttentionConfig(block_m=64)
    for bad in ["m65", "n16", "x3", "m", "m64n64q"]:
        with pytest.raises(ValueError, match="TreeAttentionConfig|config"):
            parse_config(bad)
