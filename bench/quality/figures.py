"""The figures across chains, read from their run directories: how far the held-out prompts are from
the training data and how much the target's answers depend on them (diversity), each chain's
spread over seeds, the claims the benchmark makes and whether each holds, and acceptance against
data size.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from dflash_jobs.formats import DATASET_KEY, TokenChunk
from dflash_jobs.rows import prompt_length

from chains import Chain, held_out_samples

DISTINCT_GOAL = 0.9
"""Distinct held-out answers per held-out prompt, at least: the target's answers depend on the prompt."""
VERBATIM_GOAL = 0.05
"""Held-out answers found word for word in a training answer, at most: the drafter cannot have learnt them."""
THINK_END = "</think>"


def split_samples(chunk: TokenChunk) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(prompt, answer) token ids of every sample: the answer is its last supervised run."""
    pairs = []
    for i in range(chunk.num_samples):
        ids, mask = chunk.sample(i)
        cut = prompt_length(mask)
        pairs.append((tuple(ids[:cut].tolist()), tuple(ids[cut:].tolist())))
    return pairs


def training_samples(chain_dir: Path) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(prompt, answer) token ids of every sample the chain's drafter trained on."""
    index = json.loads((chain_dir / "run" / DATASET_KEY).read_text())
    return [pair for chunk in index["chunks"]
            for pair in split_samples(TokenChunk.decode((chain_dir / "run" / chunk["path"]).read_bytes(), chunk["path"]))]


def reply(text: str) -> str:
    """An answer's text after its (empty) thinking block, without the turn's end."""
    return text.split(THINK_END)[-1].replace("<|im_end|>", "").strip()


@dataclass(frozen=True, slots=True)
class HeldOutAnswers:
    """The target's greedy answers to the held-out prompts (the generate step's, in the regenerated
    chain's held-out samples), cut where the evaluation stops decoding, beside what the drafter
    trained on."""

    sample_ids: list[int]
    """The data set's row of each (prepare's sample ids)."""
    prompts: list[tuple[int, ...]]
    cut: list[tuple[int, ...]]
    found: list[bool]
    """Whether a training answer begins with it, token for token."""
    replies: list[str]
    """Its text after the (empty) thinking block, not cut."""
    trained: list[tuple[tuple[int, ...], tuple[int, ...]]]
    """(prompt, answer) of every training sample."""


def held_out_answers(regenerated: Path, tokenizer, answer_tokens: int) -> HeldOutAnswers:
    held = held_out_samples(regenerated)
    held_pairs, trained = split_samples(held), training_samples(regenerated)
    cut = [answer[:answer_tokens] for _, answer in held_pairs]
    return HeldOutAnswers(
        held.sample_ids.tolist(), [prompt for prompt, _ in held_pairs], cut,
        [any(trained_answer[: len(answer)] == answer for _, trained_answer in trained) for answer in cut],
        [reply(tokenizer.decode(answer)) for _, answer in held_pairs], trained,
    )


def distinct_and_found(cut: list[tuple[int, ...]], found: list[bool]) -> dict[str, Any]:
    """How many of these held-out answers are distinct and how many were found among the training answers, against the goals."""
    prompts, distinct, verbatim = len(cut), len(set(cut)), sum(found)
    return {"held_out_prompts": prompts, "held_out_answers_distinct": distinct, "held_out_answers_found_in_training_answers": verbatim,
            "distinct_share": round(distinct / prompts, 3), "verbatim_share": round(verbatim / prompts, 3),
            "met": distinct >= DISTINCT_GOAL * prompts and verbatim <= VERBATIM_GOAL * prompts}


def diversity(regenerated: Path, source: Path, tokenizer, answer_tokens: int) -> dict[str, Any]:
    """How far the held-out prompts are from the drafter's training data, and how much the target's
    answers to them depend on them (held_out_answers), with how often the target says what the data
    set's writer says (`source`: the source chain). A task adds figures of its own (tasks.py)."""
    answers = held_out_answers(regenerated, tokenizer, answer_tokens)
    source_answers = [reply(tokenizer.decode(answer)) for _, answer in split_samples(held_out_samples(source))]
    trained_prompts = {prompt for prompt, _ in answers.trained}
    shares = distinct_and_found(answers.cut, answers.found)
    meaningful = shares.pop("met")
    prompts, distinct, verbatim = (shares[key] for key in ("held_out_prompts", "held_out_answers_distinct", "held_out_answers_found_in_training_answers"))
    return {
        **shares,
        "held_out_prompts_equal_to_a_training_prompt": sum(prompt in trained_prompts for prompt in answers.prompts),
        "held_out_answers_equal_to_source": sum(a == b for a, b in zip(answers.replies, source_answers, strict=True)),
        "answer_tokens": answer_tokens,
        "training_prompts": len(answers.trained),
        "training_answers_distinct": len({answer for _, answer in answers.trained}),
        "goals": {"distinct_share_at_least": DISTINCT_GOAL, "verbatim_share_at_most": VERBATIM_GOAL, "met": meaningful},
        "verdict": (f"{'meaningful' if meaningful else 'degenerate'}: {distinct} distinct answers to {prompts} held-out prompts, "
                    f"{verbatim} found word for word in a training answer (goals: >= {DISTINCT_GOAL:.0%} distinct, <= {VERBATIM_GOAL:.0%} found)"
                    + ("" if meaningful else "; the figures below say little about a real target")),
    }


