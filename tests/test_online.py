"""Online states (train.states: online): the target run inside the training step gives the very states
extraction stores, and a drafter trained on them equals one trained on the stored states.

On each target architecture (Qwen3.5/3.6 and a dense Llama), from the same token chunks: the extract
worker stores the states of the bf16 target (verify writes the manifest), and the training Job runs
once on them (stored) and once with the target in the training step (online), same seed and steps.
Exactness is asked of both at their strictest: the online states equal the stored rows bit for bit,
and the two drafters' weights are equal bit for bit (no tolerance: the same states in the same order
through the same kernels on one thread leave nothing to differ). For the states to be computed alike,
each sample runs in a row of its own, padded alike (extract.token_budget under every sample's
length): the row layout is the one thing both paths must share (`capture/batching.py`), as
extraction's own batches, packed or padded, differ from an unbatched forward only by rounding.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cli_runner import cli
from dflash_jobs.errors import EXIT_BAD_INPUT, EXIT_OK, IntegrityError
from dflash_jobs.extract.progress import Summary
from dflash_jobs.extract.worker import build_worker
from dflash_jobs.formats import DATASET_KEY, ChunkInfo, DatasetIndex, TokenChunk, hidden_chunk_key, token_chunk_key
from dflash_jobs.spec import parse_spec
from dflash_jobs.storage import open_storage
from dflash_jobs.train.__main__ import main as train_main
from dflash_jobs.train.data import BatchBuilder, DocumentRef, TargetInput
from dflash_jobs.train.online import InFlightChecks
from dflash_jobs.train.states import TargetStates
from train_fixtures import ARCHITECTURES, CHUNKS, LAYERS, tiny_extract, tiny_target, train_spec_dict, write_spec

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

MICRO_BATCH = 1024
TOKEN_BUDGET = 16
"""Under every tiny chat's length: each sample a row of its own (the planner never joins two above it)."""


def token_run(root: Path, output: Path, architecture: str) -> Path:
    """A run directory holding prepare's output alone (token chunks and tokens/dataset.json)."""
    source = tiny_extract(root, architecture=architecture)
    shutil.copytree(source / "tokens", output / "tokens")
    storage = open_storage(str(output))
    chunks = [TokenChunk.decode(storage.get_bytes(token_chunk_key(c)), "tiny") for c in range(CHUNKS)]
    infos = [ChunkInfo(id=c, path=token_chunk_key(c), samples=t.num_samples, tokens=t.num_tokens) for c, t in enumerate(chunks)]
    index = DatasetIndex(samples=sum(i.samples for i in infos), tokens=sum(i.tokens for i in infos), vocab_size=1000, chunks=infos)
    storage.put_bytes(DATASET_KEY, index.to_json().encode())
    return output


def spec_dict(target: Path, output: Path, states: str) -> dict:
    spec = train_spec_dict(target, output, epochs=1, checkpoint_every=100, states=states, micro_batch_tokens=MICRO_BATCH)
    spec["extract"] = {"shards": 1, "token_budget": TOKEN_BUDGET, "pad_multiple": 16}
    return spec


@pytest.fixture(params=ARCHITECTURES)
def runs(request, root, tmp_path, monkeypatch, capfd):
    """(spec dict, stored run, online run) of one architecture: the stored run extracted and verified."""
    architecture = request.param
    target = tiny_target(root, architecture)
    stored = token_run(root, tmp_path / "stored", architecture)
    online = tmp_path / "online"
    shutil.copytree(stored, online)
    spec = parse_spec(spec_dict(target, stored, "stored"))
    assert all(c.samples and c.tokens / c.samples > TOKEN_BUDGET for c in DatasetIndex.from_json((stored / DATASET_KEY).read_text()).chunks)
    worker = build_worker(spec, 0, summary=Summary(shard=0, shards=1))
    try:
        worker.run()
    finally:
        worker.close()
    spec_file = write_spec(tmp_path / "stored.yaml", spec_dict(target, stored, "stored"))
    code, out, err = cli(monkeypatch, capfd, "verify", "-f", str(spec_file))
    assert code == EXIT_OK, out + err
    return target, stored, online


def test_online_states_equal_the_stored_rows_bit_for_bit(runs):
    target, stored, online = runs
    spec = parse_spec(spec_dict(target, online, "online"))
    states = TargetStates(spec, open_storage(str(online)), torch.device("cpu"))
    source = states.source([[[DocumentRef(0, 0, 0, 1)]]], Path("unused"), 0)
    chunk = source.open(0)
    lengths = chunk.tokens.lengths.tolist()
    fits = int(np.searchsorted(np.cumsum(lengths), MICRO_BATCH, side="right"))  # the first documents, as one micro-batch
    documents = [DocumentRef(0, i, int(chunk.tokens.sample_ids[i]), lengths[i]) for i in range(fits)]
    builder = BatchBuilder(layout=spec.train.layout, anchors=8, mask_token_id=999, seed=0, layers=states.layers, context=states.context())
    batch = states.fill(builder.build(documents, {0: chunk}, epoch=0), step=1)
    states.check()
    with safe_open(stored / hidden_chunk_key(0), "pt") as f:
        expected = f.get_tensor("hidden_states")  # [T, L, d], the chunk's documents in order, as the batch holds them
    assert batch.context_hidden.dtype == expected.dtype == torch.bfloat16
    expected = expected[: batch.tokens]
    assert len(documents) > 1 and torch.equal(batch.context_hidden.view(expected.shape), expected)
    assert expected.abs().amax() > 0


