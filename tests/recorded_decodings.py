"""Decodings of every verify loop on the tiny targets, as recorded JSON: what the loops decoded before
a change to them, so a test can tell that the change kept every token and every count.

`python tests/recorded_decodings.py OUT.json` records them with the code on the import path (run it
with PYTHONPATH=<an older checkout>/jobs to record that code's); tests/test_eval_loops.py decodes
the same again and compares with tests/data/recorded_decodings.json.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from dflash_jobs.drafter.speculative import Decoded, DecodeTarget, ModelDrafter, greedy_decode, speculative_decode
from dflash_jobs.drafter.tree_verify import tree_decode, tree_target
from dflash_jobs.evaluate.baselines import BigramDrafter, BigramTable, PromptLookupDrafter
from dflash_jobs.evaluate.trees import VariantBranches
from dflash_jobs.spec import TrainSpec, anchor_layout
from dflash_jobs.variants import drafter_variant
from train_fixtures import ARCHITECTURES, LAYERS, fresh_drafter, tiny_target

VARIANTS = ("dflash", "dflash2", "dspark")
BLOCK = 6
NEW_TOKENS = 40
BUDGETS = (4, 9)
NO_STOP = frozenset()


def prompts(vocab_size: int) -> list[torch.Tensor]:
    """Three prompts, the last one repeating itself (prompt lookup finds what to copy there)."""
    generator = torch.Generator().manual_seed(11)
    made = [torch.randint(0, vocab_size, (length,), generator=generator) for length in (9, 23)]
    return [*made, torch.cat([made[0], made[0], made[0][:4]])]


def bigram_of(outputs: list[list[int]]) -> BigramTable:
    """A bigram table of the first successor seen of every token in these outputs."""
    successors: dict[int, int] = {}
    for output in outputs:
        for previous, following in zip(output, output[1:]):
            successors.setdefault(previous, following)
    return BigramTable(successors, {})


def record(decoded: Decoded) -> dict[str, list[int]]:
    return {"tokens": decoded.tokens, "accepted": decoded.accepted, "drafted": decoded.drafted}


def decode_every_loop(target: Path) -> dict[str, Any]:
    """Per prompt on the tiny target in `target`: greedy, each variant's chain and trees, prompt lookup and the bigram table."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    stop = NO_STOP
    asked = prompts(model.config.vocab_size)
    greedy = [greedy_decode(DecodeTarget(model), p, max_new_tokens=NEW_TOKENS, stop_ids=stop) for p in asked]
    table = bigram_of([g.tokens for g in greedy])
    recorded: list[dict[str, Any]] = [{"greedy": record(g)} for g in greedy]
    for variant_name in VARIANTS:
        drafter = fresh_drafter(target, TrainSpec(drafter=variant_name, block_size=BLOCK)).eval()
        drafts = anchor_layout(variant_name, block_size=BLOCK).drafts
        chain = ModelDrafter(drafter, drafts=drafts)
        branches = VariantBranches(drafter, drafter_variant(variant_name).branches, drafts=drafts)
        for prompt, out in zip(asked, recorded):
            out[variant_name] = record(speculative_decode(DecodeTarget(model, LAYERS), chain, prompt, max_new_tokens=NEW_TOKENS, stop_ids=stop))
            for budget in BUDGETS:
                out[f"{variant_name}-tree-{budget}"] = record(
                    tree_decode(tree_target(model, LAYERS), branches, prompt, budget=budget, max_new_tokens=NEW_TOKENS, stop_ids=stop))
    for prompt, out in zip(asked, recorded):
        for name, baseline in (("prompt_lookup", PromptLookupDrafter(BLOCK)), ("bigram", BigramDrafter(table, BLOCK))):
            out[name] = record(speculative_decode(DecodeTarget(model), baseline, prompt, max_new_tokens=NEW_TOKENS, stop_ids=stop))
    return {"prompts": [p.tolist() for p in asked], "decodings": recorded}


if __name__ == "__main__":
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        recorded = {architecture: decode_every_loop(tiny_target(Path(scratch), architecture)) for architecture in ARCHITECTURES}
    text = json.dumps(recorded, indent=1)
    # A list of ids on one line: a decoding a few lines, not an id a line.
    Path(sys.argv[1]).write_text(re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n")
