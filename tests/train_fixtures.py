"""A tiny extract for drafter and training tests: the tiny target's real hidden states over the
tiny chat data set, written as hidden-state chunks with done markers and a manifest, exactly as
extraction and verify leave them. Built once per test session (shared by test_drafter*/test_train*)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dflash_jobs.architectures import ARCHITECTURE_MODULES
from dflash_jobs.architectures.tiny import DEBUGMODEL, write_tiny_target
from dflash_jobs.architectures.tiny.chats import tiny_chat_rows
from dflash_jobs.formats import (
    DATASET_KEY, MANIFEST_KEY, DatasetIndex, DoneMarker, Manifest, TokenChunk, done_key, hidden_chunk_key, hidden_metadata, hidden_tensors, quantize_fp8,
    safetensors_parts, token_chunk_key,
)
from dflash_jobs.prepare import HOLDOUT_KEY
from dflash_jobs.rows import ChatEncoder
from dflash_jobs.spec import default_layers, parse_spec
from dflash_jobs.storage import open_storage

DOCUMENTS = 48
CHUNKS = 4
LAYERS = default_layers(DEBUGMODEL.num_layers)
ARCHITECTURES = tuple(ARCHITECTURE_MODULES)
"""Every target architecture, each run on its tiny target (dflash_jobs.architectures.tiny)."""


def tiny_target(root: Path, architecture: str = "qwen3_5") -> Path:
    """The tiny checkpoint of `architecture` under `root`, written once."""
    directory = root / f"tiny-{architecture}"
    if not (directory / "config.json").exists():
        write_tiny_target(directory, architecture=architecture)
    return directory


def fresh_drafter(target: Path, train):
    """A fresh drafter of train.drafter (a TrainSpec) for the tiny target, built as training builds
    it (seed 0), holding the target's frozen tensors, on the CPU."""
    from dflash_jobs.drafter.checkpoint import TargetCheckpoint, drafter_config_for_target
    from dflash_jobs.variants import drafter_variant

    checkpoint = TargetCheckpoint(open_storage(str(target)))
    variant = drafter_variant(train.drafter)
    config = variant.build_config(drafter_config_for_target(checkpoint, train, LAYERS, mask_token_id(checkpoint)), train)
    torch.manual_seed(0)
    drafter = variant.build_model(config)
    tensors = checkpoint.read_target_tensors()
    drafter.load_target_tensors(tensors.embed_tokens, tensors.lm_head, tensors.final_norm)
    return drafter


def mask_token_id(checkpoint) -> int:
    """The mask token training picks for a target checkpoint (drafter/mask_token.py), over data that holds none of the candidates."""
    from dflash_jobs.drafter.mask_token import pick_mask_token

    return pick_mask_token(checkpoint, None, data_holds=lambda ids: set()).id


def copy_extract(extract: Path, output: Path) -> Path:
    """A run directory of its own holding a copy of the shared tiny extract (tests train in it)."""
    import shutil

    shutil.copytree(extract, output)
    return output


def tiny_extract(root: Path, *, dtype: str = "bfloat16", final_hidden: bool = False, architecture: str = "qwen3_5") -> Path:
    """An output directory holding tokens/ and extract/ as prepare, extraction and verify leave them:
    the token chunks, the hidden-state chunks of the tiny target of `architecture` (with its final
    hidden state in every chunk: `final_hidden`), their done markers and the manifest."""
    output = root / f"extract-{dtype}{'-final' if final_hidden else ''}{'' if architecture == 'qwen3_5' else f'-{architecture}'}"
    if (output / MANIFEST_KEY).exists():
        return output
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tiny_target(root, architecture)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    encoder = ChatEncoder(tokenizer)
    rows = list(tiny_chat_rows(DOCUMENTS, seed=1))
    samples = encoder.encode([encoder.render(row) for row in rows])
    all_hidden, all_final = captured_layers(model, [ids for ids, _ in samples])
    chunks = []
    for chunk in range(CHUNKS):
        ids = list(range(chunk, DOCUMENTS, CHUNKS))
        tokens = TokenChunk(
            input_ids=np.concatenate([samples[i][0] for i in ids]),
            loss_mask=np.concatenate([samples[i][1] for i in ids]),
            cu_seqlens=np.concatenate([[0], np.cumsum([len(samples[i][0]) for i in ids])]).astype(np.int64),
            sample_ids=np.asarray(ids, dtype=np.int64),
        ).validate("tiny")
        final = torch.cat([all_final[i] for i in ids]) if final_hidden else None  # [T, d]
        chunks.append((tokens, torch.cat([all_hidden[i] for i in ids]), final))  # [T, L, d]
    write_extract(open_storage(str(output)), chunks, model=str(target), layers=LAYERS, dtype=dtype)
    return output


