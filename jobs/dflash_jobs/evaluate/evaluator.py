"""The evaluation job's work: the trained drafter against plain greedy decoding, on held-out prompts.

Prompts are the samples prepare held out of training (tokens/holdout.safetensors), each cut before
its last supervised run: what the target was asked, never what it answered. For every prompt the
target decodes four ways, on the same device and in the same loop style: plain greedy (the
reference output and speed), DFlash speculative decoding, and the baselines eval.baselines names
(evaluate/baselines.py): prompt lookup, training-free, and a bigram table fitted once on the run's
training rows; then the DFlash drafter's training forward runs on the prompt and greedy's output
(evaluate/simulated.py), the teacher-forced acceptance the decoded one should match, and, untimed,
the lossless check's figures (evaluate/lossless.py): the target's own verify-against-decode
rounding, and greedy along each output that differs from greedy's. With eval.tree_budgets, the
trained drafter also decodes by draft trees of each budget (DDTree, drafter/tree_verify.py; timed
like the chain), and its trees' exact acceptance is computed along greedy's output
(evaluate/trees.py). One untimed
warm-up prompt comes first (kernel selection and compilation). With eval.processes > 1, worker
processes on the same device take the prompts one at a time, each with its own target and
drafter, and the results are merged in prompt order. Each prompt's result is kept in storage as it
is decoded (evaluate/kept.py): a retried evaluation decodes only the prompts it lacks.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from dflash_jobs.drafter.anchors import AnchorLayout, anchor_layout
from dflash_jobs.drafter.export import DRAFTER_PREFIX, exported_config, load_drafter
from dflash_jobs.drafter.model import Drafter, DrafterConfig
from dflash_jobs.drafter.serving import run_serve_command
from dflash_jobs.drafter.speculative import BlockDrafter, Decoded, ModelDrafter, Target, greedy_decode, speculative_decode
from dflash_jobs.drafter.tree_verify import tree_decode
from dflash_jobs.errors import InputError
from dflash_jobs.evaluate.baselines import BigramDrafter, BigramTable, PromptLookupDrafter, fit_bigram
from dflash_jobs.evaluate.calibration import recorder_for
from dflash_jobs.evaluate.kept import KeptPrompts, PromptResult, evaluation_key
from dflash_jobs.evaluate.lossless import divergences, verify_noise
from dflash_jobs.evaluate.metrics import acceptance_length
from dflash_jobs.evaluate.report import build_report, store_report
from dflash_jobs.evaluate.simulated import anchors_accepted, document_batch
from dflash_jobs.evaluate.trees import PromptTrees, VariantBranches, exact_trees
from dflash_jobs.capture.checkpoint import local_checkpoint
from dflash_jobs.formats import DATASET_KEY, DatasetIndex, TokenChunk
from dflash_jobs.rows import prompt_length
from dflash_jobs.spec import EvalSpec, RunSpec
from dflash_jobs.storage import Storage, storage_for
from dflash_jobs.variants import DrafterVariant, drafter_variant

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

    checkpoint = local_checkpoint(spec)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation=spec.target.attn_implementation)
    return model.to(device).eval()


def stop_ids(model) -> frozenset[int]:
    """The tokens that end a generation: the generation config's EOS ids, else the model config's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = model.config.eos_token_id if eos is None else eos
    return frozenset([eos] if isinstance(eos, int) else eos or ())


