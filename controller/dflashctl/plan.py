"""The bill of a run before it starts: tokens, storage, GPU-hours, the upload rate a node must sustain
and what training reads from storage at what rate, and the share of the target's final hidden state
in them; with a generate section, the answers to generate first and their GPU-hours.

Pure functions of the spec, the token dataset's size and the target's shape; the readers at the
bottom fetch those (tokens/dataset.json and the checkpoint's config.json) and fall back to stated
estimates when they cannot, and check the spec against the run's verified states when readable.

Units are decimal, as storage and network are billed: 1 TB = 1e12 bytes, 1 MB/s = 1e6 bytes/s.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash_jobs.errors import DflashError, FormatError, SpecError, StorageError
from dflash_jobs.formats import DATASET_KEY, HIDDEN_DTYPES, MANIFEST_KEY, DatasetIndex, Manifest, check_final_hidden
from dflash_jobs.generation import PLAN_KEY, GenerationProgress, read_plan
from dflash_jobs.generation import read_progress as read_generation_progress
from dflash_jobs.generate.source import parse_prompt
from dflash_jobs.prepare import BadRow
from dflash_jobs.spec import RunSpec, default_layers, is_s3, local_path, resolve_layers, text_config, under
from dflash_jobs.storage import (
    AccessDenied, BucketNotFound, CredentialsMissing, EndpointUnreachable, ObjectNotFound, Storage, open_storage, read_head,
)

from dflashctl.backends import open_backend
from dflashctl.check import cluster_of
from dflashctl.plan_states import ASSUMED_WEIGHTS, Prices, StatesCost, TargetWeights, read_target_weights, states_cost
from dflashctl.pod_fit import Node, place, pod_asks

EXTRACT_TOKENS_PER_SECOND = {
    ("bfloat16", True): 11973.0,
    ("bfloat16", False): 10408.0,
    ("float8", True): 16775.0,
    ("float8", False): 13092.0,
}
"""Real (unpadded) tokens/s per GPU of the extractor, states stored to local disk, by
(extract.compute_dtype, whether extract.compile is on), 27B shape on an H200 with the image's fast
paths: bench/results/extract-compile-h200.json, extract-h200.json and extract-fp8-compile-h200.json.
Each is the rate until the last batch, what a shard of hours runs at: storing its final chunk
afterwards (3-4 s) is once per shard. Each is within 0.6% of the bare forward measured beside it."""
TRAIN_TOKENS_PER_SECOND = {True: 14288.0, False: 11228.0}
"""Context tokens/s per GPU of a drafter training step at the default micro-batch (4,096-token
documents, 512 anchors, 2,048 blocks), by whether train.compile is on, with the checkpointing auto
picks for each (none compiled, mlp eager), 27B shape on an H200 (bench/results/train-compile-h200.json,
train-fused-loss-h200.json). Shorter documents bring more blocks per token, so fewer tokens/s."""
EXTRACT_GPUS_PER_NODE = 8
"""Extraction pods (one GPU each) that land on one node, all uploading at once."""
SOURCE_BYTES_PER_TOKEN = 4.0
"""Estimate for a JSONL source not yet tokenized: ~4 characters of English per token; the JSON
framing roughly pays for the chat template's extra tokens."""
TOKEN_BYTES = 4 + 1
"""input_ids (int32) and loss_mask (uint8) of each token, stored again in its hidden-state chunk."""
FP8_SCALE_BYTES = 4
"""float8_e4m3fn chunks carry one float32 scale per token and layer."""
# Without a readable checkpoint, the plan assumes the target this project is built for.
ASSUMED_TARGET = {"hidden_size": 5120, "num_hidden_layers": 64, "name": "Qwen3.6-27B"}

TB = 1e12
MB = 1e6
GIB = 1 << 30
"""train.cache_gb counts GiB, as the cache volume's size is rendered."""
STORE_READ_MB_PER_S_PER_NODE = 2000.0
"""What the plan assumes one node can read from the object store, sustained for days (16 Gbit/s;
not measured here: `--store-mb-per-s` takes your store's). Above it the plan warns: training would
wait on storage."""
S3_ATTEMPTS = 2
"""A plan answers in seconds: an unreachable store means "estimate", not minutes of retries."""


