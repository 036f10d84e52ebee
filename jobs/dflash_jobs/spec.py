"""The run spec: one YAML file a user writes, parsed once at the edge into typed sections.

Every other part receives these objects, never raw dicts. A bad spec fails here, before anything
runs, with a `SpecError` naming the field, the bad value and what is allowed.

This module is part of the contract shared by the control plane and the data plane: it imports
neither torch nor transformers.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import posixpath
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from dflash_jobs.errors import SpecError

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
BINARY_QUANTITY = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti)?$")
MODEL_CACHE_ENV = "DFLASH_MODEL_CACHE"
"""Where a pod keeps its copy of an s3:// target.model (the renderer points it at cluster.model_cache)."""
CHUNK_CACHE_ENV = "DFLASH_CACHE_DIR"
"""Where a training pod keeps its resident hidden-state chunks (the renderer points it at the cache volume)."""
# Job names get suffixes ("-extract", "-controller") and pods another "-<index>-<hash>"; the
# Job name is also a label value (<= 63 characters), so the run name must leave room for them.
MAX_RUN_NAME = 40
UNPRIVILEGED_PORTS = (1024, 65535)
DEFAULT_SPEC_FILE = "dflash.yaml"
OPTIONAL_SECTIONS = ("generate", "train.dflash2", "train.dspark", "cluster.output_volume")
"""Sections that are off while absent (dotted paths): a resolved spec without them does not mention them."""
OUTSIDE_RUN_IDENTITY = ("cluster.namespace", "cluster.metrics_port")
"""Settings of where a run is placed and watched from, not of what it makes (dotted paths): changing
one keeps the run's identity, its spec hash and <output>/run.yaml. The namespace is where the Jobs
live (`dflashctl -n` moves them; storage is shared); the metrics port is where `dflashctl run`
serves its progress, a laptop's free port or the controller pod's."""


def is_s3(url: str) -> bool:
    return url.startswith("s3://")


def _check_location(path: str, value: str, *, what: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise SpecError(path, value, f"an s3://bucket/prefix URL or a local path ({what})")
    if "://" in value and not (value.startswith("s3://") or value.startswith("file://")):
        raise SpecError(path, value, f"an s3://bucket/prefix URL, a file:// URL or a local path ({what})")
    scheme = value.split(":", 1)[0]
    if ":" in value and scheme.lower() in ("s3", "file") and "://" not in value:
        # `s3:/bucket/x` would otherwise be a relative local path named "s3:".
        raise SpecError(path, value, f"{scheme.lower()}:// with two slashes, e.g. {scheme.lower()}://{value.split(':', 1)[1].lstrip('/')}")
    if is_s3(value):
        bucket = value[len("s3://"):].split("/", 1)[0]
        if not bucket:
            raise SpecError(path, value, "s3://<bucket>[/<prefix>] with a bucket name")
        problem = s3_bucket_problem(bucket)
        if problem:
            raise SpecError(path, value, f"an S3 bucket name S3 accepts: {bucket!r} {problem}")


S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]*[a-z0-9]$")
IPV4 = re.compile(r"^\d+\.\d+\.\d+\.\d+$")


def s3_bucket_problem(bucket: str) -> str | None:
    """Why S3 refuses a bucket name (its naming rules for general purpose buckets), or None."""
    if not 3 <= len(bucket) <= 63:
        return f"has {len(bucket)} characters (3 to 63)"
    if not S3_BUCKET.match(bucket):
        return "has characters other than lower-case letters, digits, '.' and '-', or does not start and end with a letter or digit"
    if ".." in bucket:
        return "has two adjacent periods"
    if IPV4.match(bucket):
        return "is formatted as an IP address"
    if bucket.startswith(("xn--", "sthree-")) or bucket.endswith(("-s3alias", "--ol-s3")):
        return "uses a prefix or suffix S3 reserves (xn--, sthree-, -s3alias, --ol-s3)"
    return None


def local_path(location: str) -> str | None:
    """The filesystem path of a local location (a path or a file:// URL); None for s3://."""
    return None if is_s3(location) else location.removeprefix("file://")


def under(path: str, directory: str) -> bool:
    """Whether `path` is `directory` or inside it (lexically: both absolute, normalized)."""
    path, directory = posixpath.normpath(path), posixpath.normpath(directory)
    return path == directory or path.startswith(directory.rstrip("/") + "/")


@dataclass(kw_only=True, slots=True)
class TargetSpec:
    model: str
    """HF checkpoint directory (a PVC mount in pods) or an s3:// prefix holding one."""
    layers: list[int] | None = None
    """Decoder layers to capture, 0-based and ascending: layer i is the output of decoder layer i before the final norm
    (z-lab's target_layer_ids; HF output_hidden_states[i + 1], except for the last layer, whose HF entry is after the
    final norm). Default: 5 evenly spaced over 1..n-3."""
    attn_implementation: str = "sdpa"
    """Attention kernel for the target's full-attention layers: sdpa, eager or flash_attention_2."""

    def __post_init__(self) -> None:
        _check_location("target.model", self.model, what="the target checkpoint")
        if self.layers is not None:
            if not self.layers:
                raise SpecError("target.layers", self.layers, "a non-empty list of 0-based layer indices, or null for the default")
            if any(layer < 0 for layer in self.layers):
                raise SpecError("target.layers", self.layers, "layer indices >= 0")
            if len(set(self.layers)) != len(self.layers):
                raise SpecError("target.layers", self.layers, "distinct layer indices")
            if self.layers != sorted(self.layers):
                # vLLM concatenates the captured layers in ascending order: a drafter trained on
                # another order would read them shuffled when served, silently.
                raise SpecError(
                    "target.layers", self.layers,
                    f"layer indices in ascending order, {sorted(self.layers)}: vLLM feeds the drafter the layers in ascending order",
                )
        allowed = ("sdpa", "eager", "flash_attention_2")
        if self.attn_implementation not in allowed:
            raise SpecError("target.attn_implementation", self.attn_implementation, " | ".join(allowed))


@dataclass(kw_only=True, slots=True)
class DataSpec:
    source: str
    """Chat JSONL ({"messages": [...]}) or pre-tokenized JSONL ({"input_ids", "loss_mask"}): s3:// or a path."""
    max_length: int = 4096
    """Samples longer than this are truncated (and counted in tokens/dataset.json)."""
    chunk_tokens: int = 65536
    """Target size of one work unit (a token chunk and its hidden-state chunk)."""
    holdout: int = 64
    """Samples held back from training, used as evaluation prompts."""

    def __post_init__(self) -> None:
        _check_location("data.source", self.source, what="the JSONL data set")
        _positive("data.max_length", self.max_length, minimum=2)
        _positive("data.chunk_tokens", self.chunk_tokens, minimum=1)
        if self.chunk_tokens < self.max_length:
            raise SpecError("data.chunk_tokens", self.chunk_tokens, f">= data.max_length ({self.max_length}) so that every sample fits a chunk")
        _positive("data.holdout", self.holdout, minimum=0)


