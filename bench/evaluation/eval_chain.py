"""The whole evaluation of one chain before and after issue 49, side by side: the eval step
(`python -m dflash_jobs.evaluate`'s main) of each version, on the same target, drafter and prompts.

    mkdir -p before && git archive bca2ea4 jobs | tar -x -C before/
    python bench/evaluation/eval_chain.py --shape tiny --device cpu --before before/jobs --out /tmp/eval-chain-tiny.json
    python bench/evaluation/eval_chain.py --shape smollm2 --before before/jobs --forms first --prompts 4 --out $OUT/eval-chain-first-h100.json
    python bench/evaluation/eval_chain.py --shape smollm2 --before before/jobs --forms plain --prompts 12 --out $OUT/eval-chain-plain-h100.json
    python bench/evaluation/eval_chain.py --shape smollm2 --before before/jobs --forms later --prompts 8 --out $OUT/eval-chain-later-h100.json

`--before` is the data plane as it was before (bca2ea4: main just before issue 49's branch was
merged, its other work in; the branch left it at dd571ce), an untracked copy of its `jobs/` tree.
Each evaluation runs in its own interpreter with that version's `jobs/` first on PYTHONPATH; the
module it imported is recorded beside its figures.

What both evaluate (`--workdir`, built once): a random-weight Llama of the shape asked (eval_loops.py's
SHAPES: SmolLM2-135M's, bf16 on a GPU; `tiny`, fp32 on a CPU) saved as a checkpoint; a held-out set of
random-token prompts of code-gpu's lengths (<= 256 tokens) and a chunk of random training rows for the
bigram table, as prepare stores them; a DFlash drafter of code-gpu's shape (3 layers, blocks of 16,
the spec's default target layers) with random weights, exported as training exports it. Its drafts
are noise, so tau is about 1: every evaluation takes about a verify step a token, the most steps a
drafter can cost.

The chain's evaluation as bench/quality/chains.py writes it for code-gpu: 48 new tokens, 2 processes (`--processes`),
in the forms of FORMS (`--forms`): the first chain's (both baselines, trees of 16, 32 and 64 nodes),
a plain one's (the drafter alone), and a later chain's (plain, and after issue 49 greedy's decodings
read from the references the first chain kept: filled by an untimed evaluation first). Settings both
versions know only, except the version after's own: eval.timed_prompts, a quarter of the prompts (as
code-gpu times 16 of its 64), the later chain's eval.reference_cache, and eval.cuda_graphs (on unless
`--no-cuda-graphs`: greedy and the verify loops on static caches, each forward a replayed CUDA graph). Every evaluation writes into
a fresh copy of the run's output (hard links), so none reuses another's kept results, nor greedy's
references outside the later form.

Stages, each written to the JSON as it ends: each version primed, untimed (`prime`: the bytecode of
what an evaluation imports cached, matplotlib's font list built; a machine's first evaluation would
pay both), a warm-up evaluation of 2 prompts by each version, then
per form `before`, `after`, `after`, `before` (`--order`: a device call that holds less takes one order,
the next call the other with `--no-warm-up`): the seconds of main() (the target and drafter loaded,
every prompt decoded, the report stored) and of the process, its parts by its log's times (setup,
decoding, report: logged_parts; the version after's setup also by its own process's load and warm-up
prompt), the seconds each decoding's per-prompt records sum to, and each report's acceptance figures;
then per form the comparison: tau per prompt of every decoding (chain, baselines, trees) equal before
and after, or the prompts where not, and whether each version's two evaluations decoded alike. Each
evaluation's log is written as it runs into <--out's stem>-logs/ beside the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from dflash_jobs.drafter.export import DRAFTER_PREFIX, export_dflash
from dflash_jobs.drafter.model import Drafter, DrafterConfig
from dflash_jobs.formats import DATASET_KEY, EVAL_REPORT_KEY, ChunkInfo, DatasetIndex, TokenChunk, token_chunk_key
from dflash_jobs.prepare import HOLDOUT_KEY
from dflash_jobs.spec import default_layers
from dflash_jobs.storage import open_storage

from eval_loops import SHAPES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quality"))
from launch import step_env  # noqa: E402  (bench/quality/launch.py)

RUNS = {"smollm2": {"prompts": 16, "prompt_tokens": (64, 256), "new_tokens": 48},
        "tiny": {"prompts": 8, "prompt_tokens": (16, 64), "new_tokens": 24}}
REFERENCES = "references"
PLAIN = {"baselines": [], "tree_budgets": []}
FORMS = {
    "first": {"eval": {"baselines": ["prompt_lookup", "bigram"], "tree_budgets": [16, 32, 64]}, "after": lambda workdir: {}},
    "plain": {"eval": PLAIN, "after": lambda workdir: {}},
    "later": {"eval": PLAIN, "after": lambda workdir: {"reference_cache": str(workdir / REFERENCES)}},
}
"""Each form's eval settings, and those of the version after alone (given the work directory). `first`:
the first chain's evaluation (chains.BASELINES_OF: the baselines, and trees), greedy decoded;
`plain`: every other chain's (the drafter alone), greedy decoded; `later`: the same as a later chain
of the quality benchmark runs it after issue 49, greedy's decodings read from the references the
first chain kept (chains.REFERENCES)."""
DRAFT_LAYERS, BLOCK, PROCESSES = 3, 16, 2
"""code-gpu's drafter (bench/quality/sizes.py) and eval.processes."""
TRAINING_ROWS, TRAINING_ROW_TOKENS = 256, 256
ORDER = ("before", "after", "after", "before")
"""The versions' evaluations of each form by default: both orders."""
WARM_UP_PROMPTS = 2
HELD_OUT = 64
"""Held-out prompts stored, as code-gpu holds out; an evaluation decodes the first --prompts of them."""
RUNNER = """
import json, sys, time
started = time.perf_counter()
import dflash_jobs
from dflash_jobs.evaluate.__main__ import main
code = main(["-f", sys.argv[1]])
print("EVAL_CHAIN " + json.dumps({"exit": code, "main_seconds": time.perf_counter() - started, "module": dflash_jobs.__file__}))
"""
"""One evaluation in a fresh interpreter: the eval step's own main, timed from before its imports."""


