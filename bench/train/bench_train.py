"""Speed and memory of one drafter training step (Trainer.train_step) on synthetic chunks.

    python bench/train/bench_train.py [--shape 27b] [--tokens 4096] [--cases 4:none,4:mlp,4:layers,4:mlp:compile]
                                      [--anchors 512] [--memory-gib 96] [--profile 4:mlp] [-o bench/results/train-h200.json]

The drafter has the shape z-lab uses for Qwen3.5/3.6-27B (hidden 5120, 24/4 heads of 256, FFN
17408, vocab 248,320, 5 captured layers) with random weights; the frozen embedding and LM head are
random bf16 tables. A case is DOCS:CHECKPOINTING[:compile][:autotune][:sliding=N][:drafter=NAME][:block=B][:layers=L]:
`docs` documents of `tokens` tokens (10% prompt, the rest supervised) packed into one micro-batch through the real
BatchBuilder, the drafter set up by train/parallelize.py (activation checkpointing none, mlp or
layers; compiled layers and loss or not, flex attention autotuned or not; the drafter variant, dflash by default,
at its default block size or B, of the spec's default depth or L layers), then train_step timed: flex attention, the variant's objective,
AdamW, bf16 autocast. GPU memory is capped at --memory-gib for every case (96: an RTX PRO 6000).
Reported per case: step time (median after warm-up), context tokens/s, model TFLOP/s and MFU
against the 989 TFLOP/s bf16 datasheet peak, peak memory; --profile adds torch.profiler's top
operators of one steady step of that case and its kernels by kind (bench/kernel_kinds.py). Each case
compiles afresh (dynamo's caches emptied before it).

FLOPs counted as the trainer's log counts them (jobs/dflash_jobs/train/flops.py): every matmul of
the trainable layers x3, fc x3 on the context, attention over the visible pairs only, the frozen LM
head x2 on supervised slots, and the variant's own modules (DrafterVariant.extra_flops: DFlash2's
convolutions and candidate selector; DSpark's Markov projection and confidence head, and the
target's logits its objective reads). `--shape tiny` runs the same on CPU in about a minute, with
512-token documents and 64 anchors by default: the CPU's dense attention mask grows with tokens x
anchors (4 documents of 4,096 tokens need over 24 GB).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_kinds import kernel_kinds  # noqa: E402  (bench/kernel_kinds.py)

from dflash_jobs.drafter.model import DrafterConfig
from dflash_jobs.formats import TokenChunk, encode_hidden_chunk
from dflash_jobs.spec import default_layers, parse_spec
from dflash_jobs.train.chunks import ChunkData
from dflash_jobs.train.data import BatchBuilder, DocumentRef
from dflash_jobs.train.flops import PEAK_BF16_FLOPS_BY_GPU, attention_flops, step_flops
from dflash_jobs.train.metrics import NullSink
from dflash_jobs.train.optim import build_optimizer, build_scheduler
from dflash_jobs.train.parallelize import parallelize
from dflash_jobs.train.trainer import LoopState, Runtime, Trainer
from dflash_jobs.variants import drafter_variant

PEAK_BF16_FLOPS = PEAK_BF16_FLOPS_BY_GPU["H100"]  # the benchmark's cards: H100/H200 SXM
DOCUMENT_TOKENS = {"27b": 4096, "smollm2": 512, "tiny": 512}
ANCHORS = {"27b": 512, "smollm2": 64, "tiny": 64}
SHAPES = {
    "smollm2": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                    vocab_size=49152, num_target_layers=30, target_layer_ids=default_layers(30), rope_theta=1e5),
    "27b": dict(hidden_size=5120, num_attention_heads=24, num_key_value_heads=4, head_dim=256, intermediate_size=17408,
                vocab_size=248320, num_target_layers=64, target_layer_ids=[1, 16, 31, 46, 61], rope_theta=1e7),
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                 vocab_size=1024, num_target_layers=8, target_layer_ids=[1, 2, 3, 4, 5], rope_theta=1e7),
}


def synthetic_chunk(docs: int, tokens: int, config: DrafterConfig, seed: int = 0, *, final_hidden: bool = False) -> ChunkData:
    """`docs` documents of `tokens` random tokens and states, 10% of each a prompt; with the target's
    final hidden state too (`final_hidden`: a drafter that reads it, DSpark)."""
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
    final = torch.randn(docs * tokens, config.hidden_size, generator=g).to(torch.bfloat16) if final_hidden else None
    encoded = encode_hidden_chunk(token_chunk, hidden, layers=config.target_layer_ids, model="synthetic", config_hash="synthetic", final_hidden=final)
    return ChunkData.from_bytes(encoded, "synthetic")


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Case:
    docs: int
    checkpointing: str = "none"
    compile: bool = False
    sliding: int = 0
    drafter: str = "dflash"
    block: int | None = None
    layers: int | None = None
    """train.draft_layers (None: the spec's default)."""
    autotune: bool = False
    """Compiled with inductor's max_autotune for flex attention: its tile sizes, warps and stages searched
    by timing each, where the defaults take one config a head_dim. The GEMMs stay cuBLAS's (the only
    backend left to them): timing inductor's GEMM templates against it took the whole of a 280 s call
    on an H100 at 9 s a shape, each template at 42-43% of cuBLAS's speed (train-kinds-h100.log)."""

    @classmethod
    def parse(cls, text: str) -> Case:
        """DOCS:CHECKPOINTING[:compile][:autotune][:sliding=N][:drafter=NAME][:block=B][:layers=L], e.g. 4:mlp or
        4:none:compile:drafter=dspark:block=16."""
        docs, checkpointing, *flags = text.split(":") + ([] if ":" in text else ["none"])
        values = dict(flag.split("=", 1) for flag in flags if "=" in flag)
        block, layers = values.get("block"), values.get("layers")
        return cls(int(docs), checkpointing, "compile" in flags, int(values.get("sliding", 0)), values.get("drafter", "dflash"),
                   None if block is None else int(block), None if layers is None else int(layers), "autotune" in flags)

    def __str__(self) -> str:
        return (f"{self.docs}:{self.checkpointing}" + (":compile" if self.compile else "") + (":autotune" if self.autotune else "")
                + (f":sliding={self.sliding}" if self.sliding else "") + (f":drafter={self.drafter}" if self.drafter != "dflash" else "")
                + (f":block={self.block}" if self.block else "") + (f":layers={self.layers}" if self.layers else ""))

    def compiling(self):
        """The context the case compiles in: dynamo's caches emptied (a case's graphs and flex kernels are
        its own, not an earlier case's of the same shapes), max_autotune where asked."""
        torch._dynamo.reset()
        return (torch._inductor.config.patch(max_autotune=True, max_autotune_gemm_backends="ATEN") if self.autotune
                else contextlib.nullcontext())


class GivenStates:
    """The states each batch already holds (stored states, read by the batch builder): nothing to fill or check."""

    def fill(self, batch, step: int):
        return batch

    def step_flops(self, batch) -> float:
        return 0.0

    def check(self) -> None:
        pass


def build_trainer(shape: str, case: Case, tokens: int, anchors: int, device: torch.device, states=None) -> tuple[Trainer, DrafterConfig]:
    """The drafter of `shape` with random weights and random frozen tables, set up as training sets it up;
    `states` fills each batch's context (default: the stored states it holds)."""
    spec = parse_spec({
        "name": "bench", "backend": "local", "target": {"model": "/unused"}, "data": {"source": "/unused"}, "output": "/unused",
        "train": {"anchors": anchors, "sliding_window_layers": case.sliding, "micro_batch_tokens": case.docs * tokens,
                  "micro_batch_blocks": max(anchors, case.docs * anchors), "activation_checkpointing": case.checkpointing,
                  "compile": case.compile, "drafter": case.drafter, "block_size": case.block,
                  **({"draft_layers": case.layers} if case.layers else {})},
    })
    variant = drafter_variant(spec.train.drafter)
    config = variant.build_config(DrafterConfig(
        **SHAPES[shape], num_layers=spec.train.draft_layers, block_size=spec.train.block_size,
        mask_token_id=SHAPES[shape]["vocab_size"] - 1, sliding_window=spec.train.sliding_window,
        layer_types=["sliding_attention"] * case.sliding + ["full_attention"] * (spec.train.draft_layers - case.sliding),
    ), spec.train)
    torch.manual_seed(0)
    with device:
        drafter = variant.build_model(config)
    table_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    V, d = config.vocab_size, config.hidden_size
    drafter.load_target_tensors(
        (torch.randn(V, d, device=device) * 0.02).to(table_dtype), (torch.randn(V, d, device=device) * 0.02).to(table_dtype),
        torch.ones(d),
    )
    model = parallelize(drafter, spec.train, device=device, world_size=1)
    optimizer = build_optimizer(drafter, spec.train, device=device)
    trainer = Trainer(
        spec=spec, runtime=Runtime(0, 1, device), drafter=drafter, model=model, optimizer=optimizer,
        scheduler=build_scheduler(optimizer, spec.train, 1000), stream=None, checkpointer=None, state=LoopState(),
        sink=NullSink(), storage=None, total_steps=1000, steps_per_epoch=[1000],
        attention_backend="flex" if device.type == "cuda" else "dense", variant=variant, states=states or GivenStates(),
    )
    return trainer, config


def run_case(shape: str, case: Case, tokens: int, anchors: int, steps: int, warmup: int, device: torch.device, *, profile: bool) -> dict:
    started = time.perf_counter()
    trainer, config = build_trainer(shape, case, tokens, anchors, device)
    train = trainer.spec.train
    builder = BatchBuilder(layout=train.layout, anchors=anchors, mask_token_id=config.mask_token_id, seed=0,
                           layers=config.target_layer_ids, final_hidden=train.reads_final_hidden)
    chunk = synthetic_chunk(case.docs, tokens, config, final_hidden=train.reads_final_hidden)
    documents = [DocumentRef(0, i, i, tokens) for i in range(case.docs)]
    batches = [builder.build(documents, {0: chunk}, epoch) for epoch in range(2)]
    if device.type == "cuda":  # as the training stream hands them over: pinned, so the copy to the GPU is async
        batches = [batch.pin_memory() for batch in batches]
    flops = step_flops(config, batches[0], trainer.variant)
    setup_s = time.perf_counter() - started
    progress(f"case {case}: model and batches ready in {setup_s:.1f}s")

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
        "case": str(case), "shape": shape, "drafter": case.drafter, "docs": case.docs, "activation_checkpointing": case.checkpointing,
        "compile": case.compile, "tokens_per_doc": tokens, "anchors_per_doc": anchors, "block_size": config.block_size,
        "layer_types": config.layer_types, "context_tokens": batches[0].tokens, "blocks": batches[0].block_ids.shape[0],
        "trainable_params": sum(p.numel() for p in trainer.drafter.parameters() if p.requires_grad),
        "setup_s": setup_s, "step_s": step_time, "step_s_all": times, "tokens_per_s": batches[0].tokens / step_time,
        "blocks_per_s": batches[0].block_ids.shape[0] / step_time, "tflops_per_step": flops / 1e12,
        "tflop_per_s": flops / step_time / 1e12, "mfu": flops / step_time / PEAK_BF16_FLOPS, "loss": out.loss.item(),
    }
    if device.type == "cuda":
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    if profile:
        # attention's FLOPs x3 as step_flops counts them (forward, and its backward as twice the forward)
        attention = 3 * attention_flops(config, batches[0])
        result["profile"] = profile_step(trainer, batches[0], device, flops={"attention": attention, "gemm": flops - attention})
    return result


