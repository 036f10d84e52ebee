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

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_jobs.drafter.checkpoint import TargetCheckpoint, drafter_config_for_target, resolve_mask_token_id
from dflash_jobs.drafter.masks import build_attention
from dflash_jobs.drafter.speculative import ModelDrafter, Target, greedy_decode, speculative_decode
from dflash_jobs.evaluate.metrics import acceptance_length, acceptance_per_position, summarize_simulated
from dflash_jobs.evaluate.simulated import anchors_accepted, document_batch
from dflash_jobs.prepare import ChatEncoder, prompt_length
from dflash_jobs.spec import anchor_layout, parse_spec
from dflash_jobs.storage import open_storage
from dflash_jobs.tiny import tiny_chat_rows
from dflash_jobs.variants import drafter_variant
from train_fixtures import LAYERS, tiny_target

BLOCK = 6
LAYOUT = anchor_layout("dspark", block_size=BLOCK)
DSPARK = drafter_variant("dspark")
NEW_TOKENS = 32
PROMPTS = 6
NO_STOP = frozenset()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return tiny_target(tmp_path_factory.getbasetemp() / "train-fixtures")


@pytest.fixture(scope="module")
def target_model(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(target_dir) -> list[torch.Tensor]:
    encoder = ChatEncoder(AutoTokenizer.from_pretrained(target_dir))
    encoded = encoder.encode([encoder.render(row) for row in tiny_chat_rows(PROMPTS, seed=5)])
    return [torch.from_numpy(ids[: prompt_length(mask)].astype(np.int64)) for ids, mask in encoded]


@pytest.fixture(scope="module")
def documents(target_model, prompts) -> list[torch.Tensor]:
    """Each prompt followed by the target's greedy answer."""
    answers = [greedy_decode(Target(target_model), p, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP).tokens for p in prompts]
    return [torch.cat([p, torch.tensor(a)]) for p, a in zip(prompts, answers)]


def captured(target_model, document: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """The target's decoder-layer outputs (before any norm) over a document, [T, len(layers), d], from one forward."""
    target = Target(target_model, layers)
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
    checkpoint = TargetCheckpoint(open_storage(str(target_dir)))
    spec = parse_spec({"name": "c", "target": {"model": str(target_dir)}, "data": {"source": "/d"}, "output": "/o", "train": {
        "drafter": "dspark", "draft_layers": 2, "sliding_window_layers": 1, "sliding_window": 16, "block_size": BLOCK,
        "dspark": {"markov_rank": 32}}})
    mask = resolve_mask_token_id(None, checkpoint.tokenizer_size(), checkpoint.text["vocab_size"])
    config = DSPARK.build_config(drafter_config_for_target(checkpoint, spec.train, LAYERS, mask), spec.train)
    torch.manual_seed(0)
    model = DSPARK.build_model(config)
    tensors = checkpoint.read_target_tensors()
    model.load_target_tensors(tensors.embed_tokens, tensors.lm_head, tensors.final_norm)
    last_layer = checkpoint.text["num_hidden_layers"] - 1
    teaching = anchor_layout("dspark", block_size=BLOCK, gamma=1.0)  # each later slot weighs e^-1 of the one before: strong up front
    batches = []
    for prompt, document in zip(prompts, documents):
        batch = document_batch(document, len(prompt), captured(target_model, document, LAYERS), model, teaching)
        batches.append(dataclasses.replace(batch, final_hidden=captured(target_model, document, [last_layer])[:, 0].to(torch.bfloat16)))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    for step in range(150):
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
    target = Target(target_model, LAYERS)
    served = [speculative_decode(target, ModelDrafter(drafter, drafts=BLOCK), p, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP) for p in prompts]
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

    broken = [speculative_decode(target, FillInServing(drafter, drafts=BLOCK - 1), p, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP) for p in prompts]
    assert [d.tokens for d in broken] == greedy  # still lossless: only the drafts suffer
    target.close()
    assert acceptance_length(broken) < 1.5  # every draft one position late: next to nothing accepted
