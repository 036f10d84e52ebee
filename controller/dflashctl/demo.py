"""The demo: a tiny target of the real architecture, a small chat data set and a spec for the local
backend, so `dflashctl demo` runs the whole pipeline on a laptop CPU in a few minutes, the target's
own answers regenerated first as in a real run.

The target and data come from `python -m dflash_jobs.architectures.tiny.demo` in a subprocess: the controller never
imports torch. The spec is the starter spec (every field explained) with the demo's sizes.

Its figures hold still on a given machine: every step is seeded, and every step runs on the threads
of DEMO_CORES cores, whatever the machine has and whatever OMP_NUM_THREADS the shell exports (the
trained drafter, and so the acceptance length, changes with training's thread count).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_jobs.errors import InputError
from dflash_jobs.formats import DATASET_KEY, EVAL_PLOT_KEY, TRAIN_METRICS_KEY, TRAIN_PLOT_KEY, DatasetIndex
from dflash_jobs.generation import GenerationManifest, current_manifest
from dflash_jobs.spec import RunSpec, is_s3
from dflash_jobs.storage import Storage

from dflashctl.errors import RunFailed
from dflashctl.pipeline import PipelineResult
from dflashctl.starter import starter_spec

DEMO_CORES = 2
"""The cores the demo's steps share on any machine (local.cores; the tiny target's teaching too): the
2 the README's figures were measured on."""
SPEC_NAME = "dflash.yaml"
TARGET_DIR = "target"
CHATS_FILE = "chats.jsonl"


def demo_values(directory: Path, output: str | None = None, *, online: bool = False) -> dict[str, Any]:
    """The demo's spec over the defaults: small enough for a CPU, two shards for generation and extraction
    (with `online`, no extraction: the training Job runs the target)."""
    directory = directory.resolve()
    return {
        "name": "demo",
        "backend": "local",
        "target": {"model": str(directory / TARGET_DIR), "layers": [1, 3]},
        "data": {"source": str(directory / CHATS_FILE), "max_length": 256, "chunk_tokens": 8192, "holdout": 8},
        "output": output or str(directory / "output"),
        # Short chats: a small pad multiple wastes little, and a CPU has no kernels to warm per shape.
        "extract": {"shards": 2, "token_budget": 8192, "pad_multiple": 16, "backoff_limit_per_index": 1},
        "train": {
            "gpus_per_node": 1, "draft_layers": 1, "block_size": 8, "anchors": 24, "epochs": 4, "lr": 3.0e-3,
            "warmup_ratio": 0.1, "micro_batch_tokens": 2048, "checkpoint_every": 50, "cache_gb": 1.0,
            # A one-layer drafter of width 64 has no memory to save: recomputing would only cost time.
            "activation_checkpointing": "none",
            **({"states": "online"} if online else {}),
        },
        # One tree budget beside the chain's own: each budget decodes every prompt once more.
        "eval": {"prompts": 8, "max_new_tokens": 32, "tree_budgets": [16]},
        # The recipe of a real run: the drafter learns the target's own answers. Greedy, as the
        # evaluation decodes; answers cut at the limit are kept (the tiny target is verbose).
        "generate": {
            "engine": "transformers", "shards": 2, "temperature": 0.0, "thinking": False, "max_new_tokens": 64,
            "truncated": "keep", "chunk_prompts": 200, "batch_prompts": 100, "backoff_limit_per_index": 1,
        },
        "local": {"workdir": str(directory / ".dflash"), "device": "cpu", "cores": DEMO_CORES},
    }


