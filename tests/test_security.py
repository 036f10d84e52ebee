"""Security properties, checked on everything the system renders, logs and writes:

- no secret value in any rendered manifest, `dflashctl` output, pod log, state file or stored report;
- commands in exec form: no shell, no spec value spliced into a command line;
- run names and storage keys validated: nothing escapes the output prefix;
- every container (init containers too) non-root, no privilege escalation, read-only root
  filesystem, writable paths on emptyDirs only, all capabilities dropped;
- the controller's Role is least privilege: namespaced, no wildcards, no Secrets, pods read-only,
  and nothing in it that `dflashctl run` does not need (tests/test_kube_backend.py checks the other
  direction: every call the backend makes is allowed).
"""

from __future__ import annotations


import pytest
import yaml
from extract_helpers import LAYERS, random_chunks, tiny_target, write_prepared

from dflash_jobs.errors import SpecError, StorageError
from dflash_jobs.spec import parse_spec
from dflash_jobs.storage import check_key, open_storage
from dflashctl.local.backend import LocalBackend
from dflashctl.render import controller_role_rules, render_all, render_selection, to_yaml

from test_bad_input import cli

SECRET_ID = "AKIAFAKESECRETID7Q2X"
SECRET_KEY = "fake/Secret+Value=9f8e7d6c5b4a3f2e1d0c"
SHELL_BAIT = "/models/x$(touch /tmp/pwned);`id`|rm -rf ~"


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", SECRET_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)


def full_spec(**overrides):
    raw = {
        "name": "secure-run",
        "target": {"model": SHELL_BAIT},
        "data": {"source": "s3://bucket/chats.jsonl", "max_length": 256, "chunk_tokens": 1024},
        "output": "s3://bucket/dflash/secure-run",
        "train": {"nodes": 2, "gpus_per_node": 4},  # the Indexed training Job and its Service too
        "generate": {},  # the generation Job in the vLLM image, with its staging init container
        "cluster": {"s3_secret": "dflash-s3", "queue": "gpu", "model_volume": {"claim": "models"}},
        **overrides,
    }
    return parse_spec(raw)


def pods(objects):
    return [obj["spec"]["template"]["spec"] for obj in objects if obj["kind"] == "Job"]


def containers(pod):
    return [*pod.get("initContainers", []), *pod["containers"]]


def assert_no_secret(text: str, where: str) -> None:
    assert SECRET_KEY not in text and SECRET_ID not in text, f"a secret value reached {where}"


# ---- secrets -----------------------------------------------------------------------------------


def test_no_secret_value_in_any_rendered_manifest_or_cli_output(secret_env, tmp_path, monkeypatch, capsys):
    spec = full_spec()
    objects = render_all(spec)
    assert_no_secret(to_yaml(objects), "the rendered YAML")
    for pod in pods(objects):
        for container in containers(pod):
            # Credentials only by reference: no literal AWS_* values in the manifest.
            assert not [e for e in container.get("env", []) if e["name"].startswith("AWS_") and "value" in e]
            # Every container that talks to S3 gets the Secret by reference; the one that copies files gets none.
            expected = None if container["name"] == "stage" else [{"secretRef": {"name": "dflash-s3", "optional": True}}]
            assert container.get("envFrom") == expected

    spec_file = tmp_path / "dflash.yaml"
    spec_file.write_text(yaml.safe_dump(spec.to_dict()))
    code, out, err = cli(monkeypatch, capsys, "render", "all", "-f", str(spec_file), "-d", str(tmp_path / "rendered"))
    assert code == 0
    assert_no_secret(out + err, "dflashctl render output")
    for path in (tmp_path / "rendered").rglob("*"):
        if path.is_file():
            assert_no_secret(path.read_text(), str(path))
    # A command that fails on storage prints its error, never the credentials it used.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    from dflash_jobs import storage

    monkeypatch.setattr(storage.open_storage, "__kwdefaults__", {**storage.open_storage.__kwdefaults__, "max_attempts": 1})
    code, out, err = cli(monkeypatch, capsys, "verify", "-f", str(spec_file))
    assert code == 5 and "cannot reach the S3 endpoint" in err  # storage unavailable: transient
    assert_no_secret(out + err, "dflashctl verify's error")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory)


def test_no_secret_value_in_pod_logs_state_or_reports_of_a_local_run(secret_env, target, tmp_path, monkeypatch):
    """The rendered extract Job, really run (selfcheck init container, then the worker) by the local
    backend with the Secret in its environment: every file it leaves is scanned."""
    monkeypatch.chdir(tmp_path)
    output = tmp_path / "out"
    write_prepared(open_storage(str(output)), random_chunks(0, 1))
    spec = parse_spec({
        "name": "secure-local", "backend": "local", "target": {"model": str(target), "layers": LAYERS},
        "data": {"source": str(tmp_path / "chats.jsonl"), "max_length": 48, "chunk_tokens": 512},
        "output": str(output), "extract": {"shards": 1, "token_budget": 96, "pad_multiple": 16},
        "local": {"workdir": str(tmp_path / "work")},
    })
    backend = LocalBackend(spec)
    backend.submit(render_selection(spec, "extract"))
    status = backend.wait("secure-local-extract", timeout=300)
    logs = "\n".join(backend.logs("secure-local-extract", 0))
    assert status.complete, logs
    assert "shard 0/1 done" in logs  # the worker really ran, and its log is part of the scan
    scanned = 0
    for root in (tmp_path / "work", output):
        for path in root.rglob("*"):
            if path.is_file():
                assert_no_secret(path.read_bytes().decode("latin-1"), str(path))
                scanned += 1
    assert scanned >= 5


