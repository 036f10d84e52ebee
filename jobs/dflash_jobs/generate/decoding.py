"""How the Transformers engine decodes one batch of left-padded prompts: `StaticDecoder` (a static
KV cache, each decode step one replayed CUDA graph on a GPU) where the target's attention allows it,
else `HfGenerate` (Transformers' `generate`, for any target).

Both take the same batch and the same `pick` (the next token of each row from its float32 logits),
and return the same tokens: the plain greedy loop's, up to exact ties and the rounding of the
kernels a batch shape selects (bench/generate/bench_generate.py counts and shows them on a GPU;
tests/test_generate_decoding.py checks the equality on a CPU). Greedy is `torch.argmax`, which
returns the lowest id at an exact tie: the project's one tie rule (drafter.model.rank_top_k: score
descending, then id ascending).

Why a decoder of our own for a small target: `generate` launches some 15 kernels a layer a step from
Python and recomputes its masks every step, so a 135M-parameter target leaves an H100 idle between
launches (issue 48: 160 answers/s). One CUDA graph a step replays the launches at once; the static
cache gives the graph fixed addresses; the mask is ours, built once, and grows by one column a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    import torch

Pick = Callable[["torch.Tensor"], "torch.Tensor"]
"""Float32 logits [B, V] -> the next token of each row [B]."""

CACHE_ALIGN = 64
"""The static cache's length is a multiple of this: SDPA's memory-efficient kernel wants its mask's rows aligned."""
STOP_CHECK_STEPS = 16
"""Steps between two looks at whether every row has stopped: each look waits for the GPU."""


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The highest score, the lowest id at an exact tie (torch.argmax returns the first maximum)."""
    return logits.argmax(dim=-1)


class Decoder(Protocol):
    name: str

    def __call__(self, input_ids: torch.Tensor, attention: torch.Tensor, limit: int, pick: Pick) -> torch.Tensor:
        """Up to `limit` new tokens of each left-padded row [B, P] (attention 1 on real tokens): [B, n <= limit],
        each row's tokens after its first stop token whatever follows (the caller cuts there)."""


def static_cache_supported(model) -> bool:
    """Every layer attends to everything before it: a static cache and our own mask are then exact
    (a linear-attention or a sliding-window layer keeps other state, which generate handles)."""
    text = model.config.get_text_config(decoder=True)
    layer_types = getattr(text, "layer_types", None) or ["full_attention"]
    return all(kind == "full_attention" for kind in layer_types) and getattr(text, "sliding_window", None) in (None, 0)


def cache_argument(model) -> str:
    """The forward's name for the cache: `cache` from Transformers 5.25 (which warns at the old name),
    `past_key_values` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def pick_decoder(model, *, stop_ids: set[int], pad_id: int) -> Decoder:
    if static_cache_supported(model):
        return StaticDecoder(model, stop_ids=stop_ids, pad_id=pad_id)
    return HfGenerate(model, stop_ids=stop_ids, pad_id=pad_id)


class PickedScores:
    """A logits processor that leaves only `pick`'s token a finite score, so that generate's greedy
    step takes it (how a seeded sampler rides on generate)."""

    def __init__(self, pick: Pick) -> None:
        self.pick = pick

    def __call__(self, input_ids, scores):
        import torch

        chosen = self.pick(scores.float())[:, None]  # [B, 1]
        return torch.full_like(scores, float("-inf")).scatter_(1, chosen, 0.0)


class BatchDecoder:
    """A target, the tokens that end an answer, and the token that fills a row after its end."""

    name = ""

    def __init__(self, model, *, stop_ids: set[int], pad_id: int) -> None:
        self.model = model
        self.stop_ids = stop_ids
        self.pad_id = pad_id


class HfGenerate(BatchDecoder):
    """Transformers' `generate`: any target, one Python step a token."""

    name = "generate"

    def __call__(self, input_ids, attention, limit, pick):
        # The checkpoint's default temperature, top-k and top-p apply only to do_sample, which stays off:
        # `pick` is the whole choice.
        options = {}
        if pick is not greedy:
            from transformers import LogitsProcessorList

            options["logits_processor"] = LogitsProcessorList([PickedScores(pick)])
        output = self.model.generate(
            input_ids=input_ids, attention_mask=attention, max_new_tokens=limit, do_sample=False,
            eos_token_id=sorted(self.stop_ids), pad_token_id=self.pad_id, **options,
        )
        return output[:, input_ids.shape[1]:]


