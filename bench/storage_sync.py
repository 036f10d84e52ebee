"""What a stored chunk's end costs on the local store: the seconds from its last part handed over to
the store's return (the extraction's drain waits for them), with the data synced to the disk as it
goes (LocalStorage's SYNC_EVERY) and left to the page cache until the closing fsync (the version
before), side by side in one run, in both orders.

    python bench/storage_sync.py --mib 2048 --rounds 4 --dir /work --out bench/results/storage-sync-cpu.json

Each variant puts one object first, untimed (the file system's first allocations). The parts come
as an extraction's streamed chunk's do: in pieces, with a pause between them for the
forwards that fill them (`--gap-ms`), so a sync made while the parts come is hidden behind the pauses,
as the writer thread's is behind the GPU's forwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs"))
from dflash_jobs.storage import local  # noqa: E402

PIECE = 64 << 20
VARIANTS = {"synced as it goes": local.SYNC_EVERY, "closing fsync only (before)": sys.maxsize}


def put(root: Path, mib: int, gap_s: float, sync_every: int) -> dict[str, float]:
    """One object of `mib` MiB put in pieces: its total seconds and the seconds after the last piece."""
    piece = memoryview(os.urandom(PIECE))
    handed = 0.0

    def pieces():
        nonlocal handed
        for _ in range(mib * (1 << 20) // PIECE):
            time.sleep(gap_s)
            yield piece
        handed = time.monotonic()

    local.SYNC_EVERY = sync_every
    started = time.monotonic()
    local.LocalStorage(root).put_parts("extract/chunks/000000.safetensors", pieces())
    ended = time.monotonic()
    (root / "extract/chunks/000000.safetensors").unlink()
    return {"seconds": round(ended - started, 3), "after_last_part_s": round(ended - handed, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=2048, help="the object's size (a 27B chunk is about 3,000 MiB)")
    parser.add_argument("--gap-ms", type=float, default=50.0, help="the pause before each 64 MiB piece (the forwards that fill it)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both variants, in alternating orders")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory on this disk)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    default = local.SYNC_EVERY
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        try:
            for name in VARIANTS:  # warm-up: the file system's first allocations, the page cache's first fill
                put(Path(root), args.mib, 0.0, VARIANTS[name])
            for round_index in range(args.rounds):
                order = list(VARIANTS) if round_index % 2 == 0 else list(reversed(VARIANTS))
                for name in order:
                    runs[name].append(put(Path(root), args.mib, args.gap_ms / 1000, VARIANTS[name]))
                    print(f"round {round_index + 1}: {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
        finally:
            local.SYNC_EVERY = default
    medians = {name: {key: round(statistics.median(run[key] for run in found), 3) for key in found[0]} for name, found in runs.items()}
    report = {"command": " ".join(["python", "bench/storage_sync.py", *(argv if argv is not None else sys.argv[1:])]),
              "machine": platform.platform(), "cpus": os.cpu_count(), "mib": args.mib, "gap_ms": args.gap_ms, "sync_every": default,
              "runs": runs, "medians": medians}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(medians, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
