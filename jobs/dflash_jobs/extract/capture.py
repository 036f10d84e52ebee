"""Capturing the chosen layers of a forward straight into the host memory of their chunks.

Forward hooks copy each captured layer's output, real tokens only, into one preallocated GPU
buffer [tokens, L, d]. After the forward, one side stream reduces the buffer to per-token
absolute maxima (integrity and fp8 scales), quantizes it when the run stores fp8, and copies each
run of consecutive samples straight to its rows in the pinned host buffer of its chunk: the host
does no scatter and no extra copy. Samples of a packed batch are consecutive in their chunk, so a
batch is one or two copies; a padded batch is one copy per sample. The main stream goes on with
the next forward at once; its first hook waits (on the GPU, not the CPU) for the copies before
overwriting the buffer. A bounded pool of chunk buffers bounds host memory: when the writer falls
behind, taking a buffer blocks the GPU thread.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_jobs.formats import quantize_fp8

QUANTIZE_ROWS = 4096
"""Tokens reduced or quantized at a time: bounds the float32 temporaries on the GPU."""


class LayerCapture:
    """Hooks on the captured decoder layers, writing into one GPU buffer."""

    def __init__(
        self, decoder_layers: torch.nn.ModuleList, layer_ids: list[int], *,
        capacity: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
    ) -> None:
        self.layer_ids = list(layer_ids)
        self.capacity = capacity
        self.device = device
        self.buffer = torch.empty((capacity, len(layer_ids), hidden_size), dtype=dtype, device=device)
        self.real_index: torch.Tensor | None = None
        self.buffer_free: torch.cuda.Event | None = None  # recorded when the last copy out of the buffer ended
        self.decoder_layers = decoder_layers
        self.handles: list = []
        self.attach()

    def attach(self) -> None:
        """Registers the hooks; the first layer to run waits until the previous batch left the buffer."""
        first = min(range(len(self.layer_ids)), key=lambda j: self.layer_ids[j])
        self.handles = [
            self.decoder_layers[layer].register_forward_hook(self._hook(position, wait=position == first))
            for position, layer in enumerate(self.layer_ids)
        ]

    def _hook(self, position: int, *, wait: bool):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if self.real_index is None:
                return None
            flat = hidden.reshape(-1, hidden.shape[-1])  # [rows * length, d]
            if wait and self.buffer_free is not None:
                torch.cuda.current_stream(self.device).wait_event(self.buffer_free)
            self.buffer[: self.real_index.numel(), position] = flat.index_select(0, self.real_index)
            return None

        return hook

    def start(self, real_index: torch.Tensor | None) -> None:
        """Sets the real tokens of the next forward (None: hooks do nothing, e.g. a bare forward)."""
        if real_index is not None and real_index.numel() > self.capacity:
            raise ValueError(f"a batch of {real_index.numel()} real tokens exceeds the capture buffer ({self.capacity})")
        self.real_index = real_index

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


@dataclass(slots=True)
class ChunkBuffer:
    """Host memory (pinned on a GPU) for one chunk's states, filled in place by the copies."""

    hidden: torch.Tensor  # [capacity, L, d] bf16, or float8_e4m3fn
    absmax: torch.Tensor  # [capacity, L] float32: max |h| per token and layer
    scale: torch.Tensor | None  # [capacity, L] float32: fp8 scales (fp8 runs only)
    ids: torch.Tensor  # [capacity] int64: the token ids the forward saw, for the integrity check

    @property
    def capacity(self) -> int:
        return self.hidden.shape[0]