class PromptDecoder:
    """The target and the drafters, ready to decode one prompt at a time (in this process or in a worker):
    the trained drafter, under its variant's name, and the baselines eval.baselines names, drafting as
    many tokens a block; `bigram`: the fitted table (None when the bigram baseline is not asked for)."""

    def __init__(self, model, drafter: Drafter, variant: DrafterVariant, layout: AnchorLayout, settings: EvalSpec,
                 bigram: BigramTable | None) -> None:
        self.drafter, self.variant, self.layout = drafter, variant, layout
        self.recorder = recorder_for(drafter, drafts=layout.drafts)
        if "bigram" in settings.baselines and bigram is None:
            raise ValueError("eval.baselines asks for the bigram baseline: pass its fitted table")
        made = {"prompt_lookup": lambda: PromptLookupDrafter(layout.drafts + 1), "bigram": lambda: BigramDrafter(bigram, layout.drafts + 1)}
        baselines: dict[str, BlockDrafter] = {name: made[name]() for name in settings.baselines}
        self.drafters: dict[str, BlockDrafter] = {variant.name: self.recorder or ModelDrafter(drafter, drafts=layout.drafts), **baselines}
        self.settings = settings
        self.stop = stop_ids(model)
        self.plain = Target(model)
        self.targets = {name: Target(model, d.target_layers) for name, d in self.drafters.items()}
        self.trees = VariantBranches(drafter, variant.branches, drafts=layout.drafts)
        # The chain's own budget beside the asked ones: a tree of as many nodes as the chain drafts.
        self.budgets = sorted({*settings.tree_budgets, layout.drafts}) if settings.tree_budgets else []

    def decode(self, prompt: torch.Tensor) -> PromptResult:
        new_tokens = self.settings.max_new_tokens
        reference = greedy_decode(self.plain, prompt, max_new_tokens=new_tokens, stop_ids=self.stop)
        drafted = {
            name: speculative_decode(self.targets[name], drafter, prompt, max_new_tokens=new_tokens, stop_ids=self.stop)
            for name, drafter in self.drafters.items()
        }
        confidences = self.recorder.take() if self.recorder is not None else None
        tree_decoded = {
            budget: tree_decode(self.targets[self.variant.name], self.trees, prompt, budget=budget, max_new_tokens=new_tokens, stop_ids=self.stop)
            for budget in self.budgets
        }
        # Untimed: the lossless check's figures (the decodings above are what tokens/s measure).
        found = {
            name: divergences(self.plain, prompt, d.tokens, reference, max_new_tokens=new_tokens, stop_ids=self.stop)
            for name, d in drafted.items()
        }
        noise = verify_noise(self.plain, prompt, reference, self.layout.drafts + 1)  # the verify block: the anchor and its drafts
        document, features = self.captured(prompt, reference)
        trees = self.tree_figures(prompt, reference, drafted[self.variant.name], document, features, tree_decoded) if self.budgets else None
        return PromptResult(reference, drafted, self.simulate(prompt, document, features), found, noise, confidences, trees)

    def captured(self, prompt: torch.Tensor, reference: Decoded) -> tuple[torch.Tensor, torch.Tensor]:
        """prompt + greedy's output, and the drafter's target layers over it [T, L*d], captured in one forward."""
        target = self.targets[self.variant.name]
        document = torch.cat([prompt, torch.tensor(reference.tokens, dtype=prompt.dtype)]).to(target.device)
        with torch.inference_mode():
            target.reset()
            target.forward(document, last_only=True)
            return document, target.features()

    def simulate(self, prompt: torch.Tensor, document: torch.Tensor, features: torch.Tensor) -> list[int]:
        """The training forward on the document (prompt + greedy's output) with its captured layers."""
        hidden = features.view(len(document), len(self.drafter.config.target_layer_ids), -1)  # [T, L*d] -> [T, L, d]
        batch = document_batch(document, len(prompt), hidden, self.drafter, self.layout)
        return anchors_accepted(self.drafter, batch, self.variant.predict, self.layout)

    @torch.inference_mode()  # the variants' branches score their children lazily, from tensors made in inference mode
    def tree_figures(self, prompt: torch.Tensor, reference: Decoded, chain: Decoded, document: torch.Tensor, features: torch.Tensor,
                     decoded: dict[int, Decoded]) -> PromptTrees:
        """The trees' exact figures along greedy's output (evaluate/trees.py), and the lossless check of their decodings."""
        def branches_at(anchor: int):
            position = len(prompt) + anchor  # greedy's anchor-th token, after the prompt
            return self.trees.branches(document[: position + 1], features[:position])

        trees = exact_trees(branches_at, reference.tokens, chain, budgets=self.budgets, drafts=self.layout.drafts,
                            max_new_tokens=self.settings.max_new_tokens)
        trees.decoded = decoded
        trees.divergences = {
            budget: divergences(self.plain, prompt, d.tokens, reference, max_new_tokens=self.settings.max_new_tokens, stop_ids=self.stop)
            for budget, d in decoded.items()
        }
        return trees

    def close(self) -> None:
        for target in (self.plain, *self.targets.values()):
            target.close()


