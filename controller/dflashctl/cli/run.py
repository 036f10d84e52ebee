"""`dflashctl run`: the whole pipeline, from a terminal or as the in-cluster controller Job.

Progress goes to stderr (cli/reporting.py), the evaluation report to stdout.
"""

from __future__ import annotations

from typing import Any

import typer
from rich.markup import escape

from dflashctl.backends import open_backend
from dflashctl.check import cluster_of, preflight
from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, ForceOpt, OutputFormat, OutputOpt, SpecOpt, TimeoutOpt, read_spec
from dflashctl.cli.reporting import print_report, reporter_for
from dflashctl.metrics import with_metrics
from dflashctl.pipeline import PipelineResult, run_pipeline


def run(
    spec_file: SpecOpt = DEFAULT_SPEC,
    force: ForceOpt = False,
    timeout: TimeoutOpt = None,
    fmt: OutputOpt = OutputFormat.table,
) -> None:
    """Run the pipeline: prepare if needed, extract, verify, train, eval.

    Run it again after a crash or Ctrl-C: it attaches to the Jobs that exist, skips every step
    whose output is in storage, and goes on. Training starts only once every chunk is verified.
    `dflashctl check`'s checks run first, the target read through a probe pod when the run starts:
    a failure starts nothing, not even run.yaml.

    Examples:

      dflashctl run

      dflashctl run -f runs/qwen36-27b.yaml --timeout 3600

      dflashctl submit controller      # the same, as a CPU Job inside the cluster

    With cluster.metrics_port set, it serves its progress as Prometheus metrics on that port; where
    the port is taken (a laptop, not a pod), on a free one, which it names.
    """
    spec = read_spec(spec_file)
    backend = open_backend(spec)
    preflight(spec, "run", cluster_of(backend), force=force, say=output.info)
    with reporter_for(output.stderr) as reporter:
        result = run_pipeline(spec, backend, reporter=with_metrics(spec, reporter), force=force, timeout=timeout)
    if fmt is OutputFormat.json:
        output.result_json(result_json(result))
    else:
        print_report(result.report or {}, fmt)
    for warning in result.warnings:  # last, where a run of many hours does not scroll it away
        output.info(f"[yellow]warning:[/] {escape(warning)}")
    output.hint(f"the drafter: {spec.output}/train/drafter (the vLLM command above serves it)")


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
