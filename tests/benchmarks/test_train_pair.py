# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/train_pair at ``--scale tiny`` on the CPU: the whole pipeline, the
drafter checkpoint against vLLM's ``DFlashQwen3ForCausalLM`` (names, shapes, forward
math), the target's aux hidden states against vLLM's ``Qwen3ForCausalLM``,
determinism and resumption."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchmarks.train_pair.__main__ import EXIT_TIME_LIMIT, main
from benchmarks.train_pair.config import FULL, TINY, MissingStepError, Paths
from benchmarks.train_pair.continuations import load_sequences
from benchmarks.train_pair.dflash import (
    DrafterShape,
    block_inputs,
    block_mask,
    chain_acceptance,
    decoding_acceptance,
    default_target_layer_ids,
    load_drafter,
    position_weights,
    target_features,
)
from benchmarks.train_pair.drafter import anchor_range, sample_anchors
from benchmarks.train_pair.target import load_target, target_config
from tests.benchmarks.vllm_on_cpu import (
    build_drafter,
    build_target,
    drafter_block_hidden,
    new_model,
    vllm_on_cpu,
)

ARGS = ["--scale", "tiny", "--device", "cpu"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a small machine shared with other processes, two
    OpenMP threads wait on each other whenever one is descheduled (steps of the tiny
    target took 1-2 s instead of 0.07 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Paths:
    out = tmp_path_factory.mktemp("pair")
    assert main(["all", *ARGS, "--out", str(out)]) == 0
    return Paths(out)


@pytest.fixture(scope="module")
def summary(pair) -> dict:
    return json.loads(pair.summary.read_text())


@pytest.fixture(scope="module")
def vllm_config(pair, tmp_path_factory):
    init_file = tmp_path_factory.mktemp("dist") / "init"
    with vllm_on_cpu(pair.target, pair.drafter, init_file) as config:
        yield config


@pytest.fixture(scope="module")
def vllm_models(pair, vllm_config):
    target = build_target(vllm_config, pair.target)
    drafter = build_drafter(vllm_config, pair.drafter, target)
    return SimpleNamespace(target=target, drafter=drafter)


@pytest.fixture(scope="module")
def trained(pair):
    """The HF target and the training-time drafter as saved, in float32."""
    return SimpleNamespace(
        target=load_target(pair, "cpu"), drafter=load_drafter(pair.drafter).eval()
    )


# ------------------------------------------------------------------ pipeline


def test_tokenizer_round_trips_and_has_mask(pair, summary):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pair.target)
    text = "def f(x):\n\treturn x ** 2  # ünïcödé → ✓ 日本\n\n\n    \r\n\x0b"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.convert_tokens_to_ids(["<pad>", "<eos>", "<bos>", "<mask>"]) == [
        0,
        1,
        2,
        3,
    ]
    assert tok.mask_token == "<mask>"
    assert summary["tokenizer"]["mask_token_id"] == tok.mask_token_id == 3
    stream = np.load(pair.train_tokens)
    assert tok.mask_token_id not in stream  # only the drafter's masked slots use it
    doc = json.loads(pair.train_docs.read_text().splitlines()[0])["text"]
    eos = int(np.flatnonzero(stream == tok.eos_token_id)[0])
    assert tok.decode(stream[:eos].tolist()) == doc
    prompts = json.loads(pair.eval_prompts.read_text())["prompts"]
    assert len(prompts) == TINY.tokenizer.num_prompts
    for p in prompts:
        assert len(tok.encode(p["text"], add_special_tokens=False)) == p["num_tokens"]
        assert p["num_tokens"] >= TINY.tokenizer.prompt_tokens


def test_target_loss_decreases(summary):
    t = summary["target"]
    vocab = summary["tokenizer"]["vocab_size"]
    assert abs(t["first_losses"][0] - np.log(vocab)) < 0.5  # a fresh model guesses
    assert t["final_train_loss_mean_last_50"] < t["first_losses"][0] - 0.5
    assert t["heldout_loss_checkpoint_fp16"] < t["first_losses"][0] - 0.5


def test_drafter_loss_decreases(summary):
    d = summary["drafter"]
    assert d["eval_checkpoint_fp16"]["loss"] < d["first_losses"][0] - 1.0
    assert 1 <= d["eval_checkpoint_fp16"]["chain_acceptance_length"] <= 16
    assert 1 <= d["eval_checkpoint_fp16"]["decoding_acceptance_length"] <= 16


def test_rerun_is_identical_and_resumes_exactly(pair, summary, tmp_path):
    again = Paths(tmp_path / "again")
    for step in ("corpus", "tokenizer"):
        assert main([step, *ARGS, "--out", str(again.out)]) == 0
    assert (again.tokenizer / "tokenizer.json").read_bytes() == (
        pair.tokenizer / "tokenizer.json"
    ).read_bytes()
    assert np.array_equal(np.load(again.train_tokens), np.load(pair.train_tokens))
    # Stopped by the time limit, then resumed: the same losses as one straight run.
    assert main(["target", *ARGS, "--out", str(again.out), "--time-limit", "0.2"]) == (
        EXIT_TIME_LIMIT
    )
    stopped_at = torch.load(again.target_state, weights_only=False)["step"]
    assert 0 < stopped_at < TINY.target.steps
    assert main(["target", *ARGS, "--out", str(again.out)]) == 0
    rerun = json.loads(again.summary.read_text())["target"]
    for key in ("first_losses", "train_loss_curve", "heldout_loss_curve"):
        assert rerun[key] == summary["target"][key], key


def test_missing_step_is_named(tmp_path):
    from benchmarks.train_pair import target

    with pytest.raises(MissingStepError, match="run the `tokenizer` step first"):
        target.run(Paths(tmp_path), TINY.target, 60.0, "cpu")
    assert main(["drafter", *ARGS, "--out", str(tmp_path)]) == 2


def test_one_scale_per_output_directory(pair):
    with pytest.raises(ValueError, match="holds a --scale tiny run"):
        main(["corpus", "--scale", "full", "--out", str(pair.out)])


def test_full_scale_fits_the_size_budget():
    """float16 target + drafter (+ about 0.5 MB of tokenizer) under 20 MB, each
    weight file under 16 MiB, head_dim one that TREE_ATTN and FA3 serve."""
    from transformers import Qwen3ForCausalLM

    from benchmarks.train_pair.dflash import DFlashDrafter, drafter_config

    tokenizer = {
        "vocab_size": FULL.tokenizer.vocab_size,
        "special_ids": {"<pad>": 0, "<eos>": 1, "<bos>": 2},
    }
    config = target_config(FULL.target, tokenizer)
    with torch.device("meta"):
        target = Qwen3ForCausalLM(config)
        layer_ids = default_target_layer_ids(config.num_hidden_layers)
        d_config = drafter_config(
            config.to_dict(), FULL.drafter.num_layers, 16, 3, layer_ids
        )
        drafter = DFlashDrafter(DrafterShape.from_config(d_config))
    target_bytes = 2 * sum(p.numel() for p in target.parameters())
    drafter_bytes = 2 * sum(p.numel() for p in drafter.parameters())
    assert target_bytes < 16 * 2**20 and drafter_bytes < 16 * 2**20
    assert target_bytes + drafter_bytes + 0.5e6 < 20e6
    assert FULL.target.head_dim in (64, 128)


# ------------------------------------------------------------------ vLLM layout


def test_drafter_config_is_what_vllm_reads(pair, vllm_config):
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )

    draft = vllm_config.speculative_config.draft_model_config
    assert draft.hf_config.architectures == ["DFlashDraftModel"]
    assert dflash_has_any_non_causal(draft.hf_config)  # the block is non-causal
    config = json.loads((pair.drafter / "config.json").read_text())
    shape = DrafterShape.from_config(config)
    assert shape.block_size == 16 and shape.mask_token_id == 3
    assert config["dtype"] == "float16"  # as the weights are saved
    # DFlash's target_layer_ids i is vLLM's aux layer i + 1: the residual stream
    # after decoder layer i (index 0 being the embeddings).
    assert get_eagle3_aux_layers_from_config(vllm_config.speculative_config) == tuple(
        i + 1 for i in shape.target_layer_ids
    )


