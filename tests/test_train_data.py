"""The training data path under the faults a real run meets: a re-extraction under the same run
name, a killed download's leftovers, a cache bound with downloads in flight, a training process
that fails while its batch producer runs, and data larger than the cache."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dflash_jobs.errors import EXIT_BAD_INPUT, FormatError, InputError, StorageUnavailable
from dflash_jobs.formats import MANIFEST_KEY, HiddenChunk, Manifest, encode_hidden_chunk, header_size, hidden_chunk_key, read_header
from dflash_jobs.spec import anchor_layout, parse_spec
from dflash_jobs.storage import TEMP_PREFIX, open_storage
from dflash_jobs.train.trainer import Runtime, Trainer
from train_fixtures import LAYERS, copy_extract, tiny_target, train_spec_dict

REPO = Path(__file__).resolve().parents[1]




def build(root: Path, output: Path, cache: Path, **train) -> Trainer:
    spec = parse_spec(train_spec_dict(tiny_target(root), output, **train))
    return Trainer.build(spec, Runtime(0, 1, torch.device("cpu")), cache_dir=cache)


def first_batch(root: Path, output: Path, cache: Path):
    trainer = build(root, output, cache)
    try:
        return next(iter(trainer.stream))[2]
    finally:
        trainer.close()


def reextract_negated(output: Path) -> None:
    """Extraction again under the same run name: every chunk holds the same documents and other
    states (negated: the same size), with new done markers and a new manifest."""
    storage = open_storage(str(output))
    manifest = Manifest.from_json(storage.get_bytes(MANIFEST_KEY))
    markers = []
    for marker in manifest.chunks:
        key = hidden_chunk_key(marker.chunk)
        chunk = HiddenChunk.decode(storage.get_bytes(key), key)
        data = encode_hidden_chunk(chunk.tokens, -chunk.hidden_states, layers=LAYERS, model=chunk.model, config_hash=chunk.config_hash)
        assert len(data) == marker.bytes
        storage.put_bytes(key, data)
        markers.append(replace(marker, sha256=hashlib.sha256(data).hexdigest()))
    storage.put_bytes(MANIFEST_KEY, replace(manifest, chunks=markers).to_json().encode())


def test_a_reextracted_run_is_never_served_the_old_states_from_its_cache(root, extract, tmp_path):
    output = copy_extract(extract, tmp_path / "run")
    before = first_batch(root, output, tmp_path / "cache")
    reextract_negated(output)
    after = first_batch(root, output, tmp_path / "cache")  # the same cache directory, the same plan
    assert torch.equal(after.block_ids, before.block_ids)
    assert torch.equal(after.to(torch.device("cpu")).context_hidden, -before.to(torch.device("cpu")).context_hidden)


def test_a_killed_download_leaves_nothing_behind_in_the_cache(root, extract, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    leftovers = [cache / f"{TEMP_PREFIX}000000.safetensors.0f3a", cache / f"{TEMP_PREFIX}x8k2l1"]  # LocalStorage's and S3Storage's
    for path in leftovers:
        path.write_bytes(b"\0" * 4096)
    build(root, copy_extract(extract, tmp_path / "run"), cache).close()
    assert not any(path.exists() for path in leftovers)


class DiskWatchingStorage:
    """A real storage whose reads note how many bytes a directory holds once each read returns:
    what a node's cache volume holds at that moment, downloads in flight included."""

    def __init__(self, storage, directory: Path) -> None:
        self.storage, self.directory, self.peak = storage, directory, 0

    def __getattr__(self, name):
        return getattr(self.storage, name)

    def note(self) -> None:
        held = sum(p.stat().st_size for p in self.directory.rglob("*") if p.is_file())
        self.peak = max(self.peak, held)

    def get_bytes(self, key, start=None, end=None):
        data = self.storage.get_bytes(key, start, end)
        self.note()
        return data

    def get_file(self, key, path):
        self.storage.get_file(key, path)
        self.note()


