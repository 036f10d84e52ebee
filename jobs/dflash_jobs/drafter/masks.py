"""Which keys each block query may attend to (reference/dflash.md section 2.4).

Keys are laid out as [context (C target positions) | blocks (N blocks of B slots)], queries as the
N x B block slots. Query (n, j) sees:
- context index g iff g lies in its document before its anchor: context_start[n] <= g < anchor[n]
  (strict: the anchor's own hidden state is not known at inference);
- block slot (n', j') iff n' == n; a causal layer only the slots up to its own (j' <= j). Unless
  the drafter states its causality (the exported `is_causal`, which then holds for every layer),
  sliding-window layers are causal and full-attention layers bidirectional: vLLM's rule when the
  key is absent;
- on sliding-window layers only keys whose position is within the window: pos >= qpos - (W - 1),
  FlashAttention's (W - 1, 0) window as vLLM serves it.

One function, `visible`, states this rule on index tensors. The dense mask (CPU) evaluates it on a
broadcast grid and flex_attention (GPU) calls it as its mask_mod, so both paths see the same mask.
Which of flex's tiles hold a visible key (its BlockMask) follows from the layout's intervals for a
full-attention layer (`interval_block_mask`), without evaluating the rule on every query and key.
Training packs many blocks; inference drafts one block after all of its context
(`one_block_attention`), the same rule with N = 1.

Like model.py, this module imports torch only: the export carries it beside the model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(q [b, heads, Q, hd], k and v [b, kv_heads, K, hd]) -> [b, heads, Q, hd]."""


