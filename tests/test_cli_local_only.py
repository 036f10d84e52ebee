"""A machine without the Kubernetes client (a GPU box that only runs the local backend) runs every
local command: the client is imported where the kubernetes backend is used, and a kubernetes spec
there says what is missing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml
from kubernetes.utils import parse_quantity

from dflashctl.pod_fit import quantity


def dflashctl_without_kubernetes(tmp_path, *args):
    """`dflashctl ARGS` in a process where `import kubernetes` fails, as on a machine without it."""
    shadow = tmp_path / "no-kubernetes"
    (shadow / "kubernetes").mkdir(parents=True, exist_ok=True)
    (shadow / "kubernetes" / "__init__.py").write_text("raise ImportError('No module named kubernetes (shadowed by the test)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(shadow), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "dflashctl.cli.main", *args], capture_output=True, text=True, env=env, cwd=tmp_path)


def write_spec(tmp_path, backend):
    spec_file = tmp_path / f"{backend}.yaml"
    spec = {
        "name": "local-run", "backend": backend, "target": {"model": str(tmp_path / "model")},
        "data": {"source": str(tmp_path / "chats.jsonl")},
        "output": str(tmp_path / "out") if backend == "local" else "s3://bucket/runs/local-run",
        "local": {"workdir": str(tmp_path / "work")},
    }
    if backend == "kubernetes":  # a pod's model lies on a volume it mounts, or the spec is refused first
        spec["target"]["model"] = "/models/tiny"
        spec["cluster"] = {"model_volume": {"claim": "models", "mount": "/models"}}
    spec_file.write_text(yaml.safe_dump(spec))
    return spec_file


def test_local_commands_run_without_the_kubernetes_client(tmp_path):
    spec_file = write_spec(tmp_path, "local")
    status = dflashctl_without_kubernetes(tmp_path, "status", "-f", str(spec_file))
    assert status.returncode == 0, status.stderr
    assert "run local-run (local), step: prepare" in status.stdout
    verify = dflashctl_without_kubernetes(tmp_path, "verify", "-f", str(spec_file))
    assert "kubernetes" not in verify.stderr, verify.stderr
    assert verify.returncode == 2 and "tokens/dataset.json" in verify.stderr  # verify's own answer: nothing prepared yet
    render = dflashctl_without_kubernetes(tmp_path, "render", "extract", "-f", str(spec_file))
    assert render.returncode == 0 and "kind: Job" in render.stdout
    plan = dflashctl_without_kubernetes(tmp_path, "plan", "-f", str(spec_file))  # bills each pod's resources
    assert plan.returncode == 0 and "kubernetes" not in plan.stderr, plan.stderr


@pytest.mark.parametrize("value", ["8", "250m", "16Gi", "1.5Gi", "96Gi", "2Ti", "500M", "1e3", "2E", "100u", "0.5", 4, "12k", "3Pi"])
def test_quantities_are_read_as_the_clients_parser_reads_them(value):
    assert quantity(value) == parse_quantity(value)


def test_what_is_not_a_quantity_is_refused_naming_it():
    with pytest.raises(ValueError, match="'12 cores' is not a Kubernetes quantity"):
        quantity("12 cores")


def test_a_kubernetes_spec_without_the_client_names_the_package_to_install(tmp_path):
    result = dflashctl_without_kubernetes(tmp_path, "status", "-f", str(write_spec(tmp_path, "kubernetes")))
    assert result.returncode == 2, result.stderr
    assert "the kubernetes backend needs the `kubernetes` package" in result.stderr and "pip install" in result.stderr


def test_shell_completion_scripts_and_the_completions_they_ask_for(tmp_path):
    """`dflashctl completion SHELL` prints the script; the script calls dflashctl back with
    _DFLASHCTL_COMPLETE set, and gets the commands, options and steps that match."""
    def dflashctl(*args, **env):
        return subprocess.run([sys.executable, "-m", "dflashctl.cli.main", *args], capture_output=True, text=True,
                              env={**os.environ, **env}, cwd=tmp_path)

    bash = dflashctl("completion", "bash")
    assert bash.returncode == 0 and "complete -o default -F _dflashctl_completion dflashctl" in bash.stdout
    assert "_DFLASHCTL_COMPLETE=complete_bash" in bash.stdout
    assert "compdef _dflashctl_completion dflashctl" in dflashctl("completion", "zsh").stdout
    assert "complete --command dflashctl" in dflashctl("completion", "fish").stdout
    assert dflashctl("completion", "tcsh").returncode == 2

    def completes(words, cword):
        answer = dflashctl(_DFLASHCTL_COMPLETE="complete_bash", COMP_WORDS=words, COMP_CWORD=str(cword))
        assert answer.returncode == 0, answer.stderr
        return answer.stdout.split()

    assert completes("dflashctl sta", 1) == ["stage-model", "status"]
    assert completes("dflashctl logs --fo", 2) == ["--follow"]
    assert completes("dflashctl logs ex", 2) == ["extract"]
    assert completes("dflashctl status -o y", 3) == ["yaml"]
    fish = dflashctl(_DFLASHCTL_COMPLETE="complete_fish", _TYPER_COMPLETE_FISH_ACTION="get-args", _TYPER_COMPLETE_ARGS="dflashctl can")
    assert fish.stdout.split("\t")[0] == "cancel"
