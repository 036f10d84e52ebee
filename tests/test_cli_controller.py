"""`dflashctl render|submit|status|logs|cancel|retry` end to end: the CLI, the kubernetes backend and a fake API server.

Commands run through `main()`, so the exit codes are the ones of DESIGN section 9.

One file past the usual size on purpose: every test drives a run the `run` fixture sets up on the
fake cluster, with the same helpers, one command after another as a user would.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from importlib.metadata import entry_points, version
from pathlib import Path

import pytest
import yaml
from rich.console import Console
from cli_runner import cli
from conftest import free_port
from k8s_fake_api import PodRun, fake_k8s, make_pvc  # noqa: F401 - the fixture

from dflash_jobs.formats import DATASET_KEY, DRAFTER_CONFIG_KEY, EVAL_REPORT_KEY, MANIFEST_KEY, ChunkInfo, DatasetIndex, DoneMarker, done_key
from dflash_jobs.errors import SpecError, StorageUnavailable
from dflash_jobs.spec import load_spec, parse_spec
from dflash_jobs.storage import open_storage
from dflashctl.backend import JobStatus, ShardStatus
from dflashctl.backends import open_backend
from dflashctl.cli import status as status_cli
from dflashctl.errors import ClusterUnreachable, Conflict, Forbidden, RunFailed, WaitTimeout, exit_code
from dflash_jobs.units import format_duration
from dflashctl.progress import Progress, landing_rate, read_progress, time_left
from dflashctl.render import render_selection
from dflashctl.target import ClusterTarget, current_target

CHUNK_TOKENS = 1000
RUN = {
    "name": "demo-run",
    "target": {"model": "/models/tiny"},
    "data": {"source": "s3://bucket/chats.jsonl", "max_length": 256, "chunk_tokens": 1024},
    "extract": {"shards": 3, "backoff_limit_per_index": 1},
    "cluster": {"model_volume": {"claim": "models"}},
}
TINY_CHECKPOINT = {"exists": True, "staged": None, "tokenizer": True, "safetensors": {"files": 1},
                   "config": {"model_type": "qwen3_5_text", "num_hidden_layers": 8, "hidden_size": 8}}
"""What the probe pod finds on the models claim (dflash_jobs.stage_model --describe)."""


@pytest.fixture
def run(tmp_path, fake_k8s):  # noqa: F811 - the fixture above
    """A spec file on the fake cluster, storage in a local directory with 4 prepared chunks, 2 landed."""
    output = tmp_path / "out"
    spec_file = tmp_path / "dflash.yaml"
    # The output on a claim the pods mount at the same path as this test sees it.
    spec_file.write_text(yaml.safe_dump({**RUN, "output": str(output), "cluster": {**RUN["cluster"], "output_volume": {"claim": "runs", "mount": str(tmp_path)}}}))
    storage = open_storage(str(output))
    chunks = [ChunkInfo(id=i, path=f"tokens/chunks/{i:06d}.safetensors", samples=10, tokens=CHUNK_TOKENS) for i in range(4)]
    storage.put_bytes(DATASET_KEY, DatasetIndex(samples=40, tokens=4 * CHUNK_TOKENS, vocab_size=100, chunks=chunks).to_json().encode())
    for chunk in (0, 2):
        land(storage, chunk, at=time.time() - 3600)  # by an earlier extraction Job
    fake_k8s.api.add(make_pvc("runs"))  # the output's and the checkpoint's claims, which the preflight checks
    fake_k8s.api.add(make_pvc("models", modes=("ReadOnlyMany",)))
    fake_k8s.api.kubelet = lambda pod: PodRun(0, [json.dumps(TINY_CHECKPOINT)])
    return spec_file, storage, fake_k8s.api


def land(storage, chunk, *, at: float | None = None):
    """A chunk's done marker, landed now or at Unix time `at`."""
    marker = DoneMarker(chunk=chunk, samples=10, tokens=CHUNK_TOKENS, bytes=1, sha256="0" * 64, etag=None,
                        dtype="bfloat16", layers=[1], hidden_size=8)
    storage.put_bytes(done_key(chunk), marker.to_json().encode())
    if at is not None:
        os.utime(storage.root / done_key(chunk), (at, at))


def started(api, job, *, seconds_ago: float) -> float:
    """The Job's status.startTime, `seconds_ago` (the fake API's clock is its own); returns it."""
    at = time.time() - seconds_ago
    api.patch("Job", job, {"status": {"startTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))}})
    return at


def when_job_exists(api, name, *steps):
    """Plays `steps` on the fake cluster once the Job exists (a submit --wait is blocking meanwhile)."""

    def play():
        deadline = time.monotonic() + 10
        while api.get("Job", name) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        for step in steps:
            step()

    thread = threading.Thread(target=play, daemon=True)
    thread.start()
    return thread


def test_submit_status_logs_cancel_on_the_cluster(run, monkeypatch, capsys):
    spec_file, _, api = run
    code, _, err = cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec_file))
    assert code == 0 and "submitted Job demo-run-extract" in err, err
    code, _, err = cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec_file))
    assert code == 0 and "attached to Job demo-run-extract" in err and "submitted" not in err  # the same spec: attached, not created
    # Every pod Pending (no node yet): pending, not active or running.
    code, out, _ = cli(monkeypatch, capsys, "status", "-f", str(spec_file))
    assert "extract Pending: 0/3 done, 3 pending" in out
    api.start("demo-run-extract")
    started(api, "demo-run-extract", seconds_ago=60)
    api.finish("demo-run-extract", 1, exit_code=42)
    api.write_log("demo-run-extract", 0, "chunk 0: 1000 tokens, 5.1K tok/s")

    code, out, _ = cli(monkeypatch, capsys, "status", "-f", str(spec_file), "-o", "json")
    report = json.loads(out)
    assert code == 0
    extract = report["jobs"]["extract"]
    assert extract["state"] == "Running" and extract["failed_indexes"] == [1]
    assert [(s["index"], s["phase"], s["exit_reason"]) for s in extract["shards"]] == [
        (0, "Running", None), (1, "Failed", "exit 42 (Error)"), (2, "Running", None),
    ]
    assert extract["shards"][0]["node"] == "gpu-node-1" and extract["shards"][0]["pod"].startswith("demo-run-extract-0-")
    assert report["progress"]["chunks_done"] == 2 and report["progress"]["chunks_total"] == 4
    assert report["progress"]["tokens_per_s"] is None  # both chunks landed before this Job started
    assert report["step"] == "extract" and report["next"].startswith("extraction: 2/4 chunks landed")
    assert report["jobs"]["train"]["state"] == "not submitted"

    code, out, _ = cli(monkeypatch, capsys, "status", "-f", str(spec_file))
    assert code == 0
    assert "extract Running: 0/3 done, 1 failed (1), 2 running" in out
    assert "  extract[1] Failed pod=demo-run-extract-1-" in out and "exit 42 (Error)" in out
    assert "chunks: 2/4 (50% of tokens)" in out

    # In a terminal: the same facts as a rich table.
    console = Console(file=io.StringIO(), width=140, color_system=None)
    console.print(status_cli.rich_view(status_cli.collect(load_spec(spec_file), open_backend(load_spec(spec_file)))))
    screen = console.file.getvalue()
    assert "extract shards" in screen and "exit 42 (Error)" in screen and "gpu-node-1" in screen
    assert "next: extraction: 2/4 chunks landed" in screen

    code, out, _ = cli(monkeypatch, capsys, "logs", "--shard", "0", "-f", str(spec_file))
    assert code == 0 and out == "chunk 0: 1000 tokens, 5.1K tok/s\n"

    code, _, err = cli(monkeypatch, capsys, "cancel", "-f", str(spec_file))
    assert code == 0 and "job.batch/demo-run-extract deleted" in err and "configmap/demo-run-spec deleted" in err
    assert api.all("Job") == [] and api.all("Pod") == [] and api.all("ConfigMap") == []  # no leftovers


