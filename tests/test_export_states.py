"""`dflashctl export-states --format speculators`: a verified run's chunks as speculators' offline
files, checked the way speculators reads them (its FileTransfer and ArrowDataset: hs_<i>.safetensors,
token_ids, hidden_states [T, L, d] with the target's last layer last), from a directory and from S3,
bf16 and fp8, resumable, streaming, and without torch in the control plane."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from cli_runner import cli as dflashctl

from dflash_jobs.errors import InputError
from dflash_jobs.formats import (
    MANIFEST_KEY, DoneMarker, Manifest, TokenChunk, dequantize_fp8, done_key, encode_hidden_chunk, hidden_chunk_key, quantize_fp8,
)
from dflash_jobs.speculators import FP8_VALUES, SAMPLES_KEY, SUMMARY_KEY, bfloat16_bits, export_speculators
from dflash_jobs.storage import open_storage

DEPTH = 8  # decoder layers of the (pretend) target
LAYERS = [1, 4, DEPTH - 1]  # the last decoder layer captured, as speculators needs
HIDDEN = 16


def make_chunk(rng: np.random.Generator, first_sample: int, lengths: list[int]) -> tuple[TokenChunk, torch.Tensor]:
    ids = rng.integers(0, 1000, sum(lengths)).astype(np.int32)
    tokens = TokenChunk(
        input_ids=ids, loss_mask=(rng.random(len(ids)) < 0.6).astype(np.uint8),
        cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        sample_ids=np.arange(first_sample, first_sample + len(lengths), dtype=np.int64) * 3,  # gaps, like dropped rows
    ).validate("test")
    hidden = torch.from_numpy(rng.standard_normal((len(ids), len(LAYERS), HIDDEN)).astype(np.float32) * 4).to(torch.bfloat16)
    return tokens, hidden


def write_run(
    output: str, *, dtype: str = "bfloat16", layers: list[int] = LAYERS, seed: int = 0, final_hidden: bool = False,
) -> list[tuple[TokenChunk, torch.Tensor]]:
    """What extraction and verify leave: chunks, done markers, the manifest (a directory or s3://).
    With `final_hidden` every chunk also holds the target's final hidden state, returned as the
    last layer of its states ([T, L + 1, d])."""
    storage = open_storage(output)
    rng = np.random.default_rng(seed)
    chunks, markers, first = [], [], 0
    final_dtype = dtype if final_hidden else None
    for chunk, lengths in enumerate([[5, 9, 3], [7, 2, 11, 4]]):
        tokens, hidden = make_chunk(rng, first, lengths)
        first += len(lengths)
        final = torch.from_numpy(rng.standard_normal((tokens.num_tokens, HIDDEN)).astype(np.float32) * 8).to(torch.bfloat16) if final_hidden else None
        data = encode_hidden_chunk(tokens, hidden, layers=layers, model="tiny", config_hash="h", dtype=dtype, final_hidden=final)
        put = storage.put_bytes(hidden_chunk_key(chunk), data)
        marker = DoneMarker(
            chunk=chunk, samples=tokens.num_samples, tokens=tokens.num_tokens, bytes=put.size,
            sha256=hashlib.sha256(data).hexdigest(), etag=put.etag, dtype=dtype, layers=layers, hidden_size=HIDDEN, final_hidden=final_dtype,
        )
        storage.put_bytes(done_key(chunk), marker.to_json().encode())
        markers.append(marker)
        chunks.append((tokens, hidden if final is None else torch.cat([hidden, final[:, None]], dim=1)))
    manifest = Manifest(
        model="tiny", layers=layers, dtype=dtype, hidden_size=HIDDEN, samples=sum(m.samples for m in markers),
        tokens=sum(m.tokens for m in markers), bytes=sum(m.bytes for m in markers), chunks=markers, final_hidden=final_dtype,
    )
    storage.put_bytes(MANIFEST_KEY, manifest.to_json().encode())
    return chunks


def write_spec(tmp_path: Path, output: str, *, depth: int | None = DEPTH, layers: list[int] = LAYERS) -> Path:
    target = tmp_path / "target"
    target.mkdir(exist_ok=True)
    if depth is not None:
        (target / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": {"num_hidden_layers": depth}}))
    spec = {"name": "states", "backend": "local", "target": {"model": str(target), "layers": layers}, "data": {"source": "/d.jsonl"}, "output": output}
    path = tmp_path / "dflash.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def expected_samples(chunks, dtype: str):
    """(token_ids, loss_mask, states as bf16 [T, L, d]) per sample, in export order."""
    for tokens, hidden in chunks:
        states = hidden
        if dtype == "float8_e4m3fn":  # as stored (quantized: a scale per token and layer, or per token), then dequantized the torch way
            states = dequantize_fp8(*quantize_fp8(hidden))
        for i in range(tokens.num_samples):
            begin, end = tokens.cu_seqlens[i], tokens.cu_seqlens[i + 1]
            yield tokens.input_ids[begin:end].astype(np.int64), tokens.loss_mask[begin:end], states[begin:end]


def read_as_speculators(directory: Path, index: int, input_ids: np.ndarray) -> dict[str, torch.Tensor]:
    """What speculators does with hs_<index>.safetensors: load_file, check_hidden_states, ArrowDataset's split."""
    loaded = load_file(directory / f"hs_{index}.safetensors")
    assert {"token_ids", "hidden_states"} <= loaded.keys()
    assert loaded["token_ids"].tolist() == input_ids.tolist()  # check_hidden_states / ArrowDataset's torch.equal
    assert loaded["hidden_states"].shape[0] == len(input_ids) and torch.isfinite(loaded["hidden_states"].float()).all()
    return {
        "hidden_states": loaded["hidden_states"][:, :-1].flatten(1),  # the drafter's inputs
        "verifier_last_hidden_states": loaded["hidden_states"][:, -1],  # the target's final layer
        "raw": loaded["hidden_states"], "loss_mask": loaded["loss_mask"],
    }


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_local_run_exports_as_speculators_reads_it(tmp_path, monkeypatch, capsys, dtype):
    output = str(tmp_path / "run")
    chunks = write_run(output, dtype=dtype)
    spec_file = write_spec(tmp_path, output)

    code, out, err = dflashctl(monkeypatch, capsys, "export-states", "--format", "speculators", "-f", str(spec_file), "-o", "json")

    assert code == 0, err
    summary = json.loads(out)
    destination = tmp_path / "run/export/speculators/hidden_states"
    assert summary["destination"] == str(destination) and summary["samples"] == summary["files"] == 7 and summary["kept"] == 0
    assert summary["aux_hidden_state_layer_ids"] == [2, 5] and summary["last_layer"] == DEPTH  # --target-layer-ids 2 5, 8 appended
    assert "--target-layer-ids 2 5" in err
    # speculators finds files hs_<i> for i = 0..N-1 (its get_existing_hidden_state_indices parses the stem).
    names = sorted(p.name for p in destination.iterdir() if p.name.startswith("hs_"))
    assert sorted(int(Path(name).stem[3:]) for name in names) == list(range(7))
    for index, (input_ids, loss_mask, states) in enumerate(expected_samples(chunks, dtype)):
        read = read_as_speculators(destination, index, input_ids)
        assert read["raw"].dtype == torch.bfloat16 and torch.equal(read["raw"], states)  # fp8: bit-equal to torch's dequantization
        assert torch.equal(read["hidden_states"], states[:, :-1].flatten(1))
        assert torch.equal(read["verifier_last_hidden_states"], states[:, -1])  # our layer 7 = their aux id 8, the last
        assert read["loss_mask"].tolist() == loss_mask.tolist()
    lines = [json.loads(line) for line in (destination / SAMPLES_KEY).read_text().splitlines()]
    assert [(s["index"], s["sample_id"], s["chunk"], s["tokens"]) for s in lines][:4] == [(0, 0, 0, 5), (1, 3, 0, 9), (2, 6, 0, 3), (3, 9, 1, 7)]
    record = json.loads((destination / SUMMARY_KEY).read_text())
    assert record["format"] == "speculators" and record["layers"] == LAYERS and record["run_dtype"] == dtype


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_the_stored_final_hidden_state_goes_last_as_speculators_verifier_last_hidden_states(tmp_path, monkeypatch, capsys, dtype):
    """The layers need not include the target's last one: the stored final hidden state (its output,
    before the final norm, like vLLM's aux state num_hidden_layers) is appended after all of them,
    row t beside token t, and every captured layer is a drafter input."""
    output = str(tmp_path / "run")
    layers = [1, 4, 6]  # not the last decoder layer (7)
    chunks = write_run(output, dtype=dtype, layers=layers, final_hidden=True)
    spec_file = write_spec(tmp_path, output, layers=layers)

    code, out, err = dflashctl(monkeypatch, capsys, "export-states", "--format", "speculators", "-f", str(spec_file), "-o", "json")

    assert code == 0, err
    summary = json.loads(out)
    assert summary["final_hidden"] is True and summary["samples"] == summary["files"] == 7
    assert summary["aux_hidden_state_layer_ids"] == [2, 5, 7] and summary["last_layer"] == DEPTH  # all three layers feed the drafter
    assert "--target-layer-ids 2 5 7" in err
    destination = tmp_path / "run/export/speculators/hidden_states"
    for index, (input_ids, _, states) in enumerate(expected_samples(chunks, dtype)):
        read = read_as_speculators(destination, index, input_ids)
        assert read["raw"].shape == (len(input_ids), len(layers) + 1, HIDDEN)
        assert torch.equal(read["verifier_last_hidden_states"], states[:, -1])  # the stored final hidden state, bit for bit
        assert torch.equal(read["hidden_states"], states[:, :-1].flatten(1))  # the captured layers
    metadata = json.loads(load_metadata(destination / "hs_0.safetensors")["aux_hidden_state_layer_ids"])
    assert metadata == [2, 5, 7, DEPTH]


def load_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata()


def test_numpy_fp8_and_bf16_conversions_equal_torch_bit_for_bit():
    patterns = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    nan = np.isnan(patterns)
    assert np.array_equal(np.isnan(FP8_VALUES), nan) and np.array_equal(FP8_VALUES[~nan], patterns[~nan])
    values = np.concatenate([
        np.random.default_rng(0).standard_normal(100_000).astype(np.float32) * 1e3,
        np.array([0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.3895e38, -np.inf, np.inf], dtype=np.float32),  # ties, the top of bf16
    ])
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bfloat16_bits(values), expected)


