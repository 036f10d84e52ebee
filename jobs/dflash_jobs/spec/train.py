"""The train section: the drafter, its training Job and its optimizer, with DFlash2's and DSpark's
own sub-sections (train.dflash2, train.dspark); the drafter's anchor layout gives the block size
and loss decay it leaves unset."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from dflash_jobs.spec.anchors import ANCHOR_LAYOUTS, AnchorLayout, anchor_layout
from dflash_jobs.errors import SpecError
from dflash_jobs.spec.checks import _dns_label, _positive
from dflash_jobs.spec.sections import _compiled_on


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
    states: Literal["stored", "online"] = "stored"
    """Where the drafter's context states come from. stored: extraction's chunks in storage (extract,
    verify, then train; epochs after the first cost no target forward). online: every training rank
    loads the target beside the drafter and runs it on each micro-batch (extraction's capture: packing,
    FP8 compute, the integrity checks in flight); no extract Job, nothing stored but checkpoints and
    the drafter, a target forward per step of every epoch (`dflashctl plan` prices both)."""
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
    """The token that fills a block's slots after the anchor (a row of the target's embedding). null: the
    first embedding row the tokenizer does not use, or where it uses every row (SmolLM2), its lowest
    special token that has no role, no chat template writes and no training sample holds
    (drafter/mask_token.py); training logs which and why, and the export records it."""
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
            raise SpecError("train.mask_token_id", self.mask_token_id, "a token id >= 0, or null to pick an unused one")

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
