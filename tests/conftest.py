"""Shared fixtures: a real S3 server on loopback (moto in server mode) and tiny-model helpers."""

from __future__ import annotations

import logging
import socket
import uuid
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _no_leaked_log_handlers():
    """A worker's main called in-process configures the root logger on that test's captured stream;
    the next test would log into a closed stream ("--- Logging error ---" on its stderr)."""
    yield
    root = logging.getLogger()
    for handler in root.handlers[:]:
        if type(handler) is logging.StreamHandler:  # pytest's own handlers are subclasses
            root.removeHandler(handler)


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


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Where the tiny target and extract of the training tests live, built once per session (train_fixtures)."""
    return tmp_path_factory.getbasetemp() / "train-fixtures"


@pytest.fixture(scope="module")
def extract(root) -> Path:
    """The tiny target's real hidden states as extraction and verify leave them; copy it before writing (copy_extract)."""
    from train_fixtures import tiny_extract

    return tiny_extract(root)
