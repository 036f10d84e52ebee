"""`dflashctl render`: the run's Kubernetes objects as YAML, for kubectl or Git."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from dflash_jobs.spec import load_spec

from dflashctl import render as manifests
from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, SpecOpt

Selection = Enum("Selection", {selection: selection for selection in manifests.SELECTIONS}, type=str)


def render(
    which: Annotated[Selection, typer.Argument(help="Which step's objects; each comes with the spec ConfigMap.")] = Selection.all,
    spec_file: SpecOpt = DEFAULT_SPEC,
    directory: Annotated[Path | None, typer.Option("-o", "--output-dir", help="Write one file per object here instead of stdout.")] = None,
) -> None:
    """Print the Kubernetes objects of a run as deterministic YAML (the same spec, the same bytes).

    Examples:

      dflashctl render extract | kubectl apply -f -

      dflashctl render controller -o k8s/runs/qwen36-27b-v1   # commit it; Argo CD or Flux applies it
    """
    spec = load_spec(spec_file)
    objects = manifests.render_selection(spec, which.value)
    if directory is None:
        sys.stdout.write(manifests.to_yaml(objects))
        return
    for path in manifests.write_manifests(objects, directory):
        output.info(f"wrote {path}")
    if which is Selection.all:
        # Every step at once would start training before extraction: the controller sequences them.
        output.hint("to run it, apply the controller (`dflashctl render controller -o DIR`): it creates each step in turn")
    else:
        output.hint(f"kubectl apply -f {directory}")


def register(app: typer.Typer) -> None:
    app.command()(render)
