"""Placement on a real cluster's nodes (issue 31, item 3): tolerations, affinity, node selectors, image pull
secrets, priority class, extra labels and annotations on every pod the project creates, and
cluster.pod_template_patch applied last as `kubectl patch --type strategic` applies it."""

from __future__ import annotations

import copy
import functools
import json
import subprocess

import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml

from dflash_jobs.errors import SpecError
from dflash_jobs.spec import parse_spec
from typer.testing import CliRunner

from dflashctl.check import Preflight
from dflashctl.check.inputs import pod_template_patch
from dflashctl.cli.app import app
from dflashctl.placement import GPU_TOLERATION, RUN_CONTAINERS, patch_warnings, strategic_merge
from dflashctl.render import QUEUE_LABEL, render_all
from dflashctl.tool_pods import render_probe_pod, render_stage_model_objects

KUBECTL = "/usr/bin/kubectl"
KUBERNETES_VERSIONS = ("1.33.0", "1.34.0", "1.35.0", "1.36.0", "1.37.0")
GPU_TAINT = {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}
SPOT = {"key": "cloud.example.com/spot", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 600}
GPU_AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": ["100000"]}]}]}}}
CPU_AFFINITY = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 10, "podAffinityTerm": {
    "topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "dflash"}}}}]}}
CLUSTER = {
    "model_volume": {"claim": "models"},
    "queue": "gpu-queue",
    "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
    "tolerations": [GPU_TAINT],
    "affinity": GPU_AFFINITY,
    "cpu_placement": {"node_selector": {"pool": "cpu"}, "tolerations": [SPOT], "affinity": CPU_AFFINITY},
    "image_pull_secrets": ["registry-creds"],
    "priority_class": "ml-batch",
    "labels": {"cost-center": "ml-42"},
    "annotations": {"sidecar.istio.io/inject": "false"},
    "metrics_port": 8000,
}


def make_spec(**cluster):
    return parse_spec({
        "name": "placed", "target": {"model": "/models/Qwen3.6-27B"}, "data": {"source": "s3://bucket/chats.jsonl"},
        "output": "s3://bucket/runs/placed", "generate": {}, "train": {"nodes": 2, "gpus_per_node": 4},
        "cluster": {**CLUSTER, **cluster},
    })


def every_pod_template(spec) -> dict[str, dict]:
    """component -> pod template ({metadata, spec}) of every pod the project creates for a run."""
    jobs = [obj for obj in render_all(spec) + render_stage_model_objects(spec, "hf://Qwen/Qwen3.6-27B") if obj["kind"] == "Job"]
    templates = {job["metadata"]["labels"]["app.kubernetes.io/component"]: job["spec"]["template"] for job in jobs}
    probe = render_probe_pod(spec)
    templates["probe"] = {"metadata": {k: v for k, v in probe["metadata"].items() if k in ("labels", "annotations")}, "spec": probe["spec"]}
    return templates


GPU_PODS = ("generate", "extract", "train", "eval")
CPU_PODS = ("prepare", "controller", "stage-model", "probe")


def test_every_pod_carries_the_placement_of_its_kind():
    templates = every_pod_template(make_spec())
    assert sorted(templates) == sorted(GPU_PODS + CPU_PODS)
    for component, template in templates.items():
        pod, metadata = template["spec"], template["metadata"]
        assert pod["priorityClassName"] == "ml-batch", component
        assert pod["imagePullSecrets"] == [{"name": "registry-creds"}], component
        assert metadata["labels"]["cost-center"] == "ml-42" and metadata["labels"]["dflash.dev/run"] == "placed", component
        assert metadata["annotations"]["sidecar.istio.io/inject"] == "false", component
        if component in GPU_PODS:
            assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}, component
            assert pod["tolerations"] == [GPU_TOLERATION, GPU_TAINT] and pod["affinity"] == GPU_AFFINITY, component
        else:
            assert pod["nodeSelector"] == {"pool": "cpu"} and pod["tolerations"] == [SPOT] and pod["affinity"] == CPU_AFFINITY, component


