"""`dflashctl init`: write a commented starter spec."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dflash_jobs.errors import InputError

from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, SpecOpt, Targets
from dflashctl.demo import write_demo
from dflashctl.starter import starter_spec


def init(
    spec_file: SpecOpt = DEFAULT_SPEC,
    demo: Annotated[Path | None, typer.Option("--demo", metavar="DIR", help="Also write a tiny target and chat data into DIR, and a spec for them on the local backend.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing spec file.")] = False,
) -> None:
    """Write a starter dflash.yaml: every section and field with its default, each one explained.

    Examples:

      dflashctl init && $EDITOR dflash.yaml && dflashctl plan

      dflashctl init -f runs/qwen36-27b-v1.yaml

      dflashctl init --demo demo && dflashctl run      # what `dflashctl demo` does
    """
    if spec_file.exists() and not force:
        raise InputError(f"{spec_file} already exists", "Pass --force to overwrite it, or -f to write another file")
    if demo is not None:
        output.info(f"writing a tiny target and chat data into {demo} (about a minute: the target is taught a little)")
        write_demo(demo, spec_file, overwrite=True)
        output.info(f"wrote {spec_file}: the local backend, output in {demo}/output")
        output.hint(f"dflashctl run -f {spec_file}")
        return
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(starter_spec())
    output.info(f"wrote {spec_file}: set name, target.model, data.source and output, and cluster.image and controller_image to the images you pushed")
    output.hint(f"dflashctl plan -f {spec_file}")


def register(app: typer.Typer) -> None:
    app.command(targets=Targets.none)(init)
