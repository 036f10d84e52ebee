"""Benchmark of the extraction hot path (DESIGN section 5), side by side on the same samples:

  (a) bare forward: the extractor's batches through the truncated model, nothing captured;
  (b) the extractor end to end: ExtractWorker.run() writing chunks + markers to local disk;
  (c) the naive way: one sample at a time, output_hidden_states=True, per-sample .cpu() and
      one safetensors file per sample.

Throughput counts real (unpadded) tokens. Also measured: padding waste of both batch layouts,
warm-up time, MFU against the H200's 989 TFLOP/s dense bf16 peak, peak GPU memory, and how close
packed and padded captures are to single-sample forwards on the real shape.

    python bench/extract.py --shape 27b --out bench/results/extract-h200.json   # GPU
    python bench/extract.py --shape tiny --device cpu --samples 24 --naive-samples 4 --chunk-tokens 1024 --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dflash_jobs.extract import packing
from dflash_jobs.extract.batching import BatchPlanner, window_samples
from dflash_jobs.extract.capture import LayerCapture
from dflash_jobs.extract.progress import Summary
from dflash_jobs.extract.target import FastPaths, Target, conv_gap, load_target, prepare_for_capture
from dflash_jobs.extract.worker import ExtractWorker, iter_windows, to_device, warmup_batches, shallow, warmup_depth
from dflash_jobs.formats import DATASET_KEY, ChunkInfo, DatasetIndex, TokenChunk, token_chunk_key
from dflash_jobs.spec import ExtractSpec, TargetSpec, default_layers
from dflash_jobs.storage import open_storage

H200_PEAK_FLOPS = 989e12
REAL_27B = dict(
    hidden_size=5120, num_hidden_layers=64, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
    linear_value_head_dim=128, vocab_size=248320,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_27b(device: torch.device) -> Target:
    """Random weights of the real Qwen3.6-27B text shape, cut after layer 61 (throughput ignores the values)."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    config = Qwen3_5TextConfig(**REAL_27B)
    layers = default_layers(config.num_hidden_layers)
    config.num_hidden_layers = max(layers) + 1
    config.layer_types = config.layer_types[: config.num_hidden_layers]
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3_5TextModel(config)
    finally:
        torch.set_default_dtype(previous)
    return Target(model=prepare_for_capture(model, layers), layers=layers, hidden_size=config.hidden_size,
                  name="random-qwen3.6-27b-shape", config_hash=hashlib.sha256(config.to_json_string().encode()).hexdigest(),
                  conv_gap=conv_gap(config))


def tiny(device: torch.device, workdir: Path) -> Target:
    """The tiny target through the real loading path (save_pretrained layout -> load_target)."""
    from dflash_jobs.tiny import write_tiny_target

    checkpoint = write_tiny_target(workdir / "tiny-target")
    return load_target(TargetSpec(model=str(checkpoint)), checkpoint=checkpoint, layers=[1, 3, 6], device=device)


def lognormal_chunks(count: int, *, mean: float, max_length: int, chunk_tokens: int, vocab: int, seed: int) -> list[TokenChunk]:
    """Samples of realistic lengths (lognormal, sigma 0.8, clipped to [16, max_length]) cut into chunks like prepare."""
    rng = np.random.default_rng(seed)
    sigma = 0.8
    lengths = np.clip(rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, count).astype(int), 16, max_length)
    chunks, current = [], []
    for length in lengths.tolist():
        if current and sum(current) + length > chunk_tokens:
            chunks.append(current)
            current = []
        current.append(length)
    chunks.append(current)
    out, first = [], 0
    for lengths in chunks:
        total = sum(lengths)
        out.append(TokenChunk(
            input_ids=rng.integers(0, vocab, total, dtype=np.int32), loss_mask=np.ones(total, dtype=np.uint8),
            cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            sample_ids=np.arange(first, first + len(lengths), dtype=np.int64),
        ))
        first += len(lengths)
    return out


def write_run(root: Path, chunks: list[TokenChunk]):
    storage = open_storage(str(root))
    infos = []
    for cid, chunk in enumerate(chunks):
        storage.put_bytes(token_chunk_key(cid), chunk.encode())
        infos.append(ChunkInfo(cid, token_chunk_key(cid), chunk.num_samples, chunk.num_tokens))
    storage.put_bytes(DATASET_KEY, DatasetIndex(samples=sum(i.samples for i in infos), tokens=sum(i.tokens for i in infos),
                                                vocab_size=0, chunks=infos).to_json().encode())
    return storage, infos


def model_flops(target: Target, chunks: list[TokenChunk]) -> float:
    """2 x non-embedding parameters per token, plus causal attention on the full-attention layers."""
    model, config = target.model, target.model.config
    params = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    tokens = sum(c.num_tokens for c in chunks)
    full_layers = sum(1 for kind in (getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers) if kind == "full_attention")
    squares = sum(float((c.lengths.astype(np.float64) ** 2).sum()) for c in chunks)
    attention = 2 * config.num_attention_heads * config.head_dim * squares * full_layers  # QK^T and PV, causal half
    return 2 * params * tokens + attention


