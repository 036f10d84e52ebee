"""Tree verification on each tiny target: the hybrid one ([GDN, GDN, GDN, attention] x 2, the torch
fallback of transformers' qwen3_5) and the dense Llama (plain attention, tied embeddings): one
forward gives every node what a forward of its own root path gives, the accepted path's commit
leaves the cache as a forward of that path would, and decoding by trees is plain greedy decoding
whose acceptance is the exact one, step for step. On the hybrid target the forward and the commit
are checked twice: through transformers' torch reference of the recurrent kernel, and through a
torch port of flash-linear-attention's, called as transformers calls it on the GPU (`fla_recurrent`).

The drafter here is a stand-in that knows greedy's continuation and ranks its next token where it
is told (`OracleTrees`), so trees accept a lot, branch, and take paths other than the chain's."""

from __future__ import annotations

import importlib
import inspect
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin
from transformers.models.qwen3_5 import modeling_qwen3_5

from dflash_jobs.architectures import ARCHITECTURE_MODULES, qwen3_5
from dflash_jobs.drafter.speculative import Decoded, DecodeTarget, greedy_decode
from dflash_jobs.drafter.tree import ConditionalBranches, Tree, build_tree
from dflash_jobs.architectures.tree import TreeLayout
from dflash_jobs.drafter.tree_verify import GrowsTrees, commit_path, tree_decode, tree_target, verify_tree
from dflash_jobs.evaluate.trees import exact_trees, summarize_trees
from train_fixtures import LAYERS, tiny_target
from tree_fixtures import each_parent

BENCH = Path(__file__).resolve().parents[1] / "bench"
NEW_TOKENS = 30
NO_STOP = frozenset()
DECOYS = 6

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_of(tmp_path_factory):
    """The tiny target of an architecture, loaded once."""
    loaded = {}

    def load(architecture: str):
        if architecture not in loaded:
            directory = tiny_target(tmp_path_factory.getbasetemp() / "train-fixtures", architecture)
            loaded[architecture] = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        return loaded[architecture]

    return load


@pytest.fixture(scope="module", params=list(ARCHITECTURE_MODULES))
def model(request, model_of):
    return model_of(request.param)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 900, (14,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def greedy(model, prompt) -> list[int]:
    return greedy_decode(DecodeTarget(model), prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP).tokens


class OracleTrees(GrowsTrees):
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

        def scores(depth: int, parent: int) -> torch.Tensor:
            index = start + depth - 1
            right = self.continuation[index] if index < len(self.continuation) else None
            logits = torch.full((self.vocab,), -40.0)
            decoys = [t for t in range(depth * 37 + parent * 11, depth * 37 + parent * 11 + DECOYS + 1) if t % self.vocab != right]
            for j, token in enumerate(decoys[:DECOYS]):
                logits[token % self.vocab] = -6.0 * j
            if right is not None and parent == self.continuation[index - 1]:
                logits[right] = 3.0 - 6.0 * self.ranks[depth - 1]  # between decoys r - 1 and r
            return logits

        return ConditionalBranches(each_parent(scores), int(tokens[-1]), self.drafts, torch.device("cpu"))


def fla_fused_recurrent_gated_delta_rule(
    q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
    cu_seqlens=None, **kwargs,
):
    """flash-linear-attention 0.6.0's fused_recurrent_gated_delta_rule (fla/ops/gated_delta_rule/fused_recurrent.py)
    in torch: its signature, and its Triton kernel's arithmetic for the options Qwen3.5 uses. The
    kernel reads its tensors by offset, unchecked; here a shape it would misread is an error."""
    if gk is not None or gv is not None or use_gate_in_kernel or use_beta_sigmoid_in_kernel or state_v_first or cu_seqlens is not None:
        raise NotImplementedError("options Qwen3.5's GatedDeltaNet does not use")
    batch, steps, heads, k_dim = k.shape
    v_heads, v_dim = v.shape[-2:]
    assert q.shape == k.shape and v.shape[:2] == (batch, steps) and v_heads % heads == 0, (q.shape, k.shape, v.shape)
    assert g.dtype == torch.float32 and g.shape == beta.shape == (batch, steps, v_heads), (g.dtype, g.shape, beta.shape)  # log-space decay, head-wise beta
    assert initial_state is None or initial_state.shape == (batch, v_heads, k_dim, v_dim), initial_state.shape  # one state per sequence, [K, V]
    key_head = torch.arange(v_heads) // (v_heads // heads)  # the kernel's i_h = i_hv // (HV // H)
    q, k = q.float()[:, :, key_head], k.float()[:, :, key_head]  # [B, T, HV, K]
    if use_qk_l2norm_in_kernel:
        q, k = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6), k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (k_dim**-0.5 if scale is None else scale)
    state = torch.zeros(batch, v_heads, k_dim, v_dim) if initial_state is None else initial_state.float()
    out = torch.empty_like(v)
    for t in range(steps):
        state = state * g[:, t].exp()[..., None, None]
        delta = beta[:, t].float()[..., None] * (v[:, t].float() - (state * k[:, t, ..., None]).sum(-2))
        state = state + k[:, t, ..., None] * delta[..., None, :]
        out[:, t] = (state * q[:, t, ..., None]).sum(-2).to(v.dtype)
    return out, state if output_final_state else None  # the final state in fp32, whatever the inputs'


