"""eval/report.json and eval/acceptance.png: the evaluation's figures, stored beside the run.

report.json (format dflash.eval/v1):
    target, drafter, drafter_variant, prompts, max_new_tokens, device, dtype, processes
    block_size: the verify block, the anchor and its drafts (train.block_size, or one more for a
              drafter that samples from the anchor, DSpark); acceptance per position covers 1..block_size-1
    tie_ulps: a mismatch where greedy's top two logits were within this many units in the last
              place of its top logit (in dtype) is a numerical tie, not a bug (metrics.py)
    greedy:   {tokens, tokens_per_second}             plain greedy decoding, the reference
    drafters: {name: metrics.summarize(...)}          the trained drafter under its variant's name (drafter_variant:
              dflash, dflash2, dspark), and "prompt_lookup" as the training-free baseline;
              lossless (no mismatch but ties), ties (how many), mismatches [{prompt, position,
              greedy_margin, greedy_top_logit, tie_tolerance, tie}]
    drafters.<variant>.simulated: metrics.summarize_simulated(...)   the training forward's acceptance on
              the same prompts (evaluate/simulated.py): acceptance_length, acceptance_per_position,
              anchors, relative_gap per position ((decoded - simulated) / simulated), tolerance,
              disagreeing_positions (1-based; empty when training and serving agree)
    drafters.<variant>.calibration: calibration.summarize_calibration(...)   a drafter with a confidence head
              (DSpark): per draft position, its predicted survival (the product of the confidences up to
              it) against the realized one over the decoded verify steps, with Brier score and ECE
    lossless: true when every drafter's output equals plain greedy on every prompt, ties aside
    vllm_serve: the shell commands that serve this drafter with its target in vLLM (drafter/serving.py)
"""

from __future__ import annotations

import io
import json
from typing import Any, Mapping, Sequence

import torch

from dflash_jobs.evaluate.calibration import summarize_calibration
from dflash_jobs.evaluate.metrics import summarize, summarize_simulated, tokens_per_second
from dflash_jobs.drafter.speculative import Decoded
from dflash_jobs.formats import EVAL_PLOT_KEY, EVAL_REPORT_KEY

REPORT_FORMAT = "dflash.eval/v1"


def build_report(
    *, greedy: Sequence[Decoded], drafters: Mapping[str, Sequence[Decoded]], block_size: int, dtype: torch.dtype, tie_ulps: int,
    simulated: Mapping[str, Sequence[Sequence[int]]] | None = None,
    calibration: Mapping[str, Sequence[Sequence[Sequence[float]]]] | None = None, **about: Any,
) -> dict[str, Any]:
    """The report of one evaluation: `simulated` maps a drafter to its teacher-forced accepted
    drafts, per prompt and anchor; `calibration` a drafter with a confidence head to its survival
    probabilities, per prompt, verify step and draft; `about` holds what was evaluated (target, drafter, prompts, ...)."""
    summaries = {name: summarize(decoded, greedy, block_size, dtype=dtype, tie_ulps=tie_ulps) for name, decoded in drafters.items()}
    for name, anchors in (simulated or {}).items():
        summaries[name]["simulated"] = summarize_simulated(anchors, drafters[name], [d.tokens for d in greedy], block_size)
    for name, steps in (calibration or {}).items():
        summaries[name]["calibration"] = summarize_calibration(steps, drafters[name], block_size - 1)
    return {
        "format": REPORT_FORMAT,
        **about,
        "dtype": str(dtype).removeprefix("torch."),
        "tie_ulps": tie_ulps,
        "block_size": block_size,
        "greedy": {"tokens": sum(len(d.tokens) for d in greedy), "tokens_per_second": tokens_per_second(greedy)},
        "drafters": summaries,
        "lossless": all(s["lossless"] for s in summaries.values()),
    }


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