def test_submit_wait_exit_codes_done_failed_timeout(run, monkeypatch, capsys):
    spec_file, _, api = run
    job = "demo-run-extract"
    when_job_exists(api, job, lambda: api.start(job), *[lambda i=i: api.finish(job, i) for i in range(3)])
    code, _, err = cli(monkeypatch, capsys, "submit", "extract", "--wait", "-f", str(spec_file))
    assert code == 0 and "extract Complete: 3/3 done" in err

    api.delete("Job", job)
    when_job_exists(api, job, lambda: api.start(job), lambda: api.finish(job, 0, exit_code=2))  # EXIT_BAD_SPEC
    code, _, err = cli(monkeypatch, capsys, "submit", "extract", "--wait", "-f", str(spec_file))
    assert code == 1 and "Error: Job demo-run-extract failed: PodFailurePolicy" in err

    api.delete("Job", job)
    code, _, err = cli(monkeypatch, capsys, "submit", "extract", "--wait", "--timeout", "0.5", "-f", str(spec_file))
    assert code == 3 and "did not finish within" in err


def test_a_different_spec_is_refused_without_force(run, monkeypatch, capsys):
    spec_file, storage, api = run
    assert cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec_file))[0] == 0
    uid = api.get("Job", "demo-run-extract")["metadata"]["uid"]
    changed = yaml.safe_load(spec_file.read_text())
    changed["extract"]["shards"] = 4
    spec_file.write_text(yaml.safe_dump(changed))
    # Its output holds the first spec's run (run.yaml): refused there first, nothing touched.
    code, _, err = cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec_file))
    assert code == 2 and "already holds run 'demo-run' with another spec (differs in: extract)" in err and "--force" in err
    assert api.get("Job", "demo-run-extract")["metadata"]["uid"] == uid
    # With an output of its own, the Job of the same name refuses it.
    other = open_storage(changed["output"] + "-b")
    other.put_bytes(DATASET_KEY, storage.get_bytes(DATASET_KEY))
    changed["output"] = other.url
    spec_file.write_text(yaml.safe_dump(changed))
    code, _, err = cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec_file))
    assert code == 2 and "already exists from a different spec" in err and "--force" in err
    assert cli(monkeypatch, capsys, "submit", "extract", "--force", "-f", str(spec_file))[0] == 0
    job = api.get("Job", "demo-run-extract")
    assert job["metadata"]["uid"] != uid and job["spec"]["completions"] == 4


def test_training_needs_the_manifest(run, monkeypatch, capsys):
    spec_file, _, api = run
    code, _, err = cli(monkeypatch, capsys, "submit", "train", "-f", str(spec_file))
    assert code == 2 and "extract/manifest.json does not exist" in err and "dflashctl verify" in err
    assert api.get("Job", "demo-run-train") is None


def test_retry_resubmits_only_failed_jobs_and_says_so_on_the_new_job(run, monkeypatch, capsys):
    spec_file, _, api = run
    job = "demo-run-extract"
    code, _, err = cli(monkeypatch, capsys, "retry", "-f", str(spec_file))
    assert code == 0 and "no failed Job to retry" in err
    cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec_file))
    api.start(job)
    api.finish(job, 0)
    api.finish(job, 1, exit_code=42)
    api.finish(job, 2)
    uid = api.get("Job", job)["metadata"]["uid"]
    status = json.loads(cli(monkeypatch, capsys, "status", "-o", "json", "-f", str(spec_file))[1])
    assert status["jobs"]["extract"]["state"] == "Failed"
    assert status["next"].startswith("extraction shards 1 failed with chunks missing: `dflashctl logs extract --shard 1`")

    code, _, err = cli(monkeypatch, capsys, "retry", "-f", str(spec_file))
    assert code == 0 and "resubmitted Job demo-run-extract (failed shards: 1)" in err
    new = api.get("Job", job)
    assert new["metadata"]["uid"] != uid and new["status"].get("conditions") is None
    (event,) = api.all("Event")
    assert event["reason"] == "ShardsRetried" and event["involvedObject"]["uid"] == new["metadata"]["uid"]


def watched(out: str) -> list[dict]:
    """The JSON documents `status --watch -o json` printed, one per look."""
    return [json.loads(doc) for doc in out.replace("}\n{", "}\x00{").split("\x00")]


