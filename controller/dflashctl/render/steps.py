"""The data plane's Jobs, one a step: generate, prepare, extract, train and eval.

Every pod of them is built by `_pod_template`: the spec mounted from its ConfigMap, a selfcheck
init container with the worker's resources, writable emptyDirs for a read-only root filesystem.
The Jobs differ only in command, resources and retry policy.
"""

from __future__ import annotations

import math
from typing import Any

from dflash_jobs.errors import SpecError
from dflash_jobs.spec import BINARY_QUANTITY, CHUNK_CACHE_ENV, RunSpec

from dflashctl.placement import GPU, placement_fields
from dflashctl.render.names import JOB_NAME_LABEL, SPEC_PATH, Manifest, job_name, object_metadata, pod_metadata, run_labels
from dflashctl.render.pods import (
    CACHE_DIR, KERNEL_CACHE_DIR, MODEL_CACHE_DIR, WORKER, component_job, failure_policy, make_container, output_mounts,
    output_volumes, pod_security, spec_mount, spec_volume,
)

CHUNK_CACHE_DIR = f"{CACHE_DIR}/chunks"
"""Where training keeps its resident chunks: on the cache volume, which train.cache_gb sizes."""
STAGE_DIR = "/var/lib/dflash-stage"
"""The emptyDir through which the dflash image hands the generation job's code to the vLLM container."""
STAGED_PYTHON = f"{STAGE_DIR}/python"
RENDEZVOUS_PORT = 29400
CACHE_HEADROOM_GIB = 16

# Resources of the CPU pods. Prepare tokenizes the JSONL data set.
PREPARE_RESOURCES = {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "16Gi"}}
STAGE_RESOURCES = {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"memory": "512Mi"}}

# Retries of the single-pod Jobs. Training resumes from its last checkpoint, so a few are cheap;
# prepare and evaluation are short and deterministic.
TRAIN_BACKOFF_LIMIT = 3
SHORT_JOB_BACKOFF_LIMIT = 1
# torchrun restarts its worker processes in place this many times before the pod fails.
TORCHRUN_MAX_RESTARTS = 3


def render_prepare_job(spec: RunSpec) -> Manifest:
    """Tokenizes data.source into token chunks: one CPU pod."""
    pod = _pod_template(
        spec, "prepare",
        command=_module_command("dflash_jobs.prepare"),
        resources=PREPARE_RESOURCES,
        gpus=0,
    )
    return component_job(spec, "prepare", pod, {"backoffLimit": SHORT_JOB_BACKOFF_LIMIT, "podFailurePolicy": failure_policy(index=False)})


def render_generate_job(spec: RunSpec) -> Manifest:
    """Regenerates the answers of data.source with the target: an Indexed Job, generate.gpus_per_shard
    GPUs per shard; each shard owns its chunks. Engine vllm: the worker runs in the vLLM image."""
    generate = spec.generate
    if generate is None:
        raise SpecError("generate", None, "a generate section: generation is off in this spec")
    pod = _gpu_module_pod(spec, "generate", "dflash_jobs.generate", gpus=generate.gpus_per_shard)
    if generate.engine == "vllm":
        _run_in_vllm_image(spec, pod)
    return component_job(spec, "generate", pod, _indexed(generate.shards, generate.backoff_limit_per_index))


def render_extract_job(spec: RunSpec) -> Manifest:
    """One Indexed Job, one GPU per shard; each shard owns its chunks (JOB_COMPLETION_INDEX)."""
    pod = _gpu_module_pod(spec, "extract", "dflash_jobs.extract", gpus=1)
    return component_job(spec, "extract", pod, _indexed(spec.extract.shards, spec.extract.backoff_limit_per_index))


