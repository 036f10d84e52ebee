"""`dflashctl submit`: create the Jobs of one step, or attach to them (idempotent)."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from dflash_jobs.errors import InputError
from dflash_jobs.formats import MANIFEST_KEY
from dflash_jobs.storage import storage_for

from dflashctl.backend import JobStatus
from dflashctl.backends import open_backend
from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, ForceOpt, SpecOpt, TimeoutOpt, read_spec
from dflashctl.cli.status import summarize
from dflashctl.errors import RunFailed
from dflashctl.render import COMPONENTS, job_name, render_selection


Step = Enum("Step", {component: component for component in COMPONENTS}, type=str)


StepArg = Annotated[Step, typer.Argument(help="The step whose Job to submit.")]


def submit(
    step: StepArg,
    spec_file: SpecOpt = DEFAULT_SPEC,
    wait: Annotated[bool, typer.Option("--wait", help="Block until the Job finishes; exit 1 if it failed.")] = False,
    force: ForceOpt = False,
    timeout: TimeoutOpt = None,
) -> None:
    """Create the Job of one step. The same spec again attaches to it; a different one is refused without --force.

    Examples:

      dflashctl submit extract --wait

      dflashctl submit controller   # the pipeline as a CPU Job in the cluster

      dflashctl submit train        # needs extract/manifest.json (verify)
    """
    spec = read_spec(spec_file)
    if step is Step.train and not storage_for(spec).exists(MANIFEST_KEY):
        raise InputError(
            f"{spec.output}/{MANIFEST_KEY} does not exist: training starts only from verified chunks",
            "Run `dflashctl verify` once every chunk has landed (`dflashctl status` shows how many have)",
        )
    backend = open_backend(spec)
    backend.submit(render_selection(spec, step.value), force=force)
    name = job_name(spec, step.value)
    output.info(f"submitted Job {name} ({spec.backend}, spec hash {spec.fingerprint()})")
    if not wait:
        output.hint("dflashctl status --watch")
        return
    last: list[str] = []

    def report(status: JobStatus) -> None:
        line = summarize(step.value, status)
        if line != (last[-1] if last else None):
            output.info(line)
            last.append(line)

    final = backend.wait(name, timeout=timeout, on_update=report)
    if final.failed_terminally:
        raise RunFailed(f"Job {name} failed: {final.failure_message}", "`dflashctl status` shows the shards; `dflashctl logs --shard N` why")
    output.hint("dflashctl status")


def register(app: typer.Typer) -> None:
    app.command()(submit)
