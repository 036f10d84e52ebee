"""An evaluation's decoded prompts, kept in storage as they are decoded, so that a pod retried after a
preemption, a crash or its call's time limit goes on from the prompts it lacks.

Decoding is nearly all of an evaluation (every held-out prompt decoded greedily, by the drafter, by
the baselines and by trees, on a target that can be 27B), and the report is built from every prompt
at the end: an evaluation stopped one prompt before its report lost every prompt before. Each
prompt's result is stored when it is decoded, as JSON (storage holds data, never code: no pickle),
under eval/prompts/<key>/, and removed once the report is stored. `key` fingerprints what the
results depend on: the evaluation's settings (but not how many prompts, timed or not, or worker processes), the
target, the exported drafter's files (their contents: a retrained drafter is another evaluation, the
same drafter exported again the same one) and the device's kind; each file also holds its prompt's tokens, checked when it
is read back, so a result is never taken for another prompt. A resumed prompt keeps the seconds its
own decoding took in the earlier pod.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dflash_jobs.drafter.speculative import Decoded
from dflash_jobs.evaluate.lossless import Divergence
from dflash_jobs.evaluate.trees import PromptTrees
from dflash_jobs.spec import RunSpec
from dflash_jobs.storage import Storage, sha256_stream

log = logging.getLogger("dflash.eval")

KEPT_PREFIX = "eval/prompts/"
FORMAT = "dflash.eval-prompt/v1"


@dataclass
class PromptResult:
    """One prompt decoded every way, and the DFlash drafter's teacher-forced acceptance on greedy's output."""

    greedy: Decoded
    drafted: dict[str, Decoded]
    simulated: list[int]
    """Per anchor of the simulation (evaluate/simulated.py), the drafts the training forward gets right in a row."""
    divergences: dict[str, list[Divergence]]
    """Per drafter, where its output leaves greedy's (evaluate/lossless.py; empty when it is greedy's)."""
    verify_noise: list[float]
    """The target's verify-against-decode rounding of greedy's decision margin, per position (evaluate/lossless.py)."""
    confidences: list[list[float]] | None = None
    """A drafter with a confidence head (DSpark): per verify step, its survival probability of each draft (evaluate/calibration.py)."""
    trees: PromptTrees | None = None
    """The trained drafter's draft trees, decoded and exact (evaluate/trees.py); None without eval.tree_budgets."""


EVALUATION_ONLY = ("prompts", "processes", "timed_prompts", "prompt_sets", "reference_cache")
"""eval settings a prompt's result does not depend on: how many prompts, timed or not, worker processes,
the other prompt sets (each set's results are kept under a key of their own), where greedy's are shared."""


def evaluation_key(spec: RunSpec, storage: Storage, drafter_prefix: str, device: torch.device) -> str:
    """What a prompt's result depends on besides the prompt, as 16 hex digits (the module docstring)."""
    settings = {name: value for name, value in dataclasses.asdict(spec.eval).items() if name not in EVALUATION_ONLY}
    drafter = {key: content_fingerprint(storage, key) for key in sorted(storage.list(drafter_prefix))}
    about = {"eval": settings, "target": dataclasses.asdict(spec.target), "drafter": drafter, "device": device.type}
    return hashlib.sha256(json.dumps(about, sort_keys=True).encode()).hexdigest()[:16]


def content_fingerprint(storage: Storage, key: str) -> str:
    """What an object holds: its store's etag where it gives one (S3's is derived from the bytes), else
    the sha256 of its bytes. Not its modification time: a finished training's retried pod exports the
    same drafter again, and its evaluation must go on from the prompts it kept (a quality run's curve
    chain decoded 32 prompts twice so, 2026-12-06)."""
    info = storage.stat(key)
    if info is not None and info.etag:
        return info.etag
    with storage.open_read(key) as stream:
        return sha256_stream(stream)


class KeptPrompts:
    """The results of one evaluation (`key`) that storage already holds, and the keeping of new ones.
    `prefix` and the codec (to JSON, from JSON) keep other per-prompt records alike (evaluate/reference.py)."""

    def __init__(self, storage: Storage, key: str, *, prefix: str = KEPT_PREFIX,
                 codec: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None) -> None:
        self.storage, self.prefix = storage, f"{prefix}{key}/"
        self.to_json, self.from_json = codec or (result_to_json, result_from_json)

    def load(self, prompts: list[torch.Tensor]) -> dict[int, PromptResult]:
        """The kept result of each prompt that has one, by its index; a file of another prompt's tokens is ignored."""
        found: dict[int, PromptResult] = {}
        for key in self.storage.list(self.prefix):
            document = json.loads(self.storage.get_bytes(key))
            index = document["index"]
            if document.get("format") == FORMAT and index < len(prompts) and document["prompt"] == prompts[index].tolist():
                found[index] = self.from_json(document["result"])
        return found

    def keep(self, index: int, prompt: torch.Tensor, result: Any) -> None:
        document = {"format": FORMAT, "index": index, "prompt": prompt.tolist(), "result": self.to_json(result)}
        self.storage.put_bytes(f"{self.prefix}{index:06d}.json", json.dumps(document).encode())

    def clear(self) -> None:
        for key in self.storage.list(self.prefix):
            self.storage.delete(key)


# ---- JSON: dataclasses as dicts, int-keyed dicts (per budget) with string keys ---------------------


def result_to_json(result: PromptResult) -> dict[str, Any]:
    return dataclasses.asdict(result)


def result_from_json(raw: dict[str, Any]) -> PromptResult:
    trees = raw["trees"]
    return PromptResult(
        greedy=Decoded(**raw["greedy"]),
        drafted={name: Decoded(**decoded) for name, decoded in raw["drafted"].items()},
        simulated=raw["simulated"],
        divergences={name: [Divergence(**d) for d in found] for name, found in raw["divergences"].items()},
        verify_noise=raw["verify_noise"],
        confidences=raw["confidences"],
        trees=None if trees is None else PromptTrees(
            chain=trees["chain"],
            at_chain_steps=_per_budget(trees["at_chain_steps"]),
            contains_chain=_per_budget(trees["contains_chain"]),
            exact=_per_budget(trees["exact"]),
            ranks=trees["ranks"],
            decoded={budget: Decoded(**decoded) for budget, decoded in _per_budget(trees["decoded"]).items()},
            divergences={budget: [Divergence(**d) for d in found] for budget, found in _per_budget(trees["divergences"]).items()},
        ),
    )


def _per_budget(raw: dict[str, Any]) -> dict[int, Any]:
    return {int(budget): value for budget, value in raw.items()}
