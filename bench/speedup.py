"""What a user gets from an acceptance length: the decoding speed-up it buys at the Qwen3.6-27B shape.

    python bench/speedup.py --shape 27b --contexts 1024,4096 --acceptance 3.2 2.0 --out $OUT/speedup.json
    python bench/speedup.py --shape tiny --out /tmp/speedup.json          # CPU check, well under a minute
    python bench/speedup.py --shape 27b --contexts 2048 --tree-acceptance 16=3.4 32=3.6 64=3.8 128=3.9 --out $OUT/speedup-tree.json

Greedy speculative decoding with a block drafter (reference/dflash.md section 2.1) commits tau tokens
per cycle on average (tau = acceptance length, bonus token included). One cycle costs one target
verify forward over the block (B = 16 tokens: the anchor and 15 drafts) plus one drafter step;
plain decoding costs one target forward of one token per token. So

    speed-up(tau) = tau * t_decode1 / (t_verify16 + t_draft(tau))

where t_draft(tau) is the drafter's step with tau new context tokens (the tokens the last cycle
committed, whose target hidden states the drafter has not seen yet). Break-even: tau = (t_verify16 +
t_draft) / t_decode1.

What is built (random weights: timing does not depend on their values):
- target: transformers' Qwen3_5ForCausalLM of the real Qwen3.6-27B text shape (bench/extract_shapes.py's
  REAL_27B: 64 layers, 48 Gated DeltaNet + 16 gated attention, hidden 5120, vocab 248,320), all 64
  layers and the LM head (extract_shapes.py's own builder cuts after layer 61 and has no head), bf16 on the
  GPU, SDPA attention, the GDN kernels transformers binds (flash-linear-attention and causal-conv1d
  where installed: `fast_paths` says which, `kernels.gdn_kernels_seen` lists the kernels that ran);
- drafter: dflash_jobs.drafter.model.Drafter at bench/train/bench_train.py's "27b" shape (5 layers,
  24/4 heads of 256, FFN 17408, fc 5 x 5120 -> 5120, block 16), bf16, sharing the target's embedding
  and LM head; and the exported form (dflash.py's DFlashDraftModel) for the cached drafter.

What is timed, at each context length C (the prompt, random ids, prefilled into the target's real
cache with use_cache: attention K/V of C tokens, GDN conv and recurrent states), batch 1, eager:
- target `decode1`: one token through the target and its LM head, argmax (speculative.DecodeTarget.forward,
  last_only), the cache rolled back (speculative.DecodeTarget.rollback) before each rep, untimed, so every
  rep starts from exactly C tokens;
- target `verify16`: 16 tokens on the same cache, logits of all 16 positions and their argmax, same
  rollback; `forward_last_only[n]`: n tokens, last logits only (n = 1 is decode1): the re-run of
  (accepted + 1) tokens that our HF loop does after a rejection; `checkpoint` and `rollback`: the
  GDN state copies our loop makes around every verify (speculative.py's module docstring);
- drafter `cached[n]`: one step of dflash.py's CachedDrafter (what the exported HF model's
  spec_generate runs, and what vLLM does): the K/V of C - n context tokens already in its cache, the
  n new context tokens through fc, hidden_norm and every layer's k/v, the block of 16 over
  [context ; block], the 15 drafted slots through the LM head and argmax; its cache cropped back
  after each rep, untimed. speed-up(tau) interpolates cached[n] at n = tau;
- drafter `full_recompute`: speculative.ModelDrafter.propose -> Drafter.draft_block, what our
  evaluation (jobs/dflash_jobs/evaluate) drafts with: all C context tokens through fc and every
  layer's k/v on every call (no drafter cache), then the block and the head as above.
Each is warmed up (`--warmup` reps: Triton compiles there) and timed `--reps` times; reported: the
median (and min, max) of CUDA-event time (GPU stream time between two events, which at batch 1
includes the gaps while the CPU launches kernels), and of wall time between two synchronizes. On a
CPU both are wall time. The `kernels` stage (GPU only) profiles a few reps of each with
torch.profiler: the sum of kernel times per step and the kernel count, i.e. the cost without launch
gaps, roughly what CUDA graphs would leave.

The speed-up table (per context) has three columns:
- `engine`: tau * decode1 / (verify16 + cached(tau)): the brief's formula, a serving loop that keeps
  the GDN state per verified token (no re-run) and the drafter's context K/V cached;
- `engine_full_recompute`: the same with the drafter's full_recompute step (our evaluator's drafter);
- `hf_loop`: our speculative_decode with CachedDrafter (dflash.py's spec_generate): checkpoint +
  verify16 + cached(tau) + rollback + forward_last_only(tau) per cycle, i.e. assuming every cycle
  has a rejection and re-runs (true unless all 15 drafts are accepted; an upper bound on its cost);
- `engine_kernels` (GPU): the engine formula from kernel sums instead of event times.

Draft trees (DDTree, `--tree-budgets`, bench/speedup_trees.py, jobs/dflash_jobs/drafter/tree_verify.py): a
cycle verifies a tree of `budget` nodes below the anchor in one forward instead of the block. Timed per budget, on the
same cache: `tree_verify` (the forward over the anchor and the nodes: attention with the ancestor
mask, the Gated DeltaNet layers' recurrence in one call a layer over the tree's root paths, each from
the cached state, the logits of every node and their argmax), `tree_commit` (the accepted path's K/V
appended and the GDN states after its last node recomputed, every GDN layer in one recurrent call: a
path of 4 nodes), `tree_build` (DDTree's best-first heap over the
drafter's [15, V] slot distributions: the top-k on the device, then the heap on the host), and
`flat_forward` (a plain causal forward of as many tokens, budget + 1, with all their logits: what
the forward costs where a kernel takes the tree's recurrence at the price of a sequence); `check`
compares the tree forward's logits at every node (the kernels' path, right where it is timed) with
two plain computations of every leaf's root path, the path in one forward (`whole`: on the GPU the
chunk kernel) and token by token through decode (`stepwise`: the recurrent kernel); what those two
differ by is the noise floor of the dtype and kernels, and `verdict` says whether the tree lies
within it (NOISE_FACTOR floors of the nearer) or outside it (a defect, not rounding). The trees
are the typical shape of a drafter whose top token's probability falls from 0.8 at the first slot
to 0.4 at the last, the rest halving rank by rank (`typical_tree`; `trees.<budget>.shape` gives its
nodes per depth). Speed-up per budget and tau (`--tree-acceptance BUDGET=TAU`, from the evaluation
report's `drafters.<variant>.tree`, else the tau grid): `tree` = tau * decode1 / (tree_verify +
tree_commit + tree_build + cached(tau)), and `tree_flat` the same with flat_forward in place of
tree_verify + tree_commit, shown where the tree-aware recurrence costs more than the flat forward.
With `--profile-reps` on a GPU, `trees.<budget>.kernels` gives the kernels tree_verify, tree_commit and
flat_forward launch (bench/tree_launches.py counts the same on a CPU, against an older commit).

Not modelled: batch > 1 (verify is then no longer nearly free against decode: the speed-up shrinks
as the batch grows), CUDA graphs and fused kernels of a serving engine (vLLM and SGLang run decode
and verify under CUDA graphs with their own attention and GDN kernels and keep per-token GDN states:
their absolute times differ, and at batch 1 eager HF is partly launch-bound, which `engine_kernels`
shows), prefill and the time to the first token, sampling at temperature > 0, tensor parallelism, FP8 weights or KV cache, the host work of the loop between forwards (argmax
syncs, list bookkeeping), and how tau itself varies with C. tau comes from the quality
benchmark or dflashctl eval: this script only turns it into a speed-up.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent / "train")]
from bench_train import SHAPES as DRAFTER_SHAPES  # noqa: E402  (bench/train/bench_train.py)
from extract_shapes import REAL_27B, bench_device  # noqa: E402  (bench/extract_shapes.py)
from speedup_timing import curve, kernel_profile, measure, sync  # noqa: E402
from speedup_trees import time_trees, tree_speedups  # noqa: E402

from dflash_jobs.drafter.model import Drafter, DrafterConfig  # noqa: E402
from dflash_jobs.drafter.speculative import DecodeTarget, ModelDrafter  # noqa: E402
from dflash_jobs.architectures import target_architecture  # noqa: E402
from dflash_jobs.capture.target import FastPaths  # noqa: E402

log = logging.getLogger("bench.speedup")

DEFAULT_CONTEXTS = {"27b": "1024,4096", "tiny": "64,256"}
DEFAULT_TAUS = [1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 6.5, 7.0]
NEW_CONTEXT = (1, 2, 4, 8, 16)
"""New context tokens per drafter step (accepted + 1 = tau per cycle) and re-run lengths that are timed."""
GDN_KERNEL_HINTS = ("gated_delta", "recurrent", "chunk_", "causal_conv", "l2norm")
"""Substrings of flash-linear-attention's and causal-conv1d's kernel names (not "fla": SDPA's flash kernels match it)."""
DEFAULT_REPS = {"27b": (10, 3), "tiny": (3, 1)}
"""(timed reps, warm-up reps) per kind, by shape."""
DEFAULT_TREE_BUDGETS = "16,32,64,128"
# ---- models -----------------------------------------------------------------------------------------


def target_config(shape: str):
    """Qwen3.6-27B's text config (all 64 layers), or the tiny target's (dflash_jobs.architectures.tiny, 8 layers)."""
    from transformers import Qwen3_5TextConfig

    if shape == "27b":
        config = Qwen3_5TextConfig(**REAL_27B)
    else:
        from dflash_jobs.architectures.tiny import DEBUGMODEL
        from dflash_jobs.architectures.tiny.qwen3_5 import tiny_target_config

        names = ("<|endoftext|>", "<|im_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
        ids = {name: DEBUGMODEL.vocab_size - 32 + i for i, name in enumerate(names)}
        config = tiny_target_config(num_layers=DEBUGMODEL.num_layers, hidden_size=DEBUGMODEL.hidden_size,
                                    vocab_size=DEBUGMODEL.vocab_size, token_ids=ids).text_config
    config._attn_implementation = "sdpa"
    return config


def build(shape: str, device: torch.device, dtype: torch.dtype, block_size: int):
    """The target with its LM head, the Drafter (draft_block) and the exported DFlashDraftModel (cached)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3Config

    from dflash_jobs.drafter.dflash import DFlashDraftModel

    torch.manual_seed(0)
    config = target_config(shape)
    drafter_config = DrafterConfig(**DRAFTER_SHAPES[shape], block_size=block_size,
                                   mask_token_id=DRAFTER_SHAPES[shape]["vocab_size"] - 1)
    if (config.hidden_size, config.vocab_size, config.num_hidden_layers) != (
            drafter_config.hidden_size, drafter_config.vocab_size, drafter_config.num_target_layers):
        raise ValueError(f"target and drafter shapes disagree for {shape!r}")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3_5ForCausalLM(config).eval()
            drafter = Drafter(drafter_config).eval()
            exported = DFlashDraftModel(Qwen3Config(**drafter_config.to_zlab())).eval()
    finally:
        torch.set_default_dtype(previous)
    model.requires_grad_(False)
    drafter.requires_grad_(False)
    exported.requires_grad_(False)
    # The drafter reads the target's own tables (shared storage, as in serving), not copies.
    drafter.load_target_tensors(model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach(),
                                torch.ones(config.hidden_size))
    return model, drafter, exported, drafter_config


def parameter_gib(module: torch.nn.Module) -> float:
    return round(sum(p.numel() * p.element_size() for p in module.parameters()) / 2**30, 2)


# ---- the speed-up -----------------------------------------------------------------------------------


def speedups(ctx: dict, taus: list[float], block_size: int) -> dict:
    """Speed-up per tau from one context's measured costs (see the module docstring for the columns)."""
    target, drafter = ctx["target"], ctx["drafter"]
    t1, t16 = target["decode1"]["median_ms"], target["verify16"]["median_ms"]
    rows = []
    for tau in taus:
        if not 1.0 <= tau <= block_size:
            continue
        draft = curve(drafter["cached"], tau)
        row = {"tau": tau, "engine": round(tau * t1 / (t16 + draft), 3),
               "cycle_ms": round(t16 + draft, 3), "tokens_per_s": round(tau / (t16 + draft) * 1e3, 1)}
        if "full_recompute" in drafter:
            row["engine_full_recompute"] = round(tau * t1 / (t16 + drafter["full_recompute"]["median_ms"]), 3)
        if "forward_last_only" in target and "checkpoint" in target:
            loop = target["checkpoint"]["median_ms"] + t16 + draft + target["rollback"]["median_ms"] + curve(target["forward_last_only"], tau)
            row["hf_loop"] = round(tau * t1 / loop, 3)
        kernels = ctx.get("kernels") or {}
        if all(k in kernels for k in ("decode1", "verify16", "cached")) and "error" not in kernels:
            k_cycle = kernels["verify16"]["kernel_ms"] + curve(kernels["cached"], tau, "kernel_ms")
            if k_cycle > 0:
                row["engine_kernels"] = round(tau * kernels["decode1"]["kernel_ms"] / k_cycle, 3)
        rows.append(row)
    draft_at_1 = curve(drafter["cached"], 1)
    return {
        "decode1_ms": t1, "verify16_ms": t16, "verify16_over_decode1": round(t16 / t1, 3),
        "draft_cached_over_decode1": {n: round(s["median_ms"] / t1, 3) for n, s in drafter["cached"].items()},
        "break_even_tau_engine": round((t16 + draft_at_1) / t1, 3),
        "plain_tokens_per_s": round(1e3 / t1, 1),
        "table": rows,
    }


# ---- the run ----------------------------------------------------------------------------------------


@dataclass
class Bench:
    """What every context's timings work on: the settings, the models built once, and the one result
    document, written after every timing so a run cut short keeps what it measured."""

    args: argparse.Namespace
    device: torch.device
    taus: list[float]
    tree_budgets: list[int]
    tree_acceptance: dict[int, float]
    started: float
    result: dict
    model: torch.nn.Module
    drafter: Drafter
    exported: torch.nn.Module
    drafter_config: DrafterConfig
    target: DecodeTarget
    full: ModelDrafter
    generator: torch.Generator

    def save(self) -> None:
        self.result["elapsed_s"] = round(time.perf_counter() - self.started, 1)
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(json.dumps(self.result, indent=2) + "\n")

    def ids(self, n: int) -> torch.Tensor:
        return torch.randint(0, self.model.config.vocab_size - 64, (n,), generator=self.generator).to(self.device)


@dataclass
class Context:
    """One context length in the target's cache: the prompt prefilled, what the drafter reads, the block to verify."""

    length: int
    target: DecodeTarget
    checkpoint: object
    tokens: torch.Tensor
    """Committed: the prompt, then the anchor."""
    features: torch.Tensor
    """[C, L*d]: the drafter's context."""
    block: torch.Tensor
    cached: object = None
    """dflash.py's CachedDrafter, once the drafter's timings build it."""

    def reset(self) -> None:
        self.target.rollback(self.checkpoint)

    def prime(self, kept: int) -> None:
        """The cached drafter holding the K/V of the first `kept` context tokens."""
        cached = self.cached
        if cached.cached > kept:
            cached.cache.crop(kept - cached.cache.get_seq_length())
            cached.cached = kept
        elif cached.cached < kept:
            cached.propose(self.tokens[: kept + 1], self.features[:kept])
        assert cached.cached == kept == cached.cache.get_seq_length(), (cached.cached, kept, cached.cache.get_seq_length())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=("27b", "tiny"), default="27b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--contexts", help=f"context lengths in the cache, comma-separated (default by shape: {DEFAULT_CONTEXTS})")
    parser.add_argument("--acceptance", type=float, nargs="*", default=[], help="measured acceptance lengths (tau) to state speed-ups for")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"),
                        help="weights and activations (default: bfloat16 on a GPU, float32 on the CPU; the tree check's noise floor is this dtype's)")
    parser.add_argument("--reps", type=int, help=f"timed reps per kind (default by shape: {({k: v[0] for k, v in DEFAULT_REPS.items()})})")
    parser.add_argument("--warmup", type=int, help=f"warm-up reps per kind (default by shape: {({k: v[1] for k, v in DEFAULT_REPS.items()})})")
    parser.add_argument("--profile-reps", type=int, default=3, help="reps per kind under torch.profiler (GPU; 0: no kernels stage)")
    parser.add_argument("--tree-budgets", default=DEFAULT_TREE_BUDGETS, help="draft tree node budgets to time, comma-separated ('' for none)")
    parser.add_argument("--tree-acceptance", nargs="*", default=[], metavar="BUDGET=TAU",
                        help="measured tree acceptance lengths (the evaluation's drafters.<variant>.tree) to state speed-ups for")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.reps = args.reps or DEFAULT_REPS[args.shape][0]
    args.warmup = args.warmup if args.warmup is not None else DEFAULT_REPS[args.shape][1]
    return args


