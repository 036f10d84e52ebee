"""k8s/: every overlay builds with kustomize, every object validates against Kubernetes 1.33-1.37,
the controller's RBAC is least privilege and equal to what `dflashctl render` emits, and the GitOps
examples point at what exists and leave the shared objects to the base."""

from __future__ import annotations

import base64
import dataclasses
import fnmatch
import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from dflash_jobs.spec import ClusterSpec, parse_spec
from dflashctl.render import controller_role_rules, render_all, render_selection
from dflashctl.run_directory import write_manifests

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
KUBECTL = "/usr/bin/kubectl"
OVERLAYS = ("rtx-pro-6000", "dev", "metrics")
KUBERNETES_VERSIONS = ("1.33.0", "1.34.0", "1.35.0", "1.36.0", "1.37.0")
DEFAULTS = ClusterSpec()
CUSTOM_RESOURCE_GROUPS = {"monitoring.coreos.com", "external-secrets.io"}

# The ServiceMonitor is the Prometheus Operator's custom resource (monitoring.coreos.com/v1): no
# schema of it ships with Kubernetes. This is the part of its structure the metrics component uses,
# written after the operator's CRD: a field it does not know is refused here (the API server would
# silently prune it), the required ones are there, durations have the CRD's pattern.
DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def custom_resource_schema(api_version: str, kind: str, spec: dict) -> dict:
    """A custom resource's object: apiVersion, kind, metadata and the `spec` schema given, nothing else."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": {
                "type": "object", "required": ["name"], "additionalProperties": False,
                "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": STRING_MAP, "annotations": STRING_MAP},
            },
            "spec": spec,
        },
    }


SERVICE_MONITOR_SCHEMA = custom_resource_schema("monitoring.coreos.com/v1", "ServiceMonitor", {
    "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
    "properties": {
        "selector": {"type": "object", "additionalProperties": False, "properties": {"matchLabels": STRING_MAP}},
        "namespaceSelector": {
            "type": "object", "additionalProperties": False,
            "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}},
        },
        "jobLabel": {"type": "string"},
        "podTargetLabels": {"type": "array", "items": {"type": "string"}},
        "targetLabels": {"type": "array", "items": {"type": "string"}},
        "endpoints": {
            "type": "array", "minItems": 1,
            "items": {
                "type": "object", "additionalProperties": False,
                "properties": {
                    "port": {"type": "string"},
                    "path": {"type": "string", "pattern": "^/"},
                    "scheme": {"enum": ["http", "https"]},
                    "interval": {"type": "string", "pattern": DURATION},
                    "scrapeTimeout": {"type": "string", "pattern": DURATION},
                    "honorLabels": {"type": "boolean"},
                },
            },
        },
    },
})

# The ExternalSecret is the External Secrets Operator's custom resource (external-secrets.io/v1):
# likewise written after the operator's CRD (config/crds/bases/external-secrets.io_externalsecrets.yaml),
# the part of it the s3-external-secret component uses, strict where the API server would prune.
DNS_SUBDOMAIN = {"type": "string", "maxLength": 253, "minLength": 1, "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}
GO_DURATION = r"^(0|([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+)$"
REMOTE_REF = {
    "type": "object", "required": ["key"], "additionalProperties": False,
    "properties": {
        "key": {"type": "string"}, "property": {"type": "string"}, "version": {"type": "string"},
        "conversionStrategy": {"enum": ["Default", "Unicode"]},
        "decodingStrategy": {"enum": ["Auto", "Base64", "Base64URL", "None"]},
        "metadataPolicy": {"enum": ["None", "Fetch"]},
    },
}
EXTERNAL_SECRET_SCHEMA = custom_resource_schema("external-secrets.io/v1", "ExternalSecret", {
    "type": "object", "required": ["secretStoreRef", "target"], "additionalProperties": False,
    "properties": {
        "refreshInterval": {"type": "string", "pattern": GO_DURATION},
        "secretStoreRef": {
            "type": "object", "required": ["name"], "additionalProperties": False,
            "properties": {"kind": {"enum": ["SecretStore", "ClusterSecretStore"]}, "name": DNS_SUBDOMAIN},
        },
        "target": {
            "type": "object", "additionalProperties": False,
            "properties": {
                "name": DNS_SUBDOMAIN,
                "creationPolicy": {"enum": ["Owner", "Orphan", "Merge", "None"]},
                "deletionPolicy": {"enum": ["Delete", "Merge", "Retain"]},
                "immutable": {"type": "boolean"},
                "template": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "type": {"type": "string"}, "engineVersion": {"enum": ["v1", "v2"]}, "mergePolicy": {"enum": ["Replace", "Merge"]},
                        "metadata": {"type": "object", "additionalProperties": False, "properties": {"labels": STRING_MAP, "annotations": STRING_MAP}},
                        "data": STRING_MAP,
                    },
                },
            },
        },
        "data": {"type": "array", "items": {
            "type": "object", "required": ["secretKey", "remoteRef"], "additionalProperties": False,
            "properties": {"secretKey": {"type": "string", "pattern": r"^[-._a-zA-Z0-9]+$", "maxLength": 253, "minLength": 1}, "remoteRef": REMOTE_REF},
        }},
        "dataFrom": {"type": "array", "items": {
            "type": "object", "additionalProperties": False,
            "properties": {"extract": REMOTE_REF, "find": {"type": "object"}, "rewrite": {"type": "array"}, "sourceRef": {"type": "object"}},
        }},
    },
})
PLACEHOLDER = re.compile(r"^(|\.\.\.|<.*>|changeme|change-me|replace-?me|todo|xxx+|placeholder)$", re.IGNORECASE)


def kustomize(path: Path) -> list[dict]:
    result = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, f"kubectl kustomize {path} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def builds() -> dict[str, list[dict]]:
    """Every overlay, and the default base itself, built once."""
    return {"default": kustomize(K8S / "default")} | {name: kustomize(K8S / "overlays" / name) for name in OVERLAYS}


@pytest.fixture
def cached_schemas(monkeypatch):
    """kubernetes_validate re-reads its schema files (a 1 MB definitions file) on every call."""
    monkeypatch.setattr(kubernetes_validate.utils, "schema_contents", functools.lru_cache(kubernetes_validate.utils.schema_contents))


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [obj for obj in objects if obj["kind"] == kind]


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    matches = [obj for obj in by_kind(objects, kind) if name is None or obj["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def pod_specs(objects: list[dict]) -> list[tuple[str, dict]]:
    return [(f"{obj['kind']}/{obj['metadata']['name']}", obj["spec"]["template"]["spec"])
            for obj in objects if obj["kind"] in ("Deployment", "Job")]


@pytest.fixture(scope="module")
def run_spec():
    return parse_spec({
        "name": "qwen36-27b-v1",
        "target": {"model": "/models/Qwen3.6-27B"},
        "data": {"source": "s3://bucket/chats.jsonl"},
        "output": "s3://bucket/dflash/qwen36-27b-v1",
        "cluster": {"model_volume": {"claim": "models"}},
        "generate": {},  # the vLLM image's pod must be admitted too
    })


# ---- every overlay is valid Kubernetes -------------------------------------------------------


def test_overlays_validate_strictly_against_kubernetes_1_33_to_1_37(builds, cached_schemas):
    # The overlays share most objects: validate each distinct object once per version. Custom
    # resources have no schema in Kubernetes: see the ServiceMonitor's own test below.
    distinct = {json.dumps(obj, sort_keys=True): obj for objects in builds.values() for obj in objects}
    assert len(distinct) >= 10
    for obj in distinct.values():
        if obj["apiVersion"].split("/")[0] in CUSTOM_RESOURCE_GROUPS:
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} is invalid for Kubernetes {version}: {exc.message}")


def test_every_object_lives_in_the_spec_default_namespace_with_dflash_labels(builds):
    for name in OVERLAYS:
        objects = builds[name]
        namespace = one(objects, "Namespace")
        assert namespace["metadata"]["name"] == DEFAULTS.namespace
        # The rendered pods are non-root, capability-free and seccomp'd: the restricted profile admits them.
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
        for obj in objects:
            labels = obj["metadata"].get("labels", {})
            assert labels.get("app.kubernetes.io/part-of") == "dflash-k8s", f"{name}: {obj['kind']} lacks part-of"
            if obj["kind"] != "Namespace":
                assert obj["metadata"]["namespace"] == DEFAULTS.namespace, f"{name}: {obj['kind']} outside the namespace"


def test_static_objects_have_the_names_the_spec_defaults_refer_to(builds):
    for objects in builds.values():
        one(objects, "ServiceAccount", DEFAULTS.service_account)
        one(objects, "PersistentVolumeClaim", "models")
        one(objects, "PersistentVolumeClaim", "dflash-kernels")
    # Only the dev overlay brings the S3 Secret (its own MinIO's): see the GitOps tests below.
    assert {name for name, objects in builds.items() if by_kind(objects, "Secret")} == {"dev"}


# ---- metrics (an optional component) ---------------------------------------------------------


def seconds(duration: str) -> float:
    return sum(int(n) * {"h": 3600, "m": 60, "s": 1}[unit] for n, unit in re.findall(r"(\d+)([hms])", duration))


def test_the_metrics_component_is_optional_and_well_formed(builds):
    for name in ("default", "rtx-pro-6000", "dev"):
        assert not by_kind(builds[name], "ServiceMonitor"), f"{name} must not need the Prometheus Operator"
    monitor = one(builds["metrics"], "ServiceMonitor")
    jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)
    for endpoint in monitor["spec"]["endpoints"]:
        assert seconds(endpoint["scrapeTimeout"]) <= seconds(endpoint["interval"])  # the operator refuses a longer timeout
    # The check has teeth: a misspelled field fails it.
    broken = {**monitor, "spec": {**monitor["spec"], "endpoint": monitor["spec"]["endpoints"]}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SERVICE_MONITOR_SCHEMA)


def test_the_service_monitor_finds_the_controller_pods_and_their_metrics_port(builds, run_spec):
    """ServiceMonitor -> Service (labels, port name) -> the rendered controller pod (labels, port name)."""
    monitor, service = one(builds["metrics"], "ServiceMonitor"), one(builds["metrics"], "Service", "dflash-controller-metrics")
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"] == DEFAULTS.namespace
    selected = [s for s in by_kind(builds["metrics"], "Service") if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert selected == [service]
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    with_metrics = dataclasses.replace(run_spec, cluster=dataclasses.replace(run_spec.cluster, metrics_port=9100))
    for spec, scraped in ((with_metrics, True), (run_spec, False)):
        (job,) = by_kind(render_selection(spec, "controller"), "Job")
        template = job["spec"]["template"]
        assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
        (container,) = template["spec"]["containers"]
        names = {p["name"] for p in container.get("ports", [])}
        assert (port["targetPort"] in names) == scraped
    # No other pod of a run matches the Service: only the controller serves metrics.
    for job in by_kind(render_all(with_metrics), "Job"):
        labels = job["spec"]["template"]["metadata"]["labels"]
        assert (service["spec"]["selector"].items() <= labels.items()) == (labels["app.kubernetes.io/component"] == "controller")


# ---- RBAC ---------------------------------------------------------------------------------------


def test_role_is_exactly_the_rules_dflashctl_renders(builds):
    for objects in builds.values():
        assert one(objects, "Role", DEFAULTS.service_account)["rules"] == controller_role_rules()


def test_controller_rbac_is_least_privilege_and_namespaced(builds):
    for objects in builds.values():
        assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")
        for rule in one(objects, "Role")["rules"]:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], f"wildcard in {key}: {rule}"
            assert "secrets" not in rule["resources"], "the controller never reads Secrets: pods reference them"
            assert set(rule["verbs"]) <= {"get", "list", "watch", "create", "patch", "delete"}
        # Read-only where the controller only observes.
        rules = {resource: set(rule["verbs"]) for rule in one(objects, "Role")["rules"] for resource in rule["resources"]}
        assert rules["pods"] == {"get", "list", "watch"} and rules["pods/log"] == {"get"}
        binding = one(objects, "RoleBinding")
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": DEFAULTS.service_account}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": DEFAULTS.service_account, "namespace": DEFAULTS.namespace}]


def test_rendered_controller_rbac_is_the_same_objects_as_the_base(builds, run_spec):
    """A run applied with plain kubectl and the base must not disagree about the shared RBAC."""
    rendered = render_selection(run_spec, "controller")
    for kind in ("ServiceAccount", "Role", "RoleBinding"):
        ours = one(builds["rtx-pro-6000"], kind)
        theirs = one(rendered, kind)
        assert theirs["metadata"]["name"] == ours["metadata"]["name"]
        assert theirs["metadata"]["namespace"] == ours["metadata"]["namespace"]
        body = {key: value for key, value in ours.items() if key not in ("metadata", "apiVersion", "kind")}
        assert body == {key: value for key, value in theirs.items() if key not in ("metadata", "apiVersion", "kind")}


# ---- secrets, volumes, pods -------------------------------------------------------------------


def test_single_node_overlay_makes_the_model_pvc_read_write_once(builds):
    base = one(builds["default"], "PersistentVolumeClaim", "models")
    assert base["spec"]["accessModes"] == ["ReadWriteMany"]
    rtx = one(builds["rtx-pro-6000"], "PersistentVolumeClaim", "models")
    assert rtx["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert rtx["spec"]["resources"] == base["spec"]["resources"]
    # GitOps tools never prune the checkpoints.
    annotations = rtx["metadata"]["annotations"]
    assert annotations["argocd.argoproj.io/sync-options"] == "Prune=false"
    assert annotations["kustomize.toolkit.fluxcd.io/prune"] == "disabled"


def test_single_node_overlay_keeps_compiled_kernels_on_the_node(builds):
    assert one(builds["default"], "PersistentVolumeClaim", "dflash-kernels")["spec"]["accessModes"] == ["ReadWriteMany"]
    assert one(builds["rtx-pro-6000"], "PersistentVolumeClaim", "dflash-kernels")["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_dev_overlay_wires_minio_as_the_s3_endpoint(builds):
    objects = builds["dev"]
    deployment, service = one(objects, "Deployment", "minio"), one(objects, "Service", "minio")
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    assert service["spec"]["selector"].items() <= template_labels.items()
    port = service["spec"]["ports"][0]["port"]
    secret = one(objects, "Secret", DEFAULTS.s3_secret)["stringData"]
    assert secret["AWS_ENDPOINT_URL"] == f"http://{service['metadata']['name']}:{port}"
    assert secret["AWS_ACCESS_KEY_ID"] and secret["AWS_SECRET_ACCESS_KEY"]
    # MinIO's root credentials and the bucket Job's come from that same Secret.
    env = {item["name"]: item["valueFrom"]["secretKeyRef"] for item in deployment["spec"]["template"]["spec"]["containers"][0]["env"] if "valueFrom" in item}
    assert env["MINIO_ROOT_USER"] == {"name": DEFAULTS.s3_secret, "key": "AWS_ACCESS_KEY_ID"}
    assert env["MINIO_ROOT_PASSWORD"] == {"name": DEFAULTS.s3_secret, "key": "AWS_SECRET_ACCESS_KEY"}
    bucket_job = one(objects, "Job", "minio-create-bucket")
    container = bucket_job["spec"]["template"]["spec"]["containers"][0]
    assert container["envFrom"] == [{"secretRef": {"name": DEFAULTS.s3_secret}}]
    assert "mc mb --ignore-existing dev/dflash" in container["args"][0]
    assert "ttlSecondsAfterFinished" not in bucket_job["spec"]


def test_every_image_is_pinned_to_a_release_tag(builds):
    for objects in builds.values():
        for where, spec in pod_specs(objects):
            for container in spec.get("initContainers", []) + spec["containers"]:
                image = container["image"]
                assert re.search(r":[\w.-]+$", image) and not image.endswith(":latest"), f"{where}: {image} is not pinned"


def assert_restricted(where: str, spec: dict) -> None:
    """The Pod Security "restricted" rules the namespace enforces (the ones a pod spec can break)."""
    pod = spec.get("securityContext", {})
    assert pod.get("runAsNonRoot") is True, f"{where}: runAsNonRoot"
    assert pod.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{where}: seccompProfile"
    assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), where
    assert all("hostPath" not in volume for volume in spec.get("volumes", [])), f"{where}: hostPath"
    for container in spec.get("initContainers", []) + spec["containers"]:
        context = container.get("securityContext", {})
        assert context.get("allowPrivilegeEscalation") is False, f"{where}/{container['name']}: allowPrivilegeEscalation"
        assert context.get("capabilities", {}).get("drop") == ["ALL"], f"{where}/{container['name']}: capabilities"
        assert not context.get("privileged"), f"{where}/{container['name']}: privileged"


def test_every_pod_is_admitted_by_the_restricted_namespace(builds, run_spec):
    for objects in builds.values():
        for where, spec in pod_specs(objects):
            assert_restricted(where, spec)
    for where, spec in pod_specs(render_all(run_spec)):
        assert_restricted(where, spec)


# ---- GitOps -----------------------------------------------------------------------------------


def expand_braces(pattern: str) -> list[str]:
    """`{a,b}` alternatives as Argo CD's glob reads them (one level is all the examples use)."""
    match = re.fullmatch(r"\{(.*)\}", pattern)
    return match.group(1).split(",") if match else [pattern]


