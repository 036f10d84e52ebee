"""What a draft tree (DDTree) buys over the chain, from the drafter's own distributions: exact, and decoded.

Under greedy verification a tree commits exactly the longest root path whose tokens are the
target's greedy tokens, plus the target's next token. Along greedy's own output that is known
without a tree forward: walk the tree along greedy's tokens after the anchor. So the evaluation
computes, from greedy's output and the target's captured layers over it (one forward, the
simulation's), with the drafter's pass at each anchor:
- at every verify step of the chain's decoding (its anchors, while its output is greedy's): how
  many drafts the chain and a tree of each budget would commit from there, and whether the tree
  holds the whole chain (where it does, it commits at least as much);
- a decoding of the tree's own per budget, each step's committed path deciding the next anchor;
- top-k coverage per slot: how often greedy's token is among the drafter's k likeliest at a slot,
  given greedy's token before it (a branch's parent on the right path), k = 1, 2, 4, 8: what a tree
  of some width can gain before any tree is built.
Trees are cut as a verify step's block is (no deeper than the output has room for), and a step
counts only what it commits (up to a stop token). The trees of every budget at an anchor are the
first nodes of the largest one's (drafter/tree.py: equal scores ranked by token id, never in topk's
order). The real tree decoding (drafter/tree_verify.py) must accept exactly the exact decoding's
figures step for step on every prompt whose output is greedy's (`agrees_with_exact`): the same
drafter, target and tokens. What may still part them: the drafter's context is the target's
layers from the verify forwards there and from one forward over the output here, equal up to
rounding, so two of the drafter's scores closer than that rounding (bf16 on a GPU) can rank either
way; in fp32 only scores that all but tie can. A prompt whose real output left
greedy's (at a tie of the target's) is another text, left out of the comparison and named
(`prompts_off_greedy`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from dflash_jobs.drafter.speculative import Decoded
from dflash_jobs.drafter.replayed_drafter import PaddedContext
from dflash_jobs.drafter.tree import Branches, GrownTree, Tree, build_tree, grow_tree
from dflash_jobs.drafter.tree_verify import GrowsTrees
from dflash_jobs.evaluate.lossless import Divergence
from dflash_jobs.evaluate.metrics import mean_committed, summarize

COVERAGE_K = (1, 2, 4, 8)


class VariantBranches(GrowsTrees):
    """A trained drafter module as a tree's drafter (tree_verify.BranchDrafter): one pass over the
    block, its slots' distributions by the drafter's variant (DrafterVariant.branches)."""

    def __init__(self, drafter, branches: Callable[[Any, torch.Tensor, int], Branches], *, drafts: int) -> None:
        self.drafter, self.offer = drafter, branches
        self.block_size = drafter.config.block_size
        self.drafts = drafts
        self.target_layers = list(drafter.config.target_layer_ids)

    reads_host = True
    """The anchor's token is taken from the committed tokens as a host list (tree_decode gives them so): no read."""

    @torch.inference_mode()
    def branches(self, tokens: torch.Tensor | Sequence[int], context: torch.Tensor | None) -> Branches:
        anchor_position = len(tokens) - 1
        positions = torch.arange(anchor_position, device=context.device)
        hidden = self.drafter.block_hidden(context[None], positions, int(tokens[-1]), anchor_position)
        return self.offer(self.drafter, hidden, int(tokens[-1]))


