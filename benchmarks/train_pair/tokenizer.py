# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Step 2: a byte-level BPE tokenizer, the token streams, and the evaluation prompts.

The tokenizer is GPT-2 style byte-level BPE (any byte string encodes) with four
specials first: ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<mask>`` 3. ``<mask>`` fills
the DFlash drafter's masked block slots; ``<eos>`` separates documents in the token
streams. Streams are uint16 ``.npy`` files.
"""

import hashlib
import json
import random
import time

import numpy as np

from .config import EOS, MASK, SPECIAL_TOKENS, Paths, TokenizerScale
from .corpus import read_documents
from .runlog import log, update_summary, write_json

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, path) -> None:
    from transformers import PreTrainedTokenizerFast

    pad, eos, bos, mask = SPECIAL_TOKENS
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=pad,
        eos_token=eos,
        bos_token=bos,
        mask_token=mask,
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def load_tokenizer(path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))


def encode_stream(tok, texts: list[str], chunk: int = 512) -> np.ndarray:
    """Every text's tokens followed by ``<eos>``, as one uint16 array."""
    eos = tok.token_to_id(EOS)
    pieces = []
    for i in range(0, len(texts), chunk):
        for enc in tok.encode_batch(texts[i : i + chunk]):
            pieces.append(np.asarray(enc.ids + [eos], dtype=np.uint16))
    return np.concatenate(pieces)


def eval_prompts(tok, docs: list[dict], scale: TokenizerScale) -> list[dict]:
    """Line-aligned excerpts of held-out files, ``prompt_tokens`` to twice that long.

    Each document gives at most one prompt, starting at a line picked by a hash of
    its name in the first half of the file.
    """
    prompts = []
    for doc in docs:
        lines = doc["text"].splitlines(keepends=True)
        seed = int(hashlib.sha256(f"prompt:{doc['name']}".encode()).hexdigest()[:8], 16)
        start = random.Random(seed).randrange(max(1, len(lines) // 2))
        text, num_tokens = "", 0
        for line in lines[start:]:
            text += line
            num_tokens = len(tok.encode(text).ids)
            if num_tokens >= scale.prompt_tokens:
                break
        if (
            scale.prompt_tokens <= num_tokens <= 2 * scale.prompt_tokens
            and text.strip()
        ):
            prompts.append(
                {
                    "source": doc["name"],
                    "start_line": start,
                    "num_tokens": num_tokens,
                    "text": text,
                }
            )
        if len(prompts) == scale.num_prompts:
            break
    return prompts


def run(paths: Paths, scale: TokenizerScale) -> dict:
    t0 = time.perf_counter()
    train = read_documents(paths.require(paths.train_docs, "corpus"))
    heldout = read_documents(paths.require(paths.heldout_docs, "corpus"))
    sample, size = [], 0
    for doc in train:
        if size >= scale.train_bytes:
            break
        sample.append(doc["text"])
        size += len(doc["text"].encode("utf-8"))
    tok = train_tokenizer(sample, scale.vocab_size)
    save_tokenizer(tok, paths.tokenizer)
    log.info(
        "tokenizer: vocab %d learned on %d bytes in %.1fs",
        tok.get_vocab_size(),
        size,
        time.perf_counter() - t0,
    )

    paths.tokens.mkdir(parents=True, exist_ok=True)
    streams = {}
    for name, docs, out in (
        ("train", train, paths.train_tokens),
        ("heldout", heldout, paths.heldout_tokens),
    ):
        streams[name] = encode_stream(tok, [d["text"] for d in docs])
        np.save(out, streams[name])
    prompts = eval_prompts(tok, heldout, scale)
    write_json(
        paths.eval_prompts,
        {
            "about": "held-out evaluation prompts: see docs/train_pair.md",
            "prompts": prompts,
        },
    )
    train_bytes = sum(len(d["text"].encode("utf-8")) for d in train)
    result = {
        "vocab_size": tok.get_vocab_size(),
        "special_ids": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
        "mask_token_id": tok.token_to_id(MASK),
        "learned_on_bytes": size,
        "train_tokens": int(streams["train"].size),
        "heldout_tokens": int(streams["heldout"].size),
        "train_bytes_per_token": round(train_bytes / streams["train"].size, 3),
        "eval_prompts": len(prompts),
        "tokenizer_sha256": hashlib.sha256(
            (paths.tokenizer / "tokenizer.json").read_bytes()
        ).hexdigest(),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    update_summary(paths, "tokenizer", result)
    log.info("tokenizer: %s", json.dumps(result))
    return result
