"""`dflashctl status`: where the run is, per shard, with chunks done (prompts answered when the answers
are regenerated), tokens/s, ETA and what comes next.

`--watch` follows the run to its end, across the gaps between its Jobs (verify runs between
extraction and training without a Job of its own). Also installed as `kubectl-dflash`, so
`kubectl dflash status` works for people who live in kubectl.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from dflash_jobs.drafter.serving import run_serve_command
from dflash_jobs.errors import FormatError, StorageError
from dflash_jobs.formats import DATASET_KEY, DRAFTER_CONFIG_KEY, EVAL_REPORT_KEY, MANIFEST_KEY
from dflash_jobs.generation import MANIFEST_KEY as GENERATION_MANIFEST_KEY
from dflash_jobs.generation import PLAN_KEY, ChunkMarker, GenerationManifest, GenerationProgress, current_manifest
from dflash_jobs.generation import read_progress as read_generation_progress
from dflash_jobs.spec import RunSpec
from dflash_jobs.storage import Storage, open_storage
from dflash_jobs.units import format_duration

from dflashctl.backend import Backend, JobStatus, format_indexes
from dflashctl.backends import open_backend, targeted
from dflashctl.check import STORAGE_ATTEMPTS
from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, LocatorSpecOpt, OutputFormat, OutputOpt, WatchOpt, locate, read_spec
from dflashctl.errors import exit_code
from dflashctl.pipeline import completed_without_chunks
from dflashctl.progress import (
    Progress, format_rate, generation_rates, generation_time_left, landing_rate, read_progress, time_left,
)
from dflashctl.render import COMPONENTS, STEPS, job_name, job_ref
from dflashctl.runs import spec_of_run

REFRESH_S = 5.0
"""Seconds between refreshes of `status --watch`."""


@dataclass(slots=True)
class RunReport:
    """Everything `status` shows, gathered once per refresh."""

    run: str
    backend: str
    jobs: dict[str, JobStatus]
    progress: Progress | None
    tokens_per_s: float | None
    eta_s: float | None
    manifest: bool
    trained: bool
    evaluated: bool
    storage_error: str | None
    next_step: str = ""
    storage_exit: int = 0
    """The exit code for `storage_error` (5: unavailable, run again later; 2: credentials, bucket), 0 without one."""
    serve: str | None = None
    """Once the drafter is exported: the vLLM command that serves it (or why it cannot be formatted)."""
    generation: GenerationProgress | None = None
    """With a generate section: chunks and prompts done, from the plan and the markers."""
    generation_manifest: GenerationManifest | None = None
    """generate/manifest.json, when it exists with the spec's generation settings."""
    generation_error: str | None = None
    """Why the run cannot go on from that manifest (it keeps no more rows than data.holdout), with the fix."""
    generation_tokens_per_s: float | None = None
    generation_eta_s: float | None = None
    stored_states: bool = True
    """train.states stored: extraction and verify come between prepare and training (online: neither)."""

    @property
    def generated(self) -> bool:
        return self.generation_manifest is not None

    @property
    def generation_warning(self) -> str | None:
        """That generation dropped a large share of the lines, and why."""
        return None if self.generation_manifest is None else self.generation_manifest.drop_warning()

    @property
    def active(self) -> bool:
        """Something still runs: a Job of the run that has not finished."""
        return any(job.exists and not job.finished for job in self.jobs.values())

    @property
    def failed(self) -> bool:
        return not self.evaluated and (any(job.failed_terminally for job in self.jobs.values()) or self.verdict is not None)

    @property
    def verdict(self) -> str | None:
        """A Job that completed (its pods exited 0) without what its step writes: nothing runs, and
        nothing follows by itself. For generation and extraction, a defect (completed_without_chunks)."""
        jobs, progress, generation = self.jobs, self.progress, self.generation
        if progress is None:
            return None  # storage unreadable: nothing to hold the Jobs against
        short = None
        if generation is not None and not self.generated and jobs["generate"].complete and not generation.landed:
            short = completed_without_chunks("generate", jobs["generate"], generation)
        elif progress.chunks_total is not None and jobs["extract"].complete and not progress.landed:
            short = completed_without_chunks("extract", jobs["extract"], progress)
        if short is not None:
            return ". ".join(short)
        for step, done, key in (("prepare", progress.chunks_total is not None, DATASET_KEY), ("train", self.trained, DRAFTER_CONFIG_KEY),
                                ("eval", self.evaluated, EVAL_REPORT_KEY)):
            if jobs[step].complete and not done:
                return (f"{step} Job {jobs[step].name} completed without {key}: its pod wrote nothing (a defect to report: "
                        f"`dflashctl logs {step}`), or it was deleted since; `dflashctl run` runs the step again")
        return None

    @property
    def step(self) -> str:
        """The step the run is at: the first whose output is not in storage ("done" at the end)."""
        if self.evaluated:
            return "done"
        if self.progress is None:
            return "unknown (storage unreachable)"
        if self.progress.chunks_total is None:
            return "generate" if self.generation is not None and (not self.generated or self.generation_error) else "prepare"
        if self.stored_states and not self.progress.landed:
            return "extract"
        if self.stored_states and not self.manifest:
            return "verify"
        return "train" if not self.trained else "eval"


