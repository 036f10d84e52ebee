"""`dflashctl check`: every preflight check of a run, one line each with the fix (check/)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table


from dflashctl.backends import open_backend
from dflashctl.check import CheckResult, Preflight, cluster_of, exit_code_of, run_checks
from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, OutputFormat, OutputOpt, SpecOpt, read_spec
from dflashctl.errors import ClusterUnreachable

STYLES = {"ok": "green", "warn": "yellow", "fail": "bold red", "skipped": "dim"}


def check(
    spec_file: SpecOpt = DEFAULT_SPEC,
    fmt: OutputOpt = OutputFormat.table,
    probe: Annotated[bool, typer.Option("--probe/--no-probe", help="Read the target's config.json through a small pod on the model volume when it is not readable here.")] = True,
) -> None:
    """Check everything a run needs before a GPU is spent, one line per check with its fix.

    Namespace, permissions, Secrets, volumes, nodes, the output, data.source, the target
    checkpoint, the image. Exit 2 when a check fails (4: the cluster, 5: storage); `run` and
    `submit` run those of their step by themselves and start nothing this refuses.

    Examples:

      dflashctl check

      dflashctl check -o json | jq '.checks[] | select(.status == "fail")'

      dflashctl check -o name   # the checks that fail, one a line

      dflashctl check --no-probe   # no pod: the target is read only from here
    """
    spec = read_spec(spec_file)
    try:
        preflight = Preflight(spec, cluster=cluster_of(open_backend(spec)), probe=probe)
    except ClusterUnreachable as error:  # no kubeconfig: the storage and spec checks still run
        preflight = Preflight(spec, probe=probe, cluster_error=error)
    results = run_checks(preflight)
    code = exit_code_of(results)
    if fmt is OutputFormat.table:
        output.stdout.print(results_table(spec.name, results))
    else:
        failed = [f"check/{result.name.replace(' ', '-')}" for result in results if result.status == "fail"]
        output.result(fmt, {"run": spec.name, "checks": [result.to_dict() for result in results], "exit_code": code}, failed)
    if code:
        output.hint("fix what failed (each line says how), then `dflashctl check` again")
        raise typer.Exit(code)
    output.hint(f"dflashctl plan -f {spec_file}   (then `dflashctl run`)")


def results_table(run: str, results: list[CheckResult]) -> Table:
    table = Table(title=f"checks for {run}", title_justify="left")
    for column in ("", "check", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for result in results:
        fix = result.fix if result.status in ("warn", "fail") else ""
        table.add_row(f"[{STYLES[result.status]}]{result.status}[/]", result.name, escape(result.detail), escape(fix))
    return table


def register(app: typer.Typer) -> None:
    app.command()(check)
