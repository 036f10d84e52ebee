"""DDTree in the evaluation: draft trees hold the likeliest paths of each variant's distributions
(DSpark's conditioned on the parent, DFlash2's ranked by its selector), their first children are
the block the variant drafts, their exact acceptance is what greedy's output says, and the report
puts tree tau per budget, top-k coverage per slot and a lossless verdict beside the chain's."""

from __future__ import annotations

import heapq
import itertools
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_jobs.drafter.host_reads import HostReads
from dflash_jobs.drafter.speculative import Decoded
from dflash_jobs.drafter.model import rank_top_k
from dflash_jobs.drafter.tree import ConditionalBranches, MarginalBranches, Tree, build_tree, grow_tree
from dflash_jobs.errors import SpecError
from dflash_jobs.evaluate.baselines import BigramTable
from dflash_jobs.evaluate.evaluator import PromptDecoder
from dflash_jobs.evaluate.lossless import Divergence
from dflash_jobs.evaluate.report import build_report, report_warnings
from dflash_jobs.evaluate.trees import COVERAGE_K, PromptTrees, committed, summarize_trees
from dflash_jobs.spec import MAX_TREE_BUDGET, EvalSpec, anchor_layout, parse_spec
from dflash_jobs.variants import drafter_variant
from train_fixtures import fresh_drafter
from tree_fixtures import each_parent

V, DEPTHS = 5, 3

pytestmark = pytest.mark.usefixtures("one_thread")


def marginal() -> MarginalBranches:
    return MarginalBranches(torch.randn(DEPTHS, V, generator=torch.Generator().manual_seed(0)) * 2, anchor=1)


def conditional() -> ConditionalBranches:
    """Every (depth, parent) its own random distribution."""
    scores = each_parent(lambda depth, parent: torch.randn(V, generator=torch.Generator().manual_seed(10 * depth + parent)) * 2)
    return ConditionalBranches(scores, 1, DEPTHS, torch.device("cpu"))


def path_scores(branches) -> dict[tuple[int, ...], float]:
    """Every root path up to DEPTHS by brute force, with the sum of its log-probabilities."""
    scores = {}
    for depth in range(1, DEPTHS + 1):
        for path in itertools.product(range(V), repeat=depth):
            parent, score = branches.anchor, 0.0
            for d, token in enumerate(path, 1):
                tokens, log_probs = branches.children(d, parent, V)
                score += log_probs[tokens.index(token)]
                parent = token
            scores[path] = score
    return scores


def node_path(tree, node) -> tuple[int, ...]:
    path = []
    while node >= 0:
        path.append(tree.tokens[node])
        node = tree.parents[node]
    return tuple(path[::-1])


@pytest.mark.parametrize("make", [marginal, conditional])
def test_the_tree_holds_the_likeliest_root_paths_best_first(make):
    branches = make()
    scores = path_scores(branches)
    best = sorted(scores, key=scores.get, reverse=True)
    largest = build_tree(branches, budget=40, depth_limit=DEPTHS)
    for budget in (1, 2, 7, 40):
        tree = build_tree(branches, budget=budget, depth_limit=DEPTHS)
        assert {node_path(tree, n) for n in range(len(tree))} == set(best[:budget])
        assert tree == largest.prefix(budget)  # a smaller budget's tree is the first nodes of a larger one's
    assert all(parent < node for node, parent in enumerate(largest.parents))
    assert largest.scores == sorted(largest.scores, reverse=True)
    assert all(math.isclose(largest.scores[n], scores[node_path(largest, n)], abs_tol=1e-5) for n in range(len(largest)))
    # Budget 1 is the chain's first token; the chain is the first child at every depth.
    chain = branches.chain(DEPTHS)
    assert build_tree(branches, budget=1, depth_limit=DEPTHS).tokens == chain[:1]
    assert chain == [branches.children(d, ([branches.anchor] + chain)[d - 1], 1)[0][0] for d in range(1, DEPTHS + 1)]


def test_no_node_is_deeper_than_the_limit_or_the_drafted_slots():
    assert max(build_tree(marginal(), budget=60, depth_limit=2).depths) == 2
    assert max(build_tree(marginal(), budget=60, depth_limit=9).depths) == DEPTHS
    assert len(build_tree(marginal(), budget=60, depth_limit=0)) == 0


