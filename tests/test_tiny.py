"""The tiny targets: the real Qwen3.5 checkpoint layout, loadable both ways, non-degenerate,
deterministic; the dense Llama with tied embeddings and a tokenizer that fills every embedding row."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_jobs.architectures import ARCHITECTURE_MODULES
from dflash_jobs.architectures.tiny import DEBUGMODEL, tiny_target_module, write_tiny_target
from dflash_jobs.architectures.tiny.chats import tiny_chat_dataset
from dflash_jobs.architectures.tiny.llama import SPECIAL_TOKENS as LLAMA_SPECIAL_TOKENS
from dflash_jobs.architectures.tiny.qwen3_5 import SPECIAL_TOKENS


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_tiny_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.mark.parametrize("architecture", list(ARCHITECTURE_MODULES))
def test_every_target_architecture_has_a_tiny_target_the_suite_runs_it_on(architecture):
    builder = tiny_target_module(architecture)
    assert callable(builder.build_tokenizer) and callable(builder.random_model)


def test_a_tiny_target_is_asked_for_by_an_architecture_of_the_seam(tmp_path):
    with pytest.raises(ValueError, match="no target architecture 'gpt2'"):
        write_tiny_target(tmp_path, architecture="gpt2")


def test_checkpoint_has_the_multimodal_layout(target_dir):
    config = json.loads((target_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_5"
    assert config["text_config"]["num_hidden_layers"] == DEBUGMODEL.num_layers
    assert config["text_config"]["hidden_size"] == DEBUGMODEL.hidden_size
    # Three GDN layers, then full attention, twice: the 27B's pattern.
    assert config["text_config"]["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    with safe_open(target_dir / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" in keys
    assert "model.language_model.embed_tokens.weight" in keys
    assert "model.language_model.layers.0.linear_attn.dt_bias" in keys
    assert "model.language_model.layers.3.self_attn.q_proj.weight" in keys
    assert any(key.startswith("model.visual.") for key in keys)


def test_causal_lm_loads_the_text_model_only(target_dir):
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert not any("visual" in name for name, _ in model.named_parameters())
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4, 5]])).logits
    assert logits.shape == (1, 5, DEBUGMODEL.vocab_size)
    assert torch.isfinite(logits).all()


def test_random_weights_are_not_degenerate(target_dir):
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    norms = {name: p for name, p in model.named_parameters() if name.endswith("norm.weight") or name.endswith("dt_bias")}
    assert len(norms) > 2 * DEBUGMODEL.num_layers
    for name, weight in norms.items():
        assert weight.std() > 0.1, name
    assert model.model.embed_tokens.weight[tokenizer.pad_token_id].abs().sum() > 0


def test_tokenizer_has_chatml_and_leaves_free_embedding_rows(target_dir):
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    assert 512 <= len(tokenizer) < DEBUGMODEL.vocab_size
    assert tokenizer.eos_token_id == config["text_config"]["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.pad_token_id == config["text_config"]["pad_token_id"] == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert config["image_token_id"] == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for token in SPECIAL_TOKENS:
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1, token

    messages = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "2 + 3 = 5."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n2 + 3 = 5.<|im_end|>\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_target_is_deterministic(target_dir, tmp_path):
    again = write_tiny_target(tmp_path / "again")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (target_dir / name).read_bytes(), name


def test_the_llama_ties_its_embeddings_fills_every_row_and_is_not_degenerate(target_of, tmp_path):
    directory = target_of("llama")
    config = json.loads((directory / "config.json").read_text())
    with safe_open(directory / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] and "lm_head.weight" not in keys
    assert config["num_hidden_layers"] == DEBUGMODEL.num_layers and "model.embed_tokens.weight" in keys
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert len(tokenizer) == config["vocab_size"] <= DEBUGMODEL.vocab_size  # no row free for a mask token
    assert [tokenizer.convert_tokens_to_ids(token) for token in LLAMA_SPECIAL_TOKENS] == list(range(len(LLAMA_SPECIAL_TOKENS)))
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == config["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    norms = [p for name, p in model.named_parameters() if name.endswith("norm.weight")]
    assert len(norms) == 2 * DEBUGMODEL.num_layers + 1 and all(weight.std() > 0.1 for weight in norms)
    assert model.model.embed_tokens.weight[tokenizer.pad_token_id].abs().sum() > 0
    again = write_tiny_target(tmp_path / "again", architecture="llama")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (again / name).read_bytes() == (directory / name).read_bytes(), name


def test_chat_dataset_is_structured_and_deterministic(tmp_path):
    first = tiny_chat_dataset(tmp_path / "a.jsonl", 200, seed=3)
    second = tiny_chat_dataset(tmp_path / "b.jsonl", 200, seed=3)
    other = tiny_chat_dataset(tmp_path / "c.jsonl", 200, seed=4)
    assert first.read_bytes() == second.read_bytes() != other.read_bytes()
    rows = [json.loads(line) for line in first.read_text().splitlines()]
    assert len(rows) == 200
    for row in rows:
        roles = [m["role"] for m in row["messages"] if m["role"] != "system"]
        assert roles[0::2] == ["user"] * (len(roles) // 2) and roles[1::2] == ["assistant"] * (len(roles) // 2)
        assert all(m["content"] for m in row["messages"])
    assert any(len(row["messages"]) > 2 for row in rows)
