"""Online states (train.states: online): the target runs inside the training step, on the
micro-batch's own documents, and its captured layers go straight to the drafter. Nothing is stored.

The capture is extraction's (capture/runner.py: the same loading, FP8 compute, packing and hooks),
so for the same rows the states are the very bits extraction would have stored; with extract.dtype
float8_e4m3fn they take the same quantization round trip the stored path gives them (quantized at
extraction, dequantized on the device by the trainer). The target's forward runs on the training
stream before the drafter's: the capture buffer is read by this step's forward and backward, which
the stream orders before the next step's target overwrites it.

The checks `dflashctl verify` applies to stored chunks (extract/integrity.py: finite, no sample all
zero, the token ids the forward saw equal the input) run on the states in flight, on the device:
one small tensor of flags a step, read with the metric line's sync and before every checkpoint
(`check`), so a broken target fails the Job with the same IntegrityError (exit 42) within a log
interval instead of training on zeros, and no checkpoint holds a step trained on bad states.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dflash_jobs.capture.runner import TargetCapture
from dflash_jobs.errors import IntegrityError
from dflash_jobs.formats import dequantize_fp8, quantize_fp8
from dflash_jobs.train.data import Batch, TargetInput

FIX = "Check target.model (a broken checkpoint gives zeros or NaN), fix it, then start the training Job again (it resumes from its last checkpoint)"
FLAGS = ("non-finite hidden states", "all-zero hidden states", "token ids differ from the input",
         "non-finite final hidden states", "all-zero final hidden states")


@dataclass(slots=True)
class _Flagged:
    step: int
    sample_ids: list[int]
    flags: torch.Tensor  # bool [documents, len(FLAGS)], on the device


class InFlightChecks:
    """The integrity of each step's states, flagged on the device and read in one sync by `check`."""

    def __init__(self) -> None:
        self.pending: list[_Flagged] = []

    def add(self, step: int, inputs: TargetInput, seen_ids: torch.Tensor, hidden: torch.Tensor, final: torch.Tensor | None) -> None:
        """`hidden` [C, L, d] and `final` [C, d] the step's states, `seen_ids` [C] the ids the target read."""
        C, docs = inputs.ids.numel(), len(inputs.sample_ids)
        document = torch.repeat_interleave(torch.arange(docs, device=hidden.device), inputs.lengths, output_size=C)

        def per_document(values: torch.Tensor, reduce: str) -> torch.Tensor:
            return torch.zeros(docs, dtype=values.dtype, device=values.device).scatter_reduce(0, document, values, reduce)

        def state_flags(states: torch.Tensor) -> list[torch.Tensor]:
            absmax = states.abs().flatten(1).amax(dim=1).float()  # NaN propagates
            return [per_document((~torch.isfinite(absmax)).float(), "amax") > 0, per_document(absmax.nan_to_num(1.0), "amax") == 0]

        flags = state_flags(hidden) + [per_document((seen_ids != inputs.ids).float(), "amax") > 0]
        if final is not None:
            flags += state_flags(final)
        self.pending.append(_Flagged(step, inputs.sample_ids, torch.stack(flags, dim=1)))

    def check(self) -> None:
        """Raises IntegrityError naming the first bad step, sample and check; a host sync."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        bad = torch.cat([entry.flags.any(dim=1) for entry in pending]).cpu()
        if not bad.any():
            return
        first = int(bad.nonzero()[0])
        for entry in pending:
            if first < len(entry.sample_ids):
                flags = entry.flags[first].cpu().tolist()
                what = ", ".join(name for name, flagged in zip(FLAGS, flags) if flagged)
                raise IntegrityError(f"online states of step {entry.step}: {what} for sample {entry.sample_ids[first]} "
                                     "(the target's capture in the training Job)", FIX)
            first -= len(entry.sample_ids)


class OnlineStates:
    """Fills a micro-batch's context (and final hidden state) by running the target on it."""

    def __init__(self, capture: TargetCapture, *, dtype: str = "bfloat16") -> None:
        self.capture = capture
        self.fp8 = dtype == "float8_e4m3fn"
        self.checks = InFlightChecks()

    def fill(self, batch: Batch, step: int) -> Batch:
        """`batch` on the device, its context states made by the target."""
        inputs = batch.target_input
        hooks = self.capture.hooks
        C = batch.tokens
        seen = torch.empty(C, dtype=torch.int64, device=hooks.device)
        with torch.no_grad():
            for rows_batch, rows in inputs.rows:
                self.capture.forward(rows_batch, rows)
                seen[rows] = rows_batch.input_ids.reshape(-1).index_select(0, rows_batch.real_index)
            hidden = hooks.buffer[:C]
            final = None if hooks.final is None else hooks.final[:C]
            self.checks.add(step, inputs, seen, hidden, final)
            if self.fp8:
                hidden = dequantize_fp8(*quantize_fp8(hidden))
                final = None if final is None else dequantize_fp8(*quantize_fp8(final))
        return dataclasses.replace(batch, context_hidden=hidden.reshape(C, -1), final_hidden=final, target_input=None)

    def check(self) -> None:
        self.checks.check()
