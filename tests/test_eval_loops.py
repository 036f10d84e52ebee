"""The verify loops as the evaluation runs them: what they decode did not change when they stopped
waiting on the device, they wait on it once a step, and they all commit the same token where the
target's top two logits are exactly equal (one tie rule: the lower token id, drafter/model.py
rank_top_k); the lossless check judges such a tie as a tie.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_jobs.drafter.host_reads import HostReads
from dflash_jobs.drafter.speculative import Decoded, DecodeTarget, ModelDrafter, greedy_decode, speculative_decode
from dflash_jobs.drafter.tree_verify import tree_decode, tree_target
from dflash_jobs.evaluate.baselines import BigramDrafter, PromptLookupDrafter, along_greedy
from dflash_jobs.evaluate.calibration import recorder_for
from dflash_jobs.evaluate.lossless import divergences, is_tie, mismatches
from dflash_jobs.evaluate.trees import VariantBranches
from dflash_jobs.spec import TrainSpec, anchor_layout
from dflash_jobs.variants import drafter_variant
from recorded_decodings import BLOCK, BUDGETS, NEW_TOKENS, VARIANTS, bigram_of, decode_every_loop, prompts
from train_fixtures import LAYERS, fresh_drafter

RECORDED = Path(__file__).parent / "data" / "recorded_decodings.json"
NO_STOP = frozenset()

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: the tiny matrices gain nothing from more threads


def test_every_loop_decodes_what_it_decoded_before_it_read_the_device_once_a_step(each_target, architecture):
    """tests/data/recorded_decodings.json holds what greedy, every variant's chain and trees, prompt
    lookup and the bigram table decoded before the loops were changed to read the device once a step
    (recorded by tests/recorded_decodings.py with that code): every token, every step's count, alike;
    the trees' too, since grown on the device."""
    recorded = json.loads(RECORDED.read_text())[architecture]
    now = decode_every_loop(each_target)
    assert now["prompts"] == recorded["prompts"]
    for prompt, (decoded, before) in enumerate(zip(now["decodings"], recorded["decodings"])):
        assert decoded.keys() == before.keys()
        for loop, figures in before.items():
            assert decoded[loop] == figures, f"prompt {prompt}, {loop}"


