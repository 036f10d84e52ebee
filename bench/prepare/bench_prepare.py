"""Throughput and peak memory of `prepare` on synthetic chat JSONL.

    python bench/prepare/bench_prepare.py [--samples 100000] [--workers 1,N] [-o bench/results/prepare.json]

Writes the tiny target (its Qwen3.5-style tokenizer and chat template) and synthetic conversations,
then runs prepare once per configuration, each in a fresh process so that its peak RSS is its own:
getrusage ru_maxrss of the main process (whole life, imports included) and of the largest worker,
and the peak during prepare alone (VmHWM reset after the imports). The time excludes importing
transformers and torch. With one worker the Rust tokenizer still uses every CPU. Two inputs:
- chat: the demo's conversations (1-3 short turns, ~90 tokens): the per-row cost of rendering;
- long-chat: the same with every reply repeated 20 times (~1K tokens, like real chat data).
Streaming shows as a peak RSS that does not grow with the number of samples (10% and 100% runs).
Prints one JSON document and writes it to -o.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LONG_REPEAT = 20


def write_source(path: Path, kind: str, samples: int) -> None:
    from dflash_jobs.architectures.tiny.chats import tiny_chat_rows

    with path.open("w") as f:
        for row in tiny_chat_rows(samples, seed=0):
            if kind == "long-chat":
                for message in row["messages"]:
                    if message["role"] == "assistant":
                        message["content"] = " ".join([message["content"]] * LONG_REPEAT)
            f.write(json.dumps(row) + "\n")


def reset_peak_rss() -> bool:
    """Restarts the kernel's peak-RSS counter (VmHWM) of this process; False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_child(args: argparse.Namespace) -> None:
    """One measured prepare run; prints its figures as JSON."""
    from dflash_jobs.prepare import prepare
    from dflash_jobs.rows import load_tokenizer
    from dflash_jobs.spec import parse_spec

    # Importing transformers (and torch with it) takes seconds and most of the memory: not prepare's.
    load_tokenizer(args.target)
    baseline_mib = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    measured_peak = reset_peak_rss()

    spec = parse_spec({
        "name": "bench", "backend": "local", "target": {"model": args.target},
        "data": {"source": args.source, "max_length": 4096, "chunk_tokens": 65536, "holdout": 64},
        "output": args.run_output,
    })
    started = time.perf_counter()
    index = prepare(spec, workers=args.child_workers)
    seconds = time.perf_counter() - started
    rows = index.samples + index.holdout["samples"] + sum(index.dropped.values())
    tokens = index.tokens + index.holdout.get("tokens", 0)
    print(json.dumps({
        "rows": rows,
        "tokens": tokens,
        "chunks": len(index.chunks),
        "seconds": round(seconds, 2),
        "samples_per_s": round(rows / seconds, 1),
        "tokens_per_s": round(tokens / seconds),
        # ru_maxrss is in KiB on Linux; RUSAGE_CHILDREN reports the largest worker.
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rss_after_imports_mib": baseline_mib,
        "peak_rss_during_prepare_mib": peak_rss_mib() if measured_peak else None,
        "peak_rss_worker_mib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--long-samples", type=int, default=10_000)
    parser.add_argument("--workers", default=None, help="comma-separated worker counts (default: 1 and every CPU)")
    parser.add_argument("-o", "--output", type=Path, default=Path("bench/results/prepare.json"))
    parser.add_argument("--child-workers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--run-output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_workers is not None:
        run_child(args)
        return

    import tokenizers
    import transformers

    from dflash_jobs.prepare import cpu_budget
    from dflash_jobs.architectures.tiny import write_tiny_target

    cpus = cpu_budget()
    workers = [int(w) for w in args.workers.split(",")] if args.workers else sorted({1, cpus})
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as scratch:
        scratch = Path(scratch)
        target = write_tiny_target(scratch / "target")
        plan = [("chat", max(args.samples // 10, 1)), ("chat", args.samples), ("long-chat", args.long_samples)]
        for kind, samples in plan:
            source = scratch / f"{kind}-{samples}.jsonl"
            write_source(source, kind, samples)
            for count in workers:
                command = [
                    sys.executable, __file__, "--child-workers", str(count), "--target", str(target),
                    "--source", str(source), "--run-output", str(scratch / f"out-{kind}-{samples}-{count}"),
                ]
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode != 0:
                    sys.exit(f"prepare run failed ({' '.join(command)}):\n{done.stderr[-4000:]}")
                figures = json.loads(done.stdout.strip().splitlines()[-1])
                runs.append({"input": kind, "samples": samples, "input_mib": round(source.stat().st_size / 2**20, 1), "workers": count, **figures})
                print(json.dumps(runs[-1]), file=sys.stderr)
    result = {
        "benchmark": "prepare",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpus": cpus, "processor": platform.processor() or platform.machine(), "python": platform.python_version(),
                    "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                    "load_average": [round(x, 2) for x in os.getloadavg()]},
        "tokenizer": "tiny Qwen3.5 tokenizer (byte-level BPE) with a Qwen3.5-style chat template (dflash_jobs.architectures.tiny.qwen3_5)",
        "runs": runs,
    }
    text = json.dumps(result, indent=2) + "\n"
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