@dataclass(kw_only=True, slots=True)
class StorageSpec:
    endpoint_url: str | None = None
    """S3 endpoint for MinIO and other S3-compatible stores; AWS_ENDPOINT_URL overrides it."""
    region: str | None = None
    """S3 region; AWS_REGION / AWS_DEFAULT_REGION override it."""


@dataclass(kw_only=True, slots=True)
class ExtractSpec:
    shards: int = 8
    """Number of extraction pods (one GPU each). Chunks are balanced across shards by tokens."""
    token_budget: int = 32768
    """Padded tokens per forward batch."""
    dtype: Literal["bfloat16", "float8_e4m3fn"] = "bfloat16"
    """Storage dtype of hidden states; float8_e4m3fn stores a float32 scale per token and layer."""
    compute_dtype: Literal["bfloat16", "float8"] = "bfloat16"
    """The target's linear layers: bfloat16, or float8 (row-wise scaled FP8 matmuls, for targets served
    in FP8; needs FP8 tensor cores: Ada, Hopper, Blackwell). On an H200 at the 27B shape, in one run,
    the forward runs 1.28x the bf16 one eager, and 1.64x it compiled (16,801 tokens/s:
    bench/results/extract-fp8-compile-h200.json)."""
    compile: bool | None = None
    """torch.compile the target's norms and MLPs (extract/fusion.py): fused elementwise work, the
    same states up to rounding. Unset: on a GPU (an H200 at the 27B shape runs 1.17x faster in bf16,
    1.28x with FP8 compute: bench/results/extract-compile-h200.json, extract-fp8-compile-h200.json),
    off on a CPU (where compiling takes longer than a small run's whole extraction). Its graphs land
    in the kernel cache with Triton's, so a node's later pods load them."""
    backoff_limit_per_index: int = 3
    """Retries of one shard before it is marked failed."""
    pad_multiple: int = 256
    """Padded batch lengths are multiples of this, so only a few shapes need Triton warm-up."""
    sort_window: int = 4
    """Chunks sorted together by length to cut padding (bounded host memory)."""
    final_hidden: bool | None = None
    """Also store the target's final hidden state at every token (the last decoder layer's output,
    before the final norm, [T, d], in extract.dtype): DSpark's objective reads the target's
    next-token distribution from it. null: stored when the drafter needs it (train.drafter: dspark).
    It costs d x 2 bytes a token in bf16: +10,240 B, +20% at the 27B shape."""

    def __post_init__(self) -> None:
        _positive("extract.shards", self.shards, minimum=1)
        _positive("extract.token_budget", self.token_budget, minimum=1)
        _positive("extract.backoff_limit_per_index", self.backoff_limit_per_index, minimum=0)
        _positive("extract.pad_multiple", self.pad_multiple, minimum=1)
        _positive("extract.sort_window", self.sort_window, minimum=1)

    def compiled_on(self, device_type: str) -> bool:
        """Whether a pod on this device type ("cuda", "cpu") compiles the target's norms and MLPs."""
        return _compiled_on(self.compile, device_type)


def _compiled_on(compile: bool | None, device_type: str) -> bool:
    """An unset `compile` means on a GPU: torch.compile pays there, and on a CPU costs more to build than it saves."""
    return compile if compile is not None else device_type == "cuda"


VLLM_IMAGE = "vllm/vllm-openai:v0.21.0"
"""The official vLLM image; from v0.20.0 its unsuffixed tags are CUDA 13 builds."""
VLLM_OWN_ARGS = ("-i", "--input-file", "-o", "--output-file", "--model", "--served-model-name", "--tensor-parallel-size", "-tp",
                 "--seed", "--generation-config")
"""`vllm run-batch` arguments the generation job sets itself (from the spec), so generate.vllm_args may not."""


