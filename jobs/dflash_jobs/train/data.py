"""Training data: hidden-state chunks streamed from storage into packed micro-batches of blocks.

- Each rank owns a fixed set of chunks (balanced by tokens), so its local cache keeps serving it
  across epochs. Every epoch shuffles the rank's chunks and the documents inside each chunk, and
  packs documents into micro-batches of at most `micro_batch_tokens` context tokens.
- The plan of an epoch is a pure function of (document index, world size, seed, epoch): a
  restarted job rebuilds it and skips to its cursor, so the data order survives a kill.
- Every rank runs the same number of steps per epoch (the shortest rank's plan), as DDP needs.
- A background thread opens upcoming chunks and builds the next micro-batches while the GPU works
  on the current one. Every chunk is checked against the manifest when fetched; a fixed subset of
  the rank's chunks (what the cache bound holds) stays on local disk across epochs, the rest streams
  through memory (ChunkCache, in train/chunks.py). A batch reads only its documents' rows, straight
  into pinned memory; fp8 states cross to the GPU as stored and are dequantized there (Batch.to).
- The target's final hidden state (DSpark's target distribution) is read the same way, row for row
  beside the context, only by a builder asked for it (BatchBuilder's final_hidden): other drafters
  read and hold none of it.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Protocol

import numpy as np
import torch

from dflash_jobs.balance import balance_by_tokens
from dflash_jobs.capture.batching import Batch as TargetBatch
from dflash_jobs.capture.batching import BatchPlanner, SampleRef
from dflash_jobs.spec import AnchorLayout
from dflash_jobs.errors import FormatError
from dflash_jobs.formats import DoneMarker, dequantize_fp8, fetch_header_bytes, hidden_chunk_key, object_range, read_header
from dflash_jobs.storage import Storage
from dflash_jobs.train.anchors import anchor_candidates, sample_anchors
from dflash_jobs.train.chunks import ChunkCache, ChunkData, TokenChunkData, TokenChunks
from dflash_jobs.drafter.masks import BlockLayout

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


def read_chunk_documents(storage: Storage, chunk: int, key_of: Callable[[int], str] = hidden_chunk_key) -> ChunkDocuments:
    """A chunk's document boundaries and loss masks, by ranged reads (never the hidden states): a
    hidden-state chunk's, or a token chunk's (`key_of`: token_chunk_key), which holds the same tensors."""
    key = key_of(chunk)
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


def read_document_index(
    storage: Storage, chunks: list[int], *, threads: int = 16, key_of: Callable[[int], str] = hidden_chunk_key,
) -> list[ChunkDocuments]:
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda chunk: read_chunk_documents(storage, chunk, key_of), chunks))


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


def planned_chunks(chunks: list[DoneMarker], plans: list[list[MicroBatch]]) -> list[DoneMarker]:
    """The manifest entries of the chunks these plans read (one rank's share)."""
    read = {doc.chunk for plan in plans for batch in plan for doc in batch}
    return [marker for marker in chunks if marker.chunk in read]


# ---- micro-batches ---------------------------------------------------------------------------


@dataclass
class Batch:
    """One packed micro-batch: the documents' context, and one block per anchor."""

    context_hidden: torch.Tensor | None  # [C, L*d], the captured layers concatenated per token: bf16, or fp8 as stored; None online until the target ran
    context_positions: torch.Tensor  # int64 [C], positions inside each document
    block_ids: torch.Tensor  # int64 [N, B]: the anchor token, then mask tokens
    block_positions: torch.Tensor  # int64 [N, B]: anchor position + slot
    labels: torch.Tensor  # int64 [N, B]: the token slot k predicts, at anchor + k (+ 1 when sampling from the anchor); 0 past the document's end
    loss_weights: torch.Tensor  # float32 [N, B]: slot decay x loss_mask of the label (its leading run only, by the layout); 0 for an untrained anchor slot
    layout: BlockLayout
    documents: int
    context_scale: torch.Tensor | None = None  # float32 [C, L] for fp8 states: dequantized by to(), on the device
    final_hidden: torch.Tensor | None = None
    """[C, d] the target's final hidden state (its last decoder layer, before the final norm), row for
    row with context_hidden: bf16, or fp8 as stored; only from a builder asked for it."""
    final_scale: torch.Tensor | None = None  # float32 [C] for fp8 final states: dequantized by to(), on the device
    target_input: TargetInput | None = None
    """Online states (train.states: online): what the target runs to make context_hidden (None until it has)."""

    @property
    def tokens(self) -> int:
        return self.context_positions.shape[0]

    def pin_memory(self) -> Batch:
        return self._map(lambda t: t if t.is_pinned() else t.pin_memory())

    def select(self, blocks: slice) -> Batch:
        """The same context with only the blocks `blocks` (the evaluation's training forward runs a long document's blocks a group at a time)."""
        layout = self.layout
        return dataclasses.replace(
            self, block_ids=self.block_ids[blocks], block_positions=self.block_positions[blocks],
            labels=self.labels[blocks], loss_weights=self.loss_weights[blocks],
            layout=BlockLayout(
                layout.num_context, layout.block_size, layout.context_start[blocks], layout.anchor[blocks],
                torch.cat([self.context_positions, self.block_positions[blocks].flatten()]),
            ),
        )

    def to(self, device: torch.device) -> Batch:
        """On `device`, the states in bf16: fp8 crosses PCIe at half the bytes of bf16 and is
        dequantized on the device (one multiply per element, where the CPU would spend a core)."""
        moved = self._map(lambda t: t.to(device, non_blocking=True))
        if moved.context_scale is not None:
            C, L = moved.context_scale.shape
            moved.context_hidden = dequantize_fp8(moved.context_hidden.view(C, L, -1), moved.context_scale).view(C, -1)  # [C, L, d] -> [C, L*d]
            moved.context_scale = None
        if moved.final_scale is not None:
            moved.final_hidden = dequantize_fp8(moved.final_hidden, moved.final_scale)  # [C, d]
            moved.final_scale = None
        return moved

    def _map(self, fn) -> Batch:
        layout = self.layout

        def optional(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        return Batch(
            optional(self.context_hidden), fn(self.context_positions), fn(self.block_ids), fn(self.block_positions),
            fn(self.labels), fn(self.loss_weights),
            BlockLayout(layout.num_context, layout.block_size, fn(layout.context_start), fn(layout.anchor), fn(layout.key_positions)),
            self.documents, optional(self.context_scale), optional(self.final_hidden), optional(self.final_scale),
            None if self.target_input is None else self.target_input.map(fn),
        )


class BatchBuilder:
    """Turns a micro-batch plan entry into tensors: samples anchors, lays out the blocks, and gives
    the documents their context through `context`: stored states read straight into the batch
    (StoredContext, the default: several documents at once with `readers`, with `final_hidden` the
    target's final hidden state beside them), or the target's input to make them online (TargetContext)."""

    def __init__(
        self, *, layout: AnchorLayout, anchors: int, mask_token_id: int, seed: int, layers: list[int], final_hidden: bool = False,
        context: Context | None = None,
    ) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.anchors = anchors
        self.mask_token_id = mask_token_id
        self.seed = seed
        self.layers = layers
        self.context = context if context is not None else StoredContext(final_hidden=final_hidden)
        self.decay = np.array(layout.slot_decay())

    def build(self, documents: MicroBatch, chunks: Mapping[int, ChunkData | TokenChunkData], epoch: int, *,
              pin_memory: bool = False, readers: ThreadPoolExecutor | None = None) -> Batch:
        B = self.block_size
        slots = np.arange(B)
        spans: list[Span] = []
        positions, ids, block_pos, labels, weights, starts, anchors = [], [], [], [], [], [], []
        offset = 0
        for doc in documents:
            chunk = chunks[doc.chunk]
            begin, end = (int(x) for x in chunk.tokens.cu_seqlens[doc.index : doc.index + 2])
            input_ids, loss_mask = chunk.tokens.input_ids[begin:end].astype(np.int64), chunk.tokens.loss_mask[begin:end]
            T = end - begin
            spans.append(Span(chunk, begin, end, offset, doc.sample_id))
            positions.append(np.arange(T))
            a = sample_anchors(loss_mask, self.anchors, seed=self.seed, epoch=epoch, sample_id=doc.sample_id)
            slot_positions = a[:, None] + slots[None, :]  # [n, B]
            label_positions = slot_positions + self.layout.label_offset
            inside = label_positions < T
            clipped = np.minimum(label_positions, T - 1)
            block = np.full((len(a), B), self.mask_token_id, dtype=np.int64)
            block[:, 0] = input_ids[a]
            ids.append(block)
            block_pos.append(slot_positions)
            labels.append(np.where(inside, input_ids[clipped], 0))
            supervised = np.where(inside, loss_mask[clipped], 0)
            if self.layout.contiguous_prefix:  # a slot counts only while every drafted slot before it is supervised
                supervised[:, self.layout.first_draft :] = np.cumprod(supervised[:, self.layout.first_draft :], axis=1)
            weights.append(supervised * self.decay[None, :])
            starts.append(np.full(len(a), offset))
            anchors.append(offset + a)
            offset += T
        context = self.context.read(spans, offset, pin_memory=pin_memory, readers=readers)
        context_positions = torch.from_numpy(np.concatenate(positions))
        block_positions = torch.from_numpy(np.concatenate(block_pos))
        layout = BlockLayout(
            num_context=offset, block_size=B,
            context_start=torch.from_numpy(np.concatenate(starts)),
            anchor=torch.from_numpy(np.concatenate(anchors)),
            key_positions=torch.cat([context_positions, block_positions.flatten()]),
        )
        batch = Batch(
            context_positions=context_positions,
            block_ids=torch.from_numpy(np.concatenate(ids)),
            block_positions=block_positions,
            labels=torch.from_numpy(np.concatenate(labels)),
            loss_weights=torch.from_numpy(np.concatenate(weights).astype(np.float32)),
            layout=layout,
            documents=len(documents),
            **context,
        )
        return batch.pin_memory() if pin_memory else batch  # the small tensors; the states are pinned already


@dataclass(frozen=True, slots=True)
class Span:
    """One document of a micro-batch: tokens [begin, end) of `chunk`, at row `at` of the batch's context."""

    chunk: ChunkData | TokenChunkData
    begin: int
    end: int
    at: int
    sample_id: int


class Context(Protocol):
    """How a micro-batch's documents get their context states: the Batch fields it fills."""

    def read(self, spans: list[Span], tokens: int, *, pin_memory: bool, readers: ThreadPoolExecutor | None) -> dict[str, Any]: ...


class StoredContext:
    """The stored states (and with `final_hidden` the final hidden state) of each document's rows,
    read straight into the batch's (pinned) buffers."""

    def __init__(self, *, final_hidden: bool = False) -> None:
        self.final_hidden = final_hidden

    def read(self, spans: list[Span], tokens: int, *, pin_memory: bool, readers: ThreadPoolExecutor | None) -> dict[str, Any]:
        first = spans[0].chunk
        for span in spans:
            if span.chunk.dtype != first.dtype:
                raise FormatError(f"{span.chunk.name} holds {span.chunk.dtype} states, {first.name} {first.dtype}",
                                  "Re-run extraction with one extract.dtype, then verify")
        hidden = torch.empty((tokens, first.num_layers * first.hidden_size), dtype=first.torch_dtype, pin_memory=pin_memory)
        scale = torch.empty((tokens, first.num_layers), dtype=torch.float32, pin_memory=pin_memory) if first.quantized else None
        final, final_scale = final_buffers([span.chunk for span in spans], tokens, pin_memory=pin_memory) if self.final_hidden else (None, None)

        def read(span: Span) -> None:
            rows = slice(span.at, span.at + span.end - span.begin)
            span.chunk.read_states(span.begin, span.end, hidden[rows])
            if scale is not None:
                span.chunk.read_scales(span.begin, span.end, scale[rows])
            if final is not None:
                span.chunk.read_final(span.begin, span.end, final[rows])
            if final_scale is not None:
                span.chunk.read_final_scales(span.begin, span.end, final_scale[rows])

        for _ in (readers.map(read, spans) if readers is not None else map(read, spans)):
            pass
        return {"context_hidden": hidden, "context_scale": scale, "final_hidden": final, "final_scale": final_scale}


@dataclass
class TargetInput:
    """A micro-batch's context as the target's input (online states): its tokens, and the target's
    rows that make their states (capture/batching.py), each with the context rows its real tokens fill."""

    ids: torch.Tensor  # int64 [C]: the context tokens, documents in the batch's order
    lengths: torch.Tensor  # int64 [documents]
    sample_ids: list[int]
    rows: list[tuple[TargetBatch, slice | torch.Tensor]]

    def map(self, fn) -> TargetInput:
        return TargetInput(fn(self.ids), fn(self.lengths), self.sample_ids,
                           [(batch.map(fn), rows if isinstance(rows, slice) else fn(rows)) for batch, rows in self.rows])


class TargetContext:
    """Lays the documents into the target's rows (`planner`, as extraction lays a window's samples),
    so the training step can run the target on them (train/online.py)."""

    def __init__(self, planner: BatchPlanner) -> None:
        self.planner = planner

    def read(self, spans: list[Span], tokens: int, *, pin_memory: bool, readers: ThreadPoolExecutor | None) -> dict[str, Any]:
        pieces = [span.chunk.tokens for span in spans]
        samples = [SampleRef(slot, 0, span.begin, span.end - span.begin) for slot, span in enumerate(spans)]
        rows = []
        for group in self.planner.plan(samples):
            batch = self.planner.build(group, pieces)
            targets = [np.arange(spans[s.slot].at, spans[s.slot].at + s.length) for s in group]
            flat = np.concatenate(targets)
            contiguous = bool(np.all(np.diff(flat) == 1))
            rows.append((batch, slice(int(flat[0]), int(flat[-1]) + 1) if contiguous else torch.from_numpy(flat)))
        ids = np.concatenate([span.chunk.tokens.input_ids[span.begin : span.end] for span in spans]).astype(np.int64)
        lengths = np.array([span.end - span.begin for span in spans], dtype=np.int64)
        return {"context_hidden": None,
                "target_input": TargetInput(torch.from_numpy(ids), torch.from_numpy(lengths), [span.sample_id for span in spans], rows)}


def final_buffers(chunks: list[ChunkData], tokens: int, *, pin_memory: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Room for `tokens` rows of the final hidden state of `chunks` (which must all hold it, in one
    dtype): the states [tokens, d], and their scales [tokens] when fp8."""
    first = chunks[0]
    for chunk in chunks:
        if chunk.final_hidden is None:
            raise FormatError(f"{chunk.name} holds no final hidden state of the target, which this drafter reads",
                              "Re-run extraction with extract.final_hidden: true, then verify")
        if chunk.final_hidden != first.final_hidden:
            raise FormatError(f"{chunk.name} holds its final hidden state in {chunk.final_hidden}, {first.name} in {first.final_hidden}",
                              "Re-run extraction with one extract.dtype, then verify")
    fp8 = first.final_hidden == "float8_e4m3fn"
    states = torch.empty((tokens, first.hidden_size), dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, pin_memory=pin_memory)
    return states, torch.empty(tokens, dtype=torch.float32, pin_memory=pin_memory) if fp8 else None


class BatchStream:
    """This rank's micro-batches over all epochs, from a cursor (epoch, step): Stateful, so the
    checkpointer restores the exact position. Iterating yields (epoch, step, Batch).

    A producer thread opens upcoming chunks (`prefetch_chunks` beyond the current batch's, in the
    order the plan needs them, across chunk and epoch boundaries) and builds `prefetch_batches`
    batches ahead, reading each document's rows straight into the batch with `read_threads` threads.
    close() stops it and waits for it: a process must never tear down under a thread running torch
    code (it dies by SIGABRT, not with its own exit code).

    Host memory is bounded: at most the chunks of the batch being built plus `prefetch_chunks` are
    open at once, each held whole in memory while it is streamed or first fetched (3.4 GB in bf16 at
    the 27B shape: with a batch's one or two chunks and 2 read ahead, 10-13 GB), one on the cache's
    disk costing nothing; plus `prefetch_batches` + 1 built batches (0.8 GB each for 16K tokens).
    A chunk that cannot be read fails the stream with its error when the batch that needs it is due.
    Opening a chunk holds the GIL only briefly (ChunkCache), so reading ahead does not slow the
    training thread's launches."""

    def __init__(
        self, plans: list[list[MicroBatch]], cache: ChunkCache | TokenChunks, builder: BatchBuilder,
        *, prefetch_batches: int = 2, prefetch_chunks: int = 2, read_threads: int = 4, pin_memory: bool = False,
    ) -> None:
        self.plans = plans  # per epoch: this rank's micro-batches
        self.cache = cache
        self.builder = builder
        self.prefetch_batches = prefetch_batches
        self.prefetch_chunks = prefetch_chunks
        self.read_threads = read_threads
        self.pin_memory = pin_memory
        self.epoch, self.step = 0, 0
        self.wait_s = 0.0
        """Seconds the consumer spent waiting for a batch (the training loop starved by the loader)."""
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
            waited = time.perf_counter()
            item = ready.get()
            self.wait_s += time.perf_counter() - waited
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
        self.cache.close()
        if self._thread is not None:
            self._thread.join()

    def _upcoming(self, batches: list[list[int]], i: int) -> list[int]:
        """The chunks batch i reads, then the next `prefetch_chunks` other chunks the plan reads."""
        wanted = list(batches[i])
        for later in batches[i + 1 :]:
            if len(wanted) >= len(batches[i]) + self.prefetch_chunks:
                break
            wanted += [chunk for chunk in later if chunk not in wanted]
        return wanted[: len(batches[i]) + self.prefetch_chunks]

    def _produce(self, ready: queue.Queue) -> None:
        upcoming = list(self.positions())
        batches = [list(dict.fromkeys(doc.chunk for doc in self.plans[e][s])) for e, s in upcoming]
        opened: dict[int, Future] = {}
        with ThreadPoolExecutor(max(1, self.prefetch_chunks), thread_name_prefix="chunk") as fetch, \
                ThreadPoolExecutor(self.read_threads, thread_name_prefix="rows") as readers:
            try:
                for i, (epoch, step) in enumerate(upcoming):
                    if self._stop.is_set():
                        break
                    wanted = self._upcoming(batches, i)
                    for chunk in [c for c in opened if c not in wanted]:
                        opened.pop(chunk).add_done_callback(_close_chunk)
                    for chunk in wanted:
                        if chunk not in opened:
                            opened[chunk] = fetch.submit(self.cache.open, chunk)
                    chunks = {chunk: opened[chunk].result() for chunk in batches[i]}
                    batch = self.builder.build(self.plans[epoch][step], chunks, epoch, pin_memory=self.pin_memory, readers=readers)
                    if not self._hand_over(ready, (epoch, step, batch)):
                        break
                else:
                    self._hand_over(ready, None)
            except BaseException as exc:  # re-raised in the training thread
                if not self._stop.is_set():
                    self._hand_over(ready, exc)
            finally:
                for pending in opened.values():
                    pending.cancel()
                    pending.add_done_callback(_close_chunk)

    def _hand_over(self, ready: queue.Queue, item) -> bool:
        """Puts `item` for the training thread; False once close() was called (nobody takes it)."""
        while not self._stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False


def _close_chunk(opened: Future) -> None:
    if not opened.cancelled() and opened.exception() is None:
        opened.result().close()
