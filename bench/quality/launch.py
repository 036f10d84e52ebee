"""Starting the product's entry points as their pods do (`python -m dflash_jobs.<step> ...`): every
step is a process of its own, with its own argv, environment and log, and exits with its own code.

On a CPU the import is shared: each step is forked from a server that imported torch, transformers
and the steps' modules once. A CPU run of the benchmark starts some fifty steps; each fresh
interpreter spent 7-15 s importing torch and transformers (more than most tiny steps compute), so
the import was most of the test's time. The server imports them before any thread or device
exists (a forkserver: the benchmark's threads are never forked).

On a GPU every step is a fresh interpreter, exactly `python -m`, nothing inherited: a forked child
cannot use CUDA once its parent has initialised it, and the server's imports did (the GPU size
failed every step with "Cannot re-initialize CUDA in forked subprocess", 2026-12-05), which no CPU
run can see. There the import costs seconds beside steps of minutes, and the steps run side by side.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import runpy
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

PRELOADED = (
    "torch", "transformers", "transformers.models.qwen3_5.modeling_qwen3_5", "safetensors.torch",
    "dflash_jobs.generate.worker", "dflash_jobs.extract.worker", "dflash_jobs.train.trainer", "dflash_jobs.evaluate.evaluator",
)
"""What the CPU server imports once (a module that fails to import is left to the step, which then says why)."""

_context: multiprocessing.context.ForkServerContext | None = None

_reading_exit_codes = threading.Lock()
"""A forked step's exit code is one message on a pipe, and Process.start() polls every earlier child
(multiprocessing's _cleanup) from whichever thread starts a step: a poll there and a join here could
both read a step's pipe, one got the code and the other EOF, which multiprocessing reports as exit
255 (one prepare in three of the tiny size's runs, each of them exiting 0). Starts and the reads
after a step ended take turns; the blocking wait happens outside."""


def step_env(workdir: Path, *, cpu: bool) -> dict[str, str]:
    """The environment a step's interpreter starts in: this process's, its output unbuffered (the log as
    it runs); Python's bytecode written and read under workdir/pycache (PYTHONPYCACHEPREFIX, unless set)
    with PYTHONDONTWRITEBYTECODE dropped: these machines set it and their sites hold no .pyc (the GPU
    machine's torch, the wheels installed there with --no-compile), so every fresh interpreter compiled
    torch's and transformers' sources, 8.4 of an evaluation's 27 s on an H100
    (bench/results/spy-eval-after-16-h100-summary.json), where an image's pip install compiles them once;
    on a CPU one intra-op thread (the matrices are tiny, and on a shared machine a second thread spins
    while it waits, slowing a step many times over)."""
    inherited = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    return {"PYTHONPYCACHEPREFIX": str(workdir / "pycache"), **inherited, "PYTHONUNBUFFERED": "1", **({"OMP_NUM_THREADS": "1"} if cpu else {})}


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
    """In the forked step's process: its environment, its log on stdout and stderr, then the module as `python -m` runs it."""
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


def start(module: str, args: list[str], env: dict[str, str], log: Path, *, fresh: bool = False) -> Callable[[], int]:
    """Starts `python -m module args` with `env`, its output in `log`; returns what waits for its exit
    code. `fresh`: in a new interpreter (a GPU step), else forked from the server (a CPU step)."""
    if fresh:
        with open(log, "w") as file:  # the child holds its own copy of the descriptor
            process = subprocess.Popen([sys.executable, "-m", module, *args], env=env, stdout=file, stderr=subprocess.STDOUT)
        return process.wait
    forked = _server().Process(target=_entry_point, args=(module, args, env, str(log)), name=module)
    with _reading_exit_codes:
        forked.start()

    def wait() -> int:
        multiprocessing.connection.wait([forked.sentinel])  # the step ended: its exit code is in the pipe
        with _reading_exit_codes:
            forked.join()
        return forked.exitcode

    return wait
