"""The file formats of a run (DESIGN sections 3 and 4): where each file lives and what it holds.

Token chunks and every JSON document are handled with numpy and json only, so the control plane
can read them without torch. Hidden-state chunks need torch (bf16 and fp8 have no numpy dtype):
those functions import it when called.

Readers reject a truncated, mislabeled or inconsistent file with a FormatError naming the file.

The layer convention of hidden-state chunks: hidden_states[:, k] is the output of decoder layer
layers[k] (0-based, ascending), before the final norm. That is z-lab's target_layer_ids and
Transformers' output_hidden_states[layers[k] + 1], except for the target's last decoder layer:
Transformers' last entry is after the final norm, ours is before it, like vLLM's aux state
num_hidden_layers (which speculators appends to its files). vLLM and speculators number every
layer one higher (their 0 is the embeddings). tests/test_layer_convention.py pins the edge.

A chunk may also hold the target's final hidden state, final_hidden_states [T, d] (extract.final_hidden:
DSpark's objective reads the target's next-token distribution from it): the output of the target's
last decoder layer, before the final norm, like a captured layer (so a consumer applies the final
norm, then the LM head), row t beside the token that produced it. The header's metadata names its
dtype ("final_hidden"); chunks, markers and manifests without it are read as before.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from dflash_jobs.errors import FormatError, InputError

if TYPE_CHECKING:
    import torch

    from dflash_jobs.spec import TrainSpec
    from dflash_jobs.storage import Storage

TOKENS_FORMAT = "dflash.tokens/v1"
HIDDEN_FORMAT = "dflash.hidden/v1"
DONE_FORMAT = "dflash.done/v1"
MANIFEST_FORMAT = "dflash.manifest/v1"

RUN_KEY = "run.yaml"
DATASET_KEY = "tokens/dataset.json"
MANIFEST_KEY = "extract/manifest.json"
TOKEN_CHUNKS = "tokens/chunks/"
HIDDEN_CHUNKS = "extract/chunks/"
DONE_MARKERS = "extract/done/"
DRAFTER_DIR = "train/drafter"  # the exported drafter, z-lab layout
DRAFTER_CONFIG_KEY = f"{DRAFTER_DIR}/config.json"  # written last by the export: the drafter is complete
SPECULATORS_DRAFTER_DIR = "train/drafter-speculators"  # the same drafter in speculators' format, where its variant has one (DSpark)
TRAIN_METRICS_KEY = "train/metrics.jsonl"
TRAIN_PLOT_KEY = "train/metrics.png"
EVAL_REPORT_KEY = "eval/report.json"
EVAL_PLOT_KEY = "eval/acceptance.png"

HIDDEN_DTYPES = ("bfloat16", "float8_e4m3fn")
FP8_MAX = 448.0  # largest finite float8_e4m3fn

Document = TypeVar("Document")
"""A dataclass stored as a JSON document (document_of builds it)."""


def token_chunk_key(chunk: int) -> str:
    return f"{TOKEN_CHUNKS}{chunk:06d}.safetensors"


def hidden_chunk_key(chunk: int) -> str:
    return f"{HIDDEN_CHUNKS}{chunk:06d}.safetensors"


def done_key(chunk: int) -> str:
    return f"{DONE_MARKERS}{chunk:06d}.json"


def chunk_of_key(key: str) -> int:
    """The chunk id of a chunk or marker key (…/000042.json -> 42)."""
    stem = key.rsplit("/", 1)[-1].split(".", 1)[0]
    if not stem.isdigit():
        raise FormatError(f"{key} is not a chunk file name", "Chunk files are named like 000042.safetensors")
    return int(stem)


# ---- safetensors header, read without torch ----------------------------------------------------

_ST_DTYPES = {"I32": 4, "U8": 1, "I64": 8, "BF16": 2, "F8_E4M3": 1, "F32": 4, "F16": 2}
HEADER_PROBE = 64 << 10
"""Bytes of the first ranged read of a header: a hidden-state chunk's (~1 KB) fits, so one request usually suffices."""
MAX_HEADER = 100 << 20
"""A longer header is not a safetensors header but a corrupt or foreign file."""