def load_decoder(spec: RunSpec, bigram: BigramTable | None, *, device: torch.device) -> PromptDecoder:
    """The run's target and exported drafter on `device`, and the baselines, as a PromptDecoder."""
    model = load_target(spec, device=device, dtype=eval_dtype(device))
    variant = drafter_variant(spec.train.drafter)
    drafter, config = load_drafter(
        drafter_url(spec), target=spec.target.model, variant=variant, device=device,
        endpoint_url=spec.storage.endpoint_url, region=spec.storage.region,
    )
    return PromptDecoder(model, drafter, variant, served_layout(spec, config), spec.eval, bigram)


def served_layout(spec: RunSpec, config: DrafterConfig) -> AnchorLayout:
    """The anchor layout of the exported drafter: its variant's, at the block size it was exported with (what a server runs)."""
    return anchor_layout(spec.train.drafter, block_size=config.block_size, gamma=spec.train.gamma)


def eval_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def drafter_url(spec: RunSpec) -> str:
    return f"{storage_for(spec).url.rstrip('/')}/{DRAFTER_PREFIX}"


def decode_here(spec: RunSpec, bigram: BigramTable | None, prompts: list[torch.Tensor], *, device: torch.device) -> Iterator[PromptResult]:
    """Every prompt decoded in this process, after one untimed warm-up prompt (kernel selection and compilation)."""
    decoder = load_decoder(spec, bigram, device=device)
    try:
        decoder.decode(prompts[0])
        yield from map(decoder.decode, prompts)
    finally:
        decoder.close()


# ---- worker processes (eval.processes > 1) -------------------------------------------------------

_worker_decoder: PromptDecoder | None = None


def _start_worker(spec: RunSpec, bigram: BigramTable | None, device: torch.device, threads: int, warm_up: torch.Tensor) -> None:
    global _worker_decoder
    torch.set_num_threads(threads)
    _worker_decoder = load_decoder(spec, bigram, device=device)
    _worker_decoder.decode(warm_up)


def _decode_in_worker(prompt: torch.Tensor) -> PromptResult:
    assert _worker_decoder is not None
    return _worker_decoder.decode(prompt)


