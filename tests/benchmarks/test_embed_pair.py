# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/embed_pair.py at reduced sizes on the CPU: the embedded target's
logits and the embedded drafter's draft logits against the trained pair's
(DESIGN section 12), in float32 through transformers and the training code's
drafter (``benchmarks/train_pair/dflash.py``, vLLM's inference math)."""

import json
from pathlib import Path

import pytest
import torch

from benchmarks.embed_pair import (
    PAIR,
    EmbeddingMap,
    Shape,
    embed_pair,
    fc_blocks,
    layer_slots,
)
from benchmarks.train_pair.dflash import (
    draft_logits,
    load_drafter,
    target_features,
)

# Reduced real shapes: head_dim 128 as Qwen3-8B's, 4 query heads per kv head
# (the pair has 2), a wider hidden and MLP, 12 layers with 5 read by the drafter.
SMALL_BIG = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
}
BIG_IDS = [1, 3, 5, 7, 9]
NUM_PROMPTS = 8
PROMPT_TOKENS = 96
# A position whose top-2 logits differ by less than this may flip under the
# fp16 rounding of the scaled norm weights; elsewhere the argmax must agree.
TIE = 0.05
MIN_POSITIONS = 600


def reduced_configs(tmp: Path, vocab: int | None = None) -> tuple[Path, Path]:
    base_t = json.loads((PAIR / "target" / "config.json").read_text())
    target = {
        **base_t,
        **SMALL_BIG,
        "num_hidden_layers": 12,
        "rope_theta": 1000000,
        "torch_dtype": "bfloat16",
    }
    drafter = {
        **json.loads((PAIR / "drafter" / "config.json").read_text()),
        **SMALL_BIG,
        "num_hidden_layers": 3,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": BIG_IDS},
        "target_hidden_size": SMALL_BIG["hidden_size"],
    }
    if vocab is not None:
        target["vocab_size"] = drafter["vocab_size"] = vocab
    paths = tmp / "target.json", tmp / "drafter.json"
    for path, config in zip(paths, (target, drafter)):
        path.write_text(json.dumps(config))
    return paths


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embed")
    t_cfg, d_cfg = reduced_configs(tmp)
    summary = embed_pair(
        tmp / "out", PAIR, t_cfg, d_cfg, device="cpu", shard_bytes=8 << 20
    )
    return tmp / "out", summary


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(PAIR / "target")
    texts = json.loads((PAIR / "eval_prompts.json").read_text())["prompts"]
    rows = [tok(t["text"])["input_ids"][:PROMPT_TOKENS] for t in texts]
    rows = [r for r in rows if len(r) == PROMPT_TOKENS][:NUM_PROMPTS]
    assert len(rows) == NUM_PROMPTS
    return torch.tensor(rows)


def load_target(path: Path):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def compare(small: torch.Tensor, big: torch.Tensor, label: str) -> None:
    """Argmax equal wherever the small model's top two are not tied."""
    top2 = small.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > TIE
    same = small.argmax(-1) == big.argmax(-1)
    diff = (small - big).abs().max().item()
    print(
        f"\n{label}: argmax equal at {int(same.sum())} of {same.numel()} positions "
        f"({int(clear.sum())} without a tie, all equal there: "
        f"{bool(same[clear].all())}); largest logit difference {diff:.4f}"
    )
    assert same.numel() >= MIN_POSITIONS and int(clear.sum()) >= 0.9 * same.numel()
    assert bool(same[clear].all())
    assert diff < 0.05