def bare_forward(target: Target, storage, infos, planner: BatchPlanner, window: int) -> dict:
    """(a) the same batches, forward only."""
    device = target.device
    real = padded = 0
    elapsed = 0.0
    with torch.inference_mode():
        for win in iter_windows(storage, infos, planner, window):
            batches = [to_device(planner.build(s, win.tokens), device) for s in win.batches]
            sync(device)
            started = time.perf_counter()
            for batch in batches:
                target.model(**packing.forward_kwargs(batch))
            sync(device)
            elapsed += time.perf_counter() - started
            real += sum(b.real_tokens for b in batches)
            padded += sum(b.padded_tokens for b in batches)
    return {"seconds": round(elapsed, 2), "real_tokens": real, "padded_tokens": padded,
            "tokens_per_s": round(real / elapsed, 1), "padding_waste": round(1 - real / padded, 4)}


def naive(target: Target, chunks: list[TokenChunk], samples: int, workdir: Path) -> dict:
    """(c) one sample at a time, all hidden states, per-sample .cpu() and file."""
    from safetensors.torch import save_file

    device = target.device
    workdir.mkdir(parents=True, exist_ok=True)
    refs = window_samples(chunks)[:samples]
    tokens = 0
    sync(device)
    started = time.perf_counter()
    with torch.inference_mode():
        for n, ref in enumerate(refs):
            ids = torch.from_numpy(chunks[ref.slot].input_ids[ref.start:ref.start + ref.length].astype(np.int64))[None].to(device)
            out = target.model(input_ids=ids, output_hidden_states=True, use_cache=False)
            states = torch.stack([out.hidden_states[i + 1][0].cpu() for i in target.layers], dim=1)
            save_file({"hidden_states": states, "input_ids": ids[0].cpu()}, str(workdir / f"{n:06d}.safetensors"))
            tokens += ref.length
    elapsed = time.perf_counter() - started
    return {"samples": len(refs), "real_tokens": tokens, "seconds": round(elapsed, 2), "tokens_per_s": round(tokens / elapsed, 1)}


