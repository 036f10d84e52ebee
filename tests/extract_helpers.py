"""Helpers for the extraction tests: a prepared run (token chunks + dataset index) on the tiny target."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import yaml

from dflash_jobs.formats import DATASET_KEY, ChunkInfo, DatasetIndex, TokenChunk, token_chunk_key
from dflash_jobs.storage import Storage, open_storage

LAYERS = [1, 3, 6]
VOCAB = 900
"""Token ids the random chunks draw from: below every tiny target's vocabulary (the tiny Llama's tokenizer has 975 tokens, its every row)."""
_TARGET: dict[str, Path] = {}


def tiny_target(tmp_path_factory, architecture: str = "qwen3_5") -> Path:
    """One tiny checkpoint of each architecture per test process (building its tokenizer takes seconds)."""
    if architecture not in _TARGET:
        from dflash_jobs.architectures.tiny import write_tiny_target

        _TARGET[architecture] = write_tiny_target(tmp_path_factory.mktemp(f"tiny-{architecture}"), architecture=architecture)
    return _TARGET[architecture]


def random_chunks(seed: int, count: int, *, min_len: int = 2, max_len: int = 48, vocab: int = VOCAB) -> list[TokenChunk]:
    rng = np.random.default_rng(seed)
    chunks, first_sample = [], 0
    for _ in range(count):
        lengths = rng.integers(min_len, max_len + 1, size=int(rng.integers(3, 7)))
        ids = rng.integers(0, vocab, int(lengths.sum())).astype(np.int32)
        chunks.append(TokenChunk(
            input_ids=ids,
            loss_mask=(rng.random(len(ids)) < 0.5).astype(np.uint8),
            cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            sample_ids=np.arange(first_sample, first_sample + len(lengths), dtype=np.int64),
        ))
        first_sample += len(lengths)
    return chunks


def write_prepared(storage: Storage, chunks: list[TokenChunk]) -> list[ChunkInfo]:
    """What prepare leaves behind: token chunks and tokens/dataset.json."""
    infos = []
    for cid, chunk in enumerate(chunks):
        storage.put_bytes(token_chunk_key(cid), chunk.encode())
        infos.append(ChunkInfo(cid, token_chunk_key(cid), chunk.num_samples, chunk.num_tokens))
    index = DatasetIndex(
        samples=sum(c.samples for c in infos), tokens=sum(c.tokens for c in infos), vocab_size=1024, chunks=infos,
    )
    storage.put_bytes(DATASET_KEY, index.to_json().encode())
    return infos


def write_spec(path: Path, *, target: Path, output: Path, train: dict | None = None, **extract) -> Path:
    spec = {
        "name": "extract-test",
        "backend": "local",
        "target": {"model": str(target), "layers": LAYERS},
        "data": {"source": str(output / "chats.jsonl"), "max_length": 48, "chunk_tokens": 512},
        "output": str(output),
        "extract": {"shards": 1, "token_budget": 96, "pad_multiple": 16, "sort_window": 1, **extract},
        **({"train": train} if train is not None else {}),
    }
    path.write_text(yaml.safe_dump(spec))
    return path


def reference_states(model, ids: np.ndarray, layers: list[int]) -> torch.Tensor:
    """One sample alone, unpadded, through the full causal LM with output_hidden_states: [T, L, d].

    Layer i is HF output_hidden_states[i + 1] (index 0 is the embeddings): the convention pinned here."""
    with torch.inference_mode():
        out = model(torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True, use_cache=False)
    return torch.stack([out.hidden_states[i + 1][0] for i in layers], dim=1)


def prepared_run(tmp_path: Path, chunks: list[TokenChunk]) -> tuple[Storage, list[ChunkInfo]]:
    storage = open_storage(str(tmp_path / "run"))
    return storage, write_prepared(storage, chunks)
