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
A step reads only the cache's filled part (a graph per window of CACHE_ALIGN columns), greedy picks
inside the graph, and the cache and its graphs serve the next batch of the same rows and length.

Compiled (`compile`, generate.compile: off by default, measured slower on an H100), the step's forward goes through
torch.compile before the capture: a graph replays every kernel at once, but each of a step's some
55 small kernels a layer (the RMSNorms' casts and reductions, rotary, the cache writes, residuals,
SiLU x up) still costs its few microseconds of GPU time, a fixed cost a step at any batch. Inductor
fuses the elementwise work between the matmuls and attention into fewer kernels, and our own capture
records them as it records the eager ones.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Protocol

from dflash_jobs.static_cache import CACHE_ALIGN, CapturedSteps, aligned, cache_argument, static_cache_supported, windowed_cache

if TYPE_CHECKING:
    import torch

Pick = Callable[["torch.Tensor"], "torch.Tensor"]
"""Float32 logits [B, V] -> the next token of each row [B]."""

CACHE_BUCKET = 256
"""The static cache's length is a multiple of this: batches of lengths that round up alike share a cache and its graphs."""
STOP_CHECK_STEPS = 16
"""Steps between two looks at whether every row has stopped: each look waits for the GPU."""
RECOMPILE_LIMIT = 64
"""Graphs torch.compile keeps of the decode step (dynamo's default, 8, counts per function and process):
one for each pick kind (greedy in the step, or logits out) and target, another where a batch has one
row (dynamo specialises sizes of 1), each serving every window and batch size. Past the limit dynamo
would run the step eagerly, saying so only in a warning."""


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The highest score, the lowest id at an exact tie (torch.argmax returns the first maximum)."""
    return logits.argmax(dim=-1)


class Decoder(Protocol):
    name: str

    def __call__(self, input_ids: torch.Tensor, attention: torch.Tensor, limit: int, pick: Pick) -> torch.Tensor:
        """Up to `limit` new tokens of each left-padded row [B, P] (attention 1 on real tokens): [B, n <= limit],
        each row's tokens after its first stop token whatever follows (the caller cuts there)."""