def test_a_step_counts_the_matched_drafts_and_never_past_the_output_end():
    assert committed(3, anchor=2, output_length=20) == 3
    # The output's last token (a stop token, or the last max_new_tokens allows) is output index 9:
    # an anchor at 4 matching 5 drafts reached it, and it takes the next token's place.
    assert committed(5, anchor=4, output_length=10) == 4
    assert committed(0, anchor=8, output_length=10) == 0


# ---- the variants' distributions ---------------------------------------------------------------


def tiny_drafter(target_dir, name: str, block_size: int, *, boost: bool = True):
    """A fresh drafter of the variant for the tiny target; `boost`: its own modules made to matter
    (DFlash2's successor codebook starts at zero, DSpark's Markov bias near it)."""
    spec = parse_spec({"name": "t", "backend": "local", "target": {"model": "/m"}, "data": {"source": "/d.jsonl"}, "output": "/o",
                       "train": {"drafter": name, "draft_layers": 2, "block_size": block_size}})
    drafter = fresh_drafter(target_dir, spec.train)
    with torch.no_grad():
        if boost and name == "dflash2":
            drafter.candidate_selector.successor_codebook.normal_(std=1.0)
            drafter.candidate_selector.hidden_projection.weight.normal_(std=1.0)
        if boost and name == "dspark":
            drafter.markov_head.markov_w2.weight.normal_(std=3.0)
    return drafter.eval().requires_grad_(False), drafter_variant(name)


def block(drafter, anchor: int = 17):
    context = torch.randn(1, 11, drafter.config.context_features, generator=torch.Generator().manual_seed(4))
    arguments = (context, torch.arange(11), anchor, 11)
    return drafter.block_hidden(*arguments), drafter.draft_block(*arguments).tolist()


@pytest.mark.parametrize("name", ["dflash", "dflash2", "dspark"])
def test_each_variants_first_children_are_the_block_it_drafts(target_dir, name):
    drafter, variant = tiny_drafter(target_dir, name, block_size=6)
    hidden, drafts = block(drafter)
    branches = variant.branches(drafter, hidden, 17)
    assert branches.depths == len(drafts) == anchor_layout(name, block_size=6).drafts
    assert branches.chain(len(drafts)) == drafts
    assert build_tree(branches, budget=1, depth_limit=len(drafts)).tokens == drafts[:1]


def test_dspark_branches_follow_their_parent(target_dir):
    """A branch's children are the slot's logits plus the Markov bias of the branch's own token."""
    drafter, variant = tiny_drafter(target_dir, "dspark", block_size=5)
    with torch.no_grad():  # a peaked bias: the likeliest paths go deep, and each parent's children are its own
        drafter.markov_head.markov_w1.weight.normal_(std=1.0)
    hidden, _ = block(drafter)
    branches = variant.branches(drafter, hidden, 17)
    logits = drafter.logits(hidden)

    def expected(depth: int, parent: int, k: int):
        biased = logits[depth - 1] + drafter.markov_head(drafter.markov_head.markov_w1(torch.tensor([parent])))[0]
        values, tokens = biased.log_softmax(-1).topk(k)
        return tokens.tolist(), values.tolist()

    first, second = branches.children(1, 17, 2)[0]
    assert branches.children(2, first, 8)[0] != branches.children(2, second, 8)[0]
    tree = build_tree(branches, budget=30, depth_limit=5)
    assert len({tree.depths[n] for n in range(len(tree)) if tree.parents[n] >= 0}) > 1  # branches below the first depth
    for node in range(len(tree)):
        parent = tree.parents[node]
        parent_token = 17 if parent < 0 else tree.tokens[parent]
        tokens, log_probs = expected(tree.depths[node], parent_token, 30)
        gained = tree.scores[node] - (tree.scores[parent] if parent >= 0 else 0.0)
        assert math.isclose(gained, log_probs[tokens.index(tree.tokens[node])], abs_tol=1e-4)


