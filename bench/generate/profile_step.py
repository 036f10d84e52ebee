"""Where a batch's time goes in the static decoder, and its knobs side by side (bench_generate.py's
profile and sweep stages).

`profile_batch`: one batch after a warm-up: the wall time of its prompt forward (prefill and first
token) and of its decode steps, each synchronised; then torch.profiler over the prefill and over a
few replayed steps of one window (CUDA graph captured), the 25 kernels (aten ops on a CPU) of most
time, how many kernels a step runs, and per step the kernels' time against the step's wall time:
the rest is the GPU idle (gaps between kernels, the launch, the host's work between steps).

`sweep`: the same prompts decoded by each variant (windows on or off, greedy in the step or
float32 argmax outside it, the step compiled or eager, batch size, SDPA backend), each after a short
warm-up of its batch size (which compiles the step, where the process has not yet); each pair
compared in both orders. Its groups of variants (SWEEP_GROUPS) can be chosen.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
from torch.profiler import ProfilerActivity, profile

from dflash_jobs.generate.decoding import StaticDecoder, greedy
from dflash_jobs.generate.sizing import TargetShape

TOP = 25
PROFILED_STEPS = 8
SWEEP_GROUPS = ("before-after", "changes", "batches", "compiled", "sdpa")
"""before-after: before (whole cache, float32 argmax outside the step) and after (windows, argmax in
the step), in the order before, after, after, before; changes: each of after's two changes alone;
batches: after at the other batch sizes; compiled: after and after compiled in the order after,
compiled, compiled, after, then compiled at the other batch sizes; sdpa: after under each SDPA backend."""


def float_greedy(logits: torch.Tensor) -> torch.Tensor:
    """Greedy as any other pick is served: float32 logits, argmax outside the replayed step."""
    return logits.argmax(dim=-1)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def top_kernels(prof, device: torch.device, steps: int = 1) -> dict:
    """The TOP kernels (aten ops on a CPU) by self time, per step in ms, and over all of them: the time
    and the count a step."""
    on_gpu = device.type == "cuda"
    rows = []
    for event in prof.key_averages():
        if on_gpu and event.device_type.name != "CUDA":
            continue
        if not on_gpu and event.device_type.name != "CPU":
            continue
        micros = getattr(event, "self_device_time_total", None) if on_gpu else event.self_cpu_time_total
        if micros is None:
            micros = event.self_cuda_time_total
        rows.append((micros, event.key, event.count))
    rows.sort(reverse=True)
    total = sum(micros for micros, _, _ in rows)
    return {"ms_per_step": round(total / 1000 / steps, 3), "calls_per_step": round(sum(count for _, _, count in rows) / steps, 1),
            "top": [{"name": name[:160], "calls_per_step": round(count / steps, 2), "ms_per_step": round(micros / 1000 / steps, 3),
                     "share": round(micros / total, 4) if total else 0.0} for micros, name, count in rows[:TOP]]}


def bytes_read(model, rows: int, window: int, step_ms: float) -> dict:
    """What a decode step must read at the least, from the config: every row's keys and values over
    the window (each layer's, in the cache's dtype) and the weights once; the rate of that at the
    step's wall time. The card's bandwidth bounds it (an H100 SXM's datasheet: 3,350 GB/s)."""
    cache = TargetShape.of(model).cache_bytes_per_token * rows * window
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"cache_bytes_per_step": cache, "weight_bytes": weights,
            "read_gb_per_s": round((cache + weights) / (step_ms / 1000) / 1e9, 1)}


