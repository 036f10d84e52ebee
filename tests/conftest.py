"""Shared fixtures: a guard on process-wide state, a real S3 server on loopback (moto in server
mode), and the training tests' tiny target and extract."""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import socket
import sys
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from dflash_jobs.architectures import ARCHITECTURE_MODULES

GUARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
UNGUARDED_VARIABLES = {
    "PYTEST_CURRENT_TEST",  # pytest sets it per phase (setup, call, teardown)
    # torch's inductor sets these on its first compile, to values nothing a test does changes
    "TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
}


def _unguarded_path(entry: str) -> bool:
    """setuptools adds its vendored packages to sys.path when first imported (inductor's C++ builder imports it)."""
    return entry.endswith(os.path.join("setuptools", "_vendor"))


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--order", default="collected", metavar="collected|reverse|shuffle:SEED",
        help="run the tests in another order to show the suite does not depend on one: reverse, or shuffled with "
             "SEED (test files shuffled, and the tests within each file; a file's tests stay together, as its "
             "module fixtures are built once)",
    )


def pytest_report_header(config) -> str:
    return f"test order: {config.getoption('--order')}"


def pytest_collection_modifyitems(config, items) -> None:
    order = config.getoption("--order")
    if order == "collected":
        return
    if order == "reverse":
        items.reverse()
        return
    kind, _, seed = order.partition(":")
    if kind != "shuffle" or not seed.isdigit():
        raise pytest.UsageError(f"--order {order!r}: expected collected, reverse or shuffle:SEED (an integer)")
    rng = random.Random(int(seed))
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    groups = list(files.values())
    rng.shuffle(groups)
    for group in groups:
        rng.shuffle(group)
    items[:] = [item for group in groups for item in group]


def process_state() -> dict[str, Any]:
    """What one test could change for every later one in this process. Read before and after every
    test (about 50 microseconds: no copies but os.environ's and sys.path's)."""
    return {
        "torch.get_num_threads()": torch.get_num_threads(),
        "torch.get_num_interop_threads()": torch.get_num_interop_threads(),
        "torch.get_default_dtype()": torch.get_default_dtype(),
        "torch.is_grad_enabled()": torch.is_grad_enabled(),
        "torch.are_deterministic_algorithms_enabled()": (torch.are_deterministic_algorithms_enabled(),
                                                         torch.is_deterministic_algorithms_warn_only_enabled()),
        "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision(),
        "os.getcwd()": os.getcwd(),
        "os.environ": {name: value for name, value in os.environ.items() if name not in UNGUARDED_VARIABLES},
        "sys.path": [entry for entry in sys.path if not _unguarded_path(entry)],
        "signal handlers": {int(number): signal.getsignal(number) for number in GUARDED_SIGNALS},
        "torch.distributed.is_initialized()": torch.distributed.is_available() and torch.distributed.is_initialized(),
    }


def restore_process_state(state: dict[str, Any]) -> None:
    """Puts back what process_state read (all but the inter-op thread count, which torch sets once;
    a process group the test left is destroyed)."""
    torch.set_num_threads(state["torch.get_num_threads()"])
    torch.set_default_dtype(state["torch.get_default_dtype()"])
    torch.set_grad_enabled(state["torch.is_grad_enabled()"])
    enabled, warn_only = state["torch.are_deterministic_algorithms_enabled()"]
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.set_float32_matmul_precision(state["torch.get_float32_matmul_precision()"])
    os.chdir(state["os.getcwd()"])
    for name in os.environ.keys() - state["os.environ"].keys() - UNGUARDED_VARIABLES:
        del os.environ[name]
    os.environ.update(state["os.environ"])
    sys.path[:] = state["sys.path"] + [entry for entry in sys.path if _unguarded_path(entry)]
    for number, handler in state["signal handlers"].items():
        signal.signal(number, handler)
    if torch.distributed.is_initialized() and not state["torch.distributed.is_initialized()"]:
        torch.distributed.destroy_process_group()


def _changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    changes = []
    for key, value in before.items():
        if after[key] == value:
            continue
        if key == "os.environ":
            names = sorted(name for name in value.keys() | after[key].keys() if value.get(name) != after[key].get(name))
            changes.append(f"os.environ ({', '.join(names)})")
        else:
            changes.append(f"{key} {value!r} -> {after[key]!r}")
    return changes