def test_jobs_carry_the_extra_labels_and_keep_the_kueue_queue_label():
    spec = make_spec()
    jobs = {obj["metadata"]["labels"]["app.kubernetes.io/component"]: obj for obj in render_all(spec) if obj["kind"] == "Job"}
    for component, job in jobs.items():
        assert job["metadata"]["labels"]["cost-center"] == "ml-42", component
        # Kueue admits the data-plane Jobs; the controller, a small CPU pod that waits on them, is not queued.
        assert job["metadata"]["labels"].get(QUEUE_LABEL) == (None if component == "controller" else "gpu-queue"), component


def test_without_placement_settings_a_gpu_pod_only_tolerates_the_gpu_taint():
    spec = parse_spec({"name": "plain", "target": {"model": "s3://bucket/m"}, "data": {"source": "s3://bucket/c.jsonl"}, "output": "s3://bucket/o"})
    jobs = {obj["metadata"]["labels"]["app.kubernetes.io/component"]: obj["spec"]["template"]["spec"] for obj in render_all(spec) if obj["kind"] == "Job"}
    assert jobs["extract"]["tolerations"] == [GPU_TOLERATION]
    for pod in jobs.values():
        assert not {"priorityClassName", "imagePullSecrets", "affinity", "nodeSelector"} & set(pod)
    assert "tolerations" not in jobs["prepare"] and "tolerations" not in jobs["controller"]


# ---- the pod template patch -------------------------------------------------------------------


PATCHES = {
    "sidecar, env and a volume": {"spec": {
        "containers": [
            {"name": "worker", "env": [{"name": "NCCL_DEBUG", "value": "INFO"}], "volumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/custom", "readOnly": True}]},
            {"name": "log-shipper", "image": "fluent/fluent-bit:3.2", "resources": {"limits": {"memory": "64Mi"}}},
        ],
        "volumes": [{"name": "certs", "secret": {"secretName": "corp-ca"}}],
    }},
    "delete, change and null": {
        "metadata": {"labels": {"team": "inference"}},
        "spec": {
            "volumes": [{"name": "dshm", "$patch": "delete"}, {"name": "tmp", "emptyDir": {"medium": "Memory"}}],
            "containers": [{"name": "worker", "env": [{"name": "TMPDIR", "value": "/scratch"}, {"name": "PYTHONUNBUFFERED", "$patch": "delete"}],
                            "volumeMounts": [{"mountPath": "/dev/shm", "$patch": "delete"}]}],
            "initContainers": [{"name": "selfcheck", "volumeMounts": [{"mountPath": "/dev/shm", "$patch": "delete"}]}],
            "nodeSelector": {"nvidia.com/gpu.product": None, "zone": "a"},
            "tolerations": [{"operator": "Exists"}],
            "hostIPC": False,
        },
    },
    "ports by number": {"spec": {"containers": [{"name": "worker", "ports": [{"containerPort": 8000, "protocol": "UDP"}, {"containerPort": 9000}]}]}},
    "replace directives": {"spec": {
        "securityContext": {"$patch": "replace", "runAsNonRoot": True, "runAsUser": 2000},
        "imagePullSecrets": [{"$patch": "replace"}, {"name": "other-creds"}],
        "dnsConfig": {"options": [{"name": "ndots", "value": "2"}]},
    }},
}


