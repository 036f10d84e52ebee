"""What a draft tree's verify and commit launch, beside a flat forward of as many tokens: the CPU
proxy of bench/speedup.py's tree timings, whose eager batch-1 forward at the 27B shape is bound by
kernel launches (about 4-5K a forward).

    python bench/tree_launches.py --baseline 542339a --out bench/results/tree-launches-cpu.json

The target has the Qwen3.6-27B text model's layer structure (64 layers: [3 Gated DeltaNet, 1 gated
attention] x 16, bench/extract_shapes.py's REAL_27B) at the tiny target's widths (dflash_jobs.architectures.tiny):
what a call launches depends on the layers, not on their widths; in bf16 by default, as on the GPU
(a cast launches a copy, which float32 would hide). A context of CONTEXT random tokens
is prefilled; then per budget, on DDTree's typical tree (bench/speedup_trees.py's `typical_tree`):
`tree_verify` (verify_tree), `tree_commit` (commit_path of the root and COMMITTED_PATH nodes, as
bench/speedup.py times it) and `flat_forward` (a plain forward of budget + 1 tokens with all their
logits). Counted (`Launches`): every aten operator that computes (a view or a bare allocation
launches nothing; contiguous, reshape or to count where they copy), and each call of a Gated DeltaNet kernel as one launch whatever its torch
fallback runs on the CPU: on the GPU flash-linear-attention and causal-conv1d run
`torch_recurrent_gated_delta_rule` as one kernel and `causal_conv1d_fn` / `causal_conv1d_update` as
one, while `torch_chunk_gated_delta_rule` (the flat forward's) is 8 in fla 0.6 (the l2-norms of q and
k, a cumsum, the kkt product, solve_tril, w and u, the states, the output): a flat forward's count is
therefore a floor, by about 7 a GDN layer. fla's two gated delta rule functions also copy each input
that is not contiguous (its input_guard), counted here too (`input_copies`). Their `tokens` are the
sequence positions they run (batch x length, a tree's padding included).

`--baseline REF` counts the same calls with the data plane of git commit REF (its jobs/ in a
temporary directory, a child process of this script), side by side in the one JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent / "train")]
from extract_shapes import REAL_27B  # noqa: E402  (bench/extract_shapes.py)
from speedup import target_config  # noqa: E402
from speedup_trees import COMMITTED_PATH, chain_rows, tree_shape, typical_tree  # noqa: E402

import dflash_jobs  # noqa: E402
from dflash_jobs.drafter.tree_verify import commit_path, verify_tree  # noqa: E402

try:
    from dflash_jobs.drafter.tree_verify import tree_target
except ImportError:  # a --baseline's data plane from before the target carried its architecture (issue 51)
    from dflash_jobs.drafter.speculative import Target as tree_target

REPOSITORY = Path(__file__).resolve().parents[1]
CONTEXT = 64
DEPTHS = 15
"""The drafted slots of a block of 16: no tree deeper."""
GDN_KERNELS = ("torch_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update")
"""The functions of transformers' qwen3_5 modeling that flash-linear-attention and causal-conv1d take over on a GPU."""
NO_LAUNCH = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default, torch.ops.aten.empty_like.default,
             torch.ops.aten.lift_fresh.default}


def _first_tensor(values) -> torch.Tensor | None:
    values = values if isinstance(values, (tuple, list)) else (values,)
    return next((value for value in values if isinstance(value, torch.Tensor)), None)


def _shares_storage(out, args) -> bool:
    result, source = _first_tensor(out), _first_tensor(args)
    return result is None or source is None or result.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()


