"""The extraction loop of one shard: windows of chunks -> batches -> forward + capture -> writer.

    for each window of `sort_window` pending chunks (loaded and planned one window ahead):
        for each batch: forward with hooks -> async copies into the chunks' host buffers
        each chunk whose samples are all copied -> writer: integrity -> store -> done marker

The GPU thread never waits on a copy or an upload; it blocks when every chunk buffer is in use
(the back-pressure of a writer that cannot keep up; the time is reported as host_wait_s) and, at
a window's start, on its token chunks if the one-window-ahead read has not finished. After the last
batch it waits for the stores still running (the drain, drain_s): each is logged with what it had
left to write then and when it got through (drain_stores).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from dflash_jobs.devices import pick_device
from dflash_jobs.errors import FormatError, InputError
from dflash_jobs.capture.batching import Batch, BatchPlanner, window_samples
from dflash_jobs.capture.runner import TargetCapture, open_target
from dflash_jobs.capture.target import CaptureTarget
from dflash_jobs.extract.transfer import BufferPool, DeviceToHost, Run, merge_runs
from dflash_jobs.extract.progress import Progress, Summary
from dflash_jobs.extract.sharding import shard_chunks
from dflash_jobs.extract.writer import WRITER_THREADS, ChunkAssembly, ChunkMetadata, ChunkWriter
from dflash_jobs.formats import (
    DATASET_KEY, DONE_MARKERS, ChunkInfo, DatasetIndex, DoneMarker, TokenChunk, done_key, hidden_chunk_key, token_chunk_key,
)
from dflash_jobs.spec import ExtractSpec, RunSpec
from dflash_jobs.storage import ObjectNotFound, Storage, storage_for

log = logging.getLogger("dflash.extract")


# ---- which chunks still need work -----------------------------------------------------------------


def chunk_is_done(storage: Storage, chunk: ChunkInfo, expected: ChunkMetadata) -> bool:
    """The marker exists, describes this chunk as this run extracts it (samples, tokens, layers,
    dtype, compute dtype, hidden size, and the final hidden state when the run stores it: a chunk
    that holds one the run does not ask for is kept), and its object matches it (size, and etag when
    both have one).

    A stale marker (its object missing or different, or from other settings) is deleted, so the
    redone chunk can commit; verify would reject it otherwise, one round later."""
    key = done_key(chunk.id)
    try:
        marker = DoneMarker.from_json(storage.get_bytes(key), key)
    except FormatError:
        marker = None
    if marker is not None and (marker.samples, marker.tokens, marker.layers, marker.dtype, marker.hidden_size, marker.compute_dtype) == (
        chunk.samples, chunk.tokens, expected.layers, expected.dtype, expected.hidden_size, expected.compute_dtype
    ) and expected.final_hidden in (None, marker.final_hidden):
        info = storage.stat(hidden_chunk_key(chunk.id))
        if info is not None and info.size == marker.bytes and (info.etag is None or marker.etag is None or info.etag == marker.etag):
            return True
    log.warning("chunk %06d: done marker does not match its object or this run's settings; redoing the chunk", chunk.id)
    storage.delete(key)
    return False


def pending_chunks(storage: Storage, chunks: Sequence[ChunkInfo], expected: ChunkMetadata) -> list[ChunkInfo]:
    """The chunks without a valid done marker. A chunk object without a marker is redone (the marker commits)."""
    marked = set(storage.list(DONE_MARKERS))
    return [c for c in chunks if done_key(c.id) not in marked or not chunk_is_done(storage, c, expected)]


# ---- windows: chunks loaded and planned together ----------------------------------------------------


@dataclass(slots=True)
class Window:
    chunks: list[ChunkInfo]
    tokens: list[TokenChunk]
    batches: list[Batch]
    """Built on the loader thread, pinned for a GPU: the GPU thread only launches work."""
    open: dict[int, ChunkAssembly] = field(default_factory=dict)
    """The window's chunks that hold a buffer, by position in the window: taken at the first sample."""

    def assembly(self, slot: int, writer: ChunkWriter) -> ChunkAssembly:
        if slot not in self.open:
            self.open[slot] = writer.open(self.chunks[slot], self.tokens[slot])
        return self.open[slot]


