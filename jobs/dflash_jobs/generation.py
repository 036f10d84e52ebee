"""The contract of generation (the `generate` step): where its files live under <output>/generate
and what they hold. It sits beside `formats` because three parties read it: the generate pods write
it, prepare reads the rows it lists, and the control plane shows progress and plans from it.

    generate/plan.json              the source cut into chunks of generate.chunk_prompts lines
    generate/chunks/000000.jsonl    chat JSONL: the prompt's messages and the target's answer, one row per kept line
    generate/done/000000.json       written after its chunk: rows kept and dropped (by reason), tokens, sha256, settings
    generate/manifest.json          written once every chunk is done; prepare reads the chunks it lists
    generate/rejected.jsonl         every dropped line with its reason, written with the manifest

A row of a chunk: {"sample_id", "messages", "tools"?, "generation"}: the prompt's messages (earlier
assistant turns marked "weight": 0) and the target's answer as text, then how it was generated,
{"finish_reason", "prompt_tokens", "completion_tokens", "token_ids"}. `token_ids` is the answer as
the target sampled it, the end token it stopped on included (none where cut at the limit): prepare
trains on those ids, which the text does not give back. Rows written before generation stored them
have none; prepare trains those on their text and counts them (an addition readers of v1 ignore).

A chunk is the unit of work and of retry, as in extraction: it becomes visible only complete (its
object, then its marker), a marker made with other settings or without its object is stale (the
chunk is generated again), and chunks never depend on the shard count.

Plain JSON only, no torch: the control plane imports this module.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dflash_jobs.errors import FormatError, InputError
from dflash_jobs.formats import document_of, dump_json_document, load_json_document
from dflash_jobs.spec import RunSpec
from dflash_jobs.storage import ObjectNotFound, Storage

log = logging.getLogger("dflash.generate")

PLAN_FORMAT = "dflash.generate-plan/v1"
DONE_FORMAT = "dflash.generate-done/v1"
MANIFEST_FORMAT = "dflash.generate/v1"

PLAN_KEY = "generate/plan.json"
CHUNKS = "generate/chunks/"
DONE_MARKERS = "generate/done/"
MANIFEST_KEY = "generate/manifest.json"
REJECTED_KEY = "generate/rejected.jsonl"

# Why a prompt's answer is not kept: keys of `dropped` in the markers and the manifest, beside the
# reasons of lines that hold no prompt (dflash_jobs.generate.source's, and prepare's malformed_json, ...).
OVER_CONTEXT = "over_context"  # the prompt leaves no room for an answer within data.max_length
ENGINE_ERROR = "engine_error"  # the engine failed this one prompt
EMPTY_ANSWER = "empty_answer"  # no text (generate.empty: drop)
TRUNCATED = "truncated"  # cut at the token limit, finish_reason length (generate.truncated: drop)

LARGE_DROP_SHARE = 0.25
"""Generation that drops more than this share of data.source's lines says so (the pod's log,
`dflashctl status`, `dflashctl run`): the settings may be dropping what the drafter should learn."""


def chunk_key(chunk: int) -> str:
    return f"{CHUNKS}{chunk:06d}.jsonl"


def done_key(chunk: int) -> str:
    return f"{DONE_MARKERS}{chunk:06d}.json"


# ---- what a run generates with -------------------------------------------------------------------


def generation_settings(spec: RunSpec) -> dict[str, Any]:
    """Everything that decides what a chunk holds. A marker made with other settings is stale.

    Throughput-only knobs (shards, GPUs, batch sizes, the image, extra vLLM arguments) are left out:
    changing them regenerates nothing."""
    generate = spec.generate
    if generate is None:
        raise ValueError("generation is off in this spec (no generate section)")
    return {
        "source": spec.data.source,
        "model": spec.target.model,
        "engine": generate.engine,
        "temperature": generate.temperature,
        "top_p": generate.top_p,
        "max_new_tokens": generate.max_new_tokens,
        "max_length": spec.data.max_length,
        "thinking": generate.thinking,
        "seed": generate.seed,
        "truncated": generate.truncated,
        "empty": generate.empty,
        "chunk_prompts": generate.chunk_prompts,
    }


def engine_options(spec: RunSpec) -> dict[str, Any]:
    """How the answers were computed beyond the settings: recorded in the manifest, regenerating nothing."""
    generate = spec.generate
    assert generate is not None
    options: dict[str, Any] = {"gpus_per_shard": generate.gpus_per_shard}
    if generate.engine == "vllm":
        options.update(vllm_image=generate.vllm_image, vllm_args=list(generate.vllm_args))
    else:
        options.update(batch_prompts=generate.batch_prompts, compile=generate.compile, attn_implementation=spec.target.attn_implementation)
    return options


def settings_hash(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _load(text: str | bytes, name: str, fmt: str) -> dict[str, Any]:
    return load_json_document(text, name, fmt, fix="Delete it; generation writes it again")


# ---- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SourceChunk:
    """`lines` lines of data.source from line `first_line` (0-based), at bytes [offset, offset + size)."""

    id: int
    first_line: int
    lines: int
    offset: int
    size: int
    weight: int
    """Estimated tokens of work: prompt tokens (from the bytes) plus generate.max_new_tokens per line."""


@dataclass(frozen=True, slots=True)
class GenerationPlan:
    source: str
    source_size: int
    chunk_prompts: int
    chunks: list[SourceChunk]

    @property
    def lines(self) -> int:
        return sum(c.lines for c in self.chunks)

    def to_json(self) -> str:
        return dump_json_document(PLAN_FORMAT, asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes, name: str = PLAN_KEY) -> GenerationPlan:
        return document_of(cls, _load(text, name, PLAN_FORMAT), name, "generation plan", "Delete it; generation writes it again", chunks=SourceChunk)


# ---- a chunk's marker ----------------------------------------------------------------------------


@dataclass(slots=True)
class ChunkMarker:
    """generate/done/<chunk>.json: written after the chunk's rows are stored."""

    chunk: int
    first_line: int
    lines: int
    """Lines of data.source read (every prompt of the chunk, kept or not)."""
    rows: int
    """Rows stored: prompts with their regenerated answer."""
    bytes: int
    sha256: str
    etag: str | None
    settings: str
    """settings_hash of the generation settings it was made with."""
    dropped: dict[str, int] = field(default_factory=dict)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    """Every dropped line: {"line" (1-based), "sample_id", "reason", "detail"}."""
    truncated_kept: int = 0
    empty_kept: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    """Tokens the engine generated for this chunk's prompts, kept or not."""
    seconds: float = 0.0
    """Wall time of the engine on this chunk (model load included for vllm)."""
    shard: int = 0
    engine: str = ""

    def to_json(self) -> str:
        return dump_json_document(DONE_FORMAT, asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes, name: str) -> ChunkMarker:
        return document_of(cls, _load(text, name, DONE_FORMAT), name, "generation marker", "Delete it; its chunk is generated again")


