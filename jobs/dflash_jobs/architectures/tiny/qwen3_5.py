"""The tiny Qwen3.5/3.6 target (`qwen3_5`): a random-weight checkpoint in the real multimodal layout
(`model.language_model.*`, `model.visual.*`, `lm_head.*`) plus a byte-level BPE tokenizer with a
Qwen3.5-style ChatML template, so the code paths that load Qwen3.6-27B load it unchanged:
`AutoModelForCausalLM.from_pretrained(dir)` gives the text model and `AutoTokenizer.from_pretrained(dir)`
the tokenizer. Everything is built offline and deterministically from write_tiny_target's `seed`.

Recipe of the weights: shared/reference/qwen_gdn.md section 5 (norm weights, dt_bias and the pad
embedding row are randomised, otherwise tests of padding and masking pass spuriously).
"""

from __future__ import annotations

import json
from typing import Iterable

from dflash_jobs.architectures.tiny import MIN_BPE_VOCAB, TinyTargetShape, randomise_degenerate_weights
from dflash_jobs.architectures.tiny.chats import tokenizer_corpus

UNUSED_EMBEDDING_ROWS = 16
"""Embedding rows past the tokenizer, at least; like Qwen3.6 (248,320 rows for ~248K tokens)."""

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



def build_tokenizer(vocab_size: int, corpus: Iterable[str] | None = None):
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


def random_model(shape: TinyTargetShape, tokenizer):
    """A Qwen3.5 model of `shape` (the multimodal one: the checkpoint keeps the real layout) with random
    weights, the degenerate ones randomised too; the caller seeds torch."""
    from transformers import Qwen3_5ForConditionalGeneration

    token_ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = tiny_target_config(num_layers=shape.num_layers, hidden_size=shape.hidden_size, vocab_size=shape.vocab_size,
                                token_ids=token_ids, heads=shape.heads, head_dim=shape.head_dim)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    randomise_degenerate_weights(model.model.language_model, token_ids["<|endoftext|>"])
    return model