@dataclass(frozen=True, slots=True)
class DataSize:
    samples: int | None
    tokens: int | None
    estimated: bool
    basis: str
    """Where the numbers come from, for the user to judge them."""
    tokens_upper_bound: int | None = None
    """With regenerated answers, before prepare: the tokens if every answer reached generate.max_new_tokens."""


@dataclass(frozen=True, slots=True)
class TargetShape:
    hidden_size: int
    layers: list[int]
    basis: str
    warning: str | None = None
    """Layers past the depth of the target the plan assumes (its config.json unread)."""
    weights: TargetWeights = ASSUMED_WEIGHTS
    """What its weights take on a GPU (online training holds them beside the drafter)."""


@dataclass(frozen=True, slots=True)
class GenerationCost:
    """What regenerating the answers costs: prompts x tokens per answer, at a rate per GPU."""

    prompts: int | None
    prompts_estimated: bool
    prompts_basis: str
    max_new_tokens: int
    tokens_per_prompt: float | None
    """Mean answer length measured by the chunks done so far; None before the first."""
    tokens: float | None
    """Tokens to generate: prompts x the measured mean, or x max_new_tokens (an upper bound) before any chunk."""
    upper_bound: bool
    tokens_per_second_per_gpu: float | None
    rate_basis: str
    gpu_hours: float | None
    shards: int
    gpus_per_shard: int
    wall_clock_hours: float | None


@dataclass(frozen=True, slots=True)
class TrainingReads:
    """Training reads every token's states once per epoch. Each rank trains on a fixed share of the
    chunks; its part of the node's cache (train.cache_gb / gpus_per_node) keeps a fixed subset of
    that share on local disk across epochs, the rest is read from storage again every epoch
    (train/chunks.py ChunkCache). Sizes in the spec's extract.dtype."""

    dtype: str
    gpus_per_node: int
    share_tb_per_rank: float | None
    cache_gib_per_rank: float
    resident_fraction: float | None
    """Of each rank's share, what stays on local disk: 1.0 when the share fits the cache."""
    read_tb_first_epoch: float | None
    """Every chunk, once: what the cache starts from."""
    read_tb_per_later_epoch: float | None
    read_tb_total: float | None
    consumed_mb_per_s_per_gpu: float
    """What one GPU's training steps consume at the training rate (from disk, memory or storage)."""
    store_mb_per_s_per_node_first_epoch: float
    store_mb_per_s_per_node_later_epochs: float | None
    store_limit_mb_per_s_per_node: float
    warnings: list[str]
    """Where the store would have to deliver more than the limit, and what helps."""

    @property
    def fits_cache(self) -> bool | None:
        return None if self.resident_fraction is None else self.resident_fraction >= 1.0


@dataclass(frozen=True, slots=True)
class PodBill:
    """What one pod of a component asks, and whether a node of the cluster can hold it."""

    component: str
    count: int
    """Pods of it at once."""
    gpus: int
    cpu: float
    memory_gib: float
    fits: bool | None
    """None where the nodes were not read."""
    detail: str


def pod_bills(spec: RunSpec, nodes: list[Node] | None) -> list[PodBill]:
    """Each Job's pod as rendered (placement and patch included) against the nodes, when they were read."""
    bills = []
    for ask in pod_asks(spec):
        placement = None if nodes is None else place(ask, nodes)
        bills.append(PodBill(
            ask.component, ask.count, ask.gpus, float(ask.cpu), float(ask.memory) / GIB,
            fits=None if placement is None else bool(placement.fitting), detail="" if placement is None else placement.describe(),
        ))
    return bills


@dataclass(frozen=True, slots=True)
class Plan:
    name: str
    data: DataSize
    target: TargetShape
    dtype: str
    """extract.dtype: the storage and upload figures of this one are the ones that apply."""
    bytes_per_token: dict[str, int]
    storage_tb: dict[str, float | None]
    tokens_per_second_per_gpu: float
    gpu_hours: float | None
    shards: int
    wall_clock_hours: float | None
    gpus_per_node: int
    upload_mb_per_s_per_node: dict[str, float]
    train_tokens_per_second_per_gpu: float
    train_gpu_hours: float | None
    """Every token once per epoch (train.epochs), at the measured training rate."""
    train_wall_clock_hours: float | None
    """On train.nodes x train.gpus_per_node GPUs."""
    training_reads: TrainingReads
    """What training reads from storage, at what rate, and whether the store keeps up."""
    final_hidden: FinalHiddenCost
    """The target's final hidden state: what it adds to the figures above when stored, what it would add when not."""
    states: StatesCost
    """train.states' two paths, stored and online, side by side, and the one the plan picks."""
    generation: GenerationCost | None = None
    """With a generate section: the generation step's bill, before prepare's tokens exist."""
    pods: list[PodBill] = field(default_factory=list)
    nodes_basis: str = ""
    """Where the nodes the pods were held against come from, or why they were not read."""
    warnings: list[str] = field(default_factory=list)
    """What the spec still holds of the starter's placeholders."""

    def to_dict(self) -> dict[str, Any]:
        plan = asdict(self)
        plan["training_reads"]["fits_cache"] = self.training_reads.fits_cache
        return plan