@dataclass(kw_only=True, slots=True)
class GenerateSpec:
    engine: Literal["vllm", "transformers"] = "vllm"
    """vllm: `vllm run-batch` in the vLLM image (real runs); transformers: batched generate in the dflash image (demo, tests, small runs)."""
    temperature: float = 0.7
    """Sampling temperature; 0 decodes greedily."""
    top_p: float = 0.8
    """Nucleus sampling: the smallest set of tokens holding this much probability."""
    max_new_tokens: int = 2048
    """Longest answer in tokens; each prompt's is also capped so that prompt and answer fit data.max_length."""
    thinking: bool | None = None
    """The chat template's enable_thinking switch: true or false as you will serve the target; null keeps the template's default. A template without the switch refuses true or false."""
    seed: int = 42
    """Every prompt samples with a seed derived from this and its line, so a chunk generated again gives the same answers, in whatever batch a prompt lands (both engines)."""
    truncated: Literal["drop", "keep"] = "drop"
    """An answer cut at its token limit (finish_reason length): dropped, or kept as it is. Counted either way."""
    empty: Literal["drop", "keep"] = "drop"
    """An answer with no text: dropped, or kept. Counted either way."""
    shards: int = 8
    """Generation pods; each owns a token-balanced set of chunks."""
    gpus_per_shard: int = 1
    """GPUs of one generation pod (vllm's tensor parallelism; transformers: 1)."""
    chunk_prompts: int = 1024
    """Prompts per work unit: what a killed pod loses at most, and (vllm) one model load per chunk."""
    batch_prompts: int = 64
    """Prompts decoded together by the transformers engine (vllm schedules its own batches)."""
    backoff_limit_per_index: int = 3
    """Retries of one shard before it is marked failed."""
    vllm_image: str = VLLM_IMAGE
    """The image of the vllm engine's pods: the official vLLM image (CUDA 13), or one built on it."""
    vllm_args: list[str] = field(default_factory=list)
    """More `vllm run-batch` arguments, e.g. [--gpu-memory-utilization, "0.92", --max-num-seqs, "256"].
    No reasoning parser: the answer is stored as the target wrote it (its token ids), which a parser
    would only split into reasoning and content."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise SpecError("generate.temperature", self.temperature, "a number >= 0 (0 decodes greedily)")
        if not 0 < self.top_p <= 1:
            raise SpecError("generate.top_p", self.top_p, "a number in (0, 1]")
        _positive("generate.max_new_tokens", self.max_new_tokens, minimum=1)
        _positive("generate.seed", self.seed, minimum=0)
        _positive("generate.shards", self.shards, minimum=1)
        _positive("generate.gpus_per_shard", self.gpus_per_shard, minimum=1)
        _positive("generate.chunk_prompts", self.chunk_prompts, minimum=1)
        _positive("generate.batch_prompts", self.batch_prompts, minimum=1)
        _positive("generate.backoff_limit_per_index", self.backoff_limit_per_index, minimum=0)
        if self.engine == "transformers" and self.gpus_per_shard != 1:
            raise SpecError("generate.gpus_per_shard", self.gpus_per_shard, "1 with engine transformers (engine vllm splits a model over several GPUs)")
        if not self.vllm_image or any(c.isspace() for c in self.vllm_image):
            raise SpecError("generate.vllm_image", self.vllm_image, f"an image reference such as {VLLM_IMAGE}")
        own = [arg for arg in self.vllm_args if arg.split("=", 1)[0] in VLLM_OWN_ARGS]
        if own:
            raise SpecError(
                "generate.vllm_args", self.vllm_args,
                f"arguments other than {', '.join(VLLM_OWN_ARGS)}: the job sets those from target.model and the generate section ({own[0]})",
            )
        # A reasoning parser returns the answer's text in two parts, </think> cut out: rejoined, it is
        # what the target wrote only approximately, and not at all for an answer cut before </think>.
        parsing = [arg for arg in self.vllm_args
                   if "reasoning-parser" in arg.replace("_", "-") or arg.replace("_", "-").split("=", 1)[0] == "--enable-reasoning"]
        if parsing:
            raise SpecError(
                "generate.vllm_args", self.vllm_args,
                f"no reasoning parser (remove {parsing[0]}): generation keeps the target's answer whole, as the token ids it "
                "sampled, and trains on those; the parser would only split its text into reasoning and content",
            )


DRAFTERS = ("dflash", "dflash2", "dspark")
MAX_TREE_BUDGET = 1024
"""The largest draft tree the evaluation verifies: its verify forward holds budget + 1 tokens with a
dense ancestor mask; the DDTree authors sweep budgets up to 1,024, and at that size one verify costs
what a prefill chunk of as many tokens costs, far past the budgets where their speed-ups peak."""


@dataclass(frozen=True, slots=True)
class AnchorLayout:
    """What the slots of a block drafted after an anchor predict, and which are trained
    (reference/dflash2-dspark.md 4.5); torch-free, so that the spec, the controller, the training
    data and the evaluation agree on it."""

    sample_from_anchor: bool
    """False: slot k predicts the token at anchor + k (slot 0 is the anchor itself, untrained; B - 1
    drafts). True: slot k predicts anchor + k + 1 (the anchor is a prediction slot; B drafts)."""
    contiguous_prefix: bool
    """Only a block's leading run of supervised labels is trained (DSpark); else every supervised slot."""
    block_size: int
    """Slots per block, the anchor's included (the variant's default until the spec sets train.block_size)."""
    gamma: float
    """Loss decay over the drafted slots: the j-th drafted slot (j = 0, 1, ...) weighs exp(-j / gamma)."""

    @property
    def drafts(self) -> int:
        """Drafted tokens per block: what vLLM's num_speculative_tokens must be."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def first_draft(self) -> int:
        """The slot of the first drafted token: 0 when the anchor is a prediction slot, else 1."""
        return 0 if self.sample_from_anchor else 1

    @property
    def label_offset(self) -> int:
        """Slot k's label is the token at anchor + k + label_offset."""
        return 1 if self.sample_from_anchor else 0

    def slot_decay(self) -> list[float]:
        """Per slot, its loss weight before the loss mask: 0 for the anchor slot of a fill-in block,
        exp(-j / gamma) for the j-th drafted slot (z-lab's exp(-(k-1)/gamma), DeepSpec's exp(-k/gamma))."""
        return [0.0 if k < self.first_draft else math.exp(-(k - self.first_draft) / self.gamma) for k in range(self.block_size)]


ANCHOR_LAYOUTS = {
    "dflash": AnchorLayout(sample_from_anchor=False, contiguous_prefix=False, block_size=16, gamma=7.0),
    "dflash2": AnchorLayout(sample_from_anchor=False, contiguous_prefix=False, block_size=8, gamma=7.0),
    "dspark": AnchorLayout(sample_from_anchor=True, contiguous_prefix=True, block_size=7, gamma=4.0),
}


def anchor_layout(drafter: str = "dflash", *, block_size: int | None = None, gamma: float | None = None) -> AnchorLayout:
    """A drafter's anchor layout, at its defaults unless given."""
    layout = ANCHOR_LAYOUTS[drafter]
    return dataclasses.replace(layout, block_size=block_size or layout.block_size, gamma=gamma or layout.gamma)


@dataclass(kw_only=True, slots=True)
class DFlash2Spec:
    """DFlash2's additions to the DFlash backbone (reference/dflash2-dspark.md section 3), trained
    with SpecForge's objective. Every draft layer is bidirectional inside the block (exported as
    is_causal: false, as z-lab's checkpoint), sliding or not, so any train.sliding_window_layers
    serves as trained (z-lab's layout: all 5 sliding). SpecForge's selector warm-up and ramp are left
    out: their defaults there are 0, a constant selector_alpha from the first step."""

    conv_kernel_size: int = 2
    """Taps of the in-block dynamic causal convolution around every attention and MLP sublayer
    (at most train.block_size: the convolution resets at every block)."""
    conv_group_size: int = 16
    """Channels sharing one input-dependent kernel offset (the target's hidden size must be a multiple)."""
    selector_rank: int = 256
    """Rank of the candidate selector's predecessor/successor codebooks."""
    selector_top_k: int = 16
    """Candidates per slot re-ranked by the selector: the strict top-k of the drafter's own logits."""
    selector_alpha: float = 1.0
    """Weight of the selector's cross-entropy beside the DFlash loss."""
    selector_stop_gradient: bool = False
    """The selector's loss trains only the selector (verl-SpeCo, SpecForge's switch); by default it
    also reaches the backbone through the drafter's logits and hidden states (SpecForge's default)."""

    def __post_init__(self) -> None:
        _positive("train.dflash2.conv_kernel_size", self.conv_kernel_size, minimum=1)
        _positive("train.dflash2.conv_group_size", self.conv_group_size, minimum=1)
        _positive("train.dflash2.selector_rank", self.selector_rank, minimum=1)
        _positive("train.dflash2.selector_top_k", self.selector_top_k, minimum=2)
        if self.selector_alpha < 0:
            raise SpecError("train.dflash2.selector_alpha", self.selector_alpha, "a number >= 0")


