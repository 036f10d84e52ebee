"""The controller refuses, before submitting the training Job, a drafter that reads the target's
final hidden state (DSpark) on verified states extracted without it: a spec changed to DSpark on a
run extracted for DFlash finds extraction and verification done, and would otherwise fail minutes
later in the training pod."""

from __future__ import annotations

import pytest
from extracted_chunks import CHUNKS, extracted_run

from dflash_jobs.errors import InputError
from dflash_jobs.formats import MANIFEST_KEY
from dflash_jobs.spec import parse_spec
from dflash_jobs.storage import open_storage

from dflashctl.errors import EXIT_USAGE, exit_code
from dflashctl.pipeline import run_pipeline
from dflashctl.verify import Expected, verify_run
from test_pipeline import LAYERS, SHARDS, backend_for, make_job, pipeline_work


def spec_for(tmp_path, **train):
    return parse_spec({
        "name": "pipe", "backend": "local", "target": {"model": str(tmp_path / "model"), "layers": LAYERS},
        "data": {"source": str(tmp_path / "chats.jsonl"), "max_length": 64, "chunk_tokens": 256},
        "output": str(tmp_path / "out"), "extract": {"shards": 2}, "local": {"workdir": str(tmp_path / "work")}, "train": train,
    })


def verified_for_dflash(spec) -> None:
    """Prepared, extracted and verified under a spec that did not store the final hidden state."""
    storage = open_storage(spec.output)
    extracted_run(storage)
    assert verify_run(storage, Expected(dtype="bfloat16", layers=LAYERS)).final_hidden is None


def test_training_a_dspark_drafter_on_states_without_it_is_refused_before_its_job(tmp_path):
    spec = spec_for(tmp_path, drafter="dspark")
    verified_for_dflash(spec)
    storage = open_storage(spec.output)
    work = pipeline_work(storage)
    backend = backend_for(work)
    with pytest.raises(InputError) as refused:
        run_pipeline(spec, backend, storage=storage, refresh_s=0.01)
    assert exit_code(refused.value) == EXIT_USAGE
    assert f"{storage.url}/{MANIFEST_KEY}: the hidden states hold no final hidden state of the target" in refused.value.what
    assert "extract.final_hidden: true" in refused.value.fix and "train.dspark.ce_only: true" in refused.value.fix
    assert work["manifest_at_train"] == [] and ("submit", "pipe-train") not in backend.calls


def test_cross_entropy_only_trains_on_them(tmp_path):
    spec = spec_for(tmp_path, drafter="dspark", dspark={"ce_only": True})
    verified_for_dflash(spec)
    storage = open_storage(spec.output)
    work = pipeline_work(storage)
    result = run_pipeline(spec, backend_for(work), storage=storage, refresh_s=0.01)
    assert result.ran == ["train", "eval"] and work["manifest_at_train"] == [True]


def test_a_dspark_run_extracts_it_verifies_it_and_trains(tmp_path):
    spec = spec_for(tmp_path, drafter="dspark")
    storage = open_storage(spec.output)
    work = pipeline_work(storage)

    def extract(attempt):  # what the pods of a DSpark spec write: every chunk with the final hidden state
        extracted_run(storage, final_hidden=True)
        return make_job("pipe-extract", completions=SHARDS)

    work["extract"] = extract
    result = run_pipeline(spec, backend_for(work), storage=storage, refresh_s=0.01)
    assert result.manifest.final_hidden == "bfloat16" and len(result.manifest.chunks) == CHUNKS
    assert work["manifest_at_train"] == [True]
