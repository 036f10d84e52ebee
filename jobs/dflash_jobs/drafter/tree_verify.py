"""Tree verification: a whole draft tree in one forward of the target, then the accepted path committed.

The verify forward runs the root (the anchor: the last committed token, not yet in the cache) and
every node of the tree (drafter/tree.py) after the cached tokens, layer by layer with the target's
own modules; how each kind of decoder layer runs over the tree is its architecture's, by the tree
protocol of the architecture seam (architectures/tree.py: `TreeLayout`, `TreeStep`, a `TreeMixer`
per layer type in `TargetArchitecture.tree_mixers`), which the target carries (`DecodeTarget.architecture`,
resolved once when it is built: `tree_target`). Nothing is written to the cache during the forward.
`commit_path` then hands each kind of layer what its layers kept, and the root and the accepted nodes:
attention appends their K/V (the positions they were computed at are theirs in the text), the
recurrent layers set their states to those after the last accepted node, all layers in one call. No
rollback: a tree step costs one forward and a commit.

The target runs the forward (`tree_forward`): over its cache as it stands (DecodeTarget), or, on a
static cache, replayed as a CUDA graph per row count and window from buffers it copies the tree into, the
cached columns past its length masked (static_target.py StaticTarget).

`tree_decode` is speculative decoding (speculative.py) with a tree in place of the block, the
committed path deciding the next anchor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from torch import nn

from dflash_jobs.architectures import target_architecture
from dflash_jobs.architectures.tree import KeptRows, TreeLayout, TreeStep
from dflash_jobs.drafter.speculative import Decoded, DecodeTarget, finished, on_device, prefill, text_model, through_stop
from dflash_jobs.drafter.tree import Branches, GrownTree, Tree, grow_tree


class BranchDrafter(Protocol):
    """A drafter that offers its slots' distributions (a tree's Branches) instead of one block."""

    block_size: int
    drafts: int
    """The deepest slot: no tree node deeper."""
    target_layers: list[int]

    def branches(self, tokens: torch.Tensor, context: torch.Tensor | None) -> Branches:
        """The Branches of the block anchored at tokens[-1] (BlockDrafter.propose's arguments)."""
        ...

    def grown(self, tokens: torch.Tensor, context: torch.Tensor | None, *, budget: int, depth_limit: int) -> GrownTree:
        """The step's tree: grow_tree over `branches` (GrowsTrees gives it so)."""
        ...


class GrowsTrees:
    """A BranchDrafter's tree grown from its branches (grow_tree), for a drafter to inherit; one whose
    whole step is a replayed graph (drafter/replayed_drafter.py) grows its own."""

    def grown(self, tokens, context, *, budget: int, depth_limit: int) -> GrownTree:
        return grow_tree(self.branches(tokens, context), budget=budget, depth_limit=depth_limit)


@dataclass
class VerifiedTree:
    logits: torch.Tensor
    """[n, V] the target's logits after each row."""
    features: torch.Tensor | None
    """[n, L * d] the captured layers (DecodeTarget.layers) at each row."""
    kept: dict[int, KeptRows]
    """Per decoder layer, what commit_path needs."""

    @property
    def predicted(self) -> torch.Tensor:
        """[n] the target's greedy token after each row."""
        return self.logits.argmax(-1)


def tree_target(model: nn.Module, layers: Sequence[int] = ()) -> DecodeTarget:
    """The decode-time Target that tree decoding takes: its architecture resolved here, once (from the text
    model's config, as the checkpoint nests it)."""
    return DecodeTarget(model, layers, architecture=target_architecture(text_model(model).config))


@dataclass
class LaidTree:
    """A tree's rows as the layout reads them: a host tree's lists, or tensors (a grown tree's, or a static target's buffers)."""

    tokens: Sequence[int] | torch.Tensor
    parents: Sequence[int] | torch.Tensor
    depths: Sequence[int] | torch.Tensor
    depth_bound: int


@torch.inference_mode()
def verify_tree(target: DecodeTarget, root: int, tree: Tree | GrownTree) -> VerifiedTree:
    """The target's greedy token after the root and after every node, in one forward that leaves the cache as it was."""
    if target.architecture is None:
        raise ValueError("tree decoding runs each layer by its architecture: build the target with tree_target(model, layers)")
    model, device, text = target.model, target.device, target.text
    mixers = target.architecture.tree_mixers
    layer_types = getattr(text.config, "layer_types", None) or ["full_attention"] * len(text.layers)

    def forward(cached, columns, cache_layers, depth_bound, *, root, tokens, parents, depths) -> VerifiedTree:
        layout = TreeLayout.of(root, LaidTree(tokens, parents, depths, depth_bound), cached, device, columns=columns)
        h = model.get_input_embeddings()(layout.ids)[None]  # [1, n, d]
        step = TreeStep(layout, *text.rotary_emb(h, layout.positions[None]))
        captured, kept = {}, {}
        for index, layer in enumerate(text.layers):
            mixed, kept[index] = mixers[layer_types[index]](layer, layer.input_layernorm(h), cache_layers[index], step)
            h = h + mixed
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if index in target.layers:
                captured[index] = h[0]
        logits = model.get_output_embeddings()(text.norm(h))[0]
        features = torch.cat([captured[layer] for layer in target.layers], dim=-1) if target.layers else None  # L x [n, d] -> [n, L * d]
        return VerifiedTree(logits, features, kept)

    inputs = {"root": root, "tokens": tree.tokens, "parents": tree.parents, "depths": tree.depths}
    return target.tree_forward(len(tree) + 1, tree.depth_bound, inputs, forward)


@torch.inference_mode()
def commit_path(target: DecodeTarget, verified: VerifiedTree, rows: Sequence[int] | torch.Tensor) -> None:
    """Appends these rows (the root, then the accepted nodes by depth) to the cache: each kind of layer
    commits what its layers kept (attention their K/V, the recurrent layers their states after the
    last of them)."""
    index = rows if isinstance(rows, torch.Tensor) else on_device(torch.tensor(list(rows)), target.device)  # from pinned memory: no wait
    kinds: dict[type, dict[int, KeptRows]] = {}
    for layer_index, kept in verified.kept.items():
        kinds.setdefault(type(kept), {})[layer_index] = kept
    for kind, kept_by_layer in kinds.items():
        kind.commit(target.cache, kept_by_layer, index)
    target.length += len(index)


@torch.inference_mode()
def tree_decode(
    target: DecodeTarget, drafter: BranchDrafter, prompt: torch.Tensor, *, budget: int, max_new_tokens: int, stop_ids: frozenset[int],
) -> Decoded:
    """Greedy decoding by draft trees of `budget` nodes: each step grows the anchor's tree on the
    device, verifies it in one forward, reads the tree and the target's tokens in the step's one
    read, commits the longest root path the target agrees with plus its next token, and takes the
    captured layers of the anchor and the accepted nodes as the drafter's next context.
    `accepted` and `drafted` per step are as speculative_decode's, `drafted` the tree's depth: the
    drafts along its longest root path, as conditional acceptance reads it (position k is reached
    only where some path is k deep)."""
    decoding = prefill(target, drafter, prompt, max_new_tokens=max_new_tokens)
    context, tokens = decoding.context, decoding.tokens
    while not finished(tokens, max_new_tokens, stop_ids):
        # As a block: no deeper than the output still has room for, the next token included.
        grown = drafter.grown(decoding.committed(drafter), context.view() if context is not None else None, budget=budget,
                              depth_limit=min(drafter.drafts, max_new_tokens - len(tokens) - 1))
        verified = verify_tree(target, decoding.history[-1], grown)
        tree, predicted = grown.read(verified.predicted)  # the step's one sync: the tree and the target's tokens
        path = tree.follow(predicted.__getitem__)
        new = [tree.tokens[node] for node in path] + [predicted[path[-1] + 1 if path else 0]]
        accepted = through_stop(new, stop_ids) - 1  # a stop token in the tree ends the output there
        rows = on_device(torch.tensor([0] + [node + 1 for node in path[:accepted]]), target.device)
        commit_path(target, verified, rows)
        if context is not None:
            context.append(verified.features[rows])
        decoding.commit(on_device(torch.tensor(new[: accepted + 1]), target.device), new[: accepted + 1], accepted, max(tree.depths, default=0))
    return decoding.decoded()
