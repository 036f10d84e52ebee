"""What the drafter borrows from the target checkpoint, read from its safetensors alone.

Training never loads the target model (27B): it needs the embedding and the LM head, which the
drafter shares, and the final norm, through which DSpark's objective reads the target's next-token
distribution: three tensors read by key name with ranged reads, from a local directory or an s3://
prefix.
Key names are the target architecture's (architectures/: `weight_prefixes`): Qwen3.5/3.6 multimodal
checkpoints nest the text model (`model.language_model.*`), text-only ones and Llama's do not
(`model.*`); `lm_head.weight` is absent when the embeddings are tied (SmolLM2, Llama 3.2 1B/3B).

Norm semantics: Qwen3.5/3.6 store a zero-centred final norm applied as x * (1 + w) (transformers'
Qwen3_5RMSNorm; `zero_centred_norms`); the drafter applies norms as Qwen3's x * w, so the weight is
converted here, once, to 1 + w. (The drafter's own final norm, which the export holds and vLLM
applies as x * w, starts at 1 and is trained: drafter/model.py.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from dflash_jobs.architectures import target_architecture
from dflash_jobs.errors import InputError
from dflash_jobs.formats import fetch_header_bytes, read_header
from dflash_jobs.spec import TrainSpec, rope_kind, text_config
from dflash_jobs.storage import Storage

LM_HEAD_KEY = "lm_head.weight"
_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass
class TargetTensors:
    embed_tokens: torch.Tensor  # [V, d]
    lm_head: torch.Tensor  # [V, d]; the embedding itself when tied
    final_norm: torch.Tensor  # [d], as a Qwen3 x * w weight


class TargetCheckpoint:
    """A HF checkpoint in storage: its config, its weight map and single tensors by name."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.config: dict[str, Any] = json.loads(self._get("config.json"))
        self.text = text_config(self.config)
        self.architecture = target_architecture(self.config)
        self._weight_map = self._read_weight_map()

    def _get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        if not self.storage.exists(key):
            raise InputError(f"target checkpoint {self.storage.url} has no {key}", "Point target.model at a HF checkpoint directory (config.json + *.safetensors)")
        return self.storage.get_bytes(key, start, end)

    def _read_weight_map(self) -> dict[str, str]:
        if self.storage.exists(INDEX_FILE):
            return dict(json.loads(self._get(INDEX_FILE))["weight_map"])
        header, _ = read_header(self._header_bytes(SINGLE_FILE), f"{self.storage.url}/{SINGLE_FILE}")
        return {key: SINGLE_FILE for key in header if key != "__metadata__"}

    def _header_bytes(self, file: str) -> bytes:
        return fetch_header_bytes(lambda start, end: self._get(file, start, end))

    def find(self, candidates: tuple[str, ...]) -> str | None:
        return next((key for key in candidates if key in self._weight_map), None)

    def read_tensor(self, key: str) -> torch.Tensor:
        """One tensor, fetched with two ranged reads (header, then the tensor's bytes)."""
        file = self._weight_map[key]
        name = f"{self.storage.url}/{file}"
        prefix = self._header_bytes(file)
        header, _ = read_header(prefix, name)
        length = len(prefix)
        entry = header[key]
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise InputError(f"{name}: {key} is {entry['dtype']}", f"Use a checkpoint with {sorted(_SAFETENSORS_DTYPES)} weights")
        begin, end = entry["data_offsets"]
        data = bytearray(self._get(file, length + begin, length + end))
        return torch.frombuffer(data, dtype=_SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])

    def read_target_tensors(self) -> TargetTensors:
        prefixes = self.architecture.weight_prefixes
        embed_key, norm_key = (self.find(tuple(prefix + name for prefix in prefixes)) for name in ("embed_tokens.weight", "norm.weight"))
        if embed_key is None or norm_key is None:
            looked = [prefix + name for name in ("embed_tokens.weight", "norm.weight") for prefix in prefixes]
            raise InputError(
                f"target checkpoint {self.storage.url} lacks {'the embedding' if embed_key is None else 'the final norm'} (looked for {looked})",
                "Point target.model at the target's HF checkpoint",
            )
        embed = self.read_tensor(embed_key)
        if self.find((LM_HEAD_KEY,)) is not None:
            lm_head = self.read_tensor(LM_HEAD_KEY)
        elif self.tied_embeddings:
            lm_head = embed
        else:
            raise InputError(f"target checkpoint {self.storage.url} has no {LM_HEAD_KEY} and does not tie its embeddings", "Use a complete checkpoint")
        norm = self.read_tensor(norm_key).float()
        return TargetTensors(embed, lm_head, 1.0 + norm if self.architecture.zero_centred_norms else norm)

    @property
    def tied_embeddings(self) -> bool:
        return bool(self.text.get("tie_word_embeddings", self.config.get("tie_word_embeddings", False)))

    @property
    def rope_theta(self) -> float:
        """The RoPE base the drafter takes over. A scaled RoPE (YaRN, linear, dynamic) is refused: the
        drafter's RoPE has none, and a drafter exported without the target's scaling would place its
        positions otherwise than the target does, past the original context most."""
        kind = rope_kind(self.config)
        if kind != "default":
            raise InputError(
                f"the target {self.storage.url} scales its RoPE ({kind!r}), which the DFlash drafter does not implement",
                "Train the drafter for a target with plain RoPE (rope_type 'default'), or drop the scaling from its config.json if it serves without it",
            )
        return float((self.text.get("rope_parameters") or {}).get("rope_theta", self.text.get("rope_theta", 1e6)))

    def read_optional(self, key: str) -> bytes | None:
        """A file beside the weights (the tokenizer's, the generation config), or None where there is none."""
        return self.storage.get_bytes(key) if self.storage.exists(key) else None

    def tokenizer_size(self) -> int | None:
        """len(tokenizer) of the tokenizer.json beside the weights (added tokens included), or None."""
        data = self.read_optional("tokenizer.json")
        if data is None:
            return None
        from tokenizers import Tokenizer

        return Tokenizer.from_str(data.decode()).get_vocab_size(with_added_tokens=True)


def drafter_config_for_target(target: TargetCheckpoint, train: TrainSpec, layers: list[int], mask_token_id: int):
    """The drafter shape for this target: z-lab copies the target's attention and FFN shape."""
    from dflash_jobs.drafter.model import DrafterConfig

    text = target.text
    sliding = train.sliding_window_layers
    return DrafterConfig(
        hidden_size=text["hidden_size"],
        num_layers=train.draft_layers,
        num_attention_heads=text["num_attention_heads"],
        num_key_value_heads=text["num_key_value_heads"],
        head_dim=text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
        intermediate_size=text["intermediate_size"],
        vocab_size=text["vocab_size"],
        target_layer_ids=list(layers),
        num_target_layers=text["num_hidden_layers"],
        block_size=train.block_size,
        mask_token_id=mask_token_id,
        layer_types=["sliding_attention"] * sliding + ["full_attention"] * (train.draft_layers - sliding),
        sliding_window=train.sliding_window,
        rope_theta=target.rope_theta,
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        max_position_embeddings=text.get("max_position_embeddings", 262144),
    )
