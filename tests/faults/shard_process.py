"""Extraction shards as real processes that a test can SIGKILL at any moment.

Starting `python -m dflash_jobs.extract` costs seconds of imports (torch, transformers) per start,
too much for dozens of kills. So shards are forked from a zygote: multiprocessing's fork server
imports this module (and with it torch, transformers and the worker) once, then forks one process
per shard attempt, which runs the real entry point `dflash_jobs.extract.__main__.main`. A fork of a
process that never ran a parallel op is a clean process: SIGKILL ends it like a pod's OOM-kill.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

import torch

_context = multiprocessing.get_context("forkserver")
# Installed modules only: the fork server does not get the tests' sys.path (its children do).
_context.set_forkserver_preload(["torch", "transformers.models.qwen3_5.modeling_qwen3_5", "dflash_jobs.extract.worker"])


def _run_shard(spec: str, shard: int, env: dict[str, str], log: str) -> None:
    """The body of one shard process: its output to `log`, the real entry point, its exit code."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)  # the zygote's environment is the one it started with
    torch.set_num_threads(1)  # the reference run too: identical shapes and threads give identical bytes
    from dflash_jobs.extract.__main__ import main

    code = main(["-f", spec, "--shard", str(shard)])
    sys.stdout.flush()
    os._exit(code)


def start_shard(spec: Path, shard: int, *, env: dict[str, str], log: Path) -> multiprocessing.Process:
    """Starts shard `shard` of the run in `spec`; `env` is its whole relevant environment."""
    process = _context.Process(target=_run_shard, args=(str(spec), shard, env, str(log)), daemon=True)
    process.start()
    return process


def _nothing() -> None:
    os._exit(0)


def warm_zygote() -> None:
    """Starts the fork server (its imports take seconds) so that timings of shard attempts exclude it."""
    process = _context.Process(target=_nothing, daemon=True)
    process.start()
    process.join()
