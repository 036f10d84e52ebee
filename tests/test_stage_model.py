"""The stage-model pod (`python -m dflash_jobs.stage_model`): a checkpoint from the hub (a local double of
its HTTP API, tests/hub_server.py, through the real huggingface_hub), from S3 (moto on loopback), or
converted from a GGUF file (the tiny Llama written as llama.cpp writes one, tests/gguf_files.py) into
target.model, every file checked, resumable, the revision recorded beside the weights."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
import yaml
from boto3.s3.transfer import TransferConfig

from dflash_jobs.errors import EXIT_BAD_INPUT, EXIT_FAILED
from dflash_jobs.stage_model import GGUF_DOWNLOAD, RECORD_FILE, describe_checkpoint, git_blob_sha1, s3_etag_matches
from gguf_files import write_gguf
from hub_server import HubServer, Repo, git_blob_id
from k8s_fake_api import fake_k8s, make_pvc, make_secret  # noqa: F401 - the fixture
from cli_runner import cli
from test_cli_controller import when_job_exists

CONFIG = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
          "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 64, "hidden_size": 5120}}
COMMIT = "c0ffee" + "0" * 34
FILES = {
    "config.json": json.dumps(CONFIG).encode(),
    "model-00001-of-00002.safetensors": os.urandom(12 << 20),  # more than huggingface_hub's 10 MiB read chunk
    "model-00002-of-00002.safetensors": os.urandom(200_000),
    "tokenizer_config.json": json.dumps({"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}).encode(),
}


@pytest.fixture
def hub():
    server = HubServer().start()
    server.repos["Qwen/Qwen3.6-27B"] = Repo(dict(FILES), revisions={"main": "b" * 40, "v1": COMMIT})
    try:
        yield server
    finally:
        server.stop()


def write_spec(tmp_path: Path) -> Path:
    spec = tmp_path / "dflash.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "staged", "backend": "local", "target": {"model": str(tmp_path / "models" / "Qwen3.6-27B")},
        "data": {"source": str(tmp_path / "chats.jsonl")}, "output": str(tmp_path / "out"),
    }))
    return spec


def stage(tmp_path: Path, source: str, **env: str) -> subprocess.CompletedProcess:
    """The pod's command, with the environment the rendered Job gives it (HF_HOME on the cache volume, online)."""
    environment = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_PROGRESS_BARS": "1", **env}
    return subprocess.run([sys.executable, "-m", "dflash_jobs.stage_model", "-f", str(write_spec(tmp_path)), "--from", source],
                          capture_output=True, text=True, env=environment, timeout=300)


def test_a_hub_revision_is_staged_at_its_commit_every_file_checked_and_recorded(tmp_path, hub):
    # The connection drops mid-file once, after the first 10 MiB chunk reached the disk.
    hub.cut("model-00001-of-00002.safetensors", after=(10 << 20) + 4096)
    result = stage(tmp_path, "hf://Qwen/Qwen3.6-27B@v1", HF_ENDPOINT=hub.url)
    assert result.returncode == 0, result.stdout + result.stderr
    model = tmp_path / "models" / "Qwen3.6-27B"
    for name, data in FILES.items():
        assert (model / name).read_bytes() == data, name
    # Resumed where the connection dropped, from the CDN host the hub redirected to.
    resumed = hub.downloads("model-00001-of-00002.safetensors")
    assert [headers.get("range") for headers in resumed] == [None, f"bytes={10 << 20}-"]
    assert all(headers["host"].startswith("localhost:") and "authorization" not in headers for headers in resumed)
    # Every request named the commit the tag resolved to, not the tag.
    resolved = [path for method, path, _ in hub.requests if "/resolve/" in path]
    assert resolved and all(f"/resolve/{COMMIT}/" in path for path in resolved)
    record = json.loads((model / RECORD_FILE).read_text())
    assert (record["source"], record["revision"], record["commit"], record["complete"]) == ("hf://Qwen/Qwen3.6-27B@v1", "v1", COMMIT, True)
    assert record["files"]["model-00002-of-00002.safetensors"]["checksum"] == "sha256:" + hashlib.sha256(FILES["model-00002-of-00002.safetensors"]).hexdigest()
    assert record["files"]["config.json"]["checksum"] == "git-sha1:" + git_blob_id(FILES["config.json"])
    assert "file 2/4 model-00001-of-00002.safetensors" in result.stdout
    # What the probe pod of `dflashctl check` prints about it.
    described = describe_checkpoint(str(model))
    assert described["config"] == CONFIG and described["tokenizer"] is True
    assert described["staged"] | {"staged_at": None} == {"source": "hf://Qwen/Qwen3.6-27B@v1", "revision": "v1", "commit": COMMIT,
                                                         "complete": True, "files": 4, "staged_at": None}
    assert described["safetensors"] == {"files": 2, "bytes": (12 << 20) + 200_000}


