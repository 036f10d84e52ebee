"""The verify loops' static-cache target (drafter/static_target.py) against the dynamic-cache one
(DecodeTarget) on the tiny Llama, on a CPU in float32, where every forward runs eagerly (the CUDA
graphs replay these forwards on a GPU: bench/evaluation/eval_loops.py times them there): the same
logits through padded blocks, longer windows, rewinds and a cache reused across prompts; the same
tokens from greedy, from speculative decoding (whose drafter sees the same captured layers) and from
tree decoding; one host read a step; the evaluation's figures alike on either cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_jobs.architectures import target_architecture
from dflash_jobs.drafter.host_reads import HostReads
from dflash_jobs.drafter.speculative import DecodeTarget, ModelDrafter, greedy_decode, speculative_decode
from dflash_jobs.drafter.replayed_drafter import ReplayedDrafter
from dflash_jobs.drafter.static_target import CACHE_BUCKET, StaticTarget
from dflash_jobs.drafter.tree import Tree, grow_tree
from dflash_jobs.drafter.tree_verify import tree_decode, tree_target, verify_tree
from dflash_jobs.errors import SpecError
from dflash_jobs.evaluate.baselines import BigramTable
from dflash_jobs.evaluate.evaluator import PromptDecoder, uses_static_cache
from dflash_jobs.evaluate.trees import ReplayedBranches, VariantBranches
from dflash_jobs.spec import EvalSpec, TrainSpec, anchor_layout, parse_spec
from dflash_jobs.variants import drafter_variant
from train_fixtures import fresh_drafter

BLOCK = 6
LAYERS = [0, 2]
NO_STOP = frozenset()
NEW_TOKENS = 40

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: the tiny matrices gain nothing from more threads


@pytest.fixture(scope="module")
def llama(target_of):

    return AutoModelForCausalLM.from_pretrained(target_of("llama"), dtype=torch.float32, attn_implementation="sdpa").eval()


def prompt_of(length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


def static_target(llama, layers=LAYERS) -> StaticTarget:
    return StaticTarget(llama, layers, block=BLOCK, room=NEW_TOKENS + BLOCK)


class OracleDrafter:
    """Knows the greedy continuation: drafts its first `right` tokens a block correctly, the rest wrong,
    and keeps the context it was given at each call."""

    def __init__(self, continuation: torch.Tensor, right: int, vocab: int) -> None:
        self.continuation, self.right, self.vocab = continuation, right, vocab
        self.block_size, self.drafts, self.target_layers = BLOCK, BLOCK - 1, list(LAYERS)
        self.contexts: list[torch.Tensor] = []

    def propose(self, tokens, context):
        self.contexts.append(context.clone())
        draft = self.continuation[len(tokens) : len(tokens) + self.drafts].clone()
        draft[self.right :] = (draft[self.right :] + 1) % self.vocab
        return draft


@torch.inference_mode()
def test_forwards_give_the_dynamic_caches_logits_and_layers_through_blocks_and_rewinds(llama):
    vocab = llama.config.vocab_size
    static, dynamic = static_target(llama), DecodeTarget(llama, LAYERS)
    prompt, tokens = prompt_of(21, vocab, seed=0), prompt_of(3 * BLOCK, vocab, seed=1)
    for target in (static, dynamic):
        target.reset()
    torch.testing.assert_close(static.forward(prompt, last_only=True), dynamic.forward(prompt, last_only=True))
    checkpoint = static.checkpoint()
    # A block of BLOCK, one shorter (padded to BLOCK), a token, a token's last logits: each as the dynamic cache gives it.
    for ids, last_only in ((tokens[:BLOCK], False), (tokens[BLOCK : 2 * BLOCK - 2], False), (tokens[2 * BLOCK - 2 : 2 * BLOCK - 1], False),
                           (tokens[2 * BLOCK - 1 : 2 * BLOCK], True)):
        torch.testing.assert_close(static.forward(ids, last_only=last_only), dynamic.forward(ids, last_only=last_only))
        torch.testing.assert_close(static.features(), dynamic.features())
    assert static.length == dynamic.length == len(prompt) + 2 * BLOCK
    # Keep 4 tokens of the forwards since the checkpoint: the next forward sees those and none of the rest.
    assert static.rewind(checkpoint, 4) == 4 and static.length == len(prompt) + 4
    fresh = DecodeTarget(llama, LAYERS)
    fresh.reset()
    fresh.forward(torch.cat([prompt, tokens[:4]]), last_only=True)
    torch.testing.assert_close(static.forward(tokens[-BLOCK:]), fresh.forward(tokens[-BLOCK:]))
    torch.testing.assert_close(static.features(), fresh.features())


@torch.inference_mode()
def test_greedy_gives_the_dynamic_caches_tokens_as_the_cache_grows_and_is_reused(llama):
    vocab = llama.config.vocab_size
    static, dynamic = static_target(llama, []), DecodeTarget(llama)
    capacities = []
    for length, seed in ((12, 2), (CACHE_BUCKET, 3), (30, 4)):  # a longer prompt makes a longer cache; a shorter one reuses it
        prompt = prompt_of(length, vocab, seed)
        expected = greedy_decode(dynamic, prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
        decoded = greedy_decode(static, prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
        assert decoded.tokens == expected.tokens and decoded.runners_up == expected.runners_up
        assert decoded.margins == pytest.approx(expected.margins, abs=1e-4)
        capacities.append(static.capacity)
    assert capacities == [CACHE_BUCKET, 2 * CACHE_BUCKET, 2 * CACHE_BUCKET]


@pytest.mark.parametrize("right", [0, 2, BLOCK - 1])
def test_speculative_decoding_commits_greedys_tokens_from_the_same_steps_and_contexts(llama, right):
    """Rejected drafts rewind the static cache to the accepted ones instead of re-running them: the
    steps, their counts and what the drafter reads are the dynamic cache's all the same."""
    vocab = llama.config.vocab_size
    prompt = prompt_of(19, vocab, seed=5)
    reference = greedy_decode(DecodeTarget(llama), prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP).tokens
    continuation = torch.cat([prompt, torch.tensor(reference)])
    decoded = {}
    for name, target in (("dynamic", DecodeTarget(llama, LAYERS)), ("static", static_target(llama))):
        drafter = OracleDrafter(continuation, right, vocab)
        decoded[name] = (speculative_decode(target, drafter, prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP), drafter.contexts)
    (dynamic, dynamic_contexts), (static, static_contexts) = decoded["dynamic"], decoded["static"]
    assert static.tokens == dynamic.tokens == reference
    assert static.accepted == dynamic.accepted == [min(right, drafted) for drafted in dynamic.drafted]
    assert static.drafted == dynamic.drafted
    assert len(static_contexts) == len(dynamic_contexts)
    for seen, expected in zip(static_contexts, dynamic_contexts):
        torch.testing.assert_close(seen, expected)


