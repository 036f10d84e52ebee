"""Training data: hidden-state chunks streamed from storage into packed micro-batches of blocks.

- Each rank owns a fixed set of chunks (balanced by tokens), so its local cache keeps serving it
  across epochs. Every epoch shuffles the rank's chunks and the documents inside each chunk, and
  packs documents into micro-batches of at most `micro_batch_tokens` context tokens.
- The plan of an epoch is a pure function of (document index, world size, seed, epoch): a
  restarted job rebuilds it and skips to its cursor, so the data order survives a kill.
- Every rank runs the same number of steps per epoch (the shortest rank's plan), as DDP needs.
- A background thread downloads upcoming chunks into a bounded local disk cache and builds the
  next micro-batches while the GPU works on the current one.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from dflash_jobs.balance import balance_by_tokens
from dflash_jobs.errors import FormatError
from dflash_jobs.formats import HiddenChunk, dequantize_fp8, fetch_header_bytes, hidden_chunk_key, object_range, read_header
from dflash_jobs.storage import Storage
from dflash_jobs.train.anchors import anchor_candidates, sample_anchors
from dflash_jobs.train.loss import slot_weights
from dflash_jobs.drafter.masks import BlockLayout

DECODED_CHUNKS = 2
"""Chunks held decoded in host memory (~3 GiB each at the 27B shape): the current and the next."""

# ---- the document index: which documents each chunk holds ----------------------------------


@dataclass
class ChunkDocuments:
    chunk: int
    sample_ids: list[int]  # 0-based line numbers in data.source: the anchors' seed
    lengths: list[int]
    candidates: list[int]  # anchor candidates (two consecutive supervised tokens) per document

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def trainable(self, index: int) -> bool:
        return self.candidates[index] > 0


def read_chunk_documents(storage: Storage, chunk: int) -> ChunkDocuments:
    """A chunk's document boundaries and loss masks, by ranged reads (never the hidden states)."""
    key = hidden_chunk_key(chunk)
    prefix = fetch_header_bytes(object_range(storage, key))
    header, length = read_header(prefix, key)[0], len(prefix)

    def tensor(name: str, dtype) -> np.ndarray:
        begin, end = header[name]["data_offsets"]
        return np.frombuffer(storage.get_bytes(key, length + begin, length + end), dtype=dtype)

    cu_seqlens, loss_mask = tensor("cu_seqlens", np.int64), tensor("loss_mask", np.uint8)
    bounds = list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    return ChunkDocuments(
        chunk=chunk,
        sample_ids=tensor("sample_ids", np.int64).tolist(),
        lengths=[end - begin for begin, end in bounds],
        candidates=[len(anchor_candidates(loss_mask[begin:end])) for begin, end in bounds],
    )


def read_document_index(storage: Storage, chunks: list[int], *, threads: int = 16) -> list[ChunkDocuments]:
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda chunk: read_chunk_documents(storage, chunk), chunks))


# ---- the plan: which documents each rank trains on at each step -----------------------------


@dataclass(frozen=True, slots=True)
class DocumentRef:
    chunk: int
    index: int  # position in the chunk
    sample_id: int
    tokens: int


MicroBatch = list[DocumentRef]


def assign_chunks(index: list[ChunkDocuments], world_size: int) -> list[list[ChunkDocuments]]:
    """Chunks per rank, balanced by tokens as extraction shards are, fixed across epochs."""
    return balance_by_tokens(index, world_size, tokens=lambda c: c.tokens, ident=lambda c: c.chunk)


@dataclass(frozen=True, slots=True)
class Budget:
    """What one micro-batch may hold: context tokens, and blocks (one per anchor, at most `anchors`
    per document), which is what activation memory grows with."""

    tokens: int
    blocks: int
    anchors: int


def plan_rank_epoch(chunks: list[ChunkDocuments], *, seed: int, epoch: int, rank: int, budget: Budget) -> list[MicroBatch]:
    """Shuffled chunks, shuffled documents inside each, packed greedily into micro-batches."""
    rng = np.random.default_rng([seed, epoch, rank])
    batches: list[MicroBatch] = []
    current: MicroBatch = []
    tokens = blocks = 0
    for c in rng.permutation(len(chunks)):
        chunk = chunks[c]
        for i in rng.permutation(len(chunk.lengths)):
            if not chunk.trainable(i):
                continue
            doc = DocumentRef(chunk.chunk, int(i), chunk.sample_ids[i], chunk.lengths[i])
            doc_blocks = min(budget.anchors, chunk.candidates[i])
            if current and (tokens + doc.tokens > budget.tokens or blocks + doc_blocks > budget.blocks):
                batches.append(current)
                current, tokens, blocks = [], 0, 0
            current.append(doc)
            tokens += doc.tokens
            blocks += doc_blocks
    if current:
        batches.append(current)
    return batches