def version(name: str) -> str | None:
    try:
        return getattr(importlib.import_module(name), "__version__", "?")
    except Exception:
        return None


def open_bench(args: argparse.Namespace, device: torch.device, started: float) -> Bench:
    """The result's header, the models built and described in its setup (saved), the target ready to time."""
    import transformers

    # Here, not at the top: bench/tree_launches.py imports this module under a --baseline's older data plane.
    from dflash_jobs.drafter.tree_verify import tree_target

    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    tree_budgets = [int(b) for b in args.tree_budgets.split(",") if b]
    tree_acceptance = {int(budget): float(tau) for budget, tau in (pair.split("=") for pair in args.tree_acceptance)}
    result: dict = {
        "command": "python bench/speedup.py " + shlex.join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "fla": version("fla"), "causal_conv1d": version("causal_conv1d"),
        "shape": args.shape, "dtype": str(dtype).removeprefix("torch."), "batch": 1, "block_size": args.block_size,
        "reps": args.reps, "warmup": args.warmup, "acceptance": args.acceptance,
        "tree_budgets": tree_budgets, "tree_acceptance": tree_acceptance,
        "contexts": {},
    }
    model, drafter, exported, drafter_config = build(args.shape, device, dtype, args.block_size)
    sync(device)
    b = Bench(args=args, device=device, taus=sorted(set(DEFAULT_TAUS) | set(args.acceptance)), tree_budgets=tree_budgets,
              tree_acceptance=tree_acceptance, started=started, result=result, model=model, drafter=drafter, exported=exported,
              drafter_config=drafter_config, target=tree_target(model, drafter_config.target_layer_ids),
              full=ModelDrafter(drafter, drafts=drafter_config.block_size - 1), generator=torch.Generator().manual_seed(0))
    describe_setup(b)
    return b