def job_statuses(spec: RunSpec, backend: Backend) -> dict[str, JobStatus]:
    """Every Job of the run, pipeline order, the controller last."""
    return {component: backend.job_status(job_name(spec, component)) for component in COMPONENTS}


def current_step(jobs: dict[str, JobStatus]) -> str | None:
    """The furthest data-plane step that has a Job."""
    existing = [step for step in STEPS if jobs[step].exists]
    return existing[-1] if existing else None


def job_state(job: JobStatus) -> str:
    if not job.exists:
        return "not submitted"
    for condition in ("Complete", "Failed"):
        if condition in job.conditions:
            return condition
    if "FailureTarget" in job.conditions or "SuccessCriteriaMet" in job.conditions:
        return "Finishing"  # decided; the remaining pods are being terminated
    if job.suspended:
        return "Queued"
    running = sum(shard.phase == "Running" for shard in job.shards) if job.shards else job.active
    return "Running" if running else "Pending"


def summarize(step: str, job: JobStatus) -> str:
    """One line per Job: `extract Running: 5/8 done, 1 failed (3), 1 running, 1 pending`."""
    state = job_state(job)
    if not job.exists:
        return f"{step} {state}"
    parts = [f"{len(job.completed_indexes)}/{job.completions} done"]
    if job.failed_indexes:
        parts.append(f"{len(job.failed_indexes)} failed ({format_indexes(job.failed_indexes)})")
    if job.active and job.shards:  # the pods' phases: scheduled and running, or waiting for a node, an image, a volume
        running = sum(shard.phase == "Running" for shard in job.shards)
        parts += [f"{count} {phase}" for count, phase in ((running, "running"), (job.active - running, "pending")) if count > 0]
    elif job.active:
        parts.append(f"{job.active} active")
    return f"{step} {state}: {', '.join(parts)}"


