"""Timing a GPU or CPU call for the speed-up benchmark: the median of reps after warm-up (CUDA events
on a GPU), the kernels a call launched (torch.profiler), and interpolation between measured points."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, device: torch.device, *, reps: int, warmup: int, before=None) -> dict:
    """Median of `reps` timed calls of fn after `warmup` untimed ones; `before` runs untimed ahead of each."""
    events, walls = [], []
    for rep in range(warmup + reps):
        if before is not None:
            before()
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            end.record()
        sync(device)
        wall = (time.perf_counter() - started) * 1e3
        if rep >= warmup:
            walls.append(wall)
            events.append(start.elapsed_time(end) if device.type == "cuda" else wall)
    return {"median_ms": round(statistics.median(events), 3), "min_ms": round(min(events), 3), "max_ms": round(max(events), 3),
            "wall_median_ms": round(statistics.median(walls), 3), "reps": reps}


def kernel_profile(fn, device: torch.device, reps: int) -> dict:
    """Kernel time per call (sum over the GPU kernels and copies it launched) and kernel count, from torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        sync(device)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us()
    total_us = sum(by_name.values())
    if not kernels:  # a profiler that does not list device events flat: the operators' own device time, as bench/extract.py sums it
        total_us = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages())
    top = sorted(by_name.items(), key=lambda item: item[1], reverse=True)[:8]
    return {"kernel_ms": round(total_us / 1e3 / reps, 3), "kernels_per_call": round(len(kernels) / reps, 1),
            "top": [{"name": name[:100], "ms_per_call": round(us / 1e3 / reps, 3)} for name, us in top],
            "names": sorted(by_name)}


def curve(points: dict, x: float, key: str = "median_ms") -> float:
    """Linear interpolation of {"n": stats} at x (clamped to the measured n)."""
    ns = sorted(int(n) for n in points)
    return float(np.interp(x, ns, [points[str(n)][key] for n in ns]))


