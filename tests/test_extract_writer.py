"""The chunk writer on its own: chunks filled sample by sample as the GPU's copies fill them, stored
once complete or, the shard's last, as its rows fill (issue 42: the last chunk's drain). Whichever
way, the same objects, bytes and done markers; the end waits for every store; a chunk the GPU
thread never finishes leaves nothing behind."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from dflash_jobs.extract.transfer import BufferPool
from dflash_jobs.extract.writer import ChunkMetadata, ChunkWriter
from dflash_jobs.formats import ChunkInfo, DoneMarker, done_key, header_size, hidden_chunk_key, read_header
from dflash_jobs.storage import TEMP_PREFIX, open_storage

from extract_helpers import LAYERS, random_chunks

HIDDEN = 8


class WatchedStorage:
    """A real store that notes, as each of a chunk's bytes are taken, how many of its samples were placed then;
    `delay`: seconds before each piece is taken, of every chunk or of the chunks a mapping names."""

    def __init__(self, storage, placed: dict[int, int], delay: float | dict[int, float] = 0.0) -> None:
        self.storage, self.placed, self.delay = storage, placed, delay
        self.taken: dict[str, list[tuple[int, int]]] = {}  # key -> (bytes so far, samples placed then)

    def __getattr__(self, name):
        return getattr(self.storage, name)

    def put_parts(self, key, parts, size=None):
        chunk = int(key.rsplit("/", 1)[-1].split(".")[0])
        taken = self.taken.setdefault(key, [])
        delay = self.delay.get(chunk, 0.0) if isinstance(self.delay, dict) else self.delay

        def watched():
            total = 0
            for part in parts:
                total += len(memoryview(part))
                taken.append((total, self.placed.get(chunk, 0)))
                time.sleep(delay)
                yield part

        return self.storage.put_parts(key, watched(), size)


def states_of(chunk_id: int, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """What the forward would capture: [tokens, L, d], deterministic per chunk."""
    return torch.randn(tokens, len(LAYERS), HIDDEN, generator=torch.Generator().manual_seed(chunk_id)).to(dtype)


def write_chunks(storage, chunks, *, streamed: int | None, dtype: str = "bfloat16", final: bool = False,
                 placed: dict[int, int] | None = None, pause: float = 0.0, stop_at: tuple[int, int] | None = None):
    """Fills each chunk sample by sample in order (as packed batches do), `pause` between samples;
    `stop_at` (chunk, sample): the GPU thread fails there (the writer drained). Returns the markers."""
    placed = {} if placed is None else placed
    state_dtype = torch.float8_e4m3fn if dtype == "float8_e4m3fn" else torch.bfloat16
    pool = BufferPool(size=3, capacity=max(c.num_tokens for c in chunks), layers=len(LAYERS), hidden_size=HIDDEN, dtype=state_dtype,
                      pinned=False, final_hidden=final)
    pool.start(3)
    markers: list[DoneMarker] = []
    writer = ChunkWriter(storage=storage, metadata=ChunkMetadata(layers=LAYERS, hidden_size=HIDDEN, model="m", config_hash="h", dtype=dtype,
                                                                  shard=0, final_hidden=dtype if final else None),
                         pool=pool, on_commit=markers.append, streamed=streamed)
    for cid, tokens in enumerate(chunks):
        assembly = writer.open(ChunkInfo(cid, hidden_chunk_key(cid), tokens.num_samples, tokens.num_tokens), tokens)
        states = states_of(cid, tokens.num_tokens, torch.float32)
        for index in range(tokens.num_samples):
            if stop_at == (cid, index):
                writer.drain()
                return markers, writer
            begin, end = assembly.rows(index)
            buffer = assembly.buffer
            layers = states[begin:end]
            if dtype == "float8_e4m3fn":
                buffer.layers.scale[begin:end] = layers.abs().amax(-1) / 448.0
                buffer.layers.states[begin:end] = (layers / buffer.layers.scale[begin:end, :, None]).to(state_dtype)
            else:
                buffer.layers.states[begin:end] = layers.to(state_dtype)
            buffer.layers.absmax[begin:end] = layers.abs().amax(-1)
            if final:
                buffer.final.states[begin:end] = layers[:, -1].to(state_dtype) if dtype != "float8_e4m3fn" else (layers[:, -1] / 448.0).to(state_dtype)
                buffer.final.absmax[begin:end] = layers[:, -1].abs().amax(-1)
                if buffer.final.scale is not None:
                    buffer.final.scale[begin:end] = 1.0
            buffer.ids[begin:end] = torch.from_numpy(tokens.input_ids[begin:end].astype(np.int64))
            assembly.placed(index, None)
            placed[cid] = index + 1
            if assembly.remaining == 0:
                writer.submit(assembly)
            time.sleep(pause)
    writer.close()
    return markers, writer


@pytest.mark.parametrize("dtype, final", [("bfloat16", False), ("bfloat16", True), ("float8_e4m3fn", False)])
def test_the_last_chunk_stored_as_its_rows_fill_is_the_chunk_stored_once_complete(tmp_path, dtype, final):
    chunks = random_chunks(seed=3, count=3, min_len=4, max_len=40)
    whole = open_storage(str(tmp_path / "whole"))
    placed: dict[int, int] = {}
    streaming = WatchedStorage(open_storage(str(tmp_path / "streamed")), placed)
    expected, _ = write_chunks(whole, chunks, streamed=None, dtype=dtype, final=final)
    got, _ = write_chunks(streaming, chunks, streamed=2, dtype=dtype, final=final, placed=placed, pause=0.05)
    assert sorted(got, key=lambda m: m.chunk) == sorted(expected, key=lambda m: m.chunk)  # sizes, sha256, stats: every field
    for cid in range(3):
        assert streaming.get_bytes(hidden_chunk_key(cid)) == whole.get_bytes(hidden_chunk_key(cid))
        assert streaming.get_bytes(done_key(cid)) == whole.get_bytes(done_key(cid))
    last, samples = streaming.taken[hidden_chunk_key(2)], chunks[2].num_samples
    data = streaming.get_bytes(hidden_chunk_key(2))
    header, _ = read_header(data[: header_size(data)], "chunk 2")
    states_at = header_size(data) + header["hidden_states"]["data_offsets"][0]
    if dtype == "bfloat16":
        # The states were stored while the samples after them were still to come: all but the last sample's rows.
        row = len(LAYERS) * HIDDEN * 2
        assert max(total for total, placed_then in last if placed_then < samples) >= states_at + int(chunks[2].cu_seqlens[-2]) * row
        if final:  # the final hidden state, as wide and smaller, lies after them: it alone waits for the last sample
            final_at = header_size(data) + header["final_hidden_states"]["data_offsets"][0]
            assert final_at > states_at
            assert all(placed_then == samples for total, placed_then in last if total > final_at)
    else:
        # The scales, wider than fp8's states, lie before them (aligned offsets): the states wait for all of them.
        assert header["hidden_states_scale"]["data_offsets"][0] < header["hidden_states"]["data_offsets"][0]
        assert all(placed_then == samples for total, placed_then in last if total > states_at)
    assert all(placed_then == chunks[c].num_samples for c in (0, 1) for _, placed_then in streaming.taken[hidden_chunk_key(c)])

def test_the_end_waits_for_every_store_the_streamed_one_included(tmp_path):
    chunks = random_chunks(seed=4, count=3, min_len=4, max_len=40)
    storage = WatchedStorage(open_storage(str(tmp_path / "run")), {}, delay=0.05)  # every piece of every chunk slow
    started = time.monotonic()
    markers, writer = write_chunks(storage, chunks, streamed=2)
    assert time.monotonic() - started >= 0.05 * len(storage.taken[hidden_chunk_key(2)])
    assert [m.chunk for m in sorted(markers, key=lambda m: m.chunk)] == [0, 1, 2]  # committed before close() returned
    assert all(storage.exists(done_key(c)) for c in range(3)) and not any(t.is_alive() for t in writer.threads)


def test_the_end_says_what_each_store_had_left_to_write_and_when_it_got_through(tmp_path):
    chunks = random_chunks(seed=6, count=3, min_len=4, max_len=40)
    storage = WatchedStorage(open_storage(str(tmp_path / "run")), {}, delay={2: 0.2})  # the streamed chunk's storage slow
    markers, writer = write_chunks(storage, chunks, streamed=2, pause=0.05)
    tail = writer.tail()
    sizes = {m.chunk: m.bytes for m in markers}
    streamed = next(store for store in tail if store["chunk"] == 2)
    assert streamed["streamed"] and not any(store["streamed"] for store in tail if store is not streamed)
    for store in tail:  # what the end waited for, each on the clock from it
        assert store["bytes"] == sizes[store["chunk"]] and 0 <= store["bytes_left_at_end"] <= store["bytes"]
        assert store["queued_s"] <= 0 and store["last_byte_s"] <= store["stored_s"] <= store["committed_s"] and store["committed_s"] > 0
    # Handed to a writer thread at its first sample, it had sent its first pieces while the samples came, not the rest.
    assert streamed["started_s"] < 0 < streamed["bytes_left_at_end"] < streamed["bytes"]
    pieces_after = sum(1 for total, _ in storage.taken[hidden_chunk_key(2)] if total > streamed["bytes"] - streamed["bytes_left_at_end"])
    assert pieces_after >= 1 and streamed["last_byte_s"] >= 0.2 * (pieces_after - 1)
    # The stores left out were through (their markers written) before the end.
    left_out = [times for chunk, times in writer.stores.items() if chunk not in {store["chunk"] for store in tail}]
    assert all(times.committed <= writer.closed for times in left_out) and len(left_out) + len(tail) == 3


def test_a_streamed_chunk_the_gpu_thread_never_finishes_leaves_nothing_and_does_not_hang(tmp_path):
    chunks = random_chunks(seed=5, count=2, min_len=4, max_len=40)
    storage = open_storage(str(tmp_path / "run"))
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(result=write_chunks(storage, chunks, streamed=1, stop_at=(1, 2))))
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "drain() waited forever on the chunk that cannot complete"
    markers, writer = outcome["result"]
    assert [m.chunk for m in markers] == [0] and storage.exists(done_key(0))
    assert not storage.exists(hidden_chunk_key(1)) and not storage.exists(done_key(1))
    assert not [p for p in (tmp_path / "run").rglob("*") if p.name.startswith(TEMP_PREFIX)]
    with pytest.raises(Exception, match="chunk 000001: the extraction stopped with"):
        writer.check()
