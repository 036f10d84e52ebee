"""The cluster section: images, volumes, where the GPU and CPU pods are placed, and the Kubernetes
objects given in Kubernetes' own spelling (tolerations, affinity, labels and annotations), checked
as the API server would check them."""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from dflash_jobs.errors import SpecError
from dflash_jobs.spec.checks import _binary_quantity, _dns_label, _positive

UNPRIVILEGED_PORTS = (1024, 65535)


@dataclass(kw_only=True, slots=True)
class VolumeSpec:
    claim: str
    """PersistentVolumeClaim holding the target checkpoint."""
    mount: str = "/models"
    """Where it is mounted in the pods (read-only)."""

    def __post_init__(self) -> None:
        _dns_label("cluster.model_volume.claim", self.claim, limit=63)
        if not self.mount.startswith("/"):
            raise SpecError("cluster.model_volume.mount", self.mount, "an absolute path such as /models")


@dataclass(kw_only=True, slots=True)
class OutputVolumeSpec:
    claim: str = "dflash-runs"
    """PersistentVolumeClaim that holds a local `output` (ReadWriteMany: the pods of several nodes write to it)."""
    mount: str = "/runs"
    """Where it is mounted, read-write, in every pod: `output` is this path or lies under it. `dflashctl`
    itself reads the output at the same path, so run it where the same filesystem is mounted there too
    (the in-cluster controller, `dflashctl submit controller`, mounts the claim)."""

    def __post_init__(self) -> None:
        _dns_label("cluster.output_volume.claim", self.claim, limit=253)
        if not self.mount.startswith("/") or posixpath.normpath(self.mount) == "/":
            raise SpecError("cluster.output_volume.mount", self.mount, "an absolute path other than / such as /data/runs")


@dataclass(kw_only=True, slots=True)
class CpuPlacementSpec:
    node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels the CPU pods (prepare, the controller, stage-model, the target-config probe) must carry."""
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    """Taints the CPU pods tolerate, in Kubernetes' spelling (key, operator, value, effect, tolerationSeconds)."""
    affinity: dict[str, Any] | None = None
    """The CPU pods' affinity, in Kubernetes' spelling (nodeAffinity, podAffinity, podAntiAffinity)."""

    def __post_init__(self) -> None:
        _check_tolerations("cluster.cpu_placement.tolerations", self.tolerations)
        _check_affinity("cluster.cpu_placement.affinity", self.affinity)


