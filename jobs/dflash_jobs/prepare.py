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
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator

import numpy as np

from dflash_jobs.errors import EXIT_BAD_SPEC, EXIT_OK, DflashError, InputError, SpecError
from dflash_jobs.formats import DATASET_KEY, DONE_MARKERS, TOKEN_CHUNKS, ChunkInfo, DatasetIndex, TokenChunk, token_chunk_key
from dflash_jobs.generation import MANIFEST_KEY as GENERATION_MANIFEST_KEY
from dflash_jobs.generation import GenerationManifest, current_manifest, generated_lines
from dflash_jobs.spec import DEFAULT_SPEC_FILE, DataSpec, RunSpec, is_s3, load_spec, text_config
from dflash_jobs.storage import ObjectNotFound, Storage, open_storage, open_url, storage_for

log = logging.getLogger("dflash.prepare")

HOLDOUT_KEY = "tokens/holdout.safetensors"
REJECTED_KEY = "tokens/rejected.jsonl"
LOG_EVERY_S = 5.0
LOGGED_BAD_ROWS = 20
BATCH_ROWS = 512
"""Rows tokenized together: the Rust tokenizer parallelises a batch; memory stays bounded by it."""

# Why a row is dropped: the keys of `dropped` in tokens/dataset.json.
MALFORMED_JSON = "malformed_json"  # not JSON, or not a JSON object
MISSING_FIELDS = "missing_fields"  # neither "messages" nor "input_ids" + "loss_mask"
INVALID_FIELDS = "invalid_fields"  # wrong types, lengths that differ, a loss mask other than 0/1
TEMPLATE_ERROR = "template_error"  # the chat template refused the messages
SPLIT_ANSWER = "split_answer"  # a generated answer a parser split (reasoning, tool calls), stored without its token ids
OUT_OF_VOCAB = "out_of_vocab"  # a token id outside the tokenizer's vocabulary (a generated answer's: the target's embedding)
EMPTY = "empty"  # a blank line, no messages, no tokens
NO_SUPERVISED_TOKENS = "no_supervised_tokens"  # no assistant token (left after truncation)

# What AutoTokenizer reads from a checkpoint; fetched alone when the target lives in S3.
TOKENIZER_FILES = (
    "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
)


class BadRow(Exception):
    """A row that cannot become a sample; `reason` is one of the constants above."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail

    def __reduce__(self):  # crosses from worker processes as a value
        return BadRow, (self.reason, self.detail)


@dataclass(slots=True)
class RenderedChat:
    text: str
    spans: list[tuple[int, int]]  # character spans the assistant generates
    answer_ids: list[int] | None = None
    """A regenerated answer as the target sampled it, after `text` (its generation prompt): supervised whole."""


# How a sample's supervised tokens were made: the keys of `answers` in tokens/dataset.json.
TARGET_IDS = "target_ids"  # the target's own token ids, stored by the generate step
TEXT = "text"  # text tokenized here (generation off, or generated rows stored without ids)
RETOKENIZED = {
    TARGET_IDS: "target_ids_retokenized_differently",  # their text would tokenize into other ids (a sampled split, normalised text)
    TEXT: "text_changed_by_tokenizer",  # their tokens do not decode back to the text (the tokenizer normalised it: non-NFC text)
}


@dataclass(frozen=True, slots=True)
class Tokenized:
    """One row's tokens before truncation, and how its supervised tokens were made."""

    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    answer: str | None = None
    """TARGET_IDS, TEXT, or None for a pre-tokenized row."""
    retokenized_differently: bool = False
    """TARGET_IDS: tokenizing their decoded text gives other ids, which is what training on the text
    would have lost. TEXT: the tokens do not give the text back; which ids its writer produced is
    not known from text, so this is the part of the loss that can be measured."""


@dataclass(slots=True)
class Sample:
    sample_id: int  # 0-based line number in data.source
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]


# ---- reading the source --------------------------------------------------------------------------


@contextmanager
def open_source(source: str, *, endpoint_url: str | None = None, region: str | None = None) -> Iterator[BinaryIO]:
    """data.source as a binary stream: an s3:// object is streamed, never downloaded whole."""
    try:
        if is_s3(source):
            storage, key = open_url(source, endpoint_url=endpoint_url, region=region)
            stream = storage.open_read(key)
        else:
            stream = open(source.removeprefix("file://"), "rb")
    except (ObjectNotFound, FileNotFoundError):
        raise SpecError("data.source", source, "an existing JSONL file (local path or s3:// object)") from None
    with stream:
        yield stream


