"""Every hidden-state chunk against its done marker; then extract/manifest.json (DESIGN sections 3, 6).

"All shards landed" is decided here, from storage, never from the Job's Complete. For each chunk
of tokens/dataset.json:

- its done marker exists, parses, names the chunk, and agrees with the dataset index (samples, tokens);
- its object exists with the marker's size, and the marker's etag when both are known;
- the object's safetensors header (read with a ranged get, no torch) is a consistent hidden-state
  header that agrees with the marker (tokens, samples, layers, dtype, hidden size, final hidden
  state) and with the spec (extract.dtype, target.layers, and the target's final hidden state when
  the spec stores it: extract.final_hidden, or a drafter that reads it), and its data ends exactly
  where the object ends;
- its sha256 equals the marker's, recomputed when the storage gives no etag (a local directory) or
  with `deep`.

All chunks must come from one target (model name and config hash in the headers). The manifest is
written only when every chunk passes; otherwise a stale one is removed, so training cannot start
on data that no longer checks out. It records the final hidden state when every chunk holds it.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dflash_jobs.errors import FormatError, InputError
from dflash_jobs.formats import (
    DATASET_KEY,
    DONE_MARKERS,
    MANIFEST_KEY,
    ChunkInfo,
    DatasetIndex,
    DoneMarker,
    Manifest,
    check_hidden_header,
    chunk_of_key,
    done_key,
    fetch_header_bytes,
    hidden_chunk_key,
    object_range,
    read_header,
)
from dflash_jobs.spec import RunSpec
from dflash_jobs.storage import HASH_BLOCK, ObjectNotFound, Storage

from dflashctl.errors import RunFailed

WORKERS = 16
"""Chunks checked at once: the checks wait on storage round trips, not on the CPU."""
LISTED_PROBLEMS = 20
"""Problems spelled out in the error; the rest are counted."""


@dataclass(frozen=True, slots=True)
class Expected:
    """What the spec says every chunk must hold."""

    dtype: str
    layers: list[int] | None
    """None: the default layers, resolved from the checkpoint by the extract pods; chunks must agree."""
    final_hidden: bool = False
    """Every chunk must hold the target's final hidden state (in `dtype`); chunks may hold it regardless."""

    @classmethod
    def of(cls, spec: RunSpec) -> Expected:
        return cls(dtype=spec.extract.dtype, layers=spec.target.layers, final_hidden=spec.stores_final_hidden)


@dataclass(frozen=True, slots=True)
class ChunkCheck:
    """The outcome for one chunk: its marker and header identity, or what is wrong."""

    chunk: int
    marker: DoneMarker | None = None
    model: str | None = None
    config_hash: str | None = None
    problem: str | None = None
    has_marker: bool = True
    """False when the chunk was never marked done (extraction has not finished it)."""


class VerificationFailed(RunFailed):
    """Some chunks do not check out; `bad_markers` are the markers that lie about their chunk."""

    def __init__(self, what: str, fix: str, *, bad_markers: list[str]) -> None:
        super().__init__(what, fix)
        self.bad_markers = bad_markers


def check_chunk(storage: Storage, info: ChunkInfo, expected: Expected, *, deep: bool) -> ChunkCheck:
    """One chunk against its marker, the dataset index and the spec."""
    try:
        raw = storage.get_bytes(done_key(info.id))
    except ObjectNotFound:
        return ChunkCheck(info.id, problem="not extracted yet (no done marker)", has_marker=False)
    try:
        marker = DoneMarker.from_json(raw, done_key(info.id))
        return _check_against_marker(storage, info, marker, expected, deep=deep)
    except FormatError as error:
        return ChunkCheck(info.id, problem=error.what)


