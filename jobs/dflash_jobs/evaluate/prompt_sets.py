"""Named prompt sets (eval.prompt_sets): the chat JSONL files users report drafters on (MT-Bench-,
HumanEval-, GSM8K-style), evaluated beside the held-out prompts, a table each.

A row is any chat row (`{"messages": [...]}`, as data.source holds): its prompt is the conversation
up to and including its last user turn, rendered with the target's chat template and its
generation prompt (generate.thinking as prepare renders), whatever answers follow it. Rows that give no
prompt are counted by why, never dropped silently: not JSON or not a chat row (rows.py's reasons),
no user turn (NO_USER_TURN), or a prompt that leaves no room for eval.max_new_tokens within
data.max_length, the context the drafter was trained on (OVER_CONTEXT). A set is read up to
eval.prompts prompts; one that gives none is refused, naming the set, its file and why.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_jobs.errors import InputError, SpecError
from dflash_jobs.rows import MISSING_FIELDS, TEMPLATE_ERROR, BadRow, chat_messages, json_row, load_tokenizer, open_source
from dflash_jobs.spec import RunSpec

NO_USER_TURN = "no_user_turn"
OVER_CONTEXT = "over_context"


@dataclass
class PromptSet:
    """One named set's prompts, and what its file held."""

    name: str
    source: str
    prompts: list[torch.Tensor] = field(default_factory=list)
    rows: int = 0
    """Rows read (up to the last prompt taken)."""
    refused: Counter = field(default_factory=Counter)
    """Rows that gave no prompt, by reason."""

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "rows": self.rows, "prompts": len(self.prompts), "refused": dict(sorted(self.refused.items()))}


def prompt_text(row: dict[str, Any], tokenizer, template_kwargs: dict[str, Any]) -> str:
    """The conversation through its last user turn, with the generation prompt; BadRow where there is none."""
    if "messages" not in row:
        raise BadRow(MISSING_FIELDS, 'no "messages"')
    messages = chat_messages(row)
    users = [i for i, message in enumerate(messages) if message["role"] == "user"]
    if not users:
        raise BadRow(NO_USER_TURN, "no user turn")
    try:
        return tokenizer.apply_chat_template(messages[: users[-1] + 1], tools=row.get("tools"), tokenize=False,
                                             add_generation_prompt=True, **template_kwargs)
    except Exception as exc:  # noqa: BLE001 - jinja raises anything: the row's reason says what
        raise BadRow(TEMPLATE_ERROR, f"the chat template failed: {type(exc).__name__}: {exc}") from None


def read_prompt_set(name: str, source: str, tokenizer, spec: RunSpec) -> PromptSet:
    """The set's first eval.prompts prompts as token ids, and its refused rows by reason."""
    read = PromptSet(name, source)
    room = spec.data.max_length - spec.eval.max_new_tokens
    thinking = None if spec.generate is None else spec.generate.thinking
    template_kwargs = {} if thinking is None else {"enable_thinking": thinking}
    try:
        with open_source(source, endpoint_url=spec.storage.endpoint_url, region=spec.storage.region) as stream:
            for line in stream:
                if len(read.prompts) == spec.eval.prompts:
                    break
                read.rows += 1
                try:
                    ids = tokenizer(prompt_text(json_row(line), tokenizer, template_kwargs), add_special_tokens=False)["input_ids"]
                except BadRow as bad:
                    read.refused[bad.reason] += 1
                    continue
                if len(ids) > room:
                    read.refused[OVER_CONTEXT] += 1
                    continue
                read.prompts.append(torch.tensor(ids, dtype=torch.long))
    except SpecError:  # open_source names data.source
        raise SpecError(f"eval.prompt_sets.{name}", source, "an existing chat JSONL file (local path or s3:// object)") from None
    if not read.prompts:
        raise InputError(
            f"eval.prompt_sets.{name} ({source}) gave no prompt from its {read.rows} rows (refused: {dict(read.refused)})",
            f"Give chat rows ({{\"messages\": [...]}}) with a user turn whose prompt leaves eval.max_new_tokens "
            f"({spec.eval.max_new_tokens}) of room within data.max_length ({spec.data.max_length})",
        )
    return read


def read_prompt_sets(spec: RunSpec) -> list[PromptSet]:
    """Every set of eval.prompt_sets, in its order; [] without any (the tokenizer is not loaded then)."""
    if not spec.eval.prompt_sets:
        return []
    tokenizer = load_tokenizer(spec.target.model, endpoint_url=spec.storage.endpoint_url, region=spec.storage.region)
    return [read_prompt_set(name, source, tokenizer, spec) for name, source in spec.eval.prompt_sets.items()]
