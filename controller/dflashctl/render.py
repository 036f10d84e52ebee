"""The Kubernetes objects of a run, as pure functions from the spec to plain dicts (DESIGN section 6).

The same spec always gives the same objects and byte-identical YAML, so the output of
`dflashctl render` can be committed to Git. Nothing here talks to a cluster.

Every pod of the data plane is built by `_pod_template`: the spec mounted from a ConfigMap, a
selfcheck init container, non-root with a read-only root filesystem and writable emptyDirs, S3
credentials only by Secret reference. The Jobs differ only in command, resources and retry policy.
Where the pods are placed, and what cluster.pod_template_patch changes last, is placement.py's;
the public building blocks (make_container, pod_security, spec_mount, failure_policy, job_object, ...)
also build the helper pods of tool_pods.py.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import yaml

from dflash_jobs.errors import EXIT_BAD_INPUT, EXIT_BAD_SPEC, SpecError
from dflash_jobs.spec import BINARY_QUANTITY, CHUNK_CACHE_ENV, MODEL_CACHE_ENV, RunSpec, dump_spec

from dflashctl.errors import EXIT_RUN_FAILED
from dflashctl.placement import GPU, extra_labels, finish_pod_template, placement_fields

Manifest = dict[str, Any]

STEPS = ("generate", "prepare", "extract", "train", "eval")
"""The data-plane Jobs of a run, in pipeline order (generate only when the spec has a generate section)."""
COMPONENTS = (*STEPS, "controller")
"""Every Job of a run: the steps and the controller that drives them; each is named `<run>-<component>`."""

SPEC_DIR = "/etc/dflash"
SPEC_FILE = "dflash.yaml"
SPEC_PATH = f"{SPEC_DIR}/{SPEC_FILE}"

SPEC_HASH = "dflash.dev/spec-hash"
RUN_LABEL = "dflash.dev/run"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "dflashctl"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"

WORKER = "worker"
RUN_AS_USER = 10001  # the images' user (UID 1000 is ubuntu in Ubuntu 24.04 images)
CACHE_DIR = "/var/cache/dflash"
CHUNK_CACHE_DIR = f"{CACHE_DIR}/chunks"
"""Where training keeps its resident chunks: on the cache volume, which train.cache_gb sizes."""
MODEL_CACHE_DIR = "/var/cache/dflash-models"
"""Where cluster.model_cache is mounted."""
KERNEL_CACHE_DIR = "/var/cache/dflash-kernels"
"""Where cluster.kernel_cache is mounted."""
OUTPUT_VOLUME = "output"
"""The volume of cluster.output_volume, mounted read-write at its mount path."""
STAGE_DIR = "/var/lib/dflash-stage"
"""The emptyDir through which the dflash image hands the generation job's code to the vLLM container."""
STAGED_PYTHON = f"{STAGE_DIR}/python"
RENDEZVOUS_PORT = 29400
METRICS_PORT_NAME = "metrics"
CACHE_HEADROOM_GIB = 16

# Resources of the CPU pods. Prepare tokenizes the JSONL data set; the controller only watches.
PREPARE_RESOURCES = {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "16Gi"}}
CONTROLLER_RESOURCES = {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}
STAGE_RESOURCES = {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"memory": "512Mi"}}

# Retries of the single-pod Jobs. Training resumes from its last checkpoint, so a few are cheap;
# prepare and evaluation are short and deterministic; the controller attaches to what exists.
TRAIN_BACKOFF_LIMIT = 3
SHORT_JOB_BACKOFF_LIMIT = 1
CONTROLLER_BACKOFF_LIMIT = 6
# torchrun restarts its worker processes in place this many times before the pod fails.
TORCHRUN_MAX_RESTARTS = 3


# ---- readers -----------------------------------------------------------------------------------