def write_demo(directory: Path, spec_file: Path, *, output: str | None = None, fresh: bool = False,
               overwrite: bool = False, online: bool = False) -> None:
    """DIR/target and DIR/chats.jsonl (kept when they exist, unless `fresh`), and the spec at `spec_file`.

    An existing spec that differs is replaced only with `overwrite`: it may hold the user's edits."""
    if fresh and directory.exists():
        if any(directory.iterdir()) and not (directory / SPEC_NAME).is_file():
            raise InputError(
                f"{directory} holds files but no {SPEC_NAME}: it is not a demo directory, and --fresh would delete it",
                "Give --fresh the directory of an earlier demo, or a new one",
            )
        shutil.rmtree(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if not ((directory / TARGET_DIR / "config.json").exists() and (directory / CHATS_FILE).exists()):
        write_demo_inputs(directory)
    text = starter_spec(demo_values(directory, output, online=online))
    if spec_file.exists() and spec_file.read_text() != text and not overwrite:
        raise InputError(
            f"{spec_file} exists and differs from the demo's spec (edited, or written for another --output)",
            "Pass --fresh (demo) or --force (init) to replace it, or use another directory",
        )
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(text)


def write_demo_inputs(directory: Path) -> None:
    """Runs `python -m dflash_jobs.architectures.tiny.demo DIR` on DEMO_CORES threads; its progress shows on stderr, its JSON summary is dropped."""
    command = [sys.executable, "-m", "dflash_jobs.architectures.tiny.demo", str(directory)]
    try:
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": str(DEMO_CORES)})
    except FileNotFoundError:
        raise InputError(f"{sys.executable} cannot be run", "Install dflash-k8s with its jobs extra: pip install 'dflash-k8s[jobs]'") from None
    except subprocess.CalledProcessError as failure:
        raise RunFailed(
            f"writing the demo's target and data failed (exit {failure.returncode}): {' '.join(command)}",
            "The demo needs the jobs extra (torch, transformers): pip install 'dflash-k8s[jobs]'",
        ) from None


@dataclass(frozen=True, slots=True)
class DemoSummary:
    """What a finished demo made, and where it is."""

    spec_file: Path
    output: str
    logs: Path
    online: bool
    """The training Job made the states (train.states: online): chunks and tokens are prepare's."""
    chunks: int
    tokens: int
    extract_seconds: float | None
    """Wall time of extraction in this invocation (pods' start-up included); None when it was done before."""
    generation: GenerationManifest | None
    """What generation answered and dropped (generate/manifest.json)."""
    generate_seconds: float | None
    """Wall time of generation in this invocation (pods' start-up included); None when it was done before."""
    train_steps: int
    train_loss: tuple[float, float]
    """First and last logged loss."""
    train_plot: str
    acceptance_plot: str
    acceptance_length: dict[str, float]
    tree_acceptance: dict[str, float]
    """The trained drafter's acceptance length decoding by draft trees (DDTree), per node budget."""
    lossless: bool

    @property
    def tokens_per_s(self) -> float | None:
        return None if not self.extract_seconds else self.tokens / self.extract_seconds


def summarize_demo(spec_file: Path, spec: RunSpec, storage: Storage, result: PipelineResult) -> DemoSummary:
    records = [json.loads(line) for line in storage.get_bytes(TRAIN_METRICS_KEY).decode().splitlines() if line]
    online = spec.train.states == "online"
    states = DatasetIndex.from_json(storage.get_bytes(DATASET_KEY), DATASET_KEY) if online else result.manifest
    report = result.report or {}
    if states is None or not records:
        raise RunFailed(f"the demo's run in {storage.url} has no manifest or no training metrics", "Run the demo again with --fresh")
    where = spec.output if is_s3(spec.output) else str(Path(spec.output).resolve())
    return DemoSummary(
        spec_file=spec_file,
        output=where,
        logs=Path(spec.local.workdir) / "logs",
        online=online,
        chunks=len(states.chunks),
        tokens=states.tokens,
        extract_seconds=result.seconds.get("extract"),
        generation=current_manifest(storage, spec) if spec.generate is not None else None,
        generate_seconds=result.seconds.get("generate"),
        train_steps=records[-1]["step"],
        train_loss=(records[0]["loss"], records[-1]["loss"]),
        train_plot=f"{where}/{TRAIN_PLOT_KEY}",
        acceptance_plot=f"{where}/{EVAL_PLOT_KEY}",
        acceptance_length={name: s["acceptance_length"] for name, s in (report.get("drafters") or {}).items()},
        tree_acceptance={budget: d["acceptance_length"] for s in (report.get("drafters") or {}).values()
                         for budget, d in (s.get("tree") or {}).get("decoded", {}).items()},
        lossless=bool(report.get("lossless")),
    )