def test_a_file_that_fails_its_checksum_is_deleted_and_a_rerun_fetches_only_what_is_missing(tmp_path, hub):
    hub.corrupt("model-00002-of-00002.safetensors")
    failed = stage(tmp_path, "hf://Qwen/Qwen3.6-27B", HF_ENDPOINT=hub.url)
    assert failed.returncode == EXIT_FAILED, failed.stdout  # retried by the Job, not bad input
    assert "model-00002-of-00002.safetensors landed with checksum sha256:" in failed.stdout
    model = tmp_path / "models" / "Qwen3.6-27B"
    assert not (model / "model-00002-of-00002.safetensors").exists()
    record = json.loads((model / RECORD_FILE).read_text())
    assert record["complete"] is False and sorted(record["files"]) == ["config.json", "model-00001-of-00002.safetensors"]
    before = {name: len(hub.downloads(name)) for name in FILES}

    hub.corrupted.clear()
    again = stage(tmp_path, "hf://Qwen/Qwen3.6-27B", HF_ENDPOINT=hub.url)
    assert again.returncode == 0, again.stdout + again.stderr
    fetched = {name: len(hub.downloads(name)) - before[name] for name in FILES}
    assert fetched == {"config.json": 0, "model-00001-of-00002.safetensors": 0, "model-00002-of-00002.safetensors": 1, "tokenizer_config.json": 1}
    assert json.loads((model / RECORD_FILE).read_text())["complete"] is True
    assert (model / "model-00002-of-00002.safetensors").read_bytes() == FILES["model-00002-of-00002.safetensors"]


def test_a_gated_repository_needs_the_token_and_a_missing_revision_is_named(tmp_path, hub):
    hub.repos["Qwen/Qwen3.6-27B"].token = "hf_secret_token"
    refused = stage(tmp_path, "hf://Qwen/Qwen3.6-27B", HF_ENDPOINT=hub.url)
    assert refused.returncode == EXIT_BAD_INPUT
    assert "Qwen/Qwen3.6-27B on http://127.0.0.1" in refused.stdout and "no HF_TOKEN is set" in refused.stdout
    assert "cluster.hf_secret" in refused.stdout
    missing = stage(tmp_path, "hf://Qwen/Qwen3.6-27B@v9", HF_ENDPOINT=hub.url, HF_TOKEN="hf_secret_token")
    assert missing.returncode == EXIT_BAD_INPUT and "has no revision 'v9'" in missing.stdout
    staged = stage(tmp_path, "hf://Qwen/Qwen3.6-27B", HF_ENDPOINT=hub.url, HF_TOKEN="hf_secret_token")
    assert staged.returncode == 0, staged.stdout + staged.stderr
    assert "hf_secret_token" not in staged.stdout + staged.stderr


def test_another_checkpoint_or_unknown_files_in_the_directory_are_refused(tmp_path, hub):
    model = tmp_path / "models" / "Qwen3.6-27B"
    model.mkdir(parents=True)
    (model / "weights.bin").write_bytes(b"someone else's")
    refused = stage(tmp_path, "hf://Qwen/Qwen3.6-27B", HF_ENDPOINT=hub.url)
    assert refused.returncode == EXIT_BAD_INPUT and "was not staged by dflashctl" in refused.stdout
    (model / "weights.bin").unlink()
    assert stage(tmp_path, "hf://Qwen/Qwen3.6-27B", HF_ENDPOINT=hub.url).returncode == 0
    other = stage(tmp_path, "hf://Qwen/Qwen3.6-27B@v1", HF_ENDPOINT=hub.url)
    assert other.returncode == EXIT_BAD_INPUT and f"holds hf://Qwen/Qwen3.6-27B (commit {'b' * 40})" in other.stdout