def test_s3_to_s3_through_the_cli_and_a_rerun_keeps_what_is_complete(tmp_path, monkeypatch, capsys, s3_bucket, s3_server):
    import boto3

    output = f"s3://{s3_bucket}/runs/states"
    chunks = write_run(output, dtype="float8_e4m3fn")
    spec_file = write_spec(tmp_path, output)
    to = f"s3://{s3_bucket}/speculators/hidden_states"

    code, out, err = dflashctl(monkeypatch, capsys, "export-states", "--format", "speculators", "-f", str(spec_file), "--to", to)
    assert code == 0, err
    assert "7 (7 written, 0 already there)" in out and "--target-layer-ids 2 5, last layer 8 appended" in out

    s3 = boto3.client("s3", endpoint_url=s3_server)
    local = tmp_path / "downloaded"
    local.mkdir()
    for item in s3.list_objects_v2(Bucket=s3_bucket, Prefix="speculators/hidden_states/")["Contents"]:
        s3.download_file(s3_bucket, item["Key"], str(local / item["Key"].rsplit("/", 1)[-1]))
    for index, (input_ids, _, states) in enumerate(expected_samples(chunks, "float8_e4m3fn")):
        assert torch.equal(read_as_speculators(local, index, input_ids)["raw"], states)

    # One file lost, one truncated: a rerun rewrites those two and keeps the others.
    s3.delete_object(Bucket=s3_bucket, Key="speculators/hidden_states/hs_2.safetensors")
    s3.put_object(Bucket=s3_bucket, Key="speculators/hidden_states/hs_5.safetensors", Body=(local / "hs_5.safetensors").read_bytes()[:-10])
    code, out, err = dflashctl(monkeypatch, capsys, "export-states", "--format", "speculators", "-f", str(spec_file), "--to", to, "-o", "json")
    assert code == 0, err
    assert (json.loads(out)["files"], json.loads(out)["kept"]) == (2, 5)
    again = s3.get_object(Bucket=s3_bucket, Key="speculators/hidden_states/hs_5.safetensors")["Body"].read()
    assert again == (local / "hs_5.safetensors").read_bytes()