def describe_setup(b: Bench) -> None:
    model, device = b.model, b.device
    fast = FastPaths.detect(device, target_architecture(model.config))
    b.result["setup"] = {
        "build_s": round(time.perf_counter() - b.started, 1), "fast_paths": fast.as_dict(),
        "target": {"layers": model.config.num_hidden_layers, "layer_types": {t: model.config.layer_types.count(t) for t in set(model.config.layer_types)},
                   "hidden_size": model.config.hidden_size, "vocab_size": model.config.vocab_size, "weights_gib": parameter_gib(model),
                   "attention": model.config._attn_implementation},
        "drafter": {**{k: v for k, v in b.drafter_config.to_dict().items() if k != "layer_types"},
                    "trainable_gib": round(sum(p.numel() * p.element_size() for n, p in b.drafter.named_parameters()
                                               if n not in ("embed_tokens", "lm_head")) / 2**30, 2)},
    }
    if device.type == "cuda":
        b.result["setup"]["memory_allocated_gib"] = round(torch.cuda.memory_allocated(device) / 2**30, 2)
    b.save()
    log.info("built in %.1fs: target %.1f GiB, fast paths %s", time.perf_counter() - b.started, b.result["setup"]["target"]["weights_gib"], fast.as_dict())


def prefill(b: Bench, C: int, ctx: dict) -> Context:
    """C random tokens into the target's cache, checkpointed: every timing starts from exactly these C."""
    target = b.target
    prompt = b.ids(C)
    sync(b.device)
    t0 = time.perf_counter()
    target.reset()
    bonus = target.forward(prompt, last_only=True)[-1].argmax()
    features = target.features()
    sync(b.device)
    ctx["prefill_s"] = round(time.perf_counter() - t0, 3)
    checkpoint = target.checkpoint()
    return Context(length=C, target=target, checkpoint=checkpoint, tokens=torch.cat([prompt, bonus[None]]), features=features,
                   block=b.ids(b.args.block_size))