@dataclass
class BlockLayout:
    """Where the blocks of one packed micro-batch sit relative to the context."""

    num_context: int
    block_size: int
    context_start: torch.Tensor  # int64 [N]: context index of the first token of the block's document
    anchor: torch.Tensor  # int64 [N]: context index of the anchor token (its document's start + anchor position)
    key_positions: torch.Tensor  # int64 [C + N*B]: RoPE positions of every key (context, then block slots)

    def __post_init__(self) -> None:
        # Per-query and per-key lookup tables: `visible` is then gathers and comparisons only, which
        # flex_attention's compiler handles well (no division of symbolic indices).
        C, B, device = self.num_context, self.block_size, self.anchor.device
        slots = torch.arange(self.num_queries, device=device)  # block slots, as queries and as keys
        self._q_block, self._q_slot = slots // B, slots % B
        self._q_start, self._q_anchor = self.context_start[self._q_block], self.anchor[self._q_block]
        self._q_position = self.key_positions[C:]
        self._k_block = torch.cat([torch.full((C,), -1, device=device), self._q_block])  # -1: a context key
        self._k_slot = torch.cat([torch.zeros(C, dtype=torch.long, device=device), self._q_slot])

    @property
    def num_blocks(self) -> int:
        return self.context_start.shape[0]

    @property
    def num_queries(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_keys(self) -> int:
        return self.num_context + self.num_queries

    def visible(self, q_idx: torch.Tensor, kv_idx: torch.Tensor, sliding_window: int | None, causal: bool | None = None) -> torch.Tensor:
        """True where query q_idx may attend to key kv_idx (broadcasting index tensors). causal:
        whether a slot sees only the slots up to its own; None: causal iff sliding (see above)."""
        # Context keys: in the query's document, before its anchor (anchors are context indices, so
        # no block key ever passes this test).
        context_ok = (kv_idx >= self._q_start[q_idx]) & (kv_idx < self._q_anchor[q_idx])
        block_ok = self._k_block[kv_idx] == self._q_block[q_idx]
        if layer_causal(sliding_window, causal):
            block_ok = block_ok & (self._k_slot[kv_idx] <= self._q_slot[q_idx])
        if sliding_window is not None:
            context_ok = context_ok & (self.key_positions[kv_idx] > self._q_position[q_idx] - sliding_window)
        return context_ok | block_ok

    def mask_mod(self, sliding_window: int | None, causal: bool | None = None):
        """`visible` in flex_attention's mask_mod signature."""

        def mask_mod(b, h, q_idx, kv_idx):
            return self.visible(q_idx, kv_idx, sliding_window, causal)

        return mask_mod

    def dense_mask(self, sliding_window: int | None, causal: bool | None = None) -> torch.Tensor:
        """bool [N*B, C + N*B]; memory grows with queries x keys, so for CPU and small batches."""
        device = self.anchor.device
        q_idx = torch.arange(self.num_queries, device=device)[:, None]
        kv_idx = torch.arange(self.num_keys, device=device)[None, :]
        return self.visible(q_idx, kv_idx, sliding_window, causal)


def layer_causal(sliding_window: int | None, causal: bool | None) -> bool:
    """A layer's causality inside the block: as stated, else causal iff it has a sliding window."""
    return sliding_window is not None if causal is None else causal


def dense_attention(mask: torch.Tensor) -> AttentionFn:
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return attend


@functools.cache
def compiled_flex(backend: str = "inductor"):
    """(create_block_mask, flex_attention), each compiled once for every shape. Every micro-batch
    brings its own numbers of queries and keys: dynamic=True traces one shape-generic graph where
    automatic dynamic shapes would compile a static one first and recompile on a later size."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return torch.compile(create_block_mask, dynamic=True, backend=backend), torch.compile(flex_attention, dynamic=True, backend=backend)


TILE = 128
"""flex_attention's tile (its BlockMask's BLOCK_SIZE), queries and keys alike."""


def interval_block_mask(layout: BlockLayout, causal: bool | None = None):
    """The BlockMask of a full-attention layer from the layout's intervals: each query slot sees the
    context keys [start, anchor) of its block and its own block's slots, so the tiles it touches
    are two ranges, marked on a [query tiles, key tiles] grid by a difference array. A tile is full
    (every query of a complete query tile sees every key) only where every slot's context interval
    covers it. create_block_mask finds the same tiles by evaluating `visible` on every (query, key)
    pair: at 2,048 blocks of 16 against 16K context, 7.8 ms of a 43 ms training step on an H100
    (bench/results/online-scale-h100.json); this is a few small kernels over the tiles, no host read.
    Tiles of a causal block's later slots are kept as partial: flex applies `visible` inside them."""
    from torch.nn.attention.flex_attention import BlockMask

    C, B, Q, K, device = layout.num_context, layout.block_size, layout.num_queries, layout.num_keys, layout.anchor.device
    q_tiles, k_tiles = -(-Q // TILE), -(-K // TILE)
    slots = torch.arange(Q, device=device)
    q_tile, block = slots // TILE, slots // B
    start, anchor = layout.context_start[block], layout.anchor[block]
    seen = (anchor > start).int()  # a block anchored at its document's first token sees no context
    own = C + block * B  # the first key of the slot's own block
    marks = torch.zeros(q_tiles, k_tiles + 1, dtype=torch.int32, device=device)
    for first, last, weight in ((start // TILE, (anchor - 1).clamp(min=0) // TILE, seen), (own // TILE, (own + B - 1) // TILE, torch.ones_like(seen))):
        marks.index_put_((q_tile, first), weight, accumulate=True)
        marks.index_put_((q_tile, last + 1), -weight, accumulate=True)
    touched = marks.cumsum(dim=1)[:, :k_tiles] > 0
    # Full context tiles of a slot: [ceil(start / TILE), floor(anchor / TILE)); of a query tile, the
    # intersection over its slots; the last query tile only if it is complete.
    low = torch.zeros(q_tiles, dtype=torch.long, device=device).scatter_reduce(0, q_tile, -(-start // TILE), "amax", include_self=False)
    high = torch.zeros(q_tiles, dtype=torch.long, device=device).scatter_reduce(0, q_tile, anchor // TILE, "amin", include_self=False)
    complete = (torch.arange(q_tiles, device=device) + 1) * TILE <= Q
    k_tile = torch.arange(k_tiles, device=device)
    full = (k_tile >= low[:, None]) & (k_tile < high[:, None]) & complete[:, None]
    partial = touched & ~full

    def indexed(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = tiles.sum(dim=1, dtype=torch.int32)
        order = torch.argsort(tiles.to(torch.int8), dim=1, descending=True, stable=True).to(torch.int32)
        return count[None, None], order[None, None]

    return BlockMask.from_kv_blocks(*indexed(partial), *indexed(full), BLOCK_SIZE=TILE, mask_mod=layout.mask_mod(None, causal), seq_lengths=(Q, K))


def flex_attention_fn(layout: BlockLayout, sliding_window: int | None, *, causal: bool | None = None, backend: str = "inductor") -> AttentionFn:
    """flex_attention over a BlockMask of `visible`: only the tiles that hold a visible key are
    computed, which is what makes 512 blocks x 16 slots against 4K context affordable. The kernel
    is compiled (uncompiled, flex runs its unfused path, a [heads, queries, keys] fp32 score
    tensor); the mask of a full-attention layer comes from the layout's intervals, a sliding
    layer's (its window depends on the keys' positions) from create_block_mask, compiled (uncompiled,
    it materialises [queries, keys])."""
    make_block_mask, kernel = compiled_flex(backend)
    if sliding_window is None:
        block_mask = interval_block_mask(layout, causal)
    else:
        block_mask = make_block_mask(layout.mask_mod(sliding_window, causal), None, None, layout.num_queries, layout.num_keys, device=layout.anchor.device)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return kernel(q, k, v, block_mask=block_mask, enable_gqa=True)

    return attend


def one_block_attention(key_positions: torch.Tensor, block_size: int, sliding_window: int | None, causal: bool | None = None, *,
                        context_length: torch.Tensor | None = None) -> AttentionFn:
    """Dense attention of one block over all of its context: keys are [context | block], with RoPE
    positions `key_positions` [K]; the block is the last `block_size` of them. context_length: a
    device scalar where only the context's first so many keys are real, the rest padding it never
    sees (a context padded to a fixed size, as a replayed CUDA graph reads it); None: all of them."""
    device = key_positions.device
    num_context = len(key_positions) - block_size
    anchor = torch.full((1,), num_context, dtype=torch.long, device=device) if context_length is None else context_length.view(1)
    layout = BlockLayout(
        num_context=num_context, block_size=block_size,
        context_start=torch.zeros(1, dtype=torch.long, device=device),
        anchor=anchor,
        key_positions=key_positions,
    )
    return dense_attention(layout.dense_mask(sliding_window, causal))


def build_attention(
    layout: BlockLayout, layer_types: list[str], sliding_window: int, *, backend: str, is_causal: bool | None = None
) -> dict[str, AttentionFn]:
    """One attention function per layer type present: "dense" (SDPA + bool mask) or "flex".
    is_causal: the drafter's stated causality (DrafterConfig.is_causal); None: causal iff sliding."""
    functions = {}
    for layer_type in sorted(set(layer_types)):
        window = sliding_window if layer_type == "sliding_attention" else None
        if backend == "flex":
            functions[layer_type] = flex_attention_fn(layout, window, causal=is_causal)
        elif backend == "dense":
            functions[layer_type] = dense_attention(layout.dense_mask(window, is_causal))
        else:
            raise ValueError(f"attention backend {backend!r}: expected 'dense' or 'flex'")
    return functions
