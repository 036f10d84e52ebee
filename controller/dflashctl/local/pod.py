"""One pod of a local Job: one attempt at one index, its initContainers and then its containers,
each a subprocess run to its end with the manifest's command and env, paths mapped to this machine."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_jobs.errors import InputError

from dflashctl.backend import INDEX_ANNOTATION
from dflashctl.local.processes import ProcessRef, kill_groups
from dflashctl.local.state import JobFiles, JobRecord
from dflashctl.render import WORKER

NODE_NAME = "local"
CONTAINER_HEADER = "==> container "
"""Starts the line a pod's log gets before each of its containers' output: `==> container NAME: argv`."""
SECRET_ENV_PREFIX = "AWS_"
"""What the S3 Secret holds (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ...)."""

# command[0] of a manifest -> how to run it with this interpreter (pods run the image's python).
_LAUNCHERS = {
    "python": [sys.executable],
    "python3": [sys.executable],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "dflashctl": [sys.executable, "-m", "dflashctl.cli.main"],
}
_ENV_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


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
        self.started: ProcessRef | None = None
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
    def running_process(self) -> ProcessRef | None:
        """The container that runs now, as the state file records it."""
        return self.started if self.process is not None and self.result is None else None

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
        self.log.write(f"{CONTAINER_HEADER}{container.name}: {shlex.join(container.argv)}\n".encode())
        self.log.flush()
        try:
            self.process = subprocess.Popen(
                container.argv, env=container.env, cwd=container.cwd, stdin=subprocess.DEVNULL,
                stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            )
            self.started = ProcessRef.of(self.process.pid)
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


def kill_pods(pods: list[Pod]) -> None:
    """SIGTERM the running containers of `pods` at once, SIGKILL after the grace period."""
    kill_groups([pod.process for pod in pods if pod.process is not None])
    for pod in pods:
        if pod.result is None:
            pod._finish((pod.container, 128 + signal.SIGTERM))


def exit_reason(container: str, exit_code: int) -> str:
    """Like the kubernetes backend's: "exit 42 (Error)", "selfcheck exit 2 (Error)", "exit 137 (Killed)"."""
    reason = "Killed" if exit_code in (128 + signal.SIGKILL, 128 + signal.SIGTERM) else "Error"
    prefix = "" if container in (WORKER, "") else f"{container} "
    return f"{prefix}exit {exit_code} ({reason})"

