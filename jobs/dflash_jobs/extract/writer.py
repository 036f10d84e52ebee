"""Host side of the pipeline: chunks filled in place by the GPU's copies, then stored by writer threads.

    GPU thread --(copies into a chunk's pinned buffer)--> complete chunk --> writer threads --> storage
                  bounded buffer pool                                        (hash while writing)

A chunk takes a buffer from the pool when its first sample is captured and gives it back once it
is stored: the pool bounds host memory, and a store that cannot keep up blocks the GPU thread
instead of growing it (the time blocked is reported). A writer streams the chunk to storage
straight from its buffer in file order, each tensor the copies fill as far as its leading rows'
copies have completed (the local store writes each byte once, S3 gets a multipart upload from
memory; both hash as they go), checks the whole chunk before the store completes, then creates
its done marker: the marker is the commit point, so a chunk is visible only complete.

A chunk is handed to a writer once complete, except the shard's last one when batches take its
samples in order (packed): that one from its first sample, so its bytes are written and hashed
while the forwards that fill it run, and what is left after the last forward (the drain) is only
the rows of the last batch, not the whole chunk (about 3 GB at the 27B shape).
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from dflash_jobs.errors import DflashError, IntegrityError, StorageError
from dflash_jobs.extract import integrity
from dflash_jobs.extract.transfer import BufferPool, ChunkBuffer
from dflash_jobs.formats import (
    ChunkInfo, DoneMarker, TokenChunk, done_key, hidden_chunk_key, hidden_metadata, hidden_tensors, safetensors_names, safetensors_parts,
)
from dflash_jobs.storage import Storage

POLL_S = 1.0
WRITER_THREADS = 2
"""Chunks stored at once: one can hash and write while the other waits on storage."""
FILLED_BY_COPIES = ("hidden_states", "hidden_states_scale", "final_hidden_states", "final_hidden_states_scale")
"""The tensors of a chunk the GPU's copies fill, row by row; the others come from its token chunk."""
KILL_BEFORE_MARKER_ENV = "DFLASH_TEST_KILL_BEFORE_MARKER"
"""Fault injection for the restart test: SIGKILL this process once chunk N is stored, before its marker."""


@dataclass(frozen=True, slots=True)
class ChunkMetadata:
    """What every chunk of the run carries besides its states."""

    layers: list[int]
    hidden_size: int
    model: str
    config_hash: str
    dtype: str
    shard: int
    compute_dtype: str = "bfloat16"
    final_hidden: str | None = None
    """The dtype of the target's final hidden state stored beside the layers; None: not stored."""


class ChunkAbandoned(DflashError):
    """The writer was stopped while a chunk it streams still waited for samples (the GPU thread failed)."""


@dataclass(slots=True)
class StoreTimes:
    """One chunk's store on the clock (time.monotonic()): what the time after the GPU's last batch,
    the drain, is made of."""

    chunk: int
    streamed: bool
    queued: float
    """Handed to the writer threads: the streamed chunk at its first sample, any other once complete."""
    size: int = 0
    started: float | None = None
    handed: int = 0
    """The file's bytes handed to the store so far."""
    last_byte: float | None = None
    stored: float | None = None
    """The store returned: the object whole, synced, in place."""
    committed: float | None = None
    """Its done marker written."""
    handed_at_end: int | None = None
    """`handed` when the GPU's last batch was done (ChunkWriter.close), of a store not yet through then."""

    def since(self, end: float) -> dict[str, int | float | bool | None]:
        """This store's figures, each time in seconds from `end` (negative: before it)."""
        def at(when: float | None) -> float | None:
            return None if when is None else round(when - end, 3)

        left = 0 if self.handed_at_end is None else self.size - self.handed_at_end
        return {"chunk": self.chunk, "streamed": self.streamed, "bytes": self.size, "bytes_left_at_end": left,
                "queued_s": at(self.queued), "started_s": at(self.started), "last_byte_s": at(self.last_byte),
                "stored_s": at(self.stored), "committed_s": at(self.committed)}


