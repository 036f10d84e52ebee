"""`dflashctl export-states --format speculators`: a run's hidden states in a peer trainer's layout,
streamed from the run's verified chunks (S3 or a directory) to a directory or an S3 prefix, here,
without torch (dflash_jobs/speculators.py)."""

from __future__ import annotations

from dataclasses import asdict
from enum import Enum
from typing import Annotated

import typer
from rich.table import Table

from dflash_jobs.spec import load_spec
from dflash_jobs.speculators import DEFAULT_WORKERS, default_destination, export_speculators, target_depth
from dflash_jobs.storage import open_storage, storage_for

from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, OutputFormat, OutputOpt, SpecOpt, Targets
from dflashctl.cli.reporting import reporter_for
from dflashctl.pipeline import StepUpdate


class StatesFormat(str, Enum):
    speculators = "speculators"


FormatOpt = Annotated[StatesFormat, typer.Option("--format", help="The peer's layout: speculators (vllm-project/speculators, hs_<i>.safetensors).")]
ToOpt = Annotated[str | None, typer.Option("--to", help="Directory or s3:// prefix to write into. Default: <output>/export/<format>/hidden_states.")]
DepthOpt = Annotated[int | None, typer.Option("--target-depth", min=1, help="The target's num_hidden_layers, when its config.json is not readable from here.")]
WorkersOpt = Annotated[int, typer.Option("--workers", min=1, help="Samples read, converted and written at once.")]


def export_states(
    states_format: FormatOpt,
    spec_file: SpecOpt = DEFAULT_SPEC,
    to: ToOpt = None,
    depth: DepthOpt = None,
    workers: WorkersOpt = DEFAULT_WORKERS,
    fmt: OutputOpt = OutputFormat.table,
) -> None:
    """Write the run's hidden states as a peer trainer reads them, so one extraction feeds several trainers.

    speculators: one hs_<i>.safetensors per sample (hidden_states bf16 [T, L, d], token_ids, and
    loss_mask, which it ignores), fp8 runs dequantized with their scales. speculators reads the last
    layer of each file as the target's final one: the run's stored final hidden state
    (extract.final_hidden), appended after target.layers, or else the target's last decoder layer,
    which the run must then have captured as the last of target.layers. Streams chunk by chunk, a
    sample per ranged read; run it again after an interruption: complete files are kept.

    Examples:

      dflashctl export-states --format speculators

      dflashctl export-states --format speculators --workers 32 \\
        --to s3://bucket/speculators/qwen36/hidden_states
    """
    spec = load_spec(spec_file)
    source = storage_for(spec)
    destination = open_storage(to or default_destination(spec), endpoint_url=spec.storage.endpoint_url, region=spec.storage.region)
    depth = depth or target_depth(spec)
    with reporter_for(output.stderr) as reporter:
        summary = export_speculators(
            source, destination, depth=depth, workers=workers,
            on_progress=lambda done, total: reporter.update(StepUpdate("export", done=done, total=total)),
        )
    if fmt is not OutputFormat.table:
        output.result(fmt, {"format": states_format.value, **asdict(summary)}, [summary.destination])
    else:
        table = Table(title=f"{states_format.value} hidden states: {summary.destination}", show_header=False, title_justify="left")
        for name, value in (
            ("files", f"{summary.samples:,} ({summary.files:,} written, {summary.kept:,} already there)"),
            ("tokens", f"{summary.tokens:,}"), ("size", f"{summary.bytes / 2**30:.2f} GiB"),
            ("layers (ours)", summary.layers),
            ("speculators ids", f"--target-layer-ids {' '.join(map(str, summary.aux_hidden_state_layer_ids))}, last layer {summary.last_layer} appended"
                                + (" (the stored final hidden state)" if summary.final_hidden else "")),
        ):
            table.add_row(name, str(value))
        output.stdout.print(table)
    ids = " ".join(map(str, summary.aux_hidden_state_layer_ids))
    output.hint(
        f"speculators' train.py --hidden-states-path {summary.destination} --target-layer-ids {ids} --data-path <its data set: "
        "row i = hs_<i>'s token_ids and loss_mask; dflash_samples.jsonl maps i to data.source lines>"
    )


def register(app: typer.Typer) -> None:
    app.command("export-states", targets=Targets.none)(export_states)
