"""Storing one hidden-state chunk on local disk: safetensors' own writer against the extraction
worker's path, side by side in one run.

    python bench/extract_io/bench_chunk_write.py [--tokens 16384] [--layers 5] [--hidden 5120] [--repeats 8] -o OUT.json

The worker stores a chunk as `Storage.put_parts(key, formats.safetensors_parts(...))`: a canonical
header (a re-extracted chunk is byte-identical), the tensors' bytes written in place from memory,
fsync, SHA-256 computed on another thread meanwhile, then an atomic rename. This checks that all of
that costs no throughput against `safetensors.torch.save_file` plus fsync. Each writer runs
`repeats` times, alternating (the first round warms the page cache and is dropped); the median
counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from dflash_jobs.formats import TokenChunk, hidden_metadata, hidden_tensors, safetensors_parts
from dflash_jobs.storage import open_storage


def chunk_tensors(tokens: int, layers: int, hidden: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    lengths = np.full(tokens // 1024, 1024)
    chunk = TokenChunk(
        input_ids=np.arange(tokens, dtype=np.int32) % 1000, loss_mask=np.ones(tokens, dtype=np.uint8),
        cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), sample_ids=np.arange(len(lengths), dtype=np.int64),
    )
    states = torch.randn(tokens, layers, hidden, dtype=torch.bfloat16)
    metadata = hidden_metadata(layers=list(range(layers)), model="bench", config_hash="bench", dtype="bfloat16")
    return hidden_tensors(chunk, states, None), metadata


def timed(write, path: Path) -> float:
    started = time.perf_counter()
    write(path)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("-o", "--out", type=Path, required=True)
    args = parser.parse_args(argv)
    tensors, metadata = chunk_tensors(args.tokens, args.layers, args.hidden)

    def library(path: Path) -> None:
        save_file(tensors, str(path), metadata=metadata)
        with open(path, "rb") as f:
            os.fsync(f.fileno())  # on disk, as the worker's put_parts leaves it

    def worker(path: Path) -> None:
        open_storage(str(path.parent)).put_parts(path.name, safetensors_parts(tensors, metadata))

    writers = {"safetensors_save_file": library, "worker_put_parts": worker}
    seconds: dict[str, list[float]] = {name: [] for name in writers}
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as scratch:
        for _ in range(args.repeats):
            for name, write in writers.items():
                path = Path(scratch) / f"{name}.safetensors"
                seconds[name].append(timed(write, path))
                size = path.stat().st_size
                path.unlink()
    median = {name: statistics.median(times[1:]) for name, times in seconds.items()}
    result = {
        "benchmark": "chunk_write",
        "command": shlex.join(["python", "bench/extract_io/bench_chunk_write.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"cpus": os.cpu_count(), "processor": platform.machine(), "python": platform.python_version(), "torch": torch.__version__},
        "chunk": {"tokens": args.tokens, "layers": args.layers, "hidden": args.hidden, "bytes": size},
        "seconds": seconds,
        "median_gb_per_s": {name: round(size / t / 1e9, 3) for name, t in median.items()},
        "ratio_worker_over_library": round(median["safetensors_save_file"] / median["worker_put_parts"], 3),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
