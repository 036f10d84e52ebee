"""Tree verification on the hybrid target: a whole draft tree in one forward, then the accepted path committed.

The verify forward runs the root (the anchor: the last committed token, not yet in the cache) and
every node of the tree (drafter/tree.py) after the cached tokens, layer by layer with the target's
own modules:
- attention layers: each node at position cached + its depth (RoPE as if its root path were the
  text), attending to the cache, its ancestors and itself (an ancestor-only mask);
- Gated DeltaNet layers carry a short convolution window and a recurrent state instead of K/V and
  take no mask, so they run tree-aware: the projections, the gated norm and the output over all
  nodes at once; each node's convolution over its own ancestors' inputs (those above the root from
  the cached window); the recurrence one depth at a time, the nodes of a depth as one batch, each
  starting from its parent's state (the root from the cached one), through the recurrent kernel
  transformers binds (flash-linear-attention's fused_recurrent where installed).
Nothing is written to the cache during the forward. `commit_path` then appends the K/V of the root
and the accepted nodes (the positions they were computed at are theirs in the text) and sets each
GDN layer's states to those after the last accepted node, recomputed along the path from the
per-node inputs the forward kept (keeping every node's recurrent state instead costs nodes x 3 MB
per GDN layer at the 27B shape). No rollback: a tree step costs one forward and a commit.

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
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicLayer

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


@dataclass
class AttentionRows:
    """An attention layer's K/V of every row, [1, heads, n, head_dim]: the accepted ones go to the cache."""

    key: torch.Tensor
    value: torch.Tensor


@dataclass
class RecurrentRows:
    """A GDN layer's per-row inputs: its convolution input [n, C], and the recurrence's inputs (q, k [n, Hk, dk], v [n, Hv, dv], g, beta [n, Hv])."""

    module: nn.Module
    mixed: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


@dataclass
class VerifiedTree:
    logits: torch.Tensor
    """[n, V] the target's logits after each row."""
    features: torch.Tensor | None
    """[n, L * d] the captured layers (Target.layers) at each row."""
    kept: dict[int, AttentionRows | RecurrentRows]
    """Per decoder layer, what commit_path needs."""

    @property
    def predicted(self) -> torch.Tensor:
        """[n] the target's greedy token after each row."""
        return self.logits.argmax(-1)


def _kernels(module: nn.Module):
    """The modeling module `module` comes from: its RoPE and the GDN kernels transformers bound there."""
    return sys.modules[type(module).__module__]


def _recurrence(module: nn.Module, query, key, value, g, beta, state):
    """The gated delta rule token by token from `state` (q, k, v positional: fla names them q, k, v, the fallback query, key, value)."""
    recurrent = _kernels(module).torch_recurrent_gated_delta_rule
    return recurrent(query, key, value, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)


def _text_model(model: nn.Module) -> nn.Module:
    inner = model.model
    return getattr(inner, "language_model", inner)


def cached_length(target: Target) -> int:
    """Tokens in the target's cache, from its attention layers' K/V."""
    return next(layer.get_seq_length() for layer in target.cache.layers if isinstance(layer, DynamicLayer))


def _tree_attention(attention: nn.Module, x: torch.Tensor, cos, sin, visible: torch.Tensor, cached: DynamicLayer):
    """Qwen3.5's gated attention over the cache and the tree (x [1, n, d])."""
    kernels = _kernels(attention)
    shape = (*x.shape[:-1], -1, attention.head_dim)
    query, gate = torch.chunk(attention.q_proj(x).view(*x.shape[:-1], -1, attention.head_dim * 2), 2, dim=-1)
    query = attention.q_norm(query.reshape(shape)).transpose(1, 2)  # [1, H, n, hd]
    key = attention.k_norm(attention.k_proj(x).view(shape)).transpose(1, 2)
    value = attention.v_proj(x).view(shape).transpose(1, 2)
    query, key = kernels.apply_rotary_pos_emb(query, key, cos, sin)
    groups = attention.num_key_value_groups
    keys = kernels.repeat_kv(torch.cat([cached.keys, key], dim=2), groups)  # [1, H, cached + n, hd]
    values = kernels.repeat_kv(torch.cat([cached.values, value], dim=2), groups)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=attention.scaling)
    out = out.transpose(1, 2).reshape(*x.shape[:-1], -1) * torch.sigmoid(gate.reshape(*x.shape[:-1], -1))
    return attention.o_proj(out), AttentionRows(key, value)