def bytes_per_token(hidden_size: int, num_layers: int, dtype: str, *, final_hidden: bool = False) -> int:
    """Bytes one token takes in a hidden-state chunk: L captured states of `hidden_size` (and the
    final hidden state, one more), plus its ids and mask."""
    return (num_layers + final_hidden) * state_bytes(hidden_size, dtype) + TOKEN_BYTES


def state_bytes(hidden_size: int, dtype: str) -> int:
    """Bytes of one stored state of `hidden_size` (one layer of one token), its fp8 scale included."""
    if dtype == "bfloat16":
        return hidden_size * 2
    if dtype == "float8_e4m3fn":
        return hidden_size + FP8_SCALE_BYTES
    raise SpecError("extract.dtype", dtype, " | ".join(HIDDEN_DTYPES))


def extraction_rate(spec: RunSpec) -> float:
    """The measured extractor rate for this spec's compute dtype and compilation, on a GPU."""
    return EXTRACT_TOKENS_PER_SECOND[spec.extract.compute_dtype, spec.extract.compiled_on("cuda")]


def training_rate(spec: RunSpec) -> float:
    """The measured training rate for this spec's compilation, on a GPU."""
    return TRAIN_TOKENS_PER_SECOND[spec.train.compiled_on("cuda")]


def training_reads(spec: RunSpec, tokens: int | None, per_token: int, *, tokens_per_second: float, store_limit: float) -> TrainingReads:
    """The storage bill of training for `tokens` tokens of `per_token` bytes (see TrainingReads)."""
    train = spec.train
    cache_per_rank = train.cache_gb * GIB / train.gpus_per_node
    consumed = tokens_per_second * per_token / MB
    first_rate = consumed * train.gpus_per_node
    warnings = []
    fp8 = " fp8 storage (extract.dtype: float8_e4m3fn) halves it;" if spec.extract.dtype == "bfloat16" else ""
    if first_rate > store_limit:
        warnings.append(
            f"the first epoch reads every chunk from storage at {first_rate:,.0f} MB/s per node, over the {store_limit:,.0f} MB/s "
            f"assumed sustainable (--store-mb-per-s): its steps will wait on storage.{fp8.rstrip(';')}"
        )
    if tokens is None:
        return TrainingReads(spec.extract.dtype, train.gpus_per_node, None, cache_per_rank / GIB, None, None, None, None, consumed, first_rate, None, store_limit, warnings)
    total = tokens * per_token
    share = total / train.world_size
    resident = min(1.0, cache_per_rank / share) if share else 1.0
    later = total * (1 - resident)
    later_rate = first_rate * (1 - resident)
    if later_rate > store_limit:
        cache_gb = math.ceil(share * train.gpus_per_node / GIB)
        nodes = math.ceil(total / (train.cache_gb * GIB))
        warnings.append(
            f"each later epoch streams {1 - resident:.0%} of every rank's share from storage again at {later_rate:,.0f} MB/s per node: "
            f"a node-local cache of train.cache_gb: {cache_gb:,} holds the whole share (train.cache_storage_class for local NVMe);"
            f"{fp8} or train.nodes: {nodes} makes each share fit the cache of {train.cache_gb:g} GiB per node"
        )
    return TrainingReads(
        dtype=spec.extract.dtype, gpus_per_node=train.gpus_per_node, share_tb_per_rank=share / TB, cache_gib_per_rank=cache_per_rank / GIB, resident_fraction=resident,
        read_tb_first_epoch=total / TB, read_tb_per_later_epoch=later / TB, read_tb_total=(total + later * (train.epochs - 1)) / TB,
        consumed_mb_per_s_per_gpu=consumed, store_mb_per_s_per_node_first_epoch=first_rate,
        store_mb_per_s_per_node_later_epochs=later_rate, store_limit_mb_per_s_per_node=store_limit, warnings=warnings,
    )


