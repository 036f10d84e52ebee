"""verify: every chunk against its done marker, on a local directory and on S3; the manifest only when clean."""

from __future__ import annotations

import json

import pytest
import torch
from extracted_chunks import CHUNKS, HIDDEN, LAYERS, extracted_run, hidden_chunk, mark_done, token_chunk

from dflash_jobs.errors import InputError
from dflash_jobs.formats import DATASET_KEY, MANIFEST_KEY, DatasetIndex, done_key, hidden_chunk_key, hidden_metadata, hidden_tensors
from dflash_jobs.spec import parse_spec
from dflash_jobs.storage import open_storage

from dflashctl.verify import Expected, VerificationFailed, read_manifest, verify_run

EXPECTED = Expected(dtype="bfloat16", layers=LAYERS)


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path, s3_server):
    """Both kinds, for the checks where they differ (etag on S3, sha256 recomputed locally). The S3
    server is a parameter, not looked up inside: a session fixture started in a test's own setup sets
    its environment after conftest's process-state guard has read it."""
    if request.param == "local":
        return open_storage(str(tmp_path / "run"))
    return open_storage(f"s3://{request.getfixturevalue('s3_bucket')}/runs/r1")


@pytest.fixture
def local(tmp_path):
    return open_storage(str(tmp_path / "run"))


def failure(storage, **kwargs) -> VerificationFailed:
    with pytest.raises(VerificationFailed) as caught:
        verify_run(storage, EXPECTED, **kwargs)
    assert not storage.exists(MANIFEST_KEY), "no manifest unless every chunk passes"
    return caught.value


