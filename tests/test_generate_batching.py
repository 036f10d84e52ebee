"""How the transformers engine batches a chunk's prompts: generate.batch_prompts (auto sized from the
free device memory, or a number), and the prompts sorted by length into batches, every answer the
same as its prompt's alone; generate.compile, whether it compiles its decode step."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from dflash_jobs.errors import SpecError
from dflash_jobs.generate import batch
from dflash_jobs.generate.engines import SERVED_MODEL, TransformersEngine
from dflash_jobs.generate.sizing import AUTO_CAP, CPU_ROWS, TargetShape, auto_rows, batch_rows, row_bytes
from dflash_jobs.generate.worker import prompt_seed
from dflash_jobs.spec import GenerateSpec, parse_spec, run_identity
from dflash_jobs.architectures.tiny.chats import tiny_chat_rows

# SmolLM2-135M's config: 30 layers, 3 key/value heads of 64, hidden 576, MLP 1,536, 49,152 tokens; bf16.
SMOLLM2 = TargetShape(layers=30, kv_heads=3, head_dim=64, hidden=576, intermediate=1536, vocab=49152, dtype_bytes=2)
GIB = 2**30
RUN = {"name": "gen", "backend": "local", "target": {"model": "/models/m"}, "data": {"source": "/data/chats.jsonl"}, "output": "/out"}


def test_a_row_costs_its_kv_cache_prompt_forward_and_logits():
    per_row = row_bytes(SMOLLM2, prompt=1023, new_tokens=1025)
    cache = 30 * 2 * 3 * 64 * 2 * 2048  # layers x (K, V) x kv heads x head dim x bf16 x (prompt + answer)
    assert cache == 47_185_920
    buffers, mask = 2048 * 9, 1023 * 1023 * 5
    activations = 1023 * (4 * 576 + 3 * 1536) * 2
    logits = 49152 * 22
    assert per_row == cache + buffers + mask + activations + logits == 67_660_293
    # The cache grows with the answer, the prompt's forward with the square of the prompt.
    assert row_bytes(SMOLLM2, prompt=1023, new_tokens=2049) - per_row == 30 * 2 * 3 * 64 * 2 * 1024 + 1024 * 9


def test_auto_fills_the_free_memory_under_a_cap():
    per_row = row_bytes(SMOLLM2, prompt=1023, new_tokens=1025)
    # An H100 with SmolLM2 loaded: some 79 GiB free; 80% of it holds 1,002 rows of 64.5 MiB.
    assert auto_rows(79 * GIB, per_row) == int(79 * GIB * 0.8) // per_row == 1002
    assert auto_rows(79 * GIB, per_row, headroom=0.5) == 626
    # Short rows: the cap; no room for one row: one all the same (it fails as it would have).
    assert auto_rows(79 * GIB, row_bytes(SMOLLM2, prompt=127, new_tokens=129)) == AUTO_CAP
    assert auto_rows(GIB // 100, per_row) == 1


def test_an_explicit_number_is_kept_and_auto_on_a_cpu_is_small():
    model = SimpleNamespace()  # neither path reads the model
    assert batch_rows(GenerateSpec(batch_prompts=300), model, torch.device("cuda"), max_length=4096) == (300, "generate.batch_prompts")
    rows, why = batch_rows(GenerateSpec(), model, torch.device("cpu"), max_length=4096)
    assert (rows, why) == (CPU_ROWS, "generate.batch_prompts auto on cpu")


def test_batch_prompts_is_auto_or_a_positive_integer():
    assert GenerateSpec().batch_prompts == "auto"
    assert parse_spec(RUN | {"generate": {"batch_prompts": 512}}).generate.batch_prompts == 512
    for bad in (0, "big", 1.5, True):
        with pytest.raises(SpecError, match="generate.batch_prompts"):
            parse_spec(RUN | {"generate": {"batch_prompts": bad}})


def test_a_run_started_under_the_old_default_is_the_same_run():
    """batch_prompts is the engine's speed (outside the settings hash too): run.yaml's 64 and today's auto are one run."""
    resolved = parse_spec(RUN | {"generate": {}}).to_dict()
    assert resolved["generate"]["batch_prompts"] == "auto"
    assert run_identity(resolved | {"generate": resolved["generate"] | {"batch_prompts": 64}}) == run_identity(resolved)


