"""Speed and memory of the training data path: real hidden-state chunks through the real BatchStream.

    python bench/train/bench_loader.py [--shape 27b] [--chunks 4] [--dtypes bfloat16,float8_e4m3fn] [--s3 float8_e4m3fn]
                                       [--workdir DIR] [--step-s 1.23] [-o bench/results/loader-cpu.json]

Chunks of the real format at the shape (27b: 65,536 tokens of 16 documents of 4,096, 5 layers x
5,120, 3.36 GB in bf16, 1.68 GB in fp8; random states) are written to a local directory (and, with
--s3, to a real S3 server on loopback: moto in server mode, holding them in memory). Each case runs the real ChunkCache and
BatchStream (fetch and check against the manifest, read each document's rows, lay out the blocks,
pin on a GPU) and a consumer that moves every batch to the device (fp8 dequantized there) and
takes the next at once; per case:

- `streamed`: a cache of 0 bytes, every chunk fetched from storage every epoch (ranged GETs, sha256);
- `resident`: a cache holding every chunk, the epochs after the first read from the cache's files.

The chunk files' pages are dropped from the page cache (fsync, then posix_fadvise DONTNEED) before
each epoch, so disk reads are cold. Reported per case: tokens/s, GB/s of states delivered, the
seconds the consumer waited per step, the peak host memory (RSS sampled every 20 ms, above the
case's start), against `--gpu-tokens-per-s` (one GPU's training rate; bench_feed.py measures it in
the same call). Then `paced`: the resident case again with a consumer that spends `--step-s` per
step (as the GPU does), reporting the wait per step the training loop would see.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # train_fixtures: chunks, markers and manifest as extraction writes them

from dflash_jobs.spec import anchor_layout  # noqa: E402
from dflash_jobs.formats import Manifest  # noqa: E402
from dflash_jobs.storage import open_storage  # noqa: E402
from dflash_jobs.train.chunks import ChunkCache  # noqa: E402
from dflash_jobs.train.data import BatchBuilder, BatchStream, Budget, plan_epoch, read_document_index  # noqa: E402
from train_fixtures import synthetic_chunk, write_extract  # noqa: E402

SHAPES = {
    "27b": dict(chunk_tokens=65536, document_tokens=4096, layers=5, hidden_size=5120, vocab_size=248320, batch_tokens=16384,
                anchors=512, block_size=16, step_s=1.23),
    "tiny": dict(chunk_tokens=2048, document_tokens=256, layers=5, hidden_size=64, vocab_size=1024, batch_tokens=512,
                 anchors=32, block_size=16, step_s=0.02),
    # The 27B shape's rows in chunks of a quarter (0.84 GB): what a development machine's memory holds a few of.
    "cpu": dict(chunk_tokens=16384, document_tokens=4096, layers=5, hidden_size=5120, vocab_size=248320, batch_tokens=4096,
                anchors=64, block_size=16, step_s=0.3),
}
CONSUMER = (
    "The consumer moves each batch to the device (fp8 dequantized there) and takes the next; on a CPU the device is the "
    "CPU, so fp8's dequantization runs in the consumer on the CPU's cores and bounds the fp8 cases (wait per step ~0): "
    "on a GPU it is a kernel. peak_gib covers the whole case, the first epoch's downloads held in memory included."
)
GPU_TOKENS_PER_S = 13300.0
"""One H200's training step at the 27B shape (4 x 4,096 tokens, compiled, 1.23 s), measured 2026-12-04."""


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def write_chunks(storage, shape: dict, chunks: int, dtype: str, device: str) -> Manifest:
    documents = shape["chunk_tokens"] // shape["document_tokens"]
    generated = (synthetic_chunk(c, documents=documents, document_tokens=shape["document_tokens"], layers=shape["layers"],
                                 hidden_size=shape["hidden_size"], vocab_size=shape["vocab_size"], device=device) for c in range(chunks))
    return write_extract(storage, generated, model="synthetic", layers=list(range(1, shape["layers"] + 1)), dtype=dtype)


