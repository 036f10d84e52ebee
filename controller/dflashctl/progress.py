"""How far extraction (and generation) is, from the storage markers: chunks done of total, tokens/s, ETA.

Storage is the source of truth (DESIGN section 6): a chunk is done when its marker exists, whatever
the Job says. Counting needs one list of extract/done/ and the token dataset index, never a chunk.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from dflash_jobs.formats import DATASET_KEY, DONE_MARKERS, DatasetIndex, chunk_of_key
from dflash_jobs.generate.layout import ChunkMarker, GenerationProgress
from dflash_jobs.generate.layout import read_progress as read_generation_progress
from dflash_jobs.spec import RunSpec
from dflash_jobs.storage import Storage


@dataclass(frozen=True, slots=True)
class Progress:
    """Extraction progress at one moment. Totals are None until prepare has written tokens/dataset.json."""

    chunks_done: int
    chunks_total: int | None
    tokens_done: int
    tokens_total: int | None

    @property
    def label(self) -> str:
        """"12/40": the value of the dflash.dev/progress annotation."""
        return f"{self.chunks_done}/{'?' if self.chunks_total is None else self.chunks_total}"

    @property
    def fraction(self) -> float | None:
        if not self.tokens_total:
            return None
        return self.tokens_done / self.tokens_total

    @property
    def landed(self) -> bool:
        """Every chunk has its done marker (verify still has to check them against their objects)."""
        return self.chunks_total is not None and self.chunks_done == self.chunks_total


def read_progress(storage: Storage) -> Progress:
    """Chunks and tokens done, from the done markers and the dataset index."""
    done_ids = {chunk_of_key(key) for key in storage.list(DONE_MARKERS) if key.endswith(".json")}
    if not storage.exists(DATASET_KEY):
        return Progress(chunks_done=len(done_ids), chunks_total=None, tokens_done=0, tokens_total=None)
    dataset = DatasetIndex.from_json(storage.get_bytes(DATASET_KEY), DATASET_KEY)
    done = [chunk for chunk in dataset.chunks if chunk.id in done_ids]
    return Progress(
        chunks_done=len(done),
        chunks_total=len(dataset.chunks),
        tokens_done=sum(chunk.tokens for chunk in done),
        tokens_total=dataset.tokens,
    )


class RateMeter:
    """Tokens per second over a sliding window of observations, and the ETA it implies.

    Chunks land in steps of ~64K tokens, so the rate is measured over minutes, not between two
    refreshes. `seed` starts the window with a known earlier point (e.g. the Job's start time).
    """

    def __init__(self, window_s: float = 600.0, clock: Callable[[], float] = time.time) -> None:
        self.window_s = window_s
        self.clock = clock
        self._points: deque[tuple[float, int]] = deque()

    def seed(self, at: float, tokens: int) -> None:
        self._points.appendleft((at, tokens))

    def observe(self, progress: Progress) -> None:
        self.observe_count(progress.tokens_done)

    def observe_count(self, done: int) -> None:
        """One reading of a growing count (tokens, prompts)."""
        now = self.clock()
        self._points.append((now, done))
        # Keep one point older than the window, so the rate always spans the whole window.
        while len(self._points) > 2 and self._points[1][0] < now - self.window_s:
            self._points.popleft()

    @property
    def tokens_per_s(self) -> float | None:
        """The count's growth per second over the window (tokens for extraction)."""
        if len(self._points) < 2:
            return None
        (t0, n0), (t1, n1) = self._points[0], self._points[-1]
        if t1 <= t0 or n1 < n0:
            return None
        return (n1 - n0) / (t1 - t0)

    def eta_s(self, progress: Progress) -> float | None:
        return self.eta_for(progress.tokens_total, progress.tokens_done)

    def eta_for(self, total: int | None, done: int) -> float | None:
        rate = self.tokens_per_s
        if total is None or not rate:
            return None
        return max(0, total - done) / rate


class GenerationMeter:
    """Generation as `status` and `run` show it: generated tokens per second, and the ETA from the
    prompts answered per second. Keeps each done marker it read (they never change)."""

    def __init__(self, window_s: float = 600.0, clock: Callable[[], float] = time.time) -> None:
        self.prompts = RateMeter(window_s, clock)
        self.tokens = RateMeter(window_s, clock)
        self.markers: dict[str, ChunkMarker] = {}

    def read(self, storage: Storage, spec: RunSpec) -> GenerationProgress:
        progress = read_generation_progress(storage, spec, self.markers)
        self.prompts.observe_count(progress.prompts_done)
        self.tokens.observe_count(progress.completion_tokens)
        return progress

    def seed(self, at: float) -> None:
        """Starts both windows at an earlier point with nothing done (the Job's start)."""
        self.prompts.seed(at, 0)
        self.tokens.seed(at, 0)

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens.tokens_per_s

    def eta_s(self, progress: GenerationProgress) -> float | None:
        return self.prompts.eta_for(progress.prompts_total, progress.prompts_done)


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def format_rate(tokens_per_s: float | None) -> str:
    if tokens_per_s is None:
        return "-"
    if tokens_per_s >= 1000:
        return f"{tokens_per_s / 1000:.1f}K tok/s"
    return f"{tokens_per_s:.0f} tok/s"
