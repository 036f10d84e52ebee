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
- target: transformers' Qwen3_5ForCausalLM of the real Qwen3.6-27B text shape (bench/extract.py's
  REAL_27B: 64 layers, 48 Gated DeltaNet + 16 gated attention, hidden 5120, vocab 248,320), all 64
  layers and the LM head (extract.py's own builder cuts after layer 61 and has no head), bf16 on the
  GPU, SDPA attention, the GDN kernels transformers binds (flash-linear-attention and causal-conv1d
  where installed: `fast_paths` says which, `kernels.gdn_kernels_seen` lists the kernels that ran);
- drafter: dflash_jobs.drafter.model.Drafter at bench/train/bench_train.py's "27b" shape (5 layers,
  24/4 heads of 256, FFN 17408, fc 5 x 5120 -> 5120, block 16), bf16, sharing the target's embedding
  and LM head; and the exported form (dflash.py's DFlashDraftModel) for the cached drafter.

What is timed, at each context length C (the prompt, random ids, prefilled into the target's real
cache with use_cache: attention K/V of C tokens, GDN conv and recurrent states), batch 1, eager:
- target `decode1`: one token through the target and its LM head, argmax (speculative.Target.forward,
  last_only), the cache rolled back (speculative.Target.rollback) before each rep, untimed, so every
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

Draft trees (DDTree, `--tree-budgets`, jobs/dflash_jobs/drafter/tree_verify.py): a cycle verifies a
tree of `budget` nodes below the anchor in one forward instead of the block. Timed per budget, on the
same cache: `tree_verify` (the forward over the anchor and the nodes: attention with the ancestor
mask, the Gated DeltaNet layers one depth at a time from each node's parent's states, the logits of
every node and their argmax), `tree_commit` (the accepted path's K/V appended and the GDN states
after its last node recomputed: a path of 4 nodes), `tree_build` (DDTree's best-first heap over the
drafter's [15, V] slot distributions: the top-k on the device, then the heap on the host), and
`flat_forward` (a plain causal forward of as many tokens, budget + 1, with all their logits: what
the forward costs where a kernel takes the tree's recurrence at the price of a sequence); `check`
compares the tree forward's logits with plain forwards of two root paths (the kernels' path is
right where it is timed; bf16 rounds the two orders differently). The trees
are the typical shape of a drafter whose top token's probability falls from 0.8 at the first slot
to 0.4 at the last, the rest halving rank by rank (`typical_tree`; `trees.<budget>.shape` gives its
nodes per depth). Speed-up per budget and tau (`--tree-acceptance BUDGET=TAU`, from the evaluation
report's `drafters.<variant>.tree`, else the tau grid): `tree` = tau * decode1 / (tree_verify +
tree_commit + tree_build + cached(tau)), and `tree_flat` the same with flat_forward in place of
tree_verify + tree_commit, shown where the tree-aware recurrence costs more than the flat forward.

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
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent / "train")]
from bench_train import SHAPES as DRAFTER_SHAPES  # noqa: E402  (bench/train/bench_train.py)
from extract import REAL_27B  # noqa: E402  (bench/extract.py)

from dflash_jobs.drafter.model import Drafter, DrafterConfig  # noqa: E402
from dflash_jobs.drafter.speculative import ModelDrafter, Target  # noqa: E402
from dflash_jobs.drafter.tree import MarginalBranches, Tree, build_tree  # noqa: E402
from dflash_jobs.drafter.tree_verify import commit_path, verify_tree  # noqa: E402
from dflash_jobs.extract.target import FastPaths  # noqa: E402

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
COMMITTED_PATH = 4
"""Accepted nodes in the timed tree commit."""


# ---- models -----------------------------------------------------------------------------------------


def target_config(shape: str):
    """Qwen3.6-27B's text config (all 64 layers), or the tiny target's (dflash_jobs.tiny, 8 layers)."""
    from transformers import Qwen3_5TextConfig

    if shape == "27b":
        config = Qwen3_5TextConfig(**REAL_27B)
    else:
        from dflash_jobs.tiny import DEBUGMODEL, tiny_target_config

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


