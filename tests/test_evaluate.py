"""Speculative decoding is lossless and its accounting is right, on a tiny hybrid target with stand-in drafters.

The target has the real Qwen3.5 layout ([GDN, GDN, GDN, attention] x 2), so every verify step
exercises both halves of the rollback: cropped attention K/V and restored GDN states.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.cache_utils import DynamicLayer

from dflash_jobs.errors import InputError
from dflash_jobs.evaluate.baselines import BigramDrafter, BigramTable, PromptLookupDrafter, fit_bigram
from dflash_jobs.evaluate.evaluator import held_out_prompts
from dflash_jobs.evaluate.lossless import TIE_RULE, TOLERANCE_STATISTIC, Divergence
from dflash_jobs.evaluate.metrics import acceptance_length, acceptance_per_position, conditional_acceptance, same_anchor_pairs, summarize
from dflash_jobs.evaluate.report import build_report, store_report
from dflash_jobs.formats import EVAL_PLOT_KEY as PLOT_KEY, EVAL_REPORT_KEY as REPORT_KEY
from dflash_jobs.drafter.speculative import Decoded, DecodeTarget, greedy_decode, speculative_decode
from dflash_jobs.formats import DATASET_KEY, MANIFEST_KEY, DatasetIndex, TokenChunk
from dflash_jobs.storage import open_storage
from train_fixtures import write_extract

VOCAB = 128
BLOCK = 6
LAYERS = [1, 3, 6]
NO_STOP = frozenset()


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: the tiny matrices gain nothing from more threads


@pytest.fixture(scope="module")
def model():
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        full_attention_interval=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    )
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():  # default norms are the identity: randomise them (reference/qwen_gdn.md section 5)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                param.add_(torch.randn_like(param) * 0.3)
    return model


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, VOCAB, (17,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def reference(model, prompt) -> list[int]:
    """Plain greedy output: 1 + 4 full blocks of new tokens."""
    return greedy_decode(DecodeTarget(model), prompt, max_new_tokens=1 + 4 * BLOCK, stop_ids=NO_STOP).tokens


class OracleDrafter:
    """Knows the greedy continuation; drafts its first `right` tokens correctly and corrupts the rest.

    Records the context it was given at every call, to check what the drafter sees."""

    def __init__(self, continuation: torch.Tensor, right: int, layers=LAYERS, block_size: int = BLOCK) -> None:
        self.continuation, self.right = continuation, right
        self.block_size, self.drafts, self.target_layers = block_size, block_size - 1, list(layers)
        self.contexts: list[torch.Tensor] = []

    def propose(self, tokens, context):
        self.contexts.append(context)
        assert torch.equal(tokens, self.continuation[: len(tokens)]), "committed tokens diverged from greedy"
        draft = self.continuation[len(tokens) : len(tokens) + self.drafts].clone()
        draft[self.right :] = (draft[self.right :] + 1) % VOCAB
        return draft


class RandomDrafter:
    block_size, drafts, target_layers = BLOCK, BLOCK - 1, []

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(2)

    def propose(self, tokens, context):
        return torch.randint(0, VOCAB, (BLOCK - 1,), generator=self.generator)


def test_greedy_decode_equals_transformers_generate(model, prompt, reference):
    generated = model.generate(prompt[None], max_new_tokens=len(reference), min_new_tokens=len(reference), do_sample=False)
    assert generated[0, len(prompt):].tolist() == reference


def test_random_drafter_is_lossless_and_mostly_rejected(model, prompt, reference):
    decoded = speculative_decode(DecodeTarget(model), RandomDrafter(), prompt, max_new_tokens=len(reference), stop_ids=NO_STOP)
    assert decoded.tokens == reference
    assert acceptance_length([decoded]) < 1.5
    assert len(decoded.accepted) >= len(reference) // 2


def test_oracle_drafter_reaches_the_block_size(model, prompt, reference):
    continuation = torch.cat([prompt, torch.tensor(reference)])
    decoded = speculative_decode(DecodeTarget(model, LAYERS), OracleDrafter(continuation, right=BLOCK - 1), prompt, max_new_tokens=len(reference), stop_ids=NO_STOP)
    assert decoded.tokens == reference
    assert decoded.accepted == [BLOCK - 1] * 4
    assert acceptance_length([decoded]) == BLOCK
    assert acceptance_per_position([decoded], BLOCK) == [1.0] * (BLOCK - 1)


@pytest.mark.parametrize("right", [0, 2])
def test_partly_right_drafter_rolls_back_exactly(model, prompt, reference, right):
    continuation = torch.cat([prompt, torch.tensor(reference)])
    drafter = OracleDrafter(continuation, right=right)
    decoded = speculative_decode(DecodeTarget(model, LAYERS), drafter, prompt, max_new_tokens=len(reference), stop_ids=NO_STOP)
    assert decoded.tokens == reference
    # Every step but the last (cut to what the output still needs) accepts exactly `right` drafts.
    assert decoded.accepted[:-1] == [right] * (len(decoded.accepted) - 1)
    rates = acceptance_per_position([decoded], BLOCK)
    assert rates[right:] == [0.0] * (BLOCK - 1 - right)
    assert acceptance_length([decoded]) == pytest.approx(1 + sum(rates))

    # The drafter saw the target's layer i output (HF hidden_states[i + 1]) at every committed
    # position before the anchor, computed through the rollbacks: compare with one full forward.
    context = drafter.contexts[-1]
    committed = continuation[: len(context)]
    with torch.no_grad():
        states = model(committed[None], output_hidden_states=True).hidden_states
    expected = torch.cat([states[layer + 1][0] for layer in LAYERS], dim=-1)
    torch.testing.assert_close(context, expected, rtol=1e-4, atol=1e-4)


def test_a_rollback_that_misses_cache_state_is_refused(model, prompt, monkeypatch):
    # A transformers release that keeps more per-layer state than DecodeTarget.checkpoint saves (5.25 added
    # a token count to the GDN layers) must fail loudly, not decode at shifted positions: stand in
    # for it with attention layers whose crop does nothing.
    target = DecodeTarget(model, LAYERS)
    with torch.inference_mode():
        target.reset()
        target.forward(prompt)
        checkpoint = target.checkpoint()
        target.forward(prompt[:3])
        monkeypatch.setattr(DynamicLayer, "crop", lambda layer, tokens: None)
        with pytest.raises(RuntimeError, match=f"left {len(prompt) + 3} tokens, not {len(prompt)}.*TRANSFORMERS_VERSION"):
            target.rollback(checkpoint)


def test_generation_stops_at_the_stop_token(model, prompt, reference):
    stop = frozenset([reference[9]])
    expected = reference[: reference.index(reference[9]) + 1]
    continuation = torch.cat([prompt, torch.tensor(reference)])
    assert greedy_decode(DecodeTarget(model), prompt, max_new_tokens=len(reference), stop_ids=stop).tokens == expected
    decoded = speculative_decode(DecodeTarget(model, LAYERS), OracleDrafter(continuation, right=BLOCK - 1), prompt, max_new_tokens=len(reference), stop_ids=stop)
    assert decoded.tokens == expected
    # What the steps count is what they committed: the first token comes from the prefill.
    assert 1 + sum(accepted + 1 for accepted in decoded.accepted) == len(expected)


def test_acceptance_counts_only_what_was_committed_before_the_stop_token(model, prompt):
    """The issue's case: blocks of 8, an oracle drafter that knows greedy's continuation past the stop
    token too, and an answer of three tokens and the stop. Its one verify step drafts 7 tokens and the
    target agrees with all of them, but only 3 were committed (the third is the stop): acceptance 3.0,
    not 8.0, and the train/serve check compares 3 with 3 at that anchor."""
    block, new_tokens = 8, 16
    unbounded = greedy_decode(DecodeTarget(model), prompt, max_new_tokens=new_tokens, stop_ids=NO_STOP).tokens
    stop = frozenset([unbounded[3]])
    assert unbounded[3] not in unbounded[:3]
    greedy = greedy_decode(DecodeTarget(model), prompt, max_new_tokens=new_tokens, stop_ids=stop)
    assert greedy.tokens == unbounded[:4]
    oracle = OracleDrafter(torch.cat([prompt, torch.tensor(unbounded)]), right=block - 1, block_size=block)
    decoded = speculative_decode(DecodeTarget(model, LAYERS), oracle, prompt, max_new_tokens=new_tokens, stop_ids=stop)
    assert decoded.tokens == greedy.tokens
    # The first token comes from the prefill; the one verify step commits the other three.
    assert decoded.drafted == [block - 1] and decoded.accepted == [2]
    summary = summarize([decoded], [greedy], block, divergences=[[]], tie_tolerance=0.0)
    assert summary["acceptance_length"] == 3.0
    assert summary["acceptance_per_position"] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    # The oracle's teacher-forced acceptance at greedy's anchors 0, 1, 2: every label right to the
    # end (a slot past the end counts as wrong), cut where the answer stops as decoding's is.
    teacher_forced = [3, 2, 1]
    assert same_anchor_pairs(teacher_forced, decoded, greedy.tokens, block) == [(2, 2)]


def test_a_verify_step_commits_nothing_past_max_new_tokens(model, prompt):
    block = 8
    unbounded = greedy_decode(DecodeTarget(model), prompt, max_new_tokens=16, stop_ids=NO_STOP).tokens
    oracle = OracleDrafter(torch.cat([prompt, torch.tensor(unbounded)]), right=block - 1, block_size=block)
    decoded = speculative_decode(DecodeTarget(model, LAYERS), oracle, prompt, max_new_tokens=5, stop_ids=NO_STOP)
    assert decoded.tokens == unbounded[:5] and decoded.accepted == [3] and decoded.drafted == [3]
    assert acceptance_length([decoded]) == 4.0


def test_drafter_must_read_the_captured_layers(model, prompt):
    with pytest.raises(ValueError, match="captures layers"):
        speculative_decode(DecodeTarget(model, [1]), OracleDrafter(prompt, right=0, layers=[2]), prompt, max_new_tokens=4, stop_ids=NO_STOP)


def test_prompt_lookup_drafts_like_transformers():
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    generator = torch.Generator().manual_seed(3)
    reference = PromptLookupCandidateGenerator(num_output_tokens=BLOCK - 1, max_matching_ngram_size=2, max_length=10_000)
    drafter = PromptLookupDrafter(BLOCK, max_ngram=2)
    drafted = 0
    for length in range(2, 60):
        tokens = torch.randint(0, 6, (length,), generator=generator)
        candidates, _ = reference.get_candidates(tokens[None])
        expected = candidates[0, length:]
        assert drafter.propose(tokens.tolist()).tolist() == expected.tolist()
        drafted += len(expected) > 0
    assert drafted > 40


def token_rows(*samples: tuple[list[int], list[int]]) -> TokenChunk:
    """Samples (ids, loss mask) end to end, as prepare writes a chunk."""
    return TokenChunk(
        input_ids=np.array([t for ids, _ in samples for t in ids], dtype=np.int32),
        loss_mask=np.array([m for _, mask in samples for m in mask], dtype=np.uint8),
        cu_seqlens=np.cumsum([0, *(len(ids) for ids, _ in samples)]).astype(np.int64), sample_ids=np.arange(len(samples), dtype=np.int64),
    ).validate("rows")


def stored_training_rows(tmp_path, *chunks: TokenChunk):
    """A run's storage holding `chunks` as extraction and verify leave them (states of no interest here)."""
    storage = open_storage(str(tmp_path))
    write_extract(storage, [(rows, torch.zeros(rows.num_tokens, 1, 4)) for rows in chunks], model="t", layers=[0], dtype="bfloat16")
    return storage


