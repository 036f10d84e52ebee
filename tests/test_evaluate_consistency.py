"""The evaluation's verdicts: a mismatch at a numerical tie is told from a real one, the training
forward's (teacher-forced) acceptance agrees with speculative decoding's on the same prompts and
a serving path off by one position does not, and worker processes give the one-process report.

The drafter is trained here, briefly, on the tiny target's own greedy answers to held-out-style
chat prompts, with a sliding-window layer whose window cuts into the context: decoding serves it
through `Drafter.draft_block`, the simulation through the training batch and mask.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_jobs.drafter.checkpoint import TargetCheckpoint, drafter_config_for_target, resolve_mask_token_id
from dflash_jobs.drafter.export import export_dflash
from dflash_jobs.drafter.masks import build_attention
from dflash_jobs.drafter.model import Drafter
from dflash_jobs.drafter.speculative import Decoded, ModelDrafter, Target, greedy_decode, speculative_decode
from dflash_jobs.errors import SpecError
from dflash_jobs.evaluate.evaluator import evaluate
from dflash_jobs.evaluate.metrics import (
    acceptance_length, acceptance_per_position, mismatches, simulated_consistency, summarize, summarize_simulated, tie_tolerance,
)
from dflash_jobs.evaluate.report import build_report
from dflash_jobs.evaluate.simulated import anchors_accepted, blocks_per_call, document_batch
from dflash_jobs.formats import DATASET_KEY, DatasetIndex, TokenChunk
from dflash_jobs.rows import ChatEncoder, prompt_length
from dflash_jobs.spec import EvalSpec, TrainSpec, anchor_layout, parse_spec
from dflash_jobs.storage import open_storage
from dflash_jobs.tiny import tiny_chat_rows
from dflash_jobs.train.loss import draft_loss
from dflash_jobs.variants import drafter_variant
from train_fixtures import LAYERS, tiny_target

BLOCK = 8
LAYOUT = anchor_layout(block_size=BLOCK)
DFLASH = drafter_variant("dflash")
WINDOW = 16  # shorter than every document: the sliding layer's window cuts into the context
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
    """Chat prompts rendered and cut as the evaluation's held-out ones are (before the last answer)."""
    encoder = ChatEncoder(AutoTokenizer.from_pretrained(target_dir))
    encoded = encoder.encode([encoder.render(row) for row in tiny_chat_rows(PROMPTS, seed=5)])
    return [torch.from_numpy(ids[: prompt_length(mask)].astype(np.int64)) for ids, mask in encoded]


def captured(target_model, document: torch.Tensor) -> torch.Tensor:
    """The drafter's target layers over a document, [T, L, d], from one forward."""
    target = Target(target_model, LAYERS)
    with torch.inference_mode():
        target.reset()
        target.forward(document, last_only=True)
        return target.features().view(len(document), len(LAYERS), -1).clone()


@pytest.fixture(scope="module")
def documents(target_model, prompts) -> list[torch.Tensor]:
    """Each prompt followed by the target's greedy answer."""
    answers = [greedy_decode(Target(target_model), p, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP).tokens for p in prompts]
    return [torch.cat([p, torch.tensor(a)]) for p, a in zip(prompts, answers)]


@pytest.fixture(scope="module")
def drafter(target_dir, target_model, prompts, documents) -> Drafter:
    """A drafter (one sliding-window layer, one full) trained by the training forward on these documents, in bf16 as exported."""
    checkpoint = TargetCheckpoint(open_storage(str(target_dir)))
    train = TrainSpec(draft_layers=2, sliding_window_layers=1, sliding_window=WINDOW, block_size=BLOCK)
    mask = resolve_mask_token_id(None, checkpoint.tokenizer_size(), checkpoint.text["vocab_size"])
    torch.manual_seed(0)
    model = Drafter(drafter_config_for_target(checkpoint, train, LAYERS, mask))
    tensors = checkpoint.read_target_tensors()
    model.load_target_tensors(tensors.embed_tokens, tensors.lm_head, tensors.final_norm)
    teaching = anchor_layout(block_size=BLOCK, gamma=1.0)  # every later slot weighs e^-1 of the one before: a drafter strong up front
    batches = [document_batch(d, len(p), captured(target_model, d), model, teaching) for p, d in zip(prompts, documents)]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    config = model.config
    for step in range(150):
        batch = batches[step % len(batches)]
        attention = build_attention(batch.layout, config.layer_types, config.sliding_window, backend="dense")
        hidden = model(batch.context_hidden, batch.context_positions, batch.block_ids, batch.block_positions, attention)
        draft_loss(hidden, model.lm_head, batch.labels, batch.loss_weights).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def simulated(drafter, target_model, prompt, document) -> list[int]:
    batch = document_batch(document, len(prompt), captured(target_model, document), drafter, LAYOUT)
    return anchors_accepted(drafter, batch, DFLASH.predict, LAYOUT)


