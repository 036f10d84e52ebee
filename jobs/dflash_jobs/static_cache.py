"""A static KV cache read in windows, and forwards replayed as CUDA graphs: what generate's batch
decoder (generate/decoding.py: StaticDecoder) and the evaluation's verify target
(drafter/static_target.py: StaticTarget) share.

A small target decoded at a few rows leaves a GPU idle between the some 15 kernels a layer that
Python launches one by one; one CUDA graph a step launches them at once. A graph replays fixed
addresses, so the cache is a static one (Transformers' StaticCache: every layer's keys and values
preallocated), and a forward of each shape (tokens, the cache's window) is captured once and
replayed for every later forward of that shape.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable, Hashable

if TYPE_CHECKING:
    import torch

CACHE_ALIGN = 64
"""Attention reads the cache in windows of a multiple of this: SDPA's memory-efficient kernel wants its mask's rows aligned."""


def aligned(length: int) -> int:
    return -(-length // CACHE_ALIGN) * CACHE_ALIGN


def static_cache_supported(model) -> bool:
    """Every layer attends to everything before it: a static cache and our own mask are then exact
    (a linear-attention or a sliding-window layer keeps other state, which a dynamic cache handles)."""
    text = model.config.get_text_config(decoder=True)
    layer_types = getattr(text, "layer_types", None) or ["full_attention"]
    return all(kind == "full_attention" for kind in layer_types) and getattr(text, "sliding_window", None) in (None, 0)


def cache_argument(model) -> str:
    """The forward's name for the cache: `cache` from Transformers 5.25 (which warns at the old name),
    `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@functools.cache
def windowed_cache():
    """A Transformers StaticCache whose `update` hands attention its first `window` columns (all of them
    while window is None): the columns past the filled part are masked, and reading them is waste."""
    from transformers import StaticCache

    class WindowedCache(StaticCache):
        window: int | None = None

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            return keys[:, :, : self.window], values[:, :, : self.window]

    return WindowedCache


class CapturedSteps:
    """Calls of forwards by shape: on a GPU a shape's first call runs eagerly (it warms the kernels,
    the cache allocates itself lazily, torch.compile compiles), its second is captured as a CUDA graph,
    and every later one replays that graph and returns the same output tensors, refilled. Elsewhere
    every call is eager.

    A step must read its inputs from, and write its state to, tensors whose addresses stay (the
    caller's static buffers): a replay does exactly what the captured call's kernels did, on those
    addresses, and runs no Python. The graphs share one memory pool (one replays at a time; each
    keeps its outputs)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.graphs: dict[Hashable, tuple[Any, Any]] = {}  # shape -> its graph and the captured call's output
        self.warm: set[Hashable] = set()
        self.pool = None

    def __call__(self, shape: Hashable, step: Callable[[], Any]) -> Any:
        import torch

        if self.device.type != "cuda" or shape not in self.warm:
            self.warm.add(shape)
            return step()
        if shape not in self.graphs:
            # Recorded on a side stream (capture refuses the default one) into the shared pool.
            # Recording runs no kernel, so the state stands where the eager call left it, and the
            # first replay does this call. Not torch.cuda.graph: it empties the allocator's cache at
            # every capture.
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=self.pool)
                try:
                    output = step()
                finally:
                    graph.capture_end()
            torch.cuda.current_stream().wait_stream(stream)
            self.pool = graph.pool()
            self.graphs[shape] = (graph, output)
        graph, output = self.graphs[shape]
        graph.replay()
        return output
