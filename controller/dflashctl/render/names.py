"""The names, labels and metadata every object of a run carries: how the controller, `kubectl` and
`dflashctl status` find a run's objects again."""

from __future__ import annotations

from typing import Any

from dflash_jobs.spec import RunSpec

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


def object_metadata(spec: RunSpec, name: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": spec.cluster.namespace,
        "labels": run_labels(spec, component),
        "annotations": {SPEC_HASH: spec.fingerprint()},
    }


def pod_metadata(spec: RunSpec, component: str) -> dict[str, Any]:
    return {"labels": run_labels(spec, component), "annotations": {SPEC_HASH: spec.fingerprint()}}