def test_dflash2_branches_rank_the_selectors_candidates_after_the_parent(target_dir):
    drafter, variant = tiny_drafter(target_dir, "dflash2", block_size=6)
    hidden, _ = block(drafter)
    branches = variant.branches(drafter, hidden, 17)
    selector = drafter.candidate_selector
    unary, candidates = selector.candidates(drafter.logits(hidden[1:]))
    projected = selector.hidden_projection(hidden[1:])
    for depth, parent in ((1, 17), (2, 5), (2, 300), (4, 9)):
        tokens, log_probs = branches.children(depth, parent, 100)
        scores = selector.scores(projected[depth - 1], unary[depth - 1], candidates[depth - 1], torch.tensor(parent))
        assert len(tokens) == selector.top_k and set(tokens) == set(candidates[depth - 1].tolist())
        assert tokens == sorted(candidates[depth - 1].tolist(), key=lambda c: (-scores[candidates[depth - 1].tolist().index(c)], c))
        assert math.isclose(sum(math.exp(p) for p in log_probs), 1.0, rel_tol=1e-5)
    assert branches.children(2, 5, 4)[0] != branches.children(2, 300, 4)[0]  # the selector's edge from the parent decides



def scored_alone(drafter, name: str, hidden: torch.Tensor):
    """(depth, parent [1]) -> the scores of the parent's children at depth as the variant drafts: DSpark's
    logits plus the Markov head's bias of that parent, DFlash2's selector edges from it (its walk's call)."""
    if name == "dspark":
        head = drafter.markov_head
        return lambda depth, parent: drafter.logits(hidden)[depth - 1] + head(head.markov_w1(parent))[0]
    selector = drafter.candidate_selector
    unary, candidates = selector.candidates(drafter.logits(hidden[1:]))
    projected = selector.hidden_projection(hidden[1:])
    return lambda depth, parent: selector.scores(projected[depth - 1], unary[depth - 1], candidates[depth - 1], parent)


@pytest.mark.parametrize("name", ["dflash2", "dspark"])
def test_every_parent_of_a_depth_is_scored_in_one_call_bit_for_bit_as_alone(target_dir, name):
    """A tree grows a depth at a time, the depth's parents scored in one call, and nothing read: each
    parent's scores are bit for bit what the variant computes for that parent alone (DSpark's
    Markov bias through its head, DFlash2's edges as its walk scores them), so the tree is the one a
    search expanding a parent at a time builds; reading it is one read."""
    drafter, variant = tiny_drafter(target_dir, name, block_size=6)
    hidden, _ = block(drafter)
    branches = variant.branches(drafter, hidden, 17)
    alone = scored_alone(drafter, name, hidden)
    parents = torch.randint(0, drafter.config.vocab_size, (33,), generator=torch.Generator().manual_seed(5))
    for depth in range(1, branches.depths + 1):
        scores, _ = branches.scores(depth, parents)
        assert torch.equal(scores, torch.stack([alone(depth, parent[None]) for parent in parents])), depth
    with HostReads() as reads:
        grown = grow_tree(branches, budget=32, depth_limit=branches.depths)
    assert reads.total == 0 and len(grown) == 32
    with HostReads() as reads:
        tree = grown.read()[0]
    assert reads.total == 1 and tree == build_tree(branches, budget=32, depth_limit=branches.depths)


# ---- equal scores -------------------------------------------------------------------------------


def tied_scores(*shape: int, seed: int) -> torch.Tensor:
    """bf16 scores of a few values, every token sharing its score with others: three tie for the best
    (far above the rest, so the likeliest paths go deep), the rest among -3..3."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, shape, generator=generator).float()
    best = torch.rand(shape, generator=generator).argsort(-1)[..., :3]  # three tokens at random
    return scores.scatter(-1, best, 8.0).to(torch.bfloat16)


def first_path(tree) -> list[int]:
    """The tokens down the first child of the root, then of each node: the tree's first path."""
    path, parent = [], -1
    while (children := [n for n in range(len(tree)) if tree.parents[n] == parent]):
        parent = children[0]
        path.append(tree.tokens[parent])
    return path


