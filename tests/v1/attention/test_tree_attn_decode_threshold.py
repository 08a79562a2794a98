# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TREE_ATTN's decode bound: requests of up to ``1 + num_speculative_tokens``
query tokens (a tree and its root) run the tree kernel, whether or not the
speculative config has parallel drafting on. vLLM's spec-as-decode bound
doubles the draft count under parallel drafting, which vLLM sets for DFlash's
drafter and so for DDTree; the drafter's mask tokens run in its own batch,
never in the batch TREE_ATTN serves."""

import json
from types import SimpleNamespace

import pytest
import torch

from vllm.config import DeviceConfig, ModelConfig, VllmConfig
from vllm.v1.attention.backends.tree_attn import TreeAttentionMetadataBuilder
from vllm.v1.kv_cache_interface import FullAttentionSpec


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    """A VllmConfig for a tiny Qwen3-shaped model (a config.json, no weights)."""
    target = tmp_path_factory.mktemp("tiny_qwen3")
    (target / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "model_type": "qwen3",
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "num_hidden_layers": 1,
                "vocab_size": 1000,
                "max_position_embeddings": 4096,
                "torch_dtype": "float16",
            }
        )
    )
    model_config = ModelConfig(
        model=str(target), skip_tokenizer_init=True, dtype=torch.float16
    )
    return VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"))


def _threshold(vllm_config, speculative_config):
    vllm_config.speculative_config = speculative_config
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
    )
    builder = TreeAttentionMetadataBuilder(
        spec, ["model.layers.0.self_attn.attn"], vllm_config, torch.device("cpu")
    )
    return builder.reorder_batch_threshold


@pytest.mark.parametrize("num_spec", [1, 15, 127, 1024])
@pytest.mark.parametrize("parallel_drafting", [False, True])
def test_decode_bound_is_one_tree(vllm_config, num_spec, parallel_drafting):
    spec = SimpleNamespace(
        num_speculative_tokens=num_spec, parallel_drafting=parallel_drafting
    )
    assert _threshold(vllm_config, spec) == 1 + num_spec


def test_decode_bound_without_speculation(vllm_config):
    assert _threshold(vllm_config, None) == 1
