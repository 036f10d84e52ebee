"""eval/report.json and eval/acceptance.png: the evaluation's figures, stored beside the run.

report.json (format dflash.eval/v1):
    target, drafter, drafter_variant, prompts, max_new_tokens, device, dtype, processes
    block_size: the verify block, the anchor and its drafts (train.block_size, or one more for a
              drafter that samples from the anchor, DSpark); acceptance per position covers 1..block_size-1
    tie_tolerance: {value, statistic, positions, block_size, rule}: the target's own verify-against-decode
              rounding, measured on this run (evaluate/lossless.py verify_noise): the largest change a
              verify forward made to greedy's top-1 minus top-2 logit over `positions` positions; `rule`
              says which divergences it makes ties (lossless.TIE_RULE)
    timed:    {prompts, warm_up, processes, figures}: the speeds' source: the first `prompts` held-out prompts
              decoded by greedy and by every drafter as served, one after another in one process alone, after
              `warm_up` untimed prompt(s) (evaluator.decode_set); every other figure comes from all prompts
    greedy:   {tokens, tokens_per_second, per_prompt {tokens, seconds}}   plain greedy decoding, the reference;
              tokens_per_second from the timed subset, per_prompt from the figures' pass
    drafters: {name: metrics.summarize(...)}          the trained drafter under its variant's name (drafter_variant:
              dflash, dflash2, dspark), and the baselines eval.baselines names (evaluate/baselines.py):
              "prompt_lookup", training-free, and "bigram", the table described under `bigram`;
              acceptance counts only tokens committed (never past a stop token or max_new_tokens);
              acceptance_per_position[k-1]: the share of verify steps that accepted drafts 1..k;
              conditional_acceptance {rates, steps}: rates[k-1] the share of the steps that drafted at
              least k tokens (a tree: k deep) and accepted the first k-1 (steps[k-1] of them) that
              accepted draft k too, null
              where none did; lossless (no real mismatch), mismatching_prompts, ties, real_mismatches
              (prompts), mismatches [{prompt, tie, divergences [{position, token, greedy_token,
              greedy_runner_up, greedy_margin, greedy_top_logit, token_logit, greedy_logit_gap, tie}]}]:
              a divergence is a tie only where greedy's top logit minus its logit of the output's token
              (greedy_logit_gap) is within tie_tolerance.value;
              per_prompt {committed, verify_steps, tokens, seconds}: one list each, a value a held-out
              prompt in prompt order (metrics.per_prompt): committed tokens (accepted drafts and bonus
              tokens) and verify steps, so that acceptance_length = sum(committed) / sum(verify_steps) and
              verify_steps is the sum of its list; the output's tokens and the decoding's seconds (0 for
              a baseline, computed along greedy's output: baselines.along_greedy); tokens_per_second and
              speedup (over greedy's) from the timed subset (`timed`);
              acceptance_length_interval [low, high]: tau's 95% interval over the prompts (`intervals`)
    drafters.<variant>.simulated: metrics.summarize_simulated(...)   the training forward's acceptance on
              the same prompts (evaluate/simulated.py): acceptance_length, acceptance_per_position,
              anchors, at_decoded_anchors {steps, minimum_steps, compared, verdict, simulated and
              decoded per position}, relative_gap per position ((decoded - simulated) / simulated),
              tolerance, disagreeing_positions (1-based; empty when training and serving agree, null
              when too few steps were compared)
    drafters.<variant>.calibration: calibration.summarize_calibration(...)   a drafter with a confidence head
              (DSpark): per draft position, its predicted survival (the product of the confidences up to
              it) against the realized one over the decoded verify steps, with Brier score and ECE
    drafters.<variant>.tree: trees.summarize_trees(...)   the drafter's draft trees (DDTree) at each budget of
              eval.tree_budgets and at the chain's own (chain_budget: as many nodes as the chain drafts):
              at_chain_steps {steps, chain_acceptance_length, acceptance_length and contains_chain per
              budget}: exact, at every verify step of the chain's decoding; decoded {budget: the real tree
              decoding's metrics.summarize(...), its per_prompt and acceptance_length_interval among them,
              with exact_acceptance_length (the same decoding computed along greedy's output),
              agrees_with_exact, prompts_unlike_exact (whose real decoding committed otherwise),
              prompts_off_greedy (whose output left greedy's: not compared)}; lossless
    drafters.<variant>.coverage: trees.summarize_coverage(...)   per slot, the share of the chain's verify
              steps whose greedy token is among the drafter's k likeliest there (k = 1, 2, 4, 8)
    bigram:   null without the bigram baseline; else what it was fitted on: pairs_counted (which token
              pairs: the anchor and first label of every block training may draw), max_tokens (the cap
              on the token rows read: whole chunks in a random order, fixed seed, until the next would
              pass it; the first is always read), chunks_read of chunks, tokens_read of tokens, pairs,
              distinct_pairs, previous_tokens (tokens with a successor; the others end a bigram draft)
    intervals: how every acceptance_length_interval was computed (evaluate/intervals.py): {method (a
              paired percentile bootstrap over the held-out prompts), interval, confidence, resamples, seed,
              prompts}; every decoding's interval comes from the same draws of the prompts, and a paired
              comparison of two decodings (a drafter against a baseline, a tree against its chain, two
              runs' drafters on the same prompts) draws their per_prompt records alike
              (intervals.PairedBootstrap)
    prompt_sets: {name: prompt_set_table(...)} per set of eval.prompt_sets ({} without): source, rows read,
              prompts, refused {reason: rows} (evaluate/prompt_sets.py), tie_tolerance, timed_prompts,
              greedy_tokens_per_second, drafters {name: SET_FIGURES}, lossless
    lossless: true when no drafter, chain or tree, has a real mismatch on any prompt, of any set
    vllm_serve: the shell commands that serve this drafter with its target in vLLM (drafter/serving.py)
"""

