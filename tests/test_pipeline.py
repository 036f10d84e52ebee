"""The pipeline's state machine against a fake backend whose Jobs write what their pods would.

What is pinned: training is never submitted before the manifest; a rerun attaches to what exists
and skips what is done; a failed shard gets exactly one retry, then the run fails with exit code 1.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable

import pytest
from extracted_chunks import CHUNKS, LAYERS, hidden_chunk, mark_done, write_dataset

from dflash_jobs.errors import StorageError
from dflash_jobs.formats import DONE_MARKERS, DRAFTER_CONFIG_KEY, EVAL_REPORT_KEY, MANIFEST_KEY, RUN_KEY, done_key, hidden_chunk_key
from dflash_jobs.spec import RunSpec, parse_spec
from dflash_jobs.storage import open_storage

from dflashctl.backend import (
    EVENT_CHUNKS_VERIFIED,
    EVENT_RUN_FAILED,
    EVENT_SHARDS_FAILED,
    EVENT_SHARDS_RETRIED,
    EVENT_TRAINING_LAUNCHED,
    PROGRESS_ANNOTATION,
    JobStatus,
    ShardStatus,
)
from dflashctl.errors import Conflict, RunFailed, WaitTimeout, exit_code
from dflashctl.pipeline import StepUpdate, run_pipeline
from dflashctl.render import SPEC_HASH
from dflashctl.verify import VerificationFailed

SHARDS = 2
REPORT = {"drafters": {"dflash": {"acceptance_length": 3.25, "speedup": 2.1}}, "lossless": True}


def make_job(name: str, *, completions: int = 1, failed: set[int] = frozenset(), running: bool = False) -> JobStatus:
    """A Job at its end (or still running), like make_job_status in jobset's wrappers."""
    completed = set(range(completions)) - set(failed) if not running else set()
    conditions = {} if running else (
        {"Failed": "FailedIndexes: Job has failed indexes"} if failed else {"Complete": "CompletionsReached: done"}
    )
    shards = [
        ShardStatus(index=i, pod=f"{name}-{i}", node="n", attempts=1,
                    phase="Running" if running else ("Failed" if i in failed else "Succeeded"),
                    exit_reason="exit 1 (Error)" if i in failed else None)
        for i in range(completions)
    ]
    return JobStatus(name=name, exists=True, active=completions if running else 0, succeeded=len(completed),
                     failed=len(failed), completed_indexes=completed, failed_indexes=set(failed),
                     conditions=conditions, shards=shards, completions=completions)


class FakeBackend:
    """Jobs that run at submit: `work[component](attempt)` does what the pods would and returns the Job's end."""

    def __init__(self, work: dict[str, Callable[[int], JobStatus]]) -> None:
        self.work = work
        self.jobs: dict[str, JobStatus] = {}
        self.hashes: dict[str, str] = {}
        self.attempts: Counter[str] = Counter()
        self.calls: list[tuple[str, str]] = []
        self.events: list[tuple[str, str]] = []
        self.annotations: dict[tuple[str, str], str] = {}
        self.on_wait: dict[str, Callable[[], None]] = {}
        """A running Job's end, played when it is first waited on."""

    def submit(self, objects: list[dict], *, force: bool = False) -> dict[str, str]:
        outcomes = {}
        for obj in objects:
            if obj["kind"] != "Job":
                continue
            name, spec_hash = obj["metadata"]["name"], obj["metadata"]["annotations"][SPEC_HASH]
            if name in self.jobs:
                if self.hashes[name] != spec_hash and not force:
                    raise Conflict(f"Job {name} exists with another spec")
                self.calls.append(("attach", name))
                outcomes[name] = "attached"
                continue
            component = obj["metadata"]["labels"]["app.kubernetes.io/component"]
            self.calls.append(("submit", name))
            self.hashes[name] = spec_hash
            self.jobs[name] = self.work[component](self.attempts[component])
            self.attempts[component] += 1
            outcomes[name] = "created"
        return outcomes

    def job_status(self, job_name: str) -> JobStatus:
        return self.jobs.get(job_name) or JobStatus(name=job_name, exists=False)

    def wait(self, job_name, *, timeout, on_update=None) -> JobStatus:
        if job_name in self.on_wait:
            self.on_wait.pop(job_name)()
        status = self.job_status(job_name)
        if not status.exists:
            raise RunFailed(f"Job {job_name} does not exist")
        if on_update is not None:
            on_update(status)
        if not status.finished:
            time.sleep(timeout)
            raise WaitTimeout(f"Job {job_name} still runs")
        return status

    def logs(self, job_name, index, follow):
        return iter(())

    def delete(self, job_name: str) -> None:
        self.calls.append(("delete", job_name))
        self.jobs.pop(job_name, None)

    def record_event(self, job_name, reason, message, *, warning=False) -> None:
        self.events.append((job_name, reason))

    def annotate(self, job_name, key, value) -> None:
        self.annotations[(job_name, key)] = value


