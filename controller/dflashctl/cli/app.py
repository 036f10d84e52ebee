"""Assembles the `dflashctl` command line. Each verb family lives in its own module."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="dflashctl",
    help="Train DFlash drafters for large hybrid models on Kubernetes: render, submit, watch, verify, train, evaluate.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Commands register below, one line per verb family (keep this list sorted by pipeline order).
