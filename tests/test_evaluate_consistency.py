"""The evaluation's verdicts: a mismatch at a numerical tie is told from a real one, the training
forward's (teacher-forced) acceptance agrees with speculative decoding's on the same prompts and
a serving path off by one position does not, and worker processes give the one-process report.

The drafter is trained here, briefly, on the tiny target's own greedy answers to held-out-style
chat prompts, with a sliding-window layer whose window cuts into the context: decoding serves it
through `Drafter.draft_block`, the simulation through the training batch and mask.
"""

from __future__ import annotations

import copy
import json
import pickle
import logging
import re

import numpy as np
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_jobs.drafter.checkpoint import TargetCheckpoint, drafter_config_for_target
from dflash_jobs.drafter.export import export_dflash
from dflash_jobs.drafter.masks import build_attention
from dflash_jobs.drafter.model import Drafter
from dflash_jobs.drafter.speculative import Decoded, DecodeTarget, ModelDrafter, greedy_decode, speculative_decode
from dflash_jobs.errors import SpecError
from dflash_jobs.formats import TokenChunk
from dflash_jobs.evaluate.__main__ import main as evaluate_main
from dflash_jobs.evaluate.baselines import fit_bigram
from dflash_jobs.evaluate.evaluator import DecoderOnFirstUse, PromptDecoder, evaluate, held_out_prompts
from dflash_jobs.evaluate.lossless import TIE_RULE, TOLERANCE_STATISTIC, Divergence, divergences, is_tie, mismatches, tie_tolerance, verify_noise
from dflash_jobs.evaluate.metrics import (
    MIN_COMPARED_STEPS, acceptance_length, acceptance_per_position, simulated_consistency, summarize, summarize_simulated,
)
from dflash_jobs.evaluate.simulated import anchors_accepted, blocks_per_call, document_batch
from dflash_jobs.rows import ChatEncoder, prompt_length
from dflash_jobs.spec import EvalSpec, TrainSpec, anchor_layout, parse_spec
from dflash_jobs.storage import open_storage
from dflash_jobs.architectures.tiny.chats import tiny_chat_rows
from dflash_jobs.train.loss import draft_loss
from dflash_jobs.variants import drafter_variant
from train_fixtures import LAYERS, mask_token_id, write_extract, write_holdout

BLOCK = 8
LAYOUT = anchor_layout(block_size=BLOCK)
DFLASH = drafter_variant("dflash")
WINDOW = 16  # shorter than every document: the sliding layer's window cuts into the context
NEW_TOKENS = 32
PROMPTS = 8
NO_STOP = frozenset()
VOCAB_PROBE = 64  # enough candidate ids to find one outside a few given ones


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: the tiny matrices gain nothing from more threads


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
    target = DecodeTarget(target_model, LAYERS)
    with torch.inference_mode():
        target.reset()
        target.forward(document, last_only=True)
        return target.features().view(len(document), len(LAYERS), -1).clone()


@pytest.fixture(scope="module")
def documents(target_model, prompts) -> list[torch.Tensor]:
    """Each prompt followed by the target's greedy answer."""
    answers = [greedy_decode(DecodeTarget(target_model), p, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP).tokens for p in prompts]
    return [torch.cat([p, torch.tensor(a)]) for p, a in zip(prompts, answers)]


