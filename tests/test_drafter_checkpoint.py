"""What the drafter reads from the target checkpoint, and the z-lab export vLLM loads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_jobs.drafter.checkpoint import TargetCheckpoint, drafter_config_for_target, resolve_mask_token_id
from dflash_jobs.drafter.export import export_dflash, load_drafter
from dflash_jobs.drafter.model import Drafter, RMSNorm
from dflash_jobs.errors import InputError, SpecError
from dflash_jobs.spec import TrainSpec
from dflash_jobs.storage import open_storage
from train_fixtures import LAYERS

ZLAB_KEYS = {
    "architectures", "attention_bias", "attention_dropout", "auto_map", "block_size", "dflash_config", "dtype",
    "head_dim", "hidden_act", "hidden_size", "initializer_range", "intermediate_size", "layer_types",
    "max_position_embeddings", "model_type", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
    "num_target_layers", "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta", "sliding_window", "tie_word_embeddings",
    "use_cache", "use_sliding_window", "vocab_size",
}


@pytest.fixture(scope="module")
def target_model(target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def test_frozen_tensors_come_from_the_multimodal_checkpoint_with_its_norm_semantics(target_dir, target_model):
    checkpoint = TargetCheckpoint(open_storage(str(target_dir)))
    assert checkpoint.find(("model.language_model.embed_tokens.weight",))  # the Qwen3.5 VLM layout
    tensors = checkpoint.read_target_tensors()
    assert torch.equal(tensors.embed_tokens, target_model.model.embed_tokens.weight)
    assert torch.equal(tensors.lm_head, target_model.lm_head.weight)
    assert not torch.equal(tensors.lm_head, tensors.embed_tokens)
    # The drafter's x * w norm with the converted weight is the target's x * (1 + w) norm.
    norm = RMSNorm(tensors.final_norm.shape[0], target_model.config.rms_norm_eps)
    norm.weight.data.copy_(tensors.final_norm)
    x = torch.randn(7, tensors.final_norm.shape[0])
    with torch.no_grad():
        torch.testing.assert_close(norm(x), target_model.model.norm(x))


def test_text_only_sharded_checkpoint_with_tied_embeddings(tmp_path):
    embed, norm = torch.randn(20, 8), torch.randn(8)
    save_file({"model.embed_tokens.weight": embed}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"model.norm.weight": norm, "model.layers.0.mlp.up_proj.weight": torch.randn(4, 8)}, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors", "model.norm.weight": "model-00002-of-00002.safetensors",
                  "model.layers.0.mlp.up_proj.weight": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "tie_word_embeddings": True, "hidden_size": 8, "vocab_size": 20}))
    tensors = TargetCheckpoint(open_storage(str(tmp_path))).read_target_tensors()
    assert torch.equal(tensors.embed_tokens, embed) and torch.equal(tensors.lm_head, embed)
    assert torch.equal(tensors.final_norm, norm)  # Qwen3 norms are already x * w


@pytest.mark.parametrize("rope", [{"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e7, "factor": 4.0}},
                                  {"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}}])
def test_a_target_with_scaled_rope_is_refused_naming_the_scaling(tmp_path, rope):
    """The drafter takes the target's RoPE base over, and has no scaling: exported without the
    target's, it would draft at other positions than the target verifies."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 8, **rope}))
    save_file({"model.norm.weight": torch.ones(8)}, tmp_path / "model.safetensors")
    with pytest.raises(InputError, match="scales its RoPE") as refused:
        TargetCheckpoint(open_storage(str(tmp_path))).rope_theta
    assert refused.value.fix.startswith("Train the drafter for a target with plain RoPE")


def test_mask_token_is_the_first_row_past_the_tokenizer(target_dir):
    from transformers import AutoTokenizer

    checkpoint = TargetCheckpoint(open_storage(str(target_dir)))
    rows = checkpoint.text["vocab_size"]
    size = checkpoint.tokenizer_size()
    assert size == len(AutoTokenizer.from_pretrained(target_dir)) < rows
    assert resolve_mask_token_id(None, size, rows) == size
    assert resolve_mask_token_id(5, None, rows) == 5
    for requested, tokenizer_size in ((None, None), (None, rows), (rows, None)):
        with pytest.raises(SpecError, match="train.mask_token_id"):
            resolve_mask_token_id(requested, tokenizer_size, rows)


def test_export_is_the_zlab_layout_and_loads_back(tmp_path, target_dir):
    checkpoint = TargetCheckpoint(open_storage(str(target_dir)))
    train = TrainSpec(draft_layers=3, sliding_window_layers=2, sliding_window=64, block_size=8)
    config = drafter_config_for_target(checkpoint, train, LAYERS, resolve_mask_token_id(None, checkpoint.tokenizer_size(), checkpoint.text["vocab_size"]))
    torch.manual_seed(0)
    drafter = Drafter(config)
    tensors = checkpoint.read_target_tensors()
    drafter.load_target_tensors(tensors.embed_tokens, tensors.lm_head, tensors.final_norm)
    export_dflash(drafter, open_storage(str(tmp_path)), prefix="drafter/")

    raw = json.loads((tmp_path / "drafter/config.json").read_text())
    assert set(raw) == ZLAB_KEYS
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["dflash_config"] == {"mask_token_id": checkpoint.tokenizer_size(), "target_layer_ids": LAYERS}
    assert raw["block_size"] == 8 and raw["num_hidden_layers"] == 3 and raw["num_target_layers"] == 8
    assert raw["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert raw["sliding_window"] == 64 and raw["use_sliding_window"] is True
    assert raw["hidden_size"] == checkpoint.text["hidden_size"] and raw["vocab_size"] == checkpoint.text["vocab_size"]

    weights = load_file(tmp_path / "drafter/model.safetensors")
    assert not any("embed" in key or "lm_head" in key for key in weights)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.2.self_attn.k_norm.weight", "layers.0.mlp.down_proj.weight"} <= set(weights)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())

    from transformers import AutoConfig  # a plain Qwen3 config to transformers (and so to vLLM)

    hf = AutoConfig.from_pretrained(tmp_path / "drafter")
    assert hf.layer_types == raw["layer_types"] and hf.rope_parameters["rope_theta"] == checkpoint.rope_theta

    loaded, loaded_config = load_drafter(str(tmp_path / "drafter"), target=str(target_dir))
    assert loaded_config == config
    context = torch.randn(1, 12, config.context_features)
    expected = drafter.to(torch.bfloat16).draft_block(context, torch.arange(12), 40, 12)
    assert torch.equal(loaded.draft_block(context, torch.arange(12), 40, 12), expected)
