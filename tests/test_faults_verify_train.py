"""Damaged chunks in storage: a flipped byte (same size), a truncated object, and on S3 an object
replaced after its marker. `dflashctl verify` must fail with exit code 1 naming the chunk and the
fix, remove a manifest that no longer holds, and training must then refuse to start.

(Training killed mid-epoch and resumed to the weights of an uninterrupted run: tests/test_train.py,
`test_killed_and_restarted_it_ends_with_the_weights_of_an_uninterrupted_run`.)"""

from __future__ import annotations

import logging

import pytest
import yaml
from extracted_chunks import LAYERS, extracted_run

from dflash_jobs.errors import EXIT_BAD_INPUT
from dflash_jobs.formats import MANIFEST_KEY, hidden_chunk_key
from dflash_jobs.storage import open_storage
from dflash_jobs.train.__main__ import main as train_main

from cli_runner import cli


def write_spec(path, output: str):
    path.write_text(yaml.safe_dump({
        "name": "damaged", "backend": "local", "target": {"model": str(path.parent / "no-target"), "layers": LAYERS},
        "data": {"source": f"{output}/chats.jsonl", "max_length": 64, "chunk_tokens": 1024}, "output": output,
    }))
    return path


def flip_a_byte(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1:]


DAMAGE = {
    "flipped": (flip_a_byte, "sha256"),
    "truncated": (lambda data: data[: len(data) - 100], "truncated"),
}


def check_damage_is_caught(spec, storage, chunk: int, damage, expected: str, monkeypatch, capsys, caplog):
    code, out, _ = cli(monkeypatch, capsys, "verify", "-f", str(spec))
    assert code == 0 and storage.exists(MANIFEST_KEY)

    key = hidden_chunk_key(chunk)
    storage.put_bytes(key, damage(storage.get_bytes(key)))
    code, _, err = cli(monkeypatch, capsys, "verify", "-f", str(spec))
    assert code == 1
    assert f"chunk {chunk:06d}" in err and expected in err  # names the chunk and what is wrong
    assert "dflashctl verify --delete-bad" in err  # and the fix
    assert not storage.exists(MANIFEST_KEY)  # the stale manifest went with it

    caplog.clear()
    with caplog.at_level(logging.ERROR):
        assert train_main(["-f", str(spec)]) == EXIT_BAD_INPUT
    assert "extract/manifest.json does not exist" in caplog.text and "dflashctl verify" in caplog.text
    assert not storage.list("train/")


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_damaged_local_chunk_fails_verify_and_training_refuses(how, tmp_path, monkeypatch, capsys, caplog):
    output = str(tmp_path / "run")
    storage = open_storage(output)
    extracted_run(storage)
    damage, expected = DAMAGE[how]
    check_damage_is_caught(write_spec(tmp_path / "dflash.yaml", output), storage, 2, damage, expected, monkeypatch, capsys, caplog)


def test_a_chunk_replaced_on_s3_after_its_marker_fails_verify(s3_bucket, tmp_path, monkeypatch, capsys, caplog):
    output = f"s3://{s3_bucket}/run"
    storage = open_storage(output)
    extracted_run(storage)
    # Same size, other bytes: S3's etag changes, which verify compares without reading the object.
    check_damage_is_caught(write_spec(tmp_path / "dflash.yaml", output), storage, 1, flip_a_byte, "etag", monkeypatch, capsys, caplog)