def batched(lines: Iterable[tuple[int, bytes]], size: int) -> Iterator[list[tuple[int, bytes]]]:
    """(sample id, raw line) pairs in batches of `size`."""
    batch: list[tuple[int, bytes]] = []
    for number, line in lines:
        batch.append((number, line))
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


# ---- the tokenizer -------------------------------------------------------------------------------


def load_tokenizer(model: str, *, endpoint_url: str | None = None, region: str | None = None):
    """The target's tokenizer; for an s3:// checkpoint only the tokenizer files are fetched."""
    from transformers import AutoTokenizer

    if not is_s3(model):
        directory = Path(model.removeprefix("file://"))
        if not (directory / "tokenizer_config.json").is_file() and not (directory / "tokenizer.json").is_file():
            raise SpecError("target.model", model, "a checkpoint directory holding the tokenizer (tokenizer.json, tokenizer_config.json)")
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    storage = open_storage(model, endpoint_url=endpoint_url, region=region)
    present = set(storage.list(""))
    if "tokenizer.json" not in present:
        raise SpecError("target.model", model, "a checkpoint with tokenizer.json (a fast tokenizer) next to config.json")
    with tempfile.TemporaryDirectory(prefix="dflash-tokenizer-") as directory:
        for name in TOKENIZER_FILES:
            if name in present:
                storage.get_file(name, Path(directory) / name)
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def embedding_rows(model: str, *, endpoint_url: str | None = None, region: str | None = None) -> int | None:
    """The token ids the target can produce: its embedding's rows (config.json's vocab_size), more
    than its tokenizer names (Qwen3.6: 248,320 rows for ~248K tokens); None without a config."""
    storage = open_storage(model, endpoint_url=endpoint_url, region=region)
    if not storage.exists("config.json"):
        return None
    rows = text_config(json.loads(storage.get_bytes("config.json"))).get("vocab_size")
    return rows if isinstance(rows, int) else None


CONTENT_PROBE = "\x00"
"""A reply's content no template renders otherwise and no text holds: where a conversation rendered
with it parts from the real one, the reply's content starts."""