@dataclass(kw_only=True, slots=True)
class DSparkSpec:
    """DSpark's additions to the DFlash backbone (reference/dflash2-dspark.md section 4), and the
    weights of its objective (DeepSpec's: 0.1 CE + 0.9 L1 + 1.0 confidence BCE)."""

    markov_rank: int = 256
    """Rank of the Markov head's low-rank bigram bias W2 W1[previous token] (two vocabulary x rank tables)."""
    ce_only: bool = False
    """Train without the target's final hidden state: cross-entropy to the data token and the Markov
    head only, no L1 term and no confidence head (exported with enable_confidence_head false). Only
    for a store extracted without it (extract.final_hidden false); no reference measures this setting."""
    ce_weight: float | None = None
    """Weight of the cross-entropy to the data token. null: 0.1, or 1.0 CE-only."""
    l1_weight: float | None = None
    """Weight of the L1 distance between the drafter's and the target's next-token distributions.
    null: 0.9, or 0 CE-only."""
    confidence_weight: float | None = None
    """Weight of the confidence head's BCE toward 1 - L1/2 (the slot's acceptance probability given
    its prefix). null: 1.0, or 0 CE-only. 0 trains and exports no confidence head (as DeepSpec does)."""

    def __post_init__(self) -> None:
        _positive("train.dspark.markov_rank", self.markov_rank, minimum=1)
        if self.ce_only:
            for name in ("l1_weight", "confidence_weight"):
                if getattr(self, name):
                    raise SpecError(f"train.dspark.{name}", getattr(self, name),
                                    "0 or null with train.dspark.ce_only (CE-only reads no target distribution), or ce_only: false")
        defaults = (1.0, 0.0, 0.0) if self.ce_only else (0.1, 0.9, 1.0)
        for name, default in zip(("ce_weight", "l1_weight", "confidence_weight"), defaults):
            value = getattr(self, name)
            if value is None:
                setattr(self, name, default)
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise SpecError(f"train.dspark.{name}", value, "a number >= 0, or null for the default")
        if not self.ce_weight and not self.l1_weight:
            raise SpecError("train.dspark.ce_weight/l1_weight", (self.ce_weight, self.l1_weight),
                            "a positive weight on at least one of them: nothing else trains the drafted tokens")
        if not self.ce_only and not self.l1_weight and not self.confidence_weight:
            raise SpecError("train.dspark.l1_weight/confidence_weight", (self.l1_weight, self.confidence_weight),
                            "a positive weight on one of them, or train.dspark.ce_only: true (neither reads the target's final hidden state then)")

    @property
    def confidence_head(self) -> bool:
        """Whether the drafter has a confidence head: trained only with a positive weight, as in DeepSpec."""
        return self.confidence_weight > 0


VARIANT_SETTINGS = {"dflash2": DFlash2Spec, "dspark": DSparkSpec}
"""The drafters with a settings section of their own (train.<name>)."""


@dataclass(kw_only=True, slots=True)
class TrainSpec:
    drafter: Literal["dflash", "dflash2", "dspark"] = "dflash"
    """dflash (z-lab), dflash2 (in-block convolutions and a candidate selector) or dspark (the anchor
    as a prediction slot, a Markov head and a confidence head), all trained from the same stored states."""
    dflash2: DFlash2Spec | None = None
    """DFlash2's settings (train.drafter: dflash2; its defaults when left out)."""
    dspark: DSparkSpec | None = None
    """DSpark's settings (train.drafter: dspark; its defaults when left out)."""
    nodes: int = 1
    """Training nodes; more than one renders an Indexed Job plus a headless Service for rendezvous."""
    gpus_per_node: int = 8
    """GPUs per training node (torchrun --nproc_per_node)."""
    draft_layers: int = 5
    """Decoder layers of the drafter."""
    sliding_window_layers: int = 0
    """How many of the first draft layers use sliding-window attention (z-lab's Qwen3.6 drafter: 4),
    causal inside the block for dflash; dflash2 keeps every layer bidirectional."""
    sliding_window: int = 2048
    """Window of the sliding-window layers."""
    block_size: int | None = None
    """Tokens per drafted block, the anchor included; served with exactly this block. null: the
    drafter's default (dflash 16, dflash2 8, dspark 7)."""
    anchors: int = 512
    """Blocks sampled per document each epoch."""
    epochs: int = 6
    lr: float = 6.0e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None
    """Loss decay over block slots: slot k weighs exp(-(k - 1) / gamma) (dflash, dflash2: slots
    1..B-1) or exp(-k / gamma) (dspark: slots 0..B-1). null: the drafter's default (7; dspark 4)."""
    micro_batch_tokens: int = 16384
    """Target tokens per micro-batch on one rank."""
    micro_batch_blocks: int = 2048
    """Blocks per micro-batch on one rank: memory grows with blocks (anchors), not with context, so
    many short documents (each with up to `anchors` blocks) must not fill one micro-batch."""
    activation_checkpointing: Literal["auto", "none", "mlp", "layers"] = "auto"
    """Recompute in backward instead of keeping: nothing, each layer's SwiGLU, or whole layers
    (train/parallelize.py has the memory and speed of each at the 27B shape). auto: the fastest
    that fits 96 GB at the default micro-batch, none where training compiles, mlp where it does not."""
    compile: bool | None = None
    """torch.compile each draft layer (fused norms, RoPE and SwiGLU) and the loss's elementwise work
    between its two LM-head matmuls (train/loss.py). Unset: on a GPU (faster and smaller: an H200
    step at the 27B shape is 1.23 s compiled against 1.46 s eager, both with mlp checkpointing, and
    51 GiB against 77), off on a CPU."""
    mask_token_id: int | None = None
    """Mask token; default: the first unused embedding row."""
    seed: int = 42
    checkpoint_every: int = 500
    """Optimizer steps between checkpoints (also saved at the end of every epoch)."""
    cache_gb: float = 64.0
    """GiB of hidden-state chunks each node keeps on local disk across epochs, shared by its ranks.
    A rank keeps as many of its chunks as its part holds and streams the rest from storage every
    epoch (`dflashctl plan` shows what that costs); rendered as the size of the pod's cache volume."""
    cache_storage_class: str | None = None
    """StorageClass of a node-local volume for the chunk cache (a generic ephemeral volume of
    train.cache_gb, e.g. local NVMe through TopoLVM, OpenEBS LocalPV or local-path), created and
    deleted with the pod. null: an emptyDir limited to train.cache_gb, on the node's ephemeral storage."""
    stall_seconds: float = 600.0
    """A rank that completes no step for this long writes every thread's stack to its log (and again
    each time as long again passes): a stalled pod says where it is stuck. The first step compiles
    (a minute or two on a GPU), so keep it well above that."""

    def __post_init__(self) -> None:
        self._resolve_drafter()
        _positive("train.nodes", self.nodes, minimum=1)
        _positive("train.gpus_per_node", self.gpus_per_node, minimum=1)
        _positive("train.draft_layers", self.draft_layers, minimum=1)
        if not 0 <= self.sliding_window_layers <= self.draft_layers:
            raise SpecError("train.sliding_window_layers", self.sliding_window_layers, f"0..train.draft_layers ({self.draft_layers})")
        _positive("train.sliding_window", self.sliding_window, minimum=1)
        _positive("train.block_size", self.block_size, minimum=2)
        if self.dflash2 is not None and self.dflash2.conv_kernel_size > self.block_size:
            raise SpecError("train.dflash2.conv_kernel_size", self.dflash2.conv_kernel_size,
                            f"at most train.block_size ({self.block_size}): the convolution resets at every block, so a tap past it never reaches a slot")
        _positive("train.anchors", self.anchors, minimum=1)
        _positive("train.epochs", self.epochs, minimum=1)
        _positive("train.micro_batch_tokens", self.micro_batch_tokens, minimum=1)
        if self.micro_batch_blocks < self.anchors:
            raise SpecError("train.micro_batch_blocks", self.micro_batch_blocks,
                            f"at least train.anchors ({self.anchors}): one document can bring that many blocks")
        _positive("train.checkpoint_every", self.checkpoint_every, minimum=1)
        for name in ("lr", "gamma", "cache_gb", "stall_seconds"):
            if getattr(self, name) <= 0:
                raise SpecError(f"train.{name}", getattr(self, name), "a number > 0")
        if not 0 <= self.warmup_ratio < 1:
            raise SpecError("train.warmup_ratio", self.warmup_ratio, "a number in [0, 1)")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise SpecError("train.weight_decay/grad_clip", (self.weight_decay, self.grad_clip), "numbers >= 0")
        if self.cache_storage_class is not None:
            _dns_label("train.cache_storage_class", self.cache_storage_class, limit=63)
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise SpecError("train.mask_token_id", self.mask_token_id, "a token id >= 0, or null for the first unused embedding row")

    def _resolve_drafter(self) -> None:
        """The drafter's own settings section and its layout's defaults, filled in once, here."""
        for name, settings in VARIANT_SETTINGS.items():
            if name == self.drafter and getattr(self, name) is None:
                setattr(self, name, settings())
            elif name != self.drafter and getattr(self, name) is not None:
                raise SpecError(f"train.{name}", dataclasses.asdict(getattr(self, name)),
                                f"no train.{name} section while train.drafter is {self.drafter}: set train.drafter: {name}, or remove train.{name}")
        layout = ANCHOR_LAYOUTS[self.drafter]
        if self.block_size is None:
            self.block_size = layout.block_size
        if self.gamma is None:
            self.gamma = layout.gamma

    @property
    def layout(self) -> AnchorLayout:
        """The anchor layout of train.drafter, at train.block_size and train.gamma."""
        return anchor_layout(self.drafter, block_size=self.block_size, gamma=self.gamma)

    @property
    def reads_final_hidden(self) -> bool:
        """Whether the objective reads the target's final hidden state (DSpark, unless trained CE-only)."""
        return self.dspark is not None and not self.dspark.ce_only

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def compiled_on(self, device_type: str) -> bool:
        """Whether training on this device type ("cuda", "cpu") compiles the draft layers and the loss."""
        return _compiled_on(self.compile, device_type)

    def checkpointing_on(self, device_type: str) -> str:
        """activation_checkpointing with auto resolved: none where training compiles, else mlp."""
        if self.activation_checkpointing != "auto":
            return self.activation_checkpointing
        return "none" if self.compiled_on(device_type) else "mlp"


