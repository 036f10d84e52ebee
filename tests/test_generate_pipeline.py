"""Generation in the control plane: `dflashctl run` chains it before prepare, `status` shows prompts
answered, tokens/s and ETA, `plan` bills it. The pipeline runs against test_pipeline's fake backend,
whose generate Job lands chunks and markers as the pods write them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner
from cli_runner import cli
from test_pipeline import FakeBackend, Recorder, make_job, pipeline_spec, pipeline_work

from dflash_jobs.generation import (
    MANIFEST_KEY, PLAN_KEY, TRUNCATED, ChunkMarker, GenerationPlan, SourceChunk, chunk_key, done_key, generation_settings,
    settings_hash, write_manifest_if_complete,
)
from dflash_jobs.spec import parse_spec
from dflash_jobs.storage import open_storage

from dflashctl.backend import EVENT_RUN_FAILED, EVENT_SHARDS_FAILED, EVENT_SHARDS_RETRIED, PROGRESS_ANNOTATION
from dflashctl.cli import run as run_command
from dflashctl.cli import status as status_cli
from dflashctl.cli.app import app
from dflashctl.errors import RunFailed, exit_code
from dflashctl.pipeline import EVENT_GENERATION_FINISHED, run_pipeline

PROMPTS_PER_CHUNK = 3
GENERATION_CHUNKS = 2
TOKENS_PER_ANSWER = 40


@pytest.fixture
def spec(tmp_path):
    return pipeline_spec(
        tmp_path,
        data={"source": str(tmp_path / "chats.jsonl"), "max_length": 64, "chunk_tokens": 256, "holdout": 2},
        extract={"shards": 2},
        generate={"shards": 2, "chunk_prompts": PROMPTS_PER_CHUNK},
    )


@pytest.fixture
def storage(spec):
    return open_storage(spec.output)


def plan_generation(storage, spec) -> GenerationPlan:
    chunks = [SourceChunk(id=i, first_line=i * PROMPTS_PER_CHUNK, lines=PROMPTS_PER_CHUNK, offset=i * 300, size=300, weight=100)
              for i in range(GENERATION_CHUNKS)]
    plan = GenerationPlan(source=spec.data.source, source_size=300 * GENERATION_CHUNKS, chunk_prompts=PROMPTS_PER_CHUNK, chunks=chunks)
    storage.put_bytes(PLAN_KEY, plan.to_json().encode())
    return plan


def land(storage, spec, chunk: int, *, seconds: float = 10.0, kept: int = PROMPTS_PER_CHUNK) -> None:
    """What a generation pod stores for one chunk: its rows, then its marker. The first `kept`
    prompts keep their answer; the others' were cut at the limit and dropped (generate.truncated: drop)."""
    first = chunk * PROMPTS_PER_CHUNK
    rows = [{"sample_id": first + i, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
            for i in range(kept)]
    stored = storage.put_bytes(chunk_key(chunk), "".join(json.dumps(r) + "\n" for r in rows).encode())
    marker = ChunkMarker(
        chunk=chunk, first_line=first, lines=PROMPTS_PER_CHUNK, rows=kept, bytes=stored.size, sha256=stored.sha256,
        etag=stored.etag, settings=settings_hash(generation_settings(spec)), completion_tokens=PROMPTS_PER_CHUNK * TOKENS_PER_ANSWER,
        seconds=seconds, engine="vllm", dropped={TRUNCATED: PROMPTS_PER_CHUNK - kept} if kept < PROMPTS_PER_CHUNK else {},
    )
    storage.put_bytes(done_key(chunk), marker.to_json().encode())


def generation_work(storage, spec, *, failing_shards=lambda attempt: set(), kept: int = PROMPTS_PER_CHUNK,
                    bad_input_shards: set[int] = frozenset()) -> dict:
    """The pipeline's Jobs with a generate Job whose failing shards land nothing (shard i owns chunk
    i) and whose `bad_input_shards` land their chunk, then fail (a pod exiting 42)."""
    work = pipeline_work(storage)
    work.pop("manifest_at_train")

    def generate(attempt):
        plan_generation(storage, spec)
        failed = failing_shards(attempt)
        for chunk in range(GENERATION_CHUNKS):
            if chunk not in failed:
                land(storage, spec, chunk, kept=kept)
        return make_job("pipe-generate", completions=2, failed=failed | bad_input_shards)

    prepare = work["prepare"]

    def prepare_after_generation(attempt):
        assert storage.exists(MANIFEST_KEY), "prepare ran before the generation manifest existed"
        return prepare(attempt)

    return {**work, "generate": generate, "prepare": prepare_after_generation}


def test_run_generates_before_prepare_and_writes_the_manifest(spec, storage):
    backend = FakeBackend(generation_work(storage, spec))
    recorder = Recorder()
    result = run_pipeline(spec, backend, storage=storage, reporter=recorder, refresh_s=0.01)
    assert result.ran == ["generate", "prepare", "extract", "verify", "train", "eval"]
    assert backend.calls[:2] == [("submit", "pipe-generate"), ("submit", "pipe-prepare")]
    manifest = json.loads(storage.get_bytes(MANIFEST_KEY))
    assert manifest["rows"] == manifest["lines"] == GENERATION_CHUNKS * PROMPTS_PER_CHUNK
    assert ("pipe-generate", EVENT_GENERATION_FINISHED) in backend.events
    assert backend.annotations[("pipe-generate", PROGRESS_ANNOTATION)] == f"{GENERATION_CHUNKS}/{GENERATION_CHUNKS}"
    updates = [u for u in recorder.updates if u.step == "generate"]
    assert (updates[-1].done, updates[-1].total) == (6, 6)
    assert any(line.startswith("generation: 6 of 6 prompts answered (240 tokens generated)") for line in recorder.lines)
    # Run again: generation is found done, as every other step.
    again = FakeBackend(generation_work(storage, spec))
    assert run_pipeline(spec, again, storage=storage, refresh_s=0.01).found_done[0] == "generate" and again.calls == []


def test_a_failed_generation_shard_is_retried_once_then_fails_the_run(spec, storage):
    backend = FakeBackend(generation_work(storage, spec, failing_shards=lambda attempt: {1} if attempt == 0 else set()))
    result = run_pipeline(spec, backend, storage=storage, refresh_s=0.01)
    assert result.ran[0] == "generate"
    assert [c for c in backend.calls if c[1] == "pipe-generate"] == [("submit", "pipe-generate"), ("delete", "pipe-generate"), ("submit", "pipe-generate")]
    reasons = [reason for name, reason in backend.events if name == "pipe-generate"]
    assert EVENT_SHARDS_FAILED in reasons and EVENT_SHARDS_RETRIED in reasons

    storage_b = open_storage(spec.output + "-b")
    spec_b = parse_spec({**spec.to_dict(), "output": spec.output + "-b"})
    failing = FakeBackend(generation_work(storage_b, spec_b, failing_shards=lambda attempt: {1}))
    with pytest.raises(RunFailed) as caught:
        run_pipeline(spec_b, failing, storage=storage_b, refresh_s=0.01)
    assert exit_code(caught.value) == 1
    assert "generation ended with 1/2 chunks landed after 2 attempts" in str(caught.value)
    assert not storage_b.exists(MANIFEST_KEY) and ("submit", "pipe-prepare") not in failing.calls


def test_a_manifest_of_other_settings_is_generated_again(spec, storage):
    plan_generation(storage, spec)
    older = parse_spec({**spec.to_dict(), "generate": {**spec.to_dict()["generate"], "temperature": 0.2}})
    for chunk in range(GENERATION_CHUNKS):
        land(storage, older, chunk)
    assert write_manifest_if_complete(storage, older).settings["temperature"] == 0.2  # the older spec's manifest
    backend = FakeBackend(generation_work(storage, spec))
    result = run_pipeline(spec, backend, storage=storage, refresh_s=0.01)
    assert result.ran[0] == "generate" and backend.calls[0] == ("submit", "pipe-generate")
    assert json.loads(storage.get_bytes(MANIFEST_KEY))["settings"]["temperature"] == spec.generate.temperature


def test_generation_that_keeps_too_few_rows_stops_the_run_naming_the_settings_and_a_rerun_stops_again(
    spec, storage, tmp_path, monkeypatch, capsys,
):
    """The repro of a new user: answers cut at the limit and dropped (generate.truncated: drop) leave
    2 of 6 rows, no more than data.holdout = 2. The run stops after generation with the bad-input
    exit code, naming the drops and the settings, not in prepare blaming the hold-out; run again
    unchanged, it stops there again at once; status says the same."""
    spec_file = tmp_path / "dflash.yaml"
    spec_file.write_text(yaml.safe_dump(spec.to_dict()))
    # The shard that writes the manifest exits 42 (bad input): the Job fails with every chunk landed.
    backend = FakeBackend(generation_work(storage, spec, kept=1, bad_input_shards={1}))
    monkeypatch.setattr(run_command, "open_backend", lambda _: backend)
    monkeypatch.setattr(status_cli, "open_backend", lambda _: backend)
    code, _, err = cli(monkeypatch, capsys, "run", "-f", str(spec_file))
    assert code == 2, err
    assert ("Error: generation kept 2 of 6 lines of data.source, and prepare holds out the last data.holdout = 2 for "
            "evaluation, leaving nothing to train on; dropped: truncated 4 (answers cut at generate.max_new_tokens = 2048 "
            "or at data.max_length, dropped by generate.truncated: drop). Change the spec: set generate.truncated: keep or "
            "raise generate.max_new_tokens, or lower data.holdout; then `dflashctl run --force`") in err
    assert "warning: generation dropped 4 of 6 lines (67%)" in err
    assert [c for c in backend.calls if c[1] != "pipe-generate"] == []  # prepare never started
    assert ("pipe-generate", EVENT_RUN_FAILED) in backend.events
    calls = list(backend.calls)
    code, _, again = cli(monkeypatch, capsys, "run", "-f", str(spec_file))
    assert code == 2 and "Error: generation kept 2 of 6 lines of data.source" in again
    assert backend.calls == calls  # from the manifest, at once: nothing submitted
    code, out, _ = cli(monkeypatch, capsys, "status", "-f", str(spec_file))
    assert code == 0
    assert "step: generate" in out and "done (generate/manifest.json): 2 rows kept" in out
    assert "warning: generation dropped 4 of 6 lines (67%): truncated 4" in out
    assert "next: generation kept 2 of 6 lines of data.source" in out and "lower data.holdout" in out


def test_generation_that_drops_over_a_quarter_says_so_in_run_and_status_and_goes_on(spec, storage, tmp_path, monkeypatch, capsys):
    spec_file = tmp_path / "dflash.yaml"
    spec_file.write_text(yaml.safe_dump(spec.to_dict()))
    backend = FakeBackend(generation_work(storage, spec, kept=2))  # 4 of 6 kept: enough to train on, 33% dropped
    monkeypatch.setattr(run_command, "open_backend", lambda _: backend)
    code, out, err = cli(monkeypatch, capsys, "run", "-f", str(spec_file), "-o", "json")
    assert code == 0, err
    warning = ("generation dropped 2 of 6 lines (33%): truncated 2 (answers cut at generate.max_new_tokens = 2048 or at "
               "data.max_length, dropped by generate.truncated: drop)")
    assert json.loads(out)["warnings"] == [warning]
    assert err.count(f"warning: {warning}") == 2  # when generation ended, and again below the run's summary
    report = status_cli.collect(spec, backend)
    assert f"warning: {warning}" in status_cli.plain_lines(report)
    body = status_cli.report_json(report)["generation"]
    assert (body["rows"], body["dropped"], body["warning"], body["error"]) == (4, {TRUNCATED: 2}, warning, None)
    # A quarter or less is not worth a warning.
    land(storage, spec, 0, kept=PROMPTS_PER_CHUNK)
    storage.delete(MANIFEST_KEY)
    assert write_manifest_if_complete(storage, spec).drop_warning() is None


def test_status_shows_prompts_answered_tokens_per_second_and_what_comes_next(spec, storage):
    backend = FakeBackend({})
    job = make_job("pipe-generate", completions=2, running=True)
    job.started_at = time.time() - 100
    backend.jobs["pipe-generate"] = job
    plan_generation(storage, spec)
    markers: dict = {}
    report = status_cli.collect(spec, backend, markers)
    assert status_cli.generation_line(report) == "generation: 0/2 chunks, 0/6 prompts (0%), - generated, ETA -"
    assert report.next_step == "generation: 0/2 chunks landed; prepare follows once all have" and report.step == "generate"
    land(storage, spec, 0)
    report = status_cli.collect(spec, backend, markers)
    # 120 tokens and 3 prompts landed in the 100 s since the Job started: 3 prompts left at 0.03/s.
    assert report.generation_tokens_per_s == pytest.approx(1.2, rel=0.05)
    assert report.generation_eta_s == pytest.approx(100, rel=0.05)
    assert status_cli.generation_line(report).startswith("generation: 1/2 chunks, 3/6 prompts (50%), 1 tok/s generated, ETA 1m")
    body = status_cli.report_json(report)["generation"]
    assert (body["prompts_done"], body["prompts_total"], body["completion_tokens"], body["done"]) == (3, 6, 120, False)
    assert list(markers) == [done_key(0)]  # read once, kept for the next look
    # A chunk an earlier Job left gets no credit in this Job's rate.
    job.started_at = time.time() + 1
    assert status_cli.collect(spec, backend, markers).generation_tokens_per_s is None
    backend.jobs["pipe-generate"] = make_job("pipe-generate", completions=2, failed={1})
    report = status_cli.collect(spec, backend)
    assert report.next_step == "generation shards 1 failed with chunks missing: `dflashctl logs generate --shard 1`, then `dflashctl retry generate`"
    land(storage, spec, 1)
    report = status_cli.collect(spec, backend)
    assert report.next_step.startswith("every generation chunk landed: `dflashctl run` writes generate/manifest.json")
    assert any(line.startswith("generation: 2/2 chunks") for line in status_cli.plain_lines(report))
    # A spec without generation shows none of it.
    plain = parse_spec({k: v for k, v in spec.to_dict().items() if k != "generate"})
    assert status_cli.collect(plain, FakeBackend({})).generation is None


# ---- plan ----------------------------------------------------------------------------------------


def plan_json(*args: str) -> dict:
    result = CliRunner().invoke(app, ["plan", *args, "-o", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_plan_bills_generation_from_the_source_then_from_what_chunks_measured(spec, storage, tmp_path):
    spec_file = tmp_path / "dflash.yaml"
    spec_file.write_text(yaml.safe_dump(spec.to_dict()))
    line = json.dumps({"messages": [{"role": "user", "content": "q" * 90}]}) + "\n"
    Path(spec.data.source).write_text(line * 500)
    # Before generation: the source's lines, each answer at most max_new_tokens long; no rate yet.
    cost = plan_json("-f", str(spec_file))["generation"]
    assert (cost["prompts"], cost["prompts_estimated"], cost["upper_bound"]) == (500, False, True)
    assert cost["tokens"] == 500 * 2048 and cost["gpu_hours"] is None and "--generate-tokens-per-second" in cost["rate_basis"]
    cost = plan_json("-f", str(spec_file), "--generate-tokens-per-second", "1000")["generation"]
    assert cost["gpu_hours"] == pytest.approx(500 * 2048 / 1000 / 3600)
    assert cost["wall_clock_hours"] == pytest.approx(cost["gpu_hours"] / 2)  # 2 shards x 1 GPU
    # A source larger than the sample: lines per byte of its first MiB.
    Path(spec.data.source).write_text(line * 20_000)
    cost = plan_json("-f", str(spec_file))["generation"]
    assert cost["prompts_estimated"] and cost["prompts"] == pytest.approx(20_000, rel=0.01)
    # Once chunks are done: the planned prompts, the measured answer length and rate (10 s per chunk).
    plan_generation(storage, spec)
    land(storage, spec, 0)
    cost = plan_json("-f", str(spec_file))["generation"]
    assert (cost["prompts"], cost["prompts_estimated"], cost["tokens_per_prompt"]) == (6, False, TOKENS_PER_ANSWER)
    assert cost["tokens"] == 6 * TOKENS_PER_ANSWER and not cost["upper_bound"]
    assert cost["tokens_per_second_per_gpu"] == pytest.approx(PROMPTS_PER_CHUNK * TOKENS_PER_ANSWER / 10.0)
    table = CliRunner().invoke(app, ["plan", "-f", str(spec_file)])
    assert "tokens to generate" in table.stdout and "measured by this run" in table.stderr
    assert plan_json("-f", str(spec_file), "--generate-tokens-per-second", "1")["generation"]["tokens_per_second_per_gpu"] == 1