# ---- seeds and claims ------------------------------------------------------------------------


def seed_groups(chains: Sequence[Chain]) -> dict[str, list[Chain]]:
    """The chains that train one drafter on the same states with other seeds, under the first one's name."""
    groups: dict[tuple[str, str, tuple, int | None], list[Chain]] = {}
    for chain in chains:
        groups.setdefault((chain.states_of or chain.name, chain.drafter, chain.settings, chain.epochs), []).append(chain)
    return {group[0].name: group for group in groups.values()}


def seed_spread(runs: dict[str, dict[str, Any]], chains: Sequence[Chain]) -> dict[str, dict[str, Any]]:
    """Each data set's and drafter's acceptance length over its seeds: mean, and spread (largest minus smallest)."""
    spread = {}
    for name, group in seed_groups(chains).items():
        values = [runs[c.name]["acceptance_length"][c.drafter] for c in group]
        spread[name] = {"drafter": group[0].drafter, **({"settings": dict(group[0].settings)} if group[0].settings else {}),
                        "seeds": [c.seed for c in group], "acceptance_length": values,
                        "mean": round(statistics.fmean(values), 3), "spread": round(max(values) - min(values), 3)}
    return spread


def train_serve(figures: dict[str, Any]) -> dict[str, Any]:
    """Whether the training forward and decoding accept alike at the same anchors, position by position
    (the evaluation's check): not passed where it did not compare them (too few steps)."""
    simulated = figures["drafters"][figures["drafter"]].get("simulated") or {}
    at_anchors = simulated.get("at_decoded_anchors")
    at_anchors = at_anchors if isinstance(at_anchors, dict) else {}
    compared = bool(at_anchors.get("compared", at_anchors.get("steps")))
    return {
        "passed": compared and simulated.get("disagreeing_positions") == [],
        "compared": compared,
        "verdict": at_anchors.get("verdict"),
        "steps": at_anchors.get("steps"),
        "minimum_steps": at_anchors.get("minimum_steps"),
        "disagreeing_positions": simulated.get("disagreeing_positions"),
        "relative_gap": simulated.get("relative_gap"),
        "decoded_per_position": at_anchors.get("decoded_per_position"),
        "simulated_per_position": at_anchors.get("simulated_per_position"),
    }


def tree_acceptance(drafter: dict[str, Any]) -> dict[str, Any] | None:
    """A drafter's tree tau per node budget beside its chain tau (the evaluation's drafters.<variant>.tree,
    decoded by trees); None for a drafter the evaluation built no trees for."""
    tree = drafter.get("tree")
    if tree is None:
        return None
    return {"chain": round(tree["chain_acceptance_length"], 3), "lossless": tree["lossless"],
            "per_budget": {budget: round(decoded["acceptance_length"], 3) for budget, decoded in tree["decoded"].items()}}


def above(name: str, value: float, other: str, other_value: float, spread: float | None) -> dict[str, Any]:
    """The claim "`name` > `other` by more than the spread between seeds"; not passed without a spread."""
    return {
        "claim": f"{name} > {other} by more than the spread between seeds",
        "passed": spread is not None and value - other_value > spread,
        "difference": round(value - other_value, 3),
        "spread": spread,
    }