# ---- timing -----------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, device: torch.device, *, reps: int, warmup: int, before=None) -> dict:
    """Median of `reps` timed calls of fn after `warmup` untimed ones; `before` runs untimed ahead of each."""
    events, walls = [], []
    for rep in range(warmup + reps):
        if before is not None:
            before()
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            end.record()
        sync(device)
        wall = (time.perf_counter() - started) * 1e3
        if rep >= warmup:
            walls.append(wall)
            events.append(start.elapsed_time(end) if device.type == "cuda" else wall)
    return {"median_ms": round(statistics.median(events), 3), "min_ms": round(min(events), 3), "max_ms": round(max(events), 3),
            "wall_median_ms": round(statistics.median(walls), 3), "reps": reps}


def kernel_profile(fn, device: torch.device, reps: int) -> dict:
    """Kernel time per call (sum over the GPU kernels and copies it launched) and kernel count, from torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        sync(device)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us()
    total_us = sum(by_name.values())
    if not kernels:  # a profiler that does not list device events flat: the operators' own device time, as bench/extract.py sums it
        total_us = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages())
    top = sorted(by_name.items(), key=lambda item: item[1], reverse=True)[:8]
    return {"kernel_ms": round(total_us / 1e3 / reps, 3), "kernels_per_call": round(len(kernels) / reps, 1),
            "top": [{"name": name[:100], "ms_per_call": round(us / 1e3 / reps, 3)} for name, us in top],
            "names": sorted(by_name)}


# ---- the speed-up -----------------------------------------------------------------------------------


def curve(points: dict, x: float, key: str = "median_ms") -> float:
    """Linear interpolation of {"n": stats} at x (clamped to the measured n)."""
    ns = sorted(int(n) for n in points)
    return float(np.interp(x, ns, [points[str(n)][key] for n in ns]))


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


# ---- draft trees ------------------------------------------------------------------------------------


def typical_tree(budget: int, depths: int, vocab: int, device: torch.device) -> tuple[Tree, torch.Tensor]:
    """DDTree's tree of `budget` nodes over slot distributions shaped like a trained drafter's: at
    depth d the top token has probability 0.8 falling linearly to 0.4 at the last depth, the rest
    halving rank by rank. Returns the tree and the [depths, vocab] logits it was built from."""
    ranks = min(budget + 1, vocab)
    logits = torch.full((depths, vocab), -1e4)
    for d in range(depths):
        top = 0.8 - 0.4 * d / max(depths - 1, 1)
        rest = torch.tensor([0.5**r for r in range(1, ranks)])
        logits[d, :ranks] = torch.cat([torch.tensor([top]), (1 - top) * rest / rest.sum()]).log()
    return build_tree(MarginalBranches(logits, anchor=0), budget=budget, depth_limit=depths), logits.to(device)


def tree_shape(tree: Tree) -> dict:
    per_depth = [tree.depths.count(d) for d in range(1, max(tree.depths, default=0) + 1)]
    return {"nodes": len(tree), "depth": len(per_depth), "per_depth": per_depth}


def tree_check(target: Target, tree: Tree, reset) -> dict:
    """The tree verify forward against plain forwards of its deepest node's root path and of the last
    node's (a branch): each row's logits against the plain forward's at the same token, relative to
    the logits' scale, and whether their argmax agree (on the GPU: the fla kernels' path)."""
    verified = verify_tree(target, 0, tree)
    differences, agree = [], []
    for node in {max(range(len(tree)), key=tree.depths.__getitem__), len(tree) - 1}:
        path = []
        while node >= 0:
            path.append(node)
            node = tree.parents[node]
        rows = [0] + [n + 1 for n in reversed(path)]
        reset()
        plain = target.forward(verified.logits.new_tensor([0, *(tree.tokens[n] for n in reversed(path))], dtype=torch.long)).float()
        mine = verified.logits[rows].float()
        differences.append(float((mine - plain).abs().max() / plain.abs().max()))
        agree.append(bool((mine.argmax(-1) == plain.argmax(-1)).all()))
    reset()
    return {"max_relative_logit_difference": float(f"{max(differences):.3g}"), "argmax_agree": all(agree)}


def time_trees(target: Target, budgets: list[int], depths: int, device: torch.device, reps: int, warmup: int, reset, save) -> dict:
    """tree_verify, tree_commit, tree_build and flat_forward per budget (see the module docstring), on the target's cache as `reset` leaves it."""
    vocab = target.model.config.vocab_size
    trees: dict = {}
    for budget in budgets:
        tree, logits = typical_tree(budget, depths, vocab, device)
        entry = trees[str(budget)] = {"shape": tree_shape(tree)}
        reset()
        entry["check"] = tree_check(target, tree, reset)
        entry["tree_verify"] = measure(lambda: verify_tree(target, 0, tree).predicted, device, reps=reps, warmup=warmup)
        verified = verify_tree(target, 0, tree)
        path, parent = [0], -1  # the root and the first COMMITTED_PATH nodes of the chain (each depth's first child)
        for node in range(len(tree)):
            if tree.parents[node] == parent and len(path) <= COMMITTED_PATH:
                path.append(node + 1)
                parent = node
        entry["tree_commit"] = measure(lambda: commit_path(target, verified, path), device, reps=reps, warmup=1, before=reset)
        entry["tree_build"] = measure(lambda: build_tree(MarginalBranches(logits, anchor=0), budget=budget, depth_limit=depths), device,
                                      reps=reps, warmup=1)
        ids = torch.arange(len(tree) + 1, device=device)
        entry["flat_forward"] = measure(lambda: target.forward(ids).argmax(-1), device, reps=reps, warmup=warmup, before=reset)
        reset()
        save()
    return trees


