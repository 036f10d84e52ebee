"""A local Job on disk: where its files live, the Job as submitted and its rules, and its state.

The supervisor (supervisor.py) writes the state; the backend (backend.py), in this process or
another, reads it. Every write is atomic, so a reader never sees half a file.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflashctl.backend import parse_indexes
from dflashctl.errors import RunFailed
from dflashctl.local.processes import ProcessRef

DEFAULT_BACKOFF_LIMIT = 6
"""The Job's backoffLimit when the manifest sets none (the Kubernetes default)."""
POLL_S = 0.1
"""How often the supervisor checks its pods, and `wait` / `logs --follow` the state and log files."""


# ---- where things live under the workdir ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JobFiles:
    """The files of one Job under the workdir."""

    workdir: Path
    name: str

    @property
    def dir(self) -> Path:
        return self.workdir / "jobs" / self.name

    @property
    def job(self) -> Path:
        """The manifest and how its volumes map to local paths; written once at submit."""
        return self.dir / "job.json"

    @property
    def state(self) -> Path:
        """Written by the supervisor on every change: conditions and one entry per index."""
        return self.dir / "state.json"

    @property
    def lock(self) -> Path:
        """Held (flock) by the living supervisor."""
        return self.dir / "supervisor.lock"

    @property
    def pid(self) -> Path:
        """The supervisor's pid and start time (JSON)."""
        return self.dir / "supervisor.pid"

    @property
    def supervisor_log(self) -> Path:
        return self.dir / "supervisor.log"

    @property
    def logs(self) -> Path:
        return self.workdir / "logs" / self.name

    def pod_log(self, index: int, attempt: int) -> Path:
        return self.logs / f"{index}-{attempt}.log"

    def pod_dir(self, pod: str) -> Path:
        """The emptyDir volumes of one pod."""
        return self.workdir / "pods" / pod


def write_json(path: Path, data: Any) -> None:
    """Atomic: readers in other processes never see half a file."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(temp, path)


def read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def try_lock(path: Path, *, shared: bool = False, patience_s: float = 0.0) -> int | None:
    """An fd holding the lock on `path`, or None when another process holds it (still, after
    `patience_s`: a status probe holds it for an instant)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + patience_s
    while True:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(POLL_S)


