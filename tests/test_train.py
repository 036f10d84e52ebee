"""Drafter training on a tiny real extract: anchors, planning, batching, refusal without a
manifest, kill and resume, DDP on two gloo ranks, and a loss that goes down."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dflash_jobs.drafter.checkpoint import TargetCheckpoint
from dflash_jobs.errors import EXIT_BAD_INPUT, InputError
from dflash_jobs.formats import MANIFEST_KEY, HiddenChunk, Manifest, TokenChunk, encode_hidden_chunk, hidden_chunk_key
from dflash_jobs.spec import anchor_layout, parse_spec
from dflash_jobs.storage import open_storage
from dflash_jobs.train.__main__ import main
from dflash_jobs.train.anchors import anchor_candidates, sample_anchors
from dflash_jobs.train.checkpointer import step_prefix
from dflash_jobs.train.chunks import ChunkCache, ChunkData
from dflash_jobs.train.data import BatchBuilder, BatchStream, Budget, DocumentRef, assign_chunks, plan_epoch, read_document_index
from dflash_jobs.formats import TRAIN_METRICS_KEY as METRICS_KEY, TRAIN_PLOT_KEY as PLOT_KEY
from dflash_jobs.train.trainer import Runtime, Trainer
from train_fixtures import LAYERS, copy_extract, tiny_target, train_spec_dict, write_spec

from conftest import free_port

EPOCHS = 6
STEPS = 30  # 5 micro-batches of <= 1024 tokens per epoch on one rank
THREADS = 1  # intra-op threads of every run the kill-and-resume test compares, in this process and in its subprocess


def spec_for(root: Path, output: Path, **train) -> dict:
    return train_spec_dict(tiny_target(root), output, **{"epochs": EPOCHS, "checkpoint_every": 5, "lr": 1e-2, **train})


def run_in_process(spec: dict, cache: Path) -> None:
    trainer = Trainer.build(parse_spec(spec), Runtime(0, 1, torch.device("cpu")), cache_dir=cache)
    try:
        trainer.train()
    finally:
        trainer.close()


def final_weights(output: Path) -> dict[str, torch.Tensor]:
    return load_file(output / step_prefix(STEPS) / "model.safetensors")


# ---- anchors, plans, batches -----------------------------------------------------------------


def tokens_only(tokens: int) -> Budget:
    return Budget(tokens=tokens, blocks=10**9, anchors=512)


def test_anchors_are_supervised_positions_with_a_supervised_successor():
    mask = np.array([0, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1], dtype=np.uint8)
    assert anchor_candidates(mask).tolist() == [2, 3, 6, 9, 10, 11]
    picked = sample_anchors(mask, 4, seed=1, epoch=0, sample_id=7)
    assert len(picked) == 4 and set(picked) <= {2, 3, 6, 9, 10, 11} and list(picked) == sorted(picked)
    assert np.array_equal(picked, sample_anchors(mask, 4, seed=1, epoch=0, sample_id=7))
    other_epochs = [tuple(sample_anchors(mask, 4, seed=1, epoch=e, sample_id=7)) for e in range(1, 6)]
    assert any(a != tuple(picked) for a in other_epochs)
    assert sample_anchors(mask, 512, seed=1, epoch=0, sample_id=7).tolist() == [2, 3, 6, 9, 10, 11]


def test_each_rank_gets_its_own_chunks_and_the_same_number_of_steps(extract):
    index = read_document_index(open_storage(str(extract)), [0, 1, 2, 3])
    assignment = assign_chunks(index, 2)
    assert sorted(c.chunk for rank in assignment for c in rank) == [0, 1, 2, 3]
    for epoch in range(3):
        plans = plan_epoch(index, world_size=2, seed=3, epoch=epoch, budget=tokens_only(400))
        assert len(plans[0]) == len(plans[1]) > 0
        for rank, plan in enumerate(plans):
            docs = [(d.chunk, d.index) for batch in plan for d in batch]
            assert len(docs) == len(set(docs))  # no document twice in an epoch
            assert {c for c, _ in docs} <= {c.chunk for c in assignment[rank]}
            assert all(sum(d.tokens for d in batch) <= 400 or len(batch) == 1 for batch in plan)
    first, second = (plan_epoch(index, world_size=1, seed=3, epoch=e, budget=tokens_only(400))[0] for e in (0, 1))
    assert first != second  # reshuffled every epoch


def test_micro_batches_are_bounded_by_blocks_as_well_as_tokens(extract):
    """Memory grows with blocks: many short documents, each with up to `anchors` blocks, must not
    fill one micro-batch however few tokens they hold."""
    index = read_document_index(open_storage(str(extract)), [0, 1, 2, 3])
    anchors = 6
    blocks_of = {(c.chunk, i): min(anchors, c.candidates[i]) for c in index for i in range(len(c.lengths))}
    unbounded = plan_epoch(index, world_size=1, seed=0, epoch=0, budget=Budget(tokens=10**6, blocks=10**9, anchors=anchors))[0]
    bounded = plan_epoch(index, world_size=1, seed=0, epoch=0, budget=Budget(tokens=10**6, blocks=20, anchors=anchors))[0]
    assert len(unbounded) == 1 and len(bounded) > 1
    for batch in bounded:
        assert sum(blocks_of[d.chunk, d.index] for d in batch) <= 20
    assert sorted((d.chunk, d.index) for b in bounded for d in b) == sorted((d.chunk, d.index) for d in unbounded[0])


def test_batches_hold_one_block_per_anchor_with_in_place_labels(extract):
    storage = open_storage(str(extract))
    chunk = HiddenChunk.decode(storage.get_bytes(hidden_chunk_key(0)), "0")
    index = read_document_index(storage, [0])
    docs = plan_epoch(index, world_size=1, seed=0, epoch=0, budget=tokens_only(10**6))[0][0]
    builder = BatchBuilder(layout=anchor_layout(block_size=4, gamma=7.0), anchors=8, mask_token_id=999, seed=0, layers=LAYERS)
    batch = builder.build(docs, {0: ChunkData.from_bytes(storage.get_bytes(hidden_chunk_key(0)), "0")}, epoch=0)
    assert batch.context_hidden.shape == (chunk.tokens.num_tokens, len(LAYERS) * chunk.hidden_states.shape[-1])
    assert (batch.block_ids[:, 1:] == 999).all() and (batch.loss_weights[:, 0] == 0).all()
    offset = 0
    for doc in docs:
        begin, end = chunk.tokens.cu_seqlens[doc.index : doc.index + 2]
        ids, mask = chunk.tokens.input_ids[begin:end], chunk.tokens.loss_mask[begin:end]
        blocks = (batch.layout.context_start == offset).nonzero().flatten()
        assert 0 < len(blocks) <= 8
        for n in blocks.tolist():
            a = int(batch.layout.anchor[n]) - offset
            assert mask[a] and mask[a + 1] and batch.block_ids[n, 0] == ids[a]
            assert batch.block_positions[n].tolist() == [a, a + 1, a + 2, a + 3]
            for j in range(1, 4):
                inside = a + j < len(ids)
                assert batch.labels[n, j] == (ids[a + j] if inside else 0)
                assert (batch.loss_weights[n, j] > 0) == bool(inside and mask[a + j])
            assert torch.equal(batch.context_hidden[offset + a], chunk.hidden_states[begin + a].flatten())
        offset += len(ids)


@pytest.mark.parametrize("drafter", ["dflash", "dspark"])
def test_each_anchor_layout_labels_its_slots_and_weighs_only_what_it_trains(drafter):
    # One document, two supervised runs: [prompt x3][answer x5][user turn x2][answer x4].
    ids = np.arange(100, 114, dtype=np.int32)
    mask = np.array([0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1], dtype=np.uint8)
    tokens = TokenChunk(input_ids=ids, loss_mask=mask, cu_seqlens=np.array([0, 14]), sample_ids=np.array([0])).validate("hand-made")
    encoded = encode_hidden_chunk(tokens, torch.randn(14, 2, 4).to(torch.bfloat16), layers=[1, 2], model="m", config_hash="h")
    layout = anchor_layout(drafter, block_size=4)
    builder = BatchBuilder(layout=layout, anchors=64, mask_token_id=999, seed=0, layers=[1, 2])
    batch = builder.build([DocumentRef(0, 0, 0, 14)], {0: ChunkData.from_bytes(encoded, "hand-made")}, epoch=0)
    decay = np.array(layout.slot_decay())
    assert batch.layout.anchor.tolist() == anchor_candidates(mask).tolist() == [3, 4, 5, 6, 10, 11, 12]
    for n, a in enumerate(batch.layout.anchor.tolist()):
        assert batch.block_positions[n].tolist() == [a, a + 1, a + 2, a + 3]  # slots sit at anchor + k either way
        for k in range(4):
            label = a + k + layout.label_offset
            inside = label < len(ids)
            assert batch.labels[n, k] == (ids[label] if inside else 0)
            supervised = k >= layout.first_draft and inside and bool(mask[label])
            if layout.contiguous_prefix:  # DSpark trains a block only up to its first unsupervised label
                supervised = supervised and all(mask[j] for j in range(a + layout.label_offset, label + 1))
            assert batch.loss_weights[n, k].item() == pytest.approx(decay[k] if supervised else 0.0)
    if drafter == "dspark":
        # Anchor 6: labels 7, then 8 and 9 (the user turn) unsupervised, 10 supervised again but past the gap.
        assert batch.loss_weights[3].tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0])
    else:
        assert batch.loss_weights[3].tolist() == pytest.approx([0.0, 1.0, 0.0, 0.0])


def test_fp8_chunks_are_dequantized_into_the_same_batch(extract):
    storage = open_storage(str(extract))
    chunk = HiddenChunk.decode(storage.get_bytes(hidden_chunk_key(1)), "1")
    fp8 = encode_hidden_chunk(chunk.tokens, chunk.hidden_states, layers=LAYERS, model="tiny", config_hash="tiny", dtype="float8_e4m3fn")
    docs = plan_epoch(read_document_index(storage, [1]), world_size=1, seed=0, epoch=0, budget=tokens_only(10**6))[0][0]
    builder = BatchBuilder(layout=anchor_layout(block_size=4, gamma=7.0), anchors=8, mask_token_id=999, seed=0, layers=LAYERS)
    exact = builder.build(docs, {1: ChunkData.from_bytes(storage.get_bytes(hidden_chunk_key(1)), "1")}, 0)
    quantized = builder.build(docs, {1: ChunkData.from_bytes(fp8, "1-fp8")}, 0)
    # fp8 stays fp8 on the host (half the bytes over PCIe) and is dequantized where the batch goes.
    assert quantized.context_hidden.dtype == torch.float8_e4m3fn and quantized.context_scale.shape == (quantized.tokens, len(LAYERS))
    on_device = quantized.to(torch.device("cpu"))
    assert on_device.context_hidden.dtype == torch.bfloat16 and on_device.context_scale is None
    assert torch.equal(quantized.block_ids, exact.block_ids)
    torch.testing.assert_close(on_device.context_hidden.float(), exact.context_hidden.float(), rtol=0.07, atol=1e-3)


def rank_cache(storage, directory: Path, max_bytes: int) -> ChunkCache:
    return ChunkCache(storage, directory, max_bytes, Manifest.from_json(storage.get_bytes(MANIFEST_KEY)).chunks)


def test_the_data_order_survives_a_restart_from_the_cursor(extract, tmp_path):
    storage = open_storage(str(extract))
    index = read_document_index(storage, [0, 1, 2, 3])
    plans = [plan_epoch(index, world_size=1, seed=0, epoch=e, budget=tokens_only(700))[0] for e in range(2)]

    def stream() -> BatchStream:
        builder = BatchBuilder(layout=anchor_layout(block_size=4, gamma=7.0), anchors=8, mask_token_id=999, seed=0, layers=LAYERS)
        return BatchStream(plans, rank_cache(storage, tmp_path, 1 << 30), builder)

    def fingerprint(item) -> tuple:
        epoch, step, batch = item
        return epoch, step, batch.block_ids.tolist(), float(batch.context_hidden.float().sum())

    uninterrupted = [fingerprint(item) for item in stream()]
    first = stream()
    iterator = iter(first)
    head = [fingerprint(next(iterator)) for _ in range(len(plans[0]) + 1)]  # into the second epoch
    state = first.state_dict()
    first.close()
    resumed = stream()
    resumed.load_state_dict(state)
    assert head + [fingerprint(item) for item in resumed] == uninterrupted


@pytest.mark.parametrize("micro_batch_tokens", [700, 10**6], ids=["batches-within-chunks", "one-batch-spans-every-chunk"])
def test_a_cache_smaller_than_a_batch_still_streams_every_epoch_exactly(extract, tmp_path, micro_batch_tokens):
    storage = open_storage(str(extract))
    index = read_document_index(storage, [0, 1, 2, 3])
    plans = [plan_epoch(index, world_size=1, seed=0, epoch=e, budget=tokens_only(micro_batch_tokens))[0] for e in range(3)]
    chunk_bytes = storage.stat(hidden_chunk_key(0)).size

    def batches(cache_bytes: int, directory: Path) -> list[tuple]:
        builder = BatchBuilder(layout=anchor_layout(block_size=4, gamma=7.0), anchors=8, mask_token_id=999, seed=0, layers=LAYERS)
        return [(epoch, step, batch.block_ids.tolist(), float(batch.context_hidden.float().sum()))
                for epoch, step, batch in BatchStream(plans, rank_cache(storage, directory, cache_bytes), builder)]

    # A cache of about one chunk keeps one on disk and streams the others through memory, every epoch.
    assert batches(int(chunk_bytes * 1.2), tmp_path / "small") == batches(1 << 30, tmp_path / "large")


# ---- the job ---------------------------------------------------------------------------------


def test_training_refuses_to_start_without_a_manifest(root, extract, tmp_path, caplog):
    output = copy_extract(extract, tmp_path / "run")
    (output / MANIFEST_KEY).unlink()
    spec = write_spec(tmp_path / "dflash.yaml", spec_for(root, output))
    assert main(["-f", str(spec)]) == EXIT_BAD_INPUT
    assert "extract/manifest.json does not exist" in caplog.text and "dflashctl verify" in caplog.text
    assert not (output / "train").exists()


@pytest.fixture
def pinned_threads():
    """THREADS intra-op threads in this process, put back after: a run's weights depend on the
    thread count (reductions split otherwise), so runs compared bit for bit must share it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield THREADS
    torch.set_num_threads(threads)