class Recorder:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.updates: list[StepUpdate] = []

    def say(self, message: str) -> None:
        self.lines.append(message)

    def update(self, update: StepUpdate) -> None:
        self.updates.append(update)


def write_inputs(directory) -> None:
    """What `dflashctl run` checks before it starts anything (its preflight): data.source readable, its
    rows parsing, and the target's checkpoint (config.json deep enough for LAYERS, weights, a tokenizer
    with its chat template, as the chat rows need) in `directory`. The fake backend's Jobs never read them."""
    (directory / "chats.jsonl").write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n')
    model = directory / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text", "num_hidden_layers": max(LAYERS) + 1, "hidden_size": 8}))
    (model / "model.safetensors").write_bytes(b"\0" * 8)
    (model / "tokenizer_config.json").write_text("{}")
    (model / "chat_template.jinja").write_text("{% for message in messages %}{{ message['content'] }}{% endfor %}")


def pipeline_spec(tmp_path, **sections) -> RunSpec:
    """The pipeline tests' run on the local backend, its inputs written to `tmp_path` (write_inputs);
    `sections` replace or add whole sections."""
    write_inputs(tmp_path)
    return parse_spec({
        "name": "pipe",
        "backend": "local",
        "target": {"model": str(tmp_path / "model"), "layers": LAYERS},
        "data": {"source": str(tmp_path / "chats.jsonl"), "max_length": 64, "chunk_tokens": 256},
        "output": str(tmp_path / "out"),
        "extract": {"shards": SHARDS},
        "local": {"workdir": str(tmp_path / "work")},
        **sections,
    })


@pytest.fixture
def spec(tmp_path):
    return pipeline_spec(tmp_path)


@pytest.fixture
def storage(spec):
    return open_storage(spec.output)


def pipeline_work(storage, *, failing_shards: Callable[[int], set[int]] = lambda attempt: set()) -> dict:
    """The four Jobs, doing what their pods do; extraction shards in `failing_shards(attempt)` fail."""
    manifest_at_train: list[bool] = []

    def prepare(attempt):
        write_dataset(storage)
        return make_job("pipe-prepare")

    def extract(attempt):
        failed = failing_shards(attempt)
        for chunk in range(CHUNKS):
            if chunk % SHARDS not in failed and not storage.exists(done_key(chunk)):
                mark_done(storage, chunk, hidden_chunk(chunk))
        return make_job("pipe-extract", completions=SHARDS, failed=failed)

    def train(attempt):
        manifest_at_train.append(storage.exists(MANIFEST_KEY))
        storage.put_bytes(DRAFTER_CONFIG_KEY, b"{}")
        return make_job("pipe-train")

    def evaluate(attempt):
        storage.put_bytes(EVAL_REPORT_KEY, json.dumps(REPORT).encode())
        return make_job("pipe-eval")

    return {"prepare": prepare, "extract": extract, "train": train, "eval": evaluate, "manifest_at_train": manifest_at_train}


def backend_for(work: dict) -> FakeBackend:
    return FakeBackend({k: v for k, v in work.items() if k != "manifest_at_train"})


