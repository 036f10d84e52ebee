"""The evaluation job's work: the trained drafter against plain greedy decoding, on held-out prompts.

Prompts are the samples prepare held out of training (tokens/holdout.safetensors), each cut before
its last supervised run: what the target was asked, never what it answered. Two passes:

- The figures, on every prompt: plain greedy (the reference output); the trained drafter's chain,
  decoded for real (its drafts read the target's states as the loop makes them: the figure users
  compare), a drafter with a confidence head recording each draft's predicted survival as it goes
  (evaluate/calibration.py); the baselines eval.baselines names (evaluate/baselines.py: prompt
  lookup, and a bigram table fitted once on the run's training rows), whose drafts depend on the
  committed tokens alone, computed exactly along greedy's output without decoding; the drafter's training forward on the
  prompt and greedy's output (evaluate/simulated.py), the teacher-forced acceptance the decoded one
  should match; untimed, the lossless check's figures (evaluate/lossless.py); and with
  eval.tree_budgets the draft trees (DDTree, drafter/tree_verify.py) decoded for real per budget,
  their exact acceptance computed along greedy's output (evaluate/trees.py). With eval.processes > 1,
  this process and eval.processes - 1 workers on the same device take the prompts one at a time, each
  with its own target and drafter, and the results are merged in prompt order (evaluate/workers.py).
  Each prompt's result is kept in storage as it is decoded (evaluate/kept.py): a retried evaluation
  decodes only the prompts it lacks; greedy's decoding of each is kept for every evaluation on the same target and
  prompts (evaluate/reference.py).
  The same for each named set of eval.prompt_sets (evaluate/prompt_sets.py), a table each.
- The speeds, on the first eval.timed_prompts prompts, decoded first, in this process alone after a
  warm-up prompt (the workers load and warm up meanwhile, and take prompts only after them: a warm
  worker runs no kernel while it waits): greedy and every drafter as served (the chain without a
  confidence recorder, the baselines in the real verify loop), one after another: tokens/s and
  speed-ups of an uncontended device. Where a figure's decoding is the served
  one (greedy's; the chain's, with no recorder riding it) it is the same decoding, not a second one.
  The trees' speeds come from their decodings in the first pass.

With eval.cuda_graphs, on a GPU and for a target of full attention only, every decoding runs on
static caches and every step's forwards (the target's, the drafter's block, a tree's growth) are
replayed CUDA graphs (PromptDecoder's `static_cache`): eager at batch 1, a small target's steps wait
on the host's kernel launches.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from dflash_jobs.architectures import target_architecture
from dflash_jobs.drafter.export import DRAFTER_PREFIX, exported_config, load_drafter
from dflash_jobs.drafter.model import Drafter, DrafterConfig
from dflash_jobs.drafter.serving import run_serve_command
from dflash_jobs.drafter.replayed_drafter import ReplayedDrafter
from dflash_jobs.drafter.speculative import BlockDrafter, Decoded, DecodeTarget, ModelDrafter, greedy_decode, speculative_decode, text_model
from dflash_jobs.drafter.static_target import StaticTarget
from dflash_jobs.drafter.tree_verify import tree_decode
from dflash_jobs.errors import InputError
from dflash_jobs.evaluate.baselines import BigramDrafter, BigramTable, PromptLookupDrafter, along_greedy, fit_bigram
from dflash_jobs.evaluate.calibration import recorder_for
from dflash_jobs.evaluate.kept import KeptPrompts, PromptResult, evaluation_key
from dflash_jobs.evaluate.lossless import divergences, verify_noise
from dflash_jobs.evaluate.metrics import acceptance_length
from dflash_jobs.evaluate.prompt_sets import read_prompt_sets
from dflash_jobs.evaluate.reference import KeptReferences, Reference
from dflash_jobs.evaluate.report import GREEDY, build_report, prompt_set_table, store_report
from dflash_jobs.evaluate.simulated import anchors_accepted, document_batch
from dflash_jobs.evaluate.trees import PromptTrees, ReplayedBranches, VariantBranches, exact_trees
from dflash_jobs.evaluate.workers import Workers, share_prompts
from dflash_jobs.capture.checkpoint import local_checkpoint
from dflash_jobs.formats import DATASET_KEY, DatasetIndex, TokenChunk
from dflash_jobs.pacing import Every
from dflash_jobs.rows import prompt_length
from dflash_jobs.static_cache import static_cache_supported
from dflash_jobs.spec import BIGRAM, PROMPT_LOOKUP, AnchorLayout, EvalSpec, RunSpec, anchor_layout
from dflash_jobs.storage import Storage, storage_for
from dflash_jobs.variants import DrafterVariant, drafter_variant

log = logging.getLogger("dflash.eval")

LOG_EVERY_S = 5.0
HELD_OUT = ""
"""The held-out prompts' name beside eval.prompt_sets' (which are never empty)."""


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


def load_target_model(spec: RunSpec, *, device: torch.device, dtype: torch.dtype):
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


@dataclass
class Decodings:
    """A prompt's decodings, what its figures take from them before their other work (PromptDecoder.figures)."""

    reference: Decoded
    """Greedy's decoding."""
    noise: list[float] | None
    """Greedy's verify noise where an earlier evaluation computed it (evaluate/reference.py), else None."""
    drafted: dict[str, Decoded]
    """The trained drafter's chain, decoded; the baselines, along greedy's output."""
    confidences: list[list[float]] | None
    trees: dict[int, Decoded]
    """The draft trees decoded, by node budget."""


