"""`dflashctl check`, and the cheap checks `run` and every `submit` make first (issue 31, item 1): the real
kubernetes client against the API double (tests/k8s_fake_api.py), S3 through boto3 against moto on
loopback. Each first-run mistake of the issue is found before a Job exists, with the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import boto3
import pytest
import yaml

from dflash_jobs.formats import DATASET_KEY, MANIFEST_KEY, RUN_KEY, ChunkInfo, DatasetIndex, Manifest
from dflash_jobs.spec import dump_spec, load_spec, parse_spec
from dflash_jobs.stage_model import RECORD_FILE, describe_checkpoint
from dflash_jobs.storage import open_storage
from dflashctl.errors import EXIT_CLUSTER, EXIT_STORAGE_UNAVAILABLE, EXIT_USAGE
from dflashctl.render import render_controller_objects
from dflashctl.starter import STARTER_VALUES, starter_spec
from faults.s3_fault_proxy import INVALID_KEY, S3FaultProxy
from k8s_fake_api import PodRun, fake_k8s, make_node, make_pvc, make_secret  # noqa: F401 - the fixture
from cli_runner import cli

CONFIG = {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 64, "hidden_size": 5120}}
H200 = {"nvidia.com/gpu.product": "NVIDIA-H200"}


def write_checkpoint(directory: Path, config: dict = CONFIG, *, complete: bool = True) -> Path:
    """A checkpoint as stage-model leaves it (the weights are placeholders: only their names and sizes matter here)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 64)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}))
    (directory / RECORD_FILE).write_text(json.dumps({"source": "hf://Qwen/Qwen3.6-27B@main", "revision": "main", "commit": "c" * 40,
                                                     "files": {"config.json": {}}, "complete": complete, "staged_at": None}))
    return directory


def forget_s3_credentials(monkeypatch) -> None:
    """No S3 credentials anywhere boto3 looks: the environment, the shared files, the instance metadata."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(name, "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


class Cluster:
    """A first run's setting: the spec file, the fake API, the bucket, and the checkpoint the probe pod finds."""

    def __init__(self, tmp_path: Path, api, bucket: str) -> None:
        self.tmp_path, self.api, self.bucket = tmp_path, api, bucket
        self.spec_file = tmp_path / "dflash.yaml"
        self.checkpoint = tmp_path / "pvc" / "Qwen3.6-27B"  # what the probe pod sees on the claim
        self.s3 = boto3.client("s3")
        self.raw = {
            "name": "first", "target": {"model": "/models/Qwen3.6-27B"},
            "data": {"source": f"s3://{bucket}/data/chats.jsonl"}, "output": f"s3://{bucket}/runs/first",
            "cluster": {"model_volume": {"claim": "models"}, "node_selector": H200, "image_pull_secrets": ["registry-creds"],
                        "image": "registry.example.com/dflash:0.1.0", "controller_image": "registry.example.com/dflashctl:0.1.0"},
        }
        self.write()
        self.s3.put_object(Bucket=bucket, Key="data/chats.jsonl", Body=b'{"messages": [{"role": "user", "content": "hi"}, '
                                                                           b'{"role": "assistant", "content": "hello"}]}\n' * 3)
        for obj in (make_pvc("models", modes=("ReadOnlyMany",)), make_secret("dflash-s3", {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}),
                    make_secret("registry-creds", {".dockerconfigjson": "{}"}, type="kubernetes.io/dockerconfigjson"),
                    make_node("gpu-1", labels=H200), make_node("cpu-1", gpus=0, cpu="16", memory="64Gi")):
            api.add(obj)
        for obj in render_controller_objects(parse_spec(self.raw))[:3]:  # the RBAC of k8s/components/rbac, applied
            api.add(obj)
        write_checkpoint(self.checkpoint)
        api.kubelet = self.kubelet
        self.probes: list[dict] = []

    def write(self, **changes) -> Path:
        for key, value in changes.items():
            self.raw[key] = {**self.raw[key], **value} if isinstance(value, dict) and isinstance(self.raw.get(key), dict) else value
        self.spec_file.write_text(yaml.safe_dump(self.raw))
        return self.spec_file

    def kubelet(self, pod: dict) -> PodRun:
        """The probe pod runs its command (`--describe PATH`) on the claim, here tmp_path/pvc mounted at /models."""
        self.probes.append(pod)
        command = pod["spec"]["containers"][0]["command"]
        assert command[:4] == ["python", "-m", "dflash_jobs.stage_model", "--describe"] and command[4].startswith("/models/")
        on_claim = self.checkpoint.parent / command[4].removeprefix("/models/")
        return PodRun(0, ["starting", json.dumps(describe_checkpoint(str(on_claim)))])

    def check(self, monkeypatch, capsys, *args) -> tuple[int, dict[str, dict]]:
        code, out, err = cli(monkeypatch, capsys, "check", "-f", str(self.spec_file), "-o", "json", *args)
        report = json.loads(out)
        assert report["exit_code"] == code, err
        return code, {result["name"]: result for result in report["checks"]}


