"""The extraction loop of one shard: windows of chunks -> batches -> forward + capture -> writer.

    for each window of `sort_window` pending chunks (loaded and planned one window ahead):
        for each batch: forward with hooks -> async copies into the chunks' host buffers
        each chunk whose samples are all copied -> writer: integrity -> store -> done marker

The GPU thread never waits on a copy or an upload; it blocks when every chunk buffer is in use
(the back-pressure of a writer that cannot keep up; the time is reported as host_wait_s) and, at
a window's start, on its token chunks if the one-window-ahead read has not finished.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_jobs.devices import pick_device
from dflash_jobs.errors import FormatError, InputError
from dflash_jobs.extract import fp8, fusion, packing
from dflash_jobs.extract.batching import Batch, BatchPlanner, round_up, window_samples
from dflash_jobs.extract.capture import BufferPool, DeviceToHost, LayerCapture, Run, merge_runs
from dflash_jobs.extract.progress import Progress, Summary
from dflash_jobs.extract.sharding import shard_chunks
from dflash_jobs.extract.target import FastPaths, Target, load_target, local_checkpoint, read_config
from dflash_jobs.extract.writer import WRITER_THREADS, ChunkAssembly, ChunkMetadata, ChunkWriter
from dflash_jobs.formats import (
    DATASET_KEY, DONE_MARKERS, ChunkInfo, DatasetIndex, DoneMarker, TokenChunk, done_key, hidden_chunk_key, token_chunk_key,
)
from dflash_jobs.spec import ExtractSpec, RunSpec, resolve_layers
from dflash_jobs.storage import ObjectNotFound, Storage, open_storage, storage_for

log = logging.getLogger("dflash.extract")


# ---- which chunks still need work -----------------------------------------------------------------


def chunk_is_done(storage: Storage, chunk: ChunkInfo, expected: ChunkMetadata) -> bool:
    """The marker exists, describes this chunk as this run extracts it (samples, tokens, layers,
    dtype, compute dtype, hidden size, and the final hidden state when the run stores it: a chunk
    that holds one the run does not ask for is kept), and its object matches it (size, and etag when
    both have one).

    A stale marker (its object missing or different, or from other settings) is deleted, so the
    redone chunk can commit; verify would reject it otherwise, one round later."""
    key = done_key(chunk.id)
    try:
        marker = DoneMarker.from_json(storage.get_bytes(key), key)
    except FormatError:
        marker = None
    if marker is not None and (marker.samples, marker.tokens, marker.layers, marker.dtype, marker.hidden_size, marker.compute_dtype) == (
        chunk.samples, chunk.tokens, expected.layers, expected.dtype, expected.hidden_size, expected.compute_dtype
    ) and expected.final_hidden in (None, marker.final_hidden):
        info = storage.stat(hidden_chunk_key(chunk.id))
        if info is not None and info.size == marker.bytes and (info.etag is None or marker.etag is None or info.etag == marker.etag):
            return True
    log.warning("chunk %06d: done marker does not match its object or this run's settings; redoing the chunk", chunk.id)
    storage.delete(key)
    return False


def pending_chunks(storage: Storage, chunks: Sequence[ChunkInfo], expected: ChunkMetadata) -> list[ChunkInfo]:
    """The chunks without a valid done marker. A chunk object without a marker is redone (the marker commits)."""
    marked = set(storage.list(DONE_MARKERS))
    return [c for c in chunks if done_key(c.id) not in marked or not chunk_is_done(storage, c, expected)]


# ---- windows: chunks loaded and planned together ----------------------------------------------------


@dataclass(slots=True)
class Window:
    chunks: list[ChunkInfo]
    tokens: list[TokenChunk]
    batches: list[Batch]
    """Built on the loader thread, pinned for a GPU: the GPU thread only launches work."""
    open: dict[int, ChunkAssembly] = field(default_factory=dict)
    """The window's chunks that hold a buffer, by position in the window: taken at the first sample."""

    def assembly(self, slot: int, writer: ChunkWriter) -> ChunkAssembly:
        if slot not in self.open:
            self.open[slot] = writer.open(self.chunks[slot], self.tokens[slot])
        return self.open[slot]


