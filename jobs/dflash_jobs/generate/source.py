"""data.source as generation reads it: cut into chunks of lines, each chunk read alone, each line a prompt.

The plan (generate/plan.json) is one pass over the source's bytes, without parsing a line: chunk
`k` holds lines [k * chunk_prompts, (k + 1) * chunk_prompts) and the byte range they occupy, so a
shard reads only its own chunks (ranged reads on S3). Every pod that finds no plan makes it; they all
make the same bytes.

A line becomes a prompt by dropping the conversation's last assistant turn, if any: the target
answers the conversation as it stood before it. Earlier turns stay as the context they were; the
stored row marks earlier assistant messages `"weight": 0` (the convention of OpenAI's fine-tuning
format), so that prepare trains only on what the target wrote.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from dflash_jobs.errors import InputError, SpecError
from dflash_jobs.formats import DATASET_KEY
from dflash_jobs.generation import DONE_MARKERS, PLAN_KEY, GenerationPlan, SourceChunk, read_plan
from dflash_jobs.rows import MISSING_FIELDS, BadRow, chat_messages, json_row, open_source
from dflash_jobs.spec import RunSpec, is_s3
from dflash_jobs.storage import Storage, open_url

log = logging.getLogger("dflash.generate")

BYTES_PER_TOKEN = 4.0
"""Plan weights only: ~4 bytes of JSONL per prompt token (balance, not billing)."""

# Why a line gets no answer, beside prepare's reasons (malformed_json, missing_fields, ...).
NOT_CHAT = "not_chat"  # a pre-tokenized row: no conversation to answer
NO_USER_TURN = "no_user_turn"  # nothing asked: no user message before the dropped answer


@dataclass(frozen=True, slots=True)
class Prompt:
    """One line of data.source, as the target is asked it."""

    sample_id: int
    """0-based line number in data.source: the sample id prepare gives the row."""
    messages: list[dict[str, Any]]
    """The conversation without its last assistant turn."""
    tools: list[Any] | None = None


class Source:
    """data.source: its size, its bytes in order, and any byte range (an s3:// object or a local file)."""

    def __init__(self, spec: RunSpec) -> None:
        self.url = spec.data.source
        self.location = {"endpoint_url": spec.storage.endpoint_url, "region": spec.storage.region}

    def _object(self) -> tuple[Storage, str]:
        return open_url(self.url, **self.location)

    def size(self) -> int:
        if is_s3(self.url):
            storage, key = self._object()
            info = storage.stat(key)
            size = None if info is None else info.size
        else:
            path = Path(self.url.removeprefix("file://"))
            size = path.stat().st_size if path.is_file() else None
        if size is None:
            raise SpecError("data.source", self.url, "an existing JSONL file (local path or s3:// object)")
        return size

    def read(self, offset: int, size: int) -> bytes:
        if is_s3(self.url):
            storage, key = self._object()
            return storage.get_bytes(key, offset, offset + size)
        with open(self.url.removeprefix("file://"), "rb") as f:
            f.seek(offset)
            return f.read(size)

    def lines(self, chunk: SourceChunk) -> list[tuple[int, bytes]]:
        """(0-based line number, raw line) of every line of the chunk."""
        data = self.read(chunk.offset, chunk.size)
        # Cut as make_plan's stream was, at b"\n" only: a bare b"\r" is JSON whitespace inside a
        # line, where bytes.splitlines would cut it in two.
        lines = io.BytesIO(data).readlines()
        if len(data) != chunk.size or len(lines) != chunk.lines:
            raise InputError(
                f"data.source {self.url} changed since generation planned it: chunk {chunk.id:06d} should hold "
                f"{chunk.lines} lines in {chunk.size} bytes at byte {chunk.offset}, it holds {len(lines)} in {len(data)}",
                "Restore the source, or delete the generate/ folder of the output to generate from the new one",
            )
        return list(enumerate(lines, chunk.first_line))


def make_plan(stream: BinaryIO, *, source: str, chunk_prompts: int, max_new_tokens: int) -> GenerationPlan:
    """Chunks of `chunk_prompts` lines (the last may be shorter) with their byte ranges and weights."""
    chunks: list[SourceChunk] = []
    position = line = 0
    start = first = count = 0

    def close() -> None:
        size = position - start
        weight = round(size / BYTES_PER_TOKEN) + count * max_new_tokens
        chunks.append(SourceChunk(id=len(chunks), first_line=first, lines=count, offset=start, size=size, weight=weight))

    for raw in stream:
        if count == 0:
            start, first = position, line
        count += 1
        position += len(raw)
        line += 1
        if count == chunk_prompts:
            close()
            count = 0
    if count:
        close()
    return GenerationPlan(source=source, source_size=position, chunk_prompts=chunk_prompts, chunks=chunks)


def load_plan(storage: Storage, spec: RunSpec, source: Source) -> GenerationPlan:
    """The stored plan if it is of this source and chunk size; else a new one, stored."""
    generate = spec.generate
    assert generate is not None
    size = source.size()
    plan = read_plan(storage)
    if plan is not None and (plan.source, plan.source_size, plan.chunk_prompts) == (spec.data.source, size, generate.chunk_prompts):
        return plan
    if plan is not None and plan.source == spec.data.source and plan.source_size != size and storage.list(DONE_MARKERS):
        raise InputError(
            f"data.source {spec.data.source} changed since generation started: {size} bytes now, {plan.source_size} when it was planned",
            f"Restore the source, or delete {storage.url}/generate to generate from the new one "
            f"(and {storage.url}/{DATASET_KEY} if prepare ran)",
        )
    with open_source(spec.data.source, **source.location) as stream:
        plan = make_plan(stream, source=spec.data.source, chunk_prompts=generate.chunk_prompts, max_new_tokens=generate.max_new_tokens)
    storage.put_bytes(PLAN_KEY, plan.to_json().encode())
    log.info("planned %d chunks of up to %d prompts over %d lines of %s", len(plan.chunks), plan.chunk_prompts, plan.lines, spec.data.source)
    return plan


def parse_prompt(sample_id: int, line: bytes) -> Prompt:
    """The prompt of one source line, or BadRow saying why it has none."""
    row = json_row(line)
    if "messages" not in row:
        if "input_ids" in row:
            raise BadRow(NOT_CHAT, "a pre-tokenized row holds no conversation to answer; generation needs chat rows")
        raise BadRow(MISSING_FIELDS, 'expected "messages" (a chat row)')
    messages = chat_messages(row)
    end = len(messages)
    while end and messages[end - 1]["role"] == "assistant":
        end -= 1
    if not any(m["role"] == "user" for m in messages[:end]):
        raise BadRow(NO_USER_TURN, "no user message before the last assistant turn: nothing to answer")
    tools = row.get("tools")
    return Prompt(sample_id, messages[:end], tools if isinstance(tools, list) else None)


def prompts_of(lines: list[tuple[int, bytes]]) -> Iterator[tuple[int, Prompt | BadRow]]:
    for sample_id, line in lines:
        try:
            yield sample_id, parse_prompt(sample_id, line)
        except BadRow as bad:
            yield sample_id, bad