def test_equal_scores_rank_by_the_lower_token_id_as_argmax_picks():
    scores = tied_scores(6, 300, seed=0)
    order = rank_top_k(scores, 300)
    for row, ranked in zip(scores.tolist(), order.tolist()):
        assert ranked == sorted(range(300), key=lambda token: (-row[token], token))
    assert torch.equal(order[:, 0], scores.argmax(-1))  # argmax takes the first maximal index: the lowest id
    assert torch.equal(rank_top_k(scores, 7), order[:, :7])
    ids = torch.randperm(300, generator=torch.Generator().manual_seed(1))  # candidates in no particular order
    for row, ranked in zip(scores.tolist(), rank_top_k(scores, 300, ids.expand(6, 300)).tolist()):
        assert [ids[i] for i in ranked] == sorted(ids.tolist(), key=lambda token: (-row[ids.tolist().index(token)], token))
    assert rank_top_k(torch.tensor([-0.0, 0.0, -1.0]), 3).tolist() == [0, 1, 2]  # -0.0 and 0.0 are one score


def tied_marginal(seed: int) -> tuple[MarginalBranches, list[int]]:
    logits = tied_scores(6, 300, seed=seed)
    return MarginalBranches(logits, anchor=1), logits.argmax(-1).tolist()


def tied_conditional(seed: int) -> tuple[ConditionalBranches, list[int]]:
    """Each (depth, parent) its own tied scores over the vocabulary; the chain takes argmax after its own token."""
    def scores(depth: int, parent: int) -> torch.Tensor:
        return tied_scores(300, seed=1000 * seed + 10 * depth + parent)

    chain, parent = [], 1
    for depth in range(1, 7):
        parent = int(scores(depth, parent).argmax())
        chain.append(parent)
    return ConditionalBranches(each_parent(scores), 1, 6, torch.device("cpu")), chain


@pytest.mark.parametrize("make", [tied_marginal, tied_conditional])
def test_with_equal_scores_the_first_path_is_the_chain_and_a_smaller_tree_the_first_nodes_of_a_larger(make):
    for seed in range(12):
        branches, chain = make(seed)
        largest = build_tree(branches, budget=48, depth_limit=6)
        path = first_path(largest)
        assert len(path) >= 3 and path == chain[: len(path)] and chain == branches.chain(6)
        for budget in (1, 2, 4, 8, 16, 32):
            assert build_tree(make(seed)[0], budget=budget, depth_limit=6) == largest.prefix(budget)


def best_first(branches, budget: int, depth_limit: int) -> Tree:
    """DDTree's search on the host, a parent at a time: a heap of (-score, ranks down the path), each
    candidate a node's next sibling or its first child, popped `budget` times."""
    tree = Tree([], [], [], [])
    offered = {-1: branches.children(1, branches.anchor, budget)}  # each parent's children, likeliest first
    heap: list[tuple[float, tuple[int, ...], int, int]] = []

    def offer(parent: int, depth: int, ranks: tuple[int, ...]) -> None:
        score = (tree.scores[parent] if parent >= 0 else 0.0) + offered[parent][1][ranks[-1]]
        heapq.heappush(heap, (-score, ranks, parent, depth))

    offer(-1, 1, (0,))
    while heap and len(tree) < budget:
        negative, ranks, parent, depth = heapq.heappop(heap)
        children, node = offered[parent][0], len(tree)
        for part, value in zip((tree.tokens, tree.parents, tree.depths, tree.scores), (children[ranks[-1]], parent, depth, -negative)):
            part.append(value)
        if ranks[-1] + 1 < len(children):
            offer(parent, depth, ranks[:-1] + (ranks[-1] + 1,))
        if depth < depth_limit:
            offered[node] = branches.children(depth + 1, children[ranks[-1]], budget)
            offer(node, depth + 1, ranks + (0,))
    return tree


def peaked_marginal(seed: int) -> MarginalBranches:
    """Scores so far apart that the best child's log-probability is often exactly 0: a child as likely as its parent."""
    return MarginalBranches(torch.randn(6, 300, generator=torch.Generator().manual_seed(seed)) * 60, anchor=1)


def peaked_conditional(seed: int) -> ConditionalBranches:
    scores = each_parent(lambda depth, parent: torch.randn(300, generator=torch.Generator().manual_seed(1000 * seed + 10 * depth + parent)) * 60)
    return ConditionalBranches(scores, 1, 6, torch.device("cpu"))


