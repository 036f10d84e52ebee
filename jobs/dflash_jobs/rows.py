"""A data set's rows as tokens: reading the JSONL source, the target's tokenizer and chat template,
the loss mask over what the assistant generates (`ChatEncoder`), pre-tokenized rows, and why a row
is dropped (`BadRow` and its reasons). prepare turns these into token chunks; the generate step and
the evaluation read rows and prompts the same way.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator

import numpy as np

from dflash_jobs.errors import InputError, SpecError
from dflash_jobs.spec import is_s3, text_config
from dflash_jobs.storage import ObjectNotFound, open_storage, open_url

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

CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
"""Where a checkpoint keeps its chat template besides tokenizer_config.json's `chat_template` (Transformers 5 writes the first)."""
CHAT_TEMPLATE_FIX = ("Use a checkpoint whose tokenizer carries its chat template (an instruction-tuned model's), add one as "
                     "chat_template.jinja, or give pre-tokenized rows (input_ids, loss_mask)")


def chat_template_text(read: Callable[[str], bytes | None]) -> str:
    """Every chat template a checkpoint's tokenizer files hold, as one text ("" for none), from
    read(file name) -> its bytes or None: tokenizer_config.json's chat_template (one, or a list of
    named ones), chat_template.jinja, chat_template.json."""
    found = []
    for name in ("tokenizer_config.json", *CHAT_TEMPLATE_FILES):
        data = read(name)
        if data is None:
            continue
        if name.endswith(".jinja"):
            found.append(data.decode())
            continue
        template = json.loads(data).get("chat_template")
        found += [template] if isinstance(template, str) else [entry.get("template", "") for entry in template or []]
    return "\n".join(found)


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
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    tokenizer.name_or_path = model  # where it came from, not the temporary directory, for the messages that name it
    return tokenizer


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
            raise InputError(
                f"target.model {tokenizer.name_or_path}: its tokenizer has no chat template (none in tokenizer_config.json, "
                f"{' or '.join(CHAT_TEMPLATE_FILES)}), so chat rows cannot be rendered", CHAT_TEMPLATE_FIX,
            )
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


def prompt_length(loss_mask: np.ndarray) -> int:
    """Where the last supervised run of a sample starts: its tokens before it are the eval prompt."""
    supervised = np.flatnonzero(loss_mask)
    if not supervised.size:
        return len(loss_mask)
    gaps = np.flatnonzero(np.diff(supervised) > 1)
    return int(supervised[gaps[-1] + 1] if gaps.size else supervised[0])
