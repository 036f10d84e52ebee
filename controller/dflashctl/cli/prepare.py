"""`dflashctl prepare`: tokenize data.source into <output>/tokens, here, in a subprocess.

The control plane never imports torch or transformers: prepare runs as `python -m dflash_jobs.prepare`
with this interpreter, the same command its Kubernetes Job runs (`dflashctl render prepare`).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Annotated

import typer

from dflash_jobs.errors import EXIT_BAD_SPEC, EXIT_OK
from dflash_jobs.spec import load_spec

from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, SpecOpt, Targets
from dflashctl.errors import EXIT_RUN_FAILED, EXIT_USAGE


def prepare(
    spec_file: SpecOpt = DEFAULT_SPEC,
    strict: Annotated[bool, typer.Option("--strict", help="Fail on the first bad or over-long row instead of dropping or truncating it.")] = False,
) -> None:
    """Tokenize data.source with the target's tokenizer and chat template into token chunks.

    Bad rows are dropped and counted by reason in <output>/tokens/dataset.json (each one listed in
    tokens/rejected.jsonl); --strict stops at the first one instead, naming its line.

    Examples:

      dflashctl prepare

      dflashctl prepare --strict && dflashctl plan
    """
    load_spec(spec_file)  # a bad spec fails here, with the usual message, before any import of torch
    command = [sys.executable, "-m", "dflash_jobs.prepare", "-f", str(spec_file)] + (["--strict"] if strict else [])
    code = subprocess.run(command).returncode  # its log lines stream through to this terminal
    if code == EXIT_OK:
        output.hint(f"dflashctl plan -f {spec_file}   (exact tokens, storage and GPU-hours)")
        return
    output.info(f"prepare failed (exit code {code}); its log above names the cause")
    raise typer.Exit(EXIT_USAGE if code == EXIT_BAD_SPEC else EXIT_RUN_FAILED)


def register(app: typer.Typer) -> None:
    app.command(targets=Targets.none)(prepare)