@pytest.fixture(scope="module")
def run_directory(tmp_path_factory, run_spec) -> tuple[Path, list[str]]:
    """A repository-like tree with one run rendered the documented way; returns (runs dir, file paths)."""
    runs = tmp_path_factory.mktemp("repo") / "k8s" / "runs"
    written = write_manifests(render_selection(run_spec, "controller"), runs / run_spec.name).written
    return runs, [path.relative_to(runs).as_posix() for path in written]


def shared_rbac_files(files: list[str]) -> set[str]:
    return {path for path in files if re.match(r"[^/]+/(serviceaccount|role|rolebinding)-", path)}


def overlay_of(path: str) -> str:
    """The overlay a GitOps example syncs as the base; it must be one that the tests build."""
    name = Path(path).name
    assert Path(path.removeprefix("./")).parent.as_posix() == "k8s/overlays" and name in OVERLAYS, path
    return name


def test_argocd_example_syncs_the_base_and_the_runs_without_the_shared_rbac(run_directory):
    base, runs = yaml.safe_load_all((K8S / "gitops" / "argocd-application.yaml").read_text())
    assert base["kind"] == runs["kind"] == "Application"
    assert base["spec"]["destination"]["namespace"] == runs["spec"]["destination"]["namespace"] == DEFAULTS.namespace
    overlay_of(base["spec"]["source"]["path"])
    assert runs["spec"]["source"]["path"] == "k8s/runs" and (REPO / "k8s" / "runs").is_dir()
    # A directory application fails on kustomization files: k8s/runs must hold plain manifests only.
    assert not list((REPO / "k8s" / "runs").rglob("kustomization.yaml"))
    directory = runs["spec"]["source"]["directory"]
    assert directory["recurse"] is True
    _, files = run_directory
    excluded = {path for path in files if any(fnmatch.fnmatch(path, glob) for glob in expand_braces(directory["exclude"]))}
    assert excluded == shared_rbac_files(files)
    assert len(files) - len(excluded) == 2  # the spec ConfigMap and the controller Job
    assert runs["spec"]["syncPolicy"]["automated"]["prune"] is True


