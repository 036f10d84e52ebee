"""What every pod of a run is built from, whoever renders it (the steps' Jobs, the controller's Job,
the helper pods of tool_pods.py): the spec ConfigMap and its mount, non-root containers with a
read-only root filesystem whose writable paths point into volumes, S3 credentials only by Secret
reference, the Job around a pod and its failure policy."""

from __future__ import annotations

import copy
from typing import Any

from dflash_jobs.errors import EXIT_BAD_INPUT, EXIT_BAD_SPEC
from dflash_jobs.spec import MODEL_CACHE_ENV, RunSpec, dump_spec

from dflashctl.placement import extra_labels, finish_pod_template
from dflashctl.render.names import QUEUE_LABEL, SPEC_DIR, SPEC_FILE, Manifest, configmap_name, job_name, object_metadata

WORKER = "worker"
RUN_AS_USER = 10001  # the images' user (UID 1000 is ubuntu in Ubuntu 24.04 images)
CACHE_DIR = "/var/cache/dflash"
MODEL_CACHE_DIR = "/var/cache/dflash-models"
"""Where cluster.model_cache is mounted."""
KERNEL_CACHE_DIR = "/var/cache/dflash-kernels"
"""Where cluster.kernel_cache is mounted."""
OUTPUT_VOLUME = "output"
"""The volume of cluster.output_volume, mounted read-write at its mount path."""


def render_configmap(spec: RunSpec) -> Manifest:
    """The resolved spec, mounted by every pod at /etc/dflash/dflash.yaml."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_metadata(spec, configmap_name(spec), "spec"),
        "data": {SPEC_FILE: dump_spec(spec)},
    }


def component_job(spec: RunSpec, component: str, pod: dict[str, Any], job_spec: dict[str, Any], *, queue: bool = True) -> Manifest:
    """The Job `<run>-<component>` around `pod`."""
    metadata = object_metadata(spec, job_name(spec, component), component)
    return job_object(spec, metadata, pod, job_spec, queue=queue)


def job_object(spec: RunSpec, metadata: dict[str, Any], pod: dict[str, Any], job_spec: dict[str, Any], *, queue: bool = True) -> Manifest:
    """A Job of the run: the queue and extra labels on it, its pod template finished (placement.py)."""
    metadata["labels"].update(extra_labels(spec))
    if queue and spec.cluster.queue:
        metadata["labels"][QUEUE_LABEL] = spec.cluster.queue
    body = dict(job_spec)
    if spec.cluster.ttl_seconds_after_finished is not None:
        body["ttlSecondsAfterFinished"] = spec.cluster.ttl_seconds_after_finished
    body["template"] = finish_pod_template(spec, pod)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": body}


def ignore_disruptions() -> dict[str, Any]:
    """Preemption, eviction and node drains do not count against the retries."""
    # status "True" is required by the 1.33/1.34 schemas (optional from 1.35).
    return {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}


def failure_policy(*, index: bool) -> dict[str, Any]:
    """Disruptions are free; a bad spec fails the Job; bad input fails the shard (or the Job), no retry."""
    return {"rules": [
        ignore_disruptions(),
        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [EXIT_BAD_SPEC]}},
        {"action": "FailIndex" if index else "FailJob", "onExitCodes": {"operator": "In", "values": [EXIT_BAD_INPUT]}},
    ]}


def make_container(
    spec: RunSpec,
    *,
    name: str,
    image: str,
    command: list[str],
    resources: dict[str, Any],
    mounts: list[dict[str, Any]],
    env: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": name,
        "image": image,
        "command": command,
        "env": _env(spec) + (env or []),
    }
    if spec.cluster.s3_secret:
        # Optional: on EKS/GKE the credentials may come from workload identity instead.
        container["envFrom"] = [{"secretRef": {"name": spec.cluster.s3_secret, "optional": True}}]
    container.update({
        "resources": copy.deepcopy(resources),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        # The worker's one-line JSON summary; the log tail when it dies without writing one.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": copy.deepcopy(mounts),
    })
    return container


def kernel_cache_dir(spec: RunSpec) -> str:
    """Where compiled kernels go: a volume the node's pods share when the spec names one."""
    if spec.cluster.kernel_cache:
        return KERNEL_CACHE_DIR
    if spec.cluster.model_cache:
        return f"{MODEL_CACHE_DIR}/kernels"
    return CACHE_DIR


def _env(spec: RunSpec) -> list[dict[str, str]]:
    """Every writable path points into a volume: the root filesystem is read-only."""
    model_cache = [{"name": MODEL_CACHE_ENV, "value": MODEL_CACHE_DIR}] if spec.cluster.model_cache else []
    kernels = kernel_cache_dir(spec)
    return model_cache + [
        {"name": "HOME", "value": "/tmp"},
        {"name": "TMPDIR", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        # Triton keys its cache by kernel source, GPU architecture and version, and writes entries
        # atomically, so the pods of a node (or of a cluster, on a ReadWriteMany claim) share it;
        # FLA caches its autotuning results there too, and TRITON_CACHE_AUTOTUNING does the same
        # for every other autotuned kernel.
        {"name": "TRITON_CACHE_DIR", "value": f"{kernels}/triton"},
        {"name": "TRITON_CACHE_AUTOTUNING", "value": "1"},
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{kernels}/inductor"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
    ]


def pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def output_mounts(spec: RunSpec) -> list[dict[str, Any]]:
    volume = spec.cluster.output_volume
    return [] if volume is None else [{"name": OUTPUT_VOLUME, "mountPath": volume.mount}]


def output_volumes(spec: RunSpec) -> list[dict[str, Any]]:
    volume = spec.cluster.output_volume
    return [] if volume is None else [{"name": OUTPUT_VOLUME, "persistentVolumeClaim": {"claimName": volume.claim}}]


def spec_mount() -> dict[str, Any]:
    return {"name": "spec", "mountPath": SPEC_DIR, "readOnly": True}


def spec_volume(spec: RunSpec) -> dict[str, Any]:
    return {"name": "spec", "configMap": {"name": configmap_name(spec)}}
