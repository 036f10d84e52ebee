"""Tree verification: a whole draft tree in one forward of the target, then the accepted path committed.

The verify forward runs the root (the anchor: the last committed token, not yet in the cache) and
every node of the tree (drafter/tree.py) after the cached tokens, layer by layer with the target's
own modules; how each kind of decoder layer runs over the tree is its architecture's
(architectures/: `TargetArchitecture.tree_mixers`):
- attention layers: each node at position cached + its depth (RoPE as if its root path were the
  text), attending to the cache, its ancestors and itself (an ancestor-only mask): `attend_tree`,
  after the architecture's own projections (Llama's plain ones, Qwen3.5's gated query);
- recurrent layers (Qwen3.5's Gated DeltaNet) carry a short convolution window and a recurrent
  state instead of K/V and take no mask, so they run tree-aware: each node's convolution over its
  own ancestors, and the recurrence in one call over the tree's root paths, a sequence each
  (`TreeLayout.paths`, architectures/qwen3_5.py).
Nothing is written to the cache during the forward. `commit_path` then hands each kind of layer what
its layers kept, and the root and the accepted nodes: attention appends their K/V (the positions they
were computed at are theirs in the text), the recurrent layers set their states to those after the
last accepted node, all layers in one call. No rollback: a tree step costs one forward and a commit.

`tree_decode` is speculative decoding (speculative.py) with a tree in place of the block, the
committed path deciding the next anchor.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from dflash_jobs.architectures import target_architecture
from dflash_jobs.drafter.speculative import Decoded, Target, finished, on_device, prefill, through_stop
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
    paths: torch.Tensor
    """[P, D] every leaf's root path as rows, the root first, those shorter than the deepest (D rows)
    padded at their end with row 0: the tree as P sequences that share their prefixes, for a
    recurrence that runs each from the cached state. What a padded position computes comes after its
    path's last row and is never read."""
    path_slots: torch.Tensor
    """[n] where each row is in the paths flattened to [P * D]: in the first path that holds it."""
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
        ancestors = [[False] * len(parents) for _ in parents]  # [n, n]: each row's ancestors and itself
        for row, rows in enumerate(lineage):
            for seen in rows:
                ancestors[row][seen] = True
        visible = torch.cat([torch.ones(len(parents), cached, dtype=torch.bool), torch.tensor(ancestors)], dim=1)  # built on the host at once
        inner = set(parents)
        paths = [lineage[row][::-1] for row in range(len(parents)) if row not in inner]  # the leaves' root paths
        deepest = max(map(len, paths))
        slots: dict[int, int] = {}
        for p, path in enumerate(paths):
            for depth, row in enumerate(path):
                slots.setdefault(row, p * deepest + depth)
        return cls(
            ids=torch.tensor([root, *tree.tokens], device=device),
            positions=cached + torch.tensor(depths, device=device),
            visible=visible.to(device),
            paths=torch.tensor([path + [0] * (deepest - len(path)) for path in paths], device=device),
            path_slots=torch.tensor([slots[row] for row in range(len(parents))], device=device),
            lineage=lineage,
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
    """What a kind of layer's tree mixer keeps of every row for `commit_path`."""

    @classmethod
    def commit(cls, cache: Cache, kept: Mapping[int, KeptRows], rows: torch.Tensor) -> None:
        """Appends these rows (indices: the root, then the accepted nodes by depth) to the cache of every
        layer in `kept` (layer index -> what it kept, all of this kind), in as few calls as the kind can."""
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

    @classmethod
    def commit(cls, cache: Cache, kept: Mapping[int, AttentionRows], rows: torch.Tensor) -> None:
        """The rows of every layer picked at once; each layer's cache then grows by its own concatenation."""
        keys = torch.stack([layer_rows.key for layer_rows in kept.values()])[:, :, :, rows]  # [L, 1, heads, r, head_dim]
        values = torch.stack([layer_rows.value for layer_rows in kept.values()])[:, :, :, rows]
        for layer_index, key, value in zip(kept, keys, values):
            cache.update(key, value, layer_index)


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
    """Appends these rows (the root, then the accepted nodes by depth) to the cache: each kind of layer
    commits what its layers kept (attention their K/V, the recurrent layers their states after the
    last of them)."""
    index = torch.tensor(list(rows), device=target.device)
    kinds: dict[type, dict[int, KeptRows]] = {}
    for layer_index, kept in verified.kept.items():
        kinds.setdefault(type(kept), {})[layer_index] = kept
    for kind, kept_by_layer in kinds.items():
        kind.commit(target.cache, kept_by_layer, index)
    target.length += len(index)


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
        branches = drafter.branches(decoding.committed(drafter), context.view() if context is not None else None)
        # As a block: no deeper than the output still has room for, the next token included.
        tree = build_tree(branches, budget=budget, depth_limit=min(drafter.drafts, max_new_tokens - len(tokens) - 1))
        verified = verify_tree(target, decoding.history[-1], tree)
        predicted = verified.predicted.tolist()
        path = tree.follow(predicted.__getitem__)
        new = [tree.tokens[node] for node in path] + [predicted[path[-1] + 1 if path else 0]]
        accepted = through_stop(new, stop_ids) - 1  # a stop token in the tree ends the output there
        rows = [0] + [node + 1 for node in path[:accepted]]
        commit_path(target, verified, rows)
        if context is not None:
            context.append(verified.features[rows])
        decoding.commit(on_device(torch.tensor(new[: accepted + 1]), target.device), new[: accepted + 1], accepted, max(tree.depths, default=0))
    return decoding.decoded()
