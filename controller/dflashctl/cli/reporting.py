"""How `run`, `eval` and `verify` show a pipeline at work: live bars in a terminal, one line every
few seconds in a pod's log (the in-cluster controller) or CI; and the evaluation report as a table."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn
from rich.table import Table

from dflash_jobs.units import format_duration

from dflashctl.cli import output
from dflashctl.cli.options import OutputFormat
from dflashctl.cli.status import summarize
from dflashctl.pipeline import Reporter, StepUpdate
from dflashctl.progress import format_rate

LINE_INTERVAL_S = 10.0
"""Without a terminal: at most one progress line per step this often."""

def describe(update: StepUpdate) -> str:
    """The text beside a step's bar: its Job, and for extraction and generation the rate and ETA."""
    parts = []
    if update.job is not None:
        parts.append(summarize(update.step, update.job).removeprefix(f"{update.step} "))
    if update.step == "extract" and update.total is not None:
        parts.append(f"chunks {update.done}/{update.total}, {format_rate(update.tokens_per_s)}, ETA {format_duration(update.eta_s)}")
    if update.step == "generate" and update.total is not None:
        parts.append(f"prompts {update.done:,}/{update.total:,}, {format_rate(update.tokens_per_s)} generated, ETA {format_duration(update.eta_s)}")
    return "; ".join(parts)


class LiveReporter:
    """A terminal: a bar per step (chunks for extract and verify, prompts for generate, pods otherwise), milestones above."""

    def __init__(self, console: Console) -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.description:<8}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[detail]}"),
            console=console,
        )
        self.tasks: dict[str, TaskID] = {}

    def say(self, message: str) -> None:
        self.progress.console.print(message)

    def update(self, update: StepUpdate) -> None:
        if update.step not in self.tasks:
            self.tasks[update.step] = self.progress.add_task(update.step, total=None, detail="")
        done, total = update.done, update.total
        if total is None and update.job is not None and update.job.exists:
            done, total = len(update.job.completed_indexes), update.job.completions
        self.progress.update(self.tasks[update.step], completed=done or 0, total=total, detail=describe(update))


class LineReporter:
    """A log: milestones as they happen, progress one line per step when it changed, every few seconds."""

    def __init__(self, console: Console, interval_s: float = LINE_INTERVAL_S) -> None:
        self.console = console
        self.interval_s = interval_s
        self.last: dict[str, tuple[float, str]] = {}

    def say(self, message: str) -> None:
        self.console.print(message, highlight=False)

    def update(self, update: StepUpdate) -> None:
        line = describe(update) or (f"{update.done}/{update.total}" if update.total else "")
        when, previous = self.last.get(update.step, (0.0, ""))
        finished = update.job is not None and update.job.finished
        if line and line != previous and (finished or time.monotonic() - when >= self.interval_s):
            self.console.print(f"{update.step}: {line}", highlight=False)
            self.last[update.step] = (time.monotonic(), line)


@contextmanager
def reporter_for(console: Console) -> Iterator[Reporter]:
    """Live bars on a terminal, plain lines anywhere else."""
    if not console.is_terminal:
        yield LineReporter(console)
        return
    live = LiveReporter(console)
    with live.progress:
        yield live


def print_report(report: dict[str, Any], fmt: OutputFormat, names: Iterable[str] = ()) -> None:
    """eval/report.json as JSON or YAML (`names` for -o name), or one row per drafter (and per draft
    tree budget it decoded with) and one for plain greedy; tau with its 95% interval over the prompts."""
    if fmt is not OutputFormat.table:
        output.result(fmt, report, names)
        return
    title = f"evaluation: {report.get('prompts', '?')} held-out prompts, block size {report.get('block_size', '?')}"
    table = Table(title=title, title_justify="left")
    for column in ("decoding", "acceptance length [95% interval]", "tokens/s", "speed-up", "equals greedy"):
        table.add_column(column, justify="left" if column == "decoding" else "right")
    greedy = report.get("greedy") or {}
    table.add_row("greedy (reference)", "1.00", _number(greedy.get("tokens_per_second")), "1.00x", "-")
    for name, summary in (report.get("drafters") or {}).items():
        _decoding_row(table, name, summary)
        for budget, decoded in ((summary.get("tree") or {}).get("decoded") or {}).items():
            _decoding_row(table, f"  tree of {budget}", decoded)  # under its drafter
    output.stdout.print(table)
    for name, prompt_set in (report.get("prompt_sets") or {}).items():
        output.stdout.print(_prompt_set_table(name, prompt_set))
    if report.get("vllm_serve"):
        output.stdout.print(f"serve it with vLLM:\n{report['vllm_serve']}", markup=False, highlight=False)


def _prompt_set_table(name: str, prompt_set: dict[str, Any]) -> Table:
    """A named prompt set's table (eval.prompt_sets): a row per drafter, its acceptance per position beside tau."""
    refused = ", ".join(f"{rows} {reason}" for reason, rows in (prompt_set.get("refused") or {}).items()) or "none"
    title = (f"prompt set {name}: {prompt_set.get('prompts', '?')} prompts of {prompt_set.get('rows', '?')} rows ({prompt_set.get('source')}; "
             f"refused: {refused}), speeds on {prompt_set.get('timed_prompts', '?')}")
    table = Table(title=title, title_justify="left")
    for column in ("decoding", "acceptance length [95% interval]", "accepted per position", "tokens/s", "speed-up", "equals greedy"):
        table.add_column(column, justify="left" if column == "decoding" else "right")
    table.add_row("greedy (reference)", "1.00", "-", _number(prompt_set.get("greedy_tokens_per_second")), "1.00x", "-")
    for drafter, figures in (prompt_set.get("drafters") or {}).items():
        table.add_row(drafter, _acceptance(figures), " ".join(f"{rate:.2f}" for rate in figures.get("acceptance_per_position") or []),
                      _number(figures.get("tokens_per_second")), f"{_number(figures.get('speedup'))}x",
                      "yes" if figures.get("lossless") else "[red]NO[/]")
    return table


def _decoding_row(table: Table, name: str, figures: dict[str, Any]) -> None:
    """A decoding's row: metrics.summarize's figures (a drafter's, or its draft trees' at one budget)."""
    table.add_row(
        name,
        _acceptance(figures),
        _number(figures.get("tokens_per_second")),
        f"{_number(figures.get('speedup'))}x",
        "yes" if figures.get("lossless") else "[red]NO[/]",
    )


def _acceptance(figures: dict[str, Any]) -> str:
    """tau, and its 95% interval over the prompts where the report has one (evaluate/intervals.py)."""
    low, high = figures.get("acceptance_length_interval") or (None, None)
    interval = f" [{low:.2f}, {high:.2f}]" if low is not None and high is not None else ""
    return _number(figures.get("acceptance_length")) + interval


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
