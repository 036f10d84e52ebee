"""The one module that talks to the Kubernetes API, through the official client.

A handful of verbs on plain dicts (create-or-attach, get, list, watch, delete, logs, patch,
events): the rest of dflashctl never sees a client model or an ApiException. Errors become the
domain's vocabulary once, here: Forbidden (401/403), ClusterUnreachable (no connection, or 5xx
after retries), Conflict (a different spec under the same name).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

import urllib3
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from dflash_jobs.errors import InputError

from dflashctl.backend import submit_outcome
from dflashctl.errors import ClusterUnreachable, DflashError, Forbidden
from dflashctl.target import current_target

log = logging.getLogger(__name__)

Obj = dict[str, Any]

# kind -> (API class, the resource's snake_case name in the client's method names)
_KINDS: dict[str, tuple[type, str]] = {
    "Job": (client.BatchV1Api, "job"),
    "Pod": (client.CoreV1Api, "pod"),
    "ConfigMap": (client.CoreV1Api, "config_map"),
    "Service": (client.CoreV1Api, "service"),
    "ServiceAccount": (client.CoreV1Api, "service_account"),
    "Event": (client.CoreV1Api, "event"),
    "Role": (client.RbacAuthorizationV1Api, "role"),
    "RoleBinding": (client.RbacAuthorizationV1Api, "role_binding"),
    "Secret": (client.CoreV1Api, "secret"),
    "PersistentVolumeClaim": (client.CoreV1Api, "persistent_volume_claim"),
    # Cluster-scoped: read with get_cluster_object / list_cluster_objects.
    "Namespace": (client.CoreV1Api, "namespace"),
    "Node": (client.CoreV1Api, "node"),
    "SelfSubjectAccessReview": (client.AuthorizationV1Api, "self_subject_access_review"),
}

# Network errors after which a call is repeated: the API server restarting, a dropped stream.
_TRANSIENT_NETWORK = (urllib3.exceptions.HTTPError, ConnectionError, socket.timeout)
_TRANSIENT_STATUS = {429, 500, 502, 503, 504}


class _NotFound(Exception):
    pass


class _AlreadyExists(Exception):
    pass


class _Expired(Exception):
    """410 Gone: the watch's resourceVersion is too old; list again."""


