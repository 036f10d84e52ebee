"""Plain greedy decoding and speculative decoding with a block drafter: pure functions of (target, drafter, prompt).

Speculative decoding (reference/dflash.md section 2.1): the last committed token is the anchor of
a block; the drafter proposes the tokens after it; the target runs once on [anchor, drafts...]
and its greedy prediction at each slot checks the next draft. The longest matching prefix is
accepted, plus one bonus token: the target's own prediction after it. Every committed token is
therefore the target's greedy choice, and the output must equal plain greedy decoding.

Rolling the target back on a hybrid model. The target's cache holds attention K/V, which can be
cropped to the last accepted token, and, for each Gated DeltaNet layer, a short conv window and a
recurrent state that summarise every token seen so far: those cannot be cropped. So each block is
verified from a checkpoint. Before the verify forward the GDN states are copied (a few small
tensors per layer, independent of the context length). When a draft is rejected, the cache is
rolled back (K/V cropped, GDN states restored): the tokens it accepted are committed but no longer
in the cache. They do not get a forward of their own: they lead the next block's verify forward
([uncached committed tokens, anchor, drafts]), which computes for them exactly what a forward of
their own would (causal attention, the GDN state rebuilt from the real tokens, as plain decoding
builds it). Their captured layers were taken from the verify that accepted them. So a block costs
one target forward; only when the uncached tokens reach block_size are they run alone, which
keeps a verify forward under two blocks. At batch size 1 a forward costs about the same for 16
tokens as for 32 (launch or weight-read bound), which is why deferring beats re-running at once
(which cost a second forward per rejected block); serving engines avoid both with verify kernels
that keep the recurrent state after every token. A cache that can drop the rejected drafts alone
(a static cache of full attention: drafter/static_target.py) keeps the accepted tokens instead
(`rewind`), and every verify forward is the anchor and its drafts.

The export carries this module beside dflash.py (whose spec_generate runs this loop), so it imports
torch and transformers only.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol, Sequence

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionCacheLayerMixin

from .model import rank_top_k


class BlockDrafter(Protocol):
    """Anything that proposes the tokens after the anchor: the DFlash drafter, prompt lookup, a test stand-in."""

    block_size: int
    """Tokens per drafted block, the anchor included."""
    drafts: int
    """The most tokens one call proposes: block_size - 1, or block_size where the anchor is a prediction slot (DSpark)."""
    target_layers: list[int]
    """Target layers the drafter reads as context (0-based: the output of decoder layer i, before the final norm); [] for none."""

    def propose(self, tokens: torch.Tensor, context: torch.Tensor | None) -> torch.Tensor:
        """Draft ids to follow `tokens`.

        tokens: the committed ids [n] on the target's device; the last one is the anchor, which the
        target has not run yet. A drafter whose class sets `reads_host = True` (one that drafts on the
        CPU: prompt lookup, a table) gets them as a host list instead, so reading them costs no sync.
        context: the captured target layers at positions 0..n-2, [n - 1, L * d] (None without target_layers).
        Returns a 1-D tensor of at most `drafts` ids (possibly empty), on any device. Reading a
        device tensor back (`int()`, `.tolist()`) waits for the device: the verify loop reads once a
        step, a drafter should not read at all.
        """
        ...


class ModelDrafter:
    """A trained drafter module (any variant: its `draft_block` drafts one block greedily) as a BlockDrafter."""

    def __init__(self, drafter, *, drafts: int) -> None:
        self.drafter = drafter
        self.block_size = drafter.config.block_size
        self.drafts = drafts
        self.target_layers = list(drafter.config.target_layer_ids)

    def propose(self, tokens: torch.Tensor, context: torch.Tensor | None) -> torch.Tensor:
        anchor_position = len(tokens) - 1
        positions = torch.arange(anchor_position, device=context.device)
        return self.drafter.draft_block(context[None], positions, tokens[-1], anchor_position)  # the anchor stays on the device


@dataclass
class Decoded:
    """One prompt's decoding: what was generated and how."""

    tokens: list[int]
    """New tokens, stopped after EOS or at max_new_tokens."""
    seconds: float
    """Wall time, prefill included."""
    accepted: list[int] = field(default_factory=list)
    """Per verify step, the tokens it committed minus one: the drafts the target accepted, up to a stop
    token among them (which then takes the bonus token's place; drafts are never longer than
    max_new_tokens leaves room for). So 1 + accepted is exactly what the step added to the output
    (empty for plain greedy)."""
    drafted: list[int] = field(default_factory=list)
    """Per verify step, the tokens proposed along the block (a draft tree: along its longest root path)."""
    margins: list[float] = field(default_factory=list)
    """Plain greedy only: the target's top-1 minus top-2 logit at each token, to tell a numerical near-tie from a bug."""
    top_logits: list[float] = field(default_factory=list)
    """Plain greedy only: the target's top-1 logit at each token, the scale of its rounding."""
    runners_up: list[int] = field(default_factory=list)
    """Plain greedy only: the target's second choice at each token (its first is the token)."""
    forced_logits: list[float] = field(default_factory=list)
    """Greedy along a forced output only: the target's logit of the forced token at each position."""


