"""Prepare: `data.source` JSONL -> token chunks under <output>/tokens (DESIGN sections 3 and 4).

    python -m dflash_jobs.prepare -f dflash.yaml [--strict]

Each line of the source is one sample, detected by its keys:
- chat: `{"messages": [...], "tools": [...]?}`, rendered with the target's tokenizer and chat template;
  the loss mask covers what the assistant generates (see `ChatEncoder`); a row the generate step
  wrote is its generation prompt and the answer's token ids as the target sampled them
  (`"generation": {"token_ids": [...]}`), or its text where it holds none;
- pre-tokenized: `{"input_ids": [...], "loss_mask": [...]}`, ids checked against the tokenizer.

A sample's id is its 0-based line number in the source. Messages name lines 1-based, as editors do.
Bad rows are dropped, counted by reason in tokens/dataset.json, listed in tokens/rejected.jsonl, and
the first few are logged; over-long samples are cut to `data.max_length` and counted; `--strict`
turns any of them into an error (InputError, exit code 2) naming the line. tokens/dataset.json also
counts the chat samples by how their answers became tokens (`answers`): the target's own ids, or
text tokenized here, and of each how many tokenizing text changes.

Samples fill chunks of at most `data.chunk_tokens` tokens in source order, never split. The last
`data.holdout` valid samples go to tokens/holdout.safetensors (evaluation prompts), not into the
training chunks: a source sorted by topic should be shuffled first. tokens/dataset.json is written
last, so a reader sees a complete data set or none. The output is deterministic (same bytes for the
same source and tokenizer) and memory stays bounded: the source is streamed in batches of rows.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import logging
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack, closing
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from dflash_jobs.errors import EXIT_BAD_SPEC, EXIT_OK, DflashError, InputError, SpecError
from dflash_jobs.formats import DATASET_KEY, DONE_MARKERS, TOKEN_CHUNKS, ChunkInfo, DatasetIndex, TokenChunk, token_chunk_key
from dflash_jobs.generation import MANIFEST_KEY as GENERATION_MANIFEST_KEY
from dflash_jobs.generation import GenerationManifest, current_manifest, generated_lines
from dflash_jobs.pacing import Every
from dflash_jobs.rows import (
    MISSING_FIELDS, NO_SUPERVISED_TOKENS, RETOKENIZED, TARGET_IDS, TEXT, BadRow, ChatEncoder, RenderedChat, Tokenized, batched,
    embedding_rows, json_row, load_tokenizer, open_source, parse_pretokenized,
)
from dflash_jobs.spec import DEFAULT_SPEC_FILE, DataSpec, RunSpec, load_spec
from dflash_jobs.storage import Storage, storage_for

log = logging.getLogger("dflash.prepare")

HOLDOUT_KEY = "tokens/holdout.safetensors"
REJECTED_KEY = "tokens/rejected.jsonl"
LOG_EVERY_S = 5.0
LOGGED_BAD_ROWS = 20
BATCH_ROWS = 512
"""Rows tokenized together: the Rust tokenizer parallelises a batch; memory stays bounded by it."""

@dataclass(slots=True)
class Sample:
    sample_id: int  # 0-based line number in data.source
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]


# ---- writing -------------------------------------------------------------------------------------


class ChunkWriter:
    """Packs samples into token chunks of at most `chunk_tokens` tokens, in order, never splitting one."""

    def __init__(self, storage: Storage, chunk_tokens: int) -> None:
        self.storage = storage
        self.chunk_tokens = chunk_tokens
        self.pending: list[Sample] = []
        self.pending_tokens = 0
        self.chunks: list[ChunkInfo] = []
        self.supervised_tokens = 0

    def add(self, sample: Sample) -> None:
        if self.pending_tokens + len(sample.input_ids) > self.chunk_tokens:
            self.flush()
        self.pending.append(sample)
        self.pending_tokens += len(sample.input_ids)
        self.supervised_tokens += int(sample.loss_mask.sum())

    def flush(self) -> None:
        if not self.pending:
            return
        chunk_id = len(self.chunks)
        key = token_chunk_key(chunk_id)
        self.storage.put_bytes(key, pack(self.pending).encode())
        self.chunks.append(ChunkInfo(id=chunk_id, path=key, samples=len(self.pending), tokens=self.pending_tokens))
        self.pending, self.pending_tokens = [], 0


def pack(samples: list[Sample]) -> TokenChunk:
    lengths = [len(s.input_ids) for s in samples]
    return TokenChunk(
        input_ids=np.concatenate([s.input_ids for s in samples]).astype(np.int32),
        loss_mask=np.concatenate([s.loss_mask for s in samples]).astype(np.uint8),
        cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        sample_ids=np.asarray([s.sample_id for s in samples], dtype=np.int64),
    )


# ---- the job -------------------------------------------------------------------------------------

Encoded = BadRow | Tokenized
"""One row's outcome: why it is bad, or its tokens before truncation."""


