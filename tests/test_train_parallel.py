"""How the drafter runs on its ranks (train/parallelize.py, train/launch.py): the loss under DDP is
the mean over every rank's supervised slots, activation checkpointing changes memory and nothing
else, a worker's bad-spec or bad-input verdict survives torchrun to fail the Job at once, and a
worker that trained well exits 0, never finalizing its interpreter under the process group's threads."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from dflash_jobs.drafter.model import Drafter
from dflash_jobs.errors import EXIT_BAD_INPUT, EXIT_BAD_SPEC, EXIT_FAILED
from dflash_jobs.spec import TrainSpec, parse_spec
from dflash_jobs.train.launch import exit_worker, pod_code
from dflash_jobs.train.loss import draft_loss
from dflash_jobs.drafter.masks import build_attention
from dflash_jobs.train.parallelize import parallelize
from dflash_jobs.train.trainer import global_loss_normalizer, leave_process_group

from conftest import free_port
from test_drafter import packed_inputs, random_drafter, small_config


def rank_data(rank: int, config):
    """Rank 0: three blocks, most slots supervised; rank 1: one block with few: unequal counts."""
    context_hidden, context_positions, block_ids, block_positions, layout = packed_inputs(config, seed=1 + rank)
    g = torch.Generator().manual_seed(10 + rank)
    labels = torch.randint(0, config.vocab_size - 1, block_ids.shape, generator=g)
    weights = torch.rand(block_ids.shape, generator=g) * (torch.rand(block_ids.shape, generator=g) < (0.9 if rank == 0 else 0.2))
    weights[:, 0] = 0
    if rank == 1:
        weights[1:] = 0  # only the first block supervised
    return (context_hidden, context_positions, block_ids, block_positions, layout), labels, weights


def loss_of(model, drafter: Drafter, inputs, labels, weights, normalizer):
    """As Trainer.train_step computes it: the hidden states through `model` (DDP or not), the loss after."""
    context_hidden, context_positions, block_ids, block_positions, layout = inputs
    attention = build_attention(layout, drafter.config.layer_types, drafter.config.sliding_window, backend="dense")
    hidden = model(context_hidden, context_positions, block_ids, block_positions, attention)
    return draft_loss(hidden, drafter.lm_head, labels, weights, normalizer=normalizer).loss


def ddp_rank(rank: int, port: int, out: str) -> None:
    """A training worker's life in short: the process group, a DDP step, and its end as
    Trainer.close and the worker's entry point end it (a barrier, the group destroyed, exit_worker)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    completed = False
    try:
        config = small_config()
        drafter = random_drafter(config).train()
        model = parallelize(drafter, TrainSpec(activation_checkpointing="none"), device=torch.device("cpu"), world_size=2)
        inputs, labels, weights = rank_data(rank, config)
        loss_of(model, drafter, inputs, labels, weights, global_loss_normalizer(weights, 2)).backward()
        if rank == 0:
            torch.save({n: p.grad for n, p in drafter.named_parameters() if p.requires_grad}, out)
        completed = True
    finally:
        leave_process_group(together=completed)
    exit_worker(0)