def read_header(data: bytes, name: str) -> tuple[dict[str, Any], int]:
    """Parses a safetensors header from the first bytes of a file: (header, total file size).

    Needs only the prefix (8 + header length bytes), so verify can check a remote object with a
    ranged read."""
    if len(data) < 8:
        raise FormatError(f"{name} is truncated: {len(data)} bytes, no safetensors header", "Re-create the file (re-run the step that wrote it)")
    (length,) = struct.unpack("<Q", data[:8])
    if 8 + length > MAX_HEADER:
        raise FormatError(f"{name} is not a safetensors file (header length {length})", "Re-create the file")
    if len(data) < 8 + length:
        raise FormatError(f"{name} is truncated inside its header", "Re-create the file")
    try:
        header = json.loads(data[8 : 8 + length])
    except ValueError:
        raise FormatError(f"{name} has a corrupt safetensors header", "Re-create the file") from None
    end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        begin, stop = entry["data_offsets"]
        expected = int(np.prod(entry["shape"], dtype=np.int64)) * _ST_DTYPES.get(entry["dtype"], 0)
        if entry["dtype"] in _ST_DTYPES and stop - begin != expected:
            raise FormatError(f"{name}: tensor {key} has {stop - begin} bytes for shape {entry['shape']} {entry['dtype']}", "Re-create the file")
        end = max(end, stop)
    return header, 8 + length + end


def header_size(prefix: bytes) -> int:
    """Bytes to fetch to read a whole header, given at least the first 8 bytes of the file."""
    return 8 + struct.unpack("<Q", prefix[:8])[0]


def fetch_header_bytes(read_range: Callable[[int, int], bytes]) -> bytes:
    """The first bytes of a safetensors file up to the end of its header (what `read_header`
    parses; their length is where the tensor data starts), by ranged reads.

    `read_range(start, end)` returns those bytes of the file: `object_range(storage, key)` for a
    stored object, `file_range(path)` for a local file. One probe covers most headers; a longer one
    takes a second read. A file too short or with an implausible length is returned as read, for
    `read_header` to reject by name."""
    prefix = read_range(0, HEADER_PROBE)
    if len(prefix) < 8 or header_size(prefix) > MAX_HEADER:
        return prefix
    if header_size(prefix) > len(prefix):
        prefix = read_range(0, header_size(prefix))
    return prefix[: header_size(prefix)]


def object_range(storage: Storage, key: str) -> Callable[[int, int], bytes]:
    """A stored object as `read_range` for `fetch_header_bytes`: one ranged get per call."""
    return lambda start, end: storage.get_bytes(key, start, end)


def file_range(path: str | Path) -> Callable[[int, int], bytes]:
    """A local file as `read_range` for `fetch_header_bytes`."""

    def read(start: int, end: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    return read


# ---- token chunks ------------------------------------------------------------------------------


@dataclass
class TokenChunk:
    """Samples laid end to end: `cu_seqlens` are their boundaries, `sample_ids` their source lines."""

    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T], 1 on supervised (assistant) tokens
    cu_seqlens: np.ndarray  # int64 [n + 1], 0 .. T
    sample_ids: np.ndarray  # int64 [n], 0-based line numbers in data.source

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.cu_seqlens)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        begin, end = self.cu_seqlens[i], self.cu_seqlens[i + 1]
        return self.input_ids[begin:end], self.loss_mask[begin:end]

    def tensors(self) -> dict[str, np.ndarray]:
        return {
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
            "cu_seqlens": self.cu_seqlens,
            "sample_ids": self.sample_ids,
        }

    def validate(self, name: str) -> TokenChunk:
        expected = {"input_ids": np.int32, "loss_mask": np.uint8, "cu_seqlens": np.int64, "sample_ids": np.int64}
        for key, dtype in expected.items():
            array = getattr(self, key)
            if array.dtype != dtype or array.ndim != 1:
                raise FormatError(f"{name}: {key} is {array.dtype}{list(array.shape)}, expected a 1-D {np.dtype(dtype).name} array", "Re-run prepare")
        cu = self.cu_seqlens
        if len(cu) != len(self.sample_ids) + 1 or len(cu) < 2 or cu[0] != 0 or cu[-1] != len(self.input_ids):
            raise FormatError(f"{name}: cu_seqlens do not cover input_ids ({len(cu)} boundaries for {len(self.sample_ids)} samples, {len(self.input_ids)} tokens)", "Re-run prepare")
        if np.any(np.diff(cu) <= 0):
            raise FormatError(f"{name}: cu_seqlens are not strictly increasing (an empty sample)", "Re-run prepare")
        if len(self.loss_mask) != len(self.input_ids):
            raise FormatError(f"{name}: loss_mask has {len(self.loss_mask)} entries for {len(self.input_ids)} tokens", "Re-run prepare")
        if self.loss_mask.size and self.loss_mask.max() > 1:
            raise FormatError(f"{name}: loss_mask holds values other than 0 and 1", "Re-run prepare")
        return self

    def encode(self) -> bytes:
        from safetensors.numpy import save

        return save(self.tensors(), metadata={"format": TOKENS_FORMAT})

    @classmethod
    def decode(cls, data: bytes, name: str) -> TokenChunk:
        header, total = read_header(data, name)
        if total != len(data):
            raise FormatError(f"{name} is truncated or has trailing bytes: {len(data)} bytes, header says {total}", "Re-run prepare")
        if (header.get("__metadata__") or {}).get("format") != TOKENS_FORMAT:
            raise FormatError(f"{name} is not a token chunk (format {(header.get('__metadata__') or {}).get('format')!r}, expected {TOKENS_FORMAT})", "Point at tokens/chunks/ of a prepared run")
        from safetensors.numpy import load

        tensors = load(data)
        missing = {"input_ids", "loss_mask", "cu_seqlens", "sample_ids"} - set(tensors)
        if missing:
            raise FormatError(f"{name} lacks {sorted(missing)}", "Re-run prepare")
        return cls(**{k: tensors[k] for k in ("input_ids", "loss_mask", "cu_seqlens", "sample_ids")}).validate(name)