def test_status_watch_follows_the_run_across_the_gaps_between_jobs_until_it_ends(run, monkeypatch, capsys):
    spec_file, storage, api = run
    spec = load_spec(spec_file)
    backend = open_backend(spec)
    job = "demo-run-extract"
    cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec_file))

    def submit_and_start(step):
        backend.submit(render_selection(spec, step))
        api.start(f"demo-run-{step}")

    story = iter([
        lambda: api.start(job),
        lambda: (land(storage, 1), api.finish(job, 0)),
        lambda: (land(storage, 3), api.finish(job, 1), api.finish(job, 2)),
        lambda: None,  # verify checks the chunks: no Job runs
        lambda: storage.put_bytes(MANIFEST_KEY, b"{}"),  # verified; training not submitted yet
        lambda: submit_and_start("train"),
        lambda: (storage.put_bytes(DRAFTER_CONFIG_KEY, b"{}"), api.finish("demo-run-train", 0)),
        lambda: submit_and_start("eval"),
        lambda: (storage.put_bytes(EVAL_REPORT_KEY, b"{}"), api.finish("demo-run-eval", 0)),
    ])
    monkeypatch.setattr(status_cli.time, "sleep", lambda seconds: next(story)())
    code, out, _ = cli(monkeypatch, capsys, "status", "--watch", "-o", "json", "-f", str(spec_file))
    reports = watched(out)
    assert code == 0 and len(reports) == 10 and next(story, None) is None  # every look, to the end
    steps = [r["step"] for r in reports]
    assert steps == ["extract"] * 3 + ["verify"] * 2 + ["train"] * 2 + ["eval"] * 2 + ["done"]
    gap = [r for r in reports if r["step"] == "verify" or (r["step"] == "train" and r["jobs"]["train"]["state"] == "not submitted")]
    assert len(gap) == 3 and all(r["jobs"]["extract"]["state"] == "Complete" for r in gap)
    assert reports[3]["next"].startswith("every chunk landed: `dflashctl verify`")
    assert reports[-1]["next"].startswith("done: the drafter is in")

    # As plain lines: one block per change, the step in its first line.
    monkeypatch.setattr(status_cli.time, "sleep", lambda seconds: pytest.fail("the run had ended"))
    code, out, _ = cli(monkeypatch, capsys, "status", "--watch", "-f", str(spec_file))
    assert code == 0 and out.startswith("run demo-run (kubernetes), step: done")


def test_a_generation_job_that_completed_having_written_nothing_is_a_defect_to_status_watch_and_run(run, monkeypatch, capsys):
    """Issue 37, item 5: every shard Succeeded, nothing landed (not even the plan). status says what
    happened, `status -w` ends with it (exit 1), and `run` reports it instead of submitting the Job again."""
    spec_file, _, api = run
    spec_file.write_text(yaml.safe_dump({**yaml.safe_load(spec_file.read_text()), "generate": {"shards": 2}}))
    spec = load_spec(spec_file)
    job = "demo-run-generate"
    open_backend(spec).submit(render_selection(spec, "generate"))
    api.start(job)
    api.finish(job, 0)
    api.finish(job, 1)
    uid = api.get("Job", job)["metadata"]["uid"]
    verdict = (f"{job} completed (its 2 shard(s) exited 0) with no chunk planned or landed: its pods wrote nothing, a defect to report, "
               "not a failure a retry fixes. `dflashctl logs generate` shows what they did")
    code, out, _ = cli(monkeypatch, capsys, "status", "-f", str(spec_file))
    assert code == 0 and "generation: nothing written, not even generate/plan.json, by a generate Job that completed" in out
    assert f"next: generate Job {verdict}" in out and "failed" not in out
    monkeypatch.setattr(status_cli.time, "sleep", lambda seconds: None)
    code, out, _ = cli(monkeypatch, capsys, "status", "--watch", "-o", "json", "-f", str(spec_file))
    reports = watched(out)
    assert code == 1 and len(reports) == 2 and reports[-1]["next"].startswith(f"generate Job {verdict}")
    code, _, err = cli(monkeypatch, capsys, "run", "--timeout", "10", "-f", str(spec_file))
    assert code == 1 and f"Error: generate Job {verdict}" in err
    assert api.get("Job", job)["metadata"]["uid"] == uid  # not submitted again


def test_status_watch_ends_on_a_failure_that_stays_and_ctrl_c_detaches(run, monkeypatch, capsys):
    spec_file, storage, api = run
    job = "demo-run-extract"
    cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec_file))
    story = iter([
        lambda: api.start(job),
        lambda: (api.finish(job, 0), api.finish(job, 1, exit_code=42), api.finish(job, 2)),  # shard 1: bad input
        lambda: None,  # nobody replaces the Job: the failure stays
    ])
    monkeypatch.setattr(status_cli.time, "sleep", lambda seconds: next(story)())
    code, out, _ = cli(monkeypatch, capsys, "status", "--watch", "-o", "json", "-f", str(spec_file))
    reports = watched(out)
    assert code == 1 and len(reports) == 4 and next(story, None) is None
    assert [r["jobs"]["extract"]["state"] for r in reports] == ["Pending", "Running", "Failed", "Failed"]  # no pod ran before start
    assert reports[-1]["next"].startswith("extraction shards 1 failed with chunks missing")

    # A failed step under a running in-cluster controller is the controller's to replace: no end.
    cli(monkeypatch, capsys, "submit", "controller", "-f", str(spec_file))
    api.start("demo-run-controller")
    looks = iter(range(3))
    monkeypatch.setattr(status_cli.time, "sleep", lambda seconds: next(looks) == 2 and api.finish("demo-run-controller", 0, exit_code=1))
    code, out, _ = cli(monkeypatch, capsys, "status", "--watch", "-o", "json", "-f", str(spec_file))
    reports = watched(out)
    assert code == 1 and len(reports) == 4  # it ended when the controller did
    assert [r["jobs"]["controller"]["state"] for r in reports] == ["Running", "Running", "Running", "Failed"]

    api.delete("Job", job)
    api.delete("Job", "demo-run-controller")
    cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec_file))

    def interrupt(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(status_cli.time, "sleep", interrupt)
    code, _, err = cli(monkeypatch, capsys, "status", "--watch", "-f", str(spec_file))
    assert code == 130 and "detached, the run goes on" in err
    assert api.get("Job", job) is not None  # the run goes on


def test_an_unreachable_cluster_exits_4(run, monkeypatch, capsys, tmp_path):
    spec_file, _, _ = run
    kubeconfig = tmp_path / "nowhere.yaml"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{free_port()}"}}],
        "users": [{"name": "u", "user": {}}], "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    code, _, err = cli(monkeypatch, capsys, "status", "-f", str(spec_file))
    assert code == 4 and err.startswith("Error: the Kubernetes API at http://127.0.0.1:") and "current-context" in err


def test_status_with_storage_unreachable_exits_5_and_prints_the_error_it_refers_to(run, monkeypatch, capsys):
    """Issue 37, item 4: the README's code for unavailable storage, and the error above the `next:` that points at it."""
    spec_file, _, _ = run
    spec_file.write_text(yaml.safe_dump({**RUN, "output": "s3://bucket/runs/demo-run"}))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    code, out, _ = cli(monkeypatch, capsys, "status", "-f", str(spec_file))
    lines = out.splitlines()
    assert code == 5, out
    storage = next(i for i, line in enumerate(lines) if line.startswith("storage: cannot reach the S3 endpoint for s3://bucket/runs/demo-run"))
    assert lines[-1] == "next: fix storage access first (see the error above), then `dflashctl status` again" and storage < len(lines) - 1
    code, out, _ = cli(monkeypatch, capsys, "status", "-f", str(spec_file), "-o", "json")
    assert code == 5 and json.loads(out)["storage_error"].startswith("cannot reach the S3 endpoint")


def test_o_yaml_is_the_json_document_and_o_name_what_the_command_is_about(run, monkeypatch, capsys):
    spec_file, _, api = run
    cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec_file))
    for command in (["status"], ["check", "--no-probe"]):
        code, as_json, _ = cli(monkeypatch, capsys, *command, "-o", "json", "-f", str(spec_file))
        code_yaml, as_yaml, _ = cli(monkeypatch, capsys, *command, "-o", "yaml", "-f", str(spec_file))
        assert code == code_yaml and as_yaml.startswith("---\n") and yaml.safe_load(as_yaml) == json.loads(as_json)
    assert cli(monkeypatch, capsys, "status", "-o", "name", "-f", str(spec_file))[:2] == (0, "job.batch/demo-run-extract\n")
    code, names, _ = cli(monkeypatch, capsys, "check", "--no-probe", "-o", "name", "-f", str(spec_file))
    failed = [c["name"] for c in json.loads(cli(monkeypatch, capsys, "check", "--no-probe", "-o", "json", "-f", str(spec_file))[1])["checks"] if c["status"] == "fail"]
    assert names.splitlines() == [f"check/{name.replace(' ', '-')}" for name in failed]
    code, names, _ = cli(monkeypatch, capsys, "render", "controller", "-o", "name", "-f", str(spec_file))
    assert code == 0 and names.splitlines() == [
        "configmap/demo-run-spec", "serviceaccount/dflash-controller", "role.rbac.authorization.k8s.io/dflash-controller",
        "rolebinding.rbac.authorization.k8s.io/dflash-controller", "job.batch/demo-run-controller",
    ]