def kubectl_patch(template: dict, patch: dict) -> dict:
    """The template patched by kubectl itself (offline: `kubectl patch --local` of a Job holding it)."""
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x", "namespace": "d"}, "spec": {"template": template}}
    result = subprocess.run(
        [KUBECTL, "patch", "--local", "-f", "-", "--type", "strategic", "-p", json.dumps({"spec": {"template": patch}}), "-o", "json"],
        input=json.dumps(job), capture_output=True, text=True, env={"KUBECONFIG": "/nonexistent", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["spec"]["template"]


def without_other_pods_containers(patch: dict, template: dict) -> dict:
    """The patch without its items naming containers this pod lacks (selfcheck on a CPU pod): kubectl
    would add them with no image, dflash-k8s leaves them to the pods that have them (placement.py)."""
    spec = dict(patch.get("spec") or {})
    for key in ("containers", "initContainers"):
        names = {container["name"] for container in template["spec"].get(key) or []}
        if key in spec:
            spec[key] = [item for item in spec[key] if item["name"] in names or "image" in item]
            if not spec[key]:
                del spec[key]
    return {**patch, "spec": spec}


@pytest.mark.parametrize("case", sorted(PATCHES))
def test_the_patch_merges_every_pod_template_as_kubectl_does(case):
    patch = PATCHES[case]
    plain, patched = every_pod_template(make_spec()), every_pod_template(make_spec(pod_template_patch=patch))
    for component, template in plain.items():
        # The patch is part of the spec, so of its hash: the one difference besides the patch.
        template["metadata"]["annotations"]["dflash.dev/spec-hash"] = patched[component]["metadata"]["annotations"]["dflash.dev/spec-hash"]
        assert patched[component] == kubectl_patch(template, without_other_pods_containers(patch, template)), f"{case}: {component}"


def test_every_container_the_run_renders_is_one_the_patch_may_name():
    names = {container["name"] for template in every_pod_template(make_spec()).values()
             for key in ("containers", "initContainers") for container in template["spec"].get(key) or []}
    assert names == set(RUN_CONTAINERS)


def test_a_typo_in_a_container_name_is_refused_naming_the_containers_there_are():
    """`wroker` merged as kubectl merges it would be a new container with no image in every pod."""
    with pytest.raises(SpecError) as refused:
        render_all(make_spec(pod_template_patch={"spec": {"containers": [{"name": "wroker", "env": [{"name": "A", "value": "1"}]}]}}))
    assert refused.value.field == "cluster.pod_template_patch.spec.containers[name=wroker]"
    assert "worker, selfcheck, stage" in refused.value.allowed and "an image to add it as a new container" in refused.value.allowed
    with pytest.raises(SpecError, match="selfcheck is one of the pod's initContainers"):
        render_all(make_spec(pod_template_patch={"spec": {"containers": [{"name": "selfcheck", "env": []}]}}))


def test_an_item_for_another_pod_s_container_changes_only_the_pods_that_have_it():
    limits = {"resources": {"limits": {"memory": "2Gi"}}}
    templates = every_pod_template(make_spec(pod_template_patch={"spec": {"initContainers": [{"name": "stage", **limits}]}}))
    plain = every_pod_template(make_spec())
    (stage,) = [c for c in templates["generate"]["spec"]["initContainers"] if c["name"] == "stage"]
    assert stage["resources"]["limits"]["memory"] == "2Gi" and stage["image"]
    for component in set(templates) - {"generate"}:
        assert templates[component]["spec"].get("initContainers") == plain[component]["spec"].get("initContainers"), component


@pytest.mark.parametrize("tolerations, warned", [
    ([{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}], True),
    ([{"operator": "Exists"}], False),  # every taint
    ([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}, GPU_TAINT], False),
    ([{"key": "nvidia.com/gpu", "operator": "Equal", "value": "present", "effect": "NoSchedule"}], False),
    ([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}], True),
])
def test_a_patch_whose_tolerations_drop_the_gpu_toleration_is_warned_in_check_and_render(tolerations, warned, tmp_path):
    spec = make_spec(pod_template_patch={"spec": {"tolerations": tolerations}})
    assert every_pod_template(spec)["extract"]["spec"]["tolerations"] == tolerations  # replaced, as kubectl replaces it
    result = pod_template_patch(Preflight(spec))
    assert (result.status == "warn") == warned and bool(patch_warnings(spec)) == warned
    if warned:
        assert "no longer tolerate nvidia.com/gpu" in result.detail and "cluster.tolerations" in result.fix
        spec_file = tmp_path / "dflash.yaml"
        spec_file.write_text(yaml.safe_dump(spec.to_dict()))
        rendered = CliRunner().invoke(app, ["render", "extract", "-f", str(spec_file)])
        assert rendered.exit_code == 0 and "warning: cluster.pod_template_patch.spec.tolerations replaces every pod's tolerations" in rendered.output


@pytest.fixture
def cached_schemas(monkeypatch):
    monkeypatch.setattr(kubernetes_validate.utils, "schema_contents", functools.lru_cache(kubernetes_validate.utils.schema_contents))


