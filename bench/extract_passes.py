"""What bench/extract.py measures with: the write speed of a disk, a bare forward over the extractor's
batches, the extractor end to end, host synchronisations, a profile, and the captured states against
each sample alone. Each pass takes the target and its data as arguments; the stages that wire them
are bench/extract.py's.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from dflash_jobs.capture import packing
from dflash_jobs.capture.batching import BatchPlanner, window_samples
from dflash_jobs.capture.hooks import LayerCapture
from dflash_jobs.capture.target import CaptureTarget
from dflash_jobs.extract.progress import Summary
from dflash_jobs.extract.worker import ExtractWorker, iter_windows
from dflash_jobs.formats import TokenChunk
from dflash_jobs.spec import ExtractSpec

from extract_shapes import write_run


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_speed(directory: Path, gigabytes: float) -> dict:
    """Sequential write with fsync, what a chunk's store does: the floor of any extractor on this disk."""
    directory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(64 << 20)
    path = directory / "write-speed.bin"
    started = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(int(gigabytes * 1e9) // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - started
    size = path.stat().st_size
    path.unlink()
    filesystem = next((line.split()[2] for line in reversed(Path("/proc/mounts").read_text().splitlines())
                       if str(directory.resolve()).startswith(line.split()[1])), "?")
    return {"path": str(directory), "filesystem": filesystem, "gb_per_s": round(size / elapsed / 1e9, 2)}


def bare_forward(target: CaptureTarget, storage, infos, planner: BatchPlanner, window: int) -> dict:
    """The extractor's batches through the model, forward only, nothing captured."""
    device = target.device
    real = padded = 0
    elapsed = 0.0
    target.model.set_attn_implementation(packing.PACKED_ATTENTION if planner.packed else "sdpa")
    with torch.inference_mode():
        for win in iter_windows(storage, infos, planner, window):
            batches = [batch.to(device) for batch in win.batches]
            sync(device)
            started = time.perf_counter()
            for batch in batches:
                target.model(**packing.forward_kwargs(batch, target.architecture))
            sync(device)
            elapsed += time.perf_counter() - started
            real += sum(b.real_tokens for b in batches)
            padded += sum(b.padded_tokens for b in batches)
    return {"seconds": round(elapsed, 2), "real_tokens": real, "padded_tokens": padded,
            "tokens_per_s": round(real / elapsed, 1), "padding_waste": round(1 - real / padded, 4)}


def extractor(target: CaptureTarget, root: Path, chunks: list[TokenChunk], spec: ExtractSpec, args, *, packed: bool) -> dict:
    """ExtractWorker.run() end to end: chunks, integrity, store with fsync, done markers."""
    storage, infos = write_run(root, chunks)
    device = target.device
    worker = ExtractWorker(spec, target=target, storage=storage, chunks=infos, summary=Summary(shard=0, shards=1),
                           max_length=args.max_length, packed=packed, log_interval=10.0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        summary = worker.run()
    finally:
        worker.close()
    out = {"store": str(root), "seconds": summary.elapsed_s, "warmup_s": summary.warmup_s, "real_tokens": summary.tokens,
           "tokens_per_s": round(summary.tokens / summary.elapsed_s, 1), "drain_s": summary.drain_s,
           # What the stores had left at the GPU's last batch, and when each got through, from then.
           "drain_bytes": summary.drain_bytes, "drain_stores": worker.drain_stores,
           # The last chunk is stored after the GPU's last batch: a fixed tail, a rounding error in a shard of hours.
           "tokens_per_s_before_drain": round(summary.tokens / (summary.elapsed_s - summary.drain_s), 1),
           "padding_waste": summary.padding_waste,
           "chunks": summary.chunks_done, "bytes_written": summary.bytes, "host_wait_s": summary.host_wait_s,
           "oom_splits": summary.oom_splits}
    if device.type == "cuda":
        out["peak_gpu_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        out["peak_gpu_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
    shutil.rmtree(root, ignore_errors=True)
    return out


def count_syncs(target: CaptureTarget, chunk: TokenChunk, planner: BatchPlanner) -> dict:
    """Host synchronisations in one forward of a real batch, by the Python line that caused them."""
    device = target.device
    batch = planner.build(planner.plan(window_samples([chunk]))[0], [chunk]).to(device)
    sync(device)
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            target.model(**packing.forward_kwargs(batch, target.architecture))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(device)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    where: dict[str, int] = {}
    for w in syncs:
        key = f"{Path(w.filename).name}:{w.lineno}"
        where[key] = where.get(key, 0) + 1
    return {"per_forward": len(syncs), "where": where}


def profile(target: CaptureTarget, root: Path, chunks: list[TokenChunk], spec: ExtractSpec, args, *, packed: bool) -> dict:
    """torch.profiler over a short, warm extractor run: the top operators by GPU and by CPU time."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if target.device.type == "cuda" else [])
    started = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        run = extractor(target, root, chunks, spec, args, packed=packed)
    wall = time.perf_counter() - started
    events = prof.key_averages()

    def top(attribute: str, count: int = 15) -> list[dict]:
        rows = sorted(events, key=lambda e: getattr(e, attribute, 0), reverse=True)[:count]
        return [{"name": e.key[:90], "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 1),
                 "self_device_ms": round(getattr(e, "self_device_time_total", 0) / 1e3, 1)} for e in rows]

    device_ms = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3
    return {"run": run, "wall_s": round(wall, 1), "device_busy_ms": round(device_ms, 1),
            "top_device": top("self_device_time_total"), "top_cpu": top("self_cpu_time_total")}


def capture(target: CaptureTarget, chunk: TokenChunk, plan: BatchPlanner, refs, capture_buffer: LayerCapture, attention: str) -> torch.Tensor:
    batch = plan.build(refs, [chunk]).to(target.device)
    target.model.set_attn_implementation(attention)
    capture_buffer.start(batch.real_index)
    target.model(**packing.forward_kwargs(batch, target.architecture))
    sync(target.device)
    return capture_buffer.buffer[: batch.real_tokens].float().clone()


def capture_errors(target: CaptureTarget, chunk: TokenChunk, planner: BatchPlanner, samples: int) -> dict:
    """Max |batched - single| / max|single| per sample, for one batch of `samples` samples."""
    device = target.device
    refs = window_samples([chunk])[:samples]
    buffer = LayerCapture(target.decoder_layers, target.layers, capacity=sum(r.length + planner.gap for r in refs) + 64,
                          hidden_size=target.hidden_size, dtype=target.dtype, device=device)
    single = BatchPlanner(token_budget=buffer.capacity, pad_multiple=1)
    attention = packing.PACKED_ATTENTION if planner.packed else "sdpa"
    try:
        with torch.inference_mode():
            batched = capture(target, chunk, planner, refs, buffer, attention)
            errors, offset = [], 0
            for ref in refs:
                alone = capture(target, chunk, single, [ref], buffer, "sdpa")
                got = batched[offset:offset + ref.length]
                errors.append(float((got - alone).abs().max() / alone.abs().max()))
                offset += ref.length
    finally:
        buffer.remove()
        target.model.set_attn_implementation(attention)
    return {"samples": len(refs), "max_relative_error": max(errors), "mean_relative_error": float(np.mean(errors))}


def varlen_attention_error(device: torch.device) -> dict | None:
    """The packed row's varlen FlashAttention against causal SDPA per sample, at the 27B attention shape."""
    if device.type != "cuda" or packing.VARLEN is None:
        return None
    g = torch.Generator(device).manual_seed(0)
    lengths = [700, 1300, 37, 2048, 911]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    segments = tuple(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
    q = torch.randn(1, 24, bounds[-1], 256, device=device, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, 4, bounds[-1], 256, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    module = type("Module", (), {"num_key_value_groups": 6, "is_causal": True, "training": False})()
    with torch.inference_mode():
        fast, _ = packing.packed_attention(module, q, k, v, None, segments=segments, scaling=256**-0.5,
                                           segment_bounds=torch.tensor(bounds, device=device, dtype=torch.int32))
        reference = packing.per_sample_sdpa(q, k, v, segments, module=module, scaling=256**-0.5, dropout=0.0)
    error = float((fast.float() - reference.float()).norm() / reference.float().norm())
    return {"path": packing.attention_path(device), "relative_error": error}


def layer_errors(reference: torch.Tensor, got: torch.Tensor) -> list[float]:
    """||got - ref|| / ||ref|| per captured layer ([T, L, d] each)."""
    return [round(float((got[:, j] - reference[:, j]).norm() / reference[:, j].norm()), 5) for j in range(reference.shape[1])]
