"""The drafter model: block visibility (no leaks), dense and flex masks agree, the chunked loss
equals the plain one, and the inference entry point agrees with training."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_jobs.spec import anchor_layout
from dflash_jobs.drafter.model import Drafter, DrafterConfig
from dflash_jobs.train.loss import ChunkedLinearCrossEntropy, draft_loss
from dflash_jobs.drafter.masks import TILE, BlockLayout, build_attention, dense_attention, flex_attention_fn, interval_block_mask

WINDOW = 6


def small_config(**overrides) -> DrafterConfig:
    fields = dict(
        hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
        vocab_size=50, target_layer_ids=[1, 3], num_target_layers=6, block_size=4, mask_token_id=49,
        layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW, rope_theta=1e4,
    )
    return DrafterConfig(**{**fields, **overrides})


def random_drafter(config: DrafterConfig, seed: int = 0) -> Drafter:
    torch.manual_seed(seed)
    drafter = Drafter(config)
    V, d = config.vocab_size, config.hidden_size
    drafter.load_target_tensors(torch.randn(V, d), torch.randn(V, d), 1 + 0.1 * torch.randn(d))
    return drafter.eval()


# Two documents packed in one row: doc 0 at context [0, 10), doc 1 at [10, 18).
# Blocks: anchors 3 and 5 in doc 0 (overlapping spans), anchor 4 in doc 1.
DOC_STARTS = [0, 0, 10]
ANCHORS = [3, 5, 4]


def packed_inputs(config: DrafterConfig, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    B = config.block_size
    context_hidden = torch.randn(18, config.context_features, generator=g)
    context_positions = torch.cat([torch.arange(10), torch.arange(8)])
    block_ids = torch.full((3, B), config.mask_token_id)
    block_ids[:, 0] = torch.randint(0, 40, (3,), generator=g)
    block_positions = torch.tensor(ANCHORS)[:, None] + torch.arange(B)
    layout = BlockLayout(
        num_context=18, block_size=B,
        context_start=torch.tensor(DOC_STARTS), anchor=torch.tensor(DOC_STARTS) + torch.tensor(ANCHORS),
        key_positions=torch.cat([context_positions, block_positions.flatten()]),
    )
    return context_hidden, context_positions, block_ids, block_positions, layout


def block_logits(drafter: Drafter, inputs, backend: str = "dense") -> torch.Tensor:
    context_hidden, context_positions, block_ids, block_positions, layout = inputs
    config = drafter.config
    if backend == "dense":
        attention = build_attention(layout, config.layer_types, config.sliding_window, backend="dense")
    else:  # the compiled flex path, traced as on a GPU, its kernels run eagerly: the CPU stand-in
        attention = {
            kind: flex_attention_fn(layout, config.sliding_window if kind == "sliding_attention" else None, backend="aot_eager")
            for kind in set(config.layer_types)
        }
    with torch.no_grad():
        return drafter.logits(drafter(context_hidden, context_positions, block_ids, block_positions, attention))


def reference_visible(q: int, kv: int, *, window: int | None, B: int = 4, C: int = 18) -> bool:
    """The rule of reference/dflash.md 2.4, written out per element."""
    block, slot = divmod(q, B)
    anchor_position = ANCHORS[block]
    if kv < C:
        start = DOC_STARTS[block]
        in_document_before_anchor = start <= kv < start + anchor_position
        key_position = kv - start
        return in_document_before_anchor and (window is None or key_position > anchor_position + slot - window)
    key_block, key_slot = divmod(kv - C, B)
    return key_block == block and (window is None or key_slot <= slot)


@pytest.mark.parametrize("window", [None, WINDOW, 2])
def test_dense_mask_matches_the_rule_and_flex_mask_mod_agrees_elementwise(window):
    layout = packed_inputs(small_config(sliding_window=max(window or WINDOW, 4)))[4]
    dense = layout.dense_mask(window)
    expected = torch.tensor([[reference_visible(q, kv, window=window) for kv in range(layout.num_keys)] for q in range(layout.num_queries)])
    assert torch.equal(dense, expected)
    # flex_attention evaluates the mask_mod on scalar indices under vmap: do the same on the whole grid.
    mask_mod = layout.mask_mod(window)
    zero = torch.tensor(0)
    per_key = torch.vmap(mask_mod, in_dims=(None, None, None, 0))
    grid = torch.vmap(per_key, in_dims=(None, None, 0, None))(zero, zero, torch.arange(layout.num_queries), torch.arange(layout.num_keys))
    assert torch.equal(grid, dense)


def test_flex_attention_equals_dense_attention_on_cpu():
    drafter = random_drafter(small_config())
    inputs = packed_inputs(drafter.config)
    torch.testing.assert_close(block_logits(drafter, inputs, "flex"), block_logits(drafter, inputs, "dense"), atol=1e-5, rtol=1e-5)


def random_layout(generator: torch.Generator, *, context: int, blocks: int, block_size: int = 16) -> BlockLayout:
    """Blocks anchored at random in a context of `context` tokens, as a packed micro-batch has them."""
    start = torch.sort(torch.randint(0, context // 2, (blocks,), generator=generator)).values
    anchor = start + 1 + torch.randint(0, context // 2 - 1, (blocks,), generator=generator)
    positions = torch.cat([torch.arange(context), (anchor[:, None] + torch.arange(block_size)).flatten()])
    return BlockLayout(num_context=context, block_size=block_size, context_start=start, anchor=anchor, key_positions=positions)


def test_compiled_flex_serves_every_micro_batch_shape_from_the_first_graphs():
    """Every micro-batch brings its own numbers of queries and keys. The kernel's graphs serve every
    shape: a graph per new size would stall training for seconds a step on a GPU, and past dynamo's
    recompile limit fall back to flex's unfused path. The CPU runs the same tracing and guards
    (backend aot_eager), with eager kernels."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    generator = torch.Generator().manual_seed(0)
    graphs = []
    for context, blocks in [(397, 31), (220, 21), (461, 36), (444, 27), (498, 18), (458, 13), (344, 12), (586, 11), (516, 21), (301, 40)]:
        layout = random_layout(generator, context=context, blocks=blocks)
        attend = flex_attention_fn(layout, None, backend="aot_eager")
        q = torch.randn(1, 4, layout.num_queries, 8, generator=generator)
        k, v = (torch.randn(1, 2, layout.num_keys, 8, generator=generator) for _ in range(2))
        expected = dense_attention(layout.dense_mask(None))(q, k, v)
        torch.testing.assert_close(attend(q, k, v), expected, atol=1e-5, rtol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    # flex_attention alone is traced (the mask is built from intervals): once, then once more where
    # dynamo makes the BlockMask's lengths symbolic (they are constants of the first graph); never again.
    assert graphs[0] == 1 and graphs[1:] == [2] * (len(graphs) - 1), graphs


def tile_grid(block_mask, *, full: bool) -> torch.Tensor:
    """bool [query tiles, key tiles]: the tiles a BlockMask computes with its mask_mod (partial) or without (full)."""
    count, indices = (block_mask.full_kv_num_blocks, block_mask.full_kv_indices) if full else (block_mask.kv_num_blocks, block_mask.kv_indices)
    grid = torch.zeros(indices.shape[-2], indices.shape[-1], dtype=torch.bool)
    for row, (n, order) in enumerate(zip(count[0, 0].tolist(), indices[0, 0])):
        grid[row, order[:n]] = True
    return grid


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_size", [16, 12])
def test_interval_block_mask_has_the_tiles_create_block_mask_finds(causal, block_size):
    """The tiles from the layout's intervals against create_block_mask's evaluation of `visible` on
    every pair, on layouts of several query and key tiles (blocks anchored at their document's first
    token, blocks straddling tiles): the same full tiles on every complete query tile, the same
    tiles touched; a causal layer may keep a few more as partial (flex masks inside them), never fewer."""
    from torch.nn.attention.flex_attention import create_block_mask

    generator = torch.Generator().manual_seed(block_size)
    for context, blocks in [(700, 40), (1000, 23), (300, 64)]:
        layout = random_layout(generator, context=context, blocks=blocks, block_size=block_size)
        layout.anchor[::7] = layout.context_start[::7]  # nothing to see in the context
        layout = BlockLayout(layout.num_context, block_size, layout.context_start, layout.anchor, layout.key_positions)
        ours = interval_block_mask(layout, causal)
        theirs = create_block_mask(layout.mask_mod(None, causal), None, None, layout.num_queries, layout.num_keys, device="cpu")
        complete = layout.num_queries // TILE
        assert torch.equal(tile_grid(ours, full=True)[:complete], tile_grid(theirs, full=True)[:complete])
        assert not tile_grid(ours, full=True)[complete:].any()
        touched = tile_grid(ours, full=True) | tile_grid(ours, full=False)
        expected = tile_grid(theirs, full=True) | tile_grid(theirs, full=False)
        assert torch.equal(touched & expected, expected)
        if not causal:
            assert torch.equal(touched, expected)
        q = torch.randn(1, 4, layout.num_queries, 8, generator=generator)
        k, v = (torch.randn(1, 2, layout.num_keys, 8, generator=generator) for _ in range(2))
        attend = flex_attention_fn(layout, None, causal=causal, backend="aot_eager")
        torch.testing.assert_close(attend(q, k, v), dense_attention(layout.dense_mask(None, causal))(q, k, v), atol=1e-5, rtol=1e-5)


def test_a_block_sees_nothing_after_its_anchor_nor_other_blocks_nor_other_documents():
    drafter = random_drafter(small_config())
    inputs = packed_inputs(drafter.config)
    base = block_logits(drafter, inputs)[0]  # block 0: doc 0, anchor 3

    def logits_after(change) -> torch.Tensor:
        changed = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
        change(*changed)
        return block_logits(drafter, changed)[0]

    def later_context(hidden, *_):  # the anchor's own state and everything after it in doc 0
        hidden[3:10] += 5.0

    def other_block(hidden, positions, ids, *_):  # block 1 overlaps block 0's positions
        ids[1, 0] = (ids[1, 0] + 1) % 40

    def other_document(hidden, *_):
        hidden[10:] += 5.0

    for change in (later_context, other_block, other_document):
        assert torch.equal(logits_after(change), base), change.__name__

    # Controls: what the block may see does change it.
    def earlier_context(hidden, *_):
        hidden[2] += 5.0

    def own_anchor(hidden, positions, ids, *_):
        ids[0, 0] = (ids[0, 0] + 1) % 40

    for change in (earlier_context, own_anchor):
        assert not torch.allclose(logits_after(change), base), change.__name__


def test_sliding_layers_are_causal_inside_the_block():
    drafter = random_drafter(small_config(layer_types=["sliding_attention"] * 2))
    inputs = packed_inputs(drafter.config)
    base = block_logits(drafter, inputs)[0]
    changed = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
    changed[2][0, 2] = 7  # slot 2 of block 0 stops being a mask token
    after = block_logits(drafter, changed)[0]
    assert torch.equal(after[:2], base[:2])  # slots before it cannot see it
    assert not torch.allclose(after[2:], base[2:])


def test_slot_weights_decay_from_the_first_drafted_slot():
    fill_in = anchor_layout("dflash", block_size=4, gamma=7.0).slot_decay()
    assert fill_in == pytest.approx([0.0, 1.0, math.exp(-1 / 7), math.exp(-2 / 7)])
    from_anchor = anchor_layout("dspark", block_size=4, gamma=4.0).slot_decay()  # the anchor is a prediction slot
    assert from_anchor == pytest.approx([1.0, math.exp(-1 / 4), math.exp(-2 / 4), math.exp(-3 / 4)])


def test_chunked_loss_and_gradient_equal_the_unchunked_computation():
    g = torch.Generator().manual_seed(0)
    N, B, d, V = 5, 4, 16, 37
    hidden = torch.randn(N, B, d, generator=g, dtype=torch.float64, requires_grad=True)
    lm_head = torch.randn(V, d, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N, B), generator=g)
    mask = torch.ones(N, B)
    mask[1, 3] = mask[4, 2:] = 0  # unsupervised labels
    weights = mask * torch.tensor(anchor_layout(block_size=B, gamma=7.0).slot_decay())

    out = draft_loss(hidden, lm_head, labels, weights, chunk_rows=3)
    out.loss.backward()
    chunked_grad = hidden.grad.clone()

    hidden.grad = None
    logits = hidden @ lm_head.T  # [N, B, V], fine at this size
    ce = F.cross_entropy(logits.reshape(-1, V), labels.flatten(), reduction="none").view(N, B)
    reference = (ce * weights).sum() / weights.sum()
    reference.backward()
    torch.testing.assert_close(out.loss, reference.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(chunked_grad, hidden.grad)

    correct = (logits.argmax(-1) == labels) & (weights > 0)
    assert torch.equal(out.correct_per_slot, correct.sum(0))
    assert torch.equal(out.supervised_per_slot, (weights > 0).sum(0))
    assert out.accepted == correct[:, 1:].long().cumprod(1).sum()


def test_chunked_loss_never_builds_full_logits():
    """Chunks of 2 rows over 64 supervised rows: the function sees at most [2, V] logits at a time."""
    seen = []
    hidden = torch.randn(16, 4, 8)
    lm_head = torch.randn(11, 8)

    original = torch.Tensor.logsumexp

    def spy(self, *args, **kwargs):
        seen.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    torch.Tensor.logsumexp = spy
    try:
        ChunkedLinearCrossEntropy.apply(hidden.view(64, 8), lm_head, torch.zeros(64, dtype=torch.long), torch.ones(64), 2)
    finally:
        torch.Tensor.logsumexp = original
    assert seen and max(shape[0] for shape in seen) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_chunk_terms_equal_the_eager_ones(dtype):
    """Training compiles _chunk_terms under train.compile on a GPU; compiled here on the CPU by the
    same Inductor, it gives the eager loss, predictions and hidden-state gradient for chunks of
    several sizes (ragged last chunks among them) and rows of weight 0, and no chunk size compiles
    a second graph."""
    g = torch.Generator().manual_seed(0)
    rows, d, V = 23, 16, 37
    hidden = torch.randn(rows, d, generator=g)
    lm_head = torch.randn(V, d, generator=g).to(dtype)
    labels = torch.randint(0, V, (rows,), generator=g)
    row_weights = torch.rand(rows, generator=g)
    unweighted = torch.tensor([0, 9, 22])
    row_weights[unweighted] = 0
    logits = hidden.to(dtype) @ lm_head.T
    best = logits.amax(-1, keepdim=True)  # bf16 logits tie often: either index of a tied maximum is right

    def loss_predictions_grad(chunk_rows, fused):
        h = hidden.clone().requires_grad_()
        loss, predictions = ChunkedLinearCrossEntropy.apply(h, lm_head, labels, row_weights, chunk_rows, None, fused)
        loss.backward()
        return loss, predictions, h.grad

    # Compiled first on two chunks, as training's micro-batches always are: on a single chunk, the
    # compiler would tie the chunk's row count to the whole label tensor's it is a view of.
    loss_predictions_grad(16, fused=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for chunk_rows in (4, 7, 10, rows):  # row counts 4 and 3, 7 and 2, 10 and 3, 23
            fused_loss, fused_predictions, fused_grad = loss_predictions_grad(chunk_rows, fused=True)
            eager_loss, eager_predictions, eager_grad = loss_predictions_grad(chunk_rows, fused=False)
            torch.testing.assert_close(fused_loss, eager_loss)
            assert torch.equal(logits.gather(-1, fused_predictions[:, None]), best)
            assert torch.equal(logits.gather(-1, eager_predictions[:, None]), best)
            torch.testing.assert_close(fused_grad, eager_grad)
            assert fused_grad.abs().sum() > 0 and not fused_grad[unweighted].any()


def test_draft_block_agrees_with_the_training_forward():
    """The inference entry point (one block after the whole context) equals the training view."""
    config = small_config()
    drafter = random_drafter(config)
    C, B = 9, config.block_size
    context_hidden = torch.randn(1, C, config.context_features)
    positions = torch.arange(C)
    anchor_token = 17
    drafted = drafter.draft_block(context_hidden, positions, anchor_token, C)

    block_ids = torch.full((1, B), config.mask_token_id)
    block_ids[0, 0] = anchor_token
    block_positions = C + torch.arange(B)[None]
    layout = BlockLayout(C, B, torch.tensor([0]), torch.tensor([C]), torch.cat([positions, block_positions[0]]))
    attention = build_attention(layout, config.layer_types, config.sliding_window, backend="dense")
    with torch.no_grad():
        logits = drafter.logits(drafter(context_hidden[0], positions, block_ids, block_positions, attention))
    assert drafted.shape == (B - 1,)
    assert torch.equal(drafted, logits[0, 1:].argmax(-1))


def test_a_drafter_refuses_captured_layers_out_of_ascending_order():
    """vLLM concatenates the captured layers in ascending order: fc must have been trained on that order."""
    with pytest.raises(ValueError, match=r"target_layer_ids \[3, 1\] must be distinct and ascending"):
        small_config(target_layer_ids=[3, 1])


def test_the_final_norm_is_the_drafters_own_trained_from_one_and_the_targets_is_kept_apart():
    """SpecForge's DFlashDraftModel trains its own final norm, initialised to 1 (reference/dflash.md
    2.2); the target's final norm is kept only to read the target's distribution (DSpark)."""
    from dflash_jobs.spec import TrainSpec
    from dflash_jobs.train.optim import build_optimizer

    config = small_config()
    drafter = random_drafter(config)
    target_norm = 1 + 0.1 * torch.randn(config.hidden_size, generator=torch.Generator().manual_seed(0))
    drafter.load_target_tensors(drafter.embed_tokens, drafter.lm_head, target_norm)
    assert torch.equal(drafter.norm.weight.detach(), torch.ones(config.hidden_size)) and drafter.norm.weight.requires_grad
    assert torch.equal(drafter.target_norm, target_norm)
    assert "norm.weight" in drafter.state_dict() and "target_norm" not in drafter.state_dict()  # checkpointed and exported: the drafter's own

    optimizer = build_optimizer(drafter, TrainSpec(), device=torch.device("cpu"))
    assert any(p is drafter.norm.weight for group in optimizer.param_groups for p in group["params"])
    context_hidden, context_positions, block_ids, block_positions, layout = packed_inputs(config)
    attention = build_attention(layout, config.layer_types, config.sliding_window, backend="dense")
    hidden = drafter.train()(context_hidden, context_positions, block_ids, block_positions, attention)
    labels = torch.randint(0, 40, block_ids.shape, generator=torch.Generator().manual_seed(2))
    weights = torch.tensor(anchor_layout(block_size=config.block_size, gamma=7.0).slot_decay()).expand(block_ids.shape)
    draft_loss(hidden, drafter.lm_head, labels, weights).loss.backward()
    optimizer.step()
    assert not torch.equal(drafter.norm.weight.detach(), torch.ones(config.hidden_size)), "the final norm learns"
    assert torch.equal(drafter.target_norm, target_norm)
