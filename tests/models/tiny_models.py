# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tiny checkpoints made on the spot: a Qwen3 target and a DFlash drafter for it.

Nothing is downloaded. The tokenizer is byte-level (256 byte tokens, a few
specials, and filler tokens up to ``VOCAB_SIZE``); weights are random. The vocabulary
is larger than any verify length the tests use: vLLM's warm-up step prefills the
token ids ``0 .. decode_query_len`` (vllm/v1/worker/gpu/warmup.py), which index past
the embedding when ``tree_budget + 1`` reaches the vocabulary size. Random models rate many tokens alike (top-2 logit
gap under 0.1 at about 12 % of positions), so engines with different attention
kernels part ways at numerical ties; the checkpoints are float16, whose logits are
8x finer than bfloat16's (exact top-2 ties at 0.25 % of positions instead of
1.6 %), and tests comparing outputs must tell such ties from real differences.
"""

import json
from pathlib import Path

import torch

NUM_SPECIAL = 4  # <pad>, <eos>, <bos>, <mask>
VOCAB_SIZE = 2048  # > 1025: vLLM's warm-up feeds token ids up to tree_budget + 1
MASK_TOKEN_ID = 259
DTYPE = torch.float16


def make_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    specials = ["<pad>", "<eos>", "<bos>", "<mask>"]
    for i, tok in enumerate(specials):
        vocab[tok] = 256 + i
    # Never produced by encoding; they decode to their own text.
    for i in range(256 + len(specials), VOCAB_SIZE):
        vocab[f"<x{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        mask_token="<mask>",
    )
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    fast.save_pretrained(path)


def _qwen3_config(**overrides):
    from transformers import Qwen3Config

    kwargs = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.15,
        bos_token_id=258,
        eos_token_id=257,
        pad_token_id=256,
        torch_dtype=str(DTYPE).removeprefix("torch."),
    )
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def make_tiny_qwen3(path: Path, seed: int = 0, **overrides) -> Path:
    """A random Qwen3ForCausalLM checkpoint with tokenizer at ``path``."""
    from transformers import Qwen3ForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(_qwen3_config(**overrides)).to(DTYPE)
    model.save_pretrained(path)
    make_tokenizer(path)
    return path


def make_tiny_dflash(
    path: Path, target: Path, num_layers: int = 1, seed: int = 1, block_size: int = 16
) -> Path:
    """A random DFlash drafter for the target at ``target`` in vLLM's layout."""
    from safetensors.torch import save_file
    from transformers import Qwen3Model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    target_cfg = json.loads((Path(target) / "config.json").read_text())
    target_layers = target_cfg["num_hidden_layers"]
    layer_ids = sorted({1, target_layers // 2, target_layers - 2})
    cfg = _qwen3_config(num_hidden_layers=num_layers)
    torch.manual_seed(seed)
    body = Qwen3Model(cfg).to(DTYPE)
    weights = {
        k: v.contiguous()
        for k, v in body.state_dict().items()
        if not k.startswith("embed_tokens")
    }
    hidden = cfg.hidden_size
    weights["fc.weight"] = (
        torch.randn(hidden, hidden * len(layer_ids)) * cfg.initializer_range
    ).to(DTYPE)
    weights["hidden_norm.weight"] = torch.ones(hidden, dtype=DTYPE)
    save_file(weights, str(path / "model.safetensors"))

    config = cfg.to_dict()
    config.update(
        architectures=["DFlashDraftModel"],
        block_size=block_size,
        dflash_config={"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": layer_ids},
        target_hidden_size=target_cfg["hidden_size"],
    )
    (path / "config.json").write_text(json.dumps(config, indent=1))
    make_tokenizer(path)
    return path
