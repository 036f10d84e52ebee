"""The verify loops' target on a static KV cache, each forward of a verify block, a token or a draft
tree one replayed CUDA graph on a GPU: for a target of full attention only (static_cache.static_cache_supported).

At batch size 1 a small target's forward is bound by the host: Python launches some 15 kernels a
layer one by one, and a verify step of SmolLM2's shape took 18-21 ms on an H100 eagerly, a greedy
token as long (issue 49). A replayed graph launches a forward's kernels at once. A graph replays
fixed addresses and shapes, so:

- The cache is static (static_cache.windowed_cache), sized at each prompt for it and the decoding
  after it (`room`); it and its graphs serve the next prompt that fits.
- Every forward of 2 to `block` tokens runs as one of `block` tokens: the rows past the real ones
  compute whatever the buffer holds and are never read (causal attention: they change no earlier
  row), their keys land past the cache's length, where the next forward overwrites them. So a
  decoding has three shapes a window of the cache: a token (greedy, the last token's logits), a
  block (the verify loops, the lossless check's blocks), and the prompt's, run eagerly.
- Rolling back is setting the length: keys past it are masked by position (a query at position p
  sees the columns up to p) until overwritten. So a rejected verify keeps its accepted tokens
  (`rewind`), and the next verify is the anchor and its drafts alone.
- A draft tree's forward (drafter/tree_verify.py) reads the cache's window with the columns past the
  length masked, from buffers the tree is copied into: a graph per tree size and window.

Its logits differ from the dynamic cache's (DecodeTarget) by roundings (the kernels a padded block
and a longer window select), which can part two decodings only where greedy's top two scores are
that close: the evaluation measures that noise (evaluate/lossless.py) on this target too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Sequence

import torch
from torch import nn

from dflash_jobs.drafter.speculative import CacheCheckpoint, DecodeTarget, on_device
from dflash_jobs.static_cache import CapturedSteps, aligned, cache_argument, static_cache_supported, windowed_cache

CACHE_BUCKET = 256
"""The cache's length is a multiple of this: prompts whose lengths round up alike share a cache and its graphs."""


@dataclass
class CacheWindow:
    """An attention layer's cached keys and values [1, heads, window, head_dim], as a tree forward reads a cache layer."""

    keys: torch.Tensor
    values: torch.Tensor