def write_extract(storage, chunks, *, model: str, layers: list[int], dtype: str) -> Manifest:
    """Hidden-state chunks ((TokenChunk, states [T, L, d]) each, or (TokenChunk, states, final
    hidden state [T, d] or None), on any device: fp8 is quantized there) with their token chunks,
    done markers and the manifest, as extraction and verify leave them."""

    def stored(states):
        if dtype == "float8_e4m3fn":
            quantized, scale = quantize_fp8(states)
            return quantized.cpu(), scale.cpu()
        return states.to(torch.bfloat16).cpu(), None

    markers = []
    for chunk, (tokens, hidden, *final) in enumerate(chunks):  # a generator keeps one chunk in memory at a time
        final = final[0] if final else None
        states, scale = stored(hidden)
        final_states, final_scale = stored(final) if final is not None else (None, None)
        final_dtype = None if final is None else dtype
        metadata = hidden_metadata(layers=layers, model=model, config_hash="synthetic", dtype=dtype, final_hidden=final_dtype)
        storage.put_bytes(token_chunk_key(chunk), tokens.encode())
        tensors = hidden_tensors(tokens, states, scale, final_states, final_scale)
        put = storage.put_parts(hidden_chunk_key(chunk), safetensors_parts(tensors, metadata))
        marker = DoneMarker(
            chunk=chunk, samples=tokens.num_samples, tokens=tokens.num_tokens, bytes=put.size, sha256=put.sha256,
            etag=put.etag, dtype=dtype, layers=layers, hidden_size=hidden.shape[-1], final_hidden=final_dtype,
        )
        storage.put_bytes(done_key(chunk), marker.to_json().encode())
        markers.append(marker)
    final_hidden = {m.final_hidden for m in markers}
    manifest = Manifest(
        model=model, layers=layers, dtype=dtype, hidden_size=markers[0].hidden_size,
        samples=sum(m.samples for m in markers), tokens=sum(m.tokens for m in markers), bytes=sum(m.bytes for m in markers),
        chunks=markers, final_hidden=final_hidden.pop() if len(final_hidden) == 1 else None,
    )
    storage.put_bytes(MANIFEST_KEY, manifest.to_json().encode())
    return manifest


