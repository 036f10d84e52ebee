"""Does the whole chain make a drafter that drafts, and what does it take? A small target of the
real architecture trained on real text, then the product's chain, end to end, on the same held-out
prompts, for several data sets side by side.

    python bench/quality/run_quality.py --size cpu|tiny|gpu [--out bench/results/quality-<size>.json] [--workdir DIR]

1. Corpus: the Python standard library's source and pydoc pages, plus the manual pages and package
   documentation installed on the machine: real text, available offline everywhere. Five percent
   of the documents are held out of the target's training, for its held-out loss.
2. Tokenizer and target: a byte-level BPE trained on the corpus (Qwen's pre-tokenizer), and a
   model of the Qwen3.5/3.6 architecture (`dflash_jobs.tiny`: Gated DeltaNet and gated attention
   layers 3:1, multimodal checkpoint layout) trained on chats "continue this text" built from it.
3. Data: new chats of the same kind, with the corpus's own continuation as the answer (chat JSONL).
4. The product's chain through its own entry points (`python -m dflash_jobs.generate`, `prepare`,
   `extract --shard i`, `dflashctl verify`, `train`, `evaluate`), on specs written to the work
   directory, once per data set (on a GPU all at once; their small models leave it mostly idle):
   - regenerated: the target's own answers (generate, transformers engine, greedy) first;
   - source: the corpus's answers, as they are;
   - with the GPU size, from the regenerated rows: the same stored in fp8 (float8_e4m3fn), and a
     half and a quarter of them (the same held-out prompts at the end).
   The held-out prompts are the last chats of the source in every chain, the same tokens (checked).
5. The figures, side by side: each drafter's acceptance length and per-position acceptance next to
   prompt lookup's (training-free n-gram drafting) on the same held-out prompts, tokens/s against
   plain greedy, lossless up to ties, the trainer's simulated acceptance against the evaluation's,
   and acceptance against data size (a PNG beside the JSON).

Prints one JSON document (and writes it to --out, after every stage too, marked "complete": false
until the end). A rerun with the same --workdir goes on after the last finished stage (a device
call cut by its time limit), and inside a chain the product's own steps resume. The CPU size runs
in tests/test_quality.py; the tiny size runs every chain of the GPU size on a CPU in minutes, as a
check of the command before device time is spent.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pydoc
import re
import random
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import yaml

from dflash_jobs.formats import DATASET_KEY, EVAL_REPORT_KEY, TRAIN_METRICS_KEY, TokenChunk
from dflash_jobs.generation import generated_lines, read_manifest
from dflash_jobs.prepare import HOLDOUT_KEY
from dflash_jobs.rows import ChatEncoder, prompt_length
from dflash_jobs.storage import open_storage
from dflash_jobs.tiny import teach_tiny_target, write_tiny_target

REPO = Path(__file__).resolve().parents[2]
PYDOC_MODULES = ("json", "textwrap", "string", "functools", "itertools", "collections", "pathlib", "re", "heapq",
                 "bisect", "dataclasses", "argparse", "shutil", "typing", "contextlib", "statistics", "fractions",
                 "os", "os.path", "sys", "math", "random", "datetime", "time", "logging", "subprocess", "threading",
                 "queue", "socket", "urllib.parse", "email.message", "csv", "sqlite3", "hashlib", "base64", "struct",
                 "array", "enum", "abc", "inspect", "ast", "tokenize", "difflib", "pprint", "decimal", "zipfile",
                 "tarfile", "tempfile", "glob", "fnmatch", "uuid", "operator", "copy", "weakref", "unittest", "doctest")
"""Documented with pydoc too: modules that are safe to import (no side effects)."""
LINE_CHARS = 160
"""Longer lines are cut: a chat of a few lines stays within data.max_length."""
DOCUMENT_CHARS = 200_000
"""Longest document kept whole; longer ones are cut (a few generated modules would dominate)."""


@dataclass(frozen=True, slots=True)
class Size:
    """One scale of the benchmark: everything that differs between the CPU test and the GPU run."""

    target_layers: int
    target_hidden: int
    target_heads: int
    target_head_dim: int
    vocab_size: int
    """Embedding rows of the target; its BPE tokenizer leaves some unused (the drafter's mask token takes one)."""
    capture: list[int]
    """Target layers the drafter reads (target.layers)."""
    corpus_files: int | None
    """Standard-library modules read (sampled with a fixed seed; None: every one)."""
    installed_text: bool
    """Add pydoc pages, manual pages and the package documentation installed on the machine."""
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
    data_fractions: tuple[float, ...] = ()
    """Chains on part of the regenerated rows (the held-out prompts kept): does more data help?"""
    fp8_chain: bool = False
    """A chain on the regenerated rows stored in float8_e4m3fn: acceptance against bf16 storage."""
    eval_processes: int = 1
    """eval.processes: held-out prompts decoded in this many processes (a small target fits many times on a GPU)."""


SIZES = {
    "cpu": Size(
        target_layers=4, target_hidden=64, target_heads=4, target_head_dim=16, vocab_size=1024, capture=[1, 3], corpus_files=60,
        installed_text=False, prompt_lines=2, answer_lines=1, train_steps=110, train_seconds=60.0, train_batch=32, train_length=64, lr=1e-2,
        chats=168, holdout=8, max_answer_tokens=24, regenerate_batch=56,
        draft_layers=1, block_size=8, anchors=24, epochs=8, draft_lr=3e-3, micro_batch_tokens=512, micro_batch_blocks=2048, chunk_tokens=4096,
        max_length=256, eval_new_tokens=24,
    ),
    "tiny": Size(
        target_layers=4, target_hidden=64, target_heads=4, target_head_dim=16, vocab_size=1024, capture=[1, 3], corpus_files=30,
        installed_text=True, prompt_lines=2, answer_lines=1, train_steps=40, train_seconds=30.0, train_batch=16, train_length=64, lr=1e-2,
        chats=96, holdout=4, max_answer_tokens=12, regenerate_batch=48,
        draft_layers=1, block_size=8, anchors=16, epochs=2, draft_lr=3e-3, micro_batch_tokens=512, micro_batch_blocks=2048, chunk_tokens=2048,
        max_length=256, eval_new_tokens=12, data_fractions=(0.25, 0.5), fp8_chain=True, eval_processes=2,
    ),
    "gpu": Size(
        target_layers=12, target_hidden=512, target_heads=8, target_head_dim=64, vocab_size=4096, capture=[1, 4, 7, 10], corpus_files=None,
        installed_text=True, prompt_lines=6, answer_lines=6, train_steps=6000, train_seconds=150.0, train_batch=32, train_length=512, lr=2e-3,
        chats=16384, holdout=64, max_answer_tokens=128, regenerate_batch=512,
        draft_layers=2, block_size=16, anchors=48, epochs=3, draft_lr=1e-3, micro_batch_tokens=8192, micro_batch_blocks=8192, chunk_tokens=65536,
        max_length=512, eval_new_tokens=96, data_fractions=(0.25, 0.5), fp8_chain=True, eval_processes=8,
    ),
}


# ---- 1. the corpus ---------------------------------------------------------------------------------


def stdlib_sources(files: int | None) -> list[str]:
    """Standard-library modules and packages (no tests, no vendored or IDLE code)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo"}
    modules = sorted(path for path in root.rglob("*.py") if not skipped & set(path.relative_to(root).parts))
    if files is not None:
        modules = random.Random(0).sample(modules, min(files, len(modules)))
    return [path.read_text(errors="replace")[:DOCUMENT_CHARS] for path in sorted(modules)]


TROFF_ESCAPE = re.compile(r"\\f[BIRP]|\\f\(..|\\&|\\-|\\\(..|\\e")


def manual_pages() -> list[str]:
    """English manual pages, their troff requests dropped and font escapes removed."""
    pages = []
    for path in sorted(Path("/usr/share/man").glob("man[1-8]/*.gz")):
        try:
            text = gzip.decompress(path.read_bytes()).decode(errors="replace")
        except (OSError, EOFError):
            continue
        lines = [TROFF_ESCAPE.sub("", line) for line in text.splitlines() if not line.startswith((".", "'"))]
        if len(lines) > 10:
            pages.append("\n".join(lines)[:DOCUMENT_CHARS])
    return pages


def package_documentation() -> list[str]:
    """README and guide files the installed Debian and Python packages ship (no licences, no changelogs)."""
    roots = [Path("/usr/share/doc"), Path(sysconfig.get_paths()["purelib"])]
    found = []
    for root in roots:
        for path in sorted(root.rglob("*")):
            name = path.name.lower()
            if not path.is_file() or "copyright" in name or "license" in name or "changelog" in name or "news" in name:
                continue
            if name.endswith((".md", ".rst", ".txt")) or name.startswith("readme"):
                try:
                    text = (gzip.decompress(path.read_bytes()) if name.endswith(".gz") else path.read_bytes()).decode()
                except (OSError, EOFError, UnicodeDecodeError):
                    continue
                if text.count("\n") > 10:
                    found.append(text[:DOCUMENT_CHARS])
    return found


def at_most(documents: list[str], chars: int) -> list[str]:
    """Documents picked with a fixed seed until they hold `chars` characters: no installed source
    outweighs the standard library (a developer machine has 80 MB of manual pages, a GPU one few)."""
    picked, total = [], 0
    for document in random.Random(4).sample(documents, len(documents)):
        if total >= chars:
            break
        picked.append(document)
        total += len(document)
    return picked


def corpus(size: Size) -> dict[str, list[str]]:
    """The documents by source."""
    sources = {"stdlib": stdlib_sources(size.corpus_files)}
    if size.installed_text:
        budget = sum(map(len, sources["stdlib"]))
        sources["pydoc"] = [pydoc.render_doc(name, renderer=pydoc.plaintext) for name in PYDOC_MODULES]
        sources["man"] = at_most(manual_pages(), budget)
        sources["docs"] = at_most(package_documentation(), budget)
    return sources


def split_documents(documents: list[str]) -> tuple[list[str], list[str]]:
    """(training, held out): every twentieth document, in a fixed shuffle, is held out of the target's training."""
    order = list(range(len(documents)))
    random.Random(5).shuffle(order)
    held = set(order[:: 20])
    return [d for i, d in enumerate(documents) if i not in held], [d for i, d in enumerate(documents) if i in held]


def continuation_chats(documents: list[str], count: int, size: Size, rng: random.Random) -> Iterator[tuple[str, str]]:
    """(prompt, answer) pairs: `prompt_lines` lines of a document, then the `answer_lines` that follow them."""
    lines_of = [[line.rstrip()[:LINE_CHARS] for line in document.splitlines()] for document in documents]
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


# ---- 2. the tokenizer and the target ---------------------------------------------------------------


def make_target(directory: Path, documents: list[str], size: Size, device: torch.device) -> dict[str, Any]:
    """A BPE tokenizer trained on the corpus, a random target, then trained in place on chats of the
    training documents; its held-out loss on chats of the held-out ones."""
    from transformers import AutoTokenizer

    training, held_out = split_documents(documents)
    write_tiny_target(directory, num_layers=size.target_layers, hidden_size=size.target_hidden, vocab_size=size.vocab_size,
                      heads=size.target_heads, head_dim=size.target_head_dim, corpus=training)
    encoder = ChatEncoder(AutoTokenizer.from_pretrained(directory))

    def rendered(docs: list[str], count: int, seed: int) -> list[list[int]]:
        """Chats tokenized as prepare tokenizes them, which is as serving does (the prompt apart from
        the answer): a target taught on whole conversations tokenized at once would be served a
        generation prompt whose last token it never saw there."""
        chats = [encoder.render({"messages": conversation(p, a)}) for p, a in continuation_chats(docs, count, size, random.Random(seed))]
        return [ids.tolist() for ids, _ in encoder.encode(chats)]

    texts = rendered(training, size.train_steps * size.train_batch // 4, 1)
    taught = teach_tiny_target(directory, texts, steps=size.train_steps, batch=size.train_batch, length=size.train_length,
                               lr=size.lr, seconds=size.train_seconds, device=device.type, held_out=rendered(held_out, 2000, 2))
    return {**taught, "tokenizer_tokens": len(encoder.tokenizer), "documents": {"training": len(training), "held_out": len(held_out)}}


# ---- 3. the chats -----------------------------------------------------------------------------------


def write_chats(documents: list[str], size: Size, path: Path) -> Path:
    """`size.chats` chats answered by the corpus itself: the data set before regeneration."""
    rows = [{"messages": conversation(p, a)} for p, a in continuation_chats(documents, size.chats, size, random.Random(3))]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ---- 4. the product's chain ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Chain:
    """One data set through the chain: the source's answers or the target's, all of them or a part, in bf16 or fp8."""

    name: str
    regenerated: bool
    fraction: float = 1.0
    dtype: str = "bfloat16"

    @property
    def generates(self) -> bool:
        """The one chain that runs the generate step; the other regenerated chains read its rows."""
        return self.regenerated and self.fraction == 1.0 and self.dtype == "bfloat16"


def chains_of(size: Size) -> list[Chain]:
    chains = [Chain("regenerated", True), Chain("source", False)]
    if size.fp8_chain:
        chains.append(Chain("regenerated-fp8", True, dtype="float8_e4m3fn"))
    chains += [Chain(f"regenerated-{fraction:g}", True, fraction=fraction) for fraction in size.data_fractions]
    return chains


def write_spec(workdir: Path, target: Path, data: Path, size: Size, device: torch.device, chain: Chain) -> Path:
    spec = {
        "name": "quality",
        "backend": "local",
        "target": {"model": str(target), "layers": size.capture},
        "data": {"source": str(data), "max_length": size.max_length, "chunk_tokens": size.chunk_tokens, "holdout": size.holdout},
        "output": str(workdir / "run"),
        # Compiling a target this small costs more than its whole extraction.
        "extract": {"shards": 2, "token_budget": 8192, "dtype": chain.dtype, "pad_multiple": 128, "compile": False},
        "train": {
            "gpus_per_node": 1, "draft_layers": size.draft_layers, "block_size": size.block_size, "anchors": size.anchors,
            "epochs": size.epochs, "lr": size.draft_lr, "micro_batch_tokens": size.micro_batch_tokens,
            "micro_batch_blocks": size.micro_batch_blocks, "checkpoint_every": 200, "cache_gb": 8.0, "stall_seconds": 120.0,
        },
        "eval": {"prompts": size.holdout, "max_new_tokens": size.eval_new_tokens, "processes": size.eval_processes},
        "local": {"workdir": str(workdir / "local"), "device": device.type},
    }
    if chain.generates:
        # Greedy, as the evaluation decodes. The answers are cut at max_answer_tokens and kept: a
        # briefly trained target rarely ends its turn, and every prompt must keep its row (the same
        # held-out prompts in every chain). The template's default thinking mode, as the source
        # chain's prepare renders it: the held-out prompts are then the same tokens in every chain.
        spec["generate"] = {
            "engine": "transformers", "shards": 2, "temperature": 0.0, "thinking": None, "max_new_tokens": size.max_answer_tokens,
            "truncated": "keep", "empty": "keep", "chunk_prompts": -(-size.chats // 4), "batch_prompts": size.regenerate_batch,
        }
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "dflash.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


class ChainRunner:
    """One chain's steps, each as its pod would run it, each step's seconds kept: generate (the
    generating chain's, as a stage of its own), then prepare, extract (two shards at once), verify,
    train, evaluate."""

    def __init__(self, spec: Path, workdir: Path) -> None:
        self.spec, self.workdir = spec, workdir
        self.env = {**os.environ, "DFLASH_CACHE_DIR": str(workdir / "cache"), "PYTHONUNBUFFERED": "1"}
        self.seconds: dict[str, float] = {}

    def step(self, name: str, *commands: list[str], extra_env: dict[str, str] | None = None) -> None:
        started = time.monotonic()
        logs = [open(self.workdir / f"{name}-{i}.log", "w") for i in range(len(commands))]
        processes = [subprocess.Popen(c, env={**self.env, **(extra_env or {})}, stdout=log, stderr=subprocess.STDOUT) for c, log in zip(commands, logs)]
        codes = [p.wait() for p in processes]
        for log in logs:
            log.close()
        self.seconds[name] = round(time.monotonic() - started, 1)
        print(f"quality: {self.workdir.name} {name}: exit {max(codes)} after {self.seconds[name]} s", file=sys.stderr, flush=True)
        if any(codes):
            failed = next(i for i, code in enumerate(codes) if code)
            tail = (self.workdir / f"{name}-{failed}.log").read_text()[-3000:]
            raise RuntimeError(f"{name} failed (exit {codes[failed]}): {shlex.join(commands[failed])}\n{tail}")

    def job(self, module: str, *args: str) -> list[str]:
        return [sys.executable, "-m", module, *args, "-f", str(self.spec)]

    def generate(self) -> None:
        # Two shards share the machine: one intra-op thread each keeps them from fighting over cores.
        self.step("generate", *[self.job("dflash_jobs.generate", "--shard", str(i)) for i in range(2)], extra_env={"OMP_NUM_THREADS": "1"})

    def run(self) -> dict[str, float]:
        # As `dflashctl run` does: prepare refuses to re-chunk tokens that hidden states were extracted
        # from, so a chain cut after it (a device call's limit) goes on from the stored data set.
        if (self.workdir / "run" / DATASET_KEY).exists():
            print(f"quality: {self.workdir.name} prepare: skipped, {DATASET_KEY} is stored", file=sys.stderr, flush=True)
        else:
            self.step("prepare", self.job("dflash_jobs.prepare"))
        self.step("extract", *[self.job("dflash_jobs.extract", "--shard", str(i)) for i in range(2)], extra_env={"OMP_NUM_THREADS": "1"})
        self.step("verify", self.job("dflashctl.cli.main", "verify"))
        self.step("train", self.job("dflash_jobs.train"))
        self.step("evaluate", self.job("dflash_jobs.evaluate"))
        return self.seconds


def regenerated_rows(chain_dir: Path) -> list[str]:
    """The generate step's rows, in sample order, as chat JSONL lines: prepare reads them as it reads
    the generated rows (their "generation" record included), without the sample ids of data.source."""
    storage = open_storage(str(chain_dir / "run"))
    manifest = read_manifest(storage)
    if manifest is None:
        raise RuntimeError(f"{chain_dir}/run holds no generate/manifest.json: the generate step did not finish")
    rows = [json.loads(line) for _, line in sorted(generated_lines(storage, manifest))]
    return [json.dumps({key: value for key, value in row.items() if key != "sample_id"}) + "\n" for row in rows]


def part_of(rows: list[str], fraction: float, holdout: int) -> list[str]:
    """The first `fraction` of the training rows, then the held-out rows (prepare holds out the last ones)."""
    training = rows[: len(rows) - holdout]
    return training[: round(fraction * len(training))] + rows[len(rows) - holdout :]


def held_out_prompts(workdir: Path) -> list[list[int]]:
    """The token ids the evaluation asked the target: each held-out sample before its last answer."""
    chunk = TokenChunk.decode((workdir / "run" / HOLDOUT_KEY).read_bytes(), HOLDOUT_KEY)
    return [chunk.sample(i)[0][: prompt_length(chunk.sample(i)[1])].tolist() for i in range(chunk.num_samples)]


def chain_figures(workdir: Path) -> dict[str, Any]:
    """One chain's evaluation report, reduced to its figures, the trainer's last metrics, and the
    prompts it was evaluated on."""
    report = json.loads((workdir / "run" / EVAL_REPORT_KEY).read_text())
    dataset = json.loads((workdir / "run" / DATASET_KEY).read_text())
    train_metrics = [json.loads(line) for line in (workdir / "run" / TRAIN_METRICS_KEY).read_text().splitlines() if line]
    wanted = ("acceptance_length", "acceptance_per_position", "tokens_per_second", "speedup", "lossless", "mismatches", "tie_mismatches", "simulated")
    columns = {name: {key: summary[key] for key in wanted if key in summary} for name, summary in report["drafters"].items()}
    return {
        "acceptance_length": {name: round(column["acceptance_length"], 3) for name, column in columns.items()},
        "lossless": report["lossless"],
        "drafters": columns,
        "consistency": report.get("consistency"),
        "greedy_tokens_per_second": report["greedy"]["tokens_per_second"],
        "eval": {key: report[key] for key in ("prompts", "max_new_tokens", "block_size", "dtype") if key in report},
        "train_last": train_metrics[-1],
        "held_out_sample_ids": dataset["holdout"]["sample_ids"],
        "samples": dataset["samples"],
        "tokens": dataset["tokens"],
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
        settings = json.loads(json.dumps(settings))  # as stages.json holds them (tuples as lists)
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


def data_curve(runs: dict[str, dict[str, Any]], chains: list[Chain]) -> list[dict[str, Any]]:
    """Acceptance length against the supervised tokens the drafter trained on, bf16 regenerated chains only."""
    points = [{"fraction": c.fraction, "supervised_tokens": runs[c.name]["supervised_tokens"],
               "acceptance_length": runs[c.name]["acceptance_length"]["dflash"]}
              for c in chains if c.regenerated and c.dtype == "bfloat16"]
    return sorted(points, key=lambda point: point["fraction"])


def plot_curve(curve: list[dict[str, Any]], prompt_lookup: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["supervised_tokens"] / 1e6 for p in curve], [p["acceptance_length"] for p in curve], "o-", label="DFlash drafter (regenerated answers)")
    ax.axhline(prompt_lookup, color="gray", linestyle="--", label="prompt lookup")
    ax.set_xlabel("supervised tokens trained on (millions)")
    ax.set_ylabel("acceptance length (tokens per target step)")
    ax.set_title("Acceptance against data size, same held-out prompts")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(size_name: str, workdir: Path, report: Callable[[dict[str, Any]], None] = lambda stages: None) -> dict[str, Any]:
    """run_chains on one intra-op thread at the CPU size, the caller's thread count put back after
    (the tests call this in their own process)."""
    threads = torch.get_num_threads()
    if size_name != "gpu":
        # Tiny matrices: extra intra-op threads only add synchronisation, and on a shared box they spin.
        torch.set_num_threads(1)
    try:
        return run_chains(size_name, workdir, report)
    finally:
        torch.set_num_threads(threads)


def run_chains(size_name: str, workdir: Path, report: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    size = SIZES[size_name]
    device = torch.device("cuda" if size_name == "gpu" else "cpu")
    stages = Stages(workdir, asdict(size), report)
    sources = corpus(size)
    documents = [document for docs in sources.values() for document in docs]
    target = workdir / "target"
    target_training = stages.run("target_training", lambda: {
        **make_target(target, documents, size, device), "corpus": {name: {"documents": len(docs), "chars": sum(map(len, docs))} for name, docs in sources.items()}})
    chats = write_chats(documents, size, workdir / "chats.jsonl")
    chains = chains_of(size)

    def runner(chain: Chain, data: Path) -> ChainRunner:
        return ChainRunner(write_spec(workdir / chain.name, target, data, size, device, chain), workdir / chain.name)

    generating = next(c for c in chains if c.generates)

    def generation_stage() -> dict[str, Any]:
        generation = runner(generating, chats)
        generation.generate()
        rows = regenerated_rows(workdir / generating.name)
        (workdir / "regenerated.jsonl").write_text("".join(rows))
        return {"rows": len(rows), "seconds": generation.seconds["generate"]}

    def chain_stage(chain: Chain, generated: Future) -> dict[str, Any]:
        if not chain.regenerated:
            chain_runner = runner(chain, chats)
        else:
            generated.result()  # the target's answers, stored by the generation stage
            if chain.generates:
                chain_runner = runner(chain, chats)
            else:
                rows = (workdir / "regenerated.jsonl").read_text().splitlines(keepends=True)
                data = workdir / chain.name / "chats.jsonl"
                data.parent.mkdir(parents=True, exist_ok=True)
                data.write_text("".join(part_of(rows, chain.fraction, size.holdout)))
                chain_runner = runner(chain, data)
        return {"step_seconds": chain_runner.run(), **chain_figures(workdir / chain.name)}

    # On a GPU the source chain runs beside generation, then every chain side by side: their small
    # models leave it mostly idle, and one device call holds more of the run. On a CPU they would
    # only fight over its cores (the stages run in the order submitted).
    with ThreadPoolExecutor(max_workers=len(chains) + 1 if device.type == "cuda" else 1) as pool:
        generated = pool.submit(stages.run, "generation", generation_stage)
        futures = {c.name: pool.submit(stages.run, c.name, lambda c=c: chain_stage(c, generated)) for c in chains}
        generation = generated.result()
        runs = {name: future.result() for name, future in futures.items()}
    prompts = {c.name: held_out_prompts(workdir / c.name) for c in chains}
    if any(p != prompts["regenerated"] for p in prompts.values()):
        raise RuntimeError("the chains were evaluated on different prompts (a held-out chat dropped, or rendered otherwise)")
    regenerated, source = runs["regenerated"], runs["source"]
    result = {
        "size": size_name,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "acceptance_length": {name: figures["acceptance_length"] for name, figures in runs.items()},
        "same_prompts": True,
        "chains_concurrent": device.type == "cuda",
        "goals": {
            "regenerated_dflash": regenerated["acceptance_length"]["dflash"],
            "over_prompt_lookup": round(regenerated["acceptance_length"]["dflash"] / regenerated["acceptance_length"]["prompt_lookup"], 3),
            "regenerated_over_source": round(regenerated["acceptance_length"]["dflash"] / source["acceptance_length"]["dflash"], 3),
            "lossless_up_to_ties": all(figures["lossless"] for figures in runs.values()),
        },
        "runs": runs,
        "generation": generation,
        "target_training": target_training,
        "settings": asdict(size),
        "seconds": {name: stages.done[name]["seconds"] for name in stages.done if name != "settings"},
    }
    curve = data_curve(runs, chains)
    if len(curve) > 1:
        result["data_curve"] = curve
    if size.fp8_chain:
        fp8 = runs["regenerated-fp8"]["acceptance_length"]["dflash"]
        result["fp8_over_bf16"] = round(fp8 / regenerated["acceptance_length"]["dflash"], 3)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON (default: bench/results/quality-<size>.json); the data curve's PNG goes beside it")
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
    if "data_curve" in result:
        plot = out.with_name(out.stem + "-data.png")
        plot_curve(result["data_curve"], result["acceptance_length"]["regenerated"]["prompt_lookup"], plot)
        result["data_curve_plot"] = plot.name
    write({"complete": True, **result})
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
