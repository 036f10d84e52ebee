"""What the extraction benchmark (bench/extract.py) runs on: the device, the target of each --shape
(random weights of the real Qwen3.6-27B text shape, or the tiny one through the real loading path),
its FLOPs per token, lognormal samples cut into chunks like prepare's, and the store they go through.
bench/speedup.py runs on the same device and the same 27B shape.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import torch

from dflash_jobs.architectures import qwen3_5
from dflash_jobs.capture.target import CaptureTarget, load_capture_target, prepare_for_capture
from dflash_jobs.formats import DATASET_KEY, DONE_MARKERS, ChunkInfo, DatasetIndex, TokenChunk, chunk_of_key, hidden_chunk_key, token_chunk_key
from dflash_jobs.spec import TargetSpec, default_layers
from dflash_jobs.storage import LocalStorage

REAL_27B = dict(
    hidden_size=5120, num_hidden_layers=64, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
    linear_value_head_dim=128, vocab_size=248320,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
)


def bench_device(name: str) -> torch.device:
    """--device with its index ("cuda": the current one), as the memory and timing calls want it."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def random_27b(device: torch.device) -> CaptureTarget:
    """Random weights of the real Qwen3.6-27B text shape, cut after layer 61 (throughput ignores the values)."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    config = Qwen3_5TextConfig(**REAL_27B)
    layers = default_layers(config.num_hidden_layers)
    config.num_hidden_layers = max(layers) + 1
    config.layer_types = config.layer_types[: config.num_hidden_layers]
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3_5TextModel(config)
    finally:
        torch.set_default_dtype(previous)
    return CaptureTarget(model=prepare_for_capture(model, layers), layers=layers, hidden_size=config.hidden_size,
                  name="random-qwen3.6-27b-shape", config_hash=hashlib.sha256(config.to_json_string().encode()).hexdigest(),
                  architecture=qwen3_5.ARCHITECTURE, conv_gap=qwen3_5.packing_gap(config))


def tiny(device: torch.device, workdir: Path) -> CaptureTarget:
    """The tiny target through the real loading path (save_pretrained layout -> load_capture_target)."""
    from dflash_jobs.architectures.tiny import write_tiny_target

    checkpoint = write_tiny_target(workdir / "tiny-target")
    return load_capture_target(TargetSpec(model=str(checkpoint)), checkpoint=checkpoint, layers=[1, 3, 6], device=device)


def build_target(shape: str, device: torch.device, workdir: Path) -> CaptureTarget:
    return random_27b(device) if shape == "27b" else tiny(device, workdir)


def lognormal_chunks(count: int, *, mean: float, max_length: int, chunk_tokens: int, vocab: int, seed: int) -> list[TokenChunk]:
    """Samples of realistic lengths (lognormal, sigma 0.8, clipped to [16, max_length]) cut into chunks like prepare."""
    rng = np.random.default_rng(seed)
    sigma = 0.8
    lengths = np.clip(rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, count).astype(int), 16, max_length)
    chunks, current = [], []
    for length in lengths.tolist():
        if current and sum(current) + length > chunk_tokens:
            chunks.append(current)
            current = []
        current.append(length)
    chunks.append(current)
    out, first = [], 0
    for lengths in chunks:
        total = sum(lengths)
        out.append(TokenChunk(
            input_ids=rng.integers(0, vocab, total, dtype=np.int32), loss_mask=np.ones(total, dtype=np.uint8),
            cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            sample_ids=np.arange(first, first + len(lengths), dtype=np.int64),
        ))
        first += len(lengths)
    return out


class DiscardingStorage(LocalStorage):
    """A local store that drops each hidden-state chunk once its done marker is written (after it was
    fully written and fsynced): a 500K-token run is 25 GB of states, more than a work disk keeps."""

    def put_if_absent(self, key: str, data: bytes) -> bool:
        created = super().put_if_absent(key, data)
        if key.startswith(DONE_MARKERS):
            self.delete(hidden_chunk_key(chunk_of_key(key)))
        return created


def write_run(root: Path, chunks: list[TokenChunk]) -> tuple[DiscardingStorage, list[ChunkInfo]]:
    shutil.rmtree(root, ignore_errors=True)
    storage = DiscardingStorage(root)
    infos = []
    for cid, chunk in enumerate(chunks):
        storage.put_bytes(token_chunk_key(cid), chunk.encode())
        infos.append(ChunkInfo(cid, token_chunk_key(cid), chunk.num_samples, chunk.num_tokens))
    storage.put_bytes(DATASET_KEY, DatasetIndex(samples=sum(i.samples for i in infos), tokens=sum(i.tokens for i in infos),
                                                vocab_size=0, chunks=infos).to_json().encode())
    return storage, infos


def model_flops(target: CaptureTarget, chunks: list[TokenChunk]) -> float:
    """2 x non-embedding parameters per token, plus causal attention on the full-attention layers."""
    model, config = target.model, target.model.config
    params = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    params += sum(b.numel() for name, b in model.named_buffers() if name.endswith(".weight"))  # FP8 weights are buffers
    tokens = sum(c.num_tokens for c in chunks)
    full_layers = sum(1 for kind in (getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers) if kind == "full_attention")
    squares = sum(float((c.lengths.astype(np.float64) ** 2).sum()) for c in chunks)
    attention = 2 * config.num_attention_heads * config.head_dim * squares * full_layers  # QK^T and PV, causal half
    return 2 * params * tokens + attention