@pytest.fixture
def first(tmp_path, fake_k8s, s3_bucket):  # noqa: F811 - the fixture above
    return Cluster(tmp_path, fake_k8s.api, s3_bucket)


def test_a_healthy_first_run_passes_every_check_and_the_probe_pod_is_gone(first, monkeypatch, capsys):
    code, checks = first.check(monkeypatch, capsys)
    assert code == 0, {name: check["detail"] for name, check in checks.items() if check["status"] != "ok"}
    assert {name: check["status"] for name, check in checks.items() if check["status"] not in ("ok", "skipped")} == {}
    assert checks["target"]["detail"] == ("/models/Qwen3.6-27B: qwen3_5_text, 64 layers, hidden 5120, capturing [1, 16, 31, 46, 61]; "
                                          f"staged from hf://Qwen/Qwen3.6-27B@main at {'c' * 12} (read by pod first-probe on claim models)")
    assert checks["image"]["detail"] == "registry.example.com/dflash:0.1.0 was pulled by the probe pod"
    assert checks["data.source"]["detail"].endswith("the first 3 row(s) are chat conversations")
    assert checks["output"]["detail"] == f"s3://{first.bucket}/runs/first: no run there yet"
    assert checks["nodes for train"]["detail"].startswith("train: 8 GPU, 64 CPU, 768Gi fits gpu-1")
    assert checks["nodes for prepare"]["detail"].startswith("prepare: 4 CPU, 16Gi fits cpu-1, gpu-1")
    assert checks["s3 secret"]["detail"] == "dflash-s3 holds AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY"
    assert "permissions" in checks and checks["permissions"]["status"] == "ok"
    # The probe pod: placed as a CPU pod, the claim read-only, and deleted once read.
    (probe,) = first.probes
    assert probe["spec"]["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in probe["spec"]["volumes"]
    assert first.api.all("Pod") == []
    # Nothing is created by a check, and no Secret value leaves the cluster.
    assert first.api.all("Job") == [] and "AWS_SECRET_ACCESS_KEY\": \"s\"" not in json.dumps(checks)
    table = cli(monkeypatch, capsys, "check", "-f", str(first.spec_file))
    assert table[0] == 0 and "checks for first" in table[1] and "next: dflashctl plan" in table[2]


@pytest.mark.parametrize("mistake, name, code, detail", [
    (lambda c: setattr(c.api, "namespaces", {"default"}), "namespace", EXIT_USAGE, "namespace dflash does not exist"),
    (lambda c: c.api.deny("create", "jobs", group="batch"), "permissions", EXIT_CLUSTER, "this client may not create jobs"),
    (lambda c: c.api.deny("get", "pods", subresource="log"), "permissions", EXIT_CLUSTER, "may not get pods/log"),
    (lambda c: c.api.add(make_secret("dflash-s3", {"AWS_ACCESS_KEY_ID": "k"})), "s3 secret", EXIT_USAGE,
     "Secret dflash-s3 has no AWS_SECRET_ACCESS_KEY (or an empty one); it holds AWS_ACCESS_KEY_ID"),
    (lambda c: c.api.add(make_secret("registry-creds", {"token": "x"})), "image pull secret registry-creds", EXIT_USAGE,
     "Secret registry-creds is of type Opaque, not a registry credential"),
    (lambda c: c.api.objects.pop(("PersistentVolumeClaim", "models")), "volume models", EXIT_USAGE,
     "cluster.model_volume names claim models, which does not exist in dflash"),
    (lambda c: c.api.add(make_node("gpu-1", labels=H200, memory="512Gi")), "nodes for train", EXIT_USAGE,
     "train: 8 GPU, 64 CPU, 768Gi: no node can hold one: the largest of 1 candidate(s), gpu-1, has memory 512Gi < 768Gi"),
    (lambda c: c.api.add(make_node("gpu-1", labels=H200, gpus=4)), "nodes for train", EXIT_USAGE, "has nvidia.com/gpu 4 < 8"),
])
def test_each_cluster_mistake_fails_its_own_check_with_the_fix(first, monkeypatch, capsys, mistake, name, code, detail):
    mistake(first)
    got, checks = first.check(monkeypatch, capsys)
    assert got == code and checks[name]["status"] == "fail" and detail in checks[name]["detail"], checks[name]
    assert checks[name]["fix"]
    failed = [n for n, check in checks.items() if check["status"] == "fail"]
    assert failed == [name], failed  # the others pass, or are skipped when there is no namespace to look in


def test_placement_is_judged_from_the_rendered_pods_labels_taints_and_cordon(first, monkeypatch, capsys):
    dedicated = {"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}
    first.api.add(make_node("gpu-1", labels=H200, taints=[dedicated]))
    first.api.add(make_node("gpu-2", labels=H200, unschedulable=True))
    first.api.add(make_node("gpu-3", labels={"nvidia.com/gpu.product": "NVIDIA-A100"}))
    _, checks = first.check(monkeypatch, capsys)
    extract = checks["nodes for extract"]
    # None takes it now: a warning (an autoscaler may add one), naming why for each node.
    assert extract["status"] == "warn" and "extract: 1 GPU, 8 CPU, 96Gi: no node takes it now (" in extract["detail"]
    assert "gpu-1: taint dedicated=gpu:NoSchedule not tolerated" in extract["detail"] and "gpu-2: cordoned" in extract["detail"]
    assert "gpu-3: no label nvidia.com/gpu.product=NVIDIA-H200" in extract["detail"]
    first.write(cluster={"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}]})
    _, checks = first.check(monkeypatch, capsys)
    assert checks["nodes for extract"]["status"] == "ok" and "fits gpu-1" in checks["nodes for extract"]["detail"]
    # The CPU pods go by cluster.cpu_placement, which the GPU taint does not concern.
    assert checks["nodes for prepare"]["detail"].startswith("prepare: 4 CPU, 16Gi fits cpu-1")


def test_a_read_write_once_claim_whose_pods_may_land_on_different_nodes_is_named(first, monkeypatch, capsys):
    """Issue 37, item 6: k8s/overlays/rtx-pro-6000's models claim is ReadWriteOnce; stage-model, its first
    consumer, may land on the CPU node and bind it there, where the GPU pods cannot follow."""
    first.api.add(make_pvc("models", phase="Pending", modes=("ReadWriteOnce",)))
    code, _, err = cli(monkeypatch, capsys, "stage-model", "--from", "hf://Qwen/Qwen3.6-27B", "-f", str(first.spec_file))
    assert code == EXIT_USAGE and ("volume models: claim models is ReadWriteOnce and its first pod binds it to that pod's node, but the pods "
                                   "that mount it may land on different nodes (prepare, stage-model, probe on cpu-1, gpu-1; extract, train, eval on gpu-1)") in err
    assert "cluster.cpu_placement" in err and first.api.all("Job") == []
    code, checks = first.check(monkeypatch, capsys)
    assert code == EXIT_USAGE and checks["volume models"]["status"] == "fail" and first.probes == []  # no probe pod binds it either
    assert checks["target"]["status"] == "skipped"
    # The example's way: every pod on the GPU node.
    first.write(cluster={"cpu_placement": {"node_selector": H200, "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}})
    code, checks = first.check(monkeypatch, capsys, "--no-probe")
    assert code == 0 and checks["volume models"]["status"] == "warn" and "WaitForFirstConsumer" in checks["volume models"]["detail"]
    # Bound to the CPU node by a stage-model of before: the GPU pods cannot mount it there.
    bound = make_pvc("models", modes=("ReadWriteOnce",))
    bound["metadata"]["annotations"] = {"volume.kubernetes.io/selected-node": "cpu-1"}
    first.api.add(bound)
    first.write(cluster={"cpu_placement": {}})
    code, checks = first.check(monkeypatch, capsys, "--no-probe")
    assert code == EXIT_USAGE and checks["volume models"]["detail"] == ("claim models is ReadWriteOnce and bound to node cpu-1 (by the first pod "
                                                                        "that mounted it), where extract, train, eval may not go: those pods cannot mount it")
    assert "kubectl -n dflash delete pvc models" in checks["volume models"]["fix"]


def test_the_example_on_the_single_node_overlay_puts_every_pod_of_its_read_write_once_claims_on_the_gpu_node(tmp_path, fake_k8s, monkeypatch, capsys):  # noqa: F811
    """examples/qwen36-27b/dflash.yaml on k8s/overlays/rtx-pro-6000 (its claims as kustomize builds them),
    a tainted GPU node beside a CPU node: every pod that mounts models or dflash-kernels lands on the GPU node."""
    from test_k8s_manifests import REPO, kustomize

    for obj in kustomize(REPO / "k8s" / "overlays" / "rtx-pro-6000"):
        if obj["kind"] == "PersistentVolumeClaim":
            fake_k8s.api.add(obj)
    product = {"nvidia.com/gpu.product": "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition"}
    fake_k8s.api.add(make_node("rtx-1", labels=product, taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]))
    fake_k8s.api.add(make_node("cpu-1", gpus=0, cpu="16", memory="64Gi"))
    example = yaml.safe_load((REPO / "examples" / "qwen36-27b" / "dflash.yaml").read_text())
    spec_file = tmp_path / "dflash.yaml"
    spec_file.write_text(yaml.safe_dump(example))
    code, out, _ = cli(monkeypatch, capsys, "check", "--no-probe", "-o", "json", "-f", str(spec_file))
    volumes = {check["name"]: check for check in json.loads(out)["checks"] if check["name"].startswith("volume ")}
    assert set(volumes) == {"volume models", "volume dflash-kernels"}
    assert all(check["status"] == "warn" and "WaitForFirstConsumer" in check["detail"] for check in volumes.values()), volumes
    # Without its cpu_placement the CPU pods could not even go there (the GPU taint): named, and refused.
    del example["cluster"]["cpu_placement"]
    spec_file.write_text(yaml.safe_dump(example))
    code, out, _ = cli(monkeypatch, capsys, "check", "--no-probe", "-o", "json", "-f", str(spec_file))
    volumes = {check["name"]: check for check in json.loads(out)["checks"] if check["name"].startswith("volume ")}
    assert code == EXIT_USAGE and volumes["volume models"]["status"] == "fail"
    assert "(generate, extract, train, eval on rtx-1; prepare, stage-model, probe on cpu-1)" in volumes["volume models"]["detail"]


def test_no_permission_to_read_nodes_or_secrets_is_a_warning_not_a_failure(first, monkeypatch, capsys):
    first.api.fail_requests(100, status=403, method="GET", path="/api/v1/nodes")
    first.api.fail_requests(100, status=403, method="GET", path="/secrets/")
    code, checks = first.check(monkeypatch, capsys)
    assert code == 0
    assert checks["nodes"]["status"] == "warn" and "cannot list nodes here" in checks["nodes"]["detail"]
    assert checks["s3 secret"]["status"] == "warn" and "dflash-s3 not verified" in checks["s3 secret"]["detail"]


def test_an_unreachable_cluster_fails_once_with_exit_4_and_the_rest_skip(first, monkeypatch, capsys):
    config = first.tmp_path / "unreachable"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "gone",
        "clusters": [{"name": "gone", "cluster": {"server": "http://127.0.0.1:9"}}],
        "users": [{"name": "u", "user": {"token": "t"}}], "contexts": [{"name": "gone", "context": {"cluster": "gone", "user": "u"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(config))
    code, checks = first.check(monkeypatch, capsys)
    assert code == EXIT_CLUSTER and checks["namespace"]["status"] == "fail" and "unreachable" in checks["namespace"]["detail"]
    for name in ("permissions", "s3 secret", "volumes", "nodes"):
        assert checks[name]["status"] == "skipped", name


def test_without_a_kubeconfig_the_cluster_fails_once_and_storage_is_still_checked(first, monkeypatch, capsys):
    monkeypatch.setenv("KUBECONFIG", str(first.tmp_path / "none"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "")
    code, checks = first.check(monkeypatch, capsys)
    assert code == EXIT_CLUSTER and checks["namespace"]["detail"].startswith("no Kubernetes configuration")
    assert checks["volumes"]["status"] == checks["target"]["status"] == "skipped"
    assert checks["data.source"]["status"] == checks["output"]["status"] == "ok"


# ---- storage: why an input cannot be read, told apart --------------------------------------------


def test_data_source_unreadable_for_each_reason_a_distinct_message(first, monkeypatch, capsys, s3_server):
    def source_check() -> tuple[int, dict]:
        code, checks = first.check(monkeypatch, capsys, "--no-probe")
        return code, checks["data.source"]

    first.write(data={"source": f"s3://{first.bucket}/data/absent.jsonl"})
    code, missing = source_check()
    assert code == EXIT_USAGE and missing["detail"] == f"cannot read it: s3://{first.bucket}/data/absent.jsonl does not exist"
    first.write(data={"source": "s3://no-such-bucket-dflash/data/chats.jsonl"})
    code, bucket = source_check()
    assert code == EXIT_USAGE and "the S3 bucket of s3://no-such-bucket-dflash/data" in bucket["detail"] and "does not exist" in bucket["detail"]
    first.write(data={"source": f"s3://{first.bucket}/data/chats.jsonl"})
    with S3FaultProxy(s3_server, seed=0) as proxy:
        proxy.outage(INVALID_KEY)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        code, denied = source_check()
    assert code == EXIT_USAGE and "S3 refused access" in denied["detail"] and "AWS_SECRET_ACCESS_KEY" in denied["fix"]
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    code, unreachable = source_check()
    assert code == EXIT_STORAGE_UNAVAILABLE and "cannot reach the S3 endpoint" in unreachable["detail"]
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    forget_s3_credentials(monkeypatch)
    code, anonymous = source_check()
    assert code == EXIT_USAGE and anonymous["detail"].startswith("cannot read it: no S3 credentials")
    assert len({missing["detail"], bucket["detail"], denied["detail"], unreachable["detail"], anonymous["detail"]}) == 5


def test_the_first_rows_of_data_source_must_parse(first, monkeypatch, capsys):
    first.s3.put_object(Bucket=first.bucket, Key="data/chats.jsonl", Body=b'{"messages": []}\n{"text": "a plain corpus"}\n')
    code, checks = first.check(monkeypatch, capsys, "--no-probe")
    assert code == EXIT_USAGE
    assert checks["data.source"]["detail"].endswith("line 2 is neither a chat row (messages with roles) nor a pre-tokenized one "
                                                    "(input_ids, loss_mask): it has ['text']")


def test_a_local_source_the_pods_cannot_see_is_refused_with_both_ways_out(first, monkeypatch, capsys):
    source = first.tmp_path / "chats.jsonl"
    source.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    first.write(data={"source": str(source)})
    code, checks = first.check(monkeypatch, capsys, "--no-probe")
    assert code == EXIT_USAGE and "which the pods that read it cannot see" in checks["data.source"]["detail"]
    assert "`dflashctl prepare`" in checks["data.source"]["fix"]
    # Prepared here already: no pod reads it, and nothing is checked.
    prepared = DatasetIndex(samples=1, tokens=10, vocab_size=10, chunks=[ChunkInfo(0, "tokens/chunks/000000.safetensors", 1, 10)])
    open_storage(first.raw["output"]).put_bytes(DATASET_KEY, prepared.to_json().encode())
    code, checks = first.check(monkeypatch, capsys, "--no-probe")
    assert code == 0 and checks["data.source"]["status"] == "skipped"


def test_the_unedited_starter_is_refused_for_its_placeholders(first, monkeypatch, capsys):
    first.spec_file.write_text(starter_spec(STARTER_VALUES))
    code, checks = first.check(monkeypatch, capsys, "--no-probe")
    assert code == EXIT_USAGE and checks["placeholders"]["status"] == "fail"
    assert "output s3://my-bucket/dflash/qwen36-27b-v1" in checks["placeholders"]["detail"]
    assert "the project's default image names, which nothing publishes: cluster.image ghcr.io/dflash-k8s/dflash:0.1.0-cuda13.0, " \
           "cluster.controller_image ghcr.io/dflash-k8s/dflashctl:0.1.0" in checks["placeholders"]["detail"]
    # The default images alone: not ok, a warning (issue 37, item 9).
    first.write(cluster={"image": "ghcr.io/dflash-k8s/dflash:0.1.0-cuda13.0", "controller_image": "ghcr.io/dflash-k8s/dflashctl:0.1.0"})
    code, checks = first.check(monkeypatch, capsys, "--no-probe")
    assert code == 0 and checks["placeholders"]["status"] == "warn" and "cluster.controller_image" in checks["placeholders"]["detail"]
    assert "images/README.md" in checks["placeholders"]["fix"]


def test_check_json_gives_an_exit_code_to_failures_only_and_a_missing_service_account_is_not_ok(first, monkeypatch, capsys):
    """Issue 37, item 9."""
    for kind in ("ServiceAccount", "Role", "RoleBinding"):
        first.api.objects.pop((kind, "dflash-controller"))
    first.write(data={"source": f"s3://{first.bucket}/data/absent.jsonl"})
    code, checks = first.check(monkeypatch, capsys, "--no-probe")
    assert code == EXIT_USAGE and checks["data.source"]["exit_code"] == EXIT_USAGE
    assert [name for name, check in checks.items() if "exit_code" in check] == ["data.source"]
    account = checks["service account"]
    assert account["status"] == "warn" and account["detail"] == "dflash-controller: ServiceAccount, Role, RoleBinding missing"
    assert "`dflashctl submit controller` creates them" in account["fix"]


# ---- the target, through the probe pod -----------------------------------------------------------


@pytest.mark.parametrize("change, status, detail", [
    ({"target": {"layers": [1, 16, 31, 46, 70]}}, "fail", "layer indices 0..63: the checkpoint has 64 decoder layers"),
    ({"target": {"model": "/models/Other"}}, "fail", "/models/Other does not exist (read by pod first-probe on claim models)"),
])
def test_target_mistakes_on_the_volume_are_found_through_the_probe_pod(first, monkeypatch, capsys, change, status, detail):
    first.write(**change)
    code, checks = first.check(monkeypatch, capsys)
    assert code == EXIT_USAGE and checks["target"]["status"] == status and detail in checks["target"]["detail"], checks["target"]
    assert first.api.all("Pod") == []


@pytest.mark.parametrize("config, complete, status, detail", [
    ({**CONFIG, "text_config": {**CONFIG["text_config"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}}, True, "fail", "scales its RoPE ('yarn')"),
    ({"model_type": "llama", "num_hidden_layers": 64, "hidden_size": 4096}, True, "ok", "llama, 64 layers, hidden 4096"),
    ({"model_type": "mistral", "num_hidden_layers": 64, "hidden_size": 4096}, True, "warn",
     "mistral is not an architecture the suite proves (qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text, llama): it runs as the nearest, llama"),
    (CONFIG, False, "fail", "is staged only in part"),
])
def test_the_checkpoint_config_is_judged(first, monkeypatch, capsys, config, complete, status, detail):
    shutil.rmtree(first.checkpoint)
    write_checkpoint(first.checkpoint, config, complete=complete)
    _, checks = first.check(monkeypatch, capsys)
    assert checks["target"]["status"] == status and detail in checks["target"]["detail"], checks["target"]


def test_a_checkpoint_without_a_chat_template_fails_for_chat_rows_only(first, monkeypatch, capsys):
    """data.source holds chat conversations, which prepare renders with the target's chat template:
    a tokenizer without one fails here, read through the probe pod, not after generation on the GPUs."""
    (first.checkpoint / "tokenizer_config.json").write_text("{}")
    code, checks = first.check(monkeypatch, capsys)
    assert code == EXIT_USAGE and checks["target"]["status"] == "fail", checks["target"]
    assert "its tokenizer has no chat template (none in tokenizer_config.json, chat_template.jinja or chat_template.json)" in checks["target"]["detail"]
    assert "chat_template.jinja" in checks["target"]["fix"] and "pre-tokenized rows" in checks["target"]["fix"]
    (first.checkpoint / "chat_template.jinja").write_text("{{ messages }}")  # Transformers 5 saves it apart
    assert first.check(monkeypatch, capsys)[1]["target"]["status"] == "ok"


def test_an_image_that_cannot_be_pulled_fails_target_and_image(first, monkeypatch, capsys):
    first.api.kubelet = lambda pod: PodRun(waiting="ErrImagePull", message='failed to pull "registry.example.com/dflash:0.1.0": 401 Unauthorized')
    code, checks = first.check(monkeypatch, capsys)
    assert code == EXIT_USAGE
    assert "the probe pod cannot pull registry.example.com/dflash:0.1.0: ErrImagePull" in checks["target"]["detail"]
    assert checks["image"]["status"] == "fail" and "cluster.image_pull_secrets" in checks["image"]["fix"]
    assert first.api.all("Pod") == []


@pytest.mark.parametrize("logs", [
    ["usage: python -m dflash_jobs.stage_model [-h] [-f FILE] [--from SOURCE]"],  # an image older than --describe
    [],  # a log cut or rotated away
    ['{"level": "info", "msg": "mounted /models"}', '{"path": "/models/Qwen3.6-27B", "exists": tru'],  # JSON of another kind, a line cut short
])
def test_a_probe_pod_that_prints_no_description_fails_target_with_what_it_printed(first, monkeypatch, capsys, logs):
    """Issue 43, item 1: the probe pod succeeds and its log holds no description of the checkpoint.
    `check` and `submit` crashed ("generator raised StopIteration"); the target check now fails with
    the pod's last lines, the image it ran and the fix, and submit refuses as for any failed check."""
    first.api.kubelet = lambda pod: PodRun(0, logs)
    code, checks = first.check(monkeypatch, capsys)
    target = checks["target"]
    assert code == EXIT_USAGE and target["status"] == "fail" and target["exit_code"] == EXIT_USAGE, target
    assert "the probe pod first-probe ran registry.example.com/dflash:0.1.0 and printed no description of /models/Qwen3.6-27B" in target["detail"]
    assert (f"its last lines: {' | '.join(logs)}" if logs else "it printed nothing") in target["detail"], target["detail"]
    assert "rebuild and push cluster.image" in target["fix"]
    code, _, err = cli(monkeypatch, capsys, "submit", "prepare", "-f", str(first.spec_file))
    assert code == EXIT_USAGE and "nothing was started" in err and "printed no description" in err and "StopIteration" not in err, err
    assert first.api.all("Pod") == [] and first.api.all("Job") == []


def test_a_probe_pod_that_fails_fails_target_with_exit_2_as_any_failed_check(first, monkeypatch, capsys):
    first.api.kubelet = lambda pod: PodRun(1, ["Traceback (most recent call last):", "ModuleNotFoundError: No module named 'dflash_jobs'"])
    code, checks = first.check(monkeypatch, capsys)
    assert code == EXIT_USAGE and checks["target"]["exit_code"] == EXIT_USAGE, checks["target"]
    assert ("the probe pod first-probe failed (exit 1 (Error)) running registry.example.com/dflash:0.1.0; its last lines: "
            "Traceback (most recent call last): | ModuleNotFoundError: No module named 'dflash_jobs'") in checks["target"]["detail"]
    assert first.api.all("Pod") == []


# ---- run and every submit: the cheap checks first, the output claimed --------------------------


def test_nothing_is_submitted_for_a_missing_source_or_a_step_out_of_order(first, monkeypatch, capsys):
    first.write(data={"source": f"s3://{first.bucket}/data/absent.jsonl"}, generate={"shards": 8})
    for step in ("generate", "controller"):
        code, _, err = cli(monkeypatch, capsys, "submit", step, "-f", str(first.spec_file))
        assert code == EXIT_USAGE and "data.source: cannot read it" in err and "nothing was started" in err, (step, err)
    code, _, err = cli(monkeypatch, capsys, "run", "-f", str(first.spec_file))
    assert code == EXIT_USAGE and "data.source: cannot read it" in err
    code, _, err = cli(monkeypatch, capsys, "submit", "prepare", "-f", str(first.spec_file))
    assert code == EXIT_USAGE and "generate/manifest.json of these settings does not exist" in err
    code, _, err = cli(monkeypatch, capsys, "submit", "extract", "-f", str(first.spec_file))
    assert code == EXIT_USAGE and f"s3://{first.bucket}/runs/first/{DATASET_KEY} does not exist, and extract reads it" in err
    assert first.api.all("Job") == [] and first.api.all("ConfigMap") == []
    assert not open_storage(first.raw["output"]).exists(RUN_KEY)  # nothing claimed either


def test_nothing_check_refuses_starts_a_run_the_target_on_the_volume_read_through_the_probe_pod(first, monkeypatch, capsys):
    """Layer 70 of a 64-layer checkpoint on the model volume (issue 37, item 2): `run` and `submit` read
    it through the probe pod as `check` does, and start nothing, not even run.yaml; once the run has
    Jobs, re-attaching reads it no more."""
    first.write(target={"layers": [1, 16, 31, 46, 70]})
    for command in (["run", "--timeout", "5"], ["submit", "prepare"], ["submit", "controller"]):
        code, _, err = cli(monkeypatch, capsys, *command, "-f", str(first.spec_file))
        assert code == EXIT_USAGE and "nothing was started" in err and "layer indices 0..63: the checkpoint has 64 decoder layers" in err, (command, err)
    assert len(first.probes) == 3 and first.api.all("Pod") == []
    assert first.api.all("Job") == [] and first.api.all("ConfigMap") == [] and not open_storage(first.raw["output"]).exists(RUN_KEY)
    first.write(target={"layers": [1, 16, 31, 46, 61]})
    assert cli(monkeypatch, capsys, "submit", "prepare", "-f", str(first.spec_file))[0] == 0
    assert len(first.probes) == 4
    code, _, err = cli(monkeypatch, capsys, "submit", "prepare", "-f", str(first.spec_file))
    assert code == 0 and len(first.probes) == 4, err  # attached: its Job exists, the target was read when it started
    # Who may not create pods is told the target went unread, and is not stopped by it.
    assert cli(monkeypatch, capsys, "cancel", "-f", str(first.spec_file))[0] == 0
    first.api.deny("create", "pods")
    code, _, err = cli(monkeypatch, capsys, "submit", "prepare", "-f", str(first.spec_file))
    assert code == 0 and "check warn    target: /models/Qwen3.6-27B lies on claim models, read through a pod, and this client may not create pods" in err
    assert len(first.probes) == 4


def test_plan_holds_the_layers_against_the_target_it_assumes_and_speaks_of_the_volume_as_one(first, monkeypatch, capsys):
    first.write(target={"layers": [1, 16, 31, 46, 70]})
    code, out, err = cli(monkeypatch, capsys, "plan", "-f", str(first.spec_file), "-o", "json")
    plan = json.loads(out)
    assert code == 0 and plan["target"]["basis"] == ("assumed Qwen3.6-27B: /models/Qwen3.6-27B lies on claim models, not mounted here "
                                                     "(`dflashctl check` reads it through a pod)")
    assert any(warning.startswith("target.layers [1, 16, 31, 46, 70]: 70 past the last layer of the assumed Qwen3.6-27B (64 decoder layers, 0..63)")
               for warning in plan["warnings"]), plan["warnings"]
    first.write(target={"layers": [1, 16, 31, 46, 61]})
    assert not any("target.layers" in warning for warning in json.loads(cli(monkeypatch, capsys, "plan", "-f", str(first.spec_file), "-o", "json")[1])["warnings"])


def test_submit_train_refuses_a_drafter_that_reads_the_final_hidden_state_on_states_without_it(first, monkeypatch, capsys):
    output = open_storage(first.raw["output"])
    stored = Manifest(model="m", layers=[1, 16, 31, 46, 61], dtype="bfloat16", hidden_size=5120, samples=1, tokens=1, bytes=1, chunks=[])
    output.put_bytes(MANIFEST_KEY, stored.to_json().encode())
    first.write(train={"drafter": "dspark"})
    code, _, err = cli(monkeypatch, capsys, "submit", "train", "-f", str(first.spec_file))
    assert code == EXIT_USAGE and "hold no final hidden state of the target" in err and "train.dspark.ce_only: true" in err
    assert first.api.all("Job") == []
    first.write(train={"drafter": "dspark", "dspark": {"ce_only": True}})  # asked for: trained on cross-entropy only
    assert cli(monkeypatch, capsys, "submit", "train", "-f", str(first.spec_file))[0] == 0
    assert [job["metadata"]["name"] for job in first.api.all("Job")] == ["first-train"]


def test_another_run_in_the_output_is_refused_by_every_command_that_starts_work(first, monkeypatch, capsys):
    other = parse_spec({**first.raw, "name": "someone-else"})
    open_storage(first.raw["output"]).put_bytes(RUN_KEY, dump_spec(other).encode())
    for command in (["submit", "controller"], ["submit", "generate"], ["submit", "prepare"], ["run"], ["eval"], ["verify"], ["prepare"]):
        code, _, err = cli(monkeypatch, capsys, *command, "-f", str(first.spec_file))
        assert code == EXIT_USAGE and "already holds run 'someone-else' with another spec (differs in: name)" in err, (command, err)
    assert first.api.all("Job") == []
    code, checks = first.check(monkeypatch, capsys, "--no-probe")
    assert code == EXIT_USAGE and "already holds run 'someone-else'" in checks["output"]["detail"]
    # --force takes the output over: said, then claimed for this spec.
    code, _, err = cli(monkeypatch, capsys, "submit", "prepare", "--force", "-f", str(first.spec_file))
    assert code == 0 and "--force replaces its run.yaml" in err
    assert open_storage(first.raw["output"]).get_bytes(RUN_KEY).decode() == dump_spec(load_spec(first.spec_file))


def test_force_never_hands_an_output_to_another_run_while_that_run_has_jobs(first, monkeypatch, capsys):
    """Ownership as helm has it (issue 37, item 1): --force re-specs the same run, and takes an output
    from another run only once that run has no Jobs left; the refusal names the owner and the way out."""
    assert cli(monkeypatch, capsys, "submit", "prepare", "-f", str(first.spec_file))[0] == 0
    owned = open_storage(first.raw["output"]).get_bytes(RUN_KEY)
    other = first.tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({**first.raw, "name": "other-run", "generate": {"shards": 2}}))
    for command in (["submit", "generate"], ["submit", "prepare"], ["submit", "controller"], ["run"]):
        code, _, err = cli(monkeypatch, capsys, *command, "--force", "-f", str(other))
        assert code == EXIT_USAGE, (command, err)
        assert "already holds run 'first' with another spec" in err and "run 'first' owns it: its Jobs first-prepare exist in namespace dflash" in err
        assert "`dflashctl delete first -n dflash`" in err and "--force" not in err, err  # no way around it offered
    code, checks = first.check(monkeypatch, capsys, "--no-probe", "-f", str(other))
    assert code == EXIT_USAGE and "owns it" in checks["output"]["detail"]
    assert [job["metadata"]["name"] for job in first.api.all("Job")] == ["first-prepare"]
    assert open_storage(first.raw["output"]).get_bytes(RUN_KEY) == owned
    # The same run re-specced: --force is what it is for.
    first.write(extract={"shards": 4})
    code, _, err = cli(monkeypatch, capsys, "submit", "prepare", "-f", str(first.spec_file))
    assert code == EXIT_USAGE and "or pass --force to re-spec run first" in err
    assert cli(monkeypatch, capsys, "submit", "prepare", "--force", "-f", str(first.spec_file))[0] == 0
    # Once run first has no Jobs, the output is free to take over, with --force only.
    assert cli(monkeypatch, capsys, "delete", "first")[0] == 0
    code, _, err = cli(monkeypatch, capsys, "submit", "generate", "-f", str(other))
    assert code == EXIT_USAGE and "pass --force to take the output over (run first has no Jobs left)" in err
    code, _, err = cli(monkeypatch, capsys, "submit", "generate", "--force", "-f", str(other))
    assert code == 0, err
    assert yaml.safe_load(open_storage(first.raw["output"]).get_bytes(RUN_KEY))["name"] == "other-run"


def test_a_submit_claims_the_output_so_that_a_second_run_there_is_refused(first, monkeypatch, capsys):
    assert cli(monkeypatch, capsys, "submit", "prepare", "-f", str(first.spec_file))[0] == 0
    assert open_storage(first.raw["output"]).get_bytes(RUN_KEY).decode() == dump_spec(load_spec(first.spec_file))
    first.write(name="second")
    code, _, err = cli(monkeypatch, capsys, "submit", "prepare", "-f", str(first.spec_file))
    assert code == EXIT_USAGE and "already holds run 'first'" in err
    assert [job["metadata"]["name"] for job in first.api.all("Job")] == ["first-prepare"]


def test_a_failed_in_cluster_controller_says_why_in_status(first, monkeypatch, capsys):
    assert cli(monkeypatch, capsys, "submit", "controller", "-f", str(first.spec_file))[0] == 0
    first.api.start("first-controller")
    last_words = ("check fail    output: s3://b/runs/first already holds run 'someone-else' with another spec (differs in: name)\n"
                  "Error: 1 preflight check(s) failed, nothing was started: output: s3://b/runs/first already holds run 'someone-else'")
    first.api.finish("first-controller", 0, exit_code=EXIT_USAGE, message=last_words)
    code, out, _ = cli(monkeypatch, capsys, "status", "-f", str(first.spec_file), "-o", "json")
    report = json.loads(out)
    assert code == 0 and report["jobs"]["controller"]["state"] == "Failed"
    assert report["next"] == ("the in-cluster controller failed: Error: 1 preflight check(s) failed, nothing was started: "
                              "output: s3://b/runs/first already holds run 'someone-else'; fix that, then `dflashctl retry controller`")


def test_check_refuses_an_online_target_that_does_not_fit_beside_the_drafter():
    """Before a GPU is spent: a 27B checkpoint's bf16 weights beside its drafter pass a 96 GB card; with
    FP8 compute and mlp checkpointing they fit, and the check says so."""
    from dflashctl.check.inputs import judge_target

    config = {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64,
                                                       "vocab_size": 248320}}
    description = {"exists": True, "staged": None, "config": config, "safetensors": {"files": 12, "bytes": 54_000_000_000},
                   "tokenizer": True, "chat_template": True}
    raw = {"name": "fit", "backend": "local", "target": {"model": "/models/q"}, "data": {"source": "/d.jsonl"}, "output": "/o"}
    bf16 = judge_target(parse_spec({**raw, "train": {"states": "online"}}), description)
    assert bf16.status == "fail" and "train.states online: online, the target (bfloat16) beside the drafter takes" in bf16.detail
    assert "with extract.compute_dtype: float8 and train.activation_checkpointing: mlp it takes" in bf16.detail
    assert "train.states: stored" in bf16.fix
    fp8 = judge_target(parse_spec({**raw, "train": {"states": "online", "activation_checkpointing": "mlp"}, "extract": {"compute_dtype": "float8"}}), description)
    assert fp8.status == "ok", fp8.detail
    assert judge_target(parse_spec(raw), description).status == "ok"  # stored states: the target never sits beside the drafter