def test_it_streams_a_sample_at_a_time(tmp_path):
    """No read is larger than the largest sample's states: a 3 GiB chunk is never held whole."""
    output = str(tmp_path / "run")
    chunks = write_run(output)
    source = open_storage(output)
    reads = []
    original = source.get_bytes

    def recording(key, start=None, end=None):
        data = original(key, start, end)
        reads.append((key, len(data)))
        return data

    source.get_bytes = recording
    export_speculators(source, open_storage(str(tmp_path / "out")), depth=DEPTH, workers=2)
    largest_sample = max(int(np.diff(tokens.cu_seqlens).max()) for tokens, _ in chunks) * len(LAYERS) * HIDDEN * 2
    chunk_reads = [size for key, size in reads if key.startswith("extract/chunks/")]
    assert max(chunk_reads) == largest_sample
    assert sum(chunk_reads) < sum(len(open_storage(output).get_bytes(hidden_chunk_key(c))) for c in range(2)) * 1.5


def test_a_run_without_the_targets_last_layer_is_refused_naming_the_fix(tmp_path, monkeypatch, capsys):
    output = str(tmp_path / "run")
    write_run(output, layers=[1, 4, 6])
    spec_file = write_spec(tmp_path, output)
    code, _, err = dflashctl(monkeypatch, capsys, "export-states", "--format", "speculators", "-f", str(spec_file))
    assert code == 2
    assert "the run captured layers [1, 4, 6] of a 8-layer target, not its last decoder layer 7, and stored no final hidden state" in err
    assert "extract.final_hidden: true" in err and "target.layers [1, 4, 6, 7]" in err
    assert not (tmp_path / "run/export").exists()


