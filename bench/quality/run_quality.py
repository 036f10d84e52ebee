"""Does the whole chain make a drafter that drafts, and does regenerating the answers pay? A small
target trained on real text, end to end, twice on the same prompts.

    python bench/quality/run_quality.py --size cpu|gpu [--out bench/results/quality-<size>.json] [--workdir DIR]

1. Corpus: the Python standard library's source, plus pydoc text of a few modules: real
   structure, available offline everywhere.
2. Target: a small model of the Qwen3.5 architecture (`dflash_jobs.tiny`, GDN + gated attention,
   multimodal checkpoint layout) trained briefly on chats "continue this code" built from it.
3. Data: new chats of the same kind, with the corpus's own continuation as the answer (chat JSONL).
4. The product's chain through its own entry points, twice (on a GPU both at once, so a chain's
   tokens/s may share the GPU with the other's), on specs written to the work directory:
   - source: `python -m dflash_jobs.prepare`, `python -m dflash_jobs.extract --shard 0/1`,
     `dflashctl verify`, `python -m dflash_jobs.train`, `python -m dflash_jobs.evaluate`, on the
     chats as they are;
   - regenerated: `python -m dflash_jobs.generate --shard 0/1` first (the transformers engine,
     greedy), so that the answers are the target's own, then the same chain.
   The held-out prompts are the last chats of the source in both, the same tokens (checked).
5. The figures, side by side: each drafter's acceptance length next to prompt lookup's
   (training-free n-gram drafting, as Transformers' `prompt_lookup_num_tokens`) on the same
   held-out prompts, tokens/s against plain greedy, and whether every output equals plain greedy.

Prints one JSON document (and writes it to --out, after every stage too, marked "complete": false
until the end). A rerun with the same --workdir goes on after the last finished stage (a device
call cut by its time limit), and inside a chain the product's own steps resume. The CPU size runs
in tests/test_quality.py.
"""

from __future__ import annotations

import argparse
import json
import os
import pydoc
import random
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import yaml

from dflash_jobs.formats import DATASET_KEY, EVAL_REPORT_KEY, TokenChunk
from dflash_jobs.prepare import HOLDOUT_KEY, prompt_length
from dflash_jobs.tiny import teach_tiny_target, write_tiny_target

REPO = Path(__file__).resolve().parents[2]
PYDOC_MODULES = ("json", "textwrap", "string", "functools", "itertools", "collections", "pathlib", "re", "heapq",
                 "bisect", "dataclasses", "argparse", "shutil", "typing", "contextlib", "statistics", "fractions")
"""Documented with pydoc too: modules that are safe to import (no side effects)."""


@dataclass(frozen=True, slots=True)
class Size:
    """One scale of the benchmark: everything that differs between the CPU test and the GPU run."""

    target_layers: int
    target_hidden: int
    vocab_size: int
    """Embedding rows of the target (the tokenizer leaves some unused: the drafter's mask token takes one)."""
    capture: list[int]
    """Target layers the drafter reads (target.layers)."""
    corpus_files: int
    """Standard-library modules read (sampled with a fixed seed)."""
    pydoc: bool
    """Add pydoc pages; their ruled layout ("     |  ") takes a target many steps to get beyond."""
    prompt_lines: int
    answer_lines: int
    train_steps: int
    train_seconds: float
    """Target training also stops here (the GPU run must fit its device-time budget); the JSON says where."""
    train_batch: int
    train_length: int
    lr: float
    chats: int
    """Conversations of the data set; the last `holdout` of them are the evaluation prompts."""
    holdout: int
    max_answer_tokens: int
    """generate.max_new_tokens: the target's answers are this long (a briefly trained target rarely ends them)."""
    regenerate_batch: int
    """generate.batch_prompts."""
    draft_layers: int
    block_size: int
    anchors: int
    epochs: int
    draft_lr: float
    micro_batch_tokens: int
    """train.micro_batch_tokens. Small on the CPU: its few epochs are then enough optimizer steps for the
    drafter to learn (at 2,048 it stopped after 67 steps, half trained, and the figures swung with the
    target's rounding), and the dense attention mask of the CPU path is quadratic in it."""
    micro_batch_blocks: int
    chunk_tokens: int
    max_length: int
    """data.max_length: also the longest batch shape extraction warms up, so kept near the longest sample."""
    eval_new_tokens: int


