"""Tree verification: a whole draft tree in one forward of the target, then the accepted path committed.

The verify forward runs the root (the anchor: the last committed token, not yet in the cache) and
every node of the tree (drafter/tree.py) after the cached tokens, layer by layer with the target's
own modules; how each kind of decoder layer runs over the tree is its architecture's
(architectures/: `TargetArchitecture.tree_mixers`):
- attention layers: each node at position cached + its depth (RoPE as if its root path were the
  text), attending to the cache, its ancestors and itself (an ancestor-only mask): `attend_tree`,
  after the architecture's own projections (Llama's plain ones, Qwen3.5's gated query);
- recurrent layers (Qwen3.5's Gated DeltaNet) carry a short convolution window and a recurrent
  state instead of K/V and take no mask, so they run tree-aware: each node from its parent's states
  (architectures/qwen3_5.py).
Nothing is written to the cache during the forward. `commit_path` then hands each layer's kept rows
the root and the accepted nodes: attention appends their K/V (the positions they were computed at
are theirs in the text), a recurrent layer sets its states to those after the last accepted node.
No rollback: a tree step costs one forward and a commit.

`tree_decode` is speculative decoding (speculative.py) with a tree in place of the block, the
committed path deciding the next anchor.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from dflash_jobs.architectures import target_architecture
from dflash_jobs.drafter.speculative import Decoded, Target, finished, prefill, through_stop
from dflash_jobs.drafter.tree import Branches, Tree, build_tree


class BranchDrafter(Protocol):
    """A drafter that offers its slots' distributions (a tree's Branches) instead of one block."""

    block_size: int
    drafts: int
    """The deepest slot: no tree node deeper."""
    target_layers: list[int]

    def branches(self, tokens: torch.Tensor, context: torch.Tensor | None) -> Branches:
        """The Branches of the block anchored at tokens[-1] (BlockDrafter.propose's arguments)."""
        ...


@dataclass
class TreeLayout:
    """A tree as the verify forward lays it out: row 0 is the root, row i + 1 node i."""

    ids: torch.Tensor
    """[n] the rows' tokens."""
    positions: torch.Tensor
    """[n] cached + depth."""
    visible: torch.Tensor
    """[n, cached + n] bool: what each row attends to (the cache, its ancestors, itself)."""
    levels: list[tuple[torch.Tensor, torch.Tensor | None]]
    """Per depth 0, 1, ...: its rows, and each one's parent as an index into the previous depth's rows (None at depth 0)."""
    lineage: list[list[int]]
    """Per row, itself then its ancestors up to the root."""
    _windows: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, root: int, tree: Tree, cached: int, device: torch.device) -> TreeLayout:
        parents = [-1] + [parent + 1 for parent in tree.parents]  # by row
        depths = [0, *tree.depths]
        lineage = [[0]]
        for row in range(1, len(parents)):
            lineage.append([row, *lineage[parents[row]]])
        visible = torch.zeros(len(parents), cached + len(parents), dtype=torch.bool)
        visible[:, :cached] = True
        for row, rows in enumerate(lineage):
            visible[row, [cached + r for r in rows]] = True
        levels, place = [], {}
        for depth in range(max(depths) + 1):
            rows = [row for row in range(len(parents)) if depths[row] == depth]
            place.update({row: i for i, row in enumerate(rows)})
            up = None if depth == 0 else torch.tensor([place[parents[row]] for row in rows], device=device)
            levels.append((torch.tensor(rows, device=device), up))
        return cls(
            ids=torch.tensor([root, *tree.tokens], device=device),
            positions=cached + torch.tensor(depths, device=device),
            visible=visible.to(device), levels=levels, lineage=lineage,
        )

    def windows(self, width: int) -> torch.Tensor:
        """[n, width] each row's convolution window, oldest first, as indices into [the cached window
        (width inputs, the newest last); the rows' inputs]: its ancestors' rows, then the cached inputs
        above the root. Built once a forward (every GDN layer has the same width)."""
        if width not in self._windows:
            windows = []
            for rows in self.lineage:
                newest_first = [width + row for row in rows[:width]] + [width - 1 - i for i in range(width - len(rows))]
                windows.append(newest_first[::-1])
            self._windows[width] = torch.tensor(windows, device=self.ids.device)
        return self._windows[width]


class KeptRows(Protocol):
    """What a layer's tree mixer keeps of every row for `commit_path`."""

    def commit(self, cache: Cache, layer_index: int, rows: torch.Tensor) -> None:
        """Appends these rows (indices: the root, then the accepted nodes by depth) to the layer's cache."""
        ...


@dataclass
class TreeStep:
    """What every layer's tree mixer reads in one verify forward."""

    layout: TreeLayout
    cos: torch.Tensor
    sin: torch.Tensor
    """The target's RoPE at the rows' positions."""


class TreeMixer(Protocol):
    def __call__(self, layer: nn.Module, x: torch.Tensor, cached, step: TreeStep) -> tuple[torch.Tensor, KeptRows]:
        """A decoder layer's token mixer over the tree: x [1, n, d] (its input norm applied) and its cache
        layer -> the mixer's output [1, n, d], and what the commit needs."""
        ...


@dataclass
class AttentionRows:
    """An attention layer's K/V of every row, [1, heads, n, head_dim]: the accepted ones go to the cache."""

    key: torch.Tensor
    value: torch.Tensor

    def commit(self, cache: Cache, layer_index: int, rows: torch.Tensor) -> None:
        cache.update(self.key[:, :, rows], self.value[:, :, rows], layer_index)


