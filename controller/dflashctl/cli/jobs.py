"""`dflashctl cancel`, `dflashctl retry` and `dflashctl delete`: stop a run, run its failed Jobs again,
or remove a run by name.

cancel and delete remove the run's objects only (its Jobs with their pods, its Services, its spec
ConfigMap: every object labelled with its name, never another run's), and keep its storage:
chunks whose done marker exists are not extracted again, so cancel then `dflashctl run`, or retry,
loses nothing that has landed. `delete --data` also deletes the storage, after a confirmation.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from dflash_jobs.errors import InputError
from dflash_jobs.spec import RunSpec

from dflashctl.backend import EVENT_SHARDS_RETRIED, Backend, format_indexes
from dflashctl.backends import open_backend
from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, DryRunOpt, LocatorSpecOpt, SpecOpt, backend_location, locate, read_spec
from dflashctl.cli.status import job_statuses
from dflashctl.cli.submit import Step, clear_to_start
from dflashctl.render import STEPS, job_name, render_selection
from dflashctl.runs import delete_objects, output_objects, remove_run, stored_spec

RunArg = Annotated[str, typer.Argument(help="The run's name (its spec's `name`).", show_default=False)]
OptionalRunArg = Annotated[str | None, typer.Argument(help="A run by name instead of the spec file's run.", show_default=False)]


def cancel(run: OptionalRunArg = None, spec_file: LocatorSpecOpt = None, dry_run: DryRunOpt = False) -> None:
    """Stop a run: delete its Jobs and their pods, its Services and its spec ConfigMap; its storage stays.

    The run is the spec file's, or the one named (found on the spec file's backend, else in the
    cluster's namespace). Only objects labelled with the run's name are deleted, never another
    run's, nor the namespace's shared ServiceAccount, Role and RoleBinding.

    Examples:

      dflashctl cancel

      dflashctl cancel && dflashctl run     # start over; landed chunks are kept

      dflashctl cancel qwen36-27b-v1 -n team-a --dry-run
    """
    backend, spec, run_name, where = run_to_remove(run, spec_file)
    remove(backend, spec, run_name, where, dry_run=dry_run, named=run is not None)
    if not dry_run:
        output.hint("dflashctl run   (resumes: landed chunks are not extracted again)")


def delete(
    run: RunArg,
    spec_file: LocatorSpecOpt = None,
    data: Annotated[bool, typer.Option("--data", help="Also delete the run's storage (its output: chunks, checkpoints, drafter), after a confirmation.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Confirm --data without a prompt (scripts).")] = False,
    dry_run: DryRunOpt = False,
) -> None:
    """Remove a run by name: its Jobs, pods, Services and spec ConfigMap; with --data its storage too.

    As cancel, it deletes only the objects labelled with the run's name. The storage is kept
    unless --data asks for it: then every object under the run's output is deleted once you
    confirm (or --yes), and only if that output holds this run.

    Examples:

      dflashctl delete qwen36-27b-v1

      dflashctl delete qwen36-27b-v1 --data --dry-run   # what would go

      dflashctl delete old-run --data --yes -n team-a
    """
    backend, spec, run_name, where = run_to_remove(run, spec_file)
    if data and spec is None:
        raise InputError(f"the output of run {run_name} is not known here: its spec ConfigMap is gone", "Give its spec file with -f")
    remove(backend, spec, run_name, where, dry_run=dry_run, named=True, data=data, yes=yes)


def run_to_remove(run: str | None, spec_file: Path | None) -> tuple[Backend, RunSpec | None, str, str]:
    """The backend, the run's spec (None when only its name is known), its name, and where it is."""
    if run is None:
        spec = read_spec(spec_file or DEFAULT_SPEC)
        return open_backend(spec), spec, spec.name, backend_location(spec)
    backend, file_spec, where = locate(spec_file)
    spec = file_spec if file_spec is not None and file_spec.name == run else stored_spec(backend, run)
    return backend, spec, run, where


def remove(backend: Backend, spec: RunSpec | None, run: str, where: str, *, dry_run: bool, named: bool, data: bool = False, yes: bool = False) -> None:
    """Deletes the run's objects (and with `data` its storage, once confirmed: before anything is
    deleted), then says what it kept."""
    storage, keys = output_objects(spec) if data and spec is not None else (None, [])
    question = f"Delete the {len(keys):,} objects under {spec.output if spec else ''} (run {run}'s chunks, checkpoints and drafter)?"
    if data and keys and not dry_run and not confirmed(question, yes):
        output.info("nothing deleted")
        return
    removed = remove_run(backend, run, dry_run=dry_run, say=output.info)
    if not removed and named and not data:
        raise InputError(f"no run {run!r} in {where}: no Job, Service or ConfigMap carries its label", "`dflashctl list` shows the runs there")
    if not removed:
        output.info(f"run {run} has no objects in {where}")
    if storage is not None:
        if not dry_run:
            delete_objects(storage, keys)
        output.info(f"{len(keys):,} objects under {storage.url} deleted{' (dry run)' if dry_run else ''}")
    elif spec is not None:
        output.info(f"kept: {spec.output} (the run's storage; `dflashctl delete {run} --data` deletes it)")
    if spec is not None and spec.backend == "kubernetes":
        output.info(f"kept: ServiceAccount, Role and RoleBinding {spec.cluster.service_account} (shared by the namespace's runs)")


def confirmed(question: str, yes: bool) -> bool:
    if yes:
        return True
    if not sys.stdin.isatty():
        raise InputError(f"{question} needs a confirmation, and stdin is not a terminal: nothing was deleted", "Pass --yes to delete it without a prompt")
    return typer.confirm(question, default=False)


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
        clear_to_start(spec, backend, name, force=False)
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
    app.command()(delete)