def tree_speedups(ctx: dict, taus: list[float], acceptance: dict[int, float]) -> dict:
    """Per budget: its costs against decode1 and the flat forward, and the speed-up at its measured tau
    (--tree-acceptance) or at every tau of the grid."""
    t1 = ctx["target"]["decode1"]["median_ms"]
    table = {}
    for budget, entry in ctx["trees"].items():
        verify = entry["tree_verify"]["median_ms"] + entry["tree_commit"]["median_ms"]
        flat = entry["flat_forward"]["median_ms"]
        build = entry["tree_build"]["median_ms"]
        rows = []
        for tau in [acceptance[int(budget)]] if int(budget) in acceptance else taus:
            draft = curve(ctx["drafter"]["cached"], tau) + build
            row = {"tau": tau, "tree": round(tau * t1 / (verify + draft), 3), "cycle_ms": round(verify + draft, 3)}
            if verify > flat:
                row["tree_flat"] = round(tau * t1 / (flat + draft), 3)
            rows.append(row)
        table[budget] = {
            "nodes": entry["shape"]["nodes"], "verify_and_commit_ms": round(verify, 3), "flat_forward_ms": flat,
            "verify_over_flat": round(verify / flat, 3), "verify_over_decode1": round(verify / t1, 3), "build_ms": build,
            "break_even_tau": round((verify + curve(ctx["drafter"]["cached"], 1) + build) / t1, 3), "table": rows,
        }
    return table