class PromptDecoder:
    """The target and the drafters, ready to decode one prompt at a time (in this process or in a worker):
    the trained drafter, under its variant's name, and the baselines eval.baselines names, drafting as
    many tokens a block; `bigram`: the fitted table (None when the bigram baseline is not asked for).
    static_cache: greedy, the verify loops and the trees on static caches (drafter/static_target.py: on a
    GPU each step a replayed CUDA graph; uses_static_cache says where), the served drafter's block
    and the trees' growth replayed too (drafter/replayed_drafter.py); else the dynamic cache and
    eager forwards."""

    def __init__(self, model, drafter: Drafter, variant: DrafterVariant, layout: AnchorLayout, settings: EvalSpec,
                 bigram: BigramTable | None, *, static_cache: bool = False) -> None:
        self.drafter, self.variant, self.layout = drafter, variant, layout
        self.recorder = recorder_for(drafter, drafts=layout.drafts)
        if BIGRAM in settings.baselines and bigram is None:
            raise ValueError("eval.baselines asks for the bigram baseline: pass its fitted table")
        self.bigram = bigram
        made = {PROMPT_LOOKUP: lambda: PromptLookupDrafter(layout.drafts + 1), BIGRAM: lambda: BigramDrafter(bigram, layout.drafts + 1)}
        self.baselines = {name: made[name]() for name in settings.baselines}
        # What a server runs, timed: the trained drafter without the confidence recorder's extra work
        # (with the static caches, its block a replayed graph as the target's forwards are).
        served = (ReplayedDrafter if static_cache else ModelDrafter)(drafter, drafts=layout.drafts)
        self.served: dict[str, BlockDrafter] = {variant.name: served, **self.baselines}
        self.settings = settings
        self.stop = stop_ids(model)
        # The chain's own budget beside the asked ones: a tree of as many nodes as the chain drafts.
        self.budgets = sorted({*settings.tree_budgets, layout.drafts}) if settings.tree_budgets else []
        block = layout.drafts + 1
        # A static cache holds a prompt and its decoding, and past its end a verify block or a tree.
        room = settings.max_new_tokens + max([block, *(budget + 1 for budget in self.budgets)])
        make = partial(StaticTarget, model, block=block, room=room) if static_cache else partial(DecodeTarget, model)
        # One target per set of captured layers: greedy and the baselines (none) share one, and its cache.
        layer_sets = {(), *(tuple(d.target_layers) for d in self.served.values())}
        by_layers = {layers: make(layers) for layers in layer_sets}
        self.plain = by_layers[()]
        self.verifiers = {name: by_layers[tuple(d.target_layers)] for name, d in self.served.items()}
        # The trees, and the layers captured along greedy's output.
        self.tree_target = make(drafter.config.target_layer_ids, architecture=target_architecture(text_model(model).config))
        self.trees = (ReplayedBranches if static_cache else VariantBranches)(drafter, variant.branches, drafts=layout.drafts)

    def decode(self, prompt: torch.Tensor, known: Reference | Decodings | None = None) -> PromptResult:
        """The prompt's figures: its decodings, then the rest of their figures' work.
        known: greedy's decoding and verify noise of this prompt from an earlier evaluation on the
        same target and settings (evaluate/reference.py), not decoded again; or every decoding of
        the prompt (a timed prompt's, decoded alone: Decodings), their figures' work alone left."""
        return self.figures(prompt, known if isinstance(known, Decodings) else self.decodings(prompt, known))

    def decodings(self, prompt: torch.Tensor, known: Reference | None = None) -> Decodings:
        """Greedy, the trained drafter's chain decoded for real (its drafts read the target's states as
        the loop makes them), the baselines along greedy's output, the trees decoded: the decodings
        tokens/s measure, with what the figures take from them."""
        new_tokens = self.settings.max_new_tokens
        reference, noise = known or (self.greedy(prompt), None)
        chain = self.recorder or self.served[self.variant.name]
        drafted = {
            self.variant.name: speculative_decode(self.verifiers[self.variant.name], chain, prompt, max_new_tokens=new_tokens, stop_ids=self.stop),
            **{name: along_greedy(baseline, prompt.tolist(), reference.tokens, max_new_tokens=new_tokens, stop_ids=self.stop)
               for name, baseline in self.baselines.items()},
        }
        confidences = self.recorder.take() if self.recorder is not None else None
        tree_decoded = {
            budget: tree_decode(self.tree_target, self.trees, prompt, budget=budget, max_new_tokens=new_tokens, stop_ids=self.stop)
            for budget in self.budgets
        }
        return Decodings(reference, noise, drafted, confidences, tree_decoded)

    def figures(self, prompt: torch.Tensor, decoded: Decodings) -> PromptResult:
        """The figures' work beside the decodings, none of it timed: the verify noise (where not known),
        the lossless check, the drafter's training forward on greedy's output, the trees' exact figures."""
        new_tokens = self.settings.max_new_tokens
        reference, drafted = decoded.reference, decoded.drafted
        noise = decoded.noise if decoded.noise is not None else verify_noise(self.plain, prompt, reference, self.layout.drafts + 1)
        found = {
            name: divergences(self.plain, prompt, d.tokens, reference, max_new_tokens=new_tokens, stop_ids=self.stop)
            for name, d in drafted.items()
        }
        document, features = self.captured(prompt, reference)
        trees = (self.tree_figures(prompt, reference, drafted[self.variant.name], document, features, decoded.trees)
                 if self.budgets else None)
        return PromptResult(reference, drafted, self.simulate(prompt, document, features), found, noise, decoded.confidences, trees)

    def timed(self, prompt: torch.Tensor) -> dict[str, Decoded]:
        """The prompt decoded by greedy and by every drafter as served, one after another: what tokens/s measure."""
        return {GREEDY: self.greedy(prompt), **{name: self.served_decode(name, prompt) for name in self.served}}

    def decode_and_time(self, prompt: torch.Tensor, known: Reference | None = None) -> tuple[Decodings, dict[str, Decoded]]:
        """decodings() and timed()'s decodings from one pass, where they are the same decoding:
        greedy's (decoded for its time even where `known`), and the trained drafter's chain where no
        confidence recorder rides it; the baselines (computed along greedy's output for the figures) and
        a recorded chain are decoded as served beside them. The figures' other work is left to
        decode(prompt, the Decodings), in whichever process takes it."""
        greedy = self.greedy(prompt) if known is not None else None
        decoded = self.decodings(prompt, known)
        timed = {GREEDY: greedy or decoded.reference}
        for name in self.served:
            chain_as_served = name == self.variant.name and self.recorder is None
            timed[name] = decoded.drafted[name] if chain_as_served else self.served_decode(name, prompt)
        return decoded, timed

    def greedy(self, prompt: torch.Tensor) -> Decoded:
        return greedy_decode(self.plain, prompt, max_new_tokens=self.settings.max_new_tokens, stop_ids=self.stop)

    def served_decode(self, name: str, prompt: torch.Tensor) -> Decoded:
        return speculative_decode(self.verifiers[name], self.served[name], prompt, max_new_tokens=self.settings.max_new_tokens, stop_ids=self.stop)

    def captured(self, prompt: torch.Tensor, reference: Decoded) -> tuple[torch.Tensor, torch.Tensor]:
        """prompt + greedy's output, and the drafter's target layers over it [T, L*d], captured in one forward."""
        target = self.tree_target
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

    def warm_up(self, asked: tuple[torch.Tensor, Reference | None], *, speeds: bool = True) -> None:
        """One prompt decoded and dropped: the kernels chosen and, with static caches, the graphs captured.
        speeds: every way a timed prompt is (decode_and_time: the baselines and a recorded chain as
        served too), then its figures' other work as this process does it later; else as the figures'
        pass decodes it (decode), all a worker process runs."""
        started = time.monotonic()
        if speeds:
            self.decode(asked[0], self.decode_and_time(*asked)[0])
        else:
            self.decode(*asked)
        log.info("warm-up prompt decoded in %.1f s (kernels chosen, graphs captured)", time.monotonic() - started)

    def close(self) -> None:
        for target in {self.plain, *self.verifiers.values(), self.tree_target}:
            target.close()