def test_killed_and_restarted_it_ends_with_the_weights_of_an_uninterrupted_run(root, extract, tmp_path, pinned_threads):
    uninterrupted = copy_extract(extract, tmp_path / "uninterrupted")
    run_in_process(spec_for(root, uninterrupted), tmp_path / "cache-a")

    records = [json.loads(line) for line in (uninterrupted / METRICS_KEY).read_text().splitlines()]
    assert records[-1]["step"] == STEPS
    # It learns the tiny structured data. The tiny target's random LM head (std 0.02, width 64)
    # bounds every logit near +-1.3 after the final norm, so the loss cannot fall far from ln(1024).
    assert records[-1]["loss"] < records[0]["loss"] - 0.2
    assert records[-1]["accuracy"][1] > records[0]["accuracy"][1] + 0.05
    assert all(0.0 <= record["data_wait"] < 1.0 for record in records)  # the loop's wait for its batches, a share of each window
    assert (uninterrupted / PLOT_KEY).read_bytes()[:4] == b"\x89PNG"

    killed = copy_extract(extract, tmp_path / "killed")
    spec = write_spec(tmp_path / "killed.yaml", spec_for(root, killed))
    process = subprocess.Popen(
        [sys.executable, "-m", "dflash_jobs.train", "-f", str(spec)],
        env={**os.environ, "DFLASH_CACHE_DIR": str(tmp_path / "cache-b"), "OMP_NUM_THREADS": str(pinned_threads)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not (killed / step_prefix(5) / "meta.json").exists():
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "train/drafter/config.json").exists(), "the kill came too late to test a restart"

    with pytest.raises(InputError, match=r"other settings \(differs in: train\)"):
        run_in_process(spec_for(root, killed, lr=5e-3), tmp_path / "cache-b")  # another schedule is not a resume
    run_in_process(spec_for(root, killed, checkpoint_every=7), tmp_path / "cache-b")
    expected, got = final_weights(uninterrupted), final_weights(killed)
    assert expected.keys() == got.keys()
    # Every trained weight resumes, the drafter's own final norm among them: trained from 1, not the target's.
    target_norm = TargetCheckpoint(open_storage(str(tiny_target(root)))).read_target_tensors().final_norm
    for other in (torch.ones_like(target_norm), target_norm):
        assert not torch.allclose(expected["norm.weight"], other, atol=1e-4)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_compiled_training_serves_every_micro_batch_shape_from_the_first_graphs(root, extract, tmp_path, monkeypatch):
    """train.compile is on by default on a GPU, where each micro-batch brings its own counts of
    context tokens and blocks. The layers compile with dynamic shapes: the graphs the first step
    compiles serve every later one (a recompile per shape would cost seconds a step, and past
    dynamo's limit silently run eager), and the run follows eager's, step by step, up to rounding."""
    from torch._dynamo.utils import counters

    shapes, graphs, losses = [], [], []
    train_step = Trainer.train_step

    def recording(self, batch):
        shapes.append((batch.context_hidden.shape[0], batch.block_ids.shape[0]))
        out = train_step(self, batch)
        losses.append(float(out.loss))
        graphs.append(counters["stats"]["unique_graphs"])
        return out

    monkeypatch.setattr(Trainer, "train_step", recording)
    eager = copy_extract(extract, tmp_path / "eager")
    run_in_process(spec_for(root, eager, compile=False, activation_checkpointing="none"), tmp_path / "cache-e")
    assert len(set(shapes)) >= 5, shapes  # the run does vary its shapes

    torch._dynamo.reset()
    counters.clear()
    shapes.clear()
    graphs.clear()  # the losses stay: the compiled run's follow the eager run's
    compiled = copy_extract(extract, tmp_path / "compiled")
    run_in_process(spec_for(root, compiled, compile=True), tmp_path / "cache-c")
    assert len(shapes) == STEPS and len(set(shapes)) >= 5
    assert graphs[0] > 0 and set(graphs) == {graphs[0]}, graphs  # compiled in the first step, never again
    expected, got = final_weights(eager), final_weights(compiled)
    eager_losses, compiled_losses = losses[:STEPS], losses[STEPS:]
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=1e-4, atol=0)
    for name in expected:  # 30 Adam steps carry the fused kernels' rounding: 0.5% at most here
        assert (got[name] - expected[name]).norm() <= 0.01 * expected[name].norm(), name


def test_ddp_on_two_gloo_ranks_trains_and_exports(root, extract, tmp_path):
    output = copy_extract(extract, tmp_path / "ddp")
    spec = write_spec(tmp_path / "ddp.yaml", spec_for(root, output, epochs=3))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "-m", "dflash_jobs.train", "-f", str(spec)],
        env={**os.environ, "DFLASH_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "on 2 ranks" in result.stdout and "rank1" in result.stdout
    records = [json.loads(line) for line in (output / METRICS_KEY).read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"]
    config = json.loads((output / "train/drafter/config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == LAYERS
