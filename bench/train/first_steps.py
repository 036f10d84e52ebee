"""Does training start, and how long do its first steps take, on a data set of real size? The
trainer as its pod runs it (`python -m dflash_jobs.train`), on a synthetic extract shaped like the
GPU quality benchmark's: a random-weight tiny target, documents of a prompt and a supervised
answer, random hidden states written through the product's formats, markers and manifest.

    python bench/train/first_steps.py --out $OUT/first-steps.json [--documents 4096] [--deadline 240]

Every micro-batch of a real data set brings its own numbers of context tokens and blocks: this is
where a trainer that compiles per shape, or falls back to an unfused attention, stalls. The JSON
records the seconds from the process start to each step line, the step rate after the first, and,
where no step line came for `--stall` seconds, the trainer's own watchdog dump (every thread's
stack) from its log. It is written when the run ends or is cut at --deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # train_fixtures: chunks, markers and manifest as extraction writes them

from dflash_jobs.formats import MANIFEST_KEY, TokenChunk  # noqa: E402
from dflash_jobs.storage import open_storage  # noqa: E402
from dflash_jobs.architectures.tiny import write_tiny_target  # noqa: E402
from train_fixtures import write_extract  # noqa: E402

STEP_LINE = re.compile(r"step (\d+)/(\d+)")


def synthetic_extract(output: Path, target: Path, *, documents: int, prompt: tuple[int, int], answer: int, layers: list[int],
                      hidden_size: int, vocab: int, chunk_tokens: int, seed: int = 0) -> dict:
    """Chunks of documents (a prompt of random length, then `answer` supervised tokens) with random states."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(prompt[0], prompt[1], documents) + answer
    ends = np.searchsorted(np.cumsum(lengths), np.arange(chunk_tokens, lengths.sum() + chunk_tokens, chunk_tokens))
    bounds = sorted({0, *np.minimum(ends, documents).tolist()})

    def chunks():
        for begin, end in zip(bounds, bounds[1:]):
            ids = [rng.integers(0, vocab, n).astype(np.int32) for n in lengths[begin:end]]
            masks = [np.r_[np.zeros(n - answer, np.uint8), np.ones(answer, np.uint8)] for n in lengths[begin:end]]
            tokens = TokenChunk(
                input_ids=np.concatenate(ids), loss_mask=np.concatenate(masks),
                cu_seqlens=np.r_[0, np.cumsum(lengths[begin:end])].astype(np.int64), sample_ids=np.arange(begin, end, dtype=np.int64),
            ).validate(f"synthetic {begin}")
            yield tokens, torch.randn(tokens.num_tokens, len(layers), hidden_size)

    manifest = write_extract(open_storage(str(output)), chunks(), model=str(target), layers=layers, dtype="bfloat16")
    return {"documents": documents, "tokens": manifest.tokens, "chunks": len(manifest.chunks), "bytes": manifest.bytes}


def watch(command: list[str], log_path: Path, env: dict[str, str], deadline: float) -> dict:
    """Runs the trainer with its output in `log_path`; the seconds to each step line, and whether it
    finished before the deadline."""
    started = time.monotonic()
    steps: dict[int, float] = {}
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        while process.poll() is None and time.monotonic() - started < deadline:
            time.sleep(0.5)
            for match in STEP_LINE.finditer(log_path.read_text(errors="replace")):
                steps.setdefault(int(match.group(1)), round(time.monotonic() - started, 1))
        finished = process.poll() is not None
        if not finished:
            process.kill()
        process.wait()
    return {"exit_code": process.returncode if finished else None, "finished": finished, "seconds": round(time.monotonic() - started, 1),
            "step_lines": sorted(steps.items())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/dflash-first-steps"))
    parser.add_argument("--documents", type=int, default=4096)
    parser.add_argument("--deadline", type=float, default=240.0, help="seconds the trainer may run")
    parser.add_argument("--stall", type=float, default=60.0, help="train.stall_seconds: the watchdog's dump after this long without a step")
    parser.add_argument("--compile", choices=("default", "true", "false"), default="default", help="train.compile (default: unset)")
    parser.add_argument("--target-layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layers = list(range(1, args.target_layers, 2))
    report: dict = {"command": " ".join(["python", *sys.argv]), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "torch": torch.__version__}
    target = write_tiny_target(args.workdir / "target", num_layers=args.target_layers, hidden_size=args.hidden, vocab_size=args.vocab)
    output = args.workdir / "run"
    if not (output / MANIFEST_KEY).exists():
        report["data"] = synthetic_extract(output, target, documents=args.documents, prompt=(60, 200), answer=96, layers=layers,
                                           hidden_size=args.hidden, vocab=args.vocab - 64, chunk_tokens=65536)
    train = {"gpus_per_node": 1, "draft_layers": 2, "block_size": 16, "anchors": 64, "epochs": args.epochs, "lr": 1e-3,
             "micro_batch_tokens": args.micro_batch_tokens, "micro_batch_blocks": 8192, "checkpoint_every": 100_000, "cache_gb": 4.0,
             "stall_seconds": args.stall}
    if args.compile != "default":
        train["compile"] = args.compile == "true"
    spec = {"name": "first-steps", "backend": "local", "target": {"model": str(target), "layers": layers},
            "data": {"source": str(args.workdir / "unused.jsonl"), "max_length": 512, "chunk_tokens": 65536},
            "output": str(output), "train": train, "local": {"workdir": str(args.workdir / "local"), "device": device}}
    spec_path = args.workdir / f"dflash-{args.compile}.yaml"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    for stale in output.glob("train"):  # every run trains from step 0
        subprocess.run(["rm", "-rf", str(stale)], check=True)
    env = {**os.environ, "DFLASH_CACHE_DIR": str(args.workdir / "cache"), "PYTHONUNBUFFERED": "1"}
    log_path = args.out.with_suffix(".log")
    run = watch([sys.executable, "-m", "dflash_jobs.train", "-f", str(spec_path)], log_path, env, args.deadline)
    lines = run["step_lines"]
    if len(lines) >= 2:
        (first_step, first_s), (last_step, last_s) = lines[0], lines[-1]
        run["first_step_s"] = first_s
        run["steps_per_s_after_first"] = round((last_step - first_step) / max(last_s - first_s, 1e-9), 2)
    log_text = log_path.read_text()
    run["watchdog_dumps"] = log_text.count("no training step for")
    run["log_tail"] = log_text[-6000:]
    report["train"] = {"compile": args.compile, **run}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report["train"].items() if k != "log_tail"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
