"""Extraction logic without a model: shard assignment, batch planning, integrity checks, exit codes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dflash_jobs.errors import EXIT_BAD_INPUT, EXIT_BAD_SPEC, FormatError, IntegrityError, SpecError, StorageError
from dflash_jobs.errors import pod_exit_code as exit_code
from dflash_jobs.shard import shard_index
from dflash_jobs.capture.batching import BatchPlanner, window_samples
from dflash_jobs.extract.integrity import check_assembled
from dflash_jobs.extract.progress import Summary
from dflash_jobs.termination import write_termination_message
from dflash_jobs.extract.sharding import assign_chunks, shard_chunks
from dflash_jobs.formats import ChunkInfo

from extract_helpers import random_chunks


def chunk_infos(seed: int = 0, count: int = 57) -> list[ChunkInfo]:
    rng = np.random.default_rng(seed)
    return [ChunkInfo(i, f"tokens/chunks/{i:06d}.safetensors", 10, int(rng.integers(1000, 65536))) for i in range(count)]


@pytest.mark.parametrize("shards", [1, 2, 3, 8, 13, 64])
def test_every_chunk_is_owned_by_exactly_one_shard(shards):
    chunks = chunk_infos()
    owned = assign_chunks(chunks, shards)
    ids = sorted(c.id for mine in owned for c in mine)
    assert ids == [c.id for c in chunks]
    assert [shard_chunks(chunks, shards, i) for i in range(shards)] == owned
    # Token-balanced: no shard carries more than the mean plus one chunk (LPT's guarantee).
    loads = [sum(c.tokens for c in mine) for mine in owned]
    assert max(loads) <= sum(loads) / shards + max(c.tokens for c in chunks)


def test_assignment_is_deterministic_and_ignores_listing_order():
    chunks = chunk_infos(seed=3)
    shuffled = list(reversed(chunks))
    assert assign_chunks(chunks, 5) == assign_chunks(shuffled, 5)
    with pytest.raises(ValueError):
        shard_chunks(chunks, 5, 5)


def by_position(sample):
    return sample.slot, sample.index


def planned(planner: BatchPlanner, seed: int = 0):
    chunks = random_chunks(seed=seed, count=4, max_len=60)
    samples = window_samples(chunks)
    return chunks, samples, planner.plan(samples)


def test_padded_plan_covers_each_sample_once_under_the_budget():
    planner = BatchPlanner(token_budget=128, pad_multiple=16)
    chunks, samples, batches = planned(planner)
    assert sorted((s for batch in batches for s in batch), key=by_position) == sorted(samples, key=by_position)
    for batch in batches:
        built = planner.build(batch, chunks)
        rows, length = built.shape
        assert length % 16 == 0 and length >= max(s.length for s in batch)
        assert rows * length <= 128 or rows == 1
        # Right padding: every row starts with its sample's tokens, in order.
        for row, sample in enumerate(batch):
            expected = chunks[sample.slot].input_ids[sample.start:sample.start + sample.length]
            assert np.array_equal(built.input_ids[row, :sample.length].numpy(), expected)
        flat = built.input_ids.reshape(-1)[built.real_index]
        assert np.array_equal(flat.numpy(), np.concatenate([chunks[s.slot].input_ids[s.start:s.start + s.length] for s in batch]))
    # Longest first, across the chunks of the window.
    firsts = [batch[0].length for batch in batches]
    assert firsts == sorted(firsts, reverse=True)


def test_sorting_across_a_window_cuts_padding():
    planner = BatchPlanner(token_budget=256, pad_multiple=8)
    chunks = random_chunks(seed=7, count=8, max_len=120)

    def waste(window: int) -> float:
        real = padded = 0
        for begin in range(0, len(chunks), window):
            group = chunks[begin:begin + window]
            for batch in planner.plan(window_samples(group)):
                real += sum(s.length for s in batch)
                padded += len(batch) * planner.row_length(batch[0].length)
        return 1 - real / padded

    assert waste(8) < waste(1)


def test_packed_rows_keep_samples_apart_with_masked_gaps():
    planner = BatchPlanner(token_budget=100, pad_multiple=16, packed=True, gap=3)
    chunks, samples, batches = planned(planner, seed=2)
    assert [s for batch in batches for s in batch] == samples  # window order: chunks complete one by one
    for batch in batches:
        built = planner.build(batch, chunks)
        assert built.shape[0] == 1 and built.padded_tokens <= 100 or len(batch) == 1
        assert built.cu_seqlens.tolist() == [0, *np.cumsum([s.length + 3 for s in batch]).tolist()]
        for (start, end), sample in zip(built.segments, batch):
            assert built.position_ids[0, start:end].tolist() == list(range(end - start))
            assert built.token_mask[0, start:end].tolist() == [1] * sample.length + [0] * 3


def test_split_halves_a_batch_and_refuses_a_single_sample():
    planner = BatchPlanner(token_budget=128, pad_multiple=16)
    chunks, _, batches = planned(planner)
    batch = planner.build(max(batches, key=len), chunks)
    halves = planner.split(batch, chunks)
    assert [s for half in halves for s in half.samples] == batch.samples
    assert planner.split(planner.build(batch.samples[:1], chunks), chunks) == []


def assembled(chunk):
    n, layers = chunk.num_tokens, 2
    ids = torch.from_numpy(chunk.input_ids.astype(np.int64))
    absmax = torch.rand(n, layers) + 0.5
    return ids, absmax, np.ones(chunk.num_samples, dtype=bool)


def test_integrity_checks_name_the_chunk_and_sample():
    chunk = random_chunks(seed=4, count=1)[0]
    ids, absmax, written = assembled(chunk)
    stats = check_assembled(7, chunk, ids, absmax, written)
    assert stats["absmax_max"] == pytest.approx(float(absmax.max()))

    bad = absmax.clone()
    bad[chunk.cu_seqlens[1]] = float("nan")
    with pytest.raises(IntegrityError, match=f"chunk 000007: non-finite hidden states in sample {chunk.sample_ids[1]}"):
        check_assembled(7, chunk, ids, bad, written)
    zero = absmax.clone()
    zero[chunk.cu_seqlens[2]:chunk.cu_seqlens[3]] = 0
    with pytest.raises(IntegrityError, match=f"all-zero hidden states for sample {chunk.sample_ids[2]}"):
        check_assembled(7, chunk, ids, zero, written)
    shifted = ids.roll(1)
    with pytest.raises(IntegrityError, match="token ids differ from the input"):
        check_assembled(7, chunk, shifted, absmax, written)
    missing = written.copy()
    missing[0] = False
    with pytest.raises(IntegrityError, match="never captured"):
        check_assembled(7, chunk, ids, absmax, missing)


def test_integrity_checks_the_final_hidden_state_like_the_layers():
    chunk = random_chunks(seed=5, count=1)[0]
    ids, absmax, written = assembled(chunk)
    final = torch.rand(chunk.num_tokens) + 0.5
    stats = check_assembled(3, chunk, ids, absmax, written, final)
    assert stats["final_absmax_max"] == pytest.approx(float(final.max())) and stats["absmax_max"] == pytest.approx(float(absmax.max()))
    assert "final_absmax_max" not in check_assembled(3, chunk, ids, absmax, written)

    bad = final.clone()
    bad[chunk.cu_seqlens[1]] = float("inf")
    with pytest.raises(IntegrityError, match=f"chunk 000003: non-finite final hidden states in sample {chunk.sample_ids[1]}"):
        check_assembled(3, chunk, ids, absmax, written, bad)
    zero = final.clone()
    zero[chunk.cu_seqlens[2]:chunk.cu_seqlens[3]] = 0
    with pytest.raises(IntegrityError, match=f"all-zero final hidden states for sample {chunk.sample_ids[2]}"):
        check_assembled(3, chunk, ids, absmax, written, zero)


def test_exit_codes_and_shard_index(monkeypatch):
    assert exit_code(IntegrityError("x")) == EXIT_BAD_INPUT == 42
    assert exit_code(FormatError("x")) == EXIT_BAD_INPUT
    assert exit_code(SpecError("f", 1, "y")) == EXIT_BAD_SPEC == 2
    assert exit_code(StorageError("x")) == 1 and exit_code(RuntimeError()) == 1
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "3")
    assert shard_index(None) == 3 and shard_index(1) == 1
    monkeypatch.delenv("JOB_COMPLETION_INDEX")
    with pytest.raises(SpecError, match="JOB_COMPLETION_INDEX"):
        shard_index(None)


def test_termination_message_is_one_json_line(tmp_path, monkeypatch):
    path = tmp_path / "termination"
    monkeypatch.setenv("DFLASH_TERMINATION_LOG", str(path))
    write_termination_message(Summary(shard=2, shards=8, status="failed", error="chunk 000003: boom").to_json())
    lines = path.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["error"] == "chunk 000003: boom"
