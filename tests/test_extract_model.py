"""Extraction on each tiny target, on CPU: the Qwen3.5 one (real multimodal checkpoint layout) and
the dense Llama; the worker's mechanics (faults, storage, compilation) on the first alone.

Every captured sample must equal the same sample run alone, unpadded, through the full causal LM
with output_hidden_states, at layer i = hidden_states[i + 1]."""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5

from dflash_jobs.errors import InputError, IntegrityError
from dflash_jobs.capture import fusion, packing
from dflash_jobs.extract.transfer import Run, merge_runs
from dflash_jobs.extract.progress import Summary
from dflash_jobs.capture.target import load_capture_target
from dflash_jobs.extract.worker import ExtractWorker
from dflash_jobs.extract.writer import WRITER_THREADS
from dflash_jobs.formats import HiddenChunk, hidden_chunk_key
from dflash_jobs.spec import ExtractSpec, TargetSpec

from conftest import ONE_ARCHITECTURE
from extract_helpers import LAYERS, prepared_run, random_chunks, reference_states, tiny_target

BF16_ULP = 2.0**-7  # one unit in the last place of bf16, relative


@pytest.fixture(scope="module")
def checkpoint(architecture, tmp_path_factory):
    return tiny_target(tmp_path_factory, architecture)


@pytest.fixture(scope="module")
def reference_model(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def fp32_target(checkpoint):
    return load_capture_target(TargetSpec(model=str(checkpoint)), checkpoint=checkpoint, layers=LAYERS, device=torch.device("cpu"), dtype=torch.float32)


def run_worker(checkpoint, tmp_path, chunks, *, packed=False, dtype="bfloat16", token_budget=96, target=None):
    storage, infos = prepared_run(tmp_path, chunks)
    worker = ExtractWorker(
        ExtractSpec(shards=1, token_budget=token_budget, pad_multiple=16, sort_window=2, dtype=dtype),
        target=target or fp32_target(checkpoint), storage=storage, chunks=infos, summary=Summary(shard=0, shards=1),
        max_length=48, packed=packed, log_interval=0.0,
    )
    try:
        with torch.inference_mode():
            summary = worker.run()
    finally:
        worker.close()
    return storage, summary


def stored(storage, chunk: int) -> HiddenChunk:
    return HiddenChunk.decode(storage.get_bytes(hidden_chunk_key(chunk)), hidden_chunk_key(chunk))


@pytest.fixture(scope="module")
def chunks():
    return random_chunks(seed=1, count=2, max_len=40)


@pytest.fixture(scope="module")
def references(reference_model, chunks):
    """Every sample run alone, unpadded, through the full model: [T, L, d] per (chunk, sample)."""
    return {
        (cid, i): reference_states(reference_model, chunk.sample(i)[0], LAYERS)
        for cid, chunk in enumerate(chunks) for i in range(chunk.num_samples)
    }


@pytest.fixture(scope="module")
def baseline(checkpoint, chunks, tmp_path_factory):
    """The default path: right-padded batches sorted across a window, bf16."""
    return run_worker(checkpoint, tmp_path_factory.mktemp("baseline"), chunks)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((got.float() - expected.float()).abs() / expected.float().abs().clamp_min(1e-2)).max())


def max_error_vs_references(storage, chunks, references) -> float:
    worst = 0.0
    for cid, chunk in enumerate(chunks):
        hidden = stored(storage, cid)
        assert np.array_equal(hidden.tokens.input_ids, chunk.input_ids)
        assert np.array_equal(hidden.tokens.cu_seqlens, chunk.cu_seqlens)
        states = hidden.dequantized()
        for i in range(chunk.num_samples):
            begin, end = chunk.cu_seqlens[i], chunk.cu_seqlens[i + 1]
            worst = max(worst, relative_error(states[begin:end], references[cid, i]))
    return worst


def test_padded_batches_equal_single_unpadded_forwards(baseline, chunks, references, reference_model):
    storage, summary = baseline
    assert summary.chunks_done == len(chunks) and summary.samples == sum(c.num_samples for c in chunks)
    assert summary.padded_tokens > summary.tokens  # batches really mixed lengths and padded
    hidden = stored(storage, 0)
    assert hidden.layers == LAYERS and hidden.dtype == "bfloat16" and hidden.hidden_states.shape[1:] == (3, 64)
    assert max_error_vs_references(storage, chunks, references) <= BF16_ULP

    # The off-by-one of this field: hidden_states[i] is the input of layer i, not its output.
    ids, _ = chunks[0].sample(0)
    with torch.inference_mode():
        states = reference_model(torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True).hidden_states
    shifted = torch.stack([states[i][0] for i in LAYERS], dim=1)
    assert relative_error(hidden.hidden_states[: len(ids)], shifted) > 100 * BF16_ULP


