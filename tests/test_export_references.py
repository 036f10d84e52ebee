"""The exports against what the reference loaders read (issue 37 item 14): the tensors' names and
shapes of a published checkpoint, and the names each loader maps a checkpoint's tensors to.

- DFlash2: z-lab's published fixtures (tests/fixtures/zlab-dflash2-config.json and
  zlab-dflash2-safetensors-header.json, z-lab/dflash tests/fixtures@0a7587c0 and @0698f537): our
  DFlash2 built from that config holds exactly the header's tensors, names and shapes; the codebooks
  bare, as z-lab's DFlash2DraftModel.from_pretrained key mapping and vLLM's CandidateSelector read them.
- DFlash and DSpark: the byte counts of two published Qwen3-8B drafters (z-lab/Qwen3-8B-DFlash-b16
  @9b41424b, 2,097,259,104 B, no embedding or LM head; deepseek-ai/dspark_qwen3_8b_block7 @03326e50,
  4,742,170,330 B, with DeepSpec's own copies of both, as pinned in ai-dynamo/aiconfigurator
  tests/unit/sdk/speculation/test_dense_draft_schemes.py@6290c161): ours at their configs are those
  checkpoints' tensors, the DSpark one short of exactly the two target tables.
- vLLM: every tensor of each export, renamed as vLLM's load_weights renames it (qwen3_dflash.py
  @036a00d1, qwen3_dflash2.py @030da624, qwen3_dspark.py @0302ff40), is a parameter of vLLM's model,
  and every parameter of it is loaded but the target's embedding and LM head, which it shares.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dflash_jobs.drafter.dflash2_model import DFlash2Config
from dflash_jobs.drafter.model import DrafterConfig
from dflash_jobs.spec import parse_spec
from dflash_jobs.storage import open_storage
from dflash_jobs.variants import drafter_variant

FIXTURES = Path(__file__).with_name("fixtures")
ZLAB_CODEBOOK_KEY_MAPPING = {f"candidate_selector.{name}": f"candidate_selector.{name}.weight" for name in ("predecessor_codebook", "successor_codebook")}
"""z-lab's DFlash2DraftModel.from_pretrained key_mapping: the file's bare codebooks into its nn.Embedding modules."""
SAFETENSORS_HEADER_SLACK = 64 << 10
"""A checkpoint's bytes beyond its tensors: the 8-byte length and the JSON header (a few KiB for ~100 tensors)."""


def meta_state(variant: str, config: DrafterConfig) -> dict[str, torch.Tensor]:
    """The drafter's tensors for `config`, on the meta device: shapes without memory (full-size configs)."""
    with torch.device("meta"):
        return drafter_variant(variant).build_model(config).state_dict()


def test_dflash2_at_z_lab_s_published_config_holds_exactly_the_published_checkpoint_s_tensors():
    raw = json.loads((FIXTURES / "zlab-dflash2-config.json").read_text())
    header = json.loads((FIXTURES / "zlab-dflash2-safetensors-header.json").read_text())
    # Its logits are scaled and soft-capped (output_multiplier, final_logit_softcapping), which this
    # drafter does not do: refused by name rather than loaded to draft otherwise. The tensors do not depend on them.
    with pytest.raises(ValueError, match="final_logit_softcapping.*output_multiplier"):
        DFlash2Config.from_zlab(raw)
    plain = {**raw, "dflash_config": {k: v for k, v in raw["dflash_config"].items() if k not in ("output_multiplier", "final_logit_softcapping")}}
    state = meta_state("dflash2", DFlash2Config.from_zlab(plain))
    assert {name: list(tensor.shape) for name, tensor in state.items()} == {name: entry["shape"] for name, entry in header.items()}
    assert {entry["dtype"] for entry in header.values()} == {"BF16"}  # as write_export stores every tensor
    # z-lab's loader maps the bare codebooks onto its embeddings; a `.weight` in the file would not be mapped.
    assert set(ZLAB_CODEBOOK_KEY_MAPPING) <= state.keys() and not set(ZLAB_CODEBOOK_KEY_MAPPING.values()) & state.keys()


def train_section(train: dict):
    return parse_spec({"name": "x", "backend": "local", "target": {"model": "/m"}, "data": {"source": "/d"}, "output": "/o", "train": train}).train