def simulated_anchors(drafter, target_model, prompts, documents) -> list[list[int]]:
    return [simulated(drafter, target_model, p, d) for p, d in zip(prompts, documents)]


class ContextOffByOne(ModelDrafter):
    """A serving path with the classic bug: the context one position late (position i gets the target's state of i - 1)."""

    def propose(self, tokens, context):
        return super().propose(tokens, torch.cat([context[:1], context[:-1]]))


def test_the_training_forward_accepts_what_speculative_decoding_accepts_and_an_off_by_one_serving_path_does_not(
    drafter, target_model, prompts, documents,
):
    assert drafter.config.layer_types == ["sliding_attention", "full_attention"] and all(len(d) > WINDOW for d in documents)
    simulated = simulated_anchors(drafter, target_model, prompts, documents)
    # One anchor at every answer position with a successor: the training rule (both supervised).
    assert [len(anchors) for anchors in simulated] == [NEW_TOKENS - 1] * PROMPTS
    target = Target(target_model, LAYERS)
    served = [speculative_decode(target, ModelDrafter(drafter, drafts=BLOCK - 1), p, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP) for p in prompts]
    assert [d.tokens for d in served] == [d[len(p):].tolist() for p, d in zip(prompts, documents)]
    greedy = [d[len(p):].tolist() for p, d in zip(prompts, documents)]
    report = summarize_simulated(simulated, served, greedy, BLOCK)
    # A drafter that drafts: far past one token per step, and past the first position.
    assert acceptance_length(served) > 3 and acceptance_per_position(served, BLOCK)[2] > 0.5
    assert report["disagreeing_positions"] == []
    # At the anchors decoding drafted from, the two are the same computation: equal but for rounding.
    matched = report["at_decoded_anchors"]
    assert matched["steps"] > 0.8 * sum(len(d.accepted) for d in served)
    torch.testing.assert_close(matched["simulated_per_position"], matched["decoded_per_position"], atol=0.05, rtol=0)
    assert abs(report["acceptance_length"] - acceptance_length(served)) < 0.15 * acceptance_length(served)

    broken = [speculative_decode(target, ContextOffByOne(drafter, drafts=BLOCK - 1), p, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP) for p in prompts]
    assert [d.tokens for d in broken] == [d.tokens for d in served]  # still lossless: only the drafts suffer
    verdict = summarize_simulated(simulated, broken, greedy, BLOCK)
    assert verdict["disagreeing_positions"][:3] == [1, 2, 3]
    assert verdict["relative_gap"][0] < -0.3


def test_long_documents_are_simulated_a_group_of_blocks_at_a_time_with_the_same_result(drafter, target_model, prompts, documents, monkeypatch):
    prompt, document = prompts[0], documents[0]
    whole = simulated(drafter, target_model, prompt, document)
    monkeypatch.setattr("dflash_jobs.evaluate.simulated.ATTENTION_PAIRS", 3 * BLOCK * (len(document) + 3 * BLOCK))
    assert blocks_per_call(len(document), BLOCK, NEW_TOKENS - 1) <= 3
    assert simulated(drafter, target_model, prompt, document) == whole


# ---- ties --------------------------------------------------------------------------------------


