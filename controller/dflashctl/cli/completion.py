"""`dflashctl completion bash|zsh|fish`: the shell's completion script on stdout, as `kubectl
completion` prints its own. The script calls dflashctl back with _DFLASHCTL_COMPLETE set, and
typer completes commands, options, steps and choices from the app itself."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer
import typer.completion

from dflashctl.cli.options import Targets

PROG_NAME = "dflashctl"
COMPLETE_VAR = "_DFLASHCTL_COMPLETE"
"""The variable the script sets when it asks dflashctl for completions (click's _<PROG>_COMPLETE)."""

Shell = Enum("Shell", {shell: shell for shell in ("bash", "zsh", "fish")}, type=str)


def completion(shell: Annotated[Shell, typer.Argument(help="The shell to complete in.")]) -> None:
    """Print the shell completion script: commands, options, steps and choices complete with Tab.

    Examples:

      source <(dflashctl completion bash)   # also in ~/.bashrc, to keep it

      dflashctl completion zsh > "${fpath[1]}/_dflashctl"

      dflashctl completion fish > ~/.config/fish/completions/dflashctl.fish
    """
    print(typer.completion.get_completion_script(prog_name=PROG_NAME, complete_var=COMPLETE_VAR, shell=shell.value))


def register(app: typer.Typer) -> None:
    # Typer's completion classes, which answer the script's calls (typer's own --install-completion is off).
    typer.completion.completion_init()
    app.command(targets=Targets.none)(completion)