@pytest.fixture(autouse=True)
def _process_state_is_left_as_found(request):
    """Fails the test that leaves process-wide state changed (torch threads, default dtype, grad
    mode, determinism, the environment, the working directory, sys.path, signal handlers, a process
    group, a shared fixture directory), and puts it back: the suite passes in any order, and a leak
    fails its culprit, not a later victim. Fixtures of a wider scope (a module's one_thread) are set up before and torn down
    after this check: they put back what they set themselves."""
    before = process_state()
    shared = {directory: tree_state(directory) for directory in SHARED_DIRECTORIES}
    yield
    after = process_state()
    changes = _changes(before, after)
    if changes:
        restore_process_state(before)
        pytest.fail(f"{request.node.nodeid} left process-wide state changed: {'; '.join(changes)}. Restore what the test "
                    "sets (monkeypatch.setenv / monkeypatch.chdir, or a fixture that puts it back)", pytrace=False)
    written = [directory for directory, state in shared.items() if tree_state(directory) != state]
    for directory in written:
        shutil.rmtree(directory)
        SHARED_DIRECTORIES[directory]()
    if written:
        pytest.fail(f"{request.node.nodeid} wrote into the shared fixture {', '.join(map(str, written))} (built again now): "
                    "write into a copy under tmp_path (train_fixtures.copy_extract)", pytrace=False)


@pytest.fixture(autouse=True)
def _no_leaked_logging_setup():
    """A worker's main called in-process configures the root logger (a handler on that test's
    captured stream, a level) as a pod's entry point should: put both back. A leaked handler logs
    into a closed stream ("--- Logging error ---" on a later test's stderr), a leaked level decides
    what a later test's caplog sees."""
    root = logging.getLogger()
    level = root.level
    yield
    root.setLevel(level)
    for handler in root.handlers[:]:
        if type(handler) is logging.StreamHandler:  # pytest's own handlers are subclasses
            root.removeHandler(handler)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests: the tiny matrices gain nothing from more, which only
    add synchronisation (badly so on a loaded machine). `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """The tiny Qwen3.5 target of train_fixtures, written once under the session's base directory."""
    from train_fixtures import tiny_target

    return tiny_target(tmp_path_factory.getbasetemp() / "train-fixtures")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on 127.0.0.1 for the whole session; yields its endpoint URL.

    The credentials are moto's dummies; the endpoint goes through AWS_ENDPOINT_URL exactly as in a pod."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    patch = pytest.MonkeyPatch()
    patch.setenv("AWS_ACCESS_KEY_ID", "testing")
    patch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    patch.setenv("AWS_ENDPOINT_URL", endpoint)
    try:
        yield endpoint
    finally:
        patch.undo()
        server.stop()


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A fresh, empty bucket on the loopback S3 server; yields its name."""
    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name


def tree_state(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under `directory`: (size, mtime in ns) by relative path."""
    return {str(path.relative_to(directory)): (path.stat().st_size, path.stat().st_mtime_ns) for path in sorted(directory.rglob("*"))}


SHARED_DIRECTORIES: dict[Path, Callable[[], Path]] = {}
"""Fixture directories many tests read (the tiny target, its extract), each with what builds it:
read only, checked after every test (a few dozen stats) and built again if a test wrote there."""


def shared_directory(build: Callable[[], Path]) -> Path:
    directory = build()
    SHARED_DIRECTORIES[directory] = build
    return directory


@pytest.fixture(scope="session")
def root(tmp_path_factory) -> Path:
    """Where the training tests' tiny target lives (train_fixtures.tiny_target(root)), built once per
    session and shared: read only."""
    from train_fixtures import tiny_target

    directory = tmp_path_factory.getbasetemp() / "train-fixtures"
    shared_directory(lambda: tiny_target(directory))
    return directory


@pytest.fixture(scope="session")
def extract(root) -> Path:
    """The tiny target's real hidden states as extraction and verify leave them (extract/chunks,
    done markers, the manifest), shared and read only: a test that trains or writes copies it first
    (train_fixtures.copy_extract)."""
    from train_fixtures import tiny_extract

    return shared_directory(lambda: tiny_extract(root))


@pytest.fixture(scope="session")
def target_of(root) -> Callable[[str], Path]:
    """The tiny target of an architecture (dflash_jobs.architectures.tiny) under the training tests'
    root, built on first use and shared: read only."""
    from train_fixtures import tiny_target

    built: dict[str, Path] = {}

    def target(architecture: str) -> Path:
        if architecture not in built:
            built[architecture] = shared_directory(lambda: tiny_target(root, architecture))
        return built[architecture]

    return target


@pytest.fixture(scope="module", params=list(ARCHITECTURE_MODULES))
def architecture(request) -> str:
    """Each target architecture in turn (dflash_jobs.architectures, each with its tiny target): a test
    that takes it, or a fixture built on it (`each_target`), runs once per architecture."""
    return request.param


ONE_ARCHITECTURE = pytest.mark.parametrize("architecture", ["qwen3_5"], indirect=True)
"""For a test, in a module whose fixtures run on each architecture, of mechanics no architecture
changes (batching, storage, faults, compilation): the hybrid target alone."""


@pytest.fixture(scope="module")
def each_target(architecture, target_of) -> Path:
    """The tiny target of each architecture in turn."""
    return target_of(architecture)
