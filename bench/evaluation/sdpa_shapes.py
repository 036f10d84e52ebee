"""What an attention call of a shape not seen before costs, by SDPA backend: the evaluation's eager
forwards (a prompt's prefill, the lossless check's and the captured layers' forwards, the drafter's
teacher-forced forward) each bring a new length.

    python bench/evaluation/sdpa_shapes.py --device cpu --lengths 4 --out /tmp/sdpa-shapes-cpu.json
    python3 bench/evaluation/sdpa_shapes.py --out $OUT/sdpa-shapes-h100.json      # one GPU, about a minute

The profile of the evaluation on an H100 (bench/README.md, "The evaluation of one chain") found 2.7 s
of 27 inside Transformers' SDPA call and 1.2 s inside the drafter's dense attention, on the host, for
17 prompts: some 1-40 ms a call where the kernels take microseconds. One explanation fits: a backend
that builds a plan for every new shape (cuDNN's), which a replayed graph or a repeated length never
pays again. This measures it, on random tensors of SmolLM2's attention shape (9 query heads, 3 key/value
heads of 64) in the evaluation's layouts:

- `prefill`: a prompt of P tokens over its static cache's window (P rounded up to 64 columns), a causal
  boolean mask, the key/value heads repeated to the query heads (what Transformers passes SDPA with a mask);
- `simulate`: the drafter's teacher-forced forward of a document of P + 48 tokens, a block of 16 at
  each of its 48 answer positions against the document and the blocks (grouped heads, a boolean mask).

For each backend (`default`: SDPA's own choice, recorded; else one backend alone) the same number of
lengths never used before in this process, each called twice: the first call's seconds (a new shape)
against the second's (the same shape again), device-synchronised. Then, on lengths of their own, each
backend's output against the default's (bitwise, and the largest difference), and each backend's
output where the call is padded at its end (a prefill's query rows to the window, masked as later
positions are; the drafter's key columns to a multiple of 64, seen by no query) against its own
unpadded output: a shape that repeats without changing a real row's value is what would let the
evaluation pay for a new shape once a bucket. Padding a whole forward pads its linear layers' rows too:
last, SmolLM2's linear layers at a prompt's rows against the same rows padded to the window, bitwise
(`gemms`). The JSON is written after every layout.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dflash_jobs.drafter.speculative import synchronize
from dflash_jobs.static_cache import aligned  # the static cache's window: a multiple of CACHE_ALIGN columns

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M's attention
BLOCK, NEW_TOKENS = 16, 48  # the evaluation's verify block and answer length
BACKENDS = ("default", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "FLASH_ATTENTION", "MATH")
LAYOUTS = ("prefill", "simulate")
FIRST_LENGTH = 48  # the shortest prompt the lengths start from


def prefill_call(length: int, padded: bool, *, device: torch.device, dtype: torch.dtype, seed: int) -> tuple[tuple, dict]:
    """SDPA's arguments for a prompt of `length` over its window; padded: the query rows to the window too."""
    window = aligned(length)
    rows = window if padded else length
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, window, HEAD_DIM, generator=generator)[:, :, :rows]
    k, v = (torch.randn(1, KV_HEADS, window, HEAD_DIM, generator=generator).repeat_interleave(HEADS // KV_HEADS, dim=1) for _ in "kv")
    mask = torch.arange(window)[None, :] <= torch.arange(rows)[:, None]  # causal by position: a row sees its own and earlier columns
    return tuple(t.to(device, dtype) for t in (q, k, v)), {"attn_mask": mask[None, None].to(device)}


def simulate_call(length: int, padded: bool, *, device: torch.device, dtype: torch.dtype, seed: int) -> tuple[tuple, dict]:
    """SDPA's arguments for the drafter's forward on a document of `length` prompt tokens and NEW_TOKENS
    answer tokens, a block at every answer position (keys: the context, then the blocks); padded: key
    columns after the blocks, seen by no query, to a multiple of 64."""
    context, queries = length + NEW_TOKENS, NEW_TOKENS * BLOCK
    keys = context + queries
    columns = aligned(keys) if padded else keys
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, queries, HEAD_DIM, generator=generator)
    k, v = (torch.randn(1, KV_HEADS, aligned(keys), HEAD_DIM, generator=generator)[:, :, :columns] for _ in "kv")
    anchor = length + torch.arange(NEW_TOKENS).repeat_interleave(BLOCK)  # each query's block's anchor position
    column = torch.arange(columns)[None, :]
    sees_context = column < anchor[:, None]
    sees_block = (column >= context) & (column < keys) & ((column - context) // BLOCK == torch.arange(queries)[:, None] // BLOCK)
    return tuple(t.to(device, dtype) for t in (q, k, v)), {"attn_mask": (sees_context | sees_block).to(device), "enable_gqa": True}


LAYOUT_CALLS = {"prefill": prefill_call, "simulate": simulate_call}


def attend(backend: str, args: tuple, kwargs: dict) -> torch.Tensor:
    if backend == "default":
        return F.scaled_dot_product_attention(*args, **kwargs)
    with sdpa_kernel(getattr(SDPBackend, backend)):
        return F.scaled_dot_product_attention(*args, **kwargs)


def timed(device: torch.device, call) -> tuple[float, torch.Tensor]:
    synchronize(device)
    started = time.perf_counter()
    out = call()
    synchronize(device)
    return time.perf_counter() - started, out


def default_choice(args: tuple, kwargs: dict) -> str:
    """The backend SDPA picks for these arguments by itself."""
    chosen = torch._fused_sdp_choice(*args, kwargs["attn_mask"], 0.0, False, enable_gqa=kwargs.get("enable_gqa", False))
    return SDPBackend(chosen).name


def new_shapes(layout: str, backends: list[str], count: int, *, device: torch.device, dtype: torch.dtype, next_length) -> dict:
    """Per backend, `count` lengths never seen before, each called twice: the seconds of a new shape and of a seen one."""
    make = LAYOUT_CALLS[layout]
    result = {}
    for backend in backends:
        first, again, refused = [], [], None
        for _ in range(count):
            args, kwargs = make(next_length(), False, device=device, dtype=dtype, seed=len(first))
            try:
                seconds, _ = timed(device, lambda: attend(backend, args, kwargs))
            except RuntimeError as error:  # a backend that cannot take this layout says why
                refused = str(error).splitlines()[0]
                break
            first.append(seconds)
            again.append(timed(device, lambda: attend(backend, args, kwargs))[0])
        if refused is not None:
            result[backend] = {"refused": refused}
            continue
        new_ms, seen_ms = 1e3 * statistics.median(first), 1e3 * statistics.median(again)
        result[backend] = {"lengths": count, "new_shape_ms": round(new_ms, 3), "seen_shape_ms": round(seen_ms, 3),
                           "new_over_seen_ms": round(new_ms - seen_ms, 3), "new_shape_ms_mean": round(1e3 * statistics.mean(first), 3)}
        print(json.dumps({"layout": layout, "backend": backend, **result[backend]}), flush=True)
    return result


def agreement(layout: str, backends: list[str], count: int, *, device: torch.device, dtype: torch.dtype, next_length) -> dict:
    """Per backend (each one that took the layout), over `count` lengths: its output against the default's,
    and its padded call's real rows against its unpadded output."""
    make = LAYOUT_CALLS[layout]
    found = {backend: {"equal_to_default": 0, "max_diff_to_default": 0.0, "padded_equal": 0, "padded_max_diff": 0.0, "lengths": 0, "refused": 0}
             for backend in backends}
    for index in range(count):
        length = next_length()
        args, kwargs = make(length, False, device=device, dtype=dtype, seed=1000 + index)
        padded_args, padded_kwargs = make(length, True, device=device, dtype=dtype, seed=1000 + index)
        reference = attend("default", args, kwargs)
        for backend in backends:
            tally = found[backend]
            try:
                out, padded = attend(backend, args, kwargs), attend(backend, padded_args, padded_kwargs)
            except RuntimeError:  # a backend may take some lengths of a layout and not others: counted, not fatal
                tally["refused"] += 1
                continue
            real_rows = padded[:, :, : out.shape[2]]  # a padded prefill's query rows past the prompt's are dropped
            tally["lengths"] += 1
            tally["equal_to_default"] += int(torch.equal(out, reference))
            tally["max_diff_to_default"] = max(tally["max_diff_to_default"], (out.float() - reference.float()).abs().max().item())
            tally["padded_equal"] += int(torch.equal(real_rows, out))
            tally["padded_max_diff"] = max(tally["padded_max_diff"], (real_rows.float() - out.float()).abs().max().item())
    return found


GEMMS = {"q_o": (576, 576), "k_v": (576, 192), "mlp_up": (576, 1536), "mlp_down": (1536, 576), "lm_head": (576, 49152)}
"""SmolLM2's linear layers (in, out features): a forward padded to the window runs every one at more rows."""


def padded_gemms(count: int, *, device: torch.device, dtype: torch.dtype, next_length) -> dict:
    """Per linear layer of GEMMS, over `count` lengths: its rows of a prompt's forward padded to the window
    (more rows in the same call) against the unpadded call's, bitwise: the other half of padding a
    whole forward (the attention's half is `agreement`)."""
    found = {}
    generator = torch.Generator().manual_seed(7)
    for name, (features, out_features) in GEMMS.items():
        weight = (torch.randn(out_features, features, generator=generator) * 0.02).to(device, dtype)
        tally = {"lengths": 0, "padded_equal": 0, "padded_max_diff": 0.0}
        for _ in range(count):
            length = next_length()
            rows = torch.randn(aligned(length), features, generator=generator).to(device, dtype)
            out, padded = F.linear(rows[:length], weight), F.linear(rows, weight)[:length]
            tally["lengths"] += 1
            tally["padded_equal"] += int(torch.equal(out, padded))
            tally["padded_max_diff"] = max(tally["padded_max_diff"], (out.float() - padded.float()).abs().max().item())
        found[name] = tally
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lengths", type=int, default=24, help="new lengths a backend is timed on (and compared on) per layout")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--out", type=Path, required=True)
    options = parser.parse_args()
    device = torch.device(options.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends, layouts = options.backends.split(","), options.layouts.split(",")
    for name in [*backends, *layouts]:
        if name not in (*BACKENDS, *LAYOUTS):
            parser.error(f"{name!r} is neither a backend ({', '.join(BACKENDS)}) nor a layout ({', '.join(LAYOUTS)})")
    lengths = iter(range(FIRST_LENGTH, 10**6))  # every call a length no earlier call of this process used
    result = {
        "command": " ".join(["bench/evaluation/sdpa_shapes.py", *sys.argv[1:]]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "dtype": str(dtype).removeprefix("torch."), "layouts": {},
    }
    warm_args, warm_kwargs = prefill_call(FIRST_LENGTH - 8, False, device=device, dtype=dtype, seed=0)  # a length the timings never use
    for backend in backends:  # each backend's first call (its library's loading) outside the timing
        try:
            attend(backend, warm_args, warm_kwargs)
        except RuntimeError:
            pass
    for layout in layouts:
        args, kwargs = LAYOUT_CALLS[layout](next(lengths), False, device=device, dtype=dtype, seed=0)
        timings = new_shapes(layout, backends, options.lengths, device=device, dtype=dtype, next_length=lambda: next(lengths))
        usable = [backend for backend in backends if "refused" not in timings[backend]]
        result["layouts"][layout] = {
            "default_backend": default_choice(args, kwargs), "timings": timings,
            "agreement": agreement(layout, usable, options.lengths, device=device, dtype=dtype, next_length=lambda: next(lengths)),
        }
        options.out.write_text(json.dumps(result, indent=2) + "\n")
    result["gemms"] = padded_gemms(options.lengths, device=device, dtype=dtype, next_length=lambda: next(lengths))
    options.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({key: result[key] for key in ("layouts", "gemms")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