@pytest.mark.parametrize("cache_chunks", [0.5, 2.5])
def test_the_cache_never_holds_more_than_its_bound_even_with_downloads_in_flight(extract, tmp_path, cache_chunks):
    from dflash_jobs.train.chunks import ChunkCache
    from dflash_jobs.train.data import BatchBuilder, BatchStream, Budget, plan_epoch, read_document_index

    storage = open_storage(str(extract))
    manifest = Manifest.from_json(storage.get_bytes(MANIFEST_KEY))
    index = read_document_index(storage, [c.chunk for c in manifest.chunks])
    plans = [plan_epoch(index, world_size=1, seed=0, epoch=e, budget=Budget(tokens=700, blocks=10**9, anchors=512))[0] for e in range(3)]
    bound = int(cache_chunks * max(c.bytes for c in manifest.chunks))
    watched = DiskWatchingStorage(storage, tmp_path / "cache")
    cache = ChunkCache(watched, tmp_path / "cache", bound, manifest.chunks)
    builder = BatchBuilder(layout=anchor_layout(block_size=4, gamma=7.0), anchors=8, mask_token_id=999, seed=0, layers=LAYERS)
    stream = BatchStream(plans, cache, builder, prefetch_chunks=3)
    assert sum(1 for _ in stream) == sum(len(plan) for plan in plans)
    watched.note()  # the resident chunks, stored by now (the downloads may all have returned before they were)
    assert 0 < watched.peak <= bound if cache_chunks > 1 else watched.peak == 0


# ---- reading ahead across chunks ------------------------------------------------------------------


class LiveChunks:
    """A real ChunkCache that counts the chunks opened and not yet closed (each held in memory while
    streamed, ~3.4 GB at the 27B shape), the most at once, and fails the download of `failing`."""

    def __init__(self, cache, failing: int | None = None) -> None:
        self.cache, self.failing = cache, failing
        self.live = self.most = 0
        self.lock = threading.Lock()

    def open(self, chunk: int):
        if chunk == self.failing:
            time.sleep(0.2)  # while the producer waits on it
            raise StorageUnavailable(f"chunk {chunk}: the store went away")
        data = self.cache.open(chunk)
        with self.lock:
            self.live += 1
            self.most = max(self.most, self.live)
        close = data.close

        def closed() -> None:
            with self.lock:
                self.live -= 1
            close()

        data.close = closed
        return data

    def close(self) -> None:
        self.cache.close()


def fingerprint(batch) -> tuple:
    return batch.block_ids.tolist(), batch.labels.tolist(), batch.context_hidden.view(torch.uint8).sum().item()


@pytest.mark.parametrize("prefetch_chunks", [0, 1, 2, 3])
def test_reading_ahead_across_chunks_gives_the_same_batches_in_the_same_order_within_its_memory_bound(extract, tmp_path, prefetch_chunks):
    from dflash_jobs.train.chunks import ChunkCache, ChunkData
    from dflash_jobs.train.data import BatchBuilder, BatchStream, Budget, plan_epoch, read_document_index

    storage = open_storage(str(extract))
    manifest = Manifest.from_json(storage.get_bytes(MANIFEST_KEY))
    index = read_document_index(storage, [c.chunk for c in manifest.chunks])
    plans = [plan_epoch(index, world_size=1, seed=0, epoch=e, budget=Budget(tokens=700, blocks=10**9, anchors=512))[0] for e in range(2)]
    builder = BatchBuilder(layout=anchor_layout(block_size=4, gamma=7.0), anchors=8, mask_token_id=999, seed=0, layers=LAYERS)
    # Without a stream: every batch built in the plan's order from chunks read whole.
    whole = {c.chunk: ChunkData.from_bytes(storage.get_bytes(hidden_chunk_key(c.chunk)), hidden_chunk_key(c.chunk)) for c in manifest.chunks}
    expected = [(e, s, fingerprint(builder.build(batch, whole, e))) for e, plan in enumerate(plans) for s, batch in enumerate(plan)]
    cache = LiveChunks(ChunkCache(storage, tmp_path / "cache", 0, manifest.chunks))  # every chunk streamed through memory
    stream = BatchStream(plans, cache, builder, prefetch_chunks=prefetch_chunks)
    assert [(e, s, fingerprint(batch)) for e, s, batch in stream] == expected
    widest = max(len({doc.chunk for doc in batch}) for plan in plans for batch in plan)
    assert 0 < cache.most <= widest + prefetch_chunks  # the bound BatchStream states: a batch's chunks and the read-ahead
    assert cache.live == 0  # every chunk closed once the stream ends