def test_drafter_weights_load_into_vllm(pair, vllm_config):
    from safetensors.torch import load_file
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    weights = load_file(str(pair.drafter / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {torch.float16}
    model = new_model(DFlashQwen3ForCausalLM, vllm_config)
    for p in model.parameters():
        p.data.fill_(float("nan"))
    model.load_weights(weights.items())
    shared = ("model.embed_tokens.", "lm_head.", "model.mask_embedding")
    for name, p in model.named_parameters():
        if not name.startswith(shared):
            assert torch.isfinite(p).all(), f"{name} was not in the checkpoint"
    # The check has teeth: vLLM refuses unknown names and wrong shapes.
    with pytest.raises(ValueError, match="no module or parameter named"):
        model.load_weights([("layers.0.self_attn.qkv.weight", weights["fc.weight"])])
    with pytest.raises(AssertionError):
        model.load_weights([("fc.weight", weights["fc.weight"][:, :-1])])


def test_target_features_are_vllm_aux_hidden_states(
    pair, vllm_config, vllm_models, trained
):
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )

    seq = load_sequences(pair, TINY.continuations, "eval")[0]
    layer_ids = trained.drafter.shape.target_layer_ids
    vllm_target = vllm_models.target
    vllm_target.set_aux_hidden_state_layers(
        get_eagle3_aux_layers_from_config(vllm_config.speculative_config)
    )
    with torch.no_grad():
        _, aux = vllm_target(input_ids=seq, positions=torch.arange(len(seq)))
    ours = target_features(trained.target, seq[None], layer_ids)[0]
    torch.testing.assert_close(ours, torch.cat(aux, dim=-1), atol=1e-4, rtol=1e-4)


def test_training_forward_matches_vllm_drafter(pair, vllm_models, trained):
    """Several (overlapping) blocks per sequence in one training forward give, block
    by block, what vLLM's drafter computes for a request whose committed context ends
    just before the anchor."""
    seqs = load_sequences(pair, TINY.continuations, "eval")[:2]
    s = trained.drafter.shape
    low, high = anchor_range(TINY.continuations, s.block_size)
    anchors = torch.tensor(
        [[low, low + 5, high - 9, high], [low + 1, low + 2, 40, high]]
    )
    features = target_features(trained.target, seqs, s.target_layer_ids)
    ids, positions, _ = block_inputs(seqs, anchors, s.block_size, s.mask_token_id)
    L = seqs.shape[1]
    with torch.no_grad():
        ours = trained.drafter(
            trained.target.model.embed_tokens(ids),
            positions,
            features,
            torch.arange(L).expand(2, L),
            block_mask(anchors, L, s.block_size),
        )
    ours = ours.view(2, anchors.shape[1], s.block_size, -1)
    for b in range(2):
        for n, anchor in enumerate(anchors[b].tolist()):
            block_ids = ids.view(2, -1, s.block_size)[b, n]
            with torch.no_grad():
                theirs = drafter_block_hidden(
                    vllm_models.drafter, features[b, :anchor], block_ids, anchor
                )
                torch.testing.assert_close(ours[b, n], theirs, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(
                    trained.target.lm_head(ours[b, n]),
                    vllm_models.drafter.compute_logits(theirs),
                    atol=1e-4,
                    rtol=1e-4,
                )


# ------------------------------------------------------------------ small pieces


@pytest.mark.parametrize("rows", [None, 2, 3])
def test_block_mask_matches_its_definition(rows):
    """Block n sees the context before its anchor and itself; with ``rows``,
    only its own first ``rows`` positions (a drafter run on a shorter block)."""
    anchors = torch.tensor([[3, 5, 9], [0, 7, 7]])
    bs, S = 4, 12
    mask = block_mask(anchors, S, bs, rows)
    visible = bs if rows is None else rows
    checked = 0
    for b in range(2):
        for q in range(3 * bs):
            for kv in range(S + 3 * bs):
                sees = (kv < S and kv < anchors[b, q // bs]) or (
                    kv >= S
                    and (kv - S) // bs == q // bs
                    and (kv - S) % bs < visible
                )
                assert mask[b, q, kv] == sees
                checked += 1
    assert checked == 2 * 3 * bs * (S + 3 * bs)


def test_block_inputs():
    seqs = torch.arange(100, 130)[None]
    ids, positions, labels = block_inputs(seqs, torch.tensor([[2, 10]]), 4, 3)
    assert ids.tolist() == [[102, 3, 3, 3, 110, 3, 3, 3]]
    assert positions.tolist() == [[2, 3, 4, 5, 10, 11, 12, 13]]
    assert labels.tolist() == [[[102, 103, 104, 105], [110, 111, 112, 113]]]


def test_anchors_are_distinct_sorted_and_in_range():
    gen = torch.Generator().manual_seed(0)
    anchors = sample_anchors(gen, 99, 32, 127, 496)
    assert anchors.min() >= 127 and anchors.max() <= 496
    assert (anchors.diff(dim=1) > 0).all()


def test_position_weights_and_acceptance():
    w = position_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1 and abs(float(w[8]) - np.exp(-1.0)) < 1e-6
    correct = torch.tensor(
        [[True, True, False, True], [False, True, True, True], [True, True, True, True]]
    )
    assert chain_acceptance(correct).tolist() == [3, 1, 5]


def test_decoding_acceptance_walks_like_greedy_decoding():
    # Sequence 0: anchored at 0 the step commits 3 (positions 0-2), then at 3 it
    # commits 1, at 4 it commits 2 and runs past the end: 6 tokens in 3 steps.
    # Sequence 1: 4 + 1 + 1 in 3 steps. The anchors' mean (4.25) is higher than
    # the walk's 2.0: the 9s are skipped over.
    accept = torch.tensor([[3, 9, 9, 1, 2, 1], [4, 9, 9, 9, 1, 1]])
    assert decoding_acceptance(accept[:1]) == (6, 3)
    assert decoding_acceptance(accept) == (12, 6)
    assert decoding_acceptance(torch.ones(2, 4, dtype=torch.long)) == (8, 8)
