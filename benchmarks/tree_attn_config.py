# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tile shapes of the tree attention kernel written as short strings, for
``bench_tree_attn.py --configs`` and the kernel tests' parameters."""

from vllm.v1.attention.ops.triton_tree_attention import TreeAttentionConfig

_FIELDS = {
    "m": "block_m",
    "n": "block_n",
    "w": "num_warps",
    "s": "num_stages",
    "k": "min_split_keys",
}


def parse_config(text: str) -> TreeAttentionConfig:
    """Inverse of ``str(TreeAttentionConfig)``: ``m128n64w8s5`` (missing fields
    keep their defaults)."""
    fields, key, digits = {}, None, ""
    for ch in text + "$":
        if ch.isdigit():
            digits += ch
            continue
        if key is not None:
            if not digits:
                raise ValueError(f"bad tree attention config {text!r}")
            fields[_FIELDS[key]] = int(digits)
        if ch != "$" and ch not in _FIELDS:
            raise ValueError(f"bad tree attention config {text!r}")
        key, digits = ch, ""
    return TreeAttentionConfig(**fields)