def second_run(spec_file, storage, name="other-run"):
    """A second run in the same namespace: its own spec file and output, its data prepared."""
    other = yaml.safe_load(spec_file.read_text())
    other_output = open_storage(other["output"] + "-" + name)
    other_output.put_bytes(DATASET_KEY, storage.get_bytes(DATASET_KEY))
    other.update(name=name, output=other_output.url)
    other_file = spec_file.with_name(f"{name}.yaml")
    other_file.write_text(yaml.safe_dump(other))
    return other_file, other_output


def writes(api, since: int) -> list[tuple[str, str]]:
    """The requests after the `since`-th that changed the cluster (SelfSubjectAccessReviews only ask)."""
    return [(method, path) for method, path in api.requests[since:] if method != "GET" and "selfsubjectaccessreviews" not in path]


def test_runs_are_listed_and_shown_by_name_without_their_spec_files(run, monkeypatch, capsys, tmp_path):
    spec_file, storage, api = run
    other_file, _ = second_run(spec_file, storage)
    for spec in (spec_file, other_file):
        assert cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec))[0] == 0
    api.start("other-run-extract")
    monkeypatch.chdir(tmp_path / "out")  # no dflash.yaml here: the cluster, in the spec's default namespace
    code, out, _ = cli(monkeypatch, capsys, "list", "-o", "json")
    runs = {listing["run"]: listing for listing in json.loads(out)["runs"]}
    assert code == 0 and sorted(runs) == ["demo-run", "other-run"]
    assert runs["other-run"]["jobs"] == {"extract": "Running"} and list(runs["demo-run"]["jobs"]) == ["extract"]
    assert runs["other-run"]["output"] == load_spec(other_file).output and runs["other-run"]["spec_hash"] == load_spec(other_file).fingerprint()
    assert runs["demo-run"]["objects"] == ["job.batch/demo-run-extract", "configmap/demo-run-spec"]
    assert cli(monkeypatch, capsys, "list", "-o", "name")[1] == "run/demo-run\nrun/other-run\n"
    code, out, _ = cli(monkeypatch, capsys, "list")
    assert code == 0 and "other-run" in out and "extract Running" in out

    code, out, _ = cli(monkeypatch, capsys, "status", "other-run", "-o", "json")
    report = json.loads(out)
    assert code == 0 and report["run"] == "other-run" and report["jobs"]["extract"]["state"] == "Running"
    assert report["progress"]["chunks_total"] == 4  # its own output, from the spec in its ConfigMap
    code, _, err = cli(monkeypatch, capsys, "status", "nope")
    assert code == 2 and "no run 'nope' in namespace dflash" in err and "demo-run, other-run" in err
    assert cli(monkeypatch, capsys, "list", "-n", "team-a", "-o", "name")[:2] == (0, "")  # another namespace: none


