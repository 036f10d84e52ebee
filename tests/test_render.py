"""The rendered Kubernetes objects: valid for every supported cluster, and the policy of DESIGN section 6."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml
from cli_runner import cli

from dflash_jobs.errors import EXIT_BAD_INPUT, EXIT_BAD_SPEC, SpecError
from dflash_jobs.spec import CHUNK_CACHE_ENV, MODEL_CACHE_ENV, load_spec, parse_spec
from dflashctl import render

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "qwen36-27b"
KUBERNETES_VERSIONS = ("1.33.0", "1.34.0", "1.35.0", "1.36.0", "1.37.0")


def make_spec(**sections):
    """A valid spec; keyword arguments replace or extend its sections."""
    raw = {
        "name": "demo-run",
        "target": {"model": "/models/Qwen3.6-27B"},
        "data": {"source": "s3://bucket/chats.jsonl"},
        "output": "s3://bucket/runs/demo-run",
        "cluster": {"model_volume": {"claim": "models"}},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return parse_spec(raw)


SPECS = {
    "defaults": make_spec(),
    "everything": make_spec(
        target={"model": "/weights/Qwen3.6-27B"},
        generate={"shards": 4, "gpus_per_shard": 2, "vllm_args": ["--max-num-seqs", "256"]},
        extract={"shards": 3, "backoff_limit_per_index": 5},
        train={"nodes": 2, "gpus_per_node": 4, "cache_storage_class": "local-nvme"},
        cluster={
            "queue": "gpu-queue", "ttl_seconds_after_finished": 3600, "model_volume": {"claim": "models", "mount": "/weights"},
            "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H200"}, "namespace": "team-a", "model_cache": "model-cache",
            "metrics_port": 8000,
        },
    ),
    "no-secret": make_spec(cluster={"s3_secret": None}, generate={"engine": "transformers"}),
}


def by_kind(objects, kind, component=None):
    return [
        o for o in objects
        if o["kind"] == kind and (component is None or o["metadata"]["labels"].get("app.kubernetes.io/component") == component)
    ]


def the_job(objects, component):
    (job,) = by_kind(objects, "Job", component)
    return job


def pod_specs(objects):
    return [(job["metadata"]["name"], job["spec"]["template"]["spec"]) for job in by_kind(objects, "Job")]


@pytest.fixture(scope="module")
def cached_schemas():
    """kubernetes-validate parses its large definitions file on every call: parse each file once."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kubernetes_validate.utils, "schema_contents", functools.cache(kubernetes_validate.utils.schema_contents))
        yield


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_object_validates_against_every_supported_kubernetes_schema(name, cached_schemas):
    objects = render.render_all(SPECS[name])
    assert len({(o["kind"], o["metadata"]["name"]) for o in objects}) == len(objects)
    for version in KUBERNETES_VERSIONS:
        for obj in objects:
            kubernetes_validate.validate(obj, version, strict=True)
    # The check has teeth: a misspelled field fails it.
    job = the_job(objects, "extract")
    broken = {**job, "spec": {**job["spec"], "backoffLimitPerIndx": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


def test_extraction_job_is_an_indexed_job_with_the_designed_failure_policy():
    spec = SPECS["everything"]
    job = the_job(render.render_all(spec), "extract")
    body = job["spec"]
    assert job["metadata"]["name"] == "demo-run-extract" == render.job_name(spec, "extract")
    assert body["completionMode"] == "Indexed"
    assert body["completions"] == body["parallelism"] == spec.extract.shards == 3
    assert body["backoffLimitPerIndex"] == 5
    assert body["podReplacementPolicy"] == "Failed"
    assert "maxFailedIndexes" not in body  # every shard runs; failed ones are retried by the pipeline
    rules = body["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    actions = {rule["action"]: rule["onExitCodes"]["values"] for rule in rules[1:]}
    assert actions == {"FailJob": [EXIT_BAD_SPEC], "FailIndex": [EXIT_BAD_INPUT]}
    assert all(c["status"] == "True" for rule in rules for c in rule.get("onPodConditions", []))
    pod = body["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (worker,) = pod["containers"]
    assert worker["command"] == ["python", "-m", "dflash_jobs.extract", "-f", "/etc/dflash/dflash.yaml"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    (selfcheck,) = pod["initContainers"]
    assert selfcheck["command"][-2:] == ["--component", "extract"]
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert body["ttlSecondsAfterFinished"] == 3600


def test_generation_is_an_indexed_job_whose_vllm_worker_runs_in_the_vllm_image():
    spec = SPECS["everything"]
    job = the_job(render.render_all(spec), "generate")
    body = job["spec"]
    assert job["metadata"]["name"] == "demo-run-generate"
    assert body["completionMode"] == "Indexed" and body["completions"] == body["parallelism"] == 4
    assert body["backoffLimitPerIndex"] == 3 and body["podReplacementPolicy"] == "Failed"
    assert body["podFailurePolicy"] == the_job(render.render_all(spec), "extract")["spec"]["podFailurePolicy"]
    pod = body["template"]["spec"]
    (worker,) = pod["containers"]
    assert worker["image"] == "vllm/vllm-openai:v0.21.0"
    assert worker["command"] == ["python3", "-m", "dflash_jobs.generate", "-f", "/etc/dflash/dflash.yaml"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "2"
    env = {e["name"]: e["value"] for e in worker["env"]}
    assert env["PYTHONPATH"] == render.STAGED_PYTHON and env["HF_HUB_OFFLINE"] == env["VLLM_NO_USAGE_STATS"] == "1"
    assert {"name": "stage", "mountPath": render.STAGE_DIR, "readOnly": True} in worker["volumeMounts"]
    selfcheck, stage = pod["initContainers"]
    assert selfcheck["command"][-2:] == ["--component", "generate"] and selfcheck["image"] == spec.cluster.image
    assert stage["image"] == spec.cluster.image
    assert stage["command"] == ["python", "-m", "dflash_jobs.generate.stage", render.STAGED_PYTHON]
    assert {"name": "stage", "mountPath": render.STAGE_DIR} in stage["volumeMounts"]
    assert {"name": "stage", "emptyDir": {}} in pod["volumes"]
    # The transformers engine runs in the dflash image like the other steps, on one GPU.
    local = the_job(render.render_all(SPECS["no-secret"]), "generate")["spec"]["template"]["spec"]
    assert [c["name"] for c in local["initContainers"]] == ["selfcheck"]
    assert local["containers"][0]["image"] == spec.cluster.image
    assert local["containers"][0]["command"] == ["python", "-m", "dflash_jobs.generate", "-f", "/etc/dflash/dflash.yaml"]
    assert local["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # Without a generate section there is no such Job, and asking for it names the section.
    assert not by_kind(render.render_all(SPECS["defaults"]), "Job", "generate")
    with pytest.raises(SpecError, match="generate"):
        render.render_selection(SPECS["defaults"], "generate")
    assert [o["kind"] for o in render.render_selection(spec, "generate")] == ["ConfigMap", "Job"]


def test_every_pod_is_locked_down_and_writes_only_to_empty_dirs():
    for name, spec in SPECS.items():
        for job_name, pod in pod_specs(render.render_all(spec)):
            where = f"{name}/{job_name}"
            assert pod["restartPolicy"] == "Never", where
            assert pod["securityContext"]["runAsNonRoot"] is True, where
            assert pod["securityContext"]["runAsUser"] != 0, where
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
            volumes = {v["name"]: v for v in pod["volumes"]}
            assert volumes["spec"] == {"name": "spec", "configMap": {"name": "demo-run-spec"}}, where
            for container in pod.get("initContainers", []) + pod["containers"]:
                security = container["securityContext"]
                assert security == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}, where
                mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
                assert mounts["/etc/dflash"]["readOnly"] is True
                # emptyDirs, and the training cache's ephemeral volume: created and deleted with the pod.
                writable = [path for path, m in mounts.items() if {"emptyDir", "ephemeral"} & volumes[m["name"]].keys()]
                assert "/tmp" in writable, where
                env = {e["name"]: e["value"] for e in container["env"]}
                for variable in ("HOME", "TMPDIR", "XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR"):
                    assert any(env[variable].startswith(path) for path in writable), f"{where}: {variable}={env[variable]} is not writable"
                # Credentials only by Secret reference: never a literal key in a manifest.
                assert not any(e["name"].startswith("AWS_") for e in container["env"]), where
                if container["name"] == "stage":
                    assert "envFrom" not in container, where  # it copies files: no credentials
                elif spec.cluster.s3_secret:
                    assert container["envFrom"] == [{"secretRef": {"name": "dflash-s3", "optional": True}}], where
                else:
                    assert "envFrom" not in container, where


def test_gpu_pods_get_a_memory_backed_shm_and_the_model_volume_read_only():
    spec = SPECS["everything"]
    for component in ("extract", "train", "eval"):
        pod = the_job(render.render_all(spec), component)["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["/dev/shm"]["name"] == "dshm"
        assert mounts["/weights"] == {"name": "model", "mountPath": "/weights", "readOnly": True}
        assert pod["automountServiceAccountToken"] is False
    in_s3 = make_spec(target={"model": "s3://bucket/models/Qwen3.6-27B"}, cluster={"model_volume": None})
    assert not any(v["name"] == "model" for v in the_job(render.render_all(in_s3), "extract")["spec"]["template"]["spec"]["volumes"])


def test_a_model_cache_claim_holds_the_s3_checkpoint_for_every_pod_of_a_node():
    spec = make_spec(target={"model": "s3://bucket/models/Qwen3.6-27B"}, cluster={"model_cache": "model-cache"})
    for component in ("extract", "train", "eval"):
        pod = the_job(render.render_all(spec), component)["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "model-cache"}
        for container in pod["initContainers"] + pod["containers"]:  # selfcheck reads the checkpoint too
            env = {e["name"]: e["value"] for e in container["env"]}
            assert env[MODEL_CACHE_ENV] == render.MODEL_CACHE_DIR
            assert {"name": "model-cache", "mountPath": render.MODEL_CACHE_DIR} in container["volumeMounts"]
    default = the_job(render.render_all(SPECS["defaults"]), "extract")["spec"]["template"]["spec"]
    assert not any(e["name"] == MODEL_CACHE_ENV for e in default["containers"][0]["env"])


@pytest.mark.parametrize("cluster, volume, directory", [
    ({}, None, render.CACHE_DIR),  # per pod: every pod compiles
    ({"model_cache": "model-cache"}, "model-cache", f"{render.MODEL_CACHE_DIR}/kernels"),
    ({"model_cache": "model-cache", "kernel_cache": "kernels"}, "kernel-cache", render.KERNEL_CACHE_DIR),
])
def test_compiled_kernels_and_autotuning_go_to_a_volume_the_node_s_pods_share(cluster, volume, directory):
    spec = make_spec(cluster=cluster, generate={"engine": "transformers"})  # its engine compiles the decode step on a GPU
    for component in ("generate", "extract", "train", "eval"):
        pod = the_job(render.render_all(spec), component)["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["initContainers"] + pod["containers"]:
            env = {e["name"]: e["value"] for e in container["env"]}
            assert env["TRITON_CACHE_DIR"] == f"{directory}/triton" and env["TORCHINDUCTOR_CACHE_DIR"] == f"{directory}/inductor"
            assert env["TRITON_CACHE_AUTOTUNING"] == "1"
            mounted = [m for m in container["volumeMounts"] if directory.startswith(m["mountPath"])]
            assert mounted, f"{directory} is not on a volume of {container['name']}"
        if volume == "kernel-cache":
            assert volumes[volume]["persistentVolumeClaim"] == {"claimName": "kernels"}
        elif volume is None:
            assert "kernel-cache" not in volumes


def test_labels_and_spec_hash_on_every_object_of_the_run():
    spec = SPECS["everything"]
    objects = render.render_all(spec)
    for obj in objects:
        labels = obj["metadata"]["labels"]
        assert all(len(value) <= 63 for value in labels.values())
        assert obj["metadata"]["namespace"] == "team-a"
        if obj["kind"] in ("ServiceAccount", "Role", "RoleBinding"):
            # Shared by every run of the namespace: a second run attaches instead of conflicting.
            assert "dflash.dev/run" not in labels and "annotations" not in obj["metadata"]
            continue
        assert obj["metadata"]["annotations"]["dflash.dev/spec-hash"] == spec.fingerprint()
        for key in ("name", "instance", "component", "part-of", "managed-by"):
            assert labels[f"app.kubernetes.io/{key}"]
        assert labels["dflash.dev/run"] == "demo-run"
    for job in by_kind(objects, "Job"):
        assert job["spec"]["template"]["metadata"]["labels"] == render.run_labels(spec, job["metadata"]["labels"]["app.kubernetes.io/component"])
        assert len(f"{job['metadata']['name']}-{spec.extract.shards}") <= 63  # the pod hostname of an Indexed Job
    assert "ttlSecondsAfterFinished" not in the_job(render.render_all(SPECS["defaults"]), "extract")["spec"]
    assert make_spec(extract={"shards": 9}).fingerprint() != SPECS["defaults"].fingerprint()


def test_training_on_one_node_is_one_pod_with_every_gpu():
    objects = render.render_train_objects(make_spec(train={"gpus_per_node": 8}))
    (job,) = objects
    pod = job["spec"]["template"]["spec"]
    assert "completionMode" not in job["spec"]
    assert pod["containers"][0]["command"] == [
        "python", "-m", "dflash_jobs.train.launch", "--nproc_per_node=8", "--standalone", "--nnodes=1", "-m", "dflash_jobs.train", "-f", "/etc/dflash/dflash.yaml",
    ]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert pod["containers"][0]["resources"]["requests"] == {"cpu": "64", "memory": "768Gi"}


@pytest.mark.parametrize("storage_class", [None, "local-nvme"])
def test_the_training_chunk_cache_is_the_node_local_volume_train_cache_gb_sizes(storage_class):
    """The cache bound holds only if the chunks land on the volume sized for it: /tmp is an
    emptyDir without a limit, on the node's root disk."""
    spec = make_spec(train={"cache_gb": 499.5, "cache_storage_class": storage_class})
    pod = the_job(render.render_all(spec), "train")["spec"]["template"]["spec"]
    size = f"{500 + render.CACHE_HEADROOM_GIB}Gi"
    for container in pod["initContainers"] + pod["containers"]:
        env = {e["name"]: e["value"] for e in container["env"]}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert env[CHUNK_CACHE_ENV].startswith(mounts["cache"] + "/")
    volume = next(v for v in pod["volumes"] if v["name"] == "cache")
    if storage_class is None:
        assert volume == {"name": "cache", "emptyDir": {"sizeLimit": size}}
    else:
        claim = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
        assert claim == {"accessModes": ["ReadWriteOnce"], "storageClassName": "local-nvme", "resources": {"requests": {"storage": size}}}
    for component in ("extract", "eval"):  # other pods keep their small cache
        assert CHUNK_CACHE_ENV not in {e["name"] for e in the_job(render.render_all(spec), component)["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_a_cache_storage_class_must_be_a_kubernetes_name():
    with pytest.raises(SpecError, match="train.cache_storage_class"):
        make_spec(train={"cache_storage_class": "Local NVMe"})


def test_training_on_several_nodes_rendezvous_through_a_headless_service():
    spec = SPECS["everything"]
    service, job = render.render_train_objects(spec)
    name = render.job_name(spec, "train")
    assert service["kind"] == "Service" and service["metadata"]["name"] == name
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": name}
    body = job["spec"]
    assert body["completionMode"] == "Indexed" and body["completions"] == body["parallelism"] == 2
    assert body["successPolicy"] == {"rules": [{"succeededIndexes": "0"}]}
    pod = body["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    command = pod["containers"][0]["command"]
    assert "--nnodes=2" in command and "--nproc_per_node=4" in command
    port = service["spec"]["ports"][0]["port"]
    assert f"--rdzv_endpoint={name}-0.{name}:{port}" in command  # pod 0's hostname under the Service


def test_controller_job_runs_the_pipeline_with_its_own_service_account():
    spec = make_spec(cluster={"service_account": "runner", "controller_image": "registry/dflashctl:1"})
    objects = render.render_selection(spec, "controller")
    assert [o["kind"] for o in objects] == ["ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Job"]
    account, role, binding, job = objects[1:]
    assert account["metadata"]["name"] == role["metadata"]["name"] == "runner"
    assert role["rules"] == render.controller_role_rules()
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "runner"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "runner", "namespace": "dflash"}]
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "runner"
    (container,) = pod["containers"]
    assert container["image"] == "registry/dflashctl:1"
    assert container["command"] == ["dflashctl", "run", "-f", "/etc/dflash/dflash.yaml"]
    assert "nvidia.com/gpu" not in str(container["resources"]) and "tolerations" not in pod
    assert "kueue.x-k8s.io/queue-name" not in job["metadata"]["labels"]  # CPU: never waits behind GPU quota
    assert "ports" not in container  # no metrics unless the spec asks
    (container,) = the_job(render.render_selection(make_spec(cluster={"metrics_port": 9100}), "controller"), "controller")["spec"]["template"]["spec"]["containers"]
    assert container["ports"] == [{"name": "metrics", "containerPort": 9100, "protocol": "TCP"}]


def test_render_is_deterministic_and_round_trips():
    first = render.to_yaml(render.render_all(make_spec()))
    second = render.to_yaml(render.render_all(make_spec()))
    assert first == second
    assert list(yaml.safe_load_all(first)) == render.render_all(make_spec())
    assert "&id" not in first and "*id" not in first  # no YAML anchors: every object reads on its own
    assert "dflash.yaml: |" in first  # the spec stays readable in the ConfigMap
    spec_text = next(o for o in yaml.safe_load_all(first) if o["kind"] == "ConfigMap")["data"]["dflash.yaml"]
    assert parse_spec(yaml.safe_load(spec_text)) == make_spec()


def test_bad_memory_quantity_names_the_field():
    with pytest.raises(SpecError, match="cluster.memory_per_gpu"):
        render.render_extract_job(make_spec(cluster={"memory_per_gpu": "96GB"}))


def test_committed_example_still_renders_byte_identically():
    spec = load_spec(EXAMPLE / "dflash.yaml")
    objects = render.render_all(spec)
    committed = sorted(p.name for p in (EXAMPLE / "rendered").iterdir())
    assert committed == sorted(render.manifest_filename(o) for o in objects)
    for obj in objects:
        assert (EXAMPLE / "rendered" / render.manifest_filename(obj)).read_text() == render.to_yaml([obj]), render.manifest_filename(obj)


def test_cli_render_prints_yaml_or_json_and_writes_a_directory_only_with_d(tmp_path, monkeypatch, capsys):
    spec_file = str(EXAMPLE / "dflash.yaml")
    objects = render.render_selection(load_spec(spec_file), "extract")
    code, out, _ = cli(monkeypatch, capsys, "render", "extract", "-f", spec_file)
    assert code == 0 and out == render.to_yaml(objects)
    code, out, _ = cli(monkeypatch, capsys, "render", "extract", "-f", spec_file, "-o", "json")
    assert code == 0 and json.loads(out) == {"apiVersion": "v1", "kind": "List", "items": objects}  # what kubectl apply -f reads
    code, _, err = cli(monkeypatch, capsys, "render", "controller", "-f", spec_file, "-d", str(tmp_path / "out"))
    assert code == 0 and f"next: kubectl apply -f {tmp_path / 'out'}" in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "configmap-qwen36-27b-v1-spec.yaml", "job-qwen36-27b-v1-controller.yaml", "role-dflash-controller.yaml",
        "rolebinding-dflash-controller.yaml", "serviceaccount-dflash-controller.yaml",
    ]
    # -o is a format, never a directory: the old spelling is refused with the new one, nothing written.
    code, out, err = cli(monkeypatch, capsys, "render", "train", "-f", spec_file, "-o", str(tmp_path / "json"))
    assert code == 2 and out == "" and "-o takes yaml, json or name" in err and "use -d" in err
    assert not (tmp_path / "json").exists()
    code, _, err = cli(monkeypatch, capsys, "render", "train", "-f", spec_file, "-o", "json", "-d", str(tmp_path / "both"))
    assert code == 2 and "give one of them" in err and not (tmp_path / "both").exists()
    assert cli(monkeypatch, capsys, "render", "everything", "-f", spec_file)[0] == 2


def write_spec(path: Path, **sections) -> Path:
    spec = make_spec(**sections)
    path.write_text(yaml.safe_dump(spec.to_dict()))
    return path


def test_a_run_directory_holds_exactly_one_render_of_one_spec(tmp_path, monkeypatch, capsys):
    """`render controller -d` over `render all -d` leaves no step Job behind (kubectl apply -f or a
    sync would start them all at once), keeps what dflashctl did not write, and says what it removed."""
    spec_file = write_spec(tmp_path / "dflash.yaml", generate={})
    run_dir = tmp_path / "runs" / "demo-run"
    assert cli(monkeypatch, capsys, "render", "all", "-f", str(spec_file), "-d", str(run_dir))[0] == 0
    assert len(list(run_dir.glob("job-*.yaml"))) == 6
    users = {
        "kustomization.yaml": "resources: [configmap-demo-run-spec.yaml]\n",
        "notes.yaml": "# a Job of my own, not dflashctl's\n" + render.to_yaml([{
            "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "mine", "labels": {"dflash.dev/run": "demo-run"}}, "spec": {}}]),
        "README.md": "why this run\n",
        "draft.yaml": "key: [not closed\n",
    }
    for name, text in users.items():
        (run_dir / name).write_text(text)

    code, _, err = cli(monkeypatch, capsys, "render", "controller", "-f", str(spec_file), "-d", str(run_dir))
    assert code == 0, err
    expected = render.render_selection(load_spec(spec_file), "controller")
    ours = {render.manifest_filename(obj): render.to_yaml([obj]) for obj in expected}
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([*ours, *users])
    assert all((run_dir / name).read_text() == text for name, text in {**ours, **users}.items())
    for step in ("generate", "prepare", "extract", "train", "eval"):
        assert f"removed {run_dir / f'job-demo-run-{step}.yaml'}" in err
    assert f"next: kubectl apply -f {run_dir}" in err  # which now starts only the controller

    # Rendering the same spec again changes nothing, and says so (issue 37, item 10): not even an mtime.
    before = {p.name: (p.read_text(), p.stat().st_mtime_ns) for p in run_dir.iterdir()}
    code, _, err = cli(monkeypatch, capsys, "render", "controller", "-f", str(spec_file), "-d", str(run_dir))
    assert code == 0 and "wrote" not in err and f"unchanged {run_dir / 'job-demo-run-controller.yaml'}" in err
    assert {p.name: (p.read_text(), p.stat().st_mtime_ns) for p in run_dir.iterdir()} == before


def test_a_changed_spec_under_the_same_run_name_is_refused_with_the_fix_unless_forced(tmp_path, monkeypatch, capsys):
    spec_file = write_spec(tmp_path / "dflash.yaml")
    run_dir = tmp_path / "runs" / "demo-run"
    assert cli(monkeypatch, capsys, "render", "controller", "-f", str(spec_file), "-d", str(run_dir))[0] == 0
    before = {p.name: p.read_text() for p in run_dir.iterdir()}
    old_hash, new_hash = make_spec().fingerprint(), make_spec(extract={"shards": 4}).fingerprint()

    changed = write_spec(tmp_path / "changed.yaml", extract={"shards": 4})
    code, _, err = cli(monkeypatch, capsys, "render", "controller", "-f", str(changed), "-d", str(run_dir))
    assert code == 2 and f"spec hash {old_hash}, this spec {new_hash}" in err and "new `name:`" in err and "--force" in err
    assert {p.name: p.read_text() for p in run_dir.iterdir()} == before  # nothing touched

    # Another run into this run's directory: refused too (it would prune run demo-run from Git).
    other = write_spec(tmp_path / "other.yaml", name="other-run", output="s3://bucket/runs/other-run")
    code, _, err = cli(monkeypatch, capsys, "render", "controller", "-f", str(other), "-d", str(run_dir))
    assert code == 2 and "holds run demo-run" in err and "k8s/runs/other-run/" in err

    # A setting outside the spec hash that changes a Job (the metrics port): the hash agrees, the Job would not.
    ported = write_spec(tmp_path / "ported.yaml", cluster={"metrics_port": 9100})
    assert load_spec(ported).fingerprint() == old_hash
    code, _, err = cli(monkeypatch, capsys, "render", "controller", "-f", str(ported), "-d", str(run_dir))
    assert code == 2 and "job-demo-run-controller.yaml would change" in err

    code, _, err = cli(monkeypatch, capsys, "render", "controller", "-f", str(changed), "-d", str(run_dir), "--force")
    assert code == 0
    (configmap,) = [yaml.safe_load(p.read_text()) for p in run_dir.glob("configmap-*.yaml")]
    assert configmap["metadata"]["annotations"]["dflash.dev/spec-hash"] == new_hash


def test_render_n_places_the_run_in_another_namespace_under_the_same_spec_hash(tmp_path, monkeypatch, capsys):
    spec_file = write_spec(tmp_path / "dflash.yaml")
    code, out, _ = cli(monkeypatch, capsys, "render", "controller", "-f", str(spec_file), "-n", "team-b")
    assert code == 0
    objects = list(yaml.safe_load_all(out))
    assert {obj["metadata"]["namespace"] for obj in objects} == {"team-b"}
    (binding,) = [obj for obj in objects if obj["kind"] == "RoleBinding"]
    assert binding["subjects"][0]["namespace"] == "team-b"
    (configmap,) = [obj for obj in objects if obj["kind"] == "ConfigMap"]
    in_cluster = parse_spec(yaml.safe_load(configmap["data"]["dflash.yaml"]))  # what the controller pod reads
    assert in_cluster.cluster.namespace == "team-b"
    assert {obj["metadata"].get("annotations", {}).get("dflash.dev/spec-hash") for obj in objects} - {None} == {make_spec().fingerprint()}
    code, _, err = cli(monkeypatch, capsys, "render", "controller", "-f", str(spec_file), "-n", "Team_B")
    assert code == 2 and "not a namespace name" in err


def test_the_spec_hash_is_what_the_run_makes_not_where_it_runs_or_serves_metrics():
    base = make_spec()
    assert make_spec(cluster={"namespace": "team-b", "metrics_port": 9100}).fingerprint() == base.fingerprint()
    for changed in ({"extract": {"shards": 9}}, {"cluster": {"image": "registry/dflash:2"}}, {"train": {"epochs": 2}}):
        assert make_spec(**changed).fingerprint() != base.fingerprint(), changed


def test_online_states_render_no_extract_job_and_the_train_pods_mount_the_model():
    spec = make_spec(train={"states": "online"})
    assert spec.steps == ("prepare", "train", "eval")
    objects = render.render_all(spec)
    names = [o["metadata"]["name"] for o in objects if o["kind"] == "Job"]
    assert "demo-run-extract" not in names and "demo-run-train" in names and "demo-run-prepare" in names
    train = next(o for o in objects if o["metadata"]["name"] == "demo-run-train")
    pod = train["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    assert any(m["name"] == "model" for m in pod["containers"][0]["volumeMounts"])
    with pytest.raises(SpecError, match="with train.states online the train Job runs the target"):
        render.render_selection(spec, "extract")
    assert make_spec().steps == ("prepare", "extract", "verify", "train", "eval")
