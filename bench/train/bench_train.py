"""Speed and memory of one drafter training step (Trainer.train_step) on synthetic chunks.

    python bench/train/bench_train.py [--shape 27b] [--tokens 4096] [--docs 1,4] [--anchors 512]
                                      [--sliding 0,4] [--steps 6] [-o bench/results/train-h200.json]

The drafter has the shape z-lab uses for Qwen3.5/3.6-27B (hidden 5120, 24/4 heads of 256, FFN
17408, vocab 248,320, 5 captured layers) with random weights; the frozen embedding and LM head are
random bf16 tables. Each case packs `docs` documents of `tokens` tokens (10% prompt, the rest
supervised) into one micro-batch through the real BatchBuilder, then times train_step: flex
attention, chunked loss, AdamW, bf16 autocast. Reported per case: step time (median after warm-up),
context tokens/s, model TFLOP/s and MFU against the 989 TFLOP/s bf16 datasheet peak, peak memory.

FLOPs counted: every matmul of the trainable layers x3 (forward, input and weight gradients), fc
x3 on the context, attention over the visible (query, key) pairs only x3 (4 * head_dim per pair
forward), the frozen LM head x2 on supervised slots (logits, and the hidden-state gradient; no
weight gradient). `--shape tiny` runs the same on CPU in seconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dflash_jobs.drafter.model import Drafter, DrafterConfig
from dflash_jobs.formats import HiddenChunk, TokenChunk
from dflash_jobs.spec import parse_spec
from dflash_jobs.train.data import BatchBuilder, DocumentRef
from dflash_jobs.train.metrics import NullSink
from dflash_jobs.train.optim import build_optimizer, build_scheduler
from dflash_jobs.train.trainer import LoopState, Runtime, Trainer

PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16 datasheet
SHAPES = {
    "27b": dict(hidden_size=5120, num_attention_heads=24, num_key_value_heads=4, head_dim=256, intermediate_size=17408,
                vocab_size=248320, num_target_layers=64, target_layer_ids=[1, 16, 31, 46, 61], rope_theta=1e7),
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                 vocab_size=1024, num_target_layers=8, target_layer_ids=[1, 2, 3, 4, 5], rope_theta=1e7),
}


def synthetic_chunk(docs: int, tokens: int, config: DrafterConfig, seed: int = 0) -> HiddenChunk:
    g = torch.Generator().manual_seed(seed)
    loss_mask = np.ones(tokens, dtype=np.uint8)
    loss_mask[: tokens // 10] = 0
    token_chunk = TokenChunk(
        input_ids=torch.randint(0, config.vocab_size - 1, (docs * tokens,), generator=g).numpy().astype(np.int32),
        loss_mask=np.tile(loss_mask, docs),
        cu_seqlens=np.arange(docs + 1, dtype=np.int64) * tokens,
        sample_ids=np.arange(docs, dtype=np.int64),
    )
    hidden = torch.randn(docs * tokens, len(config.target_layer_ids), config.hidden_size, generator=g).to(torch.bfloat16)
    return HiddenChunk(token_chunk, hidden, None, config.target_layer_ids, "synthetic", "synthetic", "bfloat16")


def visible_pairs(layout, window: int | None) -> int:
    """Visible (query, key) pairs of one layer, from the block layout (no dense mask)."""
    B = layout.block_size
    before = (layout.anchor - layout.context_start)[:, None].double()  # [N, 1] context tokens before each anchor
    slot = torch.arange(B, device=before.device, dtype=torch.float64)[None, :]
    if window is None:
        return int((before + B).sum().item() * B)
    context = torch.minimum(before, (window - 1 - slot).clamp(min=0))
    return int((context + slot + 1).sum().item())


def step_flops(config: DrafterConfig, batch) -> float:
    d, hd, I = config.hidden_size, config.head_dim, config.intermediate_size
    q_width, kv_width = config.num_attention_heads * hd, config.num_key_value_heads * hd
    C, Q = batch.tokens, batch.block_ids.numel()
    supervised = int((batch.loss_weights > 0).sum())
    per_layer = 2 * Q * d * q_width + 2 * 2 * (C + Q) * d * kv_width + 2 * Q * q_width * d + 3 * 2 * Q * d * I
    attention = sum(
        4 * hd * config.num_attention_heads * visible_pairs(batch.layout, config.sliding_window if kind == "sliding_attention" else None)
        for kind in config.layer_types
    )
    fc = 2 * C * config.context_features * d
    return 3 * (config.num_layers * per_layer + attention + fc) + 2 * 2 * supervised * d * config.vocab_size


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_case(shape: str, docs: int, tokens: int, anchors: int, sliding: int, steps: int, warmup: int, device: torch.device) -> dict:
    spec = parse_spec({
        "name": "bench", "target": {"model": "/unused"}, "data": {"source": "/unused"}, "output": "/unused",
        "train": {"anchors": anchors, "sliding_window_layers": sliding, "micro_batch_tokens": docs * tokens},
    })
    config = DrafterConfig(
        **SHAPES[shape], num_layers=spec.train.draft_layers, block_size=spec.train.block_size,
        mask_token_id=SHAPES[shape]["vocab_size"] - 1, sliding_window=spec.train.sliding_window,
        layer_types=["sliding_attention"] * sliding + ["full_attention"] * (spec.train.draft_layers - sliding),
    )
    started = time.perf_counter()
    torch.manual_seed(0)
    with device:
        drafter = Drafter(config)
    table_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    V, d = config.vocab_size, config.hidden_size
    drafter.load_target_tensors(
        (torch.randn(V, d, device=device) * 0.02).to(table_dtype), (torch.randn(V, d, device=device) * 0.02).to(table_dtype),
        torch.ones(d),
    )
    optimizer = build_optimizer(drafter, spec.train, device=device)
    trainer = Trainer(
        spec=spec, runtime=Runtime(0, 1, device), drafter=drafter, model=drafter, optimizer=optimizer,
        scheduler=build_scheduler(optimizer, spec.train, 1000), stream=None, checkpointer=None, state=LoopState(),
        sink=NullSink(), storage=None, total_steps=1000, steps_per_epoch=[1000],
        attention_backend="flex" if device.type == "cuda" else "dense",
    )
    builder = BatchBuilder(block_size=config.block_size, anchors=anchors, gamma=spec.train.gamma,
                           mask_token_id=config.mask_token_id, seed=0, layers=config.target_layer_ids)
    chunk = synthetic_chunk(docs, tokens, config)
    documents = [DocumentRef(0, i, i, tokens) for i in range(docs)]
    batches = [builder.build(documents, {0: chunk}, epoch) for epoch in range(2)]
    flops = step_flops(config, batches[0])
    setup_s = time.perf_counter() - started
    progress(f"docs={docs} sliding={sliding}: model and batches ready in {setup_s:.1f}s")

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(warmup + steps):
        synchronize()
        started = time.perf_counter()
        out = trainer.train_step(batches[step % 2])
        out.loss.item()
        synchronize()
        elapsed = time.perf_counter() - started
        progress(f"  step {step}: {elapsed:.2f}s{' (warm-up)' if step < warmup else ''}")
        if step >= warmup:
            times.append(elapsed)
    step_time = statistics.median(times)
    result = {
        "shape": shape, "docs": docs, "tokens_per_doc": tokens, "anchors_per_doc": anchors, "block_size": config.block_size,
        "layer_types": config.layer_types, "context_tokens": batches[0].tokens, "blocks": batches[0].block_ids.shape[0],
        "trainable_params": sum(p.numel() for p in drafter.parameters() if p.requires_grad),
        "setup_s": setup_s, "step_s": step_time, "step_s_all": times, "tokens_per_s": batches[0].tokens / step_time,
        "blocks_per_s": batches[0].block_ids.shape[0] / step_time, "tflops_per_step": flops / 1e12,
        "tflop_per_s": flops / step_time / 1e12, "mfu": flops / step_time / PEAK_BF16_FLOPS, "loss": out.loss.item(),
    }
    if device.type == "cuda":
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="27b")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per document")
    parser.add_argument("--docs", default="1,4", help="documents per micro-batch, one case each")
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--sliding", default="0,4", help="sliding-window layers, one case each")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("-o", "--output", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "peak_bf16_tflops": PEAK_BF16_FLOPS / 1e12, "cases": [],
    }
    for docs in (int(n) for n in args.docs.split(",")):
        for sliding in (int(s) for s in args.sliding.split(",")):
            try:
                case = run_case(args.shape, docs, args.tokens, args.anchors, sliding, args.steps, args.warmup, device)
            except torch.OutOfMemoryError as exc:
                case = {"docs": docs, "sliding_layers": sliding, "error": f"out of memory: {str(exc).splitlines()[0]}"}
            report["cases"].append(case)
            progress(json.dumps(case))
            if args.output:  # after every case: a run cut short keeps what it measured
                args.output.parent.mkdir(parents=True, exist_ok=True)
                args.output.write_text(json.dumps(report, indent=2) + "\n")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
