"""S3 faults between the pods and the store: connection resets, 500 InternalError, 503 SlowDown,
responses lost after S3 applied the request, and slow answers, from the seeded fault proxy on
loopback (tests/faults/s3_fault_proxy.py). Every storage call must complete with the right result,
and a whole extraction must produce the same chunks as one over a clean network."""

from __future__ import annotations

import hashlib
import os

import pytest
from faults.s3_fault_proxy import ERROR_500, ERROR_503, KINDS, LOST_RESPONSE, RESET, SLOW, S3FaultProxy, s3_error_body

from dflash_jobs.storage import MULTIPART_CHUNK, open_storage

SEEDS = (1, 2, 3)


@pytest.fixture
def through_proxy(s3_server, s3_bucket, monkeypatch):
    """Opens storage on the bucket through a fault proxy: `open(seed, **schedule) -> (storage, proxy)`."""
    proxies = []

    def open_through(seed: int, **schedule):
        proxy = S3FaultProxy(s3_server, seed=seed, **schedule).start()
        proxies.append(proxy)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        return open_storage(f"s3://{s3_bucket}/run"), proxy

    yield open_through
    for proxy in proxies:
        proxy.stop()


def test_every_storage_call_completes_correctly_through_faults(through_proxy, s3_server, s3_bucket, tmp_path):
    injected = set()
    for seed in SEEDS:
        storage, proxy = through_proxy(seed, rate=0.5, max_faults=8)
        objects = {f"seed{seed}/obj-{i:02d}": os.urandom(100 + 997 * i) for i in range(4)}
        for key, data in objects.items():
            assert storage.put_bytes(key, data).size == len(data)
        big = tmp_path / f"big-{seed}"
        big.write_bytes(os.urandom(300_000))
        assert storage.put_file(f"seed{seed}/big", big).size == 300_000
        assert storage.list(f"seed{seed}/") == sorted([*objects, f"seed{seed}/big"])
        for key, data in objects.items():
            assert storage.get_bytes(key) == data
            assert storage.get_bytes(key, 10, 50) == data[10:50]
            assert storage.stat(key).size == len(data)
        storage.get_file(f"seed{seed}/big", tmp_path / f"back-{seed}")
        assert (tmp_path / f"back-{seed}").read_bytes() == big.read_bytes()
        storage.delete(f"seed{seed}/obj-00")
        assert not storage.exists(f"seed{seed}/obj-00")
        assert proxy.faults >= 4
        injected |= set(proxy.injected)
    assert injected == set(KINDS)  # every kind of fault was really tried


def test_a_chunk_streamed_from_memory_in_parts_lands_whole_through_faults(through_proxy):
    """put_parts (how a hidden-state chunk goes up): every part and the completion survive faults."""
    storage, proxy = through_proxy(5, rate=1.0, max_faults=6, methods=("PUT", "POST"))
    header, states = os.urandom(4096), os.urandom(MULTIPART_CHUNK + 100_000)
    result = storage.put_parts("extract/chunks/000000.safetensors", [memoryview(header), memoryview(states)])
    assert result.sha256 == hashlib.sha256(header + states).hexdigest()
    assert storage.get_bytes("extract/chunks/000000.safetensors") == header + states
    assert result.etag == storage.stat("extract/chunks/000000.safetensors").etag
    assert proxy.faults >= 2  # at most every other request is faulted: create, parts and completion alike


@pytest.mark.parametrize("kind", [RESET, ERROR_500, ERROR_503, SLOW, LOST_RESPONSE])
def test_a_marker_put_hit_by_a_fault_still_reports_that_it_created_the_marker(through_proxy, kind):
    """put_if_absent is the commit point of a chunk. If its response is lost after S3 stored it, the
    retry meets its own marker: that must still count as created, or the shard fails its chunk."""
    storage, proxy = through_proxy(0, rate=1.0, max_faults=1, kinds=(kind,), methods=("PUT",))
    assert storage.put_if_absent("extract/done/000000.json", b'{"chunk": 0}') is True
    assert proxy.injected[kind] == 1
    assert storage.get_bytes("extract/done/000000.json") == b'{"chunk": 0}'
    # A marker that really existed before (another writer, different content) is still refused.
    assert storage.put_if_absent("extract/done/000000.json", b'{"chunk": 0, "other": 1}') is False


def test_faults_stop_after_their_bounds_and_error_bodies_are_s3_xml():
    proxy = S3FaultProxy("http://127.0.0.1:9", seed=4, rate=1.0, max_faults=3)
    decisions = [proxy.schedule.next("PUT")[0] for _ in range(20)]
    assert sum(d is not None for d in decisions) == 3  # bounded in count, and never two in a row
    assert all(not (a and b) for a, b in zip(decisions, decisions[1:]))
    assert b"<Code>SlowDown</Code>" in s3_error_body("SlowDown", "Please reduce your request rate.", "/b/k")
    with pytest.raises(ValueError, match="only forwards to"):
        S3FaultProxy("http://example.com:80", seed=0)
