"""What the drafter reads from the target checkpoint of each architecture, the mask token it picks,
and the z-lab export vLLM loads."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_jobs.drafter.checkpoint import TargetCheckpoint, drafter_config_for_target
from dflash_jobs.drafter.export import export_dflash, load_drafter
from dflash_jobs.drafter.mask_token import pick_mask_token, tokens_in_chunks
from dflash_jobs.drafter.model import Drafter, RMSNorm
from dflash_jobs.errors import InputError, SpecError
from dflash_jobs.spec import TrainSpec
from dflash_jobs.storage import open_storage
from dflash_jobs.architectures.tiny.llama import SPECIAL_TOKENS, UNUSED_MARKER
from train_fixtures import LAYERS, mask_token_id

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


def test_frozen_tensors_come_from_each_architectures_checkpoint_with_its_norm_semantics(architecture, each_target):
    """Qwen3.5: the multimodal layout, an LM head of its own and zero-centred norms; Llama: the text
    model at model.*, tied embeddings (no lm_head.weight stored) and x * w norms."""
    from transformers import AutoModelForCausalLM

    target_model = AutoModelForCausalLM.from_pretrained(each_target, dtype=torch.float32).eval()
    checkpoint = TargetCheckpoint(open_storage(str(each_target)))
    assert checkpoint.architecture.name == architecture
    multimodal = checkpoint.find(("model.language_model.embed_tokens.weight",)) is not None
    tied = checkpoint.find(("lm_head.weight",)) is None
    assert (multimodal, tied, checkpoint.architecture.zero_centred_norms) == {"qwen3_5": (True, False, True), "llama": (False, True, False)}[architecture]
    tensors = checkpoint.read_target_tensors()
    assert torch.equal(tensors.embed_tokens, target_model.model.embed_tokens.weight)
    assert torch.equal(tensors.lm_head, target_model.lm_head.weight)
    assert torch.equal(tensors.lm_head, tensors.embed_tokens) == tied
    # The drafter's x * w norm with the converted weight is the target's own norm (x * (1 + w) for Qwen3.5).
    norm = RMSNorm(tensors.final_norm.shape[0], target_model.config.rms_norm_eps)
    norm.weight.data.copy_(tensors.final_norm)
    x = torch.randn(7, tensors.final_norm.shape[0])
    with torch.no_grad():
        torch.testing.assert_close(norm(x), target_model.model.norm(x))
    assert not torch.allclose(tensors.final_norm, torch.ones_like(tensors.final_norm), atol=0.05)  # randomised: a wrong conversion shows


def test_text_only_sharded_checkpoint_with_tied_embeddings(tmp_path):
    embed, norm = torch.randn(20, 8), torch.randn(8)
    save_file({"model.embed_tokens.weight": embed}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"model.norm.weight": norm, "model.layers.0.mlp.up_proj.weight": torch.randn(4, 8)}, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors", "model.norm.weight": "model-00002-of-00002.safetensors",
                  "model.layers.0.mlp.up_proj.weight": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": True, "hidden_size": 8, "vocab_size": 20}))
    tensors = TargetCheckpoint(open_storage(str(tmp_path))).read_target_tensors()
    assert torch.equal(tensors.embed_tokens, embed) and torch.equal(tensors.lm_head, embed)
    assert torch.equal(tensors.final_norm, norm)  # Llama norms are already x * w


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


def test_the_mask_token_is_the_first_row_past_the_tokenizer_or_the_spec_s(target_dir):
    from transformers import AutoTokenizer

    checkpoint = TargetCheckpoint(open_storage(str(target_dir)))
    rows = checkpoint.text["vocab_size"]
    size = checkpoint.tokenizer_size()
    assert size == len(AutoTokenizer.from_pretrained(target_dir)) < rows

    def unread(ids):
        raise AssertionError("the data is read only where the tokenizer leaves no row free")

    picked = pick_mask_token(checkpoint, None, data_holds=unread)
    assert picked.id == size and "the first embedding row the tokenizer does not use" in picked.why
    assert pick_mask_token(checkpoint, 5, data_holds=unread).id == 5
    with pytest.raises(SpecError, match="train.mask_token_id") as refused:
        pick_mask_token(checkpoint, rows, data_holds=unread)
    assert f"a row of the target's embedding (0..{rows - 1})" in str(refused.value)


def test_a_tokenizer_that_uses_every_row_gives_an_unused_special_token_the_data_never_holds(target_of, tmp_path):
    """The tiny Llama's tokenizer fills its embedding, as SmolLM2's does: the mask is its lowest special
    token that has no role (not <|endoftext|>: unk; not <|im_start|>, <|im_end|>: bos, eos and written
    by the template), <repo_name>; the next one where the data holds it; none, refused naming the fix."""
    directory = target_of("llama")
    checkpoint = TargetCheckpoint(open_storage(str(directory)))
    assert checkpoint.tokenizer_size() == checkpoint.text["vocab_size"]
    asked = []

    def holding(*held):
        def data_holds(ids):
            asked.append(list(ids))
            return set(held) & set(ids)
        return data_holds

    first = pick_mask_token(checkpoint, None, data_holds=holding())
    assert (first.id, SPECIAL_TOKENS[first.id]) == (3, UNUSED_MARKER) and UNUSED_MARKER in first.why
    assert asked == [[3, 4, 5]]  # the markers only: the roles and the template's tokens are never candidates
    assert pick_mask_token(checkpoint, None, data_holds=holding(3)).id == 4
    with pytest.raises(SpecError, match="train.mask_token_id") as refused:
        pick_mask_token(checkpoint, None, data_holds=holding(3, 4, 5))
    assert "the tokenizer uses all" in str(refused.value) and "3 of them in the training data" in str(refused.value)
    # A template that writes the marker makes it a token the drafter may read: the next one is taken.
    shutil.copytree(directory, tmp_path / "target")
    template = tmp_path / "target/chat_template.jinja"
    template.write_text(template.read_text() + "{{ '<repo_name>' }}")
    assert pick_mask_token(TargetCheckpoint(open_storage(str(tmp_path / "target"))), None, data_holds=holding()).id == 4


def test_the_data_is_read_from_the_token_chunks(extract):
    """Which candidate ids the training samples hold: every token chunk read."""
    from dflash_jobs.formats import MANIFEST_KEY, Manifest, TokenChunk, token_chunk_key

    storage = open_storage(str(extract))
    chunks = [marker.chunk for marker in Manifest.from_json(storage.get_bytes(MANIFEST_KEY)).chunks]
    held = [set(TokenChunk.decode(storage.get_bytes(token_chunk_key(c)), "chunk").input_ids.tolist()) for c in chunks]
    only_last = sorted(held[-1] - set().union(*held[:-1]))[:2]
    assert only_last and tokens_in_chunks(storage, chunks, [*only_last, 10**6]) == set(only_last)
    assert tokens_in_chunks(storage, chunks[:-1], only_last) == set()


def test_export_is_the_zlab_layout_and_loads_back(tmp_path, target_dir):
    checkpoint = TargetCheckpoint(open_storage(str(target_dir)))
    train = TrainSpec(draft_layers=3, sliding_window_layers=2, sliding_window=64, block_size=8)
    config = drafter_config_for_target(checkpoint, train, LAYERS, mask_token_id(checkpoint))
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
