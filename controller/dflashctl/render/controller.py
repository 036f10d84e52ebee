"""The in-cluster controller's own objects: the CPU Job running `dflashctl run`, and the
ServiceAccount, Role and RoleBinding it acts through."""

from __future__ import annotations

from typing import Any

from dflash_jobs.errors import EXIT_BAD_SPEC
from dflash_jobs.spec import RunSpec

from dflashctl.errors import EXIT_RUN_FAILED
from dflashctl.placement import placement_fields
from dflashctl.render.names import MANAGED_BY, MANAGED_BY_LABEL, SPEC_PATH, Manifest, pod_metadata
from dflashctl.render.pods import (
    CACHE_DIR, WORKER, component_job, ignore_disruptions, make_container, output_mounts, output_volumes, pod_security,
    spec_mount, spec_volume,
)

METRICS_PORT_NAME = "metrics"
# The controller only watches.
CONTROLLER_RESOURCES = {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}
# Its retries: it attaches to what exists.
CONTROLLER_BACKOFF_LIMIT = 6


def controller_role_rules() -> list[dict[str, Any]]:
    """What the in-cluster controller may do in its namespace. k8s/components/rbac holds a copy (tested equal)."""
    return [
        # Create, watch, annotate and delete (cancel, retry, --force) the Jobs of a run.
        {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
        # The shard table and `dflashctl logs`.
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
        # The spec ConfigMap and the rendezvous Service of multi-node training.
        {"apiGroups": [""], "resources": ["configmaps", "services"], "verbs": ["get", "create", "delete"]},
        # Milestones and failures, shown by `kubectl describe job`.
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
    ]


def render_controller_objects(spec: RunSpec) -> list[Manifest]:
    """The in-cluster pipeline: a CPU Job running `dflashctl run`, with its ServiceAccount, Role and RoleBinding.

    The RBAC objects are shared by every run of the namespace, so they carry no run label and no
    spec hash: submitting a second run attaches to them.
    """
    account = spec.cluster.service_account
    shared = {"name": account, "namespace": spec.cluster.namespace, "labels": _shared_labels()}
    rbac = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(shared)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": dict(shared),
            "rules": controller_role_rules(),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": dict(shared),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": spec.cluster.namespace}],
        },
    ]
    container = make_container(
        spec,
        name=WORKER,
        image=spec.cluster.controller_image,
        command=["dflashctl", "run", "-f", SPEC_PATH],
        resources=CONTROLLER_RESOURCES,
        mounts=[spec_mount(), {"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": CACHE_DIR}, *output_mounts(spec)],
    )
    if spec.cluster.metrics_port is not None:
        # By name: the Service of k8s/components/metrics targets "metrics", whatever the number.
        container["ports"] = [{"name": METRICS_PORT_NAME, "containerPort": spec.cluster.metrics_port, "protocol": "TCP"}]
    pod_spec = {
        "serviceAccountName": account,
        "restartPolicy": "Never",
        "securityContext": pod_security(),
        **placement_fields(spec, gpu=False),
        "containers": [container],
        "volumes": [spec_volume(spec), {"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}, *output_volumes(spec)],
    }
    pod = {"metadata": pod_metadata(spec, "controller"), "spec": pod_spec}
    job = component_job(spec, "controller", pod, {
        "backoffLimit": CONTROLLER_BACKOFF_LIMIT,
        # A failed run (exit 1) or a bad spec (exit 2) fails the same way again; anything else
        # (storage or API server unavailable for long: 5, 4; OOM; node drain) is retried, and the
        # new pod attaches to the run.
        "podFailurePolicy": {"rules": [
            ignore_disruptions(),
            {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [EXIT_RUN_FAILED, EXIT_BAD_SPEC]}},
        ]},
    }, queue=False)
    return [*rbac, job]


def _shared_labels() -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "dflash",
        "app.kubernetes.io/component": "controller",
        "app.kubernetes.io/part-of": "dflash-k8s",
        MANAGED_BY_LABEL: MANAGED_BY,
    }