def load_window(storage: Storage, chunks: Sequence[ChunkInfo], planner: BatchPlanner, *, pin: bool = False) -> Window:
    tokens = [TokenChunk.decode(storage.get_bytes(token_chunk_key(c.id)), token_chunk_key(c.id)) for c in chunks]
    for info, chunk in zip(chunks, tokens):
        if chunk.num_samples != info.samples or chunk.num_tokens != info.tokens:
            raise InputError(
                f"{token_chunk_key(info.id)} holds {chunk.num_samples} samples / {chunk.num_tokens} tokens, "
                f"tokens/dataset.json says {info.samples} / {info.tokens}", "Re-run prepare",
            )
    batches = [planner.build(samples, tokens) for samples in planner.plan(window_samples(tokens))]
    return Window(list(chunks), tokens, [batch.pin_memory() for batch in batches] if pin else batches)


def iter_windows(
    storage: Storage, chunks: Sequence[ChunkInfo], planner: BatchPlanner, size: int, *, pin: bool = False,
) -> Iterator[Window]:
    """Windows of `size` chunks; the next one is read, planned and built while the current one runs."""
    groups = [chunks[i:i + size] for i in range(0, len(chunks), size)]
    with ThreadPoolExecutor(1, thread_name_prefix="window-loader") as pool:
        future = pool.submit(load_window, storage, groups[0], planner, pin=pin) if groups else None
        for index in range(len(groups)):
            window = future.result()
            if index + 1 < len(groups):
                future = pool.submit(load_window, storage, groups[index + 1], planner, pin=pin)
            yield window


# ---- running batches --------------------------------------------------------------------------


class ExtractWorker:
    """Extracts the hidden states of one shard's chunks: the target's capture (capture/runner.py),
    its buffers copied to host memory (transfer.py) and stored by the writer (writer.py)."""

    def __init__(
        self,
        spec: ExtractSpec,
        *,
        target: CaptureTarget,
        storage: Storage,
        chunks: Sequence[ChunkInfo],
        summary: Summary,
        max_length: int,
        packed: bool,
        log_interval: float = 10.0,
        started: float | None = None,
    ) -> None:
        self.spec = spec
        self.target = target
        self.storage = storage
        self.chunks = list(chunks)
        self.summary = summary
        self.device = target.device
        self.started = time.monotonic() if started is None else started  # the pod's start, for ready_s
        self.capture = TargetCapture(target, spec, packed=packed, max_length=max_length)
        self.planner = self.capture.planner
        self.transfer = DeviceToHost(self.capture.hooks, storage_dtype=spec.dtype)
        # A window's chunks can all be open at once (padded batches mix them), plus those being stored.
        self.pool = BufferPool(
            size=spec.sort_window + WRITER_THREADS, capacity=max((c.tokens for c in self.chunks), default=1),
            layers=len(target.layers), hidden_size=target.hidden_size, dtype=self.transfer.state_dtype,
            pinned=self.device.type == "cuda", final_hidden=target.final_hidden,
        )
        self.metadata = ChunkMetadata(
            layers=target.layers, hidden_size=target.hidden_size, model=target.name,
            config_hash=target.config_hash, dtype=spec.dtype, shard=summary.shard, compute_dtype=spec.compute_dtype,
            final_hidden=spec.dtype if target.final_hidden else None,
        )
        self.log_interval = log_interval
        self.progress: Progress | None = None
        self.writer: ChunkWriter | None = None
        self.drain_stores: list[dict] = []
        """The stores that ended after the GPU's last batch, each on the clock from it (ChunkWriter.tail)."""

    def warm_up(self) -> float:
        return self.capture.warm_up()

    @torch.inference_mode()
    def run(self) -> Summary:
        summary = self.summary
        summary.chunks_total = len(self.chunks)
        pending = pending_chunks(self.storage, self.chunks, self.metadata)
        summary.chunks_skipped = len(self.chunks) - len(pending)
        log.info("shard %d/%d: %d chunks, %d already done, %d to extract (%s tokens)",
                 summary.shard, summary.shards, len(self.chunks), summary.chunks_skipped, len(pending),
                 f"{sum(c.tokens for c in pending):,}")
        if not pending:
            return summary
        self.pool.start(len(pending))
        log.info("host buffers: %d of %.2f GB%s, allocated while the kernels warm up", min(len(pending), self.pool.size),
                 self.pool.buffer_bytes / 1e9, " pinned" if self.pool.pinned else "")
        summary.warmup_s = round(self.warm_up(), 1)
        self.progress = Progress(summary, total_tokens=sum(c.tokens for c in pending), interval=self.log_interval)
        # Packed batches take a window's samples in order, so the last chunk's rows fill from the first:
        # it is stored while they do, and the end waits only for its last batch's rows (the drain).
        self.writer = ChunkWriter(storage=self.storage, metadata=self.metadata, pool=self.pool, on_commit=self._committed,
                                  streamed=pending[-1].id if self.planner.packed else None)
        self.progress.start()
        try:
            for window in iter_windows(self.storage, pending, self.planner, self.spec.sort_window, pin=self.device.type == "cuda"):
                for batch in window.batches:
                    self.run_batch(batch, window)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            forwarded = time.monotonic()
            self.writer.close()
            summary.drain_s = round(time.monotonic() - forwarded, 1)
            self.drain_stores = self.writer.tail()
            summary.drain_bytes = sum(store["bytes_left_at_end"] for store in self.drain_stores)
            log_drain(self.drain_stores)
        except BaseException:
            self.writer.drain()  # nothing is mid-store when the error ends the process
            raise
        finally:
            summary.host_wait_s = round(self.writer.waited_s, 1)
        self.progress.log()
        return summary

    def _committed(self, marker: DoneMarker) -> None:
        self.progress.committed(marker.samples, marker.tokens, marker.bytes)
        if not self.summary.first_chunk_s:
            self.summary.first_chunk_s = round(time.monotonic() - self.started, 1)

    def run_batch(self, batch: Batch, window: Window) -> None:
        """Forward + capture of one batch; a batch that runs out of memory is halved and retried."""
        try:
            self._forward(batch, window)
        except torch.OutOfMemoryError:
            halves = self.planner.split(batch, window.tokens)
            if not halves:
                sample = batch.samples[0]
                raise InputError(
                    f"sample {window.tokens[sample.slot].sample_ids[sample.index]} of chunk {window.chunks[sample.slot].id:06d} "
                    f"({sample.length} tokens) does not fit in GPU memory even alone",
                    "Lower data.max_length and re-run prepare, or use GPUs with more memory",
                ) from None
            self.summary.oom_splits += 1
            log.warning("batch of %d samples (%s tokens) ran out of GPU memory: split in two", len(batch.samples), batch.padded_tokens)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            for half in halves:
                self.run_batch(half, window)

    def _forward(self, batch: Batch, window: Window) -> None:
        on_device = batch.to(self.device)
        self.capture.forward(on_device)
        if not self.summary.ready_s:
            self.summary.ready_s = round(time.monotonic() - self.started, 1)
        # While the forward runs: where each sample's rows go (a chunk takes its buffer here, which can wait).
        runs, offset = [], 0
        for sample in batch.samples:
            assembly = window.assembly(sample.slot, self.writer)
            runs.append(Run(assembly.buffer, offset, assembly.rows(sample.index)[0], sample.length))
            offset += sample.length
        copied = self.transfer.launch(merge_runs(runs), on_device.input_ids, on_device.real_index)
        for sample in batch.samples:
            assembly = window.open[sample.slot]
            assembly.placed(sample.index, copied)
            if assembly.remaining == 0:
                self.writer.submit(assembly)
        self.progress.batch(batch.real_tokens, batch.padded_tokens)

    def close(self) -> None:
        self.capture.close()


