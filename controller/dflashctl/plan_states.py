"""The two ways to the drafter's states (train.states) priced side by side, and the one the plan picks.

- stored: extraction once (GPU-hours at the extractor's rate), the states in storage (TB, for as long
  as the run lasts), then every epoch reads them.
- online: no extraction and nothing stored, but every epoch runs the target again on every token (at
  the bare forward's rate, which the extractor runs within 1% of: bench/results/extract-final-h100*.json),
  on the training GPUs, and every rank holds the target beside the drafter and its optimizer.

Memory per training rank, online: the target's weights (bf16: as stored; FP8 compute,
extract.compute_dtype: float8, halves its decoder layers' matmul weights, the embedding stays
bf16), the drafter's measured training peak at the 27B shape for the spec's activation
checkpointing (bench/results/train-compile-h200.json; scaled by (hidden / 5,120)^2 at other widths,
an estimate), and the target's capture buffer and activations for one micro-batch. Held against the
card's memory (Prices.gpu_memory_gib: --gpu-memory-gib, the RTX PRO 6000's 96 by default).

The pick: stored where online does not fit the card in the spec's compute dtype; else the cheaper
at the stated prices (--gpu-hour-usd, --tb-month-usd): online pays the target's forward again every
epoch, stored one extraction and the TB for the run's wall-clock months (one at least).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_jobs.spec import RunSpec

GIB = 1 << 30
DRAFTER_PEAK_GIB = {("none", True): 66.7, ("mlp", True): 50.8, ("layers", True): 43.3, ("mlp", False): 77.0}
"""Peak GPU memory of one training step at the 27B drafter shape and the default micro-batch (4 x 4,096
tokens, 2,048 blocks), by (activation checkpointing, compiled): bench/results/train-compile-h200.json
and shared/device/README.md (eager, mlp). Eager without mlp checkpointing was not measured: the eager
mlp figure stands for it."""
DRAFTER_HIDDEN = 5120
TARGET_ACTIVATIONS_GIB = 4.0
"""The target's transient activations in a no-grad forward of extract.token_budget tokens: the
extraction benchmark's peak less its weights and capture buffer at the 27B shape (about 2-4 GiB)."""
HOURS_PER_MONTH = 730.0


@dataclass(frozen=True, slots=True)
class Prices:
    """What the pick weighs: a GPU's memory and hour, a TB-month of storage (`dflashctl plan` options)."""

    gpu_memory_gib: float = 96.0
    """The RTX PRO 6000 Blackwell's."""
    gpu_hour_usd: float = 2.0
    tb_month_usd: float = 23.0
    """S3 Standard's first tier."""


DEFAULT_PRICES = Prices()


@dataclass(frozen=True, slots=True)
class TargetWeights:
    """What the target's weights take on a GPU, from its checkpoint's size and shape."""

    checkpoint_bytes: int
    embedding_bytes: int
    """The input embedding, kept in bf16 under FP8 compute."""
    head_bytes: int
    """An untied LM head in the checkpoint, which capture never loads."""
    basis: str

    def gib(self, compute_dtype: str) -> float:
        decoder = self.checkpoint_bytes - self.embedding_bytes - self.head_bytes
        return ((decoder / 2 if compute_dtype == "float8" else decoder) + self.embedding_bytes) / GIB


@dataclass(frozen=True, slots=True)
class StatesCost:
    states: str
    """train.states of the spec."""
    stored_tb: float | None
    extraction_gpu_hours: float | None
    train_gpu_hours: float | None
    """The drafter's steps alone, every epoch (either way)."""
    online_forward_gpu_hours: float | None
    """The target's forward in every epoch's steps: what online adds to training's GPU-hours."""
    target_gib: dict[str, float]
    """The target's weights per rank, by compute dtype (bfloat16, float8)."""
    drafter_gib: float
    rank_gib: dict[str, float]
    card_gib: float
    fits: dict[str, bool]
    stored_usd: float | None
    online_usd: float | None
    pick: str
    why: str
    basis: str


