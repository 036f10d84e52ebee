"""How the drafter runs on its ranks: activation checkpointing, compilation, data parallelism
(applied from outside the model, in that order, as torchtitan's parallelize does).

Activation checkpointing trades compute for memory at the default micro-batch (2,048 blocks of 16
slots against up to 16K context tokens, 1.84B trainable parameters at the 27B shape). One H200
step, capped at 96 GB (bench/results/train-compile-h200.json, train-fused-loss-h200.json):

| checkpointing | compiled | step | MFU | peak allocated |
|---|---|---|---|---|
| "none": every activation kept | yes | 1.15 s | 47.3% | 66.7 GiB |
| "mlp": each SwiGLU recomputed in backward | yes | 1.23 s | 44.1% | 50.8 GiB |
| "layers": each decoder layer recomputed | yes | 1.32 s | 41.3% | 43.3 GiB |
| "mlp" | no | 1.46 s | 37.2% | 77.3 GiB |
| "none" | no | out of memory at 96 GB | | |

So "auto" (the default) is none where training compiles and mlp where it does not.
The wrappers keep parameter names as they were, so checkpoints and exports do not change.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from dflash_jobs.drafter.model import Drafter
from dflash_jobs.spec import TrainSpec

log = logging.getLogger(__name__)


def apply_activation_checkpointing(drafter: Drafter, mode: str) -> None:
    if mode == "layers":
        for index, layer in enumerate(drafter.layers):
            drafter.layers[index] = checkpoint_wrapper(layer)
    elif mode == "mlp":
        for layer in drafter.layers:
            layer.mlp = checkpoint_wrapper(layer.mlp)
    elif mode != "none":
        raise ValueError(f"activation checkpointing {mode!r}: expected none, mlp or layers")


def apply_compile(drafter: Drafter) -> None:
    """Each decoder layer compiled on its own (regional compilation: one graph serves all five, and
    a new micro-batch shape recompiles one small graph); norms, RoPE and SwiGLU become fused kernels."""
    for layer in drafter.layers:
        layer.compile(dynamic=True)


def parallelize(drafter: Drafter, train: TrainSpec, *, device: torch.device, world_size: int) -> nn.Module:
    """The module the training loop calls: `drafter` itself, or its DDP wrapper."""
    checkpointing, compiled = train.checkpointing_on(device.type), train.compiled_on(device.type)
    apply_activation_checkpointing(drafter, checkpointing)
    if compiled:
        apply_compile(drafter)
    log.info("activation checkpointing: %s%s; compiled layers and loss: %s", checkpointing,
             " (auto)" if train.activation_checkpointing == "auto" else "", "yes" if compiled else "no")
    if world_size == 1:
        return drafter
    from torch.nn.parallel import DistributedDataParallel

    # The target's frozen tensors are read by every rank from the checkpoint: never broadcast them.
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(drafter, ["embed_tokens", "lm_head", "target_norm"])
    return DistributedDataParallel(drafter, device_ids=[device.index] if device.type == "cuda" else None)
