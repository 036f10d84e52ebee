"""Formats: round trips, and readers that reject truncated, mislabeled or inconsistent files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dflash_jobs.errors import FormatError, InputError
from dflash_jobs.formats import (
    HEADER_PROBE, DatasetIndex, ChunkInfo, DoneMarker, HiddenChunk, Manifest, TokenChunk, check_final_hidden, chunk_of_key,
    done_key, encode_hidden_chunk, fetch_header_bytes, file_range, header_size, hidden_metadata, hidden_tensors, hidden_chunk_key,
    object_range, quantize_fp8, read_header, safetensors_names, safetensors_parts, token_chunk_key,
)
from dflash_jobs.spec import parse_spec
from dflash_jobs.storage import open_storage


def make_tokens(lengths=(5, 3, 7), seed=0) -> TokenChunk:
    rng = np.random.default_rng(seed)
    total = sum(lengths)
    return TokenChunk(
        input_ids=rng.integers(0, 1000, total).astype(np.int32),
        loss_mask=(rng.random(total) > 0.3).astype(np.uint8),
        cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        sample_ids=np.arange(len(lengths), dtype=np.int64) * 3,
    )


def test_keys_are_zero_padded_and_parse_back():
    assert token_chunk_key(7) == "tokens/chunks/000007.safetensors"
    assert hidden_chunk_key(7) == "extract/chunks/000007.safetensors"
    assert done_key(123456) == "extract/done/123456.json"
    assert chunk_of_key(done_key(42)) == 42


def test_token_chunk_round_trip():
    chunk = make_tokens()
    back = TokenChunk.decode(chunk.encode(), "c")
    for key, value in chunk.tensors().items():
        np.testing.assert_array_equal(getattr(back, key), value)
    assert back.num_samples == 3 and back.num_tokens == 15
    ids, mask = back.sample(1)
    np.testing.assert_array_equal(ids, chunk.input_ids[5:8])


@pytest.mark.parametrize("cut", [4, 40, -1])
def test_truncated_token_chunk_is_rejected(cut):
    data = make_tokens().encode()
    with pytest.raises(FormatError, match="truncated"):
        TokenChunk.decode(data[:cut], "tokens/chunks/000000.safetensors")


def test_inconsistent_token_chunk_is_rejected():
    chunk = make_tokens()
    chunk.cu_seqlens = chunk.cu_seqlens.copy()
    chunk.cu_seqlens[-1] -= 1
    with pytest.raises(FormatError, match="cu_seqlens"):
        TokenChunk.decode(chunk.encode(), "x")
    empty = make_tokens()
    empty.cu_seqlens = np.array([0, 5, 5, 15], dtype=np.int64)
    with pytest.raises(FormatError, match="empty sample"):
        empty.validate("x")


def test_hidden_chunk_is_not_a_token_chunk():
    data = encode_hidden_chunk(make_tokens(), torch.randn(15, 2, 8), layers=[1, 3], model="m", config_hash="h")
    with pytest.raises(FormatError, match="not a token chunk"):
        TokenChunk.decode(data, "x")


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_hidden_chunk_round_trip(dtype):
    tokens = make_tokens()
    hidden = (torch.randn(15, 2, 64) * torch.logspace(-2, 2, 15)[:, None, None]).to(torch.bfloat16)
    hidden[3] = 0  # an all-zero token must survive quantization (no division by zero)
    data = encode_hidden_chunk(tokens, hidden, layers=[1, 3], model="tiny", config_hash="abc", dtype=dtype)
    chunk = HiddenChunk.decode(data, "x")
    assert chunk.layers == [1, 3] and chunk.model == "tiny" and chunk.dtype == dtype
    restored = chunk.dequantized().float()
    if dtype == "bfloat16":
        assert torch.equal(restored, hidden.float())
    else:
        # e4m3 keeps 3 mantissa bits: relative error per element <= 2^-4, scaled per token and layer.
        error = (restored - hidden.float()).abs()
        bound = hidden.float().abs().amax(-1, keepdim=True) / 448 * 8 + hidden.float().abs() / 16
        assert torch.all(error <= bound + 1e-12)
        assert torch.all(restored[3] == 0)
    header, total = read_header(data[: header_size(data[:8])], "x")
    assert total == len(data) and header["__metadata__"]["dtype"] == dtype


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_the_final_hidden_state_rides_in_the_chunk_in_its_dtype_and_older_chunks_read_without_it(dtype):
    tokens = make_tokens()
    hidden = torch.randn(15, 2, 64).to(torch.bfloat16)
    final = (torch.randn(15, 64) * torch.logspace(-2, 2, 15)[:, None]).to(torch.bfloat16)
    data = encode_hidden_chunk(tokens, hidden, layers=[1, 3], model="tiny", config_hash="abc", dtype=dtype, final_hidden=final)
    header, _ = read_header(data[: header_size(data[:8])], "x")
    assert header["__metadata__"]["final_hidden"] == dtype
    assert header["final_hidden_states"]["shape"] == [15, 64]
    assert ("final_hidden_states_scale" in header) == (dtype == "float8_e4m3fn")
    chunk = HiddenChunk.decode(data, "x")
    assert chunk.final_hidden == dtype and chunk.final_hidden_states.shape == (15, 64)
    if dtype == "bfloat16":
        assert torch.equal(chunk.dequantized_final(), final)
    else:  # one scale per token, as the layers' per token and layer
        assert chunk.final_scale.shape == (15,) and chunk.final_hidden_states.dtype == torch.float8_e4m3fn
        q, scale = quantize_fp8(final)
        assert torch.equal(chunk.final_scale, scale) and torch.equal(chunk.final_hidden_states.view(torch.uint8), q.view(torch.uint8))
        assert torch.allclose(chunk.dequantized_final().float(), final.float(), rtol=2**-3, atol=0)
    assert torch.equal(chunk.dequantized().float(), HiddenChunk.decode(
        encode_hidden_chunk(tokens, hidden, layers=[1, 3], model="tiny", config_hash="abc", dtype=dtype), "y").dequantized().float())

    older = HiddenChunk.decode(encode_hidden_chunk(tokens, hidden, layers=[1, 3], model="tiny", config_hash="abc", dtype=dtype), "old")
    assert older.final_hidden is None and older.final_hidden_states is None and older.dequantized_final() is None


def test_a_final_hidden_state_that_disagrees_with_its_chunk_is_rejected():
    from safetensors.torch import save

    tokens, hidden = make_tokens(), torch.randn(15, 2, 8, dtype=torch.bfloat16)
    metadata = hidden_metadata(layers=[1, 3], model="m", config_hash="h", dtype="bfloat16")
    labeled = hidden_metadata(layers=[1, 3], model="m", config_hash="h", dtype="bfloat16", final_hidden="bfloat16")
    cases = {
        "without its label": (hidden_tensors(tokens, hidden, None, torch.randn(15, 8, dtype=torch.bfloat16)), metadata, "come together"),
        "a label without it": (hidden_tensors(tokens, hidden, None), labeled, "come together"),
        "too few tokens": (hidden_tensors(tokens, hidden, None, torch.randn(14, 8, dtype=torch.bfloat16)), labeled, r"\[14, 8\] do not match 15 tokens"),
        "narrower": (hidden_tensors(tokens, hidden, None, torch.randn(15, 4, dtype=torch.bfloat16)), labeled, "not 8 wide"),
        "mislabeled": (hidden_tensors(tokens, hidden, None, torch.randn(15, 8).to(torch.float8_e4m3fn), torch.ones(15)),
                       labeled, "labeled bfloat16 but its final_hidden_states are F8_E4M3"),
        "fp8 without scales": (hidden_tensors(tokens, hidden, None, torch.randn(15, 8).to(torch.float8_e4m3fn)),
                               {**labeled, "final_hidden": "float8_e4m3fn"}, r"without a \[15\] final_hidden_states_scale"),
    }
    for case, (tensors, meta, message) in cases.items():
        with pytest.raises(FormatError, match=message):
            HiddenChunk.decode(save(tensors, metadata=meta), case)


def test_a_drafter_that_reads_the_final_hidden_state_is_refused_states_without_it():
    def train(**section):
        return parse_spec({"name": "x", "target": {"model": "/m"}, "data": {"source": "/d"}, "output": "/o", "backend": "local", "train": section}).train

    marker = DoneMarker(chunk=0, samples=1, tokens=9, bytes=100, sha256="ab", etag=None, dtype="bfloat16", layers=[1], hidden_size=8)
    without = Manifest(model="m", layers=[1], dtype="bfloat16", hidden_size=8, samples=1, tokens=9, bytes=100, chunks=[marker])
    with pytest.raises(InputError) as refused:
        check_final_hidden(without, train(drafter="dspark"), "s3://b/run/extract/manifest.json")
    assert "s3://b/run/extract/manifest.json: the hidden states hold no final hidden state of the target" in refused.value.what
    assert "train.drafter dspark reads it" in refused.value.what
    assert "extract.final_hidden: true" in refused.value.fix and "train.dspark.ce_only: true" in refused.value.fix
    check_final_hidden(without, train(drafter="dspark", dspark={"ce_only": True}), "m")  # explicitly without it
    check_final_hidden(without, train(drafter="dflash"), "m")
    check_final_hidden(without, train(drafter="dflash2"), "m")
    check_final_hidden(Manifest(**{**without.__dict__, "final_hidden": "float8_e4m3fn"}), train(drafter="dspark"), "m")


def test_chunk_bytes_do_not_depend_on_metadata_order_and_load_with_safetensors():
    from safetensors.torch import load

    tensors = {
        "hidden_states": torch.randn(5, 2, 8).to(torch.float8_e4m3fn), "hidden_states_scale": torch.rand(5, 2),
        "input_ids": torch.arange(5, dtype=torch.int32), "loss_mask": torch.tensor([0, 1, 1, 0, 1], dtype=torch.uint8),
        "cu_seqlens": torch.tensor([0, 5]), "sample_ids": torch.tensor([7]),
    }
    metadata = {"format": "dflash.hidden/v1", "layers": "[1, 3]", "model": "m", "config_hash": "h", "dtype": "float8_e4m3fn"}
    encodings = []
    for order in (metadata, dict(reversed(metadata.items()))):
        encodings.append(b"".join(safetensors_parts(tensors, order)))
    assert encodings[0] == encodings[1] and int.from_bytes(encodings[0][:8], "little") % 8 == 0  # aligned data
    loaded = load(encodings[0])
    assert all(torch.equal(loaded[name].view(torch.uint8), tensor.view(torch.uint8)) for name, tensor in tensors.items())


def test_a_chunk_lays_out_the_widest_elements_first_and_among_as_wide_the_largest_first():
    from safetensors.torch import load

    tokens, hidden, final = make_tokens(), torch.randn(15, 2, 8, dtype=torch.bfloat16), torch.randn(15, 8, dtype=torch.bfloat16)
    tensors = hidden_tensors(tokens, hidden, None, final)
    names = safetensors_names(tensors)
    widths = [tensors[name].itemsize for name in names]
    assert widths == sorted(widths, reverse=True)  # every offset aligned to its element
    # The layers' states before the final hidden state, as wide and smaller: a chunk streamed as its
    # rows fill (extract/writer.py) leaves only the smaller one to wait for the last row.
    assert names.index("hidden_states") < names.index("final_hidden_states")
    data = encode_hidden_chunk(tokens, hidden, layers=[1, 3], model="m", config_hash="h", final_hidden=final)
    header, _ = read_header(data[: header_size(data)], "x")
    assert header["hidden_states"]["data_offsets"][1] == header["final_hidden_states"]["data_offsets"][0]
    loaded = load(data)
    assert torch.equal(loaded["hidden_states"], hidden) and torch.equal(loaded["final_hidden_states"], final)
    chunk = HiddenChunk.decode(data, "x")
    assert torch.equal(chunk.hidden_states, hidden) and torch.equal(chunk.final_hidden_states, final)


def test_mislabeled_hidden_chunk_is_rejected():
    from safetensors.torch import save

    tensors = hidden_tensors(make_tokens(), torch.randn(15, 2, 8, dtype=torch.bfloat16), torch.ones(15, 2))
    data = save(tensors, metadata=hidden_metadata(layers=[1, 3], model="m", config_hash="h", dtype="float8_e4m3fn"))
    with pytest.raises(FormatError, match="labeled float8_e4m3fn"):
        HiddenChunk.decode(data, "x")


def test_hidden_chunk_with_wrong_layer_count_is_rejected():
    data = encode_hidden_chunk(make_tokens(), torch.randn(15, 3, 8), layers=[1, 3], model="m", config_hash="h")
    with pytest.raises(FormatError, match="do not match"):
        HiddenChunk.decode(data, "x")


def test_json_documents_round_trip_and_reject_garbage():
    marker = DoneMarker(chunk=3, samples=2, tokens=9, bytes=100, sha256="ab", etag=None, dtype="bfloat16", layers=[1], hidden_size=8, stats={"rms": 1.0})
    assert DoneMarker.from_json(marker.to_json(), "m") == marker
    manifest = Manifest(model="m", layers=[1], dtype="bfloat16", hidden_size=8, samples=2, tokens=9, bytes=100, chunks=[marker])
    assert Manifest.from_json(manifest.to_json()) == manifest
    # The final hidden state's dtype, recorded in both; documents written before it read as without it.
    final = DoneMarker(**{**marker.__dict__, "final_hidden": "bfloat16"})
    assert DoneMarker.from_json(final.to_json(), "m").final_hidden == "bfloat16"
    stored = Manifest(**{**manifest.__dict__, "chunks": [final], "final_hidden": "bfloat16"})
    assert Manifest.from_json(stored.to_json()) == stored
    older = json.loads(stored.to_json())
    del older["final_hidden"], older["chunks"][0]["final_hidden"]
    assert Manifest.from_json(json.dumps(older)) == manifest
    index = DatasetIndex(samples=3, tokens=15, vocab_size=1000, chunks=[ChunkInfo(0, token_chunk_key(0), 3, 15)], dropped={"empty": 1})
    assert DatasetIndex.from_json(index.to_json()) == index
    with pytest.raises(FormatError, match="not valid JSON"):
        DoneMarker.from_json(marker.to_json()[:20], "m")
    with pytest.raises(FormatError, match="not a dflash.manifest/v1"):
        Manifest.from_json(marker.to_json())
    bad = json.loads(index.to_json())
    bad["tokens"] = 99
    with pytest.raises(FormatError, match="disagree"):
        DatasetIndex.from_json(json.dumps(bad))


def test_a_header_is_fetched_by_range_from_a_file_or_an_object_in_one_read_or_two(tmp_path, s3_server, s3_bucket):
    tokens = make_tokens()
    small = encode_hidden_chunk(tokens, torch.randn(15, 2, 8), layers=[1, 3], model="m", config_hash="h")
    # Metadata longer than the probe: the header takes a second read.
    large = encode_hidden_chunk(tokens, torch.randn(15, 2, 8), layers=[1, 3], model="m" * HEADER_PROBE, config_hash="h")
    local = open_storage(str(tmp_path / "store"))
    s3 = open_storage(f"s3://{s3_bucket}/run")
    for name, data in (("small", small), ("large", large)):
        (tmp_path / name).write_bytes(data)
        for storage in (local, s3):
            storage.put_bytes(name, data)
        reads = []

        def counted(read):
            return lambda start, end: reads.append((start, end)) or read(start, end)

        for read_range in (file_range(tmp_path / name), object_range(local, name), object_range(s3, name)):
            reads.clear()
            prefix = fetch_header_bytes(counted(read_range))
            assert len(prefix) == header_size(data[:8]) and prefix == data[: len(prefix)]
            header, total = read_header(prefix, name)
            assert total == len(data) and header["__metadata__"]["model"].startswith("m")
            assert len(reads) == (1 if name == "small" else 2)


def test_a_truncated_or_foreign_file_comes_back_as_read_and_is_rejected_by_name(tmp_path):
    data = encode_hidden_chunk(make_tokens(), torch.randn(15, 2, 8), layers=[1], model="m", config_hash="h")
    cases = {"empty": b"", "cut-in-length": data[:5], "cut-in-header": data[:40], "not-safetensors": b"\xff" * 64}
    messages = {"empty": "truncated", "cut-in-length": "truncated", "cut-in-header": "truncated inside its header",
                "not-safetensors": "is not a safetensors file"}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        prefix = fetch_header_bytes(file_range(tmp_path / name))
        assert prefix == content[: len(prefix)]
        with pytest.raises(FormatError, match=messages[name]) as error:
            read_header(prefix, name)
        assert name in str(error.value)