class RowEncoder:
    """Turns a batch of raw lines into samples or reasons, independently of any other batch."""

    def __init__(self, tokenizer, template_kwargs: dict[str, Any] | None = None, *, answer_vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = template_kwargs
        self.answer_vocab_size = answer_vocab_size
        self.vocab_size = len(tokenizer)

    @functools.cached_property
    def chat(self) -> ChatEncoder:
        """Built at the first chat row: a pre-tokenized data set needs no chat template."""
        return ChatEncoder(self.tokenizer, self.template_kwargs, answer_vocab_size=self.answer_vocab_size)

    def encode(self, batch: list[tuple[int, bytes]]) -> list[tuple[int, Encoded]]:
        parsed: list[tuple[int, BadRow | RenderedChat | Tokenized]] = []
        for number, line in batch:
            try:
                parsed.append((number, self.parse(line)))
            except BadRow as bad:
                parsed.append((number, bad))
        # Chat rows are tokenized together: one call, parallel in the Rust tokenizer.
        chats = [item for _, item in parsed if isinstance(item, RenderedChat)]
        encoded = iter(self.chat.tokenize(chats) if chats else ())
        return [(number, next(encoded) if isinstance(item, RenderedChat) else item) for number, item in parsed]

    def parse(self, line: bytes) -> RenderedChat | Tokenized:
        """A chat row rendered (tokenized later, with its batch), or a pre-tokenized row's tokens."""
        row = json_row(line)
        if "messages" in row:
            return self.chat.render(row)
        if "input_ids" in row:
            return parse_pretokenized(row, self.vocab_size)
        raise BadRow(MISSING_FIELDS, 'expected "messages" (chat) or "input_ids" and "loss_mask" (pre-tokenized)')


# Worker processes inherit the encoder by fork; only lines and arrays cross process boundaries.
_worker_encoder: RowEncoder | None = None


def _set_worker_encoder(encoder: RowEncoder) -> None:
    global _worker_encoder
    _worker_encoder = encoder
    # The pool already uses every CPU: tokenizer threads inside each worker would oversubscribe them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _encode_in_worker(batch: list[tuple[int, bytes]]) -> list[tuple[int, Encoded]]:
    assert _worker_encoder is not None
    return _worker_encoder.encode(batch)


def encode_batches(encoder: RowEncoder, batches: Iterable[list[tuple[int, bytes]]], *, workers: int) -> Iterator[list[tuple[int, Encoded]]]:
    """`encoder.encode` over the batches, in order, on `workers` processes (rendering chat
    templates is pure Python: one core does ~1-2K rows/s). At most 2 x workers batches are in
    flight, so a fast reader cannot fill memory ahead of the writer."""
    if workers <= 1:
        yield from map(encoder.encode, batches)
        return
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_set_worker_encoder, initargs=(encoder,)) as pool:
        in_flight: collections.deque = collections.deque()
        for batch in batches:
            in_flight.append(pool.submit(_encode_in_worker, batch))
            if len(in_flight) >= 2 * workers:
                yield in_flight.popleft().result()
        while in_flight:
            yield in_flight.popleft().result()


