"""A test double of the Kubernetes HTTP API, for the official client to talk to.

A real HTTP server on 127.0.0.1 in a thread: create (409 on a taken name), get, list, watch
(resourceVersions, bookmarks, 410 Gone once history is compacted, chunked streams that can be cut),
merge patch, delete, pod logs (also followed). A small job controller moves Jobs and their pods
through their lifecycle the way batch/v1 does (Indexed, backoffLimitPerIndex, podFailurePolicy
with Ignore/FailIndex/FailJob, DisruptionTarget), on the test's command:

    api.start("run-extract")                     # pending pods get a node and run
    api.finish("run-extract", 1, exit_code=42)   # index 1 ends; the controller reacts
    api.preempt("run-extract", 2)                # evicted with a DisruptionTarget condition
    api.unschedulable("run-extract", 0, "0/4 nodes are available: ...")  # FailedScheduling event
    api.fail_requests(2, status=500)             # the next two requests fail
    api.compact()                                # watches from older versions get 410 Gone
    api.drop_watches()                           # open watch streams are cut mid-stream

The rest of a cluster a first run meets: namespaces (`namespaces`), nodes with labels, taints and
allocatable resources, Secrets, PersistentVolumeClaims with their phase (`api.add(obj)`), what this
client may do (SelfSubjectAccessReview, answered from `api.deny(verb, resource)`), and pods created
on their own, which a scripted kubelet runs (`api.kubelet = lambda pod: PodRun(exit_code, logs)`).
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from dflashctl.backend import format_indexes, parse_indexes

Obj = dict[str, Any]

RESOURCES = {
    ("batch/v1", "jobs"): "Job",
    ("v1", "secrets"): "Secret",
    ("v1", "persistentvolumeclaims"): "PersistentVolumeClaim",
    ("v1", "pods"): "Pod",
    ("v1", "configmaps"): "ConfigMap",
    ("v1", "services"): "Service",
    ("v1", "serviceaccounts"): "ServiceAccount",
    ("v1", "events"): "Event",
    ("rbac.authorization.k8s.io/v1", "roles"): "Role",
    ("rbac.authorization.k8s.io/v1", "rolebindings"): "RoleBinding",
}
CLUSTER_RESOURCES = {
    ("v1", "namespaces"): "Namespace",
    ("v1", "nodes"): "Node",
    ("authorization.k8s.io/v1", "selfsubjectaccessreviews"): "SelfSubjectAccessReview",
}
_PATH = re.compile(
    r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+/[^/]+))/namespaces/(?P<ns>[^/]+)/(?P<resource>[a-z]+)"
    r"(?:/(?P<name>[^/]+)(?:/(?P<sub>log|status))?)?$"
)
_CLUSTER_PATH = re.compile(r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+/[^/]+))/(?P<resource>[a-z]+)(?:/(?P<name>[^/]+))?$")
_EPOCH = datetime(2026, 12, 2, 12, 0, 0, tzinfo=timezone.utc)


@dataclass
class PodRun:
    """What the scripted kubelet makes of a pod: it runs and exits with `exit_code`, having logged
    `logs` (its termination message the log's tail when it fails); or it cannot start, waiting with
    `waiting` (e.g. ErrImagePull) and `message`."""

    exit_code: int = 0
    logs: list[str] = field(default_factory=list)
    waiting: str | None = None
    message: str = ""


@dataclass
class _Fault:
    count: int
    status: int
    method: str | None
    path: str | None


@dataclass
class FakeKubernetes:
    """The cluster's state, and the commands that move it. All state changes hold `lock`."""

    objects: dict[tuple[str, str], Obj] = field(default_factory=dict)
    history: list[tuple[int, str, str, Obj]] = field(default_factory=list)
    """(resourceVersion, kind, event type, object) of every change, for watches."""
    version: int = 100
    compacted: int = 0
    """Watches from a resourceVersion below this get 410 Gone."""
    logs: dict[tuple[str, str], list[tuple[float, str]]] = field(default_factory=dict)
    """(pod, container) -> (Unix time written, line) of each line its container logged."""
    requests: list[tuple[str, str]] = field(default_factory=list)
    """(method, path?query) of every request, for assertions."""
    faults: list[_Fault] = field(default_factory=list)
    watch_generation: int = 0
    """Bumped by drop_watches(): streams opened before it are cut."""
    sent_gone: int = 0
    sent_bookmarks: int = 0
    index_failures: dict[str, dict[int, int]] = field(default_factory=dict)
    """Job uid -> index -> failed pods counted against backoffLimitPerIndex."""
    namespaces: set[str] | None = None
    """The namespaces that exist; None: every one does."""
    denied: set[tuple[str, str, str, str]] = field(default_factory=set)
    """(verb, group, resource, subresource) this client may not do: SelfSubjectAccessReviews answer from it."""
    kubelet: Any = None
    """A function pod -> PodRun for pods created on their own (not by a Job); None: they stay Pending."""
    lock: threading.Condition = field(default_factory=threading.Condition)
    _clock: itertools.count = field(default_factory=itertools.count)

    # ---- commands: the cluster's side of the story ---------------------------------------------

    def start(self, job: str, *, node: str = "gpu-node-1") -> None:
        """Every pending pod of the Job is scheduled and runs."""
        with self.lock:
            for pod in self._pods_of(job):
                if pod["status"]["phase"] == "Pending":
                    pod["spec"]["nodeName"] = node
                    pod["status"]["phase"] = "Running"
                    pod["status"]["initContainerStatuses"] = [
                        container_status(pod, init["name"], {"terminated": {"exitCode": 0, "reason": "Completed"}})
                        for init in pod["spec"].get("initContainers") or []
                    ]
                    pod["status"]["containerStatuses"] = [container_status(pod, "worker", {"running": {}}, ready=True)]
                    self._changed("MODIFIED", pod)
            self._sync_job(job)

    def finish(self, job: str, index: int, *, exit_code: int = 0, message: str | None = None, container: str = "worker") -> None:
        """The live pod of `index` exits (with `message` as its termination message): its worker, or an init
        container (a failing one ends the pod before the worker starts); the job controller reacts."""
        self._terminate(job, index, exit_code=exit_code, conditions=[], message=message, container=container)

    def preempt(self, job: str, index: int) -> None:
        """The pod of `index` is evicted (preemption): DisruptionTarget, then killed by SIGTERM."""
        disruption = {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}
        self._terminate(job, index, exit_code=143, conditions=[disruption])

    def unschedulable(self, job: str, index: int, message: str, *, times: int = 1) -> None:
        """The scheduler finds no node for the pending pod of `index`: PodScheduled False, and a
        FailedScheduling event about the pod, as kube-scheduler records it (counted `times`)."""
        with self.lock:
            pod = self._live_pod(job, index)
            pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]
            self._changed("MODIFIED", pod)
            meta = pod["metadata"]
            now = self._now()
            self._create("Event", meta["namespace"], {
                "metadata": {"name": f"{meta['name']}.{next(self._clock):x}"},
                "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]},
                "reason": "FailedScheduling", "message": message, "type": "Warning", "count": times,
                "source": {"component": "default-scheduler"}, "firstTimestamp": now, "lastTimestamp": now,
            })

    def write_log(self, job: str, index: int, *lines: str, container: str = "worker", at: float | None = None) -> None:
        """Lines the container of the index's newest pod logs, at Unix time `at` (now by default)."""
        with self.lock:
            pod = self._live_pod(job, index, any_phase=True)["metadata"]["name"]
            written = time.time() if at is None else at
            self.logs.setdefault((pod, container), []).extend((written, line) for line in lines)
            self.lock.notify_all()

    def fail_requests(self, count: int, *, status: int = 500, method: str | None = None, path: str | None = None) -> None:
        """The next `count` requests (matching `method` and containing `path`) answer `status`."""
        with self.lock:
            self.faults.append(_Fault(count, status, method, path))

    def compact(self, below: int | None = None) -> None:
        """Forget the history below `below` (default: all of it): older watches get 410 Gone."""
        with self.lock:
            self.compacted = self.version + 1 if below is None else below
            self.lock.notify_all()

    def drop_watches(self) -> None:
        """Cut every open watch stream mid-stream, as a lost connection would."""
        with self.lock:
            self.watch_generation += 1
            self.lock.notify_all()

    def add(self, obj: Obj) -> None:
        """An object that exists in the cluster (a node, a Secret, a PVC), as the API returns it."""
        with self.lock:
            obj = copy.deepcopy(obj)
            obj.setdefault("metadata", {}).setdefault("uid", str(uuid.uuid4()))
            self.objects[(obj["kind"], obj["metadata"]["name"])] = obj
            self._changed("ADDED", obj)

    def deny(self, verb: str, resource: str, *, group: str = "", subresource: str = "") -> None:
        with self.lock:
            self.denied.add((verb, group, resource, subresource))

    def review(self, body: Obj) -> tuple[int, Obj]:
        """A SelfSubjectAccessReview: allowed unless denied, with the reason RBAC gives."""
        attributes = body["spec"]["resourceAttributes"]
        key = (attributes.get("verb", ""), attributes.get("group", ""), attributes.get("resource", ""), attributes.get("subresource", ""))
        allowed = key not in self.denied
        reason = "" if not allowed else f'RBAC: allowed by RoleBinding "dflash-controller/{attributes.get("namespace")}"'
        return 201, {**body, "status": {"allowed": allowed, "reason": reason}}

    def get(self, kind: str, name: str) -> Obj | None:
        with self.lock:
            obj = self.objects.get((kind, name))
            return copy.deepcopy(obj) if obj else None

    def all(self, kind: str) -> list[Obj]:
        with self.lock:
            return [copy.deepcopy(o) for (k, _), o in sorted(self.objects.items()) if k == kind]

    def requests_matching(self, method: str, fragment: str) -> list[str]:
        with self.lock:
            return [path for m, path in self.requests if m == method and fragment in path]

    # ---- the API -------------------------------------------------------------------------------

    def create(self, kind: str, namespace: str, body: Obj) -> tuple[int, Obj]:
        with self.lock:
            return self._create(kind, namespace, body)

    def _create(self, kind: str, namespace: str, body: Obj) -> tuple[int, Obj]:
        name = body.get("metadata", {}).get("name")
        if self.namespaces is not None and namespace not in self.namespaces:
            return 404, _status(404, "NotFound", f'namespaces "{namespace}" not found')
        if (kind, name) in self.objects:
            return 409, _status(409, "AlreadyExists", f'{kind.lower()}s "{name}" already exists')
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        meta.update({"namespace": namespace, "uid": str(uuid.uuid4()), "creationTimestamp": self._now()})
        obj["apiVersion"], obj["kind"] = _api_version(kind), kind
        if kind == "Job":
            obj["status"] = {"startTime": meta["creationTimestamp"]}
        if kind == "Pod":
            obj["status"] = {"phase": "Pending"}
        self.objects[(kind, name)] = obj
        self._changed("ADDED", obj)
        if kind == "Job":
            self._create_pods(obj)
            self._sync_job(name)
        if kind == "Pod" and self.kubelet is not None:
            self._run_pod(obj, self.kubelet(copy.deepcopy(obj)))
        return 201, obj

    def _run_pod(self, pod: Obj, run: PodRun) -> None:
        """The kubelet's story of a pod on its own: scheduled, then ended (or stuck waiting)."""
        name = pod["spec"]["containers"][0]["name"]
        pod["spec"]["nodeName"] = "cpu-node-1"
        pod["status"] = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]}
        if run.waiting is not None:
            pod["status"]["containerStatuses"] = [container_status(pod, name, {"waiting": {"reason": run.waiting, "message": run.message}})]
            self._changed("MODIFIED", pod)
            return
        self.logs[(pod["metadata"]["name"], name)] = [(time.time(), line) for line in run.logs]
        terminated = {"exitCode": run.exit_code, "reason": "Completed" if run.exit_code == 0 else "Error"}
        if run.exit_code:
            terminated["message"] = "\n".join(run.logs[-80:])  # terminationMessagePolicy FallbackToLogsOnError
        pod["status"].update({"phase": "Succeeded" if run.exit_code == 0 else "Failed",
                              "containerStatuses": [container_status(pod, name, {"terminated": terminated})]})
        self._changed("MODIFIED", pod)

    def patch(self, kind: str, name: str, patch: Obj) -> tuple[int, Obj]:
        with self.lock:
            obj = self.objects.get((kind, name))
            if obj is None:
                return 404, _status(404, "NotFound", f'{kind.lower()}s "{name}" not found')
            _merge(obj, patch)
            self._changed("MODIFIED", obj)
            return 200, obj

    def delete(self, kind: str, name: str) -> tuple[int, Obj]:
        with self.lock:
            return self._delete(kind, name)

    def _delete(self, kind: str, name: str) -> tuple[int, Obj]:
        obj = self.objects.pop((kind, name), None)
        if obj is None:
            return 404, _status(404, "NotFound", f'{kind.lower()}s "{name}" not found')
        self._changed("DELETED", obj)
        if kind == "Job":  # foreground propagation: the pods go with it
            for pod in self._pods_of(name, uid=obj["metadata"]["uid"]):
                del self.objects[("Pod", pod["metadata"]["name"])]
                self._changed("DELETED", pod)
        return 200, _status(200, "Success", "deleted")

    def matching(self, kind: str, query: dict[str, str]) -> list[Obj]:
        return [o for (k, _), o in sorted(self.objects.items()) if k == kind and _selected(o, query)]

    # ---- the job controller --------------------------------------------------------------------

    def _create_pods(self, job: Obj, indexes: list[int] | None = None, failures: dict[int, int] | None = None) -> None:
        spec = job["spec"]
        indexed = spec.get("completionMode") == "Indexed"
        for index in indexes if indexes is not None else range(spec.get("parallelism", 1)):
            name = job["metadata"]["name"]
            template = copy.deepcopy(spec["template"])
            labels = {**template["metadata"].get("labels", {}), "batch.kubernetes.io/job-name": name,
                      "batch.kubernetes.io/controller-uid": job["metadata"]["uid"]}
            annotations = dict(template["metadata"].get("annotations", {}))
            if indexed:
                labels["batch.kubernetes.io/job-completion-index"] = str(index)
                annotations["batch.kubernetes.io/job-completion-index"] = str(index)
                annotations["batch.kubernetes.io/job-index-failure-count"] = str((failures or {}).get(index, 0))
            pod_name = f"{name}-{index}-{next(self._clock):05d}" if indexed else f"{name}-{next(self._clock):05d}"
            pod = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod_name, "namespace": job["metadata"]["namespace"], "uid": str(uuid.uuid4()),
                             "creationTimestamp": self._now(), "labels": labels, "annotations": annotations},
                "spec": template["spec"],
                "status": {"phase": "Pending"},
            }
            self.objects[("Pod", pod_name)] = pod
            self._changed("ADDED", pod)

    def _terminate(self, job: str, index: int, *, exit_code: int, conditions: list[Obj], message: str | None = None,
                   container: str = "worker") -> None:
        with self.lock:
            pod = self._live_pod(job, index)
            terminated = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error", **({"message": message} if message else {})}
            pod["status"].update({"phase": "Succeeded" if exit_code == 0 else "Failed", "conditions": conditions})
            if container == "worker":
                pod["status"]["containerStatuses"] = [container_status(pod, "worker", {"terminated": terminated})]
            else:  # an init container ended the pod: the worker never started
                pod["status"]["initContainerStatuses"] = [container_status(pod, container, {"terminated": terminated})]
                pod["status"]["containerStatuses"] = [container_status(pod, "worker", {"waiting": {"reason": "PodInitializing"}})]
            self._changed("MODIFIED", pod)
            self._pod_ended(job, index, pod)

    def _pod_ended(self, job_name: str, index: int, pod: Obj) -> None:
        job = self.objects[("Job", job_name)]
        spec, status = job["spec"], job["status"]
        indexed = spec.get("completionMode") == "Indexed"
        failures = self.index_failures.setdefault(job["metadata"]["uid"], {})
        if pod["status"]["phase"] == "Succeeded":
            status["succeeded"] = status.get("succeeded", 0) + 1
            if indexed:
                status["completedIndexes"] = format_indexes(parse_indexes(status.get("completedIndexes")) | {index})
        else:
            action = _policy_action(spec.get("podFailurePolicy"), pod)
            if action != "Ignore":
                status["failed"] = status.get("failed", 0) + 1
            failures[index] = failures.get(index, 0) + (action != "Ignore")
            if action == "FailJob":
                self._finish_job(job, "Failed", "PodFailurePolicy", f"Container worker for pod {pod['metadata']['name']} failed with exit code matching FailJob rule")
            elif indexed and (action == "FailIndex" or failures[index] > spec.get("backoffLimitPerIndex", 6)):
                status["failedIndexes"] = format_indexes(parse_indexes(status.get("failedIndexes")) | {index})
            elif not indexed and sum(failures.values()) > spec.get("backoffLimit", 6):
                self._finish_job(job, "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")
            else:  # podReplacementPolicy Failed: the replacement starts now that the pod has failed
                self._create_pods(job, [index], failures)
        self._sync_job(job_name)

    def _sync_job(self, job_name: str) -> None:
        job = self.objects[("Job", job_name)]
        spec, status = job["spec"], job["status"]
        status["active"] = sum(p["status"]["phase"] in ("Pending", "Running") for p in self._pods_of(job_name))
        status["ready"] = sum(p["status"]["phase"] == "Running" for p in self._pods_of(job_name))
        completions = spec.get("completions", 1)
        done = parse_indexes(status.get("completedIndexes")) if spec.get("completionMode") == "Indexed" else set(range(status.get("succeeded", 0)))
        failed = parse_indexes(status.get("failedIndexes"))
        if not _terminal(job) and len(done | failed) >= completions:
            if failed:
                self._finish_job(job, "Failed", "FailedIndexes", "Job has failed indexes")
            else:
                self._finish_job(job, "Complete", "CompletionsReached", "Reached expected number of succeeded pods")
        self._changed("MODIFIED", job)

    def _finish_job(self, job: Obj, outcome: str, reason: str, message: str) -> None:
        interim = "FailureTarget" if outcome == "Failed" else "SuccessCriteriaMet"
        job["status"]["conditions"] = [
            {"type": interim, "status": "True", "reason": reason, "message": message},
            {"type": outcome, "status": "True", "reason": reason, "message": message},
        ]
        for pod in self._pods_of(job["metadata"]["name"]):
            if pod["status"]["phase"] in ("Pending", "Running"):
                pod["status"]["phase"] = "Failed"
                self._changed("MODIFIED", pod)

    # ---- plumbing ------------------------------------------------------------------------------

    def _pods_of(self, job: str, uid: str | None = None) -> list[Obj]:
        return [
            o for (k, _), o in sorted(self.objects.items())
            if k == "Pod" and o["metadata"]["labels"].get("batch.kubernetes.io/job-name") == job
            and (uid is None or o["metadata"]["labels"].get("batch.kubernetes.io/controller-uid") == uid)
        ]

    def _live_pod(self, job: str, index: int, *, any_phase: bool = False) -> Obj:
        pods = [p for p in self._pods_of(job) if int(p["metadata"]["annotations"].get("batch.kubernetes.io/job-completion-index", 0)) == index]
        live = [p for p in pods if any_phase or p["status"]["phase"] in ("Pending", "Running")]
        if not live:
            raise AssertionError(f"no live pod for {job} index {index}")
        return live[-1]

    def _changed(self, event: str, obj: Obj) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.history.append((self.version, obj["kind"], event, copy.deepcopy(obj)))
        self.lock.notify_all()

    def _now(self) -> str:
        return (_EPOCH + timedelta(seconds=next(self._clock))).strftime("%Y-%m-%dT%H:%M:%SZ")

    def take_fault(self, method: str, path: str) -> int | None:
        for fault in self.faults:
            if fault.count > 0 and (fault.method in (None, method)) and (fault.path is None or fault.path in path):
                fault.count -= 1
                return fault.status
        return None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall per request
    server: _Server

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        try:
            self._serve(method)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away (it stopped a watch or a log stream)

    def _serve(self, method: str) -> None:
        api = self.server.api
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        with api.lock:
            api.requests.append((method, self.path))
            fault = api.take_fault(method, self.path)
        if fault is not None:
            return self._send(fault, _status(fault, "InternalError" if fault >= 500 else "Forbidden", f"injected {fault}"))
        match = _PATH.match(url.path)
        if not match:
            return self._serve_cluster_scoped(method, url.path, query, body)
        kind = RESOURCES.get((match["core"] or match["group"], match["resource"]))
        if kind is None:
            return self._send(404, _status(404, "NotFound", f"unknown resource {match['resource']}"))
        name, sub = match["name"], match["sub"]
        if method == "GET" and sub == "log":
            return self._logs(name, query)
        if method == "GET" and name is None and query.get("watch", "").lower() == "true":
            return self._watch(kind, query)
        with api.lock:
            if method == "POST":
                code, obj = api.create(kind, match["ns"], body)
            elif method == "GET" and name is None:
                # A list answers for its namespace (objects added without one are seen from every namespace).
                items = [o for o in api.matching(kind, query) if o["metadata"].get("namespace") in (None, match["ns"])]
                code, obj = 200, {"kind": f"{kind}List", "apiVersion": _api_version(kind),
                                  "metadata": {"resourceVersion": str(api.version)}, "items": items}
            elif method == "GET":
                obj = api.objects.get((kind, name))
                code, obj = (200, obj) if obj else (404, _status(404, "NotFound", f'{kind.lower()}s "{name}" not found'))
            elif method == "PATCH":
                code, obj = api.patch(kind, name, body)
            else:
                code, obj = api.delete(kind, name)
            payload = json.dumps(obj)
        self._send(code, payload)

    def _serve_cluster_scoped(self, method: str, path: str, query: dict[str, str], body: Obj | None) -> None:
        """Namespaces and nodes (get, list) and SelfSubjectAccessReviews (create)."""
        api = self.server.api
        match = _CLUSTER_PATH.match(path)
        kind = match and CLUSTER_RESOURCES.get((match["core"] or match["group"], match["resource"]))
        if not kind:
            return self._send(404, _status(404, "NotFound", f"no route {path}"))
        name = match["name"]
        with api.lock:
            if kind == "SelfSubjectAccessReview" and method == "POST":
                code, obj = api.review(body)
            elif kind == "Namespace" and method == "GET" and name is not None:
                exists = api.namespaces is None or name in api.namespaces
                code, obj = (200, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}, "status": {"phase": "Active"}}) if exists \
                    else (404, _status(404, "NotFound", f'namespaces "{name}" not found'))
            elif method == "GET" and name is None:
                code, obj = 200, {"kind": f"{kind}List", "apiVersion": "v1", "metadata": {"resourceVersion": str(api.version)},
                                  "items": api.matching(kind, query)}
            elif method == "GET":
                found = api.objects.get((kind, name))
                code, obj = (200, found) if found else (404, _status(404, "NotFound", f'{kind.lower()}s "{name}" not found'))
            else:
                code, obj = 405, _status(405, "MethodNotAllowed", f"{method} {path}")
            payload = json.dumps(obj)
        self._send(code, payload)

    def _send(self, code: int, body: Obj | str) -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _start_stream(self, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _watch(self, kind: str, query: dict[str, str]) -> None:
        api = self.server.api
        since = int(query.get("resourceVersion") or 0)
        deadline = time.monotonic() + int(query.get("timeoutSeconds") or 30)
        bookmarks = query.get("allowWatchBookmarks", "").lower() == "true"
        self._start_stream("application/json")
        with api.lock:
            generation = api.watch_generation
            if since < api.compacted:
                api.sent_gone += 1
                gone = _status(410, "Expired", f"too old resource version: {since} ({api.compacted})")
                self._chunk(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
                return self._end_stream()
        while True:
            with api.lock:
                if api.watch_generation != generation:
                    # A lost connection: the socket closes in the middle of a chunk.
                    self.close_connection = True
                    self.wfile.write(b"ff\r\npartial")
                    self.wfile.flush()
                    return
                events = [(v, e, o) for v, k, e, o in api.history if v > since and k == kind and _selected(o, query)]
                if not events and bookmarks and api.version > since:
                    # Other objects changed: tell the client how far it is up to date.
                    marker = {"kind": kind, "apiVersion": _api_version(kind), "metadata": {"resourceVersion": str(api.version)}}
                    events = [(api.version, "BOOKMARK", marker)]
                    api.sent_bookmarks += 1
                if not events:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return self._end_stream()
                    api.lock.wait(min(remaining, 0.2))
                    continue
            for version, event, obj in events:
                since = version
                self._chunk(json.dumps({"type": event, "object": obj}).encode() + b"\n")

    def _logs(self, pod: str, query: dict[str, str]) -> None:
        """A container's log as the kubelet serves it: 400 before the container started; tailLines,
        sinceSeconds (by when each line was written) and follow."""
        api = self.server.api
        container = query.get("container", "worker")
        follow = query.get("follow", "").lower() == "true"
        since = time.time() - int(query["sinceSeconds"]) if "sinceSeconds" in query else None
        with api.lock:
            obj = api.objects.get(("Pod", pod))
            if obj is not None and not _container_started(obj, container):
                message = f'container "{container}" in pod "{pod}" is waiting to start: PodInitializing'
                return self._send(400, _status(400, "BadRequest", message))
            backlog = [line for written, line in api.logs.get((pod, container), []) if since is None or written >= since]
            sent = len(api.logs.get((pod, container), []))
        if "tailLines" in query:
            backlog = backlog[len(backlog) - int(query["tailLines"]):] if int(query["tailLines"]) else []
        self._start_stream("text/plain")
        for line in backlog:
            self._chunk(line.encode() + b"\n")
        while follow:
            with api.lock:
                lines = [line for _, line in api.logs.get((pod, container), [])[sent:]]
                obj = api.objects.get(("Pod", pod))
                ended = obj is None or obj["status"]["phase"] in ("Succeeded", "Failed")
                if not lines and not ended:
                    api.lock.wait(0.2)
                    continue
            for line in lines:
                self._chunk(line.encode() + b"\n")
            sent += len(lines)
            if ended and not lines:
                break
        self._end_stream()


def _container_started(pod: Obj, container: str) -> bool:
    statuses = [*pod["status"].get("initContainerStatuses", []), *pod["status"].get("containerStatuses", [])]
    return any(s["name"] == container and ("running" in s["state"] or "terminated" in s["state"]) for s in statuses)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    api: FakeKubernetes


class FakeApiServer:
    """The HTTP server around a FakeKubernetes, and a kubeconfig pointing at it."""

    def __init__(self) -> None:
        self.api = FakeKubernetes()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.api = self.api
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeApiServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.api.drop_watches()
        self._server.shutdown()
        self._server.server_close()

    def write_kubeconfig(self, path: Path, *, namespace: str = "dflash") -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "test-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester", "namespace": namespace}}],
        }))
        return path


