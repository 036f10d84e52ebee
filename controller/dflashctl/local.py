"""The local backend: the rendered Jobs of a run, run as local processes (DESIGN section 8).

It takes the very objects `dflashctl render` prints and plays the Kubernetes Job controller on one
machine, so a local run exercises the manifests themselves:

- every index of a Job is a "pod": its initContainers, then its containers, one after the other, each
  a subprocess with the manifest's command and env, `JOB_COMPLETION_INDEX` and the downward-API
  completion index, in a process group of its own;
- `parallelism` (at most `local.parallelism`), `backoffLimit` / `backoffLimitPerIndex`,
  `maxFailedIndexes`, `podFailurePolicy` exit-code rules and `successPolicy` are honoured, with the
  Job conditions and reasons the real controller sets;
- volumes become local directories: a ConfigMap its data written under the workdir, an emptyDir a
  fresh directory per pod, the model PersistentVolumeClaim the directory holding `target.model`;
  mount paths in commands and env values are rewritten to them;
- an `envFrom` Secret reference passes this environment's S3 variables (never written to disk);
  containers without one get no credentials, as in a pod;
- one log file per pod attempt: <workdir>/logs/<job>/<index>-<attempt>.log.
- the machine's cores are shared among the Job's parallel pods as a node's are among its pods:
  each gets OMP_NUM_THREADS = cores / parallelism unless the environment sets it.

Each Job is run by a detached supervisor process (`python -m dflashctl.local <job dir>`) that writes
the Job's state as JSON under the workdir. `submit` returns at once; `wait`, `status` and `logs`,
from this process or another, read that state. The supervisor holds an flock on the job's supervisor.lock
for its whole life: a free lock means no supervisor, and `submit` of the same Job resumes it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_jobs.errors import InputError
from dflash_jobs.spec import is_s3

from dflashctl.backend import INDEX_ANNOTATION, JobStatus, ShardStatus, parse_indexes
from dflashctl.errors import Conflict, RunFailed, WaitTimeout
from dflashctl.render import SPEC_HASH, WORKER

if TYPE_CHECKING:
    from dflash_jobs.spec import RunSpec

NODE_NAME = "local"
DEFAULT_BACKOFF_LIMIT = 6
"""The Job's backoffLimit when the manifest sets none (the Kubernetes default)."""
SECRET_ENV_PREFIX = "AWS_"
"""What the S3 Secret holds (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ...)."""
POLL_S = 0.1
"""How often the supervisor checks its pods, and `wait` / `logs --follow` the state and log files."""
KILL_GRACE_S = 5.0
"""SIGTERM, then SIGKILL after this long: the local terminationGracePeriodSeconds."""
DELETE_TIMEOUT_S = 30.0

# command[0] of a manifest -> how to run it with this interpreter (pods run the image's python).
_LAUNCHERS = {
    "python": [sys.executable],
    "python3": [sys.executable],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "dflashctl": [sys.executable, "-m", "dflashctl.cli.main"],
}
_ENV_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


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


def _write_json(path: Path, data: Any) -> None:
    """Atomic: readers in other processes never see half a file."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(temp, path)


def _read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def _try_lock(path: Path, *, shared: bool = False, patience_s: float = 0.0) -> int | None:
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


def _supervisor_pid(files: JobFiles) -> int:
    """The running supervisor's pid; the process that started it writes the file a moment after."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            return int(files.pid.read_text())
        except (FileNotFoundError, ValueError):
            if time.monotonic() >= deadline:
                raise RunFailed(f"the supervisor of {files.name} runs but left no pid in {files.pid}", "Kill it by hand (`pgrep -f dflashctl.local`)") from None
            time.sleep(POLL_S)


def _supervisor_alive(files: JobFiles) -> bool:
    # A shared probe: two probes never mistake each other for a supervisor.
    fd = _try_lock(files.lock, shared=True)
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

    @classmethod
    def load(cls, files: JobFiles) -> JobRecord | None:
        data = _read_json(files.job)
        return None if data is None else cls(**data)

    def save(self, files: JobFiles) -> None:
        _write_json(files.job, asdict(self))

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


# ---- one pod: its containers in order ----------------------------------------------------------