def cpu_budget() -> int:
    """CPUs this process may use: the affinity mask, capped by a cgroup v2 quota (a pod's CPU limit)."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return cpus
    return cpus if quota == "max" else max(1, min(cpus, int(quota) // int(period)))


@dataclass
class PrepareStats:
    rows: int = 0
    samples: int = 0
    tokens: int = 0
    truncated: int = 0
    dropped: collections.Counter = field(default_factory=collections.Counter)
    answers: collections.Counter = field(default_factory=collections.Counter)
    """Chat samples (held-out ones included) by how their supervised tokens were made (TARGET_IDS,
    TEXT), and of each how many tokenizing text changes (RETOKENIZED)."""


@dataclass(eq=False)
class Preparer:
    """Turns encoded rows into chunks, the holdout and the index; see the module docstring for the rules."""

    data: DataSpec
    _: KW_ONLY
    storage: Storage
    vocab_size: int
    strict: bool = False
    tokenizer_name: str | None = None
    generation: dict[str, Any] | None = None
    stats: PrepareStats = field(init=False, default_factory=PrepareStats)
    rejected: Any = field(init=False, default_factory=lambda: tempfile.NamedTemporaryFile(prefix="dflash-rejected-", suffix=".jsonl"))
    """Every bad row, spooled to disk and uploaded at the end: a data set of bad rows costs no memory."""

    def close(self) -> None:
        self.rejected.close()

    def run(self, batches: Iterable[list[tuple[int, Encoded]]]) -> DatasetIndex:
        extracted = self.storage.list(DONE_MARKERS)
        if extracted:
            # Those hidden states belong to the current token chunks; new chunks would silently
            # pair with them (and the manifest would send training onto the old data).
            raise InputError(
                f"{self.storage.url} already holds {len(extracted)} extracted chunks of the current token data set",
                f"Delete {self.storage.url}/extract first to extract again, or use a new `output` for the new data set",
            )
        # A re-run rewrites the chunks: the old index must not describe a half-written data set.
        self.storage.delete(DATASET_KEY)
        writer = ChunkWriter(self.storage, self.data.chunk_tokens)
        holdout: collections.deque[Sample] = collections.deque()
        started, every = time.monotonic(), Every(LOG_EVERY_S)
        for batch in batches:
            for number, outcome in batch:
                sample = self.sample(number, outcome)
                if sample is None:
                    continue
                holdout.append(sample)
                if len(holdout) > self.data.holdout:
                    writer.add(holdout.popleft())
            self.stats.rows += len(batch)
            if every.due():
                self.log_progress(started, len(writer.chunks))
        if not writer.pending and not writer.chunks:
            if self.generation is None:
                raise InputError(
                    f"data.source {self.data.source} has {len(holdout)} usable samples, all held out (data.holdout = {self.data.holdout})",
                    "Add samples, or lower data.holdout",
                )
            raise InputError(
                f"the generated rows ({GENERATION_MANIFEST_KEY}: {self.generation['rows']} kept of {self.generation['lines']} lines "
                f"of data.source) give {len(holdout)} usable samples, all held out (data.holdout = {self.data.holdout}); prepare "
                f"dropped {sum(self.stats.dropped.values())} of the rows ({REJECTED_KEY} says why)",
                "Keep more rows in generation (generate.truncated, generate.empty, generate.max_new_tokens), or lower data.holdout",
            )
        writer.flush()
        self.log_progress(started, len(writer.chunks))
        index = self.finish(writer, list(holdout))
        log.info("wrote %d chunks, %d samples, %d tokens (%d supervised); %d held out; dropped %s; truncated %d",
                 len(index.chunks), index.samples, index.tokens, index.supervised_tokens, len(holdout),
                 dict(sorted(index.dropped.items())) or "none", index.truncated)
        self.log_answers()
        return index

    def sample(self, number: int, outcome: Encoded) -> Sample | None:
        """The row as a sample, truncated to data.max_length; None (and counted) if it is unusable."""
        if isinstance(outcome, BadRow):
            self.reject(number, outcome)
            return None
        ids, mask = outcome.input_ids, outcome.loss_mask
        truncated = len(ids) > self.data.max_length
        ids, mask = ids[: self.data.max_length], mask[: self.data.max_length]
        if not mask.any():
            self.reject(number, BadRow(NO_SUPERVISED_TOKENS, "no assistant token" + (f" in the first {self.data.max_length} tokens" if truncated else "")))
            return None
        if truncated:
            if self.strict:
                raise InputError(f"data.source line {number + 1} is longer than data.max_length = {self.data.max_length} tokens", "Shorten it, raise data.max_length, or drop --strict to truncate it")
            self.stats.truncated += 1
        self.stats.samples += 1
        self.stats.tokens += len(ids)
        if outcome.answer is not None:
            self.stats.answers[outcome.answer] += 1
            self.stats.answers[RETOKENIZED[outcome.answer]] += outcome.retokenized_differently
        return Sample(number, ids, mask)

    def reject(self, number: int, bad: BadRow) -> None:
        if self.strict:
            raise InputError(f"data.source line {number + 1}: {bad.reason}: {bad.detail}", "Fix or remove the row, or drop --strict to skip bad rows")
        self.stats.dropped[bad.reason] += 1
        self.rejected.write((json.dumps({"line": number + 1, "sample_id": number, "reason": bad.reason, "detail": bad.detail}) + "\n").encode())
        dropped = sum(self.stats.dropped.values())
        if dropped <= LOGGED_BAD_ROWS:
            log.warning("dropped line %d (%s): %s", number + 1, bad.reason, bad.detail)
            if dropped == LOGGED_BAD_ROWS:
                log.warning("not logging further bad rows: counts in %s, every one in %s", DATASET_KEY, REJECTED_KEY)

    def finish(self, writer: ChunkWriter, held_out: list[Sample]) -> DatasetIndex:
        """Writes the holdout, the list of bad rows and, last, the index; removes chunks of an older run."""
        holdout: dict[str, Any] = {"samples": len(held_out), "selection": "last valid samples of data.source"}
        if held_out:
            chunk = pack(held_out)
            self.storage.put_bytes(HOLDOUT_KEY, chunk.encode())
            holdout.update(path=HOLDOUT_KEY, tokens=chunk.num_tokens, sample_ids=chunk.sample_ids.tolist())
        self.rejected.flush()
        self.storage.put_file(REJECTED_KEY, self.rejected.name)
        chunks = writer.chunks
        current = {c.path for c in chunks}
        for key in self.storage.list(TOKEN_CHUNKS):
            if key not in current:
                self.storage.delete(key)
        index = DatasetIndex(
            samples=sum(c.samples for c in chunks),
            tokens=sum(c.tokens for c in chunks),
            vocab_size=self.vocab_size,
            chunks=chunks,
            source=self.data.source,
            tokenizer=self.tokenizer_name,
            dropped=dict(sorted(self.stats.dropped.items())),
            truncated=self.stats.truncated,
            supervised_tokens=writer.supervised_tokens,
            holdout=holdout,
            generation=self.generation,
            answers={key: self.stats.answers[key] for key in sorted([*RETOKENIZED, *RETOKENIZED.values()])},
        )
        self.storage.put_bytes(DATASET_KEY, index.to_json().encode())
        return index

    def log_answers(self) -> None:
        """How the supervised tokens were made: the target's own ids, or text tokenized here."""
        answers = self.stats.answers
        log.info("answers: %d as the target's token ids (%d of them tokenize otherwise from their text), %d from text "
                 "(%d of them changed by the tokenizer, e.g. non-NFC text; which tokens their writer produced is unknown)",
                 answers[TARGET_IDS], answers[RETOKENIZED[TARGET_IDS]], answers[TEXT], answers[RETOKENIZED[TEXT]])
        if self.generation is not None and answers[TEXT]:
            log.warning("%d generated rows hold no token ids (generated before prepare trained on them): trained on their text "
                        "tokenized here, which may split it otherwise than the target did; delete %s and run again to train "
                        "on the target's own tokens", answers[TEXT], f"{self.storage.url}/generate")

    def log_progress(self, started: float, chunks: int) -> None:
        elapsed = max(time.monotonic() - started, 1e-9)
        stats = self.stats
        log.info("rows %d (%.0f rows/s), samples %d, tokens %d (%.0f tokens/s), chunks %d, dropped %d, truncated %d",
                 stats.rows, stats.rows / elapsed, stats.samples, stats.tokens, stats.tokens / elapsed, chunks,
                 sum(stats.dropped.values()), stats.truncated)


