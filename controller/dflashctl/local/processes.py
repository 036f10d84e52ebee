"""The processes of local Jobs: each pod's containers and each supervisor run in a process group of
their own, ended together (SIGTERM, then SIGKILL after a grace period).

A pid written to a state file outlives its process: after a reboot, or once pids wrap around, the
kernel gives it to another. So a recorded process is a `ProcessRef`, the pid and the process's
start time, and only a pid that still belongs to a process started at that time is signalled.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

KILL_GRACE_S = 5.0
"""SIGTERM, then SIGKILL after this long: the local terminationGracePeriodSeconds."""
KILL_POLL_S = 0.05
"""How often the grace period checks whether the signalled groups are gone."""
PROC = Path("/proc")

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProcessRef:
    """A process as recorded when it was started: its pid and its start time."""

    pid: int
    started: str | None
    """`start_time(pid)` right after the start; None when it could not be read (it had ended)."""

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        return cls(pid, start_time(pid))

    def is_running(self) -> bool:
        """The pid still belongs to this very process (not ended, not given to another)."""
        return self.started is not None and start_time(self.pid) == self.started


def start_time(pid: int) -> str | None:
    """When the process holding `pid` started, as an opaque string equal only for the same process;
    None when there is no such process.

    Linux: the boot id and the start time in clock ticks since boot (/proc/<pid>/stat, field 22),
    exact across reboots. Elsewhere (macOS): `ps -o lstart`, to the second."""
    if PROC.is_dir():
        try:
            stat = (PROC / str(pid) / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return None
        # The command name (field 2) may hold spaces and parentheses: count fields after its last ')'.
        fields = stat[stat.rindex(")") + 2:].split()
        return f"{_boot_id()}:{fields[19]}"
    result = subprocess.run(["ps", "-o", "lstart=", "-p", str(pid)], capture_output=True, text=True)
    return result.stdout.strip() or None


@functools.cache
def _boot_id() -> str:
    try:
        return (PROC / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    except OSError:
        return ""


def kill_groups(groups: list[ProcessRef | subprocess.Popen]) -> None:
    """Ends the process groups led by these processes together: SIGTERM to all, SIGKILL to what is
    left after the grace period (one by one, eight shards would outlast `delete`'s patience).

    A `Popen` is this process's own child, known to be running until it is reaped. A `ProcessRef`
    read from a state file is signalled only while `is_running()`: a leader that has ended, or whose
    pid is now another process's, leaves its group alone (nothing tells its members from a
    stranger's). Once signalled, the group is followed by its id: the kernel does not hand a group's
    id to a new process while the group has members."""
    alive = [(group.pid, group) for group in groups if _ours(group)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid, _ in alive:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + KILL_GRACE_S
        while alive and time.monotonic() < deadline:
            alive = [(pgid, group) for pgid, group in alive if _group_running(pgid, group)]
            if alive:
                time.sleep(KILL_POLL_S)
        if not alive:
            return


def _ours(group: ProcessRef | subprocess.Popen) -> bool:
    if isinstance(group, subprocess.Popen):
        return group.poll() is None
    now = start_time(group.pid)
    if now is not None and now != group.started:
        log.warning("pid %d is no longer the process that was started (started %s, now %s): not signalled", group.pid, group.started, now)
    return now is not None and now == group.started


def _group_running(pgid: int, group: ProcessRef | subprocess.Popen) -> bool:
    if isinstance(group, subprocess.Popen):
        return group.poll() is None
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