def job_name(spec: RunSpec, component: str) -> str:
    """The deterministic name of a Job of the run (Jobs are immutable: one name per run and step)."""
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}; expected one of {COMPONENTS}")
    return f"{spec.name}-{component}"


def configmap_name(spec: RunSpec) -> str:
    return spec_configmap_name(spec.name)


def spec_configmap_name(run: str) -> str:
    """The ConfigMap holding run `run`'s spec: `status NAME`, `cancel NAME` read the run from it."""
    return f"{run}-spec"


def run_labels(spec: RunSpec, component: str) -> dict[str, str]:
    """Labels of every object of the run: `kubectl get jobs,pods -l dflash.dev/run=<name>` finds them."""
    return {
        "app.kubernetes.io/name": "dflash",
        "app.kubernetes.io/instance": spec.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "dflash-k8s",
        MANAGED_BY_LABEL: MANAGED_BY,
        RUN_LABEL: spec.name,
    }


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


# ---- the objects -------------------------------------------------------------------------------


def render_configmap(spec: RunSpec) -> Manifest:
    """The resolved spec, mounted by every pod at /etc/dflash/dflash.yaml."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_metadata(spec, configmap_name(spec), "spec"),
        "data": {SPEC_FILE: dump_spec(spec)},
    }


def render_prepare_job(spec: RunSpec) -> Manifest:
    """Tokenizes data.source into token chunks: one CPU pod."""
    pod = _pod_template(
        spec, "prepare",
        command=_module_command("dflash_jobs.prepare"),
        resources=PREPARE_RESOURCES,
        gpus=0,
    )
    return _job(spec, "prepare", pod, {"backoffLimit": SHORT_JOB_BACKOFF_LIMIT, "podFailurePolicy": failure_policy(index=False)})


def render_generate_job(spec: RunSpec) -> Manifest:
    """Regenerates the answers of data.source with the target: an Indexed Job, generate.gpus_per_shard
    GPUs per shard; each shard owns its chunks. Engine vllm: the worker runs in the vLLM image."""
    generate = spec.generate
    if generate is None:
        raise SpecError("generate", None, "a generate section: generation is off in this spec")
    gpus = generate.gpus_per_shard
    pod = _pod_template(spec, "generate", command=_module_command("dflash_jobs.generate"), resources=_gpu_resources(spec, gpus=gpus), gpus=gpus)
    if generate.engine == "vllm":
        _run_in_vllm_image(spec, pod)
    return _job(spec, "generate", pod, _indexed(generate.shards, generate.backoff_limit_per_index))


def render_extract_job(spec: RunSpec) -> Manifest:
    """One Indexed Job, one GPU per shard; each shard owns its chunks (JOB_COMPLETION_INDEX)."""
    pod = _pod_template(
        spec, "extract",
        command=_module_command("dflash_jobs.extract"),
        resources=_gpu_resources(spec, gpus=1),
        gpus=1,
    )
    return _job(spec, "extract", pod, _indexed(spec.extract.shards, spec.extract.backoff_limit_per_index))


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
        return [_job(spec, "train", pod, job_spec)]
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
    return [service, _job(spec, "train", pod, job_spec)]


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
    pod = _pod_template(
        spec, "eval",
        command=_module_command("dflash_jobs.evaluate"),
        resources=_gpu_resources(spec, gpus=1),
        gpus=1,
    )
    return _job(spec, "eval", pod, {"backoffLimit": SHORT_JOB_BACKOFF_LIMIT, "podFailurePolicy": failure_policy(index=False)})


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
        mounts=[spec_mount(), {"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": CACHE_DIR}, *_output_mounts(spec)],
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
        "volumes": [spec_volume(spec), {"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}, *_output_volumes(spec)],
    }
    pod = {"metadata": pod_metadata(spec, "controller"), "spec": pod_spec}
    job = _job(spec, "controller", pod, {
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


SELECTIONS = (*COMPONENTS, "all")


def render_selection(spec: RunSpec, which: str) -> list[Manifest]:
    """The objects of one step, self-contained for `kubectl apply` (the spec ConfigMap comes with each)."""
    if which == "all":
        return render_all(spec)
    builders = {
        "generate": lambda: [render_generate_job(spec)],
        "prepare": lambda: [render_prepare_job(spec)],
        "extract": lambda: [render_extract_job(spec)],
        "train": lambda: render_train_objects(spec),
        "eval": lambda: [render_eval_job(spec)],
        "controller": lambda: render_controller_objects(spec),
    }
    if which not in builders:
        raise SpecError("render", which, " | ".join(SELECTIONS))
    return [render_configmap(spec), *builders[which]()]


def render_all(spec: RunSpec) -> list[Manifest]:
    """Every object of the run, in the order they are needed."""
    return [
        render_configmap(spec),
        *([render_generate_job(spec)] if spec.generate is not None else []),
        render_prepare_job(spec),
        render_extract_job(spec),
        *render_train_objects(spec),
        render_eval_job(spec),
        *render_controller_objects(spec),
    ]


# ---- output ------------------------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings (the spec in the ConfigMap stays readable in Git), no anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def to_yaml(objects: list[Manifest]) -> str:
    """A multi-document YAML stream; the same objects always give the same bytes."""
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000, explicit_start=True)


def object_ref(obj: Manifest) -> str:
    """An object's name as kubectl prints it (`-o name`): kind.group/name, the core group left out
    (job.batch/run-extract, configmap/run-spec)."""
    group = obj["apiVersion"].rpartition("/")[0]
    kind = obj["kind"].lower()
    return f"{kind}.{group}/{obj['metadata']['name']}" if group else f"{kind}/{obj['metadata']['name']}"


def job_ref(name: str) -> str:
    """A Job's name as kubectl prints it."""
    return object_ref({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name}})


