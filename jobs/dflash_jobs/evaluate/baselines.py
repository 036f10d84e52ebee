"""The bars a trained drafter has to clear: prompt lookup (n-gram) decoding, training-free, and a
bigram table fitted on the run's own training rows.

Prompt lookup drafts by copying: find the last n tokens earlier in the sequence and propose what
followed them there. It is strong on text that repeats its input (code edits, summaries with
quotes) and free to run. This follows Transformers' `prompt_lookup_num_tokens`
(`PromptLookupCandidateGenerator`): n from `max_ngram` down to 1, the earliest occurrence with a
continuation wins, and it drafts up to `num_tokens` tokens. It runs in the same verify loop as
the DFlash drafter (`speculative_decode`), so the two acceptance lengths compare like for like.

The bigram table is the simplest thing a trained drafter could have learned from its data: for
every token, the token that most often followed it in the training rows, counted on exactly the
pairs the drafter's first slot is trained on (PAIRS_COUNTED). It drafts a block by chaining those
successors from the anchor. A drafter whose first drafted token does no better than the table has
learned no more about the next token than the data's pair counts hold; the gap at later positions
is what its context (the target's states) buys. It runs in the same verify loop as the others.

Both draft from the committed tokens alone, on the host (`reads_host`), so along greedy's output
their decoding is known without the target (`along_greedy`, tested equal to the verify loop): the
evaluation computes their acceptance so on every prompt and decodes them for real on the timed
subset only, for their speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from dflash_jobs.drafter.speculative import Decoded, accepted_prefix, finished, through_stop
from dflash_jobs.errors import InputError
from dflash_jobs.formats import DATASET_KEY, MANIFEST_KEY, ChunkInfo, DatasetIndex, Manifest, TokenChunk, token_chunk_key
from dflash_jobs.storage import Storage
from dflash_jobs.train.anchors import anchor_candidates


class PromptLookupDrafter:
    """A `BlockDrafter` that copies continuations of the trailing n-gram from earlier in the sequence;
    it reads the committed tokens on the host (a search on the device would wait for it every step)."""

    target_layers: list[int] = []
    reads_host = True

    def __init__(self, block_size: int, max_ngram: int = 2) -> None:
        if block_size < 2 or max_ngram < 1:
            raise ValueError(f"block_size must be >= 2 and max_ngram >= 1, got {block_size} and {max_ngram}")
        self.block_size = block_size
        self.drafts = block_size - 1
        self.max_ngram = max_ngram

    def propose(self, tokens: Sequence[int], context: torch.Tensor | None = None) -> torch.Tensor:
        return torch.tensor(self.draft(tokens), dtype=torch.long)

    def draft(self, tokens: Sequence[int]) -> list[int]:
        """The drafts after `tokens` (the committed ids, the anchor last)."""
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            trailing = list(tokens[-n:])
            # The earliest start with something after its n-gram: the trailing n-gram itself has nothing.
            begin = next((start + n for start in range(length - n) if tokens[start : start + n] == trailing), None)
            if begin is not None:
                return list(tokens[begin : begin + self.drafts])
        return []


def along_greedy(drafter: PromptLookupDrafter | BigramDrafter, prompt: Sequence[int], greedy: Sequence[int], *, max_new_tokens: int,
                 stop_ids: frozenset[int]) -> Decoded:
    """The verify loop's decoding with `drafter` (its drafts a function of the committed tokens
    alone), computed along greedy's output without running the target: a lossless loop's output is
    greedy's, so each step commits the drafts greedy's output agrees with and greedy's next token,
    cut at a stop token and drafted no further than the output has room for, exactly as
    `speculative_decode` steps (`seconds` is 0: nothing was decoded; the timed subset gives the speed)."""
    history = [*prompt, *greedy[:1]]
    accepted, drafted = [], []
    while not finished(history[len(prompt) :], max_new_tokens, stop_ids):
        position = len(history) - len(prompt)  # output tokens committed; the next step's anchor is the last
        drafts = drafter.draft(history)[: min(drafter.drafts, max_new_tokens - position - 1)]
        matched = accepted_prefix(drafts, greedy[position:])
        block = [*drafts[:matched], *greedy[position + matched : position + matched + 1]]
        accepted.append(through_stop(block, stop_ids) - 1)
        drafted.append(len(drafts))
        history.extend(block[: accepted[-1] + 1])
    return Decoded(tokens=history[len(prompt) :], seconds=0.0, accepted=accepted, drafted=drafted)


# ---- the bigram table ------------------------------------------------------------------------

BIGRAM_MAX_TOKENS = 1 << 25
"""Token rows (ids and loss mask, 5 bytes a token) the bigram table is fitted on at most: 33.6M, 168 MB
read from tokens/chunks/ and seconds of counting, however large the run. A run with more is
sampled: whole chunks in a random order (fixed seed), the first one whatever its size."""


@dataclass
class BigramTable:
    """The most frequent successor of every token seen, from the training rows, and what it was counted on."""

    successors: dict[int, int]
    """token -> the token that followed it most often (the smallest id among equally frequent ones)."""
    fit: dict[str, Any]
    """What the table was counted on (report.json's `bigram`)."""


PAIRS_COUNTED = ("(x[p], x[p + 1]) for every p of one sample with loss_mask[p] = loss_mask[p + 1] = 1: the anchor "
                 "and the first drafted label of every anchor a training block may start at (train/anchors.py)")


def counted_pairs(chunk: TokenChunk) -> np.ndarray:
    """The chunk's counted pairs (PAIRS_COUNTED) as int64 keys previous << 32 | next."""
    anchors = anchor_candidates(chunk.loss_mask)
    # Samples lie end to end: a pair across a boundary is not one sample's.
    anchors = anchors[~np.isin(anchors + 1, chunk.cu_seqlens[1:-1])]
    ids = chunk.input_ids.astype(np.int64)
    return ids[anchors] << 32 | ids[anchors + 1]


def training_chunks(storage: Storage) -> list[ChunkInfo]:
    """The token chunks training read: the verified ones of stored states, else (online) prepare's."""
    if storage.exists(MANIFEST_KEY):
        where, chunks = MANIFEST_KEY, [ChunkInfo(m.chunk, token_chunk_key(m.chunk), m.samples, m.tokens)
                                       for m in Manifest.from_json(storage.get_bytes(MANIFEST_KEY)).chunks]
    elif storage.exists(DATASET_KEY):
        where, chunks = DATASET_KEY, DatasetIndex.from_json(storage.get_bytes(DATASET_KEY), DATASET_KEY).chunks
    else:
        raise InputError(f"{storage.url} has no {MANIFEST_KEY} and no {DATASET_KEY}: the bigram baseline is fitted on the rows training read",
                         "Evaluate a run that was prepared and trained on (`dflashctl run`)")
    if not chunks:
        raise InputError(f"{storage.url}/{where} lists no chunks: no training rows to fit the bigram baseline on",
                         "Check data.source and re-run prepare (and extraction, for stored states)")
    return chunks


def fit_bigram(storage: Storage, *, max_tokens: int = BIGRAM_MAX_TOKENS, seed: int = 0) -> BigramTable:
    """The bigram table of the rows training read (their token chunks under tokens/chunks/: those
    extract/manifest.json lists where training read stored states, else, online, those
    tokens/dataset.json lists; the held-out samples are not among them): PAIRS_COUNTED, over whole
    chunks drawn in a random order until the next would pass `max_tokens` token rows. The pairs are
    counted in one sort at the end: at most 8 bytes a token read (268 MB at the default cap)."""
    chunks = training_chunks(storage)

    pairs: list[np.ndarray] = []
    tokens_read = chunks_read = 0
    for i in np.random.default_rng(seed).permutation(len(chunks)):
        info = chunks[i]
        if chunks_read and tokens_read + info.tokens > max_tokens:
            break
        key = token_chunk_key(info.id)
        pairs.append(counted_pairs(TokenChunk.decode(storage.get_bytes(key), key)))
        tokens_read += info.tokens
        chunks_read += 1
    keys, counts = np.unique(np.concatenate(pairs), return_counts=True)
    previous, following = keys >> 32, keys & 0xFFFFFFFF
    order = np.lexsort((following, -counts, previous))  # by previous token, then most frequent first, then smallest id
    first = order[np.r_[True, previous[order][1:] != previous[order][:-1]]] if len(order) else order
    fit = {
        "pairs_counted": PAIRS_COUNTED, "max_tokens": max_tokens,
        "chunks_read": chunks_read, "chunks": len(chunks), "tokens_read": tokens_read, "tokens": sum(c.tokens for c in chunks),
        "pairs": int(counts.sum()), "distinct_pairs": len(keys), "previous_tokens": len(first),
    }
    return BigramTable(dict(zip(previous[first].tolist(), following[first].tolist())), fit)


class BigramDrafter:
    """A `BlockDrafter` that chains the bigram table's most likely next token from the anchor, up to
    `drafts` tokens, stopping early at a token the table never saw followed; it reads the anchor on the host."""

    target_layers: list[int] = []
    reads_host = True

    def __init__(self, table: BigramTable, block_size: int) -> None:
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {block_size}")
        self.successors = table.successors
        self.block_size = block_size
        self.drafts = block_size - 1

    def propose(self, tokens: Sequence[int], context: torch.Tensor | None = None) -> torch.Tensor:
        return torch.tensor(self.draft(tokens), dtype=torch.long)

    def draft(self, tokens: Sequence[int]) -> list[int]:
        """The drafts after `tokens` (the committed ids, the anchor last)."""
        drafts, token = [], tokens[-1]
        while len(drafts) < self.drafts and (token := self.successors.get(token)) is not None:
            drafts.append(token)
        return drafts
