"""GGUF files for the tests: a tiny Hugging Face Llama checkpoint written as llama.cpp's converter
writes one (convert_hf_to_gguf.py), with the gguf package's GGUFWriter: the metadata transformers
reads, the byte-level BPE tokenizer with its merges and chat template, the query and key weights
permuted to llama.cpp's rotary layout, the 2-D weights quantized (Q8_0) and the norms in float32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
"""A decoder layer's modules by their llama.cpp names (blk.<i>.<name>.weight)."""


def rotary_permuted(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's layout of a query or key projection: each head's rotary halves interleaved (transformers undoes it on load)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(checkpoint: Path, path: Path) -> Path:
    """The Llama checkpoint directory `checkpoint` (tied embeddings) as the GGUF file `path`."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    weights = load_file(checkpoint / "model.safetensors")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    special = {entry["id"] for entry in tokenizer["added_tokens"] if entry["special"]}
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if index in special else gguf.TokenType.NORMAL for _, index in vocab])
    writer.add_token_merges([" ".join(merge) if isinstance(merge, list) else merge for merge in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_chat_template((checkpoint / "chat_template.jinja").read_text())

    def add(name: str, tensor: np.ndarray) -> None:
        tensor = tensor.astype(np.float32)
        if tensor.ndim == 1:
            writer.add_tensor(name, tensor)
        else:
            quantized = gguf.quants.quantize(tensor, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, quantized, raw_shape=quantized.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    add("token_embd.weight", weights["model.embed_tokens.weight"])
    add("output_norm.weight", weights["model.norm.weight"])
    for layer in range(config["num_hidden_layers"]):
        for module, name in GGUF_NAMES.items():
            tensor = weights[f"model.layers.{layer}.{module}.weight"]
            if name in ("attn_q", "attn_k"):
                tensor = rotary_permuted(tensor, config["num_attention_heads" if name == "attn_q" else "num_key_value_heads"])
            add(f"blk.{layer}.{name}.weight", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
