"""`dflashctl plan` bills what the run will do (issue 31, item 4): extraction from the regenerated answers
(an estimate and its bound), each pod against the cluster's nodes, why an input cannot be read (told
apart), placeholders flagged, readable durations, and a next step that matches the spec."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from dflashctl.cli.app import app
from dflashctl.starter import STARTER_VALUES, starter_spec
from k8s_fake_api import fake_k8s, make_node  # noqa: F401 - the fixture
from test_check import forget_s3_credentials
from test_plan_init import write_run

runner = CliRunner()
PROMPT = {"role": "user", "content": "q" * 90}
ANSWER = {"role": "assistant", "content": "a" * 400}


def plan(*args: str) -> tuple[dict, str]:
    result = runner.invoke(app, ["plan", *args, "-o", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), result.stderr


def with_generation(tmp_path, **data) -> str:
    """A run that regenerates the answers of 500 chat rows, before generation and prepare."""
    spec_file = write_run(tmp_path, tokens=None)
    spec = yaml.safe_load(open(spec_file))
    spec["generate"] = {}
    spec["data"].update(data)
    open(spec_file, "w").write(yaml.safe_dump(spec))
    (tmp_path / "chats.jsonl").write_text((json.dumps({"messages": [PROMPT, ANSWER]}) + "\n") * 500)
    return spec_file


def test_with_generation_extraction_is_billed_from_the_regenerated_answers_with_its_bound(tmp_path):
    spec_file = with_generation(tmp_path)
    result, err = plan("-f", spec_file)
    # At 4 bytes a token: the prompt json.dumps([PROMPT]) is 30 + 90 + 3 = 123 bytes (30.75 tokens), the
    # source's answer json.dumps([ANSWER]) 35 + 400 + 3 = 438 (109.5 tokens, under max_new_tokens 2048).
    # Estimate: 500 x (30.75 + 109.5) = 70,125; bound: 500 x min(30.75 + 2048, 4096) = 1,039,375.
    assert result["data"]["tokens"] == 70_125 and result["data"]["tokens_upper_bound"] == 1_039_375
    assert result["data"]["samples"] == 500 and result["data"]["estimated"] is True
    assert result["gpu_hours"] == pytest.approx(70_125 / 11973.0 / 3600)
    assert result["generation"]["tokens"] == 500 * 2048  # what generation itself bills: every answer at its bound
    assert "at most 1,039,375 if every answer reaches 2,048 tokens" in result["data"]["basis"]
    # data.max_length caps both: 500 x min(30.75 + 2048, 1024) = 512,000.
    (tmp_path / "capped").mkdir()
    capped, _ = plan("-f", with_generation(tmp_path / "capped", max_length=1024))
    assert capped["data"]["tokens_upper_bound"] == 512_000
    table = runner.invoke(app, ["plan", "-f", spec_file], env={"COLUMNS": "200"})
    assert "70,125 (estimate), at most 1,039,375 (every answer at generate.max_new_tokens)" in table.stdout
    # Prepare waits for generation: the next step is the run, which generates first.
    assert "next: dflashctl run   (it generates the answers first" in table.stderr


def test_without_generation_next_is_prepare_and_durations_read_as_time(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    table = runner.invoke(app, ["plan", "-f", write_run(tmp_path / "a", tokens=None)])
    assert "next: dflashctl prepare" in table.stderr
    table = runner.invoke(app, ["plan", "-f", write_run(tmp_path / "b", tokens=1_000_000_000)])
    # 23.200 GPU-hours on 8 shards: 2.900 hours; 116.648 training GPU-hours on 8 GPUs: 14.581 hours.
    assert "2h54m on 8 shards" in table.stdout and "14h34m" in table.stdout and "next: dflashctl run" in table.stderr


def test_an_unreadable_source_says_why_each_reason_its_own(tmp_path, s3_server, s3_bucket, monkeypatch):
    spec_file = write_run(tmp_path, tokens=None)

    def basis(source: str) -> str:
        spec = yaml.safe_load(open(spec_file))
        spec["data"]["source"] = source
        open(spec_file, "w").write(yaml.safe_dump(spec))
        return plan("-f", spec_file)[0]["data"]["basis"]

    missing = basis(f"s3://{s3_bucket}/absent.jsonl")
    assert missing.startswith(f"unknown: no tokens/dataset.json, and s3://{s3_bucket}/absent.jsonl cannot be read (no such object)")
    assert "(no such bucket)" in basis("s3://no-such-bucket-dflash/chats.jsonl")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert "(endpoint unreachable): cannot reach the S3 endpoint" in basis(f"s3://{s3_bucket}/chats.jsonl")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    forget_s3_credentials(monkeypatch)
    assert "(no credentials): no S3 credentials" in basis(f"s3://{s3_bucket}/chats.jsonl")
    local = basis(str(tmp_path / "absent.jsonl"))
    assert f"{tmp_path / 'absent.jsonl'} cannot be read (no such file on this machine)" in local and "Upload" not in local


def test_each_pod_is_held_against_the_clusters_nodes(tmp_path, fake_k8s):  # noqa: F811 - the fixture
    spec_file = write_run(tmp_path, tokens=1_000_000)
    spec = yaml.safe_load(open(spec_file))
    spec["backend"] = "kubernetes"
    spec["cluster"] = {"model_volume": {"claim": "models", "mount": str(tmp_path)}}  # where the checkpoint is, here and in the pods
    spec["output"] = f"s3://dflash-runs/{tmp_path.name}"
    open(spec_file, "w").write(yaml.safe_dump(spec))
    fake_k8s.api.add(make_node("gpu-1", memory="512Gi"))
    result, err = plan("-f", spec_file)
    pods = {pod["component"]: pod for pod in result["pods"]}
    assert pods["extract"] == {"component": "extract", "count": 8, "gpus": 1, "cpu": 8.0, "memory_gib": 96.0, "fits": True,
                               "detail": "fits gpu-1 (of 1 candidate(s))"}
    assert pods["train"]["fits"] is False and pods["train"]["detail"].endswith("gpu-1, has memory 512Gi < 768Gi")
    assert result["nodes_basis"] == "the cluster's nodes (allocatable, not free now)"
    table = runner.invoke(app, ["plan", "-f", spec_file])
    assert "pod train" in table.stdout and "1 x (8 GPU, 64 CPU, 768 GiB)" in table.stdout


def test_without_a_cluster_the_pods_asks_are_shown_and_why_nodes_were_not_read(tmp_path, monkeypatch):
    spec_file = write_run(tmp_path, tokens=1_000_000)
    spec = yaml.safe_load(open(spec_file))
    spec.update(backend="kubernetes", output="s3://dflash-runs/x", cluster={"model_volume": {"claim": "models", "mount": str(tmp_path)}})
    open(spec_file, "w").write(yaml.safe_dump(spec))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "")
    result, _ = plan("-f", spec_file)
    assert result["nodes_basis"].startswith("not read: no Kubernetes configuration")
    assert {pod["component"]: (pod["gpus"], pod["fits"]) for pod in result["pods"]}["train"] == (8, None)


def test_the_unedited_starter_is_flagged(tmp_path):
    spec_file = tmp_path / "dflash.yaml"
    spec_file.write_text(starter_spec({**STARTER_VALUES, "backend": "local"}))
    result, _ = plan("-f", str(spec_file))
    assert any("placeholder bucket is still there" in warning for warning in result["warnings"])
    table = runner.invoke(app, ["plan", "-f", str(spec_file)])
    assert "warning: fail    placeholders: the starter's placeholder bucket is still there: output s3://my-bucket/" in table.stderr


def test_a_starter_on_kubernetes_flags_the_default_images_too(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    spec_file = tmp_path / "dflash.yaml"
    spec_file.write_text(starter_spec(STARTER_VALUES))
    result, _ = plan("-f", str(spec_file))
    assert any("ghcr.io/dflash-k8s/dflash:0.1.0-cuda13.0" in warning for warning in result["warnings"])
