"""`dflashctl plan`: validate the spec and show the bill (tokens, storage, GPU-hours, upload rate) before the run."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from dflash_jobs.spec import load_spec

from dflashctl import plan as planning
from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, OutputFormat, OutputOpt, SpecOpt


def plan(
    spec_file: SpecOpt = DEFAULT_SPEC,
    output_format: OutputOpt = OutputFormat.table,
    tokens_per_second: Annotated[
        Optional[float],
        typer.Option("--tokens-per-second", help="Extraction speed per GPU in real tokens/s (default: measured, Qwen3.6-27B on an H200, for extract.compute_dtype)."),
    ] = None,
    train_tokens_per_second: Annotated[
        float, typer.Option("--train-tokens-per-second", help="Training speed per GPU in context tokens/s (default: measured, Qwen3.6-27B drafter on an H200).")
    ] = planning.TRAIN_TOKENS_PER_SECOND,
) -> None:
    """Validate the spec and show what the run costs: tokens, storage (TB), GPU-hours of extraction and training, upload rate.

    Exact once `dflashctl prepare` wrote tokens/dataset.json; before that, estimated from the size
    of data.source.

    Examples:

      dflashctl plan

      dflashctl plan --tokens-per-second 6000 -o json
    """
    spec = load_spec(spec_file)
    result = planning.make_plan(
        spec, planning.read_data_size(spec), planning.read_target_shape(spec), tokens_per_second=tokens_per_second,
        train_tokens_per_second=train_tokens_per_second,
    )
    if output_format is OutputFormat.json:
        output.result_json(result.to_dict())
        return
    output.stdout.print(plan_table(result))
    output.info(f"data: {result.data.basis}")
    output.info(f"target: {result.target.basis}")
    output.hint("dflashctl run" if not result.data.estimated else "dflashctl prepare   (exact token counts)")


def plan_table(result: planning.Plan) -> Table:
    estimated = " (estimate)" if result.data.estimated else ""
    table = Table(title=f"plan for {result.name}", show_header=False, title_justify="left")
    table.add_column("item", style="bold")
    table.add_column("value")
    table.add_row("samples", _amount(result.data.samples, estimated))
    table.add_row("tokens", _amount(result.data.tokens, estimated))
    table.add_row("captured states", f"{len(result.target.layers)} layers {result.target.layers} x hidden {result.target.hidden_size}")
    for dtype, size in result.bytes_per_token.items():
        chosen = "  <- extract.dtype" if dtype == result.dtype else ""
        table.add_row(f"storage {dtype}", _amount(result.storage_tb[dtype], f" TB ({size:,} bytes/token){chosen}"))
    table.add_row("extraction", _amount(result.gpu_hours, f" GPU-hours at {result.tokens_per_second_per_gpu:,.0f} tokens/s per GPU"))
    table.add_row("wall clock", _amount(result.wall_clock_hours, f" hours on {result.shards} shards"))
    for dtype, rate in result.upload_mb_per_s_per_node.items():
        table.add_row(f"upload per node {dtype}", _amount(rate, f" MB/s ({result.gpus_per_node} GPUs per node)"))
    table.add_row("training", _amount(result.train_gpu_hours, f" GPU-hours at {result.train_tokens_per_second_per_gpu:,.0f} tokens/s per GPU"))
    table.add_row("training wall clock", _amount(result.train_wall_clock_hours, " hours"))
    return table


def _amount(value: float | int | None, suffix: str = "") -> str:
    """Three significant digits for small amounts, whole numbers with separators for large ones."""
    if value is None:
        return "unknown"
    if isinstance(value, int) or value >= 100:
        return f"{value:,.0f}{suffix}"
    return f"{value:.3g}{suffix}"


def register(app: typer.Typer) -> None:
    app.command()(plan)
