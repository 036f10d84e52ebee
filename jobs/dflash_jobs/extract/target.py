"""The target model, loaded for capture: text model only, cut after the deepest captured layer (or,
when the run stores the target's final hidden state, run through its last decoder layer).

`target.model` is a checkpoint directory (a PVC mount) or an s3:// prefix. An s3:// checkpoint is
downloaded once per node into a cache directory, under a file lock that the node's other pods
wait on, with parallel ranged reads; sizes and safetensors headers are verified and the file
digests recorded, so a later pod re-uses it after a size check.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from dflash_jobs.architectures import TargetArchitecture, target_architecture
from dflash_jobs.errors import InputError, SpecError
from dflash_jobs.formats import fetch_header_bytes, file_range, read_header
from dflash_jobs.selfcheck import CAUSAL_CONV1D, FLA, check_fast_path
from dflash_jobs.spec import MODEL_CACHE_ENV, TargetSpec, is_s3, text_config
from dflash_jobs.storage import Storage, sha256_file

log = logging.getLogger("dflash.extract")

RANGE_BYTES = 64 << 20
DOWNLOAD_THREADS = 16
COMPLETE_FILE = ".dflash-complete.json"


@dataclass(frozen=True, slots=True)
class FastPaths:
    fla: bool
    causal_conv1d: bool

    @classmethod
    def detect(cls, device: torch.device) -> FastPaths:
        """Which Gated DeltaNet kernels transformers binds (on CPU none is usable: their Triton kernels need a GPU)."""
        if device.type != "cuda":
            return cls(fla=False, causal_conv1d=False)
        return cls(
            fla=check_fast_path(FLA, "warn").status == "ok",
            causal_conv1d=check_fast_path(CAUSAL_CONV1D, "warn").status == "ok",
        )

    def as_dict(self) -> dict[str, bool]:
        return {"flash-linear-attention": self.fla, "causal-conv1d": self.causal_conv1d}


@dataclass(slots=True)
class Target:
    """A loaded target, ready to capture."""

    model: torch.nn.Module
    """The base decoder (embeddings + layers 0..deepest): no LM head, final norm skipped."""
    layers: list[int]
    hidden_size: int
    name: str
    config_hash: str
    architecture: TargetArchitecture
    conv_gap: int
    """Masked tokens after every packed sample: the architecture's packing gap (the Gated DeltaNet conv kernel - 1, 0 for a dense model)."""
    final_hidden: bool = False
    """Also capture the output of the model's last decoder layer (the target's last: loaded whole)."""

    @property
    def decoder_layers(self) -> torch.nn.ModuleList:
        return self.model.layers

    @property
    def final_layer(self) -> int | None:
        """The decoder layer whose output is the final hidden state (before the final norm), when captured."""
        return len(self.decoder_layers) - 1 if self.final_hidden else None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def capture_depth(layers: list[int], num_hidden_layers: int, *, final_hidden: bool) -> int:
    """Decoder layers to run: through the deepest captured one, or all of them for the final hidden state."""
    return num_hidden_layers if final_hidden else max(layers) + 1


def prepare_for_capture(model: torch.nn.Module, layers: list[int], *, final_hidden: bool = False) -> torch.nn.Module:
    """Cuts a base decoder after the deepest captured layer (keeps all with `final_hidden`) and drops
    its final norm (never read)."""
    depth = capture_depth(layers, len(model.layers), final_hidden=final_hidden)
    if len(model.layers) < max(layers) + 1:
        raise SpecError("target.layers", layers, f"layer indices below the model's depth ({len(model.layers)})")
    model.layers = model.layers[:depth]
    model.config.num_hidden_layers = depth
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:depth]
    # Hooks read each captured layer's raw output, the final hidden state included (the last layer's
    # output before the norm): the final norm would only normalise layer `depth - 1` again.
    model.norm = torch.nn.Identity()
    return model.eval().requires_grad_(False)


