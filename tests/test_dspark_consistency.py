"""DSpark's train/serve check: the training forward (teacher forced, the Markov head fed the label
before each slot) accepts at the decoded anchors exactly what speculative decoding accepts (the
block drafted left to right through the Markov head, every slot a draft), and a serving path in
the fill-in layout (the anchor slot taken for the anchor itself, as SGLang once read such
checkpoints: reference/dflash2-dspark.md section 6, pitfall 1) is named.

The drafter is trained here, briefly, with DSpark's own objective on the tiny target's greedy
answers to chat prompts, the target's final hidden state captured over them as extraction stores it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash_jobs.spec import anchor_layout
from dflash_jobs.drafter.masks import build_attention
from dflash_jobs.drafter.speculative import DecodeTarget, ModelDrafter, speculative_decode
from dflash_jobs.evaluate.calibration import ConfidenceRecorder, summarize_calibration
from dflash_jobs.evaluate.metrics import acceptance_length, acceptance_per_position, summarize_simulated
from dflash_jobs.evaluate.simulated import anchors_accepted, document_batch
from dflash_jobs.variants import drafter_variant
from test_dspark import tiny_dspark
# The DFlash consistency test's prompts, and the target's greedy answers to them (one thread, as there).
from test_evaluate_consistency import NEW_TOKENS, NO_STOP, documents, prompts, target_model  # noqa: F401
from train_fixtures import LAYERS

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 6
LAYOUT = anchor_layout("dspark", block_size=BLOCK)
DSPARK = drafter_variant("dspark")


def captured(target_model, document: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """The target's decoder-layer outputs (before any norm) over a document, [T, len(layers), d], from one forward."""
    target = DecodeTarget(target_model, layers)
    try:
        with torch.inference_mode():
            target.reset()
            target.forward(document, last_only=True)
            return target.features().view(len(document), len(layers), -1).clone()
    finally:
        target.close()


@pytest.fixture(scope="module")
def drafter(target_dir, target_model, prompts, documents):
    """A DSpark drafter (one sliding-window layer, one full) trained by its own objective on these documents, in bf16 as exported."""
    model = tiny_dspark(target_dir, draft_layers=2, sliding_window_layers=1, sliding_window=16, block_size=BLOCK, dspark={"markov_rank": 32})
    config = model.config
    last_layer = target_model.config.get_text_config().num_hidden_layers - 1
    teaching = anchor_layout("dspark", block_size=BLOCK, gamma=1.0)  # each later slot weighs e^-1 of the one before: strong up front
    batches = []
    for prompt, document in zip(prompts, documents):
        batch = document_batch(document, len(prompt), captured(target_model, document, LAYERS), model, teaching)
        batches.append(dataclasses.replace(batch, final_hidden=captured(target_model, document, [last_layer])[:, 0].to(torch.bfloat16)))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    # 300 steps: at 150 the confidence head of a drafter whose final norm starts at 1 (its own,
    # trained, as SpecForge's) still read the first draft's survival 0.08 high (0.02 at 300).
    for step in range(300):
        batch = batches[step % len(batches)]
        attention = build_attention(batch.layout, config.layer_types, config.sliding_window, backend="dense")
        hidden = model(batch.context_hidden, batch.context_positions, batch.block_ids, batch.block_positions, attention)
        DSPARK.objective(model, hidden, batch, normalizer=None, fused=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.to(torch.bfloat16).eval().requires_grad_(False)


class FillInServing(ModelDrafter):
    """A serving path in the wrong layout: the first slot taken for the anchor (a fill-in reading of a DSpark checkpoint)."""

    def propose(self, tokens, context):
        return super().propose(tokens, context)[1:]


def test_the_training_forward_accepts_what_dspark_decoding_accepts_and_a_fill_in_serving_path_does_not(drafter, target_model, prompts, documents):
    simulated = [
        anchors_accepted(drafter, document_batch(d, len(p), captured(target_model, d, LAYERS), drafter, LAYOUT), DSPARK.predict, LAYOUT)
        for p, d in zip(prompts, documents)
    ]
    target = DecodeTarget(target_model, LAYERS)
    recorder = ConfidenceRecorder(drafter, drafts=BLOCK)  # the ModelDrafter the evaluation serves a confidence head through
    served, confidences = [], []
    for prompt in prompts:
        served.append(speculative_decode(target, recorder, prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP))
        confidences.append(recorder.take())
    greedy = [d[len(p):].tolist() for p, d in zip(prompts, documents)]
    assert [d.tokens for d in served] == greedy
    verify_block = BLOCK + 1  # the anchor and its B drafts
    report = summarize_simulated(simulated, served, greedy, verify_block)
    # A drafter that drafts: past one token a step, and its first draft (the anchor slot's) mostly right.
    assert acceptance_length(served) > 3 and acceptance_per_position(served, verify_block)[0] > 0.6
    assert report["disagreeing_positions"] == []
    matched = report["at_decoded_anchors"]
    assert matched["steps"] > 0.8 * sum(len(d.accepted) for d in served)
    torch.testing.assert_close(matched["simulated_per_position"], matched["decoded_per_position"], atol=0.05, rtol=0)

    # The confidence head, trained toward 1 - L1/2, predicts the first draft's survival within 0.05;
    # later positions read high under greedy verification (README, DSpark).
    first = summarize_calibration(confidences, served, BLOCK)["per_position"][0]
    assert first["steps"] >= 0.9 * sum(len(d.accepted) for d in served)
    assert abs(first["predicted_survival"] - first["realized_survival"]) < 0.05

    broken = [speculative_decode(target, FillInServing(drafter, drafts=BLOCK - 1), p, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP) for p in prompts]
    assert [d.tokens for d in broken] == greedy  # still lossless: only the drafts suffer
    target.close()
    assert acceptance_length(broken) < 1.5  # every draft one position late: next to nothing accepted
