"""The layer convention at its edge, pinned on each tiny target through the real extraction path.

`target.layers: [i, ...]` captures the output of decoder layer i, before the final norm. For every
layer but the last that is Transformers' output_hidden_states[i + 1]; for the last decoder layer,
Transformers' entry is after the final norm, while ours (and vLLM's aux state num_hidden_layers,
which speculators appends to its files) is before it. A deliberate choice: the drafter and the
peers read the residual stream, and a consumer that wants the target's logits applies the final
norm itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_jobs.extract.progress import Summary
from dflash_jobs.capture.target import load_capture_target
from dflash_jobs.extract.worker import ExtractWorker
from dflash_jobs.formats import HiddenChunk, hidden_chunk_key
from dflash_jobs.spec import ExtractSpec, TargetSpec
from dflash_jobs.architectures.tiny import DEBUGMODEL

from extract_helpers import prepared_run, random_chunks, tiny_target

LAST = DEBUGMODEL.num_layers - 1
LAYERS = [2, LAST]
BF16_ULP = 2.0**-7


@pytest.fixture(scope="module")
def checkpoint(architecture, tmp_path_factory):
    return tiny_target(tmp_path_factory, architecture)


def extract(checkpoint, tmp_path, chunks) -> HiddenChunk:
    target = load_capture_target(TargetSpec(model=str(checkpoint), layers=LAYERS), checkpoint=checkpoint, layers=LAYERS, device=torch.device("cpu"), dtype=torch.float32)
    storage, infos = prepared_run(tmp_path, chunks)
    worker = ExtractWorker(
        ExtractSpec(shards=1, token_budget=96, pad_multiple=16, sort_window=1), target=target, storage=storage, chunks=infos,
        summary=Summary(shard=0, shards=1), max_length=48, packed=False, log_interval=0.0,
    )
    try:
        with torch.inference_mode():
            worker.run()
    finally:
        worker.close()
    return HiddenChunk.decode(storage.get_bytes(hidden_chunk_key(0)), hidden_chunk_key(0))


def close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return bool(((got.float() - expected).abs() <= BF16_ULP * expected.abs() + 1e-3).all())


def test_the_last_decoder_layer_is_captured_before_the_final_norm(checkpoint, tmp_path):
    chunks = random_chunks(seed=7, count=1, min_len=8, max_len=24)
    stored = extract(checkpoint, tmp_path, chunks)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    decoder = model.model.layers
    assert len(decoder) == LAST + 1

    pre_norm = {}
    hook = decoder[LAST].register_forward_hook(lambda module, args, output: pre_norm.update(last=output[0] if isinstance(output, tuple) else output))
    try:
        for i in range(chunks[0].num_samples):
            ids, _ = chunks[0].sample(i)
            begin, end = chunks[0].cu_seqlens[i], chunks[0].cu_seqlens[i + 1]
            with torch.inference_mode():
                states = model(torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True).hidden_states
            assert len(states) == LAST + 2  # the embeddings, then one entry per decoder layer
            ours = stored.hidden_states[begin:end]
            # A middle layer: HF's entry i + 1.
            assert close(ours[:, 0], states[2 + 1][0])
            # The last layer: the decoder layer's own output, which HF's last entry is not...
            assert close(ours[:, 1], pre_norm["last"][0])
            assert not close(ours[:, 1], states[LAST + 1][0])
            # ...because HF's last entry is that output after the final norm.
            torch.testing.assert_close(model.model.norm(pre_norm["last"]), states[LAST + 1])
    finally:
        hook.remove()