@dataclass(kw_only=True, slots=True)
class EvalSpec:
    prompts: int = 32
    """Held-out prompts decoded with and without the drafter."""
    max_new_tokens: int = 256
    """Tokens generated per prompt. Keep it several blocks long: the train/serve check compares only
    verify steps that drafted a whole block, and says "not compared" with too few of them."""
    processes: int = 1
    """Worker processes decoding prompts at once on the evaluation's device, each with its own copy of
    the target and drafter: a small target is bound by Python and kernel launches and fits many
    times on one GPU; a 27B one fits once, so keep 1 there. Tokens/s are then measured under the
    workers' contention (greedy and drafters alike, so the speed-ups stay comparable)."""
    tree_budgets: list[int] = field(default_factory=lambda: [16, 32, 64])
    """Node budgets of the draft trees (DDTree) the trained drafter is also evaluated with, beside the
    chain's own budget (as many nodes as it drafts), which is always added: each tree decodes every
    prompt for real (one verify forward of budget + 1 tokens a step) and its acceptance is computed
    exactly at every verify step of the chain. [] evaluates the chain alone."""

    def __post_init__(self) -> None:
        _positive("eval.prompts", self.prompts, minimum=1)
        _positive("eval.max_new_tokens", self.max_new_tokens, minimum=1)
        _positive("eval.processes", self.processes, minimum=1)
        if not isinstance(self.tree_budgets, list):
            raise SpecError("eval.tree_budgets", self.tree_budgets, "a list of node budgets such as [16, 32, 64], or [] for none")
        for budget in self.tree_budgets:
            if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_TREE_BUDGET:
                raise SpecError("eval.tree_budgets", self.tree_budgets,
                                f"node budgets from 1 to {MAX_TREE_BUDGET} (the tokens one verify forward holds besides the anchor)")
        if len(set(self.tree_budgets)) != len(self.tree_budgets):
            raise SpecError("eval.tree_budgets", self.tree_budgets, "distinct node budgets")


@dataclass(kw_only=True, slots=True)
class VolumeSpec:
    claim: str
    """PersistentVolumeClaim holding the target checkpoint."""
    mount: str = "/models"
    """Where it is mounted in the pods (read-only)."""

    def __post_init__(self) -> None:
        _dns_label("cluster.model_volume.claim", self.claim, limit=63)
        if not self.mount.startswith("/"):
            raise SpecError("cluster.model_volume.mount", self.mount, "an absolute path such as /models")


@dataclass(kw_only=True, slots=True)
class OutputVolumeSpec:
    claim: str = "dflash-runs"
    """PersistentVolumeClaim that holds a local `output` (ReadWriteMany: the pods of several nodes write to it)."""
    mount: str = "/runs"
    """Where it is mounted, read-write, in every pod: `output` is this path or lies under it. `dflashctl`
    itself reads the output at the same path, so run it where the same filesystem is mounted there too
    (the in-cluster controller, `dflashctl submit controller`, mounts the claim)."""

    def __post_init__(self) -> None:
        _dns_label("cluster.output_volume.claim", self.claim, limit=253)
        if not self.mount.startswith("/") or posixpath.normpath(self.mount) == "/":
            raise SpecError("cluster.output_volume.mount", self.mount, "an absolute path other than / such as /data/runs")


