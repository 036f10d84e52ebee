"""Forward hooks on the captured decoder layers, writing each one's output, real tokens only, into
one preallocated device buffer [tokens, L, d] (and the last decoder layer's output, the target's
final hidden state, into a second one, [tokens, d]). What reads the buffers (extraction's copies to
host memory, online training's drafter step) sets `buffer_free` when it must be left alone until a
device event: the first hook of the next forward waits for it on the GPU, not the CPU.
"""

from __future__ import annotations

import torch


class LayerCapture:
    """Hooks on the captured decoder layers, writing into one GPU buffer (and the final hidden state,
    the output of decoder layer `final_layer`, into another)."""

    def __init__(
        self, decoder_layers: torch.nn.ModuleList, layer_ids: list[int], *,
        capacity: int, hidden_size: int, dtype: torch.dtype, device: torch.device, final_layer: int | None = None,
    ) -> None:
        self.layer_ids = list(layer_ids)
        self.final_layer = final_layer
        self.capacity = capacity
        self.device = device
        self.buffer = torch.empty((capacity, len(layer_ids), hidden_size), dtype=dtype, device=device)
        self.final = None if final_layer is None else torch.empty((capacity, hidden_size), dtype=dtype, device=device)
        self.real_index: torch.Tensor | None = None
        self.rows: slice | torch.Tensor | None = None
        self.buffer_free: torch.cuda.Event | None = None  # recorded when the last copy out of the buffers ended
        self.decoder_layers = decoder_layers
        self.handles: list = []
        self.attach()

    def attach(self) -> None:
        """Registers the hooks; the first layer to run waits until the previous batch left the buffers."""
        outputs = [(layer, self.buffer[:, position]) for position, layer in enumerate(self.layer_ids)]  # views [capacity, d]
        if self.final is not None:
            outputs.append((self.final_layer, self.final))
        first = min(range(len(outputs)), key=lambda j: outputs[j][0])
        self.handles = [
            self.decoder_layers[layer].register_forward_hook(self._hook(out, wait=j == first))
            for j, (layer, out) in enumerate(outputs)
        ]

    def _hook(self, out: torch.Tensor, *, wait: bool):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if self.real_index is None:
                return None
            flat = hidden.reshape(-1, hidden.shape[-1])  # [rows * length, d]
            if wait and self.buffer_free is not None:
                torch.cuda.current_stream(self.device).wait_event(self.buffer_free)
            out[self.rows] = flat.index_select(0, self.real_index)
            return None

        return hook

    def start(self, real_index: torch.Tensor | None, rows: slice | torch.Tensor | None = None) -> None:
        """Sets the real tokens of the next forward (None: hooks do nothing, e.g. a bare forward) and
        the buffer rows they go to, in order (a slice, or an index per token; by default the first ones)."""
        if real_index is not None:
            rows = slice(0, real_index.numel()) if rows is None else rows
            end = rows.stop if isinstance(rows, slice) else real_index.numel()
            if end > self.capacity or real_index.numel() > self.capacity:
                raise ValueError(f"a batch of {real_index.numel()} real tokens exceeds the capture buffer ({self.capacity})")
        self.real_index, self.rows = real_index, rows

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