def test_the_bigram_table_counts_the_pairs_a_drafters_first_slot_is_trained_on(tmp_path):
    storage = stored_training_rows(
        tmp_path,
        # An unsupervised prompt token, then an answer; the next sample's answer follows with no prompt:
        # the pair across the boundary (5, 3) is no sample's and is not counted.
        token_rows(([1, 2, 3, 4, 5], [0, 1, 1, 1, 1]), ([3, 9, 3, 9], [1, 1, 1, 1])),
        # 7 is followed by 8 and by 6 once each: the smaller id wins. (1, 7) is not: 1 is unsupervised.
        token_rows(([1, 7, 8, 7, 6], [0, 1, 1, 1, 1])),
    )
    table = fit_bigram(storage)
    assert table.successors == {2: 3, 3: 9, 4: 5, 9: 3, 7: 6, 8: 7}  # 3 -> 9 twice, -> 4 once
    assert {k: table.fit[k] for k in ("chunks_read", "chunks", "tokens_read", "tokens", "pairs", "distinct_pairs", "previous_tokens")} == {
        "chunks_read": 2, "chunks": 2, "tokens_read": 14, "tokens": 14, "pairs": 9, "distinct_pairs": 8, "previous_tokens": 6,
    }
    # Under a cap, whole chunks in a random order until the next would pass it (the first one always).
    capped = fit_bigram(storage, max_tokens=9)
    assert (capped.fit["chunks_read"], capped.fit["max_tokens"]) == (1, 9) and capped.fit["tokens_read"] in (5, 9)
    assert fit_bigram(storage, max_tokens=1).fit["chunks_read"] == 1


