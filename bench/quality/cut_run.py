"""The figures of a quality run cut before its chains' reports: each chain's tau over the held-out
prompts its evaluation had decoded (the per-prompt records it keeps as it decodes, run/eval/prompts/),
paired over the prompts every such chain decoded, prompt lookup's along greedy's output on the same
prompts (computed from the records, as the evaluation computes it), and each chain's last training
line. A device call cut a run twice (code-gpu, code-scale): its stored work should still say what it
measured, and say over how many prompts.

    python bench/quality/cut_run.py WORKDIR [--block 16] [--new-tokens 48] [--stop 2] [--out FILE]

WORKDIR is the run's --workdir, or what was kept of it (each chain's run/eval/prompts/ and train-0.log).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from dflash_jobs.evaluate.baselines import PromptLookupDrafter, along_greedy
from dflash_jobs.evaluate.intervals import PairedBootstrap
from dflash_jobs.evaluate.kept import PromptResult, result_from_json
from dflash_jobs.evaluate.metrics import per_prompt
from dflash_jobs.spec import BASELINES, PROMPT_LOOKUP

from figures import judged

TRAIN_LINE = re.compile(r"step (\d+)/(\d+) .*tau ([\d.]+) .*\| (\d+) tok/s, ([\d.]+) TFLOP/s, MFU ([\d.]+)%")


def decoded_prompts(chain: Path) -> dict[int, tuple[list[int], PromptResult]]:
    """The chain's kept prompts by index, each its tokens and its result as the evaluation reads them
    back (none when its evaluation had not started)."""
    records = (json.loads(path.read_text()) for path in sorted(chain.glob("run/eval/prompts/*/*.json")))
    return {record["index"]: (record["prompt"], result_from_json(record["result"])) for record in records}


def trained_drafter(result: PromptResult) -> str:
    """The chain's own drafter among a result's decodings (the baselines are the others)."""
    [name] = [name for name in result.drafted if name not in BASELINES]
    return name


def last_training_line(chain: Path) -> dict[str, Any] | None:
    """The trainer's last metric line: step, steps, its simulated tau on training batches, tokens/s, TFLOP/s, MFU."""
    log = chain / "train-0.log"
    matches = TRAIN_LINE.findall(log.read_text(errors="replace")) if log.is_file() else []
    if not matches:
        return None
    step, steps, tau, tokens, tflops, mfu = matches[-1]
    return {"step": int(step), "steps": int(steps), "training_tau": float(tau), "tokens_per_s": int(tokens),
            "tflop_per_s": float(tflops), "mfu_percent": float(mfu)}


def cut_figures(workdir: Path, *, block: int, new_tokens: int, stop_ids: frozenset[int]) -> dict[str, Any]:
    chains = {path.name: decoded_prompts(path) for path in sorted(workdir.iterdir()) if path.is_dir() and (path / "train-0.log").is_file()}
    evaluated = {name: records for name, records in chains.items() if records}
    common = sorted(set.intersection(*(set(records) for records in evaluated.values()))) if evaluated else []
    figures: dict[str, Any] = {"prompts_decoded": {name: len(records) for name, records in chains.items()}, "paired_prompts": len(common),
                               "training": {name: last_training_line(workdir / name) for name in chains}}
    if not common:
        return figures
    bootstrap = PairedBootstrap(len(common))
    first = evaluated[next(iter(evaluated))]
    lookup = PromptLookupDrafter(block)
    lookup_tau = bootstrap.tau(per_prompt([along_greedy(lookup, first[i][0], first[i][1].greedy.tokens, max_new_tokens=new_tokens,
                                                        stop_ids=stop_ids) for i in common]))
    taus = {name: bootstrap.tau(per_prompt([records[i][1].drafted[trained_drafter(records[i][1])] for i in common]))
            for name, records in evaluated.items()}
    figures["tau"] = {name: figure.summary() for name, figure in taus.items()} | {PROMPT_LOOKUP: lookup_tau.summary()}
    figures["over_prompt_lookup"] = {name: judged(figure - lookup_tau) for name, figure in taus.items()}
    names = list(taus)
    figures["differences"] = {f"{later} - {earlier}": judged(taus[later] - taus[earlier]) for earlier, later in zip(names, names[1:])}
    figures["intervals"] = bootstrap.describe()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--block", type=int, default=16, help="the verify block the chains decoded with")
    parser.add_argument("--new-tokens", type=int, default=48, help="eval.max_new_tokens")
    parser.add_argument("--stop", type=int, action="append", default=None, help="the target's stop token ids (SmolLM2: 2, <|im_end|>)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    figures = cut_figures(args.workdir, block=args.block, new_tokens=args.new_tokens, stop_ids=frozenset(args.stop or [2]))
    text = json.dumps({"command": " ".join(["python", "bench/quality/cut_run.py", *(argv if argv is not None else sys.argv[1:])]), **figures}, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