def decode_in_processes(spec: RunSpec, bigram: BigramTable | None, prompts: list[torch.Tensor], *, device: torch.device) -> Iterator[PromptResult]:
    """Every prompt decoded by eval.processes workers on `device`, each loading the target and drafter
    and warming up once; a worker takes the next prompt when it is done with one, and the results
    come back in prompt order. The CPU threads are shared out between the workers."""
    processes = min(spec.eval.processes, len(prompts))
    threads = max(1, torch.get_num_threads() // processes)
    # spawn: CUDA cannot be used in a forked child, and a fresh interpreter inherits no threads or locks.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(processes, mp_context=context, initializer=_start_worker, initargs=(spec, bigram, device, threads, prompts[0])) as pool:
        yield from pool.map(_decode_in_worker, prompts)


def log_progress(results: Iterable[PromptResult], total: int) -> list[PromptResult]:
    done: list[PromptResult] = []
    last_log = time.monotonic()
    for result in results:
        done.append(result)
        if len(done) == total or time.monotonic() - last_log >= LOG_EVERY_S:
            last_log = time.monotonic()
            log.info("prompt %d/%d: %s", len(done), total, progress_line(done))
    return done


def progress_line(results: list[PromptResult]) -> str:
    names = results[0].drafted
    taus = ", ".join(f"{name} tau {acceptance_length([r.drafted[name] for r in results]):.2f}" for name in names)
    identical = all(d.tokens == r.greedy.tokens for r in results for d in r.drafted.values())
    return f"{taus}; every output identical to greedy so far: {identical}"


def evaluate(spec: RunSpec, storage: Storage, *, device: torch.device) -> dict[str, Any]:
    """Evaluates the exported drafter of the run; writes eval/report.json and eval/acceptance.png; returns the report."""
    prompts = held_out_prompts(storage, spec.eval.prompts)
    settings = spec.eval
    variant = drafter_variant(spec.train.drafter)
    exported = exported_config(drafter_url(spec), endpoint_url=spec.storage.endpoint_url, region=spec.storage.region)
    config = variant.config_from_export(exported)
    layout = served_layout(spec, config)
    describe(spec, config, device, len(prompts))
    bigram = fit_bigram(storage) if "bigram" in settings.baselines else None
    if bigram is not None:
        log.info("bigram baseline: %d tokens' successors from %d pairs in %d of %d chunks (%d of %d tokens)", bigram.fit["previous_tokens"],
                 bigram.fit["pairs"], bigram.fit["chunks_read"], bigram.fit["chunks"], bigram.fit["tokens_read"], bigram.fit["tokens"])
    kept = KeptPrompts(storage, evaluation_key(spec, storage, DRAFTER_PREFIX, device))
    results = decode_missing(spec, kept, bigram, prompts, device=device)
    names = list(results[0].drafted)
    report = build_report(
        greedy=[r.greedy for r in results],
        drafters={name: [r.drafted[name] for r in results] for name in names},
        divergences={name: [r.divergences[name] for r in results] for name in names},
        verify_noise=[r.verify_noise for r in results],
        simulated={variant.name: [r.simulated for r in results]},
        calibration={variant.name: [r.confidences for r in results]} if results[0].confidences is not None else None,
        trees={variant.name: [r.trees for r in results]} if results[0].trees is not None else None,
        # The verify block: the anchor and its drafts (a drafter that samples from the anchor drafts block_size of them).
        block_size=layout.drafts + 1, dtype=eval_dtype(device),
        target=spec.target.model, drafter=drafter_url(spec), drafter_variant=variant.name, prompts=len(prompts),
        max_new_tokens=settings.max_new_tokens, processes=min(settings.processes, len(prompts)), device=str(device),
        vllm_serve=run_serve_command(spec, exported), bigram=bigram.fit if bigram is not None else None,
    )
    store_report(storage, report)
    kept.clear()  # the report holds them now
    log.info("serve it with vLLM:\n%s", report["vllm_serve"])
    return report


def decode_missing(spec: RunSpec, kept: KeptPrompts, bigram: BigramTable | None, prompts: list[torch.Tensor], *,
                   device: torch.device) -> list[PromptResult]:
    """Every prompt's result, in prompt order: those an earlier run of this evaluation kept (evaluate/kept.py),
    the others decoded now (in eval.processes workers, each loading its own target and drafter) and kept as they come."""
    results = kept.load(prompts)
    missing = [i for i in range(len(prompts)) if i not in results]
    if results:
        log.info("%d of %d prompts were decoded by an earlier run of this evaluation (kept under %s): decoding the other %d",
                 len(results), len(prompts), kept.prefix, len(missing))
    if missing:
        decode = decode_in_processes if min(spec.eval.processes, len(missing)) > 1 else decode_here
        decoded = decode(spec, bigram, [prompts[i] for i in missing], device=device)
        results.update(zip(missing, log_progress(kept.keeping(missing, prompts, decoded), len(missing))))
    return [results[i] for i in range(len(prompts))]


def describe(spec: RunSpec, config: DrafterConfig, device: torch.device, prompts: int) -> None:
    log.info("target %s (%s, %s), drafter: %s, %d layers, block %d, target layers %s; %d prompts, %d new tokens each, %d process(es)",
             spec.target.model, device, eval_dtype(device), spec.train.drafter, config.num_layers, config.block_size, config.target_layer_ids,
             prompts, spec.eval.max_new_tokens, min(spec.eval.processes, prompts))