def test_a_hybrid_target_an_overrun_and_a_tree_too_deep_are_refused_naming_the_fix(llama, target_of):

    hybrid = AutoModelForCausalLM.from_pretrained(target_of("qwen3_5"), dtype=torch.float32).eval()
    with pytest.raises(ValueError, match="DecodeTarget"):
        StaticTarget(hybrid, [], block=BLOCK, room=NEW_TOKENS)
    target = StaticTarget(llama, [], block=BLOCK, room=4)
    prompt = prompt_of(CACHE_BUCKET - 4 - BLOCK, llama.config.vocab_size, seed=6)
    with torch.inference_mode():
        target.reset()
        target.forward(prompt, last_only=True)
        with pytest.raises(ValueError, match="room"):
            for _ in range(BLOCK):
                target.forward(prompt[:BLOCK])
    # A tree deeper than the verify block the target was built for: its ancestors would be cut short.
    trees = StaticTarget(llama, [], block=BLOCK, room=NEW_TOKENS, architecture=target_architecture(llama.config))
    chain = Tree.path(list(range(1, BLOCK + 2)))
    with torch.inference_mode(), pytest.raises(ValueError, match="deep"):
        trees.reset()
        trees.forward(prompt[:9], last_only=True)
        verify_tree(trees, 0, chain)