class BufferPool:
    """At most `size` chunk buffers of `capacity` tokens, allocated on a thread of their own and
    reused for the whole shard: pinning takes seconds a buffer (16 s for six of 3.4 GB on an H200
    host), which then overlaps the warm-up instead of delaying the first forward."""

    def __init__(self, *, size: int, capacity: int, layers: int, hidden_size: int, dtype: torch.dtype, pinned: bool) -> None:
        self.size, self.capacity = size, capacity
        self.shape = (capacity, layers, hidden_size)
        self.dtype, self.pinned = dtype, pinned
        self.allocated = 0
        self.free: queue.SimpleQueue[ChunkBuffer] = queue.SimpleQueue()
        self.error: BaseException | None = None  # an allocation that failed (host memory), raised by take

    @property
    def buffer_bytes(self) -> int:
        rows, layers, width = self.shape
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
        def empty(shape, dtype):
            return torch.empty(shape, dtype=dtype, pin_memory=self.pinned)

        fp8 = self.dtype == torch.float8_e4m3fn
        return ChunkBuffer(
            hidden=empty(self.shape, self.dtype), absmax=empty(self.shape[:2], torch.float32),
            scale=empty(self.shape[:2], torch.float32) if fp8 else None, ids=empty(self.shape[:1], torch.int64),
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


class DeviceToHost:
    """The side stream that moves a batch's capture to the rows of its chunks' host buffers."""

    def __init__(self, capture: LayerCapture, *, storage_dtype: str) -> None:
        self.capture = capture
        self.fp8 = storage_dtype == "float8_e4m3fn"
        device = capture.device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        rows, layers, _ = capture.buffer.shape
        self.absmax = torch.empty((rows, layers), dtype=torch.float32, device=device)
        self.ids = torch.empty(rows, dtype=torch.int64, device=device)
        self.state_dtype = torch.float8_e4m3fn if self.fp8 else torch.bfloat16
        # States leave the GPU in their storage dtype: quantized, or cast from a float32 target (tests).
        self.staged = None if capture.buffer.dtype == self.state_dtype else torch.empty(capture.buffer.shape, dtype=self.state_dtype, device=device)
        self.scale = torch.empty((rows, layers), dtype=torch.float32, device=device) if self.fp8 else None

    def launch(self, runs: Sequence[Run], input_ids: torch.Tensor, real_index: torch.Tensor) -> torch.cuda.Event | None:
        """Queues the reductions and copies of the forward just launched; returns at once with the
        event that marks their end (None on a CPU, where they are done on return)."""
        n = real_index.numel()
        buffer = self.capture.buffer[:n]
        stream_ctx = torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.capture.device))
            # The batch's inputs were allocated on the main stream: keep them alive for this stream too.
            input_ids.record_stream(self.stream)
            real_index.record_stream(self.stream)
        with stream_ctx:
            for begin in range(0, n, QUANTIZE_ROWS):  # in pieces: a whole-buffer abs() is ~1.7 GB at the 27B shape
                end = min(begin + QUANTIZE_ROWS, n)
                self.absmax[begin:end] = buffer[begin:end].abs().amax(dim=-1)  # NaN and inf propagate
                if self.fp8:
                    quantized, scale = quantize_fp8(buffer[begin:end])
                    self.staged[begin:end].copy_(quantized)
                    self.scale[begin:end].copy_(scale)
                elif self.staged is not None:
                    self.staged[begin:end].copy_(buffer[begin:end])
            torch.index_select(input_ids.reshape(-1), 0, real_index, out=self.ids[:n])
            states = self.capture.buffer if self.staged is None else self.staged
            for run in runs:
                source, dest = slice(run.source, run.source + run.rows), slice(run.dest, run.dest + run.rows)
                run.buffer.hidden[dest].copy_(states[source], non_blocking=True)
                run.buffer.absmax[dest].copy_(self.absmax[source], non_blocking=True)
                run.buffer.ids[dest].copy_(self.ids[source], non_blocking=True)
                if self.fp8:
                    run.buffer.scale[dest].copy_(self.scale[source], non_blocking=True)
            if not self.cuda:
                return None
            event = torch.cuda.Event()
            event.record(self.stream)
            self.capture.buffer_free = event
        return event