@dataclass(kw_only=True, slots=True)
class ClusterSpec:
    namespace: str = "dflash"
    image: str = "ghcr.io/dflash-k8s/dflash:0.1.0-cuda13.0"
    """CUDA 13 image with torch, flash-linear-attention, causal-conv1d and this package (images/)."""
    controller_image: str = "ghcr.io/dflash-k8s/dflashctl:0.1.0"
    """Small CPU image running `dflashctl run` in the cluster."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels the GPU pods (generate, extract, train, eval) must carry, e.g. nvidia.com/gpu.product."""
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    """Taints the GPU pods tolerate besides nvidia.com/gpu (which they always tolerate), in Kubernetes'
    spelling: key, operator (Exists | Equal), value, effect, tolerationSeconds."""
    affinity: dict[str, Any] | None = None
    """The GPU pods' affinity, in Kubernetes' spelling (nodeAffinity, podAffinity, podAntiAffinity)."""
    cpu_placement: CpuPlacementSpec = field(default_factory=CpuPlacementSpec)
    """Where the CPU pods run: the GPU pods' node_selector, tolerations and affinity do not apply to them."""
    image_pull_secrets: list[str] = field(default_factory=list)
    """Secrets (type kubernetes.io/dockerconfigjson) every pod pulls its images with: images pushed to a private registry."""
    priority_class: str | None = None
    """PriorityClass of every pod (priorityClassName); null: the cluster's default."""
    labels: dict[str, str] = field(default_factory=dict)
    """Extra labels on every Job and pod (cost allocation, policies). The run's own labels
    (app.kubernetes.io/*, dflash.dev/*, batch.kubernetes.io/*) and Kueue's queue label (cluster.queue) are
    refused here."""
    annotations: dict[str, str] = field(default_factory=dict)
    """Extra annotations on every pod, e.g. sidecar.istio.io/inject: "false"."""
    pod_template_patch: dict[str, Any] | None = None
    """Anything else: a strategic merge patch applied last to every pod template ({metadata, spec}), as
    kubectl patch applies one. Maps merge; null deletes a key; the lists containers, initContainers,
    volumes, env, imagePullSecrets (by name), volumeMounts (by mountPath) and ports (by containerPort)
    merge item by item, an item with `$patch: delete` removes its match; other lists are replaced."""
    model_volume: VolumeSpec | None = None
    """The PersistentVolumeClaim a local target.model lies on, mounted read-only by every pod (`dflashctl
    stage-model` fills it); null: target.model is s3://, or on another volume the pods mount."""
    output_volume: OutputVolumeSpec | None = None
    """The claim a local `output` lives on (backend: kubernetes); null: `output` must be s3://."""
    model_cache: str | None = None
    """PersistentVolumeClaim for an s3:// target.model: fetched into it once per node (ReadWriteOnce
    serves the pods of one node, ReadWriteMany every node) instead of once per pod."""
    kernel_cache: str | None = None
    """PersistentVolumeClaim for compiled GPU kernels and their autotuning results (Triton, FLA,
    Inductor): only the first pod of a node compiles (about two minutes), the others start in
    seconds. Defaults to a kernels/ folder of cluster.model_cache when that is set; with neither,
    every pod compiles anew."""
    s3_secret: str | None = "dflash-s3"
    """Secret with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and optionally AWS_ENDPOINT_URL."""
    hf_secret: str | None = None
    """Secret with HF_TOKEN (and optionally HF_ENDPOINT, a hub mirror) for `dflashctl stage-model --from hf://...`:
    gated or private repositories."""
    queue: str | None = None
    """Kueue LocalQueue name (adds the kueue.x-k8s.io/queue-name label)."""
    service_account: str = "dflash-controller"
    """ServiceAccount of the in-cluster controller Job (k8s/ grants it its Role)."""
    cpu_per_gpu: int = 8
    memory_per_gpu: str = "96Gi"
    shm_size: str = "16Gi"
    ttl_seconds_after_finished: int | None = None
    """Left unset by default: Git-managed Jobs must not delete themselves."""
    metrics_port: int | None = None
    """Port on which `dflashctl run` (the in-cluster controller) serves its progress as Prometheus
    metrics at /metrics; rendered as the controller Job's "metrics" port. Run from a laptop where it
    is taken, `dflashctl run` picks a free one and says which. Not part of the run's identity: a
    change keeps the run. null: no metrics."""

    def mounted_paths(self) -> list[str]:
        """Where the pods see volumes: the model and output volumes' mounts, and the volumeMounts of
        the containers pod_template_patch adds or patches."""
        patched = ((self.pod_template_patch or {}).get("spec") or {}).get("containers") or []
        return [volume.mount for volume in (self.model_volume, self.output_volume) if volume is not None] + [
            mount["mountPath"] for container in patched if isinstance(container, dict) for mount in container.get("volumeMounts") or []
            if isinstance(mount, dict) and isinstance(mount.get("mountPath"), str)]

    def __post_init__(self) -> None:
        _dns_label("cluster.namespace", self.namespace, limit=63)
        if not self.image or any(c.isspace() for c in self.image):
            raise SpecError("cluster.image", self.image, "an image reference such as registry/dflash:0.1.0-cuda13.0")
        for name, secret in (("s3_secret", self.s3_secret), ("hf_secret", self.hf_secret), ("model_cache", self.model_cache),
                             ("kernel_cache", self.kernel_cache), ("priority_class", self.priority_class)):
            if secret is not None:
                _dns_label(f"cluster.{name}", secret, limit=253)
        for i, secret in enumerate(self.image_pull_secrets):
            _dns_label(f"cluster.image_pull_secrets[{i}]", secret, limit=253)
        if self.queue is not None:
            _dns_label("cluster.queue", self.queue, limit=63)
        _dns_label("cluster.service_account", self.service_account, limit=253)
        _check_tolerations("cluster.tolerations", self.tolerations)
        _check_affinity("cluster.affinity", self.affinity)
        _check_metadata("cluster.labels", self.labels, label_values=True)
        _check_metadata("cluster.annotations", self.annotations, label_values=False)
        if self.pod_template_patch is not None and (not self.pod_template_patch or set(self.pod_template_patch) - {"metadata", "spec"}):
            raise SpecError("cluster.pod_template_patch", self.pod_template_patch, "a pod template patch with the keys metadata and/or spec")
        _positive("cluster.cpu_per_gpu", self.cpu_per_gpu, minimum=1)
        _binary_quantity("cluster.memory_per_gpu", self.memory_per_gpu)
        _binary_quantity("cluster.shm_size", self.shm_size)
        if self.metrics_port is not None and not UNPRIVILEGED_PORTS[0] <= self.metrics_port <= UNPRIVILEGED_PORTS[1]:
            raise SpecError("cluster.metrics_port", self.metrics_port, f"a port in {UNPRIVILEGED_PORTS[0]}..{UNPRIVILEGED_PORTS[1]} (the controller runs as non-root), or null")