@pytest.fixture(scope="module")
def drafter(target_dir, target_model, prompts, documents) -> Drafter:
    """A drafter (one sliding-window layer, one full) trained by the training forward on these documents, in bf16 as exported."""
    checkpoint = TargetCheckpoint(open_storage(str(target_dir)))
    train = TrainSpec(draft_layers=2, sliding_window_layers=1, sliding_window=WINDOW, block_size=BLOCK)
    mask = mask_token_id(checkpoint)
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
    target = DecodeTarget(target_model, LAYERS)
    served = [speculative_decode(target, ModelDrafter(drafter, drafts=BLOCK - 1), p, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP) for p in prompts]
    assert [d.tokens for d in served] == [d[len(p):].tolist() for p, d in zip(prompts, documents)]
    greedy = [d[len(p):].tolist() for p, d in zip(prompts, documents)]
    report = summarize_simulated(simulated, served, greedy, BLOCK)
    # A drafter that drafts: far past one token per step, and past the first position.
    assert acceptance_length(served) > 3 and acceptance_per_position(served, BLOCK)[2] > 0.5
    assert report["disagreeing_positions"] == []
    # At the anchors decoding drafted from, the two are the same computation: equal but for rounding.
    matched = report["at_decoded_anchors"]
    assert matched["compared"] and matched["verdict"] == "agree"
    assert matched["steps"] > 0.8 * sum(len(d.accepted) for d in served)
    torch.testing.assert_close(matched["simulated_per_position"], matched["decoded_per_position"], atol=0.05, rtol=0)
    assert abs(report["acceptance_length"] - acceptance_length(served)) < 0.15 * acceptance_length(served)

    broken = [speculative_decode(target, ContextOffByOne(drafter, drafts=BLOCK - 1), p, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP) for p in prompts]
    assert [d.tokens for d in broken] == [d.tokens for d in served]  # still lossless: only the drafts suffer
    verdict = summarize_simulated(simulated, broken, greedy, BLOCK)
    assert verdict["disagreeing_positions"][:3] == [1, 2, 3] and verdict["at_decoded_anchors"]["verdict"] == "disagree"
    assert verdict["relative_gap"][0] < -0.3


def test_long_documents_are_simulated_a_group_of_blocks_at_a_time_with_the_same_result(drafter, target_model, prompts, documents, monkeypatch):
    prompt, document = prompts[0], documents[0]
    whole = simulated(drafter, target_model, prompt, document)
    monkeypatch.setattr("dflash_jobs.evaluate.simulated.ATTENTION_PAIRS", 3 * BLOCK * (len(document) + 3 * BLOCK))
    assert blocks_per_call(len(document), BLOCK, NEW_TOKENS - 1) <= 3
    assert simulated(drafter, target_model, prompt, document) == whole


# ---- ties --------------------------------------------------------------------------------------


def test_a_divergence_is_a_tie_where_its_tokens_greedy_logit_is_within_the_measured_tolerance_of_the_top():
    # Greedy's top two there: token 0 at 20.0, token 1 at 19.8; token 2 (its third choice) at 19.8 too,
    # token 3 far below. The run measured 0.25 of noise. (A verdict on the margin alone, as 2 bf16
    # ulps of 20.0 = 0.25 was, calls every one a tie; one at the runner-up alone calls the third
    # choice real, as every chain's one divergence on an H100 was, at a margin of 0.0625 against 0.3125.)
    tolerance = 0.25
    third = Divergence(position=5, token=2, greedy_token=0, greedy_runner_up=1, greedy_margin=0.2, greedy_top_logit=20.0, token_logit=19.8)
    runner_up = Divergence(position=5, token=1, greedy_token=0, greedy_runner_up=1, greedy_margin=0.2, greedy_top_logit=20.0, token_logit=19.8)
    runner_up_far = Divergence(position=5, token=1, greedy_token=0, greedy_runner_up=1, greedy_margin=0.3, greedy_top_logit=20.0, token_logit=19.7)
    far_below = Divergence(position=5, token=3, greedy_token=0, greedy_runner_up=1, greedy_margin=0.2, greedy_top_logit=20.0, token_logit=12.0)
    assert [is_tie(d, tolerance) for d in (third, runner_up, runner_up_far, far_below)] == [True, True, False, False]
    (judged,) = mismatches([[third]], tolerance)
    assert judged["divergences"][0]["greedy_logit_gap"] == pytest.approx(0.2) and judged["tie"] is True

    greedy = [Decoded(tokens=[7] * 8, seconds=1.0) for _ in range(4)]
    outputs = [Decoded(tokens=[7] * 5 + [d.token] + [7] * 2, seconds=0.5, accepted=[6], drafted=[7]) for d in (far_below, runner_up, runner_up_far)]
    summary = summarize([*outputs, greedy[3]], greedy, 8, divergences=[[far_below], [runner_up], [runner_up_far], []], tie_tolerance=tolerance)
    # Every differing prompt counted: three, one of them a tie.
    assert (summary["mismatching_prompts"], summary["ties"], summary["real_mismatches"], summary["lossless"]) == (3, 1, 2, False)
    assert [(m["prompt"], m["tie"]) for m in summary["mismatches"]] == [(0, False), (1, True), (2, False)]
    ties_only = summarize([greedy[0], outputs[1], greedy[2], greedy[3]], greedy, 8, divergences=[[], [runner_up], [], []], tie_tolerance=tolerance)
    assert ties_only["lossless"] is True and ties_only["ties"] == 1 and ties_only["real_mismatches"] == 0


