# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Step 3: the target, a ``Qwen3ForCausalLM`` trained from scratch on the token stream.

Each step reads ``batch_size`` random windows of ``seq_len + 1`` tokens; the windows
depend only on the seed and the step number, so a resumed run sees the same data.
The checkpoint is saved in float16 (the dtype vLLM then serves it in) with the
tokenizer, and its held-out loss is measured again as saved.
"""

import json
import shutil
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

from .config import BOS, EOS, PAD, SEED, Paths, TargetScale
from .optim import clip_and_step, load_state, lr_at, make_optimizer, save_state, set_lr
from .runlog import (
    History,
    Progress,
    TimeLimitReached,
    log,
    pick_device,
    seeded,
    update_summary,
)

CHECKPOINT_DTYPE = torch.float16


def target_config(scale: TargetScale, tokenizer: dict):
    from transformers import Qwen3Config

    ids = tokenizer["special_ids"]
    return Qwen3Config(
        vocab_size=tokenizer["vocab_size"],
        hidden_size=scale.hidden_size,
        intermediate_size=scale.intermediate_size,
        num_hidden_layers=scale.num_layers,
        num_attention_heads=scale.num_heads,
        num_key_value_heads=scale.num_kv_heads,
        head_dim=scale.head_dim,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.02,
        pad_token_id=ids[PAD],
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        torch_dtype=str(CHECKPOINT_DTYPE).removeprefix("torch."),
    )


def load_stream(path) -> torch.Tensor:
    return torch.from_numpy(np.load(path).astype(np.int64))


def windows(stream: torch.Tensor, gen: torch.Generator, n: int, length: int):
    """``[n, length]`` windows of ``stream`` at offsets drawn from ``gen``."""
    starts = torch.randint(0, stream.numel() - length, (n,), generator=gen)
    return stream[starts[:, None] + torch.arange(length)]


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


@torch.no_grad()
def heldout_loss(
    model, batches: list[torch.Tensor], device, use_autocast=True
) -> float:
    model.eval()
    total = 0.0
    for tokens in batches:
        with autocast(device) if use_autocast else nullcontext():
            total += float(lm_loss(model, tokens.to(device)))
    model.train()
    return total / len(batches)


def heldout_batches(paths: Paths, scale: TargetScale, batch: int) -> list[torch.Tensor]:
    stream = load_stream(paths.require(paths.heldout_tokens, "tokenizer"))
    tokens = windows(stream, seeded(SEED, -1), scale.eval_windows, scale.seq_len + 1)
    return list(tokens.split(batch))


def run(paths: Paths, scale: TargetScale, time_limit: float, device=None) -> dict:
    from transformers import Qwen3ForCausalLM

    device = pick_device(device)
    summary_tok = _tokenizer_summary(paths)
    stream = load_stream(paths.require(paths.train_tokens, "tokenizer"))
    evals = heldout_batches(paths, scale, scale.batch_size)
    torch.manual_seed(SEED)
    config = target_config(scale, summary_tok)
    model = Qwen3ForCausalLM(config).to(device).train()
    optimizer = make_optimizer(model, scale.lr)
    step, extra = load_state(paths.target_state, model, optimizer)
    losses = History(extra.get("losses"))  # [step, loss, grad_norm]
    heldout = extra.get("heldout", [])  # [step, loss]
    seconds = extra.get("seconds", 0.0)
    if step:
        log.info("target: resuming at step %d", step)
    tokens_per_step = scale.batch_size * scale.seq_len
    progress = Progress("target", scale.steps, tokens_per_step, start=step)

    def checkpoint():
        losses.flush()
        save_state(
            paths.target_state,
            model,
            optimizer,
            step,
            {
                "losses": losses.rows,
                "heldout": heldout,
                "seconds": seconds + progress.elapsed(),
            },
        )

    while step < scale.steps:
        if progress.elapsed() > time_limit:
            checkpoint()
            raise TimeLimitReached(f"target: saved at step {step}/{scale.steps}")
        set_lr(optimizer, lr_at(step, scale.lr, scale.warmup, scale.steps))
        batch = windows(stream, seeded(SEED, step), scale.batch_size, scale.seq_len + 1)
        with autocast(device):
            loss = lm_loss(model, batch.to(device))
        loss.backward()
        grad_norm = clip_and_step(model, optimizer)
        step += 1
        losses.add(step, loss, grad_norm)
        if progress.due(step):
            _, loss, grad_norm = losses.flush()
            progress.log(step, loss=loss, grad_norm=grad_norm)
        if step % scale.eval_every == 0 or step == scale.steps:
            heldout.append([step, round(heldout_loss(model, evals, device), 4)])
            log.info("target step %d heldout loss %.4f", *heldout[-1])
            checkpoint()

    seconds += progress.elapsed()
    saved_loss = save_checkpoint(paths, model, evals, device)
    train_losses = [row[1] for row in losses.rows]
    result = {
        "config": {
            k: getattr(config, k)
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
            )
        },
        "params": sum(p.numel() for p in model.parameters()),
        "files_bytes": {
            f.name: f.stat().st_size for f in sorted(paths.target.iterdir())
        },
        "steps": scale.steps,
        "batch_tokens": tokens_per_step,
        "lr": scale.lr,
        "device": str(device),
        "first_losses": train_losses[:5],
        "final_train_loss_mean_last_50": round(float(np.mean(train_losses[-50:])), 4),
        "heldout_loss_curve": heldout,
        "heldout_loss_checkpoint_fp16": round(saved_loss, 4),
        "train_loss_curve": [
            row[:2] for row in losses.rows[:: max(1, scale.steps // 100)]
        ],
        "seconds": round(seconds, 1),
    }
    update_summary(paths, "target", result)
    log.info(
        "target: %s", json.dumps({k: v for k, v in result.items() if "curve" not in k})
    )
    return result


def save_checkpoint(paths: Paths, model, evals, device) -> float:
    """Save float16 weights, config and tokenizer; the held-out loss as saved."""
    from transformers import Qwen3ForCausalLM

    model.to(CHECKPOINT_DTYPE).save_pretrained(paths.target)
    for f in paths.tokenizer.iterdir():
        shutil.copy(f, paths.target / f.name)
    saved = Qwen3ForCausalLM.from_pretrained(paths.target, dtype=_eval_dtype(device))
    loss = heldout_loss(saved.to(device), evals, device, use_autocast=False)
    if not np.isfinite(loss):
        raise RuntimeError(f"the float16 target checkpoint gives held-out loss {loss}")
    log.info("target: float16 checkpoint heldout loss %.4f", loss)
    return loss


def load_target(paths: Paths, device):
    """The saved target, frozen, in the dtype it runs in on ``device``."""
    from transformers import Qwen3ForCausalLM

    path = paths.require(paths.target / "model.safetensors", "target").parent
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=_eval_dtype(device))
    return model.to(device).eval().requires_grad_(False)


def _eval_dtype(device) -> torch.dtype:
    # float16 kernels are slow or missing on the CPU; there the checkpoint's float16
    # values are held in float32 (exactly).
    return CHECKPOINT_DTYPE if torch.device(device).type == "cuda" else torch.float32


def _tokenizer_summary(paths: Paths) -> dict:
    from .runlog import read_summary

    paths.require(paths.tokenizer / "tokenizer.json", "tokenizer")
    return read_summary(paths)["tokenizer"]
