"""How far extraction (and generation) is, from the storage markers: chunks done of total, tokens/s, ETA.

Storage is the source of truth (DESIGN section 6): a chunk is done when its marker exists, whatever
the Job says. Counting needs one list of extract/done/ and the token dataset index, never a chunk.

The rate comes from when the markers landed (the listing's modification times), counting only the
chunks that landed since the extraction Job started: a Job resumed over chunks an earlier one left
gets no credit for them, so its rate and ETA are honest from the first look.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from dflash_jobs.formats import DATASET_KEY, DONE_MARKERS, DatasetIndex, chunk_of_key
from dflash_jobs.generation import GenerationProgress
from dflash_jobs.storage import Storage

RATE_WINDOW_S = 600.0
"""The rate is over this much of the recent past (or since the Job started, if that is less)."""


@dataclass(frozen=True, slots=True)
class Progress:
    """Extraction progress at one moment. Totals are None until prepare has written tokens/dataset.json."""

    chunks_done: int
    chunks_total: int | None
    tokens_done: int
    tokens_total: int | None
    landings: tuple[tuple[float, int], ...] = ()
    """(when its marker landed, Unix time; its tokens) of every done chunk, oldest first."""

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
    """Chunks and tokens done, and when each landed, from the done markers and the dataset index."""
    landed = {chunk_of_key(key): at for key, at in storage.list_modified(DONE_MARKERS).items() if key.endswith(".json")}
    if not storage.exists(DATASET_KEY):
        return Progress(chunks_done=len(landed), chunks_total=None, tokens_done=0, tokens_total=None)
    dataset = DatasetIndex.from_json(storage.get_bytes(DATASET_KEY), DATASET_KEY)
    done = [chunk for chunk in dataset.chunks if chunk.id in landed]
    return Progress(
        chunks_done=len(done),
        chunks_total=len(dataset.chunks),
        tokens_done=sum(chunk.tokens for chunk in done),
        tokens_total=dataset.tokens,
        landings=tuple(sorted((landed[chunk.id], chunk.tokens) for chunk in done)),
    )


def landing_rate(progress: Progress, *, since: float | None, now: float | None = None, window_s: float = RATE_WINDOW_S) -> float | None:
    """Tokens per second landed over the last `window_s`, counting only chunks whose markers landed
    at or after `since` (the extraction Job's start, so chunks it found done add nothing).

    Chunks land in steps of ~64K tokens, so the window spans minutes. None without a start, or
    before this Job's first chunk has landed: there is no rate to tell yet (0 means it stalled)."""
    return window_rate(progress.landings, since=since, now=now, window_s=window_s)


def window_rate(landings: Iterable[tuple[float, float]], *, since: float | None, now: float | None = None,
                window_s: float = RATE_WINDOW_S) -> float | None:
    """Per second, the amounts of the (landed at, amount) pairs of the last `window_s` (from
    `since` on); None without a start or before anything landed since it."""
    if since is None:
        return None
    landings = list(landings)
    now = time.time() if now is None else now
    start = max(since, now - window_s)
    if now <= start or not any(at >= since for at, _ in landings):
        return None
    return sum(amount for at, amount in landings if at >= start) / (now - start)


def generation_rates(progress: GenerationProgress, *, since: float | None, now: float | None = None) -> tuple[float | None, float | None]:
    """(prompts, generated tokens) per second from the generation chunks that landed since the
    generate Job started (`since`), over the rate window."""
    prompts = window_rate(((at, lines) for at, lines, _ in progress.landings), since=since, now=now)
    tokens = window_rate(((at, tokens) for at, _, tokens in progress.landings), since=since, now=now)
    return prompts, tokens


def generation_time_left(progress: GenerationProgress, prompts_per_s: float | None) -> float | None:
    """Seconds until every prompt is answered at this rate; None without a rate or a plan."""
    if progress.prompts_total is None or not prompts_per_s:
        return None
    return max(0, progress.prompts_total - progress.prompts_done) / prompts_per_s


def time_left(progress: Progress, tokens_per_s: float | None) -> float | None:
    """Seconds until every token has landed at this rate; None without a rate or a total."""
    if progress.tokens_total is None or not tokens_per_s:
        return None
    return max(0, progress.tokens_total - progress.tokens_done) / tokens_per_s


def format_rate(tokens_per_s: float | None) -> str:
    if tokens_per_s is None:
        return "-"
    if tokens_per_s >= 1000:
        return f"{tokens_per_s / 1000:.1f}K tok/s"
    return f"{tokens_per_s:.0f} tok/s"
