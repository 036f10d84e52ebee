"""`dflashctl submit`: create the Jobs of one step, or attach to them (idempotent)."""

from __future__ import annotations

import sys
from enum import Enum
from typing import Annotated

import typer

from dflash_jobs.formats import RUN_KEY
from dflash_jobs.spec import RunSpec
from dflash_jobs.storage import storage_for

from dflashctl.backend import SUBMITTED, Backend, JobStatus, submit_outcome
from dflashctl.backends import open_backend
from dflashctl.check import cluster_of, preflight
from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, DryRunOpt, ForceOpt, SpecOpt, TimeoutOpt, read_spec
from dflashctl.cli.status import summarize
from dflashctl.errors import RunFailed
from dflashctl.identity import claim_here, output_elsewhere
from dflashctl.render import COMPONENTS, job_name, object_ref, render_selection


Step = Enum("Step", {component: component for component in COMPONENTS}, type=str)


StepArg = Annotated[Step, typer.Argument(help="The step whose Job to submit.")]


def submit(
    step: StepArg,
    spec_file: SpecOpt = DEFAULT_SPEC,
    wait: Annotated[bool, typer.Option("--wait", help="Block until the Job finishes; exit 1 if it failed.")] = False,
    force: ForceOpt = False,
    timeout: TimeoutOpt = None,
    dry_run: DryRunOpt = False,
) -> None:
    """Create the Job of one step. The same spec again attaches to it; a different one is refused without --force.

    `dflashctl check`'s checks of the step run first: a failure starts nothing
    and exits 2 (4: the cluster, 5: storage). The output is claimed for this spec (run.yaml): one
    holding another run is refused. --dry-run runs the checks and says what would be created
    (`dflashctl render` prints the objects themselves).

    Examples:

      dflashctl submit extract --wait

      dflashctl submit extract --dry-run

      dflashctl submit controller   # the pipeline as a CPU Job in the cluster

      dflashctl submit train        # needs extract/manifest.json (verify)
    """
    spec = read_spec(spec_file)
    backend = open_backend(spec)
    if dry_run:
        preflight(spec, step.value, cluster_of(backend), force=force, say=output.info, dry_run=True)
        say_dry_submit(spec, backend, step.value, force=force)
        return
    clear_to_start(spec, backend, step.value, force=force)
    name = job_name(spec, step.value)
    outcome = backend.submit(render_selection(spec, step.value), force=force)[name]
    output.info(f"{SUBMITTED[outcome]} Job {name} ({spec.backend}, spec hash {spec.fingerprint()})")
    if not wait:
        output.hint("dflashctl status --watch")
        return
    wait_for_job(backend, step.value, name, timeout=timeout)
    output.hint("dflashctl status")


def clear_to_start(spec: RunSpec, backend: Backend, step: str, *, force: bool, stage_source: str | None = None) -> None:
    """Before a command creates a step's Job: the step's cheap preflight checks, then the output
    claimed for this spec (run.yaml; stage-model writes no output)."""
    preflight(spec, step, cluster_of(backend), force=force, say=output.info, stage_source=stage_source)
    if step != "stage-model":
        claim_here(spec, force=force, say=output.info)


def say_dry_submit(spec: RunSpec, backend: Backend, step: str, *, force: bool) -> None:
    """What submitting the step would do, as kubectl's dry runs say it, one object a line on stdout;
    nothing is written, to the backend or to storage."""
    if output_elsewhere(spec) is None and not storage_for(spec).exists(RUN_KEY):
        output.info(f"would claim {spec.output} for this run (run.yaml)")
    for obj in render_selection(spec, step):
        outcome = submit_outcome(obj, backend.find(obj["kind"], obj["metadata"]["name"]), force=force)
        sys.stdout.write(f"{object_ref(obj)} {outcome} (dry run)\n")
    sys.stdout.flush()


def wait_for_job(backend: Backend, step: str, name: str, *, timeout: float | None) -> None:
    """Blocks until the Job ends, a line each time its summary changes; RunFailed if it failed."""
    last: list[str] = []

    def report(status: JobStatus) -> None:
        line = summarize(step, status)
        if line != (last[-1] if last else None):
            output.info(line)
            last.append(line)

    final = backend.wait(name, timeout=timeout, on_update=report)
    if final.failed_terminally:
        raise RunFailed(f"Job {name} failed: {final.failure_message}", f"`dflashctl status` shows the shards; `dflashctl logs {step}` why")


def register(app: typer.Typer) -> None:
    app.command()(submit)