def load_window(storage: Storage, chunks: Sequence[ChunkInfo], planner: BatchPlanner, *, pin: bool = False) -> Window:
    tokens = [TokenChunk.decode(storage.get_bytes(token_chunk_key(c.id)), token_chunk_key(c.id)) for c in chunks]
    for info, chunk in zip(chunks, tokens):
        if chunk.num_samples != info.samples or chunk.num_tokens != info.tokens:
            raise InputError(
                f"{token_chunk_key(info.id)} holds {chunk.num_samples} samples / {chunk.num_tokens} tokens, "
                f"tokens/dataset.json says {info.samples} / {info.tokens}", "Re-run prepare",
            )
    batches = [planner.build(samples, tokens) for samples in planner.plan(window_samples(tokens))]
    # From pageable memory a copy to the GPU waits for the stream to reach it (a sync per batch).
    return Window(list(chunks), tokens, [pin_batch(batch) for batch in batches] if pin else batches)


def iter_windows(
    storage: Storage, chunks: Sequence[ChunkInfo], planner: BatchPlanner, size: int, *, pin: bool = False,
) -> Iterator[Window]:
    """Windows of `size` chunks; the next one is read, planned and built while the current one runs."""
    groups = [chunks[i:i + size] for i in range(0, len(chunks), size)]
    with ThreadPoolExecutor(1, thread_name_prefix="window-loader") as pool:
        future = pool.submit(load_window, storage, groups[0], planner, pin=pin) if groups else None
        for index in range(len(groups)):
            window = future.result()
            if index + 1 < len(groups):
                future = pool.submit(load_window, storage, groups[index + 1], planner, pin=pin)
            yield window


# ---- running batches --------------------------------------------------------------------------


BATCH_TENSORS = ("input_ids", "real_index", "position_ids", "token_mask", "cu_seqlens")


def _map_tensors(batch: Batch, fn) -> Batch:
    moved = {name: getattr(batch, name) for name in BATCH_TENSORS}
    return Batch(batch.samples, packed=batch.packed, segments=batch.segments,
                 **{name: None if t is None else fn(t) for name, t in moved.items()})


def to_device(batch: Batch, device: torch.device) -> Batch:
    return _map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def pin_batch(batch: Batch) -> Batch:
    return _map_tensors(batch, lambda t: t.pin_memory())


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


