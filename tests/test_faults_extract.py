"""SIGKILL the extraction worker at random points, restart it until it finishes, and compare.

Each trial kills a real shard process (the `python -m dflash_jobs.extract` entry point, forked from
a zygote: tests/faults/shard_process.py) either after a seeded random delay or, through the
worker's own hook, in the narrowest window there is: the chunk object stored, its done marker not
yet. After every kill the storage is listed: every visible chunk and marker must equal the
undisturbed run's, byte for byte (chunk headers are canonical), and no marker may exist
without its object or disagree with it. At the end the whole extract/ prefix must equal the
undisturbed run's. Local directories and S3 (moto,
through the fault proxy) both."""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from extract_helpers import LAYERS, random_chunks, tiny_target, write_prepared
from faults.s3_fault_proxy import S3FaultProxy
from faults.shard_process import start_shard, warm_zygote

from dflash_jobs.extract.writer import KILL_BEFORE_MARKER_ENV
from dflash_jobs.formats import DONE_MARKERS, HIDDEN_CHUNKS, TOKEN_CHUNKS, chunk_of_key, done_key, hidden_chunk_key
from dflash_jobs.storage import TEMP_PREFIX, Storage, open_storage

CHUNKS = 5
SIGKILL_EXIT = -9
ATTEMPT_TIMEOUT_S = 120.0
MAX_ATTEMPTS = 60


@dataclass
class KillLog:
    """What the kills hit: (how, committed chunks before the attempt, after the kill) per kill."""

    kills: list[tuple[str, int, int]] = field(default_factory=list)
    attempts: int = 0
    runs: int = 0

    def count(self, mode: str) -> int:
        return sum(1 for how, _, _ in self.kills if how == mode)


def write_run_spec(path: Path, *, name: str, target: Path, output: str) -> Path:
    spec = {
        "name": name,
        "backend": "local",
        "target": {"model": str(target), "layers": LAYERS},
        "data": {"source": f"{output}/chats.jsonl", "max_length": 48, "chunk_tokens": 512},
        "output": output,
        # sort_window 1: a chunk's batches never depend on which other chunks are still pending,
        # so a restarted shard computes every chunk exactly as an undisturbed one (byte-identical).
        "extract": {"shards": 1, "token_budget": 96, "pad_multiple": 16, "sort_window": 1},
    }
    path.write_text(yaml.safe_dump(spec))
    return path


def extract_snapshot(storage: Storage) -> dict[str, bytes]:
    return {key: storage.get_bytes(key) for key in storage.list("extract/")}


def assert_markers_match_objects(storage: Storage, markers: list[str]) -> None:
    for key in markers:
        marker = json.loads(storage.get_bytes(key))
        data = storage.get_bytes(hidden_chunk_key(chunk_of_key(key)))
        assert marker["sha256"] == hashlib.sha256(data).hexdigest() and marker["bytes"] == len(data), key
        stat = storage.stat(hidden_chunk_key(chunk_of_key(key)))
        assert marker["etag"] == stat.etag, key


def run_shard(spec: Path, env: dict[str, str], log: Path) -> int:
    process = start_shard(spec, 0, env=env, log=log)
    process.join(ATTEMPT_TIMEOUT_S)
    assert process.exitcode is not None, f"the shard did not finish in {ATTEMPT_TIMEOUT_S} s; log: {log}"
    return process.exitcode


def assert_nothing_partial(storage: Storage, reference: dict[str, bytes], log: Path) -> int:
    """Every visible chunk and marker is complete and the undisturbed run's; a marker always has its
    object and describes it exactly. Returns the number of committed chunks."""
    visible = storage.list("extract/")
    for key in visible:
        assert key.startswith((HIDDEN_CHUNKS, DONE_MARKERS)) and TEMP_PREFIX not in key, f"stray object {key}"
        assert storage.get_bytes(key) == reference[key], f"{key} is visible but differs from the undisturbed run ({log})"
    markers = [key for key in visible if key.startswith(DONE_MARKERS)]
    for key in markers:
        assert hidden_chunk_key(chunk_of_key(key)) in visible, f"{key} exists without its chunk object"
    assert_markers_match_objects(storage, markers)
    return len(markers)