def test_a_fresh_run_goes_through_every_step_and_trains_only_from_the_manifest(spec, storage):
    work = pipeline_work(storage)
    backend = backend_for(work)
    recorder = Recorder()
    result = run_pipeline(spec, backend, storage=storage, reporter=recorder, refresh_s=0.01)

    assert result.ran == ["prepare", "extract", "verify", "train", "eval"] and result.found_done == []
    assert backend.calls == [("submit", f"pipe-{step}") for step in ("prepare", "extract", "train", "eval")]
    assert work["manifest_at_train"] == [True]
    reasons = [reason for _, reason in backend.events]
    assert reasons.index(EVENT_CHUNKS_VERIFIED) < reasons.index(EVENT_TRAINING_LAUNCHED)
    assert result.manifest is not None and len(result.manifest.chunks) == CHUNKS
    assert result.report == REPORT and "acceptance length 3.25" in recorder.lines[-1]
    assert backend.annotations[("pipe-extract", PROGRESS_ANNOTATION)] == f"{CHUNKS}/{CHUNKS}"
    extract_updates = [u for u in recorder.updates if u.step == "extract"]
    assert extract_updates[-1].done == CHUNKS and extract_updates[-1].total == CHUNKS
    assert [u.done for u in recorder.updates if u.step == "verify"] == list(range(1, CHUNKS + 1))
    assert storage.exists(RUN_KEY)


def test_a_rerun_of_a_finished_run_finds_every_step_done(spec, storage):
    work = pipeline_work(storage)
    run_pipeline(spec, backend_for(work), storage=storage, refresh_s=0.01)
    backend = backend_for(work)
    result = run_pipeline(spec, backend, storage=storage, refresh_s=0.01)
    assert result.ran == [] and result.found_done == ["prepare", "extract", "verify", "train", "eval"]
    assert backend.calls == []


def test_a_rerun_after_a_crash_attaches_to_the_running_extraction(spec, storage):
    """The controller died while extraction ran: the rerun attaches, waits, then goes on."""
    work = pipeline_work(storage)
    write_dataset(storage)
    mark_done(storage, 0, hidden_chunk(0))
    backend = backend_for(work)
    backend.jobs["pipe-extract"] = make_job("pipe-extract", completions=SHARDS, running=True)
    backend.hashes["pipe-extract"] = spec.fingerprint()

    def extraction_ends() -> None:
        for chunk in range(1, CHUNKS):
            mark_done(storage, chunk, hidden_chunk(chunk))
        backend.jobs["pipe-extract"] = make_job("pipe-extract", completions=SHARDS)

    backend.on_wait["pipe-extract"] = extraction_ends
    result = run_pipeline(spec, backend, storage=storage, refresh_s=0.01)
    assert result.found_done == ["prepare"] and result.ran == ["extract", "verify", "train", "eval"]
    assert backend.calls == [("attach", "pipe-extract"), ("submit", "pipe-train"), ("submit", "pipe-eval")]


def test_storage_failing_while_extraction_runs_is_reported_and_outwaited(spec, storage, monkeypatch):
    work = pipeline_work(storage)
    write_dataset(storage)
    backend = backend_for(work)
    backend.jobs["pipe-extract"] = make_job("pipe-extract", completions=SHARDS, running=True)
    backend.hashes["pipe-extract"] = spec.fingerprint()
    real_list, outage = storage.list_modified, iter(range(1))

    def flaky_list(prefix: str = "") -> dict[str, float]:
        if prefix == DONE_MARKERS and next(outage, None) is not None:
            raise StorageError("S3 call failed: SlowDown", "retried calls exhausted their attempts")
        return real_list(prefix)

    def extraction_ends() -> None:
        monkeypatch.setattr(storage, "list_modified", flaky_list)  # the outage starts while the Job runs
        for chunk in range(CHUNKS):
            mark_done(storage, chunk, hidden_chunk(chunk))
        backend.jobs["pipe-extract"] = make_job("pipe-extract", completions=SHARDS)

    backend.on_wait["pipe-extract"] = extraction_ends
    recorder = Recorder()
    result = run_pipeline(spec, backend, storage=storage, reporter=recorder, refresh_s=0.01)
    assert result.ran == ["extract", "verify", "train", "eval"]
    assert any("cannot read progress" in line and "SlowDown" in line for line in recorder.lines)


