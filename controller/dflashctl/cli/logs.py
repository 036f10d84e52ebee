"""`dflashctl logs`: the log of one shard, or of every shard prefixed with its index."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from dflash_jobs.spec import load_spec

from dflashctl.backends import open_backend
from dflashctl.cli.options import DEFAULT_SPEC, ShardOpt, SpecOpt
from dflashctl.cli.status import current_step, job_statuses
from dflashctl.cli.submit import Step
from dflashctl.errors import RunFailed
from dflashctl.render import job_name


def logs(
    step: Annotated[Step | None, typer.Argument(help="Whose logs; default: the furthest step that has a Job.")] = None,
    spec_file: SpecOpt = DEFAULT_SPEC,
    shard: ShardOpt = None,
    follow: Annotated[bool, typer.Option("--follow", "-F", help="Keep streaming until the pods end.")] = False,
) -> None:
    """Print pod logs of the run: one shard, or every shard with its index before each line.

    Examples:

      dflashctl logs --shard 3 --follow

      dflashctl logs train --follow

      dflashctl logs extract | grep tokens/s
    """
    spec = load_spec(spec_file)
    backend = open_backend(spec)
    chosen = step.value if step is not None else current_step(job_statuses(spec, backend))
    if chosen is None:
        raise RunFailed(f"run {spec.name} has no Jobs yet", "Start it with `dflashctl run` (or `dflashctl submit extract`)")
    for line in backend.logs(job_name(spec, chosen), shard, follow):
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def register(app: typer.Typer) -> None:
    app.command()(logs)
