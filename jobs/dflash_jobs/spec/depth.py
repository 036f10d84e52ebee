"""The target's depth decides which layers are legal: the default captured layers and the
checkpoint config's fields the spec reads (its language model's config, its RoPE scaling)."""

from __future__ import annotations

from typing import Any

from dflash_jobs.errors import SpecError
from dflash_jobs.spec.run import RunSpec


def default_layers(num_hidden_layers: int, count: int = 5) -> list[int]:
    """z-lab's rule: `count` layers evenly spaced from 1 to n - 3 (64 layers: [1, 16, 31, 46, 61])."""
    if count == 1:
        return [num_hidden_layers // 2]
    start, end = 1, max(1, num_hidden_layers - 3)
    return sorted({round(start + i * (end - start) / (count - 1)) for i in range(count)})


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a checkpoint config.json (multimodal ones nest it)."""
    return config.get("text_config") or config


def rope_kind(config: dict[str, Any]) -> str:
    """The target's RoPE scaling, "default" for none (Transformers 5's rope_parameters or the older rope_scaling)."""
    text = text_config(config)
    rope = text.get("rope_parameters") or {}
    scaling = text.get("rope_scaling") or {}
    return rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"


def resolve_layers(spec: RunSpec, checkpoint_config: dict[str, Any]) -> list[int]:
    """The captured layers, checked against the checkpoint's depth."""
    depth = text_config(checkpoint_config).get("num_hidden_layers")
    if not isinstance(depth, int):
        raise SpecError("target.model", spec.target.model, "a checkpoint whose config.json has num_hidden_layers")
    layers = spec.target.layers or default_layers(depth)
    too_deep = [layer for layer in layers if layer >= depth]
    if too_deep:
        raise SpecError("target.layers", spec.target.layers, f"layer indices 0..{depth - 1}: the checkpoint has {depth} decoder layers")
    return list(layers)