@dataclass(slots=True)
class Container:
    """A container of the manifest, resolved for this machine (paths mapped, launcher resolved)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: str


class PathMap:
    """Mount paths of a pod -> the local directories behind them; longest mount wins."""

    def __init__(self, mounts: dict[str, Path]) -> None:
        self.mounts = sorted(mounts.items(), key=lambda item: len(item[0]), reverse=True)

    def __call__(self, value: str) -> str:
        for mount, local in self.mounts:
            if value == mount or value.startswith(mount.rstrip("/") + "/"):
                return str(local) + value[len(mount):]
        # --flag=/mounted/path
        head, sep, tail = value.partition("=")
        if sep and tail.startswith("/") and head.startswith("-"):
            return f"{head}={self(tail)}"
        return value


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) references to the container's env; unknown ones stay as written."""
    return _ENV_REFERENCE.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def _base_environment(with_secret: bool) -> dict[str, str]:
    """This process's environment (PATH, the venv, devices), S3 credentials only through the Secret."""
    return {
        key: value for key, value in os.environ.items()
        if with_secret or not key.startswith(SECRET_ENV_PREFIX)
    }


FIELD_PATHS = (
    f"metadata.annotations['{INDEX_ANNOTATION}']", "metadata.name", "metadata.namespace", "spec.nodeName", "status.podIP",
)
"""The downward-API fields (env valueFrom.fieldRef) a local pod can tell."""


def resolve_container(
    container: dict[str, Any],
    *,
    pod: str,
    namespace: str,
    index: int | None,
    paths: PathMap,
    cwd: str,
) -> Container:
    """A manifest container as a local process: command, env and working directory."""
    with_secret = any("secretRef" in source for source in container.get("envFrom", []))
    env = _base_environment(with_secret)
    if index is not None:
        env["JOB_COMPLETION_INDEX"] = str(index)
    fields = dict(zip(FIELD_PATHS, ("" if index is None else str(index), pod, namespace, NODE_NAME, "127.0.0.1")))
    for var in container.get("env", []):
        if "valueFrom" in var:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[var["name"]] = paths(_expand(var["value"], env))
    command = [*container["command"], *container.get("args", [])]
    argv = [*_LAUNCHERS.get(command[0], command[:1]), *(paths(_expand(arg, env)) for arg in command[1:])]
    working_dir = container.get("workingDir")
    return Container(container["name"], argv, env, paths(working_dir) if working_dir else cwd)