def test_the_bigram_table_needs_the_rows_training_read(tmp_path):
    with pytest.raises(InputError, match=MANIFEST_KEY):
        fit_bigram(open_storage(str(tmp_path)))


def test_a_bigram_draft_chains_the_most_likely_successors_from_the_anchor():
    drafter = BigramDrafter(BigramTable({2: 3, 3: 9, 9: 3, 4: 5}, {}), block_size=5)
    assert drafter.drafts == 4 and drafter.target_layers == []
    assert drafter.propose([0, 2]).tolist() == [3, 9, 3, 9]
    assert drafter.propose([0, 4]).tolist() == [5]  # 5 was never seen followed: the chain ends
    assert drafter.propose([0, 7]).tolist() == []


def test_bigram_drafting_is_lossless_and_accepts_what_it_learned(model, prompt, reference):
    """A table fitted on greedy's own output drafts much of it: decoding with it returns greedy's
    output exactly, with more than one token per verify step."""
    continuation = [int(prompt[-1]), *reference]
    successors = {}
    for before, after in zip(continuation, continuation[1:]):
        successors.setdefault(before, after)
    decoded = speculative_decode(DecodeTarget(model), BigramDrafter(BigramTable(successors, {}), BLOCK), prompt, max_new_tokens=len(reference), stop_ids=NO_STOP)
    assert decoded.tokens == reference
    assert acceptance_length([decoded]) > 1.5


