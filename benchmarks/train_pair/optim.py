# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""AdamW, the learning-rate schedule, and the resumable training state."""

import math
from pathlib import Path

import torch
from torch import nn

WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
MIN_LR_RATIO = 0.1
GRAD_CLIP = 1.0


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW; matrices of linear layers decay, embeddings and norm weights do not.

    Embedding rows that never occur (``<mask>``) thus keep their initial scale, which
    matters: the drafter embeds its masked slots with the target's ``<mask>`` row.
    """
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            is_matrix = isinstance(module, nn.Linear) and name == "weight"
            (decay if is_matrix else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": WEIGHT_DECAY},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, fused=fused)


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warmup to ``peak``, cosine decay to ``MIN_LR_RATIO * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return peak * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * cosine)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_and_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Clip, step, zero; the gradient norm before clipping (on the device)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def save_state(path: Path, model: nn.Module, optimizer, step: int, extra: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
            "extra": extra,
        },
        tmp,
    )
    tmp.replace(path)


def load_state(path: Path, model: nn.Module, optimizer) -> tuple[int, dict]:
    """Restore ``model`` and ``optimizer``; ``(step, extra)``, or ``(0, {})`` fresh."""
    if not path.exists():
        return 0, {}
    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"], state["extra"]
