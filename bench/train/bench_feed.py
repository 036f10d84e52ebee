"""Does the loader keep the GPU fed? The real training step on real chunks against the synthetic step, in one call.

    python bench/train/bench_feed.py [--shape 27b] [--chunks 5] [--dtypes bfloat16,float8_e4m3fn] [--no-loader] [--workdir DIR] -o $OUT/feed.json

One drafter of the shape (bench_train.py's: random weights, compiled on a GPU with the default
checkpointing, as Trainer.build sets it up) steps through, side by side:

1. `synthetic`: bench_train.py's two in-memory, pinned batches of 4 documents of 4,096 tokens;
2. `real bfloat16`: chunks of the real format on local disk (16 documents of 4,096 tokens each, the
   same batch shape) through ChunkCache and BatchStream as Trainer.build makes them (pinned, the
   cache holding every chunk): the first epoch fetches each chunk from the run's directory (checked
   against its sha256) and stores it in the cache, the second reads the cache's files;
3. `synthetic` again (the drift between the two synthetic passes bounds the noise);
4. `real float8_e4m3fn`: the same with fp8 chunks (half the bytes over PCIe, dequantized on the GPU);
5. the loader alone (bench_loader.py's cases, no paced case: 2-4 are it, with the real GPU step).

`--dtypes` picks the real passes (and the loader's cases), `--no-loader` leaves out 5. Per pass:
step time (median over the measured steps, and the mean, which carries any wait), its percentiles
and longest (`distribution`: a few steps that wait on a chunk raise the mean as a slower step
would), the seconds the loop waited for the loader per step, the real/synthetic ratio; a PNG of
every pass's histogram beside the JSON. Each step syncs on its loss, as the trainer's loss gather
does. The JSON is written after every stage. `--shape tiny` runs the same on a CPU in a few minutes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_loader  # noqa: E402
import bench_train  # noqa: E402
from dflash_jobs.storage import open_storage  # noqa: E402
from dflash_jobs.train.data import DocumentRef  # noqa: E402

DRAFTER_SHAPE = {"27b": "27b", "tiny": "tiny"}


def timed_steps(trainer, batches, device: torch.device, *, warmup: int, wait=lambda: 0.0) -> dict:
    """train_step over `batches` (an iterable of Batch); the first `warmup` steps are not measured."""
    times, waits = [], []
    before = wait()
    started = time.perf_counter()
    for i, batch in enumerate(batches):
        waited = wait() - before
        trainer.train_step(batch).loss.item()
        if device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        if i >= warmup:
            times.append(now - started)
            waits.append(waited)
        started, before = now, wait()
    return {"steps": len(times), "step_s": statistics.median(times), "step_s_mean": statistics.fmean(times),
            "distribution": bench_loader.step_distribution(times), "wait_s_per_step": statistics.fmean(waits),
            "step_s_all": [round(t, 4) for t in times]}


def synthetic_pass(trainer, synthetic, device, steps: int, warmup: int) -> dict:
    return timed_steps(trainer, (synthetic[i % 2] for i in range(warmup + steps)), device, warmup=warmup)


def real_pass(trainer, args, shape: dict, dtype: str, device: torch.device) -> dict:
    directory = args.workdir / f"feed-{dtype}"
    storage = open_storage(str(directory))
    started = time.perf_counter()
    manifest = bench_loader.write_chunks(storage, shape, args.chunks, dtype, "cuda" if device.type == "cuda" else "cpu")
    written_s = time.perf_counter() - started
    stream = bench_loader.make_stream(storage, manifest, shape, args.workdir / "feed-cache", manifest.bytes, 2,
                                      pin_memory=device.type == "cuda", read_threads=args.read_threads)
    per_epoch = len(stream.plans[0])
    epochs = []
    try:
        iterator = iter(stream)
        for epoch in range(2):
            batches = (next(iterator)[2] for _ in range(per_epoch))
            epochs.append(timed_steps(trainer, batches, device, warmup=1 if epoch == 0 else 0, wait=lambda: stream.wait_s))
    finally:
        stream.close()
    shutil.rmtree(directory, ignore_errors=True)
    shutil.rmtree(args.workdir / "feed-cache", ignore_errors=True)
    return {"dtype": dtype, "chunks": args.chunks, "chunk_gb": manifest.bytes / args.chunks / 1e9, "chunks_written_s": written_s,
            "first_epoch_fetched_and_cached": epochs[0], "second_epoch_from_cache": epochs[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench_loader.add_arguments(parser)
    parser.add_argument("--steps", type=int, default=8, help="measured synthetic steps per pass")
    parser.add_argument("--warmup", type=int, default=3, help="synthetic steps before the first measured one (compiles)")
    parser.add_argument("--no-loader", action="store_true", help="leave out the loader alone (stage 5)")
    parser.set_defaults(chunks=5, epochs=2)
    args = parser.parse_args()
    shape = bench_loader.SHAPES[args.shape]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {"command": " ".join(["python", *sys.argv]), "machine": bench_loader.machine(), "shape": {"name": args.shape, **shape},
              "passes": {}, "cases": []}

    def save() -> None:
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(report, indent=2) + "\n")

    docs = shape["batch_tokens"] // shape["document_tokens"]
    case = bench_train.Case(docs, "none" if device.type == "cuda" else "mlp", compile=device.type == "cuda")
    started = time.perf_counter()
    trainer, config = bench_train.build_trainer(DRAFTER_SHAPE[args.shape], case, shape["document_tokens"], shape["anchors"], device)
    chunk = bench_train.synthetic_chunk(docs, shape["document_tokens"], config)
    builder = bench_loader.BatchBuilder(layout=trainer.spec.train.layout, anchors=shape["anchors"],
                                        mask_token_id=config.mask_token_id, seed=0, layers=config.target_layer_ids)
    documents = [DocumentRef(0, i, i, shape["document_tokens"]) for i in range(docs)]
    synthetic = [builder.build(documents, {0: chunk}, epoch, pin_memory=device.type == "cuda") for epoch in range(2)]
    report["case"] = str(case)
    report["setup_s"] = time.perf_counter() - started
    save()

    report["passes"]["synthetic"] = synthetic_pass(trainer, synthetic, device, args.steps, args.warmup)
    bench_loader.progress(f"synthetic: {report['passes']['synthetic']['step_s']:.3f} s/step")
    save()
    dtypes = args.dtypes.split(",")
    report["passes"][f"real {dtypes[0]}"] = real_pass(trainer, args, shape, dtypes[0], device)
    save()
    report["passes"]["synthetic again"] = synthetic_pass(trainer, synthetic, device, args.steps, 1)
    save()
    for dtype in dtypes[1:]:
        report["passes"][f"real {dtype}"] = real_pass(trainer, args, shape, dtype, device)
    synthetic_s = statistics.fmean([report["passes"][p]["step_s"] for p in ("synthetic", "synthetic again")])
    for dtype in dtypes:
        real = report["passes"][f"real {dtype}"]
        for epoch in ("first_epoch_fetched_and_cached", "second_epoch_from_cache"):
            real[epoch]["x_synthetic"] = real[epoch]["step_s_mean"] / synthetic_s
        bench_loader.progress(f"real {dtype}: {json.dumps({e: real[e]['x_synthetic'] for e in real if isinstance(real[e], dict)})}")
    report["gpu_tokens_per_s"] = shape["batch_tokens"] / synthetic_s
    if args.output:
        steps = {"synthetic": report["passes"]["synthetic"]["step_s_all"] + report["passes"]["synthetic again"]["step_s_all"]}
        for dtype in dtypes:
            for epoch, label in (("first_epoch_fetched_and_cached", "first epoch"), ("second_epoch_from_cache", "second epoch")):
                steps[f"{dtype}, {label}"] = report["passes"][f"real {dtype}"][epoch]["step_s_all"]
        report["plot"] = str(args.output.with_suffix(".png"))
        bench_loader.plot_step_histograms(steps, args.output.with_suffix(".png"), f"Training steps at the {args.shape} shape: real chunks and synthetic batches")
    save()
    if args.no_loader:
        print(json.dumps(report["passes"], indent=2))
        return

    del trainer, synthetic
    if device.type == "cuda":
        torch.cuda.empty_cache()
    args.gpu_tokens_per_s, args.step_s, args.s3 = report["gpu_tokens_per_s"], 0.0, ""
    bench_loader.loader_cases(args, shape, device, report, save)
    save()
    print(json.dumps(report["passes"], indent=2))


if __name__ == "__main__":
    main()
