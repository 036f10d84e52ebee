"""What an evaluation computes from the target and the prompts alone, kept once for every drafter
evaluated on them: greedy's decoding of each prompt (the reference output, its top-two record and
tie noise) and the target's verify-against-decode rounding over it (lossless.verify_noise).

Every chain of the quality benchmark, and `dflashctl eval` of several drafters, evaluates on the same
target and prompts: greedy decoding was most of each evaluation's target forwards after the
baselines stopped decoding. Each prompt's reference is stored as it is computed under
<eval.reference_cache, default the run's output>/eval/reference/<key>/, kept (never cleared: other
evaluations read it), `key` fingerprinting what it depends on: the target (its spec section: the
checkpoint's location, captured layers, attention), eval.max_new_tokens, the verify block's size
(the noise is measured in blocks of it), the device's kind (its dtype follows), eval.cuda_graphs (the
static cache's roundings). Each file holds its
prompt's tokens, checked when read, so a reference is never taken for another prompt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import torch

from dflash_jobs.drafter.speculative import Decoded
from dflash_jobs.evaluate.kept import KeptPrompts
from dflash_jobs.spec import RunSpec
from dflash_jobs.storage import Storage, open_storage

REFERENCE_PREFIX = "eval/reference/"

Reference = tuple[Decoded, list[float]]
"""Greedy's decoding of a prompt, and the verify noise over it."""


def reference_key(spec: RunSpec, device: torch.device, block_size: int) -> str:
    about = {"target": dataclasses.asdict(spec.target), "max_new_tokens": spec.eval.max_new_tokens, "block_size": block_size,
             "device": device.type, "cuda_graphs": spec.eval.cuda_graphs}
    return hashlib.sha256(json.dumps(about, sort_keys=True).encode()).hexdigest()[:16]


def _to_json(reference: Reference) -> dict[str, Any]:
    greedy, noise = reference
    return {"greedy": dataclasses.asdict(greedy), "verify_noise": noise}


def _from_json(raw: dict[str, Any]) -> Reference:
    return Decoded(**raw["greedy"]), raw["verify_noise"]


class KeptReferences:
    """The references storage holds for one key, and the keeping of those computed now."""

    def __init__(self, storage: Storage, key: str) -> None:
        self.kept = KeptPrompts(storage, key, prefix=REFERENCE_PREFIX, codec=(_to_json, _from_json))

    @classmethod
    def of(cls, spec: RunSpec, run_storage: Storage, device: torch.device, block_size: int) -> KeptReferences:
        """Under eval.reference_cache, else the run's own output."""
        cache = spec.eval.reference_cache
        storage = run_storage if cache is None else open_storage(cache, endpoint_url=spec.storage.endpoint_url, region=spec.storage.region)
        return cls(storage, reference_key(spec, device, block_size))

    def load(self, prompts: list[torch.Tensor]) -> dict[int, Reference]:
        return self.kept.load(prompts)

    def keep(self, index: int, prompt: torch.Tensor, result) -> None:
        """The reference of `result` (a PromptResult of `prompt`, the index-th prompt)."""
        self.kept.keep(index, prompt, (result.greedy, result.verify_noise))
