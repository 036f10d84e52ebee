"""The kubernetes backend: the Backend interface (backend.py) on a real cluster, through cluster.py."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any

from dflash_jobs.errors import InputError

from dflashctl.backend import INDEX_ANNOTATION, JobStatus, LogQuery, RunObject, ShardStatus, first_finished, parse_indexes, run_objects_of
from dflashctl.errors import Forbidden
from dflashctl.render import MANAGED_BY, MANAGED_BY_LABEL, RUN_LABEL, WORKER

if TYPE_CHECKING:  # imported in connect: the pod helpers below serve machines without the client too
    from dflashctl.cluster import Cluster

CONTROLLER_UID_LABEL = "batch.kubernetes.io/controller-uid"
RUN_KINDS = {"Job": "batch/v1", "ConfigMap": "v1", "Service": "v1"}
"""The kinds of a run's own objects and their apiVersion (its pods go with its Jobs; the controller's RBAC
is the namespace's, shared by its runs)."""

log = logging.getLogger(__name__)

# How long a delete (cancel, retry, --force) waits for a Job's pods to terminate and the Job to go.
DELETE_WAIT_S = 300.0


class KubernetesBackend:
    """Jobs and pods of one namespace. Every call goes through the `Cluster` it was given."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    @classmethod
    def connect(cls, namespace: str) -> KubernetesBackend:
        from dflashctl.cluster import Cluster

        return cls(Cluster.connect(namespace))

    def submit(self, objects: list[dict], *, force: bool = False) -> dict[str, str]:
        jobs = {}
        for obj in objects:
            outcome = self.cluster.create_or_attach(obj, force=force, wait=DELETE_WAIT_S)
            log.info("%s %s: %s", obj["kind"], obj["metadata"]["name"], outcome)
            if obj["kind"] == "Job":
                jobs[obj["metadata"]["name"]] = outcome
        return jobs

    def job_status(self, job_name: str) -> JobStatus:
        job = self.cluster.get("Job", job_name)
        return self._status_of(job_name, job)

    def wait(self, job_name: str, *, timeout: float | None, on_update: Callable[[JobStatus], None] | None = None) -> JobStatus:
        deadline = None if timeout is None else time.monotonic() + timeout
        # Every event, and the Job again after each watch window: the caller refreshes what its status does not show.
        statuses = (self._status_of(job_name, job) for job in self.cluster.watch_object("Job", job_name, deadline=deadline))
        return first_finished(job_name, statuses, timeout=timeout, on_update=on_update, where=f"{self.cluster.namespace}/{job_name}")

    def logs(self, job_name: str, index: int | None, query: LogQuery = LogQuery()) -> Iterator[str]:
        attempts = _attempts_per_index(self._pods(job_name))
        if index is not None and index not in attempts:
            raise InputError(f"shard {index} of Job {job_name} has no pod", "`dflashctl status` shows the shards that have one")
        chosen = {i: _attempt(pods, query.previous) for i, pods in sorted(attempts.items()) if index in (None, i)}
        if index is not None and chosen[index] is None:
            raise InputError(f"shard {index} of Job {job_name} has had one attempt: there is no previous pod", "Leave out -p/--previous for the pod it has")
        pods = {i: pod for i, pod in chosen.items() if pod is not None}
        for pod in pods.values():
            _check_container(pod, query.container)
        if index is not None:
            return self._log_of(pods[index], query)
        streams = [_prefixed(f"[shard {i}] ", self._log_of(pod, query)) for i, pod in pods.items()]
        if not query.follow:
            return (line for stream in streams for line in stream)
        return _interleave(streams)

    def waiting(self, job_name: str, index: int | None) -> list[str]:
        notes = []
        for i, pod in sorted(_newest_pod_per_index(self._pods(job_name)).items()):
            if (index is not None and i != index) or _phase(pod) != "Pending":
                continue
            name = pod["metadata"]["name"]
            why = self._latest_events(name) or [exit_reason(pod) or "no events yet"]
            shard = f"shard {i}: " if INDEX_ANNOTATION in (pod["metadata"].get("annotations") or {}) else ""
            notes.append(f"{shard}pod {name} is Pending, no log yet: {'; '.join(why)}")
        return notes

    def _log_of(self, pod: dict[str, Any], query: LogQuery) -> Iterator[str]:
        """The container's log; one not started yet has none, or with `follow` is waited for first."""
        name = pod["metadata"]["name"]
        if _started(pod, query.container):
            return self.cluster.logs(name, container=query.container, follow=query.follow, tail=query.tail, since_s=query.since_s)
        return self._once_started(name, query) if query.follow else iter(())

    def _once_started(self, pod_name: str, query: LogQuery) -> Iterator[str]:
        for pod in self.cluster.watch_object("Pod", pod_name, deadline=None):
            if pod is None:
                return  # deleted before it started: no log to follow
            if _started(pod, query.container):
                break
            if _phase(pod) in ("Succeeded", "Failed"):
                return  # ended without running this container (an init container failed first)
        yield from self.cluster.logs(pod_name, container=query.container, follow=True, tail=query.tail, since_s=query.since_s)

    def _latest_events(self, pod_name: str, count: int = 3) -> list[str]:
        """The pod's newest events, e.g. "Warning FailedScheduling: 0/4 nodes are available: ... (x3)";
        [] where the caller may not list events (RBAC: the controller's Role does not need to)."""
        try:
            events, _ = self.cluster.list("Event", field_selector=f"involvedObject.kind=Pod,involvedObject.name={pod_name}")
        except Forbidden:
            return []
        events.sort(key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or e["metadata"].get("creationTimestamp") or "")
        return [_event_line(event) for event in events[-count:]]

    def find(self, kind: str, name: str) -> dict | None:
        return self.cluster.get(kind, name)

    def run_objects(self, run: str | None = None) -> list[RunObject]:
        selector = ",".join([f"{MANAGED_BY_LABEL}={MANAGED_BY}", *([f"{RUN_LABEL}={run}"] if run is not None else [])])
        found = [
            {**obj, "apiVersion": api_version, "kind": kind}  # a list's items carry no kind of their own
            for kind, api_version in RUN_KINDS.items() for obj in self.cluster.list(kind, label_selector=selector)[0]
        ]
        return run_objects_of(found, run)

    def delete_object(self, kind: str, name: str) -> None:
        self.cluster.delete(kind, name, wait=DELETE_WAIT_S)

    def delete(self, job_name: str) -> None:
        self.delete_object("Job", job_name)

    def record_event(self, job_name: str, reason: str, message: str, *, warning: bool = False) -> None:
        job = self.cluster.get("Job", job_name)
        if job is not None:  # an event needs an object to belong to
            self.cluster.record_event(job, reason=reason, message=message, warning=warning)

    def annotate(self, job_name: str, key: str, value: str) -> None:
        self.cluster.patch("Job", job_name, {"metadata": {"annotations": {key: value}}})

    # ---- helpers -------------------------------------------------------------------------------

    def _pods(self, job_name: str, job: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Pods of the current Job only: a deleted Job of the same name leaves pods with another uid."""
        job = job or self.cluster.get("Job", job_name)
        if job is None:
            return []
        pods, _ = self.cluster.list("Pod", label_selector=f"{CONTROLLER_UID_LABEL}={job['metadata']['uid']}")
        return pods

    def _status_of(self, job_name: str, job: dict[str, Any] | None) -> JobStatus:
        if job is None:
            return JobStatus(name=job_name, exists=False)
        return job_status_from(job, self._pods(job_name, job))


def job_status_from(job: dict[str, Any], pods: list[dict[str, Any]]) -> JobStatus:
    """A Job and its pods as a JobStatus: one ShardStatus per index, from the index's newest pod."""
    spec, status = job.get("spec") or {}, job.get("status") or {}
    completions = spec.get("completions") or 1
    completed = parse_indexes(status.get("completedIndexes"))
    failed = parse_indexes(status.get("failedIndexes"))
    if spec.get("completionMode") != "Indexed" and status.get("succeeded"):
        completed = set(range(completions))  # only Indexed Jobs report completedIndexes
    conditions = {
        c["type"]: ": ".join(part for part in (c.get("reason"), c.get("message")) if part)
        for c in status.get("conditions") or []
        if c.get("status") == "True"
    }
    by_index: dict[int, list[dict[str, Any]]] = {}
    for pod in pods:
        by_index.setdefault(_index_of(pod), []).append(pod)
    shards = []
    for index in range(completions):
        attempts = sorted(by_index.get(index, []), key=_created)
        if attempts:
            shards.append(_shard_from_pod(index, attempts))
        else:
            shards.append(ShardStatus(
                index=index, pod=None, node=None, attempts=0, exit_reason=None,
                phase=_phase_without_pod(index, completed, failed, suspended="Suspended" in conditions),
            ))
    return JobStatus(
        name=job["metadata"]["name"],
        exists=True,
        active=status.get("active") or 0,
        succeeded=status.get("succeeded") or 0,
        failed=status.get("failed") or 0,
        completed_indexes=completed,
        failed_indexes=failed,
        conditions=conditions,
        shards=shards,
        completions=completions,
        started_at=_timestamp(status.get("startTime")),
    )


def _timestamp(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _index_of(pod: dict[str, Any]) -> int:
    annotations = pod["metadata"].get("annotations") or {}
    return int(annotations.get(INDEX_ANNOTATION, 0))


def _created(pod: dict[str, Any]) -> tuple[str, str]:
    meta = pod["metadata"]
    return meta.get("creationTimestamp") or "", meta["name"]


def _phase_without_pod(index: int, completed: set[int], failed: set[int], *, suspended: bool) -> str:
    if index in completed:
        return "Succeeded"
    if index in failed:
        return "Failed"
    return "Queued" if suspended else "Missing"


def _shard_from_pod(index: int, attempts: list[dict[str, Any]]) -> ShardStatus:
    """The shard as its newest pod shows it; while a retry runs, why the attempt before it ended."""
    pod = attempts[-1]
    status = pod.get("status") or {}
    phase = status.get("phase") or "Pending"
    reason = exit_reason(pod)
    if reason is None and phase in ("Pending", "Running") and len(attempts) > 1:
        previous = exit_reason(attempts[-2])
        reason = f"retry after: {previous}" if previous else None
    return ShardStatus(
        index=index,
        pod=pod["metadata"]["name"],
        node=(pod.get("spec") or {}).get("nodeName"),
        phase=phase,
        attempts=len(attempts),
        exit_reason=reason,
        message=last_words(pod) if phase == "Failed" else None,
    )


def last_words(pod: dict[str, Any]) -> str | None:
    """The worker's termination message, down to its `Error: ...` line when it has one; None when it
    has none, or only blank lines (the kubelet's copy of a log that ended in them)."""
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated") or {}
        if container.get("name") == WORKER:
            lines = [line.strip() for line in (terminated.get("message") or "").splitlines() if line.strip()]
            errors = [line for line in lines if line.startswith("Error:")]
            return (errors or lines or [None])[-1]
    return None


def exit_reason(pod: dict[str, Any]) -> str | None:
    """Why a pod ended or is stuck, in a few words: preemption, exit code, OOM, image pull, scheduling."""
    status = pod.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    if "DisruptionTarget" in conditions:
        return f"preempted ({conditions['DisruptionTarget'].get('reason') or 'DisruptionTarget'})"
    for kind in ("initContainerStatuses", "containerStatuses"):
        for container in status.get(kind) or []:
            state = container.get("state") or {}
            terminated = state.get("terminated")
            if terminated and terminated.get("exitCode"):
                reason = terminated.get("reason") or "Error"
                prefix = "" if container.get("name") == WORKER else f"{container.get('name')} "
                return f"{prefix}exit {terminated['exitCode']} ({reason})"
            waiting = state.get("waiting")
            if waiting and waiting.get("reason") not in (None, "ContainerCreating", "PodInitializing"):
                return f"waiting: {waiting['reason']}"
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return f"unschedulable: {condition.get('message') or condition.get('reason')}"
    return None


def _prefixed(prefix: str, lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        yield prefix + line


def _interleave(streams: list[Iterator[str]]) -> Iterator[str]:
    """Lines of several followed streams as they come (one reader thread per stream)."""
    lines: queue.Queue[str | BaseException | None] = queue.Queue(maxsize=1024)

    def pump(stream: Iterator[str]) -> None:
        try:
            for line in stream:
                lines.put(line)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, raised there
            lines.put(error)
        finally:
            lines.put(None)

    for stream in streams:
        threading.Thread(target=pump, args=(stream,), daemon=True).start()
    remaining = len(streams)
    while remaining:
        item = lines.get()
        if item is None:
            remaining -= 1
        elif isinstance(item, BaseException):
            raise item
        else:
            yield item


def _event_line(event: dict[str, Any]) -> str:
    line = f"{event.get('type') or 'Normal'} {event.get('reason')}"
    if event.get("message"):
        line += f": {event['message']}"
    if (event.get("count") or 1) > 1:
        line += f" (x{event['count']})"
    return line


def _phase(pod: dict[str, Any]) -> str:
    return (pod.get("status") or {}).get("phase") or "Pending"


def _newest_pod_per_index(pods: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {index: attempts[-1] for index, attempts in _attempts_per_index(pods).items()}


def _attempts_per_index(pods: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Each index's pods, oldest first: a Job retries an index with a new pod."""
    attempts: dict[int, list[dict[str, Any]]] = {}
    for pod in sorted(pods, key=_created):
        attempts.setdefault(_index_of(pod), []).append(pod)
    return attempts


def _attempt(attempts: list[dict[str, Any]], previous: bool) -> dict[str, Any] | None:
    """The newest pod of an index, or with `previous` the one before it (None when there was none)."""
    wanted = -2 if previous else -1
    return attempts[wanted] if len(attempts) >= -wanted else None


def _check_container(pod: dict[str, Any], container: str) -> None:
    spec = pod.get("spec") or {}
    names = [c["name"] for c in (spec.get("initContainers") or [])] + [c["name"] for c in spec.get("containers") or []]
    if container not in names:
        raise InputError(f"pod {pod['metadata']['name']} has no container {container!r}", f"Pick one of its containers: {', '.join(names)}")


def _started(pod: dict[str, Any], container: str) -> bool:
    """Whether the container has run (running or terminated), so the kubelet holds a log of it."""
    status = pod.get("status") or {}
    for kind in ("initContainerStatuses", "containerStatuses"):
        for entry in status.get(kind) or []:
            state = entry.get("state") or {}
            if entry.get("name") == container and ("running" in state or "terminated" in state):
                return True
    return False
