"""From the samples of a window of chunks to forward batches under a token budget.

Two layouts, both exact (every real token's hidden state equals an unbatched forward's):

- padded: one sample per row, right-padded to the batch length, which is rounded up to
  `pad_multiple` so only a few shapes exist (each new one can cost Triton autotuning). Causal
  layers never let later pads influence earlier tokens, so no attention mask is needed. Samples
  are sorted by length across the whole window (several chunks), longest first (an OOM shows up
  in the first minute), and cut into batches by a small dynamic program that minimises padded
  tokens plus a per-batch cost (fewer, fuller forwards run faster).
- packed: the samples laid end to end in one row, each followed by `gap` masked tokens
  (conv kernel - 1). The Gated DeltaNet layers get `cu_seq_lens_q` (FLA resets the recurrent
  state at each boundary) and a mask that zeroes the gap tokens before their bias-free
  projections, so the causal conv of the next sample sees zeros exactly as at the start of an
  unpadded sequence; attention runs per sample (packing.py). Waste is the gaps alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dflash_jobs.formats import TokenChunk

PAD_TOKEN = 0
"""Id of padding and gap tokens: their outputs are never read, so any id works."""


@dataclass(frozen=True, slots=True)
class SampleRef:
    """One sample of the window: which chunk (its position in the window), which sample, where."""

    slot: int
    index: int
    start: int
    length: int


@dataclass(slots=True)
class Batch:
    samples: list[SampleRef]
    input_ids: torch.Tensor  # int64 [rows, length]
    real_index: torch.Tensor  # int64 [real tokens]: flat position of every real token, samples in order
    packed: bool
    position_ids: torch.Tensor | None = None  # packed: int64 [1, length], restarting at every sample
    token_mask: torch.Tensor | None = None  # packed: int64 [1, length], 0 on gap tokens
    cu_seqlens: torch.Tensor | None = None  # packed: int64 [samples + 1], segment boundaries (gaps included)
    segments: tuple[tuple[int, int], ...] = ()  # packed: the same boundaries as Python ints, for attention

    @property
    def real_tokens(self) -> int:
        return int(self.real_index.numel())

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    def to(self, device: torch.device) -> Batch:
        return self.map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> Batch:
        """Pinned: from pageable memory a copy to the GPU waits for the stream to reach it (a sync per batch)."""
        return self.map(lambda t: t.pin_memory())

    def map(self, fn) -> Batch:
        """The same batch with `fn` applied to each of its tensors."""
        moved = {name: getattr(self, name) for name in BATCH_TENSORS}
        return Batch(self.samples, packed=self.packed, segments=self.segments,
                     **{name: None if t is None else fn(t) for name, t in moved.items()})


BATCH_TENSORS = ("input_ids", "real_index", "position_ids", "token_mask", "cu_seqlens")


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True, slots=True)
class BatchPlanner:
    token_budget: int
    """Padded (or packed) tokens per forward."""
    pad_multiple: int
    """Padded row lengths are multiples of this."""
    packed: bool = False
    gap: int = 0
    """Masked tokens after every packed sample: the causal conv's kernel size - 1."""

    @property
    def batch_cost(self) -> int:
        """What one more forward costs, in padded tokens: smaller forwards run at lower efficiency."""
        return self.token_budget // 16

    def row_length(self, length: int) -> int:
        return round_up(length, self.pad_multiple)

    def plan(self, samples: Sequence[SampleRef]) -> list[list[SampleRef]]:
        """Groups the window's samples into batches (their order is the processing order)."""
        return self._plan_packed(samples) if self.packed else self._plan_padded(samples)

    def _plan_packed(self, samples: Sequence[SampleRef]) -> list[list[SampleRef]]:
        # In window order, so chunks complete one after another and uploads spread out.
        batches: list[list[SampleRef]] = []
        current: list[SampleRef] = []
        used = 0
        for sample in samples:
            size = sample.length + self.gap
            if current and used + size > self.token_budget:
                batches.append(current)
                current, used = [], 0
            current.append(sample)
            used += size
        if current:
            batches.append(current)
        return batches

    def _plan_padded(self, samples: Sequence[SampleRef]) -> list[list[SampleRef]]:
        ordered = sorted(samples, key=lambda s: (-s.length, s.slot, s.index))
        n = len(ordered)
        # best[j]: least cost of batching ordered[:j]; a batch ordered[i:j] is padded to ordered[i].
        best = [0] + [float("inf")] * n
        cut = [0] * (n + 1)
        for j in range(1, n + 1):
            for i in range(j - 1, -1, -1):
                rows, length = j - i, self.row_length(ordered[i].length)
                if rows > 1 and rows * length > self.token_budget:
                    break  # a sample longer than the budget still gets a batch of its own
                cost = best[i] + rows * length + self.batch_cost
                if cost < best[j]:
                    best[j], cut[j] = cost, i
        batches = []
        j = n
        while j > 0:
            batches.append(ordered[cut[j]:j])
            j = cut[j]
        return batches[::-1]

    def build(self, samples: Sequence[SampleRef], chunks: Sequence[TokenChunk]) -> Batch:
        """The batch's tensors, on the CPU (the worker moves them to the device)."""
        pieces = [chunks[s.slot].input_ids[s.start:s.start + s.length] for s in samples]
        return self._build_packed(samples, pieces) if self.packed else self._build_padded(samples, pieces)

    def _build_padded(self, samples: Sequence[SampleRef], pieces: list[np.ndarray]) -> Batch:
        length = self.row_length(max(s.length for s in samples))
        ids = np.full((len(samples), length), PAD_TOKEN, dtype=np.int64)
        real = []
        for row, piece in enumerate(pieces):
            ids[row, :len(piece)] = piece
            real.append(row * length + np.arange(len(piece)))
        return Batch(list(samples), torch.from_numpy(ids), torch.from_numpy(np.concatenate(real)), packed=False)

    def _build_packed(self, samples: Sequence[SampleRef], pieces: list[np.ndarray]) -> Batch:
        sizes = np.array([len(p) + self.gap for p in pieces])
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        total = int(bounds[-1])
        ids = np.full(total, PAD_TOKEN, dtype=np.int64)
        mask = np.zeros(total, dtype=np.int64)
        positions = np.arange(total) - np.repeat(bounds[:-1], sizes)
        real = []
        for start, piece in zip(bounds[:-1], pieces):
            ids[start:start + len(piece)] = piece
            mask[start:start + len(piece)] = 1
            real.append(start + np.arange(len(piece)))
        return Batch(
            list(samples),
            torch.from_numpy(ids)[None],
            torch.from_numpy(np.concatenate(real)),
            packed=True,
            position_ids=torch.from_numpy(positions)[None],
            token_mask=torch.from_numpy(mask)[None],
            cu_seqlens=torch.from_numpy(bounds.astype(np.int64)),
            segments=tuple(zip(bounds[:-1].tolist(), bounds[1:].tolist())),
        )

    def split(self, batch: Batch, chunks: Sequence[TokenChunk]) -> list[Batch]:
        """Halves a batch that ran out of memory; a single sample cannot be split."""
        if len(batch.samples) < 2:
            return []
        half = len(batch.samples) // 2
        return [self.build(batch.samples[:half], chunks), self.build(batch.samples[half:], chunks)]


def window_samples(chunks: Sequence[TokenChunk]) -> list[SampleRef]:
    """Every sample of a window of chunks, in chunk then sample order."""
    refs = []
    for slot, chunk in enumerate(chunks):
        starts = chunk.cu_seqlens[:-1].tolist()
        for index, (start, length) in enumerate(zip(starts, chunk.lengths.tolist())):
            refs.append(SampleRef(slot, index, start, length))
    return refs