# ---- main -------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=("27b", "tiny"), default="27b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--contexts", help=f"context lengths in the cache, comma-separated (default by shape: {DEFAULT_CONTEXTS})")
    parser.add_argument("--acceptance", type=float, nargs="*", default=[], help="measured acceptance lengths (tau) to state speed-ups for")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, help=f"timed reps per kind (default by shape: {({k: v[0] for k, v in DEFAULT_REPS.items()})})")
    parser.add_argument("--warmup", type=int, help=f"warm-up reps per kind (default by shape: {({k: v[1] for k, v in DEFAULT_REPS.items()})})")
    parser.add_argument("--profile-reps", type=int, default=3, help="reps per kind under torch.profiler (GPU; 0: no kernels stage)")
    parser.add_argument("--tree-budgets", default=DEFAULT_TREE_BUDGETS, help="draft tree node budgets to time, comma-separated ('' for none)")
    parser.add_argument("--tree-acceptance", nargs="*", default=[], metavar="BUDGET=TAU",
                        help="measured tree acceptance lengths (the evaluation's drafters.<variant>.tree) to state speed-ups for")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.reps = args.reps or DEFAULT_REPS[args.shape][0]
    args.warmup = args.warmup if args.warmup is not None else DEFAULT_REPS[args.shape][1]
    contexts = [int(c) for c in (args.contexts or DEFAULT_CONTEXTS[args.shape]).split(",")]
    taus = sorted(set(DEFAULT_TAUS) | set(args.acceptance))
    tree_budgets = [int(b) for b in args.tree_budgets.split(",") if b]
    tree_acceptance = {int(budget): float(tau) for budget, tau in (pair.split("=") for pair in args.tree_acceptance)}
    B = args.block_size
    started = time.perf_counter()

    def version(name: str) -> str | None:
        try:
            return getattr(importlib.import_module(name), "__version__", "?")
        except Exception:
            return None

    import transformers

    result: dict = {
        "command": "python bench/speedup.py " + shlex.join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "fla": version("fla"), "causal_conv1d": version("causal_conv1d"),
        "shape": args.shape, "dtype": str(dtype).removeprefix("torch."), "batch": 1, "block_size": B,
        "reps": args.reps, "warmup": args.warmup, "acceptance": args.acceptance,
        "tree_budgets": tree_budgets, "tree_acceptance": tree_acceptance,
        "contexts": {},
    }

    def save() -> None:
        result["elapsed_s"] = round(time.perf_counter() - started, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    model, drafter, exported, drafter_config = build(args.shape, device, dtype, B)
    sync(device)
    fast = FastPaths.detect(device)
    result["setup"] = {
        "build_s": round(time.perf_counter() - started, 1), "fast_paths": fast.as_dict(),
        "target": {"layers": model.config.num_hidden_layers, "layer_types": {t: model.config.layer_types.count(t) for t in set(model.config.layer_types)},
                   "hidden_size": model.config.hidden_size, "vocab_size": model.config.vocab_size, "weights_gib": parameter_gib(model),
                   "attention": model.config._attn_implementation},
        "drafter": {**{k: v for k, v in drafter_config.to_dict().items() if k != "layer_types"},
                    "trainable_gib": round(sum(p.numel() * p.element_size() for n, p in drafter.named_parameters()
                                               if n not in ("embed_tokens", "lm_head")) / 2**30, 2)},
    }
    if device.type == "cuda":
        result["setup"]["memory_allocated_gib"] = round(torch.cuda.memory_allocated(device) / 2**30, 2)
    save()
    log.info("built in %.1fs: target %.1f GiB, fast paths %s", time.perf_counter() - started, result["setup"]["target"]["weights_gib"], fast.as_dict())

    # Imported after the build: dflash.py needs transformers' Qwen3 classes, nothing of the GPU.
    from dflash_jobs.drafter.dflash import CachedDrafter

    target = Target(model, drafter_config.target_layer_ids)
    full = ModelDrafter(drafter, drafts=drafter_config.block_size - 1)
    generator = torch.Generator().manual_seed(0)
    V = model.config.vocab_size

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, V - 64, (n,), generator=generator).to(device)

    for C in contexts:
        ctx: dict = {}
        result["contexts"][str(C)] = ctx
        try:
            with torch.inference_mode():
                prompt = ids(C)
                sync(device)
                t0 = time.perf_counter()
                target.reset()
                bonus = target.forward(prompt, last_only=True)[-1].argmax()
                features = target.features()  # [C, L*d]: the drafter's context
                sync(device)
                ctx["prefill_s"] = round(time.perf_counter() - t0, 3)
                checkpoint = target.checkpoint()
                tokens = torch.cat([prompt, bonus[None]])  # committed: the prompt, then the anchor
                block = ids(B)
                reset = lambda: target.rollback(checkpoint)  # noqa: E731
                ctx["target"] = tgt = {}
                log.info("context %d: prefill %.2fs; timing the target", C, ctx["prefill_s"])

                tgt["decode1"] = measure(lambda: target.forward(block[:1], last_only=True).argmax(-1), device,
                                         reps=args.reps, warmup=args.warmup, before=reset)
                save()
                tgt["verify16"] = measure(lambda: target.forward(block).argmax(-1), device, reps=args.reps, warmup=args.warmup, before=reset)
                save()
                tgt["forward_last_only"] = {}
                for n in NEW_CONTEXT:
                    tgt["forward_last_only"][str(n)] = measure(lambda: target.forward(block[:n], last_only=True).argmax(-1), device,
                                                               reps=args.reps, warmup=1, before=reset)
                tgt["checkpoint"] = measure(target.checkpoint, device, reps=args.reps, warmup=1, before=reset)
                tgt["rollback"] = measure(reset, device, reps=args.reps, warmup=1, before=lambda: target.forward(block, last_only=True))
                reset()
                save()
                if tree_budgets:
                    log.info("context %d: timing draft trees of %s nodes", C, tree_budgets)
                    ctx["trees"] = time_trees(target, tree_budgets, B - 1, device, args.reps, args.warmup, reset, save)

                ctx["drafter"] = dft = {"cached": {}}
                log.info("context %d: timing the drafter", C)
                cached = CachedDrafter(exported, model)

                def prime(kept: int) -> None:
                    """The cached drafter holding the K/V of the first `kept` context tokens."""
                    if cached.cached > kept:
                        cached.cache.crop(kept - cached.cache.get_seq_length())
                        cached.cached = kept
                    elif cached.cached < kept:
                        cached.propose(tokens[: kept + 1], features[:kept])
                    assert cached.cached == kept == cached.cache.get_seq_length(), (cached.cached, kept, cached.cache.get_seq_length())

                for n in NEW_CONTEXT:
                    if n >= C:
                        continue
                    dft["cached"][str(n)] = measure(lambda: cached.propose(tokens, features), device,
                                                    reps=args.reps, warmup=args.warmup, before=lambda: prime(C - n))
                    save()
                dft["full_recompute"] = measure(lambda: full.propose(tokens, features), device, reps=args.reps, warmup=args.warmup)
                save()

                if device.type == "cuda" and args.profile_reps > 0:
                    log.info("context %d: kernel profiles", C)
                    ctx["kernels"] = kern = {}
                    try:
                        # No rollback inside a profile: the cache grows by a few tokens over the reps, then is rolled back.
                        kern["decode1"] = kernel_profile(lambda: target.forward(block[:1], last_only=True).argmax(-1), device, args.profile_reps)
                        reset()
                        kern["verify16"] = kernel_profile(lambda: target.forward(block).argmax(-1), device, args.profile_reps)
                        reset()
                        kern["cached"] = {}
                        for n in (1, 4, 16):
                            if n < C:
                                def step(n=n):
                                    prime(C - n)
                                    cached.propose(tokens, features)
                                prime(C - n)
                                kern["cached"][str(n)] = kernel_profile(step, device, args.profile_reps)
                        kern["full_recompute"] = kernel_profile(lambda: full.propose(tokens, features), device, args.profile_reps)
                        names = set(kern["decode1"]["names"]) | set(kern["verify16"]["names"])
                        kern["gdn_kernels_seen"] = sorted(n[:100] for n in names if any(h in n.lower() for h in GDN_KERNEL_HINTS))
                        for entry in [kern["decode1"], kern["verify16"], kern["full_recompute"], *kern["cached"].values()]:
                            entry.pop("names")
                    except Exception as exc:  # the timings above still stand
                        log.exception("kernel profile failed")
                        kern["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                    save()
                ctx["speedup"] = speedups(ctx, taus, B)
                if "trees" in ctx:
                    ctx["tree_speedup"] = tree_speedups(ctx, taus, tree_acceptance)
                del cached, features, checkpoint
        except Exception as exc:  # report what was measured; the next context may still run
            log.exception("context %d failed", C)
            ctx["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            if "target" in ctx and "decode1" in ctx["target"] and "verify16" in ctx["target"] and ctx.get("drafter", {}).get("cached"):
                ctx["speedup"] = speedups(ctx, taus, B)
        if device.type == "cuda":
            ctx["peak_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            torch.cuda.empty_cache()
        save()

    result["summary"] = {
        str(C): {str(row["tau"]): {k: row[k] for k in ("engine", "engine_full_recompute", "hf_loop", "engine_kernels") if k in row}
                 for row in ctx["speedup"]["table"] if not args.acceptance or row["tau"] in args.acceptance}
        for C, ctx in result["contexts"].items() if "speedup" in ctx
    }
    result["tree_summary"] = {
        str(C): {budget: {"verify_over_flat": tree["verify_over_flat"], **{str(row["tau"]): {k: row[k] for k in ("tree", "tree_flat") if k in row}
                                                                            for row in tree["table"]}}
                 for budget, tree in ctx["tree_speedup"].items()}
        for C, ctx in result["contexts"].items() if "tree_speedup" in ctx
    }
    result["total_s"] = round(time.perf_counter() - started, 1)
    save()
    print(json.dumps({k: v for k, v in result.items() if k != "contexts"}, indent=2))
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