# ---- commands, names and keys --------------------------------------------------------------------


SHELLS = {"sh", "bash", "/bin/sh", "/bin/bash", "dash", "zsh"}


def test_every_command_is_exec_form_without_a_shell_or_spec_values():
    spec = full_spec()
    values = {spec.target.model, spec.data.source, spec.output}
    for pod in pods(render_all(spec)):
        for container in containers(pod):
            command = [*container["command"], *container.get("args", [])]
            assert isinstance(container["command"], list) and all(isinstance(part, str) for part in command)
            assert command[0] not in SHELLS and "-c" not in command, command
            # Spec values travel in the mounted spec file, never on the command line.
            assert not values & set(command) and not any("$(" in part or "`" in part for part in command), command


@pytest.mark.parametrize("name", ["../evil", "a/b", "Evil", "x" * 41, "a_b", "-a", ""])
def test_run_names_that_are_not_dns_labels_are_refused(name):
    with pytest.raises(SpecError, match="name"):
        full_spec(name=name)


@pytest.mark.parametrize("key", ["../outside", "a/../../outside", "/etc/passwd", "a//b", "./a", "a\\..\\b", "a\x00b", "a/.."])
def test_storage_keys_that_could_leave_the_output_prefix_are_refused(key, tmp_path, s3_bucket):
    with pytest.raises(StorageError):
        check_key(key)
    local = open_storage(str(tmp_path / "out"))
    s3 = open_storage(f"s3://{s3_bucket}/out")
    for storage in (local, s3):
        for call in (lambda: storage.put_bytes(key, b"x"), lambda: storage.get_bytes(key), lambda: storage.delete(key)):
            with pytest.raises(StorageError):
                call()
    assert not (tmp_path / "outside").exists() and not list(tmp_path.rglob("passwd"))
    assert s3.list("") == [] and open_storage(f"s3://{s3_bucket}").list("") == []


# ---- containers ---------------------------------------------------------------------------------


def test_every_container_is_non_root_read_only_and_without_capabilities():
    objects = render_all(full_spec())
    assert len(pods(objects)) == 6  # generate, prepare, extract, train, eval, controller
    for pod in pods(objects):
        pod_security = pod["securityContext"]
        assert pod_security["runAsNonRoot"] is True and pod_security.get("runAsUser", 1) != 0
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        assert all("hostPath" not in volume for volume in volumes.values())
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        for container in containers(pod):
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, container["name"]
            assert security["readOnlyRootFilesystem"] is True, container["name"]
            assert security["capabilities"] == {"drop": ["ALL"]}, container["name"]
            assert not security.get("privileged") and security.get("runAsUser", 1) != 0
            for mount in container["volumeMounts"]:
                # Writable only where an emptyDir is mounted; the spec and the model are read-only.
                assert mount.get("readOnly") or "emptyDir" in volumes[mount["name"]], (container["name"], mount)


# ---- RBAC ---------------------------------------------------------------------------------------


ALLOWED = {
    ("batch", "jobs"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "pods"): {"get", "list", "watch"},
    ("", "pods/log"): {"get"},
    ("", "configmaps"): {"get", "create", "delete"},
    ("", "services"): {"get", "create", "delete"},
    ("", "events"): {"create", "patch"},
}
"""What `dflashctl run` needs, and why: Jobs (submit, wait, progress annotation, cancel/retry/--force);
pods and their logs, read-only (shard table, `dflashctl logs`); the spec ConfigMap and the training
rendezvous Service (create, attach, remove with the run); Events (milestones, failures)."""


def test_the_controller_role_is_least_privilege():
    objects = render_all(full_spec())
    kinds = {obj["kind"] for obj in objects}
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
    (role,) = [obj for obj in objects if obj["kind"] == "Role"]
    (binding,) = [obj for obj in objects if obj["kind"] == "RoleBinding"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "dflash"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "dflash-controller", "namespace": "dflash"}]
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    assert granted == ALLOWED
    assert not any(resource in ("secrets", "pods/exec", "pods/attach", "roles", "rolebindings") for _, resource in granted)
    assert not any(verbs & {"escalate", "bind", "impersonate", "deletecollection", "update"} for verbs in granted.values())
    assert role["rules"] == controller_role_rules()
    # Worker pods get no API token at all; only the controller pod runs under the ServiceAccount.
    for pod in pods(objects):
        if pod.get("serviceAccountName") != "dflash-controller":
            assert pod["automountServiceAccountToken"] is False