def drop_page_cache(*directories: Path) -> None:
    """Cold reads: this process's chunk files leave the page cache (other processes' pages stay)."""
    for directory in directories:
        for path in directory.rglob("*.safetensors"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def peak_rss():
    """Yields a dict whose 'peak_gib' holds the highest RSS above the start once the block ends."""
    result, stop, start = {}, threading.Event(), rss_bytes()
    peak = [start]

    def sample() -> None:
        while not stop.wait(0.02):
            peak[0] = max(peak[0], rss_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield result
    finally:
        stop.set()
        sampler.join()
        result.update(peak_gib=(peak[0] - start) / 2**30, peak_rss_gib=peak[0] / 2**30)


def step_distribution(times: list[float]) -> dict:
    """A pass's step times beside their mean: the percentiles and the longest, which a mean hides
    (a few steps that wait on a chunk raise the mean as much as a slower step every time)."""
    ordered = sorted(times)

    def percentile(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]

    return {"mean": sum(times) / len(times), "p50": percentile(50), "p90": percentile(90), "p99": percentile(99), "max": ordered[-1]}


def plot_step_histograms(passes: dict[str, list[float]], path: Path, title: str) -> None:
    """A PNG of each pass's step times: one histogram per pass on shared bins, its mean and p99 in the legend."""
    import matplotlib

    matplotlib.use("Agg")  # no display on the benchmark machines
    import matplotlib.pyplot as plt

    every = [t for times in passes.values() for t in times]
    bins = [min(every) + (max(every) - min(every)) * i / 40 for i in range(41)] if max(every) > min(every) else 10
    figure, axes = plt.subplots(figsize=(7, 4), dpi=120)
    for name, times in passes.items():
        shown = step_distribution(times)
        axes.hist(times, bins=bins, histtype="step", linewidth=1.5, label=f"{name}: mean {shown['mean']:.3f} s, p99 {shown['p99']:.3f} s")
    axes.set_xlabel("step time (s)")
    axes.set_ylabel("steps")
    axes.set_yscale("log")
    axes.legend(fontsize=8)
    axes.set_title(title, fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)


def make_stream(storage, manifest: Manifest, shape: dict, cache_dir: Path, cache_bytes: int, epochs: int, *,
                pin_memory: bool, read_threads: int) -> BatchStream:
    index = read_document_index(storage, [c.chunk for c in manifest.chunks])
    budget = Budget(tokens=shape["batch_tokens"], blocks=shape["batch_tokens"] // shape["document_tokens"] * shape["anchors"],
                    anchors=shape["anchors"])
    plans = [plan_epoch(index, world_size=1, seed=0, epoch=e, budget=budget)[0] for e in range(epochs)]
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache = ChunkCache(storage, cache_dir, cache_bytes, manifest.chunks)
    builder = BatchBuilder(layout=anchor_layout(block_size=shape["block_size"]), anchors=shape["anchors"], mask_token_id=shape["vocab_size"] - 1,
                           seed=0, layers=manifest.layers)
    return BatchStream(plans, cache, builder, pin_memory=pin_memory, read_threads=read_threads)


def consume(stream: BatchStream, device: torch.device, *, step_s: float, cold: list[Path]) -> list[dict]:
    """Every batch moved to `device` (fp8 dequantized there), then `step_s` spent as the GPU would;
    per epoch: steps, tokens, state bytes, seconds, seconds waited for the loader."""
    epochs: list[dict] = []
    started = waited = None
    try:
        for epoch, _, batch in stream:
            if len(epochs) <= epoch:
                now = time.perf_counter()
                if epochs:
                    epochs[-1].update(seconds=now - started, wait_s=stream.wait_s - waited, fetched=stream.cache.bytes_fetched)
                epochs.append(dict(epoch=epoch, steps=0, tokens=0, state_bytes=0))
                started, waited = now, stream.wait_s
            record = epochs[-1]
            record["steps"] += 1
            record["tokens"] += batch.tokens
            record["state_bytes"] += batch.context_hidden.numel() * batch.context_hidden.element_size()
            moved = batch.to(device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            del moved
            if step_s:
                time.sleep(step_s)
            if epoch + 1 < len(stream.plans) and record["steps"] == len(stream.plans[epoch]):
                drop_page_cache(*cold)  # before the producer opens the next epoch's chunks (it may be ahead)
        epochs[-1].update(seconds=time.perf_counter() - started, wait_s=stream.wait_s - waited, fetched=stream.cache.bytes_fetched)
    finally:
        stream.close()
    fetched = [record.pop("fetched") for record in epochs]  # running totals, at each epoch's last batch
    for record, before, after in zip(epochs, [0, *fetched[:-1]], fetched):
        record["fetched_gb"] = (after - before) / 1e9
    return epochs


def summarise(epochs: list[dict], gpu_tokens_per_s: float) -> dict:
    """Rates over some epochs: tokens/s, GB/s of states delivered, wait per step, GB fetched per epoch."""
    seconds, tokens = sum(e["seconds"] for e in epochs), sum(e["tokens"] for e in epochs)
    rate = tokens / seconds
    return {
        "tokens_per_s": rate, "states_gb_per_s": sum(e["state_bytes"] for e in epochs) / seconds / 1e9,
        "wait_s_per_step": sum(e["wait_s"] for e in epochs) / sum(e["steps"] for e in epochs), "x_gpu": rate / gpu_tokens_per_s,
        "fetched_gb_per_epoch": sum(e["fetched_gb"] for e in epochs) / len(epochs),
    }


def run_case(name: str, storage, manifest: Manifest, shape: dict, workdir: Path, *, cache_bytes: int, epochs: int, device: torch.device,
             read_threads: int, step_s: float, gpu_tokens_per_s: float, cold: list[Path]) -> dict:
    cache_dir = workdir / "cache"
    stream = make_stream(storage, manifest, shape, cache_dir, cache_bytes, epochs, pin_memory=device.type == "cuda", read_threads=read_threads)
    with peak_rss() as memory:
        epochs_measured = consume(stream, device, step_s=step_s, cold=[*cold, cache_dir])
    result = {"case": name, "dtype": manifest.dtype, "chunks": len(manifest.chunks), "chunk_gb": manifest.bytes / len(manifest.chunks) / 1e9,
              "cache_gb": cache_bytes / 1e9, "read_threads": read_threads, "step_s": step_s,
              # The first epoch fetches every chunk from storage (and fills a resident cache), the start-up
              # wait for the first chunk included; the later ones are the steady state.
              "first_epoch": summarise(epochs_measured[:1], gpu_tokens_per_s),
              "later_epochs": summarise(epochs_measured[1:] or epochs_measured, gpu_tokens_per_s), **memory, "epochs": epochs_measured}
    progress(json.dumps({k: v for k, v in result.items() if k != "epochs"}))
    return result


@contextmanager
def s3_server():
    """A moto S3 server on loopback, as the tests run it; yields its endpoint."""
    import socket

    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(key, value)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def loader_cases(args, shape: dict, device: torch.device, report: dict, save) -> None:
    """Every case of every dtype, the report saved after each."""
    for dtype in args.dtypes.split(","):
        directory = args.workdir / f"run-{dtype}"
        storage = open_storage(str(directory))
        started = time.perf_counter()
        manifest = write_chunks(storage, shape, args.chunks, dtype, "cuda" if device.type == "cuda" else "cpu")
        progress(f"{dtype}: {args.chunks} chunks of {manifest.bytes / args.chunks / 1e9:.2f} GB written in {time.perf_counter() - started:.1f}s")
        common = dict(device=device, read_threads=args.read_threads, gpu_tokens_per_s=args.gpu_tokens_per_s, cold=[directory])
        report["cases"].append(run_case("streamed from local disk", storage, manifest, shape, args.workdir, cache_bytes=0,
                                        epochs=args.epochs, step_s=0.0, **common))
        save()
        report["cases"].append(run_case("resident in the cache", storage, manifest, shape, args.workdir, cache_bytes=manifest.bytes,
                                        epochs=args.epochs, step_s=0.0, **common))
        save()
        if args.step_s:  # bench_feed.py paces with the real GPU step instead
            report["cases"].append(run_case("resident, paced at the GPU's step", storage, manifest, shape, args.workdir,
                                            cache_bytes=manifest.bytes, epochs=2, step_s=args.step_s, **common))
            save()
        if dtype in args.s3.split(","):
            import boto3

            with s3_server() as endpoint:
                boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
                remote = open_storage("s3://bench/run", endpoint_url=endpoint)
                for key in storage.list("extract/"):
                    remote.put_file(key, directory / key)
                report["cases"].append(run_case("streamed from S3 (moto on loopback)", remote, manifest, shape, args.workdir,
                                                cache_bytes=0, epochs=args.epochs, step_s=0.0, **common))
                save()
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(args.workdir / "cache", ignore_errors=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=sorted(SHAPES), default="27b")
    parser.add_argument("--chunks", type=int, default=4,
                        help="chunks per dtype; above BatchStream's window (a batch's chunks + prefetch_chunks) so streaming re-reads them")
    parser.add_argument("--dtypes", default="bfloat16,float8_e4m3fn")
    parser.add_argument("--epochs", type=int, default=3, help="the first warms up; the others are measured")
    parser.add_argument("--read-threads", type=int, default=4)
    parser.add_argument("--step-s", type=float, help="the GPU's step for the paced case (default by shape)")
    parser.add_argument("--gpu-tokens-per-s", type=float, default=GPU_TOKENS_PER_S)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/dflash-bench-loader"))
    parser.add_argument("-o", "--output", type=Path)


def machine() -> dict:
    return {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "python": platform.python_version(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
            "memory_gib": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--s3", default="", help="dtypes also streamed from a moto S3 server on loopback (it holds them in memory)")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    args.step_s = shape["step_s"] if args.step_s is None else args.step_s
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {"command": " ".join(["python", *sys.argv]), "machine": machine(), "shape": {"name": args.shape, **shape},
              "gpu_tokens_per_s": args.gpu_tokens_per_s, "consumer": CONSUMER, "cases": []}

    def save() -> None:
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(report, indent=2) + "\n")

    loader_cases(args, shape, device, report, save)
    report["machine"]["load_average_end"] = os.getloadavg()
    save()
    print(json.dumps({**report, "cases": [{k: v for k, v in c.items() if k != "epochs"} for c in report["cases"]]}, indent=2))


if __name__ == "__main__":
    main()
