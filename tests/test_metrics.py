"""The controller's progress as Prometheus metrics: `dflashctl run` with cluster.metrics_port serves
them over HTTP while the pipeline runs, in the text format Prometheus parses."""

from __future__ import annotations

import dataclasses
import math
import re
import time
import urllib.request

import pytest
import yaml
from conftest import free_port
from extracted_chunks import CHUNKS, hidden_chunk, mark_done, token_chunk, write_dataset
from prometheus_client.parser import text_string_to_metric_families
from test_pipeline import SHARDS, FakeBackend, Recorder, make_job, pipeline_work, write_inputs

from dflash_jobs.errors import SpecError
from dflash_jobs.spec import parse_spec

from dflashctl.cli import run as run_command
from dflashctl.cli.main import main
from dflashctl.errors import WaitTimeout
from dflashctl.metrics import MetricsReporter, RunMetrics, with_metrics
from dflashctl.pipeline import StepUpdate


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics, parsed as Prometheus does: (name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
    }


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"run": "pipe", **labels}.items())))]


def test_metrics_follow_the_steps_and_say_nan_for_what_is_not_known():
    metrics = RunMetrics("pipe")
    port = free_port()
    metrics.serve(port)
    before = scrape(port)
    assert math.isnan(value(before, "dflash_chunks_landed")) and math.isnan(value(before, "dflash_extract_eta_seconds"))

    extract = dataclasses.replace(make_job("pipe-extract", completions=3, failed={1}), conditions={})
    metrics.observe(StepUpdate("extract", job=extract, done=5, total=8, tokens_per_s=1234.5, eta_s=60.0))
    during = scrape(port)
    assert value(during, "dflash_step", step="extract") == 1
    assert (value(during, "dflash_chunks_landed"), value(during, "dflash_chunks")) == (5, 8)
    assert value(during, "dflash_extract_tokens_per_second") == 1234.5 and value(during, "dflash_extract_eta_seconds") == 60
    assert value(during, "dflash_failed_shards") == 1
    assert time.time() - value(during, "dflash_progress_timestamp_seconds") < 5

    metrics.observe(StepUpdate("verify", done=3, total=8))
    after = scrape(port)
    assert value(after, "dflash_step", step="extract") == 0 and value(after, "dflash_step", step="verify") == 1
    assert value(after, "dflash_chunks_verified") == 3 and value(after, "dflash_chunks_landed") == 8  # verify runs once all landed
    assert math.isnan(value(after, "dflash_extract_tokens_per_second")) and math.isnan(value(after, "dflash_extract_eta_seconds"))


def test_a_port_in_use_is_a_spec_error_naming_the_field():
    metrics = RunMetrics("pipe")
    port = free_port()
    metrics.serve(port)
    with pytest.raises(SpecError, match="cluster.metrics_port"):
        RunMetrics("pipe").serve(port)


def busy_spec(port: int):
    return parse_spec({"name": "pipe", "target": {"model": "s3://bucket/m"}, "data": {"source": "/d.jsonl"}, "output": "s3://bucket/o", "cluster": {"metrics_port": port}})


