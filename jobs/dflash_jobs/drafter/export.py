"""The exported drafter, in the z-lab layout that vLLM (`method: dflash`), SGLang and z-lab's HF
code load (reference/dflash.md section 5.1):

    config.json        a Qwen3 config plus architectures [DFlashDraftModel], auto_map, block_size,
                       dflash_config {mask_token_id, target_layer_ids}, num_target_layers, layer_types
    model.safetensors  fc, hidden_norm, layers.*, norm; no embedding and no LM head (the server
                       uses the target's)
    dflash.py          DFlashDraftModel, named in auto_map: `AutoModel.from_pretrained(dir,
    model.py, masks.py trust_remote_code=True)` runs the drafter with the code it was trained with,
    speculative.py     copied from this package unchanged

target_layer_ids are written in the z-lab convention of the spec (the output of decoder layer i),
unconverted: vLLM adds one when it loads them (its aux-state ids count the embeddings as 0).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from dflash_jobs.drafter.checkpoint import TargetCheckpoint
from dflash_jobs.drafter.model import Drafter, DrafterConfig
from dflash_jobs.errors import InputError
from dflash_jobs.formats import DRAFTER_DIR
from dflash_jobs.storage import Storage, open_storage
from dflash_jobs.variants import DrafterVariant, drafter_variant

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DRAFTER_PREFIX = f"{DRAFTER_DIR}/"
MODELING_FILES = ("dflash.py", "model.py", "masks.py", "speculative.py")
"""This package's inference code, copied into the export: dflash.py imports the others relatively."""


def export_dflash(drafter: Drafter, storage: Storage, prefix: str = DRAFTER_PREFIX) -> None:
    """The z-lab layout: the drafter's weights, this package's inference code, its config.json."""
    write_export(storage, prefix, drafter.state_dict(), MODELING_FILES, drafter.config.to_zlab())


def write_export(storage: Storage, prefix: str, weights: Mapping[str, torch.Tensor], modeling_files: Sequence[str], config: Mapping[str, Any]) -> None:
    """Writes bf16 model.safetensors, the modeling files (from this package) and config.json under
    `prefix`, config.json last: a reader that finds it finds the rest complete."""
    from safetensors.torch import save_file

    weights = {name: tensor.detach().to(torch.bfloat16).contiguous().cpu() for name, tensor in weights.items()}
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / WEIGHTS_FILE
        save_file(weights, path, metadata={"format": "pt"})
        storage.put_file(prefix + WEIGHTS_FILE, path)
    for name in modeling_files:
        storage.put_bytes(prefix + name, (Path(__file__).parent / name).read_bytes())
    storage.put_bytes(prefix + CONFIG_FILE, (json.dumps(config, indent=2) + "\n").encode())


def exported_config(source: str, *, endpoint_url: str | None = None, region: str | None = None) -> dict[str, Any]:
    """The config.json of the exported drafter at `source` (a directory or a storage prefix)."""
    storage = open_storage(source, endpoint_url=endpoint_url, region=region)
    if not storage.exists(CONFIG_FILE) or not storage.exists(WEIGHTS_FILE):
        raise InputError(f"{source} holds no exported drafter ({CONFIG_FILE} + {WEIGHTS_FILE})", "Train first, or point at <output>/train/drafter")
    return json.loads(storage.get_bytes(CONFIG_FILE))


def load_drafter_config(source: str, *, variant: DrafterVariant | None = None, endpoint_url: str | None = None, region: str | None = None) -> DrafterConfig:
    """The config of the exported drafter at `source` (see load_drafter), as its variant reads it
    (DFlash's by default: the z-lab keys, mask_token_id and target_layer_ids from dflash_config)."""
    raw = exported_config(source, endpoint_url=endpoint_url, region=region)
    return (variant or drafter_variant("dflash")).config_from_export(raw)


def load_drafter(
    source: str, *, target: str, variant: DrafterVariant | None = None, device: str | torch.device = "cpu",
    endpoint_url: str | None = None, region: str | None = None,
) -> tuple[Drafter, DrafterConfig]:
    """An exported drafter (a directory or a storage prefix such as s3://bucket/run/train/drafter)
    of `variant` (DFlash by default) with the frozen embedding and LM head of the target checkpoint
    `target`, in eval mode. `endpoint_url` and `region` locate s3:// URLs (the spec's storage section).

    Weights stay in bf16 as exported, and need no gradient (none is tracked, inside inference mode or
    not: the evaluation's exact tree figures score outside it); the drafter's `draft_block` drafts one
    block from there."""
    from safetensors.torch import load

    variant = variant or drafter_variant("dflash")
    config = load_drafter_config(source, variant=variant, endpoint_url=endpoint_url, region=region)
    drafter = variant.build_model(config)
    drafter.load_state_dict(load(open_storage(source, endpoint_url=endpoint_url, region=region).get_bytes(WEIGHTS_FILE)))
    tensors = TargetCheckpoint(open_storage(target, endpoint_url=endpoint_url, region=region)).read_target_tensors()
    drafter.load_target_tensors(tensors.embed_tokens, tensors.lm_head, tensors.final_norm)
    return drafter.to(device=device, dtype=torch.bfloat16).eval().requires_grad_(False), config
