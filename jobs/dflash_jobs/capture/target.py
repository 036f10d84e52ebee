"""The target model, loaded for capture: text model only, cut after the deepest captured layer (or,
when the run stores the target's final hidden state, run through its last decoder layer).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_jobs.architectures import TargetArchitecture, target_architecture
from dflash_jobs.capture.checkpoint import read_config
from dflash_jobs.errors import InputError, SpecError
from dflash_jobs.selfcheck import CAUSAL_CONV1D, FLA, check_fast_path
from dflash_jobs.spec import TargetSpec, text_config

log = logging.getLogger("dflash.capture")


@dataclass(frozen=True, slots=True)
class FastPaths:
    fla: bool
    causal_conv1d: bool

    @classmethod
    def detect(cls, device: torch.device, architecture: TargetArchitecture) -> FastPaths:
        """Which Gated DeltaNet kernels transformers binds: none probed for an architecture without such
        layers, none usable on a CPU (their Triton kernels need a GPU)."""
        if device.type != "cuda" or not architecture.gated_deltanet:
            return cls(fla=False, causal_conv1d=False)
        return cls(
            fla=check_fast_path(FLA, "warn").status == "ok",
            causal_conv1d=check_fast_path(CAUSAL_CONV1D, "warn").status == "ok",
        )

    def as_dict(self) -> dict[str, bool]:
        return {"flash-linear-attention": self.fla, "causal-conv1d": self.causal_conv1d}

    def describe(self, architecture: TargetArchitecture) -> str:
        """For the log: what the Gated DeltaNet layers run on."""
        if not architecture.gated_deltanet:
            return "none needed (no Gated DeltaNet layers)"
        return (f"flash-linear-attention {'on' if self.fla else 'OFF (torch fallback)'}, "
                f"causal-conv1d {'on' if self.causal_conv1d else 'off (torch fallback, slower)'}")


@dataclass(slots=True)
class CaptureTarget:
    """A loaded target, ready to capture."""

    model: torch.nn.Module
    """The base decoder (embeddings + layers 0..deepest): no LM head, final norm skipped."""
    layers: list[int]
    hidden_size: int
    name: str
    config_hash: str
    architecture: TargetArchitecture
    conv_gap: int
    """Masked tokens after every packed sample: the architecture's packing gap (the Gated DeltaNet conv kernel - 1, 0 for a dense model)."""
    final_hidden: bool = False
    """Also capture the output of the model's last decoder layer (the target's last: loaded whole)."""

    @property
    def decoder_layers(self) -> torch.nn.ModuleList:
        return self.model.layers

    @property
    def final_layer(self) -> int | None:
        """The decoder layer whose output is the final hidden state (before the final norm), when captured."""
        return len(self.decoder_layers) - 1 if self.final_hidden else None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def capture_depth(layers: list[int], num_hidden_layers: int, *, final_hidden: bool) -> int:
    """Decoder layers to run: through the deepest captured one, or all of them for the final hidden state."""
    return num_hidden_layers if final_hidden else max(layers) + 1


def prepare_for_capture(model: torch.nn.Module, layers: list[int], *, final_hidden: bool = False) -> torch.nn.Module:
    """Cuts a base decoder after the deepest captured layer (keeps all with `final_hidden`) and drops
    its final norm (never read)."""
    depth = capture_depth(layers, len(model.layers), final_hidden=final_hidden)
    if len(model.layers) < max(layers) + 1:
        raise SpecError("target.layers", layers, f"layer indices below the model's depth ({len(model.layers)})")
    model.layers = model.layers[:depth]
    model.config.num_hidden_layers = depth
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:depth]
    # Hooks read each captured layer's raw output, the final hidden state included (the last layer's
    # output before the norm): the final norm would only normalise layer `depth - 1` again.
    model.norm = torch.nn.Identity()
    return model.eval().requires_grad_(False)


def load_capture_target(
    spec: TargetSpec, *, checkpoint: Path, layers: list[int], device: torch.device, dtype: torch.dtype = torch.bfloat16,
    final_hidden: bool = False,
) -> CaptureTarget:
    """Loads the text model of `checkpoint` (a local directory), truncated (whole with
    `final_hidden`: its last decoder layer's output is captured too), on `device`."""
    from transformers import AutoConfig, AutoModel
    from transformers.utils import logging as hf_logging

    config_text, raw_config = read_config(spec, checkpoint)
    config = AutoConfig.from_pretrained(checkpoint).get_text_config()
    depth = capture_depth(layers, config.num_hidden_layers, final_hidden=final_hidden)
    config.num_hidden_layers = depth
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:depth]
    started = time.monotonic()
    # The dropped layers, the vision tower and the LM head are reported as unexpected keys: expected here.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModel.from_pretrained(
            checkpoint, config=config, dtype=dtype, attn_implementation=spec.attn_implementation,
            device_map=str(device), output_loading_info=True,
        )
    except OSError as exc:  # no weight files: every shard would fail alike, so a spec error, not a retry
        raise SpecError("target.model", spec.model, f"a checkpoint directory with its weights (*.safetensors) ({exc})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise InputError(
            f"target.model {spec.model}: {len(missing)} weights of the text model are missing from the checkpoint (first: {missing[0]})",
            "Point target.model at a complete Hugging Face checkpoint of a causal LM (Qwen3.5/3.6, Llama)",
        )
    model = prepare_for_capture(model, layers, final_hidden=final_hidden)
    architecture = target_architecture(config)
    log.info("loaded %s (%s, %d of %d layers, capturing %s%s) in %.1f s on %s",
             checkpoint, type(model).__name__, depth, text_config(raw_config)["num_hidden_layers"],
             layers, f" and the final hidden state (layer {depth - 1}, before the norm)" if final_hidden else "",
             time.monotonic() - started, device)
    return CaptureTarget(
        model=model,
        layers=layers,
        hidden_size=int(config.hidden_size),
        name=spec.model.rstrip("/").rsplit("/", 1)[-1] or raw_config.get("_name_or_path", "target"),
        config_hash=hashlib.sha256(config_text.encode()).hexdigest(),
        architecture=architecture,
        conv_gap=architecture.packing_gap(config),
        final_hidden=final_hidden,
    )
