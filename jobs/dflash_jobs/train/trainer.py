"""The training loop: named components wired together (DESIGN section 7, STYLE items 2-5, 9).

Trainer.build reads the manifest (refusing to start without one), the target's frozen tensors and
the document index, then assembles model, optimizer, schedule, data stream and checkpointer; it
resumes from the newest checkpoint. Trainer.train is the checklist: train_step, metrics at the log
interval (the only deliberate device sync: the loss's gather of supervised rows syncs too), checkpoints when due and at every epoch's end, export at the end.
"""

from __future__ import annotations

import logging
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dflash_jobs.devices import pick_device
from dflash_jobs.drafter.checkpoint import TargetCheckpoint, drafter_config_for_target
from dflash_jobs.drafter.export import DRAFTER_PREFIX
from dflash_jobs.drafter.mask_token import pick_mask_token, tokens_in_chunks
from dflash_jobs.drafter.masks import build_attention
from dflash_jobs.drafter.model import Drafter
from dflash_jobs.errors import InputError
from dflash_jobs.spec import RunSpec, resolve_layers
from dflash_jobs.storage import Storage, open_storage, storage_for
from dflash_jobs.train.checkpointer import Checkpointer
from dflash_jobs.train.data import Batch, BatchBuilder, BatchStream, Budget, plan_epoch, read_document_index
from dflash_jobs.train.flops import peak_flops, step_flops
from dflash_jobs.train.heartbeat import Heartbeat
from dflash_jobs.train.loss import DraftLoss, expected_acceptance_length
from dflash_jobs.train.metrics import ConsoleSink, MetricSink, MultiSink, NullSink, StorageSink, should_log
from dflash_jobs.train.optim import build_optimizer, build_scheduler
from dflash_jobs.train.parallelize import parallelize
from dflash_jobs.train.states import States, open_states
from dflash_jobs.variants import DrafterVariant, drafter_variant

log = logging.getLogger(__name__)

LOG_EVERY = 10
"""Optimizer steps between metric lines (each one reads counters from the device, all ranks together)."""


@dataclass(frozen=True, slots=True)
class Runtime:
    rank: int
    world_size: int
    device: torch.device
    local_world_size: int = 1  # ranks on this node: they share its cache bound (train.cache_gb)

    @classmethod
    def from_env(cls, spec: RunSpec) -> Runtime:
        """torchrun's environment; one process without it. Initialises the process group."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        device = pick_device(spec, int(os.environ.get("LOCAL_RANK", "0")))
        use_cuda = device.type == "cuda"
        if use_cuda:
            torch.cuda.set_device(device)
        if world_size > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
        return cls(rank, world_size, device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


@dataclass
class LoopState:
    """The loop's own resumable counters."""

    step: int = 0
    tokens: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.tokens = int(state["step"]), int(state["tokens"])


def build_drafter(spec: RunSpec, runtime: Runtime, states: States, variant: DrafterVariant) -> Drafter:
    """A fresh drafter of `variant` shaped for the target, holding the target's frozen tensors, on the device."""
    train = spec.train
    target = TargetCheckpoint(open_storage(spec.target.model, endpoint_url=spec.storage.endpoint_url, region=spec.storage.region))
    layers = resolve_layers(spec, target.config)
    if states.layers != layers or states.hidden_size != target.text["hidden_size"]:
        raise InputError(
            f"the hidden states hold layers {states.layers} of width {states.hidden_size}; the spec and target want {layers} of width {target.text['hidden_size']}",
            "Re-run extraction for this spec, or restore the target.layers it was extracted with",
        )
    storage = storage_for(spec)
    mask = _broadcast(lambda: pick_mask_token(target, train.mask_token_id, data_holds=lambda ids: tokens_in_chunks(storage, states.chunks, ids)), runtime)
    log.info("mask token %d: %s", mask.id, mask.why)
    config = variant.build_config(drafter_config_for_target(target, train, layers, mask.id), train)
    torch.manual_seed(train.seed)
    with runtime.device:  # initialised in place: 1.8B parameters for a 27B target
        drafter = variant.build_model(config)
    frozen = target.read_target_tensors()
    table_dtype = torch.bfloat16 if runtime.device.type == "cuda" else frozen.embed_tokens.dtype
    drafter.load_target_tensors(frozen.embed_tokens.to(table_dtype), frozen.lm_head.to(table_dtype), frozen.final_norm)
    return drafter


