# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plugin's TREE_ATTN registration on vLLM 0.26 (CPU).

vLLM 0.26's ``AttentionBackendEnum`` has no TREE_ATTN member, so the backend
names itself ``CUSTOM`` (``tree_attn.TREE_ATTN_NAME``) and the plugin registers
that slot for DDTree engines (``glue.register_tree_attn_backend``). The
backend's own tests (its member, capabilities, builder and layer) are in
tests/v1/attention/test_tree_attn_backend.py and need no plugin."""

import pytest
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from vllm.v1.attention.backends.tree_attn import (
    TREE_ATTN_BACKEND_PATH,
    TREE_ATTN_NAME,
    TreeAttentionBackend,
)
from vllm_ddtree import glue


@pytest.fixture
def restore_custom_backend():
    custom = AttentionBackendEnum.CUSTOM
    before = custom.get_path() if custom.is_overridden() else None
    yield
    custom.clear_override()
    if before is not None:
        register_backend(custom, before)


def test_vllm_0_26_has_no_member_so_the_backend_takes_custom():
    assert "TREE_ATTN" not in AttentionBackendEnum.__members__
    assert TREE_ATTN_NAME == TreeAttentionBackend.get_name() == "CUSTOM"
    # The plugin keeps its own copy of the path, so that loading it imports
    # no attention module; both must name the same class.
    assert glue.TREE_ATTN_BACKEND_PATH == TREE_ATTN_BACKEND_PATH


def test_registration_is_idempotent(restore_custom_backend):
    AttentionBackendEnum.CUSTOM.clear_override()
    with pytest.raises(ValueError, match="must be registered before use"):
        AttentionBackendEnum.CUSTOM.get_class()
    glue.register_tree_attn_backend()
    glue.register_tree_attn_backend()
    assert AttentionBackendEnum.CUSTOM.get_path() == TREE_ATTN_BACKEND_PATH
    assert AttentionBackendEnum.CUSTOM.get_class() is TreeAttentionBackend
    # vLLM maps a layer's backend back to the enum through get_name().
    assert AttentionBackendEnum[TreeAttentionBackend.get_name()] is (
        AttentionBackendEnum.CUSTOM
    )


def test_registration_refuses_to_replace_another_backend(restore_custom_backend):
    register_backend(AttentionBackendEnum.CUSTOM, "some.other.Backend")
    with pytest.raises(
        ValueError,
        match="CUSTOM is already registered to "
        "some.other.Backend; .*VLLM_PLUGINS=ddtree",
    ):
        glue.register_tree_attn_backend()