@pytest.mark.parametrize("make", [lambda seed: tied_marginal(seed)[0], lambda seed: tied_conditional(seed)[0], peaked_marginal, peaked_conditional],
                         ids=["tied-marginal", "tied-conditional", "peaked-marginal", "peaked-conditional"])
def test_the_tree_grown_a_depth_at_a_time_is_the_one_a_best_first_search_pops(make):
    """Node for node, in the order popped, equal path scores and children as likely as their parent included."""
    for seed in range(6):
        for budget, depth_limit in ((3, 6), (17, 6), (48, 6), (48, 2)):
            assert build_tree(make(seed), budget=budget, depth_limit=depth_limit) == best_first(make(seed), budget, depth_limit), (seed, budget)


def paired_tokens(drafter, name: str) -> None:
    """Every odd token scores as the even one before it, in every slot and after every parent: the
    LM head's rows (and DSpark's Markov bias, DFlash2's successor codebook) equal in pairs."""
    with torch.no_grad():
        drafter.lm_head[1::2] = drafter.lm_head[0::2]
        if name == "dspark":
            drafter.markov_head.markov_w2.weight[1::2] = drafter.markov_head.markov_w2.weight[0::2]
        if name == "dflash2":
            codebook = drafter.candidate_selector.successor_codebook
            codebook[1::2] = codebook[0::2]


@pytest.mark.parametrize("name", ["dflash", "dflash2", "dspark"])
def test_with_tied_tokens_each_variants_tree_starts_with_the_block_it_drafts(target_dir, name):
    drafter, variant = tiny_drafter(target_dir, name, block_size=6)
    paired_tokens(drafter, name)
    hidden, drafts = block(drafter)
    assert all(token % 2 == 0 for token in drafts)  # every draft tied with the next token, and argmax took the lower
    assert variant.branches(drafter, hidden, 17).chain(len(drafts)) == drafts  # the first child at every depth, after the chain's own
    largest = build_tree(variant.branches(drafter, hidden, 17), budget=40, depth_limit=len(drafts))
    assert first_path(largest) == drafts[: len(first_path(largest))]
    for budget in (1, 3, 8, 20):
        assert build_tree(variant.branches(drafter, hidden, 17), budget=budget, depth_limit=len(drafts)) == largest.prefix(budget)


# ---- the spec and the report -------------------------------------------------------------------


@pytest.mark.parametrize("budgets, allowed", [
    ([0, 16], f"from 1 to {MAX_TREE_BUDGET}"),
    ([MAX_TREE_BUDGET + 1], f"from 1 to {MAX_TREE_BUDGET}"),
    ([16, 16], "distinct"),
])
def test_tree_budgets_are_refused_naming_the_field(budgets, allowed):
    with pytest.raises(SpecError, match=allowed) as caught:
        EvalSpec(tree_budgets=budgets)
    assert caught.value.field == "eval.tree_budgets"
    assert EvalSpec().tree_budgets == [16, 32, 64] and EvalSpec(tree_budgets=[]).tree_budgets == []


@pytest.mark.parametrize("baselines", [["ngram"], ["bigram", "bigram"], "bigram"])
def test_baselines_are_refused_naming_the_field_and_the_known_ones(baselines):
    with pytest.raises(SpecError, match="prompt_lookup") as caught:
        EvalSpec(baselines=baselines)
    assert caught.value.field == "eval.baselines"
    assert EvalSpec().baselines == ["prompt_lookup", "bigram"] and EvalSpec(baselines=[]).baselines == []


