"""Restarts and node-level caching: a worker killed between storing a chunk and committing it
resumes to byte-identical output, and an s3:// checkpoint is fetched once per node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from dflash_jobs.errors import FormatError
from dflash_jobs.capture import checkpoint as target_module
from dflash_jobs.extract.__main__ import main
from dflash_jobs.extract.progress import Summary
from dflash_jobs.capture.checkpoint import CheckpointCache
from dflash_jobs.extract.worker import build_worker
from dflash_jobs.extract.writer import KILL_BEFORE_MARKER_ENV
from dflash_jobs.formats import DoneMarker, HiddenChunk, done_key, hidden_chunk_key
from dflash_jobs.spec import load_spec
from dflash_jobs.storage import TEMP_PREFIX, open_storage

from extract_helpers import random_chunks, tiny_target, write_prepared, write_spec


def extract(spec, env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflash_jobs.extract", "-f", str(spec), "--shard", "0"],
        env=env, capture_output=True, text=True, timeout=300,
    )


def test_killed_worker_restarts_to_identical_output(tmp_path, tmp_path_factory):
    checkpoint = tiny_target(tmp_path_factory)
    chunks = random_chunks(seed=11, count=3, max_len=30)

    reference = tmp_path / "reference"
    write_prepared(open_storage(str(reference)), chunks)
    assert main(["-f", str(write_spec(tmp_path / "reference.yaml", target=checkpoint, output=reference)), "--shard", "0"]) == 0

    output = tmp_path / "run"
    storage = open_storage(str(output))
    write_prepared(storage, chunks)
    spec = write_spec(tmp_path / "run.yaml", target=checkpoint, output=output)
    termination = tmp_path / "termination-log"
    env = {**os.environ, "DFLASH_TERMINATION_LOG": str(termination), KILL_BEFORE_MARKER_ENV: "1"}
    killed = extract(spec, env)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    # Chunk 0 committed; chunk 1 stored but never committed; chunk 2 never started; no partial files.
    assert storage.exists(done_key(0)) and storage.exists(hidden_chunk_key(1))
    assert not storage.exists(done_key(1)) and not storage.exists(hidden_chunk_key(2))
    assert not [p for p in output.rglob("*") if p.name.startswith(".tmp-")]

    del env[KILL_BEFORE_MARKER_ENV]
    restarted = extract(spec, env)
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr
    summary = json.loads(termination.read_text())
    assert summary["status"] == "done" and summary["chunks_skipped"] == 1 and summary["chunks_done"] == 2
    expected = open_storage(str(reference))
    for cid in range(len(chunks)):
        # Another process, the same bytes: chunk headers are canonical, so markers match too.
        assert storage.get_bytes(hidden_chunk_key(cid)) == expected.get_bytes(hidden_chunk_key(cid))
        assert storage.get_bytes(done_key(cid)) == expected.get_bytes(done_key(cid))
        marker = DoneMarker.from_json(storage.get_bytes(done_key(cid)), done_key(cid))
        assert marker.bytes == storage.stat(hidden_chunk_key(cid)).size and marker.samples == chunks[cid].num_samples
    assert not [p for p in output.rglob("*") if p.name.startswith(".tmp-")]


def test_chunks_marked_under_other_settings_are_redone_in_this_run_s_dtype(tmp_path, tmp_path_factory):
    checkpoint = tiny_target(tmp_path_factory)
    storage = open_storage(str(tmp_path / "run"))
    write_prepared(storage, random_chunks(seed=5, count=2, max_len=20))
    bf16 = write_spec(tmp_path / "bf16.yaml", target=checkpoint, output=tmp_path / "run")
    assert main(["-f", str(bf16), "--shard", "0"]) == 0
    fp8 = write_spec(tmp_path / "fp8.yaml", target=checkpoint, output=tmp_path / "run", dtype="float8_e4m3fn")

    assert main(["-f", str(fp8), "--shard", "0"]) == 0

    for cid in range(2):
        marker = DoneMarker.from_json(storage.get_bytes(done_key(cid)), done_key(cid))
        chunk = HiddenChunk.decode(storage.get_bytes(hidden_chunk_key(cid)), hidden_chunk_key(cid))
        assert marker.dtype == chunk.dtype == "float8_e4m3fn" and marker.bytes == storage.stat(hidden_chunk_key(cid)).size


def test_bad_token_chunk_fails_the_shard_with_the_bad_input_code(tmp_path, tmp_path_factory, monkeypatch):
    checkpoint = tiny_target(tmp_path_factory)
    output = tmp_path / "run"
    storage = open_storage(str(output))
    write_prepared(storage, random_chunks(seed=12, count=1))
    data = storage.get_bytes("tokens/chunks/000000.safetensors")
    storage.put_bytes("tokens/chunks/000000.safetensors", data[: len(data) // 2])
    termination = tmp_path / "termination-log"
    monkeypatch.setenv("DFLASH_TERMINATION_LOG", str(termination))
    assert main(["-f", str(write_spec(tmp_path / "spec.yaml", target=checkpoint, output=output)), "--shard", "0"]) == 42
    summary = json.loads(termination.read_text())
    assert summary["status"] == "failed" and "tokens/chunks/000000.safetensors is truncated" in summary["error"]


class SlowChunkUploads:
    """A storage whose chunk uploads take `seconds` each: the writer is mid-store when the GPU thread fails."""

    def __init__(self, storage, seconds: float) -> None:
        self.storage = storage
        self.seconds = seconds

    def __getattr__(self, name):
        return getattr(self.storage, name)

    def put_parts(self, key, parts, size=None):
        time.sleep(self.seconds)
        return self.storage.put_parts(key, parts, size)


def test_an_error_on_the_gpu_thread_waits_for_the_chunks_handed_to_the_writer(tmp_path, tmp_path_factory):
    """The second window's token chunk is corrupt, so the GPU thread fails while the writer stores
    the first chunk (complete: handed over). The error must leave the worker only once nothing is
    mid-store: the process exits right after, and a daemon writer thread would die there, leaving
    a local temporary file or an S3 multipart upload that nobody aborts."""
    output = tmp_path / "run"
    storage = open_storage(str(output))
    write_prepared(storage, random_chunks(seed=13, count=2))
    data = storage.get_bytes("tokens/chunks/000001.safetensors")
    storage.put_bytes("tokens/chunks/000001.safetensors", data[: len(data) // 2])
    spec = load_spec(write_spec(tmp_path / "spec.yaml", target=tiny_target(tmp_path_factory), output=output))
    worker = build_worker(spec, 0, summary=Summary(shard=0, shards=1))
    worker.storage = SlowChunkUploads(worker.storage, seconds=1.0)
    try:
        with pytest.raises(FormatError, match="000001.safetensors is truncated"):
            worker.run()
    finally:
        worker.close()
    assert not [thread.name for thread in worker.writer.threads if thread.is_alive()]
    # The chunk handed to the writer landed whole, its marker last; no temporary file is left.
    marker = DoneMarker.from_json(storage.get_bytes(done_key(0)), done_key(0))
    assert marker.bytes == storage.stat(hidden_chunk_key(0)).size
    assert storage.list("extract/") == [hidden_chunk_key(0), done_key(0)]
    assert not [path for path in output.rglob(f"{TEMP_PREFIX}*")]


class CountingStorage:
    """Counts the ranged reads made through a storage."""

    def __init__(self, storage):
        self.storage = storage
        self.reads = 0

    def __getattr__(self, name):
        return getattr(self.storage, name)

    def get_bytes(self, key, start=None, end=None):
        self.reads += 1
        return self.storage.get_bytes(key, start, end)


def test_s3_checkpoint_is_fetched_once_per_node(s3_bucket, tmp_path, tmp_path_factory, monkeypatch):
    checkpoint = tiny_target(tmp_path_factory)
    url = f"s3://{s3_bucket}/models/tiny-qwen"
    remote = open_storage(url)
    files = {path.name: path.read_bytes() for path in checkpoint.iterdir() if path.is_file()}
    for name in files:
        remote.put_file(name, checkpoint / name)
    monkeypatch.setattr(target_module, "RANGE_BYTES", 256 << 10)  # several parallel ranges per weight file
    counting = CountingStorage(open_storage(url))
    cache = CheckpointCache(tmp_path / "node-cache")

    # Two pods of one node start together: one downloads under the lock, the other waits and re-uses it.
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: cache.fetch(url, counting), range(2))
    assert first == second
    ranges = sum(-(-len(data) // (256 << 10)) or 1 for data in files.values())
    assert counting.reads == ranges
    assert {name: (first / name).read_bytes() for name in files} == files
    assert max(len(data) for data in files.values()) > 256 << 10

    # A cached file with the wrong size is noticed and the checkpoint fetched again.
    with open(first / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert cache.fetch(url, counting) == first
    assert (first / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert counting.reads == 2 * ranges