class ExtractWorker:
    """Extracts the hidden states of one shard's chunks."""

    def __init__(
        self,
        spec: ExtractSpec,
        *,
        target: Target,
        storage: Storage,
        chunks: Sequence[ChunkInfo],
        summary: Summary,
        max_length: int,
        packed: bool,
        log_interval: float = 10.0,
        started: float | None = None,
    ) -> None:
        self.spec = spec
        self.target = target
        self.storage = storage
        self.chunks = list(chunks)
        self.summary = summary
        self.max_length = max_length
        self.device = target.device
        self.started = time.monotonic() if started is None else started  # the pod's start, for ready_s
        self.planner = BatchPlanner(
            token_budget=spec.token_budget, pad_multiple=spec.pad_multiple, packed=packed, gap=target.conv_gap if packed else 0,
        )
        if packed:
            packing.use_packed_attention(target.model)
        # A sample longer than the budget still runs, alone: the buffer holds the larger of both.
        capacity = max(spec.token_budget, round_up(max_length, spec.pad_multiple))
        self.capture = LayerCapture(
            target.decoder_layers, target.layers, capacity=capacity, hidden_size=target.hidden_size,
            dtype=target.dtype, device=self.device, final_layer=target.final_layer,
        )
        self.transfer = DeviceToHost(self.capture, storage_dtype=spec.dtype)
        # A window's chunks can all be open at once (padded batches mix them), plus those being stored.
        self.pool = BufferPool(
            size=spec.sort_window + WRITER_THREADS, capacity=max((c.tokens for c in self.chunks), default=1),
            layers=len(target.layers), hidden_size=target.hidden_size, dtype=self.transfer.state_dtype,
            pinned=self.device.type == "cuda", final_hidden=target.final_hidden,
        )
        self.metadata = ChunkMetadata(
            layers=target.layers, hidden_size=target.hidden_size, model=target.name,
            config_hash=target.config_hash, dtype=spec.dtype, shard=summary.shard, compute_dtype=spec.compute_dtype,
            final_hidden=spec.dtype if target.final_hidden else None,
        )
        self.log_interval = log_interval
        self.progress: Progress | None = None
        self.writer: ChunkWriter | None = None

    def warm_up(self) -> float:
        """Compiles and tunes the kernels on every batch shape, through the shortest prefix of layers."""
        started = time.monotonic()
        vocab = self.target.model.config.vocab_size
        batches = warmup_batches(self.planner, self.max_length, vocab)
        self.capture.start(None)
        with shallow(self.target.model, warmup_depth(self.target.model)):
            for batch in batches:
                try:
                    self.target.model(**packing.forward_kwargs(to_device(batch, self.device), self.target.architecture))
                except torch.OutOfMemoryError:
                    log.warning("warm-up: a %s batch ran out of GPU memory; extract.token_budget %d is too large "
                                "for this GPU, so such batches will be split", batch.shape, self.spec.token_budget)
                    if self.device.type == "cuda":
                        torch.cuda.empty_cache()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.monotonic() - started
        log.info("warm-up: %d batch shapes in %.1f s", len(batches), elapsed)
        return elapsed

    @torch.inference_mode()
    def run(self) -> Summary:
        summary = self.summary
        summary.chunks_total = len(self.chunks)
        pending = pending_chunks(self.storage, self.chunks, self.metadata)
        summary.chunks_skipped = len(self.chunks) - len(pending)
        log.info("shard %d/%d: %d chunks, %d already done, %d to extract (%s tokens)",
                 summary.shard, summary.shards, len(self.chunks), summary.chunks_skipped, len(pending),
                 f"{sum(c.tokens for c in pending):,}")
        if not pending:
            return summary
        self.pool.start(len(pending))
        log.info("host buffers: %d of %.2f GB%s, allocated while the kernels warm up", min(len(pending), self.pool.size),
                 self.pool.buffer_bytes / 1e9, " pinned" if self.pool.pinned else "")
        summary.warmup_s = round(self.warm_up(), 1)
        self.progress = Progress(summary, total_tokens=sum(c.tokens for c in pending), interval=self.log_interval)
        # Packed batches take a window's samples in order, so the last chunk's rows fill from the first:
        # it is stored while they do, and the end waits only for its last batch's rows (the drain).
        self.writer = ChunkWriter(storage=self.storage, metadata=self.metadata, pool=self.pool, on_commit=self._committed,
                                  streamed=pending[-1].id if self.planner.packed else None)
        self.progress.start()
        try:
            for window in iter_windows(self.storage, pending, self.planner, self.spec.sort_window, pin=self.device.type == "cuda"):
                for batch in window.batches:
                    self.run_batch(batch, window)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            forwarded = time.monotonic()
            self.writer.close()
            summary.drain_s = round(time.monotonic() - forwarded, 1)
        except BaseException:
            self.writer.drain()  # nothing is mid-store when the error ends the process
            raise
        finally:
            summary.host_wait_s = round(self.writer.waited_s, 1)
        self.progress.log()
        return summary

    def _committed(self, marker: DoneMarker) -> None:
        self.progress.committed(marker.samples, marker.tokens, marker.bytes)
        if not self.summary.first_chunk_s:
            self.summary.first_chunk_s = round(time.monotonic() - self.started, 1)

    def run_batch(self, batch: Batch, window: Window) -> None:
        """Forward + capture of one batch; a batch that runs out of memory is halved and retried."""
        try:
            self._forward(batch, window)
        except torch.OutOfMemoryError:
            halves = self.planner.split(batch, window.tokens)
            if not halves:
                sample = batch.samples[0]
                raise InputError(
                    f"sample {window.tokens[sample.slot].sample_ids[sample.index]} of chunk {window.chunks[sample.slot].id:06d} "
                    f"({sample.length} tokens) does not fit in GPU memory even alone",
                    "Lower data.max_length and re-run prepare, or use GPUs with more memory",
                ) from None
            self.summary.oom_splits += 1
            log.warning("batch of %d samples (%s tokens) ran out of GPU memory: split in two", len(batch.samples), batch.padded_tokens)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            for half in halves:
                self.run_batch(half, window)

    def _forward(self, batch: Batch, window: Window) -> None:
        on_device = to_device(batch, self.device)
        self.capture.start(on_device.real_index)
        self.target.model(**packing.forward_kwargs(on_device, self.target.architecture))
        if not self.summary.ready_s:
            self.summary.ready_s = round(time.monotonic() - self.started, 1)
        # While the forward runs: where each sample's rows go (a chunk takes its buffer here, which can wait).
        runs, offset = [], 0
        for sample in batch.samples:
            assembly = window.assembly(sample.slot, self.writer)
            runs.append(Run(assembly.buffer, offset, assembly.rows(sample.index)[0], sample.length))
            offset += sample.length
        copied = self.transfer.launch(merge_runs(runs), on_device.input_ids, on_device.real_index)
        for sample in batch.samples:
            assembly = window.open[sample.slot]
            assembly.placed(sample.index, copied)
            if assembly.remaining == 0:
                self.writer.submit(assembly)
        self.progress.batch(batch.real_tokens, batch.padded_tokens)

    def close(self) -> None:
        self.capture.remove()


