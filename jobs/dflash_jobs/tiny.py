"""A tiny target of the real architecture, and a small chat data set, for CPU tests and the demo.

`write_tiny_target` saves a random-weight Qwen3.5 (`qwen3_5`) checkpoint in the real multimodal
layout (`model.language_model.*`, `model.visual.*`, `lm_head.*`) plus a byte-level BPE tokenizer
with a Qwen3.5-style ChatML template, so the code paths that load Qwen3.6-27B load it unchanged:
`AutoModelForCausalLM.from_pretrained(dir)` gives the text model and `AutoTokenizer.from_pretrained(dir)`
the tokenizer. Everything is built offline and deterministically from `seed`.

`tiny_chat_dataset` writes templated conversations (arithmetic, counting, repeating phrases): text
regular enough that a drafter trained on a few thousand of them learns to predict it.
`teach_tiny_target` trains a checkpoint briefly on text, so that it says something a drafter can
learn to predict (a random target's greedy output is noise, and every drafter's acceptance ~1).

`python -m dflash_jobs.tiny DIR` writes what `dflashctl init --demo DIR` needs: DIR/target (taught
the demo's kind of conversation) and DIR/chats.jsonl. The controller runs it as a subprocess
because it never imports torch itself.

Recipe of the weights: shared/reference/qwen_gdn.md section 5 (norm weights, dt_bias and the pad
embedding row are randomised, otherwise tests of padding and masking pass spuriously).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class TinyTargetShape:
    """A named tiny size, like torchtitan's "debugmodel": small, but every structural feature kept."""

    num_layers: int
    """8 = two [GDN, GDN, GDN, full attention] groups: a full-attention layer followed by GDN layers."""
    hidden_size: int
    vocab_size: int
    """Embedding rows; the tokenizer uses fewer, so the drafter has free rows for its mask token."""


DEBUGMODEL = TinyTargetShape(num_layers=8, hidden_size=64, vocab_size=1024)

UNUSED_EMBEDDING_ROWS = 16
"""Embedding rows past the tokenizer, at least; like Qwen3.6 (248,320 rows for ~248K tokens)."""
MIN_BPE_VOCAB = 300
"""The 256 byte tokens and a few merges: below that, text tokenizes byte by byte."""

# Appended after the BPE vocabulary, in Qwen's order: pad / end of text first, then ChatML, then vision.
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
)
THINK_TOKENS = ("<think>", "</think>")
"""Added but not special, as in Qwen3.5: they are part of the text a model generates."""

# The structure of Qwen3.5/3.6's template, without tools and multimodal content: the system prompt
# first; assistant turns after the last user message carry a <think> block (earlier ones do not, so
# a conversation prefix does not render as a prefix of the conversation); the generation prompt
# opens a <think> block unless enable_thinking is false.
CHAT_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_query_index = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- set reasoning_content = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content | trim + '\\n</think>\\n\\n' + content | trim }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content | trim }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role != 'system' %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}
"""


# ---- the chat data set -----------------------------------------------------------------------

_PHRASES = (
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts several tokens and the target verifies them at once",
    "a block of sixteen tokens is drafted in parallel from the hidden states of the target",
    "kubernetes runs one pod per shard and every chunk lands in object storage",
    "gated delta networks mix linear attention with a few full attention layers",
    "the drafter learns to predict what the target would say next",
)
_SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a careful calculator. Answer briefly.")
_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    op, verb, value = rng.choice((("+", "plus", a + b), ("-", "minus", a - b), ("*", "times", a * b)))
    return f"What is {a} {verb} {b}?", f"{a} {op} {b} = {value}. So {a} {verb} {b} is {value}."


def _counting(rng: random.Random) -> tuple[str, str]:
    start = rng.randint(0, 50)
    stop = start + rng.randint(3, 12)
    return f"Count from {start} to {stop}.", ", ".join(str(i) for i in range(start, stop + 1)) + "."


def _repeat(rng: random.Random) -> tuple[str, str]:
    phrase, times = rng.choice(_PHRASES), rng.randint(2, 4)
    return f"Repeat this {_NUMBER_WORDS[times]} times: {phrase}", " ".join([phrase.capitalize() + "."] * times)


def _spell(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(rng.choice(_PHRASES).split())
    return f"Spell the word '{word}'.", f"{word} is spelled " + "-".join(word.upper()) + "."


_TOPICS = (_arithmetic, _counting, _repeat, _spell)


def tiny_chat_conversation(rng: random.Random) -> list[dict[str, str]]:
    """One conversation: an optional system prompt, then one to three question/answer turns."""
    messages = [{"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)}] if rng.random() < 0.3 else []
    for _ in range(rng.choice((1, 1, 2, 3))):
        question, answer = rng.choice(_TOPICS)(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


def tiny_chat_rows(n: int, seed: int = 0) -> Iterator[dict[str, Any]]:
    rng = random.Random(seed)
    for _ in range(n):
        yield {"messages": tiny_chat_conversation(rng)}


def tiny_chat_dataset(path: str | Path, n: int, seed: int = 0) -> Path:
    """Writes `n` conversations as chat JSONL ({"messages": [...]}, one per line) to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in tiny_chat_rows(n, seed):
            f.write(json.dumps(row) + "\n")
    return path


