"""Host side of the pipeline: assembling chunks from batches, then storing them, in two threads.

    GPU thread --(host slots)--> assembler --(complete chunks)--> uploader --> storage
                 bounded pool                 bounded queue

The assembler waits for a slot's copy to finish, scatters its samples into their chunks (a batch
mixes samples of several chunks of the window), returns the slot, and checks each chunk it
completes. The uploader serializes a chunk to a spool file, stores it, then creates its done
marker: the marker is the commit point, so a chunk is visible only complete. Host memory is
bounded by the slot pool (batches wait for a free slot) and the bounded chunk queue, so a slow
store blocks the GPU thread instead of growing host memory.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash_jobs.errors import IntegrityError, StorageError
from dflash_jobs.extract import integrity
from dflash_jobs.extract.capture import DeviceToHost, HostSlot
from dflash_jobs.formats import (
    ChunkInfo, DoneMarker, TokenChunk, done_key, fetch_header_bytes, file_range, hidden_chunk_key, hidden_metadata, hidden_tensors, write_safetensors,
)
from dflash_jobs.storage import Storage

POLL_S = 1.0
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


class ChunkAssembly:
    """One chunk's states, filled sample by sample from the batches."""

    def __init__(self, info: ChunkInfo, tokens: TokenChunk, metadata: ChunkMetadata, state_dtype: torch.dtype) -> None:
        shape = (tokens.num_tokens, len(metadata.layers), metadata.hidden_size)
        self.info = info
        self.tokens = tokens
        self.hidden = torch.empty(shape, dtype=state_dtype)
        self.absmax = torch.empty(shape[:2], dtype=torch.float32)
        self.scale = torch.empty(shape[:2], dtype=torch.float32) if metadata.dtype == "float8_e4m3fn" else None
        self.ids = torch.empty(shape[0], dtype=torch.int64)
        self.written = np.zeros(tokens.num_samples, dtype=bool)
        self.remaining = tokens.num_samples
        self.stats: dict[str, float] = {}

    def put(self, index: int, slot: HostSlot, offset: int) -> None:
        """Copies sample `index` from rows [offset, offset + length) of a host slot."""
        if self.written[index]:
            raise IntegrityError(f"chunk {self.info.id:06d}: sample {self.tokens.sample_ids[index]} captured twice", integrity.FIX)
        begin, end = int(self.tokens.cu_seqlens[index]), int(self.tokens.cu_seqlens[index + 1])
        rows = slice(offset, offset + end - begin)
        self.hidden[begin:end] = slot.hidden[rows]
        self.absmax[begin:end] = slot.absmax[rows]
        self.ids[begin:end] = slot.ids[rows]
        if self.scale is not None:
            self.scale[begin:end] = slot.scale[rows]
        self.written[index] = True
        self.remaining -= 1


_DONE = object()


class ChunkWriter:
    def __init__(
        self,
        *,
        storage: Storage,
        metadata: ChunkMetadata,
        transfer: DeviceToHost,
        spool_dir: Path,
        queue_depth: int,
        on_commit: Callable[[DoneMarker], None] = lambda marker: None,
    ) -> None:
        self.storage = storage
        self.metadata = metadata
        self.transfer = transfer
        self.spool_dir = spool_dir
        self.on_commit = on_commit
        self.state_dtype = torch.float8_e4m3fn if metadata.dtype == "float8_e4m3fn" else torch.bfloat16
        self.batches: queue.Queue = queue.Queue()  # bounded by the slot pool: one entry per slot in use
        self.complete: queue.Queue = queue.Queue(maxsize=queue_depth)
        self.error: BaseException | None = None
        self.kill_before_marker = os.environ.get(KILL_BEFORE_MARKER_ENV)
        spool_dir.mkdir(parents=True, exist_ok=True)
        self.threads = [
            threading.Thread(target=self._guard, args=(self._assemble,), name="assembler", daemon=True),
            threading.Thread(target=self._guard, args=(self._upload,), name="uploader", daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    # ---- GPU thread side ----

    def open(self, info: ChunkInfo, tokens: TokenChunk) -> ChunkAssembly:
        return ChunkAssembly(info, tokens, self.metadata, self.state_dtype)

    def submit(self, slot: HostSlot, placements: list[tuple[ChunkAssembly, int, int]]) -> None:
        """Hands over a slot whose copy is queued; placements: (chunk, sample index, first row in the slot)."""
        self.check()
        self.batches.put((slot, placements))

    def check(self) -> None:
        """Re-raises, in the caller's thread, the first error of a writer thread."""
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Stores everything submitted, then stops the threads; raises their first error."""
        self.batches.put(_DONE)
        for thread in self.threads:
            while thread.is_alive():
                thread.join(POLL_S)
        self.check()

    # ---- threads ----

    def _guard(self, body: Callable[[], None]) -> None:
        try:
            # Chunks are created under the GPU thread's inference mode, which is per thread.
            with torch.inference_mode():
                body()
        except BaseException as exc:  # handed to the GPU thread, which stops the pod with it
            if self.error is None:
                self.error = exc

    def _put(self, target: queue.Queue, item) -> None:
        """A blocking put that gives up once another thread failed."""
        while True:
            self.check()
            try:
                target.put(item, timeout=POLL_S)
                return
            except queue.Full:
                continue

    def _get(self, source: queue.Queue):
        """A blocking get that ends (with _DONE) once another thread failed."""
        while self.error is None:
            try:
                return source.get(timeout=POLL_S)
            except queue.Empty:
                continue
        return _DONE

    def _assemble(self) -> None:
        while (item := self._get(self.batches)) is not _DONE:
            slot, placements = item
            slot.wait()
            for assembly, index, offset in placements:
                assembly.put(index, slot, offset)
                if assembly.remaining == 0:
                    assembly.stats = integrity.check_assembled(assembly.info.id, assembly.tokens, assembly.ids, assembly.absmax, assembly.written)
                    self._put(self.complete, assembly)
            self.transfer.release(slot)
        self._put(self.complete, _DONE)

    def _upload(self) -> None:
        while (assembly := self._get(self.complete)) is not _DONE:
            self._store(assembly)

    def _store(self, assembly: ChunkAssembly) -> None:
        chunk, meta = assembly.info.id, self.metadata
        path = self.spool_dir / f"{chunk:06d}.safetensors"
        with open(path, "wb") as out:
            write_safetensors(
                out, hidden_tensors(assembly.tokens, assembly.hidden, assembly.scale),
                hidden_metadata(layers=meta.layers, model=meta.model, config_hash=meta.config_hash, dtype=meta.dtype),
            )
        prefix = fetch_header_bytes(file_range(path))
        integrity.check_encoded(chunk, prefix, path.stat().st_size, assembly.tokens, meta.layers)
        put = self.storage.put_file(hidden_chunk_key(chunk), path)
        path.unlink()
        if self.kill_before_marker == str(chunk):
            os.kill(os.getpid(), signal.SIGKILL)
        marker = DoneMarker(
            chunk=chunk, samples=assembly.tokens.num_samples, tokens=assembly.tokens.num_tokens,
            bytes=put.size, sha256=put.sha256, etag=put.etag, dtype=meta.dtype, layers=list(meta.layers),
            hidden_size=meta.hidden_size, shard=meta.shard, stats=assembly.stats,
        )
        if not self.storage.put_if_absent(done_key(chunk), marker.to_json().encode()):
            raise StorageError(
                f"chunk {chunk:06d} got a done marker from another writer while this shard stored it",
                "Two pods ran the same shard: keep podReplacementPolicy: Failed, and do not run a shard by hand while its Job runs",
            )
        self.on_commit(marker)