def varlen_reference_delta_rule(monkeypatch):
    """Stands in for FLA's varlen kernel on CPU: the torch reference run per [start, end) segment of cu_seqlens.

    This is what FLA's `cu_seqlens` means (the recurrent state restarts at every boundary); the
    conv, the masks, the attention and the capture are the real code paths."""
    reference = qwen3_5.torch_chunk_gated_delta_rule
    while hasattr(reference, "__wrapped__"):
        reference = reference.__wrapped__

    def varlen(query, key, value, g, beta, *, cu_seqlens=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, **kwargs):
        bounds = [0, query.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
        outputs = [
            reference(query[:, s:e], key[:, s:e], value[:, s:e], g[:, s:e], beta[:, s:e],
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0]
            for s, e in zip(bounds[:-1], bounds[1:])
        ]
        return torch.cat(outputs, dim=1), None

    monkeypatch.setattr(qwen3_5, "torch_chunk_gated_delta_rule", varlen)


def test_packed_rows_equal_single_unpadded_forwards(checkpoint, chunks, references, tmp_path, monkeypatch):
    varlen_reference_delta_rule(monkeypatch)
    target = fp32_target(checkpoint)
    storage, summary = run_worker(checkpoint, tmp_path / "packed", chunks, packed=True, target=target)
    # Packed waste is the gaps only: the hybrid's 3 masked tokens a sample (its conv kernel - 1), none for a dense model.
    assert target.conv_gap == {"qwen3_5": 3, "llama": 0}[target.architecture.name]
    assert summary.padded_tokens == summary.tokens + target.conv_gap * summary.samples
    assert max_error_vs_references(storage, chunks, references) <= BF16_ULP

    # Attention over the whole row reads the earlier samples: the check must see it.
    per_sample = packing.per_sample_sdpa
    with monkeypatch.context() as leak:
        leak.setattr(packing, "per_sample_sdpa", lambda query, key, value, segments, **kwargs: per_sample(query, key, value, ((0, query.shape[2]),), **kwargs))
        storage, _ = run_worker(checkpoint, tmp_path / "one-segment", chunks, packed=True)
    assert max_error_vs_references(storage, chunks, references) > 10 * BF16_ULP
    if target.conv_gap:  # Without the masked gaps the causal conv reads the previous sample's last tokens: the check must see it.
        leaky = fp32_target(checkpoint)
        leaky.conv_gap = 0
        storage, _ = run_worker(checkpoint, tmp_path / "no-gaps", chunks, packed=True, target=leaky)
        assert max_error_vs_references(storage, chunks, references) > 10 * BF16_ULP


def test_fp8_round_trip_is_within_e4m3_precision(checkpoint, chunks, baseline, tmp_path):
    bf16, _ = baseline
    fp8, _ = run_worker(checkpoint, tmp_path, chunks, dtype="float8_e4m3fn")
    for cid in range(len(chunks)):
        reference, quantized = stored(bf16, cid), stored(fp8, cid)
        assert quantized.dtype == "float8_e4m3fn" and quantized.hidden_states.dtype == torch.float8_e4m3fn
        assert quantized.scale.shape == quantized.hidden_states.shape[:2]
        expected, got = reference.hidden_states.float(), quantized.dequantized().float()
        # e4m3 keeps 3 mantissa bits: at most 1/16 relative per element, plus the bf16 rounding on both sides.
        bound = expected.abs() / 16 + quantized.scale.unsqueeze(-1) * 2.0**-6 + expected.abs() * 2.0**-7
        assert ((got - expected).abs() <= bound).all()
        assert (got - expected).norm() / expected.norm() < 0.05


@ONE_ARCHITECTURE
def test_compiled_norms_and_mlps_store_the_same_states(checkpoint, chunks, references, tmp_path):
    """extract.compile: the worker's batches (several shapes) through the compiled modules give the
    states of every sample run alone, as eagerly; a few graphs serve every layer and shape."""
    target = fp32_target(checkpoint)
    layers = target.decoder_layers
    expected = sum(3 + (2 if hasattr(layer, "self_attn") else 1) for layer in layers)  # 2 norms + MLP, + the mixer's norms
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert fusion.compile_elementwise(layers, target.architecture.fused_submodules) == expected
    storage, summary = run_worker(checkpoint, tmp_path, chunks, target=target)
    assert summary.chunks_done == len(chunks)
    assert max_error_vs_references(storage, chunks, references) <= BF16_ULP
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # Graphs per module class and input rank or stride, not per layer or batch; under the limit, so none ran eagerly.
    assert 0 < graphs < min(expected, fusion.RECOMPILE_LIMIT), (graphs, expected)


@ONE_ARCHITECTURE
def test_a_batch_out_of_memory_is_split_and_retried(checkpoint, chunks, baseline, tmp_path):
    target = fp32_target(checkpoint)
    forward = target.model.forward

    def limited(*args, input_ids, **kwargs):
        if input_ids.numel() > 48:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return forward(*args, input_ids=input_ids, **kwargs)

    target.model.forward = limited
    storage, summary = run_worker(checkpoint, tmp_path, chunks, target=target)
    assert summary.oom_splits > 0
    assert summary.samples == sum(c.num_samples for c in chunks)
    for cid in range(len(chunks)):
        assert relative_error(stored(storage, cid).hidden_states, stored(baseline[0], cid).hidden_states) <= BF16_ULP

    # A single sample that does not fit alone stops the shard with a message naming it: nothing is skipped.
    target.model.forward = lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("simulated"))
    with pytest.raises(InputError, match=r"sample \d+ of chunk 000000 .* does not fit"):
        run_worker(checkpoint, tmp_path / "again", chunks, target=target)