def profile_step(trainer: Trainer, batch, device: torch.device, *, flops: dict[str, float], top: int = 25) -> dict:
    """torch.profiler of one steady step: the operators that take the time, on the GPU and on the CPU,
    and its kernels by kind with the rate of the GEMMs' and attention's (`flops`: theirs; the GEMMs' all
    but attention's, the frozen head and the variant's modules included)."""
    return profile_call(lambda: trainer.train_step(batch).loss.item(), device, top, tokens=batch.tokens, flops=flops)


def profile_call(fn, device: torch.device, top: int = 25, *, tokens: int = 0, flops: dict[str, float] | None = None) -> dict:
    """torch.profiler of one call of `fn` (warmed already): its wall time, the device's busy time, the top
    operators, and its kernels by kind (bench/kernel_kinds.py; `tokens` the call's, `flops` some kinds' work)."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    started = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - started) * 1e3
    events = prof.key_averages()

    def rows(attribute: str) -> list[dict]:
        ranked = sorted(events, key=lambda e: getattr(e, attribute, 0), reverse=True)[:top]
        return [{"name": e.key[:90], "calls": e.count, "self_device_ms": round(getattr(e, "self_device_time_total", 0) / 1e3, 2),
                 "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2)} for e in ranked]

    device_ms = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3
    return {"wall_ms": round(wall_ms, 1), "device_busy_ms": round(device_ms, 1), "top_device": rows("self_device_time_total"),
            "top_cpu": rows("self_cpu_time_total"),
            "kinds": kernel_kinds(prof, on_gpu=device.type == "cuda", wall_s=wall_ms / 1e3, tokens=tokens, flops=flops or {}, peak_flops=PEAK_BF16_FLOPS)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="27b")
    parser.add_argument("--tokens", type=int, help=f"tokens per document (default by shape: {DOCUMENT_TOKENS})")
    parser.add_argument("--cases", default="4:none,4:mlp,4:layers,4:mlp:compile,1:none",
                        help="DOCS:CHECKPOINTING[:compile][:autotune][:sliding=N][:drafter=NAME][:block=B][:layers=L], comma-separated")
    parser.add_argument("--anchors", type=int, help=f"anchors per document (default by shape: {ANCHORS})")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory-gib", type=float, default=96.0, help="cap on GPU memory (RTX PRO 6000: 96)")
    parser.add_argument("--profile", default="4:mlp", help="the case to profile one steady step of ('' for none)")
    parser.add_argument("-o", "--output", type=Path)
    args = parser.parse_args()
    args.tokens = args.tokens or DOCUMENT_TOKENS[args.shape]
    args.anchors = args.anchors or ANCHORS[args.shape]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "peak_bf16_tflops": PEAK_BF16_FLOPS / 1e12, "cases": [],
    }
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * 2**30 / total))
        report["memory_cap_gib"] = args.memory_gib
    for text in args.cases.split(","):
        case = Case.parse(text)
        try:
            with case.compiling():
                result = run_case(args.shape, case, args.tokens, args.anchors, args.steps, args.warmup, device,
                                  profile=str(case) == str(Case.parse(args.profile)) if args.profile else False)
        except torch.OutOfMemoryError as exc:
            result = {"case": str(case), "error": f"out of memory: {str(exc).splitlines()[0]}"}
        except Exception as exc:  # a case that cannot run (a compile failure) must not cost the others
            result = {"case": str(case), "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        report["cases"].append(result)
        progress(json.dumps({k: v for k, v in result.items() if k != "profile"}))
        if args.output:  # after every case: a run cut short keeps what it measured
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(report, indent=2) + "\n")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps({**report, "cases": [{k: v for k, v in c.items() if k != "profile"} for c in report["cases"]]}, indent=2))


if __name__ == "__main__":
    main()