def test_the_tie_tolerance_is_units_in_the_last_place_of_the_top_logit():
    # bf16 keeps 8 significant bits: its spacing is 2**-7 in [1, 2), 0.0625 in [8, 16), 0.125 in [16, 32).
    assert tie_tolerance(12.5, torch.bfloat16, 2) == 0.125
    assert tie_tolerance(-20.0, torch.bfloat16, 2) == 0.25
    assert tie_tolerance(16.0, torch.bfloat16, 1) == 0.125
    assert tie_tolerance(12.5, torch.float32, 2) == 2 * 2.0**-23 * 8
    assert tie_tolerance(12.5, torch.bfloat16, 0) == 0.0
    # One unit is the step between neighbouring bf16 logits there: 12.5 + 0.0625 is representable, 12.5 + 0.03 rounds back.
    top = torch.tensor(12.5, dtype=torch.bfloat16)
    assert float((top + 0.0625) - top) == tie_tolerance(12.5, torch.bfloat16, 1)
    assert float((top + 0.03) - top) == 0.0


def bf16_logits(values: list[float]) -> torch.Tensor:
    return torch.tensor(values).to(torch.bfloat16)


def greedy_from_logits(rows: list[torch.Tensor], seconds: float = 1.0) -> Decoded:
    """A plain greedy run's record, read off real bf16 logit rows the way greedy_decode reads them."""
    tops = [row.float().topk(2) for row in rows]
    return Decoded(tokens=[int(t.indices[0]) for t in tops], seconds=seconds,
                   margins=[float(t.values[0] - t.values[1]) for t in tops], top_logits=[float(t.values[0]) for t in tops])


def test_a_mismatch_at_a_bf16_tie_is_a_tie_and_only_a_real_one_makes_the_run_not_lossless():
    # Position 1: tokens 2 and 3 tie exactly (the verify forward may round 3 up, the decode step 2);
    # position 2 of the second prompt: token 0 leads by 1.0, far beyond bf16 rounding at 12.
    tie = [bf16_logits([1.0, 5.0, 0.0, 0.0]), bf16_logits([0.0, 0.0, 12.25, 12.25]), bf16_logits([3.0, 0.0, 0.0, 0.0])]
    clear = [bf16_logits([1.0, 5.0, 0.0, 0.0]), bf16_logits([12.0, 11.0, 0.0, 0.0]), bf16_logits([3.0, 0.0, 0.0, 0.0])]
    greedy = [greedy_from_logits(tie), greedy_from_logits(clear)]
    assert [g.tokens for g in greedy] == [[1, 2, 0], [1, 0, 0]]
    at_the_tie = Decoded(tokens=[1, 3, 0], seconds=0.5, accepted=[2], drafted=[2])
    real = Decoded(tokens=[1, 1, 0], seconds=0.5, accepted=[2], drafted=[2])
    found = mismatches([at_the_tie, real], greedy, dtype=torch.bfloat16, tie_ulps=2)
    assert [(m.prompt, m.position, m.greedy_margin, m.tie) for m in found] == [(0, 1, 0.0, True), (1, 1, 1.0, False)]
    assert found[0].tie_tolerance == 0.125 and found[0].greedy_top_logit == 12.25

    only_ties = summarize([at_the_tie, greedy[1]], greedy, 4, dtype=torch.bfloat16, tie_ulps=2)
    assert only_ties["lossless"] is True and only_ties["ties"] == 1 and len(only_ties["mismatches"]) == 1
    with_a_real_one = summarize([at_the_tie, real], greedy, 4, dtype=torch.bfloat16, tie_ulps=2)
    assert with_a_real_one["lossless"] is False and with_a_real_one["ties"] == 1
    # tie_ulps 0: an exact tie still counts as one (margin 0 <= 0), a margin of one ulp would not.
    assert summarize([at_the_tie, greedy[1]], greedy, 4, dtype=torch.bfloat16, tie_ulps=0)["lossless"] is True

    report = build_report(greedy=greedy, drafters={"dflash": [at_the_tie, greedy[1]], "prompt_lookup": [at_the_tie, real]},
                          block_size=4, dtype=torch.bfloat16, tie_ulps=2)
    assert report["tie_ulps"] == 2 and report["dtype"] == "bfloat16"
    assert report["drafters"]["dflash"]["lossless"] and not report["drafters"]["prompt_lookup"]["lossless"]
    assert report["lossless"] is False


def test_a_run_that_stops_at_another_length_is_a_real_mismatch():
    greedy = [greedy_from_logits([bf16_logits([0.0, 4.0]), bf16_logits([4.0, 4.0])])]  # a tie at the end
    longer = Decoded(tokens=[1, 0, 1], seconds=1.0, accepted=[2], drafted=[2])
    (found,) = mismatches([longer], greedy, dtype=torch.bfloat16, tie_ulps=2)
    assert (found.position, found.greedy_margin, found.tie) == (2, None, False)


