# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The DFlash drafter at training time, with vLLM's inference math and weight names.

vLLM 0.26 serves the drafter with ``DFlashQwen3ForCausalLM``
(``vllm/model_executor/models/qwen3_dflash.py``) driven by ``DFlashSpeculator``
(``vllm/v1/worker/gpu/spec_decode/dflash/speculator.py``). Per request and step:

* context: the target's hidden states at the committed positions ``0 .. a-1``, taken
  after decoder layers ``target_layer_ids`` (DFlash id ``i`` is vLLM aux layer
  ``i + 1``, i.e. the residual stream after layer ``i``; ``eagle3_utils.py``) and
  concatenated in layer order, become ``hidden_norm(fc(.))``. Each drafter layer
  projects them with its own ``k_proj``/``k_norm``/RoPE and ``v_proj`` (no
  ``input_layernorm``) into its KV cache at their own positions
  (``precompute_and_store_context_kv``);
* block: ``[bonus, <mask> x (block_size - 1)]`` at positions ``a .. a+block_size-1``,
  ``a`` being the first uncommitted position, embedded with the target's embedding,
  runs through the drafter layers; every block query attends to the whole context
  and to the whole block (non-causal, ``_prepare_dflash_inputs_kernel``);
* the output at block offset ``k >= 1``, through the final ``norm`` and the target's
  LM head, drafts the token at position ``a + k``.

Training runs many blocks per sequence at once: the keys are ``[context (S) | block_0 |
block_1 | ...]`` and block ``n`` (anchor ``a_n``) sees context positions ``< a_n`` and
its own block only. Weights are named as in the checkpoint vLLM loads (``layers.N.*``,
``fc.weight``, ``hidden_norm.weight``, ``norm.weight``); embeddings and LM head are the
target's and are not part of the drafter.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURE = "DFlashDraftModel"


@dataclass(frozen=True)
class DrafterShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    target_hidden_size: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int

    @classmethod
    def from_config(cls, config: dict) -> "DrafterShape":
        dflash = config["dflash_config"]
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config["num_key_value_heads"],
            head_dim=config["head_dim"],
            rms_norm_eps=config["rms_norm_eps"],
            rope_theta=_rope_theta(config),
            target_hidden_size=config["target_hidden_size"],
            target_layer_ids=tuple(dflash["target_layer_ids"]),
            block_size=config["block_size"],
            mask_token_id=dflash["mask_token_id"],
        )


def _rope_theta(config: dict) -> float:
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"only default RoPE is implemented, not {rope}")
    return rope.get("rope_theta", config.get("rope_theta", 10000.0))