def pick_decoder(model, *, stop_ids: set[int], pad_id: int, compile: bool = False) -> Decoder:
    """The static decoder (compiled where `compile`) where the target allows it, else generate."""
    if static_cache_supported(model):
        return StaticDecoder(model, stop_ids=stop_ids, pad_id=pad_id, compile=compile)
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
    """A static KV cache, the prompt in one forward, then one forward a step (captured once as a CUDA
    graph on a GPU and replayed, eager elsewhere), for a target of full attention only
    (static_cache_supported). The cache, its buffers and graphs stay for the next batch of as many
    rows whose length rounds up to the same CACHE_BUCKET, or less (prompts sorted by length: most
    batches), so such a batch captures nothing. `windows`: each forward attends over the cache's filled part only,
    rounded up to CACHE_ALIGN (a graph per such window), not over its whole length. `compile`: each
    decode step's forward through torch.compile (compiled_step), then captured as the eager one is."""

    def __init__(self, model, *, stop_ids: set[int], pad_id: int, windows: bool = True, compile: bool = False) -> None:
        super().__init__(model, stop_ids=stop_ids, pad_id=pad_id)
        self.windows = windows
        self.compile = compile
        self.name = "static compiled" if compile else "static"
        self.run: StaticRun | None = None

    def __call__(self, input_ids, attention, limit, pick):
        run = self.start(input_ids, attention, limit, pick)
        while run.advance():
            pass
        return run.tokens[:, : run.chosen].clone()

    def start(self, input_ids, attention, limit, pick) -> StaticRun:
        """The batch's prompt forward and first token; `advance` decodes each next one. Inside
        torch.inference_mode() only, as the engine decodes (generate/engines.py)."""
        import torch

        if not torch.is_inference_mode_enabled():
            # Outside it the compiled step traces for gradients and fails on the in-place token writes.
            raise RuntimeError("StaticDecoder decodes inside torch.inference_mode(), as generate/engines.py calls it: "
                               "wrap the call in `with torch.inference_mode():`")
        B, P = input_ids.shape
        bucket = CACHE_BUCKET if self.windows else CACHE_ALIGN  # whole-cache attention: no longer than needed
        length = -(-(P + limit) // bucket) * bucket
        run = self.run
        # A longer cache serves as well where attention reads only its filled part.
        fits = run is not None and (run.length == length or (self.windows and run.length > length))
        if not fits or (run.rows, run.device) != (B, input_ids.device):
            self.run = None  # the last batch's cache and graphs freed before this one's are made
            run = self.run = StaticRun(self, B, length, input_ids.device)
        run.begin(input_ids, attention, limit, pick)
        return run


@functools.cache
def compiled_step():
    """StaticRun.forward through torch.compile, one for the process: dynamo keeps its graphs on the
    function's code, so every run and decoder shares them.

    dynamic=True: one graph serves every window, batch size and cache length (each a size of the
    inputs, none a constant of the graph). Static shapes would compile a graph per window and batch
    size: seven windows for prompts of up to 288 tokens and 128 new ones, again at each batch size,
    where one graph of SmolLM2's 30 layers took 85 s to compile on a 2-core CPU, most of it inductor's
    scheduling and code generation, which compiling for a GPU does as well. The mode is the default
    one: no CUDA graphs of inductor's own (StaticRun.step captures the step, compiled or not, in its
    own pool). Inductor's numerics are its default ones: a fused kernel keeps float32 between
    elementwise steps that eager rounds to bf16 one by one (emulate_precision_casts would round them
    as eager does, but its chains of casts crash Triton 3.6's compiler in some kernels: pytorch#173547),
    so a compiled step's logits differ from the eager step's by roundings, which can part two
    decodings where two tokens' scores are that close (bench/generate/bench_generate.py counts them)."""
    import torch

    return torch.compile(StaticRun.forward, dynamic=True)


class StaticRun:
    """Batches of `rows` prompts on fixed buffers: the cache of `length` columns, the mask `visible`,
    the token in, the tokens chosen. A decode step writes its token's keys at column `slot` and picks
    the next token; on a GPU each window's second step captures it as a CUDA graph (the first, not
    captured, warms its kernels, and compiles the step where it is compiled) and every later step of
    that window, in this batch and the next, replays the graph. With greedy the pick and the stop
    bookkeeping are in the graph too, argmax on the target's own logits (a bf16 -> float32 cast is
    exact and keeps the order: the same token); any other pick takes float32 logits outside the graph."""

    def __init__(self, decoder: StaticDecoder, rows: int, length: int, device) -> None:
        import torch

        self.model, self.pad_id, self.windows, self.compiled = decoder.model, decoder.pad_id, decoder.windows, decoder.compile
        self.rows, self.length, self.device = rows, length, device
        # Past the last column any window reads, one more column in the cache and CACHE_ALIGN (its rows
        # stay aligned) in the mask: a window of the whole cache would be a contiguous slice of each,
        # the others not, and torch.compile would make that window a graph of its own.
        self.cache = windowed_cache()(config=self.model.config, max_cache_len=length + 1)
        self.cache_kwargs = {cache_argument(self.model): self.cache}
        self.stops = torch.tensor(sorted(decoder.stop_ids), device=device)
        # visible[b, j]: row b's column j holds a token of its own (prompt, then answer) [B, length + CACHE_ALIGN].
        self.visible = torch.zeros(rows, length + CACHE_ALIGN, dtype=torch.bool, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # the cache column the next step writes
        self.position = torch.zeros(rows, dtype=torch.long, device=device)  # [B], the next token's position
        self.token = torch.zeros(rows, dtype=torch.long, device=device)  # the next step's input
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.tokens = torch.zeros(rows, length, dtype=torch.long, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)  # where the next token goes in `tokens`
        self.steps = CapturedSteps(device)  # each (window, greedy) step replayed as a CUDA graph on a GPU
        self.pick: Pick = greedy
        self.limit = self.prompt_length = self.chosen = 0

    def begin(self, input_ids, attention, limit: int, pick: Pick) -> None:
        """A new batch: the buffers reset in place (the graphs read them), the prompt forward, the first token."""
        P = input_ids.shape[1]
        self.pick, self.limit, self.prompt_length = pick, limit, P
        self.cache.reset()
        real = attention.bool()
        self.visible.zero_()
        self.visible[:, :P] = real
        self.slot.fill_(P)
        self.position.copy_(attention.long().sum(-1))
        self.done.zero_()
        self.tokens.fill_(self.pad_id)
        self.column.zero_()
        self.choose(self.picked(self.prefill(input_ids, real)))
        self.chosen = 1  # tokens in `tokens`

    def window(self, filled: int) -> int:
        return min(aligned(filled), self.length) if self.windows else self.length

    def prefill(self, input_ids, real):
        import torch

        B, P = input_ids.shape
        device = input_ids.device
        width = self.cache.window = self.window(P)
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)  # [B, P], as generate numbers left-padded rows
        causal = torch.ones(P, width, dtype=torch.bool, device=device).tril()  # [P, width]
        # A padding query attends to itself alone: a row of no key at all would make SDPA's output NaN,
        # and NaN at a padded position reaches the real ones through 0 * NaN.
        itself = torch.eye(P, width, dtype=torch.bool, device=device)[None] & ~real[:, :, None]  # [B, P, width]
        mask = (self.visible[:, None, :width] & causal[None]) | itself  # [B, P, width]
        return self.model(input_ids=input_ids, attention_mask=mask[:, None], position_ids=positions,
                          use_cache=True, logits_to_keep=1, **self.cache_kwargs).logits[:, -1]

    def picked(self, logits):
        """Greedy on the target's own logits (a bf16 -> float32 cast is exact and keeps the order), any
        other pick on float32 ones."""
        return greedy(logits) if self.pick is greedy else self.pick(logits.float())

    def choose(self, token) -> None:
        """The next token of each row into `tokens` (padding once a row has stopped) and into the next step."""
        token = token.masked_fill(self.done, self.pad_id)
        self.done |= (token[:, None] == self.stops).any(dim=-1)  # not torch.isin: for many rows it sorts, which syncs
        self.tokens.index_copy_(1, self.column, token[:, None])
        self.column += 1
        self.token.copy_(token)

    def forward(self, width: int, greedy_in_step: bool):
        """One decode step over the cache's first `width` columns: the next token chosen (greedy_in_step),
        or the logits [B, V]. Reads nothing of `pick`: a compiled step would be a graph for each pick object."""
        self.cache.window = width
        self.visible.index_fill_(1, self.slot, True)
        out = self.model(input_ids=self.token[:, None], attention_mask=self.visible[:, None, None, :width],
                         position_ids=self.position[:, None], use_cache=True, **self.cache_kwargs)
        self.slot += 1
        self.position += 1
        logits = out.logits[:, -1]
        if greedy_in_step:
            self.choose(greedy(logits))
            return None
        return logits

    def decode(self, width: int, greedy_in_step: bool):
        """`forward`, through torch.compile where the decoder compiles."""
        if not self.compiled:
            return self.forward(width, greedy_in_step)
        import torch

        with torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)):
            return compiled_step()(self, width, greedy_in_step)

    def advance(self) -> bool:
        """Decodes the next token of every row; False (nothing decoded) at the limit or, at a look every
        STOP_CHECK_STEPS tokens, once every row has stopped."""
        if self.chosen >= self.limit or (self.chosen % STOP_CHECK_STEPS == 0 and bool(self.done.all())):
            return False
        # This step writes the last token's keys at column P + chosen - 1 and attends to every column before.
        logits = self.step(self.window(self.prompt_length + self.chosen))
        if self.pick is not greedy:
            self.choose(self.pick(logits.float()))
        self.chosen += 1
        return True

    def step(self, width: int):
        key = (width, self.pick is greedy)
        return self.steps(key, lambda: self.decode(*key))