def test_acceptance_accounting():
    steps = [Decoded(tokens=[1, 2, 3, 4, 5, 6], seconds=1.0, accepted=[3, 0, 1], drafted=[3, 3, 3]),
             Decoded(tokens=[7, 8], seconds=1.0, accepted=[1], drafted=[2])]
    assert acceptance_length(steps) == pytest.approx((4 + 1 + 2 + 2) / 4)
    assert acceptance_per_position(steps, 5) == [0.75, 0.25, 0.25, 0.0]
    greedy = [Decoded(tokens=[1, 2, 3, 4, 5, 6], seconds=3.0), Decoded(tokens=[7, 9], seconds=1.0)]
    # Prompt 1 took greedy's runner-up at a margin of 0.001, over a measured tolerance of 0.0005: real.
    found = [[], [Divergence(1, 8, 9, 8, 0.001, 9.0)]]
    summary = summarize(steps, greedy, 5, divergences=found, tie_tolerance=0.0005)
    assert summary["lossless"] is False and (summary["mismatching_prompts"], summary["ties"], summary["real_mismatches"]) == (1, 0, 1)
    assert [(m["prompt"], m["tie"], [d["position"] for d in m["divergences"]]) for m in summary["mismatches"]] == [(1, False, [1])]
    assert summary["tokens_per_second"] == pytest.approx(8 / 2.0)
    assert summary["speedup"] == pytest.approx((8 / 2.0) / (8 / 4.0))
    # Per prompt: each step commits its accepted drafts and one token more; tau is the sums' ratio.
    assert summary["per_prompt"] == {"committed": [7, 2], "verify_steps": [3, 1], "tokens": [6, 2], "seconds": [1.0, 1.0]}
    low, high = summary["acceptance_length_interval"]
    assert low <= summary["acceptance_length"] == 9 / 4 <= high and (low, high) == (2.0, 2.3333)  # the draws' extremes: prompt 2 twice, prompt 1 twice
    # An output that differs with no divergences to judge it by is refused, never counted lossless.
    with pytest.raises(ValueError, match="prompt 1: the output differs from greedy's"):
        summarize(steps, greedy, 5, divergences=[[], []], tie_tolerance=0.0005)