def read_config(spec: TargetSpec, checkpoint: Path) -> tuple[str, dict]:
    """The checkpoint's config.json: its text (hashed into every chunk) and its content."""
    try:
        text = (checkpoint / "config.json").read_text()
        return text, json.loads(text)
    except (OSError, ValueError) as exc:
        raise SpecError("target.model", spec.model, f"a checkpoint directory with a readable config.json ({exc})") from None


def load_target(
    spec: TargetSpec, *, checkpoint: Path, layers: list[int], device: torch.device, dtype: torch.dtype = torch.bfloat16,
    final_hidden: bool = False,
) -> Target:
    """Loads the text model of `checkpoint` (a local directory), truncated (whole with
    `final_hidden`: its last decoder layer's output is captured too), on `device`."""
    from transformers import AutoConfig, AutoModel
    from transformers.utils import logging as hf_logging

    config_text, raw_config = read_config(spec, checkpoint)
    config = AutoConfig.from_pretrained(checkpoint).get_text_config()
    depth = capture_depth(layers, config.num_hidden_layers, final_hidden=final_hidden)
    config.num_hidden_layers = depth
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:depth]
    started = time.monotonic()
    # The dropped layers, the vision tower and the LM head are reported as unexpected keys: expected here.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModel.from_pretrained(
            checkpoint, config=config, dtype=dtype, attn_implementation=spec.attn_implementation,
            device_map=str(device), output_loading_info=True,
        )
    except OSError as exc:  # no weight files: every shard would fail alike, so a spec error, not a retry
        raise SpecError("target.model", spec.model, f"a checkpoint directory with its weights (*.safetensors) ({exc})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise InputError(
            f"target.model {spec.model}: {len(missing)} weights of the text model are missing from the checkpoint (first: {missing[0]})",
            "Point target.model at a complete Hugging Face checkpoint of a causal LM (Qwen3.5/3.6, Llama)",
        )
    model = prepare_for_capture(model, layers, final_hidden=final_hidden)
    architecture = target_architecture(config)
    log.info("loaded %s (%s, %d of %d layers, capturing %s%s) in %.1f s on %s",
             checkpoint, type(model).__name__, depth, text_config(raw_config)["num_hidden_layers"],
             layers, f" and the final hidden state (layer {depth - 1}, before the norm)" if final_hidden else "",
             time.monotonic() - started, device)
    return Target(
        model=model,
        layers=layers,
        hidden_size=int(config.hidden_size),
        name=spec.model.rstrip("/").rsplit("/", 1)[-1] or raw_config.get("_name_or_path", "target"),
        config_hash=hashlib.sha256(config_text.encode()).hexdigest(),
        architecture=architecture,
        conv_gap=architecture.packing_gap(config),
        final_hidden=final_hidden,
    )


# ---- s3:// checkpoints: one download per node ---------------------------------------------------


def cache_root() -> Path:
    explicit = os.environ.get(MODEL_CACHE_ENV)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash" / "models"


def local_checkpoint(spec: TargetSpec, open_storage_fn) -> Path:
    """A local directory holding the checkpoint: target.model itself, or its per-node cached copy."""
    if not is_s3(spec.model):
        path = Path(spec.model.removeprefix("file://"))
        if not (path / "config.json").is_file():
            raise SpecError("target.model", spec.model, "a checkpoint directory containing config.json")
        return path
    return CheckpointCache(cache_root()).fetch(spec.model, open_storage_fn(spec.model))