def build_target(directory: Path, shape: str, dtype: torch.dtype) -> dict:
    """A random Llama of `shape` saved at `directory` (its EOS the last row, which no prompt holds); its config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = SHAPES[shape]
    torch.manual_seed(0)
    config = LlamaConfig(**dims, head_dim=dims["hidden_size"] // dims["num_attention_heads"], tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=100000.0, eos_token_id=dims["vocab_size"] - 1,
                         bos_token_id=dims["vocab_size"] - 1, pad_token_id=dims["vocab_size"] - 1)
    LlamaForCausalLM(config).to(dtype).save_pretrained(directory)
    return {**dims, "head_dim": config.head_dim}


def samples_chunk(samples: list[tuple[np.ndarray, np.ndarray]]) -> TokenChunk:
    return TokenChunk(
        input_ids=np.concatenate([ids for ids, _ in samples]).astype(np.int32),
        loss_mask=np.concatenate([mask for _, mask in samples]).astype(np.uint8),
        cu_seqlens=np.concatenate([[0], np.cumsum([len(ids) for ids, _ in samples])]).astype(np.int64),
        sample_ids=np.arange(len(samples), dtype=np.int64),
    )


def write_data(output: Path, *, vocab_size: int, prompts: int, prompt_tokens: tuple[int, int]) -> None:
    """What prepare stores: a chunk of random training rows (the bigram table's) and the held-out
    samples, each a random prompt of `prompt_tokens` (low, high) tokens and a 16-token answer, named
    in tokens/dataset.json. No row holds the last two ids (the EOS and the drafter's mask token)."""
    rng = np.random.default_rng(1)
    storage = open_storage(str(output))
    answer = np.r_[np.zeros(1, np.uint8), np.ones(16, np.uint8)]  # the template's last token, then the answer

    def sample(length: int) -> tuple[np.ndarray, np.ndarray]:
        mask = np.r_[np.zeros(length - 1, np.uint8), answer]
        return rng.integers(0, vocab_size - 2, len(mask)), mask

    training = samples_chunk([sample(TRAINING_ROW_TOKENS) for _ in range(TRAINING_ROWS)]).validate("training")
    storage.put_bytes(token_chunk_key(0), training.encode())
    held_out = samples_chunk([sample(int(rng.integers(*prompt_tokens, endpoint=True))) for _ in range(prompts)]).validate("holdout")
    storage.put_bytes(HOLDOUT_KEY, held_out.encode())
    index = DatasetIndex(samples=training.num_samples, tokens=training.num_tokens, vocab_size=vocab_size,
                         chunks=[ChunkInfo(id=0, path=token_chunk_key(0), samples=training.num_samples, tokens=training.num_tokens)],
                         supervised_tokens=int(training.loss_mask.sum()), holdout={"samples": prompts, "path": HOLDOUT_KEY})
    storage.put_bytes(DATASET_KEY, index.to_json().encode())


def export_drafter(output: Path, dims: dict, layers: list[int]) -> None:
    """A DFlash drafter of code-gpu's shape with random weights, exported as training exports it."""
    torch.manual_seed(2)
    config = DrafterConfig(hidden_size=dims["hidden_size"], num_layers=DRAFT_LAYERS, num_attention_heads=dims["num_attention_heads"],
                           num_key_value_heads=dims["num_key_value_heads"], head_dim=dims["head_dim"], intermediate_size=dims["intermediate_size"],
                           vocab_size=dims["vocab_size"], target_layer_ids=layers, num_target_layers=dims["num_hidden_layers"],
                           block_size=BLOCK, mask_token_id=dims["vocab_size"] - 2, rope_theta=100000.0)
    export_dflash(Drafter(config), open_storage(str(output)), DRAFTER_PREFIX)


def build_inputs(workdir: Path, shape: str, device: torch.device) -> tuple[Path, Path, list[int]]:
    """The target checkpoint and the run's output (data and exported drafter), built once; their paths and the captured layers."""
    target, run = workdir / "target", workdir / "run"
    dims = SHAPES[shape]
    layers = default_layers(dims["num_hidden_layers"])
    if not (run / DRAFTER_PREFIX / "config.json").exists():
        shutil.rmtree(workdir, ignore_errors=True)
        dims = build_target(target, shape, torch.bfloat16 if device.type == "cuda" else torch.float32)
        write_data(run, vocab_size=dims["vocab_size"], prompts=HELD_OUT, prompt_tokens=RUNS[shape]["prompt_tokens"])
        export_drafter(run, dims, layers)
    return target, run, layers


def write_spec(path: Path, *, target: Path, output: Path, layers: list[int], device: torch.device, new_tokens: int, prompts: int,
               processes: int, form: str, own: dict) -> Path:
    """The chain's dflash.yaml as chains.write_spec writes it for code-gpu, with the settings of `form`
    and the eval settings `own` (those the version after knows and the one before does not)."""
    spec = {
        "name": "eval-chain", "backend": "local",
        "target": {"model": str(target), "layers": layers},
        "data": {"source": str(output / "chats.jsonl"), "max_length": 544},
        "output": str(output),
        "train": {"drafter": "dflash", "block_size": BLOCK, "draft_layers": DRAFT_LAYERS, "gpus_per_node": 1},
        "eval": {"prompts": prompts, "max_new_tokens": new_tokens, "processes": processes, **FORMS[form]["eval"], **own},
        "local": {"workdir": str(path.parent / "local"), "device": device.type},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def fresh_output(run: Path, output: Path) -> None:
    """A copy of the run's output by hard links, without any evaluation's files."""
    shutil.rmtree(output, ignore_errors=True)
    shutil.copytree(run, output, copy_function=os.link, ignore=lambda directory, names: ["eval"] if Path(directory) == run else [])


PRIMER = """
import sys
import matplotlib.pyplot
import dflash_jobs.evaluate.__main__
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(sys.argv[1])
"""
"""What every evaluation imports and builds before its first prompt, without a GPU: its modules (those
transformers imports lazily as a checkpoint needs them), matplotlib's font list."""


def evaluation_env(jobs: Path, workdir: Path, device: torch.device) -> dict[str, str]:
    """An evaluation's environment: a quality benchmark step's (launch.step_env: bytecode cached under
    workdir/pycache, one intra-op thread on a CPU), `jobs` first on PYTHONPATH."""
    paths = [str(jobs.resolve()), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**step_env(workdir, cpu=device.type == "cpu"), "PYTHONPATH": os.pathsep.join(paths)}


def prime(jobs: Path, target: Path, workdir: Path, device: torch.device) -> float:
    """PRIMER run once with an evaluation's environment, untimed: the bytecode of what it imports
    cached and matplotlib's font list built, where the first evaluation on a machine would pay
    both (the font list 2 s of the version after's 54 s in the first H100 run) and the next find them."""
    started = time.perf_counter()
    primed = subprocess.run([sys.executable, "-c", PRIMER, str(target)], env=evaluation_env(jobs, workdir, device),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if primed.returncode:
        raise RuntimeError(f"priming the evaluations of {jobs} failed (exit {primed.returncode}):\n{primed.stderr[-3000:]}")
    return round(time.perf_counter() - started, 2)


def evaluate_once(version: str, jobs: Path, spec: Path, log: Path, workdir: Path, device: torch.device) -> dict:
    """One evaluation by `version`'s eval step (its `jobs` tree first on PYTHONPATH), in a fresh interpreter."""
    env = evaluation_env(jobs, workdir, device)
    started = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run([sys.executable, "-c", RUNNER, str(spec)], env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - started
    lines = [line for line in log.read_text().splitlines() if line.startswith("EVAL_CHAIN ")]
    if code or not lines:
        raise RuntimeError(f"the {version} evaluation failed (exit {code}); its log, {log}:\n{log.read_text()[-3000:]}")
    ran = json.loads(lines[-1].removeprefix("EVAL_CHAIN "))
    if not Path(ran["module"]).resolve().is_relative_to(jobs.resolve()):
        raise RuntimeError(f"the {version} evaluation imported {ran['module']}, not the tree {jobs}")
    return {"main_seconds": round(ran["main_seconds"], 2), "process_seconds": round(seconds, 2), "module": ran["module"],
            "parts": logged_parts(log.read_text())}


LOGGED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) eval: (?:prompt (\d+)/\d+:|(serve it with vLLM))?", re.M)
"""A line of the eval step's log (both versions log alike): its time, and the prompts decoded so far or the report stored."""
SETUP_LOGGED = {"load_seconds": re.compile(r" eval: target and drafter loaded on \S+ in ([\d.]+) s"),
                "warm_up_seconds": re.compile(r" eval: warm-up prompt decoded in ([\d.]+) s"),
                "timed_alone_seconds": re.compile(r" eval: timed prompts: \d+ decoded alone in ([\d.]+) s"),
                "timed_decodings_seconds": re.compile(r" eval: timed prompts: .*, ([\d.]+) s of it their timed decodings")}
"""Parts as the version after logs them (the version before does not): the evaluation's own process
loading its target and drafter, decoding its warm-up prompt (the graphs' captures), and decoding the
timed prompts alone, with their timed decodings' share of it (the rest is their figures' other work)."""


def logged_parts(log: str) -> dict[str, float | int]:
    """The evaluation's parts by its log's times: `setup`, from its first line (spec read) to the first
    prompt logged (the target and drafter loaded, the workers started and warmed up, the first
    prompts decoded); `decoding`, from there to the last prompt (`prompts` more decoded: the figures'
    pass, a second a prompt of it is what 64 prompts scale by); `report`, from there to the report
    stored. Where the timed prompts are decoded moved with the version after: first in `report`
    (decoded again at the end), since 2c6f936 first in the figures' pass (decoded once, alone, before
    the workers start), so that the first prompt's line came after the first timed prompt; since their
    figures' other work is shared out with the other prompts', after all of them (`setup` holds their
    decodings: `timed_alone_seconds`)."""
    lines = [(datetime.strptime(when, "%Y-%m-%d %H:%M:%S,%f"), done, served) for when, done, served in LOGGED.findall(log)]
    progress = [(when, int(done)) for when, done, _ in lines if done]
    stored = next(when for when, _, served in lines if served)
    (first, first_done), (last, last_done) = progress[0], progress[-1]
    setup = {name: float(found.group(1)) for name, pattern in SETUP_LOGGED.items() if (found := pattern.search(log))}
    return {"setup_seconds": round((first - lines[0][0]).total_seconds(), 2), **setup, "decoding_seconds": round((last - first).total_seconds(), 2),
            "prompts": last_done - first_done, "report_seconds": round((stored - last).total_seconds(), 2)}


def decodings(report: dict) -> dict[str, dict]:
    """Every decoding's per-prompt records in a report: greedy, each drafter, each tree budget."""
    found = {"greedy": report["greedy"]["per_prompt"]}
    for name, summary in report["drafters"].items():
        found[name] = summary["per_prompt"]
        for budget, tree in summary.get("tree", {}).get("decoded", {}).items():
            found[f"{name} tree {budget}"] = tree["per_prompt"]
    return found


def figures(report: dict) -> dict:
    """A report's acceptance figures and the seconds its decodings' per-prompt records sum to."""
    per_prompt = decodings(report)
    return {
        "acceptance_length": {name: round(s["acceptance_length"], 4) for name, s in report["drafters"].items()},
        "tree_acceptance_length": {f"{name} {budget}": round(t["acceptance_length"], 4) for name, s in report["drafters"].items()
                                   for budget, t in s.get("tree", {}).get("decoded", {}).items()},
        "ties": {name: s.get("ties") for name, s in report["drafters"].items()},
        "lossless": report["lossless"],
        "decoding_seconds": {name: round(sum(p["seconds"]), 3) for name, p in per_prompt.items()},
        "timed": report.get("timed"),
    }


def taus(per_prompt: dict) -> list[float | None]:
    return [c / s if s else None for c, s in zip(per_prompt["committed"], per_prompt["verify_steps"])]


def compare(before: dict, after: dict) -> dict:
    """Per decoding (greedy's output lengths, every drafter's and tree's tau): the prompts alike
    before and after, and those that are not with both values."""
    old, new = decodings(before), decodings(after)
    compared = {}
    for name in sorted(old.keys() & new.keys()):
        if name == "greedy":
            pairs = list(zip(old[name]["tokens"], new[name]["tokens"]))
        else:
            pairs = list(zip(taus(old[name]), taus(new[name])))
        unlike = [{"prompt": i, "before": b, "after": a} for i, (b, a) in enumerate(pairs) if b != a]
        compared[name] = {"prompts": len(pairs), "equal": len(pairs) - len(unlike), "unlike": unlike}
    return {"decodings": compared, "only_before": sorted(old.keys() - new.keys()), "only_after": sorted(new.keys() - old.keys())}


@dataclass(frozen=True, slots=True)
class Evaluations:
    """Evaluations of the inputs built once, by either version, each in a fresh copy of the run's output."""

    jobs: dict[str, Path]
    target: Path
    run: Path
    layers: list[int]
    workdir: Path
    device: torch.device
    new_tokens: int
    timed: int
    """eval.timed_prompts of the version after."""
    cuda_graphs: bool
    """eval.cuda_graphs of the version after."""
    processes: int
    """eval.processes of both."""
    logs: Path
    """Where each evaluation's log goes as it runs (beside --out: a device call cut short still brings them back)."""

    def evaluate(self, name: str, version: str, *, form: str, prompts: int) -> tuple[dict, dict]:
        """`version`'s evaluation of the first `prompts` prompts in `form`, under workdir/name: its seconds and its report."""
        directory = self.workdir / name
        fresh_output(self.run, directory / "run")
        own = ({"timed_prompts": self.timed, "cuda_graphs": self.cuda_graphs, **FORMS[form]["after"](self.workdir)}
               if version == "after" else {})
        spec = write_spec(directory / "dflash.yaml", target=self.target, output=directory / "run", layers=self.layers, device=self.device,
                          new_tokens=self.new_tokens, prompts=prompts, processes=self.processes, form=form, own=own)
        ran = evaluate_once(version, self.jobs[version], spec, self.logs / f"{name}.log", self.workdir, self.device)
        return ran, json.loads((directory / "run" / EVAL_REPORT_KEY).read_text())


def logs_beside(out: Path) -> Path:
    """`out`'s directory's <stem>-logs/, made."""
    logs = out.with_name(f"{out.stem}-logs")
    logs.mkdir(parents=True, exist_ok=True)
    return logs


def run_form(form: str, stage: dict, evaluations: Evaluations, prompts: int, order: list[str], save) -> None:
    """One form's evaluations in `order` (both orders by default), each saved as it ends, then the
    comparison. The form `later` first fills the shared references with an untimed evaluation by the
    version after."""
    if form == "later":
        shutil.rmtree(evaluations.workdir / REFERENCES, ignore_errors=True)
        stage["references_filled"] = evaluations.evaluate("later-references", "after", form=form, prompts=prompts)[0]
        save()
    reports: dict[str, list[dict]] = {version: [] for version in dict.fromkeys(order)}
    for i, version in enumerate(order):
        ran, report = evaluations.evaluate(f"{form}-{i}-{version}", version, form=form, prompts=prompts)
        reports[version].append(report)
        stage["runs"].append({"version": version, **ran, **figures(report)})
        print(f"eval_chain: {form} {version}: {ran['main_seconds']} s", file=sys.stderr, flush=True)
        save()
    stage["summary"] = {version: {"main_seconds": round(float(np.mean([r["main_seconds"] for r in stage["runs"] if r["version"] == version])), 2)}
                        for version in reports}
    if len(reports) == 2:
        stage["summary"]["speedup"] = round(stage["summary"]["before"]["main_seconds"] / stage["summary"]["after"]["main_seconds"], 3)
        stage["before_vs_after"] = compare(reports["before"][0], reports["after"][0])
    # Each version's evaluations decode alike (the figures before and after differ for the versions' sake, not the run's).
    stage["repeats_alike"] = {version: all(not d["unlike"] for d in compare(*kept[:2])["decodings"].values())
                              for version, kept in reports.items() if len(kept) > 1}
    save()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=tuple(RUNS), default="smollm2")
    parser.add_argument("--before", required=True, type=Path, help="the jobs/ tree before (see the module docstring)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--forms", nargs="+", choices=tuple(FORMS), default=list(FORMS))
    parser.add_argument("--prompts", type=int, help="held-out prompts every evaluation decodes (default: the shape's)")
    parser.add_argument("--workdir", type=Path, help="where the inputs (built once, kept for the next command) and every evaluation's files "
                        "go (default: eval-chain-<shape> in the system's temporary directory, not beside --out, which may be copied back)")
    parser.add_argument("--order", default=",".join(ORDER), help="the versions' evaluations of each form, in turn (default: both orders); "
                        "a device call too short for both takes before,after and the next after,before --no-warm-up")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="no warm-up evaluations (a second command on the same machine, its compiled kernels cached)")
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                        help="the version after on the dynamic cache, eager (eval.cuda_graphs: false)")
    parser.add_argument("--processes", type=int, default=PROCESSES,
                        help=f"eval.processes of both versions (default {PROCESSES}, code-gpu's): 1 decodes every prompt in the evaluation's own process")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    order = args.order.split(",")
    if not set(order) <= {"before", "after"}:
        parser.error(f"--order {args.order!r}: give before and after, comma-separated (e.g. before,after)")
    device = torch.device(args.device)
    run = RUNS[args.shape]
    prompts = args.prompts or run["prompts"]
    workdir = args.workdir or Path(tempfile.gettempdir()) / f"eval-chain-{args.shape}"
    target, output, layers = build_inputs(workdir, args.shape, device)
    evaluations = Evaluations(jobs={"before": args.before, "after": Path(__file__).resolve().parents[2] / "jobs"}, target=target, run=output,
                              layers=layers, workdir=workdir, device=device, new_tokens=run["new_tokens"], timed=max(1, prompts // 4),
                              cuda_graphs=args.cuda_graphs, processes=args.processes, logs=logs_beside(args.out))
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    result = {"command": " ".join(sys.argv), "shape": args.shape, "device": machine, "torch": torch.__version__,
              "prompts": prompts, "timed_prompts_after": evaluations.timed, "cuda_graphs_after": args.cuda_graphs, "new_tokens": run["new_tokens"], "prompt_tokens": run["prompt_tokens"],
              "processes": args.processes, "draft_layers": DRAFT_LAYERS, "block_size": BLOCK, "forms": {f: FORMS[f]["eval"] for f in args.forms},
              "order": order, "warm_up": {}, "stages": {}}

    def save() -> None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    result["primed_seconds"] = {version: prime(jobs, target, workdir, device) for version, jobs in evaluations.jobs.items()}
    save()
    for version in ("before", "after") if args.warm_up else ():
        result["warm_up"][version] = evaluations.evaluate(f"warm-up-{version}", version, form=args.forms[0], prompts=WARM_UP_PROMPTS)[0]
        save()
    for form in args.forms:
        result["stages"][form] = {"runs": []}
        run_form(form, result["stages"][form], evaluations, prompts, order, save)
    print(json.dumps({form: {"summary": stage["summary"], "repeats_alike": stage["repeats_alike"],
                             "equal": {name: f"{d['equal']}/{d['prompts']}" for name, d in stage.get("before_vs_after", {"decodings": {}})["decodings"].items()}}
                      for form, stage in result["stages"].items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