def test_a_clean_run_gets_its_manifest(storage):
    markers = extracted_run(storage)
    seen = []
    manifest = verify_run(storage, EXPECTED, on_checked=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (CHUNKS, CHUNKS) and len(seen) == CHUNKS
    assert manifest.chunks == markers
    assert (manifest.model, manifest.layers, manifest.dtype, manifest.hidden_size) == ("tiny", LAYERS, "bfloat16", HIDDEN)
    assert manifest.tokens == sum(m.tokens for m in markers) and manifest.bytes == sum(m.bytes for m in markers)
    assert read_manifest(storage) == manifest


def test_a_truncated_chunk_is_caught(storage):
    extracted_run(storage)
    data = storage.get_bytes(hidden_chunk_key(2))
    storage.put_bytes(hidden_chunk_key(2), data[:-10])
    error = failure(storage)
    assert "chunk 000002" in str(error) and f"has {len(data) - 10} bytes, its marker says {len(data)}" in str(error)
    assert error.bad_markers == [done_key(2)] and "--delete-bad" in error.fix


def test_a_chunk_replaced_after_its_marker_is_caught(storage):
    """Same size, other content: the etag (S3) or the recomputed sha256 (local) gives it away."""
    extracted_run(storage)
    storage.put_bytes(hidden_chunk_key(1), hidden_chunk(1, seed=7))
    error = failure(storage)
    assert "chunk 000001" in str(error) and ("etag" in str(error) or "sha256" in str(error))
    assert error.bad_markers == [done_key(1)]


def test_a_chunk_without_marker_is_not_extracted_yet(local):
    extracted_run(local)
    local.delete(done_key(3))
    error = failure(local)
    assert "chunk 000003: not extracted yet" in str(error)
    assert error.bad_markers == [] and "dflashctl run" in error.fix


def test_a_marker_without_its_object_is_caught(local):
    extracted_run(local)
    local.delete(hidden_chunk_key(0))
    error = failure(local)
    assert f"marked done but {hidden_chunk_key(0)} does not exist" in str(error)


def test_a_mislabeled_header_is_caught(local):
    """The header says fp8 but the states are bf16, with a marker that matches the bytes."""
    from safetensors.torch import save

    extracted_run(local)
    tokens = token_chunk(2)
    hidden = torch.zeros(tokens.num_tokens, len(LAYERS), HIDDEN, dtype=torch.bfloat16)
    metadata = hidden_metadata(layers=LAYERS, model="tiny", config_hash="cfg1", dtype="float8_e4m3fn")
    mark_done(local, 2, save(hidden_tensors(tokens, hidden, None), metadata=metadata), dtype="float8_e4m3fn")
    error = failure(local)
    assert "chunk 000002" in str(error) and "labeled float8_e4m3fn but its hidden_states are BF16" in str(error)


def test_chunks_of_another_target_or_other_layers_are_caught(tmp_path):
    storage = open_storage(str(tmp_path / "run"))
    extracted_run(storage)
    mark_done(storage, 3, hidden_chunk(3, config_hash="cfg2"))
    error = failure(storage)
    assert "chunk 000003: extracted from another target" in str(error) and "config cfg2" in str(error)
    mark_done(storage, 3, hidden_chunk(3))
    with pytest.raises(VerificationFailed, match=r"the spec asks for target.layers \[1, 2\]"):
        verify_run(storage, Expected(dtype="bfloat16", layers=[1, 2]))
    assert verify_run(storage, Expected(dtype="bfloat16", layers=None)).layers == LAYERS


def test_the_manifest_records_the_final_hidden_state_when_every_chunk_holds_it(storage):
    markers = extracted_run(storage, final_hidden=True)
    for expected in (EXPECTED, Expected(dtype="bfloat16", layers=LAYERS, final_hidden=True)):
        manifest = verify_run(storage, expected)
        assert manifest.final_hidden == "bfloat16" and manifest.chunks == markers
        assert read_manifest(storage).final_hidden == "bfloat16"


def test_a_spec_that_stores_the_final_hidden_state_fails_every_chunk_without_it(local):
    extracted_run(local)
    assert verify_run(local, EXPECTED).final_hidden is None  # a spec that does not store it passes them
    with pytest.raises(VerificationFailed) as caught:
        verify_run(local, Expected(dtype="bfloat16", layers=LAYERS, final_hidden=True), delete_bad=True)
    error = caught.value
    assert not local.exists(MANIFEST_KEY)
    for chunk in range(CHUNKS):
        assert f"chunk {chunk:06d}: {hidden_chunk_key(chunk)} holds no final hidden state of the target, the spec stores it" in str(error)
    assert error.bad_markers == [done_key(c) for c in range(CHUNKS)] and not any(local.exists(done_key(c)) for c in range(CHUNKS))


def test_a_store_where_only_some_chunks_hold_it_passes_without_recording_it(local):
    extracted_run(local, final_hidden=True)
    mark_done(local, 2, hidden_chunk(2))  # extracted again by a run that did not store it
    assert verify_run(local, EXPECTED).final_hidden is None
    with pytest.raises(VerificationFailed, match="chunk 000002: .* holds no final hidden state"):
        verify_run(local, Expected(dtype="bfloat16", layers=LAYERS, final_hidden=True))


def test_a_final_hidden_state_that_disagrees_with_its_marker_or_the_spec_is_caught(local):
    extracted_run(local, final_hidden=True)
    mark_done(local, 1, hidden_chunk(1))  # a chunk without it, under a marker...
    marker = local.get_bytes(done_key(1)).replace(b'"final_hidden": null', b'"final_hidden": "bfloat16"')
    local.put_bytes(done_key(1), marker)  # ...that says it holds it
    tokens = token_chunk(3)
    tensors = hidden_tensors(tokens, torch.zeros(tokens.num_tokens, len(LAYERS), HIDDEN, dtype=torch.bfloat16), None,
                             torch.zeros(tokens.num_tokens, HIDDEN).to(torch.float8_e4m3fn), torch.ones(tokens.num_tokens))
    from safetensors.torch import save

    metadata = hidden_metadata(layers=LAYERS, model="tiny", config_hash="cfg1", dtype="bfloat16", final_hidden="float8_e4m3fn")
    mark_done(local, 3, save(tensors, metadata=metadata), final_hidden="float8_e4m3fn")
    error = failure(local)
    assert f"chunk 000001: {hidden_chunk_key(1)} holds final_hidden None, its marker says bfloat16" in str(error)
    assert f"chunk 000003: {hidden_chunk_key(3)} holds its final hidden state in float8_e4m3fn, the spec asks for extract.dtype bfloat16" in str(error)


@pytest.mark.parametrize("extract, train, stored", [
    ({}, {}, False),
    ({}, {"drafter": "dspark"}, True),
    ({}, {"drafter": "dspark", "dspark": {"ce_only": True}}, False),
    ({"final_hidden": False}, {"drafter": "dspark"}, False),  # then training refuses a store without it
    ({"final_hidden": True}, {"drafter": "dflash2"}, True),
])
def test_the_spec_decides_whether_every_chunk_must_hold_it(tmp_path, extract, train, stored):
    spec = parse_spec({"name": "v", "target": {"model": "/m", "layers": LAYERS}, "data": {"source": "/d"},
                       "output": str(tmp_path), "backend": "local", "extract": extract, "train": train})
    assert Expected.of(spec) == Expected(dtype="bfloat16", layers=LAYERS, final_hidden=stored)

    storage = open_storage(str(tmp_path / "run"))
    extracted_run(storage, chunks=3)
    index = DatasetIndex.from_json(storage.get_bytes(DATASET_KEY))
    index.chunks[1].tokens += 1
    index.tokens += 1
    storage.put_bytes(DATASET_KEY, index.to_json().encode())
    storage.put_bytes(done_key(9), storage.get_bytes(done_key(0)))  # a marker of a chunk the dataset lacks
    error = failure(storage)
    assert "chunk 000001: its marker says 2 samples / 13 tokens, tokens/dataset.json 2 / 14" in str(error)
    assert "chunk 000009: has a done marker but tokens/dataset.json has no such chunk" in str(error)


def test_deep_recomputes_the_sha256_even_where_the_etag_matches(s3_bucket):
    storage = open_storage(f"s3://{s3_bucket}/deep")
    extracted_run(storage)
    marker = json.loads(storage.get_bytes(done_key(0)))
    marker["sha256"] = "0" * 64
    storage.put_bytes(done_key(0), json.dumps(marker).encode())
    assert verify_run(storage, EXPECTED).chunks[0].sha256 == "0" * 64  # size and etag agree: passes
    error = failure(storage, deep=True)
    assert "chunk 000000" in str(error) and "sha256" in str(error)


def test_failure_removes_a_stale_manifest_and_delete_bad_removes_only_lying_markers(tmp_path):
    storage = open_storage(str(tmp_path / "run"))
    extracted_run(storage)
    verify_run(storage, EXPECTED)
    storage.put_bytes(hidden_chunk_key(1), b"garbage")
    storage.delete(done_key(2))
    error = failure(storage, delete_bad=True)
    assert not storage.exists(done_key(1)) and storage.exists(done_key(0)) and storage.exists(done_key(3))
    assert "Deleted the 1 marker(s)" in error.fix and "1 chunk(s) are not extracted yet" in error.fix


def test_no_dataset_index_says_to_prepare(tmp_path):
    with pytest.raises(InputError, match="dflashctl prepare"):  # verify asked for before prepare: bad usage, exit 2
        verify_run(open_storage(str(tmp_path / "empty")), EXPECTED)


def test_the_verify_command_writes_the_manifest_and_fails_with_exit_code_1(tmp_path):
    import yaml
    from typer.testing import CliRunner

    from dflashctl.cli.app import app
    from dflashctl.errors import exit_code

    spec_file = tmp_path / "dflash.yaml"
    spec_file.write_text(yaml.safe_dump({
        "name": "v", "backend": "local", "output": str(tmp_path / "run"),
        "target": {"model": str(tmp_path / "model"), "layers": LAYERS},
        "data": {"source": str(tmp_path / "chats.jsonl"), "max_length": 64, "chunk_tokens": 256},
    }))
    storage = open_storage(str(tmp_path / "run"))
    extracted_run(storage)
    result = CliRunner().invoke(app, ["verify", "-f", str(spec_file), "-o", "json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["chunks"] == CHUNKS and summary["layers"] == LAYERS and storage.exists(MANIFEST_KEY)

    storage.delete(hidden_chunk_key(1))
    result = CliRunner().invoke(app, ["verify", "-f", str(spec_file), "--delete-bad"])
    assert isinstance(result.exception, VerificationFailed) and exit_code(result.exception) == 1
    assert not storage.exists(MANIFEST_KEY) and not storage.exists(done_key(1))
