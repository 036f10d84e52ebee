"""The container's termination message: what `kubectl describe pod` and `dflashctl status` show of
how a pod ended (a failed selfcheck, an extraction shard's summary)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

TERMINATION_LOG = Path("/dev/termination-log")
TERMINATION_LOG_ENV = "DFLASH_TERMINATION_LOG"
"""Where the message goes outside a pod (the local backend, tests)."""
TERMINATION_LIMIT = 4000  # the kubelet keeps at most 4096 bytes


def termination_log_path() -> Path | None:
    """/dev/termination-log in a pod; DFLASH_TERMINATION_LOG elsewhere; else none."""
    if TERMINATION_LOG.exists() and os.access(TERMINATION_LOG, os.W_OK):
        return TERMINATION_LOG
    env = os.environ.get(TERMINATION_LOG_ENV)
    return Path(env) if env else None


def write_termination_message(text: str) -> None:
    path = termination_log_path()
    if path is None:
        return
    try:
        path.write_text(text[:TERMINATION_LIMIT] + "\n")
    except OSError as exc:  # the log line says the same
        log.warning("cannot write the termination message to %s: %s", path, exc)