def load_decoder(spec: RunSpec, bigram: BigramTable | None, *, device: torch.device) -> PromptDecoder:
    """The run's target and exported drafter on `device`, and the baselines, as a PromptDecoder."""
    model = load_target_model(spec, device=device, dtype=eval_dtype(device))
    variant = drafter_variant(spec.train.drafter)
    drafter, config = load_drafter(
        drafter_url(spec), target=spec.target.model, variant=variant, device=device,
        endpoint_url=spec.storage.endpoint_url, region=spec.storage.region,
    )
    return PromptDecoder(model, drafter, variant, served_layout(spec, config), spec.eval, bigram,
                         static_cache=uses_static_cache(spec.eval, model, device))


def uses_static_cache(settings: EvalSpec, model, device: torch.device) -> bool:
    """eval.cuda_graphs, on a GPU, for a target of full attention only: a static cache gains nothing
    without the graphs it exists for, and cannot roll a linear-attention layer back."""
    return settings.cuda_graphs and device.type == "cuda" and static_cache_supported(model)


class DecoderOnFirstUse:
    """This process's PromptDecoder, loaded when first asked for (after the workers, if any, were
    started: they load theirs beside it) and warmed up once."""

    def __init__(self, spec: RunSpec, bigram: BigramTable | None, *, device: torch.device) -> None:
        self.spec, self.bigram, self.device = spec, bigram, device
        self.loaded: PromptDecoder | None = None
        self.warmed = False

    def get(self) -> PromptDecoder:
        if self.loaded is None:
            started = time.monotonic()
            self.loaded = load_decoder(self.spec, self.bigram, device=self.device)
            log.info("target and drafter loaded on %s in %.1f s", self.device, time.monotonic() - started)
        return self.loaded

    def warm(self, asked: tuple[torch.Tensor, Reference | None]) -> PromptDecoder:
        """get(), warmed up on `asked` the first time (PromptDecoder.warm_up)."""
        decoder = self.get()
        if not self.warmed:
            decoder.warm_up(asked)
            self.warmed = True
        return decoder

    def close(self) -> None:
        if self.loaded is not None:
            self.loaded.close()


