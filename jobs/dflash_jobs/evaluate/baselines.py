"""Training-free drafting, the bar a trained drafter has to clear: prompt lookup (n-gram) decoding.

Prompt lookup drafts by copying: find the last n tokens earlier in the sequence and propose what
followed them there. It is strong on text that repeats its input (code edits, summaries with
quotes) and free to run. This follows Transformers' `prompt_lookup_num_tokens`
(`PromptLookupCandidateGenerator`): n from `max_ngram` down to 1, the earliest occurrence with a
continuation wins, and it drafts up to `num_tokens` tokens. It runs in the same verify loop as
the DFlash drafter (`speculative_decode`), so the two acceptance lengths compare like for like.
"""

from __future__ import annotations

import torch


class PromptLookupDrafter:
    """A `BlockDrafter` that copies continuations of the trailing n-gram from earlier in the sequence."""

    target_layers: list[int] = []

    def __init__(self, block_size: int, max_ngram: int = 2) -> None:
        if block_size < 2 or max_ngram < 1:
            raise ValueError(f"block_size must be >= 2 and max_ngram >= 1, got {block_size} and {max_ngram}")
        self.block_size = block_size
        self.drafts = block_size - 1
        self.max_ngram = max_ngram

    def propose(self, tokens: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            windows = tokens.unfold(0, n, 1)  # [length - n + 1, n]: every n-gram, by start position
            starts = (windows == tokens[-n:]).all(dim=1).nonzero()[:, 0]
            # The last window is the trailing n-gram itself, with nothing after it.
            starts = starts[starts + n < length]
            if len(starts):
                begin = int(starts[0]) + n
                return tokens[begin : begin + self.drafts]
        return tokens[:0]