def test_a_chunk_that_cannot_be_read_ahead_fails_the_stream_with_its_error_not_a_hang(extract, tmp_path):
    from dflash_jobs.train.chunks import ChunkCache
    from dflash_jobs.train.data import BatchBuilder, BatchStream, Budget, plan_epoch, read_document_index

    storage = open_storage(str(extract))
    manifest = Manifest.from_json(storage.get_bytes(MANIFEST_KEY))
    index = read_document_index(storage, [c.chunk for c in manifest.chunks])
    plans = [plan_epoch(index, world_size=1, seed=0, epoch=0, budget=Budget(tokens=700, blocks=10**9, anchors=512))[0]]
    order = list(dict.fromkeys(doc.chunk for batch in plans[0] for doc in batch))
    builder = BatchBuilder(layout=anchor_layout(block_size=4, gamma=7.0), anchors=8, mask_token_id=999, seed=0, layers=LAYERS)
    cache = LiveChunks(ChunkCache(storage, tmp_path / "cache", 0, manifest.chunks), failing=order[-1])  # read ahead, not needed at once
    stream = BatchStream(plans, cache, builder, prefetch_chunks=2)
    served = []
    started = time.monotonic()
    with pytest.raises(StorageUnavailable, match=f"chunk {order[-1]}: the store went away"):
        for _, _, batch in stream:
            served.append({doc.chunk for doc in plans[0][len(served)]})
    stream.close()
    assert time.monotonic() - started < 60
    assert served and order[-1] not in set().union(*served)  # every batch before the failing chunk's was served
    assert cache.live == 0


FAILING_TRAINER = """
import sys
from pathlib import Path
import torch
from dflash_jobs.errors import InputError, pod_exit_code
from dflash_jobs.spec import load_spec
from dflash_jobs.train.trainer import Runtime, Trainer

def main():
    trainer = Trainer.build(load_spec(sys.argv[1]), Runtime(0, 1, torch.device("cpu")), cache_dir=Path(sys.argv[2]))
    try:
        for _ in trainer.stream:  # the producer thread is busy building the next batches
            raise InputError("a bad document", "fix the data")
    except InputError as exc:
        return pod_exit_code(exc)
    finally:
        trainer.close()

sys.exit(main())
"""


def test_a_training_process_failing_on_bad_input_exits_with_its_own_code(root, extract, tmp_path):
    """Before close() joined the producer thread, such a process died by SIGABRT (exit 134) in 2 to
    4 runs of 5 here: the interpreter tore down while the thread ran torch code, and the Job retried
    what should fail at once (42)."""
    from train_fixtures import write_spec

    output = copy_extract(extract, tmp_path / "run")
    spec = write_spec(tmp_path / "dflash.yaml", train_spec_dict(tiny_target(root), output, micro_batch_tokens=64, epochs=50))
    script = tmp_path / "failing_trainer.py"
    script.write_text(textwrap.dedent(FAILING_TRAINER))
    codes = []
    for i in range(4):
        run = subprocess.run([sys.executable, str(script), str(spec), str(tmp_path / f"cache{i}")],
                             capture_output=True, text=True, timeout=120)
        codes.append((run.returncode, run.stderr[-2000:]))
    assert [code for code, _ in codes] == [EXIT_BAD_INPUT] * 4, codes


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_a_cache_smaller_than_the_share_keeps_a_fixed_part_on_disk_and_streams_the_rest(tmp_path, fraction):
    """Every epoch reshuffles the rank's chunks: a cache that evicted by recency would miss on
    nearly every read, and the share would come from storage again each epoch. A fixed resident
    part is served from disk every epoch; only the rest is read from storage again."""
    from dflash_jobs.train.chunks import ChunkCache
    from dflash_jobs.train.data import BatchBuilder, BatchStream, Budget, plan_epoch, read_document_index
    from train_fixtures import synthetic_chunk, write_extract

    storage = open_storage(str(tmp_path / "run"))
    chunks = [synthetic_chunk(c, documents=4, document_tokens=48, layers=2, hidden_size=32, vocab_size=100) for c in range(12)]
    manifest = write_extract(storage, chunks, model="synthetic", layers=[1, 2], dtype="bfloat16")
    share, largest = manifest.bytes, max(c.bytes for c in manifest.chunks)
    index = read_document_index(storage, list(range(12)))
    epochs = 4
    plans = [plan_epoch(index, world_size=1, seed=0, epoch=e, budget=Budget(tokens=100, blocks=10**9, anchors=8))[0] for e in range(epochs)]
    cache = ChunkCache(storage, tmp_path / "cache", int(fraction * share), manifest.chunks)
    builder = BatchBuilder(layout=anchor_layout(block_size=4, gamma=7.0), anchors=8, mask_token_id=99, seed=0, layers=[1, 2])
    read_by_epoch = {}
    for epoch, _, _ in BatchStream(plans, cache, builder):
        read_by_epoch[epoch] = cache.bytes_fetched
    assert read_by_epoch[0] >= share  # the first epoch reads the whole share once (and prefetches into the next)
    later = (cache.bytes_fetched - share) / (epochs - 1)  # per epoch after the first
    kept = sum(c.bytes for c in manifest.chunks if c.chunk in cache.resident)
    assert fraction * share - largest < kept <= fraction * share
    assert later <= share - kept
    assert later / share <= {0.25: 0.8, 0.5: 0.6, 1.0: 0.0}[fraction]
    assert sum(p.stat().st_size for p in (tmp_path / "cache").iterdir()) == kept


