# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Step 5: the DFlash drafter, trained on the target's greedy continuations.

Each step takes ``batch_size`` continuation sequences and ``anchors_per_seq`` random
anchors in each (distinct, in the continuation part, with a whole block after them),
runs the frozen target for the context features and the drafter on all the blocks
at once, and minimises the position-weighted cross-entropy (``dflash.block_loss``).
Sequences and anchors depend only on the seed and the step number.

Evaluation runs every ``eval_anchor_stride``-th anchor of the held-out continuations
and reports the loss, top-1 accuracy per block offset and the chain acceptance length
(tokens a greedy DFlash step would commit: the bonus plus the leading correct drafts),
a mean over anchors. The saved checkpoint is also run at every anchor and walked the
way greedy decoding steps (``dflash.decoding_acceptance``): the decoding acceptance
length, the number comparable with vLLM's mean acceptance length (lower: decoding
spends more steps where drafting is hard).
"""

import json

import torch

from .config import SEED, ContinuationScale, DrafterScale, Paths
from .continuations import load_sequences
from .dflash import (
    DFlashDrafter,
    DrafterShape,
    block_loss,
    chain_acceptance,
    decoding_acceptance,
    default_target_layer_ids,
    draft_logits,
    drafter_config,
    save_drafter,
    target_features,
)
from .optim import clip_and_step, load_state, lr_at, make_optimizer, save_state, set_lr
from .runlog import (
    History,
    Progress,
    TimeLimitReached,
    log,
    pick_device,
    read_summary,
    seeded,
    update_summary,
)
from .target import CHECKPOINT_DTYPE, autocast, load_target


def sample_anchors(gen: torch.Generator, batch: int, num: int, low: int, high: int):
    """``[batch, num]`` distinct sorted anchors in ``[low, high]`` per row."""
    scores = torch.rand(batch, high - low + 1, generator=gen)
    return scores.argsort(dim=1)[:, :num].sort(dim=1).values + low


def anchor_range(cont: ContinuationScale, block_size: int) -> tuple[int, int]:
    """Anchors whose block lies in the continuation: the anchor is the last prompt
    token at the earliest, and the block must end inside the sequence."""
    return cont.prompt_len - 1, cont.prompt_len + cont.new_tokens - block_size


class DraftingSetup:
    """The frozen target's pieces the drafter uses, on one device."""

    def __init__(self, paths: Paths, device):
        self.target = load_target(paths, device)
        self.embed = self.target.model.embed_tokens
        self.lm_head_weight = self.target.lm_head.weight
        self.device = device

    def loss(self, drafter, seqs, anchors, layer_ids, gamma):
        seqs, anchors = seqs.to(self.device), anchors.to(self.device)
        features = target_features(self.target, seqs, layer_ids)
        with autocast(self.device):
            logits, labels = draft_logits(
                drafter, self.embed, self.lm_head_weight, seqs, features, anchors
            )
            return block_loss(logits, labels, gamma)


@torch.no_grad()
def evaluate(
    setup: DraftingSetup, drafter, seqs, scale: DrafterScale, cont: ContinuationScale
) -> dict:
    losses, corrects = [], []
    for n, loss, correct in _eval_blocks(
        setup, drafter, seqs, scale, cont, scale.eval_anchor_stride, scale.batch_size
    ):
        losses.append(float(loss) * n)
        corrects.append(correct.flatten(0, 1))
    correct = torch.cat(corrects)
    return {
        "loss": round(sum(losses) / len(seqs), 4),
        "accuracy_by_offset": [round(float(a), 4) for a in correct.float().mean(0)],
        "chain_acceptance_length": round(
            float(chain_acceptance(correct).float().mean()), 4
        ),
        "blocks": correct.shape[0],
    }