def states_cost(
    spec: RunSpec, *, tokens: int | None, hidden_size: int, captured: int, stored_tb: float | None, extract_tokens_per_second: float,
    train_tokens_per_second: float, weights: TargetWeights, prices: Prices = Prices(),
) -> StatesCost:
    train = spec.train
    card_gib = prices.gpu_memory_gib
    checkpointing = train.checkpointing_on("cuda")
    compiled = train.compiled_on("cuda")
    capture = max(train.micro_batch_tokens, spec.data.max_length) * captured * hidden_size * 2 / GIB
    target = {dtype: weights.gib(dtype) for dtype in ("bfloat16", "float8")}

    def rank_gib(dtype: str, checkpointing: str) -> float:
        drafter = DRAFTER_PEAK_GIB.get((checkpointing, compiled), DRAFTER_PEAK_GIB["mlp", False]) * (hidden_size / DRAFTER_HIDDEN) ** 2
        return target[dtype] + drafter + capture + TARGET_ACTIVATIONS_GIB

    drafter = rank_gib("bfloat16", checkpointing) - target["bfloat16"] - capture - TARGET_ACTIVATIONS_GIB
    rank = {dtype: rank_gib(dtype, checkpointing) for dtype in target}
    fits = {dtype: rank[dtype] <= card_gib for dtype in rank}
    # What would fit instead, cheapest change first: FP8 compute, then recomputing activations.
    options = [(dtype, mode) for mode in dict.fromkeys([checkpointing, "mlp", "layers"]) for dtype in dict.fromkeys([spec.extract.compute_dtype, "float8"])]
    fitting = next(((dtype, mode) for dtype, mode in options if rank_gib(dtype, mode) <= card_gib), None)
    extraction = None if tokens is None else tokens / extract_tokens_per_second / 3600
    training = None if tokens is None else tokens * train.epochs / train_tokens_per_second / 3600
    forward = None if extraction is None else extraction * train.epochs
    stored_usd = online_usd = None
    if extraction is not None and stored_tb is not None:
        months = max(1.0, (extraction / spec.extract.shards + training / train.world_size) / HOURS_PER_MONTH)
        stored_usd = (extraction + training) * prices.gpu_hour_usd + stored_tb * months * prices.tb_month_usd
        online_usd = (forward + training) * prices.gpu_hour_usd
    instead = None if fitting is None else (fitting, rank_gib(*fitting))
    pick, why = _pick(spec, fits, rank, card_gib, stored_usd, online_usd, stored_tb, instead)
    return StatesCost(
        states=train.states, stored_tb=stored_tb, extraction_gpu_hours=extraction, train_gpu_hours=training,
        online_forward_gpu_hours=forward, target_gib=target, drafter_gib=drafter, rank_gib=rank, card_gib=card_gib, fits=fits,
        stored_usd=stored_usd, online_usd=online_usd, pick=pick, why=why,
        basis=f"target weights: {weights.basis}; drafter: {checkpointing} checkpointing{', compiled' if compiled else ''}, "
              f"measured at the 27B shape{'' if hidden_size == DRAFTER_HIDDEN else ' and scaled to hidden ' + str(hidden_size)}; "
              f"prices ${prices.gpu_hour_usd:g} a GPU-hour, ${prices.tb_month_usd:g} a TB-month",
    )


def _pick(spec: RunSpec, fits: dict[str, bool], rank: dict[str, float], card: float, stored_usd: float | None,
          online_usd: float | None, stored_tb: float | None, instead: tuple[tuple[str, str], float] | None) -> tuple[str, str]:
    dtype = spec.extract.compute_dtype
    if not fits[dtype]:
        if instead is None:
            change = "; no compute dtype or activation checkpointing fits it"
        else:
            (other, mode), gib = instead
            settings = [f"extract.compute_dtype: {other}"] * (other != dtype) + [f"train.activation_checkpointing: {mode}"] * (mode != spec.train.checkpointing_on("cuda"))
            change = f"; with {' and '.join(settings)} it takes {gib:,.1f} GiB and fits"
        return "stored", (f"online, the target ({dtype}) beside the drafter takes {rank[dtype]:,.1f} GiB a rank, over the "
                          f"card's {card:g} GiB{change}")
    if stored_usd is None or online_usd is None:
        return spec.train.states, "the data's size is not known yet: `dflashctl prepare` makes the plan exact"
    if online_usd <= stored_usd:
        return "online", (f"${online_usd:,.0f} against ${stored_usd:,.0f}: the target's forward every epoch costs less than "
                          f"{stored_tb:,.1f} TB stored and one extraction")
    return "stored", (f"${stored_usd:,.0f} against ${online_usd:,.0f}: {spec.train.epochs} epochs of target forwards cost more than "
                      f"{stored_tb:,.1f} TB stored and one extraction")


ASSUMED_WEIGHTS = TargetWeights(
    checkpoint_bytes=54_000_000_000, embedding_bytes=248_320 * 5120 * 2, head_bytes=248_320 * 5120 * 2,
    basis="assumed Qwen3.6-27B: 27B parameters in bf16, an untied head of 248,320 x 5,120",
)


def target_weights(config: dict | None, checkpoint_bytes: int | None, where: str) -> TargetWeights:
    """The weights of a checkpoint of `checkpoint_bytes` in *.safetensors (its embedding and head from
    its config.json); the 27B's, stated as assumed, where either is unknown."""
    from dflash_jobs.spec import text_config

    text = text_config(config) if isinstance(config, dict) else {}
    if not checkpoint_bytes or not isinstance(text.get("hidden_size"), int) or not isinstance(text.get("vocab_size"), int):
        return ASSUMED_WEIGHTS
    embedding = text["vocab_size"] * text["hidden_size"] * 2
    tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    return TargetWeights(checkpoint_bytes, embedding, 0 if tied else embedding, basis=f"{where}: {checkpoint_bytes / 1e9:,.1f} GB of *.safetensors")


def read_target_weights(spec: RunSpec, config: dict | None) -> TargetWeights:
    """target_weights of target.model, its *.safetensors listed where it can be read."""
    from dflash_jobs.errors import StorageError
    from dflash_jobs.storage import open_storage

    try:
        storage = open_storage(spec.target.model.removeprefix("file://"), endpoint_url=spec.storage.endpoint_url,
                               region=spec.storage.region, max_attempts=2)
        size = sum(storage.stat(key).size for key in storage.list("") if key.endswith(".safetensors"))
    except StorageError:
        size = None
    return target_weights(config, size, spec.target.model)


def online_fit(spec: RunSpec, config: dict, checkpoint_bytes: int | None) -> StatesCost:
    """The memory side of online states for a checkpoint (`dflashctl check`): what a rank holds against the card."""
    from dflash_jobs.spec import resolve_layers, text_config

    return states_cost(spec, tokens=None, hidden_size=text_config(config)["hidden_size"], captured=len(resolve_layers(spec, config)),
                       stored_tb=None, extract_tokens_per_second=1.0, train_tokens_per_second=1.0,
                       weights=target_weights(config, checkpoint_bytes, spec.target.model))
