"""What a shard reports: a log line every few seconds for `kubectl logs`, and a one-line JSON
summary in the container's termination message (`kubectl describe pod`, `dflashctl status`)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from dflash_jobs.pacing import Every
from dflash_jobs.shard import ShardSummary
from dflash_jobs.units import format_duration

log = logging.getLogger("dflash.extract")


@dataclass(slots=True)
class Summary(ShardSummary):
    """tokens_per_s: tokens forwarded per second of wall time."""

    samples: int = 0
    tokens: int = 0
    bytes: int = 0
    padded_tokens: int = 0
    warmup_s: float = 0.0
    ready_s: float = 0.0  # from the pod's start to its first forward of real data
    first_chunk_s: float = 0.0  # from the pod's start to its first stored chunk
    host_wait_s: float = 0.0  # the GPU thread waited this long for a free chunk buffer (storage behind)
    drain_s: float = 0.0  # from the GPU's last batch to the last chunk stored (part of elapsed_s)
    drain_bytes: int = 0  # what the stores still had to write at the GPU's last batch (ExtractWorker.drain_stores: by store)
    padding_waste: float = 0.0
    oom_splits: int = 0
    fast_paths: dict[str, bool] = field(default_factory=dict)


class Progress:
    """Counts forwarded and committed work; logs at most every `interval` seconds (no GPU sync)."""

    def __init__(self, summary: Summary, *, total_tokens: int, interval: float = 10.0) -> None:
        self.summary = summary
        self.total_tokens = total_tokens
        self.lock = threading.Lock()
        self.forwarded_tokens = 0
        self.started = time.monotonic()
        self.every = Every(interval)

    def start(self) -> None:
        self.started = time.monotonic()
        self.every.restart()

    def batch(self, real_tokens: int, padded_tokens: int) -> None:
        with self.lock:
            self.forwarded_tokens += real_tokens
            self.summary.padded_tokens += padded_tokens
        if self.every.due():
            self.log()

    def committed(self, samples: int, tokens: int, size: int) -> None:
        with self.lock:
            self.summary.chunks_done += 1
            self.summary.samples += samples
            self.summary.tokens += tokens
            self.summary.bytes += size

    def _update(self) -> None:
        s = self.summary
        s.elapsed_s = round(time.monotonic() - self.started, 1)
        s.tokens_per_s = round(self.forwarded_tokens / max(s.elapsed_s, 1e-9), 1)
        s.padding_waste = round(1 - self.forwarded_tokens / s.padded_tokens, 4) if s.padded_tokens else 0.0

    def log(self) -> None:
        with self.lock:
            self._update()
            s = self.summary
            left = self.total_tokens - self.forwarded_tokens
            eta = format_duration(left / s.tokens_per_s) if s.tokens_per_s else "?"
            pending = s.chunks_total - s.chunks_skipped
            log.info(
                "shard %d/%d: chunks %d/%d (%d skipped), samples %d, %s tokens/s, padding %.1f%%, %.2f GB stored, ETA %s",
                s.shard, s.shards, s.chunks_done, pending, s.chunks_skipped, s.samples, f"{s.tokens_per_s:,.0f}",
                100 * s.padding_waste, s.bytes / 1e9, eta,
            )

