"""`dflashctl run`: the whole pipeline, from a terminal or as the in-cluster controller Job.

Progress goes to stderr (cli/reporting.py), the evaluation report to stdout.
"""

from __future__ import annotations

from typing import Any

import typer
from rich.markup import escape

from dflash_jobs.formats import DATASET_KEY, DRAFTER_CONFIG_KEY, EVAL_REPORT_KEY, MANIFEST_KEY
from dflash_jobs.generation import current_manifest
from dflash_jobs.spec import RunSpec
from dflash_jobs.storage import Storage, storage_for

from dflashctl.backend import Backend
from dflashctl.backends import open_backend
from dflashctl.check import cluster_of, preflight
from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, DryRunOpt, ForceOpt, OutputFormat, OutputOpt, SpecOpt, TimeoutOpt, read_spec
from dflashctl.cli.reporting import print_report, reporter_for
from dflashctl.cli.submit import say_dry_submit
from dflashctl.metrics import with_metrics
from dflashctl.pipeline import PipelineResult, run_pipeline
from dflashctl.progress import read_progress
from dflashctl.render import COMPONENTS, job_name, job_ref


def run(
    spec_file: SpecOpt = DEFAULT_SPEC,
    force: ForceOpt = False,
    timeout: TimeoutOpt = None,
    fmt: OutputOpt = OutputFormat.table,
    dry_run: DryRunOpt = False,
) -> None:
    """Run the pipeline: prepare if needed, extract, verify, train, eval.

    Run it again after a crash or Ctrl-C: it attaches to the Jobs that exist, skips every step
    whose output is in storage, and goes on. Training starts only once every chunk is verified.
    `dflashctl check`'s checks run first, the target read through a probe pod when the run starts:
    a failure starts nothing, not even run.yaml. --dry-run runs them, then says which steps storage
    still lacks and what the first Job would create.

    Examples:

      dflashctl run

      dflashctl run --dry-run

      dflashctl run -f runs/qwen36-27b.yaml --timeout 3600

      dflashctl submit controller      # the same, as a CPU Job inside the cluster

    With cluster.metrics_port set, it serves its progress as Prometheus metrics on that port; where
    the port is taken (a laptop, not a pod), on a free one, which it names.
    """
    spec = read_spec(spec_file)
    backend = open_backend(spec)
    preflight(spec, "run", cluster_of(backend), force=force, say=output.info, dry_run=dry_run)
    if dry_run:
        say_dry_run(spec, backend, force=force)
        return
    with reporter_for(output.stderr) as reporter:
        result = run_pipeline(spec, backend, reporter=with_metrics(spec, reporter), force=force, timeout=timeout)
    if fmt is OutputFormat.table:
        print_report(result.report or {}, fmt)
    else:
        output.result(fmt, result_json(result), [job_ref(job_name(spec, step)) for step in result.ran if step in COMPONENTS])
    for warning in result.warnings:  # last, where a run of many hours does not scroll it away
        output.info(f"[yellow]warning:[/] {escape(warning)}")
    output.hint(f"the drafter: {spec.output}/train/drafter (the vLLM command above serves it)")


def say_dry_run(spec: RunSpec, backend: Backend, *, force: bool) -> None:
    """The steps storage lacks, as `run` would take them, and what the first step's Job would create."""
    steps = pending_steps(spec, storage_for(spec))
    if not steps:
        output.info(f"run {spec.name} is done: {spec.output} holds every step's output, nothing would start")
        return
    if steps[0] == "verify":
        output.info("would verify the landed chunks here (no Job), then submit train")
        steps = steps[1:]
    say_dry_submit(spec, backend, steps[0], force=force)
    if steps[1:]:
        output.info(f"then: {', '.join(steps[1:])} (each once the step before it is done)")


def pending_steps(spec: RunSpec, storage: Storage) -> list[str]:
    """The steps whose output storage lacks, in the pipeline's order (storage decides, as in `run`)."""
    dataset = storage.exists(DATASET_KEY)
    manifest = storage.exists(MANIFEST_KEY)
    done = {
        "generate": dataset or (spec.generate is not None and current_manifest(storage, spec) is not None),
        "prepare": dataset,
        "extract": manifest or (dataset and read_progress(storage).landed),
        "verify": manifest,
        "train": storage.exists(DRAFTER_CONFIG_KEY),
        "eval": storage.exists(EVAL_REPORT_KEY),
    }
    return [step for step in spec.steps if not done[step]]


def result_json(result: PipelineResult) -> dict[str, Any]:
    manifest = result.manifest
    return {
        "ran": result.ran,
        "found_done": result.found_done,
        "manifest": None if manifest is None else {
            "chunks": len(manifest.chunks), "samples": manifest.samples, "tokens": manifest.tokens,
            "bytes": manifest.bytes, "layers": manifest.layers, "dtype": manifest.dtype, "model": manifest.model,
        },
        "report": result.report,
        "warnings": result.warnings,
    }


def register(app: typer.Typer) -> None:
    app.command()(run)