@dataclass(kw_only=True, slots=True)
class CpuPlacementSpec:
    node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels the CPU pods (prepare, the controller, stage-model, the target-config probe) must carry."""
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    """Taints the CPU pods tolerate, in Kubernetes' spelling (key, operator, value, effect, tolerationSeconds)."""
    affinity: dict[str, Any] | None = None
    """The CPU pods' affinity, in Kubernetes' spelling (nodeAffinity, podAffinity, podAntiAffinity)."""

    def __post_init__(self) -> None:
        _check_tolerations("cluster.cpu_placement.tolerations", self.tolerations)
        _check_affinity("cluster.cpu_placement.affinity", self.affinity)


@dataclass(kw_only=True, slots=True)
class ClusterSpec:
    namespace: str = "dflash"
    image: str = "ghcr.io/dflash-k8s/dflash:0.1.0-cuda13.0"
    """CUDA 13 image with torch, flash-linear-attention, causal-conv1d and this package (images/)."""
    controller_image: str = "ghcr.io/dflash-k8s/dflashctl:0.1.0"
    """Small CPU image running `dflashctl run` in the cluster."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels the GPU pods (generate, extract, train, eval) must carry, e.g. nvidia.com/gpu.product."""
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    """Taints the GPU pods tolerate besides nvidia.com/gpu (which they always tolerate), in Kubernetes'
    spelling: key, operator (Exists | Equal), value, effect, tolerationSeconds."""
    affinity: dict[str, Any] | None = None
    """The GPU pods' affinity, in Kubernetes' spelling (nodeAffinity, podAffinity, podAntiAffinity)."""
    cpu_placement: CpuPlacementSpec = field(default_factory=CpuPlacementSpec)
    """Where the CPU pods run: the GPU pods' node_selector, tolerations and affinity do not apply to them."""
    image_pull_secrets: list[str] = field(default_factory=list)
    """Secrets (type kubernetes.io/dockerconfigjson) every pod pulls its images with: images pushed to a private registry."""
    priority_class: str | None = None
    """PriorityClass of every pod (priorityClassName); null: the cluster's default."""
    labels: dict[str, str] = field(default_factory=dict)
    """Extra labels on every Job and pod (cost allocation, policies). The run's own labels
    (app.kubernetes.io/*, dflash.dev/*, batch.kubernetes.io/*) and Kueue's queue label (cluster.queue) are
    refused here."""
    annotations: dict[str, str] = field(default_factory=dict)
    """Extra annotations on every pod, e.g. sidecar.istio.io/inject: "false"."""
    pod_template_patch: dict[str, Any] | None = None
    """Anything else: a strategic merge patch applied last to every pod template ({metadata, spec}), as
    kubectl patch applies one. Maps merge; null deletes a key; the lists containers, initContainers,
    volumes, env, imagePullSecrets (by name), volumeMounts (by mountPath) and ports (by containerPort)
    merge item by item, an item with `$patch: delete` removes its match; other lists are replaced."""
    model_volume: VolumeSpec | None = None
    output_volume: OutputVolumeSpec | None = None
    """The claim a local `output` lives on (backend: kubernetes); null: `output` must be s3://."""
    model_cache: str | None = None
    """PersistentVolumeClaim for an s3:// target.model: fetched into it once per node (ReadWriteOnce
    serves the pods of one node, ReadWriteMany every node) instead of once per pod."""
    kernel_cache: str | None = None
    """PersistentVolumeClaim for compiled GPU kernels and their autotuning results (Triton, FLA,
    Inductor): only the first pod of a node compiles (about two minutes), the others start in
    seconds. Defaults to a kernels/ folder of cluster.model_cache when that is set; with neither,
    every pod compiles anew."""
    s3_secret: str | None = "dflash-s3"
    """Secret with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and optionally AWS_ENDPOINT_URL."""
    hf_secret: str | None = None
    """Secret with HF_TOKEN (and optionally HF_ENDPOINT, a hub mirror) for `dflashctl stage-model --from hf://...`:
    gated or private repositories."""
    queue: str | None = None
    """Kueue LocalQueue name (adds the kueue.x-k8s.io/queue-name label)."""
    service_account: str = "dflash-controller"
    """ServiceAccount of the in-cluster controller Job (k8s/ grants it its Role)."""
    cpu_per_gpu: int = 8
    memory_per_gpu: str = "96Gi"
    shm_size: str = "16Gi"
    ttl_seconds_after_finished: int | None = None
    """Left unset by default: Git-managed Jobs must not delete themselves."""
    metrics_port: int | None = None
    """Port on which `dflashctl run` (the in-cluster controller) serves its progress as Prometheus
    metrics at /metrics; rendered as the controller Job's "metrics" port. Run from a laptop where it
    is taken, `dflashctl run` picks a free one and says which. Not part of the run's identity: a
    change keeps the run. null: no metrics."""

    def __post_init__(self) -> None:
        _dns_label("cluster.namespace", self.namespace, limit=63)
        if not self.image or any(c.isspace() for c in self.image):
            raise SpecError("cluster.image", self.image, "an image reference such as registry/dflash:0.1.0-cuda13.0")
        for name, secret in (("s3_secret", self.s3_secret), ("hf_secret", self.hf_secret), ("model_cache", self.model_cache),
                             ("kernel_cache", self.kernel_cache), ("priority_class", self.priority_class)):
            if secret is not None:
                _dns_label(f"cluster.{name}", secret, limit=253)
        for i, secret in enumerate(self.image_pull_secrets):
            _dns_label(f"cluster.image_pull_secrets[{i}]", secret, limit=253)
        if self.queue is not None:
            _dns_label("cluster.queue", self.queue, limit=63)
        _dns_label("cluster.service_account", self.service_account, limit=253)
        _check_tolerations("cluster.tolerations", self.tolerations)
        _check_affinity("cluster.affinity", self.affinity)
        _check_metadata("cluster.labels", self.labels, label_values=True)
        _check_metadata("cluster.annotations", self.annotations, label_values=False)
        if self.pod_template_patch is not None and (not self.pod_template_patch or set(self.pod_template_patch) - {"metadata", "spec"}):
            raise SpecError("cluster.pod_template_patch", self.pod_template_patch, "a pod template patch with the keys metadata and/or spec")
        _positive("cluster.cpu_per_gpu", self.cpu_per_gpu, minimum=1)
        _binary_quantity("cluster.memory_per_gpu", self.memory_per_gpu)
        _binary_quantity("cluster.shm_size", self.shm_size)
        if self.metrics_port is not None and not UNPRIVILEGED_PORTS[0] <= self.metrics_port <= UNPRIVILEGED_PORTS[1]:
            raise SpecError("cluster.metrics_port", self.metrics_port, f"a port in {UNPRIVILEGED_PORTS[0]}..{UNPRIVILEGED_PORTS[1]} (the controller runs as non-root), or null")


