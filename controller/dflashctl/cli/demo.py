"""`dflashctl demo`: `init --demo` and `run` in one, on the local backend, then what it made."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from dflash_jobs.spec import load_spec
from dflash_jobs.storage import storage_for

from dflashctl.backends import open_backend
from dflashctl.cli import output
from dflashctl.cli.options import OutputFormat, Targets
from dflashctl.cli.reporting import print_report, reporter_for
from dflashctl.demo import SPEC_NAME, DemoSummary, summarize_demo, write_demo
from dflashctl.pipeline import run_pipeline
from dflashctl.progress import format_rate

DirectoryArg = Annotated[Path, typer.Argument(help="Where the demo writes its target, data, spec and run.")]
DemoOutputOpt = Annotated[
    str | None,
    typer.Option("--output", help="Store the run here instead of DIR/output, e.g. s3://bucket/demo (AWS_ENDPOINT_URL for MinIO)."),
]
FreshOpt = Annotated[bool, typer.Option("--fresh", help="Delete DIR (an earlier demo's) first and start over; an --output elsewhere is kept.")]
OnlineOpt = Annotated[bool, typer.Option("--online", help="Train on online states: no extraction, the training Job runs the target (train.states: online).")]


def demo(directory: DirectoryArg = Path("demo"), output_url: DemoOutputOpt = None, fresh: FreshOpt = False, online: OnlineOpt = False) -> None:
    """Run the whole pipeline on this machine's CPU with a tiny target: a few minutes.

    Writes a tiny Qwen3.5-architecture target (Gated DeltaNet and gated attention layers, taught a
    little), 1,200 chats and a local-backend spec into DIR, then regenerates the chats' answers with
    the target, prepares, extracts in 2 shards, verifies, trains a drafter and evaluates it (with
    --online no extraction: the training Job runs the target on every step). Run it again: finished
    steps are skipped.

    Examples:

      dflashctl demo

      dflashctl demo /tmp/dflash-demo --output s3://my-bucket/demo --fresh

      dflashctl demo demo-online --online
    """
    output.info(f"writing the demo's tiny target, data and spec into {directory} (kept for the next run)")
    spec_file = directory / SPEC_NAME
    write_demo(directory, spec_file, output=output_url, fresh=fresh, online=online)
    spec = load_spec(spec_file)
    with reporter_for(output.stderr) as reporter:
        result = run_pipeline(spec, open_backend(spec), reporter=reporter)
    print_report(result.report or {}, OutputFormat.table)
    print_summary(summarize_demo(spec_file, spec, storage_for(spec), result))


def print_summary(summary: DemoSummary) -> None:
    table = Table(title="what the demo made", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rate = summary.tokens_per_s
    extracted = f"{summary.tokens:,} tokens in {summary.chunks} chunks"
    if summary.online:
        extracted += " of tokens: the training Job ran the target on them, no hidden state was stored"
    elif rate is not None:
        extracted += f", {format_rate(rate)} over {summary.extract_seconds:.0f} s (2 CPU shards, start-up included)"
    table.add_row("spec", str(summary.spec_file))
    table.add_row("run output", summary.output)
    table.add_row("pod logs", str(summary.logs))
    if summary.generation is not None:
        table.add_row("regenerated", generated_line(summary))
    table.add_row("online states" if summary.online else "extracted", extracted)
    first, last = summary.train_loss
    table.add_row("training", f"{summary.train_steps} steps, loss {first:.2f} -> {last:.2f}; curve: {summary.train_plot}")
    lengths = ", ".join(f"{name} {value:.2f}" for name, value in summary.acceptance_length.items())
    table.add_row("acceptance length", f"{lengths} (plain greedy: 1.00); per position: {summary.acceptance_plot}")
    if summary.tree_acceptance:
        trees = ", ".join(f"{budget} nodes {value:.2f}" for budget, value in summary.tree_acceptance.items())
        table.add_row("draft trees", f"{trees} (DDTree: the drafter's likeliest branches verified in one forward a step)")
    table.add_row("lossless", "yes: every output equals plain greedy" if summary.lossless else "[red]NO[/]")
    output.stdout.print(table)
    spec = summary.spec_file
    logs = f"dflashctl logs train -f {spec}" if summary.online else f"dflashctl logs extract --shard 1 -f {spec}"
    for command in (f"dflashctl status -f {spec}", logs, f"dflashctl render all -f {spec} -d manifests/"):
        output.hint(command)


def generated_line(summary: DemoSummary) -> str:
    """`1,200 of 1,200 chats answered by the target (41,200 tokens, 96 cut at the limit and kept), 38 s`."""
    manifest = summary.generation
    assert manifest is not None
    dropped = sum(manifest.dropped.values())
    parts = [f"{manifest.completion_tokens:,} tokens"]
    if manifest.truncated_kept:
        parts.append(f"{manifest.truncated_kept:,} cut at the limit and kept")
    if dropped:
        parts.append(f"{dropped:,} dropped: " + ", ".join(f"{reason} {count}" for reason, count in manifest.dropped.items()))
    line = f"{manifest.rows:,} of {manifest.lines:,} chats answered by the target ({'; '.join(parts)})"
    if summary.generate_seconds is not None:
        line += f" in {summary.generate_seconds:.0f} s (2 CPU shards, start-up included)"
    return line


def register(app: typer.Typer) -> None:
    app.command(targets=Targets.none)(demo)
