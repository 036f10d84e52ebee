"""One chain's figures as a typed record, read once from its run directory and by attribute after.

ChainFigures.read takes them from a chain's run: the evaluation's report (each decoding's figures,
the figures the benchmark keeps of metrics.summarize's), the data set's index and the trainer's last
metrics line. The benchmark's JSON holds each as `runs.<chain>` (to_json), and from_json reads that
back (a chain stage's figures in stages.json, a committed bench/results/quality-*.json). The
evaluator's key names are read here and nowhere else in bench/quality: the figures, the curves and
the claims read attributes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from dflash_jobs.formats import DATASET_KEY, EVAL_REPORT_KEY, TRAIN_METRICS_KEY

JSON = dict[str, Any]


def to_json(value: Any) -> Any:
    """A record as its JSON object (nested records as theirs, every key a string); an optional part the
    report did not hold (None where the field's default is None: a baseline's trees) is left out."""
    if is_dataclass(value):
        return {f.name: to_json(getattr(value, f.name)) for f in fields(value)
                if not (getattr(value, f.name) is None and f.default is None)}
    if isinstance(value, dict):
        return {str(key): to_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [to_json(item) for item in value]
    return value


def picked(record: type, raw: JSON, **parsed: Any) -> JSON:
    """The keys of `raw` that are fields of `record`, `parsed` (the nested records) in their place."""
    return {f.name: raw[f.name] for f in fields(record) if f.name in raw} | parsed


@dataclass(frozen=True, slots=True)
class SameAnchors:
    """The training forward against the decoding at the decoding's own anchors (metrics.summarize_simulated)."""

    steps: int
    minimum_steps: int
    compared: bool
    """As many steps as a verdict needs (minimum_steps) were compared."""
    verdict: str
    simulated_per_position: list[float | None]
    decoded_per_position: list[float | None]


@dataclass(frozen=True, slots=True)
class Simulated:
    """The trainer's teacher-forced acceptance on the evaluation's prompts (drafters.<variant>.simulated)."""

    acceptance_length: float
    acceptance_per_position: list[float]
    anchors: int
    at_decoded_anchors: SameAnchors
    relative_gap: list[float | None]
    tolerance: float
    disagreeing_positions: list[int] | None
    """Empty where training and serving agree at every position; None where too few steps were compared."""

    @classmethod
    def from_json(cls, raw: JSON) -> Simulated:
        return cls(**picked(cls, raw, at_decoded_anchors=SameAnchors(**raw["at_decoded_anchors"])))


@dataclass(frozen=True, slots=True)
class ConditionalAcceptance:
    rates: list[float | None]
    """rates[k-1]: the share of the steps that drafted k tokens and accepted the first k-1 that accepted draft k too."""
    steps: list[int]


@dataclass(frozen=True, slots=True, kw_only=True)
class Decoding:
    """One decoding of the held-out prompts (the evaluation's drafters.<name>): a chain's drafter or a baseline."""

    acceptance_length: float
    acceptance_per_position: list[float]
    tokens_per_second: float
    speedup: float
    verify_steps: int
    lossless: bool
    mismatching_prompts: int
    ties: int
    real_mismatches: int
    mismatches: list[JSON]
    simulated: Simulated | None = None
    """The trained drafter's alone, as are calibration, tree and coverage."""
    calibration: JSON | None = None
    tree: Trees | None = None
    coverage: JSON | None = None
    conditional_acceptance: ConditionalAcceptance
    acceptance_length_interval: list[float | None]
    per_prompt: dict[str, list] | None = None
    """metrics.per_prompt's records (committed tokens, verify steps a prompt); None in a report from before them."""

    @classmethod
    def from_json(cls, raw: JSON) -> Decoding:
        return cls(**picked(cls, raw, conditional_acceptance=ConditionalAcceptance(**raw["conditional_acceptance"]),
                            **({"simulated": Simulated.from_json(raw["simulated"])} if "simulated" in raw else {}),
                            **({"tree": Trees.from_json(raw["tree"])} if "tree" in raw else {})))


@dataclass(frozen=True, slots=True, kw_only=True)
class TreeDecoding(Decoding):
    """The real decoding by draft trees of one budget (trees.summarize_trees), beside the same computed exactly."""

    tokens: int
    exact_acceptance_length: float
    agrees_with_exact: bool
    prompts_unlike_exact: list[int]
    prompts_off_greedy: list[int]


