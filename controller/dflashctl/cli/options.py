"""Options shared by the commands. Flags select things; every knob of a run lives in the spec."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer


class OutputFormat(str, Enum):
    table = "table"
    json = "json"


SpecOpt = Annotated[
    Path,
    typer.Option("-f", "--file", help="The run spec (YAML).", envvar="DFLASH_SPEC", show_default=True),
]
OutputOpt = Annotated[OutputFormat, typer.Option("-o", "--output", help="table for people, json for machines.")]
WatchOpt = Annotated[bool, typer.Option("--watch", "-w", help="Keep refreshing until the run ends.")]
ShardOpt = Annotated[int | None, typer.Option("--shard", help="Extraction shard (Job completion index).")]
TimeoutOpt = Annotated[float | None, typer.Option("--timeout", help="Give up waiting after this many seconds (exit 3); the Jobs go on.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Delete and recreate what a different spec left under this name (its Jobs, run.yaml).")]

DEFAULT_SPEC = Path("dflash.yaml")