def stored_final(storage, chunk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chunk's final_hidden_states as stored (bf16, or fp8 with its scales)."""
    key = hidden_chunk_key(chunk)
    stored = HiddenChunk.decode(storage.get_bytes(key), key)
    return stored.final_hidden_states, stored.final_scale


def final_extract(storage, dtype: str, *, chunks: int = 3) -> Manifest:
    from train_fixtures import synthetic_chunk, write_extract

    def with_final(c: int):
        tokens, states = synthetic_chunk(c, documents=3, document_tokens=40, layers=2, hidden_size=16, vocab_size=100)
        final = torch.randn(tokens.num_tokens, 16, generator=torch.Generator().manual_seed(100 + c)) * (1 + c)
        return tokens, states, final

    return write_extract(storage, (with_final(c) for c in range(chunks)), model="synthetic", layers=[1, 2], dtype=dtype)


class ReadRecorder:
    """A chunk source whose row reads are noted: (byte offset, bytes)."""

    def __init__(self, source) -> None:
        self.source, self.reads = source, []

    def __getattr__(self, name):
        return getattr(self.source, name)

    def read_into(self, offset: int, out: torch.Tensor) -> None:
        self.reads.append((offset, out.numel()))
        self.source.read_into(offset, out)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_builder_asked_for_the_final_hidden_state_delivers_the_stored_rows_beside_the_context(tmp_path, dtype):
    from dflash_jobs.formats import dequantize_fp8
    from dflash_jobs.train.chunks import ChunkData
    from dflash_jobs.train.data import BatchBuilder, DocumentRef, read_document_index

    storage = open_storage(str(tmp_path / "run"))
    manifest = final_extract(storage, dtype)
    assert manifest.final_hidden == dtype
    index = read_document_index(storage, [c.chunk for c in manifest.chunks])
    chunks = {c.chunk: ChunkData.from_bytes(storage.get_bytes(hidden_chunk_key(c.chunk)), hidden_chunk_key(c.chunk)) for c in manifest.chunks}
    documents = [DocumentRef(chunk, i, doc.sample_ids[i], doc.lengths[i]) for doc in index for chunk in [doc.chunk] for i in (2, 0)]
    builder = BatchBuilder(layout=anchor_layout(block_size=4, gamma=7.0), anchors=8, mask_token_id=99, seed=0, layers=[1, 2], final_hidden=True)
    batch = builder.build(documents, chunks, epoch=0)
    assert batch.final_hidden.shape == (batch.tokens, 16)
    assert (batch.final_scale is not None) == (dtype == "float8_e4m3fn")
    offset, expected_rows, expected_scales = 0, [], []
    for doc in documents:
        states, scale = stored_final(storage, doc.chunk)
        begin = int(chunks[doc.chunk].tokens.cu_seqlens[doc.index])
        rows = slice(begin, begin + doc.tokens)
        # Row for row with the context: as stored, bit for bit.
        assert torch.equal(batch.final_hidden[offset : offset + doc.tokens].view(torch.uint8), states[rows].view(torch.uint8))
        expected_rows.append(states[rows])
        if scale is not None:
            assert torch.equal(batch.final_scale[offset : offset + doc.tokens], scale[rows])
            expected_scales.append(scale[rows])
        offset += doc.tokens
    on_device = batch.to(torch.device("cpu"))
    expected = torch.cat(expected_rows)
    if dtype == "float8_e4m3fn":  # dequantized by to(), as the layers are
        expected = dequantize_fp8(expected, torch.cat(expected_scales))
    assert on_device.final_scale is None and on_device.final_hidden.dtype == torch.bfloat16
    assert torch.equal(on_device.final_hidden, expected)
    # What DSpark gathers: the target's state at each anchor (and slot k at anchor + k).
    assert torch.equal(on_device.final_hidden[batch.layout.anchor], expected[batch.layout.anchor])


def test_a_builder_not_asked_reads_and_holds_none_of_it(tmp_path):
    from dflash_jobs.train.chunks import ChunkData
    from dflash_jobs.train.data import BatchBuilder, DocumentRef

    storage = open_storage(str(tmp_path / "run"))
    final_extract(storage, "float8_e4m3fn", chunks=1)
    key = hidden_chunk_key(0)
    data = ChunkData.from_bytes(storage.get_bytes(key), key)
    data.source = recorder = ReadRecorder(data.source)
    documents = [DocumentRef(0, i, int(data.tokens.sample_ids[i]), 40) for i in range(3)]
    batch = BatchBuilder(layout=anchor_layout(block_size=4, gamma=7.0), anchors=8, mask_token_id=99, seed=0, layers=[1, 2]).build(documents, {0: data}, epoch=0)
    assert batch.final_hidden is None and batch.final_scale is None
    assert batch.to(torch.device("cpu")).final_hidden is None
    header, length = read_header(storage.get_bytes(key), key)[0], header_size(storage.get_bytes(key, 0, 8))
    final = [[length + offset for offset in header[name]["data_offsets"]] for name in ("final_hidden_states", "final_hidden_states_scale")]
    assert recorder.reads and not any(offset < end and begin < offset + size for offset, size in recorder.reads for begin, end in final)

    from train_fixtures import synthetic_chunk, write_extract

    builder = BatchBuilder(layout=anchor_layout(block_size=4, gamma=7.0), anchors=8, mask_token_id=99, seed=0, layers=[1, 2], final_hidden=True)
    without = open_storage(str(tmp_path / "without"))
    write_extract(without, [synthetic_chunk(0, documents=3, document_tokens=40, layers=2, hidden_size=16, vocab_size=100)],
                  model="synthetic", layers=[1, 2], dtype="float8_e4m3fn")
    plain = ChunkData.from_bytes(without.get_bytes(key), key)
    with pytest.raises(FormatError, match="holds no final hidden state of the target, which this drafter reads"):
        builder.build(documents, {0: plain}, epoch=0)


def test_training_a_drafter_that_reads_it_is_refused_a_store_without_it_and_fed_from_one_with_it(root, extract, tmp_path, caplog):
    from train_fixtures import tiny_extract

    without = copy_extract(extract, tmp_path / "without")
    with pytest.raises(InputError) as refused:
        build(root, without, tmp_path / "cache", drafter="dspark")
    assert f"{without}/{MANIFEST_KEY}: the hidden states hold no final hidden state of the target" in str(refused.value)
    assert "extract.final_hidden: true" in refused.value.fix and "train.dspark.ce_only: true" in refused.value.fix
    # Asked for explicitly, cross-entropy only: it trains on them, and says so.
    trainer = build(root, without, tmp_path / "cache", drafter="dspark", dspark={"ce_only": True})
    try:
        assert "DSpark trains on cross-entropy only, without the target's final hidden state" in caplog.text
        assert next(iter(trainer.stream))[2].final_hidden is None
    finally:
        trainer.close()

    output = copy_extract(tiny_extract(root, final_hidden=True), tmp_path / "with")
    trainer = build(root, output, tmp_path / "cache-with", drafter="dspark")
    try:
        _, _, batch = next(iter(trainer.stream))
        assert batch.final_hidden is not None and batch.final_hidden.shape == (batch.tokens, batch.context_hidden.shape[1] // len(LAYERS))
    finally:
        trainer.close()
