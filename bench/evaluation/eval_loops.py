"""The evaluation's verify loop before and after issue 49, and on static caches with CUDA graphs, side
by side: speculative decoding's tokens/s against plain greedy's at batch 1, with the host syncs and
kernel launches that explain it.

    python bench/evaluation/eval_loops.py --shape tiny --before /tmp/before_speculative.py --out /tmp/eval-loops-tiny.json
    python bench/evaluation/eval_loops.py --shape smollm2 --before before_speculative.py --out $OUT/eval-loops-h100.json
    python bench/evaluation/eval_loops.py --shape smollm2 --loops after,graphed --out $OUT/eval-loops-graphed-h100.json

`--before` is drafter/speculative.py as it was before (it imports torch and transformers only, so it
loads beside today's): `git show dd571ce:jobs/dflash_jobs/drafter/speculative.py > before_speculative.py`.
Each loop decodes with its own module's DecodeTarget, greedy_decode, speculative_decode and ModelDrafter.

What is built (random weights: timing does not depend on their values): the target, a Llama of
SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate 1536, vocab 49152,
tied embeddings), bf16 on a GPU; or `--shape tiny`, a small Llama in fp32 on the CPU. The drafter,
dflash_jobs.drafter.model.Drafter of the target's width (5 layers, blocks of 16, 5 target layers),
runs its real forward every step; its drafts are then replaced, on the device, by greedy's next
tokens for the first `--right` slots and wrong ones after (PacedDrafter): acceptance is set (tau =
1 + right, 2 by default) while the drafter's cost stays real.

Loops (`--loops`, LOOPS): `before` (--before's module), `after` (today's, on the dynamic cache),
`graphed` (today's on static caches: drafter/static_target.py, each greedy token's and verify block's
forward a replayed CUDA graph on a GPU, as the evaluation decodes a dense target there), each on
targets made once (a static cache's graphs are captured in the warm-up). Stages (`--stages`, both by
default), each written to the JSON as it ends: `runs`: the loops in order, then in the reverse
(both orders, each after an untimed warm-up of two prompts), each timing greedy and speculative
decoding over the same prompts, with how many of greedy's outputs equal the dynamic cache's
(`greedy_equal_reference`: the static cache's roundings part them only at near-ties), and the
graphs' gain in tokens/s (`summary.graphed_over_after`); then `counts`, per loop: host reads
(drafter/host_reads.py, every device) and, on a GPU, CUDA's own count of syncs
(torch.cuda.set_sync_debug_mode) and the kernels launched (the profiler), per greedy token and per
verify step. `--stages counts` runs the counts alone. The counts also take draft trees
(drafter/tree_verify.py tree_decode, `trees`): per variant (DFlash, DFlash2, DSpark: a fresh drafter
of each, random weights, the same width and blocks) and tree budget, the same counts per tree step,
the prefill's included (its two reads). They are the jobs/ tree's on the import path: run the script
with PYTHONPATH=<an older checkout>/jobs for that tree's trees (tree_decode's arguments unchanged).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

from dflash_jobs.drafter import speculative as after_module
from dflash_jobs.drafter.host_reads import HostReads
from dflash_jobs.drafter.model import Drafter, DrafterConfig

SHAPES = {
    "smollm2": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "intermediate_size": 1536, "vocab_size": 49152},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": 512},
}
TREE_VARIANTS = ("dflash", "dflash2", "dspark")
TREE_BUDGETS = (16, 64)
RUNS = {"smollm2": {"prompts": 8, "prompt_tokens": 128, "new_tokens": 128}, "tiny": {"prompts": 3, "prompt_tokens": 16, "new_tokens": 24}}
BLOCK = 16
LOOPS = ("before", "after", "graphed")
"""`before`: --before's module on its dynamic cache; `after`: today's, on the dynamic cache; `graphed`:
today's on static caches, CUDA graphs on a GPU (GraphedLoop). Run in this order, then in the reverse."""
STAGES = ("runs", "counts")
"""`runs`: the timed decodings in both orders; `counts`: the reads, syncs and launches (`--stages counts` alone needs no runs)."""


