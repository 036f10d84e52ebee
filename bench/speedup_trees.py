"""Draft trees at the 27B shape for bench/speedup.py (`--tree-budgets`): a typical DDTree tree per
budget, its verify forward, commit and build timed beside a flat forward of as many tokens, the
tree forward checked against plain computations of its root paths within their own noise floor, and
each budget's speed-up. bench/speedup.py's module docstring says what each figure is."""

from __future__ import annotations

import torch
from speedup_timing import curve, kernel_profile, measure

from dflash_jobs.drafter.speculative import DecodeTarget
from dflash_jobs.drafter.tree import MarginalBranches, Tree, build_tree
from dflash_jobs.drafter.tree_verify import commit_path, verify_tree

COMMITTED_PATH = 4
"""Accepted nodes in the timed tree commit."""
NOISE_FACTOR = 2.0
"""How far the tree check lets the tree's logits lie from the nearer plain computation, in noise floors:
a third order of the same sums is a third draw of rounding, about a floor from either plain one."""
FLOOR_ULPS = 2
"""The least noise floor, in units in the last place of the logits' dtype relative to the largest
logit: two plain computations may round alike (on the CPU they often agree to the bit) where a third
order does not."""


def typical_tree(budget: int, depths: int, vocab: int, device: torch.device) -> tuple[Tree, torch.Tensor]:
    """DDTree's tree of `budget` nodes over slot distributions shaped like a trained drafter's: at
    depth d the top token has probability 0.8 falling linearly to 0.4 at the last depth, the rest
    halving rank by rank. Returns the tree and the [depths, vocab] logits it was built from."""
    ranks = min(budget + 1, vocab)
    logits = torch.full((depths, vocab), -1e4)
    for d in range(depths):
        top = 0.8 - 0.4 * d / max(depths - 1, 1)
        rest = torch.tensor([0.5**r for r in range(1, ranks)])
        logits[d, :ranks] = torch.cat([torch.tensor([top]), (1 - top) * rest / rest.sum()]).log()
    return build_tree(MarginalBranches(logits, anchor=0), budget=budget, depth_limit=depths), logits.to(device)


def tree_shape(tree: Tree) -> dict:
    per_depth = [tree.depths.count(d) for d in range(1, max(tree.depths, default=0) + 1)]
    return {"nodes": len(tree), "depth": len(per_depth), "per_depth": per_depth}


def root_paths(tree: Tree) -> list[list[int]]:
    """Every leaf's root path, as verify rows (0 the root, node i + 1): together they hold every row."""
    inner = set(tree.parents)
    paths = []
    for leaf in (node for node in range(len(tree)) if node not in inner):
        rows, node = [], leaf
        while node >= 0:
            rows.append(node + 1)
            node = tree.parents[node]
        paths.append([0, *reversed(rows)])
    return paths


def chain_rows(tree: Tree, nodes: int) -> list[int]:
    """The root and the chain's first `nodes` nodes (each depth's first child), as verify rows: a committed path."""
    path, parent = [0], -1
    for node in range(len(tree)):
        if tree.parents[node] == parent and len(path) <= nodes:
            path.append(node + 1)
            parent = node
    return path


def logit_difference(logits: torch.Tensor, reference: torch.Tensor) -> dict:
    """[rows, V] against [rows, V]: the largest difference relative to the reference's largest logit, and
    the rows whose argmax differ."""
    logits, reference = logits.float(), reference.float()
    return {"max_relative_logit_difference": float(f"{float((logits - reference).abs().max() / reference.abs().max()):.3g}"),
            "argmax_disagreements": int((logits.argmax(-1) != reference.argmax(-1)).sum())}