def plan_epoch(index: list[ChunkDocuments], *, world_size: int, seed: int, epoch: int, budget: Budget) -> list[list[MicroBatch]]:
    """Every rank's micro-batches for one epoch, cut to the shortest rank's count."""
    plans = [
        plan_rank_epoch(chunks, seed=seed, epoch=epoch, rank=rank, budget=budget)
        for rank, chunks in enumerate(assign_chunks(index, world_size))
    ]
    steps = min(len(plan) for plan in plans)
    return [plan[:steps] for plan in plans]


# ---- micro-batches ---------------------------------------------------------------------------


@dataclass
class Batch:
    """One packed micro-batch: the documents' context, and one block per anchor."""

    context_hidden: torch.Tensor  # [C, L*d], the captured layers concatenated per token
    context_positions: torch.Tensor  # int64 [C], positions inside each document
    block_ids: torch.Tensor  # int64 [N, B]: the anchor token, then mask tokens
    block_positions: torch.Tensor  # int64 [N, B]: anchor position + slot
    labels: torch.Tensor  # int64 [N, B]: the token at anchor + slot (0 past the document's end)
    loss_weights: torch.Tensor  # float32 [N, B]: slot decay x loss_mask of the label; 0 for slot 0
    layout: BlockLayout
    documents: int

    @property
    def tokens(self) -> int:
        return self.context_hidden.shape[0]

    def pin_memory(self) -> Batch:
        return self._map(lambda t: t.pin_memory())

    def to(self, device: torch.device) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=True))

    def _map(self, fn) -> Batch:
        layout = self.layout
        return Batch(
            fn(self.context_hidden), fn(self.context_positions), fn(self.block_ids), fn(self.block_positions),
            fn(self.labels), fn(self.loss_weights),
            BlockLayout(layout.num_context, layout.block_size, fn(layout.context_start), fn(layout.anchor), fn(layout.key_positions)),
            self.documents,
        )


class BatchBuilder:
    """Turns a micro-batch plan entry into tensors: samples anchors and lays out the blocks."""

    def __init__(self, *, block_size: int, anchors: int, gamma: float, mask_token_id: int, seed: int, layers: list[int]) -> None:
        self.block_size = block_size
        self.anchors = anchors
        self.mask_token_id = mask_token_id
        self.seed = seed
        self.layers = layers
        self.decay = slot_weights(block_size, gamma).numpy()

    def build(self, documents: MicroBatch, chunks: dict[int, HiddenChunk], epoch: int) -> Batch:
        B = self.block_size
        slots = np.arange(B)
        hidden, positions, ids, block_pos, labels, weights, starts, anchors = [], [], [], [], [], [], [], []
        offset = 0
        for doc in documents:
            chunk = chunks[doc.chunk]
            begin, end = (int(x) for x in chunk.tokens.cu_seqlens[doc.index : doc.index + 2])
            input_ids, loss_mask = chunk.tokens.input_ids[begin:end].astype(np.int64), chunk.tokens.loss_mask[begin:end]
            T = end - begin
            states = chunk.hidden_states[begin:end]
            if chunk.scale is not None:
                states = dequantize_fp8(states, chunk.scale[begin:end])
            hidden.append(states.reshape(T, -1))  # [T, L, d] -> [T, L*d]
            positions.append(np.arange(T))
            a = sample_anchors(loss_mask, self.anchors, seed=self.seed, epoch=epoch, sample_id=doc.sample_id)
            target = a[:, None] + slots[None, :]  # [n, B] positions of each slot
            inside = target < T
            clipped = np.minimum(target, T - 1)
            block = np.full((len(a), B), self.mask_token_id, dtype=np.int64)
            block[:, 0] = input_ids[a]
            ids.append(block)
            block_pos.append(target)
            labels.append(np.where(inside, input_ids[clipped], 0))
            weights.append(np.where(inside, loss_mask[clipped], 0) * self.decay[None, :])
            starts.append(np.full(len(a), offset))
            anchors.append(offset + a)
            offset += T
        context_positions = torch.from_numpy(np.concatenate(positions))
        block_positions = torch.from_numpy(np.concatenate(block_pos))
        layout = BlockLayout(
            num_context=offset, block_size=B,
            context_start=torch.from_numpy(np.concatenate(starts)),
            anchor=torch.from_numpy(np.concatenate(anchors)),
            key_positions=torch.cat([context_positions, block_positions.flatten()]),
        )
        return Batch(
            context_hidden=torch.cat(hidden),
            context_positions=context_positions,
            block_ids=torch.from_numpy(np.concatenate(ids)),
            block_positions=block_positions,
            labels=torch.from_numpy(np.concatenate(labels)),
            loss_weights=torch.from_numpy(np.concatenate(weights).astype(np.float32)),
            layout=layout,
            documents=len(documents),
        )


# ---- chunks: local cache and streaming -------------------------------------------------------