def make_pvc(name: str, *, phase: str = "Bound", modes: tuple[str, ...] = ("ReadWriteMany",), size: str = "1Ti") -> Obj:
    """A PersistentVolumeClaim as the API returns it."""
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
            "spec": {"accessModes": list(modes), "resources": {"requests": {"storage": size}}},
            "status": {"phase": phase, **({"accessModes": list(modes), "capacity": {"storage": size}} if phase == "Bound" else {})}}


def make_node(name: str, *, gpus: int = 8, cpu: str = "128", memory: str = "2Ti", labels: dict | None = None,
              taints: list | None = None, unschedulable: bool = False) -> Obj:
    """A node with its allocatable resources (GPUs from the device plugin), labels and taints."""
    allocatable = {"cpu": cpu, "memory": memory, "pods": "110", **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
            "spec": {**({"taints": taints} if taints else {}), **({"unschedulable": True} if unschedulable else {})},
            "status": {"allocatable": allocatable, "capacity": allocatable}}


def make_secret(name: str, data: dict[str, str], *, type: str = "Opaque") -> Obj:
    """A Secret; `data` values are base64-encoded as the API returns them."""
    import base64

    return {"apiVersion": "v1", "kind": "Secret", "type": type, "metadata": {"name": name},
            "data": {key: base64.b64encode(value.encode()).decode() for key, value in data.items()}}


