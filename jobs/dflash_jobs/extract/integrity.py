"""Integrity of a hidden-state chunk before it is stored.

A chunk must hold finite states, no sample whose states are all zero (a capture that never ran),
the final hidden state included when the run stores it,
the very token ids of its token chunk at every position (so a hidden row can only sit at the
position of the token that produced it), and every sample written exactly once (boundaries kept).
A failure raises IntegrityError naming the chunk and sample: the worker stops with EXIT_BAD_INPUT.
"""

from __future__ import annotations

import numpy as np
import torch

from dflash_jobs.errors import IntegrityError
from dflash_jobs.formats import TokenChunk, check_hidden_header, read_header

FIX = "Inspect the sample (a broken target checkpoint or a numerical overflow), fix it, then `dflashctl retry` (the index is not retried by itself)"


def check_assembled(
    chunk: int, tokens: TokenChunk, ids: torch.Tensor, absmax: torch.Tensor, written: np.ndarray, final_absmax: torch.Tensor | None = None,
) -> dict[str, float]:
    """Checks a chunk assembled in host memory; returns the stats its done marker records.

    `ids` [T] are the token ids the forward saw, `absmax` [T, L] the max |h| per token and layer,
    `final_absmax` [T] that of the final hidden state (when the run stores it)."""
    name = f"chunk {chunk:06d}"
    missing = np.flatnonzero(~written)
    if missing.size:
        raise IntegrityError(f"{name}: {missing.size} samples were never captured (first: sample {tokens.sample_ids[missing[0]]})", FIX)
    mismatch = np.flatnonzero(ids.numpy() != tokens.input_ids)
    if mismatch.size:
        raise IntegrityError(f"{name}: token ids differ from the input at {mismatch.size} positions (first: {mismatch[0]})", FIX)
    stats = _check_states(name, tokens, absmax, "hidden states")
    if final_absmax is not None:
        final = _check_states(name, tokens, final_absmax[:, None], "final hidden states")
        stats.update({f"final_{key}": value for key, value in final.items()})
    return stats


def _check_states(name: str, tokens: TokenChunk, absmax: torch.Tensor, what: str) -> dict[str, float]:
    """Finite and, per sample, not all zero: `absmax` [T, L] of the states called `what`; their stats."""
    finite = torch.isfinite(absmax).all(dim=1).numpy()
    if not finite.all():
        position = int(np.flatnonzero(~finite)[0])
        raise IntegrityError(f"{name}: non-finite {what} in sample {_sample_at(tokens, position)} (token {position})", FIX)
    per_sample = np.maximum.reduceat(absmax.amax(dim=1).numpy(), tokens.cu_seqlens[:-1])
    zero = np.flatnonzero(per_sample == 0)
    if zero.size:
        raise IntegrityError(f"{name}: all-zero {what} for sample {tokens.sample_ids[zero[0]]}", FIX)
    return {"absmax_max": float(absmax.max()), "absmax_mean": float(absmax.mean())}


def check_encoded(chunk: int, prefix: bytes, size: int, tokens: TokenChunk, layers: list[int], final_hidden: str | None = None) -> None:
    """The serialized file's header agrees with its size, its tokens, its layers and its final hidden state."""
    name = f"chunk {chunk:06d}"
    header, total = read_header(prefix, name)
    meta = check_hidden_header(header, name)
    if total != size:
        raise IntegrityError(f"{name}: file holds {size} bytes, its header describes {total}", FIX)
    if header["input_ids"]["shape"] != [tokens.num_tokens] or header["cu_seqlens"]["shape"] != [tokens.num_samples + 1]:
        raise IntegrityError(f"{name}: tokens or boundaries differ from the token chunk", FIX)
    if meta["layers"] != list(layers):
        raise IntegrityError(f"{name}: layers {meta['layers']} instead of {list(layers)}", FIX)
    if meta["final_hidden"] != final_hidden:
        raise IntegrityError(f"{name}: final hidden state {meta['final_hidden']} instead of {final_hidden}", FIX)


def _sample_at(tokens: TokenChunk, position: int) -> int:
    return int(tokens.sample_ids[np.searchsorted(tokens.cu_seqlens, position, side="right") - 1])