class StaticDecoder(BatchDecoder):
    """A static KV cache of the batch's length, the prompt in one forward, then one forward a step
    (captured once as a CUDA graph on a GPU and replayed, eager elsewhere), for a target of full
    attention only (static_cache_supported)."""

    name = "static"

    def __call__(self, input_ids, attention, limit, pick):
        import torch
        from transformers import StaticCache

        B, P = input_ids.shape
        device = input_ids.device
        length = -(-(P + limit) // CACHE_ALIGN) * CACHE_ALIGN
        cache = StaticCache(config=self.model.config, max_cache_len=length)
        real = attention.bool()
        # visible[b, j]: row b's position j holds a token of its own (prompt, then answer) [B, length].
        visible = torch.zeros(B, length, dtype=torch.bool, device=device)
        visible[:, :P] = real
        positions = (attention.long().cumsum(-1) - 1).clamp(min=0)  # [B, P], as generate numbers left-padded rows
        causal = torch.ones(P, length, dtype=torch.bool, device=device).tril()  # [P, length]
        # A padding query attends to itself alone: a row of no key at all would make SDPA's output NaN,
        # and NaN at a padded position reaches the real ones through 0 * NaN.
        itself = torch.eye(P, length, dtype=torch.bool, device=device)[None] & ~real[:, :, None]  # [B, P, length]
        prompt_mask = (visible[:, None, :] & causal[None]) | itself  # [B, P, length]
        cache_kwargs = {cache_argument(self.model): cache}
        logits = self.model(input_ids=input_ids, attention_mask=prompt_mask[:, None], position_ids=positions,
                            use_cache=True, logits_to_keep=1, **cache_kwargs).logits[:, -1]
        step = DecodeStep(self.model, cache_kwargs, visible, first_slot=P, next_position=attention.long().sum(-1))
        stops = torch.tensor(sorted(self.stop_ids), device=device)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        tokens = []
        for t in range(limit):
            token = pick(logits.float()).masked_fill(done, self.pad_id)  # [B]
            tokens.append(token)
            done |= torch.isin(token, stops)
            if t == limit - 1 or (t % STOP_CHECK_STEPS == STOP_CHECK_STEPS - 1 and bool(done.all())):
                break
            logits = step(token)
        return torch.stack(tokens, dim=1)


class DecodeStep:
    """One decode step of the whole batch on fixed buffers: the token in, the logits [B, V] out. On
    a GPU the second call captures it as a CUDA graph (the first, eager, warms its kernels) and
    every later call replays that graph."""

    def __init__(self, model, cache_kwargs, visible, *, first_slot: int, next_position) -> None:
        import torch

        self.model = model
        self.cache_kwargs = cache_kwargs
        self.visible = visible  # [B, length], a column opened a step
        self.slot = torch.tensor([first_slot], device=visible.device)  # the cache column this step writes
        self.position = next_position.clone()  # [B]
        self.token = torch.zeros_like(self.position)
        self.graph = None
        self.logits = None
        self.calls = 0

    def forward(self):
        self.visible.index_fill_(1, self.slot, True)
        out = self.model(input_ids=self.token[:, None], attention_mask=self.visible[:, None, None, :],
                         position_ids=self.position[:, None], use_cache=True, **self.cache_kwargs)
        self.slot += 1
        self.position += 1
        return out.logits[:, -1]

    def __call__(self, token):
        import torch

        self.token.copy_(token)
        self.calls += 1
        if self.visible.device.type != "cuda":
            return self.forward()
        if self.graph is None and self.calls == 1:
            return self.forward()
        if self.graph is None:
            # Recorded on a side stream (capture refuses the default one) into its own memory pool.
            # Recording runs no kernel, so the cache and the counters stand where the eager call
            # left them, and the first replay does this step. Not torch.cuda.graph: it empties the
            # allocator's cache at every capture, one a batch.
            self.graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.graph.capture_begin()
                try:
                    self.logits = self.forward()
                finally:
                    self.graph.capture_end()
            torch.cuda.current_stream().wait_stream(stream)
        self.graph.replay()
        return self.logits