TOLERATION_KEYS = ("key", "operator", "value", "effect", "tolerationSeconds")
TAINT_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")
AFFINITY_KINDS = ("nodeAffinity", "podAffinity", "podAntiAffinity")
RESERVED_LABEL_PREFIXES = ("app.kubernetes.io/", "dflash.dev/", "batch.kubernetes.io/", "kueue.x-k8s.io/queue-name")
LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _check_tolerations(path: str, tolerations: list[dict[str, Any]]) -> None:
    for i, toleration in enumerate(tolerations):
        where = f"{path}[{i}]"
        unknown = sorted(set(toleration) - set(TOLERATION_KEYS))
        if unknown:
            raise SpecError(f"{where}.{unknown[0]}", toleration[unknown[0]], f"one of the toleration keys {', '.join(TOLERATION_KEYS)}")
        operator = toleration.get("operator", "Equal")
        if operator not in ("Exists", "Equal"):
            raise SpecError(f"{where}.operator", operator, "Exists | Equal")
        if operator == "Exists" and toleration.get("value"):
            raise SpecError(f"{where}.value", toleration["value"], "no value with operator Exists")
        if operator == "Equal" and not toleration.get("key"):
            raise SpecError(f"{where}.key", toleration.get("key"), "a taint key (an empty key needs operator Exists)")
        if toleration.get("effect", "") not in TAINT_EFFECTS:
            raise SpecError(f"{where}.effect", toleration["effect"], " | ".join(effect or '""' for effect in TAINT_EFFECTS))
        seconds = toleration.get("tolerationSeconds")
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int) or toleration.get("effect") != "NoExecute"):
            raise SpecError(f"{where}.tolerationSeconds", seconds, "whole seconds, with effect NoExecute only")


def _check_affinity(path: str, affinity: dict[str, Any] | None) -> None:
    if affinity is None:
        return
    for kind, value in affinity.items():
        if kind not in AFFINITY_KINDS:
            raise SpecError(f"{path}.{kind}", value, f"one of {', '.join(AFFINITY_KINDS)}")
        if not isinstance(value, dict):
            raise SpecError(f"{path}.{kind}", value, "a mapping, as in a pod's spec.affinity")


def _check_metadata(path: str, mapping: dict[str, str], *, label_values: bool) -> None:
    """Label or annotation keys ([prefix/]name) and, for labels, values, as the API server checks them."""
    for key, value in mapping.items():
        prefix, _, name = key.rpartition("/")
        if not LABEL_NAME.match(name) or (prefix and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.match(prefix))):
            raise SpecError(path, key, "keys of the form [prefix/]name: a DNS subdomain prefix, a name of at most 63 letters, digits, '-', '_' or '.'")
        if key.startswith(RESERVED_LABEL_PREFIXES):
            raise SpecError(path, key, f"a key outside {', '.join(RESERVED_LABEL_PREFIXES)}, which the run sets itself (the queue: cluster.queue)")
        if label_values and value and not LABEL_NAME.match(value):
            raise SpecError(f"{path}.{key}", value, "a label value: at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit")