def tree_check(target: DecodeTarget, tree: Tree, reset) -> dict:
    """The tree verify forward's logits at every row against two plain computations of the rows' root
    paths (every leaf's), each a legitimate order of the same sums: `whole`, a path in one forward
    after the cache (on the GPU flash-linear-attention's chunk kernel), and `stepwise`, the path
    token by token through decode (the recurrent kernel, as the tree's GDN layers run). What the two
    plain ones differ by is the noise floor of this dtype and these kernels (no finer than
    FLOOR_ULPS); the tree is right where it lies no further from the nearer of them than
    NOISE_FACTOR floors. A wrong state, position or window moves the logits by more (several floors
    at the tiny shape in bf16, 10^4 and more in fp32). Argmax may flip within the floor where the top
    two logits nearly tie (random weights over 248K tokens), hence the plain pair's count too."""
    verified = verify_tree(target, 0, tree)
    tokens = [0, *tree.tokens]  # by row: the root, then the nodes
    whole, stepwise = {}, {}
    for rows in root_paths(tree):
        ids = torch.tensor([tokens[row] for row in rows], device=target.device)
        reset()
        at_once = target.forward(ids)
        reset()
        by_token = torch.cat([target.forward(ids[i : i + 1]) for i in range(len(ids))])
        for i, row in enumerate(rows):
            whole.setdefault(row, at_once[i])
            stepwise.setdefault(row, by_token[i])
    reset()
    rows = sorted(whole)
    mine, whole, stepwise = verified.logits[rows], torch.stack([whole[r] for r in rows]), torch.stack([stepwise[r] for r in rows])
    check = {"rows": len(rows), "tree_vs_whole": logit_difference(mine, whole), "tree_vs_stepwise": logit_difference(mine, stepwise),
             "stepwise_vs_whole": logit_difference(stepwise, whole)}
    floor = max(check["stepwise_vs_whole"]["max_relative_logit_difference"], FLOOR_ULPS * torch.finfo(verified.logits.dtype).eps)
    nearer = min(check["tree_vs_whole"]["max_relative_logit_difference"], check["tree_vs_stepwise"]["max_relative_logit_difference"])
    check["noise_floor"] = float(f"{floor:.3g}")
    check["tree_over_floor"] = round(nearer / floor, 2)
    check["within_noise"] = nearer <= NOISE_FACTOR * floor
    check["verdict"] = (f"within the plain computations' own spread: the tree lies {check['tree_over_floor']}x their difference from the nearer"
                        if check["within_noise"] else
                        f"outside the plain computations' own spread: the tree lies {check['tree_over_floor']}x their difference from the "
                        f"nearer (over {NOISE_FACTOR}x): a defect of the tree forward, not rounding")
    return check


def time_trees(target: DecodeTarget, budgets: list[int], depths: int, device: torch.device, reps: int, warmup: int, profile_reps: int, reset,
               save) -> dict:
    """tree_verify, tree_commit, tree_build and flat_forward per budget (see the module docstring), on the target's cache as
    `reset` leaves it; on a GPU with profile_reps, the kernels each of tree_verify, tree_commit and flat_forward launches."""
    vocab = target.model.config.vocab_size
    trees: dict = {}
    for budget in budgets:
        tree, logits = typical_tree(budget, depths, vocab, device)
        entry = trees[str(budget)] = {"shape": tree_shape(tree)}
        reset()
        entry["check"] = tree_check(target, tree, reset)
        entry["tree_verify"] = measure(lambda: verify_tree(target, 0, tree).predicted, device, reps=reps, warmup=warmup)
        verified = verify_tree(target, 0, tree)
        path = chain_rows(tree, COMMITTED_PATH)
        entry["tree_commit"] = measure(lambda: commit_path(target, verified, path), device, reps=reps, warmup=1, before=reset)
        entry["tree_build"] = measure(lambda: build_tree(MarginalBranches(logits, anchor=0), budget=budget, depth_limit=depths), device,
                                      reps=reps, warmup=1)
        ids = torch.arange(len(tree) + 1, device=device)
        entry["flat_forward"] = measure(lambda: target.forward(ids).argmax(-1), device, reps=reps, warmup=warmup, before=reset)
        reset()
        if device.type == "cuda" and profile_reps > 0:
            # No rollback inside a profile: the commits grow the cache by a few tokens over the reps, then it is rolled back.
            entry["kernels"] = {"tree_verify": kernel_profile(lambda: verify_tree(target, 0, tree).predicted, device, profile_reps),
                                "tree_commit": kernel_profile(lambda: commit_path(target, verified, path), device, profile_reps)}
            reset()
            entry["kernels"]["flat_forward"] = kernel_profile(lambda: target.forward(ids).argmax(-1), device, profile_reps)
            reset()
            for profiled in entry["kernels"].values():
                profiled.pop("names")
        save()
    return trees


def tree_speedups(ctx: dict, taus: list[float], acceptance: dict[int, float]) -> dict:
    """Per budget: its costs against decode1 and the flat forward, and the speed-up at its measured tau
    (--tree-acceptance) or at every tau of the grid."""
    t1 = ctx["target"]["decode1"]["median_ms"]
    table = {}
    for budget, entry in ctx["trees"].items():
        verify = entry["tree_verify"]["median_ms"] + entry["tree_commit"]["median_ms"]
        flat = entry["flat_forward"]["median_ms"]
        build = entry["tree_build"]["median_ms"]
        rows = []
        for tau in [acceptance[int(budget)]] if int(budget) in acceptance else taus:
            draft = curve(ctx["drafter"]["cached"], tau) + build
            row = {"tau": tau, "tree": round(tau * t1 / (verify + draft), 3), "cycle_ms": round(verify + draft, 3)}
            if verify > flat:
                row["tree_flat"] = round(tau * t1 / (flat + draft), 3)
            rows.append(row)
        table[budget] = {
            "nodes": entry["shape"]["nodes"], "verify_and_commit_ms": round(verify, 3), "flat_forward_ms": flat,
            "verify_over_flat": round(verify / flat, 3), "verify_over_decode1": round(verify / t1, 3), "build_ms": build,
            "break_even_tau": round((verify + curve(ctx["drafter"]["cached"], 1) + build) / t1, 3), "table": rows,
        }
    return table