def test_landed_chunks_are_verified_even_when_the_job_failed(spec, storage):
    """A shard that failed after its chunks landed (e.g. at shutdown) does not hold training back."""
    write_dataset(storage)
    for chunk in range(CHUNKS):
        mark_done(storage, chunk, hidden_chunk(chunk))
    work = pipeline_work(storage)
    backend = backend_for(work)
    backend.jobs["pipe-extract"] = make_job("pipe-extract", completions=SHARDS, failed={1})
    result = run_pipeline(spec, backend, storage=storage, refresh_s=0.01)
    assert result.found_done == ["prepare", "extract"] and "verify" in result.ran
    assert ("submit", "pipe-extract") not in backend.calls and ("delete", "pipe-extract") not in backend.calls


def test_a_rerun_replaces_an_extraction_that_ended_with_chunks_missing(spec, storage):
    """E.g. after `verify --delete-bad`: the Job is Complete, a marker is gone; the rerun extracts it again."""
    write_dataset(storage)
    for chunk in range(CHUNKS - 1):
        mark_done(storage, chunk, hidden_chunk(chunk))
    backend = backend_for(pipeline_work(storage))
    backend.jobs["pipe-extract"] = make_job("pipe-extract", completions=SHARDS)
    backend.hashes["pipe-extract"] = spec.fingerprint()
    result = run_pipeline(spec, backend, storage=storage, refresh_s=0.01)
    assert result.found_done == ["prepare"]
    assert backend.calls[:2] == [("delete", "pipe-extract"), ("submit", "pipe-extract")]
    assert EVENT_SHARDS_RETRIED not in [reason for _, reason in backend.events], "not a retry of this run's failure"


def test_a_failed_shard_is_retried_once_and_the_run_goes_on(spec, storage):
    work = pipeline_work(storage, failing_shards=lambda attempt: {1} if attempt == 0 else set())
    backend = backend_for(work)
    result = run_pipeline(spec, backend, storage=storage, refresh_s=0.01)
    assert result.ran == ["prepare", "extract", "verify", "train", "eval"]
    extract_calls = [call for call in backend.calls if call[1] == "pipe-extract"]
    assert extract_calls == [("submit", "pipe-extract"), ("delete", "pipe-extract"), ("submit", "pipe-extract")]
    reasons = [reason for _, reason in backend.events]
    assert EVENT_SHARDS_FAILED in reasons and EVENT_SHARDS_RETRIED in reasons


def test_a_shard_that_fails_again_fails_the_run_with_exit_code_1(spec, storage):
    work = pipeline_work(storage, failing_shards=lambda attempt: {1})
    backend = backend_for(work)
    with pytest.raises(RunFailed) as caught:
        run_pipeline(spec, backend, storage=storage, refresh_s=0.01)
    assert exit_code(caught.value) == 1
    assert "2/4 chunks landed after 2 attempts" in str(caught.value) and "shard 1: exit 1 (Error)" in str(caught.value)
    assert [call for call in backend.calls if call[1] == "pipe-extract"] == [
        ("submit", "pipe-extract"), ("delete", "pipe-extract"), ("submit", "pipe-extract"),
    ]
    assert ("submit", "pipe-train") not in backend.calls and not storage.exists(MANIFEST_KEY)
    assert ("pipe-extract", EVENT_RUN_FAILED) in backend.events


def test_a_complete_job_without_every_marker_never_starts_training(spec, storage):
    """The Job says Complete, storage says otherwise: storage wins."""
    work = pipeline_work(storage)

    def extract_that_loses_chunk_3(attempt):
        for chunk in range(CHUNKS - 1):
            mark_done(storage, chunk, hidden_chunk(chunk))
        return make_job("pipe-extract", completions=SHARDS)

    work["extract"] = extract_that_loses_chunk_3
    backend = backend_for(work)
    with pytest.raises(RunFailed, match="3/4 chunks landed") as caught:
        run_pipeline(spec, backend, storage=storage, refresh_s=0.01)
    assert work["manifest_at_train"] == [] and ("submit", "pipe-train") not in backend.calls
    # Every shard exited 0 and a chunk is missing: a defect, which running the same pods again would repeat (issue 37, item 5).
    assert "completed (its 2 shard(s) exited 0) with 3/4 chunks landed: its pods left chunks unwritten, a defect to report" in str(caught.value)
    assert [call for call in backend.calls if call[1] == "pipe-extract"] == [("submit", "pipe-extract")]


