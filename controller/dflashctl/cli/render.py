"""`dflashctl render`: the run's Kubernetes objects as YAML or JSON on stdout, or one file per
object in a run directory for Git."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from dflashctl import render as manifests
from dflashctl.placement import patch_warnings
from dflashctl.run_directory import write_manifests
from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, SpecOpt, Targets, read_spec

Selection = Enum("Selection", {selection: selection for selection in manifests.SELECTIONS}, type=str)
FORMATS = ("yaml", "json", "name")


def manifest_format(value: str) -> str:
    """-o is an output format, as everywhere else; a directory given to it (the spelling before
    -d) is refused with the flag that writes one."""
    if value not in FORMATS:
        raise typer.BadParameter(
            f"{value!r} is not an output format: -o takes yaml, json or name. To write one file per object into a directory, use -d {value}"
        )
    return value


FormatOpt = Annotated[
    str,
    typer.Option(
        "-o", "--output", callback=manifest_format, metavar="yaml|json|name",
        help="The format printed on stdout: yaml (a multi-document stream), json (a v1 List) or name (kind.group/name, one a line).",
    ),
]
DirectoryOpt = Annotated[
    Path | None,
    typer.Option(
        "-d", "--dir", "--output-dir", file_okay=False,
        help="Write one YAML file per object into this run directory instead of printing; dflashctl's files of an earlier render that this one does not produce are removed, other files are left alone.",
    ),
]
ForceRenderOpt = Annotated[
    bool, typer.Option("--force", help="Overwrite a run directory that holds another run, or this run from another spec.")
]


def render(
    which: Annotated[Selection, typer.Argument(help="Which step's objects; each comes with the spec ConfigMap.")] = Selection.all,
    spec_file: SpecOpt = DEFAULT_SPEC,
    fmt: FormatOpt = "yaml",
    directory: DirectoryOpt = None,
    force: ForceRenderOpt = False,
) -> None:
    """Print the Kubernetes objects of a run: the same spec gives the same bytes, so they can be committed to Git.

    With -d, a run directory holds exactly what one render of one spec produced. A different spec
    under the same run name is refused (Jobs are immutable: give the run a new name), and so is a
    directory holding another run; --force overwrites either.

    With -n, the objects are rendered into that namespace: metadata, the controller's RoleBinding
    and the spec in the ConfigMap, which the in-cluster controller reads. The spec hash stays the
    same: a namespace is where a run lives, not what it makes.

    Examples:

      dflashctl render extract | kubectl apply -f -

      dflashctl render controller -d k8s/runs/qwen36-27b-v1   # commit it

      dflashctl render train -o json | jq '.items[1].spec'

      dflashctl render controller -n team-a -d k8s/runs/team-a-v1
    """
    if directory is not None and fmt != "yaml":
        raise typer.BadParameter("-d writes YAML files and -o prints to stdout: give one of them", param_hint="'-o' / '-d'")
    spec = read_spec(spec_file)
    objects = manifests.render_selection(spec, which.value)
    for warning in patch_warnings(spec):
        output.info(f"warning: {warning}")
    if directory is None:
        printers = {"yaml": manifests.to_yaml, "json": manifests.to_json, "name": lambda objects: "".join(f"{manifests.object_ref(o)}\n" for o in objects)}
        sys.stdout.write(printers[fmt](objects))
        return
    result = write_manifests(objects, directory, force=force)
    for path in result.removed:
        output.info(f"removed {path} (an earlier render's; not part of this one)")
    for path in result.written:
        output.info(f"wrote {path}")
    for path in result.unchanged:
        output.info(f"unchanged {path}")
    if which is Selection.all:
        # Every step at once would start training before extraction: the controller sequences them.
        output.hint(f"review it; to run it, render the controller instead (`dflashctl render controller -d {directory}`): it creates each step in turn")
    else:
        output.hint(f"kubectl apply -f {directory}")


def register(app: typer.Typer) -> None:
    app.command(targets=Targets.namespace)(render)
