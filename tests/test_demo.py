"""`dflashctl demo` end to end: the real jobs on the local backend, the run stored on a loopback S3.

The demo's inputs are written smaller first (fewer chats, a target taught for a few steps): the
demo keeps inputs it finds, so the pipeline, the spec and the command are exactly the user's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from dflash_jobs.formats import DATASET_KEY, DRAFTER_CONFIG_KEY, EVAL_PLOT_KEY, EVAL_REPORT_KEY, MANIFEST_KEY, TRAIN_PLOT_KEY, Manifest
from dflash_jobs.generation import MANIFEST_KEY as GENERATION_MANIFEST_KEY
from dflash_jobs.spec import load_spec

from dflashctl.demo import DEMO_CORES

pytestmark = pytest.mark.slow


def dflashctl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflashctl.cli.main", *args], cwd=cwd, capture_output=True, text=True, timeout=900)


def write_small_inputs(directory: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "dflash_jobs.architectures.tiny.demo", str(directory), "--conversations", "240", "--teaching-steps", "30"],
        check=True, capture_output=True, timeout=300,
    )


def test_demo_runs_the_whole_pipeline_into_s3_and_a_rerun_finds_it_done(tmp_path, s3_bucket, s3_server):
    directory = tmp_path / "demo"
    write_small_inputs(directory)
    output = f"s3://{s3_bucket}/runs/demo"

    first = dflashctl("demo", str(directory), "--output", output, cwd=tmp_path)

    assert first.returncode == 0, first.stderr[-3000:]
    for step in ("generate", "prepare", "extract", "train", "eval"):
        assert f"{step}: submitted Job demo-{step}" in first.stderr
    # The target answered every chat first; the drafter learned those answers.
    assert "240 of 240 chats answered by the target" in first.stdout
    assert "extraction: all " in first.stderr and " chunks verified: " in first.stderr
    # The summary names where everything is, in S3, and the commands to look further.
    assert f"{output}/{TRAIN_PLOT_KEY}" in first.stdout and f"{output}/{EVAL_PLOT_KEY}" in first.stdout
    assert "every output equals plain greedy" in first.stdout
    assert f"dflashctl status -f {directory / 'dflash.yaml'}" in first.stderr

    s3 = boto3.client("s3", endpoint_url=s3_server)
    keys = {o["Key"].removeprefix("runs/demo/") for o in s3.list_objects_v2(Bucket=s3_bucket, Prefix="runs/demo/")["Contents"]}
    assert {MANIFEST_KEY, GENERATION_MANIFEST_KEY, DRAFTER_CONFIG_KEY, EVAL_REPORT_KEY, TRAIN_PLOT_KEY, EVAL_PLOT_KEY} <= keys
    dataset = json.loads(s3.get_object(Bucket=s3_bucket, Key=f"runs/demo/{DATASET_KEY}")["Body"].read())
    assert dataset["generation"]["rows"] == 240 and dataset["generation"]["settings"]["engine"] == "transformers"
    manifest = Manifest.from_json(s3.get_object(Bucket=s3_bucket, Key=f"runs/demo/{MANIFEST_KEY}")["Body"].read())
    assert {chunk.shard for chunk in manifest.chunks} == {0, 1}, "both extraction shards wrote chunks"
    assert manifest.tokens > 10_000 and f"{manifest.tokens:,} tokens in {len(manifest.chunks)} chunks" in first.stdout
    report = json.loads(s3.get_object(Bucket=s3_bucket, Key=f"runs/demo/{EVAL_REPORT_KEY}")["Body"].read())
    assert report["lossless"] is True and report["drafters"]["dflash"]["acceptance_length"] >= 1.0
    assert report["drafters"]["dflash"]["tree"]["lossless"] and "draft trees" in first.stdout
    assert not (directory / "output").exists(), "with --output s3://... nothing goes to the local output directory"
    # How to serve it: in the report, after the table, and in the status of the finished run.
    spec = load_spec(directory / "dflash.yaml")
    serve = report["vllm_serve"]
    assert f'"num_speculative_tokens": {spec.train.block_size - 1}' in serve and f"aws s3 sync {output}/train/drafter ./drafter" in serve
    assert f"serve it with vLLM:\n{serve}" in first.stdout
    status = dflashctl("status", "-f", str(directory / "dflash.yaml"), cwd=tmp_path)
    assert status.returncode == 0 and f"serve with vLLM:\n{serve}" in status.stdout

    again = dflashctl("demo", str(directory), "--output", output, cwd=tmp_path)

    assert again.returncode == 0, again.stderr[-3000:]
    assert "submitted" not in again.stderr, "every step was found done in S3"
    assert f"{manifest.tokens:,} tokens in {len(manifest.chunks)} chunks" in again.stdout


def test_two_fresh_demos_give_the_same_figures_whatever_threads_the_shell_asks_for(tmp_path):
    """The demo's figure holds still on a machine: the same inputs through two runs, the second from
    a shell that exports OMP_NUM_THREADS=1 (training on one thread instead of two trains another
    drafter), give the same drafter, bit for bit, and the same report. Every step runs on the threads
    of the demo's DEMO_CORES (local.cores), whatever the shell or the machine's cores say."""
    from shutil import copytree

    first, second = tmp_path / "first", tmp_path / "second"
    write_small_inputs(first)
    copytree(first, second)
    runs = {}
    for directory, threads in ((first, None), (second, "1")):
        env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
        if threads is not None:
            env["OMP_NUM_THREADS"] = threads
        result = subprocess.run([sys.executable, "-m", "dflashctl.cli.main", "demo", str(directory)], cwd=tmp_path,
                                capture_output=True, text=True, timeout=900, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        report = json.loads((directory / "output" / EVAL_REPORT_KEY).read_text())
        runs[directory] = (
            (directory / "output" / "train" / "drafter" / "model.safetensors").read_bytes(),
            {name: (s["acceptance_length"], s["acceptance_per_position"]) for name, s in report["drafters"].items()},
        )
    assert runs[first][0] == runs[second][0], "the same drafter"
    assert runs[first][1] == runs[second][1]
    assert load_spec(first / "dflash.yaml").local.cores == DEMO_CORES


def test_init_demo_writes_a_local_spec_for_the_demo_inputs(tmp_path):
    directory = tmp_path / "inputs"
    write_small_inputs(directory)
    spec_file = tmp_path / "dflash.yaml"

    result = dflashctl("init", "--demo", str(directory), "-f", str(spec_file), cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    spec = load_spec(spec_file)
    assert (spec.backend, spec.extract.shards, spec.output) == ("local", 2, str(directory.resolve() / "output"))
    assert (spec.generate.engine, spec.generate.shards, spec.generate.temperature) == ("transformers", 2, 0.0)
    assert Path(spec.target.model) == directory.resolve() / "target" and Path(spec.data.source).is_file()
    assert f"dflashctl run -f {spec_file}" in result.stderr

    refused = dflashctl("init", "--demo", str(directory), "-f", str(spec_file), cwd=tmp_path)
    assert refused.returncode == 2 and "already exists" in refused.stderr and "--force" in refused.stderr


def test_fresh_refuses_a_directory_that_is_not_a_demo(tmp_path):
    precious = tmp_path / "work"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")

    result = dflashctl("demo", str(precious), "--fresh", cwd=tmp_path)

    assert result.returncode == 2 and "not a demo directory" in result.stderr
    assert (precious / "notes.txt").read_text() == "keep me"


def test_the_online_demo_trains_and_evaluates_with_no_hidden_state_stored(tmp_path):
    """`dflashctl demo --online`: no extract Job, no verify; the training Job runs the target on every
    step, and the run's output holds no hidden-state chunk, marker or manifest."""
    directory = tmp_path / "demo"
    write_small_inputs(directory)

    result = dflashctl("demo", str(directory), "--online", cwd=tmp_path)

    assert result.returncode == 0, result.stderr[-3000:]
    for step in ("generate", "prepare", "train", "eval"):
        assert f"{step}: submitted Job demo-{step}" in result.stderr
    assert "demo-extract" not in result.stderr and "chunks verified" not in result.stderr
    output = directory / "output"
    assert not (output / "extract").exists(), "nothing stored but checkpoints, metrics and the drafter"
    assert (output / DRAFTER_CONFIG_KEY).exists()
    dataset = json.loads((output / DATASET_KEY).read_text())
    assert "online states" in result.stdout and f"{dataset['tokens']:,} tokens in {len(dataset['chunks'])} chunks" in result.stdout
    report = json.loads((output / EVAL_REPORT_KEY).read_text())
    assert report["lossless"] is True and report["drafters"]["dflash"]["acceptance_length"] > 1.0
    train_log = "\n".join(path.read_text() for path in (directory / ".dflash/logs/demo-train").glob("*.log"))
    assert "online states: the target" in train_log