class ChunkCache:
    """Chunks downloaded to local disk, least recently used evicted above `max_bytes`."""

    def __init__(self, storage: Storage, directory: Path, max_bytes: int) -> None:
        self.storage = storage
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._files: OrderedDict[int, int] = OrderedDict()  # chunk -> bytes, oldest use first
        for path in sorted(self.directory.glob("*.safetensors")):
            self._files[int(path.stem)] = path.stat().st_size

    def path(self, chunk: int) -> Path:
        return self.directory / f"{chunk:06d}.safetensors"

    def fetch(self, chunk: int) -> Path:
        path = self.path(chunk)
        with self._lock:
            if chunk in self._files:
                self._files.move_to_end(chunk)
                return path
        self.storage.get_file(hidden_chunk_key(chunk), path)
        with self._lock:
            self._files[chunk] = path.stat().st_size
            while sum(self._files.values()) > self.max_bytes and len(self._files) > 1:
                evicted, _ = self._files.popitem(last=False)
                self.path(evicted).unlink(missing_ok=True)
        return path

    def read(self, chunk: int) -> bytes:
        """The chunk's bytes. A prefetched file may have been evicted since (a chunk spans many
        steps and the cache a few chunks): then it is fetched again."""
        while True:
            path = self.fetch(chunk)
            with self._lock:  # eviction takes the lock too: the file stays while it is read
                if chunk in self._files:
                    self._files.move_to_end(chunk)
                    return path.read_bytes()


class BatchStream:
    """This rank's micro-batches over all epochs, from a cursor (epoch, step): Stateful, so the
    checkpointer restores the exact position. Iterating yields (epoch, step, Batch)."""

    def __init__(
        self, plans: list[list[MicroBatch]], cache: ChunkCache, builder: BatchBuilder,
        *, prefetch_batches: int = 2, prefetch_chunks: int = 2, pin_memory: bool = False,
    ) -> None:
        self.plans = plans  # per epoch: this rank's micro-batches
        self.cache = cache
        self.builder = builder
        self.prefetch_batches = prefetch_batches
        self.prefetch_chunks = prefetch_chunks
        self.pin_memory = pin_memory
        self.epoch, self.step = 0, 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if self._thread is not None:
            raise RuntimeError("the data cursor moves only before iteration starts")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])

    def positions(self) -> Iterator[tuple[int, int]]:
        epoch, step = self.epoch, self.step
        while epoch < len(self.plans):
            if step < len(self.plans[epoch]):
                yield epoch, step
                step += 1
            else:
                epoch, step = epoch + 1, 0

    def __iter__(self) -> Iterator[tuple[int, int, Batch]]:
        ready: queue.Queue = queue.Queue(self.prefetch_batches)
        self._thread = threading.Thread(target=self._produce, args=(ready,), daemon=True, name="batches")
        self._thread.start()
        while True:
            item = ready.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            epoch, step, batch = item
            # The cursor names the next batch to train on: a checkpoint taken after this step resumes there.
            self.epoch, self.step = (epoch, step + 1)
            yield epoch, step, batch

    def close(self) -> None:
        self._stop.set()

    def _produce(self, ready: queue.Queue) -> None:
        downloads: dict[int, Future] = {}
        decoded: OrderedDict[int, HiddenChunk] = OrderedDict()
        with ThreadPoolExecutor(self.prefetch_chunks, thread_name_prefix="download") as pool:
            try:
                upcoming = list(self.positions())
                for i, (epoch, step) in enumerate(upcoming):
                    if self._stop.is_set():
                        return
                    for ahead_epoch, ahead_step in upcoming[i : i + 1 + self.prefetch_batches]:
                        for doc in self.plans[ahead_epoch][ahead_step]:
                            if doc.chunk not in downloads and doc.chunk not in decoded:
                                downloads[doc.chunk] = pool.submit(self.cache.fetch, doc.chunk)
                    documents = self.plans[epoch][step]
                    needed = {doc.chunk for doc in documents}
                    for chunk in sorted(needed):
                        if chunk not in decoded:
                            # Room first, never taking a chunk this batch needs (a batch can span several).
                            spare = [c for c in decoded if c not in needed]
                            for old in spare[: max(0, len(decoded) + 1 - DECODED_CHUNKS)]:
                                del decoded[old]
                            pending = downloads.pop(chunk, None)
                            if pending is not None:
                                pending.result()  # its download, or its error
                            decoded[chunk] = self._decode(chunk)
                        decoded.move_to_end(chunk)
                    batch = self.builder.build(documents, decoded, epoch)
                    if not self._hand_over(ready, (epoch, step, batch.pin_memory() if self.pin_memory else batch)):
                        return
                self._hand_over(ready, None)
            except BaseException as exc:  # re-raised in the training thread
                self._hand_over(ready, exc)

    def _hand_over(self, ready: queue.Queue, item) -> bool:
        """Puts `item` for the training thread; False once close() was called (nobody takes it)."""
        while not self._stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _decode(self, chunk_id: int) -> HiddenChunk:
        name = self.cache.path(chunk_id).name
        chunk = HiddenChunk.decode(self.cache.read(chunk_id), name)
        if chunk.layers != self.builder.layers:
            raise FormatError(f"{name} holds layers {chunk.layers}, the manifest says {self.builder.layers}", "Re-run extraction and verify")
        return chunk
