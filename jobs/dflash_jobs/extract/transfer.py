"""A forward's captured layers on their way into the host memory of their chunks.

The capture hooks (capture/hooks.py) fill one device buffer per forward. After the forward, one side stream reduces
each buffer to per-token absolute maxima (integrity and fp8 scales), quantizes it when the run
stores fp8, and copies each run of consecutive samples straight to its rows in the pinned host
buffer of its chunk: the host does no scatter and no extra copy. Samples of a packed batch are
consecutive in their chunk, so a batch is one or two copies (of each buffer); a padded batch is one
copy per sample. The main stream goes on with the next forward at once; its first hook waits (on
the GPU, not the CPU) for the copies before overwriting the buffers. A bounded pool of chunk
buffers bounds host memory: when the writer falls behind, taking a buffer blocks the GPU thread.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_jobs.capture.hooks import LayerCapture
from dflash_jobs.formats import quantize_fp8

QUANTIZE_ROWS = 4096
"""Tokens reduced or quantized at a time: bounds the float32 temporaries on the GPU."""


@dataclass(slots=True)
class HostStates:
    """One captured tensor's rows in host memory (pinned on a GPU), filled in place by the copies."""

    states: torch.Tensor  # [capacity, L, d] (the layers) or [capacity, d] (the final hidden state): bf16, or float8_e4m3fn
    absmax: torch.Tensor  # float32 [capacity, L] or [capacity]: max |h| per row of d
    scale: torch.Tensor | None  # float32, absmax's shape: fp8 scales (fp8 runs only)


@dataclass(slots=True)
class ChunkBuffer:
    """Host memory for one chunk's states."""

    layers: HostStates
    final: HostStates | None  # the final hidden state, when the run stores it
    ids: torch.Tensor  # [capacity] int64: the token ids the forward saw, for the integrity check

    @property
    def capacity(self) -> int:
        return self.ids.shape[0]


class BufferPool:
    """At most `size` chunk buffers of `capacity` tokens, allocated on a thread of their own and
    reused for the whole shard: pinning takes seconds a buffer (16 s for six of 3.4 GB on an H200
    host), which then overlaps the warm-up instead of delaying the first forward."""

    def __init__(
        self, *, size: int, capacity: int, layers: int, hidden_size: int, dtype: torch.dtype, pinned: bool, final_hidden: bool = False,
    ) -> None:
        self.size, self.capacity = size, capacity
        self.shape = (capacity, layers, hidden_size)
        self.dtype, self.pinned, self.final_hidden = dtype, pinned, final_hidden
        self.allocated = 0
        self.free: queue.SimpleQueue[ChunkBuffer] = queue.SimpleQueue()
        self.error: BaseException | None = None  # an allocation that failed (host memory), raised by take

    @property
    def buffer_bytes(self) -> int:
        rows, layers, width = self.shape
        layers += self.final_hidden
        floats = 2 if self.dtype == torch.float8_e4m3fn else 1  # absmax, and the fp8 scales
        return rows * (layers * width * self.dtype.itemsize + layers * 4 * floats + 8)

    def start(self, count: int) -> None:
        """Allocates min(count, size) buffers in the background, each ready for `take` as it comes."""
        def allocate() -> None:
            try:
                for _ in range(min(count, self.size)):
                    self.free.put(self._allocate())
                    self.allocated += 1
            except BaseException as exc:  # handed to the GPU thread at its next take
                self.error = exc

        threading.Thread(target=allocate, name="buffer-pool", daemon=True).start()

    def take(self, timeout: float) -> ChunkBuffer:
        """A free buffer; raises queue.Empty after `timeout` seconds (the caller checks the writer's health)."""
        if self.error is not None and self.free.empty():
            raise self.error
        return self.free.get(timeout=timeout)

    def give_back(self, buffer: ChunkBuffer) -> None:
        self.free.put(buffer)

    def _allocate(self) -> ChunkBuffer:
        def host_states(shape: tuple[int, ...]) -> HostStates:
            rows = shape[:-1]
            return HostStates(
                states=torch.empty(shape, dtype=self.dtype, pin_memory=self.pinned),
                absmax=torch.empty(rows, dtype=torch.float32, pin_memory=self.pinned),
                scale=torch.empty(rows, dtype=torch.float32, pin_memory=self.pinned) if self.dtype == torch.float8_e4m3fn else None,
            )

        capacity, _, width = self.shape
        return ChunkBuffer(
            layers=host_states(self.shape), final=host_states((capacity, width)) if self.final_hidden else None,
            ids=torch.empty(capacity, dtype=torch.int64, pin_memory=self.pinned),
        )


