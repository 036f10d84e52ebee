"""How many prompts the Transformers engine decodes together (generate.batch_prompts: auto, or a number).

A decode step of a small target costs about the same kernel launches at any batch (some 1,660 for
SmolLM2-135M, CUDA graph or not), so on a GPU the rows a batch holds decide the answers a second (an
H100 answered about 640 a second at 1,024 rows: bench/generate). `auto` fills the memory
the weights leave free with as many rows as fit the longest a row can get, under a cap; on a CPU,
where a step's cost grows with its rows, it takes a small fixed number.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_jobs.spec import GenerateSpec

AUTO_CAP = 4096
"""The most rows `auto` puts in a batch, whatever the memory (a batch holds one chunk's prompts at most:
generate.chunk_prompts, 1,024 by default)."""
AUTO_HEADROOM = 0.8
"""The share of the free device memory `auto` plans for: the rest is for the allocator's fragments, CUDA
graphs' pools, the estimate's misses (another process on the same GPU is not counted)."""
CPU_ROWS = 64
"""`auto` on a CPU: a step there costs in proportion to its rows, so a larger batch gains little."""


@dataclass(frozen=True, slots=True)
class TargetShape:
    """What a row of a batch costs on a target, read from its config."""

    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    dtype_bytes: int
    """Bytes of one element of the weights and the KV cache (bfloat16 on a GPU: 2)."""

    @classmethod
    def of(cls, model) -> TargetShape:
        text = model.config.get_text_config(decoder=True)
        heads = text.num_attention_heads
        return cls(
            layers=text.num_hidden_layers, kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads, hidden=text.hidden_size,
            intermediate=getattr(text, "intermediate_size", None) or 4 * text.hidden_size, vocab=text.vocab_size,
            dtype_bytes=model.dtype.itemsize,
        )

    @property
    def cache_bytes_per_token(self) -> int:
        """A row's KV cache for one position: every layer's keys and values over its kv heads."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes


def row_bytes(shape: TargetShape, *, prompt: int, new_tokens: int) -> int:
    """Device bytes one row of a batch takes at most, for prompts up to `prompt` tokens and answers up to
    `new_tokens`: its KV cache over prompt + answer (layers x keys and values x kv heads x head dim), the
    decoder's per-row buffers (the visible mask, the tokens chosen), the prompt forward's activations
    (its attention mask over the prompt, the MLP's gate, up and product, a few hidden states) and the
    logits row with the sampler's float32 copies (softmax, its sorted copy and int64 order, the cumsum)."""
    length = prompt + new_tokens
    cache = shape.cache_bytes_per_token * length
    buffers = length * (1 + 8)  # visible (bool) and tokens (int64) [length] a row
    mask = prompt * prompt * (3 + shape.dtype_bytes)  # the boolean masks combined, and SDPA's additive one
    activations = prompt * (4 * shape.hidden + 3 * shape.intermediate) * shape.dtype_bytes
    logits = shape.vocab * (shape.dtype_bytes + 4 + 4 + 8 + 4)
    return cache + buffers + mask + activations + logits


def auto_rows(free_bytes: int, per_row: int, *, headroom: float = AUTO_HEADROOM, cap: int = AUTO_CAP) -> int:
    """The rows of `per_row` bytes that fit `headroom` of `free_bytes`: at least 1, at most `cap`."""
    return max(1, min(cap, int(free_bytes * headroom) // per_row))


def batch_rows(settings: GenerateSpec, model, device, *, max_length: int) -> tuple[int, str]:
    """The prompts a batch holds on `device` with `model` loaded there, and why (for the log). A row is
    sized for the longest it can get: a prompt of data.max_length - 1 tokens and an answer of
    generate.max_new_tokens (a batch's answers run as long as its longest limit)."""
    if settings.batch_prompts != "auto":
        return settings.batch_prompts, "generate.batch_prompts"
    if device.type != "cuda":
        return CPU_ROWS, f"generate.batch_prompts auto on {device.type}"
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    per_row = row_bytes(TargetShape.of(model), prompt=max_length - 1, new_tokens=settings.max_new_tokens)
    rows = auto_rows(free, per_row)
    return rows, (f"generate.batch_prompts auto: {AUTO_HEADROOM:.0%} of {free / 2**30:.1f} GiB free after the weights, "
                  f"{per_row / 2**20:.1f} MiB a row (prompt up to {max_length - 1} + {settings.max_new_tokens} new tokens), "
                  f"at most {AUTO_CAP}")
