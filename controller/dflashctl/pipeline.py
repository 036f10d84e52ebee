"""`dflashctl run`: [generate,] prepare, extract, verify, train, eval; run again after a crash, it goes on.

Each step first looks at what exists, in storage and on the backend, and does only what is missing:

    step     done when                               otherwise
    generate generate/manifest.json exists with      the generate Job (only with a generate section):
             the spec's generation settings          attached to, replaced once like extract's; the
                                                     manifest is written once every chunk landed;
                                                     either way, one that keeps no more rows than
                                                     data.holdout fails the run (bad input: 2)
    prepare  tokens/dataset.json exists              the prepare Job
    extract  every chunk has its done marker         the extract Job (attached to when it runs); a Job
                                                     that ended with chunks missing is replaced once
                                                     (shards skip the chunks that landed)
    verify   extract/manifest.json exists            every chunk against its marker -> the manifest
    train    train/drafter/config.json exists        the train Job, only once the manifest exists (and
                                                     holds the target's final hidden state if the drafter
                                                     reads it: else bad input, 2)
    eval     eval/report.json exists                 the eval Job

With train.states: online there is no extract and no verify step (RunSpec.steps): the train Job
runs the target itself on prepare's token chunks; an output that already holds verified stored
states is refused (bad spec: 2), as training from them needs no target forward.

Storage decides, never a Job's Complete: with backoffLimitPerIndex one failed index fails the
whole Job although its chunks may have landed, and a Complete Job proves nothing about its
objects. The same code runs in a terminal and as the in-cluster controller Job, on either backend.

A run lasts days, and storage has outages: every storage call waits one out (STORAGE_PATIENCE_S,
with backoff, said in the log), and past that the run exits 5, which the controller Job retries;
only a bad spec or bad input (2) and a failed step (1) are final.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from dflash_jobs.errors import SpecError, StorageError, StorageUnavailable
from dflash_jobs.formats import DATASET_KEY, DRAFTER_CONFIG_KEY, EVAL_REPORT_KEY, MANIFEST_KEY, DatasetIndex, Manifest, check_final_hidden
from dflash_jobs.generation import ChunkMarker, GenerationProgress, current_manifest, write_manifest_if_complete
from dflash_jobs.generation import read_progress as read_generation_progress
from dflash_jobs.spec import RunSpec
from dflash_jobs.storage import ObjectNotFound, Patience, Storage, storage_for

from dflashctl.backend import (
    EVENT_CHUNKS_VERIFIED,
    EVENT_EVALUATION_DONE,
    EVENT_EXTRACTION_FINISHED,
    EVENT_RUN_FAILED,
    EVENT_SHARDS_FAILED,
    EVENT_SHARDS_RETRIED,
    EVENT_TRAINING_FINISHED,
    EVENT_TRAINING_LAUNCHED,
    EVENT_VERIFY_FAILED,
    PROGRESS_ANNOTATION,
    SUBMITTED,
    Backend,
    JobStatus,
    format_indexes,
)
from dflashctl.errors import RunFailed, WaitTimeout
from dflashctl.identity import claim_output
from dflashctl.progress import generation_rates, generation_time_left, landing_rate, read_progress, time_left
from dflashctl.render import job_name, render_selection
from dflashctl.verify import Expected, VerificationFailed, read_manifest, verify_run

SHARDED_JOB_RETRIES = 1
"""Times a failed extract or generate Job is replaced within one `run` before it fails (each `run` starts afresh)."""
EVENT_GENERATION_FINISHED = "GenerationFinished"
REFRESH_S = 10.0
"""How often progress is read from storage while a Job runs."""
STORAGE_PATIENCE_S = 900.0
"""How long one storage call waits out an outage before the run exits 5 (and is run again)."""
OUTAGE_LINE_S = 30.0
"""At most one "storage unavailable" line this often: verify's many threads all wait at once."""


@dataclass(frozen=True, slots=True)
class StepUpdate:
    """Where the current step is: its Job, for extract and verify the chunks done of total, for
    generate the prompts done of total (tokens/s: generated tokens)."""

    step: str
    job: JobStatus | None = None
    done: int | None = None
    total: int | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None


