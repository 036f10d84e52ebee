"""Training metrics: one interface for every sink (`log(metrics, step)`, `close()`), a console
line for pod logs, a JSONL record in storage with a PNG plot beside it, and a no-op for tests."""

from __future__ import annotations

import io
import json
import logging
import math
from typing import Any, Protocol

from dflash_jobs.formats import TRAIN_METRICS_KEY, TRAIN_PLOT_KEY
from dflash_jobs.storage import Storage
from dflash_jobs.units import format_duration

log = logging.getLogger(__name__)



class MetricSink(Protocol):
    def log(self, metrics: dict[str, Any], step: int) -> None: ...
    def close(self) -> None: ...


def should_log(step: int, every: int) -> bool:
    return step == 1 or step % every == 0


class NullSink:
    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class ConsoleSink:
    """One line per interval: step, loss, the first draft's accuracy and the acceptance, a variant's own
    figures (`extra`), throughput (with the share of the interval the loop waited for its batches), ETA.
    `first_draft`: the slot of the first drafted token (1 when slot 0 is the anchor; 0 for a drafter
    whose anchor is a prediction slot, DSpark)."""

    def __init__(self, extra: tuple[str, ...] = (), *, first_draft: int = 1) -> None:
        self.extra, self.first_draft = extra, first_draft

    def log(self, metrics: dict[str, Any], step: int) -> None:
        own = "".join(f" {name} {metrics[name]:.4g}" for name in self.extra)
        rates = "" if metrics.get("mfu") is None else f", MFU {metrics['mfu']:.1%}"
        if metrics.get("data_wait") is not None:  # the loader starving the loop shows here, not as a slow GPU
            rates += f", waiting for data {metrics['data_wait']:.0%}"
        log.info(
            "step %d/%d epoch %d | loss %.4f acc@1 %.3f tau %.2f%s | lr %.2e | %.0f tok/s, %.1f TFLOP/s%s | eta %s",
            step, metrics["total_steps"], metrics["epoch"], metrics["loss"], metrics["accuracy"][self.first_draft],
            metrics["acceptance_length"], f" |{own}" if own else "", metrics["lr"], metrics["tokens_per_s"],
            metrics.get("tflop_per_s", 0.0), rates, format_duration(metrics.get("eta_s")),
        )

    def close(self) -> None:
        pass


class StorageSink:
    """train/metrics.jsonl (rewritten whole at each flush: object stores do not append) and
    train/metrics.png. A resumed run keeps the records up to its checkpoint."""

    def __init__(self, storage: Storage, *, resume_step: int = 0, flush_every: int = 10) -> None:
        self.storage = storage
        self.flush_every = flush_every
        self.records: list[dict[str, Any]] = []
        if resume_step and storage.exists(TRAIN_METRICS_KEY):
            lines = storage.get_bytes(TRAIN_METRICS_KEY).decode().splitlines()
            self.records = [r for r in map(json.loads, filter(None, lines)) if r["step"] <= resume_step]

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.records.append({"step": step, **metrics})
        if len(self.records) % self.flush_every == 0:
            self.flush()

    def flush(self) -> None:
        body = "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.records)
        self.storage.put_bytes(TRAIN_METRICS_KEY, body.encode())

    def close(self) -> None:
        self.flush()
        if self.records:
            self.storage.put_bytes(TRAIN_PLOT_KEY, plot_png(self.records))


class MultiSink:
    def __init__(self, *sinks: MetricSink) -> None:
        self.sinks = sinks

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def plot_png(records: list[dict[str, Any]]) -> bytes:
    """Loss, estimated acceptance length and the last per-slot accuracy, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(steps, [r["loss"] for r in records])
    axes[0].set(title="loss (weighted over the drafted slots)", xlabel="step")
    axes[1].plot(steps, [r["acceptance_length"] for r in records])
    axes[1].set(title="estimated acceptance length", xlabel="step")
    accuracy = records[-1]["accuracy"]
    drafted = [slot for slot, value in enumerate(accuracy) if not math.isnan(value)]  # DFlash's anchor slot is never trained
    axes[2].bar(drafted, [accuracy[slot] for slot in drafted])
    axes[2].set(title=f"accuracy per slot at step {steps[-1]}", xlabel="slot", ylim=(0, 1))
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()