def test_conditional_acceptance_judges_draft_k_only_where_it_was_drafted_after_k_minus_1_accepted():
    # Blocks of 5 (4 drafts). Steps (accepted, drafted): (4, 4), (1, 4), (2, 2) the output's last block,
    # (0, 0) a baseline that found nothing to copy, (2, 4) whose third draft was the stop token: the
    # stop took the bonus token's place, so it committed two drafts, as the unconditional rates count.
    decoded = [Decoded(tokens=[0] * 9, seconds=1.0, accepted=[4, 1, 2], drafted=[4, 4, 2]),
               Decoded(tokens=[0] * 4, seconds=1.0, accepted=[0, 2], drafted=[0, 4])]
    assert acceptance_per_position(decoded, 5) == [0.8, 0.6, 0.2, 0.2]
    conditional = conditional_acceptance(decoded, 5)
    # k = 1: the four steps that drafted, all accepted one; k = 2: three of the four that reached it;
    # k = 3: of the two that drafted a third after two (the (2, 2) step drafted none), one; k = 4: that one.
    assert conditional == {"rates": [1.0, 0.75, 0.5, 1.0], "steps": [4, 4, 2, 1]}
    assert conditional_acceptance([Decoded(tokens=[0], seconds=1.0, accepted=[0], drafted=[0])], 3) == {"rates": [None, None], "steps": [0, 0]}


def test_report_is_stored_with_its_plot(tmp_path):
    greedy = [Decoded(tokens=[1, 2, 3], seconds=1.0, margins=[1.0] * 3)]
    drafted = {"dflash": [Decoded(tokens=[1, 2, 3], seconds=0.5, accepted=[1, 0], drafted=[3, 3])],
               "prompt_lookup": [Decoded(tokens=[1, 2, 3], seconds=0.9, accepted=[0, 0, 0], drafted=[0, 1, 0])]}
    report = build_report(greedy=greedy, drafters=drafted, divergences={"dflash": [[]], "prompt_lookup": [[]]}, verify_noise=[[0.01, 0.03]],
                          block_size=4, dtype=torch.bfloat16, target="t", prompts=1, max_new_tokens=3)
    storage = open_storage(str(tmp_path))
    store_report(storage, report)
    stored = json.loads(storage.get_bytes(REPORT_KEY))
    assert stored["format"] == "dflash.eval/v1" and stored["lossless"] is True
    assert stored["tie_tolerance"] == {"value": 0.03, "positions": 2, "block_size": 4, "statistic": TOLERANCE_STATISTIC, "rule": TIE_RULE}
    assert set(stored["drafters"]) == {"dflash", "prompt_lookup"}
    assert set(stored["drafters"]["dflash"]) >= {
        "acceptance_length", "acceptance_per_position", "conditional_acceptance", "tokens_per_second", "speedup", "lossless", "mismatches",
    }
    assert stored["drafters"]["dflash"]["acceptance_length"] == 1.5
    assert stored["greedy"]["tokens_per_second"] == 3.0
    assert storage.get_bytes(PLOT_KEY).startswith(b"\x89PNG")


def test_held_out_prompts_stop_before_the_answer(tmp_path):
    storage = open_storage(str(tmp_path))
    ids = np.arange(10, dtype=np.int32)
    # Two samples: a one-turn chat (answer from 4), and a two-turn one (the last answer from 6).
    mask = np.array([0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 1], dtype=np.uint8)[:20]
    holdout = TokenChunk(np.concatenate([ids, ids]), mask, np.array([0, 10, 20]), np.array([7, 8]))
    storage.put_bytes("tokens/holdout.safetensors", holdout.encode())
    index = DatasetIndex(samples=0, tokens=0, vocab_size=16, chunks=[], holdout={"samples": 2, "path": "tokens/holdout.safetensors"})
    storage.put_bytes(DATASET_KEY, index.to_json().encode())
    prompts = held_out_prompts(storage, 5)
    assert [p.tolist() for p in prompts] == [list(range(4)), list(range(6))]