# ---- wiring -------------------------------------------------------------------------------------


def build_worker(spec: RunSpec, shard: int, *, summary: Summary, started: float | None = None) -> ExtractWorker:
    """Everything shard `shard` needs: its chunks, the target on its device, the output storage."""
    storage = storage_for(spec)
    try:
        index = DatasetIndex.from_json(storage.get_bytes(DATASET_KEY), DATASET_KEY)
    except ObjectNotFound:
        raise InputError(f"{storage.url}/{DATASET_KEY} does not exist", "Run `dflashctl prepare` first") from None
    chunks = shard_chunks(index.chunks, spec.extract.shards, shard)
    opened = open_target(spec, pick_device(spec), final_hidden=spec.stores_final_hidden)
    summary.fast_paths = opened.fast.as_dict()
    return ExtractWorker(
        spec.extract, target=opened.target, storage=storage, chunks=chunks, summary=summary,
        max_length=spec.data.max_length, packed=opened.packed, started=started,
    )


def log_drain(stores: list[dict]) -> None:
    """A line per store the end waited for (ChunkWriter.tail): where the time after the GPU's last batch went."""
    for store in stores:
        log.info("drain: chunk %06d%s, %s of its %s bytes left at the last batch; its last byte handed over at +%s s, "
                 "stored at +%s s, committed at +%s s", store["chunk"], " (streamed)" if store["streamed"] else "",
                 f"{store['bytes_left_at_end']:,}", f"{store['bytes']:,}", store["last_byte_s"], store["stored_s"], store["committed_s"])
