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
  fp8       extract.compute_dtype: float8: the states' relative error per layer against bf16, then bare
            forward (bf16 and FP8) and the FP8 extractor on disk and tmpfs.
  compile   extract.compile (the target's norms and MLPs compiled) against eager on the target as
            the stages before left it (bf16, or FP8 after fp8): the states' relative error per layer,
            then a first compiled pass (recompiles for shapes warm-up did not see), and timed: bare
            eager, bare compiled, the compiled extractor on disk, bare compiled, bare eager.
  kernels   the forward as the extraction job runs it by default (compiled; its linear layers in FP8
            with --kernels-compute float8, or after fp8), warm, a bare pass over the first
            --kernels-chunks chunks under torch.profiler: its kernels by kind (GEMMs, attention,
            Gated DeltaNet, compiled elementwise, ...), the GPU's idle share, the GEMMs' TFLOP/s and
            the ceiling they leave (bench/kernel_kinds.py): what bounds the forward.

Every stage but warm-pod and compile runs the target eager, as extract.compile: false does.
Throughput counts real (unpadded) tokens; MFU is against the H200's 989 TFLOP/s dense bf16 peak.
The target of each --shape and the data it runs on: bench/extract_shapes.py; the passes each stage
times: bench/extract_passes.py.

    python bench/extract.py --shape 27b --stages setup,warmup,syncs,bf16,profile,exact,warm-pod --out $OUT/extract.json
    python bench/extract.py --shape 27b --stages setup,warmup,final --out $OUT/extract-final.json
    python bench/extract.py --shape 27b --stages setup,warmup,fp8 --out $OUT/extract-fp8.json
    python bench/extract.py --shape 27b --stages setup,warmup,compile --out $OUT/extract-compile.json
    python bench/extract.py --shape 27b --stages setup,kernels --kernels-compute float8 --out $OUT/extract-kernels-fp8.json
    python bench/extract.py --shape tiny --device cpu --samples 24 --chunk-tokens 1024 --out /tmp/x.json   # CPU check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.monotonic()  # a warm pod's clock starts with its process

import numpy as np
import torch
from torch.profiler import ProfilerActivity

from dflash_jobs.capture import fp8, fusion, packing
from dflash_jobs.capture.batching import BatchPlanner, window_samples
from dflash_jobs.capture.hooks import LayerCapture
from dflash_jobs.extract.progress import Summary
from dflash_jobs.capture.target import CaptureTarget, FastPaths
from dflash_jobs.extract.worker import ExtractWorker
from dflash_jobs.formats import TokenChunk
from dflash_jobs.spec import ExtractSpec

from extract_passes import (bare_forward, capture, capture_errors, count_syncs, extractor, layer_errors, profile, sync,
                            varlen_attention_error, write_speed)
from extract_shapes import DiscardingStorage, bench_device, build_target, lognormal_chunks, model_flops, write_run
from kernel_kinds import kernel_kinds, linear_flops_per_token

log = logging.getLogger("bench.extract")

H200_PEAK_FLOPS = 989e12
PEAK_FLOPS = {"bfloat16": H200_PEAK_FLOPS, "float8": 2 * H200_PEAK_FLOPS}
"""Dense tensor-core peaks of an H100 / H200 SXM by the GEMMs' input dtype."""
STAGES = ("setup", "warmup", "syncs", "bf16", "profile", "exact", "warm-pod", "final", "fp8", "compile", "kernels")
OPT_IN_STAGES = ("final", "fp8", "compile", "kernels")
"""Run only when asked; fp8 and compile change the target in place for the stages after them: run them last."""


# ---- the stages -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Bench:
    """What every stage works on: one target (fp8 and compile change it in place), the same chunks and
    spec, and the one result document, written after every stage (and inside a long one) so a run cut
    short keeps it."""

    args: argparse.Namespace
    device: torch.device
    workdir: Path
    started: float
    result: dict
    target: CaptureTarget
    fast: FastPaths
    packed: bool
    chunks: list[TokenChunk]
    spec: ExtractSpec
    planner: BatchPlanner
    flops_per_token: float
    disk: Path
    tmpfs: Path
    compiled: bool = False
    """Whether a stage compiled the target's norms and MLPs (in place, for the stages after it)."""

    def save(self) -> None:
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(json.dumps(self.result, indent=2) + "\n")

    def save_partial(self, name: str, value: dict) -> None:
        self.result[name] = value
        self.save()

    def passes(self, name: str, runs: dict) -> dict:
        """Each of `runs` in order into result[name], saved after each (a run cut short keeps what it measured)."""
        out: dict = {}
        for key, run in runs.items():
            out[key] = run()
            self.save_partial(name, out)
        return out

    def mfu(self, tokens_per_s: float) -> float:
        return round(self.flops_per_token * tokens_per_s / H200_PEAK_FLOPS, 4)

    def bare(self, chunks: list[TokenChunk] | None = None) -> dict:
        chunks = self.chunks if chunks is None else chunks
        return bare_forward(self.target, *write_run(self.workdir / "bare", chunks), self.planner, self.spec.sort_window)

    def extract(self, root: Path, spec: ExtractSpec | None = None, target: CaptureTarget | None = None) -> dict:
        target, spec = self.target if target is None else target, self.spec if spec is None else spec
        return extractor(target, root, self.chunks, spec, self.args, packed=self.packed)

    def warm(self, extract_spec: ExtractSpec, times: int = 1) -> list[float]:
        """The extractor's own warm-up: every batch shape through the shortest prefix of layers."""
        worker = ExtractWorker(extract_spec, target=self.target, storage=DiscardingStorage(self.workdir / "warmup"), chunks=[],
                               summary=Summary(shard=0, shards=1), max_length=self.args.max_length, packed=self.packed)
        try:
            with torch.inference_mode():
                return [worker.warm_up() for _ in range(times)]
        finally:
            worker.close()

    def sample_states(self) -> torch.Tensor:
        """The captured states of chunk 0's first 8 samples, one packed (or padded) batch, as the target computes them now."""
        target, planner = self.target, self.planner
        refs = window_samples([self.chunks[0]])[:8]
        buffer = LayerCapture(target.decoder_layers, target.layers, capacity=sum(r.length + planner.gap for r in refs) + 64,
                              hidden_size=target.hidden_size, dtype=target.dtype, device=self.device)
        try:
            with torch.inference_mode():
                return capture(target, self.chunks[0], planner, refs, buffer, packing.PACKED_ATTENTION if self.packed else "sdpa")
        finally:
            buffer.remove()


def open_bench(args: argparse.Namespace, device: torch.device, workdir: Path) -> Bench:
    """The target, capped to --memory-gib, and the data every stage runs on."""
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
    return Bench(args=args, device=device, workdir=workdir, started=started, result=result, target=target, fast=fast,
                 packed=packed, chunks=chunks, spec=spec, planner=planner,
                 flops_per_token=model_flops(target, chunks) / lengths.sum(), disk=workdir / "store", tmpfs=args.tmpfs)


def setup(b: Bench) -> dict:
    args, target = b.args, b.target
    lengths = np.concatenate([c.lengths for c in b.chunks])
    return {
        "shape": args.shape, "layers": target.layers, "model_build_s": round(time.perf_counter() - b.started, 1),
        "weights_gib": round(sum(p.numel() * p.element_size() for p in target.model.parameters()) / 2**30, 2),
        "memory_cap_gib": args.memory_gib if b.device.type == "cuda" else None,
        "fast_paths": b.fast.as_dict(), "layout": "packed" if b.packed else "padded",
        "attention": packing.attention_path(b.device) if b.packed else "SDPA, right-padded rows",
        "data": {"samples": int(len(lengths)), "chunks": len(b.chunks), "tokens": int(lengths.sum()),
                 "mean_length": round(float(lengths.mean()), 1), "max_length": int(lengths.max())},
        "gflop_per_token": round(b.flops_per_token / 1e9, 2),
        "write_speed": [write_speed(b.disk, 4.0 if args.shape == "27b" else 0.2), write_speed(b.tmpfs, 4.0 if args.shape == "27b" else 0.2)],
        "state_bytes_per_token": len(target.layers) * target.hidden_size * 2,
    }


def warmup(b: Bench) -> dict:
    cold, again = b.warm(b.spec, times=2)
    return {"cold_s": round(cold, 1), "again_s": round(again, 1), "triton_cache_was_cold": b.result["triton_cache"]["cold"]}


def syncs(b: Bench) -> dict | None:
    return count_syncs(b.target, b.chunks[0], b.planner) if b.device.type == "cuda" else None


def bf16(b: Bench) -> dict:
    out = b.passes("bf16", {
        "bare_1": b.bare, "extractor_disk": lambda: b.extract(b.disk),
        "extractor_tmpfs": lambda: b.extract(b.tmpfs), "bare_2": b.bare,
    })
    bare_rates = [out["bare_1"]["tokens_per_s"], out["bare_2"]["tokens_per_s"]]
    out["bare_mean_tokens_per_s"] = round(statistics.mean(bare_rates), 1)
    for where in ("disk", "tmpfs"):
        rate = out[f"extractor_{where}"]["tokens_per_s"]
        out[f"ratio_{where}"] = {"vs_mean": round(rate / out["bare_mean_tokens_per_s"], 4),
                                 "vs_bare_1": round(rate / bare_rates[0], 4), "vs_bare_2": round(rate / bare_rates[1], 4)}
    out["mfu"] = {"bare": b.mfu(out["bare_mean_tokens_per_s"]), "extractor_disk": b.mfu(out["extractor_disk"]["tokens_per_s"]),
                  "extractor_tmpfs": b.mfu(out["extractor_tmpfs"]["tokens_per_s"])}
    return out


def profiled(b: Bench) -> dict:
    return profile(b.target, b.tmpfs, b.chunks[:2], b.spec, b.args, packed=b.packed)


def exact(b: Bench) -> dict:
    out = {"capture_error": capture_errors(b.target, b.chunks[0], b.planner, 8), "varlen_attention": varlen_attention_error(b.device)}
    padded = BatchPlanner(token_budget=b.spec.token_budget, pad_multiple=b.spec.pad_multiple)
    out["capture_error_padded"] = capture_errors(b.target, b.chunks[0], padded, 8)
    return out


def pod(b: Bench, name: str) -> dict:
    """This script again as a pod of the node (--warm-pod), its report with the wall time of its process."""
    args, workdir = b.args, b.workdir
    out_file = workdir / f"{name}.json"
    command = [sys.executable, __file__, "--warm-pod", "--shape", args.shape, "--device", args.device, "--workdir", str(workdir / name),
               "--samples", str(max(8, args.samples // 8)), "--mean-length", str(args.mean_length), "--max-length", str(args.max_length),
               "--chunk-tokens", str(args.chunk_tokens), "--token-budget", str(args.token_budget), "--pad-multiple", str(args.pad_multiple),
               "--sort-window", str(args.sort_window), "--memory-gib", str(args.memory_gib), "--out", str(out_file)]
    if b.device.type == "cuda":
        torch.cuda.empty_cache()  # the pod needs its own room on this GPU
    launched = time.perf_counter()
    subprocess.run(command, check=True)
    report = json.loads(out_file.read_text())
    report["process_wall_s"] = round(time.perf_counter() - launched, 1)
    return report


def pods(b: Bench) -> dict:
    # The first pod finds the Triton kernels of the warm-up stage but compiles its own graphs
    # (extract.compile, on by default on a GPU); the second finds both, as a node's later pods do.
    out = {"first_pod": pod(b, "pod-1")}
    b.save_partial("warm-pod", out)
    out["warm_pod"] = pod(b, "pod-2")
    return out


def final_hidden(b: Bench) -> dict:
    with_final = dataclasses.replace(b.target, final_hidden=True)
    out = b.passes("final", {
        "bare_1": b.bare, "extractor_disk": lambda: b.extract(b.disk),
        "extractor_final_disk": lambda: b.extract(b.disk, target=with_final), "bare_2": b.bare,
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


def convert_to_fp8(b: Bench) -> int:
    """The target's linear layers in FP8, in place, as extract.compute_dtype: float8 makes them (the tiny
    shape's narrow ones too, or none would be), their bf16 weights' memory given back; how many."""
    converted = fp8.to_float8(b.target.decoder_layers, min_features=fp8.MIN_FEATURES if b.args.shape == "27b" else 16)
    if b.device.type == "cuda":
        torch.cuda.empty_cache()
    return converted


def float8(b: Bench) -> dict:
    target = b.target
    if b.device.type == "cuda":
        fp8.require_fp8(b.device)
    out: dict = {}
    reference = b.sample_states()
    out["bare_bf16"] = b.bare()
    b.save_partial("fp8", out)
    converted = time.perf_counter()
    out["linear_layers_in_fp8"] = convert_to_fp8(b)
    out["convert_s"] = round(time.perf_counter() - converted, 1)
    out["weights_gib"] = round(sum(t.numel() * t.element_size() for t in [*target.model.parameters(), *target.model.buffers()]) / 2**30, 2)
    out["relative_error_per_layer"] = dict(zip(map(str, target.layers), layer_errors(reference, b.sample_states())))
    b.save_partial("fp8", out)
    fp8_spec = dataclasses.replace(b.spec, compute_dtype="float8")
    out["warmup_fp8_s"] = round(b.warm(fp8_spec)[0], 1)
    out["bare_fp8"] = b.bare()
    b.save_partial("fp8", out)
    out["extractor_fp8_disk"] = b.extract(b.disk, fp8_spec)
    b.save_partial("fp8", out)
    out["extractor_fp8_tmpfs"] = b.extract(b.tmpfs, fp8_spec)
    out["speedup_bare"] = round(out["bare_fp8"]["tokens_per_s"] / out["bare_bf16"]["tokens_per_s"], 3)
    return out


def eager():
    # Every compiled function of the process eager, FP8's quantization too. A new object per use:
    # set_stance sets the stance when it is constructed, not only inside its `with`.
    return torch.compiler.set_stance("force_eager")


def compute_of(target: CaptureTarget) -> str:
    return "float8" if any(isinstance(m, fp8.Float8Linear) for m in target.model.modules()) else "bfloat16"


def compile_target(b: Bench) -> int:
    """The target's norms and MLPs compiled in place, as extract.compile does; how many modules."""
    b.compiled = True
    return fusion.compile_elementwise(b.target.decoder_layers, b.target.architecture.fused_submodules)


def compiled(b: Bench) -> dict:
    target = b.target
    compute = compute_of(target)
    compile_spec = dataclasses.replace(b.spec, compute_dtype=compute, compile=True)
    with eager():
        reference = b.sample_states()
    out: dict = {"compute": compute, "modules": compile_target(b)}
    out["warmup_s"] = round(b.warm(compile_spec)[0], 1)
    out["relative_error_per_layer"] = dict(zip(map(str, target.layers), layer_errors(reference, b.sample_states())))
    b.save_partial("compile", out)
    # Warm-up compiles every module class, but batch sizes and strides it did not see recompile later: one
    # compiled pass first, so that the timed ones below are all warm.
    out["bare_compiled_first_pass"] = b.bare()
    b.save_partial("compile", out)
    with eager():
        out["bare_eager_1"] = b.bare()
    b.save_partial("compile", out)
    out["bare_compiled_1"] = b.bare()
    b.save_partial("compile", out)
    out["extractor_compiled_disk"] = b.extract(b.disk, compile_spec)
    b.save_partial("compile", out)
    out["bare_compiled_2"] = b.bare()
    with eager():
        out["bare_eager_2"] = b.bare()
    eager_mean = statistics.mean([out["bare_eager_1"]["tokens_per_s"], out["bare_eager_2"]["tokens_per_s"]])
    compiled_mean = statistics.mean([out["bare_compiled_1"]["tokens_per_s"], out["bare_compiled_2"]["tokens_per_s"]])
    out["speedup_bare"] = round(compiled_mean / eager_mean, 3)
    out["ratio_disk_vs_compiled_bare"] = round(out["extractor_compiled_disk"]["tokens_per_s"] / compiled_mean, 4)
    out["mfu"] = {"bare_eager": b.mfu(eager_mean), "bare_compiled": b.mfu(compiled_mean),
                  "extractor_compiled_disk": b.mfu(out["extractor_compiled_disk"]["tokens_per_s"])}
    return out


def kernels(b: Bench) -> dict:
    target = b.target
    out: dict = {}
    if b.args.kernels_compute == "float8" and compute_of(target) == "bfloat16":
        if b.device.type == "cuda":
            fp8.require_fp8(b.device)
        out["linear_layers_in_fp8"] = convert_to_fp8(b)
    out["compute"] = compute = compute_of(target)
    if not b.compiled:
        out["modules_compiled"] = compile_target(b)
    out["warmup_s"] = round(b.warm(dataclasses.replace(b.spec, compute_dtype=compute, compile=True))[0], 1)
    chunks = b.chunks[: b.args.kernels_chunks]
    out["first_pass"] = b.bare(chunks)  # batch sizes warm-up did not see compile here, not under the profiler
    b.save_partial("kernels", out)
    # the device's timeline alone on a GPU: the host's ops would be a million events of overhead
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA if b.device.type == "cuda" else ProfilerActivity.CPU]) as prof:
        out["pass"] = b.bare(chunks)
    out["kernels"] = kernel_kinds(prof, on_gpu=b.device.type == "cuda", wall_s=out["pass"]["seconds"], tokens=out["pass"]["real_tokens"],
                                  flops={"gemm": linear_flops_per_token(target.decoder_layers) * out["pass"]["padded_tokens"]},
                                  peak_flops=PEAK_FLOPS[compute])
    out["mfu"] = b.mfu(out["pass"]["tokens_per_s"])
    return out


RUNS = {"setup": setup, "warmup": warmup, "syncs": syncs, "bf16": bf16, "profile": profiled, "exact": exact,
        "warm-pod": pods, "final": final_hidden, "fp8": float8, "compile": compiled, "kernels": kernels}
"""Each stage's function, in STAGES' order: the order they run in."""


def run_stage(b: Bench, name: str, fn) -> None:
    """One stage into result[name]; a stage that fails records its error and the others still report."""
    started = time.perf_counter()
    log.info("stage %s", name)
    try:
        b.result[name] = fn(b)
    except Exception as exc:
        log.exception("stage %s failed", name)
        b.result[name] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    b.result.setdefault("stage_seconds", {})[name] = round(time.perf_counter() - started, 1)
    b.save()


# ---- the run ----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
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
    parser.add_argument("--kernels-compute", choices=("bfloat16", "float8"), default="bfloat16",
                        help="the kernels stage's linear layers (float8: converted there, unless fp8 ran before)")
    parser.add_argument("--kernels-chunks", type=int, default=2, help="chunks the kernels stage profiles a bare pass over")
    parser.add_argument("--warm-pod", action="store_true", help="(internal) run as the second pod of a node")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    unknown = set(args.stages.split(",")) - set(STAGES)
    if unknown:
        parser.error(f"unknown stages {sorted(unknown)}; choose from {STAGES}")
    return args


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    device = bench_device(args.device)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-extract-"))
    if args.warm_pod:
        return warm_pod(args, device, workdir)
    b = open_bench(args, device, workdir)
    stages = args.stages.split(",")
    for name, fn in RUNS.items():
        if name in stages:
            run_stage(b, name, fn)
    b.result["total_s"] = round(time.perf_counter() - b.started, 1)
    b.save()
    print(json.dumps({key: b.result[key] for key in b.result if key not in ("profile",)}, indent=2))
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
