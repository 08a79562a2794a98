# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's own Qwen3 target and DFlash drafter modules, run on the CPU in float32.

Without a GPU, vLLM 0.26 has no compiled ops (``vllm._C``) and picks no attention
backend, so only the pieces that need them are swapped, everything else is vLLM's
code (weight loading, QKV and gate/up stacking, norms, RoPE, residuals, the drafter's
``precompute_and_store_context_kv``):

* construction: the attention-backend lookup answers FlashAttention's class (only
  its metadata is used while building layers);
* custom ops: every ``CustomOp`` runs its ``forward_native``; the two ``_C`` ops the
  drafter's context precompute calls are given native equivalents built on vLLM's
  ``ir.ops.rms_norm`` and ``RotaryEmbedding.forward_static``;
* attention: each ``Attention`` layer is replaced by plain SDPA over one sequence
  (causal for the target; for the drafter, non-causal over the context K/V that
  ``precompute_and_store_context_kv`` would have written to the KV cache plus the
  block's own K/V).
"""

from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


@contextmanager
def vllm_on_cpu(target_dir: Path, drafter_dir: Path, init_file: Path):
    """Yield a ``VllmConfig`` (float32, eager) with the patches above in place."""
    import vllm.model_executor.layers.attention.attention as attention_mod
    import vllm.model_executor.models.qwen3_dflash as dflash_mod
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import parallel_state
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    model_config = ModelConfig(
        model=str(target_dir),
        dtype=torch.float32,
        enforce_eager=True,
        skip_tokenizer_init=True,
    )
    parallel_config = ParallelConfig()
    config = VllmConfig(
        model_config=model_config,
        parallel_config=parallel_config,
        device_config=DeviceConfig(device="cpu"),
        speculative_config=SpeculativeConfig(
            method="dflash",
            model=str(drafter_dir),
            num_speculative_tokens=15,
            target_model_config=model_config,
            target_parallel_config=parallel_config,
        ),
    )
    with pytest_monkeypatch() as mp, set_current_vllm_config(config):
        mp.setattr(
            attention_mod, "get_attn_backend", lambda *a, **k: FlashAttentionBackend
        )
        mp.setattr(
            dflash_mod,
            "ops",
            SimpleNamespace(rms_norm=_rms_norm, rotary_embedding=_rotary_embedding),
        )
        owns_groups = not parallel_state.model_parallel_is_initialized()
        if owns_groups:  # a one-process "group", through a file, not a port
            parallel_state.init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                backend="gloo",
                distributed_init_method=f"file://{init_file}",
            )
            parallel_state.initialize_model_parallel(1, 1)
        try:
            yield config
        finally:
            if owns_groups:
                parallel_state.destroy_model_parallel()
                parallel_state.destroy_distributed_environment()


@contextmanager
def pytest_monkeypatch():
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        yield mp


def native_custom_ops(model: nn.Module) -> nn.Module:
    from vllm.model_executor.custom_op import CustomOp

    for module in model.modules():
        if isinstance(module, CustomOp):
            module._forward_method = module.forward_native
    return model


def _rms_norm(out, x, weight, eps):
    """``ops.rms_norm``; a 2-D weight holds one row per leading index of ``x``."""
    from vllm import ir

    if weight.dim() == 1:
        out.copy_(ir.ops.rms_norm(x, weight, eps))
        return
    for i in range(weight.shape[0]):
        out[i].copy_(ir.ops.rms_norm(x[i], weight[i], eps))


def _rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    """``ops.rotary_embedding``: rotates ``query`` (and ``key``) in place."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    q, k = RotaryEmbedding.forward_static(
        positions, query, key, head_size, head_size, cos_sin_cache, is_neox
    )
    query.copy_(q)
    if key is not None:
        key.copy_(k)


class _Sdpa(nn.Module):
    """Attention over one sequence: ``q [T, H*D]``, ``k, v [T, KV*D]``."""

    def __init__(self, attn, causal: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim, self.scale, self.causal = attn.head_size, attn.impl.scale, causal
        self.context_k = self.context_v = None  # [C, KV, D], the drafter's context

    def forward(self, q, k, v):
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.context_k is not None:
            k = torch.cat([self.context_k, k])
            v = torch.cat([self.context_v, v])
        group = self.num_heads // self.num_kv_heads
        k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k, v, scale=self.scale, is_causal=self.causal
        )
        return out.transpose(0, 1).reshape(T, -1)


def new_model(cls, config) -> nn.Module:
    """``cls(vllm_config=config)``, native custom ops. Layer names are registered per
    config; models built earlier in this config are not run through it."""
    config.compilation_config.static_forward_context.clear()
    return native_custom_ops(cls(vllm_config=config))


def build_target(config, target_dir: Path):
    """vLLM's ``Qwen3ForCausalLM`` with the checkpoint's weights, causal SDPA."""
    from safetensors.torch import load_file
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

    model = new_model(Qwen3ForCausalLM, config)
    model.load_weights(load_file(str(target_dir / "model.safetensors")).items())
    for layer in model.model.layers:
        layer.self_attn.attn = _Sdpa(layer.self_attn.attn, causal=True)
    return model


def build_drafter(config, drafter_dir: Path, target):
    """vLLM's ``DFlashQwen3ForCausalLM`` loaded by its ``load_weights``; embedding and
    LM head taken from ``target`` as ``load_dflash_model`` shares them."""
    from safetensors.torch import load_file
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    model = new_model(DFlashQwen3ForCausalLM, config)
    model.load_weights(load_file(str(drafter_dir / "model.safetensors")).items())
    model.model.embed_tokens = target.model.embed_tokens
    model.lm_head = target.lm_head
    return model


def drafter_block_hidden(drafter, context_states, block_ids, anchor: int):
    """vLLM's drafter output ``[block_size, hidden]`` for one request: context K/V
    from ``context_states [anchor, fc_in]`` at positions ``0 .. anchor-1``, then the
    block at positions ``anchor ..``."""
    captured = []
    for attn in drafter.model._attn_layers:  # the layers the precompute writes to
        attn.impl.do_kv_cache_update = lambda _attn, k, v, _cache, _slots: (
            captured.append((k, v))
        )
    combined = drafter.combine_hidden_states(context_states)
    positions = torch.arange(anchor)
    drafter.precompute_and_store_context_kv(combined, positions, positions)
    for layer, (k, v) in zip(drafter.model.layers, captured, strict=True):
        attn = layer.self_attn.attn
        if not isinstance(attn, _Sdpa):
            attn = layer.self_attn.attn = _Sdpa(attn, causal=False)
        attn.context_k, attn.context_v = k, v
    block_positions = torch.arange(anchor, anchor + len(block_ids))
    return drafter(block_ids, block_positions)