def holds(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd`: not deleted, and not replaced by another
    file of that name (the same device and inode)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def record_supervisor(files: JobFiles, pid: int) -> None:
    """supervisor.pid: the supervisor's pid and start time (written by its starter and by itself)."""
    process = ProcessRef.of(pid)
    write_json(files.pid, {"pid": process.pid, "started": process.started})


def supervisor_process(files: JobFiles) -> ProcessRef:
    """The running supervisor, from supervisor.pid; its starter writes the file a moment after the
    start, so a missing file, or one naming a process that no longer runs, is read again for a while."""
    deadline = time.monotonic() + 5.0
    while True:
        recorded = read_json(files.pid)
        if isinstance(recorded, dict):  # a bare pid, as older versions wrote it, cannot be verified
            process = ProcessRef(recorded["pid"], recorded["started"])
            if process.is_running():
                return process
        if time.monotonic() >= deadline:
            raise RunFailed(
                f"the supervisor of {files.name} holds its lock but {files.pid} does not name a running process ({recorded})",
                "Kill it by hand (`pgrep -f dflashctl.local.supervisor`)",
            )
        time.sleep(POLL_S)


def supervisor_alive(files: JobFiles) -> bool:
    # A shared probe: two probes never mistake each other for a supervisor.
    fd = try_lock(files.lock, shared=True)
    if fd is None:
        return True
    os.close(fd)
    return False


@dataclass(frozen=True, slots=True)
class JobRecord:
    """job.json: the Job as submitted, and what its pods need on this machine."""

    manifest: dict[str, Any]
    volumes: dict[str, str | None]
    """Volume name -> the local directory behind it; None: an emptyDir, a fresh directory per pod."""
    cwd: str
    """Where `submit` ran: relative paths of the spec (output, data.source) resolve from there."""
    parallelism_cap: int | None
    """local.parallelism."""
    cores: int | None = None
    """local.cores: the cores the Job's parallel pods share, whatever the environment says (None: this machine's)."""

    @classmethod
    def load(cls, files: JobFiles) -> JobRecord | None:
        data = read_json(files.job)
        return None if data is None else cls(**data)

    def save(self, files: JobFiles) -> None:
        write_json(files.job, asdict(self))

    @property
    def pod_spec(self) -> dict[str, Any]:
        return self.manifest["spec"]["template"]["spec"]

    @property
    def containers(self) -> list[dict[str, Any]]:
        """initContainers, then containers: the order a pod runs them in."""
        return [*self.pod_spec.get("initContainers", []), *self.pod_spec["containers"]]

    def policy(self) -> JobPolicy:
        return JobPolicy.of(self.manifest, parallelism_cap=self.parallelism_cap)


# ---- the Job's rules ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JobPolicy:
    """The parts of a Job's spec that decide when pods run, retry, and how the Job ends."""

    indexed: bool
    completions: int
    parallelism: int
    backoff_limit: int
    backoff_limit_per_index: int | None
    max_failed_indexes: int | None
    failure_rules: list[dict[str, Any]]
    success_rules: list[dict[str, Any]]

    @classmethod
    def of(cls, job: dict[str, Any], *, parallelism_cap: int | None) -> JobPolicy:
        spec = job["spec"]
        completions = spec.get("completions", 1)
        parallelism = min(spec.get("parallelism", 1), completions)
        if parallelism_cap is not None:
            parallelism = min(parallelism, parallelism_cap)
        return cls(
            indexed=spec.get("completionMode") == "Indexed",
            completions=completions,
            parallelism=max(parallelism, 1),
            backoff_limit=spec.get("backoffLimit", DEFAULT_BACKOFF_LIMIT),
            backoff_limit_per_index=spec.get("backoffLimitPerIndex"),
            max_failed_indexes=spec.get("maxFailedIndexes"),
            failure_rules=(spec.get("podFailurePolicy") or {}).get("rules", []),
            success_rules=(spec.get("successPolicy") or {}).get("rules", []),
        )

    def failure_action(self, container: str, exit_code: int) -> tuple[str, int | None]:
        """(action, rule index) of the first podFailurePolicy rule matching a container's exit code.

        Rules on pod conditions never match: a local process is not preempted or evicted."""
        for number, rule in enumerate(self.failure_rules):
            on_exit = rule.get("onExitCodes")
            if not on_exit or on_exit.get("containerName", container) != container:
                continue
            listed = exit_code in on_exit.get("values", [])
            if listed == (on_exit.get("operator", "In") == "In"):
                return rule["action"], number
        return "Count", None

    def success_met(self, succeeded: set[int]) -> bool:
        """successPolicy: any rule whose succeededIndexes (and succeededCount) are satisfied."""
        for rule in self.success_rules:
            wanted = parse_indexes(rule["succeededIndexes"]) if "succeededIndexes" in rule else set(range(self.completions))
            reached = wanted & succeeded
            if "succeededCount" in rule and len(reached) >= rule["succeededCount"]:
                return True
            if "succeededCount" not in rule and reached == wanted:
                return True
        return False


# ---- the state the supervisor writes ----------------------------------------------------------


@dataclass(slots=True)
class IndexState:
    index: int
    phase: str = "Missing"
    failures: int = 0
    """Failed pods counted against the backoff limit."""
    attempts: int = 0
    """Pods started for this index (the next one's log is <index>-<attempts>.log)."""
    pod: str | None = None
    pid: int | None = None
    """The running container's process (the leader of its group) and its start time."""
    pid_started: str | None = None
    exit_reason: str | None = None

    @property
    def process(self) -> ProcessRef | None:
        return None if self.pid is None else ProcessRef(self.pid, self.pid_started)

    @process.setter
    def process(self, process: ProcessRef | None) -> None:
        self.pid, self.pid_started = (None, None) if process is None else (process.pid, process.started)


@dataclass(slots=True)
class JobState:
    shards: list[IndexState]
    conditions: dict[str, str] = field(default_factory=dict)
    failed_pods: int = 0
    started_at: float | None = None
    """When the supervisor first started the Job (the Job's status.startTime), Unix time."""

    def to_json(self) -> dict[str, Any]:
        return {
            "conditions": self.conditions,
            "failed_pods": self.failed_pods,
            "started_at": self.started_at,
            "shards": [asdict(shard) for shard in self.shards],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobState:
        return cls([IndexState(**s) for s in data["shards"]], data["conditions"], data["failed_pods"], data["started_at"])

    @classmethod
    def load(cls, files: JobFiles) -> JobState | None:
        """state.json, or None before the supervisor first wrote it."""
        saved = read_json(files.state)
        return None if saved is None else cls.from_json(saved)

    @property
    def finished(self) -> bool:
        return "Complete" in self.conditions or "Failed" in self.conditions
