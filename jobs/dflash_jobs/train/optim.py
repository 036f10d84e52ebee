"""AdamW with a cosine schedule after a linear warmup (the SpecForge "paper-faithful" recipe)."""

from __future__ import annotations

import math

import torch
from torch import nn

from dflash_jobs.spec import TrainSpec


def build_optimizer(model: nn.Module, train: TrainSpec, *, device: torch.device) -> torch.optim.AdamW:
    """Weight decay on matrices only; norms (1-D) are left alone."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=train.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def cosine_with_warmup(total_steps: int, warmup_ratio: float):
    """LR multiplier per step: linear warmup to 1, then cosine down to 0 at `total_steps`."""
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return multiplier


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainSpec, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(total_steps, train.warmup_ratio))