def _api_version(kind: str) -> str:
    return next(group for (group, _), k in RESOURCES.items() if k == kind)


def _status(code: int, reason: str, message: str) -> Obj:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure" if code >= 300 else "Success",
            "code": code, "reason": reason, "message": message}


def _selected(obj: Obj, query: dict[str, str]) -> bool:
    for term in filter(None, query.get("fieldSelector", "").split(",")):
        path, _, value = term.partition("=")  # metadata.name, involvedObject.name (events), ...
        found: Any = obj
        for key in path.split("."):
            found = found.get(key) if isinstance(found, dict) else None
        if found != value:
            return False
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, query.get("labelSelector", "").split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


def _merge(target: Obj, patch: Obj) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def _terminal(job: Obj) -> bool:
    return any(c["type"] in ("Complete", "Failed") for c in job["status"].get("conditions", []))


def _policy_action(policy: Obj | None, pod: Obj) -> str | None:
    """The first podFailurePolicy rule matching the failed pod, as the job controller evaluates it."""
    status = pod["status"]
    conditions = {c["type"] for c in status.get("conditions", []) if c.get("status") == "True"}
    codes = [c["state"]["terminated"]["exitCode"] for c in [*status.get("initContainerStatuses", []), *status.get("containerStatuses", [])]
             if "terminated" in c.get("state", {})]
    for rule in (policy or {}).get("rules", []):
        if any(p["type"] in conditions for p in rule.get("onPodConditions", [])):
            return rule["action"]
        on_codes = rule.get("onExitCodes")
        if on_codes and any((code in on_codes["values"]) == (on_codes["operator"] == "In") for code in codes):
            return rule["action"]
    return None


@pytest.fixture
def fake_k8s(tmp_path, monkeypatch):
    """A fresh fake API server; KUBECONFIG points at it and the client's waits are short."""
    from dflashctl.cluster import Cluster

    server = FakeApiServer().start()
    monkeypatch.setenv("KUBECONFIG", str(server.write_kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.setattr(Cluster, "retry_delays", (0.01, 0.01, 0.01))
    monkeypatch.setattr(Cluster, "poll_interval", 0.02)
    monkeypatch.setattr(Cluster, "watch_window", 2)
    try:
        yield server
    finally:
        server.stop()


def container_status(pod: Obj, name: str, state: Obj, *, ready: bool = False) -> Obj:
    """A container's status as the kubelet reports it: image and imageID are required fields of the API
    (the typed client refuses a status without them)."""
    containers = [*pod["spec"].get("initContainers", []), *pod["spec"].get("containers", [])]
    image = next((c.get("image", "unknown") for c in containers if c["name"] == name), "unknown")
    return {"name": name, "image": image, "imageID": f"{image}@sha256:{'0' * 64}", "ready": ready, "restartCount": 0, "state": state}