@pytest.fixture(scope="module")
def model(each_target):
    return AutoModelForCausalLM.from_pretrained(each_target, dtype=torch.float32).eval()


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_verify_step_reads_the_device_once(model, each_target, variant):
    """Beside the prefill's two reads (the prompt's ids, the first token), one read a verify step, for
    every variant's drafter (with its confidence recorder where it has a head) and both baselines."""
    prompt = prompts(model.config.vocab_size)[2]
    drafter = fresh_drafter(each_target, TrainSpec(drafter=variant, block_size=BLOCK)).eval()
    drafts = anchor_layout(variant, block_size=BLOCK).drafts
    greedy = greedy_decode(DecodeTarget(model), prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
    loops = {"chain": (ModelDrafter(drafter, drafts=drafts), LAYERS),
             "prompt_lookup": (PromptLookupDrafter(BLOCK), []), "bigram": (BigramDrafter(bigram_of([greedy.tokens]), BLOCK), [])}
    if (recorder := recorder_for(drafter, drafts=drafts)) is not None:
        loops["recorder"] = (recorder, LAYERS)
    for name, (block_drafter, layers) in loops.items():
        with HostReads() as reads:
            decoded = speculative_decode(DecodeTarget(model, layers), block_drafter, prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
        assert decoded.tokens == greedy.tokens, name
        assert reads.total == len(decoded.accepted) + 2, (name, dict(reads.counts))


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_tree_step_reads_the_device_once(model, each_target, variant):
    """Beside the prefill's two reads, a tree step reads once, for every variant's drafter: the tree
    is grown and laid out on the device (drafter/tree.py grow_tree, DSpark's and DFlash2's parents
    ranked a depth at a time), then read with the target's tokens after the verify forward."""
    prompt = prompts(model.config.vocab_size)[2]
    drafter = fresh_drafter(each_target, TrainSpec(drafter=variant, block_size=BLOCK)).eval()
    branches = VariantBranches(drafter, drafter_variant(variant).branches, drafts=anchor_layout(variant, block_size=BLOCK).drafts)
    greedy = greedy_decode(DecodeTarget(model), prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
    for budget in BUDGETS:
        with HostReads() as reads:
            decoded = tree_decode(tree_target(model, LAYERS), branches, prompt, budget=budget, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
        assert decoded.tokens == greedy.tokens
        assert reads.total == 2 + len(decoded.accepted), (budget, dict(reads.counts))


@pytest.mark.parametrize("stop_at", [None, 9])
def test_the_baselines_acceptance_along_greedys_output_is_the_verify_loops(model, stop_at):
    """prompt lookup and the bigram table, decoded by the verify loop and computed along greedy's
    output, step for step alike on every prompt: without a stop token, and with greedy's 10th token
    as one (steps cut where a stop token among the drafts ends the output)."""
    asked = prompts(model.config.vocab_size)
    unbounded = [greedy_decode(DecodeTarget(model), p, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP).tokens for p in asked]
    stop = NO_STOP if stop_at is None else frozenset([unbounded[0][stop_at]])
    table = bigram_of(unbounded)
    compared = 0
    for prompt in asked:
        greedy = greedy_decode(DecodeTarget(model), prompt, max_new_tokens=NEW_TOKENS, stop_ids=stop)
        for baseline in (PromptLookupDrafter(BLOCK), BigramDrafter(table, BLOCK)):
            decoded = speculative_decode(DecodeTarget(model), baseline, prompt, max_new_tokens=NEW_TOKENS, stop_ids=stop)
            computed = along_greedy(baseline, prompt.tolist(), greedy.tokens, max_new_tokens=NEW_TOKENS, stop_ids=stop)
            assert (computed.tokens, computed.accepted, computed.drafted) == (decoded.tokens, decoded.accepted, decoded.drafted)
            compared += sum(decoded.accepted)
    assert compared > 0, "some drafts were accepted"


@pytest.fixture(scope="module")
def tied(each_target):
    """The tiny target with two tokens made one: token `high`'s embedding and LM-head rows copied into
    token `low`'s (low < high): wherever greedy would take `high`, the two logits are exactly equal,
    and the context after either is the same. `high` is greedy's first token on the prompt."""
    model = AutoModelForCausalLM.from_pretrained(each_target, dtype=torch.float32).eval()
    prompt = prompts(model.config.vocab_size)[1]
    high = greedy_decode(DecodeTarget(model), prompt, max_new_tokens=1, stop_ids=NO_STOP).tokens[0]
    if high == 0:
        pytest.fail("greedy's first token is 0: no lower id to tie it with; pick another prompt")
    low = high // 2
    with torch.no_grad():
        for rows in {model.get_input_embeddings().weight, model.get_output_embeddings().weight}:  # one set where they are tied
            rows[low] = rows[high]
        logits = model(prompt[None]).logits[0, -1]
    assert logits[low] == logits[high] == logits.max(), "an exact tie at the top"
    return model, prompt, low, high


def test_every_loop_takes_the_lower_token_id_at_an_exact_tie(tied, each_target):
    model, prompt, low, high = tied
    greedy = greedy_decode(DecodeTarget(model), prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
    assert greedy.tokens[0] == low and greedy.runners_up[0] == high and greedy.margins[0] == 0.0
    assert high not in greedy.tokens  # every later tie too
    drafter = fresh_drafter(each_target, TrainSpec(drafter="dflash", block_size=BLOCK)).eval()
    drafts = anchor_layout("dflash", block_size=BLOCK).drafts
    # A drafter that proposes the other token of the tie: the verify forward must still commit the lower one.
    table = bigram_of([greedy.tokens, [high if t == low else t for t in greedy.tokens]])
    decoded = {
        "chain": speculative_decode(DecodeTarget(model, LAYERS), ModelDrafter(drafter, drafts=drafts), prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP),
        "tree": tree_decode(tree_target(model, LAYERS), VariantBranches(drafter, drafter_variant("dflash").branches, drafts=drafts), prompt,
                            budget=8, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP),
        "prompt_lookup": speculative_decode(DecodeTarget(model), PromptLookupDrafter(BLOCK), prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP),
        "bigram": speculative_decode(DecodeTarget(model), BigramDrafter(table, BLOCK), prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP),
    }
    for name, output in decoded.items():
        assert output.tokens == greedy.tokens, name


def other_break(greedy: Decoded, low: int, high: int) -> Decoded:
    """Greedy's output as a run that broke the tie the other way would record it (the two tokens swapped in its record)."""
    swap = {low: high, high: low}
    return Decoded(tokens=[swap.get(t, t) for t in greedy.tokens], seconds=greedy.seconds, margins=greedy.margins,
                   top_logits=greedy.top_logits, runners_up=[swap.get(t, t) for t in greedy.runners_up])


def test_the_lossless_check_judges_a_tie_greedy_broke_the_other_way_as_a_tie(tied):
    """Two outputs of one length, alike but where greedy tied: one as the reference and the other as
    the output, each way round. Greedy along the output agrees with it everywhere in one of the two
    (the reference is the other break): the check judges the first position where output and
    reference differ, not their lengths."""
    model, prompt, low, high = tied
    greedy = greedy_decode(DecodeTarget(model), prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
    other = other_break(greedy, low, high)
    assert len(other.tokens) == len(greedy.tokens) and other.tokens != greedy.tokens
    for output, reference in ((greedy.tokens, other), (other.tokens, greedy)):
        found = divergences(DecodeTarget(model), prompt, output, reference, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
        assert found[0].position == 0 and found[0].token == output[0] and found[0].greedy_token == reference.tokens[0]
        assert found[0].greedy_logit_gap == 0.0
        assert all(is_tie(d, 0.0) for d in found)
        assert mismatches([found], 0.0) == [{"prompt": 0, "tie": True, "divergences": mismatches([found], 0.0)[0]["divergences"]}]


def test_the_lossless_check_says_lengths_differ_only_where_they_do(tied):
    model, prompt, _, _ = tied
    greedy = greedy_decode(DecodeTarget(model), prompt, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
    short = greedy.tokens[:5]
    found = divergences(DecodeTarget(model), prompt, short, greedy, max_new_tokens=NEW_TOKENS, stop_ids=NO_STOP)
    assert [(d.position, d.token, d.greedy_token) for d in found] == [(5, None, None)]
    assert not is_tie(found[0], 1.0)
