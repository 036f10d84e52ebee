"""Benchmark of the extraction hot path (DESIGN section 5): steady state, side by side, same batches.

Stages (one JSON document, rewritten after every stage, so a run cut short keeps what it measured):

  setup     the target (random weights of the real Qwen3.6-27B text shape, cut after layer 61, or the
            tiny one through the real loading path), lognormal samples cut into chunks, the write
            speed of the work dir and of tmpfs (the floor of any store), GPU memory capped at
            --memory-gib (96: an RTX PRO 6000) for every stage;
  warmup    the extractor's own warm-up, cold (empty Triton cache) and timed;
  syncs     host synchronisations inside one forward (torch.cuda.set_sync_debug_mode), by caller;
  bf16      bare forward, extractor with its output on local disk, extractor on tmpfs, bare forward
            again: the same batches, all warm; ratios against the mean of both bare passes and each;
  profile   torch.profiler over a short extractor run: where CPU and GPU time go;
  exact     one packed batch against every sample run alone, and the varlen attention against SDPA;
  warm-pod  two more processes, pods of the node, each with the spec's default extract.compile:
            the first finds the Triton cache of warm-up but compiles its graphs, the second finds
            both; each: warm-up, time to its first forward (ready_s) and to its first stored chunk
            (first_chunk_s), from its own start;
  final     the extractor storing the target's final hidden state too (extract.final_hidden, for
            DSpark) against the plain extractor and bare forward, the same batches, all warm: one more
            [T, d] state per token through the same copies. It hooks the last layer of the model as
            built (61 of the cut 27B standing in for 63: the cost does not depend on which layer);
  fp8       --compute float8: the states' relative error per layer against bf16, then bare forward
            (bf16 and FP8) and the FP8 extractor on disk and tmpfs.
  compile   extract.compile (the target's norms and MLPs compiled) against eager on the target as
            the stages before left it (bf16, or FP8 after fp8): the states' relative error per layer,
            then a first compiled pass (recompiles for shapes warm-up did not see), and timed: bare
            eager, bare compiled, the compiled extractor on disk, bare compiled, bare eager.

Every stage but warm-pod and compile runs the target eager, as extract.compile: false does.
Throughput counts real (unpadded) tokens; MFU is against the H200's 989 TFLOP/s dense bf16 peak.
The target of each --shape and the data it runs on: bench/extract_shapes.py.

    python bench/extract.py --shape 27b --stages setup,warmup,syncs,bf16,profile,exact,warm-pod --out $OUT/extract.json
    python bench/extract.py --shape 27b --stages setup,warmup,final --out $OUT/extract-final.json
    python bench/extract.py --shape 27b --stages setup,warmup,fp8 --out $OUT/extract-fp8.json
    python bench/extract.py --shape 27b --stages setup,warmup,compile --out $OUT/extract-compile.json
    python bench/extract.py --shape tiny --device cpu --samples 24 --chunk-tokens 1024 --out /tmp/x.json   # CPU check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

STARTED = time.monotonic()  # a warm pod's clock starts with its process

import numpy as np
import torch

from dflash_jobs.capture import fp8, fusion, packing
from dflash_jobs.capture.batching import BatchPlanner, window_samples
from dflash_jobs.capture.hooks import LayerCapture
from dflash_jobs.extract.progress import Summary
from dflash_jobs.capture.target import FastPaths, Target
from dflash_jobs.extract.worker import ExtractWorker, iter_windows
from dflash_jobs.formats import TokenChunk
from dflash_jobs.spec import ExtractSpec

from extract_shapes import DiscardingStorage, bench_device, build_target, lognormal_chunks, model_flops, write_run

log = logging.getLogger("bench.extract")

H200_PEAK_FLOPS = 989e12
STAGES = ("setup", "warmup", "syncs", "bf16", "profile", "exact", "warm-pod", "final", "fp8", "compile")
OPT_IN_STAGES = ("final", "fp8", "compile")
"""Run only when asked; fp8 and compile change the target in place for the stages after them: run them last."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- the passes -------------------------------------------------------------------------------------


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


def bare_forward(target: Target, storage, infos, planner: BatchPlanner, window: int) -> dict:
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