@dataclass
class CacheCheckpoint:
    length: int
    """Tokens in the cache."""
    linear_states: list[dict[str, dict[int, torch.Tensor]] | None]
    """Per layer: copies of the conv and recurrent states of GDN layers (None for attention layers)."""


def _linear_layer_length(layer: LinearAttentionCacheLayerMixin) -> torch.Tensor | None:
    """The token count a linear-attention cache layer keeps (transformers >= 5.25), which sets the positions
    of the next forward when a GDN layer comes first; None where the version does not keep one."""
    length = getattr(layer, "cumulative_length_linear", None)
    return None if length is None else length.clone()


def text_model(model: nn.Module) -> nn.Module:
    """The text model of an HF causal LM, which holds the decoder layers: `model.model`, or the language
    model a multimodal wrapper nests there (`model.model.language_model`)."""
    inner = model.model
    return getattr(inner, "language_model", inner)


class DecodeTarget:
    """The target model behind the verify loop: a cache that rolls back, and the captured layers as context.

    `forward(ids)` appends `ids` to the cache and returns their logits; `features()` then returns the
    captured layers of those positions, concatenated in `layers` order: [n, L * d].
    """

    def __init__(self, model: nn.Module, layers: Sequence[int] = (), *, architecture=None) -> None:
        self.model = model
        self.layers = list(layers)
        self.text = text_model(model)
        """The text model, which holds the decoder layers."""
        self.architecture = architecture
        """The target's architecture (architectures/: a TargetArchitecture), which tree decoding reads; the
        block loop needs none, and this module, exported beside dflash.py, imports no architecture: the
        caller resolves it (drafter/tree_verify.py's tree_target)."""
        self.cache: DynamicCache | None = None
        self.length = 0
        """Tokens in the cache, counted on the host: a hybrid cache's own count is a device tensor (a sync to read)."""
        # transformers 5.25 renamed the forward's past_key_values to cache (the old name goes in 5.40);
        # the releases before it, which pyproject.toml still allows, know only the old one.
        self._cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = [self.text.layers[i].register_forward_hook(partial(self._capture, i)) for i in self.layers]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _capture(self, layer: int, module: nn.Module, args, output) -> None:
        self._captured[layer] = output[0] if isinstance(output, tuple) else output

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.length = 0

    def forward(self, ids: torch.Tensor, *, last_only: bool = False) -> torch.Tensor:
        """Runs ids [n] after the cached tokens: logits [n, V], or [1, V] for the last position only."""
        output = self.model(input_ids=ids[None], **{self._cache_argument: self.cache}, use_cache=True, logits_to_keep=1 if last_only else 0)
        self.length += len(ids)
        return output.logits[0]

    def features(self) -> torch.Tensor:
        """The captured layers of the last forward's positions: [n, L * d]."""
        return torch.cat([self._captured[layer][0] for layer in self.layers], dim=-1)  # L x [n, d] -> [n, L * d]

    def checkpoint(self) -> CacheCheckpoint:
        states = []
        for layer in self.cache.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                states.append({
                    "conv": {i: t.clone() for i, t in layer.conv_states.items() if t is not None},
                    "recurrent": {i: t.clone() for i, t in layer.recurrent_states.items() if t is not None},
                    "length": _linear_layer_length(layer),
                })
            elif isinstance(layer, DynamicLayer) and type(layer).crop is DynamicLayer.crop:
                states.append(None)
            else:
                raise TypeError(f"cannot roll back a {type(layer).__name__} cache layer: only full attention and linear attention are supported")
        return CacheCheckpoint(self.length, states)

    def rollback(self, checkpoint: CacheCheckpoint) -> None:
        """Puts the cache back to `checkpoint`: K/V cropped, GDN states restored in place (their addresses stay static)."""
        for layer, saved in zip(self.cache.layers, checkpoint.linear_states):
            if saved is not None:
                for i, state in saved["conv"].items():
                    layer.conv_states[i].copy_(state)
                for i, state in saved["recurrent"].items():
                    layer.recurrent_states[i].copy_(state)
                if saved["length"] is not None:
                    layer.cumulative_length_linear.copy_(saved["length"])
            if isinstance(layer, DynamicLayer):
                DynamicLayer.crop(layer, checkpoint.length - layer.get_seq_length())
        # Every attention layer's length, from its K/V's shape (a GDN layer's count is a device tensor,
        # restored above from the checkpoint: reading it back would cost a sync a step).
        lengths = {DynamicLayer.get_seq_length(layer) for layer in self.cache.layers if isinstance(layer, DynamicLayer)}
        self.length = checkpoint.length
        if lengths - {checkpoint.length}:
            raise RuntimeError(
                f"rolling the cache back left {max(lengths - {checkpoint.length})} tokens, not {checkpoint.length}: this "
                "transformers version keeps cache state that DecodeTarget.checkpoint does not save; install the version "
                "images/Dockerfile pins (TRANSFORMERS_VERSION), which the tests run"
            )

    def tree_forward(self, rows: int, depth_bound: int, inputs: dict, forward):
        """A draft tree's verify forward (drafter/tree_verify.py) of `rows` rows, no node deeper than
        depth_bound: forward(cached, columns, cache_layers, depth_bound, **inputs) over the cache as it
        stands, which it reads and never writes: the tokens cached, the cache's columns the rows may see
        (None: all of them), each layer's cache, the depth the layout follows ancestors to."""
        return forward(self.length, None, self.cache.layers, depth_bound, **inputs)

    def rewind(self, checkpoint: CacheCheckpoint, kept: int) -> int:
        """Drops what a forward since `checkpoint` left past its first `kept` tokens; returns how many of
        those the cache keeps. None here: a GDN state cannot be cut inside a forward, so the cache goes
        back to the checkpoint and the kept tokens lead the next forward (the module docstring)."""
        self.rollback(checkpoint)
        return 0

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def finished(tokens: list[int], max_new_tokens: int, stop_ids: frozenset[int]) -> bool:
    return len(tokens) >= max_new_tokens or not stop_ids.isdisjoint(tokens)