def qwen3_8b_drafter(**overrides) -> DrafterConfig:
    """The published Qwen3-8B drafters' backbone: 5 layers at the target's shape, taps [1, 9, 17, 25, 33]."""
    return DrafterConfig(
        hidden_size=4096, num_layers=5, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
        vocab_size=151936, target_layer_ids=[1, 9, 17, 25, 33], num_target_layers=36, mask_token_id=151669, **overrides,
    )


def tensor_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(tensor.numel() for tensor in state.values()) * 2  # bf16, as exported


def test_the_published_qwen3_8b_checkpoints_are_our_tensors_and_deepspec_s_adds_the_target_tables():
    published_dflash, published_dspark = 2_097_259_104, 4_742_170_330
    dflash = tensor_bytes(meta_state("dflash", qwen3_8b_drafter(block_size=16)))
    assert 0 < published_dflash - dflash < SAFETENSORS_HEADER_SLACK
    train = train_section({"drafter": "dspark", "dspark": {"markov_rank": 256}})
    config = drafter_variant("dspark").build_config(qwen3_8b_drafter(block_size=7), train)
    ours = tensor_bytes(meta_state("dspark", config))
    target_tables = 2 * config.vocab_size * config.hidden_size * 2  # embed_tokens and lm_head, bf16
    assert 0 < published_dspark - (ours + target_tables) < SAFETENSORS_HEADER_SLACK
    assert round(target_tables / published_dspark, 3) == 0.525  # what writing them would cost: half of DeepSpec's checkpoint


# ---- vLLM's load_weights ------------------------------------------------------------------------


def vllm_names(file_names: set[str]) -> set[str]:
    """The names vLLM's DFlash-family load_weights gives a checkpoint's tensors: lm_head as it is, every
    other under `model.`, then the model's mapper stacks q/k/v_proj into qkv_proj and gate/up_proj into
    gate_up_proj (one parameter for each stack)."""
    renamed = set()
    for name in file_names:
        name = name if "lm_head" in name else f"model.{name}"
        for parts, fused in (((".q_proj", ".k_proj", ".v_proj"), ".qkv_proj"), ((".gate_proj", ".up_proj"), ".gate_up_proj")):
            for part in parts:
                name = name.replace(part, fused)
        renamed.add(name)
    return renamed


def vllm_parameters(variant: str, layers: int, *, confidence_head: bool = True) -> set[str]:
    """What vLLM's drafter model loads from a checkpoint (DFlashQwen3Model and its DFlash2 and DSpark
    subclasses), besides embed_tokens and lm_head, which it takes from the target when the file has none."""
    per_layer = ["self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]
    extra: list[str] = []
    if variant == "dflash2":
        per_layer += [f"{conv}.{weight}" for conv in ("attention_conv", "mlp_conv") for weight in ("base_kernel", "kernel_projection.weight")]
        extra = ["candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook", "candidate_selector.hidden_projection.weight"]
    if variant == "dspark":
        extra = ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight"]
        extra += ["confidence_head.proj.weight", "confidence_head.proj.bias"] * confidence_head
    names = [f"layers.{i}.{name}" for i in range(layers) for name in per_layer] + ["fc.weight", "hidden_norm.weight", "norm.weight", *extra]
    return {f"model.{name}" for name in names}


def tiny_backbone() -> DrafterConfig:
    return DrafterConfig(hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                         vocab_size=512, target_layer_ids=[1, 2, 3], num_target_layers=6, mask_token_id=500, block_size=8,
                         layer_types=["sliding_attention", "full_attention"], sliding_window=32)


@pytest.mark.parametrize("variant, train, confidence_head", [
    ("dflash", {}, False),
    ("dflash2", {"dflash2": {"selector_rank": 8, "selector_top_k": 4}}, False),
    ("dspark", {"dspark": {"markov_rank": 8}}, True),
    ("dspark", {"dspark": {"markov_rank": 8, "ce_only": True}}, False),
])
def test_every_tensor_of_each_export_loads_into_vllm_s_model_and_nothing_of_it_is_missing(tmp_path, variant, train, confidence_head):
    spec_train = train_section({"drafter": variant, **train})
    chosen = drafter_variant(variant)
    config = chosen.build_config(tiny_backbone(), spec_train)
    torch.manual_seed(0)
    chosen.export(chosen.build_model(config), open_storage(str(tmp_path)), "drafter/")
    with safe_open(tmp_path / "drafter/model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert not {"embed_tokens.weight", "lm_head.weight"} & names  # vLLM shares the target's (equal: it would compare and share)
    assert vllm_names(names) == vllm_parameters(variant, config.num_layers, confidence_head=confidence_head)