def global_loss_normalizer(loss_weights: torch.Tensor, world_size: int) -> torch.Tensor | None:
    """Under DDP, the mean over ranks of their summed loss weights: each rank divides its own sum
    by it and DDP averages the gradients, which gives the gradient of the mean over every supervised
    slot of every rank. (Each rank's own sum would weigh the ranks with few supervised slots more.)
    One small all-reduce per step, on the device; None in one process (the batch's own sum)."""
    if world_size == 1:
        return None
    total = loss_weights.sum(dtype=torch.float32)
    dist.all_reduce(total)
    return total / world_size


class MetricsWindow:
    """DraftLoss counters summed on the device between log lines, reduced across ranks once per line."""

    def __init__(self, block_size: int, device: torch.device, ratios: tuple[str, ...] = ()) -> None:
        self.block_size, self.device, self.ratios = block_size, device, ratios
        self.peak = peak_flops(device)
        self.reset()

    def reset(self) -> None:
        # [loss sum, steps, accepted, blocks, tokens, correct per slot (B), supervised per slot (B),
        #  then a numerator and a denominator per variant ratio]
        self.sums = torch.zeros(5 + 2 * self.block_size + 2 * len(self.ratios), dtype=torch.float64, device=self.device)
        self.flops = 0.0  # on the host: counted from the batches' layouts (train/flops.py)
        self.started = time.monotonic()

    def add(self, out: DraftLoss, tokens: int, flops: float = 0.0) -> None:
        B = self.block_size
        self.flops += flops
        self.sums[0] += out.loss.detach().double()
        self.sums[1] += 1
        self.sums[2] += out.accepted
        self.sums[3] += out.blocks
        self.sums[4] += tokens
        self.sums[5 : 5 + B] += out.correct_per_slot
        self.sums[5 + B : 5 + 2 * B] += out.supervised_per_slot
        for i, name in enumerate(self.ratios):
            numerator, denominator = out.ratios[name]
            self.sums[5 + 2 * B + 2 * i] += numerator.detach().double()
            self.sums[6 + 2 * B + 2 * i] += denominator.detach().double()

    def read(self, waited_s: float = 0.0) -> dict[str, Any]:
        """The window's figures; waited_s: the seconds of it the loop waited for its batches (data_wait, a share)."""
        if dist.is_initialized():
            dist.all_reduce(self.sums)
        sums = self.sums.tolist()
        B = self.block_size
        correct, supervised = sums[5 : 5 + B], sums[5 + B : 5 + 2 * B]
        elapsed = time.monotonic() - self.started
        pairs = sums[5 + 2 * B :]
        return {
            "loss": sums[0] / sums[1],
            "acceptance_length": expected_acceptance_length(sums[2], sums[3]),
            "accuracy": [c / s if s else math.nan for c, s in zip(correct, supervised)],
            "tokens_per_s": sums[4] / elapsed,
            "tflop_per_s": self.flops / elapsed / 1e12,
            "mfu": None if self.peak is None else self.flops / elapsed / self.peak,
            "blocks": int(sums[3]),
            "data_wait": waited_s / elapsed,
            **{name: pairs[2 * i] / pairs[2 * i + 1] if pairs[2 * i + 1] else math.nan for i, name in enumerate(self.ratios)},
        }


