"""Hidden-state chunks and done markers exactly as extract workers leave them, without a model:
random states of the right shape through formats.encode_hidden_chunk (used by verify and pipeline tests)."""

from __future__ import annotations

import numpy as np
import torch

from dflash_jobs.formats import (
    DATASET_KEY,
    ChunkInfo,
    DatasetIndex,
    DoneMarker,
    TokenChunk,
    done_key,
    encode_hidden_chunk,
    hidden_chunk_key,
    token_chunk_key,
)

LAYERS = [1, 3]
HIDDEN = 8
CHUNKS = 4


def token_chunk(chunk: int) -> TokenChunk:
    rng = np.random.default_rng(chunk)
    lengths = [5 + chunk, 7]
    tokens = sum(lengths)
    return TokenChunk(
        input_ids=rng.integers(0, 100, tokens, dtype=np.int32),
        loss_mask=np.ones(tokens, dtype=np.uint8),
        cu_seqlens=np.array([0, lengths[0], tokens], dtype=np.int64),
        sample_ids=np.array([2 * chunk, 2 * chunk + 1], dtype=np.int64),
    )


def hidden_chunk(
    chunk: int, *, seed: int = 0, model: str = "tiny", config_hash: str = "cfg1", dtype: str = "bfloat16", final_hidden: bool = False,
) -> bytes:
    tokens = token_chunk(chunk)
    generator = torch.Generator().manual_seed(seed * 1000 + chunk)
    hidden = torch.randn(tokens.num_tokens, len(LAYERS), HIDDEN, generator=generator).to(torch.bfloat16)
    final = torch.randn(tokens.num_tokens, HIDDEN, generator=generator).to(torch.bfloat16) if final_hidden else None
    return encode_hidden_chunk(tokens, hidden, layers=LAYERS, model=model, config_hash=config_hash, dtype=dtype, final_hidden=final)


def mark_done(storage, chunk: int, data: bytes, *, dtype: str = "bfloat16", final_hidden: str | None = None) -> DoneMarker:
    """What an extract worker does: the object first, then its marker."""
    put = storage.put_bytes(hidden_chunk_key(chunk), data)
    tokens = token_chunk(chunk)
    marker = DoneMarker(
        chunk=chunk, samples=tokens.num_samples, tokens=tokens.num_tokens, bytes=put.size, sha256=put.sha256,
        etag=put.etag, dtype=dtype, layers=LAYERS, hidden_size=HIDDEN, shard=chunk % 2, final_hidden=final_hidden,
    )
    storage.put_bytes(done_key(chunk), marker.to_json().encode())
    return marker


def write_dataset(storage, *, chunks: int = CHUNKS) -> None:
    """tokens/dataset.json of `chunks` token chunks, as prepare writes it."""
    infos = [ChunkInfo(id=c, path=token_chunk_key(c), samples=2, tokens=token_chunk(c).num_tokens) for c in range(chunks)]
    index = DatasetIndex(
        samples=sum(i.samples for i in infos), tokens=sum(i.tokens for i in infos), vocab_size=100, chunks=infos
    )
    storage.put_bytes(DATASET_KEY, index.to_json().encode())


def extracted_run(storage, *, chunks: int = CHUNKS, final_hidden: bool = False) -> list[DoneMarker]:
    """A prepared and fully extracted run (with the target's final hidden state in every chunk: `final_hidden`)."""
    write_dataset(storage, chunks=chunks)
    final = "bfloat16" if final_hidden else None
    return [mark_done(storage, c, hidden_chunk(c, final_hidden=final_hidden), final_hidden=final) for c in range(chunks)]
