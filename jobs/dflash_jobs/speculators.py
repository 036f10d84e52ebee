"""A run's hidden states in speculators' offline layout (vllm-project/speculators), so the tens of
terabytes one extraction wrote can also feed its trainers: one `hs_<i>.safetensors` per sample, the
files its `FileTransfer` reads from `--hidden-states-path` (`hs_{i}.safetensors`, i = the row of its
preprocessed data set):

    hidden_states  bf16 [T, L, d]  the captured layers, ascending, then the target's final hidden
                                   state when the run stored it ([T, L + 1, d]); speculators reads
                                   the last entry as the target's final layer, its
                                   `verifier_last_hidden_states` (the last decoder layer's output
                                   before the final norm, row t beside token t: it applies its
                                   verifier_norm and lm_head, row t's logits predicting token t + 1),
                                   and the others as the drafter's inputs (`[:, :-1].flatten(1)`)
    token_ids      int64 [T]       the sample's tokens; speculators skips a file whose ids differ from
                                   its data set's input_ids
    loss_mask      uint8 [T]       ours, an extra key speculators ignores (it takes the loss mask from
                                   its Arrow data set): here so that data set can be built from these files

Layer numbering: our layer i (the output of decoder layer i) is speculators' and vLLM's aux id
i + 1, and the target's last decoder layer n - 1, which speculators' extraction appends
(`--include-last-layer`), is their n. That last entry is the run's stored final hidden state
(final_hidden_states: extract.final_hidden) when it has one, after all of target.layers, which
are then all the drafter's inputs; otherwise the run must have captured the target's last layer,
as the last of target.layers, which becomes the last entry: the export refuses a run with
neither rather than hand speculators layer 61 as the final one. Both are taken before the final
norm, as vLLM's (formats.py states the convention).

Numbering of the files: i counts samples in the manifest's chunk order, then in chunk order;
`dflash_samples.jsonl` maps each i to its line in data.source, its chunk and its length, and
`dflash_export.json`, written last, records the layer ids on both conventions.

Streaming: a chunk's header and token tensors by ranged reads, then each sample's rows of
hidden_states (contiguous in [T, L, d]) by one ranged read (and of final_hidden_states by another),
a few samples at a time: memory stays at a few samples, whatever the chunk size. fp8 chunks are
dequantized with their per-token (and per-layer) scales exactly as formats.dequantize_fp8 does (a
float32 product rounded to the nearest even bf16), in numpy: the control plane runs this module
and never imports torch. A file that exists with its exact size is kept: an interrupted export
resumes where it stopped.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from typing import Callable

import numpy as np

from dflash_jobs.errors import InputError, StorageError
from dflash_jobs.formats import (
    MANIFEST_KEY, Manifest, RawTensor, check_hidden_header, header_size, hidden_chunk_key, raw_safetensors_parts, read_header,
    safetensors_header,
)
from dflash_jobs.spec import RunSpec, text_config
from dflash_jobs.storage import Storage, open_storage

FORMAT = "speculators"
SAMPLES_KEY = "dflash_samples.jsonl"
SUMMARY_KEY = "dflash_export.json"
"""Written last: its presence says every file is there."""
DEFAULT_WORKERS = 8
"""Samples read, converted and written at once (I/O bound: storage round trips)."""


def hs_key(index: int) -> str:
    return f"hs_{index}.safetensors"


def default_destination(spec: RunSpec) -> str:
    return f"{spec.output.rstrip('/')}/export/{FORMAT}/hidden_states"


def aux_layer_ids(layers: list[int]) -> list[int]:
    """speculators' and vLLM's ids of our captured layers: one higher (their 0 is the embeddings)."""
    return [layer + 1 for layer in layers]


@dataclass
class ExportSummary:
    destination: str
    files: int  # written by this call
    kept: int  # found complete from an earlier call
    samples: int
    tokens: int
    bytes: int  # of every file, kept ones included
    layers: list[int]  # ours: decoder layer i, before the final norm
    aux_hidden_state_layer_ids: list[int]  # theirs (vLLM numbering), the last layer excluded: --target-layer-ids
    last_layer: int  # theirs: the target's num_hidden_layers, appended last in every file
    final_hidden: bool  # the last entry is the run's stored final hidden state (else its last captured layer)


# ---- fp8 -> bf16 without torch -----------------------------------------------------------------


def _fp8_e4m3fn_table() -> np.ndarray:
    """float32 value of each of the 256 float8_e4m3fn bit patterns (no infinities; S.1111.111 is NaN)."""
    bits = np.arange(256, dtype=np.uint32)
    exponent, mantissa = (bits >> 3) & 0xF, (bits & 7).astype(np.float64)
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * 2.0 ** (exponent.astype(np.float64) - 7))
    magnitude[(exponent == 15) & ((bits & 7) == 7)] = np.nan
    return np.where(bits >> 7, -magnitude, magnitude).astype(np.float32)


FP8_VALUES = _fp8_e4m3fn_table()


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), rounded to nearest even, as torch's conversion."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    quiet_nan = (bits >> 16) | np.uint32(0x40)  # keep the sign, force a mantissa bit
    return np.where(np.isnan(values), quiet_nan, rounded).astype(np.uint16)


def dequantize_fp8(quantized: bytes, scale: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """float8_e4m3fn [T, ..., d] times its float32 scales [T, ...], as bf16 bit patterns (uint16)."""
    values = FP8_VALUES[np.frombuffer(quantized, dtype=np.uint8).reshape(shape)] * scale[..., None]
    return bfloat16_bits(values)


# ---- reading a chunk by ranges -----------------------------------------------------------------


@dataclass
class ChunkReader:
    """One hidden-state chunk: its header and token tensors read, its states read per sample."""

    storage: Storage
    key: str
    header: dict
    data_start: int
    dtype: str
    layers: list[int]
    final_hidden: str | None  # the final hidden state's dtype; None: not stored

    @classmethod
    def open(cls, storage: Storage, key: str) -> ChunkReader:
        name = f"{storage.url}/{key}"
        length = header_size(storage.get_bytes(key, 0, 8))
        header, total = read_header(storage.get_bytes(key, 0, length), name)
        info = storage.stat(key)
        if info is not None and info.size != total:
            raise InputError(f"{name} has {info.size} bytes, its header describes {total}", "Run `dflashctl verify`: the chunk changed since it was verified")
        meta = check_hidden_header(header, name)
        return cls(storage, key, header, length, meta["dtype"], meta["layers"], meta["final_hidden"])

    def array(self, name: str, dtype) -> np.ndarray:
        begin, end = self.header[name]["data_offsets"]
        data = self.storage.get_bytes(self.key, self.data_start + begin, self.data_start + end)
        return np.frombuffer(data, dtype=dtype).reshape(self.header[name]["shape"])

    def rows(self, name: str, begin: int, end: int) -> bytes:
        """The raw bytes of tensor `name` [begin:end] (hidden_states or final_hidden_states: bf16 or fp8)."""
        entry = self.header[name]
        row = int(np.prod(entry["shape"][1:])) * (2 if entry["dtype"] == "BF16" else 1)
        start = self.data_start + entry["data_offsets"][0]
        return self.storage.get_bytes(self.key, start + begin * row, start + end * row)


# ---- the export --------------------------------------------------------------------------------


def target_depth(spec: RunSpec) -> int:
    """num_hidden_layers of the target checkpoint, from its config.json."""
    location = f"{spec.target.model.rstrip('/')}/config.json"
    try:
        storage = open_storage(spec.target.model, endpoint_url=spec.storage.endpoint_url, region=spec.storage.region)
        return int(text_config(json.loads(storage.get_bytes("config.json")))["num_hidden_layers"])
    except (StorageError, OSError, ValueError, KeyError, TypeError) as error:
        raise InputError(
            f"cannot read the target's depth from {location} ({error}); it tells whether the run captured the target's last layer",
            "Run this where target.model is readable, or pass --target-depth N (num_hidden_layers of the checkpoint)",
        ) from None


def check_layers(manifest: Manifest, depth: int) -> None:
    layers = manifest.layers
    if layers != sorted(layers):
        raise InputError(f"the run's layers {layers} are not ascending: speculators (and vLLM) concatenate layers in ascending order", "Extract again with target.layers in ascending order")
    if manifest.final_hidden is None and layers[-1] != depth - 1:
        raise InputError(
            f"the run captured layers {layers} of a {depth}-layer target, not its last decoder layer {depth - 1}, and stored no final hidden "
            f"state: speculators reads the last entry of every file as the target's final layer, and would take layer {layers[-1]} for it",
            "Store the final hidden state (extract.final_hidden: true) or capture the last layer too "
            f"(target.layers {layers + [depth - 1]}), then extract again (export-states reads what was stored)",
        )


def file_layers(manifest: Manifest, depth: int) -> list[int]:
    """Our ids of the entries of every file's hidden_states: the captured layers, then the final hidden state when stored."""
    return manifest.layers + ([depth - 1] if manifest.final_hidden is not None else [])


