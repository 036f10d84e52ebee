"""The Kubernetes objects of a run, as pure functions from the spec to plain dicts (DESIGN section 6).

The same spec always gives the same objects and byte-identical YAML, so the output of
`dflashctl render` can be committed to Git. Nothing here talks to a cluster.

Import from the package itself. Its modules: `names` (the names, labels and metadata that find a
run's objects again), `pods` (what every pod is built from: the spec mount, the containers'
security and writable paths, the Job around a pod; tool_pods.py builds its helper pods from them
too), `steps` (the data plane's Jobs), `controller` (the in-cluster controller's Job and RBAC) and
`output` (YAML, JSON, kubectl's names). Where the pods are placed, and what
cluster.pod_template_patch changes last, is placement.py's.
"""

from __future__ import annotations

from dflash_jobs.errors import SpecError
from dflash_jobs.spec import RunSpec

from dflashctl.render.controller import controller_role_rules, render_controller_objects
from dflashctl.render.names import (
    COMPONENTS, MANAGED_BY, MANAGED_BY_LABEL, QUEUE_LABEL, RUN_LABEL, SPEC_FILE, SPEC_HASH, SPEC_PATH, STEPS, Manifest,
    job_name, object_metadata, pod_metadata, run_labels, spec_configmap_name,
)
from dflashctl.render.output import job_ref, manifest_filename, object_ref, to_json, to_yaml
from dflashctl.render.pods import (
    CACHE_DIR, KERNEL_CACHE_DIR, MODEL_CACHE_DIR, WORKER, failure_policy, job_object, make_container, pod_security,
    render_configmap, spec_mount, spec_volume,
)
from dflashctl.render.steps import (
    CACHE_HEADROOM_GIB, STAGE_DIR, STAGED_PYTHON, render_eval_job, render_extract_job, render_generate_job, render_prepare_job,
    render_train_objects,
)

__all__ = [
    "CACHE_DIR", "CACHE_HEADROOM_GIB", "COMPONENTS", "KERNEL_CACHE_DIR", "MANAGED_BY", "MANAGED_BY_LABEL", "MODEL_CACHE_DIR",
    "QUEUE_LABEL", "RUN_LABEL", "SELECTIONS", "SPEC_FILE", "SPEC_HASH", "SPEC_PATH", "STAGED_PYTHON", "STAGE_DIR", "STEPS",
    "WORKER", "Manifest",
    "controller_role_rules", "failure_policy", "job_name", "job_object", "job_ref", "make_container", "manifest_filename",
    "object_metadata", "object_ref", "pod_metadata", "pod_security", "render_all", "render_configmap",
    "render_controller_objects", "render_eval_job", "render_extract_job", "render_generate_job", "render_prepare_job",
    "render_selection", "render_train_objects", "run_labels", "spec_configmap_name", "spec_mount", "spec_volume", "to_json",
    "to_yaml",
]

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
    if which == "extract" and which not in spec.steps:
        raise SpecError("render", which, f"a step of this run ({', '.join(spec.steps)}): with train.states online the train Job runs the target")
    return [render_configmap(spec), *builders[which]()]


def render_all(spec: RunSpec) -> list[Manifest]:
    """Every object of the run, in the order they are needed."""
    return [
        render_configmap(spec),
        *([render_generate_job(spec)] if spec.generate is not None else []),
        render_prepare_job(spec),
        *([render_extract_job(spec)] if "extract" in spec.steps else []),
        *render_train_objects(spec),
        render_eval_job(spec),
        *render_controller_objects(spec),
    ]