class ReplayedBranches(VariantBranches):
    """VariantBranches whose tree step (the block over the context padded to its window, the variant's
    branches, grow_tree) is one replayed graph per window, budget and depth limit on a GPU, eager
    elsewhere (drafter/replayed_drafter.py): the same tree, its scores up to roundings (the padded
    keys change the order of attention's sums). So its `branches`, which the exact trees read, are
    taken over the padded context too (eagerly: the same kernels), and the exact trees score as the
    decoded ones."""

    def __init__(self, drafter, branches: Callable[[Any, torch.Tensor, int], Branches], *, drafts: int) -> None:
        super().__init__(drafter, branches, drafts=drafts)
        self.padded = PaddedContext()

    def _padded_branches(self, window: int, anchor: int | torch.Tensor) -> Branches:
        """The variant's branches of the block over the loaded context's window."""
        args, kwargs = self.padded.arguments(window)
        return self.offer(self.drafter, self.drafter.block_hidden(*args, **kwargs), anchor)

    @torch.inference_mode()
    def branches(self, tokens: torch.Tensor | Sequence[int], context: torch.Tensor | None) -> Branches:
        return self._padded_branches(self.padded.load(context, int(tokens[-1])), int(tokens[-1]))

    @torch.inference_mode()
    def grown(self, tokens: Sequence[int], context: torch.Tensor | None, *, budget: int, depth_limit: int) -> GrownTree:
        window = self.padded.load(context, int(tokens[-1]))  # a host list (reads_host): filled in, no read
        return self.padded.steps((window, budget, depth_limit), lambda: grow_tree(
            self._padded_branches(window, self.padded.anchor_token), budget=budget, depth_limit=depth_limit))


def committed(matched: int, anchor: int, output_length: int) -> int:
    """The drafts a verify step anchored at output token `anchor` counts when `matched` of them are
    greedy's: the matched ones and greedy's next token, cut where the output ends (its last token
    is the stop token or the last max_new_tokens allows), minus the one the target adds."""
    return min(matched + 1, output_length - anchor - 1) - 1


def exact_accepted(tree: Tree, greedy: Sequence[int], anchor: int) -> int:
    """The drafts a verify step anchored at greedy[anchor] with this tree commits, from greedy's output alone."""
    def greedy_after(row: int) -> int | None:
        position = anchor + (tree.depths[row - 1] if row else 0) + 1
        return greedy[position] if position < len(greedy) else None

    return committed(len(tree.follow(greedy_after)), anchor, len(greedy))


@dataclass
class AnchorTrees:
    """The drafter's pass at one anchor: its largest tree, its chain and the coverage ranks."""

    tree: Tree
    chain: list[int]
    ranks: list[int | None]
    """Per slot 1, 2, ... with a greedy token: the rank of greedy's token among the slot's
    max(COVERAGE_K) likeliest after greedy's token before it (None: not among them)."""


@dataclass
class PromptTrees:
    """One prompt's tree figures (see the module docstring)."""

    chain: list[int] = field(default_factory=list)
    """At each verify step of the chain's decoding: the chain's committed drafts, exact."""
    at_chain_steps: dict[int, list[int]] = field(default_factory=dict)
    """Per budget, the tree's committed drafts at those steps."""
    contains_chain: dict[int, list[bool]] = field(default_factory=dict)
    exact: dict[int, list[int]] = field(default_factory=dict)
    """Per budget, the committed drafts of each step of the tree's own decoding, exact."""
    ranks: list[list[int | None]] = field(default_factory=list)
    """Per chain step, the coverage ranks of its slots."""
    decoded: dict[int, Decoded] = field(default_factory=dict)
    """Per budget, the real tree decoding (tree_verify.tree_decode)."""
    divergences: dict[int, list[Divergence]] = field(default_factory=dict)
    """Per budget, where its output leaves greedy's (lossless.divergences)."""


def chain_anchors(decoded: Decoded, greedy: Sequence[int]) -> list[int]:
    """The output positions of the anchors of the chain's verify steps, while its output is greedy's."""
    anchors, anchor = [], 0
    for accepted in decoded.accepted:
        end = anchor + accepted + 1
        if list(decoded.tokens[:end]) != list(greedy[:end]):
            break
        anchors.append(anchor)
        anchor = end
    return anchors