def served_layout(spec: RunSpec, config: DrafterConfig) -> AnchorLayout:
    """The anchor layout of the exported drafter: its variant's, at the block size it was exported with (what a server runs)."""
    return anchor_layout(spec.train.drafter, block_size=config.block_size, gamma=spec.train.gamma)


def eval_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def drafter_url(spec: RunSpec) -> str:
    return f"{storage_for(spec).url.rstrip('/')}/{DRAFTER_PREFIX}"


def log_progress(decoded: Iterable[tuple[int, PromptResult]], total: int) -> Iterator[tuple[int, PromptResult]]:
    """`decoded` passed through, with a line every LOG_EVERY_S seconds and at the last of `total`."""
    done: list[PromptResult] = []
    every = Every(LOG_EVERY_S)
    for index, result in decoded:
        yield index, result
        done.append(result)
        if every.due() or len(done) == total:
            log.info("prompt %d/%d: %s", len(done), total, progress_line(done))


def progress_line(results: list[PromptResult]) -> str:
    names = results[0].drafted
    taus = ", ".join(f"{name} tau {acceptance_length([r.drafted[name] for r in results]):.2f}" for name in names)
    identical = all(d.tokens == r.greedy.tokens for r in results for d in r.drafted.values())
    return f"{taus}; every output identical to greedy so far: {identical}"


