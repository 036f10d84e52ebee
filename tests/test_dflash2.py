"""The DFlash2 drafter on tiny shapes: its modules start as no-ops (a DFlash's weights give DFlash's
hidden states and drafts), the convolution is the reference formula and resets at every block, its
layers are bidirectional inside the block, the objective equals a direct computation (loss and
gradients, gold misses skipped), and the teacher-forced prediction is the decoded walk's."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dflash_jobs.drafter.dflash2_model import CandidateSelector, DFlash2Config, DFlash2Drafter, GroupedDynamicCausalConv
from dflash_jobs.drafter.masks import build_attention
from dflash_jobs.drafter.model import Drafter, DrafterConfig
from dflash_jobs.train.dflash2_loss import dflash2_objective, teacher_forced_predecessors
from dflash_jobs.train.loss import draft_loss
from dflash_jobs.variants import drafter_variant
from test_drafter import packed_inputs

DFLASH2_MODULES = ("attention_conv", "mlp_conv", "candidate_selector")


def small_config(**overrides) -> DFlash2Config:
    fields = dict(
        hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
        vocab_size=50, target_layer_ids=[1, 3], num_target_layers=6, block_size=4, mask_token_id=49,
        layer_types=["sliding_attention", "full_attention"], sliding_window=6, rope_theta=1e4,
        conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=5,
    )
    return DFlash2Config(**{**fields, **overrides})


def with_target_tensors(drafter, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    V, d = drafter.config.vocab_size, drafter.config.hidden_size
    drafter.load_target_tensors(torch.randn(V, d, generator=g), torch.randn(V, d, generator=g), 1 + 0.1 * torch.randn(d, generator=g))
    return drafter.eval()


def trained_like(drafter: DFlash2Drafter, seed: int = 1) -> DFlash2Drafter:
    """Every DFlash2 module moved off its no-op start, as training leaves it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            if any(module in name for module in DFLASH2_MODULES):
                parameter.copy_(torch.randn(parameter.shape, generator=g) * (0.3 if "codebook" in name else 0.1))
            if name.endswith("base_kernel"):
                parameter[:, 0] += 1.0
    return drafter


def block_hidden(drafter, inputs) -> torch.Tensor:
    context_hidden, context_positions, block_ids, block_positions, layout = inputs
    config = drafter.config
    attention = build_attention(layout, config.layer_types, config.sliding_window, backend="dense", is_causal=config.is_causal)
    with torch.no_grad():
        return drafter(context_hidden, context_positions, block_ids, block_positions, attention)


# ---- the model ---------------------------------------------------------------------------------


def test_a_fresh_dflash2_starts_its_modules_as_no_ops():
    drafter = DFlash2Drafter(small_config())
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            assert torch.equal(conv.base_kernel[:, 0], torch.ones(2, 32)) and not conv.base_kernel[:, 1:].any()
            assert not conv.kernel_projection.weight.any()
    selector = drafter.candidate_selector
    assert not selector.successor_codebook.any()
    assert selector.predecessor_codebook.std() > 0.01 and selector.hidden_projection.weight.std() > 0.01  # these learn once B moves


def test_a_dflash2_holding_a_dflash_drafters_weights_computes_its_hidden_states_and_drafts():
    """The warm start: DFlash at the same block size, bidirectional layers (as DFlash2's) -> exactly DFlash."""
    config = small_config(layer_types=["full_attention"] * 2)
    torch.manual_seed(0)
    dflash = with_target_tensors(Drafter(DrafterConfig(**{k: v for k, v in dataclasses.asdict(config).items() if k in DrafterConfig.__dataclass_fields__} | {"is_causal": None})))
    dflash2 = DFlash2Drafter(config)
    missing, unexpected = dflash2.load_state_dict(dflash.state_dict(), strict=False)
    assert unexpected == [] and missing and all(any(module in name for module in DFLASH2_MODULES) for name in missing)
    dflash2.load_target_tensors(dflash.embed_tokens, dflash.lm_head, dflash.norm.weight.detach())
    dflash2.eval()

    inputs = packed_inputs(config)
    assert torch.equal(block_hidden(dflash2, inputs), block_hidden(dflash, inputs))
    context = torch.randn(1, 9, config.context_features, generator=torch.Generator().manual_seed(2))
    for anchor in (3, 17, 41):
        assert torch.equal(dflash2.draft_block(context, torch.arange(9), anchor, 9), dflash.draft_block(context, torch.arange(9), anchor, 9))
    # Trained, the modules do change the computation: the no-op above is their start, not their nature.
    assert not torch.allclose(block_hidden(trained_like(dflash2), inputs), block_hidden(dflash, inputs))