@dataclass
class ChunkInfo:
    id: int
    path: str
    samples: int
    tokens: int


@dataclass
class DatasetIndex:
    """tokens/dataset.json: what prepare wrote, and what it dropped and why."""

    samples: int
    tokens: int
    vocab_size: int
    chunks: list[ChunkInfo]
    source: str = ""
    tokenizer: str | None = None
    dropped: dict[str, int] = field(default_factory=dict)
    truncated: int = 0
    supervised_tokens: int = 0
    holdout: dict[str, Any] = field(default_factory=dict)
    generation: dict[str, Any] | None = None
    """With generation on: the generate/manifest.json the rows came from (settings, counts, drops)."""
    answers: dict[str, int] = field(default_factory=dict)
    """Chat samples (held-out ones included) by how their supervised tokens were made: the target's
    own ids ("target_ids") or text tokenized here ("text"), and of each how many tokenizing text
    changes (prepare.RETOKENIZED)."""

    def to_json(self) -> str:
        return dump_json_document(TOKENS_FORMAT, asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes, name: str = DATASET_KEY) -> DatasetIndex:
        index = document_of(cls, load_json_document(text, name, TOKENS_FORMAT), name, "token dataset index", "Re-run prepare", chunks=ChunkInfo)
        if sum(c.tokens for c in index.chunks) != index.tokens or sum(c.samples for c in index.chunks) != index.samples:
            raise FormatError(f"{name}: chunk totals disagree with samples/tokens", "Re-run prepare")
        return index


def dump_json_document(fmt: str, body: dict[str, Any]) -> str:
    """`body` as a JSON object carrying `"format": fmt`, keys sorted: what load_json_document reads."""
    return json.dumps({"format": fmt, **body}, indent=2, sort_keys=True) + "\n"


def load_json_document(text: str | bytes, name: str, fmt: str, *, fix: str | None = None) -> dict[str, Any]:
    """A JSON object carrying `"format": fmt` (removed from what is returned); `fix` says how to mend a bad one."""
    try:
        raw = json.loads(text)
    except ValueError:
        raise FormatError(f"{name} is not valid JSON (truncated?)", fix or "Re-create it") from None
    if not isinstance(raw, dict) or raw.pop("format", None) != fmt:
        raise FormatError(f"{name} is not a {fmt} document", fix or "Point at the right file, or re-create it")
    return raw


def document_of(cls: type[Document], raw: dict[str, Any], name: str, what: str, fix: str, **lists: type) -> Document:
    """`cls` from the fields load_json_document read, each field of `lists` a list built item by item
    as its type (chunks=ChunkInfo); a field missing or unknown is a FormatError: `name` is not a valid `what`."""
    try:
        return cls(**{**raw, **{key: [kind(**item) for item in raw[key]] for key, kind in lists.items()}})
    except (KeyError, TypeError) as exc:
        raise FormatError(f"{name} is not a valid {what} ({exc})", fix) from None


# ---- hidden-state chunks -----------------------------------------------------------------------