def check_container(container: dict[str, Any], job: str) -> None:
    """Refuses at submit what the local backend cannot run faithfully, naming it."""
    where = f"container {container['name']} of Job {job}"
    if not container.get("command"):
        raise InputError(f"{where} has no command", "The local backend runs the manifest's command; set it in exec form")
    for source in container.get("envFrom", []):
        if "secretRef" not in source:
            raise InputError(f"{where} takes env from {sorted(source)}", "The local backend maps envFrom secretRef only")
    for var in container.get("env", []):
        path = (var.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
        if "valueFrom" in var and path not in FIELD_PATHS:
            raise InputError(
                f"env {var['name']} of {where} uses valueFrom {var['valueFrom']}",
                f"The local backend maps a value, or a fieldRef to one of {FIELD_PATHS}",
            )


class Pod:
    """One attempt at one index: the initContainers, then the containers, each run to its end."""

    def __init__(self, files: JobFiles, record: JobRecord, index: int, attempt: int, *, indexed: bool, threads: int) -> None:
        self.record = record
        self.threads = threads
        self.index = index
        self.indexed = indexed
        self.name = f"{files.name}-{index}-{attempt}"
        self.dir = files.pod_dir(self.name)
        self.specs = record.containers
        self.init_containers = len(self.specs) - len(record.pod_spec["containers"])
        log_path = files.pod_log(index, attempt)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "ab")
        self.position = -1
        self.process: subprocess.Popen | None = None
        self.result: tuple[str, int] | None = None
        """(container, exit code) of the container that ended the pod; ("", 0) when all succeeded."""

    @property
    def container(self) -> str:
        return self.specs[self.position]["name"] if self.position >= 0 else ""

    @property
    def in_init(self) -> bool:
        return self.position < self.init_containers

    def start(self) -> None:
        self._next()

    def poll(self) -> bool:
        """True once the pod has ended; its `result` says how."""
        if self.result is not None:
            return True
        assert self.process is not None
        code = self.process.poll()
        if code is None:
            return False
        exit_code = 128 - code if code < 0 else code  # killed by signal N: exit code 128 + N, as in a pod
        if exit_code != 0:
            self._finish((self.container, exit_code))
        elif self.position + 1 < len(self.specs):
            self._next()
        else:
            self._finish(("", 0))
        return self.result is not None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.result is None else None

    def _next(self) -> None:
        self.position += 1
        mounts = self._mounts(self.specs[self.position])
        container = resolve_container(
            self.specs[self.position],
            pod=self.name,
            namespace=self.record.manifest["metadata"].get("namespace", "default"),
            index=self.index if self.indexed else None,
            paths=PathMap(mounts),
            cwd=self.record.cwd,
        )
        # Without it every pod's torch takes all cores and parallel pods thrash each other.
        container.env.setdefault("OMP_NUM_THREADS", str(self.threads))
        self.log.write(f"==> container {container.name}: {shlex.join(container.argv)}\n".encode())
        self.log.flush()
        try:
            self.process = subprocess.Popen(
                container.argv, env=container.env, cwd=container.cwd, stdin=subprocess.DEVNULL,
                stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        except OSError as error:  # like a container that cannot start (bad command): exit 127/128
            self.log.write(f"cannot start {container.argv[0]}: {error}\n".encode())
            self._finish((container.name, 127 if isinstance(error, FileNotFoundError) else 128))

    def _mounts(self, container: dict[str, Any]) -> dict[str, Path]:
        mounts = {}
        for mount in container.get("volumeMounts", []):
            local = self.record.volumes[mount["name"]]
            path = Path(local) if local is not None else self.dir / mount["name"]
            path = path / mount["subPath"] if mount.get("subPath") else path
            if local is None:
                path.mkdir(parents=True, exist_ok=True)
            mounts[mount["mountPath"]] = path
        return mounts

    def _finish(self, result: tuple[str, int]) -> None:
        self.result = result
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)  # emptyDirs live as long as their pod


def _kill_groups(groups: list[tuple[int, subprocess.Popen | None]]) -> None:
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
            alive = [(pgid, process) for pgid, process in alive if _running(pgid, process)]
            if alive:
                time.sleep(POLL_S)
        if not alive:
            return


def _running(pgid: int, process: subprocess.Popen | None) -> bool:
    if process is not None:
        return process.poll() is None
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def kill_pods(pods: list[Pod]) -> None:
    """SIGTERM the running containers of `pods` at once, SIGKILL after the grace period."""
    _kill_groups([(pod.process.pid, pod.process) for pod in pods if pod.process is not None and pod.process.poll() is None])
    for pod in pods:
        if pod.result is None:
            pod._finish((pod.container, 128 + signal.SIGTERM))


def exit_reason(container: str, exit_code: int) -> str:
    """Like the kubernetes backend's: "exit 42 (Error)", "selfcheck exit 2 (Error)", "exit 137 (Killed)"."""
    reason = "Killed" if exit_code in (128 + signal.SIGKILL, 128 + signal.SIGTERM) else "Error"
    prefix = "" if container in (WORKER, "") else f"{container} "
    return f"{prefix}exit {exit_code} ({reason})"


# ---- the supervisor: the Job controller of one Job --------------------------------------------


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
    exit_reason: str | None = None


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

    @property
    def finished(self) -> bool:
        return "Complete" in self.conditions or "Failed" in self.conditions