# ---- the tokenizer ---------------------------------------------------------------------------


def tokenizer_corpus() -> Iterator[str]:
    """The BPE training text: turns of the data set's kinds, so its tokens fit the demo data."""
    for row in tiny_chat_rows(1000, seed=12345):
        for message in row["messages"]:
            yield f"{message['role']}\n{message['content']}"
    yield from _PHRASES


def build_tiny_tokenizer(vocab_size: int, corpus: Iterable[str] | None = None):
    """A Qwen3.5 tokenizer (Qwen's pre-tokenizer regex, byte-level BPE) with a small vocabulary
    trained on `corpus` (default: turns of the demo's kinds of conversation).

    transformers loads any `qwen3_5` checkpoint's tokenizer as `Qwen3_5Tokenizer`, which rebuilds
    the normaliser and pre-tokenizer itself, so the BPE is trained under exactly that pipeline.
    It has at most `vocab_size - UNUSED_EMBEDDING_ROWS` tokens, special tokens included.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    added = len(SPECIAL_TOKENS) + len(THINK_TOKENS)
    size = vocab_size - UNUSED_EMBEDDING_ROWS - added
    if size < MIN_BPE_VOCAB:
        raise ValueError(f"vocab_size={vocab_size} is too small for the tiny tokenizer: use >= {MIN_BPE_VOCAB + UNUSED_EMBEDDING_ROWS + added}")
    pipeline = Qwen3_5Tokenizer().backend_tokenizer
    backend = Tokenizer(models.BPE())
    backend.normalizer = pipeline.normalizer
    backend.pre_tokenizer = pipeline.pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(tokenizer_corpus() if corpus is None else corpus, trainer=trainer)
    bpe = json.loads(backend.to_str())["model"]
    # Special and think tokens take the ids after the BPE vocabulary, in a fixed order (as in Qwen's).
    vocab = dict(bpe["vocab"])
    for token in SPECIAL_TOKENS + THINK_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen3_5Tokenizer(
        vocab=vocab,
        merges=[tuple(merge) for merge in bpe["merges"]],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
    )
    tokenizer.add_tokens(list(SPECIAL_TOKENS), special_tokens=True)
    tokenizer.add_tokens(list(THINK_TOKENS))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# ---- the checkpoint --------------------------------------------------------------------------


def tiny_target_config(*, num_layers: int, hidden_size: int, vocab_size: int, token_ids: dict[str, int], heads: int = 4, head_dim: int = 16):
    """Qwen3_5Config with the text model scaled down and every structural feature of the 27B kept.
    `heads` query heads of `head_dim` in the attention layers, half as many key/value heads; the
    Gated DeltaNet layers have `heads` value heads and half as many key heads of the same width."""
    from transformers import Qwen3_5Config

    rotary_pairs = head_dim // 8  # head_dim x partial_rotary_factor (0.25) / 2, split over (t, h, w) like the 27B's [11, 11, 10]
    mrope_section = [(rotary_pairs + 2) // 3, (rotary_pairs + 1) // 3, rotary_pairs // 3]

    text_config = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "head_dim": head_dim,
        # GVA > 1 (more value heads than key heads), like the 27B's 16 -> 48.
        "linear_num_key_heads": heads // 2,
        "linear_num_value_heads": heads,
        "linear_key_head_dim": head_dim,
        "linear_value_head_dim": head_dim,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
            "mrope_section": mrope_section, "mrope_interleaved": True,
        },
        "max_position_embeddings": 32768,
        "pad_token_id": token_ids["<|endoftext|>"],
        "eos_token_id": token_ids["<|im_end|>"],
        "tie_word_embeddings": False,
    }
    vision_config = {
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": hidden_size,
    }
    return Qwen3_5Config(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def randomise_degenerate_weights(text_model, pad_token_id: int) -> None:
    """Default init makes norms the identity, dt_bias constant and the pad row zero: tests could pass by accident."""
    import torch

    with torch.no_grad():
        for name, param in text_model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                # Adds noise around the init (0 for `x * (1 + w)` norms, 1 for `x * w` ones and the gated GDN norm).
                param.add_(torch.randn_like(param) * 0.3)
        text_model.embed_tokens.weight[pad_token_id].normal_(0, 0.02)


def write_tiny_target(
    directory: str | Path,
    *,
    seed: int = 0,
    num_layers: int = DEBUGMODEL.num_layers,
    hidden_size: int = DEBUGMODEL.hidden_size,
    vocab_size: int = DEBUGMODEL.vocab_size,
    heads: int = 4,
    head_dim: int = 16,
    corpus: Iterable[str] | None = None,
) -> Path:
    """Writes a random-weight Qwen3.5 checkpoint (float32) and its tokenizer into `directory`;
    `corpus`: the text the tokenizer's BPE is trained on (default: the demo's kinds of conversation)."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    directory = Path(directory)
    tokenizer = build_tiny_tokenizer(vocab_size, corpus)
    token_ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = tiny_target_config(num_layers=num_layers, hidden_size=hidden_size, vocab_size=vocab_size, token_ids=token_ids,
                                heads=heads, head_dim=head_dim)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5ForConditionalGeneration(config).eval()
        randomise_degenerate_weights(model.model.language_model, token_ids["<|endoftext|>"])
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


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