def collect(spec: RunSpec, backend: Backend, markers: dict[str, ChunkMarker] | None = None) -> RunReport:
    """One look at the run. `markers`: generation's done markers already read (a watcher passes the
    same dict every time, so each is read once)."""
    jobs = job_statuses(spec, backend)
    progress = manifest = trained = evaluated = serve = None
    generation = generation_manifest = generation_error = None
    storage_error, storage_exit = None, 0
    try:
        storage = open_storage(spec.output, endpoint_url=spec.storage.endpoint_url, region=spec.storage.region,
                               max_attempts=STORAGE_ATTEMPTS)
        progress = read_progress(storage)
        manifest = storage.exists(MANIFEST_KEY)
        trained = storage.exists(DRAFTER_CONFIG_KEY)
        evaluated = storage.exists(EVAL_REPORT_KEY)
        serve = serve_command(spec, storage) if trained else None
        if spec.generate is not None:
            generation = read_generation_progress(storage, spec, markers)
            generation_manifest = current_manifest(storage, spec)
            too_few = None if generation_manifest is None else generation_manifest.too_few_rows(spec.data.holdout)
            generation_error = None if too_few is None else str(too_few)
    except StorageError as error:
        storage_error, storage_exit = str(error), exit_code(error)
    extract, generate = jobs["extract"], jobs["generate"]
    rate = None
    if progress is not None and extract.exists and not extract.finished:
        rate = landing_rate(progress, since=extract.started_at)  # what landed since this Job started
    prompts_per_s = generation_tokens_per_s = None
    if generation is not None and generate.exists and not generate.finished:
        prompts_per_s, generation_tokens_per_s = generation_rates(generation, since=generate.started_at)
    report = RunReport(
        run=spec.name,
        backend=spec.backend,
        jobs=jobs,
        progress=progress,
        tokens_per_s=rate,
        eta_s=None if progress is None else time_left(progress, rate),
        manifest=bool(manifest),
        trained=bool(trained),
        evaluated=bool(evaluated),
        storage_error=storage_error,
        storage_exit=storage_exit,
        serve=serve,
        generation=generation,
        generation_manifest=generation_manifest,
        generation_error=generation_error,
        generation_tokens_per_s=generation_tokens_per_s,
        generation_eta_s=None if generation is None else generation_time_left(generation, prompts_per_s),
        stored_states=spec.train.states == "stored",
    )
    report.next_step = next_step(spec, report)
    return report


def serve_command(spec: RunSpec, storage: Storage) -> str:
    """The vLLM serve command of the exported drafter, from its config.json."""
    try:
        return run_serve_command(spec, json.loads(storage.get_bytes(DRAFTER_CONFIG_KEY)))
    except (ValueError, FormatError) as error:  # json's errors are ValueErrors
        return f"(cannot tell: {spec.output}/{DRAFTER_CONFIG_KEY} is unreadable: {error})"


def next_step(spec: RunSpec, report: RunReport) -> str:
    """What happens next, or the command that makes it happen."""
    jobs, progress = report.jobs, report.progress
    controller = jobs["controller"]
    by = " (the in-cluster controller does it)" if controller.exists and not controller.finished else ""
    if controller.failed_terminally and not report.evaluated:
        words = next((shard.message for shard in controller.shards if shard.message), None) or controller.failure_message
        return f"the in-cluster controller failed: {words}; fix that, then `dflashctl retry controller`"
    if report.storage_error:
        return "fix storage access first (see the error above), then `dflashctl status` again"
    if report.evaluated:
        return f"done: the drafter is in {spec.output}/train/drafter, the evaluation in {spec.output}/{EVAL_REPORT_KEY}"
    if report.verdict is not None:
        return report.verdict
    if report.generation_error and (progress is None or progress.chunks_total is None):
        return report.generation_error
    if spec.generate is not None and not report.generated and (progress is None or progress.chunks_total is None):
        return generation_hint(jobs["generate"], report.generation) + by
    if progress is None or progress.chunks_total is None:
        return _step_hint("prepare", jobs["prepare"], running="prepare is tokenizing data.source", start="`dflashctl run`, or `dflashctl prepare` alone") + by
    if report.stored_states and not progress.landed:
        return _sharded_step_hint(
            "extract", jobs["extract"], noun="extraction", landed=progress.label, follows="verify and training follow",
            start="`dflashctl submit extract` (or `dflashctl run`)",
        ) + by
    if report.stored_states and not report.manifest:
        return f"every chunk landed: `dflashctl verify` checks them and writes {MANIFEST_KEY}, then training starts{by}"
    if not report.trained:
        nodes = f"{spec.train.nodes} node(s) x {spec.train.gpus_per_node} GPUs"
        return _step_hint("train", jobs["train"], running=f"training on {nodes}: `dflashctl logs train --follow`", start="`dflashctl submit train`") + by
    return _step_hint("eval", jobs["eval"], running="evaluating the drafter: `dflashctl logs eval --follow`", start="`dflashctl eval`") + by