def test_cancel_and_delete_remove_one_run_s_objects_and_never_another_s(run, monkeypatch, capsys, tmp_path):
    """Two runs in one namespace: cancelling one leaves the other's Jobs, pods and spec untouched."""
    spec_file, storage, api = run
    other_file, other_storage = second_run(spec_file, storage)
    for spec in (spec_file, other_file):
        assert cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec))[0] == 0
    cli(monkeypatch, capsys, "submit", "controller", "-f", str(other_file))
    other_objects = {(kind, obj["metadata"]["name"], obj["metadata"]["uid"]) for kind in ("Job", "Pod", "ConfigMap", "ServiceAccount")
                     for obj in api.all(kind) if not obj["metadata"]["name"].startswith("demo-run")}

    before = len(api.requests)
    code, _, err = cli(monkeypatch, capsys, "cancel", "-f", str(spec_file), "--dry-run")
    assert code == 0 and "job.batch/demo-run-extract deleted (dry run)" in err and "configmap/demo-run-spec deleted (dry run)" in err
    assert writes(api, before) == [] and api.get("Job", "demo-run-extract") is not None

    code, _, err = cli(monkeypatch, capsys, "cancel", "-f", str(spec_file))
    assert code == 0 and f"kept: {load_spec(spec_file).output}" in err and "shared by the namespace's runs" in err
    assert [obj["metadata"]["name"] for obj in api.all("Job")] == ["other-run-controller", "other-run-extract"]
    assert {(kind, obj["metadata"]["name"], obj["metadata"]["uid"]) for kind in ("Job", "Pod", "ConfigMap", "ServiceAccount")
            for obj in api.all(kind)} == other_objects
    assert storage.exists(DATASET_KEY)  # the storage stays

    monkeypatch.chdir(tmp_path / "out")  # by name, no spec file
    code, _, err = cli(monkeypatch, capsys, "delete", "other-run", "--data")
    assert code == 2 and "Pass --yes" in err and api.all("Job")  # stdin is no terminal: nothing asked, nothing deleted
    code, _, err = cli(monkeypatch, capsys, "delete", "other-run", "--data", "--dry-run")
    assert code == 0 and "objects under" in err and other_storage.exists(DATASET_KEY)
    code, _, err = cli(monkeypatch, capsys, "delete", "other-run", "--data", "--yes")
    assert code == 0 and "job.batch/other-run-controller deleted" in err.splitlines()[0]  # the controller first
    assert api.all("Job") == [] and api.all("ConfigMap") == [] and other_storage.list("") == []
    assert [obj["metadata"]["name"] for obj in api.all("ServiceAccount")] == ["dflash-controller"]  # shared: kept
    assert storage.exists(DATASET_KEY)  # the other run's storage
    code, _, err = cli(monkeypatch, capsys, "delete", "other-run")
    assert code == 2 and "no run 'other-run' in namespace dflash" in err


def test_dry_runs_of_submit_and_run_say_what_they_would_create_and_write_nothing(run, monkeypatch, capsys):
    spec_file, storage, api = run
    before = len(api.requests)
    code, out, err = cli(monkeypatch, capsys, "submit", "extract", "--dry-run", "-f", str(spec_file))
    assert code == 0, err
    assert out.splitlines() == ["configmap/demo-run-spec created (dry run)", "job.batch/demo-run-extract created (dry run)"]
    assert not storage.exists("run.yaml") and "would claim" in err
    code, out, err = cli(monkeypatch, capsys, "run", "--dry-run", "-f", str(spec_file))
    assert code == 0, err
    assert out.splitlines() == ["configmap/demo-run-spec created (dry run)", "job.batch/demo-run-extract created (dry run)"]
    assert "then: verify, train, eval" in err
    assert writes(api, before) == [] and api.all("Job") == [] and not storage.exists("run.yaml")

    assert cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec_file))[0] == 0
    code, out, _ = cli(monkeypatch, capsys, "submit", "extract", "--dry-run", "-f", str(spec_file))
    assert out.splitlines() == ["configmap/demo-run-spec unchanged (dry run)", "job.batch/demo-run-extract unchanged (dry run)"]
    changed = yaml.safe_load(spec_file.read_text())
    changed["extract"]["shards"] = 4
    spec_file.write_text(yaml.safe_dump(changed))
    code, _, err = cli(monkeypatch, capsys, "submit", "extract", "--dry-run", "-f", str(spec_file))
    assert code == 2 and "already holds run 'demo-run' with another spec" in err  # as the submit itself would