@dataclass(frozen=True, slots=True)
class Trees:
    """A drafter's draft trees beside its chain (drafters.<variant>.tree)."""

    budgets: list[int]
    chain_budget: int
    chain_acceptance_length: float
    at_chain_steps: JSON
    decoded: dict[int, TreeDecoding]
    """By node budget."""
    lossless: bool

    @classmethod
    def from_json(cls, raw: JSON) -> Trees:
        return cls(**picked(cls, raw, decoded={int(budget): TreeDecoding.from_json(decoded) for budget, decoded in raw["decoded"].items()}))


@dataclass(frozen=True, slots=True)
class TieTolerance:
    """The target's own verify-against-decode rounding, below which a divergence is a tie (lossless.tie_tolerance)."""

    value: float
    statistic: str
    positions: int
    block_size: int
    rule: str


@dataclass(frozen=True, slots=True)
class EvalSettings:
    """What the chain's evaluation decoded: how many prompts, how far, at which verify block and dtype."""

    prompts: int
    max_new_tokens: int
    block_size: int
    dtype: str
    tie_tolerance: TieTolerance

    @classmethod
    def from_json(cls, raw: JSON) -> EvalSettings:
        return cls(**picked(cls, raw, tie_tolerance=TieTolerance(**raw["tie_tolerance"])))


@dataclass(frozen=True, slots=True, kw_only=True)
class ChainFigures:
    """One chain's figures: its steps' seconds, its decodings, what its evaluation decoded, what it trained on."""

    step_seconds: dict[str, float]
    drafter: str
    """Its drafter's variant (dflash, dflash2, dspark): its decoding's name among `drafters`."""
    acceptance_length: dict[str, float]
    """Each decoding's tau, rounded for the side-by-side table."""
    lossless: bool
    drafters: dict[str, Decoding]
    """Its drafter's decoding and the baselines' it decoded (chains.BASELINES_OF), by name."""
    consistency: JSON | None
    greedy_tokens_per_second: float
    eval: EvalSettings
    train_last: JSON
    """The trainer's last metrics line (train/metrics.jsonl)."""
    held_out_sample_ids: list[int]
    samples: int
    tokens: int
    supervised_tokens: int
    generation: JSON | None
    """The generate step's record of the rows it trained on; None for another writer's answers."""

    @property
    def own(self) -> Decoding:
        """Its drafter's decoding."""
        return self.drafters[self.drafter]

    @property
    def trained_steps(self) -> int:
        return self.train_last["step"]

    @classmethod
    def read(cls, chain_dir: Path, step_seconds: dict[str, float]) -> ChainFigures:
        """The figures a chain's run directory holds, beside the seconds its steps took."""
        run = chain_dir / "run"
        report = json.loads((run / EVAL_REPORT_KEY).read_text())
        dataset = json.loads((run / DATASET_KEY).read_text())
        train_metrics = [json.loads(line) for line in (run / TRAIN_METRICS_KEY).read_text().splitlines() if line]
        drafters = {name: Decoding.from_json(summary) for name, summary in report["drafters"].items()}
        return cls(step_seconds=step_seconds, drafter=report["drafter_variant"],
                   acceptance_length={name: round(decoding.acceptance_length, 3) for name, decoding in drafters.items()},
                   lossless=report["lossless"], drafters=drafters, consistency=report.get("consistency"),
                   greedy_tokens_per_second=report["greedy"]["tokens_per_second"], eval=EvalSettings.from_json(report),
                   train_last=train_metrics[-1], held_out_sample_ids=dataset["holdout"]["sample_ids"], samples=dataset["samples"],
                   tokens=dataset["tokens"], supervised_tokens=dataset["supervised_tokens"], generation=dataset.get("generation"))

    @classmethod
    def from_json(cls, raw: JSON) -> ChainFigures:
        """Read back from the benchmark's JSON (to_json)."""
        return cls(**picked(cls, raw, drafters={name: Decoding.from_json(decoding) for name, decoding in raw["drafters"].items()},
                            eval=EvalSettings.from_json(raw["eval"])))

    def to_json(self) -> JSON:
        return to_json(self)