def manifest_filename(obj: Manifest) -> str:
    """`<kind>-<name>.yaml`, e.g. job-qwen36-27b-v1-extract.yaml."""
    return f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def to_json(objects: list[Manifest]) -> str:
    """The objects as one `v1 List`, as `kubectl get -o json` prints several (and `kubectl apply -f` reads)."""
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=2) + "\n"


# ---- building blocks ---------------------------------------------------------------------------


def object_metadata(spec: RunSpec, name: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": spec.cluster.namespace,
        "labels": run_labels(spec, component),
        "annotations": {SPEC_HASH: spec.fingerprint()},
    }


def pod_metadata(spec: RunSpec, component: str) -> dict[str, Any]:
    return {"labels": run_labels(spec, component), "annotations": {SPEC_HASH: spec.fingerprint()}}


def _shared_labels() -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "dflash",
        "app.kubernetes.io/component": "controller",
        "app.kubernetes.io/part-of": "dflash-k8s",
        MANAGED_BY_LABEL: MANAGED_BY,
    }


def _job(spec: RunSpec, component: str, pod: dict[str, Any], job_spec: dict[str, Any], *, queue: bool = True) -> Manifest:
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
    mounts += _output_mounts(spec)
    volumes += _output_volumes(spec)

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


def _output_mounts(spec: RunSpec) -> list[dict[str, Any]]:
    volume = spec.cluster.output_volume
    return [] if volume is None else [{"name": OUTPUT_VOLUME, "mountPath": volume.mount}]


def _output_volumes(spec: RunSpec) -> list[dict[str, Any]]:
    volume = spec.cluster.output_volume
    return [] if volume is None else [{"name": OUTPUT_VOLUME, "persistentVolumeClaim": {"claimName": volume.claim}}]


def spec_mount() -> dict[str, Any]:
    return {"name": "spec", "mountPath": SPEC_DIR, "readOnly": True}


def spec_volume(spec: RunSpec) -> dict[str, Any]:
    return {"name": "spec", "configMap": {"name": configmap_name(spec)}}


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