def test_unverified_runs_and_an_unreadable_target_are_refused(tmp_path, monkeypatch, capsys):
    output = str(tmp_path / "run")
    write_run(output)
    spec_file = write_spec(tmp_path, output, depth=None)  # target.model holds no config.json
    code, _, err = dflashctl(monkeypatch, capsys, "export-states", "--format", "speculators", "-f", str(spec_file))
    assert code == 2 and "cannot read the target's depth from" in err and "--target-depth N" in err
    code, _, err = dflashctl(monkeypatch, capsys, "export-states", "--format", "speculators", "-f", str(spec_file), "--target-depth", str(DEPTH))
    assert code == 0, err

    (tmp_path / "run" / MANIFEST_KEY).unlink()
    with pytest.raises(InputError, match="Run `dflashctl verify` first"):
        export_speculators(open_storage(output), open_storage(str(tmp_path / "out")), depth=DEPTH)


@pytest.mark.parametrize("final_hidden", [False, True])
def test_the_export_runs_in_a_process_where_torch_cannot_be_imported(tmp_path, final_hidden):
    output = str(tmp_path / "run")
    write_run(output, dtype="float8_e4m3fn", final_hidden=final_hidden)
    spec_file = write_spec(tmp_path, output)
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "from dflashctl.cli.main import main\n"
        f"sys.argv = ['dflashctl', 'export-states', '--format', 'speculators', '-f', {str(spec_file)!r}]\n"
        "main()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert len(list((tmp_path / "run/export/speculators/hidden_states").glob("hs_*.safetensors"))) == 7
