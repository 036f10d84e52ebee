"""Where acceptance stops rising, and what each kind of prompt gets: the steps curve and the
per-kind acceptance, beside figures.py's data curve (and its claims, which are figures.py's).

The steps curve: the regenerated states trained into DFlash for fewer epochs than the size's
(Size.step_epochs), each to the end of its own schedule (the learning rate decays to zero at a
chain's last step, so a longer chain's checkpoint halfway is no shorter chain), evaluated without
trees on the same held-out prompts. The data curve's chains (a part of the rows for the size's
epochs) train fewer steps too, so the plot puts both against optimizer steps: at the same steps,
a chain on all the rows above one on a part of them is data's doing, not steps'.

Each step along a curve is a paired difference on the same held-out prompts, decided by its 95%
interval (figures.judged): where the interval first holds zero, acceptance has stopped rising as
far as these prompts can tell.

Per kind: each prompt kind's acceptance (committed tokens over verify steps, pooled over the kind's
prompts as the report pools them over all) from the evaluation's per-prompt records, with its 95%
interval from a paired bootstrap over that kind's prompts alone, and the drafter's lead over prompt
lookup on them decided the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from dflash_jobs.evaluate.intervals import Draws, PairedBootstrap
from dflash_jobs.spec import PROMPT_LOOKUP

from chains import BASELINES_OF, Chain
from figures import Taus, judged, per_prompt
from records import ChainFigures, Decoding


def steps_curve(runs: dict[str, ChainFigures], chains: Sequence[Chain], epochs: int) -> list[dict[str, Any]]:
    """DFlash's acceptance against optimizer steps, first seed, bf16: on all the regenerated rows for
    each number of epochs (`rows` 1.0), and on the data curve's parts of them for `epochs`."""
    first = chains[0].seed
    points = [{"chain": chain.name, "rows": chain.fraction, "epochs": chain.epochs or epochs, "steps": runs[chain.name].trained_steps,
               "supervised_tokens": runs[chain.name].supervised_tokens, "acceptance_length": runs[chain.name].acceptance_length[chain.drafter],
               "interval": runs[chain.name].own.acceptance_length_interval}
              for chain in chains
              if chain.regenerated and chain.drafter == "dflash" and chain.dtype == "bfloat16" and chain.seed == first and not chain.settings]
    return sorted(points, key=lambda point: (point["rows"], point["steps"]))


def rises(points: list[dict[str, Any]], taus: Taus) -> list[dict[str, Any]]:
    """Each step along one series of the curve: how much acceptance rose from the point before, as a
    paired difference on the same prompts with its 95% interval and verdict."""
    return [{"from_steps": a["steps"], "to_steps": b["steps"], **judged(taus.decoding(b["chain"]) - taus.decoding(a["chain"]))}
            for a, b in zip(points, points[1:])]


def per_kind(runs: dict[str, ChainFigures], kinds: list[str]) -> dict[str, Any]:
    """Per prompt kind, every chain's decodings' acceptance on the held-out prompts of that kind, each
    with its 95% interval over them, and each chain's drafter's lead there over the prompt lookup of
    BASELINES_OF (paired, decided; prompt lookup decodes alike in every chain); `kinds`: the kind of
    each evaluated prompt, in order (the same in every chain)."""
    found: dict[str, dict[str, Any]] = {}
    for kind in dict.fromkeys(kinds):
        mine = [i for i, of in enumerate(kinds) if of == kind]
        bootstrap = PairedBootstrap(len(mine))
        entry = found[kind] = {"prompts": len(mine), "acceptance_length": {}, "over_prompt_lookup": {}}
        taus = {chain: {name: kind_tau(bootstrap, chain, name, decoding, mine, len(kinds)) for name, decoding in run.drafters.items()}
                for chain, run in runs.items()}
        lookup = taus[BASELINES_OF][PROMPT_LOOKUP]
        for chain, run in runs.items():
            entry["acceptance_length"][chain] = {name: tau.summary() for name, tau in taus[chain].items()}
            entry["over_prompt_lookup"][chain] = judged(taus[chain][run.drafter] - lookup)
    return found


def kind_tau(bootstrap: PairedBootstrap, chain: str, name: str, decoding: Decoding, mine: list[int], evaluated: int) -> Draws:
    """tau of one decoding over the prompts `mine` of one kind, of the `evaluated` prompts its records hold."""
    records = per_prompt(f"{chain} {name}", decoding)
    if len(records["committed"]) != evaluated:
        raise RuntimeError(f"{chain}: {len(records['committed'])} per-prompt records of {name} for {evaluated} evaluated prompts")
    return bootstrap.tau({key: [records[key][i] for i in mine] for key in ("committed", "verify_steps")}, name=f"{chain} {name}")


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
        figures = [entry["acceptance_length"][chain][drafter] for entry in kinds.values()]
        values = [figure["estimate"] or 0.0 for figure in figures]
        # The interval as drawn, not as +- offsets: a percentile interval need not be centred on its estimate.
        errors = [[max(value - (figure["interval"][0] if figure["interval"][0] is not None else value), 0.0) for value, figure in zip(values, figures)],
                  [max((figure["interval"][1] if figure["interval"][1] is not None else value) - value, 0.0) for value, figure in zip(values, figures)]]
        ax.bar([k + i * width for k in range(len(kinds))], values, width, yerr=errors, capsize=3, label=label)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(kinds))], [f"{kind} ({entry['prompts']})" for kind, entry in kinds.items()])
    ax.set_ylabel("acceptance length (tokens per target step)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
