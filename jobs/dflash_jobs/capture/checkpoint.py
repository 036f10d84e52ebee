"""The target's checkpoint as a local directory: `target.model` itself (a PVC mount), or an s3://
prefix fetched once per node into a cache directory, under a file lock that the node's other pods
wait on, with parallel ranged reads; sizes and safetensors headers are verified and the file
digests recorded, so a later pod re-uses it after a size check. Extraction, online training,
generation and evaluation all read the target from here.
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
from pathlib import Path
from typing import Iterator

from dflash_jobs.errors import InputError, SpecError
from dflash_jobs.formats import fetch_header_bytes, file_range, read_header
from dflash_jobs.spec import MODEL_CACHE_ENV, RunSpec, TargetSpec, is_s3
from dflash_jobs.storage import Storage, open_storage, sha256_file

log = logging.getLogger("dflash.checkpoint")

RANGE_BYTES = 64 << 20
DOWNLOAD_THREADS = 16
COMPLETE_FILE = ".dflash-complete.json"


def read_config(spec: TargetSpec, checkpoint: Path) -> tuple[str, dict]:
    """The checkpoint's config.json: its text (hashed into every chunk) and its content."""
    try:
        text = (checkpoint / "config.json").read_text()
        return text, json.loads(text)
    except (OSError, ValueError) as exc:
        raise SpecError("target.model", spec.model, f"a checkpoint directory with a readable config.json ({exc})") from None



def cache_root() -> Path:
    explicit = os.environ.get(MODEL_CACHE_ENV)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash" / "models"


def local_checkpoint(spec: RunSpec) -> Path:
    """A local directory holding the run's target checkpoint: target.model itself, or its per-node cached copy."""
    model = spec.target.model
    if not is_s3(model):
        path = Path(model.removeprefix("file://"))
        if not (path / "config.json").is_file():
            raise SpecError("target.model", model, "a checkpoint directory containing config.json")
        return path
    storage = open_storage(model, endpoint_url=spec.storage.endpoint_url, region=spec.storage.region)
    return CheckpointCache(cache_root()).fetch(model, storage)


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