def test_a_port_in_use_on_a_laptop_gives_way_to_a_free_one_and_the_reporter_says_which(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    port = free_port()
    RunMetrics("other program").serve(port)
    recorder = Recorder()
    reporter = with_metrics(busy_spec(port), recorder)
    (line,) = recorder.lines
    served = int(re.search(r"Prometheus text on port (\d+)", line).group(1))
    assert served != port and f"port {port} (cluster.metrics_port) is taken here" in line
    reporter.update(StepUpdate("verify", done=1, total=2))
    assert value(scrape(served), "dflash_chunks_verified") == 1


def test_in_a_pod_the_port_is_the_spec_s_the_one_the_controller_job_declares(monkeypatch):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    port = free_port()
    RunMetrics("other program").serve(port)
    with pytest.raises(SpecError, match="cluster.metrics_port"):
        with_metrics(busy_spec(port), Recorder())
    free = free_port()
    recorder = Recorder()
    with_metrics(busy_spec(free), recorder)
    assert recorder.lines == [f"metrics: Prometheus text on port {free} at /metrics"]


def test_a_run_with_another_metrics_port_or_namespace_is_the_same_run(tmp_path, monkeypatch):
    """Changing where the metrics are served (a busy laptop port), where the Jobs live or how many
    local cores and processes the steps take keeps the run: the same spec hash, and <output>/run.yaml accepts it; anything it makes is another run."""
    from dflash_jobs.storage import open_storage
    from test_pipeline import backend_for

    from dflashctl.errors import Conflict
    from dflashctl.pipeline import run_pipeline

    raw = {
        "name": "pipe", "backend": "local", "target": {"model": str(tmp_path / "model"), "layers": [1, 3]},
        "data": {"source": str(tmp_path / "chats.jsonl"), "max_length": 64, "chunk_tokens": 256},
        "output": str(tmp_path / "out"), "extract": {"shards": SHARDS}, "cluster": {"metrics_port": 8000},
    }
    spec = parse_spec(raw)
    storage = open_storage(spec.output)
    run_pipeline(spec, backend_for(pipeline_work(storage)), storage=storage, refresh_s=0.01)
    moved = parse_spec({**raw, "cluster": {"metrics_port": 8001, "namespace": "team-b"}, "local": {"cores": 1, "parallelism": 1}})
    assert moved.fingerprint() == spec.fingerprint()
    result = run_pipeline(moved, backend_for(pipeline_work(storage)), storage=storage, refresh_s=0.01)
    assert result.ran == []  # attached to the finished run: every step found done
    changed = parse_spec({**raw, "extract": {"shards": SHARDS + 1}})
    with pytest.raises(Conflict, match="differs in: extract"):
        run_pipeline(changed, backend_for(pipeline_work(storage)), storage=storage, refresh_s=0.01)


class SlowExtraction(FakeBackend):
    """The extraction Job runs through one wait (the pipeline reports on it), then `on_running` is
    called and every chunk lands."""

    def __init__(self, work, storage, on_running) -> None:
        super().__init__(work)
        self.storage = storage
        self.on_running = on_running
        self.waits = 0

    def wait(self, job_name, *, timeout, on_update=None):
        if job_name == "pipe-extract":
            self.waits += 1
            if self.waits == 1:
                on_update(self.jobs[job_name])
                raise WaitTimeout(f"Job {job_name} still runs")
            self.on_running()
            for chunk in range(CHUNKS):
                mark_done(self.storage, chunk, hidden_chunk(chunk))
            self.jobs[job_name] = make_job(job_name, completions=SHARDS)
        return super().wait(job_name, timeout=timeout, on_update=on_update)


def test_dflashctl_run_serves_the_pipeline_s_progress_while_it_runs(tmp_path, monkeypatch, capsys):
    from dflash_jobs.storage import open_storage

    port = free_port()
    write_inputs(tmp_path)
    raw = {
        "name": "pipe", "backend": "local", "target": {"model": str(tmp_path / "model"), "layers": [1, 3]},
        "data": {"source": str(tmp_path / "chats.jsonl"), "max_length": 64, "chunk_tokens": 256},
        "output": str(tmp_path / "out"), "extract": {"shards": SHARDS}, "local": {"workdir": str(tmp_path / "work")},
        "cluster": {"metrics_port": port},
    }
    spec = parse_spec(raw)
    spec_file = tmp_path / "dflash.yaml"
    spec_file.write_text(yaml.safe_dump(spec.to_dict()))
    storage = open_storage(spec.output)
    work = {k: v for k, v in pipeline_work(storage).items() if k != "manifest_at_train"}
    started = time.time() - 100

    def extraction_underway(attempt):
        write_dataset(storage)
        mark_done(storage, 0, hidden_chunk(0))
        job = make_job("pipe-extract", completions=SHARDS, running=True)
        job.failed_indexes = {1}
        return dataclasses.replace(job, started_at=started)

    work["extract"] = extraction_underway
    seen = []
    backend = SlowExtraction(work, storage, on_running=lambda: seen.append(scrape(port)))
    monkeypatch.setattr(run_command, "open_backend", lambda _: backend)
    monkeypatch.setattr("sys.argv", ["dflashctl", "run", "-f", str(spec_file)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 0, err
    assert f"metrics: Prometheus text on port {port} at /metrics" in err

    (samples,) = seen
    assert value(samples, "dflash_step", step="extract") == 1
    assert (value(samples, "dflash_chunks_landed"), value(samples, "dflash_chunks")) == (1, CHUNKS)
    first_chunk = token_chunk(0).num_tokens
    assert value(samples, "dflash_extract_tokens_per_second") == pytest.approx(first_chunk / 100, rel=0.1)
    rest = sum(token_chunk(c).num_tokens for c in range(1, CHUNKS))
    assert value(samples, "dflash_extract_eta_seconds") == pytest.approx(rest / (first_chunk / 100), rel=0.1)
    assert value(samples, "dflash_failed_shards") == 1


def test_metrics_port_is_checked_with_the_spec():
    raw = {"name": "pipe", "backend": "local", "target": {"model": "/m"}, "data": {"source": "/d.jsonl"}, "output": "/o"}
    assert parse_spec(raw).cluster.metrics_port is None
    for bad in (80, 70000, "9090"):
        with pytest.raises(SpecError, match="cluster.metrics_port"):
            parse_spec({**raw, "cluster": {"metrics_port": bad}})


def test_the_reporter_passes_everything_on():
    recorder = Recorder()
    reporter = MetricsReporter(recorder, RunMetrics("pipe"))
    reporter.say("hello")
    reporter.update(StepUpdate("train"))
    assert recorder.lines == ["hello"] and [u.step for u in recorder.updates] == ["train"]
