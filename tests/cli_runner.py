"""`dflashctl ARGS` in the test's process, through the real entry point (main(), its exit codes)."""

from __future__ import annotations

import pytest

from dflashctl.cli.main import main


def cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """Runs `dflashctl ARGS` through main(); returns (exit code, stdout, stderr)."""
    monkeypatch.setattr("sys.argv", ["dflashctl", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err