def test_an_s3_prefix_is_copied_with_single_and_multipart_etags_checked(tmp_path, s3_server, s3_bucket):
    client = boto3.client("s3", endpoint_url=s3_server)
    big = os.urandom(12 << 20)
    odd = os.urandom(13 << 20)
    client.put_object(Bucket=s3_bucket, Key="models/q/config.json", Body=FILES["config.json"])
    (tmp_path / "big").write_bytes(big)
    (tmp_path / "odd").write_bytes(odd)
    eight = TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20)
    client.upload_file(str(tmp_path / "big"), s3_bucket, "models/q/model.safetensors", Config=eight)
    six = TransferConfig(multipart_threshold=6 << 20, multipart_chunksize=6 << 20 | 12345)  # a part size no one uses
    client.upload_file(str(tmp_path / "odd"), s3_bucket, "models/q/extra/odd.bin", Config=six)

    result = stage(tmp_path, f"s3://{s3_bucket}/models/q")
    assert result.returncode == 0, result.stdout + result.stderr
    model = tmp_path / "models" / "Qwen3.6-27B"
    assert (model / "model.safetensors").read_bytes() == big and (model / "extra" / "odd.bin").read_bytes() == odd
    files = json.loads((model / RECORD_FILE).read_text())["files"]
    assert files["model.safetensors"]["checksum"].endswith("-2") and files["config.json"]["checksum"].startswith("s3-etag:")
    assert files["extra/odd.bin"]["checksum"] == "size" and "only its size is checked" in result.stdout
    again = stage(tmp_path, f"s3://{s3_bucket}/models/q")
    assert again.returncode == 0 and "file 1/3" not in again.stdout and "staged 3 files" in again.stdout  # nothing fetched twice


