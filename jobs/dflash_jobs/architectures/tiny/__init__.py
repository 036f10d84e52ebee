"""Tiny targets of the real architectures, for CPU tests, the demo and a benchmark's `--shape tiny`: one
per entry of the architecture seam, in the module of the entry's name (`tiny/qwen3_5.py` beside
`architectures/qwen3_5.py`), so the architectures' registry (ARCHITECTURE_MODULES) is theirs too.

Each module builds its architecture's two halves, `build_tokenizer(vocab_size, corpus)` (a byte-level
BPE with its family's special tokens and chat template) and `random_model(shape, tokenizer)`;
`write_tiny_target` seeds and saves them, built offline and deterministically from `seed`, for
`AutoModelForCausalLM` and `AutoTokenizer` to load as they load the real model. Beside them: the chat
data set they are tested and taught on (chats.py), the short training that makes a target say
something a drafter can learn (teach.py), and the demo's inputs (demo.py).

Like the seam's registry, this module imports neither torch nor transformers: a builder's module is
imported when its architecture is asked for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Iterable

from dflash_jobs.architectures import ARCHITECTURE_MODULES


@dataclass(frozen=True, slots=True)
class TinyTargetShape:
    """A named tiny size, like torchtitan's "debugmodel": small, but every structural feature kept."""

    num_layers: int
    """8 = two [GDN, GDN, GDN, full attention] groups: a full-attention layer followed by GDN layers."""
    hidden_size: int
    vocab_size: int
    """Embedding rows; the tokenizer uses fewer, so the drafter has free rows for its mask token."""
    heads: int = 4
    """Query heads of the attention layers, half as many key/value heads (and Qwen3.5's Gated DeltaNet
    layers: as many value heads, half as many key heads)."""
    head_dim: int = 16


DEBUGMODEL = TinyTargetShape(num_layers=8, hidden_size=64, vocab_size=1024)

MIN_BPE_VOCAB = 300
"""The 256 byte tokens and a few merges: below that, text tokenizes byte by byte."""


def tiny_target_module(architecture: str) -> ModuleType:
    """The module that builds `architecture`'s tiny target (an entry of ARCHITECTURE_MODULES)."""
    if architecture not in ARCHITECTURE_MODULES:
        raise ValueError(f"no target architecture {architecture!r}: one of {', '.join(ARCHITECTURE_MODULES)}")
    return importlib.import_module(f"{__name__}.{architecture}")


def write_tiny_target(
    directory: str | Path,
    *,
    architecture: str = "qwen3_5",
    seed: int = 0,
    num_layers: int = DEBUGMODEL.num_layers,
    hidden_size: int = DEBUGMODEL.hidden_size,
    vocab_size: int = DEBUGMODEL.vocab_size,
    heads: int = DEBUGMODEL.heads,
    head_dim: int = DEBUGMODEL.head_dim,
    corpus: Iterable[str] | None = None,
) -> Path:
    """Writes the tiny target of `architecture` (float32 weights, from `seed`) and its tokenizer into
    `directory`; `corpus`: the text the tokenizer's BPE is trained on (default: the demo's kinds of
    conversation)."""
    import torch

    builder = tiny_target_module(architecture)
    tokenizer = builder.build_tokenizer(vocab_size, corpus)
    shape = TinyTargetShape(num_layers=num_layers, hidden_size=hidden_size, vocab_size=vocab_size, heads=heads, head_dim=head_dim)
    with torch.random.fork_rng(devices=[]):  # the caller's random state untouched
        torch.manual_seed(seed)
        model = builder.random_model(shape, tokenizer)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return Path(directory)


def randomise_degenerate_weights(text_model, pad_token_id: int) -> None:
    """Default init makes norms the identity, dt_bias constant and the pad row zero: tests could pass by accident."""
    import torch

    with torch.no_grad():
        for name, param in text_model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                # Adds noise around the init (0 for `x * (1 + w)` norms, 1 for `x * w` ones and the gated GDN norm).
                param.add_(torch.randn_like(param) * 0.3)
        text_model.embed_tokens.weight[pad_token_id].normal_(0, 0.02)