class Reporter(Protocol):
    """Where the pipeline tells people what it does (the CLI draws it on stderr)."""

    def say(self, message: str) -> None:
        """A milestone, one line."""

    def update(self, update: StepUpdate) -> None:
        """Live progress of the current step."""


class Silent:
    """A Reporter for callers that only want the result."""

    def say(self, message: str) -> None:
        pass

    def update(self, update: StepUpdate) -> None:
        pass


@dataclass(slots=True)
class PipelineResult:
    ran: list[str] = field(default_factory=list)
    """Steps this invocation did."""
    found_done: list[str] = field(default_factory=list)
    """Steps already done by an earlier invocation (or by hand)."""
    manifest: Manifest | None = None
    report: dict[str, Any] | None = None
    """eval/report.json."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time of each step this invocation did, Job start-up included."""
    warnings: list[str] = field(default_factory=list)
    """What the run went on despite, worth a look: generation that dropped a large share of the lines."""


def run_pipeline(
    spec: RunSpec,
    backend: Backend,
    *,
    storage: Storage | None = None,
    reporter: Reporter | None = None,
    force: bool = False,
    timeout: float | None = None,
    refresh_s: float = REFRESH_S,
    storage_patience_s: float | None = None,
) -> PipelineResult:
    """Runs what is missing of the run, step by step; see the module docstring.

    `force` replaces a run.yaml and Jobs left by a different spec under this name. `timeout` bounds
    the whole call (WaitTimeout; the Jobs go on). Raises RunFailed when a step fails, and
    StorageUnavailable when storage stays unavailable for `storage_patience_s`."""
    reporter = reporter or Silent()
    storage = storage or patient_storage(spec, reporter, storage_patience_s)
    pipeline = Pipeline(spec, backend, storage, reporter, force=force, timeout=timeout, refresh_s=refresh_s)
    return pipeline.run()


def run_eval(
    spec: RunSpec,
    backend: Backend,
    *,
    storage: Storage | None = None,
    reporter: Reporter | None = None,
    timeout: float | None = None,
    refresh_s: float = REFRESH_S,
    storage_patience_s: float | None = None,
) -> dict[str, Any]:
    """`dflashctl eval`: evaluate the trained drafter (or attach to the evaluation that runs); the report."""
    reporter = reporter or Silent()
    storage = storage or patient_storage(spec, reporter, storage_patience_s)
    pipeline = Pipeline(spec, backend, storage, reporter, force=False, timeout=timeout, refresh_s=refresh_s)
    if not pipeline.storage.exists(DRAFTER_CONFIG_KEY):
        raise RunFailed(
            f"{pipeline.storage.url}/{DRAFTER_CONFIG_KEY} does not exist: there is no trained drafter to evaluate",
            "Train it first: `dflashctl run`",
        )
    pipeline.job_step("eval", EVAL_REPORT_KEY)
    return pipeline.read_report()


def patient_storage(spec: RunSpec, reporter: Reporter, patience_s: float | None) -> Storage:
    """The run's storage, its calls waiting out an outage of up to `patience_s` (None:
    STORAGE_PATIENCE_S), the waits said (one line every OUTAGE_LINE_S at most)."""
    said = [float("-inf")]
    lock = threading.Lock()

    def waiting(error: StorageUnavailable, seconds: float) -> None:
        with lock:
            if time.monotonic() - said[0] < OUTAGE_LINE_S:
                return
            said[0] = time.monotonic()
        reporter.say(f"storage unavailable ({error.what}); trying again in {seconds:.0f} s")

    return storage_for(spec, patience=Patience(STORAGE_PATIENCE_S if patience_s is None else patience_s, on_wait=waiting))