def make_plan(
    spec: RunSpec, data: DataSize, target: TargetShape, *, tokens_per_second: float | None = None,
    train_tokens_per_second: float | None = None, generation: GenerationCost | None = None,
    store_mb_per_s: float = STORE_READ_MB_PER_S_PER_NODE, nodes: list[Node] | None = None, nodes_basis: str = "",
    warnings: list[str] = (), prices: Prices = Prices(),
) -> Plan:
    tokens_per_second = extraction_rate(spec) if tokens_per_second is None else tokens_per_second
    train_tokens_per_second = training_rate(spec) if train_tokens_per_second is None else train_tokens_per_second
    for option, rate in (("--tokens-per-second", tokens_per_second), ("--train-tokens-per-second", train_tokens_per_second),
                         ("--store-mb-per-s", store_mb_per_s)):
        if rate <= 0:
            raise SpecError(option, rate, "a number > 0")
    final = spec.stores_final_hidden
    per_token = {dtype: bytes_per_token(target.hidden_size, len(target.layers), dtype, final_hidden=final) for dtype in HIDDEN_DTYPES}
    gpus_per_node = min(EXTRACT_GPUS_PER_NODE, spec.extract.shards)
    gpu_hours = None if data.tokens is None else data.tokens / tokens_per_second / 3600
    train_gpu_hours = None if data.tokens is None else data.tokens * spec.train.epochs / train_tokens_per_second / 3600
    return Plan(
        name=spec.name,
        data=data,
        target=target,
        dtype=spec.extract.dtype,
        bytes_per_token=per_token,
        storage_tb={dtype: None if data.tokens is None else data.tokens * size / TB for dtype, size in per_token.items()},
        tokens_per_second_per_gpu=tokens_per_second,
        gpu_hours=gpu_hours,
        shards=spec.extract.shards,
        wall_clock_hours=None if gpu_hours is None else gpu_hours / spec.extract.shards,
        gpus_per_node=gpus_per_node,
        upload_mb_per_s_per_node={dtype: tokens_per_second * size * gpus_per_node / MB for dtype, size in per_token.items()},
        train_tokens_per_second_per_gpu=train_tokens_per_second,
        train_gpu_hours=train_gpu_hours,
        train_wall_clock_hours=None if train_gpu_hours is None else train_gpu_hours / spec.train.world_size,
        training_reads=training_reads(spec, data.tokens, per_token[spec.extract.dtype], tokens_per_second=train_tokens_per_second,
                                      store_limit=store_mb_per_s),
        final_hidden=final_hidden_cost(spec, data, target, tokens_per_second=tokens_per_second,
                                       train_tokens_per_second=train_tokens_per_second, gpus_per_node=gpus_per_node),
        states=states_cost(
            spec, tokens=data.tokens, hidden_size=target.hidden_size, captured=len(target.layers),
            stored_tb=None if data.tokens is None else data.tokens * per_token[spec.extract.dtype] / TB,
            extract_tokens_per_second=tokens_per_second, train_tokens_per_second=train_tokens_per_second, weights=target.weights, prices=prices,
        ),
        generation=generation,
        pods=pod_bills(spec, nodes),
        nodes_basis=nodes_basis,
        warnings=list(warnings),
    )


# ---- the target's final hidden state -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FinalHiddenCost:
    """The target's final hidden state (DSpark's objective reads it): one more state of `hidden_size`
    a token, in extract.dtype. When the run stores it (extract.final_hidden, or a drafter that reads
    it: `stored`), the plan's storage, upload and training figures include this; when not, this is
    what storing it would add."""

    stored: bool
    dtype: str
    bytes_per_token: int
    fraction: float
    """Of a token's bytes without it: +20% over five captured layers."""
    storage_tb: float | None
    upload_mb_per_s_per_node: float
    train_read_mb_per_s_per_gpu: float
    """What one GPU's training steps read of it at the training rate, every epoch (DFlash's too: a chunk is read whole)."""
    train_read_mb_per_s_per_node: float