class Trainer:
    def __init__(
        self, *, spec: RunSpec, runtime: Runtime, drafter: Drafter, model: torch.nn.Module, optimizer, scheduler,
        stream: BatchStream, checkpointer: Checkpointer, state: LoopState, sink: MetricSink, storage: Storage,
        total_steps: int, steps_per_epoch: list[int], attention_backend: str, variant: DrafterVariant, states: States,
        log_every: int = LOG_EVERY,
    ) -> None:
        self.spec, self.runtime, self.drafter, self.model, self.variant, self.states = spec, runtime, drafter, model, variant, states
        self.optimizer, self.scheduler, self.stream = optimizer, scheduler, stream
        self.checkpointer, self.state, self.sink, self.storage = checkpointer, state, sink, storage
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        self.attention_backend, self.log_every = attention_backend, log_every
        self.window = MetricsWindow(spec.train.block_size, runtime.device, variant.metrics)
        self.trainable = [p for p in drafter.parameters() if p.requires_grad]
        self.completed = False
        """train() ran to its end on this rank (the drafter saved, and exported on rank 0)."""

    @classmethod
    def build(cls, spec: RunSpec, runtime: Runtime, *, cache_dir: Path, log_every: int = LOG_EVERY) -> Trainer:
        train = spec.train
        storage = storage_for(spec)
        if train.dspark is not None and train.dspark.ce_only:
            log.warning("train.dspark.ce_only: DSpark trains on cross-entropy only, without the target's final hidden state "
                        "(no L1 term, no confidence head)")
        states = open_states(spec, storage, runtime.device)
        variant = drafter_variant(train.drafter)
        drafter = build_drafter(spec, runtime, states, variant)
        config, layers = drafter.config, drafter.config.target_layer_ids
        model = parallelize(drafter, train, device=runtime.device, world_size=runtime.world_size)

        log.info("reading the document index of %d chunks", len(states.chunks))
        index = _broadcast(lambda: read_document_index(storage, states.chunks, key_of=states.key_of), runtime)
        budget = Budget(tokens=train.micro_batch_tokens, blocks=train.micro_batch_blocks, anchors=train.anchors)
        plans = [
            plan_epoch(index, world_size=runtime.world_size, seed=train.seed, epoch=epoch, budget=budget)[runtime.rank]
            for epoch in range(train.epochs)
        ]
        steps_per_epoch = [len(plan) for plan in plans]
        total_steps = sum(steps_per_epoch)
        if len(index) < runtime.world_size:  # every rank decides alike: none is left waiting in a collective
            raise InputError(
                f"{len(index)} chunks for {runtime.world_size} training ranks: some ranks would have no data",
                "Train on fewer GPUs (train.nodes x train.gpus_per_node) or cut more chunks (a smaller data.chunk_tokens, then prepare and extract again)",
            )
        if total_steps == 0:
            raise InputError(f"no trainable documents in {len(index)} chunks (none has two consecutive supervised tokens)", "Check the data's loss masks (assistant turns)")
        optimizer = build_optimizer(drafter, train, device=runtime.device)
        scheduler = build_scheduler(optimizer, train, total_steps)
        builder = BatchBuilder(
            layout=train.layout, anchors=train.anchors, mask_token_id=config.mask_token_id, seed=train.seed, layers=layers,
            context=states.context(),
        )
        source = states.source(plans, cache_dir, int(train.cache_gb * (1 << 30) / runtime.local_world_size))
        stream = BatchStream(plans, source, builder, pin_memory=runtime.device.type == "cuda")
        state = LoopState()
        meta = {
            "train": spec.to_dict()["train"], "drafter": config.to_dict(), "world_size": runtime.world_size,
            "manifest": states.describe(),  # the chunks trained on, stored or online (the key checkpoints have always had)
        }
        checkpointer = Checkpointer(
            storage, drafter, {"optimizer": optimizer, "scheduler": scheduler, "data": stream, "loop": state},
            every=train.checkpoint_every, meta=meta, rank=runtime.rank,
        )
        resumed = checkpointer.load_latest() or 0
        console = ConsoleSink(variant.metrics, first_draft=train.layout.first_draft)
        sink = MultiSink(console, StorageSink(storage, resume_step=resumed)) if runtime.rank == 0 else NullSink()
        log.info(
            "drafter: %s, %d layers, %.1fM trainable parameters, mask token %d; %d chunks, %d steps over %d epochs on %d ranks%s",
            variant.name, config.num_layers, sum(p.numel() for p in drafter.parameters() if p.requires_grad) / 1e6, config.mask_token_id,
            len(index), total_steps, train.epochs, runtime.world_size, f", resuming after step {resumed}" if resumed else "",
        )
        return cls(
            spec=spec, runtime=runtime, drafter=drafter, model=model, optimizer=optimizer, scheduler=scheduler,
            stream=stream, checkpointer=checkpointer, state=state, sink=sink, storage=storage, total_steps=total_steps,
            steps_per_epoch=steps_per_epoch, attention_backend="flex" if runtime.device.type == "cuda" else "dense",
            variant=variant, states=states, log_every=log_every,
        )

    def autocast(self):
        if self.runtime.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    def train_step(self, batch: Batch) -> DraftLoss:
        """Forward, backward, clip, optimizer and schedule step on one micro-batch."""
        batch = self.states.fill(batch.to(self.runtime.device), self.state.step)
        config = self.drafter.config
        attention = build_attention(batch.layout, config.layer_types, config.sliding_window, backend=self.attention_backend, is_causal=config.is_causal)
        with self.autocast():
            hidden = self.model(batch.context_hidden, batch.context_positions, batch.block_ids, batch.block_positions, attention)
            out = self.variant.objective(
                self.drafter, hidden, batch, normalizer=global_loss_normalizer(batch.loss_weights, self.runtime.world_size),
                fused=self.spec.train.compiled_on(hidden.device.type),
            )
        out.loss.backward()
        max_norm = self.spec.train.grad_clip or math.inf
        torch.nn.utils.clip_grad_norm_(self.trainable, max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return out

    def train(self) -> None:
        start_step, started = self.state.step, time.monotonic()
        saved = self.state.step
        waited = self.stream.wait_s  # the loader's share of each log window: what it starved the loop of
        with Heartbeat(total_steps=self.total_steps, step=start_step, stall_seconds=self.spec.train.stall_seconds) as heartbeat:
            for epoch, step_in_epoch, batch in self.stream:
                self.state.step += 1
                self.state.tokens += batch.tokens
                flops = step_flops(self.drafter.config, batch, self.variant) + self.states.step_flops(batch)
                out = self.train_step(batch)
                self.window.add(out, batch.tokens, flops)
                step = self.state.step
                heartbeat.stepped(step)
                if should_log(step, self.log_every) or step == self.total_steps:
                    self.states.check()
                    metrics = self.window.read(waited_s=self.stream.wait_s - waited)
                    waited = self.stream.wait_s
                    rate = (time.monotonic() - started) / (step - start_step)
                    metrics.update(epoch=epoch, total_steps=self.total_steps, lr=self.scheduler.get_last_lr()[0], eta_s=int(rate * (self.total_steps - step)))
                    self.sink.log(metrics, step)
                    heartbeat.logged()
                    self.window.reset()
                if self.checkpointer.due(step) or step_in_epoch == self.steps_per_epoch[epoch] - 1:
                    self.states.check()
                    self.checkpointer.save(step)
                    saved = step
        self.states.check()
        if self.state.step != saved:
            self.checkpointer.save(self.state.step)
        if self.runtime.rank == 0:
            self.variant.export(self.drafter, self.storage, DRAFTER_PREFIX)
            log.info("drafter exported to %s/train/drafter/ after %d steps", self.storage.url, self.state.step)
        self.completed = True

    def close(self) -> None:
        """The end of a rank, in order: its threads stopped (the batch producer and its downloads; the
        heartbeat ended with train()), its sinks closed, then the process group left."""
        self.stream.close()
        self.sink.close()
        leave_process_group(together=self.completed)


def leave_process_group(*, together: bool) -> None:
    """Destroys this rank's process group (if any), after a barrier when `together`: every rank
    completed, and none tears gloo or NCCL down under another still in a collective (that one would
    die by SIGABRT). After a failure there is no barrier: the other ranks may never come to it."""
    if not dist.is_initialized():
        return
    if together:
        dist.barrier()
    dist.destroy_process_group()


def _broadcast(compute, runtime: Runtime):
    """Rank 0 computes, every rank receives (the document index: one read of the chunks, not one per rank)."""
    if runtime.world_size == 1:
        return compute()
    box = [compute() if runtime.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