def test_the_evaluation_takes_the_static_cache_where_asked_on_a_gpu_for_a_dense_target_only(llama, target_of):

    hybrid = AutoModelForCausalLM.from_pretrained(target_of("qwen3_5"), dtype=torch.float32).eval()
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    graphs = EvalSpec()  # on by default
    assert uses_static_cache(graphs, llama, gpu)
    assert not uses_static_cache(EvalSpec(cuda_graphs=False), llama, gpu)
    assert not uses_static_cache(graphs, llama, cpu)  # eager either way: the dynamic cache's figures stay
    assert not uses_static_cache(graphs, hybrid, gpu)
    with pytest.raises(SpecError, match="true or false"):
        EvalSpec(cuda_graphs="yes")


def test_an_evaluation_on_the_static_cache_gives_the_dynamic_caches_figures(llama, target_of):
    """Greedy, the trained drafter's chain, the baselines and the trees, each prompt's figures and the
    timed decodings, on static caches (one shared by greedy and the baselines) as on dynamic ones."""
    spec = parse_spec({"name": "t", "backend": "local", "target": {"model": "/m"}, "data": {"source": "/d.jsonl"}, "output": "/o",
                       "train": {"drafter": "dflash", "draft_layers": 1, "block_size": BLOCK}})
    drafter, variant = fresh_drafter(target_of("llama"), spec.train).eval().requires_grad_(False), drafter_variant("dflash")
    layout, settings = anchor_layout("dflash", block_size=BLOCK), EvalSpec(max_new_tokens=NEW_TOKENS, tree_budgets=[3, 2 * BLOCK])
    prompts = [prompt_of(length, llama.config.vocab_size, seed=10 + length) for length in (9, 30)]
    # A table of greedy's own bigrams on the first prompt: its drafts are accepted in part, rewinding often.
    answer = greedy_decode(DecodeTarget(llama), prompts[0], max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP).tokens
    table = BigramTable(dict(zip(answer, answer[1:])), {})
    figures = {}
    for static in (False, True):
        decoder = PromptDecoder(llama, drafter, variant, layout, settings, table, static_cache=static)
        try:
            assert all(isinstance(t, StaticTarget) == static for t in (decoder.plain, *decoder.verifiers.values(), decoder.tree_target))
            results = [decoder.decode(prompt) for prompt in prompts]
            timed = decoder.timed(prompts[0])
        finally:
            decoder.close()
        figures[static] = ([(r.greedy.tokens, {name: (d.tokens, d.accepted, d.drafted) for name, d in r.drafted.items()}, r.divergences,
                             {budget: (d.tokens, d.accepted, d.drafted) for budget, d in r.trees.decoded.items()}, r.trees.divergences)
                            for r in results], {name: d.tokens for name, d in timed.items()})
    assert figures[True] == figures[False]
    greedy, drafted, found, trees, tree_found = figures[True][0][0]
    assert greedy == answer and set(drafted) == {"dflash", "prompt_lookup", "bigram"} and set(trees) == {3, BLOCK - 1, 2 * BLOCK}
    assert all(tokens == greedy for tokens, _, _ in [*drafted.values(), *trees.values()])
    assert not any(found.values()) and not any(tree_found.values())


