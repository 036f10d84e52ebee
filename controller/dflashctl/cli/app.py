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
from dflashctl.cli import init; init.register(app)  # noqa: E402,E702
from dflashctl.cli import check; check.register(app)  # noqa: E402,E702
from dflashctl.cli import stage_model; stage_model.register(app)  # noqa: E402,E702
from dflashctl.cli import plan; plan.register(app)  # noqa: E402,E702
from dflashctl.cli import prepare; prepare.register(app)  # noqa: E402,E702
from dflashctl.cli import render; render.register(app)  # noqa: E402,E702
from dflashctl.cli import submit; submit.register(app)  # noqa: E402,E702
from dflashctl.cli import run; run.register(app)  # noqa: E402,E702
from dflashctl.cli import verify; verify.register(app)  # noqa: E402,E702
from dflashctl.cli import eval; eval.register(app)  # noqa: E402,E702
from dflashctl.cli import export_states; export_states.register(app)  # noqa: E402,E702
from dflashctl.cli import status; status.register(app)  # noqa: E402,E702
from dflashctl.cli import logs; logs.register(app)  # noqa: E402,E702
from dflashctl.cli import jobs; jobs.register(app)  # noqa: E402,E702
from dflashctl.cli import demo; demo.register(app)  # noqa: E402,E702