def claims(runs: dict[str, dict[str, Any]], spread: dict[str, dict[str, Any]], curve: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The benchmark's claims, each with its figures and whether it holds (issue 35): regenerated
    above source, above prompt lookup and at least 1.5x it, and rising with data, each by more than
    the seeds' spread; training and serving within 10% at every position in every chain; and each
    successor (DFlash2, DSpark) at or above DFlash on the same states, prompts and verify block
    (issue 30: as published)."""
    regenerated, source = spread["regenerated"], spread["source"]
    measured = len(regenerated["seeds"]) > 1 and len(source["seeds"]) > 1
    noise = regenerated["spread"] if measured else None
    lookup = runs["regenerated"]["acceptance_length"]["prompt_lookup"]
    agreement = {name: train_serve(figures) for name, figures in runs.items()}
    rises = [round(b["acceptance_length"] - a["acceptance_length"], 3) for a, b in zip(curve, curve[1:])]
    found = [
        above("regenerated", regenerated["mean"], "source", source["mean"], max(regenerated["spread"], source["spread"]) if measured else None),
        above("regenerated", regenerated["mean"], "prompt lookup", lookup, noise),
        {"claim": "regenerated >= 1.5x prompt lookup by more than the spread between seeds",
         "passed": noise is not None and regenerated["mean"] - noise >= 1.5 * lookup,
         "ratio": round(regenerated["mean"] / lookup, 3), "spread": noise},
        {"claim": "rising with data, each step by more than the spread between seeds",
         "passed": noise is not None and bool(rises) and all(rise > noise for rise in rises),
         "supervised_tokens": [point["supervised_tokens"] for point in curve], "rises": rises, "spread": noise},
        {"claim": "train/serve within 10% per position, every chain", "passed": all(a["passed"] for a in agreement.values()),
         "chains": {name: {key: a[key] for key in ("passed", "compared", "steps", "disagreeing_positions", "relative_gap")}
                    for name, a in agreement.items()}},
    ]
    for name, successor in spread.items():
        if successor["drafter"] == "dflash" or "settings" in successor:
            continue
        difference = round(successor["mean"] - regenerated["mean"], 3)
        found.append({
            "claim": f"{successor['drafter']} >= DFlash on the same states and verify block",
            "passed": difference >= 0,
            "acceptance_length": successor["mean"], "dflash": regenerated["mean"], "difference": difference,
            "dflash_seed_spread": regenerated["spread"] if measured else None,
            "within_seed_spread": measured and abs(difference) <= regenerated["spread"],
            "verify_block": (runs[name]["eval"].get("block_size"), runs["regenerated"]["eval"].get("block_size")),
        })
    return found


def attribution(spread: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each successor's lead over DFlash split at its ablation (the successor without its own head,
    on the same states): what the ablated drafter keeps is its anchor path's, what it loses its
    head's; a part decides nothing unless it exceeds DFlash's spread between seeds."""
    dflash = spread["regenerated"]
    noise = dflash["spread"] if len(dflash["seeds"]) > 1 else None
    full = {entry["drafter"]: entry for entry in spread.values() if entry["drafter"] != "dflash" and "settings" not in entry}
    found = []
    for name, ablated in spread.items():
        if "settings" not in ablated or ablated["drafter"] not in full:
            continue
        successor = full[ablated["drafter"]]
        head, anchor_path = round(successor["mean"] - ablated["mean"], 3), round(ablated["mean"] - dflash["mean"], 3)
        found.append({
            "drafter": ablated["drafter"], "ablation": name, "settings": ablated["settings"],
            "acceptance_length": {"successor": successor["mean"], "ablated": ablated["mean"], "dflash": dflash["mean"]},
            "lead_over_dflash": round(successor["mean"] - dflash["mean"], 3), "from_its_head": head, "from_its_anchor_path": anchor_path,
            "dflash_seed_spread": noise,
            "head_decides": noise is not None and abs(head) > noise, "anchor_path_decides": noise is not None and abs(anchor_path) > noise,
        })
    return found


def goals(runs: dict[str, dict[str, Any]], spread: dict[str, dict[str, Any]], curve: list[dict[str, Any]]) -> dict[str, Any]:
    """The H200 goals of issue 29: tau >= 3.0 and >= 1.5x prompt lookup, regenerated > source,
    acceptance rising with data, train/serve within 10% per position, lossless up to ties."""
    regenerated = spread["regenerated"]["mean"]
    lookup = runs["regenerated"]["acceptance_length"]["prompt_lookup"]
    return {
        "regenerated_dflash": regenerated,
        "tau_at_least_3": regenerated >= 3.0,
        "over_prompt_lookup": round(regenerated / lookup, 3),
        "over_prompt_lookup_at_least_1_5": regenerated >= 1.5 * lookup,
        "regenerated_over_source": round(regenerated / spread["source"]["mean"], 3),
        "regenerated_above_source": regenerated > spread["source"]["mean"],
        "rising_with_data": len(curve) > 1 and all(a["acceptance_length"] < b["acceptance_length"] for a, b in zip(curve, curve[1:])),
        "train_serve_within_10_percent": all(train_serve(figures)["passed"] for figures in runs.values()),
        "lossless_up_to_ties": all(figures["lossless"] for figures in runs.values()),
    }


# ---- data size -------------------------------------------------------------------------------


def data_curve(runs: dict[str, dict[str, Any]], chains: Sequence[Chain]) -> list[dict[str, Any]]:
    """Acceptance length against the supervised tokens the drafter trained on: the regenerated chains
    in bf16, first seed, DFlash."""
    points = [{"fraction": c.fraction, "supervised_tokens": runs[c.name]["supervised_tokens"],
               "acceptance_length": runs[c.name]["acceptance_length"]["dflash"]}
              for c in chains if c.regenerated and c.dtype == "bfloat16" and c.drafter == "dflash" and c.seed == chains[0].seed and c.epochs is None]
    return sorted(points, key=lambda point: point["fraction"])


def plot_curve(curve: list[dict[str, Any]], prompt_lookup: float, path: Path, about: str = "") -> None:
    """`about`: the target, under the title (a real model's figures say which)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["supervised_tokens"] / 1e6 for p in curve], [p["acceptance_length"] for p in curve], "o-", label="DFlash drafter (regenerated answers)")
    ax.axhline(prompt_lookup, color="gray", linestyle="--", label="prompt lookup")
    ax.set_xlabel("supervised tokens trained on (millions)")
    ax.set_ylabel("acceptance length (tokens per target step)")
    ax.set_title("Acceptance against data size, same held-out prompts" + (f"\n{about}" if about else ""), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