FLA_PARAMETERS = tuple(inspect.signature(fla_fused_recurrent_gated_delta_rule).parameters)


def fla_as_transformers_binds_it(*args, **kwargs):
    """transformers' use_kernel_func_from_hub_with_fallback with fla installed: keyword arguments the
    package's function does not name are dropped, the rest passed on as they come."""
    return fla_fused_recurrent_gated_delta_rule(*args, **{name: value for name, value in kwargs.items() if name in FLA_PARAMETERS})


RECURRENT_KERNELS = {"qwen3_5": ("torch_reference", "fla_recurrent"), "llama": ("no_recurrent_layer",)}


@pytest.fixture(params=[(architecture, kernel) for architecture, kernels in RECURRENT_KERNELS.items() for kernel in kernels],
                ids="-".join)
def kernel_model(request, model_of, monkeypatch):
    """Each target, its recurrent layers (the hybrid's) through the kernel their module binds:
    transformers' torch reference, or fla's (ported) as bound on the GPU."""
    architecture, kernel = request.param
    if kernel == "fla_recurrent":
        monkeypatch.setattr(modeling_qwen3_5, "torch_recurrent_gated_delta_rule", fla_as_transformers_binds_it)
    return model_of(architecture)


def tree_of(parents: list[int], seed: int, vocab: int) -> Tree:
    """A tree of these parents, random tokens."""
    rng = random.Random(seed)
    depths = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return Tree([rng.randrange(vocab) for _ in parents], parents, depths, [0.0] * len(parents))


def random_tree(seed: int, nodes: int, vocab: int) -> Tree:
    """A tree with a chain of 7 (deeper than the conv window) and random branches off it."""
    rng = random.Random(seed)
    parents = [-1, 0, 1, 2, 3, 4, 5]
    for node in range(len(parents), nodes):
        parents.append(rng.randint(-1, node - 1))
    return tree_of(parents, seed, vocab)