def _check_against_marker(storage: Storage, info: ChunkInfo, marker: DoneMarker, expected: Expected, *, deep: bool) -> ChunkCheck:
    key = hidden_chunk_key(info.id)

    def bad(problem: str) -> ChunkCheck:
        return ChunkCheck(info.id, marker=marker, problem=problem)

    if marker.chunk != info.id:
        return bad(f"its marker describes chunk {marker.chunk}")
    if (marker.samples, marker.tokens) != (info.samples, info.tokens):
        return bad(
            f"its marker says {marker.samples} samples / {marker.tokens} tokens, tokens/dataset.json "
            f"{info.samples} / {info.tokens} (prepared again after extraction?)"
        )
    stat = storage.stat(key)
    if stat is None:
        return bad(f"marked done but {key} does not exist")
    if stat.size != marker.bytes:
        return bad(f"{key} has {stat.size} bytes, its marker says {marker.bytes} (truncated or replaced)")
    if stat.etag and marker.etag and stat.etag != marker.etag:
        return bad(f"{key} has etag {stat.etag}, its marker says {marker.etag} (replaced after it was marked)")

    header, end = read_header(fetch_header_bytes(object_range(storage, key)), key)
    if end != stat.size:
        return bad(f"{key}: its header describes {end} bytes, the object has {stat.size}")
    meta = check_hidden_header(header, key)
    hidden_shape = header["hidden_states"]["shape"]
    found = {
        "tokens": header["input_ids"]["shape"][0],
        "samples": header["sample_ids"]["shape"][0],
        "layers": meta["layers"],
        "dtype": meta["dtype"],
        "hidden_size": hidden_shape[2],
        "final_hidden": meta["final_hidden"],
    }
    for name, value in found.items():
        if value != getattr(marker, name):
            return bad(f"{key} holds {name} {value}, its marker says {getattr(marker, name)}")
    if meta["dtype"] != expected.dtype:
        return bad(f"{key} is {meta['dtype']}, the spec asks for extract.dtype {expected.dtype}")
    if expected.layers is not None and meta["layers"] != expected.layers:
        return bad(f"{key} holds layers {meta['layers']}, the spec asks for target.layers {expected.layers}")
    if expected.final_hidden and meta["final_hidden"] is None:
        return bad(f"{key} holds no final hidden state of the target, the spec stores it (extract.final_hidden, or a drafter that reads it)")
    if meta["final_hidden"] not in (None, expected.dtype):
        return bad(f"{key} holds its final hidden state in {meta['final_hidden']}, the spec asks for extract.dtype {expected.dtype}")

    if deep or not stat.etag:
        digest = _sha256(storage, key)
        if digest != marker.sha256:
            return bad(f"{key} has sha256 {digest[:12]}…, its marker says {marker.sha256[:12]}… (corrupt or replaced)")
    return ChunkCheck(info.id, marker=marker, model=meta.get("model"), config_hash=meta.get("config_hash"))


def _sha256(storage: Storage, key: str) -> str:
    digest = hashlib.sha256()
    with storage.open_read(key) as stream:
        while block := stream.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _one_target(checks: list[ChunkCheck]) -> list[ChunkCheck]:
    """Chunks whose identity (target, layers, dtype, width) differs from most: their states do not mix."""
    identity = {c.chunk: (c.model, c.config_hash, tuple(c.marker.layers), c.marker.dtype, c.marker.hidden_size) for c in checks}
    common, _ = Counter(identity.values()).most_common(1)[0]
    return [
        ChunkCheck(
            c.chunk, marker=c.marker,
            problem=(
                f"extracted from another target or setup (model {c.model}, config {c.config_hash}, layers {c.marker.layers}, "
                f"{c.marker.dtype}, width {c.marker.hidden_size}; most chunks: model {common[0]}, config {common[1]}, "
                f"layers {list(common[2])}, {common[3]}, width {common[4]})"
            ),
        )
        for c in checks
        if identity[c.chunk] != common
    ]


def check_all(
    storage: Storage,
    expected: Expected,
    *,
    deep: bool = False,
    workers: int = WORKERS,
    on_checked: Callable[[int, int], None] | None = None,
) -> tuple[list[ChunkCheck], list[ChunkCheck], int]:
    """Every chunk of the dataset, checked concurrently: (passed, problems, chunks in the dataset).

    `on_checked(done, total)` is called after each chunk, from this thread."""
    try:
        dataset = DatasetIndex.from_json(storage.get_bytes(DATASET_KEY), DATASET_KEY)
    except ObjectNotFound:  # a step asked for before the one it needs: bad usage (2), as `submit train` before verify
        raise InputError(
            f"{storage.url}/{DATASET_KEY} does not exist: nothing was prepared",
            "Run `dflashctl prepare` (or `dflashctl run`, which prepares first)",
        ) from None
    if not dataset.chunks:
        raise RunFailed(f"{storage.url}/{DATASET_KEY} lists no chunks", "Check data.source and run `dflashctl prepare` again")
    checks: list[ChunkCheck] = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for check in pool.map(lambda info: check_chunk(storage, info, expected, deep=deep), dataset.chunks):
            checks.append(check)
            if on_checked is not None:
                on_checked(len(checks), len(dataset.chunks))

    known = {info.id for info in dataset.chunks}
    stray = [
        ChunkCheck(chunk_of_key(key), problem="has a done marker but tokens/dataset.json has no such chunk (prepared again after extraction?)")
        for key in storage.list(DONE_MARKERS)
        if key.endswith(".json") and chunk_of_key(key) not in known
    ]
    passed = [c for c in checks if c.problem is None]
    problems = [c for c in checks if c.problem is not None] + stray
    if passed:
        odd = _one_target(passed)
        passed = [c for c in passed if c.chunk not in {o.chunk for o in odd}]
        problems += odd
    return passed, sorted(problems, key=lambda c: c.chunk), len(dataset.chunks)