TOLERATION_KEYS = ("key", "operator", "value", "effect", "tolerationSeconds")
TAINT_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")
AFFINITY_KINDS = ("nodeAffinity", "podAffinity", "podAntiAffinity")
RESERVED_LABEL_PREFIXES = ("app.kubernetes.io/", "dflash.dev/", "batch.kubernetes.io/", "kueue.x-k8s.io/queue-name")
LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _check_tolerations(path: str, tolerations: list[dict[str, Any]]) -> None:
    for i, toleration in enumerate(tolerations):
        where = f"{path}[{i}]"
        unknown = sorted(set(toleration) - set(TOLERATION_KEYS))
        if unknown:
            raise SpecError(f"{where}.{unknown[0]}", toleration[unknown[0]], f"one of the toleration keys {', '.join(TOLERATION_KEYS)}")
        operator = toleration.get("operator", "Equal")
        if operator not in ("Exists", "Equal"):
            raise SpecError(f"{where}.operator", operator, "Exists | Equal")
        if operator == "Exists" and toleration.get("value"):
            raise SpecError(f"{where}.value", toleration["value"], "no value with operator Exists")
        if operator == "Equal" and not toleration.get("key"):
            raise SpecError(f"{where}.key", toleration.get("key"), "a taint key (an empty key needs operator Exists)")
        if toleration.get("effect", "") not in TAINT_EFFECTS:
            raise SpecError(f"{where}.effect", toleration["effect"], " | ".join(effect or '""' for effect in TAINT_EFFECTS))
        seconds = toleration.get("tolerationSeconds")
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int) or toleration.get("effect") != "NoExecute"):
            raise SpecError(f"{where}.tolerationSeconds", seconds, "whole seconds, with effect NoExecute only")


def _check_affinity(path: str, affinity: dict[str, Any] | None) -> None:
    if affinity is None:
        return
    for kind, value in affinity.items():
        if kind not in AFFINITY_KINDS:
            raise SpecError(f"{path}.{kind}", value, f"one of {', '.join(AFFINITY_KINDS)}")
        if not isinstance(value, dict):
            raise SpecError(f"{path}.{kind}", value, "a mapping, as in a pod's spec.affinity")


def _check_metadata(path: str, mapping: dict[str, str], *, label_values: bool) -> None:
    """Label or annotation keys ([prefix/]name) and, for labels, values, as the API server checks them."""
    for key, value in mapping.items():
        prefix, _, name = key.rpartition("/")
        if not LABEL_NAME.match(name) or (prefix and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.match(prefix))):
            raise SpecError(path, key, "keys of the form [prefix/]name: a DNS subdomain prefix, a name of at most 63 letters, digits, '-', '_' or '.'")
        if key.startswith(RESERVED_LABEL_PREFIXES):
            raise SpecError(path, key, f"a key outside {', '.join(RESERVED_LABEL_PREFIXES)}, which the run sets itself (the queue: cluster.queue)")
        if label_values and value and not LABEL_NAME.match(value):
            raise SpecError(f"{path}.{key}", value, "a label value: at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit")


@dataclass(kw_only=True, slots=True)
class LocalSpec:
    workdir: str = ".dflash"
    """Where the local backend keeps pod logs, mapped volumes and state."""
    parallelism: int | None = None
    """Processes at once per Job; default: the Job's own parallelism."""
    device: str = "cpu"
    """torch device for local pods: cpu, or cuda on a workstation."""


