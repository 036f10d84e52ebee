"""DSpark (reference/dflash2-dspark.md section 4): its spec, its block layout, its objective against a
direct computation, its heads, its left-to-right drafting, its two exports (DeepSpec's flat layout,
loaded by AutoModel in a fresh process, and speculators'), and lossless decoding with the
confidence head's calibration recorded."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dflash_jobs.drafter.checkpoint import TargetCheckpoint
from dflash_jobs.drafter.dspark_export import DSPARK_MODELING_FILES, export_dspark
from dflash_jobs.drafter.dspark_model import DSparkConfig, DSparkDrafter
from dflash_jobs.drafter.export import load_drafter
from dflash_jobs.drafter.masks import BlockLayout, build_attention
from dflash_jobs.drafter.speculative import DecodeTarget, greedy_decode, speculative_decode
from dflash_jobs.errors import SpecError
from dflash_jobs.evaluate.calibration import ConfidenceRecorder, recorder_for, summarize_calibration
from dflash_jobs.drafter.speculative import Decoded
from dflash_jobs.formats import TokenChunk, encode_hidden_chunk
from dflash_jobs.spec import anchor_layout, parse_spec
from dflash_jobs.storage import open_storage
from dflash_jobs.train.chunks import ChunkData
from dflash_jobs.train.data import BatchBuilder, DocumentRef
from dflash_jobs.train.dspark_loss import ChunkedMarkovDistillation, _fused_markov_chunk_terms, _markov_chunk_terms, dspark_objective
from dflash_jobs.variants import drafter_variant
from train_fixtures import LAYERS, fresh_drafter

USER_PROCESS = Path(__file__).with_name("deepspec_user_process.py")
V, D, RANK = 37, 16, 5


def minimal_spec(**train) -> dict:
    return {"name": "dspark", "backend": "local", "target": {"model": "/m"}, "data": {"source": "/d.jsonl"}, "output": "/o", "train": {"drafter": "dspark", **train}}


# ---- the spec ----------------------------------------------------------------------------------


def test_dspark_gets_deepspecs_weights_and_ce_only_its_own():
    settings = parse_spec(minimal_spec()).train.dspark
    assert (settings.ce_weight, settings.l1_weight, settings.confidence_weight, settings.confidence_head) == (0.1, 0.9, 1.0, True)
    spec = parse_spec(minimal_spec(dspark={"ce_only": True}))
    settings = spec.train.dspark
    assert (settings.ce_weight, settings.l1_weight, settings.confidence_weight, settings.confidence_head) == (1.0, 0.0, 0.0, False)
    assert not spec.train.reads_final_hidden and not spec.stores_final_hidden
    assert parse_spec(spec.to_dict()) == spec  # run.yaml holds the resolved weights, and reads back the same
    no_head = parse_spec(minimal_spec(dspark={"confidence_weight": 0})).train
    assert no_head.reads_final_hidden and not no_head.dspark.confidence_head  # the L1 term still reads the target


@pytest.mark.parametrize("settings, field, fix", [
    ({"ce_only": True, "l1_weight": 0.9}, "train.dspark.l1_weight", "ce_only: false"),
    ({"ce_only": True, "confidence_weight": 1.0}, "train.dspark.confidence_weight", "ce_only: false"),
    ({"l1_weight": 0, "confidence_weight": 0}, "train.dspark.l1_weight/confidence_weight", "train.dspark.ce_only: true"),
    ({"ce_weight": 0, "l1_weight": 0}, "train.dspark.ce_weight/l1_weight", "nothing else trains the drafted tokens"),
    ({"ce_only": True, "ce_weight": 0}, "train.dspark.ce_weight/l1_weight", "nothing else trains the drafted tokens"),
    ({"l1_weight": -0.5}, "train.dspark.l1_weight", "a number >= 0"),
    ({"markov_rank": 0}, "train.dspark.markov_rank", "an integer >= 1"),
])
def test_contradictory_dspark_settings_are_refused_naming_the_fix(settings, field, fix):
    with pytest.raises(SpecError) as refused:
        parse_spec(minimal_spec(dspark=settings))
    assert refused.value.field == field and fix in str(refused.value)


# ---- the block layout --------------------------------------------------------------------------


def test_labels_are_one_ahead_and_only_the_leading_supervised_run_of_a_block_weighs():
    """DeepSpec's build_eval_mask: slot k's label is x[a + k + 1], supervised while every label up to
    it is (a later supervised label after a gap does not count), and nothing past the document."""
    ids = np.arange(100, 114, dtype=np.int32)
    mask = np.array([0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1], dtype=np.uint8)
    tokens = TokenChunk(input_ids=ids, loss_mask=mask, cu_seqlens=np.array([0, 14]), sample_ids=np.array([0])).validate("hand-made")
    encoded = encode_hidden_chunk(tokens, torch.randn(14, 2, 4).to(torch.bfloat16), layers=[1, 2], model="m", config_hash="h")
    builder = BatchBuilder(layout=anchor_layout("dspark", block_size=4), anchors=64, mask_token_id=999, seed=0, layers=[1, 2])
    batch = builder.build([DocumentRef(0, 0, 0, 14)], {0: ChunkData.from_bytes(encoded, "hand-made")}, epoch=0)
    decay = [math.exp(-k / 4) for k in range(4)]
    blocks = {int(a): n for n, a in enumerate(batch.layout.anchor)}
    expected = {  # anchor: (labels, which slots weigh)
        3: ([104, 105, 106, 107], [1, 1, 1, 1]),
        6: ([107, 108, 109, 110], [1, 0, 0, 0]),  # labels 8 and 9 are the user's turn: 10 is supervised but after the gap
        12: ([113, 0, 0, 0], [1, 0, 0, 0]),  # past the document's end
    }
    for anchor, (labels, weighs) in expected.items():
        n = blocks[anchor]
        assert batch.block_ids[n].tolist() == [100 + anchor, 999, 999, 999]
        assert batch.block_positions[n].tolist() == [anchor + k for k in range(4)]
        assert batch.labels[n].tolist() == labels
        assert batch.loss_weights[n].tolist() == pytest.approx([w * d for w, d in zip(weighs, decay)])


# ---- the objective ------------------------------------------------------------------------------


def small_config(**overrides) -> DSparkConfig:
    fields = dict(
        hidden_size=D, num_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32,
        vocab_size=V, target_layer_ids=[1, 3], num_target_layers=6, block_size=4, mask_token_id=V - 1, markov_rank=RANK,
        layer_types=["sliding_attention", "full_attention"], sliding_window=6, rope_theta=1e4,
    )
    return DSparkConfig(**{**fields, **overrides})


def small_drafter(config: DSparkConfig, *, dtype=torch.float64, seed: int = 0) -> DSparkDrafter:
    torch.manual_seed(seed)
    drafter = DSparkDrafter(config).to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    drafter.load_target_tensors(
        torch.randn(V, D, generator=g, dtype=dtype), torch.randn(V, D, generator=g, dtype=dtype), (1 + 0.1 * torch.randn(D, generator=g)).to(dtype),
    )
    with torch.no_grad():  # a Markov head and a confidence head that have learned something: their terms then matter
        for parameter in (drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight):
            parameter.normal_(generator=g)
        if drafter.confidence_head is not None:
            drafter.confidence_head.proj.weight.normal_(std=0.3, generator=g)
    return drafter


N, B, CONTEXT = 5, 4, 20
ANCHORS = [2, 5, 9, 11, 14]  # blocks 0-1 and 2-3 share a context row: their slots read the same target state


def hand_made_batch(*, final_hidden: bool = True, seed: int = 2, anchors: list[int] = ANCHORS, dtype=torch.float64) -> SimpleNamespace:
    """What the objective reads of a Batch: 5 blocks of 4 over 20 context rows, the final hidden state beside them."""
    g = torch.Generator().manual_seed(seed)
    block_ids = torch.full((N, B), V - 1)
    block_ids[:, 0] = torch.randint(0, V - 1, (N,), generator=g)
    prefix = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.float32)
    layout = BlockLayout(CONTEXT, B, torch.zeros(N, dtype=torch.long), torch.tensor(anchors),
                         torch.cat([torch.arange(CONTEXT), (torch.tensor(anchors)[:, None] + torch.arange(B)).flatten()]))
    batch = SimpleNamespace(
        block_ids=block_ids, labels=torch.randint(0, V - 1, (N, B), generator=g), layout=layout,
        loss_weights=prefix * torch.tensor(anchor_layout("dspark", block_size=B).slot_decay(), dtype=torch.float32),
    )
    if final_hidden:
        batch.final_hidden = torch.randn(CONTEXT, D, generator=g, dtype=torch.float64).to(dtype)
    return batch


def reference_loss(drafter: DSparkDrafter, hidden: torch.Tensor, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reference 4.4 written out over whole [N, B, V] tensors, autograd for every gradient."""
    config = drafter.config
    previous = torch.cat([batch.block_ids[:, :1], batch.labels[:, :-1]], dim=1)  # the anchor, then the label before
    embedded = drafter.markov_head.markov_w1(previous)
    logits = hidden @ drafter.lm_head.T + drafter.markov_head.markov_w2(embedded)
    ce = F.cross_entropy(logits.reshape(-1, V), batch.labels.flatten(), reduction="none").view(N, B)
    weights = batch.loss_weights.double()
    terms = {"ce": ce}
    loss = config.ce_weight * (weights * ce).sum()
    if config.reads_target:
        state = batch.final_hidden[batch.layout.anchor[:, None] + torch.arange(B)]  # slot k: the target at anchor + k
        normed = state * torch.rsqrt(state.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * drafter.target_norm
        l1 = (logits.softmax(-1) - (normed @ drafter.lm_head.T).softmax(-1)).abs().sum(-1)
        loss = loss + config.l1_weight * (weights * l1).sum()
        terms["l1"] = l1
        if drafter.confidence_head is not None:
            confidence = drafter.confidence_head.proj(torch.cat([hidden, embedded], -1)).squeeze(-1)
            acceptance = (1 - l1 / 2).clamp(0, 1).detach()
            loss = loss + config.confidence_weight * (weights * F.binary_cross_entropy_with_logits(confidence, acceptance, reduction="none")).sum()
            terms.update(confidence=confidence.sigmoid(), confidence_target=acceptance)
    return loss / weights.sum(), terms


def gradients(drafter: DSparkDrafter, hidden: torch.Tensor, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    drafter.zero_grad()
    hidden.grad = None
    loss.backward()
    found = {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}
    return {**found, "hidden": hidden.grad.clone()}


@pytest.mark.parametrize("heads", ["full", "no_confidence_head", "ce_only"])
@pytest.mark.parametrize("chunk_rows", [3, 1000])
def test_the_objective_and_its_gradients_equal_a_direct_computation(heads, chunk_rows):
    """CE + L1 + confidence BCE with the same weights and one normalizer, chunked or not, against
    the reference written over whole tensors: the loss, every gradient (hidden states, both Markov
    tables, the confidence head), the figures it logs and its acceptance counts. CE-only never reads
    the target's state (the batch has none)."""
    config = {
        "full": small_config(),
        "no_confidence_head": small_config(enable_confidence_head=False, confidence_weight=0.0),
        "ce_only": small_config(enable_confidence_head=False, confidence_weight=0.0, l1_weight=0.0, ce_weight=1.0),
    }[heads]
    drafter = small_drafter(config)
    batch = hand_made_batch(final_hidden=heads != "ce_only")
    hidden = torch.randn(N, B, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3), requires_grad=True)

    out = dspark_objective(drafter, hidden, batch, normalizer=None, fused=False, chunk_rows=chunk_rows)
    chunked = gradients(drafter, hidden, out.loss)
    expected_loss, terms = reference_loss(drafter, hidden, batch)
    expected = gradients(drafter, hidden, expected_loss)

    torch.testing.assert_close(out.loss.double(), expected_loss, rtol=1e-6, atol=1e-7)
    assert chunked.keys() == expected.keys() and {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"} <= chunked.keys()
    assert ("confidence_head.proj.weight" in chunked) == (heads == "full")
    for name in expected:  # the chunks run in fp32, the reference in fp64
        torch.testing.assert_close(chunked[name].double(), expected[name], rtol=1e-5, atol=1e-7, msg=name)
    if "confidence" in terms:
        terms["confidence_error"] = (terms["confidence"] - terms["confidence_target"]).abs()
    weights = batch.loss_weights.double()
    assert out.ratios.keys() == set(drafter_variant("dspark").metrics)
    for name, (numerator, denominator) in out.ratios.items():
        if name in terms:
            expected_mean = float((weights * terms[name].detach()).sum() / weights.sum())
            assert float(numerator) / float(denominator) == pytest.approx(expected_mean, rel=1e-5), name
        else:  # nothing measured it (CE-only, or no confidence head): logged as NaN, never as 0
            assert float(denominator) == 0, name
    with torch.no_grad():
        previous = torch.cat([batch.block_ids[:, :1], batch.labels[:, :-1]], dim=1)
        predicted = drafter.teacher_forced_tokens(hidden, previous)
    correct = (predicted == batch.labels) & (batch.loss_weights > 0)
    assert torch.equal(out.correct_per_slot, correct.sum(0)) and torch.equal(out.supervised_per_slot, (batch.loss_weights > 0).sum(0))
    assert out.accepted == correct.long().cumprod(1).sum()  # every slot is a draft: the run counts from slot 0


class TargetLogitRows(torch.overrides.TorchFunctionMode):
    """Counts the rows of every matmul by the bare LM head, [V, D].T: the target's logits (the
    drafter's go through the LM head joined with W2, [V, D + RANK])."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) == "matmul" and args[1].shape == (D, V):  # `@` and torch.matmul
            self.rows += args[0].shape[0]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("chunk_rows", [3, 7, 1000])
def test_slots_sharing_a_target_state_get_its_logits_once_and_the_float32_objective_matches_float64(chunk_rows):
    """Blocks one position apart (every context row read by up to 4 slots, masked slots among them):
    in float32, as the chunks run on a GPU, the loss and every gradient equal the float64 reference
    over whole tensors within float32's tolerance, whichever chunk boundaries split a shared row's
    readers; the target's logits are computed once per context row and chunk that reads it."""
    drafter = small_drafter(small_config(), dtype=torch.float32)
    batch = hand_made_batch(anchors=[3, 4, 5, 6, 7], dtype=torch.float32)
    hidden = torch.randn(N, B, D, generator=torch.Generator().manual_seed(3), requires_grad=True)
    with TargetLogitRows() as target_logits:
        out = dspark_objective(drafter, hidden, batch, normalizer=None, fused=False, chunk_rows=chunk_rows)
    supervised = int((batch.loss_weights > 0).sum())
    distinct = len((batch.layout.anchor[:, None] + torch.arange(B))[batch.loss_weights > 0].unique())
    chunks = math.ceil(supervised / chunk_rows)
    assert distinct < supervised and distinct <= target_logits.rows <= distinct + chunks - 1
    chunked = gradients(drafter, hidden, out.loss)

    reference = copy.deepcopy(drafter).double()
    reference_batch = hand_made_batch(anchors=[3, 4, 5, 6, 7])
    reference_hidden = hidden.detach().double().requires_grad_()
    expected_loss, _ = reference_loss(reference, reference_hidden, reference_batch)
    expected = gradients(reference, reference_hidden, expected_loss)
    torch.testing.assert_close(out.loss.double(), expected_loss, rtol=1e-5, atol=1e-6)
    assert chunked.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(chunked[name].double(), expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_chunk_never_holds_more_rows_of_logits_than_asked():
    seen = []
    original = torch.Tensor.logsumexp

    def spy(self, *args, **kwargs):
        seen.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    rows = 30
    g = torch.Generator().manual_seed(0)
    torch.Tensor.logsumexp = spy
    try:
        ChunkedMarkovDistillation.apply(
            torch.randn(rows, D, generator=g), torch.randn(V, D, generator=g), torch.randn(rows, RANK, generator=g),
            torch.randn(V, RANK, generator=g), torch.randn(rows, D, generator=g), torch.arange(rows), torch.zeros(rows, dtype=torch.long),
            torch.ones(rows), 4, None, 0.1, 0.9, False,
        )
    finally:
        torch.Tensor.logsumexp = original
    assert seen and max(shape[0] for shape in seen) == 4


@pytest.mark.parametrize("with_target", [True, False])
def test_fused_markov_chunk_terms_equal_the_eager_ones(with_target):
    """Compiled (train.compile on a GPU; the same Inductor here), the chunk's elementwise work gives
    the eager sums, L1 distances, predictions and gradient, with and without the target's logits
    (over fewer distinct rows than the chunk's, some read by several rows)."""
    g = torch.Generator().manual_seed(0)
    rows = 23
    logits = torch.randn(rows, V, generator=g) * 3
    target = torch.randn(15, V, generator=g) * 3 if with_target else None
    target_index = torch.randint(0, 15, (rows,), generator=g).sort().values if with_target else None
    labels = torch.randint(0, V, (rows,), generator=g)
    weights = torch.rand(rows, generator=g)
    weights[[0, 9]] = 0
    total = weights.sum()
    arguments = (target_index, labels, weights, total, 0.1, 0.9, True)
    eager = _markov_chunk_terms(logits.clone(), None if target is None else target.clone(), *arguments)
    fused = _fused_markov_chunk_terms()(logits.clone(), None if target is None else target.clone(), *arguments)
    for got, want in zip(fused, eager):
        torch.testing.assert_close(got, want)
    assert eager[4].abs().sum() > 0 and not eager[4][[0, 9]].any()


def test_the_target_distribution_is_the_targets_own_through_its_final_norm(architecture, each_target):
    """The store's final hidden state is the last decoder layer before the final norm. Through the
    target's final norm the drafter keeps (Qwen3.5's zero-centred 1 + w, converted to x * w on load;
    Llama's x * w as it is; never the drafter's own, trained norm) and LM head (Llama's: its tied
    embedding) it gives the target's own logits, which is what the L1 term and the confidence labels read."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(each_target, dtype=torch.float32).eval()
    checkpoint = TargetCheckpoint(open_storage(str(each_target)))
    assert checkpoint.architecture.zero_centred_norms == (architecture == "qwen3_5")
    drafter = DSparkDrafter(small_config(hidden_size=checkpoint.text["hidden_size"], vocab_size=checkpoint.text["vocab_size"],
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, mask_token_id=5,
                                         rms_norm_eps=checkpoint.text["rms_norm_eps"]))  # the target's, as training's drafter config takes it
    tensors = checkpoint.read_target_tensors()
    drafter.load_target_tensors(tensors.embed_tokens, tensors.lm_head, tensors.final_norm)

    captured = {}
    last = getattr(model.model, "language_model", model.model).layers[-1]
    hook = last.register_forward_hook(lambda module, args, output: captured.update(h=output[0] if isinstance(output, tuple) else output))
    try:
        with torch.no_grad():
            ids = torch.randint(0, 500, (1, 24), generator=torch.Generator().manual_seed(0))
            logits = model(ids).logits[0]
    finally:
        hook.remove()
    with torch.no_grad():
        ours = drafter.logits(drafter.target_final_norm(captured["h"][0]))
        own = drafter.logits(drafter.norm(captured["h"][0]))  # the drafter's own norm, from 1: not the target's
        plain = captured["h"][0] @ drafter.lm_head.T  # a control: without the norm the logits are not the target's
    torch.testing.assert_close(ours, logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(plain, logits, atol=1e-2) and not torch.allclose(own, logits, atol=1e-2)


# ---- the heads and drafting ---------------------------------------------------------------------


def test_the_heads_start_as_deepspec_initialises_them_under_its_names():
    config = small_config(vocab_size=4096, hidden_size=64, head_dim=16, markov_rank=64)
    torch.manual_seed(0)
    drafter = DSparkDrafter(config)
    shapes = {name: tuple(p.shape) for name, p in drafter.named_parameters() if "head" in name}
    assert shapes == {
        "markov_head.markov_w1.weight": (4096, 64), "markov_head.markov_w2.weight": (4096, 64),
        "confidence_head.proj.weight": (1, 64 + 64), "confidence_head.proj.bias": (1,),
    }
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"):
        weight = drafter.get_parameter(name)
        assert abs(weight.mean().item()) < 3e-3 and weight.std().item() == pytest.approx(0.02, rel=0.1), name
    assert not drafter.confidence_head.proj.bias.any()
    assert all(p.requires_grad for name, p in drafter.named_parameters() if "head" in name)
    without = DSparkDrafter(small_config(enable_confidence_head=False))
    assert without.confidence_head is None and not any("confidence" in name for name in without.state_dict())


def block_forward(drafter: DSparkDrafter, context: torch.Tensor, anchor_token: int) -> torch.Tensor:
    """The block's hidden states [B, d] through the training forward (Drafter.forward, the training masks)."""
    config = drafter.config
    C = context.shape[0]
    block_ids = torch.full((1, config.block_size), config.mask_token_id)
    block_ids[0, 0] = anchor_token
    block_positions = C + torch.arange(config.block_size)[None]
    layout = BlockLayout(C, config.block_size, torch.tensor([0]), torch.tensor([C]), torch.cat([torch.arange(C), block_positions[0]]))
    attention = build_attention(layout, config.layer_types, config.sliding_window, backend="dense")
    with torch.no_grad():
        return drafter(context, torch.arange(C), block_ids, block_positions, attention)[0]


def test_drafting_walks_the_markov_chain_left_to_right_as_teacher_forcing_predicts():
    """draft_block's B drafts: each slot's argmax of its logits plus the Markov bias of the draft
    before it (the anchor for the first), which is what teacher forcing predicts when every earlier
    draft was right; the confidence head reads the same W1[prev]."""
    drafter = small_drafter(small_config(), dtype=torch.float32).eval()
    context = torch.randn(9, drafter.config.context_features, generator=torch.Generator().manual_seed(4))
    anchor = 17
    drafts, survival = drafter.draft_scored(context[None], torch.arange(9), anchor, 9)
    assert drafts.shape == (B,) and survival.shape == (B,) and ((survival > 0) & (survival < 1)).all()
    assert torch.equal(drafter.draft_block(context[None], torch.arange(9), anchor, 9), drafts)

    hidden = block_forward(drafter, context, anchor)
    previous = torch.cat([torch.tensor([anchor]), drafts[:-1]])
    assert torch.equal(drafter.teacher_forced_tokens(hidden[None], previous[None])[0], drafts)
    embedded = drafter.markov_head.markov_w1(previous)
    torch.testing.assert_close(survival, drafter.confidence_head(hidden, embedded).sigmoid())
    # A control: the chain matters here, the backbone's argmax alone drafts otherwise.
    assert not torch.equal(drafter.logits(hidden).argmax(-1), drafts)


# ---- the exports --------------------------------------------------------------------------------


def tiny_dspark(target_dir: Path, **train):
    """A fresh DSpark drafter for the tiny target, built as training builds it (train: the spec's train section), on the CPU."""
    return fresh_drafter(target_dir, parse_spec(minimal_spec(**train)).train)


@pytest.fixture(scope="module")
def trained(target_dir):
    """A DSpark drafter for the tiny target (sliding and full layers, a Markov head that matters),
    its weights already bf16-exact as the export stores them."""
    drafter = tiny_dspark(target_dir, draft_layers=2, sliding_window_layers=1, sliding_window=16, block_size=5, dspark={"markov_rank": 32})
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.normal_(std=1.0)
        drafter.confidence_head.proj.weight.normal_(std=0.3)
        for parameter in drafter.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())
    return drafter.eval()


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    directory = tmp_path_factory.mktemp("dspark-export")
    export_dspark(trained, open_storage(str(directory)), prefix="drafter/", speculators_prefix="speculators/")
    return directory


NATIVE_KEYS = {  # reference/dflash2-dspark.md 4.7a: DeepSpec's build_draft_config, plus sample_from_anchor
    "target_layer_ids", "num_target_layers", "mask_token_id", "block_size", "num_anchors", "markov_rank", "markov_head_type",
    "enable_confidence_head", "confidence_head_with_markov", "layer_types", "tie_word_embeddings", "sample_from_anchor",
}


def test_the_native_export_holds_deepspecs_config_and_names_but_not_the_target_tables(trained, exported):
    config = json.loads((exported / "drafter/config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and "DSparkDraftModel" not in json.dumps(config)
    assert NATIVE_KEYS <= config.keys() and "dflash_config" not in config
    assert config["target_layer_ids"] == LAYERS  # z-lab ids: the output of decoder layer i
    assert (config["block_size"], config["sample_from_anchor"], config["tie_word_embeddings"]) == (5, True, False)
    assert (config["markov_rank"], config["markov_head_type"], config["enable_confidence_head"], config["confidence_head_with_markov"]) == (32, "vanilla", True, True)
    assert config["auto_map"] == {"AutoModel": "dspark.Qwen3DSparkModel"} and config["model_type"] == "qwen3"
    assert {p.name for p in (exported / "drafter").iterdir()} == {"config.json", "model.safetensors", *DSPARK_MODELING_FILES}
    weights = load_file(exported / "drafter/model.safetensors")
    d, vocab = trained.config.hidden_size, trained.config.vocab_size
    assert weights["markov_head.markov_w1.weight"].shape == weights["markov_head.markov_w2.weight"].shape == (vocab, 32)
    assert weights["confidence_head.proj.weight"].shape == (1, d + 32) and weights["confidence_head.proj.bias"].shape == (1,)
    assert weights["fc.weight"].shape == (d, len(LAYERS) * d) and "norm.weight" in weights and "hidden_norm.weight" in weights
    assert not {"embed_tokens.weight", "lm_head.weight"} & weights.keys()  # vLLM shares the target's
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    assert DSparkConfig.from_deepspec(config) == trained.config  # the objective's weights are the defaults here, and not exported


def test_the_speculators_export_holds_the_same_weights_under_speculators_keys(trained, exported):
    config = json.loads((exported / "speculators/config.json").read_text())
    assert (config["speculators_model_type"], config["architectures"]) == ("dspark", ["DSparkSpeculator"])
    assert config["aux_hidden_state_layer_ids"] == [layer + 1 for layer in LAYERS]  # vLLM's numbering: its 0 is the embeddings
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5  # B: the anchor is a draft slot
    assert config["speculators_config"]["default_proposal_method"] == "greedy"
    assert (config["block_size"], config["mask_token_id"], config["draft_vocab_size"]) == (5, trained.config.mask_token_id, trained.config.vocab_size)
    assert (config["markov_rank"], config["markov_head_type"], config["enable_confidence_head"], config["confidence_head_with_markov"]) == (32, "vanilla", True, True)
    assert (config["sample_from_anchor"], config["sliding_window_non_causal"]) == (True, False)
    layers = config["transformer_layer_config"]
    assert layers["model_type"] == "qwen3" and layers["layer_types"] == trained.config.layer_types and layers["num_hidden_layers"] == 2
    assert not {"architectures", "auto_map", "block_size", "dflash_config"} & layers.keys()
    assert {p.name for p in (exported / "speculators").iterdir()} == {"config.json", "model.safetensors"}
    native, theirs = load_file(exported / "drafter/model.safetensors"), load_file(exported / "speculators/model.safetensors")
    assert native.keys() == theirs.keys() and all(torch.equal(native[k], theirs[k]) for k in native)


def test_the_export_loads_back_as_the_same_drafter(trained, exported, target_dir):
    variant = drafter_variant("dspark")
    loaded, config = load_drafter(str(exported / "drafter"), target=str(target_dir), variant=variant)
    assert isinstance(loaded, DSparkDrafter) and (config.block_size, config.markov_rank) == (5, 32)
    context = torch.randn(1, 12, config.context_features, generator=torch.Generator().manual_seed(5))
    assert all(t.dtype == torch.bfloat16 for t in loaded.state_dict().values())  # as exported: the frozen tables too
    drafts, survival = loaded.float().draft_scored(context, torch.arange(12), 7, 12)
    expected_drafts, expected_survival = copy.deepcopy(trained).to(torch.bfloat16).float().draft_scored(context, torch.arange(12), 7, 12)
    assert torch.equal(drafts, expected_drafts) and torch.equal(survival, expected_survival)


@pytest.mark.parametrize("change, message", [
    ({"sample_from_anchor": False}, "sample_from_anchor is false"),
    ({"markov_head_type": "gated"}, "only the vanilla Markov head"),
    ({"confidence_head_with_markov": False}, "confidence_head_with_markov is false"),
])
def test_a_deepspec_config_this_drafter_cannot_run_is_refused(trained, change, message):
    with pytest.raises(ValueError, match=message):
        DSparkConfig.from_deepspec({**trained.config.to_deepspec(), **change})


def stop_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def test_a_fresh_process_loads_the_export_with_automodel_and_drafts_as_training(tmp_path, trained, exported, target_dir):
    """AutoModel.from_pretrained(dir, trust_remote_code=True) in a process that cannot import this
    project builds a Qwen3DSparkModel whose drafts and confidences are the training model's, through
    one forward or the cache spec_generate drives, and whose spec_generate is plain greedy decoding."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    config = trained.config
    g = torch.Generator().manual_seed(3)
    context = torch.randn(1, 30, config.context_features, generator=g)
    prompt = torch.randint(0, 200, (12,), generator=g)
    inputs = {"context": context, "anchor_token": 17, "first_anchor_token": 5, "split": 19, "prompt": prompt,
              "max_new_tokens": 20, "stop_token_ids": stop_ids(target)}
    torch.save(inputs, tmp_path / "inputs.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "hf-modules")}
    subprocess.run([sys.executable, str(USER_PROCESS), str(exported / "drafter"), str(target_dir), str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt")],
                   check=True, env=env, cwd=tmp_path)
    outputs = torch.load(tmp_path / "outputs.pt")

    assert outputs["class_name"] == "Qwen3DSparkModel" and outputs["module"].startswith("transformers_modules.")
    assert outputs["drafts_per_block"] == config.block_size
    expected_drafts, expected_survival = trained.draft_scored(context, torch.arange(30), 17, 30)
    torch.testing.assert_close(outputs["hidden"], block_forward(trained, context[0], 17), rtol=1e-5, atol=1e-5)
    assert torch.equal(outputs["drafts"], expected_drafts) and torch.equal(outputs["cached_drafts"], expected_drafts)
    torch.testing.assert_close(outputs["survival"], expected_survival, rtol=1e-5, atol=1e-5)
    reference = target.generate(prompt[None], max_new_tokens=20, do_sample=False)
    assert outputs["generated"].tolist() == reference.tolist()


# ---- decoding and calibration -------------------------------------------------------------------


def test_speculative_decoding_with_dspark_is_lossless_and_records_each_steps_confidences(trained, target_dir):
    """B drafts a block, verified whole: the output is plain greedy's, and the recorder keeps one
    list of B survival probabilities per verify step, which the calibration pairs with the step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    recorder = recorder_for(trained, drafts=trained.config.block_size)
    assert isinstance(recorder, ConfidenceRecorder) and recorder_for(DSparkDrafter(small_config(enable_confidence_head=False)), drafts=4) is None
    prompt = torch.randint(0, 200, (10,), generator=torch.Generator().manual_seed(6))
    target = DecodeTarget(model, trained.config.target_layer_ids)
    try:
        decoded = speculative_decode(target, recorder, prompt, max_new_tokens=40, stop_ids=frozenset())
        greedy = greedy_decode(DecodeTarget(model), prompt, max_new_tokens=40, stop_ids=frozenset())
    finally:
        target.close()
    assert decoded.tokens == greedy.tokens
    assert max(decoded.drafted) == trained.config.block_size  # every slot drafted, the anchor's too
    steps = recorder.take()
    assert len(steps) == len(decoded.accepted) and all(len(step) == trained.config.block_size for step in steps)
    assert recorder.take() == []
    summary = summarize_calibration([steps], [decoded], trained.config.block_size)
    first = summary["per_position"][0]
    drafting = [accepted for accepted, drafted in zip(decoded.accepted, decoded.drafted) if drafted]  # the last step may draft none
    assert first["steps"] == len(drafting) and first["realized_survival"] == pytest.approx(sum(a >= 1 for a in drafting) / len(drafting))


def test_calibration_compares_the_product_of_confidences_with_what_verification_accepted():
    # Two prompts: three verify steps of blocks of 3, the last one cut to 2 drafts (max_new_tokens).
    steps = [[[0.9, 0.5, 0.5], [0.5, 1.0, 1.0]], [[0.8, 0.25, 1.0]]]
    decoded = [Decoded(tokens=[], seconds=1.0, accepted=[2, 0], drafted=[3, 2]), Decoded(tokens=[], seconds=1.0, accepted=[3], drafted=[3])]
    summary = summarize_calibration(steps, decoded, 3)
    one, two, three = summary["per_position"]
    assert one["steps"] == 3 and one["predicted_survival"] == pytest.approx((0.9 + 0.5 + 0.8) / 3) and one["realized_survival"] == pytest.approx(2 / 3)
    assert one["brier"] == pytest.approx((0.1**2 + 0.5**2 + 0.2**2) / 3)
    assert two["predicted_survival"] == pytest.approx((0.45 + 0.5 + 0.2) / 3) and two["realized_survival"] == pytest.approx(2 / 3)
    assert three["steps"] == 2  # the step that drafted two tokens says nothing about the third
    assert three["predicted_survival"] == pytest.approx((0.225 + 0.2) / 2) and three["realized_survival"] == pytest.approx(1 / 2)
    # ECE of position 1: bins 0.9 (1 pair, right), 0.5 (1, wrong), 0.8 (1, right) -> (0.1 + 0.5 + 0.2) / 3
    assert one["ece"] == pytest.approx(0.8 / 3)
    assert summary["predicted_acceptance_length"] == pytest.approx(1 + sum(p["predicted_survival"] for p in (one, two, three)))
    empty = summarize_calibration([[]], [Decoded(tokens=[], seconds=1.0)], 2)
    assert empty["per_position"][0]["predicted_survival"] is None and empty["realized_acceptance_length"] == 1


def test_the_console_line_shows_a_variants_own_figures(caplog):
    from dflash_jobs.train.metrics import ConsoleSink, plot_png

    record = {"total_steps": 10, "epoch": 0, "loss": 1.5, "accuracy": [0.5, 0.25, math.nan, math.nan], "acceptance_length": 1.6,
              "lr": 1e-3, "tokens_per_s": 100.0, "eta_s": 5, "l1": 0.8125, "confidence": 0.4}
    with caplog.at_level("INFO"):
        ConsoleSink(("l1", "confidence"), first_draft=0).log(record, 1)
    # DSpark's first draft is slot 0: its accuracy is the acc@1 shown.
    assert "acc@1 0.500 tau 1.60 | l1 0.8125 confidence 0.4 | lr" in caplog.text
    assert plot_png([{"step": 1, **record}])[:4] == b"\x89PNG"  # slots never supervised (NaN) are left out of the plot