def extractor(target: Target, root: Path, chunks: list[TokenChunk], spec: ExtractSpec, args, *, packed: bool) -> dict:
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


def count_syncs(target: Target, chunk: TokenChunk, planner: BatchPlanner) -> dict:
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


def profile(target: Target, root: Path, chunks: list[TokenChunk], spec: ExtractSpec, args, *, packed: bool) -> dict:
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


def capture(target: Target, chunk: TokenChunk, plan: BatchPlanner, refs, capture_buffer: LayerCapture, attention: str) -> torch.Tensor:
    batch = plan.build(refs, [chunk]).to(target.device)
    target.model.set_attn_implementation(attention)
    capture_buffer.start(batch.real_index)
    target.model(**packing.forward_kwargs(batch, target.architecture))
    sync(target.device)
    return capture_buffer.buffer[: batch.real_tokens].float().clone()


def capture_errors(target: Target, chunk: TokenChunk, planner: BatchPlanner, samples: int) -> dict:
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


# ---- the run ----------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("27b", "tiny"), default="27b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--stages", default=",".join(s for s in STAGES if s not in OPT_IN_STAGES), help=f"comma-separated, of {STAGES}")
    parser.add_argument("--samples", type=int, default=520, help="520 lognormal samples: about 540K tokens")
    parser.add_argument("--mean-length", type=float, default=1050)
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--chunk-tokens", type=int, default=65536)
    parser.add_argument("--token-budget", type=int, default=ExtractSpec().token_budget)
    parser.add_argument("--pad-multiple", type=int, default=64)
    parser.add_argument("--sort-window", type=int, default=ExtractSpec().sort_window)
    parser.add_argument("--memory-gib", type=float, default=96.0, help="cap on GPU memory for every stage (RTX PRO 6000: 96)")
    parser.add_argument("--workdir", type=Path, default=None, help="local disk for the store (default: a temp dir)")
    parser.add_argument("--tmpfs", type=Path, default=Path("/dev/shm/bench-extract"))
    parser.add_argument("--warm-pod", action="store_true", help="(internal) run as the second pod of a node")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    device = bench_device(args.device)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-extract-"))
    stages = args.stages.split(",")
    unknown = set(stages) - set(STAGES)
    if unknown:
        parser.error(f"unknown stages {sorted(unknown)}; choose from {STAGES}")
    if args.warm_pod:
        return warm_pod(args, device, workdir)

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    def stage(name: str, fn) -> None:
        if name not in stages:
            return
        started = time.perf_counter()
        log.info("stage %s", name)
        try:
            result[name] = fn()
        except Exception as exc:  # the other stages still report
            log.exception("stage %s failed", name)
            result[name] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
        result.setdefault("stage_seconds", {})[name] = round(time.perf_counter() - started, 1)
        save()

    triton_cache = os.environ.get("TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache"))
    result: dict = {
        "command": "python bench/extract.py " + shlex.join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton_cache": {"dir": triton_cache, "cold": not any(Path(triton_cache).rglob("*"))},
    }
    started = time.perf_counter()
    target = build_target(args.shape, device, workdir)
    sync(device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * 2**30 / total), device)
    fast = FastPaths.detect(device, target.architecture)
    packed = packing.can_pack(target.architecture, device, fla=fast.fla)
    chunks = lognormal_chunks(args.samples, mean=args.mean_length, max_length=args.max_length,
                              chunk_tokens=args.chunk_tokens, vocab=target.model.config.vocab_size, seed=0)
    lengths = np.concatenate([c.lengths for c in chunks])
    spec = ExtractSpec(shards=1, token_budget=args.token_budget, pad_multiple=args.pad_multiple, sort_window=args.sort_window)
    planner = BatchPlanner(token_budget=spec.token_budget, pad_multiple=spec.pad_multiple, packed=packed, gap=target.conv_gap if packed else 0)
    flops_per_token = model_flops(target, chunks) / lengths.sum()
    disk, tmpfs = workdir / "store", args.tmpfs

    def mfu(tokens_per_s: float) -> float:
        return round(flops_per_token * tokens_per_s / H200_PEAK_FLOPS, 4)

    def bare() -> dict:
        return bare_forward(target, *write_run(workdir / "bare", chunks), planner, spec.sort_window)

    def setup() -> dict:
        return {
            "shape": args.shape, "layers": target.layers, "model_build_s": round(time.perf_counter() - started, 1),
            "weights_gib": round(sum(p.numel() * p.element_size() for p in target.model.parameters()) / 2**30, 2),
            "memory_cap_gib": args.memory_gib if device.type == "cuda" else None,
            "fast_paths": fast.as_dict(), "layout": "packed" if packed else "padded",
            "attention": packing.attention_path(device) if packed else "SDPA, right-padded rows",
            "data": {"samples": int(len(lengths)), "chunks": len(chunks), "tokens": int(lengths.sum()),
                     "mean_length": round(float(lengths.mean()), 1), "max_length": int(lengths.max())},
            "gflop_per_token": round(flops_per_token / 1e9, 2),
            "write_speed": [write_speed(disk, 4.0 if args.shape == "27b" else 0.2), write_speed(tmpfs, 4.0 if args.shape == "27b" else 0.2)],
            "state_bytes_per_token": len(target.layers) * target.hidden_size * 2,
        }

    def warm(extract_spec: ExtractSpec, times: int = 1) -> list[float]:
        """The extractor's own warm-up: every batch shape through the shortest prefix of layers."""
        worker = ExtractWorker(extract_spec, target=target, storage=DiscardingStorage(workdir / "warmup"), chunks=[],
                               summary=Summary(shard=0, shards=1), max_length=args.max_length, packed=packed)
        try:
            with torch.inference_mode():
                return [worker.warm_up() for _ in range(times)]
        finally:
            worker.close()

    def warmup() -> dict:
        cold, again = warm(spec, times=2)
        return {"cold_s": round(cold, 1), "again_s": round(again, 1), "triton_cache_was_cold": result["triton_cache"]["cold"]}

    def syncs() -> dict | None:
        return count_syncs(target, chunks[0], planner) if device.type == "cuda" else None

    def bf16() -> dict:
        out = passes("bf16", {
            "bare_1": bare, "extractor_disk": lambda: extractor(target, disk, chunks, spec, args, packed=packed),
            "extractor_tmpfs": lambda: extractor(target, tmpfs, chunks, spec, args, packed=packed), "bare_2": bare,
        })
        bare_rates = [out["bare_1"]["tokens_per_s"], out["bare_2"]["tokens_per_s"]]
        out["bare_mean_tokens_per_s"] = round(statistics.mean(bare_rates), 1)
        for where in ("disk", "tmpfs"):
            rate = out[f"extractor_{where}"]["tokens_per_s"]
            out[f"ratio_{where}"] = {"vs_mean": round(rate / out["bare_mean_tokens_per_s"], 4),
                                     "vs_bare_1": round(rate / bare_rates[0], 4), "vs_bare_2": round(rate / bare_rates[1], 4)}
        out["mfu"] = {"bare": mfu(out["bare_mean_tokens_per_s"]), "extractor_disk": mfu(out["extractor_disk"]["tokens_per_s"]),
                      "extractor_tmpfs": mfu(out["extractor_tmpfs"]["tokens_per_s"])}
        return out

    def save_partial(name: str, value: dict) -> None:
        result[name] = value
        save()

    def passes(name: str, runs: dict) -> dict:
        """Each of `runs` in order into result[name], saved after each (a run cut short keeps what it measured)."""
        out: dict = {}
        for key, run in runs.items():
            out[key] = run()
            save_partial(name, out)
        return out

    def profiled() -> dict:
        return profile(target, tmpfs, chunks[:2], spec, args, packed=packed)

    def exact() -> dict:
        out = {"capture_error": capture_errors(target, chunks[0], planner, 8), "varlen_attention": varlen_attention_error(device)}
        out["capture_error_padded"] = capture_errors(target, chunks[0], BatchPlanner(token_budget=spec.token_budget, pad_multiple=spec.pad_multiple), 8)
        return out

    def pod(name: str) -> dict:
        out_file = workdir / f"{name}.json"
        command = [sys.executable, __file__, "--warm-pod", "--shape", args.shape, "--device", args.device, "--workdir", str(workdir / name),
                   "--samples", str(max(8, args.samples // 8)), "--mean-length", str(args.mean_length), "--max-length", str(args.max_length),
                   "--chunk-tokens", str(args.chunk_tokens), "--token-budget", str(args.token_budget), "--pad-multiple", str(args.pad_multiple),
                   "--sort-window", str(args.sort_window), "--memory-gib", str(args.memory_gib), "--out", str(out_file)]
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the pod needs its own room on this GPU
        launched = time.perf_counter()
        subprocess.run(command, check=True)
        report = json.loads(out_file.read_text())
        report["process_wall_s"] = round(time.perf_counter() - launched, 1)
        return report

    def pods() -> dict:
        # The first pod finds the Triton kernels of the warm-up stage but compiles its own graphs
        # (extract.compile, on by default on a GPU); the second finds both, as a node's later pods do.
        out = {"first_pod": pod("pod-1")}
        save_partial("warm-pod", out)
        out["warm_pod"] = pod("pod-2")
        return out

    def final_hidden() -> dict:
        with_final = dataclasses.replace(target, final_hidden=True)
        out = passes("final", {
            "bare_1": bare, "extractor_disk": lambda: extractor(target, disk, chunks, spec, args, packed=packed),
            "extractor_final_disk": lambda: extractor(with_final, disk, chunks, spec, args, packed=packed), "bare_2": bare,
        })
        out["final_layer"] = with_final.final_layer
        bare_mean = statistics.mean([out["bare_1"]["tokens_per_s"], out["bare_2"]["tokens_per_s"]])
        plain, final = out["extractor_disk"], out["extractor_final_disk"]
        out["ratio_vs_bare_mean"] = {"extractor": round(plain["tokens_per_s"] / bare_mean, 4),
                                     "extractor_final": round(final["tokens_per_s"] / bare_mean, 4)}
        out["ratio_final_vs_extractor"] = {"end_to_end": round(final["tokens_per_s"] / plain["tokens_per_s"], 4),
                                           "before_drain": round(final["tokens_per_s_before_drain"] / plain["tokens_per_s_before_drain"], 4)}
        out["bytes_ratio"] = round(final["bytes_written"] / plain["bytes_written"], 4)
        return out

    def sample_states() -> torch.Tensor:
        """The captured states of chunk 0's first 8 samples, one packed (or padded) batch, as the target computes them now."""
        refs = window_samples([chunks[0]])[:8]
        buffer = LayerCapture(target.decoder_layers, target.layers, capacity=sum(r.length + planner.gap for r in refs) + 64,
                              hidden_size=target.hidden_size, dtype=target.dtype, device=device)
        try:
            with torch.inference_mode():
                return capture(target, chunks[0], planner, refs, buffer, packing.PACKED_ATTENTION if packed else "sdpa")
        finally:
            buffer.remove()

    def float8() -> dict:
        if device.type == "cuda":
            fp8.require_fp8(device)
        out: dict = {}
        reference = sample_states()
        out["bare_bf16"] = bare()
        save_partial("fp8", out)
        converted = time.perf_counter()
        out["linear_layers_in_fp8"] = fp8.to_float8(target.decoder_layers, min_features=fp8.MIN_FEATURES if args.shape == "27b" else 16)
        out["convert_s"] = round(time.perf_counter() - converted, 1)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out["weights_gib"] = round(sum(t.numel() * t.element_size() for t in [*target.model.parameters(), *target.model.buffers()]) / 2**30, 2)
        out["relative_error_per_layer"] = dict(zip(map(str, target.layers), layer_errors(reference, sample_states())))
        save_partial("fp8", out)
        fp8_spec = dataclasses.replace(spec, compute_dtype="float8")
        out["warmup_fp8_s"] = round(warm(fp8_spec)[0], 1)
        out["bare_fp8"] = bare()
        save_partial("fp8", out)
        out["extractor_fp8_disk"] = extractor(target, disk, chunks, fp8_spec, args, packed=packed)
        save_partial("fp8", out)
        out["extractor_fp8_tmpfs"] = extractor(target, tmpfs, chunks, fp8_spec, args, packed=packed)
        out["speedup_bare"] = round(out["bare_fp8"]["tokens_per_s"] / out["bare_bf16"]["tokens_per_s"], 3)
        return out

    def compiled() -> dict:
        compute = "float8" if any(isinstance(m, fp8.Float8Linear) for m in target.model.modules()) else "bfloat16"
        compile_spec = dataclasses.replace(spec, compute_dtype=compute, compile=True)
        def eager():
            # Every compiled function of the process eager, FP8's quantization too. A new object per use:
            # set_stance sets the stance when it is constructed, not only inside its `with`.
            return torch.compiler.set_stance("force_eager")

        with eager():
            reference = sample_states()
        out: dict = {"compute": compute, "modules": fusion.compile_elementwise(target.decoder_layers, target.architecture.fused_submodules)}
        out["warmup_s"] = round(warm(compile_spec)[0], 1)
        out["relative_error_per_layer"] = dict(zip(map(str, target.layers), layer_errors(reference, sample_states())))
        save_partial("compile", out)
        # Warm-up compiles every module class, but batch sizes and strides it did not see recompile later: one
        # compiled pass first, so that the timed ones below are all warm.
        out["bare_compiled_first_pass"] = bare()
        save_partial("compile", out)
        with eager():
            out["bare_eager_1"] = bare()
        save_partial("compile", out)
        out["bare_compiled_1"] = bare()
        save_partial("compile", out)
        out["extractor_compiled_disk"] = extractor(target, disk, chunks, compile_spec, args, packed=packed)
        save_partial("compile", out)
        out["bare_compiled_2"] = bare()
        with eager():
            out["bare_eager_2"] = bare()
        eager_mean = statistics.mean([out["bare_eager_1"]["tokens_per_s"], out["bare_eager_2"]["tokens_per_s"]])
        compiled_mean = statistics.mean([out["bare_compiled_1"]["tokens_per_s"], out["bare_compiled_2"]["tokens_per_s"]])
        out["speedup_bare"] = round(compiled_mean / eager_mean, 3)
        out["ratio_disk_vs_compiled_bare"] = round(out["extractor_compiled_disk"]["tokens_per_s"] / compiled_mean, 4)
        out["mfu"] = {"bare_eager": mfu(eager_mean), "bare_compiled": mfu(compiled_mean),
                      "extractor_compiled_disk": mfu(out["extractor_compiled_disk"]["tokens_per_s"])}
        return out

    stage("setup", setup)
    stage("warmup", warmup)
    stage("syncs", syncs)
    stage("bf16", bf16)
    stage("profile", profiled)
    stage("exact", exact)
    stage("warm-pod", pods)
    stage("final", final_hidden)
    stage("fp8", float8)
    stage("compile", compiled)
    result["total_s"] = round(time.perf_counter() - started, 1)
    save()
    print(json.dumps({key: result[key] for key in result if key not in ("profile",)}, indent=2))
    return 0


def warm_pod(args, device: torch.device, workdir: Path) -> int:
    """A pod of the node: its own process, the node's kernel caches, one short extraction."""
    target = build_target(args.shape, device, workdir)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * 2**30 / total), device)
    built = time.monotonic() - STARTED
    fast = FastPaths.detect(device, target.architecture)
    packed = packing.can_pack(target.architecture, device, fla=fast.fla)
    chunks = lognormal_chunks(args.samples, mean=args.mean_length, max_length=args.max_length,
                              chunk_tokens=args.chunk_tokens, vocab=target.model.config.vocab_size, seed=1)
    storage, infos = write_run(workdir / "store", chunks)
    spec = ExtractSpec(shards=1, token_budget=args.token_budget, pad_multiple=args.pad_multiple, sort_window=args.sort_window)
    compiled = spec.compiled_on(device.type)
    if compiled:  # as the extraction job's worker does
        fusion.compile_elementwise(target.decoder_layers, target.architecture.fused_submodules)
    worker = ExtractWorker(spec, target=target, storage=storage, chunks=infos, summary=Summary(shard=0, shards=1),
                           max_length=args.max_length, packed=packed, started=STARTED)
    try:
        summary = worker.run()
    finally:
        worker.close()
    report = {"compiled": compiled, "model_build_s": round(built, 1), "warmup_s": summary.warmup_s, "ready_s": summary.ready_s,
              "first_chunk_s": summary.first_chunk_s, "tokens": summary.tokens, "tokens_per_s": summary.tokens_per_s,
              "note": "from the process start; a real pod loads the checkpoint where this one builds random weights"}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
