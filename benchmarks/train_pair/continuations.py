# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Step 4: the drafter's training data, the target's own greedy continuations.

Prompts are ``prompt_len``-token windows of the training stream (of the held-out
stream for the evaluation set); the target, as saved, continues each greedily for
``new_tokens`` tokens, not stopping at ``<eos>``. Batches are written as shards, so a
run stopped by its time limit resumes at the next shard.
"""

import json

import torch

from .config import EOS, SEED, ContinuationScale, Paths
from .runlog import Progress, TimeLimitReached, log, pick_device, seeded, update_summary
from .target import load_stream, load_target, windows


@torch.no_grad()
def greedy(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``[B, P + new_tokens]``: the prompts and their greedy continuations."""
    out = model(input_ids=prompts, use_cache=True, logits_to_keep=1)
    tokens = [prompts, out.logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(new_tokens - 1):
        out = model(
            input_ids=tokens[-1], past_key_values=out.past_key_values, use_cache=True
        )
        tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1)


def shard_path(paths: Paths, name: str):
    return paths.continuations / f"{name}.pt"


def shard_names(scale: ContinuationScale) -> list[str]:
    num = -(-scale.num_train // scale.batch_size)
    return [f"train_{i:04d}" for i in range(num)] + ["eval"]


def load_sequences(paths: Paths, scale: ContinuationScale, part: str) -> torch.Tensor:
    """All ``train`` or ``eval`` sequences, ``[N, prompt_len + new_tokens]`` int64."""
    names = [n for n in shard_names(scale) if n.startswith(part)]
    shards = [
        torch.load(paths.require(shard_path(paths, n), "continuations")) for n in names
    ]
    return torch.cat(shards).long()


def run(paths: Paths, scale: ContinuationScale, time_limit: float, device=None) -> dict:
    device = pick_device(device)
    model = load_target(paths, device)
    train = load_stream(paths.require(paths.train_tokens, "tokenizer"))
    heldout = load_stream(paths.heldout_tokens)
    paths.continuations.mkdir(parents=True, exist_ok=True)
    names = shard_names(scale)
    done = sum(shard_path(paths, n).exists() for n in names)
    progress = Progress(
        "continuations",
        len(names),
        scale.batch_size * scale.new_tokens,
        start=done,
        lines=len(names),
    )
    for i, name in enumerate(names):
        if shard_path(paths, name).exists():
            continue
        if progress.elapsed() > time_limit:
            raise TimeLimitReached(f"continuations: {i}/{len(names)} shards written")
        if name == "eval":
            prompts = windows(
                heldout, seeded(SEED, -2), scale.num_eval, scale.prompt_len
            )
        else:
            n = min(scale.batch_size, scale.num_train - i * scale.batch_size)
            prompts = windows(train, seeded(SEED, 10_000 + i), n, scale.prompt_len)
        seqs = greedy(model, prompts.to(device), scale.new_tokens).cpu()
        torch.save(seqs.to(torch.int32), shard_path(paths, name))
        progress.log(i + 1)

    result = {
        "prompt_len": scale.prompt_len,
        "new_tokens": scale.new_tokens,
        "seconds": round(progress.elapsed(), 1),
    }
    for part in ("train", "eval"):
        gen = load_sequences(paths, scale, part)[:, scale.prompt_len :]
        result[part] = {
            "sequences": gen.shape[0],
            "eos_fraction": round(float((gen == _eos_id(paths)).float().mean()), 4),
            "distinct_tokens_per_continuation": round(
                sum(len(set(row.tolist())) for row in gen) / gen.shape[0], 1
            ),
        }
    update_summary(paths, "continuations", result)
    log.info("continuations: %s", json.dumps(result))
    return result


def _eos_id(paths: Paths) -> int:
    from .runlog import read_summary

    return read_summary(paths)["tokenizer"]["special_ids"][EOS]