class ChunkAssembly:
    """One chunk's states, written in place by the GPU's copies, sample by sample."""

    def __init__(self, info: ChunkInfo, tokens: TokenChunk, buffer: ChunkBuffer) -> None:
        self.info = info
        self.tokens = tokens
        self.buffer = buffer
        self.written = np.zeros(tokens.num_samples, dtype=bool)
        self.remaining = tokens.num_samples
        self.copied: torch.cuda.Event | None = None  # recorded after the last copy into this chunk
        self.leading = 0
        """Samples 0..leading-1 all have their copies queued: their rows end where the writer may go once `copied` completes."""
        self._placing = threading.Condition()

    def rows(self, index: int) -> tuple[int, int]:
        return int(self.tokens.cu_seqlens[index]), int(self.tokens.cu_seqlens[index + 1])

    def placed(self, index: int, event: torch.cuda.Event | None) -> None:
        """Sample `index` has its copy queued (done once `event` completes)."""
        if self.written[index]:
            raise IntegrityError(f"chunk {self.info.id:06d}: sample {self.tokens.sample_ids[index]} captured twice", integrity.FIX)
        with self._placing:
            self.written[index] = True
            self.remaining -= 1
            self.copied = event  # one copy stream: this event also marks the end of every earlier copy
            while self.leading < len(self.written) and self.written[self.leading]:
                self.leading += 1
            self._placing.notify_all()

    def final_rows(self, beyond: int, stopped: Callable[[], bool]) -> int:
        """How many leading rows hold their final states, once more than `beyond` do: waits for the
        GPU thread to queue their copies, then for the copies. Raises ChunkAbandoned if `stopped()`
        says no more samples will come."""
        with self._placing:
            while (rows := int(self.tokens.cu_seqlens[self.leading])) <= beyond:
                if stopped():
                    raise ChunkAbandoned(f"chunk {self.info.id:06d}: the extraction stopped with {self.remaining} of its samples not captured")
                self._placing.wait(POLL_S)
            copied = self.copied
        if copied is not None:
            copied.synchronize()
        return rows

    def file_bytes(self, names: list[str], parts: list[memoryview], stopped: Callable[[], bool]) -> Iterator[memoryview]:
        """The chunk's file in order (`parts`: its header, then the tensors `names` in file order) as it
        becomes final: a tensor the copies fill as far as its leading rows are (final_rows)."""
        total = self.tokens.num_tokens
        for name, part in zip([None, *names], parts, strict=True):
            if name not in FILLED_BY_COPIES:
                yield part
                continue
            row = len(part) // total if total else 0
            done = 0
            while done < total:
                rows = self.final_rows(done, stopped)
                yield part[done * row : rows * row]
                done = rows

    def view(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor[: self.tokens.num_tokens]


_DONE = object()


class ChunkWriter:
    def __init__(
        self,
        *,
        storage: Storage,
        metadata: ChunkMetadata,
        pool: BufferPool,
        on_commit: Callable[[DoneMarker], None] = lambda marker: None,
        streamed: int | None = None,
    ) -> None:
        """streamed: the chunk handed to a writer at its first sample, stored as its rows fill (the
        shard's last, when batches take its samples in order); every other one once complete."""
        self.storage = storage
        self.metadata = metadata
        self.pool = pool
        self.on_commit = on_commit
        self.to_store: queue.Queue = queue.Queue()  # bounded by the pool: a queued chunk holds a buffer
        self.streamed = streamed
        self._stopping = threading.Event()
        self.error: BaseException | None = None
        self.waited_s = 0.0  # how long the GPU thread waited for a free buffer
        self.stores: dict[int, StoreTimes] = {}
        self.closed: float | None = None
        self.kill_before_marker = os.environ.get(KILL_BEFORE_MARKER_ENV)
        self.threads = [
            threading.Thread(target=self._guard, name=f"chunk-writer-{i}", daemon=True) for i in range(WRITER_THREADS)
        ]
        for thread in self.threads:
            thread.start()

    # ---- GPU thread side ----

    def open(self, info: ChunkInfo, tokens: TokenChunk) -> ChunkAssembly:
        """A chunk with a buffer of its own; blocks while every buffer is held (back-pressure)."""
        if tokens.num_tokens > self.pool.capacity:
            raise ValueError(f"chunk {info.id:06d} holds {tokens.num_tokens} tokens, the buffers {self.pool.capacity}")
        started = time.monotonic()
        while True:
            self.check()
            try:
                buffer = self.pool.take(POLL_S)
                break
            except queue.Empty:
                continue
        self.waited_s += time.monotonic() - started
        assembly = ChunkAssembly(info, tokens, buffer)
        if info.id == self.streamed:
            self._queue(assembly)
        return assembly

    def submit(self, assembly: ChunkAssembly) -> None:
        """Hands over a chunk whose every sample has its copy queued (the streamed one is already)."""
        self.check()
        if assembly.info.id != self.streamed:
            self._queue(assembly)

    def _queue(self, assembly: ChunkAssembly) -> None:
        self.stores[assembly.info.id] = StoreTimes(assembly.info.id, assembly.info.id == self.streamed, time.monotonic())
        self.to_store.put(assembly)

    def check(self) -> None:
        """Re-raises, in the caller's thread, the first error of a writer thread."""
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Stores everything submitted, then stops the threads; raises their first error. Called when
        the GPU's last batch is done: what each store then had left to write is noted (StoreTimes)."""
        self.closed = time.monotonic()
        for times in self.stores.values():
            if times.stored is None:
                times.handed_at_end = times.handed
        self.drain()
        self.check()

    def tail(self) -> list[dict]:
        """The stores that ended after close() was called (the GPU's last batch done), in the order they
        were queued, each on the clock from that call: the drain's parts."""
        end = self.closed
        if end is None:
            return []
        return [times.since(end) for times in self.stores.values() if times.committed is None or times.committed > end]

    def drain(self) -> None:
        """Stores everything submitted, then stops the threads, raising nothing: also what the GPU
        thread does when it fails. Each chunk ends whole (it is complete: every copy was queued) or
        cleans up after itself (the local temporary file removed, the S3 multipart upload aborted);
        left running, the daemon threads would die with the process mid-store and leave both behind.
        A streamed chunk still missing samples then can never complete: its store is aborted."""
        self._stopping.set()
        for _ in self.threads:
            self.to_store.put(_DONE)
        for thread in self.threads:
            while thread.is_alive():
                thread.join(POLL_S)

    # ---- writer threads ----

    def _guard(self) -> None:
        try:
            while self.error is None:
                try:
                    assembly = self.to_store.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if assembly is _DONE:
                    return
                self._store(assembly)
                self.pool.give_back(assembly.buffer)
        except BaseException as exc:  # handed to the GPU thread, which stops the pod with it
            if self.error is None:
                self.error = exc

    def _store(self, assembly: ChunkAssembly) -> None:
        chunk, meta, buffer = assembly.info.id, self.metadata, assembly.buffer
        layers, final, view = buffer.layers, buffer.final, assembly.view
        tensors = hidden_tensors(assembly.tokens, view(layers.states), view(layers.scale), view(final and final.states), view(final and final.scale))
        parts = safetensors_parts(tensors, hidden_metadata(layers=meta.layers, model=meta.model, config_hash=meta.config_hash, dtype=meta.dtype,
                                                           compute_dtype=meta.compute_dtype, final_hidden=meta.final_hidden))
        size = sum(len(p) for p in parts)
        integrity.check_encoded(chunk, bytes(parts[0]), size, assembly.tokens, meta.layers, meta.final_hidden)
        stats: dict[str, float] = {}
        times = self.stores[chunk]
        times.size, times.started = size, time.monotonic()

        def checked() -> Iterator[memoryview]:
            """The file as it becomes final, then the whole chunk checked: a bad one aborts the store, never visible."""
            for piece in assembly.file_bytes(safetensors_names(tensors), parts, self._stopping.is_set):
                times.handed += piece.nbytes
                yield piece
            times.last_byte = time.monotonic()
            stats.update(integrity.check_assembled(
                chunk, assembly.tokens, view(buffer.ids), view(layers.absmax), assembly.written, view(final and final.absmax),
            ))

        put = self.storage.put_parts(hidden_chunk_key(chunk), checked(), size)
        times.stored = time.monotonic()
        if self.kill_before_marker == str(chunk):
            os.kill(os.getpid(), signal.SIGKILL)
        marker = DoneMarker(
            chunk=chunk, samples=assembly.tokens.num_samples, tokens=assembly.tokens.num_tokens,
            bytes=put.size, sha256=put.sha256, etag=put.etag, dtype=meta.dtype, layers=list(meta.layers),
            hidden_size=meta.hidden_size, shard=meta.shard, stats=stats, compute_dtype=meta.compute_dtype,
            final_hidden=meta.final_hidden,
        )
        if not self.storage.put_if_absent(done_key(chunk), marker.to_json().encode()):
            raise StorageError(
                f"chunk {chunk:06d} got a done marker from another writer while this shard stored it",
                "Two pods ran the same shard: keep podReplacementPolicy: Failed, and do not run a shard by hand while its Job runs",
            )
        times.committed = time.monotonic()
        self.on_commit(marker)