def test_target_logits_equal_the_pair(embedded, prompts):
    out, summary = embedded
    assert summary["layer_slots"] == [0, *BIG_IDS]
    files = sorted(p.name for p in (out / "target").glob("*.safetensors"))
    assert len(files) > 1  # sharded, with an index
    index = json.loads((out / "target" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    small, big = load_target(PAIR / "target"), load_target(out / "target")
    assert big.config.num_hidden_layers == 12 and big.config.hidden_size == 512
    with torch.no_grad():
        compare(small(prompts).logits, big(prompts).logits, "target")


def test_drafter_logits_equal_the_pair(embedded, prompts):
    out, summary = embedded
    small_ids = json.loads((PAIR / "drafter" / "config.json").read_text())[
        "dflash_config"
    ]["target_layer_ids"]
    assert summary["fc_blocks"] == [i - 1 for i in small_ids]
    small_t, big_t = load_target(PAIR / "target"), load_target(out / "target")
    small_d, big_d = load_drafter(PAIR / "drafter"), load_drafter(out / "drafter")
    assert big_d.shape.num_layers == 3 and big_d.shape.hidden_size == 512
    anchors = torch.arange(8, PROMPT_TOKENS - 16, 9).expand(len(prompts), -1)
    with torch.no_grad():
        logits = []
        for target, drafter, ids in (
            (small_t, small_d, small_ids),
            (big_t, big_d, BIG_IDS),
        ):
            features = target_features(target, prompts, ids)
            lg, _ = draft_logits(
                drafter,
                target.model.embed_tokens,
                target.lm_head.weight,
                prompts,
                features,
                anchors,
            )
            logits.append(lg[:, :, 1:])  # offsets that draft a token
    compare(*logits, "drafter")


def test_full_vocabulary_never_picks_a_padded_token(tmp_path, prompts):
    t_cfg, d_cfg = reduced_configs(tmp_path, vocab=5000)
    embed_pair(tmp_path / "out", PAIR, t_cfg, d_cfg, vocab="full", device="cpu")
    config = json.loads((tmp_path / "out" / "target" / "config.json").read_text())
    assert config["vocab_size"] == 5000
    small, big = load_target(PAIR / "target"), load_target(tmp_path / "out" / "target")
    with torch.no_grad():
        s, b = small(prompts[:2]).logits, big(prompts[:2]).logits
    # The padded rows repeat the pad token's (id 0): its logit, never above it.
    pad = b[..., :1].expand_as(b[..., 4096:])
    assert torch.equal(b[..., 4096:], pad)
    assert int((b.argmax(-1) >= 4096).sum()) == 0
    assert torch.equal(s.argmax(-1), b.argmax(-1))


def test_configs_keep_the_pairs_tokens_and_rope(embedded):
    out, _ = embedded
    pair_t = json.loads((PAIR / "target" / "config.json").read_text())
    for sub in ("target", "drafter"):
        config = json.loads((out / sub / "config.json").read_text())
        assert config["rope_parameters"] == pair_t["rope_parameters"]
        assert "rope_theta" not in config and config["dtype"] == "float16"
        assert config["vocab_size"] == pair_t["vocab_size"]
        assert config["max_position_embeddings"] == pair_t["max_position_embeddings"]
    drafter = json.loads((out / "drafter" / "config.json").read_text())
    assert drafter["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": BIG_IDS}
    assert (out / "target" / "tokenizer.json").is_file()


def test_the_map_of_heads_and_dims():
    small = Shape(256, 768, 6, 4, 2, 64, 4096)
    big = Shape(4096, 12288, 36, 32, 8, 128, 151936)
    m = EmbeddingMap(small, big)
    m.check()
    assert m.q_heads().tolist() == [0, 1, 4, 5]
    dims = m.head_dims()
    assert dims[:3].tolist() == [0, 2, 4] and dims[32:35].tolist() == [64, 66, 68]
    # neox RoPE: small dim i and the big dim it lands on rotate at one frequency
    i = torch.arange(32)
    small_freq = 10000.0 ** (-2 * i / 64)
    big_freq = 10000.0 ** (-2 * dims[:32] / 128)
    assert torch.equal(small_freq, big_freq)
    assert m.norm_scale == 0.25
    slots = layer_slots(6, [1, 9, 17, 25, 33], 36)
    assert slots == [0, 1, 9, 17, 25, 33]
    assert fc_blocks([1, 3, 4], slots, [1, 9, 17, 25, 33]) == [0, 2, 3]


@pytest.mark.parametrize(
    "args, message",
    [
        ((6, [1, 9, 17], 36), "needs 5"),
        ((6, [1, 9, 17, 25, 40], 36), "stay below 36"),
        ((6, [9, 1, 17, 25, 33], 36), "must rise"),
    ],
)
def test_layer_slots_refuse(args, message):
    with pytest.raises(ValueError, match=message):
        layer_slots(*args)


def test_a_smaller_big_model_is_refused():
    small = Shape(256, 768, 6, 4, 2, 64, 4096)
    with pytest.raises(ValueError, match="hidden_size"):
        EmbeddingMap(small, Shape(128, 768, 6, 4, 2, 64, 4096)).check()
    with pytest.raises(ValueError, match="head_dim"):
        EmbeddingMap(small, Shape(512, 768, 6, 4, 2, 96, 4096)).check()


def test_an_embedding_is_kept_only_if_made_from_the_same(embedded, capsys):
    out, summary = embedded
    again = embed_pair(
        out,
        PAIR,
        summary["target_config"],
        summary["drafter_config"],
        device="cpu",
        shard_bytes=8 << 20,
    )
    assert "is up to date" in capsys.readouterr().out
    assert again == summary
    assert summary["made_from"]["vocab_mode"] == "pair"


def test_a_drafter_reading_layer_0_is_refused():
    with pytest.raises(ValueError, match="must lie in 1..5"):
        fc_blocks([0, 3], [0, 1, 9, 17, 25, 33], [1, 9, 17, 25, 33])