@torch.inference_mode()
def profile_batch(decoder: StaticDecoder, ids: torch.Tensor, attention: torch.Tensor, new_tokens: int) -> dict:
    device = ids.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    decoder.run = None  # a cold batch: the cache made, each window's step run eagerly and captured
    synchronize(device)
    started = time.perf_counter()
    decoder(ids, attention, new_tokens, greedy)
    synchronize(device)
    cold = time.perf_counter() - started
    started = time.perf_counter()
    run = decoder.start(ids, attention, new_tokens, greedy)
    synchronize(device)
    prefilled = time.perf_counter()
    while run.advance():
        pass
    synchronize(device)
    ended = time.perf_counter()
    split = {"cold_batch_s": round(cold, 4), "prefill_and_first_token_s": round(prefilled - started, 4),
             "decode_s": round(ended - prefilled, 4), "decode_steps": run.chosen - 1, "windows": sorted(width for width, _ in run.steps.warm)}

    with profile(activities=activities) as prefill_prof:
        run = decoder.start(ids, attention, new_tokens, greedy)
        synchronize(device)
    # Into a window whose step is a captured graph, with PROFILED_STEPS more steps before the next window.
    P = ids.shape[1]
    while run.chosen + PROFILED_STEPS < new_tokens and (
            (device.type == "cuda" and (run.window(P + run.chosen), True) not in run.steps.graphs)
            or run.window(P + run.chosen) != run.window(P + run.chosen + PROFILED_STEPS)):
        run.advance()
    synchronize(device)
    began = time.perf_counter()
    with profile(activities=activities) as step_prof:
        for _ in range(PROFILED_STEPS):
            run.advance()
        synchronize(device)
    profiled_wall = time.perf_counter() - began  # with the profiler's own cost: the unprofiled steps below are the wall
    began = time.perf_counter()
    for _ in range(PROFILED_STEPS):
        if not run.advance():
            break
    synchronize(device)
    step_wall_ms = (time.perf_counter() - began) * 1000 / PROFILED_STEPS
    kernels = top_kernels(step_prof, device, PROFILED_STEPS)
    split.update({"replayed_step_wall_ms": round(step_wall_ms, 3),
                  "replayed_step_kernels_ms": kernels["ms_per_step"],
                  # the GPU idle within a step: the gaps between its kernels, the launch, the host's pick and stop check
                  "replayed_step_idle_ms": round(step_wall_ms - kernels["ms_per_step"], 3) if device.type == "cuda" else None,
                  "profiled_steps_wall_ms": round(profiled_wall * 1000 / PROFILED_STEPS, 3),
                  "profiled_window": run.window(P + run.chosen - 1), "profiled_after_tokens": run.chosen})
    split.update(bytes_read(decoder.model, ids.shape[0], split["profiled_window"], step_wall_ms))
    return {"batch": ids.shape[0], "prompt_length": P, "new_tokens": new_tokens, "split": split,
            "prefill": top_kernels(prefill_prof, device), "replayed_step": kernels}


def sdpa_backend(name: str | None):
    if name is None:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name)])


@torch.inference_mode()
def timed_variant(model, variant: dict, prompts: list[list[int]], new_tokens: int, make_batches, device) -> dict:
    """One variant over `prompts` (cut into its batch size), after a short warm-up of that batch size."""
    decoder = StaticDecoder(model, stop_ids=variant["stop_ids"], pad_id=variant["pad_id"], windows=variant["windows"],
                            compile=variant["compile"])
    pick = greedy if variant["pick"] == "greedy" else float_greedy
    work = make_batches(prompts, variant["batch"])
    row = {key: variant[key] for key in ("label", "batch", "windows", "pick", "compile", "sdpa")}
    try:
        with sdpa_backend(variant["sdpa"]):
            decoder(*work[0], min(new_tokens, 24), pick)
            synchronize(device)
            started = time.perf_counter()
            decoded = sum(decoder(ids, attention, new_tokens, pick).numel() for ids, attention in work)
            synchronize(device)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:  # a backend that refuses the mask, a batch too big
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {**row, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    seconds = time.perf_counter() - started
    return {**row, "prompts": len(prompts), "seconds": round(seconds, 3), "answers_per_s": round(len(prompts) / seconds, 1),
            "tokens_per_s": round(decoded / seconds, 1),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None}


def sweep_variants(groups: list[str], *, batch: int, batches: list[int], backends: list[str], stop_ids: set[int], pad_id: int) -> list[dict]:
    """The variants of `groups` (of SWEEP_GROUPS), in the order given."""
    base = {"stop_ids": stop_ids, "pad_id": pad_id, "batch": batch, "sdpa": None, "compile": False}
    before = {**base, "label": "before", "windows": False, "pick": "float32 argmax outside the step"}
    after = {**base, "label": "after", "windows": True, "pick": "greedy"}
    compiled = {**after, "label": "compiled", "compile": True}
    others = [size for size in batches if size != batch]
    variants = {
        "before-after": [before, after, after, before],
        "changes": [{**before, "label": "windows only", "windows": True}, {**after, "label": "argmax in the step only", "windows": False}],
        "batches": [{**after, "label": f"after, batch {size}", "batch": size} for size in others],
        "compiled": [after, compiled, compiled, after] + [{**compiled, "label": f"compiled, batch {size}", "batch": size} for size in others],
        "sdpa": [{**after, "label": f"after, SDPA {name}", "sdpa": name} for name in backends],
    }
    return [variant for group in groups for variant in variants[group]]


def sweep(model, prompts: list[list[int]], new_tokens: int, make_batches, device, variants: list[dict], on_row=None) -> list[dict]:
    """Each variant (sweep_variants) on the same prompts."""
    rows = []
    for variant in variants:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        rows.append(timed_variant(model, variant, prompts, new_tokens, make_batches, device))
        if on_row:
            on_row(rows)
    return rows
