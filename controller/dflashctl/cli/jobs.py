"""`dflashctl cancel` and `dflashctl retry`: stop a run, or run its failed Jobs again.

Storage is never touched: chunks whose done marker exists are not extracted again, so cancel
then `dflashctl run`, or retry, loses nothing that has landed.
"""

from __future__ import annotations

from typing import Annotated

import typer

from dflashctl.backend import EVENT_SHARDS_RETRIED, format_indexes
from dflashctl.backends import open_backend
from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, SpecOpt, read_spec
from dflashctl.cli.status import job_statuses
from dflashctl.cli.submit import Step
from dflashctl.render import COMPONENTS, STEPS, job_name, render_selection


def cancel(spec_file: SpecOpt = DEFAULT_SPEC) -> None:
    """Delete every Job of the run and their pods; what has landed in storage stays.

    Examples:

      dflashctl cancel

      dflashctl cancel && dflashctl run     # start over; landed chunks are kept
    """
    spec = read_spec(spec_file)
    backend = open_backend(spec)
    jobs = job_statuses(spec, backend)
    # The controller first, so that it does not submit the next step meanwhile.
    for component in reversed(COMPONENTS):
        if jobs[component].exists:
            backend.delete(job_name(spec, component))
            output.info(f"deleted Job {job_name(spec, component)}")
    if not any(job.exists for job in jobs.values()):
        output.info(f"run {spec.name} has no Jobs")
    output.hint("dflashctl run   (resumes: landed chunks are not extracted again)")


def retry(
    step: Annotated[Step | None, typer.Argument(help="The step to retry; default: every failed one.")] = None,
    spec_file: SpecOpt = DEFAULT_SPEC,
) -> None:
    """Run failed Jobs again (Jobs are immutable: delete, then create from the same spec).

    Extraction shards skip the chunks that already have a done marker, so only the work of the
    failed shards is done again.

    Examples:

      dflashctl retry

      dflashctl retry extract
    """
    spec = read_spec(spec_file)
    backend = open_backend(spec)
    jobs = job_statuses(spec, backend)
    steps = [step.value] if step is not None else [s for s in STEPS if jobs[s].failed_terminally]
    retried = []
    for name in steps:
        status = jobs[name]
        if not status.failed_terminally:
            output.info(f"{name}: {'not submitted' if not status.exists else 'has not failed'}, nothing to retry")
            continue
        backend.delete(job_name(spec, name))
        backend.submit(render_selection(spec, name))
        failed = f" (failed shards: {format_indexes(status.failed_indexes)})" if status.failed_indexes else ""
        backend.record_event(job_name(spec, name), EVENT_SHARDS_RETRIED, f"resubmitted by `dflashctl retry`{failed}")
        output.info(f"resubmitted Job {job_name(spec, name)}{failed}")
        retried.append(name)
    if not retried and step is None:
        output.info(f"run {spec.name}: no failed Job to retry")
    output.hint("dflashctl status --watch")


def register(app: typer.Typer) -> None:
    app.command()(cancel)
    app.command()(retry)
