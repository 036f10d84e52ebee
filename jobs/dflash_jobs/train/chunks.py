"""Hidden-state chunks as training reads them: fetched from storage, checked against their manifest
entries, kept on local disk or streamed through memory (ChunkCache), and read by rows straight into
a batch's buffer, never decoded whole (ChunkData).
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from dflash_jobs.errors import FormatError, InputError
from dflash_jobs.formats import ChunkInfo, DoneMarker, TokenChunk, check_hidden_header, fetch_header_bytes, hidden_chunk_key, read_header, token_chunk_key
from dflash_jobs.storage import TEMP_PREFIX, Storage

# ---- chunks as a batch reads them --------------------------------------------------------------


class _MemoryBytes:
    """A chunk held in host memory (streamed from storage), as uint8 [size]."""

    def __init__(self, data: torch.Tensor) -> None:
        self.size = data.numel()
        self._tensor = data

    def read(self, start: int, end: int) -> bytes:
        return self._tensor[start:end].numpy().tobytes()

    def read_into(self, offset: int, out: torch.Tensor) -> None:
        out.copy_(self._tensor[offset : offset + out.numel()])  # torch copies without the GIL

    def close(self) -> None:
        self._tensor = torch.empty(0, dtype=torch.uint8)


class _FileBytes:
    """A chunk on local disk: rows are read straight into the batch (pread releases the GIL)."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size

    def read(self, start: int, end: int) -> bytes:
        return os.pread(self.fd, end - start, start)

    def read_into(self, offset: int, out: torch.Tensor) -> None:
        view = memoryview(out.numpy())
        while view:
            got = os.preadv(self.fd, [view], offset)
            if got == 0:
                raise FormatError(f"local cache file ended at byte {offset}", "Delete the training cache directory and restart")
            view, offset = view[got:], offset + got

    def close(self) -> None:
        os.close(self.fd)


class ChunkData:
    """One hidden-state chunk as batches read it: the token tensors in memory (5 bytes a token),
    the states read by rows straight into a batch's (pinned) buffer, never decoded whole."""

    def __init__(self, source: _MemoryBytes | _FileBytes, name: str) -> None:
        self.source, self.name = source, name
        prefix = fetch_header_bytes(source.read)
        header, total = read_header(prefix, name)
        if total != source.size:
            raise FormatError(f"{name} is truncated or has trailing bytes: {source.size} bytes, header says {total}", "Run `dflashctl verify`, then re-extract what it names")
        meta = check_hidden_header(header, name)
        self.layers, self.dtype = meta["layers"], meta["dtype"]
        self.final_hidden: str | None = meta["final_hidden"]  # the final hidden state's dtype; None: not stored

        def tensor(key: str, dtype) -> np.ndarray:
            begin, end = header[key]["data_offsets"]
            return np.frombuffer(source.read(len(prefix) + begin, len(prefix) + end), dtype=dtype)

        self.tokens = TokenChunk(
            input_ids=tensor("input_ids", np.int32), loss_mask=tensor("loss_mask", np.uint8),
            cu_seqlens=tensor("cu_seqlens", np.int64), sample_ids=tensor("sample_ids", np.int64),
        ).validate(name)
        _, self.num_layers, self.hidden_size = header["hidden_states"]["shape"]

        def start(key: str) -> int | None:
            return len(prefix) + header[key]["data_offsets"][0] if key in header else None

        self._states, self._scales = start("hidden_states"), start("hidden_states_scale")
        self._final, self._final_scales = start("final_hidden_states"), start("final_hidden_states_scale")

    @classmethod
    def from_bytes(cls, data: bytes | bytearray, name: str) -> ChunkData:
        held = bytearray(data) if isinstance(data, bytes) else data
        return cls(_MemoryBytes(torch.frombuffer(held, dtype=torch.uint8) if held else torch.empty(0, dtype=torch.uint8)), name)

    @classmethod
    def from_file(cls, path: Path) -> ChunkData:
        source = _FileBytes(path)
        try:
            return cls(source, path.name)
        except BaseException:
            source.close()
            raise

    @property
    def quantized(self) -> bool:
        return self.dtype == "float8_e4m3fn"

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.quantized else torch.bfloat16

    def read_states(self, begin: int, end: int, out: torch.Tensor) -> None:
        """Tokens [begin, end) of hidden_states into `out` ([end - begin, L*d] of the chunk's dtype)."""
        self._read_rows(self._states, begin, out)

    def read_scales(self, begin: int, end: int, out: torch.Tensor) -> None:
        """Tokens [begin, end) of an fp8 chunk's hidden_states_scale into `out` (float32 [end - begin, L])."""
        self._read_rows(self._scales, begin, out)

    def read_final(self, begin: int, end: int, out: torch.Tensor) -> None:
        """Tokens [begin, end) of final_hidden_states into `out` ([end - begin, d] of its dtype)."""
        self._read_rows(self._final, begin, out)

    def read_final_scales(self, begin: int, end: int, out: torch.Tensor) -> None:
        """Tokens [begin, end) of an fp8 final_hidden_states_scale into `out` (float32 [end - begin])."""
        self._read_rows(self._final_scales, begin, out)

    def _read_rows(self, start: int, begin: int, out: torch.Tensor) -> None:
        """Rows begin.. of the tensor whose bytes start at `start` into `out`, a block of contiguous rows."""
        row = out.stride(0) * out.element_size()
        self.source.read_into(start + begin * row, out.view(torch.uint8).view(-1))

    def close(self) -> None:
        self.source.close()


