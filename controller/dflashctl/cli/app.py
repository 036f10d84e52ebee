"""Assembles the `dflashctl` command line. Each verb family lives in its own module.

The app adds what every command shares, so that a new command gets it by registering with
`app.command()`: help text that reads as sentences (`help_text`), and `--context` and
`-n/--namespace` where the command talks to a cluster (`with_target_options`; `targets=` says
which, by default both). The same two options before the command (`dflashctl -n team-a status`)
apply to any command; after it they override those.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from importlib.metadata import version as package_version
from typing import Annotated, Any

import typer

from dflashctl.cli.options import ContextOpt, NamespaceOpt, RenderNamespaceOpt, Targets
from dflashctl.target import ClusterTarget, current_target, set_target


def help_text(docstring: str) -> str:
    """A docstring as help that reads as sentences at any terminal width.

    typer keeps a docstring's line breaks, so a paragraph wrapped at 100 columns in the source
    breaks mid-sentence on a terminal of another width: each prose paragraph becomes one line,
    which rich wraps at the terminal's edge. Indented paragraphs (the examples) keep their lines.
    """
    paragraphs = inspect.cleandoc(docstring).split("\n\n")
    return "\n\n".join(
        paragraph if paragraph.startswith(" ") else " ".join(line.strip() for line in paragraph.splitlines())
        for paragraph in paragraphs
    )


def with_target_options(command: Callable[..., Any], targets: Targets) -> Callable[..., Any]:
    """`command` with --context and -n/--namespace (as `targets` says) added to its parameters;
    while it runs they override where the commands talk to (target.py), then the previous
    target is back."""
    if targets is Targets.none:
        return command
    signature = inspect.signature(command, eval_str=True)
    added = {"target_namespace": RenderNamespaceOpt if targets is Targets.namespace else NamespaceOpt}
    if targets is Targets.cluster:
        added = {"target_context": ContextOpt, **added}
    assert not added.keys() & signature.parameters.keys(), f"{command.__name__} has a parameter named like the target options"
    parameters = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=option) for name, option in added.items()]

    @functools.wraps(command)
    def targeted_command(*args: Any, target_context: str | None = None, target_namespace: str | None = None, **kwargs: Any) -> Any:
        given = current_target()
        previous = set_target(ClusterTarget(context=target_context or given.context, namespace=target_namespace or given.namespace))
        try:
            return command(*args, **kwargs)
        finally:
            set_target(previous)

    targeted_command.__signature__ = signature.replace(parameters=[*signature.parameters.values(), *parameters])  # type: ignore[attr-defined]
    return targeted_command


class Dflashctl(typer.Typer):
    """typer.Typer whose commands get `help_text` and their target options (module docstring)."""

    def command(self, name: str | None = None, *, targets: Targets = Targets.cluster, **settings: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:  # type: ignore[override]
        def register(command: Callable[..., Any]) -> Callable[..., Any]:
            if settings.get("help") is None:
                settings["help"] = help_text(command.__doc__ or "")
            typer.Typer.command(self, name, **settings)(with_target_options(command, targets))
            return command

        return register


app = Dflashctl(
    name="dflashctl",
    help="Train DFlash drafters for large hybrid models on Kubernetes: render, submit, watch, verify, train, evaluate.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def print_version(value: bool) -> None:
    if value:
        print(f"dflashctl {package_version('dflash-k8s')}")
        raise typer.Exit()


@app.callback()
def global_options(
    ctx: typer.Context,
    context: ContextOpt = None,
    namespace: NamespaceOpt = None,
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=print_version, help="Print the version and exit.")] = False,
) -> None:
    """Train DFlash drafters for large hybrid models on Kubernetes: render, submit, watch, verify, train, evaluate."""
    previous = set_target(ClusterTarget(context=context, namespace=namespace))
    ctx.call_on_close(lambda: set_target(previous))


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
from dflashctl.cli import runs; runs.register(app)  # noqa: E402,E702
from dflashctl.cli import demo; demo.register(app)  # noqa: E402,E702
from dflashctl.cli import completion; completion.register(app)  # noqa: E402,E702
