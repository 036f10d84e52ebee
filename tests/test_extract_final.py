"""The target's final hidden state (extract.final_hidden; DSpark reads it), extracted on each tiny
target through the real path: the output of the last decoder layer BEFORE the final norm, stored
row for row beside the layers, bf16 or fp8, recorded in the chunk, its marker and the manifest.

Before, not after: Transformers' last hidden state is after the final norm, and a consumer (our
trainer, speculators) applies the norm itself; storing the normed state would have it applied
twice, and the target distribution silently wrong (reference/dflash2-dspark.md pitfall 8)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_jobs.drafter.checkpoint import TargetCheckpoint
from dflash_jobs.extract.__main__ import main
from dflash_jobs.extract.progress import Summary
from dflash_jobs.capture.target import load_capture_target
from dflash_jobs.extract.worker import ExtractWorker, pending_chunks
from dflash_jobs.extract.writer import ChunkMetadata
from dflash_jobs.formats import DoneMarker, HiddenChunk, done_key, encode_hidden_chunk, hidden_chunk_key, read_header
from dflash_jobs.spec import ExtractSpec, TargetSpec, load_spec
from dflash_jobs.storage import open_storage
from dflash_jobs.architectures.tiny import DEBUGMODEL

from dflashctl.verify import Expected, verify_run
from extract_helpers import prepared_run, random_chunks, tiny_target, write_prepared, write_spec

LAYERS = [1, 3]  # shallow taps: the model must still run to its last layer
LAST = DEBUGMODEL.num_layers - 1
BF16_ULP = 2.0**-7


@pytest.fixture(scope="module")
def checkpoint(architecture, tmp_path_factory):
    return tiny_target(tmp_path_factory, architecture)


@pytest.fixture(scope="module")
def chunks():
    return random_chunks(seed=21, count=2, min_len=6, max_len=30)


def extract(checkpoint, directory, chunks, *, dtype: str):
    target = load_capture_target(TargetSpec(model=str(checkpoint), layers=LAYERS), checkpoint=checkpoint, layers=LAYERS,
                         device=torch.device("cpu"), dtype=torch.float32, final_hidden=True)
    assert len(target.decoder_layers) == DEBUGMODEL.num_layers and target.final_layer == LAST
    storage, infos = prepared_run(directory, chunks)
    worker = ExtractWorker(
        ExtractSpec(shards=1, token_budget=96, pad_multiple=16, sort_window=2, dtype=dtype), target=target, storage=storage,
        chunks=infos, summary=Summary(shard=0, shards=1), max_length=48, packed=False, log_interval=0.0,
    )
    try:
        with torch.inference_mode():
            worker.run()
    finally:
        worker.close()
    return storage


@pytest.fixture(scope="module")
def runs(checkpoint, chunks, tmp_path_factory):
    return {dtype: extract(checkpoint, tmp_path_factory.mktemp(dtype), chunks, dtype=dtype) for dtype in ("bfloat16", "float8_e4m3fn")}


def stored(storage, chunk: int) -> HiddenChunk:
    return HiddenChunk.decode(storage.get_bytes(hidden_chunk_key(chunk)), hidden_chunk_key(chunk))


def close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return bool(((got.float() - expected).abs() <= BF16_ULP * expected.abs() + 1e-3).all())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's x * w RMSNorm, the form the trainer holds the target's final norm in."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_the_stored_final_hidden_state_is_the_last_layer_before_the_final_norm(checkpoint, chunks, runs):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    target = TargetCheckpoint(open_storage(str(checkpoint)))
    final_norm, eps = target.read_target_tensors().final_norm, target.text["rms_norm_eps"]
    pre_norm = {}
    hook = model.model.layers[LAST].register_forward_hook(
        lambda module, args, output: pre_norm.update(last=output[0] if isinstance(output, tuple) else output))
    try:
        for cid, chunk in enumerate(chunks):
            hidden = stored(runs["bfloat16"], cid)
            assert hidden.final_hidden == "bfloat16" and hidden.final_hidden_states.shape == (chunk.num_tokens, DEBUGMODEL.hidden_size)
            for i in range(chunk.num_samples):
                ids, _ = chunk.sample(i)
                begin, end = chunk.cu_seqlens[i], chunk.cu_seqlens[i + 1]
                with torch.inference_mode():
                    states = model(torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True).hidden_states
                final = hidden.final_hidden_states[begin:end]
                # The last decoder layer's own output, row t beside token t...
                assert close(final, pre_norm["last"][0])
                # ...which is not Transformers' last hidden state: that one is after the final norm...
                assert not close(final, states[LAST + 1][0])
                # ...which the norm the trainer holds (Llama's x * w; Qwen3.5's (1 + w), as x * w) turns ours into.
                assert close(rms_norm(final, final_norm, eps), states[LAST + 1][0])
                torch.testing.assert_close(model.model.norm(pre_norm["last"]), states[LAST + 1])
                # The captured layers are what they were without it.
                assert close(hidden.hidden_states[begin:end], torch.stack([states[layer + 1][0] for layer in LAYERS], dim=1))
    finally:
        hook.remove()


def test_fp8_stores_it_with_a_scale_per_token_and_every_record_names_it(chunks, runs):
    for cid, chunk in enumerate(chunks):
        bf16, fp8 = stored(runs["bfloat16"], cid), stored(runs["float8_e4m3fn"], cid)
        assert fp8.final_hidden == "float8_e4m3fn" and fp8.final_hidden_states.dtype == torch.float8_e4m3fn
        assert fp8.final_scale.shape == (chunk.num_tokens,)
        reference = bf16.final_hidden_states.float()
        error = (fp8.dequantized_final().float() - reference).norm(dim=-1) / reference.norm(dim=-1)
        assert float(error.max()) < 0.05  # e4m3: 3 mantissa bits, one scale per token
        for dtype, storage in runs.items():
            marker = DoneMarker.from_json(storage.get_bytes(done_key(cid)), done_key(cid))
            header, _ = read_header(storage.get_bytes(hidden_chunk_key(cid)), "chunk")
            assert marker.final_hidden == header["__metadata__"]["final_hidden"] == dtype
            assert marker.stats["final_absmax_max"] > 0 and marker.stats["final_absmax_mean"] > 0


def test_a_chunk_lacking_what_the_run_stores_is_redone_and_one_holding_more_is_kept(tmp_path):
    storage = open_storage(str(tmp_path / "run"))
    chunks = random_chunks(seed=22, count=2)
    infos = write_prepared(storage, chunks)
    for info, chunk in zip(infos, chunks):
        final = torch.randn(chunk.num_tokens, 8) if info.id == 0 else None  # chunk 0 with the final hidden state, chunk 1 without
        data = encode_hidden_chunk(chunk, torch.randn(chunk.num_tokens, 2, 8), layers=LAYERS, model="m", config_hash="h", final_hidden=final)
        put = storage.put_bytes(hidden_chunk_key(info.id), data)
        marker = DoneMarker(chunk=info.id, samples=info.samples, tokens=info.tokens, bytes=put.size, sha256=put.sha256, etag=put.etag,
                            dtype="bfloat16", layers=LAYERS, hidden_size=8, final_hidden="bfloat16" if final is not None else None)
        storage.put_bytes(done_key(info.id), marker.to_json().encode())

    def metadata(final_hidden):
        return ChunkMetadata(layers=LAYERS, hidden_size=8, model="m", config_hash="h", dtype="bfloat16", shard=0, final_hidden=final_hidden)

    assert pending_chunks(storage, infos, metadata(None)) == []
    assert pending_chunks(storage, infos, metadata("bfloat16")) == [infos[1]]
    assert storage.exists(done_key(0)) and not storage.exists(done_key(1))  # the stale marker goes: the redone chunk commits


def test_a_dspark_spec_extracts_it_and_verify_records_it_store_wide(tmp_path, checkpoint):
    """train.drafter: dspark with extract.final_hidden unset: stored, through the pod's entry point to the manifest."""
    output = tmp_path / "run"
    chunks = random_chunks(seed=23, count=2, max_len=30)
    write_prepared(open_storage(str(output)), chunks)
    spec_file = write_spec(tmp_path / "dspark.yaml", target=checkpoint, output=output, train={"drafter": "dspark"})
    assert main(["-f", str(spec_file), "--shard", "0"]) == 0
    spec = load_spec(spec_file)
    storage = open_storage(str(output))
    manifest = verify_run(storage, Expected.of(spec))
    assert manifest.final_hidden == "bfloat16" and all(m.final_hidden == "bfloat16" for m in manifest.chunks)
    for cid, chunk in enumerate(chunks):
        assert stored(storage, cid).final_hidden_states.shape == (chunk.num_tokens, DEBUGMODEL.hidden_size)

