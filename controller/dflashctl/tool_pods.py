"""The run's helper pods, beside the pipeline's Jobs: pure functions of the spec, as render/'s.

- The stage-model Job (`dflashctl stage-model`): puts the target checkpoint on the model volume,
  mounted read-write in this pod only (dflash_jobs/stage_model.py does the work).
- The probe pod (`dflashctl check`): reads the checkpoint's config.json, its staging record and its
  files from the model volume, mounted read-only, and prints them as one JSON line in its log; for
  a checkpoint this machine cannot read.

Both are CPU pods, placed and patched as every other pod of the run (placement.py).
"""

from __future__ import annotations

import hashlib
from typing import Any

from dflash_jobs.errors import InputError, SpecError
from dflash_jobs.spec import RunSpec, is_s3, under
from dflash_jobs.stage_model import parse_source

from dflashctl.placement import finish_pod_template, placement_fields
from dflashctl.render import (
    CACHE_DIR, SPEC_HASH, SPEC_PATH, WORKER, Manifest, failure_policy, job_object, make_container,
    object_metadata, pod_metadata, pod_security, render_configmap, spec_mount, spec_volume,
)

STAGE_MODEL = "stage-model"
PROBE = "probe"
STAGE_RESOURCES = {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "4Gi"}}
"""Downloads and checksums stream through: neither needs the checkpoint in memory."""
GGUF_STAGE_RESOURCES = {"requests": {"cpu": "2", "memory": "16Gi"}, "limits": {"memory": "16Gi"}}
"""Converting a GGUF file holds its model dequantized in float32 and cast to bf16: about 6 bytes a
parameter, so models up to about 2.5B parameters (SmolLM2, Llama 3.2 1B/3B, Qwen2.5 1.5B)."""
PROBE_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "256Mi"}}
STAGE_BACKOFF_LIMIT = 4
"""Retries of the stage-model pod: each resumes where the last stopped (the files that landed are kept)."""
PROBE_DEADLINE_S = 300
"""The probe pod is killed past this (a volume that does not attach, an image that does not pull)."""
SOURCE_ANNOTATION = "dflash.dev/stage-source"


def stage_model_job_name(spec: RunSpec) -> str:
    return f"{spec.name}-{STAGE_MODEL}"


def probe_pod_name(spec: RunSpec) -> str:
    return f"{spec.name}-{PROBE}"


def model_directory(spec: RunSpec) -> str:
    """target.model as a directory on the model volume: what stage-model fills and the probe reads."""
    volume = spec.cluster.model_volume
    if is_s3(spec.target.model):
        raise SpecError("target.model", spec.target.model, "a directory on cluster.model_volume to stage into (an s3:// target needs no staging)")
    if volume is None:
        raise SpecError("cluster.model_volume", None, "the claim {claim, mount} that target.model lies on")
    path = spec.target.model.removeprefix("file://")
    if not under(path, volume.mount):
        raise SpecError("target.model", spec.target.model, f"a path under cluster.model_volume.mount ({volume.mount})")
    return path


def render_stage_model_objects(spec: RunSpec, source: str) -> list[Manifest]:
    """The spec ConfigMap and the Job that stages `source` (hf://org/repo[@revision], s3://..., or a
    .gguf file in S3 or on the model volume) into target.model."""
    model_directory(spec)
    volume = spec.cluster.model_volume
    assert volume is not None
    parsed = parse_source(source)
    if parsed.path is not None and not under(parsed.path, volume.mount):
        raise InputError(f"--from {source} is a path the stage-model pod cannot see: it mounts claim {volume.claim} at {volume.mount} alone",
                         f"Put the GGUF file on the model volume (under {volume.mount}), or upload it to S3 and pass its s3:// URL")
    mounts = [spec_mount(), {"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": CACHE_DIR},
              {"name": "model", "mountPath": volume.mount}]
    worker = make_container(
        spec, name=WORKER, image=spec.cluster.image,
        command=["python", "-m", "dflash_jobs.stage_model", "-f", SPEC_PATH, "--from", source],
        resources=GGUF_STAGE_RESOURCES if parsed.gguf else STAGE_RESOURCES, mounts=mounts,
        # The image is offline by default (pods load checkpoints from paths); this pod is the exception.
        env=[{"name": "HF_HUB_OFFLINE", "value": "0"}, {"name": "HF_HUB_DISABLE_PROGRESS_BARS", "value": "1"}],
    )
    if spec.cluster.hf_secret:
        worker.setdefault("envFrom", []).append({"secretRef": {"name": spec.cluster.hf_secret, "optional": True}})
    pod = {
        "metadata": pod_metadata(spec, STAGE_MODEL),
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "securityContext": pod_security(),
            **placement_fields(spec, gpu=False),
            "containers": [worker],
            "volumes": [spec_volume(spec), {"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}},
                        {"name": "model", "persistentVolumeClaim": {"claimName": volume.claim}}],
        },
    }
    metadata = object_metadata(spec, stage_model_job_name(spec), STAGE_MODEL)
    # The same spec with another --from is another Job: attach to it only when both agree.
    metadata["annotations"][SPEC_HASH] = hashlib.sha256(f"{spec.fingerprint()} {source}".encode()).hexdigest()[:16]
    metadata["annotations"][SOURCE_ANNOTATION] = source
    job = job_object(spec, metadata, pod, {"backoffLimit": STAGE_BACKOFF_LIMIT, "podFailurePolicy": failure_policy(index=False)}, queue=False)
    return [render_configmap(spec), job]


def render_probe_pod(spec: RunSpec) -> Manifest:
    """A pod that prints what target.model holds on the model volume (dflash_jobs.stage_model --describe) and exits."""
    path = model_directory(spec)
    volume = spec.cluster.model_volume
    assert volume is not None
    worker = make_container(
        spec, name=WORKER, image=spec.cluster.image,
        command=["python", "-m", "dflash_jobs.stage_model", "--describe", path],
        resources=PROBE_RESOURCES,
        mounts=[{"name": "tmp", "mountPath": "/tmp"}, {"name": "model", "mountPath": volume.mount, "readOnly": True}],
    )
    worker.pop("envFrom", None)  # it reads a volume: no credentials
    template = finish_pod_template(spec, {
        "metadata": pod_metadata(spec, PROBE),
        "spec": {
            "restartPolicy": "Never",
            "activeDeadlineSeconds": PROBE_DEADLINE_S,
            "automountServiceAccountToken": False,
            "securityContext": pod_security(),
            **placement_fields(spec, gpu=False),
            "containers": [worker],
            "volumes": [{"name": "tmp", "emptyDir": {}},
                        {"name": "model", "persistentVolumeClaim": {"claimName": volume.claim, "readOnly": True}}],
        },
    })
    metadata: dict[str, Any] = {"name": probe_pod_name(spec), "namespace": spec.cluster.namespace, **template["metadata"]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}



def tool_pod_specs(spec: RunSpec) -> list[tuple[str, dict[str, Any]]]:
    """(component, pod spec) of stage-model's Job and of the probe pod, where target.model lies on the
    model volume (else neither runs): what they mount and where they go, which stage-model's source
    does not change, and what they ask (stage-model's for a checkpoint: a GGUF file asks for more memory)."""
    try:
        model_directory(spec)
    except SpecError:
        return []
    stage_model_job = render_stage_model_objects(spec, source="hf://org/model")[1]
    return [(STAGE_MODEL, stage_model_job["spec"]["template"]["spec"]), (PROBE, render_probe_pod(spec)["spec"])]