def exact_trees(
    branches_at: Callable[[int], Branches], greedy: Sequence[int], chain: Decoded, *, budgets: Sequence[int], drafts: int, max_new_tokens: int,
) -> PromptTrees:
    """The exact figures of one prompt: branches_at(i) is the drafter's pass anchored at greedy's
    i-th token (with the target's layers over greedy's output before it)."""
    budgets = sorted(set(budgets))
    seen: dict[int, AnchorTrees] = {}

    def at(anchor: int) -> AnchorTrees:
        if anchor not in seen:
            branches = branches_at(anchor)
            depth_limit = min(drafts, max_new_tokens - anchor - 2)  # as a block: the output's room, the next token included
            ranks = []
            for slot in range(1, min(drafts, len(greedy) - 1 - anchor) + 1):
                offered = branches.children(slot, greedy[anchor + slot - 1], max(COVERAGE_K))[0]
                token = greedy[anchor + slot]
                ranks.append(offered.index(token) if token in offered else None)
            seen[anchor] = AnchorTrees(build_tree(branches, budget=max(budgets), depth_limit=depth_limit), branches.chain(depth_limit), ranks)
        return seen[anchor]

    # Every budget has its list of chain steps, empty where the chain's first step already left greedy's output (a tie).
    figures = PromptTrees(at_chain_steps={budget: [] for budget in budgets}, contains_chain={budget: [] for budget in budgets})
    for anchor in chain_anchors(chain, greedy):
        here = at(anchor)
        figures.chain.append(exact_accepted(Tree.path(here.chain), greedy, anchor))
        figures.ranks.append(here.ranks)
        for budget in budgets:
            tree = here.tree.prefix(budget)
            figures.at_chain_steps[budget].append(exact_accepted(tree, greedy, anchor))
            figures.contains_chain[budget].append(tree.contains(here.chain))
    for budget in budgets:
        steps, anchor = figures.exact.setdefault(budget, []), 0
        while anchor < len(greedy) - 1:
            steps.append(exact_accepted(at(anchor).tree.prefix(budget), greedy, anchor))
            anchor += steps[-1] + 1
    return figures


def summarize_coverage(ranks: Sequence[Sequence[Sequence[int | None]]], drafts: int) -> dict[str, Any]:
    """Per slot, over the chain's verify steps of every prompt that have greedy's token there: the
    share of them whose token is among the drafter's k likeliest, k in COVERAGE_K."""
    per_slot = []
    for slot in range(drafts):
        seen = [step[slot] for prompt in ranks for step in prompt if slot < len(step)]
        per_slot.append({
            "slot": slot + 1,
            "steps": len(seen),
            "top_k": {str(k): (sum(r is not None and r < k for r in seen) / len(seen) if seen else None) for k in COVERAGE_K},
        })
    return {"k": list(COVERAGE_K), "per_slot": per_slot}


def summarize_trees(
    prompts: Sequence[PromptTrees], chain: Sequence[Decoded], greedy: Sequence[Decoded], block_size: int, *, chain_budget: int, tie_tolerance: float,
) -> dict[str, Any]:
    """A drafter's trees beside its chain: at the chain's verify steps, and decoded (real and exact) per budget."""
    budgets = sorted(prompts[0].decoded)
    steps = [accepted for p in prompts for accepted in p.chain]
    decoded = {}
    for budget in budgets:
        real = [p.decoded[budget] for p in prompts]
        # The exact figures walk greedy's output: an output that left it (at a tie, if lossless) is another text.
        off_greedy = [i for i, p in enumerate(prompts) if p.divergences[budget]]
        unlike = [i for i, p in enumerate(prompts) if i not in off_greedy and p.decoded[budget].accepted != p.exact[budget]]
        decoded[str(budget)] = {
            **summarize(real, greedy, block_size, divergences=[p.divergences[budget] for p in prompts], tie_tolerance=tie_tolerance),
            "exact_acceptance_length": mean_committed([a for p in prompts for a in p.exact[budget]]),
            "agrees_with_exact": not unlike,
            "prompts_unlike_exact": unlike,
            "prompts_off_greedy": off_greedy,
        }
    return {
        "budgets": budgets,
        "chain_budget": chain_budget,
        "chain_acceptance_length": mean_committed([a for d in chain for a in d.accepted]),
        "at_chain_steps": {
            "steps": len(steps),
            "chain_acceptance_length": mean_committed(steps),
            "acceptance_length": {str(b): mean_committed([a for p in prompts for a in p.at_chain_steps[b]]) for b in budgets},
            "contains_chain": {str(b): (sum(c for p in prompts for c in p.contains_chain[b]) / len(steps) if steps else None) for b in budgets},
        },
        "decoded": decoded,
        "lossless": all(figures["lossless"] for figures in decoded.values()),
    }