def test_a_drafter_trained_online_equals_one_trained_on_stored_states(runs, caplog):
    target, stored, online = runs
    with caplog.at_level(logging.INFO):
        assert train_main(["-f", str(write_spec(stored.parent / "s.yaml", spec_dict(target, stored, "stored")))]) == EXIT_OK
        assert train_main(["-f", str(write_spec(online.parent / "o.yaml", spec_dict(target, online, "online")))]) == EXIT_OK
    assert "online states: the target" in caplog.text
    assert re.search(r"tok/s, [\d.]+ TFLOP/s, waiting for data \d+% \| eta", caplog.text)  # no MFU on a CPU: no known peak
    assert not (online / "extract").exists()  # nothing stored but checkpoints, metrics and the drafter
    first, second = (load_file(run / "train/drafter/model.safetensors") for run in (stored, online))
    assert first.keys() == second.keys() and first
    for name in first:
        assert torch.equal(first[name], second[name]), name
    steps = [json.loads(line)["step"] for line in (online / "train/metrics.jsonl").read_text().splitlines()]
    assert steps and steps == [json.loads(line)["step"] for line in (stored / "train/metrics.jsonl").read_text().splitlines()]

    # The stored run's checkpoint resumes under online states (the same chunks, the same order): nothing left to train.
    with caplog.at_level(logging.INFO):
        assert train_main(["-f", str(write_spec(stored.parent / "so.yaml", spec_dict(target, stored, "online")))]) == EXIT_OK
    assert f"resumed from checkpoint step {steps[-1]}" in caplog.text
    again = load_file(stored / "train/drafter/model.safetensors")
    assert all(torch.equal(first[name], again[name]) for name in first)


def test_a_target_that_gives_zeros_fails_the_training_job_as_bad_input(root, tmp_path, caplog):
    broken = tmp_path / "broken-target"
    shutil.copytree(tiny_target(root), broken)
    for weights in broken.glob("*.safetensors"):
        save_file({name: torch.zeros_like(tensor) for name, tensor in load_file(weights).items()}, weights, metadata={"format": "pt"})
    run = token_run(root, tmp_path / "run", "qwen3_5")
    with caplog.at_level(logging.ERROR):
        assert train_main(["-f", str(write_spec(tmp_path / "o.yaml", spec_dict(broken, run, "online")))]) == EXIT_BAD_INPUT
    assert "online states of step" in caplog.text and "all-zero hidden states for sample" in caplog.text
    assert not (run / "train/drafter").exists()
    assert not list((run / "train").glob("checkpoints/*/*")) if (run / "train/checkpoints").exists() else True


def test_in_flight_checks_name_the_step_the_sample_and_what_failed():
    def inputs(ids, lengths, samples):
        return TargetInput(torch.tensor(ids), torch.tensor(lengths), samples, [])

    checks = InFlightChecks()
    good = torch.ones(5, 2, 4)
    checks.add(1, inputs([1, 2, 3, 4, 5], [2, 3], [10, 11]), torch.tensor([1, 2, 3, 4, 5]), good, None)
    checks.check()  # clean: nothing raised, nothing pending
    assert checks.pending == []

    nan = good.clone()
    nan[3, 1, 2] = float("nan")
    checks.add(2, inputs([1, 2, 3, 4, 5], [2, 3], [10, 11]), torch.tensor([1, 2, 3, 4, 5]), good, None)
    checks.add(3, inputs([1, 2, 3, 4, 5], [2, 3], [20, 21]), torch.tensor([1, 2, 3, 4, 5]), nan, None)
    with pytest.raises(IntegrityError, match=r"step 3: non-finite hidden states for sample 21"):
        checks.check()

    final = torch.ones(3, 2)
    final[1:] = 0  # the second document's rows
    checks.add(4, inputs([1, 2, 3], [1, 2], [30, 31]), torch.tensor([1, 9, 3]), torch.ones(3, 1, 2), final)
    with pytest.raises(IntegrityError, match=r"step 4: token ids differ from the input, all-zero final hidden states for sample 31"):
        checks.check()
    np.testing.assert_equal(len(checks.pending), 0)


def test_an_online_run_on_an_output_holding_stored_states_is_refused_and_nothing_is_touched(root, tmp_path, monkeypatch, capfd):
    """Training online would make again what the output holds: `dflashctl run` exits 2 before any Job and
    names both ways out; the stored chunks and their manifest stay as they were."""
    from dflash_jobs.formats import MANIFEST_KEY

    output = tmp_path / "run"
    shutil.copytree(tiny_extract(root), output)
    before = sorted((p.relative_to(output), p.stat().st_size) for p in output.rglob("*") if p.is_file())
    spec = spec_dict(tiny_target(root), output, "online")
    spec["local"] = {"workdir": str(tmp_path / "work"), "device": "cpu"}
    open_storage(str(output)).put_bytes(DATASET_KEY, DatasetIndex(samples=1, tokens=1, vocab_size=1, chunks=[]).to_json().encode())
    code, out, err = cli(monkeypatch, capfd, "run", "-f", str(write_spec(tmp_path / "online.yaml", spec)))
    assert code == 2, out + err
    assert "train.states" in err and "verified chunks of stored states" in err and "a new prefix" in err
    assert (output / MANIFEST_KEY).exists() and not (tmp_path / "work" / "jobs").joinpath("tiny-train-train").exists()
    after = sorted((p.relative_to(output), p.stat().st_size) for p in output.rglob("*") if p.is_file() and "extract" in str(p.relative_to(output)))
    assert after == [entry for entry in before if "extract" in str(entry[0])]
