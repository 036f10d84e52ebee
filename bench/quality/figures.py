"""The figures across chains, read from their run directories: each chain's spread over seeds, the claims the benchmark makes and whether each holds (decided by 95% intervals
over the held-out prompts, CLAIM_RULE), and acceptance against data size.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from dflash_jobs.evaluate.intervals import DOES_NOT_HOLD, HOLDS, MIN_PROMPTS, NOT_DECIDED, Draws, PairedBootstrap, mean, verdict
from dflash_jobs.spec import PROMPT_LOOKUP

from chains import BASELINES_OF, Chain
from goals import Goals
from records import ChainFigures, Decoding

# ---- seeds, intervals and claims -------------------------------------------------------------------


def seed_groups(chains: Sequence[Chain]) -> dict[str, list[Chain]]:
    """The chains that train one drafter on the same states with other seeds, under the first one's name."""
    groups: dict[tuple[str, str, tuple, int | None, str], list[Chain]] = {}
    for chain in chains:
        groups.setdefault((chain.states_of or chain.name, chain.drafter, chain.settings, chain.epochs, chain.compute_dtype), []).append(chain)
    return {group[0].name: group for group in groups.values()}


def seed_spread(runs: dict[str, ChainFigures], chains: Sequence[Chain]) -> dict[str, dict[str, Any]]:
    """Each data set's and drafter's acceptance length over its seeds (its chains): mean, and spread
    (largest minus smallest), the training noise the intervals over prompts do not hold."""
    spread = {}
    for name, group in seed_groups(chains).items():
        values = [runs[c.name].acceptance_length[c.drafter] for c in group]
        spread[name] = {"drafter": group[0].drafter, **({"settings": dict(group[0].settings)} if group[0].settings else {}),
                        "chains": [c.name for c in group], "seeds": [c.seed for c in group], "acceptance_length": values,
                        "mean": round(statistics.fmean(values), 3), "spread": round(max(values) - min(values), 3)}
    return spread


def training_noise(entry: dict[str, Any]) -> float | None:
    """The spread of a drafter's tau over its seeds; None with one seed (no measure of it)."""
    return entry["spread"] if len(entry["seeds"]) > 1 else None


class Taus:
    """Every chain's decodings as figures of one paired bootstrap over the held-out prompts
    (dflash_jobs.evaluate.intervals): the chains decode the same prompts, token for token (run_quality
    checks it), so every difference between two of their decodings is paired prompt by prompt."""

    def __init__(self, runs: dict[str, ChainFigures]) -> None:
        self.runs = runs
        name, run = next(iter(runs.items()))
        self.bootstrap = PairedBootstrap(len(per_prompt(name, run.own)["committed"]))

    def decoding(self, chain: str, name: str | None = None) -> Draws:
        """tau of one decoding of a chain: its drafter's (None), or a baseline's (spec.BASELINES)."""
        run = self.runs[chain]
        name = name or run.drafter
        return self.bootstrap.tau(per_prompt(f"{chain} {name}", run.drafters[name]), name=f"{chain} {name}")

    def tree(self, chain: str, budget: int) -> Draws:
        """tau of a chain's drafter decoding by draft trees of `budget` nodes."""
        decoded = tree_budgets(self.runs[chain].own)
        if budget not in decoded:
            raise ValueError(f"{chain} decoded no draft trees of {budget} nodes (it has {sorted(decoded)}): set eval.tree_budgets")
        label = f"{chain} trees of {budget}"
        return self.bootstrap.tau(per_prompt(label, decoded[budget]), name=label)

    def drafter(self, entry: dict[str, Any], *, tree_budget: int | None = None) -> Draws:
        """A drafter's tau averaged over its seeds (a seed_spread entry), on every draw alike; by trees of
        `tree_budget` nodes where given."""
        return mean([self.decoding(chain) if tree_budget is None else self.tree(chain, tree_budget) for chain in entry["chains"]])


