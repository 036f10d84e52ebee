"""A profiled pass's kernels by kind: what bounds a forward whose GPU never waits on its host.

`kernel_kinds(prof, ...)` puts every kernel of a torch.profiler run (its CUDA activity; aten ops by
their self time on a CPU) in the first KINDS row whose pattern its name matches, and gives per kind
the time, the share of the kernels' time and the calls; the GPU's busy time (the union of the
kernels' intervals: overlapping streams counted once) against the pass's wall time, the rest the
GPU idle; the rate each kind reached where its FLOPs are given (the GEMMs', attention's), and the
ceiling the pass would have if everything but the GEMMs took no time.
"""

from __future__ import annotations

import re

import torch

KINDS: tuple[tuple[str, str], ...] = (
    # first: flex attention's kernels are inductor templates (triton_tem_fused_..._flex_attention_...), and
    # memory-efficient attention's CUTLASS ones (fmha_cutlassF_...)
    ("attention", r"flash|fmha|attention|attn|sdpa"),
    # inductor names its other kernels triton_{poi,red,per}_fused_...: compiled norms, gates, activations, FP8 quantization
    ("compiled_elementwise", r"^triton_"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|scaled_mm|^aten::(add|b)?mm$|^aten::linear$"),
    ("short_convolution", r"conv(1d|2d|olution)|causal_conv"),
    # flash-linear-attention's Triton kernels (fla 0.6): chunk_gated_delta_rule_fwd_kernel_h_blockdim64,
    # chunk_scaled_dot_kkt_fwd_kernel, solve_tril / merge_16x16_to_64x64_inverse_kernel, recompute_w_u_fwd_kernel,
    # chunk_fwd_kernel_o, chunk_local_cumsum, l2norm_fwd_kernel, gdn_gate_*, layer_norm_gated_fwd_kernel
    ("gated_delta_net", r"delta|chunk_|kkt|solve_tril|inverse_kernel|recompute_w_u|wy_repr|fused_recurrent|l2norm|cumsum|gdn_|norm_gated"),
    ("copy", r"copy|memcpy|memset|\bcat\b|catarray|index|gather|scatter|fill"),
    ("elementwise", r"elementwise|vectorized|reduce|norm|softmax|pow|mul|add|silu|sigmoid|exp|rsqrt|mean|sum"),
)
"""Kinds in the order their patterns are tried (case-insensitive); a kernel no pattern matches is `other`."""
PATTERNS = tuple((kind, re.compile(pattern, re.IGNORECASE)) for kind, pattern in KINDS)
NOT_KERNELS = ("Command Buffer Full", "Activity Buffer Request")
"""CUPTI's marks on the device timeline that are no kernel (a full launch queue: the host ahead of the
GPU; the profiler's own buffer)."""


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in PATTERNS if pattern.search(name)), "other")


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The union of [start, end) intervals (any unit in, seconds out for microseconds in): time some kernel ran."""
    busy = 0.0
    reach = float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        busy += end - max(start, reach)
        reach = end
    return busy / 1e6


def linear_flops_per_token(layers: torch.nn.Module) -> int:
    """2 x in x out over every linear layer (bf16 or FP8) under `layers`: the matmuls' work for one token."""
    return sum(2 * m.in_features * m.out_features for m in layers.modules() if hasattr(m, "in_features") and hasattr(m, "out_features"))


def kernel_kinds(prof, *, on_gpu: bool, wall_s: float, tokens: int, flops: dict[str, float], peak_flops: float) -> dict:
    """`prof` a finished torch.profiler.profile over one pass of `tokens` tokens that took `wall_s`;
    `flops` the work of some kinds in it (the GEMMs': the linear layers', padding included), `peak_flops`
    the card's dense peak for the GEMMs' dtype."""
    wanted = "CUDA" if on_gpu else "CPU"
    rows: dict[str, dict] = {}
    kernels: dict[str, list] = {}
    for event in prof.key_averages():
        if event.device_type.name != wanted or event.key in NOT_KERNELS:
            continue
        micros = event.self_device_time_total if on_gpu else event.self_cpu_time_total
        kind = kind_of(event.key)
        row = rows.setdefault(kind, {"seconds": 0.0, "calls": 0})
        row["seconds"] += micros / 1e6
        row["calls"] += event.count
        kernels.setdefault(kind, []).append((micros, event.key))
    total = sum(row["seconds"] for row in rows.values())
    by_kind = {}
    for kind, row in sorted(rows.items(), key=lambda item: -item[1]["seconds"]):
        top = max(kernels[kind])
        by_kind[kind] = {"seconds": round(row["seconds"], 4), "share": round(row["seconds"] / total, 4) if total else 0.0,
                         "calls": row["calls"], "largest": {"name": top[1][:120], "seconds": round(top[0] / 1e6, 4)}}
        if flops.get(kind) and row["seconds"]:
            rate = flops[kind] / row["seconds"]
            by_kind[kind].update(tflop_per_s=round(rate / 1e12, 2), of_peak=round(rate / peak_flops, 4))
    out: dict = {"wall_s": round(wall_s, 3), "kernel_s": round(total, 3), "by_kind": by_kind}
    if on_gpu:
        busy = busy_seconds([(e.time_range.start, e.time_range.end) for e in prof.events()
                             if e.device_type.name == "CUDA" and e.name not in NOT_KERNELS])
        out["busy_s"] = round(busy, 3)
        out["idle_share"] = round(1 - busy / wall_s, 4) if wall_s else 0.0
    gemm_s = rows.get("gemm", {}).get("seconds", 0.0)
    if gemm_s:  # the pass's rate were every other kernel free and the GPU never idle
        out["gemm_ceiling_tokens_per_s"] = round(tokens / gemm_s, 1)
    return out