def through_stop(tokens: list[int], stop_ids: frozenset[int]) -> int:
    """How many of `tokens` an output keeps: up to and including the first stop token (EOS)."""
    return next((i + 1 for i, token in enumerate(tokens) if token in stop_ids), len(tokens))


@torch.inference_mode()
def greedy_decode(
    target: DecodeTarget, prompt: torch.Tensor, *, max_new_tokens: int, stop_ids: frozenset[int], forced: Sequence[int] | None = None,
) -> Decoded:
    """Plain greedy decoding with the target's KV cache: one forward per token, the reference output.

    forced: feed these tokens instead of the target's own choices (one step each). `tokens` and the
    top-two record then hold what greedy would choose after each prefix of `forced`, and
    `forced_logits` the logit of each forced token there: the check of another output (a
    speculative one) at every position, not only up to its first difference.
    """
    device = target.device
    synchronize(device)
    start = time.perf_counter()
    target.reset()
    logits = target.forward(prompt.to(device), last_only=True)[-1]
    tokens, values, indices, forced_values = [], [], [], []
    while True:
        # rank_top_k, not topk: at an exact tie topk may rank the higher token id first, the verify
        # loop's argmax takes the lower; every loop must commit the same token there.
        top = rank_top_k(logits, 2)
        tokens.append(int(top[0]))
        values.append(logits[top].float())  # read once at the end: one host sync per token (the token), not three
        indices.append(top)
        if forced is not None:
            forced_values.append(logits[forced[len(tokens) - 1]].float())
        done = len(tokens) >= len(forced) if forced is not None else finished(tokens, max_new_tokens, stop_ids)
        if done:
            break
        fed = top[:1] if forced is None else torch.tensor(forced[len(tokens) - 1 : len(tokens)], device=device)
        logits = target.forward(fed, last_only=True)[-1]
    synchronize(device)
    seconds = time.perf_counter() - start
    tops = torch.stack(values).tolist()  # [n, 2]: top-1 and top-2 logits
    return Decoded(
        tokens=tokens, seconds=seconds,
        margins=[first - second for first, second in tops], top_logits=[first for first, _ in tops],
        runners_up=torch.stack(indices)[:, 1].tolist(),
        forced_logits=torch.stack(forced_values).tolist() if forced_values else [],
    )