from __future__ import annotations

import io
import json
from typing import Any, Mapping, Sequence

import torch

from dflash_jobs.drafter.speculative import Decoded
from dflash_jobs.evaluate.calibration import summarize_calibration
from dflash_jobs.evaluate.intervals import PairedBootstrap
from dflash_jobs.evaluate.lossless import Divergence, tie_tolerance
from dflash_jobs.evaluate.metrics import per_prompt, summarize, summarize_simulated, tokens_per_second
from dflash_jobs.evaluate.trees import PromptTrees, summarize_coverage, summarize_trees
from dflash_jobs.formats import EVAL_PLOT_KEY, EVAL_REPORT_KEY

REPORT_FORMAT = "dflash.eval/v1"
GREEDY = "greedy"
"""The timed subset's key of plain greedy decoding, beside the drafters' names."""


def build_report(
    *, greedy: Sequence[Decoded], drafters: Mapping[str, Sequence[Decoded]], divergences: Mapping[str, Sequence[Sequence[Divergence]]],
    verify_noise: Sequence[Sequence[float]], block_size: int, dtype: torch.dtype,
    simulated: Mapping[str, Sequence[Sequence[int]]] | None = None,
    calibration: Mapping[str, Sequence[Sequence[Sequence[float]]]] | None = None,
    trees: Mapping[str, Sequence[PromptTrees]] | None = None, timed: Mapping[str, Sequence[Decoded]] | None = None,
    prompt_sets: Mapping[str, dict[str, Any]] | None = None, **about: Any,
) -> dict[str, Any]:
    """The report of one evaluation. Per prompt: `divergences` maps a drafter to where its output
    leaves greedy's, `verify_noise` holds the target's verify-against-decode rounding
    (evaluate/lossless.py), `simulated` maps a drafter to its teacher-forced accepted drafts per
    anchor, `calibration` a drafter with a confidence head to its survival probabilities per verify
    step and draft, `trees` a drafter to its draft trees (evaluate/trees.py), `timed` greedy
    (GREEDY) and each drafter to their decodings of the timed subset (the speeds; None: from the
    figures' own decodings), `prompt_sets` each named set's table (prompt_set_table); `about`
    holds what was evaluated (target, drafter, prompts, ...)."""
    tolerance = tie_tolerance(verify_noise, block_size)
    summaries = {
        name: summarize(decoded, greedy, block_size, divergences=divergences[name], tie_tolerance=tolerance["value"],
                        timed=(timed[name], timed[GREEDY]) if timed else None)
        for name, decoded in drafters.items()
    }
    for name, anchors in (simulated or {}).items():
        summaries[name]["simulated"] = summarize_simulated(anchors, drafters[name], [d.tokens for d in greedy], block_size)
    for name, steps in (calibration or {}).items():
        summaries[name]["calibration"] = summarize_calibration(steps, drafters[name], block_size - 1)
    for name, prompts in (trees or {}).items():
        summaries[name]["tree"] = summarize_trees(prompts, drafters[name], greedy, block_size, chain_budget=block_size - 1,
                                                  tie_tolerance=tolerance["value"])
        summaries[name]["coverage"] = summarize_coverage([p.ranks for p in prompts], block_size - 1)
    return {
        "format": REPORT_FORMAT,
        **about,
        "dtype": str(dtype).removeprefix("torch."),
        "tie_tolerance": tolerance,
        "block_size": block_size,
        "timed": {"prompts": len(timed[GREEDY]) if timed else len(greedy), "warm_up": 1, "processes": 1 if timed else about.get("processes"),
                  "figures": "tokens_per_second and speedup" if timed else "every figure, speeds included, from every prompt"},
        "greedy": {"tokens": sum(len(d.tokens) for d in greedy), "tokens_per_second": tokens_per_second(timed[GREEDY] if timed else greedy),
                   "per_prompt": {key: values for key, values in per_prompt(greedy).items() if key in ("tokens", "seconds")}},
        "drafters": summaries,
        "intervals": PairedBootstrap(len(greedy)).describe(),
        "prompt_sets": dict(prompt_sets or {}),
        "lossless": (all(s["lossless"] and s.get("tree", {}).get("lossless", True) for s in summaries.values())
                     and all(table["lossless"] for table in (prompt_sets or {}).values())),
    }


