"""S3 outages longer than the client's own retries, met by the pipeline (the in-cluster controller's
code) while it verifies: it waits the outage out with backoff, says so, and finishes; an outage
longer than its patience exits 5, which the controller Job's podFailurePolicy retries, and the next
attempt finishes the run. Only a bad spec or bad input is final. The outage comes from the S3 fault
proxy on loopback (tests/faults/s3_fault_proxy.py) in front of the real S3 server."""

from __future__ import annotations

import pytest
from extracted_chunks import CHUNKS, LAYERS
from faults.s3_fault_proxy import ERROR_500, INVALID_KEY, RESET, S3FaultProxy
from test_pipeline import REPORT, FakeBackend, Recorder, pipeline_work, write_inputs

from dflash_jobs import storage as storage_module
from dflash_jobs.storage import s3 as s3_module
from dflash_jobs.errors import StorageError, StorageUnavailable
from dflash_jobs.formats import MANIFEST_KEY
from dflash_jobs.spec import dump_spec, parse_spec
from dflash_jobs.storage import AccessDenied, BucketNotFound, ObjectNotFound, Patience, open_storage

from dflashctl import pipeline as pipeline_module
from dflashctl.backend import EVENT_CHUNKS_VERIFIED, EVENT_EXTRACTION_FINISHED, EVENT_TRAINING_LAUNCHED, EVENT_VERIFY_FAILED
from dflashctl.cli import run as run_command
from dflashctl.cli.main import main
from dflashctl.errors import EXIT_STORAGE_UNAVAILABLE, exit_code
from dflashctl.local.state import JobPolicy
from dflashctl.pipeline import run_pipeline
from dflashctl.render import WORKER, render_selection

WAITS_BEFORE_RECOVERY = 3


@pytest.fixture
def quick_retries(monkeypatch):
    """The same retries with shorter waits: two client attempts, then our backoff from 50 ms."""
    monkeypatch.setattr(storage_module.open_storage, "__kwdefaults__", {**storage_module.open_storage.__kwdefaults__, "max_attempts": 2})
    monkeypatch.setattr(s3_module, "FIRST_WAIT_S", 0.05)  # Patience's, which waits out S3's outages
    monkeypatch.setattr(s3_module, "LONGEST_WAIT_S", 0.2)
    monkeypatch.setattr(pipeline_module, "OUTAGE_LINE_S", 0.0)  # every wait said

@pytest.fixture
def run_on_s3(s3_server, s3_bucket, tmp_path, monkeypatch, quick_retries):
    """(spec, the pods' storage, the proxy the controller reaches S3 through, a backend whose Jobs
    write what their pods would; the outage starts once extraction is finished, i.e. at verify)."""
    write_inputs(tmp_path)
    spec = parse_spec({
        "name": "outage", "backend": "local",
        "target": {"model": str(tmp_path / "model"), "layers": LAYERS},
        "data": {"source": str(tmp_path / "chats.jsonl"), "max_length": 64, "chunk_tokens": 256},
        "output": f"s3://{s3_bucket}/run", "extract": {"shards": 2},
    })
    pods_storage = open_storage(spec.output)  # the pods reach S3 directly
    proxy = S3FaultProxy(s3_server, seed=0, rate=0.0).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)  # the controller's storage goes through the proxy
    work = pipeline_work(pods_storage)
    backend = OutageAtVerify({k: v for k, v in work.items() if k != "manifest_at_train"}, proxy)
    yield spec, pods_storage, proxy, backend
    proxy.stop()


class OutageAtVerify(FakeBackend):
    """Starts the proxy's outage when the pipeline records that extraction finished: its next
    storage calls are verify's."""

    def __init__(self, work, proxy: S3FaultProxy, kind: str = RESET) -> None:
        super().__init__(work)
        self.proxy = proxy
        self.kind = kind

    def record_event(self, job_name, reason, message, *, warning=False) -> None:
        super().record_event(job_name, reason, message, warning=warning)
        if reason == EVENT_EXTRACTION_FINISHED:
            self.proxy.outage(self.kind)


class RecoversAfterWaits(Recorder):
    """The store comes back after the pipeline has waited for it a few times."""

    def __init__(self, proxy: S3FaultProxy) -> None:
        super().__init__()
        self.proxy = proxy

    def say(self, message: str) -> None:
        super().say(message)
        if message.startswith("storage unavailable") and sum(line.startswith("storage unavailable") for line in self.lines) == WAITS_BEFORE_RECOVERY:
            self.proxy.recover()


# 503 SlowDown is the same class of error (below), but botocore's adaptive mode then throttles the
# client for ~10 s: too slow to repeat here.
@pytest.mark.parametrize("kind", [RESET, ERROR_500])
def test_an_outage_during_verify_is_waited_out_said_and_the_run_finishes(run_on_s3, kind):
    spec, pods_storage, proxy, backend = run_on_s3
    backend.kind = kind
    recorder = RecoversAfterWaits(proxy)
    result = run_pipeline(spec, backend, reporter=recorder, refresh_s=0.01, storage_patience_s=60)

    assert result.ran == ["prepare", "extract", "verify", "train", "eval"] and result.report == REPORT
    assert proxy.injected[kind] >= WAITS_BEFORE_RECOVERY  # the outage really met the controller's calls
    waits = [line for line in recorder.lines if line.startswith("storage unavailable")]
    assert len(waits) == WAITS_BEFORE_RECOVERY and all("trying again in" in line for line in waits)
    reasons = [reason for _, reason in backend.events]
    assert EVENT_VERIFY_FAILED not in reasons
    assert reasons.index(EVENT_CHUNKS_VERIFIED) < reasons.index(EVENT_TRAINING_LAUNCHED)
    assert backend.attempts["train"] == 1 and len(result.manifest.chunks) == CHUNKS
    assert pods_storage.exists(MANIFEST_KEY)


