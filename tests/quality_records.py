"""Synthetic chains for the quality benchmark's tests (bench/quality/records.py): each decoding's tau and
interval follow from its per-prompt records, as the evaluation's do; what the figures under test do
not read is zero or empty. The benchmark's directory must be on sys.path (the tests' fixtures put it
there), as the benchmark's own scripts import their modules."""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import Any

from dflash_jobs.evaluate.metrics import acceptance_interval


def records() -> Any:
    return importlib.import_module("records")


def decoding(per_prompt: dict[str, list] | None, *, acceptance_length: float | None = None, tree_decoding: bool = False, **parts: Any) -> Any:
    """A decoding of these per-prompt records (None: a report from before them), its tau theirs unless
    `acceptance_length` is given; `tree_decoding`: a draft tree's decoding at one budget."""
    tau = acceptance_length if acceptance_length is not None else sum(per_prompt["committed"]) / sum(per_prompt["verify_steps"])
    figures = {"acceptance_length": tau, "acceptance_per_position": [], "tokens_per_second": 0.0, "speedup": 0.0,
               "verify_steps": sum(per_prompt["verify_steps"]) if per_prompt else 0, "lossless": True, "mismatching_prompts": 0, "ties": 0,
               "real_mismatches": 0, "mismatches": [], "conditional_acceptance": records().ConditionalAcceptance(rates=[], steps=[]),
               "acceptance_length_interval": acceptance_interval(per_prompt) if per_prompt else [None, None], "per_prompt": per_prompt}
    if tree_decoding:
        return records().TreeDecoding(**figures, tokens=0, exact_acceptance_length=tau, agrees_with_exact=True, prompts_unlike_exact=[],
                                      prompts_off_greedy=[], **parts)
    return records().Decoding(**figures, **parts)


def trees(per_budget: dict[int, dict[str, list]]) -> Any:
    """A drafter's trees decoded at each budget with these per-prompt records."""
    return records().Trees(budgets=sorted(per_budget), chain_budget=0, chain_acceptance_length=0.0, at_chain_steps={},
                           decoded={budget: decoding(per_prompt, tree_decoding=True) for budget, per_prompt in per_budget.items()}, lossless=True)


def simulated(*, steps: int = 40, compared: bool = True, disagreeing: list[int] | None = None) -> Any:
    """The training forward's check at the decoding's anchors: `steps` of them compared (or too few), disagreeing at `disagreeing`."""
    at_anchors = records().SameAnchors(steps=steps, minimum_steps=24, compared=compared, verdict="agree" if compared else "not compared",
                                       simulated_per_position=[], decoded_per_position=[])
    return records().Simulated(acceptance_length=0.0, acceptance_per_position=[], anchors=steps, at_decoded_anchors=at_anchors, relative_gap=[],
                               tolerance=0.1, disagreeing_positions=disagreeing if compared else None)


def chain(drafter: str, drafters: dict[str, Any], *, supervised_tokens: int = 0, block: int = 8, trained_steps: int = 0) -> Any:
    """One chain's figures: its drafter's decoding and the others of `drafters`."""
    tolerance = records().TieTolerance(value=0.0, statistic="", positions=0, block_size=block, rule="")
    return records().ChainFigures(
        step_seconds={}, drafter=drafter, acceptance_length={name: round(d.acceptance_length, 3) for name, d in drafters.items()}, lossless=True,
        drafters=drafters, consistency=None, greedy_tokens_per_second=0.0,
        eval=records().EvalSettings(prompts=0, max_new_tokens=0, block_size=block, dtype="float32", tie_tolerance=tolerance),
        train_last={"step": trained_steps}, held_out_sample_ids=[], samples=0, tokens=0, supervised_tokens=supervised_tokens, generation=None)


def with_per_prompt(figures: Any, name: str, per_prompt: dict[str, list] | None) -> Any:
    """The chain with its decoding `name` given other per-prompt records (None: a report from before them)."""
    return replace(figures, drafters={**figures.drafters, name: replace(figures.drafters[name], per_prompt=per_prompt)})