def read_marker(storage: Storage, chunk: int) -> ChunkMarker | None:
    try:
        return ChunkMarker.from_json(storage.get_bytes(done_key(chunk)), done_key(chunk))
    except ObjectNotFound:
        return None
    except FormatError as error:
        log.warning("%s", error)
        return None


def describes(marker: ChunkMarker | None, chunk: SourceChunk, settings: str) -> bool:
    """The marker is of this chunk, made with these settings."""
    return marker is not None and (marker.first_line, marker.lines, marker.settings) == (chunk.first_line, chunk.lines, settings)


def object_matches(storage: Storage, marker: ChunkMarker) -> bool:
    """The chunk's object is the one its marker describes (size, and etag when both have one)."""
    info = storage.stat(chunk_key(marker.chunk))
    return info is not None and info.size == marker.bytes and (info.etag is None or marker.etag is None or info.etag == marker.etag)


def listed_markers(
    storage: Storage, chunks: Sequence[SourceChunk], settings: str, cache: dict[str, ChunkMarker] | None = None,
    present: Collection[str] | None = None,
) -> dict[int, ChunkMarker]:
    """The markers present (`present`: a listing of generate/done/ already made) that describe one
    of `chunks` with these settings, by chunk id.

    One listing, and one read per marker not in `cache` (markers do not change once written, so a
    watcher reads each once)."""
    cache = {} if cache is None else cache
    present = set(storage.list(DONE_MARKERS) if present is None else present)
    found = {}
    for chunk in chunks:
        key = done_key(chunk.id)
        if key not in present:
            cache.pop(key, None)
            continue
        if key not in cache:
            marker = read_marker(storage, chunk.id)
            if marker is None:
                continue
            cache[key] = marker
        if describes(cache[key], chunk, settings):
            found[chunk.id] = cache[key]
    return found


def done_markers(storage: Storage, chunks: Sequence[SourceChunk], settings: str) -> dict[int, ChunkMarker]:
    """The chunks that are done: a marker with these settings, and its object as it describes."""
    return {chunk: marker for chunk, marker in listed_markers(storage, chunks, settings).items() if object_matches(storage, marker)}


# ---- the manifest ----------------------------------------------------------------------------------


@dataclass(slots=True)
class ManifestChunk:
    id: int
    path: str
    rows: int
    bytes: int
    sha256: str


