"""Tree verification on the tiny hybrid target ([GDN, GDN, GDN, attention] x 2, the torch fallback of
transformers' qwen3_5): one forward gives every node what a forward of its own root path gives, the
accepted path's commit leaves the cache as a forward of that path would, and decoding by trees is
plain greedy decoding whose acceptance is the exact one, step for step.

The drafter here is a stand-in that knows greedy's continuation and ranks its next token where it
is told (`OracleTrees`), so trees accept a lot, branch, and take paths other than the chain's."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_jobs.drafter.speculative import Target, greedy_decode
from dflash_jobs.drafter.tree import ConditionalBranches, Tree, build_tree
from dflash_jobs.drafter.tree_verify import TreeLayout, cached_length, commit_path, tree_decode, verify_tree
from dflash_jobs.evaluate.trees import exact_trees
from train_fixtures import LAYERS, tiny_target

NEW_TOKENS = 30
NO_STOP = frozenset()
DECOYS = 6

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return AutoModelForCausalLM.from_pretrained(tiny_target(tmp_path_factory.getbasetemp() / "train-fixtures"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 900, (14,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def greedy(model, prompt) -> list[int]:
    return greedy_decode(Target(model), prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP).tokens


class OracleTrees:
    """A tree drafter (tree_verify.BranchDrafter) that knows the continuation: at depth d, under a
    parent that is the continuation's token before, the continuation's token comes at rank
    ranks[d - 1] among DECOYS decoy tokens; under any other parent, decoys only. Each rank is e^6
    likelier than the next: a rank-0 child is near certain."""

    target_layers: list[int] = []

    def __init__(self, continuation: list[int], ranks: list[int], vocab: int) -> None:
        self.continuation, self.ranks, self.vocab = continuation, ranks, vocab
        self.block_size, self.drafts = len(ranks) + 1, len(ranks)

    def branches(self, tokens: torch.Tensor, context) -> ConditionalBranches:
        start = len(tokens)  # the continuation's index of depth 1

        def scores(depth: int, parent: int) -> tuple[torch.Tensor, None]:
            index = start + depth - 1
            right = self.continuation[index] if index < len(self.continuation) else None
            logits = torch.full((self.vocab,), -40.0)
            decoys = [t for t in range(depth * 37 + parent * 11, depth * 37 + parent * 11 + DECOYS + 1) if t % self.vocab != right]
            for j, token in enumerate(decoys[:DECOYS]):
                logits[token % self.vocab] = -6.0 * j
            if right is not None and parent == self.continuation[index - 1]:
                logits[right] = 3.0 - 6.0 * self.ranks[depth - 1]  # between decoys r - 1 and r
            return logits, None

        return ConditionalBranches(scores, int(tokens[-1]), self.drafts)


def random_tree(seed: int, nodes: int, vocab: int) -> Tree:
    """A tree with a chain of 7 (deeper than the conv window) and random branches off it."""
    rng = random.Random(seed)
    parents = [-1, 0, 1, 2, 3, 4, 5]
    for node in range(len(parents), nodes):
        parents.append(rng.randint(-1, node - 1))
    depths = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return Tree([rng.randrange(vocab) for _ in parents], parents, depths, [0.0] * nodes)


def root_path(tree: Tree, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(tree.tokens[node])
        node = tree.parents[node]
    return path[::-1]


def test_the_layout_sees_ancestors_only_and_places_each_node_at_its_depth():
    tree = Tree([5, 6, 7, 8], [-1, 0, -1, 1], [1, 2, 1, 3], [0.0] * 4)
    layout = TreeLayout.of(9, tree, cached=3, device=torch.device("cpu"))
    assert layout.ids.tolist() == [9, 5, 6, 7, 8] and layout.positions.tolist() == [3, 4, 5, 4, 6]
    assert layout.visible[:, :3].all()
    assert layout.visible[:, 3:].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 1, 1, 0, 1]]
    assert [(rows.tolist(), None if up is None else up.tolist()) for rows, up in layout.levels] == [([0], None), ([1, 3], [0, 0]), ([2], [0]), ([4], [0])]
    # Oldest first, 4 wide: the cached window's last inputs (indices 0..3) above the root, then the rows (4 + row).
    assert layout.windows(4).tolist() == [[1, 2, 3, 4], [2, 3, 4, 5], [3, 4, 5, 6], [2, 3, 4, 7], [4, 5, 6, 8]]


@pytest.mark.parametrize("seed", [0, 1])
def test_one_forward_gives_every_node_what_a_forward_of_its_root_path_gives(model, prompt, seed):
    vocab = model.config.vocab_size
    tree, root = random_tree(seed, 24, vocab), 17
    target, reference = Target(model, LAYERS), Target(model, LAYERS)
    with torch.inference_mode():
        target.reset()
        target.forward(prompt, last_only=True)
        before = [t.clone() for layer in target.cache.layers for t in (*getattr(layer, "conv_states", {}).values(), *getattr(layer, "recurrent_states", {}).values())]
        verified = verify_tree(target, root, tree)
        for row in range(len(tree) + 1):
            reference.reset()
            logits = reference.forward(torch.cat([prompt, torch.tensor([root, *(root_path(tree, row - 1) if row else [])])]))
            torch.testing.assert_close(verified.logits[row], logits[-1], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(verified.features[row], reference.features()[-1], rtol=1e-5, atol=1e-5)
    after = [t for layer in target.cache.layers for t in (*getattr(layer, "conv_states", {}).values(), *getattr(layer, "recurrent_states", {}).values())]
    assert cached_length(target) == len(prompt) and all(torch.equal(a, b) for a, b in zip(before, after))  # the forward wrote nothing


@pytest.mark.parametrize("accepted", [0, 2, 6])
def test_committing_a_path_leaves_the_cache_as_a_forward_of_that_path_would(model, prompt, accepted):
    """The root and `accepted` nodes down the tree's chain (6: past the 4-wide conv window) are
    committed; the next forward then sees exactly what it would after the plain path."""
    tree, root, after = random_tree(2, 24, model.config.vocab_size), 17, torch.tensor([3, 99, 250])
    path = list(range(accepted))  # nodes 0..5 are the chain 0 -> 1 -> ... -> 5
    target, reference = Target(model), Target(model)
    with torch.inference_mode():
        target.reset()
        target.forward(prompt, last_only=True)
        commit_path(target, verify_tree(target, root, tree), [0] + [node + 1 for node in path])
        assert cached_length(target) == len(prompt) + 1 + accepted
        continued = target.forward(after)
        reference.reset()
        expected = reference.forward(torch.cat([prompt, torch.tensor([root, *(tree.tokens[n] for n in path)]), after]))[-len(after):]
    torch.testing.assert_close(continued, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ranks, budget", [
    ([0, 0, 0, 0, 0], 5),  # a budget equal to the chain's: the tree is the chain
    ([1, 0, 0, 2, 0], 16),  # the best path is not the chain's: greedy's token is second at depth 1
    ([0, 3, 1, 0, 0], 40),
    ([1, 0, 0, 0, 0], 1),  # budget 1: the chain's first token alone
])
def test_tree_decoding_is_greedy_and_accepts_the_exact_figures_step_for_step(model, prompt, greedy, ranks, budget):
    drafter = OracleTrees(prompt.tolist() + greedy, ranks, model.config.vocab_size)
    target = Target(model)
    decoded = tree_decode(target, drafter, prompt, budget=budget, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
    chain = tree_decode(target, drafter, prompt, budget=1, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
    assert decoded.tokens == greedy and sum(decoded.accepted) + len(decoded.accepted) == len(greedy) - 1
    assert max(decoded.drafted) == budget
    exact = exact_trees(lambda anchor: drafter.branches(torch.tensor(prompt.tolist() + greedy[: anchor + 1]), None), greedy, chain,
                        budgets=[1, budget], drafts=drafter.drafts, max_new_tokens=NEW_TOKENS)
    assert decoded.accepted == exact.exact[budget]
    assert chain.accepted == exact.exact[1]
    # At the steps of a chain-like decoding: where the tree holds the chain it commits at least as much.
    for tree_step, chain_step, holds in zip(exact.at_chain_steps[budget], exact.chain, exact.contains_chain[budget]):
        assert tree_step >= chain_step or not holds
    if ranks[0] == 0 and budget == len(ranks):
        assert all(exact.contains_chain[budget]) and exact.at_chain_steps[budget] == exact.chain
    if ranks[0] == 1 and budget > 1:  # the chain misses at depth 1, the tree does not
        assert sum(exact.at_chain_steps[budget]) > sum(exact.chain) == 0
    if budget == 1:
        assert decoded.accepted == [0] * len(decoded.accepted)


def test_a_stop_token_inside_the_tree_ends_the_output_there(model, prompt, greedy):
    stop = greedy[11]
    expected = greedy_decode(Target(model), prompt, max_new_tokens=NEW_TOKENS, stop_ids=frozenset([stop])).tokens
    assert expected[-1] == stop and len(expected) < len(greedy)
    drafter = OracleTrees(prompt.tolist() + greedy, [0] * 6, model.config.vocab_size)
    decoded = tree_decode(Target(model), drafter, prompt, budget=12, max_new_tokens=NEW_TOKENS, stop_ids=frozenset([stop]))
    assert decoded.tokens == expected
    # Committed per step: the accepted nodes and the next token, never past the stop token.
    assert sum(a + 1 for a in decoded.accepted) == len(expected) - 1
    exact = exact_trees(lambda anchor: drafter.branches(torch.tensor(prompt.tolist() + expected[: anchor + 1]), None), expected, decoded,
                        budgets=[12], drafts=6, max_new_tokens=NEW_TOKENS)
    assert decoded.accepted == exact.exact[12]


def test_trees_are_cut_where_the_output_has_no_room(model, prompt, greedy):
    """As a verify block: with k tokens left, no node deeper than k - 1 (the next token fills the last)."""
    drafter = OracleTrees(prompt.tolist() + greedy, [0] * 6, model.config.vocab_size)
    decoded = tree_decode(Target(model), drafter, prompt, budget=8, max_new_tokens=9, stop_ids=NO_STOP)
    assert decoded.tokens == greedy[:9] and decoded.accepted == [6, 0]  # 1 + 7 tokens, then one left: an empty tree
    assert decoded.drafted[-1] == 0
    tree = build_tree(drafter.branches(torch.tensor(prompt.tolist() + greedy[:2]), None), budget=50, depth_limit=3)
    assert max(tree.depths) == 3


def test_the_speedup_benchmark_prices_trees_at_the_tiny_shape(tmp_path):
    """bench/speedup.py on the CPU: per budget the tree's shape, its verify forward beside a flat one of
    as many tokens, and the speed-up at the tree's measured tau (the flat one too where the tree costs more)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "speedup.json"
    script = Path(__file__).resolve().parents[1] / "bench" / "speedup.py"
    subprocess.run([sys.executable, str(script), "--shape", "tiny", "--contexts", "24", "--reps", "1", "--warmup", "0", "--profile-reps", "0",
                    "--tree-budgets", "4,16", "--tree-acceptance", "16=2.5", "--out", str(out)],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    result = json.loads(out.read_text())
    context = result["contexts"]["24"]
    assert result["tree_budgets"] == [4, 16] and result["tree_acceptance"] == {"16": 2.5}
    for budget in ("4", "16"):
        entry = context["trees"][budget]
        assert entry["shape"]["nodes"] == int(budget) and sum(entry["shape"]["per_depth"]) == int(budget)
        assert all(entry[kind]["median_ms"] > 0 for kind in ("tree_verify", "tree_commit", "tree_build", "flat_forward"))
        assert entry["check"]["argmax_agree"] and entry["check"]["max_relative_logit_difference"] < 1e-5
    priced = context["tree_speedup"]["16"]
    assert [row["tau"] for row in priced["table"]] == [2.5] and priced["table"][0]["tree"] > 0
    assert ("tree_flat" in priced["table"][0]) == (priced["verify_and_commit_ms"] > priced["flat_forward_ms"])
    assert len(context["tree_speedup"]["4"]["table"]) > 1  # no measured tau: the grid
    assert result["tree_summary"]["24"]["16"]["2.5"]["tree"] == priced["table"][0]["tree"]