def test_the_decode_step_compiles_only_where_generate_compile_asks(target_of):
    """generate.compile: off unless asked (until a GPU run has measured it); null, on a GPU and not on a
    CPU; set, as it says; the engine's static decoder compiles where it does. A speed knob as
    batch_prompts is: a run.yaml written before it is the same run."""
    assert not GenerateSpec().compiled_on("cuda") and not GenerateSpec().compiled_on("cpu")
    assert GenerateSpec(compile=None).compiled_on("cuda") and not GenerateSpec(compile=None).compiled_on("cpu")
    assert not GenerateSpec(compile=False).compiled_on("cuda") and GenerateSpec(compile=True).compiled_on("cpu")
    with pytest.raises(SpecError, match="generate.compile"):
        parse_spec(RUN | {"generate": {"compile": "yes"}})
    target = target_of("llama")
    tokenizer = AutoTokenizer.from_pretrained(target)
    for compile in (None, True):
        engine = TransformersEngine.load(GenerateSpec(engine="transformers", compile=compile), target, tokenizer=tokenizer,
                                         device=torch.device("cpu"), attn_implementation="sdpa", max_length=160)
        assert engine.decoder.compile is bool(compile)
    resolved = parse_spec(RUN | {"generate": {"compile": False}}).to_dict()
    before = resolved | {"generate": {key: value for key, value in resolved["generate"].items() if key != "compile"}}
    assert run_identity(before) == run_identity(resolved) == run_identity(parse_spec(RUN | {"generate": {}}).to_dict())


def test_the_target_shape_is_read_from_its_config(target_of):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_of("llama"), dtype=torch.bfloat16)
    text = model.config.get_text_config(decoder=True)
    shape = TargetShape.of(model)
    assert (shape.layers, shape.kv_heads, shape.vocab, shape.dtype_bytes) == (
        text.num_hidden_layers, text.num_key_value_heads, text.vocab_size, 2)
    assert shape.head_dim == getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


class Recorded:
    """The engine's own decoder, with the prompt lengths of every batch it was handed."""

    def __init__(self, decoder) -> None:
        self.decoder, self.name, self.batches = decoder, decoder.name, []

    def __call__(self, input_ids, attention, limit, pick):
        self.batches.append(attention.sum(-1).tolist())
        return self.decoder(input_ids, attention, limit, pick)


def test_prompts_are_batched_by_length_and_answer_as_alone(target_of, tmp_path):
    """The requests in the order longest first: batches of 3 take them shortest first, each batch of
    like lengths, and every prompt's tokens are those it gets alone, under its own id."""
    target = target_of("llama")
    tokenizer = AutoTokenizer.from_pretrained(target)
    settings = GenerateSpec(engine="transformers", temperature=0.0, batch_prompts=3)
    engine = TransformersEngine.load(settings, target, tokenizer=tokenizer, device=torch.device("cpu"), attn_implementation="sdpa",
                                     max_length=160)
    assert engine.rows == 3
    rows = list(tiny_chat_rows(9, seed=3))
    lengths = {i: len(engine.encode({"messages": row["messages"][:-1]})) for i, row in enumerate(rows)}
    order = sorted(lengths, key=lambda i: -lengths[i])
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(
        json.dumps(batch.request(i, rows[i]["messages"][:-1], tools=None, model=SERVED_MODEL, settings=settings, max_tokens=6,
                                 seed=prompt_seed(1, i))) + "\n" for i in order
    ))

    decoder = engine.decoder

    def answers(rows_a_batch: int) -> tuple[dict[int, list[int]], list[list[int]]]:
        engine.rows, engine.decoder = rows_a_batch, Recorded(decoder)
        outputs = tmp_path / f"outputs-{rows_a_batch}.jsonl"
        engine.run(requests, outputs)
        return {a.sample_id: a.token_ids for a in map(batch.parse_output, outputs.read_text().splitlines())}, engine.decoder.batches

    together, batches = answers(3)
    assert len(batches) == 3 and [length for one in batches for length in one] == sorted(lengths.values())
    alone, _ = answers(1)
    assert together == alone and sorted(together) == list(range(9))