def test_an_outage_longer_than_the_patience_exits_5_and_the_retried_controller_finishes(run_on_s3, tmp_path, monkeypatch, capsys):
    spec, pods_storage, proxy, backend = run_on_s3
    spec_file = tmp_path / "dflash.yaml"
    spec_file.write_text(dump_spec(spec))
    monkeypatch.setattr(run_command, "open_backend", lambda _: backend)
    monkeypatch.setattr(pipeline_module, "STORAGE_PATIENCE_S", 1.0)
    monkeypatch.setattr("sys.argv", ["dflashctl", "run", "-f", str(spec_file)])

    with pytest.raises(SystemExit) as first:
        main()
    err = capsys.readouterr().err
    assert first.value.code == EXIT_STORAGE_UNAVAILABLE, err
    assert "storage unavailable" in err and "still so after 1 s of retries" in err
    assert not pods_storage.exists(MANIFEST_KEY) and backend.attempts["train"] == 0

    # The controller Job retries exit 5 (only 1 and 2 fail it), as Kubernetes would read its policy.
    (controller,) = [obj for obj in render_selection(spec, "controller") if obj["kind"] == "Job"]
    policy = JobPolicy.of(controller, parallelism_cap=None)
    assert policy.failure_action(WORKER, EXIT_STORAGE_UNAVAILABLE)[0] == "Count"
    assert policy.failure_action(WORKER, 1)[0] == policy.failure_action(WORKER, 2)[0] == "FailJob"

    # Its next pod, once the store is back, attaches to what exists and finishes the run.
    proxy.recover()
    with pytest.raises(SystemExit) as second:
        main()
    assert second.value.code == 0, capsys.readouterr().err
    assert pods_storage.exists(MANIFEST_KEY) and backend.attempts == {"prepare": 1, "extract": 1, "train": 1, "eval": 1}


def test_unavailable_is_told_apart_from_refused_and_missing(s3_server, s3_bucket, monkeypatch, quick_retries):
    """Resets and 5xx are transient (exit 5: try again); refused credentials are a setup error
    (exit 2: fix it) and never waited for; a missing object is an answer, not an outage."""
    open_storage(f"s3://{s3_bucket}/run").put_bytes("there", b"x")
    for kind, expected in ((RESET, StorageUnavailable), (ERROR_500, StorageUnavailable), (INVALID_KEY, AccessDenied)):
        with S3FaultProxy(s3_server, seed=0, rate=0.0) as proxy:
            proxy.outage(kind)
            monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
            waits = []
            storage = open_storage(f"s3://{s3_bucket}/run", patience=Patience(0.5, on_wait=lambda error, s: waits.append(s)))
            with pytest.raises(StorageError) as error:
                storage.get_bytes("there")
        assert type(error.value) is expected, (kind, error.value)
        assert exit_code(error.value) == (EXIT_STORAGE_UNAVAILABLE if expected is StorageUnavailable else 2)
        if expected is StorageUnavailable:
            assert waits and sum(waits) <= 0.5 + 1e-6 and "still so after" in str(error.value)
        else:
            assert waits == []  # nothing to wait for: the credentials are wrong
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    with pytest.raises(ObjectNotFound):
        open_storage(f"s3://{s3_bucket}/run", patience=Patience(5.0)).get_bytes("absent")


@pytest.mark.parametrize("code, status, expected", [
    ("SlowDown", 503, StorageUnavailable), ("ServiceUnavailable", 503, StorageUnavailable), ("503", 503, StorageUnavailable),
    ("InternalError", 500, StorageUnavailable), ("RequestTimeout", 400, StorageUnavailable),
    ("AccessDenied", 403, AccessDenied), ("NoSuchBucket", 404, BucketNotFound), ("404", 404, ObjectNotFound),
])
def test_s3_answers_are_classified_by_code_and_status(code, status, expected):
    from botocore.exceptions import ClientError

    answer = ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "HeadObject")
    assert type(s3_module._s3_error(answer, "s3://bucket/run/key")) is expected  # where S3's errors are classified


def test_an_outage_is_said_once_in_a_while_not_once_per_waiting_thread(s3_bucket):
    """verify checks chunks on many threads, and each waits out the same outage: one line says it."""
    spec = parse_spec({"name": "outage", "target": {"model": f"s3://{s3_bucket}/m"}, "data": {"source": "/d.jsonl"}, "output": f"s3://{s3_bucket}/run"})
    recorder = Recorder()
    storage = pipeline_module.patient_storage(spec, recorder, 60)
    for _ in range(16):
        storage.patience.on_wait(StorageUnavailable("cannot reach the S3 endpoint"), 5.0)
    assert recorder.lines == ["storage unavailable (cannot reach the S3 endpoint); trying again in 5 s"]
    assert storage.patience.seconds == 60
