"""Every command's --help reads as sentences, at any terminal width.

What is checked, on the help as typer renders it (rich, through typer.testing's runner):
- at a width where nothing needs wrapping (1000 columns), every line of the description is either
  a line of an example (an indented paragraph of the docstring) or ends a sentence or a heading
  (".", ":", ")"): a line that stops mid-sentence is a line break of the source; likewise each
  option's help and each command's summary in the list fits one row;
- at 80 columns, the width of a small terminal, every example line is printed whole: a command
  wrapped mid-line cannot be copied.
"""

from __future__ import annotations

import inspect
import re

import pytest
import typer.main
import typer.rich_utils
from typer.testing import CliRunner

from dflashctl.cli.app import app, help_text

COMMANDS = sorted(typer.main.get_command(app).commands)


def rendered_help(monkeypatch, width: int, *command: str) -> str:
    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", width)
    result = CliRunner().invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    return result.output


def example_lines(command: str) -> list[str]:
    """The lines of the docstring's indented paragraphs: examples, kept line by line."""
    callback = typer.main.get_command(app).commands[command].callback
    paragraphs = inspect.cleandoc(inspect.unwrap(callback).__doc__ or "").split("\n\n")
    return [line.strip() for paragraph in paragraphs if paragraph.startswith(" ") for line in paragraph.splitlines()]


def test_there_are_commands_to_check():
    assert {"render", "logs", "status", "plan", "run"} <= set(COMMANDS) and len(COMMANDS) >= 14


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_no_line_of_help_breaks_mid_sentence(monkeypatch, command):
    text = rendered_help(monkeypatch, 1000, *filter(None, [command]))
    description, _, panels = text.partition("╭")
    examples = example_lines(command) if command else []
    for line in description.splitlines():
        line = line.strip()
        if line and not line.startswith("Usage:") and line not in examples:
            assert line.endswith((".", ":", ")")), f"dflashctl {command} --help: {line!r} breaks mid-sentence"
    # In the option and command panels, a row that starts with blank columns continues the one above.
    continued = [row.strip() for row in panels.splitlines() if re.match(r"│\s{12,}\S", row)]
    assert continued == [], f"dflashctl {command} --help: rows broken in two: {continued}"


@pytest.mark.parametrize("command", COMMANDS)
def test_examples_are_printed_whole_on_a_small_terminal(monkeypatch, command):
    text = rendered_help(monkeypatch, 80, command)
    examples = example_lines(command)
    assert examples, f"dflashctl {command} has no examples"
    for line in examples:
        assert line in text, f"dflashctl {command} --help wraps the example {line!r} ({len(line)} characters)"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_with_json_output_also_prints_yaml_and_names(command):
    """kubectl's habit: wherever -o json is, -o yaml and -o name are too (the refusal of a bogus -o lists them)."""
    if not any("-o" in parameter.opts for parameter in typer.main.get_command(app).commands[command].params):
        return
    refused = CliRunner().invoke(app, [command, "-o", "bogus"]).output
    assert all(f"{choice}" in refused for choice in ("json", "yaml", "name")), f"dflashctl {command} -o: {refused}"


def test_help_text_joins_prose_and_keeps_examples():
    doc = """First line of the summary
    and its end.

    A paragraph wrapped in the source
    at some width.

    Examples:

      dflashctl status
      dflashctl logs -f
    """
    assert help_text(doc) == (
        "First line of the summary and its end.\n\nA paragraph wrapped in the source at some width.\n\n"
        "Examples:\n\n  dflashctl status\n  dflashctl logs -f"
    )
