"""The interface both backends implement: kubernetes (kube.py) and local (local/).

A backend runs the rendered objects of a run (render.py) and reports on their Jobs in one shape,
so that `dflashctl run`, `status`, `logs`, `cancel` and `retry` are the same code on a laptop and
on a cluster. Everything here is plain data: no Kubernetes client types leak out of a backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from dflashctl.errors import Conflict
from dflashctl.render import MANAGED_BY, MANAGED_BY_LABEL, RUN_LABEL, SPEC_HASH, WORKER, object_ref

# Reasons of the events the pipeline records on its Jobs (`kubectl describe job` lists them).
EVENT_EXTRACTION_FINISHED = "ExtractionFinished"
EVENT_SHARDS_FAILED = "ShardsFailed"
EVENT_SHARDS_RETRIED = "ShardsRetried"
EVENT_CHUNKS_VERIFIED = "ChunksVerified"
EVENT_VERIFY_FAILED = "VerifyFailed"
EVENT_TRAINING_LAUNCHED = "TrainingLaunched"
EVENT_TRAINING_FINISHED = "TrainingFinished"
EVENT_EVALUATION_DONE = "EvaluationDone"
EVENT_RUN_FAILED = "RunFailed"
PROGRESS_ANNOTATION = "dflash.dev/progress"
"""On the extraction Job: chunks done/total from the storage markers, e.g. "12/40"."""
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
"""Kubernetes' annotation of an Indexed Job's pod: its completion index."""


@dataclass(slots=True)
class ShardStatus:
    """One index of a Job: its newest pod and what became of it."""

    index: int
    pod: str | None
    node: str | None
    phase: str
    """The pod phases Pending, Running, Succeeded, Failed; "Queued" while Kueue holds the Job
    (suspended), "Missing" for an index without a pod (yet)."""
    attempts: int
    """Pods started for this index so far (preempted ones included)."""
    exit_reason: str | None
    """Why the last attempt ended, e.g. "exit 42 (Error)", "OOMKilled", "preempted (DisruptionTarget)"."""
    message: str | None = None
    """The last attempt's own last words when it failed: its worker's termination message (the log's
    tail, e.g. the `Error: ...` line of a failed `dflashctl run` in the controller's pod)."""


@dataclass(frozen=True, slots=True)
class LogQuery:
    """Which lines of a shard's log `logs` reads, as kubectl logs' options say it."""

    container: str = WORKER
    """The pod's container: the worker, or an init container (selfcheck; stage in a vLLM generate pod)."""
    follow: bool = False
    """Keep streaming until the pod ends; a pod not started yet is waited for."""
    tail: int | None = None
    """Only the last lines of each log (with follow: then the new ones)."""
    since_s: float | None = None
    """Only the lines written in the last seconds (the kubelet's timestamps)."""
    previous: bool = False
    """The shard's attempt before its newest: Jobs retry with a new pod (restartPolicy Never)."""


@dataclass(slots=True)
class JobStatus:
    """A Job as one backend sees it. `exists=False` means it was never submitted (or was deleted)."""

    name: str
    exists: bool
    active: int = 0
    succeeded: int = 0
    failed: int = 0
    completed_indexes: set[int] = field(default_factory=set)
    failed_indexes: set[int] = field(default_factory=set)
    conditions: dict[str, str] = field(default_factory=dict)
    """The Job's conditions whose status is "True": type -> "Reason: message" (e.g. {"Failed": "FailedIndexes: ..."})."""
    shards: list[ShardStatus] = field(default_factory=list)
    completions: int = 0
    """Indexes the Job runs (its spec.completions)."""
    started_at: float | None = None
    """When the Job started (status.startTime), as a Unix time; None while queued or suspended."""

    @property
    def complete(self) -> bool:
        return "Complete" in self.conditions

    @property
    def failed_terminally(self) -> bool:
        """The Job's Failed condition (`failed` is the count of failed pods, as in the Job's status)."""
        return "Failed" in self.conditions

    @property
    def finished(self) -> bool:
        """Terminal: every pod is gone, so GPUs are free for what comes next."""
        return self.complete or self.failed_terminally

    @property
    def suspended(self) -> bool:
        """Held back, e.g. by Kueue until the queue admits it."""
        return "Suspended" in self.conditions

    @property
    def failure_message(self) -> str | None:
        return self.conditions.get("Failed") or self.conditions.get("FailureTarget")


@dataclass(frozen=True, slots=True)
class RunObject:
    """An object of a run on a backend (Job, ConfigMap, Service), found by its labels."""

    api_version: str
    kind: str
    name: str
    run: str
    spec_hash: str | None

    @property
    def ref(self) -> str:
        """kubectl's name of it: job.batch/NAME, configmap/NAME, service/NAME."""
        return object_ref({"apiVersion": self.api_version, "kind": self.kind, "metadata": {"name": self.name}})


def run_objects_of(manifests: list[dict], run: str | None) -> list[RunObject]:
    """The objects among `manifests` that dflashctl made for a run (of `run`, or of any), as RunObjects."""
    found = []
    for obj in manifests:
        meta = obj["metadata"]
        labels = meta.get("labels") or {}
        if labels.get(MANAGED_BY_LABEL) == MANAGED_BY and RUN_LABEL in labels and run in (None, labels[RUN_LABEL]):
            found.append(RunObject(obj["apiVersion"], obj["kind"], meta["name"], labels[RUN_LABEL], (meta.get("annotations") or {}).get(SPEC_HASH)))
    return found


def submit_outcome(obj: dict, existing: dict | None, *, force: bool) -> str:
    """What submitting `obj` over `existing` (None: absent) does, as kubectl's dry runs say it: "created",
    "unchanged" (attached to: the same spec hash) or "replaced" (--force); a different spec without
    --force raises the Conflict the submit would."""
    if existing is None:
        return "created"
    wanted = (obj["metadata"].get("annotations") or {}).get(SPEC_HASH)
    found = (existing["metadata"].get("annotations") or {}).get(SPEC_HASH)
    if wanted is None or wanted == found:
        return "unchanged"
    if force:
        return "replaced"
    where = "/".join(filter(None, [obj["metadata"].get("namespace"), obj["metadata"]["name"]]))
    raise Conflict(
        f"{obj['kind']} {where} already exists from a different spec (spec hash {found}, this spec {wanted})",
        "Give the run a new `name:` in the spec, or pass --force to delete and recreate it (its pods are lost)",
    )


class Backend(Protocol):
    """What `dflashctl` needs from wherever Jobs run."""

    def submit(self, objects: list[dict], *, force: bool = False) -> dict[str, str]:
        """Create every object, or attach to it when it exists with the same `dflash.dev/spec-hash`.

        An existing object with a different hash raises `Conflict`, unless `force`, which deletes
        and recreates it (Jobs are immutable). Returns what became of each Job, by name: "created",
        "attached" (it exists from this spec) or "replaced".
        """

    def job_status(self, job_name: str) -> JobStatus:
        """The Job and its shards now; `exists=False` when there is no such Job."""

    def wait(
        self,
        job_name: str,
        *,
        timeout: float | None,
        on_update: Callable[[JobStatus], None] | None = None,
    ) -> JobStatus:
        """Block until the Job is finished (Complete or Failed) and return its status.

        `on_update` sees every change on the way. Raises `WaitTimeout` past `timeout` seconds and
        `RunFailed` if the Job disappears while waited on. A Failed Job is returned, not raised:
        the caller decides (with the storage markers) whether to retry its failed shards.
        """

    def logs(self, job_name: str, index: int | None, query: LogQuery = LogQuery()) -> Iterator[str]:
        """Log lines of one shard, or of every shard prefixed "[shard N] " when `index` is None.

        A container not started yet has no lines; with `query.follow` it is waited for, then followed.
        A container the pod does not have, or a previous attempt of a shard that had one attempt,
        raises InputError naming what exists.
        """

    def waiting(self, job_name: str, index: int | None) -> list[str]:
        """Why the shards that have not started (of one shard, with `index`) wait, a line each for
        a person: "shard 2: pod ... is Pending: Warning FailedScheduling: 0/4 nodes are available: ..."."""

    def find(self, kind: str, name: str) -> dict | None:
        """The object as the backend holds it (a Job, ConfigMap or Service of a run), None when absent."""

    def run_objects(self, run: str | None = None) -> list[RunObject]:
        """The Jobs, ConfigMaps and Services dflashctl made for `run` (for any run when None), by their labels."""

    def delete_object(self, kind: str, name: str) -> None:
        """Delete one object of a run (a Job with its pods, as `delete`); absent is no error."""

    def delete(self, job_name: str) -> None:
        """Delete the Job and its pods. Returns once the Job is gone, so a submit right after creates it anew."""

    def record_event(self, job_name: str, reason: str, message: str, *, warning: bool = False) -> None:
        """A milestone or failure, shown by `kubectl describe job` (kubernetes) or the events file (local)."""

    def annotate(self, job_name: str, key: str, value: str) -> None:
        """Set one annotation on the Job (e.g. dflash.dev/progress: "12/40")."""


SUBMITTED = {"created": "submitted", "attached": "attached to", "replaced": "replaced"}
"""What a person is told of a Job, by what `Backend.submit` did with it: "submitted Job X", "attached to Job X"."""


def parse_indexes(text: str | None) -> set[int]:
    """A Job's compressed index list ("1,3-5,7") as a set of ints."""
    indexes: set[int] = set()
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        first, _, last = part.partition("-")
        indexes.update(range(int(first), int(last or first) + 1))
    return indexes


def format_indexes(indexes: set[int]) -> str:
    """The inverse of parse_indexes: {1, 3, 4, 5, 7} -> "1,3-5,7"."""
    runs: list[str] = []
    ordered = sorted(indexes)
    start = 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
            first, last = ordered[start], ordered[i - 1]
            runs.append(str(first) if first == last else f"{first}-{last}")
            start = i
    return ",".join(runs)

