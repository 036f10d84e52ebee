"""Target architectures: the one seam where a target model family plugs in, as drafter variants do (variants/).

Transformers runs any causal LM's forward; what the pipeline must know beyond it is an
architecture's: where its checkpoint keeps the tensors the drafter borrows (the embedding, the LM
head, the final norm) and how its norms store their weights; what a packed extraction row needs
(masked tokens between samples, the masks its forward takes); and how each kind of decoder layer
runs over a draft tree, by the tree protocol of this seam (tree.py), which tree verification drives
layer by layer with the target's own modules (drafter/tree_verify.py). Each entry fills those fields;
everything else reads the target through this record.

Two architectures, each proven step by step by the suite on a tiny random target of its own
(tiny/, a module per entry, of the entry's name):
- qwen3_5: Qwen3.5/3.6, hybrid: Gated DeltaNet layers and gated attention (q_proj emits the query
  and a gate), zero-centred norms, the multimodal checkpoint layout (`model.language_model.*`);
- llama: a dense Llama-family model: plain attention, every layer alike, embeddings possibly tied
  (no `lm_head.weight`).

This module is part of the contract both planes read (the controller's `check` names what is
supported): it imports neither torch nor transformers. An entry module, which does, is imported
only when its architecture is asked for; so is the tree protocol (tree.py), which an entry imports.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from dflash_jobs.spec import text_config

if TYPE_CHECKING:
    from dflash_jobs.architectures.tree import TreeMixer

log = logging.getLogger("dflash.architectures")

MODEL_TYPES: Mapping[str, str] = {
    "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5", "qwen3_5_moe_text": "qwen3_5",
    "llama": "llama",
}
"""config.json's model_type -> the architecture that runs it: the model types the suite proves."""

ARCHITECTURE_MODULES = {
    "qwen3_5": "dflash_jobs.architectures.qwen3_5",
    "llama": "dflash_jobs.architectures.llama",
}
"""Where each architecture is assembled (each module holds an ARCHITECTURE): imported on demand."""


@dataclass(frozen=True, slots=True)
class TargetArchitecture:
    name: str
    weight_prefixes: tuple[str, ...]
    """Where the text model's tensors sit in a checkpoint, tried in order (`<prefix>embed_tokens.weight`)."""
    zero_centred_norms: bool
    """RMSNorm weights stored as w in x * (1 + w) (Qwen3.5/3.6); the drafter's norms are x * w, so the
    target's final norm is converted when read (drafter/checkpoint.py)."""
    gated_deltanet: bool
    """Gated DeltaNet layers, whose fast path is flash-linear-attention: without it a packed row cannot keep
    samples apart (FLA's varlen kernel resets the recurrent state at each boundary) and the layers run a
    slower torch fallback."""
    packing_gap: Callable[[Any], int]
    """(the text config) -> masked tokens after every sample of a packed extraction row: what keeps a
    sample's causal convolution from reading the one before (0: nothing to keep apart but attention)."""
    packed_inputs: Callable[[Any, Any, tuple[tuple[int, int], ...]], dict[str, Any]]
    """(token mask [1, T], segment bounds [samples + 1], the same bounds as (start, end) pairs) -> a packed
    row's model inputs beyond its ids, positions and segments (which the packed attention reads)."""
    fused_submodules: tuple[str, ...]
    """Where its decoder layers keep their elementwise-heavy modules (norms, the MLP): what extract.compile
    compiles, each on its own (capture/fusion.py); absent ones are skipped."""
    tree_mixers: Mapping[str, TreeMixer]
    """Decoder layer type (the config's layer_types; "full_attention" where it has none) -> how that
    layer's token mixer runs over a draft tree and what it keeps for the commit."""


def model_type(config: Mapping[str, Any]) -> str:
    """The language model's model_type of a checkpoint config.json ("?" where it names none)."""
    return text_config(config).get("model_type") or config.get("model_type") or "?"


def supported(config: Mapping[str, Any]) -> bool:
    """Whether the suite proves the checkpoint's architecture."""
    return model_type(config) in MODEL_TYPES


def architecture_name(config: Mapping[str, Any]) -> str:
    """The architecture that runs a checkpoint (its config.json): its model type's; for a model type the
    suite does not cover, the nearest by structure (Gated DeltaNet layers: qwen3_5; else llama, dense)."""
    return _name(model_type(config), "linear_attention" in (text_config(config).get("layer_types") or ()))


def target_architecture(config: Mapping[str, Any] | Any) -> TargetArchitecture:
    """The architecture of a target: its config.json as a dict, or a transformers config."""
    if not isinstance(config, Mapping):
        config = {"model_type": config.model_type, "layer_types": getattr(config, "layer_types", None)}
    return importlib.import_module(ARCHITECTURE_MODULES[architecture_name(config)]).ARCHITECTURE


@functools.cache
def _name(model_type: str, gated_deltanet: bool) -> str:
    """Said once per process for a model type the suite does not cover."""
    name = MODEL_TYPES.get(model_type)
    if name is None:
        name = "qwen3_5" if gated_deltanet else "llama"
        log.warning("target model type %s is not one the suite proves (%s): running it as %s", model_type, ", ".join(MODEL_TYPES), name)
    return name
