"""Where the drafter's context states come from (train.states): the one seam between the two paths.

- stored: the verified hidden-state chunks extraction wrote (extract/manifest.json), each rank's
  share kept on local disk or streamed (ChunkCache), the states read into the batch on the host.
- online: prepare's token chunks (tokens/dataset.json), a few bytes a token; each rank loads the
  target as extraction does and makes every micro-batch's states inside its training step
  (train/online.py). Nothing is stored but checkpoints, metrics and the drafter.

Both give the trainer the same things: the chunks and their document index (the epoch plan is the
same pure function of it), the layers the drafter reads, the chunk source the batch stream opens,
the context the batch builder lays out, and `fill`, which completes a batch on the device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from dflash_jobs.capture.runner import TargetCapture, open_target
from dflash_jobs.errors import InputError
from dflash_jobs.formats import (
    DATASET_KEY, MANIFEST_KEY, DatasetIndex, Manifest, check_final_hidden, hidden_chunk_key, token_chunk_key,
)
from dflash_jobs.spec import RunSpec
from dflash_jobs.storage import ObjectNotFound, Storage
from dflash_jobs.train.chunks import ChunkCache, TokenChunks
from dflash_jobs.train.data import Batch, Context, MicroBatch, StoredContext, TargetContext, planned_chunks
from dflash_jobs.train.online import OnlineStates

log = logging.getLogger(__name__)


class States(Protocol):
    chunks: list[int]
    layers: list[int]
    hidden_size: int
    key_of: Callable[[int], str]

    def source(self, plans: list[list[MicroBatch]], cache_dir: Path, cache_bytes: int) -> ChunkCache | TokenChunks: ...

    def context(self) -> Context: ...

    def fill(self, batch: Batch, step: int) -> Batch: ...

    def step_flops(self, batch: Batch) -> float: ...

    def check(self) -> None: ...

    def describe(self) -> dict[str, Any]:
        """The chunks and tokens trained on, which a checkpoint records and a resumed run must match."""


def load_manifest(storage: Storage) -> Manifest:
    if not storage.exists(MANIFEST_KEY):
        raise InputError(
            f"{storage.url}/{MANIFEST_KEY} does not exist: the hidden states are not verified",
            "Training starts after extraction: run `dflashctl verify` (or `dflashctl run`) once every shard has landed",
        )
    manifest = Manifest.from_json(storage.get_bytes(MANIFEST_KEY))
    if not manifest.chunks:
        raise InputError(f"{storage.url}/{MANIFEST_KEY} lists no chunks", "Check data.source and re-run prepare and extraction")
    return manifest


class StoredStates:
    """The verified hidden-state chunks of extraction."""

    key_of = staticmethod(hidden_chunk_key)

    def __init__(self, spec: RunSpec, storage: Storage) -> None:
        self.storage = storage
        self.manifest = load_manifest(storage)
        check_final_hidden(self.manifest, spec.train, f"{storage.url}/{MANIFEST_KEY}")
        self.final_hidden = spec.train.reads_final_hidden
        self.chunks = [chunk.chunk for chunk in self.manifest.chunks]
        self.layers, self.hidden_size = self.manifest.layers, self.manifest.hidden_size

    def source(self, plans: list[list[MicroBatch]], cache_dir: Path, cache_bytes: int) -> ChunkCache:
        return ChunkCache(self.storage, cache_dir, cache_bytes, planned_chunks(self.manifest.chunks, plans))

    def context(self) -> Context:
        return StoredContext(final_hidden=self.final_hidden)

    def fill(self, batch: Batch, step: int) -> Batch:
        return batch

    def step_flops(self, batch: Batch) -> float:
        return 0.0

    def check(self) -> None:
        """Stored chunks were checked by verify and are checked against it when fetched."""

    def describe(self) -> dict[str, Any]:
        return {"chunks": len(self.chunks), "tokens": self.manifest.tokens}


class TargetStates:
    """The target run in the training step on prepare's token chunks (train/online.py)."""

    key_of = staticmethod(token_chunk_key)

    def __init__(self, spec: RunSpec, storage: Storage, device: torch.device) -> None:
        self.storage = storage
        try:
            self.index = DatasetIndex.from_json(storage.get_bytes(DATASET_KEY), DATASET_KEY)
        except ObjectNotFound:
            raise InputError(f"{storage.url}/{DATASET_KEY} does not exist", "Run `dflashctl prepare` first") from None
        if not self.index.chunks:
            raise InputError(f"{storage.url}/{DATASET_KEY} lists no chunks", "Check data.source and re-run prepare")
        self.chunks = [info.id for info in self.index.chunks]
        opened = open_target(spec, device, final_hidden=spec.train.reads_final_hidden)
        target = opened.target
        self.layers, self.hidden_size = target.layers, target.hidden_size
        self.target_parameters = sum(p.numel() for p in target.decoder_layers.parameters())
        # The context of one micro-batch, or a document longer than its budget, which comes alone.
        capacity = max(spec.train.micro_batch_tokens, spec.data.max_length)
        self.capture = TargetCapture(target, spec.extract, packed=opened.packed, max_length=spec.data.max_length, capacity=capacity)
        self.online = OnlineStates(self.capture, dtype=spec.extract.dtype)
        log.info("online states: the target (%s, layers %s%s) runs in every training step; %d token chunks, %d tokens",
                 target.name, target.layers, " and the final hidden state" if target.final_hidden else "",
                 len(self.chunks), self.index.tokens)

    def warm_up(self) -> float:
        return self.capture.warm_up()

    def source(self, plans: list[list[MicroBatch]], cache_dir: Path, cache_bytes: int) -> TokenChunks:
        read = {doc.chunk for plan in plans for batch in plan for doc in batch}
        return TokenChunks(self.storage, [info for info in self.index.chunks if info.id in read])

    def context(self) -> Context:
        return TargetContext(self.capture.planner)

    def fill(self, batch: Batch, step: int) -> Batch:
        return self.online.fill(batch, step)

    def step_flops(self, batch: Batch) -> float:
        """The target's forward: 2 FLOPs a parameter a token (its attention's pairs left out)."""
        return 2.0 * self.target_parameters * batch.tokens

    def check(self) -> None:
        self.online.check()

    def describe(self) -> dict[str, Any]:
        return {"chunks": len(self.chunks), "tokens": self.index.tokens}


def open_states(spec: RunSpec, storage: Storage, device: torch.device) -> StoredStates | TargetStates:
    """The states train.states names, ready for the trainer."""
    if spec.train.states == "online":
        states = TargetStates(spec, storage, device)
        states.warm_up()
        return states
    return StoredStates(spec, storage)
