"""A short training of the tiny Qwen3.5 target, so that it says something a drafter can learn to
predict: a random target's greedy output is noise, and every drafter's acceptance ~1. The demo
teaches its target the demo's kind of conversation (demo.py); the quality benchmark teaches its own.
"""

from __future__ import annotations

import math
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    import torch


@contextmanager
def reference_delta_rule() -> Iterator[None]:
    """The Gated DeltaNet's torch reference in place of flash-linear-attention's kernels, while the
    tiny target trains: FLA refuses its own backward on Hopper under Triton < 3.7.1 (its gated
    chunk_bwd_dqkwg gives wrong results there), and a few hundred steps at this size do not need
    it. Extraction and generation, forward only, keep the fast kernels."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5

    fused = qwen3_5.torch_chunk_gated_delta_rule
    reference = fused
    while hasattr(reference, "__wrapped__"):  # transformers wraps the torch reference with its kernel lookup
        reference = reference.__wrapped__
    qwen3_5.torch_chunk_gated_delta_rule = reference
    try:
        yield
    finally:
        qwen3_5.torch_chunk_gated_delta_rule = fused


TokenStream = tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]
"""Texts end to end: their tokens, per token whether it is a label, and where windows may start."""


def teach_tiny_target(
    directory: str | Path,
    texts: list[str] | list[list[int]],
    *,
    steps: int,
    batch: int,
    length: int,
    lr: float,
    seconds: float = math.inf,
    device: str = "cpu",
    held_out: list[str] | list[list[int]] | None = None,
    supervised: list[list[int]] | None = None,
    held_out_supervised: list[list[int]] | None = None,
    from_text_starts: bool = False,
) -> dict[str, Any]:
    """Trains the checkpoint in `directory` in place, next-token prediction on `texts` concatenated
    (strings, or token ids where the caller tokenizes them as the target will be served).

    `supervised` (token-id texts only): per token, 1 where it is a label, as a chat model is
    fine-tuned on its answers only; None: every token is. Stops after `steps` or `seconds`,
    whichever comes first; returns how far it got, the loss at both ends and, given `held_out`
    texts (with `held_out_supervised` marking their labels), the mean loss over windows of them
    after training. `from_text_starts`: every window begins where a text does, so a chat is seen
    from its prompt (a window cut inside one asks for an answer without its question). Only the language model trains: the vision tower is saved as it was, so the
    checkpoint keeps its multimodal layout."""
    import torch
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(directory)
    stream = token_stream(tokenizer, texts, supervised, length=length, from_text_starts=from_text_starts)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).to(device).train()
    text_model, head = model.model.language_model, model.lm_head
    parameters = [*text_model.parameters(), *head.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    started = time.monotonic()
    schedule = warmup_cosine(optimizer, steps=steps, seconds=seconds, started=started)
    generator = torch.Generator().manual_seed(2)

    def loss_of(stream: TokenStream) -> torch.Tensor:
        windows = random_windows(stream, batch=batch, length=length, generator=generator, device=device)
        return next_token_loss(text_model, head, windows, device)

    losses: list[float] = []
    deadline = started + seconds
    done = 0
    with reference_delta_rule():
        while done < steps and time.monotonic() < deadline:
            loss = loss_of(stream)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            if done % 50 == 0 or done + 1 == steps or time.monotonic() > deadline:
                losses.append(loss.item())
                print(f"target step {done}/{steps}: loss {losses[-1]:.3f}", file=sys.stderr, flush=True)
            done += 1
        model.eval()
        taught = {"steps": done, "tokens_seen": done * batch * length, "loss_first": losses[0], "loss_last": losses[-1]}
        if held_out:
            held_out_stream = token_stream(tokenizer, held_out, held_out_supervised, length=length, from_text_starts=from_text_starts)
            with torch.no_grad():
                taught["held_out_loss"] = sum(loss_of(held_out_stream).item() for _ in range(8)) / 8
                taught["held_out_tokens"] = len(held_out_stream[0])
    model.save_pretrained(directory)
    return taught


def token_stream(tokenizer, texts: list[str] | list[list[int]], labels: list[list[int]] | None, *, length: int,
                 from_text_starts: bool) -> TokenStream:
    """`texts` (strings, or token ids) as a stream; `labels` marks each text's label tokens (None: every token is one)."""
    import torch

    tokenized = texts if isinstance(texts[0], list) else tokenizer(texts, add_special_tokens=False)["input_ids"]
    stream = torch.tensor([t for ids in tokenized for t in ids])
    if len(stream) <= length + 1:
        raise ValueError(f"{len(stream)} tokens of text are too few to train on windows of {length}")
    starts = window_starts([len(ids) for ids in tokenized], length, from_text_starts)
    if labels is None:
        return stream, torch.ones(len(stream), dtype=torch.bool), starts
    if [len(mask) for mask in labels] != [len(ids) for ids in tokenized]:
        raise ValueError("supervised must hold one flag per token of every text")
    return stream, torch.tensor([flag for mask in labels for flag in mask], dtype=torch.bool), starts


def random_windows(stream: TokenStream, *, batch: int, length: int, generator, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` random windows of length + 1 tokens, and which of their tokens are labels."""
    import torch

    tokens, labels, allowed = stream
    starts = allowed[torch.randint(0, len(allowed), (batch,), generator=generator)].tolist()
    return (torch.stack([tokens[s : s + length + 1] for s in starts]).to(device),
            torch.stack([labels[s : s + length + 1] for s in starts]).to(device))


def next_token_loss(text_model, head, windows: tuple[torch.Tensor, torch.Tensor], device: str) -> torch.Tensor:
    """Cross-entropy of every window's next token, over its label tokens only."""
    import torch
    import torch.nn.functional as F

    tokens, labels = windows
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=torch.device(device).type == "cuda"):
        hidden = text_model(input_ids=tokens[:, :-1]).last_hidden_state
        losses = F.cross_entropy(head(hidden).float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
    weights = labels[:, 1:].flatten().float()
    return (losses * weights).sum() / weights.sum().clamp(min=1)


def warmup_cosine(optimizer, *, steps: int, seconds: float, started: float):
    """A linear warm-up over the first 5% of steps, then a cosine to zero that ends at `steps` or at
    `seconds` after `started`, whichever comes first."""
    import torch

    warmup = max(1, steps // 20)

    def progress(step: int) -> float:
        return min(1.0, max(step / steps, (time.monotonic() - started) / seconds))

    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * progress(step))))


def window_starts(lengths: list[int], length: int, from_text_starts: bool):
    """Where a window of length + 1 tokens may start in the texts of `lengths` laid end to end:
    anywhere, or only where a text starts."""
    import torch

    total = sum(lengths)
    if not from_text_starts:
        return torch.arange(total - length - 1)
    starts = torch.cumsum(torch.tensor([0, *lengths[:-1]]), 0)
    return starts[starts < total - length - 1]