class CommittedContext:
    """The captured target layers of the committed positions, grown in place (no re-concatenation per block)."""

    def __init__(self, capacity: int, width: int, like: torch.Tensor) -> None:
        self.buffer = like.new_empty(capacity, width)
        self.length = 0

    def append(self, features: torch.Tensor) -> None:
        self.buffer[self.length : self.length + len(features)] = features
        self.length += len(features)

    def view(self) -> torch.Tensor:
        return self.buffer[: self.length]


@dataclass
class Decoding:
    """A decoding under way after the prompt: the committed tokens, what the drafter reads, each step's counts."""

    sequence: torch.Tensor
    """The prompt and the committed tokens, then room for max_new_tokens and a block more."""
    history: list[int]
    """The same committed tokens (the prompt's included) on the host: what a host drafter reads, without a sync."""
    context: CommittedContext | None
    """The captured target layers of the committed positions before the anchor (None without target_layers)."""
    tokens: list[int]
    """The new tokens committed so far."""
    started: float
    """perf_counter() when the decoding started, the prefill included."""
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Committed tokens (the prompt's included); the last is the anchor of the next block."""
        return len(self.history)

    def committed(self, drafter) -> torch.Tensor | list[int]:
        """What `drafter.propose` reads as its tokens: the host list for a host drafter, else the device tensor."""
        return self.history if getattr(drafter, "reads_host", False) else self.sequence[: self.length]

    def commit(self, new: torch.Tensor, new_ids: list[int], accepted: int, drafted: int) -> None:
        """Appends a verify step's new tokens (on the device and their ids on the host: [accepted + 1]), and its counts (Decoded.accepted, drafted)."""
        self.sequence[self.length : self.length + len(new_ids)] = new
        self.history.extend(new_ids)
        self.tokens.extend(new_ids)
        self.accepted.append(accepted)
        self.drafted.append(drafted)

    def decoded(self) -> Decoded:
        synchronize(self.sequence.device)
        return Decoded(tokens=self.tokens, seconds=time.perf_counter() - self.started, accepted=self.accepted, drafted=self.drafted)


def on_device(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """ids as int64 on `device`; a host drafter's are copied from pinned memory without waiting (a
    pageable copy to a GPU blocks the host until the copy is done: a sync a step)."""
    ids = ids.to(dtype=torch.long)
    if ids.device == device:
        return ids
    if device.type == "cuda":
        ids = ids.pin_memory()
    return ids.to(device, non_blocking=True)


def prefill(target: DecodeTarget, drafter: BlockDrafter, prompt: torch.Tensor, *, max_new_tokens: int) -> Decoding:
    """Starts the clock and runs the prompt through the target (its captured layers: the drafter's
    first context); the target's first token after it is the first anchor."""
    if list(target.layers) != list(drafter.target_layers):
        raise ValueError(f"the target captures layers {target.layers} but the drafter reads {drafter.target_layers}")
    history = prompt.tolist()
    prompt = prompt.to(target.device)
    synchronize(target.device)
    started = time.perf_counter()
    target.reset()
    logits = target.forward(prompt, last_only=True)
    sequence = torch.empty(len(prompt) + max_new_tokens + drafter.block_size, dtype=torch.long, device=prompt.device)
    sequence[: len(prompt)] = prompt
    sequence[len(prompt)] = logits[-1].argmax()
    first = int(sequence[len(prompt)])
    context: CommittedContext | None = None
    if target.layers:
        features = target.features()
        context = CommittedContext(len(sequence), features.shape[-1], features)
        context.append(features)
    return Decoding(sequence, [*history, first], context, [first], started)


def accepted_prefix(drafts: list[int], predicted: list[int]) -> int:
    """How many drafts lead `drafts` that equal the target's token before them (predicted[j]: its token after the block's j-th)."""
    return next((j for j, (draft, token) in enumerate(zip(drafts, predicted)) if draft != token), len(drafts))


@torch.inference_mode()
def speculative_decode(
    target: DecodeTarget, drafter: BlockDrafter, prompt: torch.Tensor, *, max_new_tokens: int, stop_ids: frozenset[int]
) -> Decoded:
    """Speculative decoding: draft a block, verify it with one target forward, keep the matching prefix plus the bonus token.

    The drafter sees the captured target layers of every committed position before the anchor,
    exactly as in training: the prompt's from the prefill, then those of each block's accepted
    tokens (the anchor included); the bonus token has no target state yet and anchors the next block.
    A step reads the device once: its drafts and the target's tokens, together, after the verify
    forward; everything else it needs (the anchor, the lengths, the cache's) the host already has.
    """
    device = target.device
    decoding = prefill(target, drafter, prompt, max_new_tokens=max_new_tokens)
    context, tokens = decoding.context, decoding.tokens
    cached = decoding.length - 1  # committed tokens in the target's cache; those after it lead the next verify forward
    while not finished(tokens, max_new_tokens, stop_ids):
        length = decoding.length
        # A block yields at most len(draft) + 1 tokens: draft no more than the output still needs.
        draft = drafter.propose(decoding.committed(drafter), context.view() if context is not None else None)
        draft = on_device(draft[: min(drafter.drafts, max_new_tokens - len(tokens) - 1)], device)
        anchor = length - 1 - cached  # the anchor's index in the verify forward, after the uncached committed tokens
        checkpoint = target.checkpoint()
        logits = target.forward(torch.cat([decoding.sequence[cached:length], draft]))
        predicted = logits[anchor:].argmax(-1)  # predicted[j]: the target's token after the block's j-th (anchor, drafts...)
        read = torch.cat([draft, predicted]).tolist()  # the step's one sync
        drafts, greedy = read[: len(draft)], read[len(draft) :]
        accepted = accepted_prefix(drafts, greedy)
        block = [*drafts[:accepted], greedy[accepted]]
        # The output ends at a stop token: drafts the target agreed with after it are neither
        # committed nor counted (a stop among the drafts takes the bonus token's place).
        accepted = through_stop(block, stop_ids) - 1
        if context is not None:
            context.append(target.features()[anchor : anchor + accepted + 1])
        # On the device as on the host: the agreed drafts, then the target's token (a stop draft equals it).
        decoding.commit(torch.cat([draft[:accepted], predicted[accepted : accepted + 1]]), block[: accepted + 1], accepted, len(draft))
        if accepted == len(draft):
            cached = decoding.length - 1  # everything but the bonus token went through the cache as it stays
        else:
            # A rejected draft left its state in the cache: keep what the verify computed for the
            # committed tokens where the cache can (all but the bonus token), else back to the checkpoint.
            cached += target.rewind(checkpoint, anchor + accepted + 1)
            if decoding.length - 1 - cached >= drafter.block_size:
                target.forward(decoding.sequence[cached : decoding.length - 1], last_only=True)
                cached = decoding.length - 1
    return decoding.decoded()
