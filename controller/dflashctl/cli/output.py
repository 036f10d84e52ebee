"""One output object: results on stdout, progress and hints on stderr."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

stdout = Console(soft_wrap=True)
stderr = Console(stderr=True, soft_wrap=True)


def result_json(data: Any) -> None:
    """Machine-readable result on stdout, one document."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def hint(message: str) -> None:
    """The next command to run, on stderr so that stdout stays parseable."""
    stderr.print(f"[dim]next:[/] {message}")


def info(message: str) -> None:
    stderr.print(message)
