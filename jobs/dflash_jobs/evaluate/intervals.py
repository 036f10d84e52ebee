"""Confidence intervals for acceptance figures: a paired percentile bootstrap over the held-out prompts.

tau of a decoding is its committed tokens over its verify steps, each summed over the prompts (a
ratio of sums: a prompt weighs as many verify steps as it took). Its noise is the prompts': other
held-out prompts would give another tau. The bootstrap draws the prompts again, with replacement,
as many as there are, RESAMPLES times, and computes every figure on every draw; the interval at
CONFIDENCE = 0.95 is the 2.5th to the 97.5th percentile of the draws (the percentile method,
Efron & Tibshirani, An Introduction to the Bootstrap, 1993, ch. 13). It says how far the prompts
move a figure, not how far training does: a drafter trained again with another seed is the other
noise, measured by training it again (the benchmark's seeds).

Paired: every decoding of the same prompts is computed on the same draws (the draws depend only on
the prompt count, RESAMPLES and SEED, so two bootstraps of as many prompts draw alike). A difference
between two decodings keeps what the prompts share: a prompt easy for one drafter is easy for the
other, so the difference moves far less from draw to draw than either figure does, and its interval
is that much narrower than two separate intervals would say. A figure of several decodings (a
difference, tau_a - 1.5 tau_b, a ratio, a mean over seeds) is computed draw by draw, with the
arithmetic operators of `Draws`.

A claim that a figure is above zero holds when its whole interval is (`verdict`): "holds" above
zero, "does not hold" below, "not decided" when the interval straddles zero (or touches it: two
identical decodings differ by exactly 0 on every draw, and decide nothing), and below MIN_PROMPTS
prompts whatever the interval: a few prompts make few distinct draws, and the percentile interval
then holds the truth far less often than it says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

RESAMPLES = 10_000
"""Bootstrap draws: the 2.5th percentile then rests on 250 of them (its own noise is a few hundredths of the interval)."""
SEED = 0
CONFIDENCE = 0.95
MIN_PROMPTS = 16
"""Prompts below which no verdict is given. Measured on simulated decodings (tests/test_intervals.py's
model: prompts of 10-40 verify steps, blocks of 8), the 95% interval of a difference held the true one
in 84% of 400 trials at 5 prompts, 88-90% at 10, 92-93% at 16 and 94-96% at 60."""
METHOD = "paired percentile bootstrap over the held-out prompts"

HOLDS, NOT_DECIDED, DOES_NOT_HOLD = "holds", "not decided", "does not hold"


@dataclass(frozen=True, eq=False)  # arrays have no one truth value: Draws compare by identity
class Draws:
    """A figure on the prompts as decoded (`estimate`) and on every bootstrap draw of them (`draws`,
    NaN on a draw where it is undefined: a ratio whose denominator the draw left at zero), of how many
    `prompts`."""

    estimate: float
    draws: np.ndarray
    prompts: int

    def _combine(self, other: Draws | float, operation) -> Draws:
        if not isinstance(other, Draws):
            other = Draws(float(other), np.full_like(self.draws, float(other)), self.prompts)
        if other.draws.shape != self.draws.shape or other.prompts != self.prompts:
            raise ValueError(f"figures of {len(self.draws)} and {len(other.draws)} bootstrap draws of {self.prompts} and {other.prompts} "
                             "prompts cannot be combined: compute both with one PairedBootstrap")
        with np.errstate(divide="ignore", invalid="ignore"):
            estimate, draws = operation(np.float64(self.estimate), np.float64(other.estimate)), operation(self.draws, other.draws)
        # A ratio whose denominator is zero (on a draw, or on the prompts as decoded) is undefined there.
        return Draws(float(estimate) if np.isfinite(estimate) else math.nan, np.where(np.isfinite(draws), draws, np.nan), self.prompts)

    def __add__(self, other: Draws | float) -> Draws:
        return self._combine(other, np.add)

    def __sub__(self, other: Draws | float) -> Draws:
        return self._combine(other, np.subtract)

    def __mul__(self, other: Draws | float) -> Draws:
        return self._combine(other, np.multiply)

    def __rmul__(self, other: float) -> Draws:
        return self * other

    def __truediv__(self, other: Draws | float) -> Draws:
        return self._combine(other, np.divide)

    def interval(self, confidence: float = CONFIDENCE) -> tuple[float, float]:
        """The percentile interval: the draws' (1 - confidence) / 2 and (1 + confidence) / 2 quantiles
        (NaN draws left out; NaN bounds when every draw is)."""
        defined = self.draws[~np.isnan(self.draws)]
        if not len(defined):
            return math.nan, math.nan
        low, high = np.quantile(defined, [(1 - confidence) / 2, (1 + confidence) / 2])
        return float(low), float(high)

    def summary(self, digits: int = 3) -> dict[str, Any]:
        """{estimate, interval: [low, high]}, rounded, None for what is undefined (strict JSON has no NaN)."""
        return {"estimate": _rounded(self.estimate, digits), "interval": [_rounded(bound, digits) for bound in self.interval()]}


def _rounded(value: float, digits: int) -> float | None:
    return None if math.isnan(value) else round(value, digits)


def verdict(figure: Draws, confidence: float = CONFIDENCE) -> str:
    """Whether "`figure` > 0" holds at `confidence`: HOLDS when the whole interval is above zero,
    DOES_NOT_HOLD when it is below, NOT_DECIDED otherwise, and below MIN_PROMPTS prompts."""
    if figure.prompts < MIN_PROMPTS:
        return NOT_DECIDED
    low, high = figure.interval(confidence)
    if low > 0:
        return HOLDS
    if high < 0:
        return DOES_NOT_HOLD
    return NOT_DECIDED


def mean(figures: Sequence[Draws]) -> Draws:
    """The mean of figures of one bootstrap, draw by draw (a drafter's tau averaged over its seeds)."""
    if not figures:
        raise ValueError("the mean of no figures")
    total = figures[0]
    for figure in figures[1:]:
        total = total + figure
    return total * (1 / len(figures))


class PairedBootstrap:
    """RESAMPLES draws of `prompts` prompts with replacement, as counts: counts[r, i] is how often draw
    r took prompt i. Every figure computed with it is paired with every other."""

    def __init__(self, prompts: int, *, resamples: int = RESAMPLES, seed: int = SEED) -> None:
        if prompts < 1 or resamples < 1:
            raise ValueError(f"a bootstrap needs at least one prompt and one resample, got {prompts} prompts and {resamples} resamples")
        self.prompts, self.resamples, self.seed = prompts, resamples, seed
        taken = np.random.default_rng(seed).integers(0, prompts, size=(resamples, prompts))  # [R, n]: the prompts each draw took
        rows = np.arange(resamples)[:, None] * prompts
        self.counts = np.bincount((rows + taken).ravel(), minlength=resamples * prompts).reshape(resamples, prompts)  # [R, n]

    def ratio_of_sums(self, numerators: Sequence[float], denominators: Sequence[float], *, name: str = "figure") -> Draws:
        """sum(numerators) / sum(denominators) over the prompts, and over every draw of them (NaN where
        the denominators sum to zero: a decoding without a verify step has no tau)."""
        numerators, denominators = self._per_prompt(numerators, name), self._per_prompt(denominators, name)
        return (Draws(float(numerators.sum()), self.counts @ numerators, self.prompts)
                / Draws(float(denominators.sum()), self.counts @ denominators, self.prompts))

    def tau(self, per_prompt: Mapping[str, Sequence[int]], *, name: str = "tau") -> Draws:
        """The acceptance length of a decoding from its per-prompt record (metrics.per_prompt): committed
        tokens over verify steps."""
        return self.ratio_of_sums(per_prompt["committed"], per_prompt["verify_steps"], name=name)

    def describe(self) -> dict[str, Any]:
        """How the intervals were computed, for a report."""
        return {"method": METHOD, "interval": "percentile", "confidence": CONFIDENCE, "resamples": self.resamples, "seed": self.seed,
                "prompts": self.prompts, "minimum_prompts_for_a_verdict": MIN_PROMPTS}

    def _per_prompt(self, values: Sequence[float], name: str) -> np.ndarray:
        array = np.asarray(values, dtype=np.float64)
        if array.shape != (self.prompts,):
            raise ValueError(f"{name}: {array.shape[0] if array.ndim else 'no'} per-prompt values for a bootstrap of {self.prompts} prompts: "
                             "every decoding compared must have decoded the same prompts, one value each, in prompt order")
        return array
