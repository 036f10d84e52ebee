"""Capturing the chosen layers of a forward into host memory without stalling the GPU.

Forward hooks copy each captured layer's output, real tokens only, into one preallocated GPU
buffer [tokens, L, d]. After the forward, one side stream reduces the buffer to per-token
absolute maxima (integrity and fp8 scales), quantizes it when the run stores fp8, and makes one
asynchronous device-to-host copy per batch into a pinned host slot, then records an event. The
main stream goes on with the next forward at once; its first hook waits (on the GPU, not the CPU)
for that copy before overwriting the buffer, which in practice has long finished. A small pool of
host slots bounds host memory: when the writer falls behind, taking a slot blocks.
"""

from __future__ import annotations

import contextlib
import queue
from dataclasses import dataclass

import torch

from dflash_jobs.formats import quantize_fp8

QUANTIZE_ROWS = 4096
"""Tokens quantized at a time: bounds the float32 temporaries of fp8 on the GPU."""


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
class HostSlot:
    """Pinned host memory for one batch's capture."""

    hidden: torch.Tensor  # [capacity, L, d] bf16, or float8_e4m3fn
    absmax: torch.Tensor  # [capacity, L] float32: max |h| per token and layer
    scale: torch.Tensor | None  # [capacity, L] float32: fp8 scales (fp8 runs only)
    ids: torch.Tensor  # [capacity] int64: the token ids the forward saw, for the integrity check
    event: torch.cuda.Event | None = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class DeviceToHost:
    """The side stream that moves a batch's capture to a pinned host slot."""

    def __init__(self, capture: LayerCapture, *, storage_dtype: str, slots: int) -> None:
        self.capture = capture
        self.fp8 = storage_dtype == "float8_e4m3fn"
        device = capture.device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        shape = capture.buffer.shape
        dtype = torch.float8_e4m3fn if self.fp8 else capture.buffer.dtype
        self.free: queue.Queue[HostSlot] = queue.Queue()
        for _ in range(slots):
            self.free.put(HostSlot(
                hidden=torch.empty(shape, dtype=dtype, pin_memory=self.cuda),
                absmax=torch.empty(shape[:2], dtype=torch.float32, pin_memory=self.cuda),
                scale=torch.empty(shape[:2], dtype=torch.float32, pin_memory=self.cuda) if self.fp8 else None,
                ids=torch.empty(shape[0], dtype=torch.int64, pin_memory=self.cuda),
            ))

    def take_slot(self, timeout: float) -> HostSlot:
        """A free slot; raises queue.Empty after `timeout` seconds (the caller checks the writer's health)."""
        return self.free.get(timeout=timeout)

    def release(self, slot: HostSlot) -> None:
        self.free.put(slot)

    def launch(self, slot: HostSlot, input_ids: torch.Tensor, real_index: torch.Tensor) -> HostSlot:
        """Queues the copy of the forward just launched; returns at once (the slot's event marks the end)."""
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
                absmax = buffer[begin:end].abs().amax(dim=-1).float()  # [rows, L]; NaN and inf propagate
                slot.absmax[begin:end].copy_(absmax, non_blocking=True)
            slot.ids[:n].copy_(input_ids.reshape(-1).index_select(0, real_index), non_blocking=True)
            if self.fp8:
                for begin in range(0, n, QUANTIZE_ROWS):
                    end = min(begin + QUANTIZE_ROWS, n)
                    quantized, scale = quantize_fp8(buffer[begin:end])
                    slot.hidden[begin:end].copy_(quantized, non_blocking=True)
                    slot.scale[begin:end].copy_(scale, non_blocking=True)
            else:
                slot.hidden[:n].copy_(buffer, non_blocking=True)
            if self.cuda:
                slot.event = torch.cuda.Event()
                slot.event.record(self.stream)
                self.capture.buffer_free = slot.event
        return slot
