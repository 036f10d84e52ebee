"""`dflashctl logs`: the log of one shard, or of every shard prefixed with its index; `-f` follows,
as in `kubectl logs -f`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from dflash_jobs.errors import InputError

from dflashctl.backends import open_backend
from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, ShardOpt, read_spec
from dflashctl.cli.status import current_step, job_statuses
from dflashctl.cli.submit import Step
from dflashctl.errors import RunFailed
from dflashctl.render import job_name

SPEC_SUFFIXES = (".yaml", ".yml")


class LogsCommand(TyperCommand):
    """Reads `-f FILE` as `--spec FILE`, the spelling before -f meant --follow, where that cannot
    be ambiguous: FILE exists and ends in .yaml or .yml (no step is named so)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return super().parse_args(ctx, legacy_spec_flag(args))


def legacy_spec_flag(args: list[str]) -> list[str]:
    rewritten = list(args)
    for i, arg in enumerate(rewritten[:-1]):
        following = rewritten[i + 1]
        if arg == "-f" and following.endswith(SPEC_SUFFIXES) and Path(following).is_file():
            rewritten[i] = "--spec"
            output.info(f"note: read `-f {following}` as `--spec {following}`; -f now follows the log, as in kubectl")
    return rewritten


SpecOnlyOpt = Annotated[
    Path,
    typer.Option("--spec", "--file", help="The run spec (YAML). -f FILE still works for a FILE ending in .yaml or .yml.", envvar="DFLASH_SPEC", show_default=True),
]
FollowOpt = Annotated[
    bool, typer.Option("-f", "--follow", "-F", help="Keep streaming until the pods end, as kubectl logs -f; pods not started yet are waited for.")
]


def logs(
    step: Annotated[Step | None, typer.Argument(help="Whose logs; default: the furthest step that has a Job.")] = None,
    spec_file: SpecOnlyOpt = DEFAULT_SPEC,
    shard: ShardOpt = None,
    follow: FollowOpt = False,
) -> None:
    """Print pod logs of the run: one shard, or every shard with its index before each line.

    A pod that has not started has no log yet: its shard is named on stderr with why it waits
    (Pending, and its latest events such as FailedScheduling with the scheduler's message), and
    the command exits 0; with -f it waits for the pod to start, then follows it.

    Examples:

      dflashctl logs --shard 3 -f

      dflashctl logs train -f --spec runs/qwen36-27b-v1.yaml

      dflashctl logs extract | grep tokens/s
    """
    spec = read_spec(spec_file)
    backend = open_backend(spec)
    if step is None:
        chosen = current_step(job_statuses(spec, backend))
        if chosen is None:
            raise RunFailed(f"run {spec.name} has no Jobs yet", "Start it with `dflashctl run` (or `dflashctl submit extract`)")
    else:
        chosen = step.value
    name = job_name(spec, chosen)
    job = backend.job_status(name)
    if not job.exists:
        raise InputError(f"run {spec.name} has no {chosen} Job ({name})", "`dflashctl status` shows the Jobs that exist")
    if shard is not None and shard >= job.completions:
        raise InputError(
            f"--shard {shard} is not a shard of Job {name}: its shards are 0..{job.completions - 1}",
            "Pick one of them; `dflashctl status` shows each shard's pod",
        )
    for note in backend.waiting(name, shard):
        output.info(note)
    for line in backend.logs(name, shard, follow):
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def register(app: typer.Typer) -> None:
    app.command(cls=LogsCommand)(logs)
