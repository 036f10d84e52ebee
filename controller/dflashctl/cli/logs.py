"""`dflashctl logs`: the log of one shard, or of every shard prefixed with its index, with kubectl
logs' options: --follow, --tail, --since, -p/--previous, -c/--container. -f is the spec file, as
everywhere (kubectl's -f is always a file); -F follows."""

from __future__ import annotations

import re
import sys
from typing import Annotated

import typer

from dflash_jobs.errors import InputError

from dflashctl.backend import LogQuery
from dflashctl.backends import open_backend
from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, ShardOpt, SpecOpt, read_spec
from dflashctl.cli.status import current_step, job_statuses
from dflashctl.cli.submit import Step
from dflashctl.render import WORKER, job_name

DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def duration_seconds(value: str | None) -> float | None:
    """--since: a duration as kubectl writes it (30s, 5m, 2h, 1h30m) in seconds."""
    if value is None:
        return None
    match = DURATION.match(value)
    if match is None or not any(match.groups()):
        raise typer.BadParameter(f"{value!r} is not a duration: a number with h, m or s, as 30s, 5m, 2h or 1h30m")
    hours, minutes, seconds = (int(part or 0) for part in match.groups())
    return float(hours * 3600 + minutes * 60 + seconds)


FollowOpt = Annotated[bool, typer.Option("--follow", "-F", help="Keep streaming until the pods end (kubectl logs -f); pods not started yet are waited for.")]
TailOpt = Annotated[int | None, typer.Option("--tail", min=0, help="Only the last N lines of each log (with --follow: then the new ones).")]
SinceOpt = Annotated[
    float | None,
    typer.Option("--since", metavar="DURATION", parser=duration_seconds, help="Only the lines of the last DURATION (30s, 5m, 2h); the kubernetes backend only."),
]
PreviousOpt = Annotated[bool, typer.Option("-p", "--previous", help="The shard's attempt before its newest (a Job retries a shard with a new pod).")]
ContainerOpt = Annotated[
    str, typer.Option("-c", "--container", help="The pod's container: worker, or the init containers selfcheck and (vLLM generation) stage.")
]


def logs(
    step: Annotated[Step | None, typer.Argument(help="Whose logs; default: the furthest step that has a Job.")] = None,
    spec_file: SpecOpt = DEFAULT_SPEC,
    shard: ShardOpt = None,
    follow: FollowOpt = False,
    tail: TailOpt = None,
    since: SinceOpt = None,
    previous: PreviousOpt = False,
    container: ContainerOpt = WORKER,
) -> None:
    """Print pod logs of the run: one shard, or every shard with its index before each line.

    A pod that has not started has no log yet: its shard is named on stderr with why it waits
    (Pending, and its latest events such as FailedScheduling with the scheduler's message), and
    the command exits 0; with --follow it waits for the pod to start, then follows it. A run, step
    or shard that has no Job or pod exits 2, naming those that exist.

    Examples:

      dflashctl logs --shard 3 --follow

      dflashctl logs train -F --tail 20 -f runs/qwen36-27b-v1.yaml

      dflashctl logs extract --shard 1 -c selfcheck   # the image's own checks

      dflashctl logs extract --shard 1 -p   # the attempt before the retry

      dflashctl logs extract --since 10m | grep tokens/s
    """
    spec = read_spec(spec_file)
    backend = open_backend(spec)
    if step is None:
        chosen = current_step(job_statuses(spec, backend))
        if chosen is None:
            raise InputError(f"run {spec.name} has no Jobs yet: no pod has a log", "Start it with `dflashctl run` (or `dflashctl submit extract`)")
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
    query = LogQuery(container=container, follow=follow, tail=tail, since_s=since, previous=previous)
    lines = backend.logs(name, shard, query)
    if not previous:
        for note in backend.waiting(name, shard):
            output.info(note)
    for line in lines:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def register(app: typer.Typer) -> None:
    app.command()(logs)
