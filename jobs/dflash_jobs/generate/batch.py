"""The one contract between generation and its engines: OpenAI batch request and response JSONL.

A request line is OpenAI's Batch API input, as `vllm run-batch` reads it:

    {"custom_id": "line-17", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...], "max_completion_tokens": 512, "temperature": 0.7,
              "top_p": 0.8, "seed": 1234, "return_token_ids": true,
              "chat_template_kwargs": {"enable_thinking": false}}}

An output line is vLLM's `BatchRequestOutput`:

    {"id": "vllm-...", "custom_id": "line-17",
     "response": {"status_code": 200, "request_id": "vllm-batch-...", "body": {<chat.completion>}},
     "error": null}

where the chat.completion holds `choices[0].message` (`content`, and `reasoning` or
`reasoning_content` when a reasoning parser split them), `choices[0].finish_reason` ("stop" or
"length"), `usage`, and, since the request asks `return_token_ids`, `choices[0].token_ids` (and
`prompt_token_ids`): the ids the target sampled, the end token it stopped on included (vLLM leaves
that token out of the text, not out of the ids). Training learns those ids: the text does not give
them back (a sampled split the tokenizer would not make, text it normalises, which end token). A
vLLM before 0.10.2 ignores `return_token_ids` and returns no ids. vLLM before the
`status_code`/`body` wrapper wrote the chat.completion itself as `response`; a failed request has
no body and an `error`: a message, or an error object (`{"object": "error", "message", "type",
"code"}`, or `{"error": {"message", ...}}` in newer vLLM).
Every shape is read here, and the transformers engine writes the current one, so both engines end
in the same parser. The custom id carries the prompt's line: answers can come back in any order.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from dflash_jobs.errors import DflashError
from dflash_jobs.spec import GenerateSpec

CHAT_COMPLETIONS = "/v1/chat/completions"
CUSTOM_ID_PREFIX = "line-"
OWN_MESSAGE_KEYS = ("weight",)
"""Keys of a source message that are ours (training weights), never sent to an engine."""


class EngineError(DflashError):
    """The engine failed a whole chunk (crashed, or wrote what no parser reads): the pod retries."""


def custom_id(sample_id: int) -> str:
    return f"{CUSTOM_ID_PREFIX}{sample_id}"


def sample_id_of(value: Any) -> int:
    text = str(value)
    if not text.startswith(CUSTOM_ID_PREFIX) or not text[len(CUSTOM_ID_PREFIX):].isdigit():
        raise EngineError(f"a batch output line has custom_id {value!r}, not one of this job's requests (line-<n>)")
    return int(text[len(CUSTOM_ID_PREFIX):])


def engine_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as an engine gets them: without our own keys."""
    return [{k: v for k, v in m.items() if k not in OWN_MESSAGE_KEYS} for m in messages]


def request(
    sample_id: int,
    messages: list[dict[str, Any]],
    *,
    tools: list[Any] | None,
    model: str,
    settings: GenerateSpec,
    max_tokens: int,
    seed: int,
) -> dict[str, Any]:
    """One request line: the conversation, the sampling settings and this prompt's token limit and seed."""
    body: dict[str, Any] = {
        "model": model,
        "messages": engine_messages(messages),
        "max_completion_tokens": max_tokens,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "seed": seed,
        "return_token_ids": True,
    }
    if settings.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": settings.thinking}
    if tools:
        # In the prompt as the template renders them; "none": the answer is text (no tool parser runs).
        body["tools"] = tools
        body["tool_choice"] = "none"
    return {"custom_id": custom_id(sample_id), "method": "POST", "url": CHAT_COMPLETIONS, "body": body}


@dataclass(frozen=True, slots=True)
class Answer:
    sample_id: int
    content: str
    reasoning: str | None
    tool_calls: list[Any] | None
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int] | None = None
    """The answer as the target sampled it, its end token included (none when cut at the limit);
    None when the engine returned no ids."""

    @property
    def empty(self) -> bool:
        return not self.content.strip() and not (self.reasoning or "").strip() and not self.tool_calls

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass(frozen=True, slots=True)
class Failure:
    """The engine refused or failed one prompt (too long for the model, a template error, ...)."""

    sample_id: int
    status: int | None
    message: str


def parse_output(line: str | bytes) -> Answer | Failure:
    """One output line, in any shape vLLM writes (see the module docstring)."""
    try:
        record = json.loads(line)
    except ValueError:
        raise EngineError(f"a batch output line is not JSON: {line[:200]!r}") from None
    if not isinstance(record, dict) or "custom_id" not in record:
        raise EngineError(f"a batch output line has no custom_id: {str(line)[:200]}")
    sample_id = sample_id_of(record["custom_id"])
    response = record.get("response") or {}
    body = response.get("body") if "body" in response or "status_code" in response else response
    status = response.get("status_code")
    error = record.get("error")
    if error is not None or not body or (status is not None and status != 200):
        return Failure(sample_id, status or _error_code(error), _error_message(error) or f"HTTP status {status} without a body")
    try:
        choice = body["choices"][0]
        message = choice["message"]
        usage = body.get("usage") or {}
        return Answer(
            sample_id=sample_id,
            content=message.get("content") or "",
            reasoning=message.get("reasoning_content") or message.get("reasoning") or None,
            tool_calls=message.get("tool_calls") or None,
            finish_reason=choice.get("finish_reason") or "stop",
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            token_ids=_token_ids(choice.get("token_ids")),
        )
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise EngineError(f"batch output for {record['custom_id']} is not a chat completion ({type(exc).__name__}: {exc})") from None


def _token_ids(value: Any) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(type(token) is int for token in value):
        raise TypeError(f"token_ids is not a list of integers: {str(value)[:80]}")
    return value


def _error_message(error: Any) -> str | None:
    if error is None:
        return None
    if isinstance(error, dict):
        inner = error.get("error") if isinstance(error.get("error"), dict) else error
        return str(inner.get("message") or json.dumps(error))
    return str(error)


def _error_code(error: Any) -> int | None:
    if isinstance(error, dict):
        inner = error.get("error") if isinstance(error.get("error"), dict) else error
        code = inner.get("code")
        return int(code) if isinstance(code, int) or (isinstance(code, str) and code.isdigit()) else None
    return None


# ---- writing outputs: the transformers engine answers in vLLM's shape ------------------------


def completion_line(
    request_id: str, *, model: str, content: str, finish_reason: str, prompt_ids: list[int], token_ids: list[int] | None,
    completion_tokens: int,
) -> dict[str, Any]:
    """A chat.completion line; `token_ids` (the answer's, its end token included) and `prompt_ids`
    are written as vLLM writes them for a request with return_token_ids, when `token_ids` is given."""
    prompt_tokens = len(prompt_ids)
    body = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                     "finish_reason": finish_reason, "stop_reason": None, "token_ids": token_ids}],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens, "completion_tokens": completion_tokens},
        "prompt_token_ids": None if token_ids is None else prompt_ids,
    }
    return {"id": f"batch-{uuid.uuid4().hex}", "custom_id": request_id,
            "response": {"status_code": 200, "request_id": f"batch-{uuid.uuid4().hex}", "body": body}, "error": None}


def error_line(request_id: str, *, status: int, message: str) -> dict[str, Any]:
    return {"id": f"batch-{uuid.uuid4().hex}", "custom_id": request_id,
            "response": {"status_code": status, "request_id": f"batch-{uuid.uuid4().hex}", "body": None}, "error": message}
