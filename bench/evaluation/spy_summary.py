"""Where a process's time went, from py-spy's raw stacks (`py-spy record -f raw`): per process, the
seconds of every function on the stack (inclusive) and at its top (self), and the seconds Python
spent compiling sources to bytecode (a site that holds no .pyc and takes none pays it in every process).

    python bench/evaluation/spy_summary.py bench/results/spy-eval-after-16-h100.txt.gz --rate 250 --out bench/results/spy-eval-after-16-h100-summary.json

A raw record is `process P:"COMMAND";frame;frame;... COUNT`; a command may span lines (python -c).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
from pathlib import Path

RECORD = re.compile(r"\n(?=process \d+:)")
COMPILING = "SourceLoader.source_to_code"


def records(text: str):
    """(process, frames, samples) of every raw record; frames outermost first, each "function (file:line)"."""
    for record in RECORD.split(text.strip()):
        stack, _, count = record.rpartition(" ")
        parts = stack.split(";")
        processes = [p for p in parts if p.startswith("process ")]
        yield (processes[-1].split(":", 1)[0] if processes else "?"), [p for p in parts if not p.startswith("process ")], int(count)


def function(frame: str) -> str:
    """A frame without its line: one function's samples summed over its lines."""
    return re.sub(r":\d+\)$", ")", frame)


def summarize(text: str, rate: float, top: int) -> dict:
    per_process: dict[str, dict] = {}
    for process, frames, samples in records(text):
        totals = per_process.setdefault(process, {"samples": 0, "inclusive": collections.Counter(), "self": collections.Counter(), "compiling": 0})
        totals["samples"] += samples
        for name in {function(frame) for frame in frames}:
            totals["inclusive"][name] += samples
        if frames:
            totals["self"][frames[-1]] += samples
        if any(frame.startswith(COMPILING) for frame in frames):
            totals["compiling"] += samples

    def seconds(counter: collections.Counter) -> list[dict]:
        return [{"seconds": round(n / rate, 2), "frame": name[:200]} for name, n in counter.most_common(top)]

    return {process: {"seconds": round(t["samples"] / rate, 2), "compiling_sources_seconds": round(t["compiling"] / rate, 2),
                      "inclusive": seconds(t["inclusive"]), "self": seconds(t["self"])}
            for process, t in sorted(per_process.items(), key=lambda item: -item[1]["samples"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw", type=Path, help="py-spy's raw output, gzipped or not")
    parser.add_argument("--rate", type=float, required=True, help="py-spy's samples a second (its -r)")
    parser.add_argument("--top", type=int, default=60)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    text = gzip.decompress(args.raw.read_bytes()).decode() if args.raw.suffix == ".gz" else args.raw.read_text()
    summary = {"source": args.raw.name, "rate": args.rate, "processes": summarize(text, args.rate, args.top)}
    args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
