"""`dflashctl eval`: speculative decoding with the trained drafter; acceptance length, speed, losslessness."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer

from dflash_jobs.formats import EVAL_REPORT_KEY
from dflash_jobs.spec import RunSpec

from dflashctl.backends import open_backend
from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, OutputFormat, OutputOpt, SpecOpt, TimeoutOpt, read_spec
from dflashctl.cli.reporting import print_report, reporter_for
from dflashctl.cli.submit import clear_to_start
from dflashctl.pipeline import run_eval
from dflashctl.render import job_name, job_ref



PromptSetOpt = Annotated[list[str] | None, typer.Option(
    "--prompt-set", metavar="NAME=FILE",
    help="A named prompt set (a chat JSONL file or s3:// object) to evaluate beside the held-out prompts, as eval.prompt_sets "
         "names them; repeat for several.",
)]


def evaluate(
    spec_file: SpecOpt = DEFAULT_SPEC,
    timeout: TimeoutOpt = None,
    fmt: OutputOpt = OutputFormat.table,
    prompt_set: PromptSetOpt = None,
) -> None:
    """Evaluate the trained drafter: submit the eval Job (or attach to it), wait, print eval/report.json.

    Acceptance length is the mean number of tokens each target forward pass yields; the check
    that every output equals plain greedy decoding comes with it. Each prompt set (eval.prompt_sets,
    and --prompt-set) gets a table of its own.

    Examples:

      dflashctl eval

      dflashctl eval --prompt-set mt_bench=s3://bucket/mt_bench.jsonl

      dflashctl eval -o json | jq '.drafters.dflash.acceptance_length'
    """
    spec = with_prompt_sets(read_spec(spec_file), prompt_set or [])
    backend = open_backend(spec)
    clear_to_start(spec, backend, "eval", force=False)
    with reporter_for(output.stderr) as reporter:
        report = run_eval(spec, backend, reporter=reporter, timeout=timeout)
    print_report(report, fmt, [job_ref(job_name(spec, "eval"))])
    output.hint(f"the full report: {spec.output}/{EVAL_REPORT_KEY} (and the plot eval/acceptance.png beside it)")


def with_prompt_sets(spec: RunSpec, given: list[str]) -> RunSpec:
    """The spec with --prompt-set's NAME=FILE pairs added to eval.prompt_sets (checked as the spec's own)."""
    sets = dict(spec.eval.prompt_sets)
    for pair in given:
        name, separator, source = pair.partition("=")
        if not separator:
            raise typer.BadParameter(f"{pair!r}: give NAME=FILE, e.g. mt_bench=s3://bucket/mt_bench.jsonl", param_hint="--prompt-set")
        sets[name] = source
    return dataclasses.replace(spec, eval=dataclasses.replace(spec.eval, prompt_sets=sets)) if given else spec


def register(app: typer.Typer) -> None:
    app.command("eval")(evaluate)