def synthetic_chunk(chunk: int, *, documents: int, document_tokens: int, layers: int, hidden_size: int, vocab_size: int,
                    device: str = "cpu"):
    """(TokenChunk, random states [T, L, d] on `device`) of `documents` equal documents, 10% of each
    a prompt: chunks of the real format and shape, without running a target."""
    g = torch.Generator().manual_seed(chunk)
    loss_mask = np.ones(document_tokens, dtype=np.uint8)
    loss_mask[: document_tokens // 10] = 0
    tokens = TokenChunk(
        input_ids=torch.randint(0, vocab_size, (documents * document_tokens,), generator=g, dtype=torch.int32).numpy(),
        loss_mask=np.tile(loss_mask, documents),
        cu_seqlens=np.arange(documents + 1, dtype=np.int64) * document_tokens,
        sample_ids=np.arange(chunk * documents, (chunk + 1) * documents, dtype=np.int64),
    ).validate(f"synthetic chunk {chunk}")
    states = torch.empty(documents * document_tokens, layers, hidden_size, dtype=torch.bfloat16, device=device)
    return tokens, states.normal_(generator=torch.Generator(device).manual_seed(chunk))


def captured_layers(model, documents: list[np.ndarray]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """[T, L, d] per document from one right-padded forward (exact for real tokens: qwen_gdn.md),
    and [T, d] of the final hidden state: the last decoder layer's output, before the final norm
    (Transformers' last hidden state is after it)."""
    longest = max(len(ids) for ids in documents)
    batch = torch.zeros(len(documents), longest, dtype=torch.long)
    for row, ids in enumerate(documents):
        batch[row, : len(ids)] = torch.from_numpy(ids.astype(np.int64))
    last = {}
    hook = model.model.layers[-1].register_forward_hook(lambda module, args, output: last.update(out=output))
    try:
        with torch.no_grad():
            states = model(batch, output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    stacked = torch.stack([states[layer + 1] for layer in LAYERS], dim=2)  # [n, T, L, d]
    final = last["out"][0] if isinstance(last["out"], tuple) else last["out"]  # [n, T, d]
    return ([stacked[row, : len(ids)] for row, ids in enumerate(documents)],
            [final[row, : len(ids)] for row, ids in enumerate(documents)])


def write_holdout(output: Path, samples: list[tuple[np.ndarray, np.ndarray]], *, vocab_size: int) -> None:
    """Held-out samples, (input ids, loss mask) each, as prepare leaves them: tokens/holdout.safetensors,
    named in tokens/dataset.json (a data set of no training chunks)."""
    holdout = TokenChunk(
        input_ids=np.concatenate([ids for ids, _ in samples]).astype(np.int32),
        loss_mask=np.concatenate([mask for _, mask in samples]).astype(np.uint8),
        cu_seqlens=np.concatenate([[0], np.cumsum([len(ids) for ids, _ in samples])]).astype(np.int64),
        sample_ids=np.arange(len(samples), dtype=np.int64),
    ).validate("holdout")
    storage = open_storage(str(output))
    storage.put_bytes(HOLDOUT_KEY, holdout.encode())
    index = DatasetIndex(samples=0, tokens=0, vocab_size=vocab_size, chunks=[], holdout={"samples": len(samples), "path": HOLDOUT_KEY})
    storage.put_bytes(DATASET_KEY, index.to_json().encode())


def hold_out_tiny_chats(target: Path, output: Path, count: int, *, seed: int) -> None:
    """`count` tiny chats, never trained on, encoded by the target's tokenizer as the held-out samples."""
    from transformers import AutoTokenizer

    encoder = ChatEncoder(AutoTokenizer.from_pretrained(target))
    samples = encoder.encode([encoder.render(row) for row in tiny_chat_rows(count, seed=seed)])
    write_holdout(output, samples, vocab_size=DEBUGMODEL.vocab_size)


def train_spec_dict(target: Path, output: Path, **train) -> dict:
    """A spec for the tiny extract: a 2-layer drafter, blocks of 4, a short schedule."""
    return {
        "name": "tiny-train",
        "backend": "local",
        "target": {"model": str(target), "layers": LAYERS},
        "data": {"source": str(output / "chats.jsonl"), "max_length": 512, "chunk_tokens": 4096},
        "output": str(output),
        "train": {
            "draft_layers": 2, "sliding_window_layers": 1, "sliding_window": 32, "block_size": 4, "anchors": 16,
            "epochs": 3, "lr": 3e-3, "micro_batch_tokens": 1024, "checkpoint_every": 8, "gpus_per_node": 1, **train,
        },
    }


def write_spec(path: Path, spec: dict) -> Path:
    import yaml

    parse_spec(spec)  # fail here, not in the subprocess
    path.write_text(yaml.safe_dump(spec))
    return path
