"""The exported drafter, in the z-lab layout that vLLM (`method: dflash`), SGLang and z-lab's HF
code load (reference/dflash.md section 5.1):

    config.json        a Qwen3 config plus architectures [DFlashDraftModel], block_size,
                       dflash_config {mask_token_id, target_layer_ids}, num_target_layers, layer_types
    model.safetensors  fc, hidden_norm, layers.*, norm; no embedding and no LM head (the server
                       uses the target's)

target_layer_ids keep the z-lab convention of the spec (output of decoder layer i) unchanged:
vLLM's z-lab loader reads them as they are; only the speculators format counts one higher.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from dflash_jobs.drafter.checkpoint import TargetCheckpoint
from dflash_jobs.drafter.model import Drafter, DrafterConfig
from dflash_jobs.errors import InputError
from dflash_jobs.storage import Storage, open_storage

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DRAFTER_PREFIX = "train/drafter/"


def zlab_config(config: DrafterConfig) -> dict[str, Any]:
    sliding = "sliding_attention" in config.layer_types
    return {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": config.block_size,
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)},
        "dtype": "bfloat16",
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": config.intermediate_size,
        "layer_types": list(config.layer_types),
        "max_position_embeddings": config.max_position_embeddings,
        "model_type": "qwen3",
        "num_attention_heads": config.num_attention_heads,
        "num_hidden_layers": config.num_layers,
        "num_key_value_heads": config.num_key_value_heads,
        "num_target_layers": config.num_target_layers,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": config.rope_theta,
        "sliding_window": config.sliding_window if sliding else None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": sliding,
        "vocab_size": config.vocab_size,
    }


def config_from_zlab(raw: dict[str, Any]) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw["num_key_value_heads"],
        head_dim=raw["head_dim"],
        intermediate_size=raw["intermediate_size"],
        vocab_size=raw["vocab_size"],
        target_layer_ids=list(raw["dflash_config"]["target_layer_ids"]),
        num_target_layers=raw["num_target_layers"],
        block_size=raw["block_size"],
        mask_token_id=raw["dflash_config"]["mask_token_id"],
        layer_types=list(raw["layer_types"]),
        sliding_window=raw["sliding_window"] or DrafterConfig.__dataclass_fields__["sliding_window"].default,
        rope_theta=float(raw["rope_theta"]),
        rms_norm_eps=raw["rms_norm_eps"],
        max_position_embeddings=raw["max_position_embeddings"],
    )


def export_drafter(drafter: Drafter, storage: Storage, prefix: str = DRAFTER_PREFIX) -> None:
    """Writes config.json and bf16 model.safetensors under `prefix` (weights first: a reader that
    finds config.json finds complete weights)."""
    from safetensors.torch import save_file

    weights = {name: tensor.detach().to(torch.bfloat16).contiguous().cpu() for name, tensor in drafter.state_dict().items()}
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / WEIGHTS_FILE
        save_file(weights, path, metadata={"format": "pt"})
        storage.put_file(prefix + WEIGHTS_FILE, path)
    storage.put_bytes(prefix + CONFIG_FILE, (json.dumps(zlab_config(drafter.config), indent=2) + "\n").encode())


def load_drafter(
    source: str, *, target: str, device: str | torch.device = "cpu", endpoint_url: str | None = None, region: str | None = None
) -> tuple[Drafter, DrafterConfig]:
    """An exported drafter (a directory or a storage prefix such as s3://bucket/run/train/drafter)
    with the frozen embedding and LM head of the target checkpoint `target`, in eval mode.
    `endpoint_url` and `region` locate s3:// URLs (the spec's storage section).

    Weights stay in bf16 as exported; `Drafter.draft_block` drafts one block from there."""
    from safetensors.torch import load

    storage = open_storage(source, endpoint_url=endpoint_url, region=region)
    if not storage.exists(CONFIG_FILE) or not storage.exists(WEIGHTS_FILE):
        raise InputError(f"{source} holds no exported drafter ({CONFIG_FILE} + {WEIGHTS_FILE})", "Train first, or point at <output>/train/drafter")
    config = config_from_zlab(json.loads(storage.get_bytes(CONFIG_FILE)))
    drafter = Drafter(config)
    drafter.load_state_dict(load(storage.get_bytes(WEIGHTS_FILE)))
    tensors = TargetCheckpoint(open_storage(target, endpoint_url=endpoint_url, region=region)).read_target_tensors()
    drafter.load_target_tensors(tensors.embed_tokens, tensors.lm_head, tensors.final_norm)
    return drafter.to(device=device, dtype=torch.bfloat16).eval(), config