def time_target(b: Bench, c: Context, ctx: dict) -> None:
    args, target, block, reset = b.args, b.target, c.block, c.reset
    ctx["target"] = tgt = {}
    log.info("context %d: prefill %.2fs; timing the target", c.length, ctx["prefill_s"])
    tgt["decode1"] = measure(lambda: target.forward(block[:1], last_only=True).argmax(-1), b.device,
                             reps=args.reps, warmup=args.warmup, before=reset)
    b.save()
    tgt["verify16"] = measure(lambda: target.forward(block).argmax(-1), b.device, reps=args.reps, warmup=args.warmup, before=reset)
    b.save()
    tgt["forward_last_only"] = {}
    for n in NEW_CONTEXT:
        tgt["forward_last_only"][str(n)] = measure(lambda: target.forward(block[:n], last_only=True).argmax(-1), b.device,
                                                   reps=args.reps, warmup=1, before=reset)
    tgt["checkpoint"] = measure(target.checkpoint, b.device, reps=args.reps, warmup=1, before=reset)
    tgt["rollback"] = measure(reset, b.device, reps=args.reps, warmup=1, before=lambda: target.forward(block, last_only=True))
    reset()
    b.save()


def time_drafter(b: Bench, c: Context, ctx: dict) -> None:
    # Imported after the build: dflash.py needs transformers' Qwen3 classes, nothing of the GPU.
    from dflash_jobs.drafter.dflash import CachedDrafter

    args, C = b.args, c.length
    ctx["drafter"] = dft = {"cached": {}}
    log.info("context %d: timing the drafter", C)
    c.cached = CachedDrafter(b.exported, b.model)
    for n in NEW_CONTEXT:
        if n >= C:
            continue
        dft["cached"][str(n)] = measure(lambda: c.cached.propose(c.tokens, c.features), b.device,
                                        reps=args.reps, warmup=args.warmup, before=lambda: c.prime(C - n))
        b.save()
    dft["full_recompute"] = measure(lambda: b.full.propose(c.tokens, c.features), b.device, reps=args.reps, warmup=args.warmup)
    b.save()


