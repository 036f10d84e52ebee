"""Does fetching a chunk stall the training thread? The real ChunkCache and BatchStream fetch, check,
store and open chunks while the training thread runs a step that holds the GIL throughout, as a
step's kernel launches do.

    python bench/train/bench_fetch_stall.py --shape cpu --chunks 6 --workdir /tmp/fetch-stall -o /tmp/fetch-stall.json

A GPU step is Python launching kernels: while another thread holds the GIL the launches wait and the
GPU runs dry, so a loader that never starves the queue of batches can still slow the steps (the
first epoch of bench_feed.py: a mean step 1.19x the synthetic one, the steps while a chunk was
fetched 2-3 s against 1.15 s). Here the step is a fixed number of tiny tensor operations
(calibrated to `--step-s` alone), so any time the loader's threads hold the GIL shows as a longer
step, on a CPU as on a GPU machine. The chunks beyond the first three (the first batch's and the
two read ahead, fetched before the first step) are fetched while steps run. Passes, in order: `alone` (no loader), the first epoch (every
chunk fetched from the run's directory, checked against its sha256, stored in the cache), the
second epoch (the cache's files), `alone again` (the drift bounds the noise). Per pass: the step
times' mean, percentiles and longest, the longest the training thread stood still between two of
its operations (`longest_stop_s`: on a machine with cores to spare, the longest the loader held the
GIL), and the seconds waited for a batch; a PNG of the histograms beside the JSON. On a loaded
2-core machine the step times mostly measure the competition for the cores; `longest_stop_s` still
tells a GIL held for a second from a thread that waited its turn for a core. bench_feed.py
measures the first-epoch ratio with the real GPU step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_loader  # noqa: E402
from dflash_jobs.storage import open_storage  # noqa: E402


def launch_bound_step(operations: int) -> tuple[float, float]:
    """`operations` in-place additions to a tiny tensor, which need the GIL all along as a training
    step's launches do: the seconds they took, and the longest between two of them (the longest
    the training thread could not run: a GIL held elsewhere, or on a busy machine no free core)."""
    x = torch.zeros(8)
    started = last = time.perf_counter()
    longest = 0.0
    for _ in range(operations):
        x.add_(1.0)
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    return last - started, longest


def calibrate(step_s: float) -> int:
    """Operations that take about `step_s` on this machine now (the best of three tries)."""
    probe = 20_000
    per_operation = min(launch_bound_step(probe)[0] for _ in range(3)) / probe
    return max(1, round(step_s / per_operation))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench_loader.add_arguments(parser)
    parser.set_defaults(shape="cpu", chunks=6, dtypes="bfloat16", epochs=2)
    args = parser.parse_args()
    shape = bench_loader.SHAPES[args.shape]
    step_s = args.step_s or shape["step_s"]
    report: dict = {"command": " ".join(["python", *sys.argv]), "machine": bench_loader.machine(), "shape": {"name": args.shape, **shape},
                    "step_s": step_s, "passes": {}}

    def save() -> None:
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(report, indent=2) + "\n")

    directory = args.workdir / "run"
    storage = open_storage(str(directory))
    started = time.perf_counter()
    manifest = bench_loader.write_chunks(storage, shape, args.chunks, args.dtypes.split(",")[0], "cpu")
    report.update(dtype=manifest.dtype, chunks=args.chunks, chunk_gb=manifest.bytes / args.chunks / 1e9, chunks_written_s=time.perf_counter() - started)
    operations = calibrate(step_s)
    report["operations_per_step"] = operations
    stream = bench_loader.make_stream(storage, manifest, shape, args.workdir / "cache", manifest.bytes, args.epochs,
                                      pin_memory=False, read_threads=args.read_threads)
    per_epoch = len(stream.plans[0])
    steps: dict[str, list[tuple[float, float]]] = {"alone": [launch_bound_step(operations) for _ in range(per_epoch)]}
    waits: dict[str, float] = {"alone": 0.0}
    try:
        bench_loader.drop_page_cache(directory)
        for epoch, _, _ in stream:
            name = "first epoch: fetched, checked, cached" if epoch == 0 else f"epoch {epoch + 1}: from the cache"
            steps.setdefault(name, []).append(launch_bound_step(operations))
            waits[name] = stream.wait_s - sum(waited for other, waited in waits.items() if other != name)
    finally:
        stream.close()
    steps["alone again"] = [launch_bound_step(operations) for _ in range(per_epoch)]
    times = {name: [seconds for seconds, _ in measured] for name, measured in steps.items()}
    alone = [t for name in ("alone", "alone again") for t in times[name]]
    for name, measured in times.items():
        report["passes"][name] = {**bench_loader.step_distribution(measured), "x_alone": sum(measured) / len(measured) / (sum(alone) / len(alone)),
                                  "longest_stop_s": max(longest for _, longest in steps[name]), "wait_s": waits.get(name, 0.0),
                                  "step_s_all": [round(t, 4) for t in measured]}
        bench_loader.progress(f"{name}: {json.dumps({k: v for k, v in report['passes'][name].items() if k != 'step_s_all'})}")
    if args.output:
        report["plot"] = str(args.output.with_suffix(".png"))
        bench_loader.plot_step_histograms(times, args.output.with_suffix(".png"),
                                          f"A GIL-bound step of {step_s} s while the loader fetches {report['chunk_gb']:.2f} GB chunks")
    save()
    shutil.rmtree(args.workdir, ignore_errors=True)
    print(json.dumps({name: {k: v for k, v in figures.items() if k != "step_s_all"} for name, figures in report["passes"].items()}, indent=2))


if __name__ == "__main__":
    main()
