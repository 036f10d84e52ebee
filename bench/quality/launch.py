"""Starting the product's entry points as their pods do (`python -m dflash_jobs.<step> ...`), minus
the import: every step is a process of its own, forked from a server that imported torch,
transformers and the steps' modules once.

A CPU run of the benchmark starts some forty steps; each fresh interpreter spent 7-15 s importing
torch and transformers (more than most tiny steps compute), so the import was most of the test's
time. The step still runs in its own process, from the module's own `__main__` with its own
argv, environment and log, and exits with its own code; only the imports are shared, made before
any thread or device existed (a forkserver: the benchmark's threads are never forked).
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys
from pathlib import Path
from typing import Callable

PRELOADED = (
    "torch", "transformers", "transformers.models.qwen3_5.modeling_qwen3_5", "safetensors.torch",
    "dflash_jobs.generate.worker", "dflash_jobs.extract.worker", "dflash_jobs.train.trainer", "dflash_jobs.evaluate.evaluator",
)
"""What the server imports once (a module that fails to import is left to the step, which then says why)."""

_context: multiprocessing.context.ForkServerContext | None = None


def _server() -> multiprocessing.context.ForkServerContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(list(PRELOADED))
    return _context


def stop() -> None:
    """Stops the server, if one was started: the benchmark's run leaves its caller's process as it
    found it (a test that calls it in-process, a later forkserver user with other modules to preload)."""
    global _context
    if _context is not None:
        from multiprocessing import forkserver

        forkserver._forkserver._stop()  # CPython's own way (its test suite's); no public one exists
        _context = None


def _entry_point(module: str, args: list[str], env: dict[str, str], log: str) -> None:
    """In the step's process: its environment, its log on stdout and stderr, then the module as `python -m` runs it."""
    os.environ.clear()
    os.environ.update(env)
    with open(log, "w") as file:
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
    if "OMP_NUM_THREADS" in env:
        # The server's torch read the variable at its import, before this step's environment existed.
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def start(module: str, args: list[str], env: dict[str, str], log: Path) -> Callable[[], int]:
    """Starts `python -m module args` with `env`, its output in `log`; returns what waits for its exit code."""
    process = _server().Process(target=_entry_point, args=(module, args, env, str(log)), name=module)
    process.start()

    def wait() -> int:
        process.join()
        return process.exitcode

    return wait