TREES = {
    "random-24": lambda vocab: random_tree(0, 24, vocab),
    "random-64": lambda vocab: random_tree(1, 64, vocab),
    "chain-14": lambda vocab: tree_of(list(range(-1, 13)), 2, vocab),  # one path, 15 rows deep
    "bushy-40": lambda vocab: tree_of([-1] * 8 + [node // 4 for node in range(32)], 3, vocab),  # 8 children of the root, 4 under each
}
"""Trees of every shape the verify forward lays out as root paths: branching at random, a chain (one
path, no padding), bushy (many short paths sharing the root)."""


def root_path(tree: Tree, node: int) -> list[int]:
    """The nodes from depth 1 down to `node`."""
    path = []
    while node >= 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


def leaves(tree: Tree) -> list[int]:
    return [node for node in range(len(tree)) if node not in set(tree.parents)]


def cached_length(target: DecodeTarget) -> int:
    """Tokens in the target's cache, from its attention layers' K/V."""
    return next(layer.get_seq_length() for layer in target.cache.layers if isinstance(layer, DynamicLayer))


def linear_states(target: DecodeTarget) -> list[torch.Tensor]:
    """Every GDN layer's conv window and recurrent state, and its token count."""
    return [t for layer in target.cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)
            for t in (*layer.conv_states.values(), *layer.recurrent_states.values(), layer.cumulative_length_linear)]


def test_the_layout_sees_ancestors_only_and_places_each_node_at_its_depth():
    tree = Tree([5, 6, 7, 8], [-1, 0, -1, 1], [1, 2, 1, 3], [0.0] * 4)
    layout = TreeLayout.of(9, tree, cached=3, device=torch.device("cpu"))
    assert layout.ids.tolist() == [9, 5, 6, 7, 8] and layout.positions.tolist() == [3, 4, 5, 4, 6]
    assert layout.visible[:, :3].all()
    assert layout.visible[:, 3:].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 1, 1, 0, 1]]
    # Every row's root path, padded with the root to the deepest's 4 rows; each row read at its depth in its own.
    assert layout.paths.tolist() == [[0, 0, 0, 0], [0, 1, 0, 0], [0, 1, 2, 0], [0, 3, 0, 0], [0, 1, 2, 4]]
    assert layout.path_slots.tolist() == [0, 5, 10, 13, 19]
    assert all(layout.paths.flatten()[slot] == row for row, slot in enumerate(layout.path_slots.tolist()))
    # Oldest first, 4 wide: the cached window's last inputs (indices 0..3) above the root, then the rows (4 + row).
    assert layout.windows(4).tolist() == [[1, 2, 3, 4], [2, 3, 4, 5], [3, 4, 5, 6], [2, 3, 4, 7], [4, 5, 6, 8]]


def test_the_fla_port_computes_what_the_torch_reference_does():
    """The port above is fla's kernel, not a copy of the tree's assumptions: on the same inputs
    (grouped value heads, a batch of sequences, each from its own state) it matches transformers'
    torch reference, which transformers checks against fla."""
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 5, 2, 16, generator=generator), torch.randn(3, 5, 2, 16, generator=generator)
    v = torch.randn(3, 5, 4, 8, generator=generator)
    g, beta = -torch.rand(3, 5, 4, generator=generator), torch.rand(3, 5, 4, generator=generator)
    state = torch.randn(3, 4, 16, 8, generator=generator)
    ported = fla_fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    reference = modeling_qwen3_5.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                                                    use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ported, reference)
    with pytest.raises(NotImplementedError):  # g and beta by position, as the torch reference would take them: beta becomes gk
        fla_fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state)
    with pytest.raises(AssertionError):  # one state for three sequences: broadcast by torch, misread by the kernel
        fla_fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state[:1])