def quantize_fp8(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn with one float32 scale per row of d: hidden [T, L, d] -> (q, scale [T, L]) for
    the layers (a scale per token and layer), [T, d] -> (q, scale [T]) for the final hidden state."""
    import torch

    amax = hidden.abs().amax(dim=-1).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = (hidden.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized, scale


def dequantize_fp8(quantized: torch.Tensor, scale: torch.Tensor, dtype=None) -> torch.Tensor:
    import torch

    return (quantized.float() * scale.unsqueeze(-1)).to(dtype or torch.bfloat16)


def hidden_metadata(
    *, layers: list[int], model: str, config_hash: str, dtype: str, compute_dtype: str = "bfloat16", final_hidden: str | None = None,
) -> dict[str, str]:
    """The header metadata of a hidden-state chunk; compute_dtype: what the target's matmuls ran in;
    final_hidden: the dtype of the final hidden state it holds (None: it holds none)."""
    for label in (dtype, final_hidden or dtype):
        if label not in HIDDEN_DTYPES:
            raise FormatError(f"hidden-state dtype {label!r} is not supported", f"Use one of {HIDDEN_DTYPES}")
    metadata = {"format": HIDDEN_FORMAT, "layers": json.dumps(list(layers)), "model": model, "config_hash": config_hash, "dtype": dtype,
                "compute_dtype": compute_dtype}
    if final_hidden is not None:
        metadata["final_hidden"] = final_hidden
    return metadata


_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float32": "F32", "int64": "I64", "int32": "I32", "uint8": "U8"}


@dataclass(frozen=True, slots=True)
class RawTensor:
    """A tensor as safetensors stores it: dtype name, shape and little-endian bytes (no torch needed)."""

    dtype: str  # safetensors name: BF16, F8_E4M3, F32, I64, I32, U8
    shape: tuple[int, ...]
    data: Any  # a bytes-like object of exactly prod(shape) * itemsize bytes

    @property
    def itemsize(self) -> int:
        return _ST_DTYPES[self.dtype]


def safetensors_names(tensors: Mapping[str, Any]) -> list[str]:
    """The order a safetensors file lays its tensors' bytes out in (RawTensor or torch.Tensor, by
    `itemsize`): widest elements first, so every offset stays aligned (as the library lays them out);
    among as wide ones the largest first, then by name. A chunk's file streams as the GPU's copies
    fill its rows (extract/writer.py), and a tensor after a copied one waits for that one's last row:
    the layers' states before the final hidden state leave only the smaller one to the end."""
    return sorted(tensors, key=lambda name: (-tensors[name].itemsize, -_nbytes(tensors[name]), name))


def _nbytes(tensor: Any) -> int:
    return int(np.prod(tuple(tensor.shape), dtype=np.int64)) * tensor.itemsize