# ---- wiring -------------------------------------------------------------------------------------


def build_worker(spec: RunSpec, shard: int, *, summary: Summary, started: float | None = None) -> ExtractWorker:
    """Everything shard `shard` needs: its chunks, the target on its device, the output storage."""
    storage = storage_for(spec)
    try:
        index = DatasetIndex.from_json(storage.get_bytes(DATASET_KEY), DATASET_KEY)
    except ObjectNotFound:
        raise InputError(f"{storage.url}/{DATASET_KEY} does not exist", "Run `dflashctl prepare` first") from None
    chunks = shard_chunks(index.chunks, spec.extract.shards, shard)
    device = pick_device(spec)
    if spec.extract.compute_dtype == "float8":
        fp8.require_fp8(device)  # before minutes of loading: every shard would fail alike
    fast = FastPaths.detect(device)
    summary.fast_paths = fast.as_dict()
    checkpoint = local_checkpoint(
        spec.target, lambda url: open_storage(url, endpoint_url=spec.storage.endpoint_url, region=spec.storage.region)
    )
    _, config = read_config(spec.target, checkpoint)
    layers = resolve_layers(spec, config)
    target = load_target(spec.target, checkpoint=checkpoint, layers=layers, device=device, final_hidden=spec.stores_final_hidden)
    if spec.extract.compute_dtype == "float8":
        log.info("compute: %d linear layers of the target in FP8 (row-wise scaled)", fp8.to_float8(target.decoder_layers))
    if spec.extract.compiled_on(device.type):
        log.info("compiled: %d norm and MLP modules of the target (torch.compile, graphs shared across layers)",
                 fusion.compile_elementwise(target.decoder_layers))
    packed = packing.can_pack(target.architecture, device, fla=fast.fla)
    log.info(
        "device %s; fast paths: flash-linear-attention %s, causal-conv1d %s; batches: %s",
        device, "on" if fast.fla else "OFF (torch fallback)", "on" if fast.causal_conv1d else "off (torch fallback, slower)",
        packing.layout(target.architecture, device, packed=packed, pad_multiple=spec.extract.pad_multiple),
    )
    return ExtractWorker(
        spec.extract, target=target, storage=storage, chunks=chunks, summary=summary,
        max_length=spec.data.max_length, packed=packed, started=started,
    )