def readme_exit_codes() -> dict[int, str]:
    """The README's table of exit codes: code -> its meaning."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    table = text[text.index("### Exit codes"):].split("\n\n")[2]
    return {int(row.split("|")[1]): row.split("|")[2].strip() for row in table.splitlines()[2:]}


def test_the_readme_table_of_exit_codes_is_the_one_the_errors_map_to():
    table = readme_exit_codes()
    assert sorted(table) == [0, 1, 2, 3, 4, 5, 130]
    for error, code in ((RunFailed("x", "y"), 1), (SpecError("f", 1, "z"), 2), (Conflict("x", "y"), 2), (WaitTimeout("x", "y"), 3),
                        (ClusterUnreachable("x", "y"), 4), (Forbidden("x", "y"), 4), (StorageUnavailable("x", "y"), 5), (KeyboardInterrupt(), 130)):
        assert exit_code(error) == code and code in table


def test_every_command_s_error_paths_exit_as_the_readme_table_says(run, monkeypatch, capsys, tmp_path):
    """Each case: what a person did, and a phrase of the README row its exit code must stand for."""
    spec_file, _, api = run
    table = readme_exit_codes()
    f = ["-f", str(spec_file)]

    def exits(args, meaning):
        code, _, err = cli(monkeypatch, capsys, *args)
        assert code in table and meaning in table[code], f"dflashctl {' '.join(args)} exited {code} ({err.strip()}), the table: {meaning!r}"

    exits(["logs", *f], "does not exist")  # no Jobs yet: nothing of the run exists (it exited 1, "the run failed")
    exits(["status", *f], "done")  # no Jobs: reported
    exits(["submit", "train", *f], "a step asked for before the one it needs")
    exits(["verify", *f], "a chunk failed verification")  # markers without their chunks
    exits(["cancel", "nope", *f], "something named that does not exist")
    exits(["status", "nope", *f], "something named that does not exist")
    exits(["delete", "nope", *f], "something named that does not exist")
    exits(["submit", "extract", "--dry-run", *f], "done")
    assert cli(monkeypatch, capsys, "submit", "extract", *f)[0] == 0
    exits(["logs", "train", *f], "something named that does not exist")
    exits(["logs", "extract", "--shard", "7", *f], "something named that does not exist")
    exits(["logs", "extract", "-c", "sidecar", *f], "something named that does not exist")
    exits(["logs", "extract", "-p", "--shard", "0", *f], "previous attempt")
    exits(["status", "-o", "xml", *f], "an option")
    exits(["submit", "extract", "--wait", "--timeout", "0.3", *f], "timed out")
    when_job_exists(api, "demo-run-extract", lambda: api.start("demo-run-extract"), lambda: api.finish("demo-run-extract", 0, exit_code=2))
    exits(["submit", "extract", "--wait", *f], "a Job failed")
    api.fail_requests(30, status=403, path="/jobs")
    exits(["status", *f], "forbids the call")
    api.faults.clear()
    kubeconfig = tmp_path / "nowhere.yaml"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c", "users": [{"name": "u", "user": {}}],
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{free_port()}"}}], "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    exits(["cancel", *f], "unreachable")


def test_a_missing_spec_file_is_bad_usage(monkeypatch, capsys, tmp_path):
    code, _, err = cli(monkeypatch, capsys, "status", "-f", str(tmp_path / "nope.yaml"))
    assert code == 2 and f"Error: spec file {tmp_path / 'nope.yaml'} does not exist" in err and "dflashctl init" in err
    assert "spec field" not in err  # a file, not a field (issue 37, item 10)


def test_kubectl_finds_the_plugin():
    (plugin,) = [e for e in entry_points(group="console_scripts") if e.name == "kubectl-dflash"]
    assert plugin.value == "dflashctl.cli.main:main"  # `kubectl dflash status` runs `dflashctl status`


# ---- the pieces status is made of --------------------------------------------------------------


def make_job_status(name="demo-run-extract", *, completions=3, done="", failed="", active=0, conditions=None):
    from dflashctl.backend import parse_indexes

    return JobStatus(
        name=name, exists=True, active=active, completed_indexes=parse_indexes(done), failed_indexes=parse_indexes(failed),
        conditions=conditions or {}, completions=completions,
        shards=[ShardStatus(index=i, pod=None, node=None, phase="Pending", attempts=0, exit_reason=None) for i in range(completions)],
    )


def report_with(jobs=None, progress=Progress(chunks_done=4, chunks_total=4, tokens_done=4, tokens_total=4), manifest=False,
                trained=False, evaluated=False):
    spec = parse_spec({**RUN, "output": "s3://bucket/runs/demo-run"})
    statuses = {step: JobStatus(name=f"demo-run-{step}", exists=False) for step in ("prepare", "extract", "train", "eval", "controller")}
    statuses.update(jobs or {})
    report = status_cli.RunReport(run="demo-run", backend="kubernetes", jobs=statuses, progress=progress, tokens_per_s=None,
                                  eta_s=None, manifest=manifest, trained=trained, evaluated=evaluated, storage_error=None)
    return status_cli.next_step(spec, report)


def test_next_step_walks_the_pipeline():
    unprepared = Progress(chunks_done=0, chunks_total=None, tokens_done=0, tokens_total=None)
    assert report_with(progress=unprepared) == "start prepare: `dflashctl run`, or `dflashctl prepare` alone"
    half = Progress(chunks_done=2, chunks_total=4, tokens_done=2, tokens_total=4)
    assert report_with(progress=half).startswith("start extract: `dflashctl submit extract`")
    queued = make_job_status(conditions={"Suspended": "Kueue"})
    assert report_with({"extract": queued}, progress=half) == "extract is queued (Kueue has not admitted it yet)"
    controller = make_job_status("demo-run-controller", completions=1, active=1)
    assert report_with({"extract": make_job_status(active=3), "controller": controller}, progress=half).endswith("(the in-cluster controller does it)")
    assert report_with().startswith("every chunk landed: `dflashctl verify`")
    assert report_with(manifest=True) == "start train: `dflashctl submit train`"
    failed_train = make_job_status("demo-run-train", completions=1, failed="", conditions={"Failed": "BackoffLimitExceeded"})
    assert report_with({"train": failed_train}, manifest=True).startswith("train failed (BackoffLimitExceeded): `dflashctl logs train`")
    assert report_with(manifest=True, trained=True) == "start eval: `dflashctl eval`"
    evaluating = make_job_status("demo-run-eval", completions=1, active=1)
    assert report_with({"eval": evaluating}, manifest=True, trained=True).startswith("evaluating the drafter")
    assert report_with(manifest=True, trained=True, evaluated=True).startswith("done: the drafter is in s3://bucket/runs/demo-run/train/drafter")


def test_progress_counts_landed_chunks_and_the_rate_counts_only_this_job_s(run):
    _, storage, _ = run
    progress = read_progress(storage)
    assert (progress.chunks_done, progress.chunks_total, progress.tokens_done, progress.tokens_total) == (2, 4, 2000, 4000)
    assert progress.label == "2/4" and not progress.landed
    now = 10_000.0
    resumed = Progress(chunks_done=3, chunks_total=4, tokens_done=3000, tokens_total=4000,
                       landings=((100.0, 1000), (200.0, 1000), (now - 100, 1000)))
    # The Job started 200 s ago: the two chunks of an earlier Job add nothing.
    assert landing_rate(resumed, since=now - 200, now=now) == 1000 / 200
    assert time_left(resumed, 5.0) == 200.0
    # Started long ago: the rate is over the last 10 minutes.
    assert landing_rate(resumed, since=0.0, now=now, window_s=600) == 1000 / 600
    # Nothing landed since the start: no rate yet (not 0); stalled since: 0, and no ETA.
    assert landing_rate(resumed, since=now - 50, now=now) is None
    assert landing_rate(resumed, since=now - 5000, now=now + 700, window_s=600) == 0.0
    assert time_left(resumed, 0.0) is None and landing_rate(resumed, since=None, now=now) is None
    assert format_duration(3725) == "1h02m" and format_duration(None) == "-"


def test_a_resumed_extraction_is_rated_by_what_landed_since_it_started(run, monkeypatch, capsys):
    """Chunks 0 and 2 landed an hour ago under an earlier Job; this one started 100 s ago and has
    landed chunk 1 since: 1,000 tokens in 100 s (an average from its start counted all 3,000)."""
    spec_file, storage, api = run
    job = "demo-run-extract"
    cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec_file))
    api.start(job)
    start = started(api, job, seconds_ago=100)
    land(storage, 1, at=start + 50)
    code, out, _ = cli(monkeypatch, capsys, "status", "-o", "json", "-f", str(spec_file))
    progress = json.loads(out)["progress"]
    assert code == 0 and progress["tokens_done"] == 3 * CHUNK_TOKENS
    assert progress["tokens_per_s"] == pytest.approx(CHUNK_TOKENS / 100, rel=0.05)
    assert progress["eta_s"] == pytest.approx(100, rel=0.05)  # the last chunk's 1,000 tokens at that rate
    code, out, _ = cli(monkeypatch, capsys, "status", "-f", str(spec_file))
    assert "chunks: 3/4 (75% of tokens), 10 tok/s, ETA 1m" in out


# ---- kubectl's habits: logs -f, --context, -n, exit codes -----------------------------------------


def test_f_is_the_spec_file_in_logs_too_and_follow_is_its_own_flag(run, monkeypatch, capsys):
    spec_file, _, api = run
    job = "demo-run-extract"
    cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec_file))
    api.start(job)
    api.write_log(job, 0, "loading target")
    when_job_exists(api, job, lambda: time.sleep(0.3), lambda: api.write_log(job, 0, "chunk 0 landed"), lambda: api.finish(job, 0))
    code, out, _ = cli(monkeypatch, capsys, "logs", "extract", "--shard", "0", "--follow", "-f", str(spec_file))
    assert code == 0 and out == "loading target\nchunk 0 landed\n"  # it waited for the pod to end

    # -f is the spec, as in every command (kubectl's -f is a file), and follows nothing.
    code, out, err = cli(monkeypatch, capsys, "logs", "-f", str(spec_file), "--shard", "0")
    assert (code, out) == (0, "loading target\nchunk 0 landed\n") and "read `-f" not in err
    # So is DFLASH_SPEC; -F is --follow.
    monkeypatch.setenv("DFLASH_SPEC", str(spec_file))
    assert cli(monkeypatch, capsys, "logs", "extract", "--shard", "0", "-F")[:2] == (0, "loading target\nchunk 0 landed\n")
    # A spec file that is not there is bad usage, named.
    code, _, err = cli(monkeypatch, capsys, "logs", "-f", "no-such-file.yaml")
    assert code == 2 and "no-such-file.yaml" in err


def test_logs_tail_since_previous_attempt_and_init_containers_as_kubectl_logs(run, monkeypatch, capsys):
    spec_file, _, api = run
    job = "demo-run-extract"
    cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec_file))
    api.start(job)
    api.write_log(job, 1, "selfcheck: flash-linear-attention OFF", container="selfcheck")
    api.write_log(job, 1, "loading target", "chunk 4: 1000 tokens", at=time.time() - 3600)
    api.write_log(job, 1, "chunk 5: 1000 tokens", "chunk 6: 1000 tokens")
    api.finish(job, 1, exit_code=137)  # killed: the Job retries shard 1 with a new pod
    api.start(job)
    api.write_log(job, 1, "loading target again")

    def logs(*options):
        code, out, err = cli(monkeypatch, capsys, "logs", "extract", "--shard", "1", "-f", str(spec_file), *options)
        assert code == 0, err
        return out.splitlines()

    assert logs() == ["loading target again"]
    assert logs("-p") == ["loading target", "chunk 4: 1000 tokens", "chunk 5: 1000 tokens", "chunk 6: 1000 tokens"]
    assert logs("--previous", "--tail", "2") == ["chunk 5: 1000 tokens", "chunk 6: 1000 tokens"]
    assert logs("-p", "--since", "10m") == ["chunk 5: 1000 tokens", "chunk 6: 1000 tokens"]
    assert logs("-p", "-c", "selfcheck") == ["selfcheck: flash-linear-attention OFF"]
    assert logs("--tail", "0") == []
    requested = api.requests_matching("GET", "/log?")
    assert any("tailLines=2" in path for path in requested) and any("sinceSeconds=600" in path for path in requested)

    code, _, err = cli(monkeypatch, capsys, "logs", "extract", "--shard", "0", "-p", "-f", str(spec_file))
    assert code == 2 and "shard 0 of Job demo-run-extract has had one attempt" in err
    code, _, err = cli(monkeypatch, capsys, "logs", "extract", "--shard", "1", "-c", "stage", "-f", str(spec_file))
    assert code == 2 and "has no container 'stage'" in err and "selfcheck, worker" in err
    code, _, err = cli(monkeypatch, capsys, "logs", "extract", "--since", "ten minutes", "-f", str(spec_file))
    assert code == 2 and "'ten minutes' is not a duration" in err


def test_a_selfcheck_that_failed_is_read_with_c_while_the_worker_never_ran(run, monkeypatch, capsys):
    spec_file, _, api = run
    job = "demo-run-extract"
    cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec_file))
    api.write_log(job, 2, "Error: no CUDA device visible", container="selfcheck")
    api.finish(job, 2, exit_code=2, container="selfcheck")
    code, out, _ = cli(monkeypatch, capsys, "logs", "extract", "--shard", "2", "-c", "selfcheck", "-f", str(spec_file))
    assert (code, out) == (0, "Error: no CUDA device visible\n")
    code, out, _ = cli(monkeypatch, capsys, "logs", "extract", "--shard", "2", "--follow", "-f", str(spec_file))
    assert (code, out) == (0, "")  # the worker never started: nothing to wait for
    report = json.loads(cli(monkeypatch, capsys, "status", "-o", "json", "-f", str(spec_file))[1])
    assert "`dflashctl logs extract --shard 2 -c selfcheck`" in report["next"]  # where the failure is told


def test_a_bad_shard_or_a_step_without_a_job_exits_2_naming_what_exists(run, monkeypatch, capsys):
    spec_file, _, _ = run
    cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec_file))
    code, out, err = cli(monkeypatch, capsys, "logs", "extract", "--shard", "11", "--spec", str(spec_file))
    assert code == 2 and out == "" and "--shard 11 is not a shard of Job demo-run-extract: its shards are 0..2" in err
    code, _, err = cli(monkeypatch, capsys, "logs", "--shard", "-1", "--spec", str(spec_file))
    assert code == 2 and "--shard" in err and "greater than or equal to 0" in err
    code, _, err = cli(monkeypatch, capsys, "logs", "train", "--spec", str(spec_file))
    assert code == 2 and "run demo-run has no train Job (demo-run-train)" in err and "dflashctl status" in err


def test_the_logs_of_a_pod_that_has_not_started_say_why_it_waits(run, monkeypatch, capsys):
    """Pending: the scheduler's FailedScheduling event, on stderr; exit 0, stdout empty. With -f,
    logs waits for the pod to start and follows it."""
    spec_file, _, api = run
    job = "demo-run-extract"
    cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec_file))  # every pod Pending
    message = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: 0/4 nodes are available"
    api.unschedulable(job, 1, message, times=3)
    code, out, err = cli(monkeypatch, capsys, "logs", "extract", "--spec", str(spec_file))
    assert code == 0 and out == ""
    notes = err.splitlines()
    assert len(notes) == 3 and all(" is Pending, no log yet: " in note for note in notes)
    assert notes[1].startswith(f"shard 1: pod {job}-1-") and notes[1].endswith(f"Warning FailedScheduling: {message} (x3)")
    assert notes[0].startswith("shard 0: pod ") and notes[0].endswith("no events yet")
    code, out, err = cli(monkeypatch, capsys, "logs", "extract", "--shard", "1", "--spec", str(spec_file))
    assert code == 0 and out == "" and err.startswith("shard 1: pod ") and "FailedScheduling" in err and "shard 0" not in err
    # Who may not list events still learns why, from the pod's PodScheduled condition.
    api.fail_requests(1, status=403, path="/events")
    code, _, err = cli(monkeypatch, capsys, "logs", "extract", "--shard", "1", "--spec", str(spec_file))
    assert code == 0 and err.strip().endswith(f"is Pending, no log yet: unschedulable: {message}")

    # Followed, every shard is waited for, then streamed as it runs.
    def run_shards():
        api.start(job)
        for index in range(3):
            api.write_log(job, index, f"shard {index} loading target")
            api.finish(job, index)

    when_job_exists(api, job, lambda: time.sleep(0.3), run_shards)
    code, out, err = cli(monkeypatch, capsys, "logs", "extract", "--follow", "--spec", str(spec_file))
    assert code == 0 and "FailedScheduling" in err, (out, err)
    assert sorted(out.splitlines()) == [f"[shard {index}] shard {index} loading target" for index in range(3)]


def two_contexts(tmp_path, fake_k8s) -> str:  # noqa: F811 - the fixture
    """A kubeconfig whose current context "dead" reaches nothing; "fake" reaches the fake API server."""
    kubeconfig = tmp_path / "two-contexts.yaml"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "dead",
        "clusters": [{"name": "dead", "cluster": {"server": f"http://127.0.0.1:{free_port()}"}}, {"name": "fake", "cluster": {"server": fake_k8s.url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": "u"}} for name in ("dead", "fake")],
    }))
    return str(kubeconfig)


def test_context_and_namespace_override_the_kubeconfig_and_the_spec_before_or_after_the_command(run, monkeypatch, capsys, tmp_path, fake_k8s):  # noqa: F811
    spec_file, _, api = run
    monkeypatch.setenv("KUBECONFIG", two_contexts(tmp_path, fake_k8s))
    monkeypatch.setattr("dflashctl.cluster.Cluster.retry_delays", ())
    assert cli(monkeypatch, capsys, "status", "-f", str(spec_file))[0] == 4  # the current context: unreachable
    assert cli(monkeypatch, capsys, "status", "-f", str(spec_file), "--context", "fake")[0] == 0
    assert cli(monkeypatch, capsys, "--context", "fake", "status", "-f", str(spec_file))[0] == 0
    code, _, err = cli(monkeypatch, capsys, "status", "-f", str(spec_file), "--context", "prod")
    assert code == 2 and "--context prod is not a context of the kubeconfig" in err and "contexts: dead, fake" in err

    # -n over the spec's cluster.namespace (dflash), which does not exist here.
    api.namespaces = {"team-a"}
    code, _, err = cli(monkeypatch, capsys, "--context", "fake", "submit", "extract", "-f", str(spec_file))
    assert code == 2 and "namespace dflash does not exist" in err
    code, _, err = cli(monkeypatch, capsys, "--context", "fake", "submit", "extract", "-f", str(spec_file), "-n", "team-a")
    assert code == 0, err
    assert api.requests_matching("POST", "/namespaces/team-a/jobs") and not api.requests_matching("POST", "/namespaces/dflash/jobs")
    job, configmap = api.get("Job", "demo-run-extract"), api.get("ConfigMap", "demo-run-spec")
    assert job["metadata"]["namespace"] == "team-a"
    assert yaml.safe_load(configmap["data"]["dflash.yaml"])["cluster"]["namespace"] == "team-a"  # what its pods read
    assert job["metadata"]["annotations"]["dflash.dev/spec-hash"] == load_spec(spec_file).fingerprint()  # the same run
    code, out, _ = cli(monkeypatch, capsys, "-n", "team-a", "--context", "fake", "status", "-f", str(spec_file), "-o", "json")
    assert code == 0 and json.loads(out)["jobs"]["extract"]["exists"]
    assert api.requests_matching("GET", "/namespaces/team-a/jobs/demo-run-extract")
    # After a command, the process talks where it did before (tests and callers in one process).
    assert current_target() == ClusterTarget()
    code, _, err = cli(monkeypatch, capsys, "status", "-f", str(spec_file), "-n", "Team_A")
    assert code == 2 and "not a namespace name" in err


def test_version():
    result = subprocess.run([sys.executable, "-m", "dflashctl.cli.main", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout == f"dflashctl {version('dflash-k8s')}\n"


@pytest.mark.parametrize("args", [
    ["status", "-o", "xml"],
    ["submit", "everything"],
    ["logs", "--shard", "-1"],
    ["run", "--timeout", "-5"],
    ["eval", "--timeout", "-5"],
    ["render", "train", "-o", "k8s/runs/x"],
    ["render", "train", "-o", "json", "-d", "k8s/runs/x"],
    ["status", "-n", "Not_A_Namespace"],
    ["export-states"],
    ["export-states", "--format", "speculators", "--workers", "0"],
    ["plan", "--tokens-per-second", "0"],
    ["retry", "nothing"],
    ["init"],  # the spec file exists: --force
    ["frobnicate"],
])
def test_every_bad_argument_exits_2(run, monkeypatch, capsys, args):
    spec_file, _, _ = run
    monkeypatch.chdir(spec_file.parent)  # dflash.yaml, the default spec, is there
    code, _, err = cli(monkeypatch, capsys, *args)
    assert code == 2, err
    assert err.strip()


def test_status_of_an_online_run_goes_from_prepare_to_its_training_job(run, monkeypatch, capsys):
    """train.states: online: no extract or verify step to wait for; the train Job is the next step and
    shows as any Job does."""
    spec_file, _, api = run
    spec = yaml.safe_load(spec_file.read_text())
    spec["train"] = {"states": "online"}
    spec_file.write_text(yaml.safe_dump(spec))
    code, out, _ = cli(monkeypatch, capsys, "status", "-f", str(spec_file), "-o", "json")
    report = json.loads(out)
    assert code == 0 and report["step"] == "train" and report["next"] == "start train: `dflashctl submit train`"
    code, _, err = cli(monkeypatch, capsys, "submit", "train", "-f", str(spec_file))
    assert code == 0 and "submitted Job demo-run-train" in err, err
    api.start("demo-run-train")
    code, out, _ = cli(monkeypatch, capsys, "status", "-f", str(spec_file))
    assert code == 0 and "train Running" in out, out