def prepare(spec: RunSpec, *, strict: bool = False, workers: int | None = None) -> DatasetIndex:
    """Runs prepare for a spec: reads data.source (or, with generation on, the regenerated chunks
    that generate/manifest.json lists), writes <output>/tokens. `workers`: processes encoding rows
    (default: the CPUs this pod may use)."""
    location = {"endpoint_url": spec.storage.endpoint_url, "region": spec.storage.region}
    # Answers generated with the thinking switch set start where that generation prompt ends.
    thinking = None if spec.generate is None else spec.generate.thinking
    # A regenerated answer may hold any id the target can produce, beyond those its tokenizer names
    # (a random target samples them; the text path lost them without a word).
    encoder = RowEncoder(load_tokenizer(spec.target.model, **location), None if thinking is None else {"enable_thinking": thinking},
                         answer_vocab_size=embedding_rows(spec.target.model, **location))
    storage = storage_for(spec)
    generation = None if spec.generate is None else require_manifest(storage, spec)
    preparer = Preparer(
        spec.data, storage=storage, vocab_size=encoder.vocab_size, strict=strict, tokenizer_name=spec.target.model,
        generation=None if generation is None else generation.summary(),
    )
    try:
        with ExitStack() as stack:
            if generation is None:
                lines: Iterable[tuple[int, bytes]] = enumerate(stack.enter_context(open_source(spec.data.source, **location)))
            else:
                lines = generated_lines(storage, generation)
            # closing: an error stops the worker pool here, not whenever the generator is collected
            batches = stack.enter_context(closing(encode_batches(encoder, batched(lines, BATCH_ROWS), workers=workers or cpu_budget())))
            return preparer.run(batches)
    finally:
        preparer.close()


