"""DFlash2's train/serve check: a DFlash2 drafter taught by its own objective on the tiny target's
greedy answers drafts far past one token per step, its decoding (the selector's walk after the
tokens it chose) is lossless, and its training forward (the selector's teacher-forced choice after
the data tokens) accepts what decoding accepts at the same anchors. The drafter has a sliding layer
whose window cuts into the context and a full one, both bidirectional, as DFlash2 exports them.
The prompts, answers and captured states are DFlash's check's (test_evaluate_consistency)."""

from __future__ import annotations

import pytest
import torch

from dflash_jobs.drafter.masks import build_attention
from dflash_jobs.drafter.speculative import DecodeTarget, ModelDrafter, speculative_decode
from dflash_jobs.evaluate.metrics import acceptance_length, summarize_simulated
from dflash_jobs.evaluate.simulated import anchors_accepted, document_batch
from dflash_jobs.spec import DFlash2Spec, TrainSpec, anchor_layout
from dflash_jobs.variants import drafter_variant
from test_evaluate_consistency import BLOCK, NEW_TOKENS, NO_STOP, PROMPTS, WINDOW, captured
from test_evaluate_consistency import documents, prompts, target_model  # noqa: F401 (fixtures)
from train_fixtures import LAYERS, fresh_drafter

pytestmark = pytest.mark.usefixtures("one_thread")

DFLASH2 = drafter_variant("dflash2")
LAYOUT = anchor_layout("dflash2", block_size=BLOCK)


@pytest.fixture(scope="module")
def drafter(target_dir, target_model, prompts, documents):
    """A DFlash2 drafter taught by its objective through the training forward, in bf16 as exported."""
    train = TrainSpec(drafter="dflash2", draft_layers=2, sliding_window_layers=1, sliding_window=WINDOW, block_size=BLOCK,
                      dflash2=DFlash2Spec(selector_rank=32, selector_top_k=8))
    model = fresh_drafter(target_dir, train)
    config = model.config
    teaching = anchor_layout("dflash2", block_size=BLOCK, gamma=1.0)  # a drafter strong up front, as test_evaluate_consistency's
    batches = [document_batch(d, len(p), captured(target_model, d), model, teaching) for p, d in zip(prompts, documents)]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    for step in range(150):
        batch = batches[step % len(batches)]
        attention = build_attention(batch.layout, config.layer_types, config.sliding_window, backend="dense", is_causal=config.is_causal)
        hidden = model(batch.context_hidden, batch.context_positions, batch.block_ids, batch.block_positions, attention)
        DFLASH2.objective(model, hidden, batch, normalizer=None, fused=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def test_the_training_forward_accepts_what_the_selector_s_walk_accepts_when_decoding(drafter, target_model, prompts, documents):
    config = drafter.config
    assert config.layer_types == ["sliding_attention", "full_attention"] and config.is_causal is False
    assert all(len(d) > WINDOW for d in documents)
    batches = [document_batch(d, len(p), captured(target_model, d), drafter, LAYOUT) for p, d in zip(prompts, documents)]
    simulated = [anchors_accepted(drafter, batch, DFLASH2.predict, LAYOUT) for batch in batches]
    assert [len(anchors) for anchors in simulated] == [NEW_TOKENS - 1] * PROMPTS

    target = DecodeTarget(target_model, LAYERS)
    served = [speculative_decode(target, ModelDrafter(drafter, drafts=BLOCK - 1), p, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP) for p in prompts]
    greedy = [d[len(p):].tolist() for p, d in zip(prompts, documents)]
    assert [d.tokens for d in served] == greedy  # lossless
    assert acceptance_length(served) > 3
    report = summarize_simulated(simulated, served, greedy, BLOCK)
    assert report["disagreeing_positions"] == []
    matched = report["at_decoded_anchors"]
    assert matched["steps"] == sum(drafted == BLOCK - 1 for d in served for drafted in d.drafted)  # every step that drafted a whole block
    torch.testing.assert_close(matched["simulated_per_position"], matched["decoded_per_position"], atol=0.05, rtol=0)

    # The selector takes part: somewhere its teacher-forced choice is not the unary argmax.
    def choices(batch):
        batch = batch.to(torch.device("cpu"))
        attention = build_attention(batch.layout, config.layer_types, config.sliding_window, backend="dense", is_causal=config.is_causal)
        with torch.no_grad():
            hidden = drafter(batch.context_hidden, batch.context_positions, batch.block_ids, batch.block_positions, attention)
        return DFLASH2.predict(drafter, hidden, batch)[:, 1:], drafter.greedy_tokens(hidden)[:, 1:]

    assert any(not torch.equal(*choices(batch)) for batch in batches)
