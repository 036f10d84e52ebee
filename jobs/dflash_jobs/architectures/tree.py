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
    """A draft tree below the root as the layout reads it: drafter/tree.py's Tree (host lists) or
    GrownTree (device tensors, laid out without a read)."""

    tokens: Sequence[int] | torch.Tensor
    parents: Sequence[int] | torch.Tensor
    """Each node's parent node (an earlier index), -1 for the root."""
    depths: Sequence[int] | torch.Tensor
    """1 for the root's children."""
    depth_bound: int
    """No node deeper."""


@dataclass
class TreeLayout:
    """A tree as the verify forward lays it out: row 0 is the root, row i + 1 node i. Built on the
    device from the tree's tensors: nothing of the tree is read to lay it out."""

    ids: torch.Tensor
    """[n] the rows' tokens."""
    positions: torch.Tensor
    """[n] cached + depth."""
    visible: torch.Tensor
    """[n, C + n] bool: what each row attends to (the cache's C columns, its ancestors, itself)."""
    above: torch.Tensor
    """[n] each row's parent row (the root its own)."""
    depths: torch.Tensor
    """[n] each row's depth (the root's 0)."""
    deepest: int
    """Rows in the longest root path the tree can hold, the root's included."""
    _built: dict = field(default_factory=dict)

    @classmethod
    def of(cls, root: int | torch.Tensor, tree: DraftTree, cached: int | torch.Tensor, device: torch.device, *,
           columns: torch.Tensor | None = None) -> TreeLayout:
        """root: its token, or a [1] tensor of it. cached: the tokens in the cache (the root's position).
        columns: None where the cache holds exactly `cached` tokens, all seen; a static cache gives
        its window's column indices [C] instead, of which the rows see those before `cached` (then a
        device scalar: the layout is built inside a replayed CUDA graph, from its buffers alone)."""
        def rows(values) -> torch.Tensor:  # a host tree's lists copied over, a grown tree's tensors as they are
            return torch.as_tensor(values, dtype=torch.long, device=device)

        zero = torch.zeros(1, dtype=torch.long, device=device)  # the root's parent (itself) and depth, filled there: no copy to wait on
        above = torch.cat([zero, rows(tree.parents) + 1])
        depths = torch.cat([zero, rows(tree.depths)])
        deepest = tree.depth_bound + 1
        lineage = _lineage(above, deepest)  # every ancestor of every row, up to the root
        ancestors = torch.zeros(len(above), len(above), dtype=torch.bool, device=device).scatter_(1, lineage, True)
        root_row = root.view(1) if isinstance(root, torch.Tensor) else torch.full((1,), root, device=device)
        seen = (torch.ones(len(above), cached, dtype=torch.bool, device=device) if columns is None
                else (columns < cached).expand(len(above), -1))  # [n, C]: the cache's columns each row attends to
        return cls(
            ids=torch.cat([root_row, rows(tree.tokens)]),
            positions=cached + depths,
            visible=torch.cat([seen, ancestors], dim=1),
            above=above,
            depths=depths,
            deepest=deepest,
            _built={("lineage", deepest): lineage},
        )

    def lineage(self, k: int) -> torch.Tensor:
        """[n, k] each row, then its parent, its parent's parent...: the root once reached."""
        if ("lineage", k) not in self._built:
            self._built["lineage", k] = _lineage(self.above, k)
        return self._built["lineage", k]

    @property
    def paths(self) -> torch.Tensor:
        """[n, D] every row's root path as rows, the root first, padded at its end with row 0 to
        `deepest` rows: the tree as n sequences that share their prefixes, for a recurrence that runs
        each from the cached state. What a padded position computes comes after its path's last row
        and is never read. Every row's path, not only the leaves': which rows are leaves is not known
        without reading the tree."""
        if "paths" not in self._built:
            up = self.depths[:, None] - torch.arange(self.deepest, device=self.depths.device)  # [n, D]: steps up to depth j
            self._built["paths"] = torch.where(up >= 0, self.lineage(self.deepest).gather(1, up.clamp(min=0)), 0)
        return self._built["paths"]

    @property
    def path_slots(self) -> torch.Tensor:
        """[n] where each row is in the paths flattened to [n * D]: at its depth in its own path."""
        return torch.arange(len(self.depths), device=self.depths.device) * self.deepest + self.depths

    def windows(self, width: int) -> torch.Tensor:
        """[n, width] each row's convolution window, oldest first, as indices into [the cached window
        (width inputs, the newest last); the rows' inputs]: its ancestors' rows, then the cached inputs
        above the root. Built once a forward (every GDN layer has the same width)."""
        if ("windows", width) not in self._built:
            back = torch.arange(width, device=self.depths.device)  # the j-th newest input
            own = back <= self.depths[:, None]  # [n, width]: a row of the tree, or the cache above the root
            newest_first = torch.where(own, width + self.lineage(width), width - back + self.depths[:, None])
            self._built["windows", width] = newest_first.flip(-1)
        return self._built["windows", width]


def _lineage(above: torch.Tensor, k: int) -> torch.Tensor:
    """[n, k] each row, then its parent, its parent's parent...: the root once reached (above: [n] each row's parent row)."""
    lineage = [torch.arange(len(above), device=above.device)]
    for _ in range(k - 1):
        lineage.append(above[lineage[-1]])
    return torch.stack(lineage, dim=1)


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
    head_dim] before RoPE: the output [1, n, heads * head_dim] before o_proj, and the rows' K/V.
    `cached`: the layer's cached `keys` and `values` (a DynamicLayer, or a static cache's window,
    whose columns the layout masks)."""
    modeling = kernels(attention)
    query, key = modeling.apply_rotary_pos_emb(query, key, step.cos, step.sin)
    groups = attention.num_key_value_groups
    keys = modeling.repeat_kv(torch.cat([cached.keys, key], dim=2), groups)  # [1, H, cached + n, hd]
    values = modeling.repeat_kv(torch.cat([cached.values, value], dim=2), groups)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=step.layout.visible, scale=attention.scaling)
    return out.transpose(1, 2).flatten(2), AttentionRows(key, value)