def test_placed_and_patched_objects_validate_against_kubernetes_1_33_to_1_37(cached_schemas):
    spec = make_spec(pod_template_patch=PATCHES["sidecar, env and a volume"])
    objects = [*render_all(spec), *render_stage_model_objects(spec, "s3://bucket/models/q"), render_probe_pod(spec)]
    for obj in objects:
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(copy.deepcopy(obj), version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} is invalid for Kubernetes {version}: {exc.message}")


def test_strategic_merge_orders_a_merged_list_as_kubernetes_does():
    # Patch items in patch order; an item only in the template keeps its place before the patch
    # items the template has after it (k8s.io/apimachinery strategicpatch: mergeSortedSlice).
    original = {"env": [{"name": "A"}, {"name": "B", "value": "1"}, {"name": "C"}]}
    patch = {"env": [{"name": "B", "value": "2"}, {"name": "D"}]}
    merged = strategic_merge(original, patch)
    assert [e["name"] for e in merged["env"]] == ["A", "B", "D", "C"] and merged["env"][1]["value"] == "2"
    template = {"spec": {"containers": [{"name": "worker", "image": "x", **original}]}}
    assert strategic_merge(template, {"spec": {"containers": [{"name": "worker", **patch}]}}) == \
        kubectl_patch(template, {"spec": {"containers": [{"name": "worker", **patch}]}})
    assert original["env"][1]["value"] == "1"  # the original is left alone


# ---- the spec refuses what cannot work -------------------------------------------------------


@pytest.mark.parametrize("cluster, field, allowed", [
    ({"tolerations": [{"key": "a", "operator": "In"}]}, "cluster.tolerations[0].operator", "Exists | Equal"),
    ({"tolerations": [{"key": "a", "operator": "Exists", "value": "b"}]}, "cluster.tolerations[0].value", "no value with operator Exists"),
    ({"tolerations": [{"key": "a", "effect": "NoSchedule", "tolerationSeconds": 5}]}, "cluster.tolerations[0].tolerationSeconds", "NoExecute only"),
    ({"tolerations": [{"key": "a", "toleration_seconds": 5}]}, "cluster.tolerations[0].toleration_seconds", "tolerationSeconds"),
    ({"cpu_placement": {"tolerations": [{"operator": "Equal"}]}}, "cluster.cpu_placement.tolerations[0].key", "a taint key"),
    ({"affinity": {"nodeSelector": {}}}, "cluster.affinity.nodeSelector", "nodeAffinity, podAffinity, podAntiAffinity"),
    ({"labels": {"app.kubernetes.io/name": "mine"}}, "cluster.labels", "which the run sets itself"),
    ({"labels": {"kueue.x-k8s.io/queue-name": "q"}}, "cluster.labels", "cluster.queue"),
    ({"labels": {"team": "a b"}}, "cluster.labels.team", "a label value"),
    ({"annotations": {"bad key!": "x"}}, "cluster.annotations", "[prefix/]name"),
    ({"image_pull_secrets": ["Registry"]}, "cluster.image_pull_secrets[0]", "DNS-1123"),
    ({"priority_class": "High Priority"}, "cluster.priority_class", "DNS-1123"),
    ({"pod_template_patch": {"spec": {}, "kind": "Pod"}}, "cluster.pod_template_patch", "metadata and/or spec"),
])
def test_bad_placement_settings_are_refused_naming_the_field(cluster, field, allowed):
    with pytest.raises(SpecError) as refused:
        make_spec(**cluster)
    assert refused.value.field == field and allowed in refused.value.allowed


def test_a_patch_item_without_its_merge_key_is_refused_at_render():
    with pytest.raises(SpecError) as refused:
        render_all(make_spec(pod_template_patch={"spec": {"volumes": [{"emptyDir": {}}]}}))
    assert refused.value.field == "cluster.pod_template_patch.spec.volumes" and "merge key 'name'" in refused.value.allowed


def test_the_example_spec_with_placement_renders_as_yaml():
    text = yaml.safe_dump(make_spec().to_dict())
    assert parse_spec(yaml.safe_load(text)) == make_spec()  # the new fields survive run.yaml and the ConfigMap