def final_hidden_cost(
    spec: RunSpec, data: DataSize, target: TargetShape, *, tokens_per_second: float, train_tokens_per_second: float, gpus_per_node: int,
) -> FinalHiddenCost:
    dtype = spec.extract.dtype
    size = state_bytes(target.hidden_size, dtype)
    return FinalHiddenCost(
        stored=spec.stores_final_hidden, dtype=dtype, bytes_per_token=size,
        fraction=size / bytes_per_token(target.hidden_size, len(target.layers), dtype),
        storage_tb=None if data.tokens is None else data.tokens * size / TB,
        upload_mb_per_s_per_node=tokens_per_second * size * gpus_per_node / MB,
        train_read_mb_per_s_per_gpu=train_tokens_per_second * size / MB,
        train_read_mb_per_s_per_node=train_tokens_per_second * size * spec.train.gpus_per_node / MB,
    )


def generation_cost(spec: RunSpec, prompts: DataSize, measured: GenerationProgress | None, *, tokens_per_second: float | None) -> GenerationCost | None:
    """The generation bill from the prompts (`prompts.samples`), what the done chunks measured, and a
    rate per GPU: `tokens_per_second` when given, else the one measured, else unknown."""
    generate = spec.generate
    if generate is None:
        return None
    if tokens_per_second is not None and tokens_per_second <= 0:
        raise SpecError("--generate-tokens-per-second", tokens_per_second, "a number > 0")
    per_prompt = measured.tokens_per_prompt if measured is not None else None
    tokens = None if prompts.samples is None else prompts.samples * (per_prompt if per_prompt is not None else generate.max_new_tokens)
    gpu_seconds = measured.engine_seconds * generate.gpus_per_shard if measured is not None else 0.0
    rate, basis = tokens_per_second, "given (--generate-tokens-per-second)"
    if rate is None and measured is not None and measured.completion_tokens and gpu_seconds:
        rate = measured.completion_tokens / gpu_seconds
        basis = (f"measured by this run: {measured.completion_tokens:,} tokens in {measured.chunks_done} chunks, "
                 f"{gpu_seconds:,.0f} GPU-seconds (engine start-up included)")
    if rate is None:
        basis = f"unknown until a chunk is done: pass --generate-tokens-per-second (the generation log's tokens/s per {generate.gpus_per_shard} GPU(s))"
    gpu_hours = None if tokens is None or rate is None else tokens / rate / 3600
    gpus = generate.shards * generate.gpus_per_shard
    return GenerationCost(
        prompts=prompts.samples, prompts_estimated=prompts.estimated, prompts_basis=prompts.basis,
        max_new_tokens=generate.max_new_tokens, tokens_per_prompt=per_prompt, tokens=tokens, upper_bound=per_prompt is None,
        tokens_per_second_per_gpu=rate, rate_basis=basis, gpu_hours=gpu_hours, shards=generate.shards,
        gpus_per_shard=generate.gpus_per_shard, wall_clock_hours=None if gpu_hours is None else gpu_hours / gpus,
    )


# ---- readers -------------------------------------------------------------------------------------


def check_stored_states(spec: RunSpec) -> None:
    """Refuses (InputError) a spec whose drafter reads the target's final hidden state when the run's
    verified states lack it; says nothing when extract/manifest.json is absent or not readable here."""
    try:
        storage = _open(spec, spec.output)
        manifest = Manifest.from_json(storage.get_bytes(MANIFEST_KEY)) if storage.exists(MANIFEST_KEY) else None
    except (StorageError, FormatError):
        return
    if manifest is not None:
        check_final_hidden(manifest, spec.train, f"{storage.url}/{MANIFEST_KEY}")


UNREADABLE = ((CredentialsMissing, "no credentials"), (EndpointUnreachable, "endpoint unreachable"), (AccessDenied, "access denied"),
              (BucketNotFound, "no such bucket"), (ObjectNotFound, "no such object"))
"""Why an input cannot be read, told apart (`dflashctl check` says the same with its exit code)."""


def unreadable(url: str, error: StorageError) -> str:
    """`url cannot be read (no credentials): <what>. <fix>`, the reason first (a path's missing file as a file)."""
    reason = next((label for kind, label in UNREADABLE if isinstance(error, kind)), "unreadable")
    if isinstance(error, ObjectNotFound) and not is_s3(url):
        reason = "no such file on this machine"
    return f"{url} cannot be read ({reason}): {error}"