def capture_errors(target: Target, chunk: TokenChunk, planner: BatchPlanner, samples: int) -> dict:
    """Max |batched - single| / max|single| per sample, for one batch of `samples` samples."""
    device = target.device
    refs = window_samples([chunk])[:samples]
    capacity = sum(r.length + planner.gap for r in refs) + 64
    capture = LayerCapture(target.decoder_layers, target.layers, capacity=capacity, hidden_size=target.hidden_size,
                           dtype=target.dtype, device=device)
    single = BatchPlanner(token_budget=capacity, pad_multiple=1)

    def run(plan: BatchPlanner, group) -> torch.Tensor:
        batch = to_device(plan.build(group, [chunk]), device)
        target.model.set_attn_implementation(packing.PACKED_ATTENTION if plan.packed else "sdpa")
        capture.start(batch.real_index)
        target.model(**packing.forward_kwargs(batch))
        sync(device)
        return capture.buffer[: batch.real_tokens].float().clone()

    try:
        with torch.inference_mode():
            batched = run(planner, refs)
            errors, offset = [], 0
            for ref in refs:
                alone = run(single, [ref])
                got = batched[offset:offset + ref.length]
                errors.append(float((got - alone).abs().max() / alone.abs().max()))
                offset += ref.length
    finally:
        capture.remove()
    return {"samples": len(refs), "max_relative_error": max(errors), "mean_relative_error": float(np.mean(errors))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("27b", "tiny"), default="27b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--naive-samples", type=int, default=48)
    parser.add_argument("--mean-length", type=float, default=1050)
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--chunk-tokens", type=int, default=65536)
    parser.add_argument("--token-budget", type=int, default=ExtractSpec().token_budget)
    parser.add_argument("--pad-multiple", type=int, default=64)
    parser.add_argument("--sort-window", type=int, default=ExtractSpec().sort_window)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float8_e4m3fn"))
    parser.add_argument("--padded-baseline", action="store_true", help="also time the right-padded layout's bare forward")
    parser.add_argument("--workdir", type=Path, default=None, help="local disk for (b) and (c) (default: a temp dir)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    device = torch.device(args.device)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-extract-"))

    def save() -> None:  # after every stage: a run cut short still reports what it measured
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    started = time.perf_counter()
    target = random_27b(device) if args.shape == "27b" else tiny(device, workdir)
    sync(device)
    result: dict = {
        "command": "python bench/extract.py " + shlex.join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": args.shape, "layers": target.layers, "model_build_s": round(time.perf_counter() - started, 1),
        "weights_gib": round(sum(p.numel() * p.element_size() for p in target.model.parameters()) / 2**30, 2),
    }
    fast = FastPaths.detect(device)
    packed = fast.fla and device.type == "cuda" and packing.can_pack(target.model)
    result["fast_paths"] = fast.as_dict()
    result["layout"] = "packed" if packed else "padded"

    chunks = lognormal_chunks(args.samples, mean=args.mean_length, max_length=args.max_length,
                              chunk_tokens=args.chunk_tokens, vocab=target.model.config.vocab_size, seed=0)
    lengths = np.concatenate([c.lengths for c in chunks])
    result["data"] = {"samples": int(len(lengths)), "chunks": len(chunks), "tokens": int(lengths.sum()),
                      "mean_length": round(float(lengths.mean()), 1), "max_length": int(lengths.max())}
    storage, infos = write_run(workdir / "run", chunks)
    spec = ExtractSpec(shards=1, token_budget=args.token_budget, pad_multiple=args.pad_multiple,
                       sort_window=args.sort_window, dtype=args.dtype)
    flops = model_flops(target, chunks)
    result["gflop_per_token"] = round(flops / lengths.sum() / 1e9, 2)

    # (b) first builds the worker and warms up; (a) then runs on warm kernels, then (b) runs end to end.
    worker = ExtractWorker(spec, target=target, storage=storage, chunks=infos, summary=Summary(shard=0, shards=1),
                           max_length=args.max_length, packed=packed, spool_dir=workdir / "spool", log_interval=10.0)
    with torch.inference_mode():
        warmup = worker.warm_up()
    result["warmup_s"] = round(warmup, 1)
    save()
    worker.capture.remove()  # (a) runs without hooks
    result["a_bare_forward"] = bare_forward(target, storage, infos, worker.planner, args.sort_window)
    save()
    worker.capture.attach()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run_started = time.perf_counter()
    summary = worker.run()
    worker.close()
    b = {"seconds_with_warmup": round(time.perf_counter() - run_started, 2), "seconds": summary.elapsed_s,
         "second_warmup_s": summary.warmup_s, "real_tokens": summary.tokens, "padded_tokens": summary.padded_tokens,
         "tokens_per_s": round(summary.tokens / summary.elapsed_s, 1), "padding_waste": summary.padding_waste,
         "chunks": summary.chunks_done, "bytes_written": summary.bytes, "oom_splits": summary.oom_splits}
    if device.type == "cuda":
        b["peak_gpu_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        b["peak_gpu_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
    result["b_extractor"] = b
    save()
    target.model.set_attn_implementation("sdpa")  # (c) and the padded layout run plain SDPA
    result["c_naive"] = naive(target, chunks, args.naive_samples, workdir / "naive")

    a, c = result["a_bare_forward"], result["c_naive"]
    result["ratio_b_over_a"] = round(b["tokens_per_s"] / a["tokens_per_s"], 4)
    result["ratio_b_over_c"] = round(b["tokens_per_s"] / c["tokens_per_s"], 3)
    result["mfu_a"] = round(flops / result["data"]["tokens"] * a["tokens_per_s"] / H200_PEAK_FLOPS, 4)
    result["mfu_b"] = round(flops / result["data"]["tokens"] * b["tokens_per_s"] / H200_PEAK_FLOPS, 4)

    padded_planner = BatchPlanner(token_budget=args.token_budget, pad_multiple=args.pad_multiple)
    plans = [padded_planner.plan(window_samples(chunks[i:i + args.sort_window])) for i in range(0, len(chunks), args.sort_window)]
    padded = sum(len(b) * padded_planner.row_length(b[0].length) for plan in plans for b in plan)
    result["padded_layout_plan"] = {"pad_multiple": args.pad_multiple, "sort_window": args.sort_window,
                                    "batches": sum(len(p) for p in plans), "padding_waste": round(1 - lengths.sum() / padded, 4)}
    save()
    # Capture accuracy on the real shape: one batch against each sample run alone.
    if packed:
        result["capture_error_packed"] = capture_errors(target, chunks[0], worker.planner, 8)
    result["capture_error_padded"] = capture_errors(target, chunks[0], padded_planner, 8)
    save()
    if packed and args.padded_baseline:  # the right-padded layout's bare forward on the same samples
        target.model.set_attn_implementation("sdpa")
        padded_warmup = time.perf_counter()
        with torch.inference_mode(), shallow(target.model, warmup_depth(target.model)):
            for batch in warmup_batches(padded_planner, args.max_length, target.model.config.vocab_size):
                target.model(**packing.forward_kwargs(to_device(batch, device)))
        sync(device)
        result["warmup_padded_s"] = round(time.perf_counter() - padded_warmup, 1)
        result["a_bare_forward_padded"] = bare_forward(target, storage, infos, padded_planner, args.sort_window)
    result["total_s"] = round(time.perf_counter() - started, 1)
    save()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