@dataclass(kw_only=True, slots=True)
class RunSpec:
    name: str
    """DNS-1123 label; names every Job and the storage prefix."""
    target: TargetSpec
    data: DataSpec
    output: str
    """s3://bucket/prefix, or a local path / file:// URL (the local backend)."""
    backend: Literal["kubernetes", "local"] = "kubernetes"
    storage: StorageSpec = field(default_factory=StorageSpec)
    extract: ExtractSpec = field(default_factory=ExtractSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    eval: EvalSpec = field(default_factory=EvalSpec)
    generate: GenerateSpec | None = None  # answers regenerated by the target before prepare; off while None
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    local: LocalSpec = field(default_factory=LocalSpec)

    def __post_init__(self) -> None:
        _dns_label("name", self.name, limit=MAX_RUN_NAME)
        _check_location("output", self.output, what="where the run writes everything")
        self._check_output_reachable_by_pods()

    def _check_output_reachable_by_pods(self) -> None:
        """On Kubernetes every pod writes `output`: an s3:// prefix, or a path on the declared output volume."""
        path = local_path(self.output)
        if self.backend != "kubernetes" or path is None:
            return
        volume = self.cluster.output_volume
        if volume is None:
            raise SpecError(
                "output", self.output,
                "an s3://bucket/prefix URL with backend: kubernetes (the pods have no such path), or a path on a "
                "ReadWriteMany claim declared as cluster.output_volume {claim, mount}, or backend: local",
            )
        if not posixpath.isabs(path) or not under(path, volume.mount):
            raise SpecError("output", self.output, f"an absolute path under cluster.output_volume.mount ({volume.mount}), where the pods see the claim")

    @property
    def stores_final_hidden(self) -> bool:
        """Whether extraction stores the target's final hidden state beside the captured layers."""
        return self.extract.final_hidden if self.extract.final_hidden is not None else self.train.reads_final_hidden

    def to_dict(self) -> dict[str, Any]:
        # An optional section left off is left out, so a spec that never used it keeps its hash and run.yaml.
        resolved = dataclasses.asdict(self)
        for path in OPTIONAL_SECTIONS:
            *parents, key = path.split(".")
            section = functools.reduce(lambda mapping, name: mapping[name], parents, resolved)
            if section.get(key, ...) is None:
                del section[key]
        return resolved

    def fingerprint(self) -> str:
        """A stable hash of what the run makes (`run_identity`): submit refuses a different one under the same name."""
        import hashlib

        return hashlib.sha256(json.dumps(run_identity(self.to_dict()), sort_keys=True).encode()).hexdigest()[:16]


def run_identity(resolved: dict[str, Any]) -> dict[str, Any]:
    """A resolved spec (`RunSpec.to_dict()`, or a run.yaml read back) without the settings in
    OUTSIDE_RUN_IDENTITY: two specs are the same run when these are equal."""
    identity = copy.deepcopy(resolved)
    for path in OUTSIDE_RUN_IDENTITY:
        *parents, key = path.split(".")
        section = functools.reduce(lambda mapping, name: mapping.get(name) if isinstance(mapping, dict) else None, parents, identity)
        if isinstance(section, dict):
            section.pop(key, None)
    return identity


def _positive(path: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(path, value, f"an integer >= {minimum}")


def _binary_quantity(path: str, value: Any) -> None:
    # Whole binary units only: the renderer multiplies memory by the GPUs of a pod.
    if not isinstance(value, str) or not BINARY_QUANTITY.match(value):
        raise SpecError(path, value, "a whole binary quantity such as 96Gi or 512Mi")


def _dns_label(path: str, value: Any, *, limit: int) -> None:
    if not isinstance(value, str) or not DNS1123_LABEL.match(value) or len(value) > limit:
        raise SpecError(
            path, value,
            f"a DNS-1123 label: lower-case letters, digits and '-', starting and ending with a letter or digit, at most {limit} characters",
        )


# ---- parsing: YAML -> typed sections ---------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping of strings"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


YAML12_FLOAT = re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$")
"""A number as YAML 1.2 (and kubectl, Go, JSON) reads it. PyYAML reads YAML 1.1, where a float needs a
dot: `lr: 6e-4` arrives as the string "6e-4". A float field takes such a string as the number the
user wrote; anything else that is not a number (`lr: fast`, `.inf`, `1_000`) is still refused."""


def _as_integer_hint(value: Any) -> str:
    """For an integer field given `1e6` (a string to YAML 1.1) or `1.0e+6`: how to write it."""
    text = value if isinstance(value, str) and YAML12_FLOAT.match(value) else None
    number = float(text) if text is not None else value if isinstance(value, float) else None
    if number is None or not number.is_integer():
        return ""
    read = f"YAML read {text} as a string: " if text is not None else ""
    return f" ({read}write {int(number)})"


def _convert(path: str, value: Any, tp: Any) -> Any:
    """Checks `value` against the annotation `tp`, building nested dataclasses."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        section = next((arg for arg in args if dataclasses.is_dataclass(arg)), None)
        if section is not None and isinstance(value, dict):
            return _build(path, value, section)  # an optional section: its own field names the error
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(path, value, arg)
            except SpecError:
                continue
        raise SpecError(path, value, _type_name(tp))
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise SpecError(path, value, _type_name(tp))
        return value
    if origin is list:
        if not isinstance(value, list):
            raise SpecError(path, value, _type_name(tp))
        (item,) = typing.get_args(tp)
        return [_convert(f"{path}[{i}]", v, item) for i, v in enumerate(value)]
    if origin is dict:
        if typing.get_args(tp)[1] is Any:  # Kubernetes objects in their own spelling (affinity, a patch)
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise SpecError(path, value, "a mapping with string keys")
            return copy.deepcopy(value)
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise SpecError(path, value, "a mapping of strings to strings")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return _build(path, value, tp)
    if tp is float:
        if isinstance(value, str) and YAML12_FLOAT.match(value):
            return float(value)  # 6e-4: a number in YAML 1.2, a string to PyYAML's YAML 1.1 (see YAML12_FLOAT)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(path, value, "a number")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(path, value, "an integer" + _as_integer_hint(value))
        return value
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(path, value, "a string")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(path, value, "true or false")
        return value
    raise TypeError(f"unsupported spec annotation {tp!r} at {path}")


def _build(path: str, raw: Any, cls: type) -> Any:
    prefix = f"{path}." if path else ""
    if not isinstance(raw, dict):
        raise SpecError(path or "spec", raw, "a mapping")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise SpecError(f"{prefix}{unknown[0]}", raw[unknown[0]], f"one of the known keys: {', '.join(fields)}")
    missing = [
        name for name, f in fields.items()
        if name not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise SpecError(f"{prefix}{missing[0]}", None, f"a value: {missing[0]} is required")
    kwargs = {name: _convert(f"{prefix}{name}", value, hints[name]) for name, value in raw.items()}
    return cls(**kwargs)


def parse_spec(raw: Any) -> RunSpec:
    """Builds a validated RunSpec from a parsed YAML document."""
    return _build("", raw, RunSpec)


def load_spec(path: str | Path) -> RunSpec:
    """Reads and validates a spec file. Raises SpecError naming the file when it is unreadable."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError("-f", str(path), "an existing spec file; `dflashctl init` writes a starter dflash.yaml") from None
    except OSError as exc:
        raise SpecError("-f", str(path), f"a readable spec file ({exc.strerror})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError(str(path), f"invalid YAML{where}", "a YAML mapping (see `dflashctl init`)") from None
    return parse_spec(raw)


def dump_spec(spec: RunSpec) -> str:
    """The resolved spec as YAML, deterministic (written to <output>/run.yaml and into the ConfigMap)."""
    return yaml.safe_dump(spec.to_dict(), sort_keys=False, default_flow_style=False)


# ---- the target's depth decides which layers are legal ----------------------------------------


def default_layers(num_hidden_layers: int, count: int = 5) -> list[int]:
    """z-lab's rule: `count` layers evenly spaced from 1 to n - 3 (64 layers: [1, 16, 31, 46, 61])."""
    if count == 1:
        return [num_hidden_layers // 2]
    start, end = 1, max(1, num_hidden_layers - 3)
    return sorted({round(start + i * (end - start) / (count - 1)) for i in range(count)})


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a checkpoint config.json (multimodal ones nest it)."""
    return config.get("text_config") or config


def rope_kind(config: dict[str, Any]) -> str:
    """The target's RoPE scaling, "default" for none (Transformers 5's rope_parameters or the older rope_scaling)."""
    text = text_config(config)
    rope = text.get("rope_parameters") or {}
    scaling = text.get("rope_scaling") or {}
    return rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"


def resolve_layers(spec: RunSpec, checkpoint_config: dict[str, Any]) -> list[int]:
    """The captured layers, checked against the checkpoint's depth."""
    depth = text_config(checkpoint_config).get("num_hidden_layers")
    if not isinstance(depth, int):
        raise SpecError("target.model", spec.target.model, "a checkpoint whose config.json has num_hidden_layers")
    layers = spec.target.layers or default_layers(depth)
    too_deep = [layer for layer in layers if layer >= depth]
    if too_deep:
        raise SpecError("target.layers", spec.target.layers, f"layer indices 0..{depth - 1}: the checkpoint has {depth} decoder layers")
    return list(layers)