def tree_budgets(decoding: Decoding) -> dict[int, Decoding]:
    """A decoding's draft trees by node budget (none where the evaluation built none)."""
    return decoding.tree.decoded if decoding.tree else {}


def per_prompt(label: str, decoding: Decoding) -> dict[str, list]:
    """A decoding's per-prompt record from its evaluation report (metrics.per_prompt)."""
    if decoding.per_prompt is None:
        raise ValueError(f"{label}: its evaluation report has no per-prompt records (an evaluation from before them): evaluate the "
                         "chain again (remove its eval/report.json and its entry in the work directory's stages.json, then rerun)")
    return decoding.per_prompt


def judged(figure: Draws) -> dict[str, Any]:
    """A figure, its 95% interval over the prompts and whether it is above zero (intervals.verdict)."""
    return {**figure.summary(), "verdict": verdict(figure)}


CLAIM_RULE = ("a claim passes only where its figure's 95% interval over the held-out prompts (a paired percentile bootstrap: "
              "every chain decodes the same prompts) lies wholly above zero, in the claimed direction: 'holds'; wholly below: "
              f"'does not hold'; holding zero, or over fewer than {MIN_PROMPTS} prompts: 'not decided'. A drafter of several seeds "
              "enters at its mean over them, and the seeds' spread stands beside each claim as training noise, no longer its decider")


def decided(claim: str, figure: Draws, formula: str, **beside: Any) -> dict[str, Any]:
    """The claim "`figure` > 0" (`formula` says what it is): passed only when its whole 95% interval is
    above zero; not decided when the interval holds zero. `beside`: the figures it is made of, and the
    seeds' spread (training noise)."""
    found = judged(figure)
    return {"claim": claim, "passed": found["verdict"] == HOLDS, **found, "figure": formula, **beside}


def rising(curve: list[dict[str, Any]], taus: Taus) -> dict[str, Any]:
    """Acceptance rising with data: each step of the curve (more rows, the same prompts) as a paired
    difference; passed when every step's interval is above zero."""
    steps = []
    for smaller, larger in zip(curve, curve[1:]):
        rise = taus.decoding(larger["chain"]) - taus.decoding(smaller["chain"])
        steps.append({"supervised_tokens": [smaller["supervised_tokens"], larger["supervised_tokens"]], **judged(rise)})
    verdicts = {step["verdict"] for step in steps}
    found = HOLDS if steps and verdicts == {HOLDS} else DOES_NOT_HOLD if DOES_NOT_HOLD in verdicts else NOT_DECIDED
    return {"claim": "rising with data, at every step", "passed": found == HOLDS, "verdict": found,
            "figure": "tau(more rows) - tau(fewer rows), each step", "supervised_tokens": [point["supervised_tokens"] for point in curve],
            "steps": steps}


def train_serve(figures: ChainFigures) -> dict[str, Any]:
    """Whether the training forward and decoding accept alike at the same anchors, position by position
    (the evaluation's check): not passed where it did not compare them (too few steps, or no training forward)."""
    simulated = figures.own.simulated
    if simulated is None:
        return {"passed": False, "compared": False, "verdict": None, "steps": None, "minimum_steps": None, "disagreeing_positions": None,
                "relative_gap": None, "decoded_per_position": None, "simulated_per_position": None}
    at_anchors = simulated.at_decoded_anchors
    return {
        "passed": at_anchors.compared and simulated.disagreeing_positions == [],
        "compared": at_anchors.compared,
        "verdict": at_anchors.verdict,
        "steps": at_anchors.steps,
        "minimum_steps": at_anchors.minimum_steps,
        "disagreeing_positions": simulated.disagreeing_positions,
        "relative_gap": simulated.relative_gap,
        "decoded_per_position": at_anchors.decoded_per_position,
        "simulated_per_position": at_anchors.simulated_per_position,
    }


TRAIN_SERVE_RULE = ("the evaluation's check per position (metrics.simulated_consistency): a gap counts only beyond 10% of the "
                    "training forward's rate and beyond 2 standard errors of the decoded rate; fewer than 24 same-anchor steps: not compared")


