"""FP8 compute of the target's linear layers (extract.compute_dtype: float8), on each tiny target.

Row-wise scaled FP8 matmuls run on CPU too in this torch, so the numerics and the bookkeeping are
tested here; speed and the real shape are measured on the GPU (bench/extract.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dflash_jobs.errors import SpecError
from dflash_jobs.capture.fp8 import Float8Linear, quantize_rows, require_fp8, to_float8
from dflash_jobs.extract.progress import Summary
from dflash_jobs.capture.target import load_capture_target
from dflash_jobs.extract.worker import ExtractWorker
from dflash_jobs.formats import DoneMarker, HiddenChunk, done_key, hidden_chunk_key, read_header
from dflash_jobs.spec import ExtractSpec, TargetSpec, parse_spec

from extract_helpers import LAYERS, prepared_run, random_chunks, reference_states, tiny_target


@pytest.fixture(scope="module")
def bf16_target(architecture, tmp_path_factory):
    checkpoint = tiny_target(tmp_path_factory, architecture)
    return load_capture_target(TargetSpec(model=str(checkpoint)), checkpoint=checkpoint, layers=LAYERS, device=torch.device("cpu"))


def test_row_wise_fp8_linear_matches_its_dequantized_weights():
    torch.manual_seed(0)
    linear = nn.Linear(256, 384, bias=True).to(torch.bfloat16)
    fp8 = Float8Linear.from_linear(linear)
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.weight_scale.shape == (1, 384)
    x = torch.randn(3, 5, 256, dtype=torch.bfloat16) * torch.logspace(-2, 2, 256, dtype=torch.bfloat16)  # rows of varied range
    with torch.no_grad():
        got, exact = fp8(x), linear(x).float()
    assert got.shape == (3, 5, 384) and got.dtype == torch.bfloat16
    # The same product in float32 from the quantized operands: only the accumulation differs.
    xq, xs = quantize_rows(x.reshape(-1, 256))
    expected = (xq.float() * xs) @ (fp8.weight.float() * fp8.weight_scale.t()).t() + linear.bias.float()
    assert torch.allclose(got.reshape(-1, 384).float(), expected, rtol=2e-2, atol=2e-2)
    # Against bf16: e4m3 keeps 3 mantissa bits, so a few percent, never more.
    error = float((got.float() - exact).norm() / exact.norm())
    assert 1e-3 < error < 0.06


def test_fp8_states_stay_close_to_bf16_per_layer_and_the_chunks_say_how_they_were_computed(bf16_target, tmp_path):
    fp8_target = copy.deepcopy(bf16_target)
    swapped = to_float8(fp8_target.decoder_layers, min_features=16)
    expected = sum(isinstance(m, nn.Linear) and min(m.weight.shape) >= 16 and m.weight.shape[0] % 16 == 0
                   and m.weight.shape[1] % 16 == 0 for m in bf16_target.decoder_layers.modules())
    assert swapped == expected > 0
    assert not any(isinstance(m, nn.Linear) and min(m.weight.shape) >= 16 for m in fp8_target.decoder_layers.modules())

    chunks = random_chunks(seed=3, count=2, max_len=40)
    results = {}
    for name, target, compute in (("bf16", bf16_target, "bfloat16"), ("fp8", fp8_target, "float8")):
        storage, infos = prepared_run(tmp_path / name, chunks)
        worker = ExtractWorker(
            ExtractSpec(shards=1, token_budget=96, pad_multiple=16, sort_window=2, compute_dtype=compute), target=target,
            storage=storage, chunks=infos, summary=Summary(shard=0, shards=1), max_length=48, packed=False, log_interval=0.0,
        )
        try:
            with torch.inference_mode():
                worker.run()
        finally:
            worker.close()
        results[name] = storage
    for cid in range(len(chunks)):
        bf16 = HiddenChunk.decode(results["bf16"].get_bytes(hidden_chunk_key(cid)), "bf16").hidden_states.float()
        data = results["fp8"].get_bytes(hidden_chunk_key(cid))
        fp8 = HiddenChunk.decode(data, "fp8").hidden_states.float()
        per_layer = [float((fp8[:, j] - bf16[:, j]).norm() / bf16[:, j].norm()) for j in range(len(LAYERS))]
        assert all(0 < e < 0.15 for e in per_layer), per_layer  # really quantized, and still the same states
        header, _ = read_header(data, "fp8")
        assert header["__metadata__"]["compute_dtype"] == "float8"
        marker = DoneMarker.from_json(results["fp8"].get_bytes(done_key(cid)), "marker")
        assert marker.compute_dtype == "float8"
        assert DoneMarker.from_json(results["bf16"].get_bytes(done_key(cid)), "marker").compute_dtype == "bfloat16"


def test_float8_compute_is_refused_where_there_are_no_fp8_tensor_cores():
    with pytest.raises(SpecError, match=r"extract.compute_dtype.*float8.*FP8 tensor cores"):
        require_fp8(torch.device("cpu"))
    spec = parse_spec({"name": "x", "backend": "local", "target": {"model": "/m"}, "data": {"source": "/d"}, "output": "/o",
                       "extract": {"compute_dtype": "float8"}})
    assert spec.extract.compute_dtype == "float8"
    with pytest.raises(SpecError, match=r"extract.compute_dtype.*'bfloat16' \| 'float8'"):
        parse_spec({"name": "x", "backend": "local", "target": {"model": "/m"}, "data": {"source": "/d"}, "output": "/o",
                    "extract": {"compute_dtype": "fp8"}})