class Launches(TorchDispatchMode):
    """Counts the operators a call launches, each GDN kernel call as one (see the module docstring)."""

    def __init__(self, modeling) -> None:
        super().__init__()
        self.modeling = modeling
        self.operators: Counter = Counter()
        self.kernels: dict[str, dict[str, int]] = {}
        self._inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An operator that may alias its input (a view, contiguous, reshape, to) launches a copy where it returns new storage.
        if not self._inside and func not in NO_LAUNCH and not (func.is_view and _shares_storage(out, args)):
            self.operators[func.name()] += 1
        return out

    def _counted(self, name: str, kernel):
        def call(*args, **kwargs):
            entry = self.kernels.setdefault(name, {"calls": 0, "tokens": 0, "input_copies": 0})
            entry["calls"] += 1
            if name.endswith("gated_delta_rule"):
                key = args[1]  # [B, T, H, K]
                entry["tokens"] += key.shape[0] * key.shape[1]
                # flash-linear-attention's input_guard makes every tensor argument contiguous: a copy each that is not.
                entry["input_copies"] += sum(not t.is_contiguous() for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
            self._inside += 1
            try:
                return kernel(*args, **kwargs)
            finally:
                self._inside -= 1
        return call

    @contextlib.contextmanager
    def counting(self):
        originals = {name: getattr(self.modeling, name) for name in GDN_KERNELS}
        try:
            for name, kernel in originals.items():
                setattr(self.modeling, name, self._counted(name, kernel))
            with self:
                yield self
        finally:
            for name, kernel in originals.items():
                setattr(self.modeling, name, kernel)

    def summary(self) -> dict:
        kernels = sum(entry["calls"] + entry["input_copies"] for entry in self.kernels.values())
        return {"launches": sum(self.operators.values()) + kernels, "aten_operators": sum(self.operators.values()),
                "gdn_kernels": self.kernels, "top_operators": dict(self.operators.most_common(12))}


def count(fn, modeling) -> dict:
    with Launches(modeling).counting() as launches:
        fn()
    return launches.summary()


def structure_27b():
    """The tiny target's widths in the 27B's 64 layers (REAL_27B's layer types)."""
    from transformers import Qwen3_5TextConfig

    config = target_config("tiny")
    config.num_hidden_layers = REAL_27B["num_hidden_layers"]
    config.layer_types = Qwen3_5TextConfig(**REAL_27B).layer_types
    return config


def measure(budgets: list[int], dtype: torch.dtype) -> dict:
    from transformers import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5 import modeling_qwen3_5

    torch.manual_seed(0)
    config = structure_27b()
    model = Qwen3_5ForCausalLM(config).eval().to(dtype)
    target = tree_target(model)
    data_plane = Path(dflash_jobs.__file__).parent  # this checkout's (repository-relative), or a baseline's
    result = {"dflash_jobs": str(data_plane.relative_to(REPOSITORY) if data_plane.is_relative_to(REPOSITORY) else data_plane),
              "layers": Counter(config.layer_types), "budgets": {}}
    with torch.inference_mode():
        target.reset()
        target.forward(torch.randint(0, config.vocab_size, (CONTEXT,)), last_only=True)
        checkpoint = target.checkpoint()
        for budget in budgets:
            tree, _ = typical_tree(budget, DEPTHS, config.vocab_size, torch.device("cpu"))
            entry = result["budgets"][str(budget)] = {"shape": tree_shape(tree)}
            verified = None

            def verify():
                nonlocal verified
                verified = verify_tree(target, 0, tree)

            entry["tree_verify"] = count(verify, modeling_qwen3_5)
            entry["tree_commit"] = count(lambda: commit_path(target, verified, chain_rows(tree, COMMITTED_PATH)), modeling_qwen3_5)
            target.rollback(checkpoint)
            ids = torch.arange(len(tree) + 1)
            entry["flat_forward"] = count(lambda: target.forward(ids), modeling_qwen3_5)
            target.rollback(checkpoint)
            tree_launches = entry["tree_verify"]["launches"] + entry["tree_commit"]["launches"]
            entry["verify_and_commit_launches"] = tree_launches
            entry["verify_and_commit_over_flat"] = round(tree_launches / entry["flat_forward"]["launches"], 3)
    return result


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPOSITORY, check=True, capture_output=True, text=True).stdout.strip()


def baseline(ref: str, budgets: list[int], dtype: str) -> dict:
    """This script's figures with the data plane of commit `ref`, from a child process."""
    commit = git("rev-parse", ref)
    with tempfile.TemporaryDirectory() as directory:
        archive = subprocess.run(["git", "archive", commit, "jobs"], cwd=REPOSITORY, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", directory], input=archive, check=True)
        out = Path(directory) / "baseline.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(directory) / "jobs"), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, __file__, "--budgets", ",".join(map(str, budgets)), "--dtype", dtype, "--out", str(out)], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())["this"]
    if not result["dflash_jobs"].startswith(directory):
        raise RuntimeError(f"the baseline ran {result['dflash_jobs']}, not commit {commit}'s data plane: the installed package shadows PYTHONPATH")
    # The child's own record of the checkout it ran in is this one's, not the commit's.
    return {"commit": commit, **{key: value for key, value in result.items() if key not in ("commit", "uncommitted_changes", "dflash_jobs")}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", default="16,32,64,128", help="tree node budgets, comma-separated")
    parser.add_argument("--baseline", metavar="REF", help="a git commit whose data plane is counted beside this one's")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the target's weights and activations")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    torch.set_num_threads(1)
    result = {"command": shlex.join(["python", "bench/tree_launches.py", *sys.argv[1:]]), "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "dtype": args.dtype, "context": CONTEXT, "committed_path": COMMITTED_PATH}
    if args.baseline:
        result["baseline"] = baseline(args.baseline, budgets, args.dtype)
    result["this"] = {"commit": git("rev-parse", "HEAD"), "uncommitted_changes": bool(git("status", "--porcelain", "jobs")), **measure(budgets, getattr(torch, args.dtype))}
    if args.baseline:
        result["this_over_baseline"] = {
            budget: {kind: round(entry[kind]["launches"] / result["baseline"]["budgets"][budget][kind]["launches"], 3)
                     for kind in ("tree_verify", "tree_commit", "flat_forward")}
            for budget, entry in result["this"]["budgets"].items()}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    summary = {budget: {kind: entry[kind]["launches"] for kind in ("tree_verify", "tree_commit", "flat_forward")}
               for budget, entry in result["this"]["budgets"].items()}
    print(json.dumps({"this": summary, **({"this_over_baseline": result["this_over_baseline"]} if args.baseline else {})}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