def require_manifest(storage: Storage, spec: RunSpec) -> GenerationManifest:
    """generate/manifest.json of this spec's generation settings: what prepare reads with generation on."""
    manifest = current_manifest(storage, spec)
    if manifest is None:
        what = "was made with other generation settings" if storage.exists(GENERATION_MANIFEST_KEY) else "does not exist"
        raise InputError(
            f"{storage.url}/{GENERATION_MANIFEST_KEY} {what}: the spec regenerates the answers of data.source (generate section) before prepare",
            "Run the generation first: `dflashctl run` (or `dflashctl submit generate --wait`)",
        )
    too_few = manifest.too_few_rows(spec.data.holdout)
    if too_few is not None:
        raise too_few
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_jobs.prepare", description="Tokenize data.source into token chunks under <output>/tokens.")
    parser.add_argument("-f", "--file", default=DEFAULT_SPEC_FILE, help="the run spec (default: ./dflash.yaml)")
    parser.add_argument("--strict", action="store_true", help="fail on the first bad or over-long row instead of dropping or truncating it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prepare: %(message)s", stream=sys.stdout, force=True)
    try:
        prepare(load_spec(args.file), strict=args.strict)
    except (SpecError, InputError) as exc:
        log.error("%s", exc)
        return EXIT_BAD_SPEC
    except DflashError as exc:
        log.error("%s", exc)
        return 1
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