# ---- the demo's inputs -----------------------------------------------------------------------

DEMO_LAYERS = 4
DEMO_CONVERSATIONS = 1200
DEMO_TEACHING_STEPS = 300


def write_demo_inputs(directory: str | Path, *, conversations: int = DEMO_CONVERSATIONS,
                      teaching_steps: int = DEMO_TEACHING_STEPS) -> dict[str, Any]:
    """DIR/target, taught on other conversations of the same kinds, and DIR/chats.jsonl."""
    import torch
    from transformers import AutoTokenizer

    directory = Path(directory)
    torch.manual_seed(0)
    target = write_tiny_target(directory / "target", num_layers=DEMO_LAYERS)
    taught = None
    if teaching_steps:
        tokenizer = AutoTokenizer.from_pretrained(target)
        # Other conversations than the data set's (seed 7): the target generalises, it does not recite.
        texts = [tokenizer.apply_chat_template(row["messages"], tokenize=False) for row in tiny_chat_rows(4000, seed=7)]
        taught = teach_tiny_target(target, texts, steps=teaching_steps, batch=16, length=128, lr=3e-3)
    chats = tiny_chat_dataset(directory / "chats.jsonl", conversations)
    return {"target": str(target), "chats": str(chats), "conversations": conversations, "teaching": taught}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the demo's tiny target and chat data set into DIR.")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--conversations", type=int, default=DEMO_CONVERSATIONS)
    parser.add_argument("--teaching-steps", type=int, default=DEMO_TEACHING_STEPS,
                        help="training steps of the target on the demo's kind of text (0: random weights)")
    args = parser.parse_args(argv)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # one bar per saved shard is noise under the demo's progress
    print(json.dumps(write_demo_inputs(args.directory, conversations=args.conversations, teaching_steps=args.teaching_steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