def tree_acceptance(drafter: Decoding) -> dict[str, Any] | None:
    """A drafter's tree tau per node budget beside its chain tau (the evaluation's drafters.<variant>.tree,
    decoded by trees); None for a drafter the evaluation built no trees for."""
    tree = drafter.tree
    if tree is None:
        return None
    return {"chain": round(tree.chain_acceptance_length, 3), "lossless": tree.lossless,
            "agrees_with_exact": all(decoded.agrees_with_exact for decoded in tree.decoded.values()),
            "per_budget": {str(budget): round(decoded.acceptance_length, 3) for budget, decoded in tree.decoded.items()},
            "per_budget_interval": {str(budget): decoded.acceptance_length_interval for budget, decoded in tree.decoded.items()}}


def successors(spread: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The seed_spread entries of the drafters beside DFlash (DFlash2, DSpark) with their own heads, by chain name."""
    return {name: entry for name, entry in spread.items() if entry["drafter"] != "dflash" and "settings" not in entry}


def claims(runs: dict[str, ChainFigures], spread: dict[str, dict[str, Any]], curve: list[dict[str, Any]], taus: Taus) -> list[dict[str, Any]]:
    """The benchmark's claims (issue 35), each decided by its 95% interval over the held-out prompts
    (paired: every chain decodes the same prompts; a drafter of several seeds at its mean over them),
    its estimate and the seeds' spread beside it (training noise, no longer the decider): regenerated
    above source, above prompt lookup and at least 1.5x it, rising with data at every step; training
    and serving within 10% at every position in every chain (the evaluation's own check); and each
    successor (DFlash2, DSpark) at or above DFlash on the same states, prompts and verify block
    (issue 30: as published; "not decided" where the interval holds zero)."""
    regenerated = spread["regenerated"]
    dflash = taus.drafter(regenerated)
    lookup = taus.decoding(BASELINES_OF, PROMPT_LOOKUP)
    noise = {"regenerated": training_noise(regenerated)}
    agreement = {name: train_serve(figures) for name, figures in runs.items()}
    found = []
    if "source" in spread:  # a task with another writer's answers (tasks.Task.source_answers)
        from_source = taus.drafter(spread["source"])
        found.append(decided("regenerated > source", dflash - from_source, "tau(regenerated) - tau(source)",
                             acceptance_length={"regenerated": dflash.summary(), "source": from_source.summary()},
                             seed_spread={**noise, "source": training_noise(spread["source"])}))
    found += [
        decided("regenerated > prompt lookup", dflash - lookup, "tau(regenerated) - tau(prompt lookup)",
                acceptance_length={"regenerated": dflash.summary(), PROMPT_LOOKUP: lookup.summary()}, seed_spread=noise),
        decided("regenerated >= 1.5x prompt lookup", dflash - 1.5 * lookup, "tau(regenerated) - 1.5 tau(prompt lookup)",
                ratio=(dflash / lookup).summary(), seed_spread=noise),
        rising(curve, taus),
        {"claim": "train/serve within 10% per position, every chain", "passed": all(a["passed"] for a in agreement.values()),
         "decided_by": TRAIN_SERVE_RULE,
         "chains": {name: {key: a[key] for key in ("passed", "compared", "steps", "disagreeing_positions", "relative_gap")}
                    for name, a in agreement.items()}},
    ]
    for name, successor in successors(spread).items():
        tau = taus.drafter(successor)
        found.append(decided(
            f"{successor['drafter']} >= DFlash on the same states and verify block", tau - dflash, f"tau({successor['drafter']}) - tau(DFlash)",
            acceptance_length={successor["drafter"]: tau.summary(), "dflash": dflash.summary()},
            seed_spread={**noise, successor["drafter"]: training_noise(successor)},
            verify_block=(runs[name].eval.block_size, runs["regenerated"].eval.block_size),
        ))
    return found


def fp8_compute_parity(taus: Taus, chain: str) -> dict[str, Any]:
    """The drafter trained on states the target computed with FP8 linear layers (`chain`) against the
    one trained on bf16's (issue 50): at parity where its tau lies within the bf16 drafter's 95%
    interval over the prompts; the paired difference and its interval beside it."""
    bf16, fp8 = taus.decoding("regenerated"), taus.decoding(chain)
    low, high = bf16.interval()
    return {"claim": "FP8 target compute keeps the drafter's tau within bf16's 95% interval", "passed": bool(low <= fp8.estimate <= high),
            "acceptance_length": {"bfloat16": bf16.summary(), "float8": fp8.summary()},
            "difference": {**judged(fp8 - bf16), "figure": "tau(float8 compute) - tau(bfloat16)"}}


def best_drafter(spread: dict[str, dict[str, Any]], taus: Taus) -> dict[str, Any] | None:
    """The best of DFlash and its successors on the same states and prompts, named only where its lead
    over every other is decided by its interval (paired); otherwise the leader by estimate and the
    drafters it is not told apart from. None where DFlash stands alone."""
    drafters = {"dflash": taus.drafter(spread["regenerated"]),
                **{entry["drafter"]: taus.drafter(entry) for entry in successors(spread).values()}}
    if len(drafters) < 2:
        return None
    leader = max(drafters, key=lambda name: drafters[name].estimate)
    leads = {other: judged(drafters[leader] - drafters[other]) for other in drafters if other != leader}
    apart = all(lead["verdict"] == HOLDS for lead in leads.values())
    return {"best": leader if apart else None, "leader_by_estimate": leader,
            "not_told_apart_from": [other for other, lead in leads.items() if lead["verdict"] != HOLDS],
            "acceptance_length": {name: tau.summary() for name, tau in drafters.items()},
            "lead_of_the_leader": leads, "verdict": HOLDS if apart else NOT_DECIDED}


def attribution(spread: dict[str, dict[str, Any]], taus: Taus) -> list[dict[str, Any]]:
    """Each successor's lead over DFlash split at its ablation (the successor without its own head,
    on the same states): what the ablated drafter keeps is its anchor path's, what it loses its
    head's; a part decides only where its 95% interval over the prompts (paired) excludes zero, on
    either side; DFlash's seed spread stands beside it as training noise."""
    dflash = taus.drafter(spread["regenerated"])
    full = {entry["drafter"]: entry for entry in successors(spread).values()}
    found = []
    for name, ablated in spread.items():
        if "settings" not in ablated or ablated["drafter"] not in full:
            continue
        successor, without_head = taus.drafter(full[ablated["drafter"]]), taus.drafter(ablated)
        head, anchor_path = judged(successor - without_head), judged(without_head - dflash)
        found.append({
            "drafter": ablated["drafter"], "ablation": name, "settings": ablated["settings"],
            "acceptance_length": {"successor": successor.summary(), "ablated": without_head.summary(), "dflash": dflash.summary()},
            "lead_over_dflash": judged(successor - dflash), "from_its_head": head, "from_its_anchor_path": anchor_path,
            "dflash_seed_spread": training_noise(spread["regenerated"]),
            "head_decides": head["verdict"] != NOT_DECIDED, "anchor_path_decides": anchor_path["verdict"] != NOT_DECIDED,
        })
    return found


def goals(runs: dict[str, ChainFigures], spread: dict[str, dict[str, Any]], curve: list[dict[str, Any]], taus: Taus,
          asked: Goals) -> dict[str, Any]:
    """The goals `asked` (the task's: tau and its lead over prompt lookup at least, regenerated >
    source, acceptance rising with data, train/serve within 10% per position, lossless up to ties),
    each met only where its 95% interval over the prompts clears it (a ratio goal: tau_a - k tau_b
    above zero), with the estimate and interval beside it; trees over the chain where the chains
    decoded trees of asked.tree_budget nodes."""
    regenerated = spread["regenerated"]
    dflash = taus.drafter(regenerated)
    lookup = taus.decoding(BASELINES_OF, PROMPT_LOOKUP)
    found = {
        "asked": asdict(asked),
        "tau": {"at_least": asked.tau_at_least, **dflash.summary(), "met": verdict(dflash - asked.tau_at_least) == HOLDS},
        "over_prompt_lookup": {"at_least": asked.over_prompt_lookup_at_least, **(dflash / lookup).summary(),
                               "met": verdict(dflash - asked.over_prompt_lookup_at_least * lookup) == HOLDS},
    }
    if "source" in spread:
        source = taus.drafter(spread["source"])
        found["regenerated_over_source"] = {**(dflash / source).summary(), "met": verdict(dflash - source) == HOLDS}
    found |= {
        "rising_with_data": rising(curve, taus)["passed"],
        "train_serve_within_10_percent": all(train_serve(figures)["passed"] for figures in runs.values()),
        "lossless_up_to_ties": all(figures.lossless for figures in runs.values()),
    }
    decoded = tree_budgets(runs["regenerated"].own)
    at_least = asked.trees_over_chain_at_least
    if asked.tree_budget in decoded:
        trees = taus.drafter(regenerated, tree_budget=asked.tree_budget)
        found["trees_over_chain"] = {"budget": asked.tree_budget, "at_least": at_least, **(trees / dflash).summary(),
                                     "met": None if at_least is None else verdict(trees - at_least * dflash) == HOLDS}
    else:  # the size does not decode the goal's trees (Size.goal_trees): said, so that a missing goal is not read as none asked
        found["trees_over_chain"] = {"budget": asked.tree_budget, "at_least": at_least, "met": None,
                                     "not_measured": f"no draft trees of {asked.tree_budget} nodes decoded (decoded: {sorted(decoded)})"}
    return found


# ---- data size -------------------------------------------------------------------------------


def data_curve(runs: dict[str, ChainFigures], chains: Sequence[Chain]) -> list[dict[str, Any]]:
    """Acceptance length against the supervised tokens the drafter trained on: the regenerated chains
    in bf16, first seed, DFlash, trained for every epoch (the steps chains are the steps curve's), each
    with its 95% interval over the prompts (the evaluation's)."""
    points = [{"chain": c.name, "fraction": c.fraction, "supervised_tokens": runs[c.name].supervised_tokens,
               "acceptance_length": runs[c.name].acceptance_length[c.drafter], "interval": runs[c.name].own.acceptance_length_interval}
              for c in chains if c.regenerated and c.bf16 and c.drafter == "dflash" and c.seed == chains[0].seed and c.epochs is None]
    return sorted(points, key=lambda point: point["fraction"])


def plot_curve(curve: list[dict[str, Any]], prompt_lookup: float, path: Path, about: str = "") -> None:
    """The curve with each point's 95% interval over the prompts as a bar (none where a report had none);
    `about`: the target, under the title (a real model's figures say which)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    tokens = [p["supervised_tokens"] / 1e6 for p in curve]
    line, = ax.plot(tokens, [p["acceptance_length"] for p in curve], "o-", label="DFlash drafter (regenerated answers)")
    # The interval as drawn, not as +- offsets: a percentile interval need not be centred on its estimate.
    bars = [(x, p["interval"]) for x, p in zip(tokens, curve) if p.get("interval") and None not in p["interval"]]
    if bars:
        ax.vlines([x for x, _ in bars], [low for _, (low, _) in bars], [high for _, (_, high) in bars], color=line.get_color(),
                  alpha=0.6, linewidth=3, label="95% interval over the held-out prompts")
    ax.axhline(prompt_lookup, color="gray", linestyle="--", label="prompt lookup")
    ax.set_xlabel("supervised tokens trained on (millions)")
    ax.set_ylabel("acceptance length (tokens per target step)")
    ax.set_title("Acceptance against data size, same held-out prompts" + (f"\n{about}" if about else ""), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