class Pipeline:
    """One invocation of the pipeline: the steps, and how to wait for and report on their Jobs."""

    def __init__(self, spec: RunSpec, backend: Backend, storage: Storage, reporter: Reporter, *,
                 force: bool, timeout: float | None, refresh_s: float) -> None:
        self.spec = spec
        self.backend = backend
        self.storage = storage
        self.reporter = reporter
        self.force = force
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.timeout = timeout
        self.refresh_s = refresh_s
        self.progress_labels: dict[str, str] = {}
        """The dflash.dev/progress annotation last set on each step's Job."""
        self.generation_markers: dict[str, ChunkMarker] = {}
        """Generation's done markers read so far (each once: they do not change)."""

    def run(self) -> PipelineResult:
        result = PipelineResult()
        self.record_spec()
        actions: dict[str, Callable[[], bool]] = {
            "generate": lambda: self.generate(result),
            "prepare": lambda: self.step_unless_stored("prepare", DATASET_KEY),
            "extract": self.extract,
            "verify": self.verify,
            "train": self.train,
            "eval": lambda: self.step_unless_stored("eval", EVAL_REPORT_KEY),
        }
        for step, do in [(step, actions[step]) for step in self.spec.steps]:
            started = time.monotonic()
            if do():
                result.ran.append(step)
                result.seconds[step] = time.monotonic() - started
            else:
                result.found_done.append(step)
        result.manifest = read_manifest(self.storage)
        result.report = self.read_report()
        self.reporter.say(f"run {self.spec.name} is done: {summarize_report(result.report)}")
        return result

    # ---- the steps; each returns True when it did something, False when it found it done ------

    def record_spec(self) -> None:
        """<output>/run.yaml: the first run writes it; a different spec later is refused (or --force)."""
        claim_output(self.storage, self.spec, force=self.force, say=self.reporter.say)

    def step_unless_stored(self, step: str, output_key: str) -> bool:
        if self.storage.exists(output_key):
            return False
        self.job_step(step, output_key)
        return True

    def run_sharded_job(
        self, component: str, *, what: str, details: str, landed: Callable[[], bool], progress: Callable[[], ChunkCount]
    ) -> JobStatus | None:
        """Runs the Indexed Job of `component` (extract, generate) until every chunk has landed.

        A Job that failed with chunks missing, earlier in this run or before it, is replaced once
        (landed chunks are skipped). One that completed (every shard exited 0) with chunks missing is
        not run again blindly: seen completing in this run, or with none of its chunks, it is a defect
        (RunFailed, see `completed_without_chunks`); found so with some of them, the rest were deleted
        since (`verify --delete-bad`) and it is replaced. Returns the last Job's status, None when every
        chunk had landed before this run; raises RunFailed when the last attempt still left chunks
        missing. `landed` and `progress` read storage: whether every chunk is there, and how many are."""
        name = job_name(self.spec, component)
        status: JobStatus | None = None
        for attempt in range(1 + SHARDED_JOB_RETRIES):
            if landed():
                break
            current = self.backend.job_status(name)
            if current.exists and current.finished:
                seen = progress()
                if current.complete and (attempt or not seen.chunks_done):
                    raise self.failure(name, *completed_without_chunks(component, current, seen))
                if attempt:
                    self.backend.record_event(
                        name, EVENT_SHARDS_RETRIED, f"{seen.label} chunks landed; replacing the Job once (landed chunks are skipped)", warning=True,
                    )
                why = "completed, and the missing chunks were deleted since" if current.complete else "ended"
                self.reporter.say(f"{component} Job {name} {why} with {seen.label} chunks landed: submitting it again")
                self.backend.delete(name)
            outcome = self.backend.submit(render_selection(self.spec, component), force=self.force)[name]
            self.reporter.say(f"{component}: {SUBMITTED[outcome]} Job {name} ({details})")
            status = self.wait(component, name)
            if status.failed_terminally:
                self.backend.record_event(name, EVENT_SHARDS_FAILED, describe(status), warning=True)
        else:  # every attempt is spent: did the last one land everything?
            if not landed():
                seen = progress()
                if status is not None and status.complete:
                    raise self.failure(name, *completed_without_chunks(component, status, seen))
                raise self.failure(
                    name,
                    f"{what} ended with {seen.label} chunks landed after {1 + SHARDED_JOB_RETRIES} attempts: {describe(status)}",
                    f"`dflashctl logs {component} --shard N` shows why a shard failed; fix it and `dflashctl run` again "
                    "(landed chunks are kept)",
                )
        return status

    def generate(self, result: PipelineResult) -> bool:
        """Generates the answers unless generate/manifest.json of these settings exists; either way
        the manifest must keep enough rows to train on (InputError naming the settings that drop them)."""
        name = job_name(self.spec, "generate")
        manifest = current_manifest(self.storage, self.spec)
        found = "found done" if manifest is not None else "every chunk had landed"  # said when no Job ran now
        status = None
        if manifest is None:
            status = self.run_sharded_job(
                "generate", what="generation", details=f"{self.spec.generate.shards} shards, engine {self.spec.generate.engine}",
                landed=lambda: write_manifest_if_complete(self.storage, self.spec) is not None,
                progress=self.generation_progress,
            )
            manifest = current_manifest(self.storage, self.spec)
            assert manifest is not None
        dropped = ", ".join(f"{reason} {count}" for reason, count in manifest.dropped.items()) or "none"
        message = (f"{manifest.rows} of {manifest.lines} prompts answered ({manifest.completion_tokens:,} tokens generated); "
                   f"dropped: {dropped}; truncated answers kept: {manifest.truncated_kept}")
        self.reporter.say(f"generation: {message}" if status is not None else f"generation: {found}; {message}")
        warning = manifest.drop_warning()
        if warning:
            result.warnings.append(warning)
            self.reporter.say(f"warning: {warning}")
        too_few = manifest.too_few_rows(self.spec.data.holdout)
        if too_few is not None:
            self.backend.record_event(name, EVENT_RUN_FAILED, too_few.what, warning=True)
            raise too_few
        if status is None:
            return False
        self.backend.record_event(name, EVENT_GENERATION_FINISHED, message)
        return True

    def generation_progress(self) -> GenerationProgress:
        return read_generation_progress(self.storage, self.spec, self.generation_markers)

    def extract(self) -> bool:
        status = self.run_sharded_job(
            "extract", what="extraction", details=f"{self.spec.extract.shards} shards",
            landed=lambda: read_progress(self.storage).landed, progress=lambda: read_progress(self.storage),
        )
        if status is None:
            return False  # every chunk had landed before this run
        chunks = read_progress(self.storage).chunks_total
        self.backend.record_event(job_name(self.spec, "extract"), EVENT_EXTRACTION_FINISHED, f"all {chunks} chunks landed")
        self.reporter.say(f"extraction: all {chunks} chunks landed")
        return True

    def verify(self) -> bool:
        if read_manifest(self.storage) is not None:
            return False
        name = job_name(self.spec, "extract")

        def checked(done: int, total: int) -> None:
            self.reporter.update(StepUpdate("verify", done=done, total=total))

        try:
            manifest = verify_run(self.storage, Expected.of(self.spec), on_checked=checked)
        except VerificationFailed as failure:
            self.backend.record_event(name, EVENT_VERIFY_FAILED, failure.what.splitlines()[0], warning=True)
            raise
        message = f"{len(manifest.chunks)} chunks verified: {manifest.samples} samples, {manifest.tokens} tokens, {manifest.bytes / 2**30:.2f} GiB"
        self.backend.record_event(name, EVENT_CHUNKS_VERIFIED, message)
        self.reporter.say(message)
        return True

    def train(self) -> bool:
        if self.storage.exists(DRAFTER_CONFIG_KEY):
            return False
        if self.spec.train.states == "online":
            refuse_stored_states(self.spec, self.storage)
            index = DatasetIndex.from_json(self.storage.get_bytes(DATASET_KEY), DATASET_KEY)
            self.job_step("train", DRAFTER_CONFIG_KEY, launched=(
                EVENT_TRAINING_LAUNCHED, f"online: the target runs in the training Job on {len(index.chunks)} token chunks, {index.tokens} tokens"))
            return True
        manifest = read_manifest(self.storage)
        if manifest is None:  # the order of the steps guarantees it; this guards the invariant itself
            raise RunFailed("training needs extract/manifest.json, which does not exist", "Run `dflashctl verify` first")
        check_final_hidden(manifest, self.spec.train, f"{self.storage.url}/{MANIFEST_KEY}")  # here, not minutes later in the pod
        self.job_step(
            "train", DRAFTER_CONFIG_KEY,
            launched=(EVENT_TRAINING_LAUNCHED, f"from {len(manifest.chunks)} verified chunks, {manifest.tokens} tokens"),
        )
        return True

    # ---- Jobs ----------------------------------------------------------------------------------

    def job_step(self, step: str, output_key: str, *, launched: tuple[str, str] | None = None) -> None:
        """Runs the Job of a step to its end; its output must then exist in storage."""
        name = job_name(self.spec, step)
        current = self.backend.job_status(name)
        if current.exists and current.finished and not self.storage.exists(output_key):
            # Ended before this run without its output (failed, or the output was removed): run it anew.
            self.reporter.say(f"{step} Job {name} had ended without {output_key}: submitting it again")
            self.backend.delete(name)
        outcome = self.backend.submit(render_selection(self.spec, step), force=self.force)[name]
        if launched is not None and outcome != "attached":
            self.backend.record_event(name, *launched)
        self.reporter.say(f"{step}: {SUBMITTED[outcome]} Job {name}")
        status = self.wait(step, name)
        if status.failed_terminally:
            raise self.failure(
                name, f"{step} Job {name} failed: {describe(status)}",
                f"`dflashctl logs {step}` shows why; fix it and `dflashctl run` again",
            )
        if not self.storage.exists(output_key):
            raise self.failure(
                name, f"{step} Job {name} completed but {self.storage.url}/{output_key} does not exist",
                f"`dflashctl logs {step}` shows what it did",
            )
        done = {"train": EVENT_TRAINING_FINISHED, "eval": EVENT_EVALUATION_DONE}.get(step)
        if done is not None:
            self.backend.record_event(name, done, f"{output_key} written")
        self.reporter.say(f"{step}: done ({output_key})")

    def wait(self, step: str, name: str) -> JobStatus:
        """Waits for the Job to finish, reading storage progress every `refresh_s` on the way."""
        last: list[JobStatus] = []

        def seen(status: JobStatus) -> None:
            last[:] = [status]
            self.refresh(step, status)

        while True:
            remaining = None if self.deadline is None else self.deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise WaitTimeout(
                    f"{step} Job {name} did not finish within the {self.timeout:.0f} s given to `dflashctl run`",
                    "It keeps running; `dflashctl run` again attaches to it",
                )
            try:
                window = self.refresh_s if remaining is None else min(self.refresh_s, remaining)
                return self.backend.wait(name, timeout=window, on_update=seen)
            except WaitTimeout:
                self.refresh(step, last[0] if last else None)

    def refresh(self, step: str, job: JobStatus | None) -> None:
        if step == "generate":
            self.refresh_generation(job)
            return
        if step != "extract":
            self.reporter.update(StepUpdate(step, job=job))
            return
        try:
            progress = read_progress(self.storage)
        except StorageError as error:
            # Hours of extraction outlive S3 hiccups: the Job goes on, and so does the watching.
            self.reporter.say(f"extract: cannot read progress from {self.storage.url} ({error.what}); trying again in {self.refresh_s:.0f} s")
            return
        self.annotate("extract", job, progress.label)
        rate = landing_rate(progress, since=job.started_at if job is not None else None)
        self.reporter.update(StepUpdate(
            step, job=job, done=progress.chunks_done, total=progress.chunks_total,
            tokens_per_s=rate, eta_s=time_left(progress, rate),
        ))

    def refresh_generation(self, job: JobStatus | None) -> None:
        try:
            progress = self.generation_progress()
        except StorageError as error:
            self.reporter.say(f"generate: cannot read progress from {self.storage.url} ({error.what}); trying again in {self.refresh_s:.0f} s")
            return
        self.annotate("generate", job, progress.label)
        prompts_per_s, tokens_per_s = generation_rates(progress, since=job.started_at if job is not None else None)
        self.reporter.update(StepUpdate(
            "generate", job=job, done=progress.prompts_done, total=progress.prompts_total,
            tokens_per_s=tokens_per_s, eta_s=generation_time_left(progress, prompts_per_s),
        ))

    def annotate(self, step: str, job: JobStatus | None, label: str) -> None:
        """Chunks done of total on the step's Job (`kubectl get jobs` shows it), when it changed."""
        if job is not None and job.exists and label != self.progress_labels.get(step):
            self.backend.annotate(job.name, PROGRESS_ANNOTATION, label)
            self.progress_labels[step] = label

    def failure(self, name: str, what: str, fix: str) -> RunFailed:
        """RunFailed, recorded as an event on the Job first (`kubectl describe job` shows it)."""
        self.backend.record_event(name, EVENT_RUN_FAILED, what, warning=True)
        return RunFailed(what, fix)

    def read_report(self) -> dict[str, Any]:
        try:
            return json.loads(self.storage.get_bytes(EVAL_REPORT_KEY))
        except ObjectNotFound:
            raise RunFailed(f"{self.storage.url}/{EVAL_REPORT_KEY} does not exist", "Run `dflashctl eval`") from None
        except ValueError:
            raise RunFailed(f"{self.storage.url}/{EVAL_REPORT_KEY} is not valid JSON", "Run `dflashctl eval` again") from None


