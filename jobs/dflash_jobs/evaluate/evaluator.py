"""The evaluation job's work: the trained drafter against plain greedy decoding, on held-out prompts.

Prompts are the samples prepare held out of training (tokens/holdout.safetensors), each cut before
its last supervised run: what the target was asked, never what it answered. For every prompt the
target decodes three ways, on the same device and in the same loop style: plain greedy (the
reference output and speed), DFlash speculative decoding, and prompt lookup (the training-free
baseline). One untimed warm-up prompt comes first (kernel selection and compilation).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from dflash_jobs.drafter.export import DRAFTER_PREFIX, load_drafter
from dflash_jobs.drafter.serving import run_serve_command
from dflash_jobs.errors import InputError
from dflash_jobs.evaluate.baselines import PromptLookupDrafter
from dflash_jobs.evaluate.metrics import acceptance_length
from dflash_jobs.evaluate.report import build_report, store_report
from dflash_jobs.drafter.speculative import BlockDrafter, Decoded, DFlashDrafter, Target, greedy_decode, speculative_decode
from dflash_jobs.extract.target import local_checkpoint
from dflash_jobs.formats import DATASET_KEY, DatasetIndex, TokenChunk
from dflash_jobs.prepare import prompt_length
from dflash_jobs.spec import EvalSpec, RunSpec
from dflash_jobs.storage import Storage, open_storage

log = logging.getLogger("dflash.eval")

LOG_EVERY_S = 5.0


def held_out_prompts(storage: Storage, count: int) -> list[torch.Tensor]:
    """The first `count` held-out samples, each cut before its last supervised (assistant) run."""
    if not storage.exists(DATASET_KEY):
        raise InputError(f"{storage.url} has no {DATASET_KEY}", "Run `dflashctl prepare` first")
    index = DatasetIndex.from_json(storage.get_bytes(DATASET_KEY))
    path = index.holdout.get("path")
    if not path:
        raise InputError("prepare held out no samples, so there are no evaluation prompts", "Set data.holdout > 0 and re-run `dflashctl prepare`")
    chunk = TokenChunk.decode(storage.get_bytes(path), path)
    prompts = []
    for i in range(min(count, chunk.num_samples)):
        ids, mask = chunk.sample(i)
        prompts.append(torch.from_numpy(ids[: prompt_length(mask)].astype(np.int64)))
    return prompts


def load_target(spec: RunSpec, *, device: torch.device, dtype: torch.dtype):
    """The target's whole text model (LM head included) in eval mode; an s3:// checkpoint is fetched once per node."""
    from transformers import AutoModelForCausalLM

    location = {"endpoint_url": spec.storage.endpoint_url, "region": spec.storage.region}
    checkpoint = local_checkpoint(spec.target, lambda url: open_storage(url, **location))
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation=spec.target.attn_implementation)
    return model.to(device).eval()


def stop_ids(model) -> frozenset[int]:
    """The tokens that end a generation: the generation config's EOS ids, else the model config's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = model.config.eos_token_id if eos is None else eos
    return frozenset([eos] if isinstance(eos, int) else eos or ())


def decode_prompts(
    model, drafters: dict[str, BlockDrafter], prompts: list[torch.Tensor], settings: EvalSpec
) -> tuple[list[Decoded], dict[str, list[Decoded]]]:
    """Plain greedy and each drafter on every prompt: (greedy outputs, {drafter name: outputs})."""
    stop = stop_ids(model)
    plain = Target(model)
    targets = {name: Target(model, drafter.target_layers) for name, drafter in drafters.items()}

    def decode(prompt: torch.Tensor) -> tuple[Decoded, dict[str, Decoded]]:
        reference = greedy_decode(plain, prompt, max_new_tokens=settings.max_new_tokens, stop_ids=stop)
        return reference, {
            name: speculative_decode(targets[name], drafter, prompt, max_new_tokens=settings.max_new_tokens, stop_ids=stop)
            for name, drafter in drafters.items()
        }

    greedy: list[Decoded] = []
    drafted: dict[str, list[Decoded]] = {name: [] for name in drafters}
    try:
        decode(prompts[0])  # warm-up: kernel selection and compilation stay out of the timings
        last_log = time.monotonic()
        for i, prompt in enumerate(prompts, 1):
            reference, outputs = decode(prompt)
            greedy.append(reference)
            for name, output in outputs.items():
                drafted[name].append(output)
            if i == len(prompts) or time.monotonic() - last_log >= LOG_EVERY_S:
                last_log = time.monotonic()
                log.info("prompt %d/%d: %s", i, len(prompts), progress_line(greedy, drafted))
    finally:
        for target in (plain, *targets.values()):
            target.close()
    return greedy, drafted


def progress_line(greedy: list[Decoded], drafted: dict[str, list[Decoded]]) -> str:
    taus = ", ".join(f"{name} tau {acceptance_length(outputs):.2f}" for name, outputs in drafted.items())
    identical = all(d.tokens == g.tokens for outputs in drafted.values() for d, g in zip(outputs, greedy))
    return f"{taus}; every output identical to greedy so far: {identical}"


def evaluate(spec: RunSpec, storage: Storage, *, device: torch.device) -> dict[str, Any]:
    """Evaluates the exported drafter of the run; writes eval/report.json and eval/acceptance.png; returns the report."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    prompts = held_out_prompts(storage, spec.eval.prompts)
    model = load_target(spec, device=device, dtype=dtype)
    drafter, config = load_drafter(
        f"{storage.url.rstrip('/')}/{DRAFTER_PREFIX}", target=spec.target.model, device=device,
        endpoint_url=spec.storage.endpoint_url, region=spec.storage.region,
    )
    log.info("target %s (%s, %s), drafter: %d layers, block %d, target layers %s; %d prompts, %d new tokens each",
             spec.target.model, device, dtype, config.num_layers, config.block_size, config.target_layer_ids,
             len(prompts), spec.eval.max_new_tokens)
    drafters = {"dflash": DFlashDrafter(drafter, config), "prompt_lookup": PromptLookupDrafter(config.block_size)}
    greedy, drafted = decode_prompts(model, drafters, prompts, spec.eval)
    report = build_report(
        greedy=greedy, drafters=drafted, block_size=config.block_size,
        target=spec.target.model, drafter=f"{storage.url.rstrip('/')}/{DRAFTER_PREFIX}", prompts=len(prompts),
        max_new_tokens=spec.eval.max_new_tokens, device=str(device), dtype=str(dtype).removeprefix("torch."),
        vllm_serve=run_serve_command(spec, config.to_zlab()),
    )
    store_report(storage, report)
    log.info("serve it with vLLM:\n%s", report["vllm_serve"])
    return report
