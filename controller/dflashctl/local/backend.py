"""The local backend: the Backend interface (backend.py of dflashctl) over local Jobs.

`submit` writes a Job's record and starts its supervisor (supervisor.py); status, wait and logs
read what the supervisor writes (state.py), from this process or another. See the package's
docstring for what of a Job the local backend honours.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_jobs.errors import InputError
from dflash_jobs.spec import is_s3

from dflashctl.backend import JobStatus, LogQuery, RunObject, ShardStatus, run_objects_of, submit_outcome
from dflashctl.errors import RunFailed, WaitTimeout
from dflashctl.local.pod import CONTAINER_HEADER, NODE_NAME, check_container
from dflashctl.local.processes import kill_groups
from dflashctl.local.state import (
    POLL_S,
    IndexState,
    JobFiles,
    JobRecord,
    JobState,
    read_json,
    record_supervisor,
    supervisor_alive,
    supervisor_process,
    try_lock,
    write_json,
)

if TYPE_CHECKING:
    from dflash_jobs.spec import RunSpec

DELETE_TIMEOUT_S = 30.0


class LocalBackend:
    """Jobs as local processes, state under `local.workdir` (DESIGN section 8)."""

    def __init__(self, spec: RunSpec) -> None:
        self.workdir = Path(spec.local.workdir).resolve()
        self.parallelism_cap = spec.local.parallelism
        self.model = spec.target.model
        # Claims every pod of a node shares, each one directory here: the model cache, the kernel cache.
        self.shared_claims = {claim for claim in (spec.cluster.model_cache, spec.cluster.kernel_cache) if claim}

    # -- submit --

    def submit(self, objects: list[dict], *, force: bool = False) -> dict[str, str]:
        jobs = {}
        for obj in objects:
            kind, name = obj["kind"], obj["metadata"]["name"]
            if kind == "Job":
                jobs[name] = self._submit_job(obj, force=force)
                continue
            path = self._object_path(kind, name)
            existing = read_json(path)
            submit_outcome(obj, existing, force=force)  # a different spec is refused without --force
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, obj)
            if kind == "ConfigMap":
                self._write_configmap(obj)
        return jobs

    def find(self, kind: str, name: str) -> dict | None:
        if kind == "Job":
            record = JobRecord.load(JobFiles(self.workdir, name))
            return None if record is None else record.manifest
        return read_json(self._object_path(kind, name))

    def run_objects(self, run: str | None = None) -> list[RunObject]:
        jobs = [JobRecord.load(JobFiles(self.workdir, path.name)) for path in sorted((self.workdir / "jobs").glob("*"))]
        others = [read_json(path) for path in sorted((self.workdir / "objects").glob("*/*.json"))]
        return run_objects_of([record.manifest for record in jobs if record is not None] + [obj for obj in others if obj is not None], run)

    def delete_object(self, kind: str, name: str) -> None:
        if kind == "Job":
            self.delete(name)
            return
        self._object_path(kind, name).unlink(missing_ok=True)
        if kind == "ConfigMap":
            shutil.rmtree(self.workdir / "configmaps" / name, ignore_errors=True)

    def _object_path(self, kind: str, name: str) -> Path:
        """Where a submitted object other than a Job is kept (a Job's record is its JobFiles')."""
        return self.workdir / "objects" / kind / f"{name}.json"

    def _write_configmap(self, configmap: dict[str, Any]) -> None:
        directory = self.workdir / "configmaps" / configmap["metadata"]["name"]
        directory.mkdir(parents=True, exist_ok=True)
        for key, value in configmap.get("data", {}).items():
            (directory / key).write_text(value)

    def _submit_job(self, job: dict[str, Any], *, force: bool) -> str:
        """Created, attached to (resumed) or replaced: Backend.submit's outcome."""
        files = JobFiles(self.workdir, job["metadata"]["name"])
        existing = JobRecord.load(files)
        outcome = "created"
        if existing is not None:
            if submit_outcome(job, existing.manifest, force=force) == "replaced":
                self.delete(files.name)
                outcome = "replaced"
            else:
                self._resume(files)
                return "attached"
        record = JobRecord(manifest=job, volumes=self._volumes(job), cwd=os.getcwd(), parallelism_cap=self.parallelism_cap)
        for container in record.containers:
            check_container(container, files.name)
        files.dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(files.logs, ignore_errors=True)  # a deleted Job's logs, if its deletion was interrupted
        record.save(files)
        self._resume(files)
        return outcome

    def _resume(self, files: JobFiles) -> None:
        """Starts a supervisor unless one runs (or the Job has ended)."""
        state = JobState.load(files)
        if state is not None and state.finished:
            return
        fd = try_lock(files.lock, patience_s=1.0)
        if fd is None:
            return  # a supervisor runs it: attach
        try:
            files.supervisor_log.parent.mkdir(parents=True, exist_ok=True)
            with open(files.supervisor_log, "ab") as log:
                process = subprocess.Popen(
                    [sys.executable, "-m", "dflashctl.local.supervisor", str(files.dir), str(fd)],
                    pass_fds=(fd,), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    # Its own session: Ctrl-C in this terminal detaches, the Job goes on.
                    start_new_session=True,
                )
        finally:
            os.close(fd)  # the supervisor holds the lock now
        record_supervisor(files, process.pid)
        threading.Thread(target=process.wait, daemon=True).start()  # reap it, wherever it ends

    def _volumes(self, job: dict[str, Any]) -> dict[str, str | None]:
        """Each volume of the pod template -> a local directory (None: a fresh one per pod)."""
        name = job["metadata"]["name"]
        volumes: dict[str, str | None] = {}
        for volume in job["spec"]["template"]["spec"].get("volumes", []):
            if "configMap" in volume:
                directory = self.workdir / "configmaps" / volume["configMap"]["name"]
                if not directory.is_dir():
                    raise InputError(
                        f"Job {name} mounts ConfigMap {volume['configMap']['name']}, which was not submitted",
                        "Submit the objects of `dflashctl render` together (the ConfigMap comes first)",
                    )
                volumes[volume["name"]] = str(directory)
            elif "emptyDir" in volume:
                volumes[volume["name"]] = None
            elif "persistentVolumeClaim" in volume and volume["persistentVolumeClaim"]["claimName"] in self.shared_claims:
                # One directory for every pod, as the claim is one volume for every pod of a node.
                directory = self.workdir / "volumes" / volume["persistentVolumeClaim"]["claimName"]
                directory.mkdir(parents=True, exist_ok=True)
                volumes[volume["name"]] = str(directory)
            elif "persistentVolumeClaim" in volume:
                volumes[volume["name"]] = self._model_directory(name)
            else:
                raise InputError(
                    f"volume {volume['name']} of Job {name} is of a kind the local backend cannot map ({sorted(volume)})",
                    "Use configMap, emptyDir, the model, model cache or kernel cache persistentVolumeClaim",
                )
        return volumes

    def _model_directory(self, job: str) -> str:
        """The model claim shows the directory holding target.model (which must be a local path here)."""
        if is_s3(self.model):
            raise InputError(
                f"Job {job} mounts the model volume, but target.model = {self.model} is on S3",
                "With a model_volume, target.model is a checkpoint directory; on the local backend a local one",
            )
        return str(Path(self.model.removeprefix("file://")).resolve().parent)

    # -- status --

    def job_status(self, job_name: str) -> JobStatus:
        files = JobFiles(self.workdir, job_name)
        record = JobRecord.load(files)
        if record is None:
            return JobStatus(name=job_name, exists=False)
        policy = record.policy()
        state = JobState.load(files) or JobState([IndexState(i) for i in range(policy.completions)])
        conditions = dict(state.conditions)
        if not state.finished and not supervisor_alive(files):
            conditions["Failed"] = (
                f"SupervisorLost: the local process running this Job is gone (its log: {files.supervisor_log}); "
                "`dflashctl run` or `dflashctl submit` resumes it"
            )
        succeeded = {s.index for s in state.shards if s.phase == "Succeeded"}
        failed = {s.index for s in state.shards if s.phase == "Failed"}
        return JobStatus(
            name=job_name,
            exists=True,
            active=sum(s.phase in ("Pending", "Running") for s in state.shards),
            succeeded=len(succeeded),
            failed=state.failed_pods,
            completed_indexes=succeeded,
            failed_indexes=failed if policy.indexed else set(),
            conditions=conditions,
            shards=[
                ShardStatus(
                    index=s.index, pod=s.pod, node=NODE_NAME if s.pod else None, phase=s.phase,
                    attempts=s.attempts, exit_reason=s.exit_reason,
                )
                for s in state.shards
            ],
            completions=policy.completions,
            started_at=state.started_at,
        )

    def wait(
        self,
        job_name: str,
        *,
        timeout: float | None,
        on_update: Callable[[JobStatus], None] | None = None,
    ) -> JobStatus:
        deadline = None if timeout is None else time.monotonic() + timeout
        last: JobStatus | None = None
        while True:
            status = self.job_status(job_name)
            if not status.exists:
                raise RunFailed(
                    f"Job {job_name} does not exist (deleted, or never submitted)",
                    "Submit it again: `dflashctl run` attaches to what exists and creates what is missing",
                )
            if status != last and on_update is not None:
                on_update(status)
            last = status
            if status.finished:
                return status
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(
                    f"Job {job_name} did not finish within {timeout:.0f} s",
                    "It keeps running; `dflashctl status --watch` follows it",
                )
            time.sleep(POLL_S)

    # -- logs --

    def logs(self, job_name: str, index: int | None, query: LogQuery = LogQuery()) -> Iterator[str]:
        status = self.job_status(job_name)
        if not status.exists:
            raise InputError(f"Job {job_name} does not exist", "`dflashctl status` shows the Jobs of the run")
        if query.since_s is not None:
            raise InputError(
                "--since needs each line's time, which the local backend's logs do not record",
                "Use --tail N for the last lines (or follow them with --follow)",
            )
        files = JobFiles(self.workdir, job_name)
        record = JobRecord.load(files)
        assert record is not None  # the Job exists
        names = [container["name"] for container in record.containers]
        if query.container not in names:
            raise InputError(f"Job {job_name}'s pods have no container {query.container!r}", f"Pick one of their containers: {', '.join(names)}")
        if index is not None and not (0 <= index < status.completions):
            raise InputError(f"Job {job_name} has no shard {index}", f"Shards are 0..{status.completions - 1}")
        back = 2 if query.previous else 1
        if index is not None and query.previous and status.shards[index].attempts < 2:
            raise InputError(f"shard {index} of Job {job_name} has had one attempt: there is no previous pod", "Leave out -p/--previous for the pod it has")
        # Without --follow, the shards that ran; with it, every shard (the others start later). A previous attempt has ended: nothing to follow.
        follow = query.follow and not query.previous
        shown = [s for s in status.shards if (index is None or s.index == index) and (s.attempts >= back or follow)]
        tails = {
            s.index: _IndexTail(files, s.index, s.attempts - back, container=query.container, prefix="" if index is not None else f"[shard {s.index}] ")
            for s in shown
        }
        if not follow:
            return (line for tail in tails.values() for line in _last(tail.read(final=True), query.tail))
        return self._follow(job_name, tails, query.tail)
    def waiting(self, job_name: str, index: int | None) -> list[str]:
        status = self.job_status(job_name)
        return [
            f"shard {shard.index} has not started yet (no process: it waits for a free slot of the Job's parallelism), no log yet"
            for shard in status.shards
            if (index is None or shard.index == index) and not shard.attempts and not status.finished
        ]

    def _follow(self, job_name: str, tails: dict[int, _IndexTail], tail: int | None) -> Iterator[str]:
        """Lines as they are written, across retries of an index, until the Job (or the index) ends;
        with `tail`, of what is written already only its last lines."""
        for index_tail in tails.values():
            yield from _last(index_tail.read(final=False), tail)
        while tails:
            status = self.job_status(job_name)
            for index in list(tails):
                shard = status.shards[index] if status.exists else None
                done = shard is None or status.finished or shard.phase in ("Succeeded", "Failed")
                yield from tails[index].read(final=done, latest_attempt=shard.attempts - 1 if shard else None)
                if done:
                    del tails[index]
            if tails:
                time.sleep(POLL_S)

    # -- delete, events, annotations --

    def delete(self, job_name: str) -> None:
        files = JobFiles(self.workdir, job_name)
        if not files.dir.exists():
            return
        if supervisor_alive(files):
            supervisor = supervisor_process(files)
            try:
                os.kill(supervisor.pid, signal.SIGTERM)  # it ends its pods, then itself
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + DELETE_TIMEOUT_S
            while supervisor_alive(files):
                if time.monotonic() > deadline:
                    kill_groups([supervisor])
                    break
                time.sleep(POLL_S)
        # Pods a killed supervisor left behind (never a process that took over one's pid since).
        state = JobState.load(files)
        shards = state.shards if state is not None else []
        kill_groups([shard.process for shard in shards if shard.process is not None and shard.phase in ("Pending", "Running")])
        shutil.rmtree(files.dir, ignore_errors=True)
        shutil.rmtree(files.logs, ignore_errors=True)

    def record_event(self, job_name: str, reason: str, message: str, *, warning: bool = False) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        event = {
            "time": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "job": job_name,
            "type": "Warning" if warning else "Normal",
            "reason": reason,
            "message": message,
        }
        with open(self.workdir / "events.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")

    def events(self, job_name: str | None = None) -> list[dict[str, str]]:
        """The recorded events, oldest first (what `kubectl describe job` lists on a cluster)."""
        try:
            lines = (self.workdir / "events.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        events = [json.loads(line) for line in lines if line]
        return [e for e in events if job_name is None or e["job"] == job_name]

    def annotate(self, job_name: str, key: str, value: str) -> None:
        files = JobFiles(self.workdir, job_name)
        record = JobRecord.load(files)
        if record is not None:
            record.manifest["metadata"].setdefault("annotations", {})[key] = value
            record.save(files)

    def annotations(self, job_name: str) -> dict[str, str]:
        """The Job's annotations (spec hash, progress), as `kubectl get job -o yaml` shows them."""
        record = JobRecord.load(JobFiles(self.workdir, job_name))
        return {} if record is None else dict(record.manifest["metadata"].get("annotations", {}))


class _IndexTail:
    """Reads the lines one container wrote into the log files of one index (a pod's containers log into
    one file, each after a `==> container NAME: ...` line), attempt after attempt, from where it left off."""

    def __init__(self, files: JobFiles, index: int, attempt: int, *, container: str, prefix: str) -> None:
        self.files = files
        self.index = index
        self.attempt = max(attempt, 0)
        self.container = container
        self.prefix = prefix
        self.offset = 0
        self.partial = b""
        self.section: str | None = None
        """The container whose lines come now in this attempt's file."""

    def read(self, *, final: bool, latest_attempt: int | None = None) -> Iterator[str]:
        while True:
            path = self.files.pod_log(self.index, self.attempt)
            try:
                with open(path, "rb") as f:
                    f.seek(self.offset)
                    data = f.read()
            except FileNotFoundError:
                data = b""
            self.offset += len(data)
            *lines, self.partial = (self.partial + data).split(b"\n")
            yield from self._own(lines)
            if latest_attempt is not None and self.attempt < latest_attempt:
                # A retry started: the rest of this attempt is written, go on with the next one.
                yield from self._own([self.partial] if self.partial else [])
                self.attempt, self.offset, self.partial, self.section = self.attempt + 1, 0, b"", None
                continue
            if final and self.partial:
                yield from self._own([self.partial])
                self.partial = b""
            return

    def _own(self, lines: list[bytes]) -> Iterator[str]:
        for raw in lines:
            line = raw.decode("utf-8", errors="replace")
            if line.startswith(CONTAINER_HEADER):
                self.section = line[len(CONTAINER_HEADER):].split(":", 1)[0]
            elif self.section == self.container:
                yield self.prefix + line


def _last(lines: Iterator[str], count: int | None) -> Iterator[str]:
    """The last `count` of `lines` (all of them when None)."""
    return iter(lines) if count is None else iter(collections.deque(lines, maxlen=count))