def _tree_gated_delta(gdn: nn.Module, x: torch.Tensor, cached, layout: TreeLayout):
    """Qwen3.5's Gated DeltaNet over the tree (x [n, d]), each row from its parent's states."""
    n = len(x)
    mixed = gdn.in_proj_qkv(x)  # [n, C]
    z = gdn.in_proj_z(x).reshape(n, -1, gdn.head_v_dim)
    beta = gdn.in_proj_b(x).sigmoid()
    g = -gdn.A_log.float().exp() * F.softplus(gdn.in_proj_a(x).float() + gdn.dt_bias)
    window = cached.conv_states[0][0].T  # [width, C]: the cached inputs, newest last
    inputs = torch.cat([window, mixed])[layout.windows(len(window))]  # [n, width, C]
    weight = gdn.conv1d.weight[:, 0, -len(window):]  # [C, width]
    convolved = (inputs.float() * weight.T.float()).sum(1)  # in fp32, as the conv kernels accumulate
    if gdn.conv1d.bias is not None:
        convolved = convolved + gdn.conv1d.bias.float()
    convolved = ACT2FN[gdn.activation](convolved).to(x.dtype)
    query, key, value = torch.split(convolved, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
    rows = RecurrentRows(gdn, mixed, query.reshape(n, -1, gdn.head_k_dim), key.reshape(n, -1, gdn.head_k_dim),
                         value.reshape(n, -1, gdn.head_v_dim), g, beta)
    core = torch.empty_like(rows.value)
    states = cached.recurrent_states[0]  # [1, Hv, dk, dv]
    for level, up in layout.levels:
        start = states if up is None else states[up]
        out, states = _recurrence(gdn, rows.query[level, None], rows.key[level, None], rows.value[level, None], g[level, None], beta[level, None], start)
        core[level] = out[:, 0]
    core = gdn.norm(core.reshape(-1, gdn.head_v_dim), z.reshape(-1, gdn.head_v_dim)).reshape(n, -1)
    return gdn.out_proj(core)[None], rows


@torch.inference_mode()
def verify_tree(target: Target, root: int, tree: Tree) -> VerifiedTree:
    """The target's greedy token after the root and after every node, in one forward that leaves the cache as it was."""
    model, device = target.model, target.device
    text = _text_model(model)
    layout = TreeLayout.of(root, tree, cached_length(target), device)
    h = model.get_input_embeddings()(layout.ids)[None]  # [1, n, d]
    cos, sin = text.rotary_emb(h, layout.positions[None])
    captured, kept = {}, {}
    for index, layer in enumerate(text.layers):
        x = layer.input_layernorm(h)
        cached = target.cache.layers[index]
        if hasattr(layer, "linear_attn"):
            mixed, kept[index] = _tree_gated_delta(layer.linear_attn, x[0], cached, layout)
        else:
            mixed, kept[index] = _tree_attention(layer.self_attn, x, cos, sin, layout.visible, cached)
        h = h + mixed
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        if index in target.layers:
            captured[index] = h[0]
    logits = model.get_output_embeddings()(text.norm(h))[0]
    features = torch.cat([captured[layer] for layer in target.layers], dim=-1) if target.layers else None  # L x [n, d] -> [n, L * d]
    return VerifiedTree(logits, features, kept)


@torch.inference_mode()
def commit_path(target: Target, verified: VerifiedTree, rows: Sequence[int]) -> None:
    """Appends these rows (the root, then the accepted nodes by depth) to the cache: their K/V, and
    each GDN layer's conv window and recurrent state after the last of them."""
    index = torch.tensor(list(rows), device=target.device)
    for layer_index, kept in verified.kept.items():
        layer = target.cache.layers[layer_index]
        if isinstance(kept, AttentionRows):
            target.cache.update(kept.key[:, :, index], kept.value[:, :, index], layer_index)
            continue
        window = layer.conv_states[0]  # [1, C, width]
        window.copy_(torch.cat([window[0].T, kept.mixed[index]])[-window.shape[-1]:].T[None])
        _, state = _recurrence(kept.module, kept.query[index][None], kept.key[index][None], kept.value[index][None],
                               kept.g[index][None], kept.beta[index][None], layer.recurrent_states[0])
        layer.recurrent_states[0].copy_(state)
        if getattr(layer, "cumulative_length_linear", None) is not None:
            layer.cumulative_length_linear.add_(len(index))


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