@dataclass(slots=True)
class GenerationManifest:
    """generate/manifest.json: what was generated, with which settings, and what was dropped and why."""

    settings: dict[str, Any]
    settings_hash: str
    engine_options: dict[str, Any]
    lines: int
    """Lines of data.source read."""
    rows: int
    """Rows stored with a regenerated answer."""
    dropped: dict[str, int]
    truncated_kept: int
    empty_kept: int
    prompt_tokens: int
    completion_tokens: int
    engine_seconds: float
    """Engine wall time summed over chunks: GPU time of one shard's GPUs per chunk."""
    chunks: list[ManifestChunk]

    def to_json(self) -> str:
        return dump_json_document(MANIFEST_FORMAT, asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes, name: str = MANIFEST_KEY) -> GenerationManifest:
        return document_of(
            cls, _load(text, name, MANIFEST_FORMAT), name, "generation manifest", "Delete it; `dflashctl run` writes it again", chunks=ManifestChunk,
        )

    @property
    def dropped_lines(self) -> int:
        return sum(self.dropped.values())

    def explain_drops(self) -> str:
        """The drops by reason, each with the settings that decide it:
        "truncated 24 (answers cut at generate.max_new_tokens = 12 or at data.max_length, dropped by generate.truncated: drop)"."""
        causes = {
            TRUNCATED: f"answers cut at generate.max_new_tokens = {self.settings['max_new_tokens']} or at data.max_length, "
                       "dropped by generate.truncated: drop",
            EMPTY_ANSWER: "answers without text, dropped by generate.empty: drop",
            OVER_CONTEXT: f"prompts that leave no room for an answer within data.max_length = {self.settings['max_length']}",
            ENGINE_ERROR: f"the engine failed them: {REJECTED_KEY} quotes why",
        }
        return ", ".join(
            f"{reason} {count} ({causes.get(reason, f'lines that hold no prompt: {REJECTED_KEY} lists them')})"
            for reason, count in self.dropped.items()
        ) or "none"

    def drop_warning(self) -> str | None:
        """One line when more than LARGE_DROP_SHARE of the lines were dropped, else None."""
        if self.dropped_lines <= LARGE_DROP_SHARE * self.lines:
            return None
        return f"generation dropped {self.dropped_lines:,} of {self.lines:,} lines ({self.dropped_lines / self.lines:.0%}): {self.explain_drops()}"

    def too_few_rows(self, holdout: int) -> InputError | None:
        """The error a run stops with when no more rows were kept than data.holdout takes for
        evaluation (prepare would have nothing to train on), naming the settings to change; else None."""
        if self.rows > holdout:
            return None
        fixes = [fix for reason, fix in (
            (TRUNCATED, "set generate.truncated: keep or raise generate.max_new_tokens"),
            (EMPTY_ANSWER, "set generate.empty: keep"),
            (OVER_CONTEXT, "raise data.max_length"),
        ) if reason in self.dropped] or ["add lines to data.source"]
        return InputError(
            f"generation kept {self.rows} of {self.lines} lines of data.source, and prepare holds out the last "
            f"data.holdout = {holdout} for evaluation, leaving nothing to train on; dropped: {self.explain_drops()}",
            f"Change the spec: {', or '.join([*fixes, 'lower data.holdout'])}; then `dflashctl run --force` (--force accepts "
            "the changed spec; changed generation settings generate the answers again, while an unchanged spec stops here again)",
        )

    def summary(self) -> dict[str, Any]:
        """What tokens/dataset.json records of the generation it was prepared from."""
        body = asdict(self)
        body.pop("chunks")
        return {"manifest": MANIFEST_KEY, **body}


def read_manifest(storage: Storage) -> GenerationManifest | None:
    try:
        return GenerationManifest.from_json(storage.get_bytes(MANIFEST_KEY))
    except ObjectNotFound:
        return None
    except FormatError as error:
        log.warning("%s", error)
        return None


def current_manifest(storage: Storage, spec: RunSpec) -> GenerationManifest | None:
    """generate/manifest.json if it exists and was made with this spec's generation settings."""
    if not storage.exists(MANIFEST_KEY):
        return None
    manifest = read_manifest(storage)
    if manifest is None or manifest.settings_hash != settings_hash(generation_settings(spec)):
        return None
    return manifest


