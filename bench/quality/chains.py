"""The product's chain, once per data set: its specs and its steps as the pods run them (the
figures each chain leaves in its run directory are read by records.ChainFigures).

A chain runs generate (the generating chain only), prepare, extract (two shards at once), verify,
train and evaluate through the product's own entry points, on a spec written to its directory.
A chain with `states_of` trains on another chain's extracted states instead: its tokens/ and
extract/ are that chain's files, hard-linked (the same bytes, no copy, no second extraction), and
it runs train and evaluate only. That is how one data set's states train several drafters (two
seeds, DFlash2 and DSpark beside DFlash) on the same held-out prompts: one extraction, stored with
the target's final hidden state when a drafter reading them needs it (DSpark).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
import yaml

from dflash_jobs.formats import DATASET_KEY, MANIFEST_KEY
from dflash_jobs.generation import generated_lines, read_manifest
from dflash_jobs.rows import prompt_length
from dflash_jobs.spec import BASELINES
from dflash_jobs.storage import open_storage

import launch
from diversity import held_out_samples

if TYPE_CHECKING:
    from sizes import Size

SHARED_TOKENS = ("tokens",)
"""What a chain with `states_of` takes from the other chain's run when the states are online: the
token chunks (the held-out prompts among them)."""
SHARED_STATES = (*SHARED_TOKENS, "extract")
"""What it takes when they are stored: the token chunks and the extracted hidden states with their verified manifest."""
CHAIN_CACHE_GB = 1.5
"""train.cache_gb of every chain: a chain trains from its own on-disk chunk cache, and ten chains side
by side on one machine's disk (64 GiB on the GPU machine, beside their stored states) cannot each
keep the default's; 1.5 GiB holds the chunk in use and the two read ahead at the GPU size."""
DEFAULT_SEED = 42
"""train.seed's default: the first seed of every chain."""
REFERENCES = "references"
"""eval.reference_cache of every chain, in the benchmark's directory beside the chains': greedy's
decodings of the held-out prompts, kept by the first evaluation that decodes each and read by every
other (evaluate/reference.py; the key holds the target, the new tokens, the verify block and the
device): every chain evaluates on the same target and prompts, so greedy decodes each prompt once, not
once a chain."""
BASELINES_OF = "regenerated"
"""The chain that decodes the baselines (prompt lookup, the bigram table) for every chain: prompt
lookup decodes alike in each (the same target, the same held-out prompts), and each baseline costs a
greedy decoding's worth of target forwards a prompt, which ten chains side by side cannot spare."""


@dataclass(frozen=True, slots=True)
class Chain:
    """One data set through the chain: the source's answers or the target's, all of them or a part,
    its states stored in bf16 or fp8 and computed by the target in bf16 or FP8, trained into one
    drafter with one seed."""

    name: str
    regenerated: bool
    fraction: float = 1.0
    dtype: str = "bfloat16"
    """extract.dtype: the states as stored."""
    compute_dtype: str = "bfloat16"
    """extract.compute_dtype: the target's linear layers as it computes the states (float8 on a GPU with FP8 tensor cores)."""
    drafter: str = "dflash"
    """train.drafter (dflash | dflash2 | dspark)."""
    seed: int = DEFAULT_SEED
    """train.seed: the drafter's initialisation, its anchors and its batches."""
    states_of: str | None = None
    """The chain whose extracted states this one trains on (it runs train and evaluate only); None: its own."""
    settings: tuple[tuple[str, float], ...] = ()
    """train.<drafter> settings other than their defaults (an ablation: ABLATIONS)."""
    epochs: int | None = None
    """train.epochs, fewer than the size's for a point of the steps curve (None: the size's)."""
    trees: bool = True
    """Its evaluation decodes the size's draft trees too (else the chain and the baselines only)."""
    baselines: bool = True
    """Its evaluation decodes prompt lookup and the bigram table too (eval.baselines; BASELINES_OF)."""

    @property
    def bf16(self) -> bool:
        """Its states computed and stored in bf16 (not a chain of the fp8 comparisons)."""
        return self.dtype == "bfloat16" and self.compute_dtype == "bfloat16"

    @property
    def generates(self) -> bool:
        """The one chain that runs the generate step; the other regenerated chains read its rows."""
        return self.regenerated and self.fraction == 1.0 and self.bf16 and self.states_of is None


ABLATIONS = {
    "dflash2-selector-off": ("dflash2", (("selector_alpha", 0.0),)),
    "dspark-markov-rank1": ("dspark", (("markov_rank", 1),)),
}
"""Each successor without the part that is its own, on the same states: what is left of its lead
over DFlash is its anchor path (DFlash2's in-block convolution, DSpark's anchor as the first slot),
what it loses is its head's. DFlash2's candidate selector never trained (selector_alpha 0: a fresh
selector ranks as the drafter's own logits do); DSpark's Markov head at rank 1, the smallest the
spec takes (its bigram bias then one direction, not a table)."""