# ---- chunks: fetched, checked, kept or streamed --------------------------------------------------

DOWNLOAD_PART = 64 << 20
"""Bytes per ranged GET of a chunk download; DOWNLOAD_THREADS of them in flight per cache."""
DOWNLOAD_THREADS = 8


class CacheClosed(Exception):
    """A download stopped because the cache was closed (the stream is shutting down)."""


class ChunkCache:
    """This rank's chunks, each checked against its manifest entry (size and sha256) when fetched.

    A fixed subset, as many of the rank's chunks as `max_bytes` holds, stays on local disk across
    epochs; the rest is streamed through memory every epoch and never written. So a cache of half the
    share serves half the reads from disk every epoch, where LRU under a reshuffled order misses on
    nearly all. The disk never holds more than `max_bytes`: only resident chunks are written, each
    inside its own reservation. A file is named by its chunk and the manifest's sha256, and adopted
    only under that name and size: a re-extraction under the same run name never serves old states.
    Anything else in the directory (a killed download's temporary file, another extraction's chunk)
    is removed when the cache opens."""

    def __init__(self, storage: Storage, directory: Path, max_bytes: int, chunks: list[DoneMarker]) -> None:
        self.storage = storage
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.markers = {marker.chunk: marker for marker in chunks}
        self.resident: set[int] = set()
        kept = 0
        for marker in sorted(chunks, key=lambda m: m.chunk):
            if kept + marker.bytes <= max_bytes:
                self.resident.add(marker.chunk)
                kept += marker.bytes
        self._on_disk = {chunk for chunk in self.resident if self._stored(chunk)}
        wanted = {self.path(chunk).name for chunk in self._on_disk}
        for path in self.directory.iterdir():
            if path.name not in wanted and not path.is_dir():
                path.unlink(missing_ok=True)
        self._lock = threading.Lock()
        self._storing = {chunk: threading.Lock() for chunk in self.resident}
        self.bytes_fetched = 0
        """Bytes read from storage since the cache opened (what the object store had to deliver)."""
        self._closed = threading.Event()
        self._parts = ThreadPoolExecutor(DOWNLOAD_THREADS, thread_name_prefix="chunk-part")

    def path(self, chunk: int) -> Path:
        return self.directory / f"{chunk:06d}-{self.markers[chunk].sha256[:16]}.safetensors"

    def _stored(self, chunk: int) -> bool:
        path = self.path(chunk)
        return path.is_file() and path.stat().st_size == self.markers[chunk].bytes

    def open(self, chunk: int) -> ChunkData:
        """The chunk, from local disk if it is resident and stored there, else from storage (a
        resident one is then stored for the next epochs)."""
        data = self._open(chunk)
        if data.layers != self.markers[chunk].layers:
            data.close()
            raise FormatError(f"{data.name} holds layers {data.layers}, its manifest entry says {self.markers[chunk].layers}", "Re-run extraction and verify")
        return data

    def _open(self, chunk: int) -> ChunkData:
        if chunk not in self.resident:
            return ChunkData(_MemoryBytes(self._download(chunk)), hidden_chunk_key(chunk))
        # One opener at a time per resident chunk: two at once (the prefetcher reaching a chunk again
        # while it is still being stored) would both download and write it, and the disk hold it twice.
        with self._storing[chunk]:
            if chunk in self._on_disk:
                return ChunkData.from_file(self.path(chunk))
            data = self._download(chunk)
            path = self.path(chunk)
            temp = path.with_name(f"{TEMP_PREFIX}{path.name}")
            try:
                temp.write_bytes(data.numpy())  # the write releases the GIL
                os.replace(temp, path)
            finally:
                temp.unlink(missing_ok=True)
            self._on_disk.add(chunk)
        return ChunkData(_MemoryBytes(data), hidden_chunk_key(chunk))

    def close(self) -> None:
        """Stops downloads between parts and waits for the parts in flight."""
        self._closed.set()
        self._parts.shutdown(wait=True, cancel_futures=True)

    def _download(self, chunk: int) -> torch.Tensor:
        """The chunk's bytes, uint8 [size], fetched by ranged GETs on DOWNLOAD_THREADS threads and checked.

        Nothing here holds the GIL for long, so the training thread launches its kernels meanwhile:
        the buffer is not zeroed (bytearray(n) zeroes n bytes under the GIL, about a second per GB:
        the 2-3 s steps of the first epoch), and parts are copied in by numpy, which lets go of it."""
        marker, key = self.markers[chunk], hidden_chunk_key(chunk)
        data = torch.empty(marker.bytes, dtype=torch.uint8)
        view = data.numpy()

        def part(start: int) -> None:
            if self._closed.is_set():
                raise CacheClosed(key)
            end = min(start + DOWNLOAD_PART, marker.bytes)
            piece = self.storage.get_bytes(key, start, end)
            if len(piece) != end - start:
                raise InputError(
                    f"{self.storage.url}/{key} ends before byte {end}; its manifest entry says {marker.bytes} bytes",
                    "Run `dflashctl verify` (it names the chunks that changed), re-extract them, then train again",
                )
            view[start:end] = np.frombuffer(piece, dtype=np.uint8)

        for _ in self._parts.map(part, range(0, marker.bytes, DOWNLOAD_PART)):
            pass
        if hashlib.sha256(view).hexdigest() != marker.sha256:  # hashlib releases the GIL on large buffers
            raise InputError(
                f"{self.storage.url}/{key} does not match its manifest entry (sha256): it changed after verification",
                "Run `dflashctl verify` (it names the chunks that changed), re-extract them, then train again",
            )
        with self._lock:
            self.bytes_fetched += marker.bytes
        return data


