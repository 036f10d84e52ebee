"""The `dflashctl` entry point: runs the typer app and turns typed errors into exit codes."""

from __future__ import annotations

import os
import sys

from dflashctl.cli.app import app
from dflashctl.cli.completion import PROG_NAME
from dflashctl.errors import EXIT_INTERRUPTED, DflashError, exit_code


def main() -> None:
    debug = os.environ.get("DFLASHCTL_DEBUG") == "1"
    try:
        app(prog_name=PROG_NAME)  # one name however it was started: the completion script calls it back by it
    except SystemExit as stop:
        if stop.code == EXIT_INTERRUPTED:  # typer turns Ctrl-C into this exit
            print("Interrupted: detached, the run goes on. `dflashctl status` shows it.", file=sys.stderr)
        raise
    except DflashError as error:
        if debug:
            raise
        print(f"Error: {error}", file=sys.stderr)
        sys.exit(exit_code(error))
    except Exception as error:  # noqa: BLE001 - the last line of defence prints, not a traceback
        if debug:
            raise
        print(f"Error: {type(error).__name__}: {error}. Set DFLASHCTL_DEBUG=1 for the traceback.", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