def drafter_config(dims: dict, head_dim: int, layers: list[int], depth: int) -> DrafterConfig:
    return DrafterConfig(hidden_size=dims["hidden_size"], num_attention_heads=dims["num_attention_heads"],
                         num_key_value_heads=dims["num_key_value_heads"], head_dim=head_dim, intermediate_size=dims["intermediate_size"],
                         vocab_size=dims["vocab_size"], target_layer_ids=layers, num_target_layers=depth, block_size=BLOCK,
                         mask_token_id=dims["vocab_size"] - 1)


def build(shape: str, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = SHAPES[shape]
    torch.manual_seed(0)
    config = LlamaConfig(**dims, head_dim=dims["hidden_size"] // dims["num_attention_heads"], tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=100000.0)
    model = LlamaForCausalLM(config).to(device, dtype).eval()
    depth = dims["num_hidden_layers"]
    layers = sorted({1 + round(i * (depth - 4) / 4) for i in range(5)})  # evenly spaced 1..n-3, the z-lab rule
    drafter = Drafter(drafter_config(dims, config.head_dim, layers, depth))
    drafter.load_target_tensors(model.get_input_embeddings().weight, model.get_output_embeddings().weight, model.model.norm.weight)
    return model, drafter.to(device, dtype).eval(), layers


class PacedDrafter:
    """A BlockDrafter that runs the real drafter, then drafts greedy's next tokens in its first `right`
    slots and a wrong token in the others (on the device: no read)."""

    def __init__(self, served, continuation: torch.Tensor, right: int, vocab_size: int) -> None:
        self.served, self.continuation, self.right, self.vocab_size = served, continuation, right, vocab_size
        self.block_size, self.drafts, self.target_layers = served.block_size, served.drafts, served.target_layers

    def propose(self, tokens, context):
        drafts = self.served.propose(tokens, context)
        truth = self.continuation[len(tokens) : len(tokens) + len(drafts)]
        right = torch.arange(len(truth), device=truth.device) < self.right
        return torch.where(right, truth, (truth + 1) % self.vocab_size)


def load_before(path: str):
    spec = importlib.util.spec_from_file_location("before_speculative", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    if not hasattr(module, "DecodeTarget"):  # the decode-time target's name before issue 51
        module.DecodeTarget = module.Target
    return module


class GraphedLoop:
    """Today's loop functions on static caches (drafter/static_target.py: each greedy token's and
    verify block's forward a replayed CUDA graph on a GPU), the drafter's block replayed too
    (drafter/replayed_drafter.py), as a loop module's names."""

    greedy_decode = staticmethod(after_module.greedy_decode)
    speculative_decode = staticmethod(after_module.speculative_decode)

    def __init__(self, new_tokens: int) -> None:
        self.room = new_tokens + BLOCK

    def DecodeTarget(self, model, layers=()):  # noqa: N802: the loop modules' name
        from dflash_jobs.drafter.static_target import StaticTarget

        return StaticTarget(model, layers, block=BLOCK, room=self.room)

    def ModelDrafter(self, drafter, *, drafts: int):  # noqa: N802: the loop modules' name
        from dflash_jobs.drafter.replayed_drafter import ReplayedDrafter

        return ReplayedDrafter(drafter, drafts=drafts)


def loop_targets(loop, model, layers, drafter) -> tuple:
    """The loop's targets for greedy and for speculative decoding, and its served drafter, made once:
    static caches' and the drafter's graphs are captured in the warm-up and replayed in the timed runs."""
    return loop.DecodeTarget(model), loop.DecodeTarget(model, layers), loop.ModelDrafter(drafter, drafts=BLOCK - 1)


def decode_all(loop, targets, prompts, continuations, *, new_tokens: int, right: int):
    """Greedy then speculative decoding of every prompt with `loop`'s functions on its targets: their decodings."""
    plain, target, served = targets
    vocab_size = target.model.config.vocab_size
    greedy = [loop.greedy_decode(plain, p, max_new_tokens=new_tokens, stop_ids=frozenset()) for p in prompts]
    spec = [loop.speculative_decode(target, PacedDrafter(served, c, right, vocab_size), p, max_new_tokens=new_tokens, stop_ids=frozenset())
            for p, c in zip(prompts, continuations)]
    return greedy, spec


def speeds(greedy, spec) -> dict:
    rate = lambda decoded: sum(len(d.tokens) for d in decoded) / sum(d.seconds for d in decoded)  # noqa: E731
    steps = sum(len(d.accepted) for d in spec)
    return {"greedy_tokens_per_second": rate(greedy), "speculative_tokens_per_second": rate(spec), "speedup": rate(spec) / rate(greedy),
            "acceptance_length": sum(len(d.tokens) - 1 for d in spec) / steps, "verify_steps": steps,
            "outputs_equal_greedy": sum(s.tokens == g.tokens for s, g in zip(spec, greedy))}


def counted(run, device: torch.device) -> dict:
    """Host reads and ops dispatched (any device); CUDA's syncs and kernels on a GPU."""
    with HostReads() as reads:
        run()
    found = {"host_reads": reads.total, "ops": reads.ops}
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                run()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        found["cuda_syncs"] = sum("synchroniz" in str(w.message) for w in caught)
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            run()
        found["kernels"] = sum(1 for e in profiler.events() if e.device_type.name == "CUDA")
    return found


def counts(loop, targets, prompt, continuation, *, new_tokens: int, right: int, device: torch.device) -> dict:
    greedy = counted(lambda: loop.greedy_decode(targets[0], prompt, max_new_tokens=new_tokens, stop_ids=frozenset()), device)
    decoded = []
    spec = counted(lambda: decoded.append(decode_all(loop, targets, [prompt], [continuation], new_tokens=new_tokens,
                                                     right=right)[1][0]), device)
    # decode_all's greedy decoding is in `spec` too: take the greedy run's counts off.
    spec = {key: value - greedy[key] for key, value in spec.items()}
    steps = len(decoded[-1].accepted)
    return {"greedy_per_token": {k: v / new_tokens for k, v in greedy.items()}, "speculative_per_step": {k: v / steps for k, v in spec.items()},
            "verify_steps": steps}


def tree_counts(model, drafter, prompt, *, new_tokens: int, device: torch.device) -> dict:
    """Per variant and budget: tree decoding's counts per tree step (the prefill's included), a fresh
    drafter of the variant (seed 0) of the chain drafter's config and the target's tensors."""
    from dflash_jobs.drafter.tree_verify import tree_decode, tree_target
    from dflash_jobs.evaluate.trees import VariantBranches
    from dflash_jobs.spec import TrainSpec, anchor_layout
    from dflash_jobs.variants import drafter_variant

    found = {}
    for name in TREE_VARIANTS:
        variant = drafter_variant(name)
        torch.manual_seed(0)
        module = variant.build_model(variant.build_config(drafter.config, TrainSpec(drafter=name, block_size=BLOCK)))
        module.load_target_tensors(model.get_input_embeddings().weight, model.get_output_embeddings().weight, model.model.norm.weight)
        branches = VariantBranches(module.to(device, drafter.lm_head.dtype).eval(), variant.branches,
                                   drafts=anchor_layout(name, block_size=BLOCK).drafts)
        for budget in TREE_BUDGETS:
            decoded = []
            counts_here = counted(lambda: decoded.append(tree_decode(tree_target(model, branches.target_layers), branches, prompt, budget=budget,
                                                                     max_new_tokens=new_tokens, stop_ids=frozenset())), device)
            steps = len(decoded[-1].accepted)
            found[f"{name}-tree-{budget}"] = {"per_tree_step": {k: v / steps for k, v in counts_here.items()}, "tree_steps": steps, **counts_here}
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=tuple(SHAPES), default="smollm2")
    parser.add_argument("--before", help="drafter/speculative.py as it was before (see the module docstring); without it, no `before` loop")
    parser.add_argument("--loops", default=",".join(LOOPS), help=f"which of {','.join(LOOPS)} run, comma-separated (default: all)")
    parser.add_argument("--right", type=int, default=1, help="greedy's tokens drafted a block: tau = 1 + right")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES), help="which stages run (default: both)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    run = RUNS[args.shape]
    asked = args.loops.split(",")
    if not set(asked) <= set(LOOPS) or len(set(asked)) != len(asked):
        parser.error(f"--loops {args.loops!r}: distinct names from {','.join(LOOPS)}")
    if "before" in asked and not args.before:
        parser.error("the `before` loop needs --before (drafter/speculative.py as it was), or leave it out of --loops")
    made = {"before": lambda: load_before(args.before), "after": lambda: after_module, "graphed": lambda: GraphedLoop(run["new_tokens"])}
    loops = {name: made[name]() for name in asked}
    model, drafter, layers = build(args.shape, device, dtype)
    targets = {name: loop_targets(loop, model, layers, drafter) for name, loop in loops.items()}
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, SHAPES[args.shape]["vocab_size"] - 1, (run["prompt_tokens"],), generator=generator) for _ in range(run["prompts"])]
    with torch.inference_mode():
        reference = [after_module.greedy_decode(after_module.DecodeTarget(model), p, max_new_tokens=run["new_tokens"], stop_ids=frozenset()) for p in prompts]
    continuations = [torch.cat([p, torch.tensor(r.tokens)]).to(device) for p, r in zip(prompts, reference)]
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    result = {"command": " ".join(sys.argv), "shape": args.shape, "device": machine,
              "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "batch": 1, "block_size": BLOCK, "right": args.right,
              **run, "runs": []}
    out = Path(args.out)
    decode = dict(new_tokens=run["new_tokens"], right=args.right)
    for name in [*loops, *reversed(loops)] if "runs" in args.stages else ():
        loop = loops[name]
        decode_all(loop, targets[name], prompts[:2], continuations[:2], **decode)  # warm-up: every shape seen twice
        started = time.perf_counter()
        greedy, spec = decode_all(loop, targets[name], prompts, continuations, **decode)
        result["runs"].append({"loop": name, **speeds(greedy, spec), "wall_seconds": time.perf_counter() - started,
                               "greedy_equal_reference": sum(g.tokens == r.tokens for g, r in zip(greedy, reference))})
        out.write_text(json.dumps(result, indent=2) + "\n")
    if "runs" in args.stages:
        result["summary"] = {name: {key: sum(r[key] for r in result["runs"] if r["loop"] == name) / 2
                                    for key in ("greedy_tokens_per_second", "speculative_tokens_per_second", "speedup", "acceptance_length")}
                             for name in loops}
        if {"after", "graphed"} <= set(loops):  # the CUDA graphs' gain, each loop on its own target
            after, graphed = result["summary"]["after"], result["summary"]["graphed"]
            result["summary"]["graphed_over_after"] = {kind: graphed[f"{kind}_tokens_per_second"] / after[f"{kind}_tokens_per_second"]
                                                       for kind in ("greedy", "speculative")}
    if "counts" in args.stages:
        result["counts"] = {name: counts(loop, targets[name], prompts[0], continuations[0], device=device, **decode)
                            for name, loop in loops.items()}
        result["counts"]["trees"] = tree_counts(model, drafter, prompts[0], new_tokens=run["new_tokens"], device=device)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({key: result[key] for key in ("summary", "counts") if key in result}, indent=2))
    for plain, target, _ in targets.values():
        plain.close()
        target.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