class ChunkCount(Protocol):
    """How many of a sharded step's chunks landed (extraction's Progress, generation's GenerationProgress)."""

    chunks_done: int
    chunks_total: int | None
    """None until the step's chunks are planned (generation's plan, prepare's dataset)."""

    @property
    def label(self) -> str:
        """"3/12": chunks done of total."""


def refuse_stored_states(spec: RunSpec, storage: Storage) -> None:
    """Online training beside stored states would make again what the output holds: refused, nothing touched."""
    stored = read_manifest(storage)
    if stored is not None:
        raise SpecError(
            "train.states", "online",
            f"stored: {storage.url} holds {len(stored.chunks)} verified chunks of stored states ({stored.tokens} tokens) "
            "that train without a target forward; or point output at a new prefix to train online",
        )


def completed_without_chunks(step: str, job: JobStatus, progress: ChunkCount) -> tuple[str, str]:
    """What and fix of a sharded step's Job that completed, every shard having exited 0, with chunks
    missing: the pods claim work they did not store, which running them again would repeat."""
    wrote = "wrote nothing" if not progress.chunks_done else "left chunks unwritten"
    landed = f"{progress.label} chunks" if progress.chunks_total is not None else "no chunk planned or"
    return (f"{step} Job {job.name} completed (its {job.completions} shard(s) exited 0) with {landed} landed: "
            f"its pods {wrote}, a defect to report, not a failure a retry fixes",
            f"`dflashctl logs {step}` shows what they did; to run the step again anyway, `dflashctl cancel`, then `dflashctl run` "
            "(landed chunks are kept)")


def describe(status: JobStatus) -> str:
    """Why a Job failed, with the failed shards and how each ended: for messages and events."""
    parts = [status.failure_message or "failed"]
    if status.failed_indexes:
        reasons = {s.index: s.exit_reason for s in status.shards if s.index in status.failed_indexes and s.exit_reason}
        shards = "; ".join(f"shard {i}: {reasons[i]}" for i in sorted(reasons))
        parts.append(f"failed shards {format_indexes(status.failed_indexes)}" + (f" ({shards})" if shards else ""))
    return "; ".join(parts)


def summarize_report(report: dict[str, Any]) -> str:
    """One line from eval/report.json: acceptance length, speed-up and losslessness per drafter."""
    drafters = report.get("drafters") or {}
    parts = [
        f"{name}: acceptance length {summary.get('acceptance_length', float('nan')):.2f}, "
        f"speed-up {summary.get('speedup', float('nan')):.2f}x"
        for name, summary in drafters.items()
    ]
    lossless = report.get("lossless")
    if lossless is not None:
        parts.append("output equals plain greedy" if lossless else "OUTPUT DIFFERS from plain greedy")
    return "; ".join(parts) or "eval/report.json has no drafter figures"