class Supervisor:
    """Runs one Job's pods to the Job's end, writing its state after every change."""

    def __init__(self, files: JobFiles) -> None:
        self.files = files
        record = JobRecord.load(files)
        assert record is not None, f"{files.job} is written before its supervisor starts"
        self.record = record
        self.policy = record.policy()
        saved = _read_json(files.state)
        if saved is None:
            self.state = JobState([IndexState(i) for i in range(self.policy.completions)])
        else:
            self.state = JobState.from_json(saved)
            self._adopt_orphans()
        self.pods: dict[int, Pod] = {}
        self.stopping = False

    def _adopt_orphans(self) -> None:
        """A previous supervisor died: end the pods it left, and run those indexes again.

        Like a pod lost with its node, the interrupted attempt does not count against the retries."""
        interrupted = [shard for shard in self.state.shards if shard.phase in ("Pending", "Running")]
        _kill_groups([(shard.pid, None) for shard in interrupted if shard.pid is not None])
        for shard in interrupted:
            shard.phase, shard.pid = "Missing", None

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._stop)
        if self.state.started_at is None:
            self.state.started_at = time.time()
        self._save()
        while not self.state.finished and not self.stopping:
            changed = self._reap()
            changed |= self._decide()
            if not self.state.finished:
                changed |= self._launch()
            if changed:
                self._save()
            time.sleep(POLL_S)
        kill_pods(list(self.pods.values()))
        for pod in list(self.pods.values()):
            self._settle(pod, counted=False)
        self._save()

    def _stop(self, signum: int, frame: Any) -> None:
        self.stopping = True

    def _launch(self) -> bool:
        started = False
        for shard in self.state.shards:
            if len(self.pods) >= self.policy.parallelism:
                break
            if shard.phase != "Missing":
                continue
            pod = Pod(self.files, self.record, shard.index, shard.attempts, indexed=self.policy.indexed,
                      threads=max(1, (os.cpu_count() or 1) // self.policy.parallelism))
            shard.attempts += 1
            shard.pod, shard.phase = pod.name, "Pending"
            self.pods[shard.index] = pod
            pod.start()
            shard.pid = pod.pid
            started = True
        return started

    def _reap(self) -> bool:
        changed = False
        for index, pod in list(self.pods.items()):
            if self.state.finished:
                break  # a FailJob or success policy ended the Job, and its other pods with it
            shard = self.state.shards[index]
            ended = pod.poll()
            phase = "Pending" if pod.in_init and not ended else "Running"
            if not ended and (phase != shard.phase or pod.pid != shard.pid):
                shard.phase, shard.pid = phase, pod.pid
                changed = True
            if ended:
                self._settle(pod, counted=True)
                changed = True
        return changed

    def _settle(self, pod: Pod, *, counted: bool) -> None:
        """Applies a finished pod's outcome to its index (and perhaps to the Job)."""
        del self.pods[pod.index]
        shard = self.state.shards[pod.index]
        shard.pid = None
        container, exit_code = pod.result or ("", 0)
        if exit_code == 0:
            shard.phase, shard.exit_reason = "Succeeded", None
            return
        shard.exit_reason = exit_reason(container, exit_code)
        if not counted:  # ended by the supervisor itself: the Job was deleted
            shard.phase = "Failed"
            return
        action, rule = self.policy.failure_action(container, exit_code)
        if action == "Ignore":
            shard.phase = "Missing"
            return
        self.state.failed_pods += 1
        shard.failures += 1
        shard.phase = "Failed"
        if action == "FailJob":
            self._fail(
                "PodFailurePolicy",
                f"Container {container} for pod {pod.name} failed with exit code {exit_code} matching FailJob rule at index {rule}",
            )
        elif action == "FailIndex":
            pass
        elif self.policy.backoff_limit_per_index is not None:
            if shard.failures <= self.policy.backoff_limit_per_index:
                shard.phase = "Missing"
        elif self.state.failed_pods <= self.policy.backoff_limit:
            shard.phase = "Missing"
        else:
            self._fail("BackoffLimitExceeded", "Job has reached the specified backoff limit")

    def _decide(self) -> bool:
        """The Job's terminal condition, once there is one."""
        if self.state.finished:
            return False
        succeeded = {s.index for s in self.state.shards if s.phase == "Succeeded"}
        failed = {s.index for s in self.state.shards if s.phase == "Failed"}
        if self.policy.success_rules and self.policy.success_met(succeeded):
            self.state.conditions["SuccessCriteriaMet"] = "SuccessPolicy: Matched rules at index 0"
            self._end("Complete", "SuccessPolicy: Matched rules at index 0")
        elif self.policy.max_failed_indexes is not None and len(failed) > self.policy.max_failed_indexes:
            self._fail("MaxFailedIndexesExceeded", "Job has exceeded the specified maximal number of failed indexes")
        elif len(succeeded) + len(failed) == self.policy.completions:
            if failed:
                self._fail("FailedIndexes", "Job has failed indexes")
            else:
                self._end("Complete", "CompletionsReached: Reached expected number of succeeded pods")
        return self.state.finished

    def _fail(self, reason: str, message: str) -> None:
        self._end("Failed", f"{reason}: {message}")

    def _end(self, condition: str, text: str) -> None:
        """Terminal: the pods still running are ended, and their indexes count as failed."""
        self.state.conditions[condition] = text
        kill_pods(list(self.pods.values()))
        for pod in list(self.pods.values()):
            del self.pods[pod.index]
            shard = self.state.shards[pod.index]
            shard.pid = None
            shard.phase = "Failed"
            shard.exit_reason = "terminated (the Job ended)"

    def _save(self) -> None:
        _write_json(self.files.state, self.state.to_json())


def supervise(job_dir: Path, lock_fd: int) -> None:
    """The detached supervisor's main: runs the Job, holding the lock (inherited as `lock_fd`)."""
    files = JobFiles(job_dir.parent.parent, job_dir.name)
    files.pid.write_text(str(os.getpid()))
    try:
        Supervisor(files).run()
    finally:
        os.close(lock_fd)


# ---- the backend ------------------------------------------------------------------------------


class LocalBackend:
    """Jobs as local processes, state under `local.workdir` (DESIGN section 8)."""

    def __init__(self, spec: RunSpec) -> None:
        self.workdir = Path(spec.local.workdir).resolve()
        self.parallelism_cap = spec.local.parallelism
        self.model = spec.target.model
        self.model_cache = spec.cluster.model_cache

    # -- submit --

    def submit(self, objects: list[dict], *, force: bool = False) -> None:
        for obj in objects:
            kind, name = obj["kind"], obj["metadata"]["name"]
            if kind == "Job":
                self._submit_job(obj, force=force)
                continue
            path = self.workdir / "objects" / kind / f"{name}.json"
            existing = _read_json(path)
            if existing is not None and not force:
                _check_same_hash(existing, obj)
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_json(path, obj)
            if kind == "ConfigMap":
                self._write_configmap(obj)

    def _write_configmap(self, configmap: dict[str, Any]) -> None:
        directory = self.workdir / "configmaps" / configmap["metadata"]["name"]
        directory.mkdir(parents=True, exist_ok=True)
        for key, value in configmap.get("data", {}).items():
            (directory / key).write_text(value)

    def _submit_job(self, job: dict[str, Any], *, force: bool) -> None:
        files = JobFiles(self.workdir, job["metadata"]["name"])
        existing = JobRecord.load(files)
        if existing is not None:
            if force and _hash(existing.manifest) != _hash(job):
                self.delete(files.name)
            else:
                _check_same_hash(existing.manifest, job)
                self._resume(files)
                return
        record = JobRecord(manifest=job, volumes=self._volumes(job), cwd=os.getcwd(), parallelism_cap=self.parallelism_cap)
        for container in record.containers:
            check_container(container, files.name)
        files.dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(files.logs, ignore_errors=True)  # a deleted Job's logs, if its deletion was interrupted
        record.save(files)
        self._resume(files)

    def _resume(self, files: JobFiles) -> None:
        """Starts a supervisor unless one runs (or the Job has ended)."""
        state = _read_json(files.state)
        if state is not None and JobState.from_json(state).finished:
            return
        fd = _try_lock(files.lock, patience_s=1.0)
        if fd is None:
            return  # a supervisor runs it: attach
        try:
            files.supervisor_log.parent.mkdir(parents=True, exist_ok=True)
            with open(files.supervisor_log, "ab") as log:
                process = subprocess.Popen(
                    [sys.executable, "-m", "dflashctl.local", str(files.dir), str(fd)],
                    pass_fds=(fd,), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    # Its own session: Ctrl-C in this terminal detaches, the Job goes on.
                    start_new_session=True,
                )
        finally:
            os.close(fd)  # the supervisor holds the lock now
        files.pid.write_text(str(process.pid))
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
            elif "persistentVolumeClaim" in volume and volume["persistentVolumeClaim"]["claimName"] == self.model_cache:
                # One directory for every pod, as the claim is one volume for every pod of a node.
                directory = self.workdir / "volumes" / self.model_cache
                directory.mkdir(parents=True, exist_ok=True)
                volumes[volume["name"]] = str(directory)
            elif "persistentVolumeClaim" in volume:
                volumes[volume["name"]] = self._model_directory(name)
            else:
                raise InputError(
                    f"volume {volume['name']} of Job {name} is of a kind the local backend cannot map ({sorted(volume)})",
                    "Use configMap, emptyDir, the model or the model cache persistentVolumeClaim",
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
        saved = _read_json(files.state)
        state = JobState.from_json(saved) if saved else JobState([IndexState(i) for i in range(policy.completions)])
        conditions = dict(state.conditions)
        if not state.finished and not _supervisor_alive(files):
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

    def logs(self, job_name: str, index: int | None, follow: bool) -> Iterator[str]:
        status = self.job_status(job_name)
        if not status.exists:
            raise RunFailed(f"Job {job_name} does not exist", "`dflashctl status` shows the Jobs of the run")
        files = JobFiles(self.workdir, job_name)
        if index is not None and not (0 <= index < status.completions):
            raise RunFailed(f"Job {job_name} has no shard {index}", f"Shards are 0..{status.completions - 1}")
        if index is not None and not follow and not status.shards[index].attempts:
            raise RunFailed(f"shard {index} of Job {job_name} has no pod yet", "`dflashctl logs --follow` waits for it")
        # Without --follow, the shards that ran; with it, every shard (the others start later).
        shown = [s for s in status.shards if (index is None or s.index == index) and (follow or s.attempts)]
        tails = {
            s.index: _IndexTail(files, s.index, s.attempts - 1, prefix="" if index is not None else f"[shard {s.index}] ")
            for s in shown
        }
        if not follow:
            return (line for tail in tails.values() for line in tail.read(final=True))
        return self._follow(job_name, tails)

    def _follow(self, job_name: str, tails: dict[int, _IndexTail]) -> Iterator[str]:
        """Lines as they are written, across retries of an index, until the Job (or the index) ends."""
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
        if _supervisor_alive(files):
            pid = _supervisor_pid(files)
            try:
                os.kill(pid, signal.SIGTERM)  # it ends its pods, then itself
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + DELETE_TIMEOUT_S
            while _supervisor_alive(files):
                if time.monotonic() > deadline:
                    _kill_groups([(pid, None)])
                    break
                time.sleep(POLL_S)
        # Pods a killed supervisor left behind.
        saved = _read_json(files.state)
        shards = JobState.from_json(saved).shards if saved else []
        _kill_groups([(shard.pid, None) for shard in shards if shard.pid is not None and shard.phase in ("Pending", "Running")])
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
    """Reads the log files of one index, attempt after attempt, from where it left off."""

    def __init__(self, files: JobFiles, index: int, attempt: int, *, prefix: str) -> None:
        self.files = files
        self.index = index
        self.attempt = max(attempt, 0)
        self.prefix = prefix
        self.offset = 0
        self.partial = b""

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
            for line in lines:
                yield self.prefix + line.decode("utf-8", errors="replace")
            if latest_attempt is not None and self.attempt < latest_attempt:
                # A retry started: the rest of this attempt is written, go on with the next one.
                if self.partial:
                    yield self.prefix + self.partial.decode("utf-8", errors="replace")
                self.attempt, self.offset, self.partial = self.attempt + 1, 0, b""
                continue
            if final and self.partial:
                yield self.prefix + self.partial.decode("utf-8", errors="replace")
                self.partial = b""
            return


def _hash(obj: dict[str, Any]) -> str | None:
    return (obj["metadata"].get("annotations") or {}).get(SPEC_HASH)


def _check_same_hash(existing: dict[str, Any], new: dict[str, Any]) -> None:
    if _hash(existing) != _hash(new):
        meta = new["metadata"]
        raise Conflict(
            f"{new['kind']} {meta['name']} already exists with another spec ({SPEC_HASH} {_hash(existing)}, now {_hash(new)})",
            "Keep the spec of the running run, give the new one another name, or pass --force to replace it",
        )


if __name__ == "__main__":
    supervise(Path(sys.argv[1]), int(sys.argv[2]))
