"""The drafter's mask token: the id that fills every block slot after the anchor (reference/dflash.md
section 2), embedded through the target's own embedding like any token. The drafter learns what that
row means ("a token to predict here"), so no text the drafter reads may put it anywhere: the chat
template never writes it, and no training sample holds it.

The rule (`pick_mask_token`), deterministic:
1. train.mask_token_id where the spec sets it (any row of the target's embedding);
2. the first embedding row past the tokenizer (Qwen3.6: 248,320 rows for about 248K tokens): no
   text tokenizes to it;
3. where the tokenizer uses every row (SmolLM2: 49,152 of 49,152): the lowest special token that is
   none of the tokenizer's bos/eos/pad/unk tokens or the configs' stop and padding ids, whose text
   no chat template of the checkpoint writes, and that no training sample holds: an unused marker,
   such as SmolLM2's code-repository `<repo_name>`;
else training is refused, naming train.mask_token_id as the fix. The export records the pick
(dflash_config.mask_token_id), and vLLM fills the block with it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from dflash_jobs.drafter.checkpoint import TargetCheckpoint
from dflash_jobs.errors import SpecError
from dflash_jobs.formats import TokenChunk, token_chunk_key
from dflash_jobs.rows import chat_template_text
from dflash_jobs.storage import Storage

ROLE_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")
"""tokenizer_config.json's (and special_tokens_map.json's) tokens with a role in every text: never the mask."""
ROLE_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""config.json's and generation_config.json's ids of the same roles (an int or a list)."""
READ_THREADS = 8


@dataclass(frozen=True, slots=True)
class MaskToken:
    id: int
    why: str
    """Which rule chose it, for the training log."""


def pick_mask_token(target: TargetCheckpoint, requested: int | None, *, data_holds: Callable[[list[int]], set[int]]) -> MaskToken:
    """The mask token for a drafter of `target` (the module docstring's rule); `requested`:
    train.mask_token_id; data_holds(ids) -> those of `ids` some training sample holds (read only
    when the rule comes to unused special tokens)."""
    rows = int(target.text["vocab_size"])
    if requested is not None:
        if requested >= rows:
            raise SpecError("train.mask_token_id", requested, f"a row of the target's embedding (0..{rows - 1})")
        return MaskToken(requested, "train.mask_token_id")
    size = target.tokenizer_size()
    if size is None:
        raise SpecError("train.mask_token_id", None, "a token id: the target checkpoint has no tokenizer.json to find a free embedding row or an unused special token in")
    if size < rows:
        return MaskToken(size, f"the first embedding row the tokenizer does not use ({size} tokens, {rows} rows)")
    candidates = unused_special_tokens(target, rows)
    held = data_holds([token for token, _ in candidates]) if candidates else set()
    free = [(token, text) for token, text in candidates if token not in held]
    if not free:
        raise SpecError(
            "train.mask_token_id", None,
            f"a token id: the tokenizer uses all {rows} embedding rows, and none of its special tokens is unused "
            f"({len(candidates)} the chat template never writes, {len(held)} of them in the training data); "
            "set one the drafter may take over, a token the data and the template never hold",
        )
    token, text = free[0]
    return MaskToken(token, f"{text} ({token}): the tokenizer uses all {rows} embedding rows, and it is the lowest of the "
                            f"{len(free)} special tokens no chat template writes, with no role and absent from the training data")


def unused_special_tokens(target: TargetCheckpoint, rows: int) -> list[tuple[int, str]]:
    """(id, text) of the tokenizer's special tokens below `rows`, lowest first, that have no role
    (bos, eos, pad, unk, ...; the configs' stop and padding ids) and that no chat template writes."""
    tokenizer = json.loads(target.read_optional("tokenizer.json") or b"{}")
    template = chat_template_text(target.read_optional)
    role_texts = set()
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        settings = json.loads(target.read_optional(name) or b"{}")
        for role in ROLE_TOKENS:
            value = settings.get(role)
            role_texts.add(value.get("content") if isinstance(value, dict) else value)
    role_ids = set()
    for config in (target.text, target.config, json.loads(target.read_optional("generation_config.json") or b"{}")):
        for role in ROLE_IDS:
            value = config.get(role)
            role_ids.update(value if isinstance(value, list) else [value])
    specials = sorted((entry["id"], entry["content"]) for entry in tokenizer.get("added_tokens", []) if entry.get("special"))
    return [(token, text) for token, text in specials
            if token < rows and token not in role_ids and text not in role_texts and text not in template]


def tokens_in_chunks(storage: Storage, chunks: Sequence[int], ids: Iterable[int]) -> set[int]:
    """Which of `ids` the run's token chunks (tokens/chunks, the training samples) hold: every chunk
    read whole, a few bytes a token, on a few threads."""
    wanted = np.asarray(sorted(set(ids)), dtype=np.int64)

    def held(chunk: int) -> set[int]:
        key = token_chunk_key(chunk)
        tokens = TokenChunk.decode(storage.get_bytes(key), key).input_ids
        return set(wanted[np.isin(wanted, tokens)].tolist())

    with ThreadPoolExecutor(READ_THREADS) as pool:
        return set().union(*pool.map(held, chunks))