def generation_hint(job: JobStatus, generation: GenerationProgress | None) -> str:
    """What comes next while the answers are regenerated (before prepare)."""
    label = generation.label if generation is not None else "?"
    if generation is not None and generation.landed:
        return f"every generation chunk landed: `dflashctl run` writes {GENERATION_MANIFEST_KEY} and prepares the answers"
    return _sharded_step_hint(
        "generate", job, noun="generation", landed=label, follows="prepare follows", start="`dflashctl run` (or `dflashctl submit generate`)",
    )


def _sharded_step_hint(step: str, job: JobStatus, *, noun: str, landed: str, follows: str, start: str) -> str:
    """An Indexed Job's step before all its chunks landed: the shards that failed, or how far it got."""
    if job.exists and job.finished:
        failed = format_indexes(job.failed_indexes) or "some"
        first = min(job.failed_indexes or {shard.index for shard in job.shards if shard.phase == "Failed" and shard.exit_reason}, default=0)
        return f"{noun} shards {failed} failed with chunks missing: `{logs_command(step, job, first)}`, then `dflashctl retry {step}`"
    return _step_hint(step, job, running=f"{noun}: {landed} chunks landed; {follows} once all have", start=start)


def logs_command(step: str, job: JobStatus, index: int) -> str:
    """`dflashctl logs STEP --shard N`, with `-c NAME` when an init container ended the shard ("selfcheck exit 2 (Error)")."""
    reason = next((shard.exit_reason or "" for shard in job.shards if shard.index == index), "")
    container, exited, _ = reason.partition(" exit ")
    return f"dflashctl logs {step} --shard {index}" + (f" -c {container}" if exited and container else "")


def _step_hint(step: str, job: JobStatus, *, running: str, start: str) -> str:
    if not job.exists:
        return f"start {step}: {start}"
    if job.failed_terminally:
        return f"{step} failed ({job.failure_message}): `dflashctl logs {step}`, then `dflashctl retry {step}`"
    if job.suspended:
        return f"{step} is queued (Kueue has not admitted it yet)"
    return running


def follow(spec: RunSpec, backend: Backend, report: RunReport, markers: dict[str, ChunkMarker] | None = None) -> Iterator[RunReport]:
    """`report`, then a fresh one every REFRESH_S until the run has ended (see `ended`)."""
    previous = None
    while True:
        yield report
        if ended(report, previous):
            return
        time.sleep(REFRESH_S)
        previous, report = report, collect(spec, backend, markers)


def ended(report: RunReport, previous: RunReport | None) -> bool:
    """The run is over: evaluated, or its in-cluster controller finished, or (driven from a terminal
    or by hand) a Job failed with nothing running, in two looks in a row: whoever drives the run
    replaces a failed extraction within moments. A gap without Jobs (verify) is not an end."""
    if report.evaluated:
        return True
    controller = report.jobs["controller"]
    if controller.exists:
        return controller.finished
    return all(look is not None and look.failed and not look.active for look in (report, previous))


# ---- output ------------------------------------------------------------------------------------


def report_json(report: RunReport) -> dict[str, Any]:
    def job(status: JobStatus) -> dict[str, Any]:
        body = asdict(status)
        body["completed_indexes"] = sorted(status.completed_indexes)
        body["failed_indexes"] = sorted(status.failed_indexes)
        body["state"] = job_state(status)
        return body

    progress, generation, manifest = report.progress, report.generation, report.generation_manifest
    return {
        "run": report.run,
        "backend": report.backend,
        "step": report.step,
        "jobs": {step: job(status) for step, status in report.jobs.items()},
        "progress": None if progress is None else {
            "chunks_done": progress.chunks_done, "chunks_total": progress.chunks_total,
            "tokens_done": progress.tokens_done, "tokens_total": progress.tokens_total,
            "tokens_per_s": report.tokens_per_s, "eta_s": report.eta_s,
        },
        "manifest": report.manifest,
        "trained": report.trained,
        "evaluated": report.evaluated,
        "storage_error": report.storage_error,
        "generation": None if generation is None else {
            "chunks_done": generation.chunks_done, "chunks_total": generation.chunks_total,
            "prompts_done": generation.prompts_done, "prompts_total": generation.prompts_total,
            "completion_tokens": generation.completion_tokens, "done": report.generated,
            "tokens_per_s": report.generation_tokens_per_s, "eta_s": report.generation_eta_s,
            "rows": None if manifest is None else manifest.rows, "dropped": None if manifest is None else manifest.dropped,
            "warning": report.generation_warning, "error": report.generation_error,
        },
        "next": report.next_step,
        "serve": report.serve,
    }