class ChatEncoder:
    """Renders conversations with the target's chat template and marks the assistant's tokens.

    The loss covers what the model generates in each assistant turn: everything after the
    generation prompt, up to and including the end-of-turn token (`<|im_end|>` for Qwen). An
    assistant message with `"weight": 0` (OpenAI's fine-tuning convention) is context only: the
    answers regenerated by the target mark the source's earlier turns so. It is
    found by rendering, for assistant message i, the conversation before it with
    `add_generation_prompt=True`: where that text stops agreeing with the full rendering, the
    assistant's generation starts. This needs no `{% generation %}` markers and holds for Qwen3.5/3.6,
    whose template renders a turn differently depending on what follows it (a <think> block only
    after the last user message), so that rendering prefix by prefix does not give prefixes.

    A row the generate step wrote is its generation prompt followed by the answer as the target
    produced it: its token ids where the row holds them (`generation.token_ids`), else its text.
    """

    def __init__(self, tokenizer, template_kwargs: dict[str, Any] | None = None, *, answer_vocab_size: int | None = None) -> None:
        """`answer_vocab_size`: the token ids a regenerated answer may hold, the target's embedding
        rows (default: the tokenizer's vocabulary)."""
        if not tokenizer.chat_template:
            raise InputError("the target's tokenizer has no chat template, so chat rows cannot be rendered", "Use pre-tokenized rows, or a checkpoint with a chat template")
        if not getattr(tokenizer, "is_fast", False):
            raise InputError("the target's tokenizer is not a fast tokenizer", "Chat rows need tokenizer.json in the checkpoint (token offsets)")
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.backend = tokenizer.backend_tokenizer
        self.answer_vocab_size = answer_vocab_size or len(tokenizer)
        self.turn_end = self._find_turn_end()

    def _find_turn_end(self) -> str:
        """The special token that closes an assistant turn, read off a rendered probe."""
        sentinel = "dflash-probe-reply"
        probe = [{"role": "user", "content": "dflash-probe"}, {"role": "assistant", "content": sentinel}]
        text = self.tokenizer.apply_chat_template(probe, tokenize=False)
        rest = text[text.rindex(sentinel) + len(sentinel):]
        found = [(rest.find(token), token) for token in self.tokenizer.get_added_vocab() if token and token in rest]
        if found:
            return min(found)[1]
        if self.tokenizer.eos_token:
            return self.tokenizer.eos_token
        raise InputError("cannot tell how the chat template ends an assistant turn (no special token after the reply)", "Use pre-tokenized rows")

    def render(self, row: dict[str, Any]) -> RenderedChat:
        """The conversation as text, with the character spans of what the assistant generates; a
        regenerated answer stored with its token ids: the generation prompt, and those ids."""
        messages = chat_messages(row)
        if any(m.get("weight", 1) not in (0, 1) for m in messages):
            raise BadRow(INVALID_FIELDS, '"weight" of a message must be 0 (context only) or 1')
        trained = [m["role"] == "assistant" and m.get("weight", 1) == 1 for m in messages]
        if not any(trained):
            raise BadRow(NO_SUPERVISED_TOKENS, "no assistant message" + (" of weight 1" if any(m["role"] == "assistant" for m in messages) else ""))
        tools = row.get("tools")
        generation = row.get("generation")
        try:
            if isinstance(generation, dict) and messages[-1]["role"] == "assistant":  # the target's answer, from the generate step
                prompt = self._apply(messages[:-1], tools, add_generation_prompt=True)
                answer_ids = self._answer_ids(generation)
                if answer_ids is not None:
                    return RenderedChat(prompt, [], answer_ids)
                text = prompt + self._answer_text(generation, messages[-1])
            else:
                text = self._apply(messages, tools, add_generation_prompt=False)
            spans: list[tuple[int, int]] = []
            for i, message in enumerate(messages):
                if trained[i]:
                    start = self._generation_start(text, messages, i, tools)
                    spans.append(self._assistant_span(text, start, message, spans[-1][1] if spans else 0))
        except BadRow:
            raise
        except Exception as exc:  # noqa: BLE001 - jinja raises anything: the row's message says what
            raise BadRow(TEMPLATE_ERROR, f"the chat template failed: {type(exc).__name__}: {exc}") from None
        return RenderedChat(text, spans)

    def _answer_ids(self, generation: dict[str, Any]) -> list[int] | None:
        """The answer's token ids as the target sampled them (its end token included, none where it
        was cut at the limit); None for a row generated without them."""
        ids = generation.get("token_ids")
        if ids is None:
            return None
        if not isinstance(ids, list) or not all(type(token) is int for token in ids):
            raise BadRow(INVALID_FIELDS, '"generation"."token_ids" must be a list of integers')
        outside = [token for token in ids if not 0 <= token < self.answer_vocab_size]
        if outside:
            raise BadRow(OUT_OF_VOCAB, f"the answer holds token id {outside[0]}, outside the target's vocabulary 0..{self.answer_vocab_size - 1}")
        return ids

    def _answer_text(self, generation: dict[str, Any], answer: dict[str, Any]) -> str:
        """A regenerated answer stored as text alone (generated before the token ids were stored), as
        the target generated it after the generation prompt: its text, and the turn's end where it
        stopped. The template would render it otherwise (Qwen's trims the reply and opens it with
        the rest of an empty <think> block the target did not write). An answer a parser split
        (reasoning, tool calls) has no such text: the template would rejoin it, adding a </think>
        and a turn's end the target may not have written (one cut at the limit wrote neither)."""
        if answer.get("reasoning_content") or answer.get("tool_calls"):
            raise BadRow(SPLIT_ANSWER, "the answer came back split by a parser (reasoning_content or tool_calls) and was stored "
                                       "without its token ids: what the target wrote is lost; generate it again without a reasoning parser")
        if not isinstance(answer.get("content"), str):
            raise BadRow(INVALID_FIELDS, "the generated answer has no text content")
        return answer["content"] + (self.turn_end if generation.get("finish_reason") == "stop" else "")

    def _apply(self, messages: list[dict[str, Any]], tools: Any, *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs,
        )

    def _generation_start(self, text: str, messages: list[dict[str, Any]], i: int, tools: Any) -> int:
        """Where the assistant's generation of turn i starts in `text`: after the generation prompt
        where the text holds it; else where the two part, but not past where the turn's content
        starts. That is an earlier turn, which Qwen's templates render without the <think> block
        the generation prompt opens: the texts part at a character, and a reply opening with "<"
        (a "<tool_call>", HTML) agrees with "<think>" for a character or two, which would cut its
        first token in two. Where they part in an earlier turn still (the template renders it by
        what follows it: Qwen's gives a turn a <think> block while no user message follows it,
        as before a tool's result), the turn starts with its content."""
        prompt = self._apply(messages[:i], tools, add_generation_prompt=True)
        if text.startswith(prompt):
            return len(prompt)
        probe = self._apply([*messages[:i], {**messages[i], "content": CONTENT_PROBE}, *messages[i + 1:]], tools, add_generation_prompt=False)
        parted, content_at = (len(os.path.commonprefix([text, other])) for other in (prompt, probe))
        return content_at if self.turn_end in text[parted:content_at] else min(parted, content_at)

    def _assistant_span(self, text: str, start: int, message: dict[str, Any], previous_end: int) -> tuple[int, int]:
        if start < previous_end:
            raise BadRow(TEMPLATE_ERROR, "the chat template renders an earlier turn differently once a later one follows")
        end = text.find(self.turn_end, start)
        end = len(text) if end < 0 else end + len(self.turn_end)
        content = message.get("content")
        # The reply's final text must lie in the span (Qwen's templates drop an inline <think> block).
        if isinstance(content, str) and content.rsplit("</think>", 1)[-1].strip() not in text[start:end]:
            raise BadRow(TEMPLATE_ERROR, "an assistant reply does not appear where the chat template puts the turn")
        return start, end

    def tokenize(self, rendered: list[RenderedChat]) -> list[Tokenized]:
        """Tokenizes rendered conversations in one batch.

        Each assistant turn is tokenized apart from what comes before it, as serving makes it: an
        engine tokenizes the prompt (up to the end of the generation prompt) alone, and the model
        generates the turn token by token after it, so no token spans the generation prompt's end.
        Tokenized whole, text merges across it ("<think>\n" then "\n</think>" is one "\n\n"
        token in Qwen's vocabulary): regeneration would answer one prompt, training and evaluation
        see another, and the drafter learn tokens the target never produces there. A regenerated
        answer's token ids follow its prompt as they are."""
        pieces: list[tuple[int, int]] = []  # (conversation, character where the piece starts)
        texts: list[str] = []
        for index, chat in enumerate(rendered):
            cuts = sorted({0, *(start for start, _ in chat.spans)})
            for begin, end in zip(cuts, [*cuts[1:], len(chat.text)]):
                pieces.append((index, begin))
                texts.append(chat.text[begin:end])
        ids: list[list[int]] = [[] for _ in rendered]
        starts: list[list[int]] = [[] for _ in rendered]
        for (index, begin), encoding in zip(pieces, self.backend.encode_batch(texts, add_special_tokens=False)):
            ids[index].extend(encoding.ids)
            starts[index].extend(begin + first for first, _ in encoding.offsets)
        masks: list[np.ndarray] = []
        spans: list[tuple[int, str, list[int]]] = []  # (conversation, a supervised span's text, its tokens)
        for index, (chat, chat_ids, chat_starts) in enumerate(zip(rendered, ids, starts)):
            token_starts = np.asarray(chat_starts, dtype=np.int64)
            tokens = np.asarray(chat_ids, dtype=np.int64)
            mask = np.zeros(len(chat_ids), dtype=np.uint8)
            for start, end in chat.spans:
                inside = (token_starts >= start) & (token_starts < end)
                mask[inside] = 1
                spans.append((index, chat.text[start:end], tokens[inside].tolist()))
            masks.append(mask)
        result = []
        for chat, chat_ids, mask, differs in zip(rendered, ids, masks, self._retokenized_differently(rendered, spans)):
            if chat.answer_ids is not None:
                chat_ids = chat_ids + chat.answer_ids
                mask = np.concatenate([mask, np.ones(len(chat.answer_ids), dtype=np.uint8)])
            result.append(Tokenized(np.asarray(chat_ids, dtype=np.int32), mask, TEXT if chat.answer_ids is None else TARGET_IDS, differs))
        return result

    def encode(self, rendered: list[RenderedChat]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(input_ids, loss_mask) of each rendered conversation (see `tokenize`)."""
        return [(tokenized.input_ids, tokenized.loss_mask) for tokenized in self.tokenize(rendered)]

    def _retokenized_differently(self, rendered: list[RenderedChat], spans: list[tuple[int, str, list[int]]]) -> list[bool]:
        """Tokenized.retokenized_differently of each conversation: the target's ids against the
        tokens of their decoded text; a supervised span's text against the decoding of its tokens."""
        differs = [False] * len(rendered)
        decoded = self.backend.decode_batch([tokens for _, _, tokens in spans], skip_special_tokens=False) if spans else []
        for (index, text, _), back in zip(spans, decoded):
            differs[index] |= back != text
        target = [(index, chat.answer_ids) for index, chat in enumerate(rendered) if chat.answer_ids is not None]
        if target:
            texts = self.backend.decode_batch([answer for _, answer in target], skip_special_tokens=False)
            for (index, answer), encoding in zip(target, self.backend.encode_batch(texts, add_special_tokens=False)):
                differs[index] = encoding.ids != answer
        return differs


def json_row(line: bytes) -> dict[str, Any]:
    """One line of a JSONL data set as an object; BadRow for a blank line or anything else."""
    if not line.strip():
        raise BadRow(EMPTY, "blank line")
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise BadRow(MALFORMED_JSON, f"not valid JSON ({exc})") from None
    if not isinstance(row, dict):
        raise BadRow(MALFORMED_JSON, f"a JSON {type(row).__name__}, expected an object")
    return row


def chat_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat row's "messages": a non-empty list of objects, each with a string "role"; else BadRow."""
    messages = row["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise BadRow(INVALID_FIELDS, '"messages" must be a list of objects, each with a string "role"')
    if not messages:
        raise BadRow(EMPTY, '"messages" is empty')
    return messages


def parse_pretokenized(row: dict[str, Any], vocab_size: int) -> Tokenized:
    if "loss_mask" not in row:
        raise BadRow(MISSING_FIELDS, 'a pre-tokenized row needs "loss_mask" next to "input_ids"')
    ids, mask = row["input_ids"], row["loss_mask"]
    if not isinstance(ids, list) or not isinstance(mask, list) or not all(type(v) is int for v in ids):
        raise BadRow(INVALID_FIELDS, '"input_ids" must be a list of integers and "loss_mask" a list')
    if not ids:
        raise BadRow(EMPTY, '"input_ids" is empty')
    if len(mask) != len(ids) or not all(v in (0, 1) for v in mask):
        raise BadRow(INVALID_FIELDS, f'"loss_mask" must hold one 0 or 1 per token ({len(mask)} values for {len(ids)} tokens)')
    input_ids = np.asarray(ids, dtype=np.int64)
    outside = input_ids[(input_ids < 0) | (input_ids >= vocab_size)]
    if outside.size:
        raise BadRow(OUT_OF_VOCAB, f"token id {int(outside[0])} is outside the tokenizer's vocabulary 0..{vocab_size - 1}")
    return Tokenized(input_ids.astype(np.int32), np.asarray(mask, dtype=np.uint8))


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


def prompt_length(loss_mask: np.ndarray) -> int:
    """Where the last supervised run of a sample starts: its tokens before it are the eval prompt."""
    supervised = np.flatnonzero(loss_mask)
    if not supervised.size:
        return len(loss_mask)
    gaps = np.flatnonzero(np.diff(supervised) > 1)
    return int(supervised[gaps[-1] + 1] if gaps.size else supervised[0])


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


class Preparer:
    """Turns encoded rows into chunks, the holdout and the index; see the module docstring for the rules."""

    def __init__(self, data: DataSpec, *, storage: Storage, vocab_size: int, strict: bool = False, tokenizer_name: str | None = None,
                 generation: dict[str, Any] | None = None) -> None:
        self.data = data
        self.generation = generation
        self.storage = storage
        self.vocab_size = vocab_size
        self.strict = strict
        self.tokenizer_name = tokenizer_name
        self.stats = PrepareStats()
        # Every bad row, spooled to disk and uploaded at the end: a data set of bad rows costs no memory.
        self.rejected = tempfile.NamedTemporaryFile(prefix="dflash-rejected-", suffix=".jsonl")

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
        started = last_log = time.monotonic()
        for batch in batches:
            for number, outcome in batch:
                sample = self.sample(number, outcome)
                if sample is None:
                    continue
                holdout.append(sample)
                if len(holdout) > self.data.holdout:
                    writer.add(holdout.popleft())
            self.stats.rows += len(batch)
            if time.monotonic() - last_log >= LOG_EVERY_S:
                last_log = time.monotonic()
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