def test_flux_example_syncs_the_base_then_the_runs_without_force(run_directory):
    source, base, runs = yaml.safe_load_all((K8S / "gitops" / "flux-kustomization.yaml").read_text())
    assert source["kind"] == "GitRepository" and base["kind"] == runs["kind"] == "Kustomization"
    overlay_of(base["spec"]["path"])
    assert runs["spec"]["path"] == "./k8s/runs"
    assert runs["spec"]["dependsOn"] == [{"name": base["metadata"]["name"]}]
    assert runs["spec"]["prune"] is True and runs["spec"]["force"] is False
    _, files = run_directory
    ignored = {
        path for path in files
        for line in source["spec"]["ignore"].splitlines()
        if fnmatch.fnmatch(f"/k8s/runs/{path}", line.strip().replace("/**/", "/*/"))
    }
    assert ignored == shared_rbac_files(files)


def test_gitops_rendered_jobs_carry_no_ttl(run_spec):
    for obj in render_all(run_spec):
        if obj["kind"] == "Job":
            assert "ttlSecondsAfterFinished" not in obj["spec"], obj["metadata"]["name"]


# ---- the S3 credentials under GitOps ------------------------------------------------------------


def secrets_with_placeholders(objects: list[dict]) -> list[str]:
    """Secrets in `objects` with a value that is empty or a placeholder: a sync would apply them over the real one."""
    found = []
    for obj in by_kind(objects, "Secret"):
        values = {**{k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}, **(obj.get("stringData") or {})}
        if not values or any(PLACEHOLDER.match(value.strip()) for value in values.values()):
            found.append(obj["metadata"]["name"])
    return found