@pytest.mark.parametrize("shape", TREES)
def test_one_forward_gives_every_node_what_a_forward_of_its_root_path_gives(kernel_model, prompt, shape):
    model = kernel_model
    tree, root = TREES[shape](model.config.vocab_size), 17
    target, reference = tree_target(model, LAYERS), DecodeTarget(model, LAYERS)
    with torch.inference_mode():
        target.reset()
        target.forward(prompt, last_only=True)
        before = [t.clone() for t in linear_states(target)]
        verified = verify_tree(target, root, tree)
        checked = set()
        for leaf in leaves(tree):  # a forward per leaf: the root and every node above it, each at its own position
            path = root_path(tree, leaf)
            reference.reset()
            logits = reference.forward(torch.cat([prompt, torch.tensor([root, *(tree.tokens[node] for node in path)])]))[len(prompt):]
            rows = [0] + [node + 1 for node in path]
            torch.testing.assert_close(verified.logits[rows], logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(verified.features[rows], reference.features()[len(prompt):], rtol=1e-5, atol=1e-5)
            checked.update(rows)
    assert checked == set(range(len(tree) + 1))
    assert cached_length(target) == len(prompt) and all(torch.equal(a, b) for a, b in zip(before, linear_states(target)))  # the forward wrote nothing


def committed_paths(tree: Tree) -> dict[str, list[int]]:
    """Accepted paths (nodes by depth) to commit in each tree: none, short and long down its first
    path, and down the deepest path off it (the recurrence's state after a node no first path holds)."""
    first = root_path(tree, leaves(tree)[0])
    off = max((leaf for leaf in leaves(tree) if tree.parents[leaf] not in first), key=lambda leaf: tree.depths[leaf], default=None)
    paths = {"none": [], "two": first[:2], "first": first}
    if off is not None:
        paths["off_first"] = root_path(tree, off)
    return paths


@pytest.mark.parametrize("shape, accepted", [(shape, accepted) for shape in TREES for accepted in ("none", "two", "first", "off_first")
                                             if not (shape == "chain-14" and accepted == "off_first")])
def test_committing_a_path_leaves_the_cache_as_a_forward_of_that_path_would(kernel_model, prompt, shape, accepted):
    """The root and an accepted path are committed: every layer's cache (K/V, conv windows past the
    hybrid's 4-wide window, recurrent states, token counts) is what a plain forward of the same
    tokens leaves, and the next forward sees exactly what it would after the plain path."""
    model = kernel_model
    tree, root, after = TREES[shape](model.config.vocab_size), 17, torch.tensor([3, 99, 250])
    path = committed_paths(tree)[accepted]
    tokens = torch.cat([prompt, torch.tensor([root, *(tree.tokens[node] for node in path)])])
    target, reference = tree_target(model), DecodeTarget(model)
    with torch.inference_mode():
        target.reset()
        target.forward(prompt, last_only=True)
        commit_path(target, verify_tree(target, root, tree), [0] + [node + 1 for node in path])
        reference.reset()
        reference.forward(tokens)
        assert cached_length(target) == cached_length(reference) == len(tokens)
        for mine, plain in zip(target.cache.layers, reference.cache.layers, strict=True):
            if isinstance(plain, LinearAttentionCacheLayerMixin):
                for kind in ("conv_states", "recurrent_states"):
                    torch.testing.assert_close(getattr(mine, kind)[0], getattr(plain, kind)[0], rtol=1e-5, atol=1e-5)
                assert int(mine.cumulative_length_linear) == int(plain.cumulative_length_linear) == len(tokens)
            else:
                torch.testing.assert_close((mine.keys, mine.values), (plain.keys, plain.values), rtol=1e-5, atol=1e-5)
        continued = target.forward(after)
        expected = reference.forward(after)
    torch.testing.assert_close(continued, expected, rtol=1e-5, atol=1e-5)


def test_the_recurrence_runs_once_a_layer_in_the_forward_and_once_in_the_commit(model_of, prompt, monkeypatch):
    """What makes the tree cheap on a GPU: one call of the recurrent kernel per GDN layer for the whole
    tree (its root paths as one batch), and one for every layer's commit together, whatever the tree's depth."""
    model = model_of("qwen3_5")
    gdn_layers = model.config.layer_types.count("linear_attention")
    calls = []
    kernel = modeling_qwen3_5.torch_recurrent_gated_delta_rule

    def counted(query, key, value, **kwargs):
        calls.append((tuple(key.shape[:2]), tuple(kwargs["initial_state"].shape[:1])))
        return kernel(query, key, value, **kwargs)

    monkeypatch.setattr(modeling_qwen3_5, "torch_recurrent_gated_delta_rule", counted)
    tree = TREES["random-64"](model.config.vocab_size)
    paths, deepest = len(tree) + 1, max(tree.depths) + 1  # every row's root path: which are leaves is not read
    target = tree_target(model)
    with torch.inference_mode():
        target.reset()
        target.forward(prompt, last_only=True)
        calls.clear()
        verified = verify_tree(target, 17, tree)
        assert calls == [((paths, deepest), (paths,))] * gdn_layers  # [P, D] positions, a state per path
        calls.clear()
        path = committed_paths(tree)["first"]
        commit_path(target, verified, [0] + [node + 1 for node in path])
        assert calls == [((gdn_layers, len(path) + 1), (gdn_layers,))]  # a sequence per layer, from its own state


@pytest.mark.parametrize("ranks, budget", [
    ([0, 0, 0, 0, 0], 5),  # a budget equal to the chain's: the tree is the chain
    ([1, 0, 0, 2, 0], 16),  # the best path is not the chain's: greedy's token is second at depth 1
    ([0, 3, 1, 0, 0], 40),
    ([1, 0, 0, 0, 0], 1),  # budget 1: the chain's first token alone
])
def test_tree_decoding_is_greedy_and_accepts_the_exact_figures_step_for_step(model, prompt, greedy, ranks, budget):
    drafter = OracleTrees(prompt.tolist() + greedy, ranks, model.config.vocab_size)
    target = tree_target(model)
    decoded = tree_decode(target, drafter, prompt, budget=budget, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
    chain = tree_decode(target, drafter, prompt, budget=1, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
    assert decoded.tokens == greedy and sum(decoded.accepted) + len(decoded.accepted) == len(greedy) - 1
    assert max(decoded.drafted) == min(budget, drafter.drafts)  # a step's drafted is its tree's depth
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


def test_a_chain_that_left_greedy_at_its_first_step_has_no_chain_steps_and_still_summarizes(model, prompt, greedy):
    """bf16 makes exact ties common: a chain whose first verify step took the other token leaves greedy's
    output at once, and its prompt then has no chain steps to compare trees at (an H100 run crashed on it)."""
    drafter = OracleTrees(prompt.tolist() + greedy, [0] * 6, model.config.vocab_size)
    tie = Decoded(tokens=[greedy[0], (greedy[1] + 1) % model.config.vocab_size], accepted=[1], drafted=[6], seconds=1.0)
    exact = exact_trees(lambda anchor: drafter.branches(torch.tensor(prompt.tolist() + greedy[: anchor + 1]), None), greedy, tie,
                        budgets=[5, 12], drafts=6, max_new_tokens=NEW_TOKENS)
    assert exact.chain == [] and exact.at_chain_steps == {5: [], 12: []} and exact.contains_chain == {5: [], 12: []}
    reference = Decoded(tokens=greedy, accepted=[0] * (len(greedy) - 1), drafted=[0] * (len(greedy) - 1), seconds=1.0)
    exact.decoded, exact.divergences = {5: reference, 12: reference}, {5: [], 12: []}
    summary = summarize_trees([exact], [tie], [reference], 7, chain_budget=6, tie_tolerance=0.0)
    assert summary["at_chain_steps"]["steps"] == 0 and summary["at_chain_steps"]["acceptance_length"] == {"5": 0.0, "12": 0.0}


def test_a_stop_token_inside_the_tree_ends_the_output_there(model, prompt, greedy):
    stop = greedy[11]
    expected = greedy_decode(DecodeTarget(model), prompt, max_new_tokens=NEW_TOKENS, stop_ids=frozenset([stop])).tokens
    assert expected[-1] == stop and len(expected) < len(greedy)
    drafter = OracleTrees(prompt.tolist() + greedy, [0] * 6, model.config.vocab_size)
    decoded = tree_decode(tree_target(model), drafter, prompt, budget=12, max_new_tokens=NEW_TOKENS, stop_ids=frozenset([stop]))
    assert decoded.tokens == expected
    # Committed per step: the accepted nodes and the next token, never past the stop token.
    assert sum(a + 1 for a in decoded.accepted) == len(expected) - 1
    exact = exact_trees(lambda anchor: drafter.branches(torch.tensor(prompt.tolist() + expected[: anchor + 1]), None), expected, decoded,
                        budgets=[12], drafts=6, max_new_tokens=NEW_TOKENS)
    assert decoded.accepted == exact.exact[12]


def test_trees_are_cut_where_the_output_has_no_room(model, prompt, greedy):
    """As a verify block: with k tokens left, no node deeper than k - 1 (the next token fills the last)."""
    drafter = OracleTrees(prompt.tolist() + greedy, [0] * 6, model.config.vocab_size)
    decoded = tree_decode(tree_target(model), drafter, prompt, budget=8, max_new_tokens=9, stop_ids=NO_STOP)
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

    out = tmp_path / "speedup.json"
    script = BENCH / "speedup.py"
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
        check = entry["check"]
        assert check["rows"] == int(budget) + 1 and check["within_noise"] and check["verdict"].startswith("within")
        assert all(check[pair]["max_relative_logit_difference"] < 1e-5 and check[pair]["argmax_disagreements"] == 0
                   for pair in ("tree_vs_whole", "tree_vs_stepwise", "stepwise_vs_whole"))
    priced = context["tree_speedup"]["16"]
    assert [row["tau"] for row in priced["table"]] == [2.5] and priced["table"][0]["tree"] > 0
    assert ("tree_flat" in priced["table"][0]) == (priced["verify_and_commit_ms"] > priced["flat_forward_ms"])
    assert len(context["tree_speedup"]["4"]["table"]) > 1  # no measured tau: the grid
    assert result["tree_summary"]["24"]["16"]["2.5"]["tree"] == priced["table"][0]["tree"]


def test_the_launch_benchmark_counts_a_tree_beside_a_flat_forward_and_an_older_commit(tmp_path):
    """bench/tree_launches.py on the 27B's 64 layers at tiny widths: per budget what the tree's verify,
    its commit and a flat forward launch, with this checkout's data plane and (a child process) with a
    commit's. The GDN kernels are counted as calls: the verify's recurrence once per GDN layer, the
    commit's once, the flat forward's convolution and chunked recurrence once per GDN layer each."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "launches.json"
    subprocess.run([sys.executable, str(BENCH / "tree_launches.py"), "--budgets", "4", "--baseline", "HEAD", "--out", str(out)],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    result = json.loads(out.read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=BENCH, check=True, capture_output=True, text=True).stdout.strip()
    assert result["baseline"]["commit"] == result["this"]["commit"] == head and set(result["baseline"]) == {"commit", "layers", "budgets"}
    assert result["this"]["dflash_jobs"] == "jobs/dflash_jobs" and result["this"]["layers"] == {"linear_attention": 48, "full_attention": 16}
    entry = result["this"]["budgets"]["4"]
    assert entry["shape"]["nodes"] == 4
    assert {name: kernel["calls"] for name, kernel in entry["tree_verify"]["gdn_kernels"].items()} == {"torch_recurrent_gated_delta_rule": 48}
    assert {name: kernel["calls"] for name, kernel in entry["tree_commit"]["gdn_kernels"].items()} == {"torch_recurrent_gated_delta_rule": 1}
    assert {name: kernel["calls"] for name, kernel in entry["flat_forward"]["gdn_kernels"].items()} == {
        "causal_conv1d_fn": 48, "torch_chunk_gated_delta_rule": 48}
    for kind in ("tree_verify", "tree_commit", "flat_forward"):
        counted = entry[kind]
        assert counted["launches"] == counted["aten_operators"] + sum(k["calls"] + k["input_copies"] for k in counted["gdn_kernels"].values())
        assert result["this_over_baseline"]["4"][kind] == round(counted["launches"] / result["baseline"]["budgets"]["4"][kind]["launches"], 3)
    assert entry["verify_and_commit_over_flat"] == round((entry["tree_verify"]["launches"] + entry["tree_commit"]["launches"])
                                                         / entry["flat_forward"]["launches"], 3)


def test_the_benchmarks_tree_check_tells_a_wrong_state_from_rounding(model_of, prompt, monkeypatch):
    """bench/speedup.py's check of the tree forward against the plain computations' own spread: the
    tree forward lies within it; one whose GDN root paths after the first start from a zero state,
    not the cached one (right along the first path, wrong on every other branch), lies far outside."""
    model = model_of("qwen3_5")
    monkeypatch.syspath_prepend(str(BENCH))
    speedup = importlib.import_module("speedup_trees")
    tree, _ = speedup.typical_tree(16, 15, model.config.vocab_size, torch.device("cpu"))
    assert len(speedup.root_paths(tree)) > 1 and sorted({row for path in speedup.root_paths(tree) for row in path}) == list(range(17))
    target = tree_target(model)
    with torch.inference_mode():
        target.reset()
        target.forward(prompt, last_only=True)
        checkpoint = target.checkpoint()
        check = speedup.tree_check(target, tree, lambda: target.rollback(checkpoint))
        assert check["within_noise"] and check["rows"] == 17 and check["noise_floor"] < 1e-5
        right = qwen3_5.recurrence

        def first_path_from_the_cache(module, query, key, value, g, beta, state, *, final_state):
            start = torch.cat([state[:1], torch.zeros_like(state[1:])])
            return right(module, query, key, value, g, beta, start, final_state=final_state)

        monkeypatch.setattr(qwen3_5, "recurrence", first_path_from_the_cache)
        wrong = speedup.tree_check(target, tree, lambda: target.rollback(checkpoint))
    assert not wrong["within_noise"] and wrong["verdict"].startswith("outside") and wrong["tree_over_floor"] > 100
    assert wrong["stepwise_vs_whole"] == check["stepwise_vs_whole"]  # the plain computations do not go through the tree