@ONE_ARCHITECTURE
def test_non_finite_states_stop_the_shard_naming_the_chunk(checkpoint, chunks, tmp_path):
    target = fp32_target(checkpoint)
    with torch.no_grad():
        target.model.layers[2].mlp.down_proj.weight.fill_(float("nan"))
    with pytest.raises(IntegrityError, match=r"chunk 000000: non-finite hidden states in sample"):
        run_worker(checkpoint, tmp_path, chunks[:1], target=target)
    assert not (tmp_path / "run" / "extract" / "done").exists()


@ONE_ARCHITECTURE
def test_a_slow_store_holds_the_gpu_back_without_losing_or_reordering_anything(checkpoint, tmp_path):
    """Chunk buffers are the only host memory the states use: while the store is stuck, the GPU
    thread waits for a free buffer (reported as host_wait_s) and every chunk still lands whole."""
    chunks = random_chunks(seed=7, count=6, max_len=24)
    storage, infos = prepared_run(tmp_path / "slow", chunks)
    worker = ExtractWorker(
        ExtractSpec(shards=1, token_budget=64, pad_multiple=16, sort_window=1), target=fp32_target(checkpoint),
        storage=storage, chunks=infos, summary=Summary(shard=0, shards=1), max_length=48, packed=False, log_interval=0.0,
    )
    gpu_blocked = threading.Event()
    take, put_parts = worker.pool.take, storage.put_parts

    def take_or_report(timeout):
        try:
            return take(timeout)
        except queue.Empty:
            gpu_blocked.set()
            raise

    def stuck_until_the_gpu_waits(key, parts, size=None):
        assert gpu_blocked.wait(timeout=120), "the GPU thread never ran out of buffers"
        return put_parts(key, parts, size)

    worker.pool.take, storage.put_parts = take_or_report, stuck_until_the_gpu_waits
    try:
        with torch.inference_mode():
            summary = worker.run()
    finally:
        worker.close()
    assert worker.pool.allocated == worker.pool.size == 1 + WRITER_THREADS  # never more host memory than the pool
    assert summary.host_wait_s >= 1.0 and summary.chunks_done == len(chunks)
    fast, _ = run_worker(checkpoint, tmp_path / "fast", chunks)
    for cid in range(len(chunks)):
        assert stored(storage, cid).hidden_states.equal(stored(fast, cid).hidden_states)


def test_runs_of_consecutive_samples_are_merged_into_one_copy():
    first, second = object(), object()
    runs = [Run(first, 0, 10, 5), Run(first, 5, 15, 3), Run(second, 8, 0, 4), Run(second, 12, 4, 2), Run(first, 14, 40, 1)]
    assert merge_runs(runs) == [Run(first, 0, 10, 8), Run(second, 8, 0, 6), Run(first, 14, 40, 1)]
    # Rows that do not continue each other in both buffers stay apart (padded batches: one copy per sample).
    assert merge_runs([Run(first, 0, 10, 5), Run(first, 8, 15, 3)]) == [Run(first, 0, 10, 5), Run(first, 8, 15, 3)]


@ONE_ARCHITECTURE
def test_a_host_buffer_that_cannot_be_allocated_stops_the_shard_instead_of_hanging(checkpoint, tmp_path):
    chunks = random_chunks(seed=8, count=2, max_len=24)
    storage, infos = prepared_run(tmp_path, chunks)
    worker = ExtractWorker(
        ExtractSpec(shards=1, token_budget=64, pad_multiple=16, sort_window=1), target=fp32_target(checkpoint),
        storage=storage, chunks=infos, summary=Summary(shard=0, shards=1), max_length=48, packed=False, log_interval=0.0,
    )

    def out_of_host_memory():
        raise RuntimeError("simulated: cannot allocate pinned host memory")

    worker.pool._allocate = out_of_host_memory
    try:
        with pytest.raises(RuntimeError, match="cannot allocate pinned host memory"), torch.inference_mode():
            worker.run()
    finally:
        worker.close()
    assert not storage.list("extract/done/")
