"""The Transformers engine's decoders (dflash_jobs/generate/decoding.py) against the plain greedy loop
(bench/generate/reference.py): the static-cache decoder gives its tokens, greedy or sampled, stops
where it stops, and a target it cannot serve exactly gets generate. On a CPU in float32 (the CUDA
graph is the GPU's: bench/generate/bench_generate.py runs it against the same loop)."""

from __future__ import annotations

import importlib
import random
from pathlib import Path

import pytest
import torch

from dflash_jobs.generate.decoding import HfGenerate, StaticDecoder, greedy, pick_decoder
from dflash_jobs.generate.engines import SeededSampling

BENCH = Path(__file__).resolve().parents[1] / "bench" / "generate"


@pytest.fixture
def reference(monkeypatch):
    """bench/generate/reference.py, imported as the benchmark imports it."""
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("reference")


@pytest.fixture(scope="module")
def llama(target_of):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_of("llama"), dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def short_llama(target_of):
    """The tiny llama's first two layers: inductor compiles a step of two layers on a CPU in a quarter of the time of eight."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_of("llama"), dtype=torch.float32, attn_implementation="sdpa", num_hidden_layers=2).eval()


def left_padded(lengths: list[int], vocab: int, pad: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    rng = random.Random(seed)
    longest = max(lengths)
    ids = torch.full((len(lengths), longest), pad, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, longest - length:] = torch.tensor([rng.randrange(3, vocab) for _ in range(length)])
        attention[row, longest - length:] = 1
    return ids, attention


LENGTHS = [1, 5, 9, 17, 30, 3, 12, 30]


@torch.inference_mode()
def test_the_static_decoder_gives_the_plain_greedy_loops_tokens(llama, reference):
    """Rows of every length, one of a single token: each row's tokens are the plain loop's, and
    where a row parts from it (only at an exact tie can it, in float32) the scores there say so."""
    vocab = llama.config.vocab_size
    ids, attention = left_padded(LENGTHS, vocab, pad=0)
    plain, fast = reference.Recorder(), reference.Recorder()
    expected = reference.plain_greedy(llama, ids, attention, 48, plain)
    got = StaticDecoder(llama, stop_ids={vocab + 1}, pad_id=0)(ids, attention, 48, fast)
    assert got.shape == expected.shape == (len(LENGTHS), 48)
    found = reference.partings(expected, plain, got, fast)
    assert found.other == 0 and found.within_one_step == 0
    assert found.identical + found.exact_ties == len(LENGTHS) and found.identical >= len(LENGTHS) - 1
    # Greedy as the engine asks it (argmax on the target's logits, in the step): the same tokens
    # without a recorder; and attending over the whole static cache, not its filled windows (the
    # longest row, 30 + 48 tokens, reads windows of 64 then 128 columns), the same.
    decoder = StaticDecoder(llama, stop_ids={vocab + 1}, pad_id=0)
    assert torch.equal(decoder(ids, attention, 48, greedy), got)
    assert torch.equal(StaticDecoder(llama, stop_ids={vocab + 1}, pad_id=0, windows=False)(ids, attention, 48, greedy), got)
    # The next batch of as many rows reuses the cache and its buffers: the same tokens as a new decoder's.
    other_ids, other_attention = left_padded(LENGTHS[::-1], vocab, pad=0, seed=3)
    again = decoder(other_ids, other_attention, 40, greedy)
    assert decoder.run.length == 256  # 30 + 48 tokens, rounded up to CACHE_BUCKET
    assert torch.equal(again, StaticDecoder(llama, stop_ids={vocab + 1}, pad_id=0)(other_ids, other_attention, 40, greedy))


@torch.inference_mode()
def test_the_compiled_static_decoder_gives_the_plain_loops_tokens_from_one_graph_a_pick_kind(short_llama, reference):
    """compile (inductor's C++ kernels on a CPU): where a row parts from the plain loop, an exact tie
    or a rounding of the fused kernels within one bf16 step; greedy in the step gives the recorded
    tokens. The first batch compiles one graph of the step for greedy in it and one for the logits
    out, and nothing else compiles: not a window (64, 128), not another batch size, nor the whole
    cache's width, nor a step (each calls the compiled step on a CPU; a GPU calls it once a window to
    warm and once to capture)."""
    from torch._dynamo.utils import counters

    vocab = short_llama.config.vocab_size
    ids, attention = left_padded(LENGTHS, vocab, pad=0)
    torch._dynamo.reset()
    counters.clear()
    plain, fast = reference.Recorder(), reference.Recorder()
    expected = reference.plain_greedy(short_llama, ids, attention, 48, plain)
    decoder = StaticDecoder(short_llama, stop_ids={vocab + 1}, pad_id=0, compile=True)
    got = decoder(ids, attention, 48, fast)
    found = reference.partings(expected, plain, got, fast)
    assert found.other == 0 and found.identical >= len(LENGTHS) - 1, found
    assert torch.equal(decoder(ids, attention, 48, greedy), got)
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"], (dict(counters["stats"]), dict(counters["graph_break"]))
    other_ids, other_attention = left_padded(LENGTHS[:5], vocab, pad=0, seed=3)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for windows in (True, False):
            compiled = StaticDecoder(short_llama, stop_ids={vocab + 1}, pad_id=0, windows=windows, compile=True)
            eager = StaticDecoder(short_llama, stop_ids={vocab + 1}, pad_id=0, windows=windows)
            for batch in [(ids, attention), (other_ids, other_attention)]:
                assert torch.equal(compiled(*batch, 40, greedy), eager(*batch, 40, greedy))
    assert counters["stats"]["unique_graphs"] == 2


@torch.inference_mode()
def test_the_static_decoder_stops_where_generate_does_and_ends_when_every_row_has(llama, reference):
    """A token the plain loop emits mid-answer made the stop token: both decoders stop each row on
    it (padding after), and once every row has stopped the static decoder decodes no further."""
    vocab = llama.config.vocab_size
    ids, attention = left_padded(LENGTHS, vocab, pad=0, seed=1)
    free = reference.plain_greedy(llama, ids, attention, 40, greedy)
    stop = int(free[0, 3])
    static = StaticDecoder(llama, stop_ids={stop}, pad_id=0)(ids, attention, 40, greedy)
    generated = HfGenerate(llama, stop_ids={stop}, pad_id=0)(ids, attention, 40, greedy)
    steps = min(static.shape[1], generated.shape[1])
    assert torch.equal(static[:, :steps], generated[:, :steps])
    for row in range(len(LENGTHS)):
        tokens = static[row].tolist()
        if stop in tokens:
            end = tokens.index(stop)
            assert tokens[: end + 1] == free[row, : end + 1].tolist() and set(tokens[end + 1:]) <= {0}
        else:
            assert tokens == free[row, : len(tokens)].tolist()
    # A stop every row reaches early: the decoder ends at the next look, long before the limit.
    always = StaticDecoder(llama, stop_ids=set(free[:, 0].tolist()), pad_id=0)(ids, attention, 200, greedy)
    assert always.shape[1] < 200 and (always[:, 1:] == 0).all()


@torch.inference_mode()
def test_sampling_draws_the_same_tokens_in_both_decoders(llama):
    """temperature > 0: the seeded sampler picks alike in the static decoder and in generate, and
    each row draws from its own seed (another seed, another answer)."""
    vocab = llama.config.vocab_size
    ids, attention = left_padded(LENGTHS, vocab, pad=0, seed=2)

    def sampler(seed: int) -> SeededSampling:
        return SeededSampling([{"temperature": 1.0, "top_p": 0.9, "seed": seed + row} for row in range(len(LENGTHS))], torch.device("cpu"))

    decoder = StaticDecoder(llama, stop_ids={vocab + 1}, pad_id=0)
    static = decoder(ids, attention, 16, sampler(1))
    generated = HfGenerate(llama, stop_ids={vocab + 1}, pad_id=0)(ids, attention, 16, sampler(1))
    assert torch.equal(static, generated)
    other = decoder(ids, attention, 16, sampler(100))  # the same decoder, its cache reused
    assert (other != static).any(dim=1).sum() >= len(LENGTHS) // 2


def test_a_hybrid_target_decodes_with_generate_and_a_dense_one_with_the_static_cache(llama, target_of):
    from transformers import AutoModelForCausalLM

    hybrid = AutoModelForCausalLM.from_pretrained(target_of("qwen3_5"), dtype=torch.float32)
    assert isinstance(pick_decoder(hybrid, stop_ids={1}, pad_id=0), HfGenerate)
    assert isinstance(pick_decoder(llama, stop_ids={1}, pad_id=0), StaticDecoder)


def test_the_static_decoder_refuses_to_decode_outside_inference_mode(short_llama):
    """Outside inference mode the compiled step would trace for gradients and fail deep in inductor:
    the decoder says what to do instead, eager or compiled, before any forward."""
    ids, attention = left_padded([3, 5], short_llama.config.vocab_size, pad=0)
    for compile in (False, True):
        decoder = StaticDecoder(short_llama, stop_ids={2}, pad_id=0, compile=compile)
        with pytest.raises(RuntimeError, match=r"inside torch.inference_mode\(\).*with torch.inference_mode\(\):"):
            decoder(ids, attention, 4, greedy)
        assert decoder.run is None


def test_the_benchmarks_profile_of_a_batch_splits_its_time_and_names_its_top_ops(llama, monkeypatch):
    """bench/generate/profile_step.py's profile stage on a CPU: it reads the run's captured steps where
    the decoder keeps them (a renamed attribute there once ended a GPU call)."""
    monkeypatch.syspath_prepend(str(BENCH))
    profile_step = importlib.import_module("profile_step")
    decoder = StaticDecoder(llama, stop_ids=set(), pad_id=0)
    ids, attention = left_padded(LENGTHS, llama.config.vocab_size, pad=0)
    new_tokens = 24
    profiled = profile_step.profile_batch(decoder, ids, attention, new_tokens)
    split = profiled["split"]
    assert split["decode_steps"] == new_tokens - 1
    assert split["windows"] and all(width >= ids.shape[1] for width in split["windows"])
    assert split["decode_s"] > 0 and split["replayed_step_wall_ms"] > 0
    config = llama.config
    per_column = 2 * config.num_hidden_layers * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4  # float32
    assert split["cache_bytes_per_step"] == per_column * len(LENGTHS) * split["profiled_window"]
    assert split["read_gb_per_s"] > 0
    step = profiled["replayed_step"]
    assert step["top"] and step["ms_per_step"] > 0
    assert any("mm" in row["name"] or "linear" in row["name"] for row in step["top"])