def reference_convolution(x, delta, base, block_size, group_size):
    """conv(x, delta, base)[i, c] = sum_t (base[t, c] + delta[i, t, c // group_size]) * x[i - t, c], terms before i's block left out."""
    Q, d = x.shape
    out = torch.zeros_like(x)
    for i in range(Q):
        for t in range(base.shape[0]):
            if i % block_size >= t:
                for c in range(d):
                    out[i, c] += (base[t, c] + delta[i, t, c // group_size]) * x[i - t, c]
    return out


def test_the_convolution_is_the_reference_formula_and_resets_at_every_block():
    torch.manual_seed(0)
    B, d, group = 4, 12, 4
    conv = GroupedDynamicCausalConv(d, kernel_size=3, group_size=group, block_size=B)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(1, 3 * B, d, dtype=torch.float64)
    conv = conv.double()
    with torch.no_grad():
        y, delta = conv.prepare(x)
        out = conv.finish(y * 2.0, delta)
        projected = conv.kernel_projection(x[0]).view(3 * B, 2, 3, d // group)
        expected_y = reference_convolution(x[0], projected[:, 0], conv.base_kernel[0], B, group)
        torch.testing.assert_close(y[0], expected_y)
        torch.testing.assert_close(out[0], reference_convolution(expected_y * 2.0, projected[:, 1], conv.base_kernel[1], B, group))

        # Slot 1 of block 1 (row 5) changed: prepare reaches slots 1-3 of its block, and nothing
        # after the block's end, where a convolution without the reset would carry it on.
        changed = x.clone()
        changed[0, 5] += 1.0
        y_changed, delta_changed = conv.prepare(changed)
        moved = (conv.finish(y_changed, delta_changed) != conv.finish(y, delta)).any(-1)[0]
        assert moved.nonzero().flatten().tolist() == [5, 6, 7]


@pytest.mark.parametrize("is_causal", [True, False])
def test_a_changed_slot_reaches_only_its_own_block_and_never_earlier_slots_through_the_convolution(is_causal):
    """Changing slot 2 of block 0 changes nothing in the other blocks (the convolution resets at
    every block of the packed row); with causal layers, nothing before it either. DFlash2's own
    layers are bidirectional (is_causal false): there the earlier slots of the block do see it."""
    drafter = with_target_tensors(trained_like(DFlash2Drafter(small_config(is_causal=is_causal))))
    inputs = packed_inputs(drafter.config)
    base = block_hidden(drafter, inputs)
    changed = list(inputs)
    changed[2] = inputs[2].clone()
    changed[2][0, 2] = 7  # slot 2 of block 0 stops being a mask token
    after = block_hidden(drafter, changed)
    assert torch.equal(after[1:], base[1:])
    assert not torch.allclose(after[0, 2:], base[0, 2:])
    if is_causal:
        assert torch.equal(after[0, :2], base[0, :2])
    else:
        assert not torch.allclose(after[0, :2], base[0, :2])


def test_bidirectional_sliding_layers_see_the_whole_block_and_keep_their_window_on_the_context():
    layout = packed_inputs(small_config())[4]
    bidirectional = layout.dense_mask(6, causal=False)
    C = layout.num_context
    assert torch.equal(bidirectional[:, C:], layout.dense_mask(None)[:, C:])  # the block part: full attention's
    assert torch.equal(bidirectional[:, :C], layout.dense_mask(6)[:, :C])  # the context part: the window's
    assert not torch.equal(bidirectional, layout.dense_mask(6))  # and DFlash's sliding layers stay causal
    assert torch.equal(layout.dense_mask(6), layout.dense_mask(6, causal=True))


# ---- the selector and the objective ----------------------------------------------------------------


def selector_case():
    """A hand-built batch: 3 blocks of 4 slots, a vocabulary of 13, candidates K=3. The labels are
    placed by rank in the drafter's logits: slot (0,1) top-1, (0,2) second, (0,3) third, (1,1) a
    miss (rank 6), (1,2) top-1, (1,3) second, (2,1) a miss (last), (2,2) unsupervised, (2,3) third."""
    g = torch.Generator().manual_seed(4)
    N, B, d, V, K, r = 3, 4, 8, 13, 3, 5
    hidden = torch.randn(N, B, d, generator=g)
    lm_head = torch.randn(V, d, generator=g)
    order = (hidden @ lm_head.T).argsort(-1, descending=True)  # [N, B, V]
    ranks = [[0, 0, 1, 2], [0, 6, 0, 1], [0, 12, 0, 2]]
    labels = torch.tensor([[int(order[n, k, ranks[n][k]]) for k in range(B)] for n in range(N)])
    block_ids = torch.full((N, B), V - 1)
    block_ids[:, 0] = labels[:, 0]  # slot 0's label is the anchor itself
    mask = torch.ones(N, B)
    mask[:, 0] = 0
    mask[2, 2] = 0
    weights = mask * torch.exp(-(torch.arange(B) - 1).clamp(min=0) / 7.0)
    selector = CandidateSelector(d, V, r, K)
    with torch.no_grad():
        selector.successor_codebook.normal_(generator=g)
        selector.predecessor_codebook.normal_(generator=g)
        selector.hidden_projection.weight.normal_(generator=g)
    return hidden, lm_head, labels, block_ids, weights, selector, K


def objective_stand_ins(lm_head, selector, K, *, alpha, stop_gradient):
    config = SimpleNamespace(selector_top_k=K, selector_alpha=alpha, selector_stop_gradient=stop_gradient)
    return SimpleNamespace(config=config, candidate_selector=selector, lm_head=lm_head)


@pytest.mark.parametrize("stop_gradient", [False, True])
def test_the_objective_is_dflash_plus_the_selector_cross_entropy_over_the_strict_top_k_without_gold_misses(stop_gradient):
    hidden, lm_head, labels, block_ids, weights, selector, K = selector_case()
    alpha = 0.7
    h = hidden.clone().requires_grad_()
    batch = SimpleNamespace(labels=labels, loss_weights=weights, block_ids=block_ids)
    out = dflash2_objective(objective_stand_ins(lm_head, selector, K, alpha=alpha, stop_gradient=stop_gradient), h, batch, normalizer=None, fused=False)
    out.loss.backward()
    got = {"hidden": h.grad, **{name: p.grad.clone() for name, p in selector.named_parameters()}}
    selector.zero_grad()

    # The reference, written out: full logits, the strict top-K, teacher-forced predecessors.
    h = hidden.clone().requires_grad_()
    logits = h @ lm_head.T  # [N, B, V]
    unary_ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    selector_input = h.detach() if stop_gradient else h
    selector_logits = selector_input @ lm_head.T
    unary, candidates = selector_logits.topk(K, dim=-1)  # [N, B, K]
    before = torch.cat([block_ids[:, :1], block_ids[:, :1], labels[:, 1:-1]], dim=1)
    assert before[0].tolist() == [labels[0, 0], labels[0, 0], labels[0, 1], labels[0, 2]]
    A, Bc, P = selector.predecessor_codebook, selector.successor_codebook, selector.hidden_projection.weight
    scores = unary + torch.einsum("nbr,nbkr->nbk", A[before] * (selector_input @ P.T), Bc[candidates])
    in_top_k = candidates == labels[..., None]
    covered = in_top_k.any(-1)
    assert covered.tolist() == [[True, True, True, True], [True, False, True, True], [True, False, True, True]]
    selector_ce = F.cross_entropy(scores.flatten(0, 1), in_top_k.long().argmax(-1).flatten(), reduction="none").view_as(labels)
    reference = ((weights * unary_ce).sum() + alpha * (weights * covered * selector_ce).sum()) / weights.sum()
    reference.backward()
    expected = {"hidden": h.grad, **{name: p.grad for name, p in selector.named_parameters()}}

    torch.testing.assert_close(out.loss, reference, rtol=1e-5, atol=1e-6)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
    if stop_gradient:  # the backbone's gradient is DFlash's alone
        h = hidden.clone().requires_grad_()
        draft_loss(h, lm_head, labels, weights).loss.backward()
        torch.testing.assert_close(got["hidden"], h.grad)

    # The figures, over supervised slots: 8 supervised, 6 with the gold among the candidates.
    supervised = weights > 0
    chosen = candidates.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
    right = (chosen == labels) & supervised
    ratios = {name: (float(n), float(d)) for name, (n, d) in out.ratios.items()}
    torch.testing.assert_close(out.ratios["selector_loss"][0] / out.ratios["selector_loss"][1], (weights * covered * selector_ce).sum() / (weights * covered).sum())
    assert ratios["top_k_recall"] == (6.0, 8.0)
    assert ratios["unary_accuracy"] == (float(((candidates[..., 0] == labels) & supervised).sum()), 6.0) == (2.0, 6.0)
    assert ratios["selector_accuracy"] == (float(right.sum()), 6.0)
    assert torch.equal(out.correct_per_slot, right.sum(0)) and torch.equal(out.supervised_per_slot, supervised.sum(0))
    assert int(out.accepted) == int(right[:, 1:].long().cumprod(1).sum())


def test_the_objective_divides_by_the_global_normalizer_under_ddp():
    hidden, lm_head, labels, block_ids, weights, selector, K = selector_case()
    batch = SimpleNamespace(labels=labels, loss_weights=weights, block_ids=block_ids)
    stand_ins = objective_stand_ins(lm_head, selector, K, alpha=1.0, stop_gradient=False)
    own = dflash2_objective(stand_ins, hidden, batch, normalizer=None, fused=False).loss
    doubled = dflash2_objective(stand_ins, hidden, batch, normalizer=2 * weights.sum(), fused=False).loss
    torch.testing.assert_close(doubled, own / 2)


def test_the_teacher_forced_prediction_is_the_decoded_walk_while_its_drafts_are_right():
    drafter = with_target_tensors(trained_like(DFlash2Drafter(small_config())))
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.mul_(20)  # a selector strong enough to overrule the unary ranking
    hidden = torch.randn(6, 4, 32, generator=torch.Generator().manual_seed(5))
    anchors = torch.arange(6) * 7
    walks = torch.stack([drafter.block_drafts(hidden[n], int(anchors[n])) for n in range(6)])  # [N, B-1]
    assert not torch.equal(walks, drafter.greedy_tokens(hidden[:, 1:]))  # the selector does choose

    # Teacher forced with the walk's own tokens as labels: every slot's choice is the walk's.
    labels = torch.cat([anchors[:, None], walks], dim=1)
    block_ids = torch.full((6, 4), 49)
    block_ids[:, 0] = anchors
    batch = SimpleNamespace(block_ids=block_ids, labels=labels)
    predicted = drafter_variant("dflash2").predict(drafter, hidden, batch)
    assert torch.equal(predicted[:, 1:], walks)
    # With other labels, a slot's choice follows its given predecessor, not the walk's.
    batch.labels = torch.cat([anchors[:, None], (walks + 1) % 40], dim=1)
    assert not torch.equal(drafter_variant("dflash2").predict(drafter, hidden, batch)[:, 2:], walks[:, 1:])


def test_predecessors_are_the_anchor_then_the_labels_before_each_slot():
    block_ids = torch.tensor([[5, 9, 9, 9]])
    labels = torch.tensor([[5, 11, 12, 13]])
    assert teacher_forced_predecessors(block_ids, labels).tolist() == [[5, 5, 11, 12]]


def test_extra_flops_grow_with_the_slots_and_supervised_slots():
    config = small_config()
    flops = drafter_variant("dflash2").extra_flops
    assert drafter_variant("dflash").extra_flops(config, 100, 80) == 0.0
    assert 0 < flops(config, 100, 80) < flops(config, 200, 80) and flops(config, 100, 80) < flops(config, 100, 90)