def generated_lines(storage: Storage, manifest: GenerationManifest) -> Iterator[tuple[int, bytes]]:
    """(sample id, raw chat row) of every stored row, chunk by chunk, each chunk checked against the manifest."""
    for chunk in manifest.chunks:
        data = storage.get_bytes(chunk.path)
        if len(data) != chunk.bytes or hashlib.sha256(data).hexdigest() != chunk.sha256:
            raise FormatError(
                f"{storage.url}/{chunk.path} is not the chunk {MANIFEST_KEY} lists ({len(data)} bytes, {chunk.bytes} listed, or another sha256)",
                f"Delete it and {done_key(chunk.id)}, then `dflashctl run` generates it again",
            )
        for line in data.splitlines(keepends=True):
            try:
                yield int(json.loads(line)["sample_id"]), line
            except (ValueError, KeyError, TypeError):
                raise FormatError(f"{storage.url}/{chunk.path} holds a row without a sample_id", f"Delete it and {done_key(chunk.id)}, then generate it again") from None


def read_plan(storage: Storage) -> GenerationPlan | None:
    if not storage.exists(PLAN_KEY):
        return None
    return GenerationPlan.from_json(storage.get_bytes(PLAN_KEY))


def write_manifest_if_complete(storage: Storage, spec: RunSpec) -> GenerationManifest | None:
    """Writes generate/rejected.jsonl and then generate/manifest.json once every chunk of the plan is
    done with the current settings; returns the manifest, or None while chunks are missing.

    The content is a pure function of the markers, so every shard that finishes last, and the
    controller after the Job, may write it: they all write the same bytes."""
    plan = read_plan(storage)
    if plan is None:
        return None
    settings = generation_settings(spec)
    digest = settings_hash(settings)
    markers = done_markers(storage, plan.chunks, digest)
    if len(markers) < len(plan.chunks):
        return None
    ordered = [markers[chunk.id] for chunk in plan.chunks]
    dropped: Counter[str] = Counter()
    rejected = []
    for marker in ordered:
        dropped.update(marker.dropped)
        rejected += [json.dumps(entry, sort_keys=True) + "\n" for entry in marker.rejected]
    manifest = GenerationManifest(
        settings=settings,
        settings_hash=digest,
        engine_options=engine_options(spec),
        lines=sum(m.lines for m in ordered),
        rows=sum(m.rows for m in ordered),
        dropped=dict(sorted(dropped.items())),
        truncated_kept=sum(m.truncated_kept for m in ordered),
        empty_kept=sum(m.empty_kept for m in ordered),
        prompt_tokens=sum(m.prompt_tokens for m in ordered),
        completion_tokens=sum(m.completion_tokens for m in ordered),
        engine_seconds=round(sum(m.seconds for m in ordered), 1),
        chunks=[ManifestChunk(m.chunk, chunk_key(m.chunk), m.rows, m.bytes, m.sha256) for m in ordered],
    )
    storage.put_bytes(REJECTED_KEY, "".join(rejected).encode())
    storage.put_bytes(MANIFEST_KEY, manifest.to_json().encode())
    return manifest


# ---- progress --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GenerationProgress:
    """How far generation is, from the plan and the markers. Totals are None until a pod wrote the plan."""

    chunks_done: int
    chunks_total: int | None
    prompts_done: int
    prompts_total: int | None
    completion_tokens: int
    engine_seconds: float
    landings: tuple[tuple[float, int, int], ...] = ()
    """(when its marker landed, Unix time; its prompts; its generated tokens) of every done chunk, oldest first."""

    @property
    def label(self) -> str:
        """"3/12": chunks done of total, the value of the generation Job's dflash.dev/progress annotation."""
        return f"{self.chunks_done}/{'?' if self.chunks_total is None else self.chunks_total}"

    @property
    def landed(self) -> bool:
        return self.chunks_total is not None and self.chunks_done == self.chunks_total

    @property
    def tokens_per_prompt(self) -> float | None:
        """Mean generated tokens per prompt so far: the measured answer length."""
        return self.completion_tokens / self.prompts_done if self.prompts_done else None


def read_progress(storage: Storage, spec: RunSpec, cache: dict[str, ChunkMarker] | None = None) -> GenerationProgress:
    """Chunks and prompts done and when each chunk landed, from one listing of the markers (each read once with `cache`)."""
    plan = read_plan(storage)
    if plan is None:
        return GenerationProgress(0, None, 0, None, 0, 0.0)
    listing = storage.list_modified(DONE_MARKERS)
    markers = listed_markers(storage, plan.chunks, settings_hash(generation_settings(spec)), cache, listing)
    return GenerationProgress(
        chunks_done=len(markers),
        chunks_total=len(plan.chunks),
        prompts_done=sum(m.lines for m in markers.values()),
        prompts_total=plan.lines,
        completion_tokens=sum(m.completion_tokens for m in markers.values()),
        engine_seconds=sum(m.seconds for m in markers.values()),
        landings=tuple(sorted((listing[done_key(chunk)], m.lines, m.completion_tokens) for chunk, m in markers.items())),
    )
