"""Where acceptance stops rising, and what each kind of prompt gets: the steps curve and the
per-kind acceptance, beside figures.py's data curve (and its claims, which are figures.py's).

The steps curve: the regenerated states trained into DFlash for fewer epochs than the size's
(Size.step_epochs), each to the end of its own schedule (the learning rate decays to zero at a
chain's last step, so a longer chain's checkpoint halfway is no shorter chain), evaluated without
trees on the same held-out prompts. The data curve's chains (a part of the rows for the size's
epochs) train fewer steps too, so the plot puts both against optimizer steps: at the same steps,
a chain on all the rows above one on a part of them is data's doing, not steps'.

Per kind: each prompt kind's acceptance (committed tokens over verify steps, pooled over the kind's
prompts as the report pools them over all) from the evaluation's per-prompt records. Those come
with the paired-bootstrap intervals (issue 41 item 5); until a report holds them, the figure says
it is not available and why (prompt_records is the one place that reads them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from dflash_jobs.formats import EVAL_REPORT_KEY

from chains import Chain


def steps_curve(runs: dict[str, dict[str, Any]], chains: Sequence[Chain], epochs: int) -> list[dict[str, Any]]:
    """DFlash's acceptance against optimizer steps, first seed, bf16: on all the regenerated rows for
    each number of epochs (`rows` 1.0), and on the data curve's parts of them for `epochs`."""
    first = chains[0].seed
    points = [{"rows": chain.fraction, "epochs": chain.epochs or epochs, "steps": runs[chain.name]["train_last"]["step"],
               "supervised_tokens": runs[chain.name]["supervised_tokens"], "acceptance_length": runs[chain.name]["acceptance_length"]["dflash"]}
              for chain in chains
              if chain.regenerated and chain.drafter == "dflash" and chain.dtype == "bfloat16" and chain.seed == first and not chain.settings]
    return sorted(points, key=lambda point: (point["rows"], point["steps"]))


def rises(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each step along one series of the curve: how much acceptance rose from the point before."""
    return [{"from_steps": a["steps"], "to_steps": b["steps"], "rise": round(b["acceptance_length"] - a["acceptance_length"], 3)}
            for a, b in zip(points, points[1:])]


def prompt_records(report: dict[str, Any], drafter: str) -> list[tuple[int, int]] | None:
    """(committed tokens, verify steps) of each evaluated prompt for one drafter, in prompt order, or
    None where the report holds no per-prompt records (reports before issue 41 item 5, whose
    drafters.<name>.per_prompt holds a list a figure, a value a prompt)."""
    records = report["drafters"][drafter].get("per_prompt")
    if records is None:
        return None
    return list(zip(records["committed"], records["verify_steps"], strict=True))


def per_kind(workdir: Path, names: Sequence[str], kinds: list[str]) -> dict[str, Any]:
    """Per prompt kind, every chain's drafter's and baselines' acceptance on the held-out prompts of
    that kind; `kinds`: the kind of each evaluated prompt, in order (the same in every chain)."""
    found: dict[str, dict[str, Any]] = {kind: {"prompts": kinds.count(kind), "acceptance_length": {}} for kind in dict.fromkeys(kinds)}
    for name in names:
        report = json.loads((workdir / name / "run" / EVAL_REPORT_KEY).read_text())
        for drafter in report["drafters"]:
            records = prompt_records(report, drafter)
            if records is None:
                return {"available": False, "why": f"{name}'s evaluation report holds no per-prompt records (drafters.<name>.per_prompt, "
                                                   "issue 41 item 5): per-kind acceptance needs them"}
            if len(records) != len(kinds):
                raise RuntimeError(f"{name}: {len(records)} per-prompt records of {drafter} for {len(kinds)} evaluated prompts")
            for kind, entry in found.items():
                mine = [record for record, of in zip(records, kinds) if of == kind]
                steps = sum(steps for _, steps in mine)
                entry["acceptance_length"].setdefault(name, {})[drafter] = round(sum(committed for committed, _ in mine) / steps, 3) if steps else None
    return {"available": True, "kinds": found}


def plot_steps(curve: list[dict[str, Any]], prompt_lookup: float, path: Path, about: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for rows, style in ((1.0, "o-"), *((fraction, "s--") for fraction in sorted({p["rows"] for p in curve} - {1.0}))):
        series = [p for p in curve if p["rows"] == rows]
        if rows == 1.0:
            label = "all rows, " + ", ".join(f"{p['epochs']}" for p in series) + " epochs"
            ax.plot([p["steps"] for p in series], [p["acceptance_length"] for p in series], style, label=label)
        else:
            ax.plot([p["steps"] for p in series], [p["acceptance_length"] for p in series], style, color="tab:orange",
                    label=f"part of the rows, {series[0]['epochs']} epochs" if rows == min(p["rows"] for p in curve) else None)
            for p in series:
                ax.annotate(f"{p['rows']:g} of the rows", (p["steps"], p["acceptance_length"]), fontsize=8, textcoords="offset points", xytext=(4, -10))
    ax.axhline(prompt_lookup, color="gray", linestyle="--", label="prompt lookup")
    ax.set_xscale("log")
    ticks = sorted({p["steps"] for p in curve})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("optimizer steps (log scale)")
    ax.set_ylabel("acceptance length (tokens per target step)")
    ax.set_title("DFlash acceptance against training steps, same held-out prompts" + (f"\n{about}" if about else ""), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_kinds(kinds: dict[str, dict[str, Any]], columns: dict[str, tuple[str, str]], path: Path, title: str) -> None:
    """Bars per prompt kind; `columns`: label -> (chain, drafter)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(columns)
    for i, (label, (chain, drafter)) in enumerate(columns.items()):
        values = [entry["acceptance_length"][chain][drafter] or 0.0 for entry in kinds.values()]
        ax.bar([k + i * width for k in range(len(kinds))], values, width, label=label)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(kinds))], [f"{kind} ({entry['prompts']})" for kind, entry in kinds.items()])
    ax.set_ylabel("acceptance length (tokens per target step)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