@dataclass
class VerifiedTree:
    logits: torch.Tensor
    """[n, V] the target's logits after each row."""
    features: torch.Tensor | None
    """[n, L * d] the captured layers (Target.layers) at each row."""
    kept: dict[int, KeptRows]
    """Per decoder layer, what commit_path needs."""

    @property
    def predicted(self) -> torch.Tensor:
        """[n] the target's greedy token after each row."""
        return self.logits.argmax(-1)


def kernels(module: nn.Module):
    """The modeling module `module` comes from: its RoPE, repeat_kv and the kernels transformers bound there."""
    return sys.modules[type(module).__module__]


def _text_model(model: nn.Module) -> nn.Module:
    inner = model.model
    return getattr(inner, "language_model", inner)


def cached_length(target: Target) -> int:
    """Tokens in the target's cache, from its attention layers' K/V."""
    return next(layer.get_seq_length() for layer in target.cache.layers if isinstance(layer, DynamicLayer))


def attend_tree(attention: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cached: DynamicLayer,
                step: TreeStep) -> tuple[torch.Tensor, AttentionRows]:
    """Attention of the rows over the cache and their ancestors, from their projections [1, heads, n,
    head_dim] before RoPE: the output [1, n, heads * head_dim] before o_proj, and the rows' K/V."""
    modeling = kernels(attention)
    query, key = modeling.apply_rotary_pos_emb(query, key, step.cos, step.sin)
    groups = attention.num_key_value_groups
    keys = modeling.repeat_kv(torch.cat([cached.keys, key], dim=2), groups)  # [1, H, cached + n, hd]
    values = modeling.repeat_kv(torch.cat([cached.values, value], dim=2), groups)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=step.layout.visible, scale=attention.scaling)
    return out.transpose(1, 2).flatten(2), AttentionRows(key, value)


@torch.inference_mode()
def verify_tree(target: Target, root: int, tree: Tree) -> VerifiedTree:
    """The target's greedy token after the root and after every node, in one forward that leaves the cache as it was."""
    model, device = target.model, target.device
    text = _text_model(model)
    mixers = target_architecture(text.config).tree_mixers
    layer_types = getattr(text.config, "layer_types", None) or ["full_attention"] * len(text.layers)
    layout = TreeLayout.of(root, tree, cached_length(target), device)
    h = model.get_input_embeddings()(layout.ids)[None]  # [1, n, d]
    step = TreeStep(layout, *text.rotary_emb(h, layout.positions[None]))
    captured, kept = {}, {}
    for index, layer in enumerate(text.layers):
        mixed, kept[index] = mixers[layer_types[index]](layer, layer.input_layernorm(h), target.cache.layers[index], step)
        h = h + mixed
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        if index in target.layers:
            captured[index] = h[0]
    logits = model.get_output_embeddings()(text.norm(h))[0]
    features = torch.cat([captured[layer] for layer in target.layers], dim=-1) if target.layers else None  # L x [n, d] -> [n, L * d]
    return VerifiedTree(logits, features, kept)


@torch.inference_mode()
def commit_path(target: Target, verified: VerifiedTree, rows: Sequence[int]) -> None:
    """Appends these rows (the root, then the accepted nodes by depth) to the cache: every layer's kept
    rows commit themselves (attention their K/V, a recurrent layer its states after the last of them)."""
    index = torch.tensor(list(rows), device=target.device)
    for layer_index, kept in verified.kept.items():
        kept.commit(target.cache, layer_index, index)


@torch.inference_mode()
def tree_decode(
    target: Target, drafter: BranchDrafter, prompt: torch.Tensor, *, budget: int, max_new_tokens: int, stop_ids: frozenset[int],
) -> Decoded:
    """Greedy decoding by draft trees of `budget` nodes: each step verifies the anchor's tree in one
    forward, commits the longest root path the target agrees with plus its next token, and reads
    the captured layers of the anchor and the accepted nodes as the drafter's next context.
    `accepted` and `drafted` per step are as speculative_decode's, `drafted` the tree's depth: the
    drafts along its longest root path, as conditional acceptance reads it (position k is reached
    only where some path is k deep)."""
    decoding = prefill(target, drafter, prompt, max_new_tokens=max_new_tokens)
    context, tokens = decoding.context, decoding.tokens
    while not finished(tokens, max_new_tokens, stop_ids):
        branches = drafter.branches(decoding.sequence[: decoding.length], context.view() if context is not None else None)
        # As a block: no deeper than the output still has room for, the next token included.
        tree = build_tree(branches, budget=budget, depth_limit=min(drafter.drafts, max_new_tokens - len(tokens) - 1))
        verified = verify_tree(target, int(decoding.sequence[decoding.length - 1]), tree)
        predicted = verified.predicted.tolist()
        path = tree.follow(predicted.__getitem__)
        new = [tree.tokens[node] for node in path] + [predicted[path[-1] + 1 if path else 0]]
        accepted = through_stop(new, stop_ids) - 1  # a stop token in the tree ends the output there
        rows = [0] + [node + 1 for node in path[:accepted]]
        commit_path(target, verified, rows)
        if context is not None:
            context.append(verified.features[rows])
        decoding.commit(torch.tensor(new[: accepted + 1], device=target.device), accepted, max(tree.depths, default=0))
    return decoding.decoded()