def evaluate(spec: RunSpec, storage: Storage, *, device: torch.device) -> dict[str, Any]:
    """Evaluates the exported drafter of the run on the held-out prompts and on each of eval.prompt_sets;
    writes eval/report.json and eval/acceptance.png; returns the report."""
    prompts = held_out_prompts(storage, spec.eval.prompts)
    sets = read_prompt_sets(spec)  # a bad set is refused before the target loads
    settings = spec.eval
    variant = drafter_variant(spec.train.drafter)
    exported = exported_config(drafter_url(spec), endpoint_url=spec.storage.endpoint_url, region=spec.storage.region)
    config = variant.config_from_export(exported)
    layout = served_layout(spec, config)
    describe(spec, config, device, len(prompts))
    for prompt_set in sets:
        log.info("prompt set %s: %s", prompt_set.name, prompt_set.describe())
    bigram = fit_bigram(storage) if BIGRAM in settings.baselines else None
    if bigram is not None:
        log.info("bigram baseline: %d tokens' successors from %d pairs in %d of %d chunks (%d of %d tokens)", bigram.fit["previous_tokens"],
                 bigram.fit["pairs"], bigram.fit["chunks_read"], bigram.fit["chunks"], bigram.fit["tokens_read"], bigram.fit["tokens"])
    key = evaluation_key(spec, storage, DRAFTER_PREFIX, device)
    # The held-out prompts under the evaluation's key, each set under its own beside it.
    asked = {HELD_OUT: prompts, **{s.name: s.prompts for s in sets}}
    kept = {name: KeptPrompts(storage, key if name == HELD_OUT else f"{key}-{name}") for name in asked}
    references = KeptReferences.of(spec, storage, device, layout.drafts + 1)
    decoder = DecoderOnFirstUse(spec, bigram, device=device)
    try:
        decoded = {name: decode_set(spec, kept[name], references, decoder, p, device=device) for name, p in asked.items()}
    finally:
        decoder.close()
    results, timed = decoded[HELD_OUT]
    block_size = layout.drafts + 1  # the verify block: the anchor and its drafts (DSpark drafts block_size of them)
    report = build_report(
        **figures(results), timed=timed,
        simulated={variant.name: [r.simulated for r in results]},
        calibration={variant.name: [r.confidences for r in results]} if results[0].confidences is not None else None,
        trees={variant.name: [r.trees for r in results]} if results[0].trees is not None else None,
        prompt_sets={s.name: prompt_set_table(s.describe(), **figures(decoded[s.name][0]), timed=decoded[s.name][1], block_size=block_size)
                     for s in sets},
        block_size=block_size, dtype=eval_dtype(device),
        target=spec.target.model, drafter=drafter_url(spec), drafter_variant=variant.name, prompts=len(prompts),
        max_new_tokens=settings.max_new_tokens, processes=min(settings.processes, len(prompts)), device=str(device),
        vllm_serve=run_serve_command(spec, exported), bigram=bigram.fit if bigram is not None else None,
    )
    store_report(storage, report)
    for results_kept in kept.values():
        results_kept.clear()  # the report holds them now
    log.info("serve it with vLLM:\n%s", report["vllm_serve"])
    return report


def figures(results: list[PromptResult]) -> dict[str, Any]:
    """The decodings of every prompt, by drafter, as build_report and prompt_set_table take them."""
    names = list(results[0].drafted)
    return {
        "greedy": [r.greedy for r in results],
        "drafters": {name: [r.drafted[name] for r in results] for name in names},
        "divergences": {name: [r.divergences[name] for r in results] for name in names},
        "verify_noise": [r.verify_noise for r in results],
    }