class StaticTarget(DecodeTarget):
    """DecodeTarget's interface (reset, forward, features, checkpoint, rollback) on a static cache.

    block: the tokens of a verify forward (the anchor and the most drafts); forwards of 2 to `block`
    tokens run as one of `block`. room: the most tokens a decoding adds after its prompt, a verify
    block's overhang included."""

    def __init__(self, model: nn.Module, layers: Sequence[int] = (), *, block: int, room: int, architecture=None) -> None:
        if not static_cache_supported(model):
            raise ValueError(f"{type(model).__name__} has layers other than full attention (linear or sliding-window "
                             "attention keep state a static cache cannot roll back): decode it with DecodeTarget")
        super().__init__(model, layers, architecture=architecture)
        self.block, self.room = block, room
        self.capacity = 0
        self.steps: CapturedSteps | None = None
        self._cache_kwargs: dict = {}

    def reset(self) -> None:
        self.length = 0  # the cache's buffers and graphs stay for the next prompt

    def _allocate(self, needed: int) -> None:
        """A cache of at least `needed` columns, its buffers and no graphs: made anew only where the last is too short."""
        if needed <= self.capacity:
            return
        device = self.device
        self.capacity = -(-needed // CACHE_BUCKET) * CACHE_BUCKET
        self.steps = None  # the last cache's graphs (and their pool) freed before this one is made
        self.cache = windowed_cache()(config=self.model.config, max_cache_len=self.capacity)
        self._cache_kwargs = {cache_argument(self.model): self.cache}
        self.steps = CapturedSteps(device)
        self._inputs: dict[tuple, torch.Tensor] = {}  # a tree forward's inputs by name and shape: what its graph reads
        self._ids = torch.zeros(self.block, dtype=torch.long, device=device)
        self._start = torch.zeros((), dtype=torch.long, device=device)  # the forward's first position: the cache's length
        self._columns = torch.arange(self.capacity, device=device)

    def _fits(self, rows: int) -> None:
        if self.length + rows > self.capacity:
            raise ValueError(f"a forward of {rows} rows after {self.length} tokens overruns the static cache sized for prompts plus "
                             f"room={self.room}: build the StaticTarget with the room its decodings need")

    def forward(self, ids: torch.Tensor, *, last_only: bool = False) -> torch.Tensor:
        n = len(ids)
        if self.length == 0:
            self._allocate(n + self.room + self.block)
        self._fits(max(n, self.block))
        self._start.fill_(self.length)  # a scalar written on the device: no wait
        if n > self.block:  # a prompt: eager, its own shape
            rows, keep_last = n, last_only
            logits, captured = self._run(ids, n, self._window(n), keep_last)
        else:
            rows, keep_last = (1, last_only) if n == 1 else (self.block, False)
            self._ids[:n].copy_(ids)
            window = self._window(rows)
            logits, captured = self.steps((rows, window, keep_last), partial(self._run, self._ids[:rows], rows, window, keep_last))
        self.length += n
        self._captured = {layer: hidden[:, :n] for layer, hidden in captured.items()}
        # A replay refills the same output tensors: a copy keeps these logits past the next forward.
        return (logits[n - 1 : n] if last_only and not keep_last else logits[:n]).clone()

    def _window(self, rows: int) -> int:
        """The cache columns a forward of `rows` tokens reads: through its own, rounded up."""
        return min(aligned(self.length + rows), self.capacity)

    def _run(self, ids: torch.Tensor, rows: int, window: int, last_only: bool) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The forward of `rows` tokens from position `_start` over the cache's first `window` columns:
        reads only the device buffers, so that a graph of it replays any prompt's forward of this shape."""
        positions = self._start + torch.arange(rows, device=self._start.device)
        visible = self._columns[None, :window] <= positions[:, None]  # [rows, window]: causal by position
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.copy_(self._start)  # where update() writes this forward's keys
        self.cache.window = window
        output = self.model(input_ids=ids[None], attention_mask=visible[None, None], position_ids=positions[None],
                            use_cache=True, logits_to_keep=1 if last_only else 0, **self._cache_kwargs)
        return output.logits[0], dict(self._captured)

    def tree_forward(self, rows: int, depth_bound: int, inputs: dict, forward):
        """The tree's verify forward (DecodeTarget.tree_forward) over the cache's window through its rows,
        replayed as a CUDA graph per row count and window: its inputs copied into buffers it reads, the
        root's position and the visible columns computed in it, ancestors followed to the deepest a
        verify block allows (attention's mask is the same for any bound past the tree's depth, and the
        trees near an output's end, less deep, share the graph). The commit then appends the accepted
        rows where the cache's length ends (each layer's write position set here: the forward writes nothing)."""
        if depth_bound > self.block:
            raise ValueError(f"a tree {depth_bound} deep outgrows the verify block of {self.block} this StaticTarget was built for")
        self._fits(rows)
        window = self._window(rows)
        self._start.fill_(self.length)
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(self.length)
        buffers = {name: self._input(name, value) for name, value in inputs.items()}
        layers = [CacheWindow(layer.keys[:, :, :window], layer.values[:, :, :window]) for layer in self.cache.layers]
        return self.steps(("tree", rows, window), partial(forward, self._start, self._columns[:window], layers, self.block, **buffers))

    def _input(self, name: str, value) -> torch.Tensor:
        """`value` (a token, or a tensor or list of them) in the buffer of its name and length, on the device, without waiting."""
        value = on_device(torch.as_tensor(value).reshape(-1), self.device)
        buffer = self._inputs.get((name, len(value)))
        if buffer is None:
            buffer = self._inputs[name, len(value)] = torch.zeros(len(value), dtype=torch.long, device=self.device)
        return buffer.copy_(value)

    def checkpoint(self) -> CacheCheckpoint:
        return CacheCheckpoint(self.length, [])

    def rollback(self, checkpoint: CacheCheckpoint) -> None:
        self.length = checkpoint.length

    def rewind(self, checkpoint: CacheCheckpoint, kept: int) -> int:
        """Keeps the first `kept` tokens of the forward since `checkpoint`: all of them (their keys
        were computed from the committed tokens alone)."""
        self.length = checkpoint.length + kept
        return kept
