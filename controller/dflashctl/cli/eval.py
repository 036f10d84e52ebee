"""`dflashctl eval`: speculative decoding with the trained drafter; acceptance length, speed, losslessness."""

from __future__ import annotations

import typer

from dflash_jobs.formats import EVAL_REPORT_KEY

from dflashctl.backends import open_backend
from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, OutputFormat, OutputOpt, SpecOpt, TimeoutOpt, read_spec
from dflashctl.cli.reporting import print_report, reporter_for
from dflashctl.cli.submit import clear_to_start
from dflashctl.pipeline import run_eval
from dflashctl.render import job_name, job_ref



def evaluate(
    spec_file: SpecOpt = DEFAULT_SPEC,
    timeout: TimeoutOpt = None,
    fmt: OutputOpt = OutputFormat.table,
) -> None:
    """Evaluate the trained drafter: submit the eval Job (or attach to it), wait, print eval/report.json.

    Acceptance length is the mean number of tokens each target forward pass yields; the check
    that every output equals plain greedy decoding comes with it.

    Examples:

      dflashctl eval

      dflashctl eval -o json | jq '.drafters.dflash.acceptance_length'
    """
    spec = read_spec(spec_file)
    backend = open_backend(spec)
    clear_to_start(spec, backend, "eval", force=False)
    with reporter_for(output.stderr) as reporter:
        report = run_eval(spec, backend, reporter=reporter, timeout=timeout)
    print_report(report, fmt, [job_ref(job_name(spec, "eval"))])
    output.hint(f"the full report: {spec.output}/{EVAL_REPORT_KEY} (and the plot eval/acceptance.png beside it)")


def register(app: typer.Typer) -> None:
    app.command("eval")(evaluate)
