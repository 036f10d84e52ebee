"""The tree protocol: how a target's decoder layers run over a draft tree, which each architecture's
entry fills (`TargetArchitecture.tree_mixers`) and tree verification drives (drafter/tree_verify.py).

A verify forward lays the tree out as rows (`TreeLayout`: row 0 the root, the anchor not yet in the
cache; row i + 1 node i) after the cached tokens, and hands every layer the same `TreeStep`. Each
kind of decoder layer has a `TreeMixer`: its token mixer over the rows, which writes nothing to the
cache and keeps what the commit needs (`KeptRows`):
- attention layers: each row at position cached + its depth (RoPE as if its root path were the
  text), attending to the cache, its ancestors and itself (an ancestor-only mask): `attend_tree`,
  after the architecture's own projections (Llama's plain ones, Qwen3.5's gated query); they keep
  their rows' K/V (`AttentionRows`), which the commit appends;
- recurrent layers (Qwen3.5's Gated DeltaNet) carry a short convolution window and a recurrent
  state instead of K/V and take no mask, so they run tree-aware: each row's convolution over its
  own ancestors (`TreeLayout.windows`), and the recurrence in one call over the tree's root paths,
  a sequence each (`TreeLayout.paths`, architectures/qwen3_5.py).

It imports torch and transformers, as the entries do: `architectures/__init__.py` names its types
for type checking only.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer


class DraftTree(Protocol):
    """A draft tree below the root as the layout reads it (drafter/tree.py's Tree)."""

    tokens: Sequence[int]
    parents: Sequence[int]
    """Each node's parent node (an earlier index), -1 for the root."""
    depths: Sequence[int]
    """1 for the root's children."""


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
    def of(cls, root: int, tree: DraftTree, cached: int, device: torch.device) -> TreeLayout:
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
    """What a kind of layer's tree mixer keeps of every row for the commit (drafter/tree_verify.py's `commit_path`)."""

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


def kernels(module: nn.Module):
    """The modeling module `module` comes from: its RoPE, repeat_kv and the kernels transformers bound there."""
    return sys.modules[type(module).__module__]


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