@torch.no_grad()
def evaluate_decoding(
    setup: DraftingSetup, drafter, seqs, scale: DrafterScale, cont: ContinuationScale
) -> float:
    """Mean acceptance length of greedy DFlash decoding over the held-out
    continuations, from the last prompt token on (every anchor is drafted)."""
    per_batch = max(1, scale.batch_size // scale.eval_anchor_stride)
    accepts = [
        chain_acceptance(correct)
        for _, _, correct in _eval_blocks(
            setup, drafter, seqs, scale, cont, 1, per_batch
        )
    ]
    tokens, steps = decoding_acceptance(torch.cat(accepts))
    return round(tokens / steps, 4)


def _eval_blocks(setup, drafter, seqs, scale, cont, stride: int, per_batch: int):
    """(sequences, loss, correct [n, anchors, bs - 1] on the CPU) per batch of
    held-out sequences, drafted at every ``stride``-th anchor, drafter in eval mode."""
    drafter.eval()
    low, high = anchor_range(cont, scale.block_size)
    anchors = torch.arange(low, high + 1, stride)
    try:
        for batch in seqs.split(per_batch):
            loss, correct = setup.loss(
                drafter,
                batch,
                anchors.expand(len(batch), -1),
                drafter.shape.target_layer_ids,
                scale.loss_gamma,
            )
            yield len(batch), loss, correct.cpu()
    finally:
        drafter.train()


def run(
    paths: Paths,
    scale: DrafterScale,
    cont: ContinuationScale,
    time_limit: float,
    device=None,
) -> dict:
    device = pick_device(device)
    setup = DraftingSetup(paths, device)
    train = load_sequences(paths, cont, "train")
    held = load_sequences(paths, cont, "eval")
    # The saved config, not the loaded model's (whose dtype is the one it runs in).
    target_config = json.loads((paths.target / "config.json").read_text())
    layer_ids = default_target_layer_ids(target_config["num_hidden_layers"])
    mask_id = read_summary(paths)["tokenizer"]["mask_token_id"]
    config = drafter_config(
        target_config, scale.num_layers, scale.block_size, mask_id, layer_ids
    )
    torch.manual_seed(SEED + 1)
    drafter = DFlashDrafter(DrafterShape.from_config(config))
    drafter.init_weights()
    drafter = drafter.to(device).train()
    optimizer = make_optimizer(drafter, scale.lr)
    step, extra = load_state(paths.drafter_state, drafter, optimizer)
    losses = History(extra.get("losses"))  # [step, loss, top-1 accuracy, grad_norm]
    evals = extra.get("evals", [])  # [step, loss, chain acceptance length]
    seconds = extra.get("seconds", 0.0)
    if step:
        log.info("drafter: resuming at step %d", step)
    low, high = anchor_range(cont, scale.block_size)
    block_tokens = scale.batch_size * scale.anchors_per_seq * scale.block_size
    progress = Progress("drafter", scale.steps, block_tokens, start=step)

    def checkpoint():
        losses.flush()
        save_state(
            paths.drafter_state,
            drafter,
            optimizer,
            step,
            {
                "losses": losses.rows,
                "evals": evals,
                "seconds": seconds + progress.elapsed(),
            },
        )

    while step < scale.steps:
        if progress.elapsed() > time_limit:
            checkpoint()
            raise TimeLimitReached(f"drafter: saved at step {step}/{scale.steps}")
        set_lr(optimizer, lr_at(step, scale.lr, scale.warmup, scale.steps))
        gen = seeded(SEED, 20_000 + step)
        seqs = train[torch.randint(0, len(train), (scale.batch_size,), generator=gen)]
        anchors = sample_anchors(
            gen, scale.batch_size, scale.anchors_per_seq, low, high
        )
        loss, correct = setup.loss(drafter, seqs, anchors, layer_ids, scale.loss_gamma)
        loss.backward()
        grad_norm = clip_and_step(drafter, optimizer)
        step += 1
        losses.add(step, loss, correct.float().mean(), grad_norm)
        if progress.due(step):
            _, loss, acc, grad_norm = losses.flush()
            progress.log(step, loss=loss, acc=acc, grad_norm=grad_norm)
        if step % scale.eval_every == 0 or step == scale.steps:
            metrics = evaluate(setup, drafter, held, scale, cont)
            evals.append([step, metrics["loss"], metrics["chain_acceptance_length"]])
            log.info("drafter step %d eval %s", step, json.dumps(metrics))
            checkpoint()

    seconds += progress.elapsed()
    save_drafter(drafter, config, paths.drafter, CHECKPOINT_DTYPE)
    reloaded = _reloaded(paths, device)
    final = evaluate(setup, reloaded, held, scale, cont)
    final["decoding_acceptance_length"] = evaluate_decoding(
        setup, reloaded, held, scale, cont
    )
    result = {
        "num_layers": scale.num_layers,
        "block_size": scale.block_size,
        "target_layer_ids": layer_ids,
        "mask_token_id": mask_id,
        "params": sum(p.numel() for p in drafter.parameters()),
        "files_bytes": {
            f.name: f.stat().st_size for f in sorted(paths.drafter.iterdir())
        },
        "steps": scale.steps,
        "sequences_per_step": scale.batch_size,
        "anchors_per_seq": scale.anchors_per_seq,
        "loss_gamma": scale.loss_gamma,
        "lr": scale.lr,
        "device": str(device),
        "first_losses": [row[1] for row in losses.rows[:5]],
        "eval_curve": evals,
        "eval_checkpoint_fp16": final,
        "train_loss_curve": [
            row[:3] for row in losses.rows[:: max(1, scale.steps // 100)]
        ],
        "seconds": round(seconds, 1),
    }
    update_summary(paths, "drafter", result)
    log.info(
        "drafter: %s", json.dumps({k: v for k, v in result.items() if "curve" not in k})
    )
    return result


def _reloaded(paths: Paths, device) -> DFlashDrafter:
    """The saved float16 drafter, held in the dtype the target runs in."""
    from .dflash import load_drafter

    dtype = CHECKPOINT_DTYPE if torch.device(device).type == "cuda" else torch.float32
    return load_drafter(paths.drafter, dtype).to(device)
