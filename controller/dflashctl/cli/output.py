"""One output object: results on stdout, progress and hints on stderr."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import yaml
from rich.console import Console

if TYPE_CHECKING:
    from dflashctl.cli.options import OutputFormat

stdout = Console(soft_wrap=True)
stderr = Console(stderr=True, soft_wrap=True)


def result_json(data: Any) -> None:
    """Machine-readable result on stdout, one document."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def result(fmt: OutputFormat, data: Any, names: Iterable[str]) -> None:
    """A command's result for machines (-o): the document as JSON or as YAML (each starting with
    `---`, so that a watch prints a stream), or with name the `names` of what it is about, a line each."""
    if fmt.value == "json":
        result_json(data)
    elif fmt.value == "yaml":
        plain = json.loads(json.dumps(data, default=str))  # the same values the JSON holds
        sys.stdout.write(yaml.safe_dump(plain, sort_keys=True, explicit_start=True, default_flow_style=False, width=1000))
    else:
        sys.stdout.write("".join(f"{name}\n" for name in names))
    sys.stdout.flush()


def hint(message: str) -> None:
    """The next command to run, on stderr so that stdout stays parseable."""
    stderr.print(f"[dim]next:[/] {message}")


def info(message: str) -> None:
    stderr.print(message)