def kill_until_done(
    spec: Path, storage: Storage, reference: dict[str, bytes], record: KillLog, *, rng: random.Random,
    random_kills: int, hook_kills: int, reference_s: float, env: dict[str, str], logs: Path,
) -> None:
    """Restarts the shard until it exits 0. Until `record` holds `hook_kills` hook kills and
    `random_kills` delay kills, an attempt either dies between a chunk's object and its marker (a
    seeded pending chunk) or is SIGKILLed after a seeded delay; then it finishes. A delay that
    outlasts the attempt lets it finish: the run is complete."""
    while True:
        record.attempts += 1
        assert record.attempts <= MAX_ATTEMPTS, f"no progress after {MAX_ATTEMPTS} attempts: {record.kills}"
        log = logs / f"attempt-{record.attempts:02d}.log"
        before = assert_nothing_partial(storage, reference, log)
        pending = [c for c in range(CHUNKS) if done_key(c) not in storage.list(DONE_MARKERS)]
        hooks, delays = record.count("hook"), record.count("delay")
        # Hook kills spread among the delay kills (in proportion), so both meet every stage of a run.
        if hooks < hook_kills and pending and (hooks * random_kills <= delays * hook_kills or delays >= random_kills):
            mode, chunk = "hook", rng.choice(pending)
            code = run_shard(spec, {**env, KILL_BEFORE_MARKER_ENV: str(chunk)}, log)
            # Killed in the window between the object and its marker: stored, not committed.
            assert storage.exists(hidden_chunk_key(chunk)) and not storage.exists(done_key(chunk))
        elif delays < random_kills:
            mode = "delay"
            process = start_shard(spec, 0, env=env, log=log)
            process.join(rng.uniform(0.1, 0.9) * reference_s)
            process.kill()
            process.join(ATTEMPT_TIMEOUT_S)
            code = process.exitcode
        else:
            mode = "finish"
            code = run_shard(spec, env, log)
        after = assert_nothing_partial(storage, reference, log)
        if code == SIGKILL_EXIT:
            record.kills.append((mode, before, after))
            continue
        assert code == 0, f"attempt {record.attempts} exited {code}: {log.read_text()[-3000:]}"
        return


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return tiny_target(tmp_path_factory)


def undisturbed(spec: Path, storage: Storage, env: dict[str, str], logs: Path) -> tuple[dict[str, bytes], float]:
    warm_zygote()
    started = time.monotonic()
    assert run_shard(spec, env, logs / "reference.log") == 0, (logs / "reference.log").read_text()[-3000:]
    elapsed = time.monotonic() - started
    reference = extract_snapshot(storage)
    assert len([k for k in reference if k.startswith(HIDDEN_CHUNKS)]) == CHUNKS
    return reference, elapsed


def prepared(output: str, seed: int) -> Storage:
    storage = open_storage(output)
    write_prepared(storage, random_chunks(seed, CHUNKS))
    return storage


def check_kill_runs(tmp_path: Path, target: Path, *, outputs: tuple[str, str], env: dict[str, str], env_reference: dict[str, str],
                    seed: int, random_kills: int, hook_kills: int) -> KillLog:
    """Runs the shard under kills until the kill counts are reached (starting the extraction over
    from its token chunks whenever one run completes); after each run, compares it with the
    undisturbed one."""
    reference_out, killed_out = outputs
    logs = tmp_path / "logs"
    logs.mkdir()
    reference_storage = prepared(reference_out, seed)
    reference_spec = write_run_spec(tmp_path / "reference.yaml", name=f"kill-ref-{seed}", target=target, output=reference_out)
    reference, reference_s = undisturbed(reference_spec, reference_storage, env_reference, logs)

    storage = prepared(killed_out, seed)
    tokens_before = {key: storage.get_bytes(key) for key in storage.list(TOKEN_CHUNKS)}
    spec = write_run_spec(tmp_path / "killed.yaml", name=f"kill-run-{seed}", target=target, output=killed_out)
    rng, record = random.Random(seed), KillLog()
    while record.count("hook") < hook_kills or record.count("delay") < random_kills:
        for key in storage.list("extract/"):
            storage.delete(key)
        record.runs += 1
        kill_until_done(
            spec, storage, reference, record, rng=rng, random_kills=random_kills, hook_kills=hook_kills,
            reference_s=reference_s, env=env, logs=logs,
        )
        assert extract_snapshot(storage) == reference  # every chunk and marker, nothing else
        assert_markers_match_objects(storage, storage.list(DONE_MARKERS))
        assert {key: storage.get_bytes(key) for key in storage.list(TOKEN_CHUNKS)} == tokens_before
    return record


def test_sigkilled_local_shard_restarts_to_identical_output(tmp_path, target):
    env = {"DFLASH_TERMINATION_LOG": str(tmp_path / "termination-log")}
    record = check_kill_runs(
        tmp_path, target, outputs=(str(tmp_path / "reference"), str(tmp_path / "killed")),
        env=env, env_reference=env, seed=11, random_kills=14, hook_kills=3,
    )
    leftovers = [p for p in (tmp_path / "killed").rglob(f"{TEMP_PREFIX}*")]
    # A kill mid-write may leave a temporary file: never listed, never read, overwritten by name only.
    assert all(p.name.startswith(TEMP_PREFIX) for p in leftovers)
    print(f"local: {len(record.kills)} kills in {record.attempts} attempts over {record.runs} runs: {record.kills}; temp files left: {len(leftovers)}")


def test_sigkilled_s3_shard_behind_a_faulty_network_restarts_to_identical_output(tmp_path, target, s3_server, s3_bucket):
    credentials = {name: os.environ[name] for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    env_reference = {**credentials, "AWS_ENDPOINT_URL": s3_server}
    with S3FaultProxy(s3_server, seed=5, rate=0.1, max_faults=10) as proxy:
        record = check_kill_runs(
            tmp_path, target, outputs=(f"s3://{s3_bucket}/reference", f"s3://{s3_bucket}/killed"),
            env={**credentials, "AWS_ENDPOINT_URL": proxy.url}, env_reference=env_reference,
            seed=12, random_kills=6, hook_kills=2,
        )
    assert proxy.faults >= 1
    print(f"s3: {len(record.kills)} kills in {record.attempts} attempts over {record.runs} runs: {record.kills}; proxy faults: {dict(proxy.injected)}")
