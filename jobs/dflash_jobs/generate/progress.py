"""What a generation shard reports: a log line every few seconds, and a one-line JSON summary in the
container's termination message (`kubectl describe pod`, `dflashctl status`).

While an engine works on a chunk, its output file grows one answer per line (vLLM writes them in
order, flushed every 100; the transformers engine after each batch): a watcher thread reads the new
lines and counts answers and generated tokens, so the log moves within a chunk, not only between.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dflash_jobs.generate.batch import Answer, EngineError, parse_output
from dflash_jobs.generation import ChunkMarker
from dflash_jobs.shard import ShardSummary
from dflash_jobs.units import format_duration

log = logging.getLogger("dflash.generate")


@dataclass(slots=True)
class Summary(ShardSummary):
    """tokens_per_s: tokens generated per second of wall time, model loads included."""

    engine: str = ""
    prompts: int = 0
    """Lines of data.source answered (or dropped) in the chunks this pod finished."""
    rows: int = 0
    dropped: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    engine_s: float = 0.0
    manifest: bool = False
    """This pod found every chunk done and wrote generate/manifest.json."""


class Progress:
    """Counts committed chunks and the answers of the chunk in flight; logs at most every `interval` s."""

    def __init__(self, summary: Summary, *, pending_prompts: int, pending_chunks: int, interval: float = 10.0) -> None:
        self.summary = summary
        self.pending_prompts = pending_prompts
        self.pending_chunks = pending_chunks
        self.interval = interval
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.live_answers = 0
        self.live_tokens = 0
        self.live_chunk: tuple[int, int] | None = None  # (chunk id, requests)

    def committed(self, marker: ChunkMarker) -> None:
        with self.lock:
            s = self.summary
            s.chunks_done += 1
            s.prompts += marker.lines
            s.rows += marker.rows
            s.dropped += sum(marker.dropped.values())
            s.prompt_tokens += marker.prompt_tokens
            s.completion_tokens += marker.completion_tokens
            s.engine_s = round(s.engine_s + marker.seconds, 1)
            self.live_answers = self.live_tokens = 0
            self.live_chunk = None

    @contextmanager
    def watching(self, chunk: int, requests: int, outputs: Path) -> Iterator[None]:
        """Reads the engine's output file while the engine runs, logging every `interval` seconds."""
        stop = threading.Event()
        with self.lock:
            self.live_chunk, self.live_answers, self.live_tokens = (chunk, requests), 0, 0

        def watch() -> None:
            offset, rest = 0, b""
            while not stop.wait(self.interval):
                if outputs.exists():
                    with open(outputs, "rb") as f:
                        f.seek(offset)
                        data = f.read()
                    offset += len(data)
                    *lines, rest = (rest + data).split(b"\n")
                    with self.lock:
                        self.live_answers += len(lines)
                        self.live_tokens += sum(_completion_tokens(line) for line in lines)
                self.log()

        thread = threading.Thread(target=watch, name="generate-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def log(self) -> None:
        with self.lock:
            s = self.summary
            s.elapsed_s = round(time.monotonic() - self.started, 1)
            generated = s.completion_tokens + self.live_tokens
            s.tokens_per_s = round(generated / max(s.elapsed_s, 1e-9), 1)
            answered = s.prompts + self.live_answers
            rate = answered / max(s.elapsed_s, 1e-9)
            eta = format_duration((self.pending_prompts - answered) / rate) if answered else "?"
            live = ""
            if self.live_chunk is not None:
                live = f" (chunk {self.live_chunk[0]:06d}: {self.live_answers:,}/{self.live_chunk[1]:,} answered)"
            log.info(
                "shard %d/%d: chunks %d/%d (%d skipped), prompts %s/%s%s, %s tokens/s, ETA %s",
                s.shard, s.shards, s.chunks_done, self.pending_chunks, s.chunks_skipped, f"{answered:,}",
                f"{self.pending_prompts:,}", live, f"{s.tokens_per_s:,.0f}", eta,
            )


def _completion_tokens(line: bytes) -> int:
    try:
        answer = parse_output(line)
    except EngineError:
        return 0
    return answer.completion_tokens if isinstance(answer, Answer) else 0