def test_greedy_and_every_verify_step_read_the_device_once_on_the_static_cache(llama, target_of):
    """As on the dynamic cache (tests/test_eval_loops.py): one read a greedy token, and beside the
    prefill's two reads one a verify step, a chain's or a tree's; the static cache's own bookkeeping (its length, the forward's start,
    the padded block) stays on the host or on the device."""

    drafter = fresh_drafter(target_of("llama"), TrainSpec(drafter="dflash", block_size=BLOCK)).eval()
    prompt = prompt_of(23, llama.config.vocab_size, seed=7)
    target = StaticTarget(llama, drafter.config.target_layer_ids, block=BLOCK, room=NEW_TOKENS + BLOCK)
    with HostReads() as reads:
        greedy = greedy_decode(target, prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
    assert reads.counts["item"] == NEW_TOKENS and reads.total == NEW_TOKENS + 2, dict(reads.counts)  # a token each, the record's two at the end
    for served in (ModelDrafter(drafter, drafts=BLOCK - 1), ReplayedDrafter(drafter, drafts=BLOCK - 1)):
        with HostReads() as reads:
            decoded = speculative_decode(target, served, prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
        assert decoded.tokens == greedy.tokens
        assert reads.total == len(decoded.accepted) + 2, (type(served).__name__, dict(reads.counts))
    trees = StaticTarget(llama, drafter.config.target_layer_ids, block=BLOCK, room=NEW_TOKENS + 2 * BLOCK + 1,
                         architecture=target_architecture(llama.config))
    branches = ReplayedBranches(drafter, drafter_variant("dflash").branches, drafts=BLOCK - 1)
    with HostReads() as reads:
        decoded = tree_decode(trees, branches, prompt, budget=2 * BLOCK, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
    assert decoded.tokens == greedy.tokens
    assert reads.total == len(decoded.accepted) + 2, dict(reads.counts)


@pytest.mark.parametrize("variant", ["dflash", "dspark"])
def test_tree_decoding_on_the_static_cache_commits_the_dynamic_caches_paths(llama, target_of, variant):
    """A tree's verify forward reads the static cache's window (the columns past its length masked)
    and the commit appends the accepted rows at its length, the tree grown over the padded context:
    every step's tree, acceptance and tokens as on the dynamic cache, eagerly grown, at budgets below,
    at and above the verify block."""

    drafter = fresh_drafter(target_of("llama"), TrainSpec(drafter=variant, block_size=BLOCK)).eval().requires_grad_(False)
    drafts = anchor_layout(variant, block_size=BLOCK).drafts
    branches = VariantBranches(drafter, drafter_variant(variant).branches, drafts=drafts)
    replayed = ReplayedBranches(drafter, drafter_variant(variant).branches, drafts=drafts)
    layers = drafter.config.target_layer_ids
    budgets = (3, BLOCK, 2 * BLOCK)
    static = StaticTarget(llama, layers, block=BLOCK, room=NEW_TOKENS + 2 * BLOCK + 1, architecture=target_architecture(llama.config))
    prompt = prompt_of(26, llama.config.vocab_size, seed=8)
    greedy = greedy_decode(DecodeTarget(llama), prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP).tokens
    for budget in budgets:
        expected = tree_decode(tree_target(llama, layers), branches, prompt, budget=budget, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
        decoded = tree_decode(static, replayed, prompt, budget=budget, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
        assert decoded.tokens == expected.tokens == greedy, budget
        assert (decoded.accepted, decoded.drafted) == (expected.accepted, expected.drafted), budget


@pytest.mark.parametrize("variant", ["dflash", "dflash2", "dspark"])
def test_the_replayed_drafter_drafts_what_the_drafter_does_from_a_padded_context(llama, target_of, variant):
    """Each variant's block over the context padded to its window (the padding masked), across
    windows and a longer buffer made on the way: the drafts of the context as it is."""
    drafter = fresh_drafter(target_of("llama"), TrainSpec(drafter=variant, block_size=BLOCK)).eval().requires_grad_(False)
    drafts = anchor_layout(variant, block_size=BLOCK).drafts
    plain, replayed = ModelDrafter(drafter, drafts=drafts), ReplayedDrafter(drafter, drafts=drafts)
    generator = torch.Generator().manual_seed(9)
    features = torch.randn(400, drafter.config.context_features, generator=generator)
    tokens = torch.randint(0, llama.config.vocab_size, (401,), generator=generator)
    capacities = []
    with torch.inference_mode():
        for rows in (5, 64, 65, 130, 400, 17):
            expected = plain.propose(tokens[: rows + 1], features[:rows])
            assert torch.equal(replayed.propose(tokens[: rows + 1], features[:rows]), expected), rows
            capacities.append(replayed.padded.capacity)
    assert capacities == [128, 128, 128, 384, 896, 896]


@pytest.mark.parametrize("variant", ["dflash", "dflash2", "dspark"])
def test_the_replayed_branches_grow_the_drafters_tree_from_a_padded_context(target_of, variant):
    """Each variant's tree step over the context padded to its window: the tree grow_tree grows from
    the variant's branches over the context as it is (its scores up to roundings: the padded keys'
    zero weights change the order of the attention's sums), across windows, budgets and depth limits."""
    drafter = fresh_drafter(target_of("llama"), TrainSpec(drafter=variant, block_size=BLOCK)).eval().requires_grad_(False)
    drafts = anchor_layout(variant, block_size=BLOCK).drafts
    plain, replayed = (kind(drafter, drafter_variant(variant).branches, drafts=drafts) for kind in (VariantBranches, ReplayedBranches))
    generator = torch.Generator().manual_seed(10)
    features = torch.randn(200, drafter.config.context_features, generator=generator)
    tokens = torch.randint(0, drafter.config.vocab_size, (201,), generator=generator).tolist()
    for rows, budget, depth_limit in ((7, 8, drafts), (70, 2 * BLOCK, drafts), (200, 8, 2), (7, 8, drafts)):
        arguments = (tokens[: rows + 1], features[:rows])
        expected = plain.grown(*arguments, budget=budget, depth_limit=depth_limit)
        tree = replayed.grown(*arguments, budget=budget, depth_limit=depth_limit)
        assert tree.depth_bound == expected.depth_bound and len(tree) == len(expected) > 0, (rows, budget)
        for name in ("tokens", "parents", "depths"):
            assert torch.equal(getattr(tree, name), getattr(expected, name)), (rows, budget, name)
        torch.testing.assert_close(tree.scores, expected.scores)  # the padded attention's sums may round apart
        # Its branches, which the exact trees read, are the replayed step's own: the same tree, bit for bit.
        eager = grow_tree(replayed.branches(*arguments), budget=budget, depth_limit=depth_limit)
        assert all(torch.equal(getattr(eager, name), getattr(tree, name)) for name in ("tokens", "parents", "depths", "scores"))


@pytest.mark.parametrize("variant", ["dflash", "dflash2", "dspark"])
def test_the_replayed_steps_read_nothing_back_from_the_device(target_of, variant):
    """A CUDA graph's capture refuses a read back to the host (it would wait on a stream that is only
    being recorded): every variant's replayed block and tree step, run eagerly here, reads nothing
    once its inputs are loaded. (Each GPU run of an evaluation captures them; this holds the variants
    no GPU run has decoded yet to the same rule.)"""
    drafter = fresh_drafter(target_of("llama"), TrainSpec(drafter=variant, block_size=BLOCK)).eval().requires_grad_(False)
    drafts = anchor_layout(variant, block_size=BLOCK).drafts
    chain = ReplayedDrafter(drafter, drafts=drafts)
    trees = ReplayedBranches(drafter, drafter_variant(variant).branches, drafts=drafts)
    generator = torch.Generator().manual_seed(11)
    features = torch.randn(70, drafter.config.context_features, generator=generator)
    tokens = torch.randint(0, drafter.config.vocab_size, (71,), generator=generator)
    committed = tokens.tolist()  # the tree's anchor from tree_decode's host list: no read
    with torch.inference_mode(), HostReads() as reads:
        chain.propose(tokens, features)
        trees.grown(committed, features, budget=2 * BLOCK, depth_limit=drafts)
    assert reads.total == 0, dict(reads.counts)