@dataclass
class ChunkSamples:
    """One chunk's token tensors, read whole (small), and its reader for the states."""

    reader: ChunkReader
    cu_seqlens: np.ndarray
    token_ids: np.ndarray
    loss_mask: np.ndarray
    sample_ids: np.ndarray
    scale: np.ndarray | None  # [T, L] float32 for fp8 chunks
    final_scale: np.ndarray | None  # [T] float32 for an fp8 final hidden state
    with_final: bool  # append the final hidden state to every file's hidden_states

    @classmethod
    def read(cls, reader: ChunkReader, *, with_final: bool) -> ChunkSamples:
        def scales(name: str, dtype: str | None) -> np.ndarray | None:
            return reader.array(name, np.float32) if dtype == "float8_e4m3fn" else None

        return cls(
            reader, reader.array("cu_seqlens", np.int64), reader.array("input_ids", np.int32).astype(np.int64),
            reader.array("loss_mask", np.uint8), reader.array("sample_ids", np.int64),
            scales("hidden_states_scale", reader.dtype), scales("final_hidden_states_scale", reader.final_hidden) if with_final else None,
            with_final,
        )

    def tokens(self, i: int) -> int:
        return int(self.cu_seqlens[i + 1] - self.cu_seqlens[i])

    def export(self, i: int, *, destination: Storage, first: int, metadata: dict[str, str]) -> tuple[str, int]:
        """Writes sample i as hs_<first + i> unless a complete copy is there: ("files" or "kept", its size)."""
        key = hs_key(first + i)
        begin, end = int(self.cu_seqlens[i]), int(self.cu_seqlens[i + 1])
        _, L, d = self.reader.header["hidden_states"]["shape"]
        shape = (end - begin, L + self.with_final, d)
        tensors = {
            "hidden_states": RawTensor("BF16", shape, b""),  # its bytes come below, unless the file is complete
            "token_ids": RawTensor("I64", (end - begin,), self.token_ids[begin:end].tobytes()),
            "loss_mask": RawTensor("U8", (end - begin,), self.loss_mask[begin:end].tobytes()),
        }
        metadata = {**metadata, "sample_id": str(int(self.sample_ids[i]))}
        size = len(safetensors_header(tensors, metadata)[0]) + (end - begin) * (shape[1] * d * 2 + 8 + 1)
        existing = destination.stat(key)
        if existing is not None and existing.size == size:
            return "kept", size
        states = self.bf16_rows("hidden_states", self.scale, begin, end, (end - begin, L, d))
        if self.with_final:  # the target's final hidden state, last: [T, L, d] + [T, 1, d] -> [T, L + 1, d]
            final = self.bf16_rows("final_hidden_states", self.final_scale, begin, end, (end - begin, 1, d))
            states = np.concatenate([states, final], axis=1)
        tensors["hidden_states"] = RawTensor("BF16", shape, states.tobytes())
        destination.put_bytes(key, b"".join(raw_safetensors_parts(tensors, metadata)))
        return "files", size

    def bf16_rows(self, name: str, scale: np.ndarray | None, begin: int, end: int, shape: tuple[int, int, int]) -> np.ndarray:
        """Rows [begin, end) of tensor `name` as bf16 bit patterns of `shape` (fp8 dequantized with its `scale` rows)."""
        raw = self.reader.rows(name, begin, end)
        if scale is None:
            return np.frombuffer(raw, dtype=np.uint16).reshape(shape)
        return dequantize_fp8(raw, scale[begin:end].reshape(shape[:2]), shape)