def build_manifest(passed: list[ChunkCheck]) -> Manifest:
    """The manifest of chunks that all passed (and so share one target, layers, dtype and width),
    with the final hidden state's dtype when every one of them holds it."""
    markers = sorted((c.marker for c in passed), key=lambda m: m.chunk)
    final_hidden = {m.final_hidden for m in markers}
    return Manifest(
        model=passed[0].model or "",
        layers=list(markers[0].layers),
        dtype=markers[0].dtype,
        hidden_size=markers[0].hidden_size,
        samples=sum(m.samples for m in markers),
        tokens=sum(m.tokens for m in markers),
        bytes=sum(m.bytes for m in markers),
        chunks=markers,
        final_hidden=final_hidden.pop() if len(final_hidden) == 1 else None,
    )


def verify_run(
    storage: Storage,
    expected: Expected,
    *,
    deep: bool = False,
    delete_bad: bool = False,
    workers: int = WORKERS,
    on_checked: Callable[[int, int], None] | None = None,
) -> Manifest:
    """Checks every chunk and writes extract/manifest.json, or raises VerificationFailed.

    On failure a stale manifest is removed, and with `delete_bad` the markers that lie about their
    chunk, so that the next extraction (`dflashctl run`) redoes exactly those chunks."""
    passed, problems, total = check_all(storage, expected, deep=deep, workers=workers, on_checked=on_checked)
    if problems:
        storage.delete(MANIFEST_KEY)
        bad_markers = [done_key(c.chunk) for c in problems if c.has_marker]
        if delete_bad:
            for key in bad_markers:
                storage.delete(key)
        raise _failure(problems, total, bad_markers, deleted=delete_bad)
    manifest = build_manifest(passed)
    storage.put_bytes(MANIFEST_KEY, manifest.to_json().encode())
    return manifest


def _failure(problems: list[ChunkCheck], total: int, bad_markers: list[str], *, deleted: bool) -> VerificationFailed:
    lines = [f"  chunk {c.chunk:06d}: {c.problem}" for c in problems[:LISTED_PROBLEMS]]
    if len(problems) > LISTED_PROBLEMS:
        lines.append(f"  ... and {len(problems) - LISTED_PROBLEMS} more")
    missing = len(problems) - len(bad_markers)
    fixes = []
    if bad_markers and deleted:
        fixes.append(f"Deleted the {len(bad_markers)} marker(s) that do not match their chunk: `dflashctl run` extracts those chunks again")
    elif bad_markers:
        fixes.append(
            f"{len(bad_markers)} marker(s) do not match their chunk: delete them (`dflashctl verify --delete-bad`) "
            "and `dflashctl run` again; extraction redoes exactly those chunks"
        )
    if missing:
        fixes.append(f"{missing} chunk(s) are not extracted yet: `dflashctl status` shows why, `dflashctl run` extracts them")
    return VerificationFailed(
        f"{len(problems)} problem(s) with the {total} chunks of tokens/dataset.json:\n" + "\n".join(lines),
        "; ".join(fixes),
        bad_markers=bad_markers,
    )


def read_manifest(storage: Storage) -> Manifest | None:
    """The run's manifest, or None before verify has passed."""
    try:
        return Manifest.from_json(storage.get_bytes(MANIFEST_KEY), MANIFEST_KEY)
    except ObjectNotFound:
        return None
