"""Storage against a real S3 server on loopback and a local directory: the same guarantees."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import numpy as np
import pytest

from dflash_jobs.errors import StorageError
from dflash_jobs.storage import MULTIPART_CHUNK, MULTIPART_THRESHOLD, ObjectNotFound, S3Storage, open_storage, open_url
from dflash_jobs.storage import s3 as storage_module


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path, s3_server):  # s3_server started before the process-state guard reads the environment
    if request.param == "local":
        return open_storage(str(tmp_path / "root"))
    bucket = request.getfixturevalue("s3_bucket")
    return open_storage(f"s3://{bucket}/runs/r1")


def test_put_get_list_stat_delete(storage):
    result = storage.put_bytes("a/b/x.json", b"hello")
    assert result.size == 5 and result.sha256 == hashlib.sha256(b"hello").hexdigest()
    storage.put_bytes("a/c.bin", b"12345678")
    storage.put_bytes("z.txt", b"z")
    assert storage.get_bytes("a/b/x.json") == b"hello"
    assert storage.get_bytes("a/c.bin", 2, 5) == b"345"
    assert storage.get_bytes("a/c.bin", 4) == b"5678"
    assert storage.list("a/") == ["a/b/x.json", "a/c.bin"]
    assert storage.list("") == ["a/b/x.json", "a/c.bin", "z.txt"]
    assert storage.list("nothing/") == []
    assert storage.stat("a/c.bin").size == 8
    assert storage.stat("missing") is None and not storage.exists("missing")
    storage.delete("z.txt")
    assert not storage.exists("z.txt")
    with pytest.raises(ObjectNotFound):
        storage.get_bytes("z.txt")


def test_a_listing_tells_when_each_key_was_written(storage):
    before = time.time()
    storage.put_bytes("done/000001.json", b"a")
    storage.put_bytes("done/000002.json", b"b")
    storage.put_bytes("other.json", b"c")
    modified = storage.list_modified("done/")
    assert list(modified) == storage.list("done/") == ["done/000001.json", "done/000002.json"]
    # S3's LastModified has whole seconds; a local clock and the server's agree within that.
    assert all(before - 2 <= at <= time.time() + 2 for at in modified.values())
    assert storage.list_modified("nothing/") == {}


def test_put_if_absent_creates_once(storage):
    assert storage.put_if_absent("done/000001.json", b"first")
    assert not storage.put_if_absent("done/000001.json", b"second")
    assert storage.get_bytes("done/000001.json") == b"first"


def test_put_if_absent_has_one_winner_under_races(storage):
    wins = []
    barrier = threading.Barrier(6)

    def contend(i):
        barrier.wait()
        if storage.put_if_absent("race/marker", f"writer-{i}".encode()):
            wins.append(i)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(6)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(wins) == 1
    assert storage.get_bytes("race/marker") == f"writer-{wins[0]}".encode()


def test_large_file_goes_up_in_parts_and_round_trips(storage, tmp_path):
    data = os.urandom(MULTIPART_THRESHOLD + 1234)
    source = tmp_path / "big.bin"
    source.write_bytes(data)
    result = storage.put_file("chunks/big.bin", source)
    assert result.size == len(data) and result.sha256 == hashlib.sha256(data).hexdigest()
    if isinstance(storage, S3Storage):
        assert result.etag and result.etag.strip('"').endswith("-2"), "expected a two-part multipart upload"
    storage.get_file("chunks/big.bin", tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == data
    with storage.open_read("chunks/big.bin") as f:
        assert f.read(10) == data[:10]


@pytest.mark.parametrize("sizes", [(8, 100, 3), (MULTIPART_CHUNK - 8, 8, MULTIPART_CHUNK + 5, 1)])
def test_parts_stream_into_one_object_hashed_as_written(storage, sizes):
    """put_parts writes buffers in place (a chunk's header, then its tensors' memory); parts cross
    the views' boundaries, and the sha256 is of the whole object."""
    rng = np.random.default_rng(len(sizes))
    parts = [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]
    views = [memoryview(parts[0].tobytes()), *(p.data for p in parts[1:])]
    data = b"".join(p.tobytes() for p in parts)
    result = storage.put_parts("chunks/parts.bin", views)
    assert result.size == len(data) and result.sha256 == hashlib.sha256(data).hexdigest()
    assert storage.get_bytes("chunks/parts.bin") == data
    if isinstance(storage, S3Storage):
        expected_parts = -(-len(data) // MULTIPART_CHUNK) if len(data) >= MULTIPART_THRESHOLD else 1
        assert result.etag == storage.stat("chunks/parts.bin").etag
        assert (result.etag.strip('"').endswith(f"-{expected_parts}")) == (expected_parts > 1)
    else:
        assert [p.name for p in storage.root.joinpath("chunks").iterdir()] == ["parts.bin"]


def test_parts_made_as_the_store_goes_are_stored_as_they_come(storage, monkeypatch):
    """A generator of parts with the size announced (a chunk whose rows are still being filled): its
    first bytes are stored (S3: sent as a part) before its last part is made, and the object is the
    parts' bytes with their sha256."""
    rng = np.random.default_rng(7)
    parts = [rng.integers(0, 256, size, dtype=np.uint8) for size in (MULTIPART_CHUNK + 5, MULTIPART_CHUNK - 3, 7)]
    data = b"".join(p.tobytes() for p in parts)
    first_stored = threading.Event()
    if isinstance(storage, S3Storage):
        upload_part = storage.client.upload_part

        def noting(**kwargs):
            response = upload_part(**kwargs)
            first_stored.set()
            return response

        monkeypatch.setattr(storage.client, "upload_part", noting)

    def made_as_they_go():
        yield parts[0].data
        yield parts[1].data
        if isinstance(storage, S3Storage):
            assert first_stored.wait(timeout=60), "no part was sent before the last one was made"
        else:
            assert [p for p in (storage.root / "chunks").iterdir() if p.stat().st_size >= len(parts[0])], "nothing written yet"
        yield parts[2].data

    result = storage.put_parts("chunks/made.bin", made_as_they_go(), len(data))
    assert result.size == len(data) and result.sha256 == hashlib.sha256(data).hexdigest()
    assert storage.get_bytes("chunks/made.bin") == data


def test_a_local_object_is_synced_to_the_disk_as_its_parts_come(tmp_path, monkeypatch):
    """The local store flushes a large object's data every SYNC_EVERY bytes while its parts still come,
    so its closing fsync waits for the last of them only (what the extraction's drain waited for was a
    whole 3 GB chunk left dirty in the page cache); the object is still the parts' bytes."""
    from dflash_jobs.storage import local

    monkeypatch.setattr(local, "SYNC_EVERY", 1 << 20)
    synced: list[int] = []  # the file's size at each data sync
    fdatasync = os.fdatasync

    def noting(fd: int) -> None:
        synced.append(os.fstat(fd).st_size)
        fdatasync(fd)

    monkeypatch.setattr(local.os, "fdatasync", noting)
    rng = np.random.default_rng(3)
    parts = [rng.integers(0, 256, size, dtype=np.uint8) for size in (700_000, 700_000, 1_500_000, 1_100_000, 7)]

    def made_as_they_go():
        for index, part in enumerate(parts):
            if index == len(parts) - 1:
                assert len(synced) == 3, "the first 4 MB were not synced before the last part came"
            yield part.data

    data = b"".join(p.tobytes() for p in parts)
    result = local.LocalStorage(tmp_path).put_parts("chunks/synced.bin", made_as_they_go(), len(data))
    assert synced == [1_400_000, 2_900_000, 4_000_000]  # after each part that took the unsynced bytes past a MiB
    assert result.sha256 == hashlib.sha256(data).hexdigest() and (tmp_path / "chunks/synced.bin").read_bytes() == data
    # A file put whole syncs so too: its 4 MB read as one block of HASH_BLOCK (8 MiB), synced once it is written.
    source = tmp_path / "checkpoint.bin"
    source.write_bytes(data)
    synced.clear()
    assert local.LocalStorage(tmp_path).put_file("train/checkpoint.bin", source).sha256 == result.sha256 and synced == [4_000_007]


@pytest.mark.parametrize("fault", ["raises", "short"])
def test_parts_that_fail_or_fall_short_of_their_size_store_nothing(storage, s3_bucket, fault):
    def failing():
        yield memoryview(bytes(MULTIPART_CHUNK + 1))
        if fault == "raises":
            raise ValueError("a row failed its integrity check")

    with pytest.raises(ValueError if fault == "raises" else StorageError, match="integrity" if fault == "raises" else "announced"):
        storage.put_parts("chunks/bad.bin", failing(), 2 * MULTIPART_CHUNK)
    assert not storage.exists("chunks/bad.bin")
    if isinstance(storage, S3Storage):
        assert storage.client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    else:
        assert list((storage.root / "chunks").iterdir()) == []


def test_a_failed_multipart_upload_is_aborted_and_stores_nothing(s3_bucket, monkeypatch):
    storage = open_storage(f"s3://{s3_bucket}/runs/abort")
    calls = {"n": 0}
    upload_part = storage.client.upload_part

    def fail_third(**kwargs):
        calls["n"] += 1
        if kwargs["PartNumber"] == 3:
            raise StorageError("part 3 failed", "retry")
        return upload_part(**kwargs)

    monkeypatch.setattr(storage.client, "upload_part", fail_third)
    with pytest.raises(StorageError, match="part 3 failed"):
        storage.put_parts("chunks/x.bin", [memoryview(bytes(MULTIPART_CHUNK * 3))])
    assert not storage.exists("chunks/x.bin")
    assert storage.client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


def test_parts_queued_behind_a_failed_part_are_not_sent(s3_bucket, monkeypatch):
    """Once one part fails the upload is aborted: sending the parts still queued would cost their
    whole transfer for nothing (a 3 GiB chunk is 48 parts, PART_THREADS at a time)."""
    storage = open_storage(f"s3://{s3_bucket}/runs/cancel")
    monkeypatch.setattr(storage_module, "PART_THREADS", 1)  # parts 2 and 3 wait in the queue behind part 1
    sent = []
    upload_part = storage.client.upload_part

    def fail_first(**kwargs):
        sent.append(kwargs["PartNumber"])
        if kwargs["PartNumber"] == 1:
            raise StorageError("part 1 failed", "retry")
        return upload_part(**kwargs)

    monkeypatch.setattr(storage.client, "upload_part", fail_first)
    part = memoryview(bytes(MULTIPART_CHUNK))
    with pytest.raises(StorageError, match="part 1 failed"):
        storage.put_parts("chunks/x.bin", [part, part, part])
    assert sent == [1]
    assert storage.client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


def test_streaming_read_gives_lines(storage):
    storage.put_bytes("data.jsonl", b"".join(f'{{"i": {i}}}\n'.encode() for i in range(1000)))
    with storage.open_read("data.jsonl") as f:
        lines = list(f)
    assert len(lines) == 1000 and lines[999] == b'{"i": 999}\n'


def test_local_writes_leave_no_partial_files(tmp_path):
    storage = open_storage(str(tmp_path))
    storage.put_bytes("x/y.bin", b"data")
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["y.bin"]


@pytest.mark.parametrize("key", ["../escape", "/abs", "a/../../b", "a//b", "a/./b", "", "a\\b"])
def test_keys_cannot_escape_the_root(tmp_path, key):
    with pytest.raises(StorageError):
        open_storage(str(tmp_path)).put_bytes(key, b"x")


def test_open_url_splits_object_urls(s3_bucket):
    storage, key = open_url(f"s3://{s3_bucket}/data/chats.jsonl")
    assert key == "chats.jsonl" and storage.url == f"s3://{s3_bucket}/data"


def test_missing_bucket_unreachable_endpoint_and_bad_credentials_say_what_to_fix(s3_bucket, monkeypatch):
    with pytest.raises(StorageError, match="bucket .* does not exist"):
        open_storage("s3://no-such-bucket-here/x").list("")
    with monkeypatch.context() as m:
        m.delenv("AWS_ENDPOINT_URL")
        unreachable = open_storage("s3://b/x", endpoint_url="http://127.0.0.1:9", max_attempts=1)
        with pytest.raises(StorageError, match="cannot reach the S3 endpoint"):
            unreachable.put_bytes("k", b"x")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(name, "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StorageError, match="no S3 credentials"):
        open_storage(f"s3://{s3_bucket}/x", max_attempts=1).put_bytes("k", b"x")
