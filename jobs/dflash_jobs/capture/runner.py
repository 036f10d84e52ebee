"""The target's capture as one component, wired by the extraction worker and by online training alike.

`open_target` loads the target as the run asks (text model, cut after the deepest captured layer or
whole for the final hidden state; FP8 compute; the norms and MLPs compiled) and decides whether its
rows are packed on this device. `TargetCapture` then runs it: the planner lays samples into rows
under extract.token_budget (batching.py), the forward runs them (packing.py), and hooks on the
captured layers write each real token's states into one device buffer (hooks.py), at the rows the
caller names. Extraction copies the buffer to host memory and storage; online training hands it to
the drafter's step. Warm-up compiles and tunes every kernel on every row shape before the first real
batch, through the shortest prefix of layers that holds every layer type.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from dflash_jobs.capture import fp8, fusion, packing
from dflash_jobs.capture.batching import Batch, BatchPlanner, round_up, window_samples
from dflash_jobs.capture.checkpoint import local_checkpoint, read_config
from dflash_jobs.capture.hooks import LayerCapture
from dflash_jobs.capture.target import CaptureTarget, FastPaths, load_capture_target
from dflash_jobs.formats import TokenChunk
from dflash_jobs.spec import ExtractSpec, RunSpec, resolve_layers

log = logging.getLogger("dflash.capture")


@dataclass(frozen=True, slots=True)
class OpenedTarget:
    target: CaptureTarget
    fast: FastPaths
    packed: bool
    """Rows packed (several samples end to end) on this device, or right-padded (one sample a row)."""


def open_target(spec: RunSpec, device: torch.device, *, final_hidden: bool) -> OpenedTarget:
    """The run's target on `device`, as extraction and online training capture it."""
    extract = spec.extract
    if extract.compute_dtype == "float8":
        fp8.require_fp8(device)  # before minutes of loading: every pod would fail alike
    checkpoint = local_checkpoint(spec)
    _, config = read_config(spec.target, checkpoint)
    target = load_capture_target(spec.target, checkpoint=checkpoint, layers=resolve_layers(spec, config), device=device, final_hidden=final_hidden)
    fast = FastPaths.detect(device, target.architecture)
    if extract.compute_dtype == "float8":
        log.info("compute: %d linear layers of the target in FP8 (row-wise scaled)", fp8.to_float8(target.decoder_layers))
    if extract.compiled_on(device.type):
        log.info("compiled: %d norm and MLP modules of the target (torch.compile, graphs shared across layers)",
                 fusion.compile_elementwise(target.decoder_layers, target.architecture.fused_submodules))
    packed = packing.can_pack(target.architecture, device, fla=fast.fla)
    log.info("device %s; fast paths: %s; batches: %s", device, fast.describe(target.architecture),
             packing.layout(target.architecture, device, packed=packed, pad_multiple=extract.pad_multiple))
    return OpenedTarget(target, fast, packed)