@dataclass(frozen=True, slots=True)
class SourceSample:
    """data.source's size and its first SAMPLE_BYTES, parsed as generation reads its rows."""

    url: str
    size: int
    head: bytes

    @property
    def whole(self) -> bool:
        return len(self.head) >= self.size

    @property
    def lines(self) -> int:
        """Lines in the head (the last one, maybe cut, counted)."""
        return self.head.count(b"\n") + (not self.head.endswith(b"\n"))

    def conversations(self) -> list[tuple[float, float]]:
        """(prompt, answer) tokens of each chat row in the head, at SOURCE_BYTES_PER_TOKEN: the prompt as
        generation asks it (the conversation without its last assistant turn), the answer that turn."""
        rows = self.head.split(b"\n") if self.whole else self.head.split(b"\n")[:-1]
        measured = []
        for number, line in enumerate(rows):
            if not line.strip():
                continue
            try:
                prompt = parse_prompt(number, line)
            except (BadRow, DflashError):
                continue
            answer = json.loads(line)["messages"][len(prompt.messages):]
            measured.append((len(json.dumps(prompt.messages)) / SOURCE_BYTES_PER_TOKEN, len(json.dumps(answer)) / SOURCE_BYTES_PER_TOKEN))
        return measured


def read_source(spec: RunSpec) -> SourceSample:
    """data.source's size and head; a StorageError of the type that says why it cannot be read."""
    size, head = read_head(spec.data.source, SAMPLE_BYTES, endpoint_url=spec.storage.endpoint_url, region=spec.storage.region,
                           max_attempts=S3_ATTEMPTS)
    return SourceSample(spec.data.source, size, head)


def read_data_size(spec: RunSpec, source: SourceSample | StorageError) -> DataSize:
    """Exact from tokens/dataset.json once prepare ran; else estimated from the size of data.source."""
    try:
        storage = _open(spec, spec.output)
        if storage.exists(DATASET_KEY):
            index = DatasetIndex.from_json(storage.get_bytes(DATASET_KEY), f"{storage.url}/{DATASET_KEY}")
            return DataSize(index.samples, index.tokens, estimated=False, basis=f"{storage.url}/{DATASET_KEY}")
    except StorageError:
        pass  # unreachable output or no credentials here: estimate from the source instead
    if isinstance(source, StorageError):
        return DataSize(None, None, estimated=True, basis=f"unknown: no tokens/dataset.json, and {unreadable(spec.data.source, source)}")
    tokens = round(source.size / SOURCE_BYTES_PER_TOKEN)
    return DataSize(None, tokens, estimated=True, basis=f"estimate: {source.size:,} bytes of {source.url} at {SOURCE_BYTES_PER_TOKEN:g} bytes/token")


def generated_data_size(spec: RunSpec, cost: GenerationCost, source: SourceSample | StorageError) -> DataSize:
    """What extraction will read once the answers are regenerated: each prompt plus its new answer, cut
    at data.max_length. The answer is the measured mean once chunks are done, before that the source's
    own answer capped at generate.max_new_tokens; the bound has every answer reach max_new_tokens."""
    assert spec.generate is not None
    limit, longest = spec.data.max_length, spec.generate.max_new_tokens
    rows = [] if isinstance(source, StorageError) else source.conversations()
    if cost.prompts is None or not rows:
        why = unreadable(spec.data.source, source) if isinstance(source, StorageError) else f"no chat row in the first {SAMPLE_BYTES:,} bytes of {spec.data.source}"
        return DataSize(cost.prompts, None, estimated=True, basis=f"unknown: the regenerated answers' tokens need the prompts' lengths; {why}")
    answer = (lambda own: cost.tokens_per_prompt) if cost.tokens_per_prompt is not None else (lambda own: min(own, longest))
    estimate = cost.prompts * sum(min(prompt + answer(own), limit) for prompt, own in rows) / len(rows)
    bound = cost.prompts * sum(min(prompt + longest, limit) for prompt, _ in rows) / len(rows)
    length = (f"the measured {cost.tokens_per_prompt:,.0f} tokens per answer" if cost.tokens_per_prompt is not None
              else f"the source's own answers capped at generate.max_new_tokens = {longest:,}")
    return DataSize(
        cost.prompts, round(estimate), estimated=True, tokens_upper_bound=round(bound),
        basis=(f"estimate: {cost.prompts:,} prompts x (their tokens, from {len(rows):,} sampled rows, + {length}), each cut at "
               f"data.max_length = {limit:,}; at most {round(bound):,} if every answer reaches {longest:,} tokens"),
    )