def decode_with_trees(target_dir, drafter, variant, *, budgets: list[int], prompts: int):
    """The drafter (blocks of 5) decoded on `prompts` prompts every way the evaluation decodes, trees
    of `budgets` among them, and the report of it."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    layout = anchor_layout(variant.name, block_size=5)
    no_bigrams = BigramTable({}, {})  # the bigram baseline is not under test here: it drafts nothing
    decoder = PromptDecoder(model, drafter, variant, layout, EvalSpec(max_new_tokens=36, tree_budgets=budgets), no_bigrams)
    try:
        results = [decoder.decode(torch.randint(0, 900, (12,), generator=torch.Generator().manual_seed(i))) for i in range(prompts)]
    finally:
        decoder.close()
    report = build_report(
        greedy=[r.greedy for r in results], drafters={n: [r.drafted[n] for r in results] for n in results[0].drafted},
        divergences={n: [r.divergences[n] for r in results] for n in results[0].drafted}, verify_noise=[r.verify_noise for r in results],
        trees={variant.name: [r.trees for r in results]}, block_size=layout.drafts + 1, dtype=torch.float32,
    )
    return results, report


def test_an_evaluation_decodes_the_baselines_it_names_and_no_other(target_dir):
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter, variant = tiny_drafter(target_dir, "dflash", block_size=5)
    layout, prompt = anchor_layout("dflash", block_size=5), torch.randint(0, 900, (12,), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="bigram"):
        PromptDecoder(model, drafter, variant, layout, EvalSpec(max_new_tokens=8, tree_budgets=[], baselines=["bigram"]), None)
    for baselines in ([], ["prompt_lookup"]):
        decoder = PromptDecoder(model, drafter, variant, layout, EvalSpec(max_new_tokens=8, tree_budgets=[], baselines=baselines), None)
        try:
            result = decoder.decode(prompt)
        finally:
            decoder.close()
        assert list(result.drafted) == ["dflash", *baselines] and list(result.divergences) == list(result.drafted)
        assert all(d.tokens == result.greedy.tokens for d in result.drafted.values())


@pytest.fixture(scope="module")
def evaluated(target_dir):
    """One DSpark drafter decoded on three prompts every way the evaluation decodes, trees of budget 1 and 12 among them."""
    # As initialised, a DSpark drafter repeats its anchor's neighbourhood, which this target's greedy text does at times.
    drafter, variant = tiny_drafter(target_dir, "dspark", block_size=5, boost=False)
    return decode_with_trees(target_dir, drafter, variant, budgets=[1, 12], prompts=3)


def test_with_tied_tokens_the_real_tree_decoding_commits_what_the_exact_figures_say(target_dir):
    """The exact figures take each budget's tree as the first nodes of the largest one's, the real
    decoding builds each budget's own: with equal scores ranked in topk's order they held other
    tokens (issue 42: 16 of 44 (chain, budget) pairs of quality-cpu.json disagreed)."""
    drafter, variant = tiny_drafter(target_dir, "dspark", block_size=5, boost=False)
    paired_tokens(drafter, "dspark")
    results, report = decode_with_trees(target_dir, drafter, variant, budgets=[2, 3, 6, 12], prompts=4)
    for budget, decoded in report["drafters"]["dspark"]["tree"]["decoded"].items():
        assert decoded["agrees_with_exact"] and decoded["lossless"], budget
        assert decoded["acceptance_length"] == pytest.approx(decoded["exact_acceptance_length"])
    assert all(r.trees.decoded[b].accepted == r.trees.exact[b] for r in results for b in r.trees.exact)
    assert sum(a for r in results for a in r.trees.exact[2]) > 0  # the trees commit drafts: the figures say something
    assert report_warnings(report) == []


def test_the_report_puts_tree_tau_per_budget_beside_the_chains(evaluated):
    results, report = evaluated
    summary = report["drafters"]["dspark"]
    tree = summary["tree"]
    assert tree["budgets"] == [1, 5, 12] and tree["chain_budget"] == 5  # the chain's own budget added
    assert tree["chain_acceptance_length"] == summary["acceptance_length"]
    steps = tree["at_chain_steps"]
    assert steps["steps"] == len([a for r in results for a in r.drafted["dspark"].accepted])
    assert steps["chain_acceptance_length"] == pytest.approx(summary["acceptance_length"])  # replayed exactly: the chain's own figure
    for budget, decoded in tree["decoded"].items():
        assert decoded["lossless"] and decoded["real_mismatches"] == 0 and decoded["agrees_with_exact"]
        assert decoded["acceptance_length"] == pytest.approx(decoded["exact_acceptance_length"])
    assert report["lossless"]
    assert tree["decoded"]["12"]["acceptance_length"] > summary["acceptance_length"] > 1  # the tree buys acceptance here
    # Budget 1 is the chain's first token alone; where a tree holds the chain it commits at least as much.
    for r in results:
        assert r.trees.at_chain_steps[1] == [min(c, 1) for c in r.trees.chain]
        for budget in (1, 5, 12):
            for tree_step, chain_step, holds in zip(r.trees.at_chain_steps[budget], r.trees.chain, r.trees.contains_chain[budget]):
                assert tree_step >= chain_step or not holds


def test_every_decoding_reports_per_prompt_records_that_sum_to_its_figures_and_its_tau_interval(evaluated):
    results, report = evaluated
    summary = report["drafters"]["dspark"]
    decodings = {name: (report["drafters"][name], [r.drafted[name] for r in results]) for name in ("dspark", "prompt_lookup", "bigram")}
    decodings |= {f"trees of {budget}": (figures, [r.trees.decoded[int(budget)] for r in results])
                  for budget, figures in summary["tree"]["decoded"].items()}
    for name, (figures, decoded) in decodings.items():
        prompts = figures["per_prompt"]
        assert set(prompts) == {"committed", "verify_steps", "tokens", "seconds"} and all(len(v) == 3 for v in prompts.values()), name
        assert sum(prompts["committed"]) / sum(prompts["verify_steps"]) == pytest.approx(figures["acceptance_length"]), name
        assert sum(prompts["verify_steps"]) == figures["verify_steps"] and sum(prompts["tokens"]) == figures["tokens"], name
        # In prompt order: the prefill makes the first token, the verify steps commit every later one.
        assert prompts["tokens"] == [len(d.tokens) for d in decoded] and prompts["committed"] == [n - 1 for n in prompts["tokens"]], name
        assert prompts["seconds"] == pytest.approx([d.seconds for d in decoded], abs=1e-4), name
        low, high = figures["acceptance_length_interval"]
        assert low <= figures["acceptance_length"] <= high, name
    assert report["greedy"]["per_prompt"] == {"tokens": [len(r.greedy.tokens) for r in results],
                                              "seconds": [round(r.greedy.seconds, 4) for r in results]}
    assert report["intervals"] == {"method": "paired percentile bootstrap over the held-out prompts", "interval": "percentile",
                                   "confidence": 0.95, "resamples": 10_000, "seed": 0, "prompts": 3,
                                   "minimum_prompts_for_a_verdict": 16}


def test_coverage_per_slot_grows_with_k_and_counts_the_chains_steps(evaluated):
    results, report = evaluated
    coverage = report["drafters"]["dspark"]["coverage"]
    assert coverage["k"] == list(COVERAGE_K) and len(coverage["per_slot"]) == 5
    first = coverage["per_slot"][0]
    assert first["steps"] == sum(len(r.trees.chain) for r in results)  # every chain step has greedy's token at slot 1
    top1 = sum(step[0] == 0 for r in results for step in r.trees.ranks) / first["steps"]
    assert first["top_k"]["1"] == top1 > 0
    for slot in coverage["per_slot"]:
        rates = [slot["top_k"][str(k)] for k in COVERAGE_K]
        assert rates == sorted(rates) and rates[-1] <= 1


def test_a_tree_decoding_that_leaves_greedy_makes_the_run_not_lossless():
    greedy = Decoded(tokens=[4, 5, 6, 7], seconds=1.0, accepted=[0, 0, 0], drafted=[3, 3, 3])
    wrong = Decoded(tokens=[4, 5, 9, 7], seconds=0.5, accepted=[1, 1], drafted=[8, 8])
    trees = PromptTrees(chain=[0, 0, 0], at_chain_steps={3: [0, 0, 0], 8: [1, 0, 1]}, contains_chain={3: [True] * 3, 8: [True] * 3},
                        exact={3: [0, 0, 0], 8: [1, 1]}, ranks=[[0], [1], [None]],
                        decoded={3: greedy, 8: wrong}, divergences={3: [], 8: [Divergence(2, 9, 6, 8, 3.0, 10.0)]})
    summary = summarize_trees([trees], [greedy], [greedy], 4, chain_budget=3, tie_tolerance=0.1)
    assert not summary["lossless"] and summary["decoded"]["8"]["real_mismatches"] == 1 and summary["decoded"]["3"]["lossless"]
    report = build_report(greedy=[greedy], drafters={"dflash": [greedy]}, divergences={"dflash": [[]]}, verify_noise=[[0.1]],
                          trees={"dflash": [trees]}, block_size=4, dtype=torch.float32)
    assert report["drafters"]["dflash"]["lossless"] and not report["lossless"]
    # Its output is another text than greedy's, along which the exact figures were computed: not compared with them.
    assert summary["decoded"]["8"]["prompts_off_greedy"] == [0] and summary["decoded"]["8"]["agrees_with_exact"]


def tree_acceptance(monkeypatch, summary: dict):
    """The quality benchmark's tree figures of one drafter's summary in an evaluation report, read as
    the benchmark reads it (records.Decoding)."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench" / "quality"))
    import figures
    import records

    return figures.tree_acceptance(records.Decoding.from_json(summary))