def profile_kernels(b: Bench, c: Context, ctx: dict) -> None:
    target, block, device, reps = b.target, c.block, b.device, b.args.profile_reps
    log.info("context %d: kernel profiles", c.length)
    ctx["kernels"] = kern = {}
    try:
        # No rollback inside a profile: the cache grows by a few tokens over the reps, then is rolled back.
        kern["decode1"] = kernel_profile(lambda: target.forward(block[:1], last_only=True).argmax(-1), device, reps)
        c.reset()
        kern["verify16"] = kernel_profile(lambda: target.forward(block).argmax(-1), device, reps)
        c.reset()
        kern["cached"] = {}
        for n in (1, 4, 16):
            if n < c.length:
                def step(n=n):
                    c.prime(c.length - n)
                    c.cached.propose(c.tokens, c.features)
                c.prime(c.length - n)
                kern["cached"][str(n)] = kernel_profile(step, device, reps)
        kern["full_recompute"] = kernel_profile(lambda: b.full.propose(c.tokens, c.features), device, reps)
        names = set(kern["decode1"]["names"]) | set(kern["verify16"]["names"])
        kern["gdn_kernels_seen"] = sorted(n[:100] for n in names if any(h in n.lower() for h in GDN_KERNEL_HINTS))
        for entry in [kern["decode1"], kern["verify16"], kern["full_recompute"], *kern["cached"].values()]:
            entry.pop("names")
    except Exception as exc:  # the timings above still stand
        log.exception("kernel profile failed")
        kern["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    b.save()


def measure_context(b: Bench, C: int, ctx: dict) -> None:
    """Every timing at context C into ctx, then its speed-ups; the cache and the drafter's go when it returns."""
    with torch.inference_mode():
        c = prefill(b, C, ctx)
        time_target(b, c, ctx)
        if b.tree_budgets:
            log.info("context %d: timing draft trees of %s nodes", C, b.tree_budgets)
            ctx["trees"] = time_trees(b.target, b.tree_budgets, b.args.block_size - 1, b.device, b.args.reps, b.args.warmup,
                                      b.args.profile_reps, c.reset, b.save)
        time_drafter(b, c, ctx)
        if b.device.type == "cuda" and b.args.profile_reps > 0:
            profile_kernels(b, c, ctx)
        ctx["speedup"] = speedups(ctx, b.taus, b.args.block_size)
        if "trees" in ctx:
            ctx["tree_speedup"] = tree_speedups(ctx, b.taus, b.tree_acceptance)


def time_context(b: Bench, C: int) -> None:
    """Context C into result["contexts"][C]; a failure keeps what was measured, and the next context still runs."""
    ctx: dict = {}
    b.result["contexts"][str(C)] = ctx
    try:
        measure_context(b, C, ctx)
    except Exception as exc:
        log.exception("context %d failed", C)
        ctx["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        if "target" in ctx and "decode1" in ctx["target"] and "verify16" in ctx["target"] and ctx.get("drafter", {}).get("cached"):
            ctx["speedup"] = speedups(ctx, b.taus, b.args.block_size)
    if b.device.type == "cuda":
        ctx["peak_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated(b.device) / 2**30, 2)
        torch.cuda.empty_cache()
    b.save()


def summarise(result: dict, acceptance: list[float]) -> None:
    """Speed-ups by context and tau (only the measured taus, where given), of the block and of each tree budget."""
    result["summary"] = {
        str(C): {str(row["tau"]): {k: row[k] for k in ("engine", "engine_full_recompute", "hf_loop", "engine_kernels") if k in row}
                 for row in ctx["speedup"]["table"] if not acceptance or row["tau"] in acceptance}
        for C, ctx in result["contexts"].items() if "speedup" in ctx
    }
    result["tree_summary"] = {
        str(C): {budget: {"verify_over_flat": tree["verify_over_flat"], **{str(row["tau"]): {k: row[k] for k in ("tree", "tree_flat") if k in row}
                                                                            for row in tree["table"]}}
                 for budget, tree in ctx["tree_speedup"].items()}
        for C, ctx in result["contexts"].items() if "tree_speedup" in ctx
    }


def print_tables(result: dict) -> None:
    for C, ctx in result["contexts"].items():
        if "speedup" not in ctx:
            continue
        s = ctx["speedup"]
        print(f"\ncontext {C}: decode1 {s['decode1_ms']} ms, verify16 {s['verify16_ms']} ms ({s['verify16_over_decode1']}x), "
              f"draft cached[1] {ctx['drafter']['cached'].get('1', {}).get('median_ms')} ms, full {ctx['drafter']['full_recompute']['median_ms']} ms, "
              f"break-even tau {s['break_even_tau_engine']}")
        columns = [c for c in ("engine", "engine_full_recompute", "hf_loop", "engine_kernels") if c in s["table"][0]]
        print("  tau  " + "  ".join(f"{c:>21}" for c in columns))
        for row in s["table"]:
            print(f"  {row['tau']:<4} " + "  ".join(f"{row[c]:>21}" for c in columns))
        for budget, tree in ctx.get("tree_speedup", {}).items():
            rows = ", ".join(f"{row['tau']}: {row['tree']}x" + (f" (flat {row['tree_flat']}x)" if "tree_flat" in row else "") for row in tree["table"])
            print(f"  tree of {budget}: verify + commit {tree['verify_and_commit_ms']} ms ({tree['verify_over_flat']}x a flat forward of "
                  f"{tree['nodes'] + 1}), build {tree['build_ms']} ms, break-even tau {tree['break_even_tau']}; speed-up at tau {rows}")
            check = ctx["trees"][budget]["check"]
            print(f"    check: {check['verdict']} (tree {check['tree_vs_whole']['max_relative_logit_difference']} from whole, "
                  f"{check['tree_vs_stepwise']['max_relative_logit_difference']} from stepwise; floor {check['noise_floor']})")


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    device = bench_device(args.device)
    contexts = [int(c) for c in (args.contexts or DEFAULT_CONTEXTS[args.shape]).split(",")]
    b = open_bench(args, device, time.perf_counter())
    for C in contexts:
        time_context(b, C)
    summarise(b.result, args.acceptance)
    b.result["total_s"] = round(time.perf_counter() - b.started, 1)
    b.save()
    print(json.dumps({k: v for k, v in b.result.items() if k != "contexts"}, indent=2))
    print_tables(b.result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
