"""The 95% intervals of acceptance figures (dflash_jobs/evaluate/intervals.py): a paired percentile
bootstrap over held-out prompts, tried on prompts drawn from known distributions."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jobs.evaluate.intervals import (
    DOES_NOT_HOLD, HOLDS, MIN_PROMPTS, NOT_DECIDED, RESAMPLES, Draws, PairedBootstrap, mean, verdict,
)


def decodings(rng: np.random.Generator, prompts: int, taus: list[float], *, shared: float = 0.0) -> list[dict[str, list[int]]]:
    """Per-prompt records of decodings of the same prompts whose true acceptance lengths are `taus`.
    Each prompt takes 10-40 verify steps and moves every decoding's per-step rate alike by a
    difficulty of standard deviation `shared` (an easy prompt is easy for every drafter), plus noise
    of its own per decoding. A step commits 1 + Binomial(7, p) tokens (a block of 8), p chosen so
    that tau = 1 + 7 p."""
    steps = rng.integers(10, 41, size=prompts)
    difficulty = rng.normal(0.0, shared, size=prompts)
    records = []
    for tau in taus:
        rate = np.clip((tau - 1) / 7 + difficulty + rng.normal(0.0, 0.05, size=prompts), 0.01, 0.99)
        committed = steps + rng.binomial(7 * steps, rate)
        records.append({"committed": committed.tolist(), "verify_steps": steps.tolist()})
    return records


def test_tau_is_committed_tokens_over_verify_steps_summed_over_the_prompts_on_every_draw():
    bootstrap = PairedBootstrap(3, resamples=500)
    tau = bootstrap.tau({"committed": [30, 5, 12], "verify_steps": [10, 5, 3]})
    assert tau.estimate == pytest.approx(47 / 18)
    # A draw takes three prompts with replacement: its counts say how often each.
    assert bootstrap.counts.shape == (500, 3) and (bootstrap.counts.sum(axis=1) == 3).all()
    first = bootstrap.counts[0]
    assert tau.draws[0] == pytest.approx((first @ [30, 5, 12]) / (first @ [10, 5, 3]))
    # A draw can only be a ratio of the prompts' sums: never above the best prompt's, below the worst's.
    assert 1.0 <= tau.draws.min() and tau.draws.max() <= 4.0


@pytest.mark.parametrize("prompts", [60, MIN_PROMPTS])
@pytest.mark.parametrize("taus", [(3.0, 2.4), (2.5, 2.5)])
def test_the_interval_covers_a_known_difference_about_95_times_in_100(taus, prompts):
    """Many experiments, each a fresh draw of 60 prompts (or as few as a verdict takes) from the same
    distributions: the interval of tau_a - tau_b must hold the difference of the distributions' own
    taus (0 for two alike) about 95% of the time."""
    rng = np.random.default_rng(11)
    population = decodings(rng, 200_000, list(taus), shared=0.05)
    truth = [sum(d["committed"]) / sum(d["verify_steps"]) for d in population]
    true_difference = truth[0] - truth[1]
    covered, experiments = 0, 300
    for experiment in range(experiments):
        a, b = decodings(rng, prompts, list(taus), shared=0.05)
        bootstrap = PairedBootstrap(prompts, resamples=2000, seed=experiment)
        low, high = (bootstrap.tau(a) - bootstrap.tau(b)).interval()
        covered += low <= true_difference <= high
    # 95% of 300 is 285, its binomial standard deviation 3.8: 0.90-0.985 is more than 3 of them either side.
    # At 16 prompts the percentile interval runs short (about 92%: MIN_PROMPTS says why it is the floor).
    assert (0.90 if prompts > MIN_PROMPTS else 0.87) <= covered / experiments <= 0.985


def test_a_clear_difference_holds_the_reverse_does_not_and_identical_decodings_or_few_prompts_decide_nothing():
    rng = np.random.default_rng(5)
    better, worse = decodings(rng, 48, [3.0, 2.0], shared=0.05)
    bootstrap = PairedBootstrap(48)
    a, b = bootstrap.tau(better), bootstrap.tau(worse)
    assert (a - b).interval()[0] > 0.5 and verdict(a - b) == HOLDS and verdict(b - a) == DOES_NOT_HOLD
    # Identical decodings differ by exactly 0 on every draw: the interval is [0, 0], holding zero.
    assert (a - a).interval() == (0.0, 0.0) and verdict(a - a) == NOT_DECIDED
    # Below MIN_PROMPTS prompts no verdict, whatever the interval: three prompts that each took the
    # same steps to the same tau (the tiny size's target answers alike) draw an interval of no width.
    alike = PairedBootstrap(3)
    one, other = alike.tau({"committed": [10] * 3, "verify_steps": [9] * 3}), alike.tau({"committed": [9] * 3, "verify_steps": [9] * 3})
    assert (one - other).interval() == pytest.approx((1 / 9, 1 / 9)) and verdict(one - other) == NOT_DECIDED
    # The clear difference above, on its first MIN_PROMPTS - 1 prompts: its interval is above zero, and no verdict.
    few = PairedBootstrap(MIN_PROMPTS - 1)
    a, b = (few.tau({key: values[: MIN_PROMPTS - 1] for key, values in record.items()}) for record in (better, worse))
    assert (a - b).interval()[0] > 0 and verdict(a - b) == NOT_DECIDED


def test_a_ratio_claim_is_decided_as_its_difference_and_the_ratio_has_its_own_interval():
    rng = np.random.default_rng(8)
    drafter, lookup = decodings(rng, 64, [3.0, 1.6], shared=0.05)
    bootstrap = PairedBootstrap(64)
    a, b = bootstrap.tau(drafter), bootstrap.tau(lookup)
    ratio = a / b
    assert ratio.estimate == pytest.approx(a.estimate / b.estimate)
    low, high = ratio.interval()
    assert low < ratio.estimate < high
    # tau_a >= k tau_b on a draw exactly where the ratio is >= k on it: the two decide alike.
    for k in (1.5, low - 0.01, high + 0.01, 3.0):
        assert (verdict(a - k * b) == HOLDS) == (low > k)


def test_pairing_narrows_the_interval_of_a_difference_when_the_prompts_move_both_decodings():
    rng = np.random.default_rng(3)
    a, b = decodings(rng, 40, [2.8, 2.6], shared=0.12)  # the prompts' difficulty moves both rates alike
    paired = PairedBootstrap(40)
    paired_low, paired_high = (paired.tau(a) - paired.tau(b)).interval()
    # Unpaired: each decoding's prompts drawn on their own, as two separate experiments would be.
    unpaired = Draws(0.0, PairedBootstrap(40, seed=1).tau(a).draws - PairedBootstrap(40, seed=2).tau(b).draws, 40)
    unpaired_low, unpaired_high = unpaired.interval()
    assert paired_high - paired_low < 0.6 * (unpaired_high - unpaired_low)
    # Here it decides what the unpaired interval cannot.
    assert paired_low > 0 > unpaired_low


def test_the_same_seed_draws_the_same_interval_and_another_seed_nearly_the_same():
    rng = np.random.default_rng(1)
    a, b = decodings(rng, 32, [3.0, 2.5])
    first, again = PairedBootstrap(32).tau(a) - PairedBootstrap(32).tau(b), PairedBootstrap(32).tau(a) - PairedBootstrap(32).tau(b)
    assert first.interval() == again.interval() and RESAMPLES == len(first.draws) == 10_000
    other = PairedBootstrap(32, seed=9).tau(a) - PairedBootstrap(32, seed=9).tau(b)
    assert other.interval() != first.interval()
    assert other.interval() == pytest.approx(first.interval(), abs=0.03)  # 10,000 draws: the bounds' own noise is small


def test_a_mean_over_seeds_is_taken_draw_by_draw():
    rng = np.random.default_rng(2)
    seeds = decodings(rng, 20, [2.0, 2.2, 2.4])
    bootstrap = PairedBootstrap(20, resamples=100)
    taus = [bootstrap.tau(seed) for seed in seeds]
    averaged = mean(taus)
    assert averaged.estimate == pytest.approx(sum(t.estimate for t in taus) / 3)
    assert np.allclose(averaged.draws, sum(t.draws for t in taus) / 3)
    with pytest.raises(ValueError, match="the mean of no figures"):
        mean([])


def test_summaries_are_strict_json_and_a_figure_undefined_on_some_draws_leaves_them_out():
    bootstrap = PairedBootstrap(4, resamples=2000)
    # Only the first prompt took a verify step: a draw without it has no tau.
    tau = bootstrap.tau({"committed": [3, 0, 0, 0], "verify_steps": [1, 0, 0, 0]})
    assert tau.estimate == 3.0 and np.isnan(tau.draws).any() and tau.interval() == (3.0, 3.0)
    nothing = bootstrap.tau({"committed": [0, 0, 0, 0], "verify_steps": [0, 0, 0, 0]})
    assert nothing.summary() == {"estimate": None, "interval": [None, None]} and verdict(nothing) == NOT_DECIDED
    assert (tau - 1).summary() == {"estimate": 2.0, "interval": [2.0, 2.0]}


def test_bad_input_names_what_is_wrong():
    bootstrap = PairedBootstrap(3, resamples=10)
    with pytest.raises(ValueError, match="source dflash: 2 per-prompt values for a bootstrap of 3 prompts"):
        bootstrap.tau({"committed": [1, 2], "verify_steps": [1, 1]}, name="source dflash")
    with pytest.raises(ValueError, match="cannot be combined: compute both with one PairedBootstrap"):
        bootstrap.tau({"committed": [1, 2, 3], "verify_steps": [1, 1, 1]}) - PairedBootstrap(3, resamples=20).tau(
            {"committed": [1, 2, 3], "verify_steps": [1, 1, 1]})
    with pytest.raises(ValueError, match="at least one prompt"):
        PairedBootstrap(0)