def safetensors_header(tensors: dict[str, RawTensor], metadata: dict[str, str]) -> tuple[bytes, list[str]]:
    """The canonical header (length prefix included) and the order the tensors' bytes follow it in.

    Canonical: the same tensors and metadata give the same bytes in any process (the library writes
    __metadata__ in a per-process hash order, so a re-extracted chunk would get another sha256).
    Tensors are laid out in safetensors_names' order; any reader takes the offsets from the header."""
    names = safetensors_names(tensors)
    entries, offset = {}, 0
    for name in names:
        tensor = tensors[name]
        size = _nbytes(tensor)
        entries[name] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps({"__metadata__": metadata, **entries}, sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header, names


def raw_safetensors_parts(tensors: dict[str, RawTensor], metadata: dict[str, str]) -> list[memoryview]:
    """The bytes of a safetensors file as views, in file order: the canonical header, then every
    tensor's own bytes (no copy), so a writer can stream them to storage."""
    header, names = safetensors_header(tensors, metadata)
    return [memoryview(header), *(memoryview(tensors[name].data) for name in names)]


def safetensors_parts(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> list[memoryview]:
    """raw_safetensors_parts of torch tensors, viewing each tensor's own memory."""
    import torch

    raw = {
        name: RawTensor(_SAFETENSORS_DTYPES[str(t.dtype).removeprefix("torch.")], tuple(t.shape), t.contiguous().view(torch.uint8).reshape(-1).numpy().data)
        for name, t in tensors.items()
    }
    return raw_safetensors_parts(raw, metadata)


def hidden_tensors(
    tokens: TokenChunk, hidden: torch.Tensor, scale: torch.Tensor | None,
    final: torch.Tensor | None = None, final_scale: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors of a hidden-state chunk: the token chunk's four, plus the states (and scales), and
    the final hidden state [T, d] (and its scales [T]) when given."""
    import torch

    tensors = {key: torch.from_numpy(np.ascontiguousarray(value)) for key, value in tokens.tensors().items()}
    for name, tensor in (("hidden_states", hidden), ("hidden_states_scale", scale),
                         ("final_hidden_states", final), ("final_hidden_states_scale", final_scale)):
        if tensor is not None:
            tensors[name] = tensor.contiguous()
    return tensors


def encode_hidden_chunk(
    tokens: TokenChunk, hidden: torch.Tensor, *, layers: list[int], model: str, config_hash: str, dtype: str = "bfloat16",
    final_hidden: torch.Tensor | None = None,
) -> bytes:
    """Serialises one hidden-state chunk; `hidden` is [T, L, d] and `final_hidden` (optional) [T, d],
    in bf16 (quantized here for fp8)."""
    import torch

    def stored(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if dtype == "float8_e4m3fn" and states.dtype != torch.float8_e4m3fn:
            return quantize_fp8(states)
        return (states.to(torch.bfloat16) if dtype == "bfloat16" else states), None

    hidden, scale = stored(hidden)
    final, final_scale = stored(final_hidden) if final_hidden is not None else (None, None)
    metadata = hidden_metadata(layers=layers, model=model, config_hash=config_hash, dtype=dtype,
                               final_hidden=None if final_hidden is None else dtype)
    return b"".join(safetensors_parts(hidden_tensors(tokens, hidden, scale, final, final_scale), metadata))


@dataclass
class HiddenChunk:
    tokens: TokenChunk
    hidden_states: Any  # torch.Tensor [T, L, d], bf16 or float8_e4m3fn
    scale: Any  # torch.Tensor [T, L] float32, fp8 only
    layers: list[int]
    model: str
    config_hash: str
    dtype: str
    final_hidden_states: Any = None  # torch.Tensor [T, d] in `final_hidden`, when the chunk holds it
    final_scale: Any = None  # torch.Tensor [T] float32, fp8 only
    final_hidden: str | None = None  # the final hidden state's dtype; None: not stored

    def dequantized(self):
        """The states as bf16 [T, L, d], whatever the storage dtype."""
        if self.dtype == "float8_e4m3fn":
            return dequantize_fp8(self.hidden_states, self.scale)
        return self.hidden_states

    def dequantized_final(self):
        """The final hidden state as bf16 [T, d], whatever the storage dtype (None when not stored)."""
        if self.final_hidden == "float8_e4m3fn":
            return dequantize_fp8(self.final_hidden_states, self.final_scale)
        return self.final_hidden_states

    @classmethod
    def decode(cls, data: bytes, name: str) -> HiddenChunk:
        header, total = read_header(data, name)
        if total != len(data):
            raise FormatError(f"{name} is truncated or has trailing bytes: {len(data)} bytes, header says {total}", "Delete its done marker and re-run extraction for it")
        meta = check_hidden_header(header, name)
        from safetensors.torch import load

        tensors = load(data)
        tokens = TokenChunk(**{k: tensors[k].numpy() for k in ("input_ids", "loss_mask", "cu_seqlens", "sample_ids")}).validate(name)
        return cls(
            tokens, tensors["hidden_states"], tensors.get("hidden_states_scale"), meta["layers"], meta["model"], meta["config_hash"],
            meta["dtype"], tensors.get("final_hidden_states"), tensors.get("final_hidden_states_scale"), meta["final_hidden"],
        )


_ST_HIDDEN_DTYPES = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3"}


def check_hidden_header(header: dict[str, Any], name: str) -> dict[str, Any]:
    """Checks a hidden-state chunk's header for consistency; returns its metadata (layers parsed,
    final_hidden the final hidden state's dtype or None)."""
    meta = dict(header.get("__metadata__") or {})
    if meta.get("format") != HIDDEN_FORMAT:
        raise FormatError(f"{name} is not a hidden-state chunk (format {meta.get('format')!r}, expected {HIDDEN_FORMAT})", "Point at extract/chunks/ of a run")
    try:
        meta["layers"] = json.loads(meta["layers"])
    except (KeyError, ValueError):
        raise FormatError(f"{name} has no valid 'layers' metadata", "Re-run extraction for this chunk") from None
    for key in ("input_ids", "loss_mask", "cu_seqlens", "sample_ids", "hidden_states"):
        if key not in header:
            raise FormatError(f"{name} lacks tensor {key}", "Re-run extraction for this chunk")
    tokens = header["input_ids"]["shape"][0]
    _check_states(header, name, "hidden_states", meta.get("dtype"), [tokens, len(meta["layers"])], f"{tokens} tokens x {len(meta['layers'])} layers")
    meta["final_hidden"] = meta.get("final_hidden")
    if meta["final_hidden"] is not None or "final_hidden_states" in header:
        if meta["final_hidden"] is None or "final_hidden_states" not in header:
            raise FormatError(f"{name}: final_hidden_states and its 'final_hidden' metadata come together, this chunk has one of them", "Re-run extraction for this chunk")
        _check_states(header, name, "final_hidden_states", meta["final_hidden"], [tokens], f"{tokens} tokens")
        width = header["hidden_states"]["shape"][-1]
        if header["final_hidden_states"]["shape"][-1] != width:
            raise FormatError(f"{name}: final_hidden_states {header['final_hidden_states']['shape']} are not {width} wide like hidden_states", "Re-run extraction for this chunk")
    return meta


def _check_states(header: dict[str, Any], name: str, key: str, dtype: str | None, rows: list[int], described: str) -> None:
    """`key` holds [*rows, d] states labeled `dtype`, with [*rows] float32 scales when fp8."""
    if dtype not in HIDDEN_DTYPES:
        raise FormatError(f"{name} has unknown dtype label {dtype!r} for {key}", f"Expected one of {HIDDEN_DTYPES}")
    entry = header[key]
    if entry["dtype"] != _ST_HIDDEN_DTYPES[dtype]:
        raise FormatError(f"{name} is labeled {dtype} but its {key} are {entry['dtype']}", "Re-run extraction for this chunk")
    if len(entry["shape"]) != len(rows) + 1 or entry["shape"][:-1] != rows:
        raise FormatError(f"{name}: {key} {entry['shape']} do not match {described}", "Re-run extraction for this chunk")
    if dtype == "float8_e4m3fn" and header.get(f"{key}_scale", {}).get("shape") != rows:
        raise FormatError(f"{name}: fp8 {key} without a {rows} {key}_scale", "Re-run extraction for this chunk")


# ---- markers and the manifest ------------------------------------------------------------------


@dataclass
class DoneMarker:
    """extract/done/<chunk>.json: written after the chunk object is fully stored."""

    chunk: int
    samples: int
    tokens: int
    bytes: int
    sha256: str
    etag: str | None
    dtype: str
    layers: list[int]
    hidden_size: int
    shard: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    compute_dtype: str = "bfloat16"  # the target's matmuls: bfloat16, or float8 (extract.compute_dtype)
    final_hidden: str | None = None  # the dtype of the target's final hidden state in the chunk; None: not stored

    def to_json(self) -> str:
        return dump_json_document(DONE_FORMAT, asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes, name: str) -> DoneMarker:
        return document_of(cls, load_json_document(text, name, DONE_FORMAT), name, "done marker", "Delete it and re-run extraction for its chunk")


@dataclass
class Manifest:
    """extract/manifest.json: written by verify once every chunk checks out; training needs it."""

    model: str
    layers: list[int]
    dtype: str
    hidden_size: int
    samples: int
    tokens: int
    bytes: int
    chunks: list[DoneMarker]
    final_hidden: str | None = None
    """The dtype of the target's final hidden state, which every chunk then holds; None: not every chunk has it."""

    def to_json(self) -> str:
        return dump_json_document(MANIFEST_FORMAT, asdict(self))  # asdict converts the markers too

    @classmethod
    def from_json(cls, text: str | bytes, name: str = MANIFEST_KEY) -> Manifest:
        return document_of(cls, load_json_document(text, name, MANIFEST_FORMAT), name, "manifest", "Run `dflashctl verify` again", chunks=DoneMarker)


def check_final_hidden(manifest: Manifest, train: TrainSpec, location: str) -> None:
    """Refuses a drafter whose objective reads the target's final hidden state (train.reads_final_hidden)
    on states extracted without it; `location` names the manifest."""
    if not train.reads_final_hidden or manifest.final_hidden is not None:
        return
    raise InputError(
        f"{location}: the hidden states hold no final hidden state of the target, and train.drafter {train.drafter} "
        "reads it (the target's next-token distribution: its L1 term and confidence labels)",
        "Extract it: extract.final_hidden: true (or unset), then `dflashctl verify --delete-bad` (it removes the markers "
        "of the chunks without it) and `dflashctl run --force` (it extracts them again); "
        "or train without it, reported as cross-entropy only (no L1 term, no confidence head): train.dspark.ce_only: true",
    )