@pytest.fixture(scope="module")
def gguf_file(target_of, tmp_path_factory) -> Path:
    """The tiny Llama as a GGUF file: Q8_0 weights, its tokenizer, template and metadata as llama.cpp writes them."""
    return write_gguf(target_of("llama"), tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf")


def test_a_gguf_object_is_staged_as_the_checkpoint_it_converts_to(tmp_path, s3_server, s3_bucket, target_of, gguf_file):
    """From S3: fetched and checked, converted (bf16 weights, the tokenizer and chat template), every
    file recorded with its sha256, the download gone; the weights are the original's up to Q8_0's and
    bf16's rounding (0.6% at most, per tensor, here; a query or key left in llama.cpp's rotary layout
    would be 135% off), and the tokenizer renders and encodes a chat as the original does."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    boto3.client("s3", endpoint_url=s3_server).upload_file(str(gguf_file), s3_bucket, "gguf/tiny-llama.Q8_0.gguf")
    source = f"s3://{s3_bucket}/gguf/tiny-llama.Q8_0.gguf"
    result = stage(tmp_path, source)
    assert result.returncode == 0, result.stdout + result.stderr
    model = tmp_path / "models" / "Qwen3.6-27B"
    record = json.loads((model / RECORD_FILE).read_text())
    assert (record["source"], record["complete"]) == (source, True) and not (model / GGUF_DOWNLOAD).exists()
    assert set(record["files"]) == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                                    "chat_template.jinja"}
    assert record["files"]["model.safetensors"]["checksum"] == "sha256:" + hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()
    described = describe_checkpoint(str(model))
    assert described["config"]["model_type"] == "llama" and described["config"]["tie_word_embeddings"] and described["chat_template"]

    original = target_of("llama")
    expected, got = load_file(original / "model.safetensors"), load_file(model / "model.safetensors")
    assert set(got) == set(expected) and "lm_head.weight" not in got  # tied, as the original
    for name, weight in expected.items():
        assert (got[name].float() - weight).norm() <= 0.01 * weight.norm(), name
    prompt = [{"role": "user", "content": "What is 12 plus 30?"}]
    tokenizers = [AutoTokenizer.from_pretrained(directory) for directory in (original, model)]
    texts = [tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) for tokenizer in tokenizers]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for tokenizer, text in zip(tokenizers, texts)]
    assert texts[0] == texts[1] and ids[0] == ids[1] and len(tokenizers[0]) == len(tokenizers[1])
    again = stage(tmp_path, source)
    assert again.returncode == 0 and "staged from" in again.stdout and "converting" not in again.stdout  # nothing converted twice


def test_a_file_transformers_cannot_read_fails_the_job_naming_it(tmp_path, gguf_file):
    """Bad input, exit 42 (the Job fails at once): a file that is no GGUF, and a GGUF file of an architecture transformers does not read."""
    import gguf
    import numpy as np

    not_gguf = tmp_path / "files" / "weights.gguf"
    for directory in (not_gguf.parent, tmp_path / "a", tmp_path / "b"):
        directory.mkdir()
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not a GGUF file")
    result = stage(tmp_path / "a", str(not_gguf))
    assert result.returncode == EXIT_BAD_INPUT and f"{not_gguf} is not a GGUF file" in result.stdout
    unknown = tmp_path / "files" / "other.gguf"
    writer = gguf.GGUFWriter(str(unknown), "rwkv7")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = stage(tmp_path / "b", str(unknown))
    assert result.returncode == EXIT_BAD_INPUT and f"transformers cannot read GGUF file {unknown}" in result.stdout
    assert "https://huggingface.co/docs/transformers/gguf" in result.stdout


def test_etag_and_blob_checks_against_known_values(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"hello\n")
    # `git hash-object` of "hello\n"; the MD5 of the same bytes.
    assert git_blob_sha1(path) == "ce013625030ba8dba906f756967f9e9ca394464a"
    assert s3_etag_matches(path, '"b1946ac92492d2347c6235b4d2611184"') is True
    assert s3_etag_matches(path, '"00000000000000000000000000000000"') is False


# ---- the control plane: `dflashctl stage-model` -------------------------------------------------


def cluster_spec(tmp_path: Path, **cluster) -> Path:
    spec = tmp_path / "dflash.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "staged", "target": {"model": "/models/Qwen3.6-27B"}, "data": {"source": "s3://dflash-data/chats.jsonl"},
        "output": "s3://dflash-runs/staged", "cluster": {"model_volume": {"claim": "models"}, "hf_secret": "hf-token", **cluster},
    }))
    return spec


def test_stage_model_submits_a_job_that_writes_the_model_volume(tmp_path, fake_k8s, monkeypatch, capsys):
    api = fake_k8s.api
    api.add(make_pvc("models", modes=("ReadWriteMany",)))
    api.add(make_secret("hf-token", {"HF_TOKEN": "hf_x"}))
    spec = cluster_spec(tmp_path)
    job = "staged-stage-model"
    when_job_exists(api, job, lambda: api.start(job), lambda: api.finish(job, 0))
    code, _, err = cli(monkeypatch, capsys, "stage-model", "--from", "hf://Qwen/Qwen3.6-27B@main", "-f", str(spec), "--wait")
    assert code == 0, err
    assert "submitted Job staged-stage-model: hf://Qwen/Qwen3.6-27B@main into /models/Qwen3.6-27B on claim models" in err
    assert "stage-model Complete: 1/1 done" in err and "next: dflashctl check" in err
    pod = api.get("Job", job)["spec"]["template"]["spec"]
    (worker,) = pod["containers"]
    assert worker["command"] == ["python", "-m", "dflash_jobs.stage_model", "-f", "/etc/dflash/dflash.yaml", "--from", "hf://Qwen/Qwen3.6-27B@main"]
    assert {"name": "model", "mountPath": "/models"} in worker["volumeMounts"]  # read-write, in this pod only
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models"}} in pod["volumes"]
    assert {"secretRef": {"name": "hf-token", "optional": True}} in worker["envFrom"]
    assert {"name": "HF_HUB_OFFLINE", "value": "0"} in worker["env"]
    assert api.get("ConfigMap", "staged-spec") is not None
    # The same source again attaches; another one is refused without --force.
    assert cli(monkeypatch, capsys, "stage-model", "--from", "hf://Qwen/Qwen3.6-27B@main", "-f", str(spec))[0] == 0
    code, _, err = cli(monkeypatch, capsys, "stage-model", "--from", "hf://Qwen/Qwen3.6-27B@v2", "-f", str(spec))
    assert code == 2 and "already exists from a different spec" in err and "--force" in err


def test_stage_model_refuses_what_cannot_work_before_any_job(tmp_path, fake_k8s, monkeypatch, capsys):
    api = fake_k8s.api
    api.add(make_pvc("models"))
    code, _, err = cli(monkeypatch, capsys, "stage-model", "--from", "huggingface.co/Qwen/Qwen3.6-27B", "-f", str(cluster_spec(tmp_path)))
    assert code == 2 and "is not a checkpoint source" in err and "hf://<org>/<repo>[@<revision>]" in err
    code, _, err = cli(monkeypatch, capsys, "stage-model", "--from", "hf://Qwen/Qwen3.6-27B", "-f",
                       str(cluster_spec(tmp_path, model_volume={"claim": "models", "mount": "/weights"})))
    assert code == 2 and "target.model" in err and "under cluster.model_volume.mount (/weights)" in err
    code, _, err = cli(monkeypatch, capsys, "stage-model", "--from", "hf://Qwen/Qwen3.6-27B", "-f", str(cluster_spec(tmp_path)))
    assert code == 2 and "hf secret: Secret hf-token does not exist in dflash" in err
    code, _, err = cli(monkeypatch, capsys, "stage-model", "--from", "/home/me/SmolLM2.gguf", "-f", str(cluster_spec(tmp_path, hf_secret=None)))
    assert code == 2 and "--from /home/me/SmolLM2.gguf is a path the stage-model pod cannot see" in err and "under /models" in err
    assert api.all("Job") == []


def test_a_gguf_source_gets_a_pod_that_holds_its_model_in_memory(tmp_path):
    """Converting dequantizes the whole model in the pod: a GGUF source asks for GGUF_STAGE_RESOURCES, from S3 or the volume."""
    from dflash_jobs.spec import load_spec

    from dflashctl.tool_pods import GGUF_STAGE_RESOURCES, STAGE_RESOURCES, render_stage_model_objects

    spec = load_spec(cluster_spec(tmp_path))
    for source, resources in (("s3://models/SmolLM2.Q4_1.gguf", GGUF_STAGE_RESOURCES), ("/models/gguf/SmolLM2.Q4_1.gguf", GGUF_STAGE_RESOURCES),
                              ("s3://models/Qwen3.6-27B", STAGE_RESOURCES)):
        (worker,) = render_stage_model_objects(spec, source)[1]["spec"]["template"]["spec"]["containers"]
        assert worker["resources"] == resources and worker["command"][-1] == source


def test_stage_model_on_the_local_backend_and_check_sees_it(tmp_path, hub, monkeypatch, capsys):
    spec = write_spec(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    code, _, err = cli(monkeypatch, capsys, "stage-model", "--from", "hf://Qwen/Qwen3.6-27B@v1", "-f", str(spec))
    assert code == 0, err
    (tmp_path / "chats.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    code, out, err = cli(monkeypatch, capsys, "check", "-f", str(spec), "-o", "json")
    checks = {check["name"]: check for check in json.loads(out)["checks"]}
    assert code == 0, err
    assert checks["target"]["detail"] == (f"{tmp_path}/models/Qwen3.6-27B: qwen3_5_text, 64 layers, hidden 5120, capturing [1, 16, 31, 46, 61]; "
                                          f"staged from hf://Qwen/Qwen3.6-27B@v1 at {COMMIT[:12]}")


def test_a_gguf_path_on_the_local_backend_is_staged_and_check_passes_its_llama(tmp_path, gguf_file, monkeypatch, capsys):
    spec = write_spec(tmp_path)
    code, _, err = cli(monkeypatch, capsys, "stage-model", "--from", str(gguf_file), "-f", str(spec))
    assert code == 0, err
    (tmp_path / "chats.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    code, out, err = cli(monkeypatch, capsys, "check", "-f", str(spec), "-o", "json")
    target = {check["name"]: check for check in json.loads(out)["checks"]}["target"]
    assert code == 0 and target["status"] == "ok", err
    assert target["detail"] == f"{tmp_path}/models/Qwen3.6-27B: llama, 8 layers, hidden 64, capturing [1, 2, 3, 4, 5]; staged from {gguf_file} at its listing"