def render_train_objects(spec: RunSpec) -> list[Manifest]:
    """One pod with every GPU of a node; several nodes: an Indexed Job plus a headless Service for rendezvous."""
    name = job_name(spec, "train")
    train = spec.train
    # torchrun itself, run by a launcher that exits with the workers' own bad-spec or bad-input code
    # (torchrun alone reports every failure as 1, which the Job would retry).
    torchrun = ["python", "-m", "dflash_jobs.train.launch", f"--nproc_per_node={train.gpus_per_node}"]
    if train.nodes == 1:
        torchrun += ["--standalone", "--nnodes=1"]
    else:
        torchrun += [
            f"--nnodes={train.nodes}",
            "--rdzv_backend=c10d",
            # Pod 0 hosts the rendezvous store; its DNS name comes from the headless Service.
            f"--rdzv_endpoint={name}-0.{name}:{RENDEZVOUS_PORT}",
            f"--rdzv_id={spec.name}",
            f"--max_restarts={TORCHRUN_MAX_RESTARTS}",
        ]
    pod = _pod_template(
        spec, "train",
        command=[*torchrun, "-m", "dflash_jobs.train", "-f", SPEC_PATH],
        resources=_gpu_resources(spec, gpus=train.gpus_per_node),
        gpus=train.gpus_per_node,
        cache=_train_cache_volume(spec),
        env=[{"name": CHUNK_CACHE_ENV, "value": CHUNK_CACHE_DIR}],
    )
    job_spec: dict[str, Any] = {"backoffLimit": TRAIN_BACKOFF_LIMIT, "podFailurePolicy": failure_policy(index=False)}
    if train.nodes == 1:
        return [component_job(spec, "train", pod, job_spec)]
    pod["spec"]["subdomain"] = name
    job_spec.update({
        "completionMode": "Indexed",
        "completions": train.nodes,
        "parallelism": train.nodes,  # every rank must run at once
        "podReplacementPolicy": "Failed",
        # Done when rank 0 (which exports the drafter) finishes; the other ranks are reaped.
        "successPolicy": {"rules": [{"succeededIndexes": "0"}]},
    })
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_metadata(spec, name, "train"),
        "spec": {
            "clusterIP": "None",
            # Ranks resolve pod 0 before it is Ready: rendezvous happens before readiness.
            "publishNotReadyAddresses": True,
            "selector": {JOB_NAME_LABEL: name},
            "ports": [{"name": "c10d", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT}],
        },
    }
    return [service, component_job(spec, "train", pod, job_spec)]


def _train_cache_volume(spec: RunSpec) -> dict[str, Any]:
    """The node-local volume of the chunk cache: train.cache_gb, plus room for the Triton and HF caches."""
    size = f"{math.ceil(spec.train.cache_gb) + CACHE_HEADROOM_GIB}Gi"
    if spec.train.cache_storage_class is None:
        return {"emptyDir": {"sizeLimit": size}}
    return {"ephemeral": {"volumeClaimTemplate": {
        "metadata": {"labels": run_labels(spec, "train")},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": spec.train.cache_storage_class,
            "resources": {"requests": {"storage": size}},
        },
    }}}


def render_eval_job(spec: RunSpec) -> Manifest:
    """Speculative decoding with the target and the trained drafter on one GPU."""
    pod = _gpu_module_pod(spec, "eval", "dflash_jobs.evaluate", gpus=1)
    return component_job(spec, "eval", pod, {"backoffLimit": SHORT_JOB_BACKOFF_LIMIT, "podFailurePolicy": failure_policy(index=False)})


def _indexed(shards: int, backoff_limit_per_index: int) -> dict[str, Any]:
    """The Job spec of the sharded steps: one index per shard, retried alone, failed alone on bad input."""
    return {
        "completionMode": "Indexed",
        "completions": shards,
        "parallelism": shards,
        "backoffLimitPerIndex": backoff_limit_per_index,
        "podFailurePolicy": failure_policy(index=True),
        # Never two pods for one index: a replacement starts only once the old pod is gone.
        "podReplacementPolicy": "Failed",
    }