def test_a_job_found_complete_with_nothing_landed_is_a_defect_not_run_again(spec, storage):
    write_dataset(storage)
    backend = backend_for(pipeline_work(storage))
    backend.jobs["pipe-extract"] = make_job("pipe-extract", completions=SHARDS)
    backend.hashes["pipe-extract"] = spec.fingerprint()
    with pytest.raises(RunFailed) as caught:
        run_pipeline(spec, backend, storage=storage, refresh_s=0.01)
    assert exit_code(caught.value) == 1 and "with 0/4 chunks landed: its pods wrote nothing, a defect to report" in str(caught.value)
    assert "`dflashctl cancel`, then `dflashctl run`" in str(caught.value)
    assert not [call for call in backend.calls if call[1] == "pipe-extract"] and ("pipe-extract", EVENT_RUN_FAILED) in backend.events


def test_a_chunk_that_fails_verification_stops_the_run_before_training(spec, storage):
    work = pipeline_work(storage)
    original = work["extract"]

    def extract_then_corrupt(attempt):
        status = original(attempt)
        storage.put_bytes(hidden_chunk_key(2), storage.get_bytes(hidden_chunk_key(2))[:-1])
        return status

    work["extract"] = extract_then_corrupt
    backend = backend_for(work)
    with pytest.raises(VerificationFailed, match="chunk 000002") as caught:
        run_pipeline(spec, backend, storage=storage, refresh_s=0.01)
    assert exit_code(caught.value) == 1
    assert work["manifest_at_train"] == [] and not storage.exists(MANIFEST_KEY)


def test_an_output_holding_another_spec_is_refused_unless_forced(spec, storage, tmp_path):
    work = pipeline_work(storage)
    run_pipeline(spec, backend_for(work), storage=storage, refresh_s=0.01)
    other = parse_spec({**spec.to_dict(), "train": {**spec.to_dict()["train"], "epochs": 2}})
    with pytest.raises(Conflict, match=r"differs in: train") as caught:
        run_pipeline(other, backend_for(work), storage=storage, refresh_s=0.01)
    assert exit_code(caught.value) == 2
    run_pipeline(other, backend_for(work), storage=storage, force=True, refresh_s=0.01)
    assert b"epochs: 2" in storage.get_bytes(RUN_KEY)


def test_waiting_past_the_timeout_exits_3_and_leaves_the_job_running(spec, storage):
    work = pipeline_work(storage)
    work["prepare"] = lambda attempt: make_job("pipe-prepare", running=True)
    backend = backend_for(work)
    with pytest.raises(WaitTimeout) as caught:
        run_pipeline(spec, backend, storage=storage, timeout=0.2, refresh_s=0.05)
    assert exit_code(caught.value) == 3
    assert backend.calls == [("submit", "pipe-prepare")]


def test_the_run_command_prints_what_it_did_as_json(spec, storage, tmp_path, monkeypatch):
    import yaml
    from typer.testing import CliRunner

    from dflashctl.cli import run as run_command
    from dflashctl.cli.app import app

    spec_file = tmp_path / "dflash.yaml"
    spec_file.write_text(yaml.safe_dump(spec.to_dict()))
    backend = backend_for(pipeline_work(storage))
    monkeypatch.setattr(run_command, "open_backend", lambda _: backend)
    result = CliRunner().invoke(app, ["run", "-f", str(spec_file), "-o", "json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["ran"] == ["prepare", "extract", "verify", "train", "eval"]
    assert body["manifest"]["chunks"] == CHUNKS and body["report"] == REPORT
    assert "extraction: all 4 chunks landed" in result.stderr
