"""`dflashctl plan`: validate the spec and show the bill (tokens, storage, GPU-hours, upload rate) before the run."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from dflash_jobs.errors import StorageError
from dflash_jobs.units import format_duration

from dflashctl import plan as planning
from dflashctl.check import Preflight
from dflashctl.check.inputs import placeholders
from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, OutputFormat, OutputOpt, SpecOpt, Targets, read_spec
from dflashctl.plan_states import DEFAULT_PRICES, Prices, StatesCost


def plan(
    spec_file: SpecOpt = DEFAULT_SPEC,
    output_format: OutputOpt = OutputFormat.table,
    tokens_per_second: Annotated[
        Optional[float],
        typer.Option("--tokens-per-second", help="Extraction speed per GPU in real tokens/s (default: measured, Qwen3.6-27B on an H200, for extract.compute_dtype and extract.compile)."),
    ] = None,
    train_tokens_per_second: Annotated[
        Optional[float], typer.Option("--train-tokens-per-second", help="Training speed per GPU in context tokens/s (default: measured, Qwen3.6-27B drafter on an H200, for train.compile).")
    ] = None,
    generate_tokens_per_second: Annotated[
        Optional[float], typer.Option("--generate-tokens-per-second", help="Generated tokens/s per GPU (default: measured by the chunks done so far).")
    ] = None,
    store_mb_per_s: Annotated[
        float, typer.Option("--store-mb-per-s", help="What one training node can read from the object store, sustained, in MB/s: above it the plan warns.")
    ] = planning.STORE_READ_MB_PER_S_PER_NODE,
    gpu_memory_gib: Annotated[
        float, typer.Option("--gpu-memory-gib", help="One GPU's memory, which online training fills with the target beside the drafter.")
    ] = DEFAULT_PRICES.gpu_memory_gib,
    gpu_hour_usd: Annotated[float, typer.Option("--gpu-hour-usd", help="What a GPU-hour costs, for the stored/online pick.")] = DEFAULT_PRICES.gpu_hour_usd,
    tb_month_usd: Annotated[float, typer.Option("--tb-month-usd", help="What a TB stored for a month costs, for the stored/online pick.")] = DEFAULT_PRICES.tb_month_usd,
) -> None:
    """Validate the spec and show what the run costs: tokens, storage (TB), GPU-hours of extraction and training, upload rate,
    and what training reads from storage: each rank's share against its cache, TB per epoch and in all, MB/s per node;
    and the target's final hidden state's share of them (stored for DSpark, or with extract.final_hidden: true);
    stored and online states (train.states) side by side: the target's forwards every epoch against the TB stored
    and one extraction, memory per rank with the target beside the drafter, and which the plan would pick and why.
    Refuses a drafter that reads the final hidden state when the run's verified states lack it.

    Exact once `dflashctl prepare` wrote tokens/dataset.json; before that, estimated from the size
    of data.source. With a generate section, also the answers to generate: prompts (exact once
    generation planned its chunks), tokens (measured once chunks are done) and GPU-hours.

    Examples:

      dflashctl plan

      dflashctl plan --tokens-per-second 6000 -o json

      dflashctl plan --generate-tokens-per-second 2500

      dflashctl plan --store-mb-per-s 5000

      dflashctl plan --gpu-memory-gib 80 --gpu-hour-usd 3.5
    """
    spec = read_spec(spec_file)
    planning.check_stored_states(spec)
    try:
        source: planning.SourceSample | StorageError = planning.read_source(spec)
    except StorageError as error:
        source = error
    data = planning.read_data_size(spec, source)
    generation = None
    if spec.generate is not None:
        prompts, measured = planning.read_generation(spec, source)
        generation = planning.generation_cost(spec, prompts, measured, tokens_per_second=generate_tokens_per_second)
        if data.estimated:  # extraction reads the regenerated answers, not the source's
            data = planning.generated_data_size(spec, generation, source)
    nodes, nodes_basis = planning.read_nodes(spec)
    offline = Preflight(spec)
    warnings = [result.line() for result in (placeholders(offline),) if result.status in ("warn", "fail")]
    target = planning.read_target_shape(spec)
    warnings += [target.warning] if target.warning else []
    result = planning.make_plan(
        spec, data, target, tokens_per_second=tokens_per_second,
        train_tokens_per_second=train_tokens_per_second, store_mb_per_s=store_mb_per_s,
        generation=generation, nodes=nodes, nodes_basis=nodes_basis, warnings=warnings,
        prices=Prices(gpu_memory_gib=gpu_memory_gib, gpu_hour_usd=gpu_hour_usd, tb_month_usd=tb_month_usd),
    )
    if output_format is not OutputFormat.table:
        output.result(output_format, result.to_dict(), [f"run/{spec.name}"])
        return
    print_plan(result)
    output.hint(next_command(spec, result))


def print_plan(result: planning.Plan) -> None:
    """The table, then where each figure comes from and what to mind."""
    output.stdout.print(plan_table(result))
    if result.generation is not None:
        output.info(f"prompts: {result.generation.prompts_basis}")
        output.info(f"generation rate: {result.generation.rate_basis}")
    for warning in result.training_reads.warnings:
        output.info(f"warning: {warning}")
    output.info(f"states: {result.states.pick} ({result.states.why})")
    output.info(f"data: {result.data.basis}")
    output.info(f"target: {result.target.basis}")
    output.info(f"stored or online: {result.states.basis}")
    output.info(f"nodes: {result.nodes_basis}")
    for warning in result.warnings:
        output.info(f"warning: {escape(warning)}")


def next_command(spec, result: planning.Plan) -> str:
    """What to run after the plan: generation comes first when the spec regenerates the answers
    (prepare waits for it), prepare alone gives exact figures, else the run."""
    if not result.data.estimated:
        return "dflashctl run"
    if spec.generate is not None:
        return "dflashctl run   (it generates the answers first, then prepares them; `dflashctl submit generate --wait` runs generation alone)"
    return "dflashctl prepare   (exact token counts), or dflashctl run"


def plan_table(result: planning.Plan) -> Table:
    estimated = " (estimate)" if result.data.estimated else ""
    table = Table(title=f"plan for {result.name}", show_header=False, title_justify="left")
    table.add_column("item", style="bold")
    table.add_column("value")
    if result.generation is not None:
        _generation_rows(table, result.generation)
    table.add_row("samples", _amount(result.data.samples, estimated))
    bound = result.data.tokens_upper_bound
    table.add_row("tokens", _amount(result.data.tokens, estimated) + (f", at most {bound:,} (every answer at generate.max_new_tokens)" if bound else ""))
    table.add_row("captured states", f"{len(result.target.layers)} layers {result.target.layers} x hidden {result.target.hidden_size}")
    _final_hidden_row(table, result.final_hidden)
    for dtype, size in result.bytes_per_token.items():
        chosen = "  <- extract.dtype" if dtype == result.dtype else ""
        table.add_row(f"storage {dtype}", _amount(result.storage_tb[dtype], f" TB ({size:,} bytes/token){chosen}"))
    table.add_row("extraction", _amount(result.gpu_hours, f" GPU-hours at {result.tokens_per_second_per_gpu:,.0f} tokens/s per GPU"))
    table.add_row("wall clock", f"{_duration(result.wall_clock_hours)} on {result.shards} shards")
    for dtype, rate in result.upload_mb_per_s_per_node.items():
        table.add_row(f"upload per node {dtype}", _amount(rate, f" MB/s ({result.gpus_per_node} GPUs per node)"))
    table.add_row("training", _amount(result.train_gpu_hours, f" GPU-hours at {result.train_tokens_per_second_per_gpu:,.0f} tokens/s per GPU"))
    table.add_row("training wall clock", _duration(result.train_wall_clock_hours))
    _training_read_rows(table, result.training_reads)
    _states_rows(table, result.states)
    for pod in result.pods:
        gpus = f"{pod.gpus} GPU, " if pod.gpus else ""
        where = f": {pod.detail}" if pod.detail else ""
        table.add_row(f"pod {pod.component}", f"{pod.count} x ({gpus}{pod.cpu:g} CPU, {pod.memory_gib:,.4g} GiB){where}")
    return table


def _training_read_rows(table: Table, reads: planning.TrainingReads) -> None:
    kept = "" if reads.resident_fraction is None else f": {reads.resident_fraction:.0%} of it stays on local disk across epochs"
    table.add_row("training share per GPU", _amount(reads.share_tb_per_rank, f" TB ({reads.dtype}) against a cache of {reads.cache_gib_per_rank:,.0f} GiB{kept}"))
    table.add_row("training reads from storage", (
        f"{_amount(reads.read_tb_first_epoch, ' TB')} the first epoch, {_amount(reads.read_tb_per_later_epoch, ' TB')} each later one, "
        f"{_amount(reads.read_tb_total, ' TB')} in all"
    ))
    table.add_row("training read rate", (
        f"{reads.consumed_mb_per_s_per_gpu:,.0f} MB/s per GPU; from storage per node ({reads.gpus_per_node} GPUs): "
        f"{reads.store_mb_per_s_per_node_first_epoch:,.0f} MB/s the first epoch, {_amount(reads.store_mb_per_s_per_node_later_epochs, ' MB/s')} later"
    ))


def _states_rows(table: Table, cost: StatesCost) -> None:
    memory = ", ".join(f"{dtype} {cost.rank_gib[dtype]:,.1f} GiB ({'fits' if cost.fits[dtype] else 'does not fit'})" for dtype in cost.rank_gib)
    table.add_row("online: target forwards", _amount(cost.online_forward_gpu_hours, " GPU-hours over every epoch, no extraction, nothing stored"))
    table.add_row("online: memory per GPU", f"{memory} of {cost.card_gib:g}: target {cost.target_gib['bfloat16']:,.1f} / "
                                            f"{cost.target_gib['float8']:,.1f} GiB + drafter {cost.drafter_gib:,.1f} GiB + capture and activations")
    usd = "" if cost.stored_usd is None else f" (${cost.stored_usd:,.0f} stored, ${cost.online_usd:,.0f} online)"
    chosen = "" if cost.pick == cost.states else f", not train.states: {cost.states}"
    table.add_row("states", f"the plan picks {cost.pick}{chosen}{usd}")


def _final_hidden_row(table: Table, cost: planning.FinalHiddenCost) -> None:
    added = (f"+{cost.bytes_per_token:,} bytes/token (+{cost.fraction:.0%}, {cost.dtype}), {_amount(cost.storage_tb)} TB, "
             f"+{cost.upload_mb_per_s_per_node:,.0f} MB/s upload per node, +{cost.train_read_mb_per_s_per_gpu:,.0f} MB/s training reads "
             f"per GPU ({cost.train_read_mb_per_s_per_node:,.0f} per node)")
    table.add_row("final hidden state", f"stored, in the figures below: {added}" if cost.stored else f"not stored (extract.final_hidden); it would add {added}")


def _generation_rows(table: Table, cost: planning.GenerationCost) -> None:
    estimated = " (estimate)" if cost.prompts_estimated else ""
    per_answer = (f"up to {cost.max_new_tokens:,} tokens each (an upper bound)" if cost.upper_bound
                  else f"{cost.tokens_per_prompt:,.0f} tokens each (measured mean)")
    table.add_row("prompts to answer", f"{_amount(cost.prompts, estimated)}, {per_answer}")
    table.add_row("tokens to generate", _amount(cost.tokens, " (upper bound)" if cost.upper_bound else ""))
    rate = "" if cost.tokens_per_second_per_gpu is None else f" at {cost.tokens_per_second_per_gpu:,.0f} tokens/s per GPU"
    table.add_row("generation", _amount(cost.gpu_hours, f" GPU-hours{rate}"))
    table.add_row("generation wall clock", f"{_duration(cost.wall_clock_hours)} on {cost.shards} shards x {cost.gpus_per_shard} GPU(s)")


def _duration(hours: float | None) -> str:
    """Hours as a reader says them: 2h54m, 14m05s; "unknown" when not known."""
    return "unknown" if hours is None else format_duration(hours * 3600)


def _amount(value: float | int | None, suffix: str = "") -> str:
    """Three significant digits for small amounts, whole numbers with separators for large ones."""
    if value is None:
        return "unknown"
    if isinstance(value, int) or value >= 100:
        return f"{value:,.0f}{suffix}"
    return f"{value:.3g}{suffix}"


def register(app: typer.Typer) -> None:
    app.command(targets=Targets.none)(plan)