class TargetCapture:
    """Runs batches of samples through the target, each real token's captured states landing in
    `hooks.buffer` (and `hooks.final`) at the rows the caller names."""

    def __init__(self, target: CaptureTarget, spec: ExtractSpec, *, packed: bool, max_length: int, capacity: int = 0) -> None:
        self.target = target
        self.max_length = max_length
        self.planner = BatchPlanner(
            token_budget=spec.token_budget, pad_multiple=spec.pad_multiple, packed=packed, gap=target.conv_gap if packed else 0,
        )
        if packed:
            packing.use_packed_attention(target.model)
        # A sample longer than the budget still runs, alone: the buffer holds the larger of both.
        self.hooks = LayerCapture(
            target.decoder_layers, target.layers, capacity=max(capacity, spec.token_budget, round_up(max_length, spec.pad_multiple)),
            hidden_size=target.hidden_size, dtype=target.dtype, device=target.device, final_layer=target.final_layer,
        )

    @property
    def device(self) -> torch.device:
        return self.target.device

    def forward(self, batch: Batch, rows: slice | torch.Tensor | None = None) -> None:
        """Runs `batch` (on the device); its real tokens' states go to `rows` of the buffers (by
        default the first ones, in the batch's order)."""
        self.hooks.start(batch.real_index, rows)
        self.target.model(**packing.forward_kwargs(batch, self.target.architecture))

    def warm_up(self) -> float:
        """Compiles and tunes the kernels on every row shape, through the shortest prefix of layers."""
        started = time.monotonic()
        batches = warmup_batches(self.planner, self.max_length, self.target.model.config.vocab_size)
        self.hooks.start(None)
        with torch.inference_mode(), shallow(self.target.model, warmup_depth(self.target.model)):
            for batch in batches:
                try:
                    self.target.model(**packing.forward_kwargs(batch.to(self.device), self.target.architecture))
                except torch.OutOfMemoryError:
                    log.warning("warm-up: a %s batch ran out of GPU memory; extract.token_budget %d is too large "
                                "for this GPU, so such batches will be split", batch.shape, self.planner.token_budget)
                    if self.device.type == "cuda":
                        torch.cuda.empty_cache()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.monotonic() - started
        log.info("warm-up: %d batch shapes in %.1f s", len(batches), elapsed)
        return elapsed

    def close(self) -> None:
        self.hooks.remove()


def warmup_depth(model: torch.nn.Module) -> int:
    """The shortest prefix of layers holding every layer type: enough to compile and tune every kernel."""
    types = list(getattr(model.config, "layer_types", None) or ["decoder"])
    return max(types.index(kind) for kind in set(types)) + 1


@contextmanager
def shallow(model: torch.nn.Module, depth: int) -> Iterator[None]:
    """Runs only the first `depth` layers (Transformers' decoders loop over config.num_hidden_layers)."""
    full = model.config.num_hidden_layers
    model.config.num_hidden_layers = min(depth, full)
    try:
        yield
    finally:
        model.config.num_hidden_layers = full


def synthetic_chunk(lengths: Sequence[int], vocab_size: int, seed: int = 0) -> TokenChunk:
    rng = np.random.default_rng(seed)
    total = int(sum(lengths))
    return TokenChunk(
        input_ids=rng.integers(0, vocab_size, total, dtype=np.int32),
        loss_mask=np.ones(total, dtype=np.uint8),
        cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        sample_ids=np.arange(len(lengths), dtype=np.int64),
    )


PACKED_WARMUP_STEPS = 8


def warmup_batches(planner: BatchPlanner, max_length: int, vocab_size: int) -> list[Batch]:
    """Batches of the shapes the run will use, so Triton compiles and autotunes before the first chunk.

    Padded: one per row length. Packed rows vary in length; FLA specializes a few kernels on
    quantities derived from it (l2norm: the row length in steps of 4096 tokens; integer
    arguments: divisibility by 16), so rows of budget * k / 8 tokens, round and odd, cover them."""
    if planner.packed:
        batches = []
        for step in range(1, PACKED_WARMUP_STEPS + 1):
            total = planner.token_budget * step // PACKED_WARMUP_STEPS
            for row in (total, total - 3 * step - 1):
                length = min(max_length, row - planner.gap)
                if length < 1:
                    continue
                count, rest = divmod(row, length + planner.gap)
                lengths = [length] * count + ([rest - planner.gap] if rest > planner.gap else [])
                chunk = synthetic_chunk(lengths, vocab_size)
                batches.append(planner.build(window_samples([chunk]), [chunk]))
        return batches
    batches = []
    for length in range(planner.pad_multiple, round_up(max_length, planner.pad_multiple) + 1, planner.pad_multiple):
        rows = max(1, planner.token_budget // length)
        chunk = synthetic_chunk([length] * rows, vocab_size)
        batches.append(planner.build(window_samples([chunk]), [chunk]))
    return batches