SIZES = {
    "cpu": Size(
        target_layers=4, target_hidden=64, vocab_size=1024, capture=[1, 3], corpus_files=60, pydoc=False,
        prompt_lines=2, answer_lines=1, train_steps=110, train_seconds=60.0, train_batch=32, train_length=64, lr=1e-2,
        chats=168, holdout=8, max_answer_tokens=24, regenerate_batch=56,
        draft_layers=1, block_size=8, anchors=24, epochs=8, draft_lr=3e-3, micro_batch_tokens=512, micro_batch_blocks=2048, chunk_tokens=4096,
        max_length=256, eval_new_tokens=24,
    ),
    "gpu": Size(
        target_layers=8, target_hidden=256, vocab_size=2048, capture=[1, 3, 5, 7], corpus_files=170, pydoc=True,
        prompt_lines=8, answer_lines=4, train_steps=800, train_seconds=110.0, train_batch=64, train_length=256, lr=2e-3,
        chats=2048, holdout=16, max_answer_tokens=96, regenerate_batch=512,
        draft_layers=2, block_size=16, anchors=64, epochs=6, draft_lr=1e-3, micro_batch_tokens=4096, micro_batch_blocks=8192, chunk_tokens=65536,
        max_length=512, eval_new_tokens=96,
    ),
}


# ---- 1. the corpus ---------------------------------------------------------------------------------


def stdlib_documents(files: int, *, with_pydoc: bool) -> list[str]:
    """Top-level standard-library modules (no tests, no vendored packages) and pydoc pages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    modules = sorted(root.glob("*.py"))
    picked = random.Random(0).sample(modules, min(files, len(modules)))
    documents = [path.read_text(errors="replace") for path in sorted(picked)]
    if with_pydoc:
        documents += [pydoc.render_doc(name, renderer=pydoc.plaintext) for name in PYDOC_MODULES]
    return documents


def continuation_chats(documents: list[str], count: int, size: Size, rng: random.Random) -> Iterator[tuple[str, str]]:
    """(prompt, answer) pairs: `prompt_lines` lines of a document, then the `answer_lines` that follow them."""
    lines_of = [[line.rstrip() for line in document.splitlines()] for document in documents]
    lines_of = [lines for lines in lines_of if len(lines) > size.prompt_lines + size.answer_lines]
    made = 0
    while made < count:
        lines = rng.choice(lines_of)
        start = rng.randrange(len(lines) - size.prompt_lines - size.answer_lines)
        prompt = "\n".join(lines[start : start + size.prompt_lines])
        answer = "\n".join(lines[start + size.prompt_lines : start + size.prompt_lines + size.answer_lines]).strip()
        if prompt.strip() and answer:
            made += 1
            yield prompt, answer


def conversation(prompt: str, answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Continue this text:\n{prompt}"}, {"role": "assistant", "content": answer}]


# ---- 2. the target ---------------------------------------------------------------------------------


def train_target(directory: Path, documents: list[str], size: Size, device: torch.device) -> dict[str, Any]:
    """Trains the checkpoint in `directory` in place on rendered conversations; returns the loss curve's ends."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    texts = [tokenizer.apply_chat_template(conversation(p, a), tokenize=False)
             for p, a in continuation_chats(documents, size.train_steps * size.train_batch, size, random.Random(1))]
    return teach_tiny_target(directory, texts, steps=size.train_steps, batch=size.train_batch, length=size.train_length,
                             lr=size.lr, seconds=size.train_seconds, device=device.type)


# ---- 3. the chats -----------------------------------------------------------------------------------


def write_chats(documents: list[str], size: Size, path: Path) -> Path:
    """`size.chats` chats answered by the corpus itself: the data set before regeneration."""
    rows = [{"messages": conversation(p, a)} for p, a in continuation_chats(documents, size.chats, size, random.Random(3))]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ---- 4. the product's chain ------------------------------------------------------------------------