def test_ddp_gradient_is_that_of_one_process_on_every_rank_s_data(tmp_path):
    out = str(tmp_path / "ddp-grads.pt")
    mp.start_processes(ddp_rank, args=(free_port(), out), nprocs=2, start_method="spawn")
    ddp = torch.load(out)

    config = small_config()
    data = [rank_data(rank, config) for rank in range(2)]
    assert data[0][2].sum() > 5 * data[1][2].sum() > 0  # really unequal

    def one_process_grads(normalizers):
        drafter = random_drafter(config).train()
        for (inputs, labels, weights), normalizer in zip(data, normalizers):
            loss_of(drafter, drafter, inputs, labels, weights, normalizer).backward()
        return {n: p.grad for n, p in drafter.named_parameters() if p.requires_grad}

    total = sum(weights.sum() for _, _, weights in data)
    everything = one_process_grads([total, total])  # the mean over all supervised slots, in one process
    for name, grad in everything.items():
        torch.testing.assert_close(ddp[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # Each rank normalising by its own sum, as before, gives another gradient: the test can tell.
    per_rank = one_process_grads([2 * weights.sum() for _, _, weights in data])
    assert any(not torch.allclose(per_rank[n], g, rtol=1e-3, atol=1e-6) for n, g in everything.items())


@pytest.mark.parametrize("mode", ["mlp", "layers"])
def test_activation_checkpointing_changes_memory_not_the_loss_gradients_or_names(mode):
    config = small_config()
    inputs, labels, weights = rank_data(0, config)
    plain = random_drafter(config).train()
    checkpointed = random_drafter(config).train()
    parallelize(checkpointed, TrainSpec(activation_checkpointing=mode), device=torch.device("cpu"), world_size=1)
    assert list(checkpointed.state_dict()) == list(plain.state_dict())  # checkpoints and exports unchanged
    checkpointed.load_state_dict(plain.state_dict())
    losses = [loss_of(m, m, inputs, labels, weights, None) for m in (plain, checkpointed)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1])
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("compile", [None, True])
def test_parallelize_applies_what_the_spec_resolves_to_on_the_device(compile):
    """On a CPU an unset compile is off and auto checkpointing is mlp; compile: true compiles
    every layer and keeps every activation (auto: none)."""
    drafter = random_drafter(small_config())
    parallelize(drafter, TrainSpec(compile=compile), device=torch.device("cpu"), world_size=1)
    for layer in drafter.layers:
        assert (layer._compiled_call_impl is not None) is bool(compile)
        assert isinstance(layer.mlp, CheckpointWrapper) is (not compile)


def test_the_pod_exits_with_the_workers_final_verdict():
    assert pod_code([EXIT_BAD_SPEC]) == EXIT_BAD_SPEC
    assert pod_code([EXIT_FAILED, EXIT_BAD_INPUT]) == EXIT_BAD_INPUT
    assert pod_code([EXIT_BAD_INPUT, EXIT_BAD_SPEC]) == EXIT_BAD_SPEC
    assert pod_code([1, -9]) == EXIT_FAILED  # a crash or a kill: retried
    with pytest.raises(Exception, match="micro_batch_blocks"):
        parse_spec({"name": "x", "backend": "local", "target": {"model": "/m"}, "data": {"source": "/d"}, "output": "/o",
                    "train": {"anchors": 512, "micro_batch_blocks": 256}})


FINALIZATION_PROBE = """import os, sys, threading


def _record_threads():
    # threading's exit hook runs as the interpreter finalizes; a process that ends by os._exit never gets here.
    tasks = "/proc/self/task"
    threads = sorted(open(f"{tasks}/{task}/comm").read().strip() for task in os.listdir(tasks))
    who = f"rank{os.environ['RANK']}" if "RANK" in os.environ else "other"
    with open(os.path.join(os.environ["DFLASH_TEST_FINALIZED"], f"{who}-{os.getpid()}"), "w") as f:
        f.write(" ".join(sys.argv) + "\\n" + " ".join(threads))


threading._register_atexit(_record_threads)
"""
"""A sitecustomize for every Python process of a pod: a file per process whose interpreter
finalizes, naming the threads that still ran then."""
COLLECTIVE_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")
"""The C++ threads of a gloo process group (by their names in /proc)."""


@pytest.mark.slow
def test_a_two_rank_training_pod_ends_with_exit_0_and_no_worker_finalizes_under_the_group_s_threads(root, extract, tmp_path, monkeypatch):
    """Issue 43, item 3: the rendered train Job on two CPU ranks (gloo, DDP). DDP keeps the process
    group and its C++ threads alive past destroy_process_group; a worker whose interpreter finalizes
    under them can die by SIGABRT at exit (a thread taking the GIL then is ended inside a C++
    destructor), which fails a pod that trained well. Every worker must end without finalizing, its
    last log line written."""
    from dflashctl.local.backend import LocalBackend
    from dflashctl.render import render_selection
    from train_fixtures import copy_extract, tiny_target, train_spec_dict

    probe, finalized = tmp_path / "probe", tmp_path / "finalized"
    probe.mkdir()
    finalized.mkdir()
    (probe / "sitecustomize.py").write_text(FINALIZATION_PROBE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(probe), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("DFLASH_TEST_FINALIZED", str(finalized))
    output = copy_extract(extract, tmp_path / "run")
    spec = train_spec_dict(tiny_target(root), output, gpus_per_node=2, epochs=1)
    spec["local"] = {"workdir": str(tmp_path / "work")}
    spec = parse_spec(spec)
    monkeypatch.chdir(tmp_path)
    backend = LocalBackend(spec)
    objects = render_selection(spec, "train")
    backend.submit(objects)
    status = backend.wait(objects[-1]["metadata"]["name"], timeout=600)
    log = list(backend.logs(objects[-1]["metadata"]["name"], 0))
    assert status.complete and status.shards[0].attempts == 1, (status.failure_message, log[-20:])
    assert (output / "train" / "drafter" / "config.json").is_file()
    assert any("drafter exported to" in line for line in log), log[-20:]  # rank 0's last line, flushed before its exit
    records = {path.name: path.read_text().split("\n") for path in finalized.iterdir()}
    assert any(name.startswith("other") for name in records), records  # the probe runs in the pod's processes (torchrun's own finalizes)
    under_threads = {name: threads for name, (_, threads) in records.items()
                     if name.startswith("rank") and any(thread in threads.split() for thread in COLLECTIVE_THREADS)}
    assert under_threads == {}


@pytest.mark.slow
@pytest.mark.parametrize("component", ["train", "eval"])
def test_a_bad_spec_or_input_in_the_rendered_pod_fails_the_job_at_once(component, root, extract, tmp_path, monkeypatch):
    """The rendered Job itself, on the local backend: training under torchrun with a mask token the
    target does not have (a spec error found at run time), evaluation of a run with no drafter (bad
    input). Each must fail the Job through its podFailurePolicy on the first attempt, not after
    backoffLimit retries."""
    from dflashctl.local.backend import LocalBackend
    from dflashctl.render import render_selection
    from train_fixtures import copy_extract, tiny_target, train_spec_dict

    output = copy_extract(extract, tmp_path / "run")
    spec = train_spec_dict(tiny_target(root), output, mask_token_id=10**6 if component == "train" else None)
    spec["local"] = {"workdir": str(tmp_path / "work")}
    spec = parse_spec(spec)
    monkeypatch.chdir(tmp_path)
    backend = LocalBackend(spec)
    objects = render_selection(spec, component)
    backend.submit(objects)
    status = backend.wait(objects[-1]["metadata"]["name"], timeout=300)
    assert status.failed_terminally and status.failure_message.startswith("PodFailurePolicy"), status.failure_message
    expected = EXIT_BAD_SPEC if component == "train" else EXIT_BAD_INPUT
    assert f"exit code {expected}" in status.failure_message
    assert status.shards[0].attempts == 1