def test_eval_settings_are_validated_naming_the_field():
    assert EvalSpec().processes == 1 and EvalSpec().tie_ulps == 2
    for field, value in (("processes", 0), ("processes", 1.5), ("tie_ulps", -1), ("tie_ulps", True)):
        with pytest.raises(SpecError, match=f"eval.{field}"):
            EvalSpec(**{field: value})


# ---- the job -----------------------------------------------------------------------------------


def finished_training(tmp_path, target_dir, drafter, documents, prompts, **eval_settings):
    """A run's storage as training leaves it: the held-out samples and the exported drafter; and its spec."""
    output = tmp_path / "run"
    storage = open_storage(str(output))
    export_dflash(drafter, storage)
    masks = [np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(d) - len(p), np.uint8)]) for p, d in zip(prompts, documents)]
    holdout = TokenChunk(
        input_ids=np.concatenate([d.numpy() for d in documents]).astype(np.int32), loss_mask=np.concatenate(masks),
        cu_seqlens=np.concatenate([[0], np.cumsum([len(d) for d in documents])]).astype(np.int64),
        sample_ids=np.arange(len(documents), dtype=np.int64),
    )
    storage.put_bytes("tokens/holdout.safetensors", holdout.encode())
    index = DatasetIndex(samples=0, tokens=0, vocab_size=drafter.config.vocab_size, chunks=[],
                         holdout={"samples": len(documents), "path": "tokens/holdout.safetensors"})
    storage.put_bytes(DATASET_KEY, index.to_json().encode())
    spec = parse_spec({
        "name": "evaluated", "backend": "local", "target": {"model": str(target_dir), "layers": LAYERS},
        "data": {"source": str(tmp_path / "unused.jsonl")}, "output": str(output),
        "eval": {"prompts": 4, "max_new_tokens": 16, **eval_settings},
    })
    return spec, storage


def test_worker_processes_give_the_one_process_report(tmp_path, target_dir, drafter, documents, prompts):
    reports = {}
    for processes in (1, 2):
        spec, storage = finished_training(tmp_path / str(processes), target_dir, drafter, documents, prompts, processes=processes)
        reports[processes] = evaluate(spec, storage, device=torch.device("cpu"))
        assert json.loads(storage.get_bytes("eval/report.json")) == json.loads(json.dumps(reports[processes]))
    one, two = reports[1], reports[2]
    assert (one["processes"], two["processes"]) == (1, 2)
    assert one["lossless"] and two["lossless"]
    for name in ("dflash", "prompt_lookup"):
        for key in ("acceptance_length", "acceptance_per_position", "verify_steps", "tokens", "mismatches", "ties"):
            assert one["drafters"][name][key] == two["drafters"][name][key], (name, key)
    simulated = one["drafters"]["dflash"]["simulated"]
    assert simulated == two["drafters"]["dflash"]["simulated"]
    assert set(simulated) == {"acceptance_length", "acceptance_per_position", "anchors", "at_decoded_anchors", "relative_gap", "tolerance", "disagreeing_positions"}
    assert len(simulated["acceptance_per_position"]) == len(simulated["relative_gap"]) == BLOCK - 1
    assert simulated["anchors"] == 4 * (16 - 1) and simulated["disagreeing_positions"] == []
    assert "simulated" not in one["drafters"]["prompt_lookup"]


def test_a_gap_is_named_only_beyond_ten_percent_and_beyond_the_noise_of_the_verify_steps():
    # 1,000 steps: a 0.50 vs 0.40 gap (25%) is far beyond noise; 0.001 vs 0 (one step of the 1,000) is not.
    verdict = simulated_consistency([0.50, 0.30, 0.001], [0.40, 0.29, 0.0], steps=1000)
    assert verdict["disagreeing_positions"] == [1]
    assert verdict["relative_gap"][0] == pytest.approx(0.25) and verdict["relative_gap"][2] is None
    # The same 25% gap over 10 steps is within the noise.
    assert simulated_consistency([0.50, 0.30, 0.001], [0.40, 0.29, 0.0], steps=10)["disagreeing_positions"] == []