def test_a_tree_decoding_that_commits_other_drafts_than_its_exact_figures_is_warned_about(monkeypatch):
    greedy = Decoded(tokens=[4, 5, 6, 7], seconds=1.0, accepted=[0, 0, 0], drafted=[3, 3, 3])
    by_trees = Decoded(tokens=[4, 5, 6, 7], seconds=0.5, accepted=[1, 0], drafted=[3, 3])  # greedy's output, in other steps
    trees = PromptTrees(chain=[0, 0, 0], at_chain_steps={3: [0, 0, 0]}, contains_chain={3: [True] * 3}, exact={3: [0, 1]},
                        ranks=[[0], [1], [None]], decoded={3: by_trees}, divergences={3: []})
    report = build_report(greedy=[greedy], drafters={"dflash": [greedy]}, divergences={"dflash": [[]]}, verify_noise=[[0.1]],
                          trees={"dflash": [trees]}, block_size=4, dtype=torch.float32)
    decoded = report["drafters"]["dflash"]["tree"]["decoded"]["3"]
    assert not decoded["agrees_with_exact"] and decoded["prompts_unlike_exact"] == [0] and decoded["prompts_off_greedy"] == []
    assert report["lossless"]  # the output is greedy's: lossless, but the tree figures disagree
    [warning] = report_warnings(report)
    assert warning.startswith("dflash: decoding by trees of 3 nodes committed other drafts than its exact figures on prompts [0]")
    assert tree_acceptance(monkeypatch, report["drafters"]["dflash"])["agrees_with_exact"] is False