@dataclass(frozen=True, slots=True)
class Run:
    """Rows [source, source + rows) of the capture buffer go to rows [dest, dest + rows) of `buffer`."""

    buffer: ChunkBuffer
    source: int
    dest: int
    rows: int


def merge_runs(runs: Sequence[Run]) -> list[Run]:
    """Joins runs that continue each other in both buffers: a packed batch's samples are one copy."""
    merged: list[Run] = []
    for run in runs:
        last = merged[-1] if merged else None
        if last is not None and last.buffer is run.buffer and last.source + last.rows == run.source and last.dest + last.rows == run.dest:
            merged[-1] = Run(last.buffer, last.source, last.dest, last.rows + run.rows)
        else:
            merged.append(run)
    return merged


class Staging:
    """One capture buffer on its way out: its per-row absolute maxima and, unless the buffer already
    holds the storage dtype, the states in it (quantized for fp8), on the device."""

    def __init__(self, source: torch.Tensor, *, state_dtype: torch.dtype) -> None:
        self.source = source  # [capacity, L, d] or [capacity, d]
        self.fp8 = state_dtype == torch.float8_e4m3fn
        rows = source.shape[:-1]
        self.absmax = torch.empty(rows, dtype=torch.float32, device=source.device)
        # States leave the GPU in their storage dtype: quantized, or cast from a float32 target (tests).
        self.staged = None if source.dtype == state_dtype else torch.empty(source.shape, dtype=state_dtype, device=source.device)
        self.scale = torch.empty(rows, dtype=torch.float32, device=source.device) if self.fp8 else None

    def reduce(self, begin: int, end: int) -> None:
        """Rows [begin, end): their absolute maxima, and their states in the storage dtype."""
        rows = self.source[begin:end]
        self.absmax[begin:end] = rows.abs().amax(dim=-1)  # NaN and inf propagate
        if self.fp8:
            quantized, scale = quantize_fp8(rows)
            self.staged[begin:end].copy_(quantized)
            self.scale[begin:end].copy_(scale)
        elif self.staged is not None:
            self.staged[begin:end].copy_(rows)

    def copy_out(self, host: HostStates, source: slice, dest: slice) -> None:
        states = self.source if self.staged is None else self.staged
        host.states[dest].copy_(states[source], non_blocking=True)
        host.absmax[dest].copy_(self.absmax[source], non_blocking=True)
        if self.scale is not None:
            host.scale[dest].copy_(self.scale[source], non_blocking=True)


class DeviceToHost:
    """The side stream that moves a batch's capture to the rows of its chunks' host buffers."""

    def __init__(self, capture: LayerCapture, *, storage_dtype: str) -> None:
        self.capture = capture
        device = capture.device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.state_dtype = torch.float8_e4m3fn if storage_dtype == "float8_e4m3fn" else torch.bfloat16
        self.layers = Staging(capture.buffer, state_dtype=self.state_dtype)
        self.final = None if capture.final is None else Staging(capture.final, state_dtype=self.state_dtype)
        self.ids = torch.empty(capture.capacity, dtype=torch.int64, device=device)

    def launch(self, runs: Sequence[Run], input_ids: torch.Tensor, real_index: torch.Tensor) -> torch.cuda.Event | None:
        """Queues the reductions and copies of the forward just launched; returns at once with the
        event that marks their end (None on a CPU, where they are done on return)."""
        n = real_index.numel()
        staging = [self.layers] + ([self.final] if self.final is not None else [])
        stream_ctx = torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.capture.device))
            # The batch's inputs were allocated on the main stream: keep them alive for this stream too.
            input_ids.record_stream(self.stream)
            real_index.record_stream(self.stream)
        with stream_ctx:
            for begin in range(0, n, QUANTIZE_ROWS):  # in pieces: a whole-buffer abs() is ~1.7 GB at the 27B shape
                for stage in staging:
                    stage.reduce(begin, min(begin + QUANTIZE_ROWS, n))
            torch.index_select(input_ids.reshape(-1), 0, real_index, out=self.ids[:n])
            for run in runs:
                source, dest = slice(run.source, run.source + run.rows), slice(run.dest, run.dest + run.rows)
                self.layers.copy_out(run.buffer.layers, source, dest)
                if self.final is not None:
                    self.final.copy_out(run.buffer.final, source, dest)
                run.buffer.ids[dest].copy_(self.ids[source], non_blocking=True)
            if not self.cuda:
                return None
            event = torch.cuda.Event()
            event.record(self.stream)
            self.capture.buffer_free = event
        return event
