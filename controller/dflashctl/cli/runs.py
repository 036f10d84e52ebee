"""`dflashctl list`: the runs on a backend, found by their objects' labels, with their Jobs' states."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from dflashctl.cli import output
from dflashctl.cli.options import LocatorSpecOpt, OutputFormat, OutputOpt, locate
from dflashctl.cli.status import job_state
from dflashctl.runs import RunListing, list_runs


def list_command(spec_file: LocatorSpecOpt = None, fmt: OutputOpt = OutputFormat.table) -> None:
    """List the runs: each run's Jobs and their states, its output and its spec hash.

    A run is found by the label dflash.dev/run on its Jobs, Services and spec ConfigMap, in the
    namespace (-n, or the spec file's) or, for a local spec, in its local.workdir; its output
    comes from the spec in its ConfigMap. `dflashctl status NAME` then shows one of them.

    Examples:

      dflashctl list

      dflashctl list -n team-a -o name

      dflashctl list -f local.yaml   # the runs in a local spec's workdir
    """
    backend, _, where = locate(spec_file)
    listings = list_runs(backend)
    if fmt is not OutputFormat.table:
        output.result(fmt, {"runs": [listing_json(listing) for listing in listings]}, [f"run/{listing.name}" for listing in listings])
        return
    table = Table(title=f"runs in {where}", title_justify="left")
    for column in ("run", "jobs", "output", "spec hash"):
        table.add_column(column, overflow="fold")
    for listing in listings:
        body = listing_json(listing)
        jobs = ", ".join(f"{component} {state}" for component, state in body["jobs"].items()) or "none"
        table.add_row(listing.name, jobs, body["output"] or "(spec ConfigMap gone)", body["spec_hash"] or "-")
    output.stdout.print(table)
    if not listings:
        output.info(f"no runs in {where}")
    else:
        output.hint(f"dflashctl status {listings[0].name}")


def listing_json(listing: RunListing) -> dict[str, Any]:
    prefix = f"{listing.name}-"
    return {
        "run": listing.name,
        "jobs": {job.name.removeprefix(prefix): job_state(job) for job in listing.jobs},
        "output": None if listing.spec is None else listing.spec.output,
        "spec_hash": next((obj.spec_hash for obj in listing.objects if obj.kind == "ConfigMap"), None),  # as its objects carry it
        "objects": [obj.ref for obj in listing.objects],
    }


def register(app: typer.Typer) -> None:
    app.command("list")(list_command)