def progress_line(report: RunReport) -> str:
    progress = report.progress
    if progress is None:
        return "chunks: unknown (storage unreachable)"
    if progress.chunks_total is None:
        return "chunks: not prepared yet"
    percent = f" ({progress.fraction:.0%} of tokens)" if progress.fraction is not None else ""
    return f"chunks: {progress.label}{percent}, {format_rate(report.tokens_per_s)}, ETA {format_duration(report.eta_s)}"


def generation_line(report: RunReport) -> str | None:
    """`generation: 3/12 chunks, 3,072/12,288 prompts (25%), 1.2K tok/s generated, ETA 1h02m`; None without generation."""
    progress = report.generation
    if progress is None:
        return None
    if progress.prompts_total is None:
        if report.jobs["generate"].complete:
            return f"generation: nothing written, not even {PLAN_KEY}, by a generate Job that completed"
        return "generation: not started (no plan yet)"
    share = f" ({progress.prompts_done / progress.prompts_total:.0%})" if progress.prompts_total else ""
    line = f"generation: {progress.label} chunks, {progress.prompts_done:,}/{progress.prompts_total:,} prompts{share}"
    if report.generation_manifest is not None:
        return f"{line}, done ({GENERATION_MANIFEST_KEY}): {report.generation_manifest.rows:,} rows kept"
    return f"{line}, {format_rate(report.generation_tokens_per_s)} generated, ETA {format_duration(report.generation_eta_s)}"


def plain_lines(report: RunReport) -> list[str]:
    lines = [f"run {report.run} ({report.backend}), step: {report.step}"]
    lines += [summarize(step, job) for step, job in report.jobs.items() if job.exists]
    step = current_step(report.jobs)
    for shard in report.jobs[step].shards if step else []:
        reason = f" {shard.exit_reason}" if shard.exit_reason else ""
        lines.append(f"  {step}[{shard.index}] {shard.phase} pod={shard.pod or '-'} node={shard.node or '-'} attempts={shard.attempts}{reason}")
    if report.storage_error:
        lines.append(f"storage: {report.storage_error}")
    lines += [line for line in (generation_line(report),) if line]
    if report.generation_warning:
        lines.append(f"warning: {report.generation_warning}")
    lines.append(progress_line(report))
    lines.append(f"next: {report.next_step}")
    if report.serve:
        lines += ["serve with vLLM:", *report.serve.splitlines()]
    return lines


def rich_view(report: RunReport) -> Group:
    step = current_step(report.jobs)
    header = Text(f"run {report.run}", style="bold")
    header.append(f"  ({report.backend})", style="dim")
    header.append(f"  step: {report.step}")
    jobs = Text("  ".join(f"{s}: {job_state(j)}" for s, j in report.jobs.items() if s != "controller" or j.exists))
    table = Table(title=f"{step} shards" if step else None, expand=False)
    for column in ("shard", "pod", "node", "phase", "attempts", "exit reason"):
        table.add_column(column, justify="right" if column in ("shard", "attempts") else "left")
    colors = {"Succeeded": "green", "Failed": "red", "Running": "cyan"}
    for shard in report.jobs[step].shards if step else []:
        table.add_row(
            str(shard.index), shard.pod or "-", shard.node or "-",
            Text(shard.phase, style=colors.get(shard.phase, "")), str(shard.attempts), shard.exit_reason or "",
        )
    lines: list[Any] = [header, jobs]
    if step:
        lines.append(table)
    if report.storage_error:
        lines.append(Text(f"storage: {report.storage_error}", style="red"))
    lines += [Text(line) for line in (generation_line(report),) if line]
    if report.generation_warning:
        lines.append(Text(f"warning: {report.generation_warning}", style="yellow"))
    lines += [Text(progress_line(report)), Text(f"next: {report.next_step}", style="bold")]
    if report.serve:
        lines.append(Text(f"serve with vLLM:\n{report.serve}"))
    return Group(*lines)


