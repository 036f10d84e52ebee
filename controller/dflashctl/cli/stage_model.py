"""`dflashctl stage-model`: put the target checkpoint on the model volume, from the hub, from S3, or
converted from a GGUF file.

On Kubernetes a Job does it (tool_pods.py renders it, dflash_jobs/stage_model.py runs in it); on the
local backend the same module runs here, into target.model.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Annotated

import typer

from dflash_jobs.errors import EXIT_BAD_INPUT, EXIT_BAD_SPEC, EXIT_OK
from dflash_jobs.stage_model import parse_source

from dflashctl.backend import SUBMITTED
from dflashctl.backends import open_backend
from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, ForceOpt, SpecOpt, TimeoutOpt, read_spec
from dflashctl.cli.submit import clear_to_start, wait_for_job
from dflashctl.errors import EXIT_RUN_FAILED, EXIT_USAGE
from dflashctl.tool_pods import STAGE_MODEL, render_stage_model_objects, stage_model_job_name


def stage_model(
    source: Annotated[str, typer.Option("--from", metavar="SOURCE", help="hf://<org>/<repo>[@<revision>] (the hub, or HF_ENDPOINT's mirror), "
                                        "s3://<bucket>/<prefix>, or a GGUF file: s3://<bucket>/<key>.gguf or its path on the model volume.")],
    spec_file: SpecOpt = DEFAULT_SPEC,
    wait: Annotated[bool, typer.Option("--wait", help="Block until the checkpoint is staged; exit 1 if the Job failed.")] = False,
    force: ForceOpt = False,
    timeout: TimeoutOpt = None,
) -> None:
    """Stage the target checkpoint into target.model on the model volume (cluster.model_volume).

    A Job downloads it with huggingface_hub (the token from the Secret cluster.hf_secret names, key
    HF_TOKEN) or copies an S3 prefix, checks every file (sha256, git blob id, S3 ETag), resumes
    after a restart, and records the source, revision and commit in .dflash-staged.json beside the
    weights; `dflashctl check` then reads it. A GGUF file (llama.cpp's format) is converted into a
    checkpoint: its weights dequantized to bf16 safetensors (those of the quantized model), its
    tokenizer and chat template.

    Examples:

      dflashctl stage-model --from hf://Qwen/Qwen3.6-27B --wait

      dflashctl stage-model --from hf://Qwen/Qwen3.6-27B@main

      dflashctl stage-model --from s3://my-models/Qwen3.6-27B

      dflashctl stage-model --from s3://my-models/SmolLM2-135M-Instruct.Q4_1.gguf
    """
    spec = read_spec(spec_file)
    parse_source(source)  # a malformed source is refused here, not in a pod
    if spec.backend == "local":
        _stage_here(spec_file, source)
        return
    objects = render_stage_model_objects(spec, source)
    backend = open_backend(spec)
    clear_to_start(spec, backend, STAGE_MODEL, force=force, stage_source=source)
    name = stage_model_job_name(spec)
    outcome = backend.submit(objects, force=force)[name]
    output.info(f"{SUBMITTED[outcome]} Job {name}: {source} into {spec.target.model} on claim {spec.cluster.model_volume.claim}")
    if not wait:
        output.hint(f"kubectl -n {spec.cluster.namespace} logs job/{name} -f   (then `dflashctl check`)")
        return
    wait_for_job(backend, STAGE_MODEL, name, timeout=timeout)
    output.hint(f"dflashctl check -f {spec_file}")


def _stage_here(spec_file, source: str) -> None:
    """The local backend: the pod's module, run by this interpreter (its log lines stream through)."""
    code = subprocess.run([sys.executable, "-m", "dflash_jobs.stage_model", "-f", str(spec_file), "--from", source]).returncode
    if code == EXIT_OK:
        output.hint(f"dflashctl check -f {spec_file}")
        return
    output.info(f"stage-model failed (exit code {code}); its log above names the cause")
    raise typer.Exit(EXIT_USAGE if code in (EXIT_BAD_SPEC, EXIT_BAD_INPUT) else EXIT_RUN_FAILED)


def register(app: typer.Typer) -> None:
    app.command("stage-model")(stage_model)