def greedy_after(target_model, prompt: torch.Tensor, prefix: list[int], new_tokens: int) -> Decoded:
    """Plain greedy's continuation of prompt + prefix."""
    return greedy_decode(DecodeTarget(target_model), torch.cat([prompt, torch.tensor(prefix, dtype=prompt.dtype)]), max_new_tokens=new_tokens, stop_ids=NO_STOP)


def test_every_position_is_checked_and_a_real_mismatch_after_a_tie_is_found(target_model, prompts):
    """An output that takes greedy's runner-up at position 3 (a tie, at a tolerance over that margin),
    goes on as greedy goes on from there, and at position 11 takes the token greedy ranks last: a
    verdict from the first difference alone would call the prompt a tie."""
    prompt = prompts[0]
    plain = DecodeTarget(target_model)
    reference = greedy_decode(plain, prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
    output = reference.tokens[:3] + [reference.runners_up[3]]
    after_tie = greedy_after(target_model, prompt, output, 8)
    output += after_tie.tokens
    with torch.no_grad():
        logits = target_model(torch.cat([prompt, torch.tensor(output[:-1], dtype=prompt.dtype)])[None]).logits[0, -1]
    wrong = int(logits.argmin())
    output[-1] = wrong  # position 11
    output += greedy_after(target_model, prompt, output, NEW_TOKENS - len(output)).tokens
    found = divergences(plain, prompt, output, reference, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
    assert [(d.position, d.token) for d in found] == [(3, reference.runners_up[3]), (11, wrong)]
    tie, real = found
    # Greedy's record at the first difference is the reference's own; at the second, greedy after the output's prefix.
    assert (tie.greedy_token, tie.greedy_runner_up, tie.greedy_margin) == (reference.tokens[3], reference.runners_up[3], reference.margins[3])
    assert (real.greedy_token, real.greedy_runner_up) == (after_tie.tokens[-1], after_tie.runners_up[-1])
    # What the verdicts turn on: greedy's logit of the output's token there, against its top one.
    assert tie.greedy_logit_gap == pytest.approx(tie.greedy_margin, abs=1e-5)
    assert real.token_logit == pytest.approx(float(logits[wrong]), abs=1e-4) and real.greedy_top_logit == pytest.approx(float(logits.max()), abs=1e-4)
    (verdict,) = mismatches([found], tolerance=tie.greedy_margin)
    assert [d["tie"] for d in verdict["divergences"]] == [True, False] and verdict["tie"] is False
    assert divergences(plain, prompt, reference.tokens, reference, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP) == []


def test_a_run_that_stops_at_another_length_is_checked_at_the_stop(target_model, prompts):
    """Stopping where greedy goes on is a divergence like any other: a stop token greedy did not
    choose there is judged by greedy's logit of it; an output ending with neither a stop token nor
    max_new_tokens (a loop bug) has no greedy choice to be judged by, and is real."""
    prompt = prompts[1]
    plain = DecodeTarget(target_model)
    reference = greedy_decode(plain, prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
    stop = next(t for t in range(VOCAB_PROBE) if t not in reference.tokens[:6] + reference.runners_up[:6])
    early = reference.tokens[:5] + [stop]
    (found,) = divergences(plain, prompt, early, reference, max_new_tokens=NEW_TOKENS, stop_ids=frozenset([stop]))
    assert (found.position, found.token, found.greedy_token) == (5, stop, reference.tokens[5])
    # Below greedy's runner-up there: not a tie where the runner-up would be one, a tie only as far down.
    assert found.greedy_logit_gap > found.greedy_margin and not is_tie(found, found.greedy_margin) and is_tie(found, found.greedy_logit_gap)
    (short,) = divergences(plain, prompt, reference.tokens[:9], reference, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
    assert (short.position, short.token, short.greedy_token) == (9, None, None) and not is_tie(short, 1e9)


def test_the_tie_tolerance_is_measured_on_the_target_at_greedys_top_two_tokens(target_model, prompts):
    prompt = prompts[2]
    plain = DecodeTarget(target_model)
    reference = greedy_decode(plain, prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
    noise = verify_noise(plain, prompt, reference, BLOCK)
    # Every position but the first (both decodings take it from one prefill); in fp32 a block's
    # chunked GDN kernel and the one-token recurrent step still round differently, a little.
    assert len(noise) == NEW_TOKENS - 1
    assert 0 < max(noise) < 1e-4

    # A verify forward that scales its logits by 1.01 moves greedy's margin by 1% of itself: the
    # measurement reads greedy's own two tokens at the right positions, against greedy's margin.
    def scale_blocks(module, args, kwargs, output):
        if kwargs["input_ids"].shape[1] > 1:
            output.logits = output.logits * 1.01
        return output

    hook = target_model.register_forward_hook(scale_blocks, with_kwargs=True)
    try:
        scaled = verify_noise(plain, prompt, reference, BLOCK)
    finally:
        hook.remove()
    expected = [0.01 * margin for margin in reference.margins[1:]]
    torch.testing.assert_close(scaled, expected, rtol=0, atol=1e-4)
    tolerance = tie_tolerance([noise, scaled], BLOCK)
    assert tolerance == {"value": max(scaled), "statistic": TOLERANCE_STATISTIC, "positions": 2 * (NEW_TOKENS - 1), "block_size": BLOCK, "rule": TIE_RULE}


def test_eval_settings_are_validated_naming_the_field():
    assert EvalSpec().processes == 1
    for field, value in (("processes", 0), ("processes", 1.5), ("max_new_tokens", 0), ("prompts", True)):
        with pytest.raises(SpecError, match=f"eval.{field}"):
            EvalSpec(**{field: value})
    with pytest.raises(SpecError, match="eval.tie_ulps"):  # measured now: the old setting is named, not ignored
        parse_spec({"name": "x", "target": {"model": "/m"}, "data": {"source": "/d"}, "output": "/o", "eval": {"tie_ulps": 2}})


# ---- the job -----------------------------------------------------------------------------------


def finished_training(tmp_path, target_dir, target_model, drafter, documents, prompts, **eval_settings):
    """A run's storage as training leaves it: the rows the drafter trained on (these documents, as
    extraction and verify store them), the held-out samples (the same documents) and the exported
    drafter; and its spec."""
    output = tmp_path / "run"
    storage = open_storage(str(output))
    export_dflash(drafter, storage)
    masks = [np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(d) - len(p), np.uint8)]) for p, d in zip(prompts, documents)]
    rows = TokenChunk(
        input_ids=torch.cat(documents).numpy().astype(np.int32), loss_mask=np.concatenate(masks),
        cu_seqlens=np.cumsum([0, *map(len, documents)]).astype(np.int64), sample_ids=np.arange(len(documents), dtype=np.int64),
    ).validate("training rows")
    hidden = torch.cat([captured(target_model, d) for d in documents])
    write_extract(storage, [(rows, hidden)], model=str(target_dir), layers=LAYERS, dtype="bfloat16")
    write_holdout(output, [(d.numpy(), mask) for d, mask in zip(documents, masks)], vocab_size=drafter.config.vocab_size)
    spec = {
        "name": "evaluated", "backend": "local", "target": {"model": str(target_dir), "layers": LAYERS},
        "data": {"source": str(tmp_path / "unused.jsonl")}, "output": str(output),
        "eval": {"prompts": 4, "max_new_tokens": 16, **eval_settings},
    }
    (tmp_path / "dflash.yaml").write_text(yaml.safe_dump(spec))
    return parse_spec(spec), storage


def test_a_prompt_set_gets_a_table_of_its_own_and_speeds_from_the_timed_subset(tmp_path, target_dir, target_model, drafter, documents, prompts):
    """eval.prompt_sets beside the held-out prompts: the set's rows as chat prompts (one without a
    user turn counted, not decoded), tau with its interval, acceptance per position, and speeds from
    the first eval.timed_prompts prompts of each."""
    from dflash_jobs.evaluate.kept import KEPT_PREFIX

    source = tmp_path / "chats.jsonl"
    rows = [*tiny_chat_rows(3, seed=9), {"messages": [{"role": "assistant", "content": "no question"}]}]
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    spec, storage = finished_training(tmp_path, target_dir, target_model, drafter, documents, prompts, tree_budgets=[], timed_prompts=2,
                                      prompt_sets={"chats": str(source)})
    report = evaluate(spec, storage, device=torch.device("cpu"))
    table = report["prompt_sets"]["chats"]
    assert (table["source"], table["rows"], table["prompts"], table["refused"], table["timed_prompts"]) == (str(source), 4, 3, {"no_user_turn": 1}, 2)
    assert set(table["drafters"]) == {"dflash", "prompt_lookup", "bigram"} and table["lossless"] and report["lossless"]
    for name, figures in table["drafters"].items():
        low, high = figures["acceptance_length_interval"]
        assert low <= figures["acceptance_length"] <= high and len(figures["acceptance_per_position"]) == BLOCK - 1, name
        assert figures["tokens_per_second"] > 0 and figures["speedup"] > 0, name
    assert table["greedy_tokens_per_second"] > 0 and report["timed"]["prompts"] == 2
    assert storage.list(KEPT_PREFIX) == []  # every set's kept results went with the report


def test_an_evaluation_on_the_same_target_and_prompts_takes_greedys_decodings_from_an_earlier_one(
        tmp_path, target_dir, target_model, drafter, documents, prompts, monkeypatch):
    """Two runs' evaluations sharing eval.reference_cache: the second decodes greedy only for its timed
    subset (its warm-up and its one prompt), and its figures are the first's."""
    from dflash_jobs.evaluate import evaluator
    from dflash_jobs.evaluate.reference import REFERENCE_PREFIX

    cpu, settings = torch.device("cpu"), {"tree_budgets": [], "timed_prompts": 1, "reference_cache": str(tmp_path / "shared")}
    first = evaluate(*finished_training(tmp_path / "first", target_dir, target_model, drafter, documents, prompts, **settings), device=cpu)
    assert len(open_storage(str(tmp_path / "shared")).list(REFERENCE_PREFIX)) == 4  # eval.prompts
    decoded, greedy_decode = [], evaluator.greedy_decode
    monkeypatch.setattr(evaluator, "greedy_decode", lambda *args, **kwargs: decoded.append(args[1]) or greedy_decode(*args, **kwargs))
    second = evaluate(*finished_training(tmp_path / "second", target_dir, target_model, drafter, documents, prompts, **settings), device=cpu)
    assert len(decoded) == 2
    assert second["tie_tolerance"] == first["tie_tolerance"] and second["greedy"]["tokens"] == first["greedy"]["tokens"]
    for name, figures in first["drafters"].items():
        for key in ("acceptance_length", "acceptance_per_position", "verify_steps", "tokens", "mismatches", "lossless"):
            assert second["drafters"][name][key] == figures[key], (name, key)
    assert second["drafters"]["dflash"]["simulated"] == first["drafters"]["dflash"]["simulated"]


def test_a_timed_prompt_gives_its_figures_and_its_speeds_from_one_decoding(
        tmp_path, target_dir, target_model, drafter, documents, prompts, monkeypatch, caplog):
    """The first eval.timed_prompts prompts are decoded once, alone, for their figures and their speeds:
    greedy once a prompt and once for the warm-up; the chain once a prompt too (no confidence
    recorder rides it), the baselines decoded as served beside it on the timed prompts alone."""
    from dflash_jobs.evaluate import evaluator

    greedy_decode, speculative_decode, calls = evaluator.greedy_decode, evaluator.speculative_decode, {"greedy": 0, "speculative": 0}

    def counted(name, decode):
        return lambda *args, **kwargs: calls.__setitem__(name, calls[name] + 1) or decode(*args, **kwargs)

    monkeypatch.setattr(evaluator, "greedy_decode", counted("greedy", greedy_decode))
    monkeypatch.setattr(evaluator, "speculative_decode", counted("speculative", speculative_decode))
    monkeypatch.setattr(evaluator, "LOG_EVERY_S", 0.0)  # a progress line after each prompt
    with caplog.at_level(logging.INFO, logger="dflash.eval"):
        report = evaluate(*finished_training(tmp_path, target_dir, target_model, drafter, documents, prompts, tree_budgets=[], timed_prompts=2),
                          device=torch.device("cpu"))
    baselines = 2  # prompt lookup and the bigram table
    assert calls == {"greedy": 1 + 4, "speculative": (1 + 2) * (1 + baselines) + 2}  # the warm-up and two timed prompts, then two more
    assert report["timed"] == {"prompts": 2, "warm_up": 1, "processes": 1, "figures": "tokens_per_second and speedup"}
    per_prompt = report["greedy"]["per_prompt"]["seconds"]
    assert report["greedy"]["tokens_per_second"] == pytest.approx(sum(report["greedy"]["per_prompt"]["tokens"][:2]) / sum(per_prompt[:2]), rel=1e-3)  # the same decodings (seconds rounded)
    assert all(report["drafters"][name]["tokens_per_second"] > 0 for name in ("dflash", "prompt_lookup", "bigram"))
    # The log follows the timed prompts as they decode, then says where their time alone went.
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("timed prompts:")]
    assert lines[:2] == ["timed prompts: 1 of 2 decoded alone", "timed prompts: 2 of 2 decoded alone"] and len(lines) == 3
    line = lines[2]
    found = re.fullmatch(r"timed prompts: 2 decoded alone in ([\d.]+) s, ([\d.]+) s of it their timed decodings "
                         r"\(greedy ([\d.]+) s, dflash ([\d.]+) s, prompt_lookup [\d.]+ s, bigram [\d.]+ s\)", line)
    assert found, line
    alone, decodings, greedy = (float(found.group(i)) for i in (1, 2, 3))
    assert 0 < greedy <= decodings <= alone + 0.1
    assert greedy == pytest.approx(sum(per_prompt[:2]), abs=0.1)


def test_a_prompts_figures_from_decodings_handed_over_are_its_figures_decoded_in_one_pass(
        tmp_path, target_dir, target_model, drafter, documents, prompts):
    """A timed prompt's decodings, pickled as they go to a worker process, give there the figures one
    pass gives (the decodings' seconds aside): the verify noise, the lossless check, the simulation."""
    spec, storage = finished_training(tmp_path, target_dir, target_model, drafter, documents, prompts, tree_budgets=[4])
    decoder = DecoderOnFirstUse(spec, fit_bigram(storage), device=torch.device("cpu")).get()
    try:
        prompt = held_out_prompts(storage, 1)[0]
        handed_over = pickle.loads(pickle.dumps(decoder.decode_and_time(prompt)[0]))
        assert handed_over.noise is None and set(handed_over.trees) == {4, *decoder.budgets}
        results = [decoder.decode(prompt, handed_over), decoder.decode(prompt)]
    finally:
        decoder.close()

    def untimed(result):
        result = copy.deepcopy(result)
        for decoding in [result.greedy, *result.drafted.values(), *(result.trees.decoded.values() if result.trees else ())]:
            decoding.seconds = 0.0
        return result

    first, again = (untimed(r) for r in results)
    assert first.verify_noise and first.simulated and first.trees is not None
    assert first == again


def test_the_process_loads_its_own_decoder_only_when_asked(tmp_path, target_dir, target_model, drafter, documents, prompts):
    # Loaded by the first prompt this process decodes (a timed one, or with every prompt kept, its
    # warm-up before the timed decodings): nothing before.
    spec, storage = finished_training(tmp_path, target_dir, target_model, drafter, documents, prompts, processes=2)
    decoder = DecoderOnFirstUse(spec, fit_bigram(storage), device=torch.device("cpu"))
    assert decoder.loaded is None
    decoder.close()  # nothing loaded, nothing to close
    loaded = decoder.get()
    assert isinstance(loaded, PromptDecoder) and decoder.get() is loaded
    decoder.close()


def test_worker_processes_give_the_one_process_report(tmp_path, target_dir, target_model, drafter, documents, prompts):
    reports = {}
    for processes in (1, 2):
        spec, storage = finished_training(tmp_path / str(processes), target_dir, target_model, drafter, documents, prompts, processes=processes)
        reports[processes] = evaluate(spec, storage, device=torch.device("cpu"))
        assert json.loads(storage.get_bytes("eval/report.json")) == json.loads(json.dumps(reports[processes]))
    one, two = reports[1], reports[2]
    assert (one["processes"], two["processes"]) == (1, 2)
    assert one["lossless"] and two["lossless"]
    assert set(one["drafters"]) == {"dflash", "prompt_lookup", "bigram"}
    for name in ("dflash", "prompt_lookup", "bigram"):
        for key in ("acceptance_length", "acceptance_per_position", "conditional_acceptance", "verify_steps", "tokens", "mismatches",
                    "mismatching_prompts", "ties", "real_mismatches", "acceptance_length_interval"):
            assert one["drafters"][name][key] == two["drafters"][name][key], (name, key)
        # Per prompt, merged back in prompt order (the seconds are each process's own).
        for key in ("committed", "verify_steps", "tokens"):
            assert one["drafters"][name]["per_prompt"][key] == two["drafters"][name]["per_prompt"][key], (name, key)
    # The bigram table was fitted once, on the rows training read, and its every draft was verified.
    assert one["bigram"] == two["bigram"] and (one["bigram"]["chunks_read"], one["bigram"]["chunks"]) == (1, 1)
    assert one["bigram"]["pairs"] == sum(len(d) - len(p) - 1 for p, d in zip(prompts, documents))
    assert one["drafters"]["bigram"]["verify_steps"] > 0 and one["drafters"]["bigram"]["lossless"]
    # The tie tolerance is measured on every prompt, at every position but the first.
    assert one["tie_tolerance"] == two["tie_tolerance"]
    assert one["tie_tolerance"]["positions"] == 4 * (16 - 1) and 0 < one["tie_tolerance"]["value"] < 1e-4
    simulated = one["drafters"]["dflash"]["simulated"]
    assert simulated == two["drafters"]["dflash"]["simulated"]
    assert set(simulated) == {"acceptance_length", "acceptance_per_position", "anchors", "at_decoded_anchors", "relative_gap", "tolerance", "disagreeing_positions"}
    assert len(simulated["acceptance_per_position"]) == len(simulated["relative_gap"]) == BLOCK - 1
    assert simulated["anchors"] == 4 * (16 - 1)
    # 4 answers of 16 tokens hold too few whole blocks of 8 for a train/serve verdict: said so, not passed.
    matched = simulated["at_decoded_anchors"]
    assert 0 < matched["steps"] < MIN_COMPARED_STEPS and not matched["compared"] and simulated["disagreeing_positions"] is None
    assert "simulated" not in one["drafters"]["prompt_lookup"]


def test_an_evaluation_too_short_for_the_train_serve_check_says_not_compared_and_what_to_change(
    tmp_path, target_dir, target_model, drafter, documents, prompts, capsys,
):
    """Answers no longer than a block: no verify step drafts a whole block, so nothing is compared.
    The report and the pod's log say so, never an empty pass."""
    finished_training(tmp_path, target_dir, target_model, drafter, documents, prompts, max_new_tokens=BLOCK)
    assert evaluate_main(["-f", str(tmp_path / "dflash.yaml")]) == 0
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    simulated = report["drafters"]["dflash"]["simulated"]
    assert simulated["at_decoded_anchors"]["steps"] == 0 and simulated["at_decoded_anchors"]["compared"] is False
    assert simulated["at_decoded_anchors"]["verdict"].startswith("not compared: 0 verify steps")
    assert simulated["disagreeing_positions"] is None
    log = capsys.readouterr().out
    assert "training and serving were not compared: only 0 verify steps" in log
    assert f"Raise eval.max_new_tokens (now {BLOCK};" in log and "or eval.prompts (now 4)" in log


def test_a_gap_is_named_only_beyond_ten_percent_and_beyond_the_noise_of_the_verify_steps():
    # 1,000 steps: a 0.50 vs 0.40 gap (25%) is far beyond noise; 0.001 vs 0 (one step of the 1,000) is not.
    verdict = simulated_consistency([0.50, 0.30, 0.001], [0.40, 0.29, 0.0], steps=1000)
    assert verdict["disagreeing_positions"] == [1]
    assert verdict["relative_gap"][0] == pytest.approx(0.25) and verdict["relative_gap"][2] is None
    # The same 25% gap over 10 steps is within the noise.
    assert simulated_consistency([0.50, 0.30, 0.001], [0.40, 0.29, 0.0], steps=10)["disagreeing_positions"] == []


def test_an_evaluation_stopped_midway_decodes_only_the_prompts_it_lacks_when_run_again(
    tmp_path, target_dir, target_model, drafter, documents, prompts, monkeypatch,
):
    """A pod preempted (or a call cut by its limit) after two prompts: the rerun decodes the other two
    and its report is the uninterrupted one's, but for the seconds."""
    from dflash_jobs.drafter.export import DRAFTER_PREFIX
    from dflash_jobs.evaluate import evaluator
    from dflash_jobs.evaluate.kept import KEPT_PREFIX, evaluation_key

    cpu, settings = torch.device("cpu"), {"tree_budgets": [4]}
    whole = evaluate(*finished_training(tmp_path / "whole", target_dir, target_model, drafter, documents, prompts, **settings), device=cpu)
    spec, storage = finished_training(tmp_path / "stopped", target_dir, target_model, drafter, documents, prompts, **settings)
    decode, decoded = evaluator.PromptDecoder.decode, []

    def preempted_at_the_third(self, prompt, known=None):
        decoded.append(prompt.tolist())
        if len(decoded) == 4:  # the warm-up, prompts 0 and 1, then prompt 2
            raise RuntimeError("the pod was preempted")
        return decode(self, prompt, known)

    monkeypatch.setattr(evaluator.PromptDecoder, "decode", preempted_at_the_third)
    with pytest.raises(RuntimeError, match="preempted"):
        evaluate(spec, storage, device=cpu)
    assert len(storage.list(KEPT_PREFIX)) == 2 and not storage.exists("eval/report.json")
    decoded.clear()
    monkeypatch.setattr(evaluator.PromptDecoder, "decode", lambda self, prompt, known=None: decoded.append(prompt.tolist()) or decode(self, prompt, known))
    again = evaluate(spec, storage, device=cpu)
    assert decoded == [prompts[0].tolist(), prompts[2].tolist(), prompts[3].tolist()]  # its warm-up (the first prompt), then the two it lacked
    assert storage.list(KEPT_PREFIX) == []  # the report holds them now
    for name in ("dflash", "prompt_lookup", "bigram"):
        for key in ("acceptance_length", "acceptance_per_position", "verify_steps", "tokens", "mismatches", "lossless", "acceptance_length_interval"):
            assert again["drafters"][name][key] == whole["drafters"][name][key], (name, key)
        for key in ("committed", "verify_steps", "tokens"):
            assert again["drafters"][name]["per_prompt"][key] == whole["drafters"][name]["per_prompt"][key], (name, key)
    tree, whole_tree = again["drafters"]["dflash"]["tree"], whole["drafters"]["dflash"]["tree"]
    assert tree["at_chain_steps"] == whole_tree["at_chain_steps"] and tree["decoded"]["4"]["per_prompt"]["committed"] == \
        whole_tree["decoded"]["4"]["per_prompt"]["committed"]
    assert again["drafters"]["dflash"]["simulated"] == whole["drafters"]["dflash"]["simulated"] and again["tie_tolerance"] == whole["tie_tolerance"]
    # What a kept result depends on: other settings or another drafter is another evaluation; the same
    # drafter exported again (a finished training's retried pod) is the same one.
    key = evaluation_key(spec, storage, DRAFTER_PREFIX, cpu)
    assert evaluation_key(parse_spec({**yaml.safe_load((tmp_path / "stopped" / "dflash.yaml").read_text()),
                                      "eval": {"prompts": 4, "max_new_tokens": 12}}), storage, DRAFTER_PREFIX, cpu) != key
    export_dflash(drafter, storage)
    assert evaluation_key(spec, storage, DRAFTER_PREFIX, cpu) == key
    retrained = copy.deepcopy(drafter)
    with torch.no_grad():
        next(retrained.parameters()).add_(1.0)
    export_dflash(retrained, storage)
    assert evaluation_key(spec, storage, DRAFTER_PREFIX, cpu) != key
