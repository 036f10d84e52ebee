"""The processes of local Jobs: each pod's containers and each supervisor run in a process group of
their own, ended together (SIGTERM, then SIGKILL after a grace period)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from dflashctl.local.state import POLL_S

KILL_GRACE_S = 5.0
"""SIGTERM, then SIGKILL after this long: the local terminationGracePeriodSeconds."""


def kill_groups(groups: list[tuple[int, subprocess.Popen | None]]) -> None:
    """Ends process groups together: SIGTERM to all, SIGKILL to what is left after the grace
    period (one by one, eight shards would outlast `delete`'s patience)."""
    alive = list(groups)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid, _ in alive:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + KILL_GRACE_S
        while alive and time.monotonic() < deadline:
            alive = [(pgid, process) for pgid, process in alive if running(pgid, process)]
            if alive:
                time.sleep(POLL_S)
        if not alive:
            return


def running(pgid: int, process: subprocess.Popen | None) -> bool:
    if process is not None:
        return process.poll() is None
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True

