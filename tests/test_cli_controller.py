"""`dflashctl render|submit|status|logs|cancel|retry` end to end: the CLI, the kubernetes backend and a fake API server.

Commands run through `main()`, so the exit codes are the ones of DESIGN section 9.
"""

from __future__ import annotations

import io
import json
import threading
import time
from importlib.metadata import entry_points

import pytest
import yaml
from rich.console import Console
from conftest import free_port
from k8s_fake_api import fake_k8s  # noqa: F401 - the fixture

from dflash_jobs.formats import DATASET_KEY, ChunkInfo, DatasetIndex, DoneMarker, done_key
from dflash_jobs.spec import load_spec, parse_spec
from dflash_jobs.storage import open_storage
from dflashctl.backend import JobStatus, ShardStatus
from dflashctl.backends import open_backend
from dflashctl.cli import status as status_cli
from dflashctl.cli.main import main
from dflashctl.progress import Progress, RateMeter, format_duration, read_progress

CHUNK_TOKENS = 1000
RUN = {
    "name": "demo-run",
    "target": {"model": "/models/tiny"},
    "data": {"source": "s3://bucket/chats.jsonl", "max_length": 256, "chunk_tokens": 1024},
    "extract": {"shards": 3, "backoff_limit_per_index": 1},
}


@pytest.fixture
def run(tmp_path, fake_k8s):  # noqa: F811 - the fixture above
    """A spec file on the fake cluster, storage in a local directory with 4 prepared chunks, 2 landed."""
    output = tmp_path / "out"
    spec_file = tmp_path / "dflash.yaml"
    spec_file.write_text(yaml.safe_dump({**RUN, "output": str(output)}))
    storage = open_storage(str(output))
    chunks = [ChunkInfo(id=i, path=f"tokens/chunks/{i:06d}.safetensors", samples=10, tokens=CHUNK_TOKENS) for i in range(4)]
    storage.put_bytes(DATASET_KEY, DatasetIndex(samples=40, tokens=4 * CHUNK_TOKENS, vocab_size=100, chunks=chunks).to_json().encode())
    for chunk in (0, 2):
        land(storage, chunk)
    return spec_file, storage, fake_k8s.api


def land(storage, chunk):
    marker = DoneMarker(chunk=chunk, samples=10, tokens=CHUNK_TOKENS, bytes=1, sha256="0" * 64, etag=None,
                        dtype="bfloat16", layers=[1], hidden_size=8)
    storage.put_bytes(done_key(chunk), marker.to_json().encode())


def cli(monkeypatch, capsys, *args):
    """Runs `dflashctl ARGS` through main(); returns (exit code, stdout, stderr)."""
    monkeypatch.setattr("sys.argv", ["dflashctl", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


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
    assert code == 0 and "submitted Job demo-run-extract" in err
    assert cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec_file))[0] == 0  # attaches
    api.start("demo-run-extract")
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
    assert report["progress"]["tokens_per_s"] > 0  # averaged since the Job started
    assert report["next"].startswith("extraction: 2/4 chunks landed")
    assert report["jobs"]["train"]["state"] == "not submitted"

    code, out, _ = cli(monkeypatch, capsys, "status", "-f", str(spec_file))
    assert code == 0
    assert "extract Running: 0/3 done, 1 failed (1), 2 active" in out
    assert "  extract[1] Failed pod=demo-run-extract-1-" in out and "exit 42 (Error)" in out
    assert "chunks: 2/4 (50% of tokens)" in out

    # In a terminal: the same facts as a rich table.
    console = Console(file=io.StringIO(), width=140, color_system=None)
    console.print(status_cli.rich_view(status_cli.collect(load_spec(spec_file), open_backend(load_spec(spec_file)), RateMeter())))
    screen = console.file.getvalue()
    assert "extract shards" in screen and "exit 42 (Error)" in screen and "gpu-node-1" in screen
    assert "next: extraction: 2/4 chunks landed" in screen

    code, out, _ = cli(monkeypatch, capsys, "logs", "--shard", "0", "-f", str(spec_file))
    assert code == 0 and out == "chunk 0: 1000 tokens, 5.1K tok/s\n"

    code, _, err = cli(monkeypatch, capsys, "cancel", "-f", str(spec_file))
    assert code == 0 and "deleted Job demo-run-extract" in err
    assert api.all("Job") == [] and api.all("Pod") == []


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
    spec_file, _, api = run
    assert cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec_file))[0] == 0
    uid = api.get("Job", "demo-run-extract")["metadata"]["uid"]
    changed = yaml.safe_load(spec_file.read_text())
    changed["extract"]["shards"] = 4
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
    assert status["next"].startswith("shards 1 failed with chunks missing: `dflashctl logs --shard 1`")

    code, _, err = cli(monkeypatch, capsys, "retry", "-f", str(spec_file))
    assert code == 0 and "resubmitted Job demo-run-extract (failed shards: 1)" in err
    new = api.get("Job", job)
    assert new["metadata"]["uid"] != uid and new["status"].get("conditions") is None
    (event,) = api.all("Event")
    assert event["reason"] == "ShardsRetried" and event["involvedObject"]["uid"] == new["metadata"]["uid"]


def test_status_watch_follows_until_nothing_runs_and_ctrl_c_detaches(run, monkeypatch, capsys):
    spec_file, storage, api = run
    job = "demo-run-extract"
    cli(monkeypatch, capsys, "submit", "extract", "-f", str(spec_file))
    story = iter([
        lambda: api.start(job),
        lambda: (land(storage, 1), api.finish(job, 0)),
        lambda: (land(storage, 3), api.finish(job, 1), api.finish(job, 2)),
    ])
    monkeypatch.setattr(status_cli.time, "sleep", lambda seconds: next(story)())
    code, out, _ = cli(monkeypatch, capsys, "status", "--watch", "-o", "json", "-f", str(spec_file))
    reports = [json.loads(doc) for doc in out.replace("}\n{", "}\x00{").split("\x00")]
    assert code == 0 and len(reports) == 4
    assert [r["progress"]["chunks_done"] for r in reports] == [2, 2, 3, 4]
    assert reports[-1]["jobs"]["extract"]["state"] == "Complete"
    assert reports[-1]["next"].startswith("every chunk landed: `dflashctl verify`")

    api.delete("Job", job)
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


def test_a_missing_spec_file_is_bad_usage(monkeypatch, capsys, tmp_path):
    code, _, err = cli(monkeypatch, capsys, "status", "-f", str(tmp_path / "nope.yaml"))
    assert code == 2 and "dflashctl init" in err


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


def test_progress_counts_landed_chunks_and_the_rate_gives_an_eta(run):
    _, storage, _ = run
    progress = read_progress(storage)
    assert (progress.chunks_done, progress.chunks_total, progress.tokens_done, progress.tokens_total) == (2, 4, 2000, 4000)
    assert progress.label == "2/4" and not progress.landed
    clock = iter([100.0, 200.0, 1000.0])
    meter = RateMeter(window_s=600, clock=lambda: next(clock))
    meter.observe(progress)
    assert meter.tokens_per_s is None
    meter.observe(Progress(chunks_done=3, chunks_total=4, tokens_done=3000, tokens_total=4000))
    assert meter.tokens_per_s == 10.0 and meter.eta_s(Progress(3, 4, 3000, 4000)) == 100.0
    meter.observe(Progress(chunks_done=4, chunks_total=4, tokens_done=4000, tokens_total=4000))
    assert meter.tokens_per_s == pytest.approx(1000 / 800)  # the point at t=100 left the window
    assert format_duration(3725) == "1h02m" and format_duration(None) == "-"
