"""An online training step (train.states: online) against a stored-states step plus a bare target
forward of the same tokens, side by side in one run (issue 47's goal: online <= 1.10x their sum).

    python bench/train/bench_online.py --shape smollm2 [--docs 8] [--fp8] [--rounds 3] -o $OUT/online-smollm2.json
    python bench/train/bench_online.py --shape smollm2 --docs 32 --draft-layers 3 --compile-target --profile -o $OUT/online-scale.json
    python bench/train/bench_online.py --shape 27b --docs 2 --fp8 -o $OUT/online-27b.json
    python bench/train/bench_online.py --shape tiny        # the same on a CPU, in about a minute

Random weights of the target's real shape (Qwen3.6-27B's text model cut after its deepest captured
layer, bench/extract_shapes.py; SmolLM2-135M's Llama shape) and of the drafter's (bench_train.py's
shapes, compiled on a GPU). One micro-batch of `docs` documents of the shape's document length,
the same tokens and anchors on every path:
- bare: the target's forward over the capture's rows (the planner's packing), nothing captured;
- stored: Trainer.train_step on the batch built from stored states (read into pinned memory);
- online: Trainer.train_step with the target run in the step (train/online.py: capture, checks);
- with `--compile-target`, bare_compiled and online_compiled: the same on a second copy of the
  target whose norms and MLPs are compiled as extract.compile does it (capture/fusion.py), both
  copies side by side in the same rounds.
Every path is warmed first (Triton autotuning, torch.compile), then timed in rounds in both orders
(bare, stored, online, then online, stored, bare), the median of each reported with the ratio
online / (stored + bare). `--profile` then runs torch.profiler over one call of each path (its wall
time, the device's busy time, the operators that take it). JSON after every stage.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_train  # noqa: E402
from extract_shapes import bench_device, random_27b  # noqa: E402

from dflash_jobs.architectures import llama  # noqa: E402
from dflash_jobs.capture import fp8, fusion, packing  # noqa: E402
from dflash_jobs.capture.runner import TargetCapture  # noqa: E402
from dflash_jobs.capture.target import CaptureTarget, FastPaths, prepare_for_capture  # noqa: E402
from dflash_jobs.spec import ExtractSpec  # noqa: E402
from dflash_jobs.train.chunks import TokenChunkData  # noqa: E402
from dflash_jobs.train.data import BatchBuilder, DocumentRef, TargetContext  # noqa: E402
from dflash_jobs.train.online import OnlineStates  # noqa: E402

SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
               head_dim=64, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=1e5)
DOCS = {"27b": 2, "smollm2": 8, "tiny": 2}


def random_llama(config_values: dict, layers: list[int], device: torch.device, dtype: torch.dtype) -> CaptureTarget:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaModel

    config = LlamaConfig(**config_values)
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaModel(config)
    finally:
        torch.set_default_dtype(previous)
    return CaptureTarget(model=prepare_for_capture(model, layers), layers=layers, hidden_size=config.hidden_size, name="random-llama",
                  config_hash="random", architecture=llama.ARCHITECTURE, conv_gap=0)


def build_target(shape: str, device: torch.device, layers: list[int]) -> CaptureTarget:
    if shape == "27b":
        return random_27b(device)
    if shape == "smollm2":
        return random_llama(SMOLLM2, layers, device, torch.bfloat16)
    tiny = dict(SMOLLM2, hidden_size=64, num_hidden_layers=8, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, vocab_size=1024)
    return random_llama(tiny, layers, device, torch.bfloat16)


@dataclass
class Report:
    """The JSON of the run, written after every stage: a run cut short keeps what it measured."""

    output: Path | None
    result: dict

    def save(self) -> None:
        if self.output:
            self.output.parent.mkdir(parents=True, exist_ok=True)
            self.output.write_text(json.dumps(self.result, indent=2) + "\n")


def build_capture(args, device: torch.device, layers: list[int], docs: int, tokens: int, *, compiled: bool) -> tuple[TargetCapture, FastPaths, bool]:
    """A random target of the shape, set up as extraction sets it up (FP8 compute, compiled norms and MLPs as asked)."""
    target = build_target(args.shape, device, layers)
    if args.fp8:
        fp8.require_fp8(device)
        fp8.to_float8(target.decoder_layers)
    if compiled:
        fusion.compile_elementwise(target.decoder_layers, target.architecture.fused_submodules)
    fast = FastPaths.detect(device, target.architecture)
    packed = packing.can_pack(target.architecture, device, fla=fast.fla)
    capture = TargetCapture(target, ExtractSpec(token_budget=docs * tokens + 64 * docs), packed=packed, max_length=tokens, capacity=docs * tokens)
    return capture, fast, packed


def build_paths(args, device: torch.device, report: Report) -> tuple[dict[str, Callable[[], None]], Callable[[], None], int]:
    """The paths over one micro-batch (bare, stored, online; with --compile-target bare_compiled and
    online_compiled), the online checks' reader, and the batch's context tokens."""
    cuda = device.type == "cuda"
    docs, tokens = report.result["docs"], report.result["tokens_per_doc"]
    drafter_shape = args.shape if args.shape in bench_train.SHAPES else "tiny"
    started = time.perf_counter()
    case = bench_train.Case(docs=docs, checkpointing="none" if cuda else "mlp", compile=cuda, layers=args.draft_layers)
    layers = bench_train.SHAPES[drafter_shape]["target_layer_ids"]
    captures = {"": build_capture(args, device, layers, docs, tokens, compiled=False)}
    if args.compile_target:
        captures["_compiled"] = build_capture(args, device, layers, docs, tokens, compiled=True)
    capture, fast, packed = captures[""]
    # One drafter for every path (two would not fit beside a 27B target): each path sets where its states come from.
    trainer, config = bench_train.build_trainer(drafter_shape, case, tokens, bench_train.ANCHORS[drafter_shape], device)
    given = trainer.states
    chunk = bench_train.synthetic_chunk(docs, tokens, config)
    documents = [DocumentRef(0, i, i, tokens) for i in range(docs)]

    def builder(**context) -> BatchBuilder:
        return BatchBuilder(layout=trainer.spec.train.layout, anchors=bench_train.ANCHORS[drafter_shape], mask_token_id=config.mask_token_id,
                            seed=0, layers=layers, **context)

    stored_batch = builder().build(documents, {0: chunk}, 0, pin_memory=cuda)
    online_batch = builder(context=TargetContext(capture.planner)).build(documents, {0: TokenChunkData(chunk.tokens, "synthetic")}, 0, pin_memory=cuda)
    rows = [batch.to(device) for batch, _ in online_batch.target_input.rows]
    report.result["setup"] = {"seconds": round(time.perf_counter() - started, 1), "fast_paths": fast.as_dict(), "packed": packed,
                              "context_tokens": stored_batch.tokens, "target_rows": len(rows), "blocks": int(stored_batch.block_ids.shape[0])}

    def bare_of(capture: TargetCapture) -> Callable[[], None]:
        def bare() -> None:
            capture.hooks.start(None)
            with torch.no_grad():
                for batch in rows:
                    capture.target.model(**packing.forward_kwargs(batch, capture.target.architecture))
        return bare

    def online_of(states: OnlineStates) -> Callable[[], None]:
        def online() -> None:
            trainer.states = states
            trainer.train_step(online_batch)
        return online

    def stored() -> None:
        trainer.states = given
        trainer.train_step(stored_batch)

    online_states = {suffix: OnlineStates(capture) for suffix, (capture, _, _) in captures.items()}
    paths = {"bare": bare_of(capture), "stored": stored, "online": online_of(online_states[""])}
    for suffix in captures.keys() - {""}:
        paths |= {f"bare{suffix}": bare_of(captures[suffix][0]), f"online{suffix}": online_of(online_states[suffix])}

    def check() -> None:
        for states in online_states.values():
            states.check()

    return paths, check, stored_batch.tokens


def time_paths(paths: dict[str, Callable[[], None]], check: Callable[[], None], *, rounds: int, device: torch.device, report: Report) -> dict[str, float]:
    """Every path warmed (three runs each), then `rounds` rounds in alternating orders; the median seconds of each."""
    def timed(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - begin

    warm = time.perf_counter()
    for fn in paths.values():
        for _ in range(3):
            timed(fn)
    check()
    report.result["warmup_s"] = round(time.perf_counter() - warm, 1)
    report.save()
    times: dict[str, list[float]] = {name: [] for name in paths}
    for round_ in range(rounds):
        for name in (list(paths) if round_ % 2 == 0 else list(reversed(paths))):
            times[name].append(timed(paths[name]))
        check()
        report.result["seconds"] = times
        report.save()
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=["27b", "smollm2", "tiny"], default="smollm2")
    parser.add_argument("--docs", type=int)
    parser.add_argument("--fp8", action="store_true", help="the target's linear layers in FP8 (extract.compute_dtype: float8)")
    parser.add_argument("--draft-layers", type=int, help="train.draft_layers of the drafter (default: the spec's)")
    parser.add_argument("--compile-target", action="store_true",
                        help="beside the eager target, a copy with its norms and MLPs compiled (extract.compile), timed in the same rounds")
    parser.add_argument("--profile", action="store_true", help="torch.profiler over one call of each path, after the timed rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-gib", type=float, default=96.0)
    parser.add_argument("-o", "--output", type=Path)
    args = parser.parse_args()
    device = bench_device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    report = Report(args.output, {
        "command": " ".join(["python", *sys.argv]), "shape": args.shape, "docs": args.docs or DOCS[args.shape],
        "tokens_per_doc": bench_train.DOCUMENT_TOKENS[args.shape], "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "fp8_target": args.fp8, "draft_layers": args.draft_layers, "compile_target": args.compile_target,
    })
    report.save()
    try:
        if cuda:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * 2**30 / total), device)
        paths, check, tokens = build_paths(args, device, report)
        report.save()
        median = time_paths(paths, check, rounds=args.rounds, device=device, report=report)
        report.result["median_s"] = median
        report.result["online_over_stored_plus_bare"] = round(median["online"] / (median["stored"] + median["bare"]), 4)
        if args.compile_target:
            report.result["compiled_target"] = {
                "bare_compiled_over_bare": round(median["bare_compiled"] / median["bare"], 4),
                "online_compiled_over_online": round(median["online_compiled"] / median["online"], 4),
                "online_compiled_over_stored_plus_bare_compiled": round(median["online_compiled"] / (median["stored"] + median["bare_compiled"]), 4),
            }
        report.result["tokens_per_s"] = {name: round(tokens / value, 1) for name, value in median.items()}
        if cuda:
            report.result["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        report.save()
        if args.profile:
            report.result["profile"] = {}
            for name, fn in paths.items():
                report.result["profile"][name] = bench_train.profile_call(fn, device)
                report.save()
            check()
    except Exception as exc:  # what a GPU run cut short measured stays, with why it stopped
        report.result["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        report.save()
        raise
    print(json.dumps({k: v for k, v in report.result.items() if k != "profile"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