class CheckpointCache:
    def __init__(self, root: Path) -> None:
        self.root = root

    def directory(self, url: str) -> Path:
        name = url.rstrip("/").rsplit("/", 1)[-1]
        return self.root / f"{name}-{hashlib.sha256(url.encode()).hexdigest()[:12]}"

    @contextmanager
    def _locked(self, directory: Path) -> Iterator[None]:
        directory.parent.mkdir(parents=True, exist_ok=True)
        with open(directory.with_name(directory.name + ".lock"), "w") as lock:
            started = time.monotonic()
            fcntl.flock(lock, fcntl.LOCK_EX)  # the node's other pods wait here while one downloads
            waited = time.monotonic() - started
            if waited > 1:
                log.info("waited %.0f s for another pod to fetch the checkpoint", waited)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def fetch(self, url: str, storage: Storage) -> Path:
        directory = self.directory(url)
        with self._locked(directory):
            if self._valid(directory):
                log.info("checkpoint %s: using the node cache %s", url, directory)
                return directory
            self._download(url, storage, directory)
        return directory

    def _valid(self, directory: Path) -> bool:
        record = directory / COMPLETE_FILE
        if not record.is_file():
            return False
        try:
            files = {name: entry["size"] for name, entry in json.loads(record.read_text())["files"].items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("node cache %s: unreadable %s; downloading again", directory, COMPLETE_FILE)
            return False
        for name, size in files.items():
            path = directory / name
            if not path.is_file() or path.stat().st_size != size:
                log.warning("node cache %s: %s is missing or has the wrong size; downloading again", directory, name)
                return False
        return True

    def _download(self, url: str, storage: Storage, directory: Path) -> None:
        started = time.monotonic()
        (directory / COMPLETE_FILE).unlink(missing_ok=True)
        keys = [key for key in storage.list("") if not key.endswith("/")]
        if "config.json" not in keys:
            raise SpecError("target.model", url, "an s3:// prefix holding a Hugging Face checkpoint (config.json, *.safetensors)")
        sizes = {}
        for key in keys:
            info = storage.stat(key)
            if info is None:
                raise InputError(f"{url}/{key} vanished while the checkpoint was being fetched", "Do not modify the checkpoint during a run")
            sizes[key] = info.size
        ranges = []
        for key, size in sizes.items():
            path = directory / key
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                f.truncate(size)
            ranges += [(key, start, min(start + RANGE_BYTES, size)) for start in range(0, size, RANGE_BYTES)]

        def fetch_range(task: tuple[str, int, int]) -> None:
            key, start, end = task
            data = storage.get_bytes(key, start, end)
            if len(data) != end - start:
                raise InputError(f"{url}/{key}: short read at {start} ({len(data)} of {end - start} bytes)", "Retry; check the S3 endpoint")
            fd = os.open(directory / key, os.O_WRONLY)
            try:
                os.pwrite(fd, data, start)
            finally:
                os.close(fd)

        with ThreadPoolExecutor(DOWNLOAD_THREADS) as pool:
            list(pool.map(fetch_range, ranges))
            digests = dict(zip(sizes, pool.map(lambda key: sha256_file(directory / key), sizes)))
        for key, size in sizes.items():
            self._verify(url, directory / key, key, size)
        record = {"url": url, "files": {key: {"size": sizes[key], "sha256": digests[key]} for key in sizes}}
        # Written whole or not at all: a pod killed mid-write must not leave a record the others trust.
        partial = directory / f"{COMPLETE_FILE}.partial"
        partial.write_text(json.dumps(record, indent=2, sort_keys=True))
        os.replace(partial, directory / COMPLETE_FILE)
        total = sum(sizes.values())
        elapsed = time.monotonic() - started
        log.info("checkpoint %s: fetched %d files, %.2f GB in %.0f s (%.2f GB/s) into %s",
                 url, len(sizes), total / 1e9, elapsed, total / 1e9 / max(elapsed, 1e-9), directory)

    @staticmethod
    def _verify(url: str, path: Path, key: str, size: int) -> None:
        if path.stat().st_size != size:
            raise InputError(f"{url}/{key}: fetched {path.stat().st_size} bytes, the object has {size}", "Retry; check the S3 endpoint")
        if key.endswith(".safetensors"):
            _, total = read_header(fetch_header_bytes(file_range(path)), f"{url}/{key}")
            if total != size:
                raise InputError(f"{url}/{key}: its header describes {total} bytes, the object has {size}", "Re-upload the checkpoint")
