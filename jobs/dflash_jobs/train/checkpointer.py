"""Resumable training state in storage, one self-describing directory per save:

    train/checkpoints/step-00000500/model.safetensors   the drafter's weights (z-lab names)
    train/checkpoints/step-00000500/state.pt            every other Stateful: optimizer, scheduler, data cursor, loop
    train/checkpoints/step-00000500/meta.json           written last: step, the train spec, the drafter config, files

A checkpoint exists once its meta.json does, so a save cut short by a kill is never resumed from.
Rank 0 writes (DDP replicas are identical); every rank reads. The loop sees no file names.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from dflash_jobs.errors import FormatError, InputError
from dflash_jobs.storage import Storage

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "dflash.checkpoint/v1"
CHECKPOINTS = "train/checkpoints/"
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"step-(\d{8})/" + re.escape(META_FILE) + "$")


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


RESUMABLE_CHANGES = frozenset({"checkpoint_every", "cache_gb", "cache_storage_class", "states"})
"""Train settings a resumed run may change: none touches the data order or the schedule (online states
are the stored ones bit for bit, over the same chunks; a checkpoint saved before train.states existed
resumes under either)."""


def _comparable(key: str, value: Any) -> Any:
    if key == "train" and isinstance(value, dict):
        return {name: v for name, v in value.items() if name not in RESUMABLE_CHANGES}
    return value


def step_prefix(step: int) -> str:
    return f"{CHECKPOINTS}step-{step:08d}/"


class Checkpointer:
    """Saves and restores `model` (weights as safetensors) and the other `states` by name."""

    def __init__(
        self, storage: Storage, model: torch.nn.Module, states: dict[str, Stateful], *,
        every: int, meta: dict[str, Any], rank: int, keep: int = 2,
    ) -> None:
        self.storage = storage
        self.model = model
        self.states = states
        self.every = every
        self.meta = meta
        self.rank = rank
        self.keep = keep

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def steps(self) -> list[int]:
        """Complete checkpoints, oldest first."""
        return sorted(int(m.group(1)) for key in self.storage.list(CHECKPOINTS) if (m := _STEP_DIR.search(key)))

    def save(self, step: int) -> None:
        if self.rank != 0:
            return
        from safetensors.torch import save_file

        started = time.monotonic()
        prefix = step_prefix(step)
        weights = {name: tensor.detach().cpu().contiguous() for name, tensor in self.model.state_dict().items()}
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / MODEL_FILE
            save_file(weights, path)
            self.storage.put_file(prefix + MODEL_FILE, path)
            # Through a file, as the weights: the optimizer state of a 27B-shape drafter is ~10 GB.
            state_path = Path(directory) / STATE_FILE
            torch.save({name: state.state_dict() for name, state in self.states.items()}, state_path)
            self.storage.put_file(prefix + STATE_FILE, state_path)
        meta = {"format": CHECKPOINT_FORMAT, "step": step, "states": sorted(self.states), "files": [MODEL_FILE, STATE_FILE], **self.meta}
        self.storage.put_bytes(prefix + META_FILE, (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())
        log.info("checkpoint step %d saved to %s/%s in %.1fs", step, self.storage.url, prefix, time.monotonic() - started)
        for old in self.steps()[: -self.keep]:
            for key in self.storage.list(step_prefix(old)):
                self.storage.delete(key)

    def load_latest(self) -> int | None:
        """Restores the newest complete checkpoint; returns its step, or None for a fresh start."""
        from safetensors.torch import load

        steps = self.steps()
        if not steps:
            return None
        step = steps[-1]
        prefix = step_prefix(step)
        meta = json.loads(self.storage.get_bytes(prefix + META_FILE))
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise FormatError(f"{prefix}{META_FILE} is format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT}", "Delete train/checkpoints to start over")
        changed = sorted(key for key in self.meta if _comparable(key, meta.get(key)) != _comparable(key, self.meta[key]))
        if changed:
            # Another world size, batch size, schedule or data set would resume onto another data order.
            raise InputError(
                f"{self.storage.url}/{prefix} was saved by a training run with other settings (differs in: {', '.join(changed)})",
                f"Restore them to resume, or delete {self.storage.url}/{CHECKPOINTS} to train from the start",
            )
        self.model.load_state_dict(load(self.storage.get_bytes(prefix + MODEL_FILE)))
        with tempfile.TemporaryDirectory() as directory:
            state_path = Path(directory) / STATE_FILE
            self.storage.get_file(prefix + STATE_FILE, state_path)
            states = torch.load(state_path, weights_only=True)
        for name, state in self.states.items():
            state.load_state_dict(states[name])
        log.info("resumed from checkpoint step %d (%s/%s)", step, self.storage.url, prefix)
        return step