def status(
    run: Annotated[str | None, typer.Argument(help="A run by name: its spec is read from its spec ConfigMap, no file needed.", show_default=False)] = None,
    spec_file: LocatorSpecOpt = None,
    watch: WatchOpt = False,
    fmt: OutputOpt = OutputFormat.table,
) -> None:
    """Shards (pod, node, phase, attempts, exit reason), prompts answered, chunks landed, tokens/s, ETA, and the next step.

    The run is the spec file's (-f, default dflash.yaml), or the one named: its spec is read from
    its `<run>-spec` ConfigMap, on the spec file's backend or else in the cluster's namespace
    (`dflashctl list` shows the runs there).

    Examples:

      dflashctl status                 # a table

      dflashctl status qwen36-27b-v1 -n team-a   # by name, without its spec file

      dflashctl status --watch   # live until the run ends, across its gaps

      dflashctl status -o json | jq .progress

      kubectl dflash status -f dflash.yaml

    Without dflashctl, kubectl tells the same story:

      kubectl get jobs,pods -l dflash.dev/run=NAME

      kubectl describe job NAME-extract   # milestones and failures, as events

      kubectl get job NAME-extract -o yaml | grep dflash.dev/progress   # chunks
    """
    spec, backend = run_and_backend(run, spec_file)
    markers: dict[str, ChunkMarker] = {}
    report = collect(spec, backend, markers)
    if not watch:
        _show(report, fmt)
    elif fmt is OutputFormat.table and sys.stdout.isatty():
        with Live(rich_view(report), console=output.stdout, auto_refresh=False) as live:
            for report in follow(spec, backend, report, markers):
                live.update(rich_view(report), refresh=True)
    else:
        shown: list[str] = []
        for report in follow(spec, backend, report, markers):
            # A document per look for machines; a block (or the names) again only when it changed.
            look = job_names(report) if fmt is OutputFormat.name else plain_lines(report)
            if fmt in (OutputFormat.json, OutputFormat.yaml) or look != shown:
                _show(report, fmt)
                shown = look
    if report.storage_error:  # the run could not be looked at: README's exit code for storage
        raise typer.Exit(report.storage_exit)
    if watch and report.failed:
        raise typer.Exit(1)


def job_names(report: RunReport) -> list[str]:
    """-o name: the run's Jobs that exist, as kubectl names them."""
    return [job_ref(job.name) for job in report.jobs.values() if job.exists]


def run_and_backend(run: str | None, spec_file: Path | None) -> tuple[RunSpec, Backend]:
    """The spec file's run, or the run named, with the backend it is on."""
    if run is None:
        spec = read_spec(spec_file or DEFAULT_SPEC)
        return spec, open_backend(spec)
    backend, file_spec, where = locate(spec_file)
    if file_spec is not None and file_spec.name == run:
        return file_spec, backend
    return targeted(spec_of_run(backend, run, where)), backend


def _show(report: RunReport, fmt: OutputFormat) -> None:
    if fmt is not OutputFormat.table:
        output.result(fmt, report_json(report), job_names(report))
    elif sys.stdout.isatty():
        output.stdout.print(rich_view(report))
    else:
        sys.stdout.write("\n".join(plain_lines(report)) + "\n")
        sys.stdout.flush()


def register(app: typer.Typer) -> None:
    app.command()(status)