def export_speculators(
    source: Storage, destination: Storage, *, depth: int, workers: int = DEFAULT_WORKERS,
    on_progress: Callable[[int, int], None] = lambda done, total: None,
) -> ExportSummary:
    """Writes every sample of the verified run in `source` as hs_<i>.safetensors into `destination`;
    `depth` is the target's num_hidden_layers. on_progress(samples done, samples total)."""
    if not source.exists(MANIFEST_KEY):
        raise InputError(f"{source.url} has no {MANIFEST_KEY}: the chunks are not verified", "Run `dflashctl verify` first")
    manifest = Manifest.from_json(source.get_bytes(MANIFEST_KEY))
    check_layers(manifest, depth)
    with_final = manifest.final_hidden is not None
    entries = file_layers(manifest, depth)
    metadata = {
        "format": "pt", "producer": "dflash-k8s", "model": manifest.model, "layers": json.dumps(entries),
        "aux_hidden_state_layer_ids": json.dumps(aux_layer_ids(entries)),
    }
    index: list[dict] = []
    counts = {"files": 0, "kept": 0, "bytes": 0}
    with ThreadPoolExecutor(workers) as pool:
        for marker in manifest.chunks:
            reader = ChunkReader.open(source, hidden_chunk_key(marker.chunk))
            if reader.layers != manifest.layers:
                raise InputError(f"{source.url}/{reader.key} holds layers {reader.layers}, the manifest {manifest.layers}", "Run `dflashctl verify` again")
            if with_final and reader.final_hidden is None:
                raise InputError(f"{source.url}/{reader.key} holds no final hidden state, the manifest says every chunk does", "Run `dflashctl verify` again")
            chunk = ChunkSamples.read(reader, with_final=with_final)
            first = len(index)
            index += [
                {"index": first + i, "sample_id": int(chunk.sample_ids[i]), "chunk": marker.chunk, "tokens": chunk.tokens(i)}
                for i in range(len(chunk.sample_ids))
            ]
            export = partial(chunk.export, destination=destination, first=first, metadata={**metadata, "chunk": str(marker.chunk)})
            results = pool.map(export, range(len(chunk.sample_ids)))
            for outcome, size in results:
                counts[outcome] += 1
                counts["bytes"] += size
                on_progress(counts["files"] + counts["kept"], manifest.samples)
    summary = ExportSummary(
        destination=destination.url, files=counts["files"], kept=counts["kept"], samples=len(index),
        tokens=sum(s["tokens"] for s in index), bytes=counts["bytes"], layers=list(manifest.layers),
        aux_hidden_state_layer_ids=aux_layer_ids(entries[:-1]), last_layer=depth, final_hidden=with_final,
    )
    destination.put_bytes(SAMPLES_KEY, "".join(json.dumps(s) + "\n" for s in index).encode())
    record = {"format": FORMAT, **asdict(summary), "source": source.url, "model": manifest.model, "run_dtype": manifest.dtype}
    destination.put_bytes(SUMMARY_KEY, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode())
    return summary