SET_FIGURES = ("acceptance_length", "acceptance_length_interval", "acceptance_per_position", "verify_steps", "tokens",
               "tokens_per_second", "speedup", "lossless", "mismatching_prompts", "real_mismatches")
"""A drafter's figures in a prompt set's table, as summarize gives them."""


def prompt_set_table(about: Mapping[str, Any], *, greedy: Sequence[Decoded], drafters: Mapping[str, Sequence[Decoded]],
                     divergences: Mapping[str, Sequence[Sequence[Divergence]]], verify_noise: Sequence[Sequence[float]],
                     timed: Mapping[str, Sequence[Decoded]], block_size: int) -> dict[str, Any]:
    """One named prompt set's table (eval.prompt_sets), as published tables give a drafter: per drafter
    tau with its interval over the set's prompts, acceptance per position, and tokens/s and speed-up
    over greedy on the set's timed subset; the lossless verdict at the set's own tie tolerance."""
    tolerance = tie_tolerance(verify_noise, block_size)
    summaries = {name: summarize(decoded, greedy, block_size, divergences=divergences[name], tie_tolerance=tolerance["value"],
                                 timed=(timed[name], timed[GREEDY])) for name, decoded in drafters.items()}
    return {
        **about, "tie_tolerance": tolerance["value"], "timed_prompts": len(timed[GREEDY]),
        "greedy_tokens_per_second": tokens_per_second(timed[GREEDY]),
        "drafters": {name: {key: summary[key] for key in SET_FIGURES} for name, summary in summaries.items()},
        "lossless": all(summary["lossless"] for summary in summaries.values()),
    }