def write_spec(workdir: Path, target: Path, data: Path, size: Size, device: torch.device, *, regenerate: bool) -> Path:
    spec = {
        "name": "quality",
        "backend": "local",
        "target": {"model": str(target), "layers": size.capture},
        "data": {"source": str(data), "max_length": size.max_length, "chunk_tokens": size.chunk_tokens, "holdout": size.holdout},
        "output": str(workdir / "run"),
        "extract": {"shards": 2, "token_budget": 8192, "dtype": "bfloat16", "pad_multiple": 128},
        "train": {
            "gpus_per_node": 1, "draft_layers": size.draft_layers, "block_size": size.block_size, "anchors": size.anchors,
            "epochs": size.epochs, "lr": size.draft_lr, "micro_batch_tokens": size.micro_batch_tokens,
            "micro_batch_blocks": size.micro_batch_blocks,
            "checkpoint_every": 10_000, "cache_gb": 1.0,
        },
        "eval": {"prompts": size.holdout, "max_new_tokens": size.eval_new_tokens},
        "local": {"workdir": str(workdir / "local"), "device": device.type},
    }
    if regenerate:
        # Greedy, as the evaluation decodes. The answers are cut at max_answer_tokens and kept: a
        # briefly trained target rarely ends its turn, and every prompt must keep its row (the same
        # held-out prompts in both runs). The template's default thinking mode, as the source run's
        # prepare renders it: the held-out prompts are then the same tokens in both runs.
        spec["generate"] = {
            "engine": "transformers", "shards": 2, "temperature": 0.0, "thinking": None, "max_new_tokens": size.max_answer_tokens,
            "truncated": "keep", "empty": "keep", "chunk_prompts": -(-size.chats // 4), "batch_prompts": size.regenerate_batch,
        }
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "dflash.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run_chain(spec: Path, workdir: Path, *, regenerate: bool) -> dict[str, float]:
    """[generate,] prepare, extract (two shards at once each), verify, train, evaluate: each as its pod would run it."""
    env = {**os.environ, "DFLASH_CACHE_DIR": str(workdir / "cache"), "PYTHONUNBUFFERED": "1"}
    job = [sys.executable, "-m"]
    seconds: dict[str, float] = {}

    def step(name: str, *commands: list[str], extra_env: dict[str, str] | None = None) -> None:
        started = time.monotonic()
        logs = [open(workdir / f"{name}-{i}.log", "w") for i in range(len(commands))]
        processes = [subprocess.Popen(c, env={**env, **(extra_env or {})}, stdout=log, stderr=subprocess.STDOUT) for c, log in zip(commands, logs)]
        codes = [p.wait() for p in processes]
        for log in logs:
            log.close()
        seconds[name] = round(time.monotonic() - started, 1)
        print(f"quality: {workdir.name} {name}: exit {max(codes)} after {seconds[name]} s", file=sys.stderr, flush=True)
        if any(codes):
            failed = next(i for i, code in enumerate(codes) if code)
            tail = (workdir / f"{name}-{failed}.log").read_text()[-3000:]
            raise RuntimeError(f"{name} failed (exit {codes[failed]}): {shlex.join(commands[failed])}\n{tail}")

    # Two shards share the machine: one intra-op thread each keeps them from fighting over cores.
    one_thread = {"OMP_NUM_THREADS": "1"}
    if regenerate:
        step("generate", *[job + ["dflash_jobs.generate", "-f", str(spec), "--shard", str(i)] for i in range(2)], extra_env=one_thread)
    # As `dflashctl run` does: prepare refuses to re-chunk tokens that hidden states were extracted
    # from, so a chain cut after it (a device call's limit) goes on from the stored data set.
    if (workdir / "run" / DATASET_KEY).exists():
        print(f"quality: {workdir.name} prepare: skipped, {DATASET_KEY} is stored", file=sys.stderr, flush=True)
    else:
        step("prepare", job + ["dflash_jobs.prepare", "-f", str(spec)])
    step("extract", *[job + ["dflash_jobs.extract", "-f", str(spec), "--shard", str(i)] for i in range(2)], extra_env=one_thread)
    step("verify", job + ["dflashctl.cli.main", "verify", "-f", str(spec)])
    step("train", job + ["dflash_jobs.train", "-f", str(spec)])
    step("evaluate", job + ["dflash_jobs.evaluate", "-f", str(spec)])
    return seconds


def held_out_prompts(workdir: Path) -> list[list[int]]:
    """The token ids the evaluation asked the target: each held-out sample before its last answer."""
    chunk = TokenChunk.decode((workdir / "run" / HOLDOUT_KEY).read_bytes(), HOLDOUT_KEY)
    return [chunk.sample(i)[0][: prompt_length(chunk.sample(i)[1])].tolist() for i in range(chunk.num_samples)]


def chain_figures(workdir: Path) -> dict[str, Any]:
    """One chain's evaluation report, reduced to its figures, and the prompts it was evaluated on."""
    report = json.loads((workdir / "run" / EVAL_REPORT_KEY).read_text())
    dataset = json.loads((workdir / "run" / DATASET_KEY).read_text())
    columns = {
        name: {key: summary[key] for key in ("acceptance_length", "acceptance_per_position", "tokens_per_second", "speedup", "lossless", "mismatches")}
        for name, summary in report["drafters"].items()
    }
    return {
        "acceptance_length": {name: round(column["acceptance_length"], 3) for name, column in columns.items()},
        "lossless": report["lossless"],
        "drafters": columns,
        "greedy_tokens_per_second": report["greedy"]["tokens_per_second"],
        "eval": {key: report[key] for key in ("prompts", "max_new_tokens", "block_size", "dtype")},
        "held_out_sample_ids": dataset["holdout"]["sample_ids"],
        "samples": dataset["samples"],
        "supervised_tokens": dataset["supervised_tokens"],
        "generation": dataset.get("generation"),
    }


# ---- 5. the figures --------------------------------------------------------------------------------


class Stages:
    """The stages a run has finished, kept in its work directory (stages.json) so that a rerun goes on
    after them; `report` receives the figures so far after each stage."""

    def __init__(self, workdir: Path, settings: dict[str, Any], report: Callable[[dict[str, Any]], None]) -> None:
        self.path = workdir / "stages.json"
        self.report = report
        self.lock = threading.Lock()
        self.done: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {"settings": settings}
        if self.done["settings"] != settings:
            raise SystemExit(f"{workdir} holds a quality run of other settings ({self.path}): remove it, or choose another --workdir")

    def run(self, name: str, stage: Callable[[], Any]) -> Any:
        if name not in self.done:
            started = time.monotonic()
            figures = stage()
            with self.lock:
                self.done[name] = {"figures": figures, "seconds": round(time.monotonic() - started, 1)}
                self.path.write_text(json.dumps(self.done, indent=2) + "\n")
                self.report(self.done)
        return self.done[name]["figures"]


def run(size_name: str, workdir: Path, report: Callable[[dict[str, Any]], None] = lambda stages: None) -> dict[str, Any]:
    size = SIZES[size_name]
    device = torch.device("cuda" if size_name == "gpu" else "cpu")
    if device.type == "cpu":
        # Tiny matrices: extra intra-op threads only add synchronisation, and on a shared box they spin.
        torch.set_num_threads(1)
    stages = Stages(workdir, asdict(size), report)
    documents = stdlib_documents(size.corpus_files, with_pydoc=size.pydoc)
    target = workdir / "target"

    def target_stage() -> dict[str, Any]:
        write_tiny_target(target, num_layers=size.target_layers, hidden_size=size.target_hidden, vocab_size=size.vocab_size)
        return train_target(target, documents, size, device)

    target_training = stages.run("target_training", target_stage)
    chats = write_chats(documents, size, workdir / "chats.jsonl")

    def chain_stage(name: str, regenerate: bool) -> dict[str, Any]:
        chain = workdir / name
        return {"step_seconds": run_chain(write_spec(chain, target, chats, size, device, regenerate=regenerate), chain, regenerate=regenerate),
                **chain_figures(chain)}

    # On a GPU the two chains run side by side: their small models leave it mostly idle, and one
    # device call then holds the whole run. On a CPU they would only fight over its cores.
    with ThreadPoolExecutor(max_workers=2 if device.type == "cuda" else 1) as pool:
        futures = {name: pool.submit(stages.run, name, lambda name=name, regenerate=regenerate: chain_stage(name, regenerate))
                   for name, regenerate in (("regenerated", True), ("source", False))}
        runs = {name: future.result() for name, future in futures.items()}
    if held_out_prompts(workdir / "regenerated") != held_out_prompts(workdir / "source"):
        raise RuntimeError("the two runs were evaluated on different prompts (a held-out chat dropped, or rendered otherwise)")
    return {
        "size": size_name,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "acceptance_length": {name: figures["acceptance_length"] for name, figures in runs.items()},
        "same_prompts": True,
        "chains_concurrent": device.type == "cuda",
        "runs": runs,
        "target_training": target_training,
        "settings": asdict(size),
        "seconds": {name: stages.done[name]["seconds"] for name in ("target_training", *runs)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON (default: bench/results/quality-<size>.json)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the run here (default: a temporary directory)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    command = shlex.join(["python", "bench/quality/run_quality.py", *(argv if argv is not None else sys.argv[1:])])
    out = args.out or REPO / "bench" / "results" / f"quality-{args.size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(document: dict[str, Any]) -> None:
        out.write_text(json.dumps({"command": command, **document}, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="dflash-quality-") as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        result = run(args.size, workdir, report=lambda stages: write({"complete": False, "stages": stages}))
    write({"complete": True, **result})
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