def decode_set(spec: RunSpec, kept: KeptPrompts, references: KeptReferences, decoder: DecoderOnFirstUse, prompts: list[torch.Tensor], *,
               device: torch.device) -> tuple[list[PromptResult], dict[str, list[Decoded]]]:
    """Every prompt's result in prompt order, and the timed subset's decodings by name (greedy's and each
    served drafter's: the speeds).

    The results an earlier run of this evaluation kept (evaluate/kept.py) are taken, the others decoded
    and kept as they come; greedy's decoding of a prompt is taken from `references` where an evaluation
    on the same target and prompts computed it, and kept there where not. The first eval.timed_prompts
    prompts are decoded first, in this process alone after its warm-up prompt: their figures and their
    speeds from the same decodings (PromptDecoder.decode_and_time; a kept prompt is decoded again for
    its speeds alone), the figures' other work left for later. Then that work and the other prompts,
    shared out between this process and eval.processes - 1 workers (evaluate/workers.py), which load
    and warm up while this process does: the timed prompts wait for them to be warm, and they take
    prompts only after."""
    results = kept.load(prompts)
    missing = [i for i in range(len(prompts)) if i not in results]
    if results:
        log.info("%d of %d prompts were decoded by an earlier run of this evaluation (kept under %s): decoding the other %d",
                 len(results), len(prompts), kept.prefix, len(missing))
    known = references.load(prompts) if missing else {}
    if known:
        log.info("greedy's decodings of %d prompts were computed by an earlier evaluation on the same target (kept under %s)",
                 len(known), references.kept.prefix)
    timed_count = min(spec.eval.timed_prompts, len(prompts))
    timed: list[dict[str, Decoded]] = []

    def decoded(workers: Workers) -> Iterator[tuple[int, PromptResult]]:
        here = decoder.warm((prompts[0], known.get(0)))
        workers.wait_warm()  # their kernels and captures done: none runs on the device while the timed prompts decode
        started, every = time.monotonic(), Every(LOG_EVERY_S)
        asked: dict[int, tuple[torch.Tensor, Reference | Decodings | None]] = {}
        for index in range(timed_count):
            if index in results:
                timed.append(here.timed(prompts[index]))
            else:
                decodings, speeds = here.decode_and_time(prompts[index], known.get(index))
                timed.append(speeds)
                asked[index] = (prompts[index], decodings)  # their figures' other work, shared out with the rest
            if every.due():
                log.info("timed prompts: %d of %d decoded alone", len(timed), timed_count)
        if timed:
            log_timed(timed, time.monotonic() - started)
        workers.go()
        asked.update({i: (prompts[i], known.get(i)) for i in missing if i >= timed_count})
        yield from zip(asked, share_prompts(workers.submit, workers.count, decoder, list(asked.values())))

    count = max(0, min(spec.eval.processes, len(missing)) - 1)
    with Workers(count, partial(load_decoder, spec, decoder.bigram, device=device), prompts[missing[0]] if missing else None) as workers:
        for index, result in log_progress(decoded(workers), len(missing)):
            if index not in known:
                references.keep(index, prompts[index], result)
            kept.keep(index, prompts[index], result)
            results[index] = result
    return [results[i] for i in range(len(prompts))], {name: [run[name] for run in timed] for name in timed[0]}


def log_timed(timed: list[dict[str, Decoded]], seconds: float) -> None:
    """Where the timed prompts' time alone went: their timed decodings, and the rest (the trees'
    decodings, the baselines along greedy's output, the host's work between), which the workers wait on."""
    decodings = sum(decoding.seconds for speeds in timed for decoding in speeds.values())
    log.info("timed prompts: %d decoded alone in %.1f s, %.1f s of it their timed decodings (%s)", len(timed), seconds, decodings,
             ", ".join(f"{name} {sum(speeds[name].seconds for speeds in timed):.1f} s" for name in timed[0]))


def describe(spec: RunSpec, config: DrafterConfig, device: torch.device, prompts: int) -> None:
    log.info("target %s (%s, %s), drafter: %s, %d layers, block %d, target layers %s; %d prompts, %d new tokens each, %d process(es)",
             spec.target.model, device, eval_dtype(device), spec.train.drafter, config.num_layers, config.block_size, config.target_layer_ids,
             prompts, spec.eval.max_new_tokens, min(spec.eval.processes, prompts))