def _run_in_vllm_image(spec: RunSpec, pod: dict[str, Any]) -> None:
    """The generation worker in the official vLLM image: an init container of the dflash image stages
    the job's code into an emptyDir, and the worker runs it with the vLLM image's Python."""
    assert spec.generate is not None
    pod_spec = pod["spec"]
    worker = pod_spec["containers"][0]
    stage = {"name": "stage", "mountPath": STAGE_DIR}
    stager = make_container(
        spec, name="stage", image=spec.cluster.image,
        command=["python", "-m", "dflash_jobs.generate.stage", STAGED_PYTHON],
        resources=STAGE_RESOURCES, mounts=[*pod_spec["initContainers"][0]["volumeMounts"], stage],
    )
    stager.pop("envFrom", None)  # it copies files: no credentials
    pod_spec["initContainers"].append(stager)
    pod_spec["volumes"].append({"name": "stage", "emptyDir": {}})
    worker["image"] = spec.generate.vllm_image
    worker["command"] = ["python3", "-m", "dflash_jobs.generate", "-f", SPEC_PATH]
    worker["env"] += [
        {"name": "PYTHONPATH", "value": STAGED_PYTHON},
        # Checkpoints come from a path; vLLM reports usage to its project unless told not to.
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
        {"name": "DO_NOT_TRACK", "value": "1"},
    ]
    worker["volumeMounts"].append({**stage, "readOnly": True})


def _module_command(module: str) -> list[str]:
    return ["python", "-m", module, "-f", SPEC_PATH]


def _gpu_module_pod(spec: RunSpec, component: str, module: str, *, gpus: int) -> dict[str, Any]:
    """The pod of a GPU step that runs `python -m <module>` on `gpus` GPUs."""
    return _pod_template(spec, component, command=_module_command(module), resources=_gpu_resources(spec, gpus=gpus), gpus=gpus)


def _pod_template(
    spec: RunSpec,
    component: str,
    *,
    command: list[str],
    resources: dict[str, Any],
    gpus: int,
    cache: dict[str, Any] | None = None,
    env: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """`cache`: the source of the cache volume (an unlimited emptyDir by default); `env`: added to the containers' environment."""
    cluster = spec.cluster
    mounts = [
        spec_mount(),
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    volumes: list[dict[str, Any]] = [
        spec_volume(spec),
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", **(cache or {"emptyDir": {}})},
        # NCCL and DataLoader workers need more shared memory than the runtime's 64 MiB default.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": cluster.shm_size}},
    ]
    if cluster.model_volume is not None:
        mounts.append({"name": "model", "mountPath": cluster.model_volume.mount, "readOnly": True})
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": cluster.model_volume.claim, "readOnly": True}})
    if cluster.model_cache is not None:
        mounts.append({"name": "model-cache", "mountPath": MODEL_CACHE_DIR})
        volumes.append({"name": "model-cache", "persistentVolumeClaim": {"claimName": cluster.model_cache}})
    if cluster.kernel_cache is not None:
        mounts.append({"name": "kernel-cache", "mountPath": KERNEL_CACHE_DIR})
        volumes.append({"name": "kernel-cache", "persistentVolumeClaim": {"claimName": cluster.kernel_cache}})
    mounts += output_mounts(spec)
    volumes += output_volumes(spec)

    selfcheck = make_container(
        spec, name="selfcheck", image=cluster.image,
        command=["python", "-m", "dflash_jobs.selfcheck", "-f", SPEC_PATH, "--component", component],
        # The same resources as the worker, so the check sees the GPUs the worker will get.
        resources=resources, mounts=mounts, env=env,
    )
    worker = make_container(spec, name=WORKER, image=cluster.image, command=command, resources=resources, mounts=mounts, env=env)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        # Workers talk to S3, not to the Kubernetes API.
        "automountServiceAccountToken": False,
        "securityContext": pod_security(),
        **placement_fields(spec, gpu=gpus > 0),
    }
    pod_spec.update({"initContainers": [selfcheck], "containers": [worker], "volumes": volumes})
    return {"metadata": pod_metadata(spec, component), "spec": pod_spec}


def _gpu_resources(spec: RunSpec, *, gpus: int) -> dict[str, Any]:
    """GPUs are limits only; CPU is requested but never limited (throttling stalls the input pipeline)."""
    memory = _scale_quantity(spec.cluster.memory_per_gpu, gpus)
    return {
        "requests": {"cpu": str(spec.cluster.cpu_per_gpu * gpus), "memory": memory},
        "limits": {GPU: str(gpus), "memory": memory},
    }


def _scale_quantity(quantity: str, factor: int) -> str:
    """`factor` times a quantity the spec validated ("96Gi" x 8 = "768Gi")."""
    number, unit = BINARY_QUANTITY.match(quantity).groups()
    return f"{int(number) * factor}{unit or ''}"