def report_warnings(report: Mapping[str, Any]) -> list[str]:
    """What the evaluation pod warns about, each line saying what it means and what to do."""
    lines = []
    real = {name: [m for m in s["mismatches"] if not m["tie"]] for name, s in report["drafters"].items() if not s["lossless"]}
    if real:
        # Beyond a tie: a bug (rollback, positions), never rounding the target does on its own.
        lines.append(f"speculative output differs from plain greedy beyond a tie (tolerance {report['tie_tolerance']['value']:.3g}, "
                     f"measured): {real}")
    for name, summary in report["drafters"].items():
        for budget, decoded in summary.get("tree", {}).get("decoded", {}).items():
            if not decoded["lossless"]:
                lines.append(f"{name}: decoding by trees of {budget} nodes differs from plain greedy beyond a tie: "
                             f"{[m for m in decoded['mismatches'] if not m['tie']]}")
            if not decoded["agrees_with_exact"]:
                lines.append(
                    f"{name}: decoding by trees of {budget} nodes committed other drafts than its exact figures on prompts "
                    f"{decoded['prompts_unlike_exact']} (tau {decoded['acceptance_length']:.3f}, exact "
                    f"{decoded['exact_acceptance_length']:.3f}): the drafter's scores ranked otherwise there, within the rounding "
                    "between the verify forwards' context and one forward's (evaluate/trees.py); in fp32 a tree built otherwise")
    for name, summary in report["drafters"].items():
        simulated = summary.get("simulated")
        if simulated is None:
            continue
        matched = simulated["at_decoded_anchors"]
        if not matched["compared"]:
            lines.append(
                f"{name}: training and serving were not compared: only {matched['steps']} verify steps drafted a whole block "
                f"at an anchor the training forward drafted from, fewer than the {matched['minimum_steps']} a verdict needs. "
                f"Raise eval.max_new_tokens (now {report.get('max_new_tokens')}; a step counts only when its "
                f"{report['block_size'] - 1} drafts fit, so answers need several blocks of {report['block_size']}) "
                f"or eval.prompts (now {report.get('prompts')})")
        elif simulated["disagreeing_positions"]:
            lines.append(
                f"{name}: decoded acceptance differs from the training forward's by more than "
                f"{round(100 * simulated['tolerance'])}% at positions {simulated['disagreeing_positions']} (relative gaps "
                f"{[None if g is None else round(g, 3) for g in simulated['relative_gap']]}): training and serving disagree "
                "about what the drafter sees")
    return lines


def report_json(report: Mapping[str, Any]) -> bytes:
    return (json.dumps(report, indent=2, sort_keys=True) + "\n").encode()


def acceptance_plot(report: Mapping[str, Any]) -> bytes:
    """A PNG of acceptance per block position, one line per drafter, tau in the legend."""
    import matplotlib

    matplotlib.use("Agg")  # pods and CI have no display
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4), dpi=120)
    positions = list(range(1, report["block_size"]))
    for name, summary in report["drafters"].items():
        line, = axes.plot(positions, summary["acceptance_per_position"], marker="o", label=f"{name} (tau = {summary['acceptance_length']:.2f})")
        if "simulated" in summary:
            simulated = summary["simulated"]
            axes.plot(positions, simulated["acceptance_per_position"], linestyle="--", color=line.get_color(),
                      label=f"{name}, training forward (tau = {simulated['acceptance_length']:.2f})")
    axes.set_xlabel("draft position k")
    axes.set_ylabel("P(first k drafts accepted)")
    axes.set_ylim(0, 1.02)
    axes.set_xticks(positions)
    axes.grid(alpha=0.3)
    axes.legend()
    axes.set_title(f"Acceptance per position, {report.get('prompts', '?')} held-out prompts")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()


def store_report(storage, report: Mapping[str, Any]) -> None:
    """Writes report.json and the plot under eval/ of the run's storage."""
    storage.put_bytes(EVAL_PLOT_KEY, acceptance_plot(report))
    storage.put_bytes(EVAL_REPORT_KEY, report_json(report))