def drafted_block(drafter: str, verify_block: int) -> int:
    """train.block_size that drafts `verify_block` - 1 tokens a step, as DFlash's block of
    `verify_block` does: DSpark's anchor is a prediction slot, so its block of B drafts B tokens and
    is verified with the anchor (B + 1); DFlash and DFlash2 draft B - 1. The successors are then
    compared with DFlash at the same verify block, position for position."""
    return verify_block - 1 if drafter == "dspark" else verify_block


def run_name(benchmark: Path) -> str:
    """The spec's name, one per benchmark work directory: the generate step keeps its scratch files
    under the system's temporary directory by run name, and two benchmarks of one name on a machine
    (a test beside a CPU run) deleted each other's. The same directory keeps its name: a rerun resumes."""
    return f"quality-{hashlib.sha256(str(benchmark.resolve()).encode()).hexdigest()[:8]}"


EXTRACT_TOKEN_BUDGET = 8192


def target_token_budget(size: Size) -> int:
    """extract.token_budget: the target's tokens a forward, at extraction or, online, in a training step."""
    return max(EXTRACT_TOKEN_BUDGET, size.micro_batch_tokens) if size.states == "online" else EXTRACT_TOKEN_BUDGET


def write_spec(workdir: Path, target: Path, data: Path, size: Size, device: torch.device, chain: Chain, *, final_hidden: bool) -> Path:
    """The chain's dflash.yaml; `final_hidden`: extraction stores the target's final hidden state
    too (a chain reading these states trains a drafter that needs it)."""
    spec = {
        "name": run_name(workdir.parent),
        "backend": "local",
        "target": {"model": str(target), "layers": size.capture},
        "data": {"source": str(data), "max_length": size.max_length, "chunk_tokens": size.chunk_tokens, "holdout": size.holdout},
        "output": str(workdir / "run"),
        # Compiling a target this small costs more than its whole extraction. Online, the budget is the
        # trainer's target forward: a micro-batch's in one forward, as bench_online measured the step
        # (at 8,192 the code-scale run's 16,384-token micro-batches took two or three).
        "extract": {"shards": 2, "token_budget": target_token_budget(size), "dtype": chain.dtype, "compute_dtype": chain.compute_dtype,
                    "pad_multiple": 128, "compile": False,
                    **({"final_hidden": True} if final_hidden else {})},
        "train": {
            "states": size.states, "drafter": chain.drafter, "block_size": drafted_block(chain.drafter, size.block_size),
            "gpus_per_node": 1, "draft_layers": size.draft_layers, "anchors": size.anchors, "epochs": chain.epochs or size.epochs, "lr": size.draft_lr,
            "micro_batch_tokens": size.micro_batch_tokens, "micro_batch_blocks": size.micro_batch_blocks, "seed": chain.seed,
            "checkpoint_every": 200, "cache_gb": CHAIN_CACHE_GB, "stall_seconds": 120.0,
            **({chain.drafter: dict(chain.settings)} if chain.settings else {}),
        },
        "eval": {"prompts": size.eval_prompts or size.holdout, "max_new_tokens": size.eval_new_tokens, "processes": size.eval_processes,
                 "tree_budgets": list(size.tree_budgets) if chain.trees else [], "baselines": list(BASELINES) if chain.baselines else [],
                 "reference_cache": str(workdir.parent / REFERENCES)},
        "local": {"workdir": str(workdir / "local"), "device": device.type},
    }
    if chain.generates:
        # Greedy, as the evaluation decodes. The answers are cut at max_answer_tokens and kept: every
        # prompt must keep its row (the same held-out prompts in every chain). The template's default
        # thinking mode, as the source chain's prepare renders it: the held-out prompts are then the
        # same tokens in every chain.
        spec["generate"] = {
            "engine": "transformers", "shards": 2, "temperature": 0.0, "thinking": None, "max_new_tokens": size.max_answer_tokens,
            "truncated": "keep", "empty": "keep", "chunk_prompts": -(-size.chats // 4), "batch_prompts": size.regenerate_batch,
        }
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "dflash.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


class ChainRunner:
    """One chain's steps, each as its pod would run it, each step's seconds kept."""

    def __init__(self, spec: Path, workdir: Path, *, gpu: bool, online: bool = False) -> None:
        """`gpu`: every step in a fresh interpreter (launch.py says why); else forked, on one
        intra-op thread (a CPU: the matrices are tiny, and on a shared machine a second thread
        spins while it waits, slowing a step many times over). `online`: train.states is online,
        so nothing is extracted or verified (the trainer runs the target)."""
        self.spec, self.workdir, self.gpu, self.online = spec, workdir, gpu, online
        self.env = {**launch.step_env(workdir, cpu=not gpu), "DFLASH_CACHE_DIR": str(workdir / "cache")}
        self.seconds: dict[str, float] = {}

    def step(self, name: str, *commands: list[str], extra_env: dict[str, str] | None = None) -> None:
        """Runs `python -m <command>` for each command at once (launch.py), each with its own log."""
        started = time.monotonic()
        logs = [self.workdir / f"{name}-{i}.log" for i in range(len(commands))]
        waits = [launch.start(command[0], command[1:], {**self.env, **(extra_env or {})}, log, fresh=self.gpu)
                 for command, log in zip(commands, logs)]
        codes = [wait() for wait in waits]
        self.seconds[name] = round(time.monotonic() - started, 1)
        print(f"quality: {self.workdir.name} {name}: {exit_status(max(codes, key=abs))} after {self.seconds[name]} s", file=sys.stderr, flush=True)
        if any(codes):
            failed = next(i for i, code in enumerate(codes) if code)
            raise RuntimeError(f"{name} failed ({exit_status(codes[failed])}): {shlex.join(['python', '-m', *commands[failed]])}\n"
                               + printed(logs[failed]))

    def job(self, module: str, *args: str) -> list[str]:
        return [module, *args, "-f", str(self.spec)]

    def generate(self) -> None:
        # Two shards share the machine: one intra-op thread each keeps them from fighting over cores.
        self.step("generate", *[self.job("dflash_jobs.generate", "--shard", str(i)) for i in range(2)], extra_env={"OMP_NUM_THREADS": "1"})

    def run(self, states_verified: Callable[[], None] = lambda: None) -> dict[str, float]:
        """Every step; `states_verified` is called once the extracted states are verified, or once
        the token chunks are prepared when the states are online (chains reading them may start)."""
        # As `dflashctl run` does: prepare refuses to re-chunk tokens that hidden states were extracted
        # from, so a chain cut after it (a device call's limit) goes on from the stored data set.
        if (self.workdir / "run" / DATASET_KEY).exists():
            print(f"quality: {self.workdir.name} prepare: skipped, {DATASET_KEY} is stored", file=sys.stderr, flush=True)
        else:
            self.step("prepare", self.job("dflash_jobs.prepare"))
        if not self.online:
            self.step("extract", *[self.job("dflash_jobs.extract", "--shard", str(i)) for i in range(2)], extra_env={"OMP_NUM_THREADS": "1"})
            self.step("verify", self.job("dflashctl.cli.main", "verify"))
        states_verified()
        return self.train_and_evaluate()

    def train_and_evaluate(self) -> dict[str, float]:
        self.step("train", self.job("dflash_jobs.train"))
        self.step("evaluate", self.job("dflash_jobs.evaluate"))
        return self.seconds


def exit_status(code: int) -> str:
    """An exit code as words: a negative one is the signal that ended the process."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}" + (" (out of memory?)" if code == -signal.SIGKILL else "")
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


def printed(log: Path) -> str:
    """The end of what a step printed, or why there is nothing: a step that died before its log
    existed (a forked child that failed to start) printed on the benchmark's own stderr."""
    if not log.exists():
        return f"{log} does not exist: the step died before it opened its log; what it printed is on this process's stderr, above"
    text = log.read_text(errors="replace")
    return text[-3000:] if text else f"{log} is empty: the step printed nothing"


def share_states(origin: Path, workdir: Path, *, online: bool = False) -> None:
    """Hard-links the origin chain's tokens/ and extract/ (its tokens/ alone when the states are
    online) into workdir/run: every stored file is written once and renamed into place, never
    changed, so the two runs can share its bytes."""
    needed = origin / "run" / (DATASET_KEY if online else MANIFEST_KEY)
    if not needed.exists():
        raise RuntimeError(f"{origin.name} has no {'token chunks' if online else 'verified states'} ({needed}) for {workdir.name} to train on: it failed before")
    for name in SHARED_TOKENS if online else SHARED_STATES:
        if not (workdir / "run" / name).exists():
            shutil.copytree(origin / "run" / name, workdir / "run" / name, copy_function=os.link)


def regenerated_rows(chain_dir: Path) -> list[str]:
    """The generate step's rows, in sample order, as chat JSONL lines: prepare reads them as it reads
    the generated rows (their "generation" record included), without the sample ids of data.source."""
    storage = open_storage(str(chain_dir / "run"))
    manifest = read_manifest(storage)
    if manifest is None:
        raise RuntimeError(f"{chain_dir}/run holds no generate/manifest.json: the generate step did not finish")
    rows = [json.loads(line) for _, line in sorted(generated_lines(storage, manifest))]
    return [json.dumps({key: value for key, value in row.items() if key != "sample_id"}) + "\n" for row in rows]


def part_of(rows: list[str], fraction: float, holdout: int) -> list[str]:
    """The first `fraction` of the training rows, then the held-out rows (prepare holds out the last ones)."""
    training = rows[: len(rows) - holdout]
    return training[: round(fraction * len(training))] + rows[len(rows) - holdout :]


def held_out_prompts(chain_dir: Path) -> list[list[int]]:
    """The token ids the evaluation asked the target: each held-out sample before its last answer."""
    chunk = held_out_samples(chain_dir)
    return [chunk.sample(i)[0][: prompt_length(chunk.sample(i)[1])].tolist() for i in range(chunk.num_samples)]