def default_target_layer_ids(num_target_layers: int) -> list[int]:
    """Shallow, middle and deep (tests/models/tiny_models.py's choice)."""
    return sorted({1, num_target_layers // 2, num_target_layers - 2})


def drafter_config(
    target_config: dict,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int],
) -> dict:
    """The drafter's ``config.json``: the target's Qwen3 fields plus DFlash's."""
    if list(target_layer_ids) != sorted(set(target_layer_ids)):
        # vLLM concatenates aux hidden states in layer order, whatever the list order.
        raise ValueError(f"target_layer_ids must be increasing: {target_layer_ids}")
    config = {
        k: v
        for k, v in target_config.items()
        if k not in ("architectures", "max_window_layers", "layer_types")
    }
    config.update(
        architectures=[ARCHITECTURE],
        num_hidden_layers=num_layers,
        layer_types=["full_attention"] * num_layers,
        block_size=block_size,
        dflash_config={
            "mask_token_id": mask_token_id,
            "target_layer_ids": list(target_layer_ids),
        },
        target_hidden_size=target_config["hidden_size"],
    )
    return config


# ------------------------------------------------------------------------ modules


class RMSNorm(nn.Module):
    """vLLM's ``ir.ops.rms_norm`` (float32 statistics, weight in its own dtype)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h.to(self.weight.dtype) * self.weight).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """cos, sin ``[..., head_dim // 2]`` as vLLM's ``RotaryEmbedding`` cache holds."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float, device=positions.device)
        / head_dim
    )
    freqs = positions.float()[..., None] * inv_freq
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of ``x [B, T, heads, head_dim]``; cos/sin ``[B, T, d/2]``."""
    cos, sin = cos[:, :, None].to(x.dtype), sin[:, :, None].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)
        self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
        self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)

    def key_value(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V ``[B, T, kv_heads, head_dim]`` of ``x``."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.s.num_kv_heads, -1)))
        v = self.v_proj(x).unflatten(-1, (self.s.num_kv_heads, -1))
        return apply_rope(k, *rope), v

    def forward(self, x, rope, context_kv, mask) -> torch.Tensor:
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.s.num_heads, -1)))
        q = apply_rope(q, *rope)
        k, v = self.key_value(x, rope)
        k = torch.cat([context_kv[0], k], dim=1)
        v = torch.cat([context_kv[1], v], dim=1)
        group = self.s.num_heads // self.s.num_kv_heads
        k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask[:, None],
            scale=self.s.head_dim**-0.5,
        )
        return self.o_proj(out.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, h, rope, context_kv, mask) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, context_kv, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """The drafter's own weights; ``state_dict()`` is the checkpoint vLLM loads."""

    def __init__(self, s: DrafterShape):
        super().__init__()
        self.shape = s
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.num_layers))
        self.fc = nn.Linear(
            s.target_hidden_size * len(s.target_layer_ids), s.hidden_size, bias=False
        )
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def init_weights(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)

    def forward(
        self,
        # [B, Q, hidden]: target embeddings of the block tokens
        block_embeds: torch.Tensor,
        # [B, Q]
        block_positions: torch.Tensor,
        # [B, S, target_hidden * len(target_layer_ids)]
        target_features: torch.Tensor,
        # [B, S]
        context_positions: torch.Tensor,
        # [B, Q, S + Q] bool, True where a query may attend
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """The final-normed hidden states ``[B, Q, hidden]`` of the block tokens."""
        s = self.shape
        context = self.hidden_norm(self.fc(target_features))
        context_rope = rope_cos_sin(context_positions, s.head_dim, s.rope_theta)
        block_rope = rope_cos_sin(block_positions, s.head_dim, s.rope_theta)
        h = block_embeds
        for layer in self.layers:
            context_kv = layer.self_attn.key_value(context, context_rope)
            h = layer(h, block_rope, context_kv, mask)
        return self.norm(h)


# ------------------------------------------------------------------ blocks and loss


def block_inputs(
    seqs: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
):
    """Block tokens, positions and labels for ``anchors [B, N]`` into ``seqs [B, L]``.

    Returns ``ids [B, N*bs]`` (anchor token, then masks), ``positions [B, N*bs]``
    (``anchor + k``) and ``labels [B, N, bs]`` (the token at ``anchor + k``).
    """
    offsets = torch.arange(block_size, device=seqs.device)
    positions = anchors[..., None] + offsets  # [B, N, bs]
    labels = torch.gather(seqs, 1, positions.flatten(1)).view_as(positions)
    ids = torch.full_like(labels, mask_token_id)
    ids[..., 0] = labels[..., 0]
    return ids.flatten(1), positions.flatten(1), labels


def block_mask(
    anchors: torch.Tensor, context_len: int, block_size: int, rows: int | None = None
):
    """``[B, N*bs, S + N*bs]``: block ``n`` sees context ``< anchor_n`` and itself,
    or only its first ``rows`` positions (a drafter run on a shorter block)."""
    B, N = anchors.shape
    device = anchors.device
    query_block = torch.arange(N * block_size, device=device) // block_size
    ctx = torch.arange(context_len, device=device)
    sees_context = (
        ctx[None, None, :] < anchors.repeat_interleave(block_size, 1)[..., None]
    )
    sees_block = query_block[:, None] == query_block[None, :]
    if rows is not None:
        offset = torch.arange(N * block_size, device=device) % block_size
        sees_block = sees_block & (offset < rows)[None, :]
    sees_block = sees_block.expand(B, -1, -1)
    return torch.cat([sees_context, sees_block], dim=2)


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """``[bs]``: 0 for the anchor, ``exp(-(k - 1) / gamma)`` for offset ``k >= 1``."""
    k = torch.arange(block_size, device=device, dtype=torch.float)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def block_loss(logits: torch.Tensor, labels: torch.Tensor, gamma: float):
    """Position-weighted cross-entropy of ``logits [B, N, bs, V]`` and ``correct``.

    ``correct [B, N, bs - 1]`` says whether the top-1 draft at offsets 1.. is right.
    """
    weights = position_weights(labels.shape[-1], gamma, logits.device)[1:]
    drafted, targets = logits[:, :, 1:].float(), labels[:, :, 1:]
    ce = F.cross_entropy(drafted.flatten(0, 2), targets.flatten(), reduction="none")
    ce = ce.view_as(targets)
    loss = (ce * weights).sum() / (weights.sum() * targets.shape[0] * targets.shape[1])
    return loss, drafted.argmax(-1) == targets


def chain_acceptance(correct: torch.Tensor) -> torch.Tensor:
    """Tokens a greedy chain step commits per block: 1 + the leading correct drafts."""
    return 1 + correct.long().cumprod(-1).sum(-1)


def decoding_acceptance(accept: torch.Tensor) -> tuple[int, int]:
    """(tokens, steps) of greedy DFlash decoding walked over ``accept [S, A]``, the
    tokens a step anchored at each consecutive position commits: the first step
    is anchored at position 0, each next one where the last one's tokens end.

    tokens / steps is what vLLM reports as the mean acceptance length. It is lower
    than the mean of ``accept`` over all anchors: decoding takes more steps where
    drafting is hard and skips over easy stretches in long strides."""
    S, A = accept.shape
    pos = torch.zeros(S, dtype=torch.long, device=accept.device)
    rows = torch.arange(S, device=accept.device)
    tokens = steps = 0
    while True:
        live = pos < A
        if not bool(live.any()):
            return tokens, steps
        took = accept[rows[live], pos[live]].long()
        tokens += int(took.sum())
        steps += int(live.sum())
        pos[live] += took


def draft_logits(
    drafter: DFlashDrafter,
    embed: nn.Embedding,
    lm_head_weight,
    seqs: torch.Tensor,
    features: torch.Tensor,
    anchors: torch.Tensor,
    rows: int | None = None,
):
    """``(logits [B, N, bs, V], labels [B, N, bs])`` for ``anchors`` into ``seqs``;
    with ``rows``, each block's first ``rows`` positions see only each other
    (the logits of later positions are then meaningless)."""
    s = drafter.shape
    ids, positions, labels = block_inputs(seqs, anchors, s.block_size, s.mask_token_id)
    B, L = seqs.shape
    context_positions = torch.arange(L, device=seqs.device).expand(B, L)
    mask = block_mask(anchors, L, s.block_size, rows)
    # float32 residual stream; under autocast the matmuls still run in bfloat16
    hidden = drafter(
        embed(ids).float(), positions, features.float(), context_positions, mask
    )
    logits = F.linear(hidden, lm_head_weight.to(hidden.dtype))
    return logits.view(*labels.shape, -1), labels


@torch.no_grad()
def target_features(target, tokens: torch.Tensor, layer_ids) -> torch.Tensor:
    """``[B, L, hidden * len(layer_ids)]``: outputs of the target's decoder layers
    ``layer_ids`` (the residual stream after each), concatenated in layer order."""
    captured = {}
    hooks = [
        target.model.layers[i].register_forward_hook(
            lambda _m, _a, out, i=i: captured.__setitem__(
                i, out[0] if isinstance(out, tuple) else out
            )
        )
        for i in layer_ids
    ]
    try:
        target.model(input_ids=tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat([captured[i] for i in sorted(layer_ids)], dim=-1)


# ------------------------------------------------------------------ checkpoint


def save_drafter(
    drafter: DFlashDrafter, config: dict, path: Path, dtype: torch.dtype
) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = {
        k: v.detach().to(dtype).contiguous().cpu()
        for k, v in drafter.state_dict().items()
    }
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=1) + "\n")


def load_pair(pair: Path):
    """``(tokenizer, target, drafter)`` of a trained pair's directory
    (``target/``, ``drafter/``), float32 and in eval mode, for analyses on the
    CPU."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    pair = Path(pair)
    tok = AutoTokenizer.from_pretrained(pair / "target")
    target = Qwen3ForCausalLM.from_pretrained(pair / "target", dtype=torch.float32)
    return tok, target.eval(), load_drafter(pair / "drafter").eval()


def load_drafter(path: Path, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    from safetensors.torch import load_file

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    drafter = DFlashDrafter(DrafterShape.from_config(config))
    drafter.load_state_dict(load_file(str(path / "model.safetensors")))
    return drafter.to(dtype)
