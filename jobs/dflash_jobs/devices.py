"""Which device a pod's process computes on: the same rule for extraction, generation, training and evaluation."""

from __future__ import annotations

import torch

from dflash_jobs.spec import RunSpec


def pick_device(spec: RunSpec, local_rank: int = 0) -> torch.device:
    """In pods: the GPU of this local rank (the CPU where none is visible). On the local backend:
    local.device, where cuda:N puts local rank r on GPU N + r (a workstation's other GPUs stay free)."""
    if spec.backend == "local":
        device = torch.device(spec.local.device)
        return torch.device("cuda", (device.index or 0) + local_rank) if device.type == "cuda" else device
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
