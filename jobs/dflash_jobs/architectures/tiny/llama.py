"""The tiny dense Llama target (`llama`), the suite's second architecture (qwen3_5.py has the first).

A random-weight `llama` checkpoint shaped as SmolLM2-135M-Instruct is, scaled down: plain attention with
grouped K/V heads, tied embeddings (no `lm_head.weight` in the checkpoint), a byte-level BPE tokenizer
whose special tokens come first (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, then unused
code-repository markers) and that fills every embedding row, and SmolLM2's ChatML template (a default
system prompt where a conversation has none). A tokenizer that leaves no row free is what makes the
mask-token rule pick an unused special token (drafter/mask_token.py): `<repo_name>` here, as on SmolLM2.
Built offline and deterministically from write_tiny_target's `seed`; the norm weights and the pad
embedding are randomised (default init would make the norms the identity and the pad row zero, and tests
of norms and padding pass by accident).
"""

from __future__ import annotations

from typing import Iterable

from dflash_jobs.architectures.tiny import MIN_BPE_VOCAB, TinyTargetShape, randomise_degenerate_weights
from dflash_jobs.architectures.tiny.chats import tokenizer_corpus

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<file_sep>", "<filename>")
"""SmolLM2's first special tokens, in its order (ids 0..5): end of text, ChatML, then code-repository markers no chat writes."""
UNUSED_MARKER = "<repo_name>"
"""The special token the mask-token rule picks on this tokenizer (the lowest with no role that no template writes)."""

CHAT_TEMPLATE = """\
{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
' }}{% endif %}{{'<|im_start|>' + message['role'] + '
' + message['content'] + '<|im_end|>' + '
'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant
' }}{% endif %}"""
"""SmolLM2-135M-Instruct's chat template, unchanged."""


def build_tokenizer(vocab_size: int, corpus: Iterable[str] | None = None):
    """A byte-level BPE tokenizer of at most `vocab_size` tokens (SmolLM2's pipeline: byte-level
    pre-tokenizer and decoder, no normaliser), its special tokens first, trained on `corpus`
    (default: turns of the demo's kinds of conversation)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_BPE_VOCAB + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} is too small for the tiny tokenizer: use >= {MIN_BPE_VOCAB + len(SPECIAL_TOKENS)}")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(tokenizer_corpus() if corpus is None else corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>", unk_token="<|endoftext|>",
        model_max_length=8192,
    )
    tokenizer.add_tokens(list(SPECIAL_TOKENS), special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def random_model(shape: TinyTargetShape, tokenizer):
    """A Llama model of `shape` with random weights (the degenerate ones randomised too), its embeddings
    tied and a row per token of the tokenizer, at most shape.vocab_size (fewer where the corpus gives
    out of merges); the caller seeds torch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # every row a token: no row is free for the mask
        hidden_size=shape.hidden_size,
        intermediate_size=2 * shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads // 2,
        head_dim=shape.head_dim,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e5},
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|im_end|>"],
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    randomise_degenerate_weights(model.model, config.pad_token_id)
    return model