SAMPLE_BYTES = 1 << 20
"""Of data.source read to count its lines per byte and sample its rows when generation has not planned it yet."""


def read_generation(spec: RunSpec, source: SourceSample | StorageError) -> tuple[DataSize, GenerationProgress | None]:
    """The prompts to answer (exact from generate/plan.json, else from data.source's first MiB) and
    what the done chunks measured (None before generation started)."""
    try:
        storage = _open(spec, spec.output)
        plan = read_plan(storage)
        if plan is not None:
            prompts = DataSize(plan.lines, None, estimated=False, basis=f"{storage.url}/{PLAN_KEY}")
            return prompts, read_generation_progress(storage, spec)
    except (StorageError, FormatError):
        pass  # unreachable output here: estimate from the source instead
    if isinstance(source, StorageError):
        return DataSize(None, None, estimated=True, basis=f"unknown: {unreadable(spec.data.source, source)}"), None
    if source.whole:
        return DataSize(source.lines, None, estimated=False, basis=f"{source.lines:,} lines of {source.url}"), None
    estimate = round(source.size * source.lines / len(source.head))
    return DataSize(estimate, None, estimated=True, basis=f"estimate: {source.lines:,} lines in the first {len(source.head):,} of {source.size:,} bytes of {source.url}"), None


def read_target_shape(spec: RunSpec) -> TargetShape:
    """Hidden size and captured layers from the checkpoint's config.json; else the 27B's, stated as
    assumed, and the layers held against its depth."""
    model, volume = spec.target.model, spec.cluster.model_volume
    path = local_path(model)
    if spec.backend == "kubernetes" and path is not None and volume is not None and under(path, volume.mount) and not Path(path).is_dir():
        config, why = None, f"{model} lies on claim {volume.claim}, not mounted here (`dflashctl check` reads it through a pod)"
    else:
        try:
            _, raw = read_head(f"{model.rstrip('/')}/config.json", 1 << 20, endpoint_url=spec.storage.endpoint_url,
                               region=spec.storage.region, max_attempts=S3_ATTEMPTS)
            config = json.loads(raw)
            why = "" if isinstance(config, dict) else "config.json is not a JSON object"
        except StorageError as error:
            config, why = None, unreadable(f"{model}/config.json", error)
        except ValueError as error:
            config, why = None, f"{model}/config.json is not valid JSON ({error})"
    hidden_size = text_config(config).get("hidden_size") if isinstance(config, dict) else None
    if isinstance(hidden_size, int):
        return TargetShape(hidden_size, resolve_layers(spec, config), basis=f"{model}/config.json", weights=read_target_weights(spec, config))
    name, depth = ASSUMED_TARGET["name"], ASSUMED_TARGET["num_hidden_layers"]
    layers = spec.target.layers or default_layers(depth)
    past = [layer for layer in layers if layer >= depth]
    warning = None if not past else (
        f"target.layers {layers}: {', '.join(map(str, past))} past the last layer of the assumed {name} ({depth} decoder layers, 0..{depth - 1}); "
        "`dflashctl check` reads the checkpoint, and `run` refuses them on it if it is that model")
    return TargetShape(ASSUMED_TARGET["hidden_size"], list(layers), basis=f"assumed {name}: {why or 'config.json has no hidden_size'}", warning=warning)


def read_nodes(spec: RunSpec) -> tuple[list[Node] | None, str]:
    """The cluster's nodes (None where they cannot be read), and where they come from or why not."""
    if spec.backend != "kubernetes":
        return None, "backend: local"
    try:
        cluster = cluster_of(open_backend(spec))
        cluster.retry_delays = ()  # a plan answers in seconds
        return [Node.of(obj) for obj in cluster.list_cluster_objects("Node")], "the cluster's nodes (allocatable, not free now)"
    except DflashError as error:
        return None, f"not read: {error.what}"


def _open(spec: RunSpec, url: str) -> Storage:
    return open_storage(url, endpoint_url=spec.storage.endpoint_url, region=spec.storage.region, max_attempts=S3_ATTEMPTS)