class _Interrupted(Exception):
    """The watch stream broke (connection lost, 5xx): resume it from the last resourceVersion."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


class Cluster:
    """One namespace of one cluster. Built by `connect`; tests build it on a fake API server."""

    retry_delays: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    """Waits between attempts of a call that failed transiently (5xx, 429, connection)."""
    poll_interval: float = 0.5
    """How often `delete(wait=...)` checks whether the object is gone."""
    watch_window: int = 30
    """Seconds per watch request; the stream is renewed after each (and the caller refreshes)."""

    def __init__(self, api_client: client.ApiClient, namespace: str) -> None:
        self.api_client = api_client
        self.namespace = namespace

    @classmethod
    def connect(cls, namespace: str) -> Cluster:
        """The kubeconfig (KUBECONFIG, ~/.kube/config), else the pod's in-cluster service account.

        `current_target()` has the last word, as kubectl's flags do: its context instead of the
        kubeconfig's current one (which then must exist), its namespace instead of `namespace`.
        """
        target = current_target()
        configuration = client.Configuration()
        # Read KUBECONFIG now: the client reads it once, at import.
        kubeconfig = os.environ.get("KUBECONFIG")
        try:
            config.load_kube_config(config_file=kubeconfig, context=target.context, client_configuration=configuration)
        except (ConfigException, FileNotFoundError, TypeError):
            if target.context is not None:
                raise _unknown_context(target.context, kubeconfig) from None
            try:
                config.load_incluster_config(client_configuration=configuration)
            except ConfigException:
                raise ClusterUnreachable(
                    "no Kubernetes configuration: no kubeconfig and not running in a pod",
                    "Set KUBECONFIG or `kubectl config use-context <context>`, or use `backend: local` in the spec",
                ) from None
        return cls(client.ApiClient(configuration), target.namespace or namespace)

    # ---- verbs ---------------------------------------------------------------------------------

    def create(self, obj: Obj) -> Obj:
        try:
            return self._call(obj["kind"], "create_namespaced_{}", self.namespace, obj)
        except _NotFound:
            # Creating answers 404 only when the namespace itself is missing: a first-run mistake.
            raise InputError(
                f"namespace {self.namespace} does not exist (creating {obj['kind']} {obj['metadata']['name']})",
                "Create it with its RBAC and volumes: `kubectl apply -k k8s/overlays/<cluster>`, or set cluster.namespace",
            ) from None

    def create_or_attach(self, obj: Obj, *, force: bool = False, wait: float = 120.0) -> str:
        """Create `obj`, or attach to the existing one with the same spec hash.

        Returns "created", "attached" or "replaced". A different hash raises Conflict unless
        `force`, which deletes the existing object (and a Job's pods) first.
        """
        kind, name = obj["kind"], obj["metadata"]["name"]
        try:
            self.create(obj)
            return "created"
        except _AlreadyExists:
            pass
        existing = self.get(kind, name)
        if existing is None or existing["metadata"].get("deletionTimestamp"):
            # Being deleted (e.g. by `cancel` a moment ago): wait for it to go, then create anew.
            self._wait_gone(kind, name, wait)
            return self._create_once_gone(obj, wait=wait)
        if submit_outcome({**obj, "metadata": {**obj["metadata"], "namespace": self.namespace}}, existing, force=force) == "unchanged":
            return "attached"
        self.delete(kind, name, wait=wait)
        return "replaced" if self._create_once_gone(obj, wait=wait) == "created" else "attached"

    def _create_once_gone(self, obj: Obj, *, wait: float) -> str:
        try:
            self.create(obj)
            return "created"
        except _AlreadyExists:
            # Another controller (a restarted pod, a terminal `run`) created it in between: attach to it.
            return self.create_or_attach(obj, wait=wait)

    def get(self, kind: str, name: str) -> Obj | None:
        try:
            return self._call(kind, "read_namespaced_{}", name, self.namespace)
        except _NotFound:
            return None

    def list(self, kind: str, *, label_selector: str | None = None, field_selector: str | None = None) -> tuple[list[Obj], str]:
        """The objects and the list's resourceVersion (where a watch starts)."""
        result = self._call(
            kind, "list_namespaced_{}", self.namespace,
            **_selectors(label_selector=label_selector, field_selector=field_selector),
        )
        return result.get("items") or [], result["metadata"].get("resourceVersion", "")

    def delete(self, kind: str, name: str, *, wait: float | None = None) -> bool:
        """Delete with its dependents (a Job's pods). With `wait`, returns once it is gone. False if absent."""
        try:
            self._call(kind, "delete_namespaced_{}", name, self.namespace, propagation_policy="Foreground")
        except _NotFound:
            return False
        if wait is not None:
            self._wait_gone(kind, name, wait)
        return True

    def patch(self, kind: str, name: str, patch: Obj) -> Obj:
        """A JSON merge patch (RFC 7386): only the keys given change."""
        return self._call(kind, "patch_namespaced_{}", name, self.namespace, patch, _content_type="application/merge-patch+json")

    def watch_object(self, kind: str, name: str, *, deadline: float | None) -> Iterator[Obj | None]:
        """The object now (None if absent), then again after every change, until `deadline` (monotonic).

        kubectl's pattern: list, then watch from the list's resourceVersion with bookmarks; a 410
        Gone lists again; a dropped stream reconnects from the last resourceVersion seen. Each
        watch request lasts at most `watch_window` seconds, after which the object is yielded
        again so that callers refresh what the Job's status does not show (pods, storage).
        """
        selector = f"metadata.name={name}"
        while True:
            items, version = self.list(kind, field_selector=selector)
            current = items[0] if items else None
            yield current
            interruptions = 0
            try:
                while True:
                    window = _window(self.watch_window, deadline)
                    if window <= 0:
                        return
                    try:
                        for event_type, obj in self._watch(kind, selector, version, window):
                            interruptions = 0
                            version = obj["metadata"].get("resourceVersion") or version
                            if event_type == "BOOKMARK":
                                continue
                            current = None if event_type == "DELETED" else obj
                            yield current
                    except _Interrupted as interrupted:
                        # A dropped stream or a 5xx: resume from the last version seen, a few times.
                        if interruptions == len(self.retry_delays):
                            raise _unreachable(self.api_client, interrupted.cause) from None
                        log.warning("watch of %s %s interrupted (%s): resuming", kind, name, interrupted.cause)
                        time.sleep(self.retry_delays[interruptions])
                        interruptions += 1
                    yield current
            except _Expired:
                log.info("watch of %s %s expired (410 Gone): listing again", kind, name)

    def logs(self, pod: str, *, container: str, follow: bool, tail: int | None = None, since_s: float | None = None) -> Iterator[str]:
        """Lines of a container's log (the last `tail`, those of the last `since_s` seconds); with `follow`, until the container exits."""
        core = client.CoreV1Api(self.api_client)
        window = _selectors(tail_lines=tail, since_seconds=None if since_s is None else max(1, math.ceil(since_s)))
        if follow:
            stream = watch.Watch().stream(core.read_namespaced_pod_log, pod, self.namespace, container=container, **window)
            yield from _translated(stream, what=f"logs of pod {pod}")
            return
        response = self._call("Pod", "read_namespaced_pod_log", pod, self.namespace, container=container, raw=True, **window)
        yield from response.decode("utf-8", errors="replace").splitlines()

    def get_cluster_object(self, kind: str, name: str) -> Obj | None:
        """A cluster-scoped object (Namespace, Node), None if absent."""
        try:
            return self._call(kind, "read_{}", name)
        except _NotFound:
            return None

    def list_cluster_objects(self, kind: str) -> list[Obj]:
        return self._call(kind, "list_{}").get("items") or []

    def can_i(self, verb: str, resource: str, *, group: str = "", subresource: str = "") -> bool:
        """Whether this client may `verb` the resource in the namespace, as `kubectl auth can-i` asks it."""
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": {
                "namespace": self.namespace, "verb": verb, "group": group, "resource": resource, "subresource": subresource,
            }},
        }
        return bool((self._call("SelfSubjectAccessReview", "create_{}", review).get("status") or {}).get("allowed"))

    def secret_keys(self, name: str) -> tuple[str, dict[str, bool]] | None:
        """A Secret's type and, for each key, whether its value is non-empty; None if absent. The values
        themselves are dropped here, never returned or logged."""
        secret = self.get("Secret", name)
        if secret is None:
            return None
        data = {**(secret.get("stringData") or {}), **(secret.get("data") or {})}
        return secret.get("type") or "Opaque", {key: bool(value) for key, value in sorted(data.items())}

    def record_event(self, involved: Obj, *, reason: str, message: str, warning: bool) -> None:
        """A core/v1 Event about `involved`: `kubectl describe` lists it under the object."""
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        meta = involved["metadata"]
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{time.time_ns():x}", "namespace": self.namespace},
            "involvedObject": {
                "apiVersion": involved["apiVersion"],
                "kind": involved["kind"],
                "name": meta["name"],
                "namespace": self.namespace,
                "uid": meta.get("uid"),
            },
            "reason": reason,
            "message": message,
            "type": "Warning" if warning else "Normal",
            "source": {"component": "dflashctl"},
            "reportingComponent": "dflash.dev/dflashctl",
            "reportingInstance": socket.gethostname()[:128],
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        self.create(event)

    # ---- plumbing ------------------------------------------------------------------------------

    def _watch(self, kind: str, field_selector: str, version: str, window: int) -> Iterator[tuple[str, Obj]]:
        """One watch request, ending when the server ends it; raises _Expired (410) or _Interrupted."""
        api = self._api(kind)
        method = getattr(api, f"list_namespaced_{_KINDS[kind][1]}")
        stream = watch.Watch().stream(
            method, self.namespace,
            field_selector=field_selector,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=window,
            # The socket gives up a little after the server should have ended the stream.
            _request_timeout=window + 10,
        )
        try:
            for event in stream:
                yield event["type"], event["raw_object"]
        except ApiException as error:
            if error.status == 410:
                raise _Expired() from None
            if error.status in _TRANSIENT_STATUS:
                raise _Interrupted(error) from None
            raise _translate(error, what=f"watch {kind}") from None
        except _TRANSIENT_NETWORK as error:
            raise _Interrupted(error) from None

    def _wait_gone(self, kind: str, name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.get(kind, name) is not None:
            if time.monotonic() > deadline:
                raise ClusterUnreachable(
                    f"{kind} {self.namespace}/{name} is still being deleted after {timeout:.0f} s",
                    f"Check its finalizers: `kubectl get {kind.lower()} {name} -n {self.namespace} -o yaml`",
                )
            time.sleep(self.poll_interval)

    def _api(self, kind: str) -> Any:
        if kind not in _KINDS:
            raise ValueError(f"dflashctl does not manage objects of kind {kind!r}")
        return _KINDS[kind][0](self.api_client)

    def _call(self, kind: str, method: str, *args: Any, raw: bool = False, **kwargs: Any) -> Any:
        """Call an API method (its name with `{}` for the resource), retrying transient failures.

        Responses are read as plain JSON (`_preload_content=False`): no client models leak out.
        """
        name = method.format(_KINDS[kind][1])
        function: Callable[..., Any] = getattr(self._api(kind), name)
        what = name.replace("_", " ")
        for attempt, delay in enumerate((*self.retry_delays, None)):
            try:
                response = function(*args, _preload_content=False, **kwargs)
                data = response.data
                return data if raw else json.loads(data or b"{}")
            except ApiException as error:
                if error.status == 404:
                    raise _NotFound() from None
                if error.status == 409 and method.startswith("create"):
                    raise _AlreadyExists() from None
                if error.status not in _TRANSIENT_STATUS or delay is None:
                    raise _translate(error, what=what) from None
                log.warning("%s: API answered %s (attempt %d), retrying in %.1f s", what, error.status, attempt + 1, delay)
            except _TRANSIENT_NETWORK as error:
                if delay is None:
                    raise _unreachable(self.api_client, error) from None
                log.warning("%s: %s (attempt %d), retrying in %.1f s", what, type(error).__name__, attempt + 1, delay)
            time.sleep(delay)
        raise AssertionError("unreachable: the last attempt raises")


def _unknown_context(context: str, kubeconfig: str | None) -> InputError:
    """--context names a context that the kubeconfig does not have (or there is no kubeconfig)."""
    try:
        contexts, _ = config.list_kube_config_contexts(config_file=kubeconfig)
        known = ", ".join(sorted(c["name"] for c in contexts)) or "none"
    except (ConfigException, FileNotFoundError, TypeError):
        known = "none: no kubeconfig"
    return InputError(
        f"--context {context} is not a context of the kubeconfig ({kubeconfig or '~/.kube/config'}; contexts: {known})",
        "Pick one of them (`kubectl config get-contexts`), or leave --context off for the current one",
    )


def _selectors(**selectors: str | int | None) -> dict[str, str | int]:
    return {key: value for key, value in selectors.items() if value is not None and value != ""}


def _window(window: int, deadline: float | None) -> int:
    if deadline is None:
        return window
    return min(window, int(deadline - time.monotonic()))


def _translated(stream: Iterator[str], *, what: str) -> Iterator[str]:
    try:
        yield from stream
    except ApiException as error:
        raise _translate(error, what=what) from None


def _translate(error: ApiException, *, what: str) -> Exception:
    detail = _api_message(error)
    if error.status in (401, 403):
        return Forbidden(
            f"the Kubernetes API refused to {what}: {detail}",
            "Check your credentials and RBAC (`kubectl auth can-i --list -n <namespace>`); k8s/components/rbac has the Role dflashctl needs",
        )
    if error.status == 400 and "log" in what:
        return DflashError(f"cannot read {what}: {detail}", "The container has not started yet; try again in a moment")
    if error.status in (400, 422):
        # The object itself was refused (schema, admission webhook, quota): retrying cannot help.
        return InputError(f"the Kubernetes API refused to {what}: {detail}", "Fix the spec field behind it (or the admission policy it names) and retry")
    return ClusterUnreachable(f"the Kubernetes API failed to {what}: {error.status} {detail}", "Check the API server (`kubectl get --raw /readyz`) and retry")


def _unreachable(api_client: client.ApiClient, error: Exception) -> ClusterUnreachable:
    host = api_client.configuration.host
    cause = f"{error.status} {_api_message(error)}" if isinstance(error, ApiException) else type(error).__name__
    return ClusterUnreachable(
        f"the Kubernetes API at {host} is unreachable ({cause})",
        "Check the current context (`kubectl config current-context`) and the network, then retry",
    )


def _api_message(error: ApiException) -> str:
    try:
        return json.loads(error.body)["message"]
    except (TypeError, ValueError, KeyError):
        return str(error.reason)