def synced_by_the_examples(run_directory) -> dict[str, list[dict]]:
    """What each Argo CD Application and Flux Kustomization of k8s/gitops applies: its overlay built
    with kustomize, or the run directories (one rendered the documented way, as a repository would hold)."""
    runs, files = run_directory
    rendered = [yaml.safe_load((runs / path).read_text()) for path in files]
    applications = list(yaml.safe_load_all((K8S / "gitops" / "argocd-application.yaml").read_text()))
    flux = [doc for doc in yaml.safe_load_all((K8S / "gitops" / "flux-kustomization.yaml").read_text()) if doc["kind"] == "Kustomization"]
    paths = {f"argocd/{app['metadata']['name']}": app["spec"]["source"]["path"] for app in applications}
    paths |= {f"flux/{kustomization['metadata']['name']}": kustomization["spec"]["path"] for kustomization in flux}
    assert len(paths) == 4
    synced = {}
    for name, path in paths.items():
        path = path.removeprefix("./")
        synced[name] = rendered if path == "k8s/runs" else kustomize(REPO / path)
    return synced


def test_no_secret_with_placeholder_values_is_in_what_a_gitops_example_syncs(run_directory, cached_schemas):
    """A Secret with empty values in a synced overlay is put back over the real one by every sync
    (Argo CD selfHeal, Flux reconciliation) and every `kubectl apply -k`: none may be there."""
    for name, objects in synced_by_the_examples(run_directory).items():
        assert objects, name
        assert secrets_with_placeholders(objects) == [], f"{name} syncs a Secret with placeholder values"
        assert not by_kind(objects, "Secret"), f"{name} syncs a Secret: the S3 credentials come from outside Git (docs/gitops.md)"
        for obj in objects:
            if obj["apiVersion"].split("/")[0] not in CUSTOM_RESOURCE_GROUPS:
                kubernetes_validate.validate(obj, KUBERNETES_VERSIONS[0], strict=True)
    # The check has teeth: the template this repository used to ship, and the dev overlay's throwaway values, are caught.
    template = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "dflash-s3"}, "stringData": {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}}
    assert secrets_with_placeholders([template]) == ["dflash-s3"]
    assert secrets_with_placeholders([{**template, "stringData": {"AWS_ACCESS_KEY_ID": "<key id>", "AWS_SECRET_ACCESS_KEY": "s3cr3t"}}]) == ["dflash-s3"]
    assert secrets_with_placeholders([{**template, "stringData": None, "data": {"AWS_ACCESS_KEY_ID": base64.b64encode(b"AKIA1").decode()}}]) == []