# ---- token chunks: what online training reads --------------------------------------------------


class TokenChunkData:
    """A token chunk as online training reads it (train.states: online): its tokens alone, the target
    makes the states."""

    def __init__(self, tokens: TokenChunk, name: str) -> None:
        self.tokens, self.name = tokens, name

    def close(self) -> None:
        pass


class TokenChunks:
    """prepare's token chunks (5 bytes a token: a 64K-token chunk is 320 KB), each read whole when a
    batch needs it and checked against its entry in tokens/dataset.json; nothing is kept on disk."""

    def __init__(self, storage: Storage, chunks: list[ChunkInfo]) -> None:
        self.storage = storage
        self.infos = {info.id: info for info in chunks}

    def open(self, chunk: int) -> TokenChunkData:
        key, info = token_chunk_key(chunk), self.infos[chunk]
        tokens = TokenChunk.decode(self.storage.get_bytes(key), key)
        if (tokens.num_samples, tokens.num_tokens) != (info.samples, info.tokens):
            raise InputError(
                f"{self.storage.url}/{key} holds {tokens.num_samples} samples / {tokens.num_tokens} tokens, "
                f"tokens/dataset.json says {info.samples} / {info.tokens}", "Re-run prepare, then train again",
            )
        return TokenChunkData(tokens, key)

    def close(self) -> None:
        pass