def test_the_quality_benchmark_puts_tree_tau_per_budget_beside_the_chains(evaluated, monkeypatch):
    _, report = evaluated
    summary = report["drafters"]["dspark"]
    trees = tree_acceptance(monkeypatch, summary)
    assert trees["chain"] == round(summary["acceptance_length"], 3) and trees["lossless"] and trees["agrees_with_exact"]
    assert trees["per_budget"] == {b: round(d["acceptance_length"], 3) for b, d in summary["tree"]["decoded"].items()}
    assert list(trees["per_budget"]) == ["1", "5", "12"]
    assert tree_acceptance(monkeypatch, report["drafters"]["prompt_lookup"]) is None


def test_a_dflash2_drafter_as_the_evaluation_loads_it_grows_its_trees(target_dir):
    """load_drafter leaves the parameters requiring grad, and DFlash2's branches score the selector's
    candidates lazily, as the tree grows: every chain of the quality benchmark's DFlash2 failed in
    evaluate ("Inference tensors cannot be saved for backward") until the tree figures were walked
    under inference mode, as their branches were made."""
    drafter, variant = tiny_drafter(target_dir, "dflash2", block_size=5)
    drafter.requires_grad_(True)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    decoder = PromptDecoder(model, drafter, variant, anchor_layout("dflash2", block_size=5), EvalSpec(max_new_tokens=12, tree_budgets=[6]),
                            BigramTable({}, {}))
    try:
        result = decoder.decode(torch.randint(0, 900, (12,), generator=torch.Generator().manual_seed(0)))
    finally:
        decoder.close()
    assert sorted(result.trees.decoded) == [4, 6] and result.trees.divergences[6] is not None