def overlay_with_component(tmp_path: Path, overlay: str, component: str) -> list[dict]:
    """`overlay` with `component` added to its kustomization.yaml, as its comment says to: a copy
    of it, its paths pointing back into k8s/."""
    source, root = K8S / "overlays" / overlay, tmp_path / overlay
    shutil.copytree(source, root)
    kustomization = yaml.safe_load((root / "kustomization.yaml").read_text())
    relative = lambda path: os.path.relpath((source / path).resolve(), root)  # noqa: E731
    kustomization["resources"] = [relative(path) if (source / path).is_dir() else path for path in kustomization["resources"]]
    kustomization["components"] = [*map(relative, kustomization.get("components", [])), relative(f"../../components/{component}")]
    (root / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return kustomize(root)


def test_the_external_secret_component_gives_the_pods_their_secret_from_a_secret_manager(tmp_path, run_spec):
    objects = overlay_with_component(tmp_path, "rtx-pro-6000", "s3-external-secret")
    external = one(objects, "ExternalSecret")
    jsonschema.validate(external, EXTERNAL_SECRET_SCHEMA)
    assert external["metadata"]["namespace"] == DEFAULTS.namespace
    assert external["metadata"]["labels"]["app.kubernetes.io/part-of"] == "dflash-k8s"
    # The Secret it makes is the one every rendered pod reads; no Secret object itself is in Git.
    assert external["spec"]["target"]["name"] == DEFAULTS.s3_secret and not by_kind(objects, "Secret")
    for _, pod in pod_specs(render_all(run_spec)):
        for container in pod["containers"]:
            assert {"secretRef": {"name": external["spec"]["target"]["name"], "optional": True}} in container.get("envFrom", [])
    # The rest of the overlay is unchanged.
    assert [o for o in objects if o["kind"] != "ExternalSecret"] == kustomize(K8S / "overlays" / "rtx-pro-6000")
    # The check has teeth: a misspelled field or a store kind the operator does not know fails it.
    for broken in (
        {**external, "spec": {**external["spec"], "dataFrom": [{"extrakt": {"key": "dflash/s3"}}]}},
        {**external, "spec": {**external["spec"], "secretStoreRef": {"kind": "Vault", "name": "dflash"}}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, EXTERNAL_SECRET_SCHEMA)
