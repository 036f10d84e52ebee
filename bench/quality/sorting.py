"""The sorting task (tasks.py): a small target of the real architecture (Qwen3.5/3.6: Gated DeltaNet
and gated attention layers 3:1, multimodal checkpoint layout), with a byte-level BPE tokenizer
trained on the Python standard library's source, fine-tuned here to sort the words a chat gives it
(corpus.py says why this task, and who writes which answers).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from dflash_jobs.rows import ChatEncoder
from dflash_jobs.architectures.tiny import write_tiny_target
from dflash_jobs.architectures.tiny.teach import teach_tiny_target

from corpus import INSTRUCTION, WRITERS, ChatShape, chats, drafter_chats, stdlib_sources, vocabulary
from diversity import diversity, held_out_answers
from goals import Goals
from tasks import ChatCounts, ChatSet

if TYPE_CHECKING:
    import torch


TARGET_HELD_OUT_CHATS = 500
"""Chats (none of them the data set's or the target's training) the target's held-out loss is measured on."""


SORTING_GOALS = Goals("issue 29: the sorting target", tau_at_least=3.0, over_prompt_lookup_at_least=1.5)


@dataclass(frozen=True, slots=True)
class SortingTask:
    """A target taught here to sort 4-12 words, and the chats it is asked."""

    target_layers: int
    target_hidden: int
    target_heads: int
    target_head_dim: int
    vocab_size: int
    """Embedding rows of the target; its BPE tokenizer leaves some unused (the drafter's mask token takes one)."""
    corpus_files: int | None
    """Standard-library modules read (sampled with a fixed seed; None: every one): the tokenizer's text and the vocabulary's."""
    document_chars: int | None
    """A module is cut here (None: corpus.DOCUMENT_CHARS)."""
    vocabulary_size: int
    """Words the chats sort (corpus.vocabulary): the most frequent one-token words of the modules."""
    min_words: int
    max_words: int
    """Words a prompt asks to sort, drawn uniformly."""
    target_chats: int
    """Chats the target is trained on (none with a prompt of the drafter's data set), answered as the target answers."""
    train_steps: int
    train_seconds: float
    """Target training also stops here (the GPU run must fit its device-time budget); the JSON says where."""
    train_batch: int
    train_length: int
    lr: float
    name: str = "sorting"
    source_answers: ClassVar[bool] = True
    """Another writer answered every chat (corpus.WRITERS): a source chain beside the regenerated one."""

    @property
    def chat_shape(self) -> ChatShape:
        return ChatShape(self.min_words, self.max_words)

    @property
    def goals(self) -> Goals:
        return SORTING_GOALS

    def with_prompts(self, directory: Path) -> None:
        """None: its chats are drawn here, from no prompts file."""
        return None

    def documents(self) -> list[str]:
        return stdlib_sources(self.corpus_files, self.document_chars)

    def data_set(self, documents: list[str], tokenizer, counts: ChatCounts) -> tuple[list[str], ChatSet]:
        """The vocabulary the chats draw from and the drafter's data set, answered by the other writer:
        the same for the target's stage (whose chats avoid its prompts) and every later one."""
        words = vocabulary(documents, tokenizer, self.vocabulary_size)
        return words, drafter_chats(words, counts.training, counts.held_out, self.chat_shape, seed=3)

    def make_target(self, directory: Path, counts: ChatCounts, device: torch.device, source: Path | None) -> dict[str, Any]:
        """A BPE tokenizer trained on the documents, a random target, then trained in place on chats
        answered as the target answers (its writer), on their answers only (as a chat model is
        fine-tuned), none of them with a prompt of the drafter's data set; its loss on the answers of
        other such chats. `source` is unused: nothing is fetched."""
        from transformers import AutoTokenizer

        documents = self.documents()
        write_tiny_target(directory, num_layers=self.target_layers, hidden_size=self.target_hidden, vocab_size=self.vocab_size,
                          heads=self.target_heads, head_dim=self.target_head_dim, corpus=documents)
        encoder = ChatEncoder(AutoTokenizer.from_pretrained(directory))
        words, chat_set = self.data_set(documents, encoder.tokenizer, counts)
        taken, rng = set(chat_set.prompts), random.Random(1)

        def rendered(count: int) -> tuple[list[list[int]], list[list[int]]]:
            """New chats tokenized as prepare tokenizes them, which is as serving does (the prompt apart
            from the answer), and their answers' tokens: a target taught on whole conversations tokenized
            at once would be served a generation prompt whose last token it never saw there."""
            rows = [encoder.render({"messages": messages}) for messages in chats(words, count, self.chat_shape, "target", rng, taken=taken)]
            encoded = list(encoder.encode(rows))
            return [ids.tolist() for ids, _ in encoded], [mask.tolist() for _, mask in encoded]

        texts, answers = rendered(self.target_chats)
        held_out, held_out_answers_ = rendered(TARGET_HELD_OUT_CHATS)
        taught = teach_tiny_target(directory, texts, steps=self.train_steps, batch=self.train_batch, length=self.train_length, lr=self.lr,
                                   seconds=self.train_seconds, device=device.type, supervised=answers,
                                   held_out=held_out, held_out_supervised=held_out_answers_, from_text_starts=True)
        return {**taught, "tokenizer_tokens": len(encoder.tokenizer), "chats": len(texts), "vocabulary": words,
                "corpus": {"documents": len(documents), "chars": sum(map(len, documents))}}

    def chat_set(self, target: Path, counts: ChatCounts) -> ChatSet:
        from transformers import AutoTokenizer

        return self.data_set(self.documents(), AutoTokenizer.from_pretrained(target), counts)[1]

    def diversity(self, regenerated: Path, source: Path, chat_set: ChatSet, tokenizer, answer_tokens: int) -> dict[str, Any]:
        """diversity.diversity, and how often the target's answer is the sorted words as it was taught to write them."""
        answers = held_out_answers(regenerated, tokenizer, answer_tokens)
        asked = [chat_set.rows[i]["messages"][0]["content"].removeprefix(INSTRUCTION).split() for i in answers.sample_ids]
        taught = sum(text == WRITERS["target"](words) for text, words in zip(answers.replies, asked, strict=True))
        return {**diversity(regenerated, source, tokenizer, answer_tokens), "held_out_answers_as_taught": taught}
