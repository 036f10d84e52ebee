"""prepare: JSONL -> token chunks. Masks, bad rows, truncation, chunking, holdout, determinism, S3."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from dflash_jobs.errors import EXIT_BAD_SPEC, InputError, SpecError
from dflash_jobs.formats import DATASET_KEY, DatasetIndex, TokenChunk, done_key
from dflash_jobs.prepare import BATCH_ROWS, HOLDOUT_KEY, REJECTED_KEY, main, prepare
from dflash_jobs.rows import SPLIT_ANSWER, prompt_length
from dflash_jobs.spec import parse_spec
from dflash_jobs.storage import open_storage
from dflash_jobs.architectures.tiny import write_tiny_target
from dflash_jobs.architectures.tiny.chats import tiny_chat_rows

from dflashctl.cli.app import app

SYSTEM = {"role": "system", "content": "You are terse."}
TWO_TURNS = [
    SYSTEM,
    {"role": "user", "content": "What is 3 plus 4?"},
    {"role": "assistant", "content": "3 + 4 = 7."},
    {"role": "user", "content": "Count from 1 to 4."},
    {"role": "assistant", "content": "1, 2, 3, 4."},
]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def tokenizer(target):
    return AutoTokenizer.from_pretrained(target)


def write_jsonl(path: Path, rows: list) -> Path:
    """Rows are dicts (dumped as JSON) or raw strings (written as they are)."""
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def spec_fields(target: Path | str, source: Path | str, output: Path | str, **data) -> dict:
    data = {"max_length": 256, "chunk_tokens": 1024, "holdout": 0} | data
    return {
        "name": "prep", "backend": "local", "target": {"model": str(target)},
        "data": {"source": str(source), **data}, "output": str(output),
    }


def make_spec(target: Path | str, source: Path | str, output: Path | str, **data):
    return parse_spec(spec_fields(target, source, output, **data))


def write_spec_file(path: Path, target: Path, source: Path, output: Path) -> Path:
    path.write_text(json.dumps(spec_fields(target, source, output)))  # JSON is YAML
    return path


def read_output(output: Path | str) -> tuple[DatasetIndex, list[TokenChunk]]:
    storage = open_storage(str(output))
    index = DatasetIndex.from_json(storage.get_bytes(DATASET_KEY))
    return index, [TokenChunk.decode(storage.get_bytes(c.path), c.path) for c in index.chunks]


def all_samples(chunks: list[TokenChunk]) -> list[tuple[int, np.ndarray, np.ndarray]]:
    return [(int(c.sample_ids[i]), *c.sample(i)) for c in chunks for i in range(c.num_samples)]


def supervised_runs(tokenizer, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """The decoded text of each contiguous run of supervised tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [tokenizer.decode(ids[start:end].tolist()) for start, end in zip(edges[::2], edges[1::2])]


def test_loss_mask_covers_exactly_what_the_assistant_generates(target, tokenizer, tmp_path):
    with_reasoning = [
        {"role": "user", "content": "Spell 'fox'."},
        {"role": "assistant", "content": "f-o-x.", "reasoning_content": "Three letters."},
    ]
    inline_thinking = [
        {"role": "user", "content": "What is 1 plus 1?"},
        {"role": "assistant", "content": "<think>Easy.</think>\n\n1 + 1 = 2."},
        {"role": "user", "content": "And 2 plus 2?"},
        {"role": "assistant", "content": "<think>Also easy.</think>2 + 2 = 4."},
    ]
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in (TWO_TURNS, with_reasoning, inline_thinking)])
    prepare(make_spec(target, source, tmp_path / "out"), workers=1)
    _, chunks = read_output(tmp_path / "out")
    (_, ids, mask), (_, ids2, mask2), (_, ids3, mask3) = all_samples(chunks)

    # The whole sample is the chat template's rendering, token for token.
    assert tokenizer.decode(ids.tolist()) == tokenizer.apply_chat_template(TWO_TURNS, tokenize=False)
    # An earlier turn is plain; the last one (after the last user message) opens with the rest of
    # the <think> block, which the generation prompt "<|im_start|>assistant\n<think>\n" leaves open.
    assert supervised_runs(tokenizer, ids, mask) == ["3 + 4 = 7.<|im_end|>", "\n</think>\n\n1, 2, 3, 4.<|im_end|>"]
    assert supervised_runs(tokenizer, ids2, mask2) == ["Three letters.\n</think>\n\nf-o-x.<|im_end|>"]
    # Reasoning inline in the content: dropped from an earlier turn by the template, kept in the last.
    assert supervised_runs(tokenizer, ids3, mask3) == ["1 + 1 = 2.<|im_end|>", "Also easy.\n</think>\n\n2 + 2 = 4.<|im_end|>"]


def test_a_template_that_adds_a_default_system_prompt_supervises_the_answers_alone(target_of, tmp_path):
    """The tiny Llama's template, SmolLM2's: ChatML without <think> blocks, and its own system prompt
    where a conversation brings none. Only the answers and their end token are learned."""
    target = target_of("llama")
    tokenizer = AutoTokenizer.from_pretrained(target)
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": TWO_TURNS}, {"messages": TWO_TURNS[1:]}])
    prepare(make_spec(target, source, tmp_path / "out"), workers=1)
    (_, ids, mask), (_, ids2, mask2) = all_samples(read_output(tmp_path / "out")[1])
    assert tokenizer.decode(ids.tolist()) == tokenizer.apply_chat_template(TWO_TURNS, tokenize=False)
    default_system = tokenizer.decode(ids2.tolist())
    assert default_system == tokenizer.apply_chat_template(TWO_TURNS[1:], tokenize=False) and "named SmolLM" in default_system
    for sample, sample_mask in ((ids, mask), (ids2, mask2)):
        assert supervised_runs(tokenizer, sample, sample_mask) == ["3 + 4 = 7.<|im_end|>", "1, 2, 3, 4.<|im_end|>"]


def test_an_assistant_message_of_weight_0_is_context_only(target, tokenizer, tmp_path):
    context_first = [{**m, "weight": 0} if i == 2 else m for i, m in enumerate(TWO_TURNS)]
    every_one_context = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in TWO_TURNS]
    rows = [{"messages": context_first}, {"messages": every_one_context}, {"messages": [*TWO_TURNS[:4], {**TWO_TURNS[4], "weight": 2}]}]
    index = prepare(make_spec(target, write_jsonl(tmp_path / "chats.jsonl", rows), tmp_path / "out"), workers=1)
    (_, ids, mask), = all_samples(read_output(tmp_path / "out")[1])
    # The same rendering as without the weights; only the last answer is learned.
    assert tokenizer.decode(ids.tolist()) == tokenizer.apply_chat_template(TWO_TURNS, tokenize=False)
    assert supervised_runs(tokenizer, ids, mask) == ["\n</think>\n\n1, 2, 3, 4.<|im_end|>"]
    assert index.dropped == {"invalid_fields": 1, "no_supervised_tokens": 1}


def test_pretokenized_and_chat_rows_mix_and_sample_ids_are_line_numbers(target, tokenizer, tmp_path):
    rows = [
        {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},
        "this line is not json",
        {"messages": TWO_TURNS},
        {"input_ids": [9, 10], "loss_mask": [1, 1]},
    ]
    prepare(make_spec(target, write_jsonl(tmp_path / "mixed.jsonl", rows), tmp_path / "out"), workers=1)
    index, chunks = read_output(tmp_path / "out")
    samples = all_samples(chunks)
    assert [sample_id for sample_id, _, _ in samples] == [0, 2, 3]
    assert samples[0][1].tolist() == [5, 6, 7, 8] and samples[0][2].tolist() == [0, 0, 1, 1]
    assert samples[2][1].tolist() == [9, 10] and samples[2][2].tolist() == [1, 1]
    assert samples[1][1].dtype == np.int32 and samples[1][2].dtype == np.uint8
    assert index.samples == 3 and index.tokens == sum(len(ids) for _, ids, _ in samples)
    assert index.supervised_tokens == sum(int(mask.sum()) for _, _, mask in samples)
    assert index.vocab_size == len(tokenizer)
    assert index.dropped == {"malformed_json": 1}


BAD_ROWS = {
    # line (1-based) -> (row, reason)
    2: ("{not json", "malformed_json"),
    3: ('["a", "list"]', "malformed_json"),
    4: ({"text": "no known keys"}, "missing_fields"),
    5: ({"input_ids": [1, 2]}, "missing_fields"),
    6: ({"input_ids": [1, 2], "loss_mask": [1]}, "invalid_fields"),
    7: ({"input_ids": ["a"], "loss_mask": [1]}, "invalid_fields"),
    8: ({"messages": "hello"}, "invalid_fields"),
    9: ({"input_ids": [1, 10**6], "loss_mask": [1, 1]}, "out_of_vocab"),
    10: ({"input_ids": [-1], "loss_mask": [1]}, "out_of_vocab"),
    11: ("", "empty"),
    12: ({"messages": []}, "empty"),
    13: ({"input_ids": [], "loss_mask": []}, "empty"),
    14: ({"messages": [{"role": "user", "content": "hi"}]}, "no_supervised_tokens"),
    15: ({"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}, "no_supervised_tokens"),
    16: ({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}, "template_error"),
    # Rows as the generate step writes them: their answer's token ids, or text alone.
    17: ({"messages": TWO_TURNS[:3], "generation": {"finish_reason": "stop", "token_ids": ["7"]}}, "invalid_fields"),
    18: ({"messages": TWO_TURNS[:3], "generation": {"finish_reason": "stop", "token_ids": [5, 10**6]}}, "out_of_vocab"),
    19: ({"messages": [*TWO_TURNS[:2], {"role": "assistant", "content": "7.", "reasoning_content": "3 plus 4"}],
          "generation": {"finish_reason": "length"}}, SPLIT_ANSWER),
}


def bad_rows_source(path: Path) -> Path:
    good = {"messages": TWO_TURNS}
    last = max(BAD_ROWS) + 1
    return write_jsonl(path, [BAD_ROWS[line][0] if line in BAD_ROWS else good for line in range(1, last + 1)])


def test_bad_rows_are_counted_by_reason_and_listed_with_line_numbers(target, tmp_path, caplog):
    source = bad_rows_source(tmp_path / "bad.jsonl")
    with caplog.at_level(logging.WARNING, logger="dflash.prepare"):
        prepare(make_spec(target, source, tmp_path / "out"), workers=1)
    index, chunks = read_output(tmp_path / "out")

    expected: dict[str, int] = {}
    for _, reason in BAD_ROWS.values():
        expected[reason] = expected.get(reason, 0) + 1
    assert index.dropped == expected
    assert [sample_id for sample_id, _, _ in all_samples(chunks)] == [0, max(BAD_ROWS)]

    rejected = [json.loads(line) for line in open_storage(str(tmp_path / "out")).get_bytes(REJECTED_KEY).splitlines()]
    assert [(r["line"], r["reason"]) for r in rejected] == [(line, reason) for line, (_, reason) in sorted(BAD_ROWS.items())]
    assert all(r["sample_id"] == r["line"] - 1 for r in rejected)
    for line, (_, reason) in BAD_ROWS.items():
        assert f"dropped line {line} ({reason})" in caplog.text


@pytest.mark.parametrize("line", sorted(BAD_ROWS))
def test_strict_stops_at_the_first_bad_row_naming_it(target, tmp_path, line):
    row, reason = BAD_ROWS[line]
    source = write_jsonl(tmp_path / "one-bad.jsonl", [{"messages": TWO_TURNS}, row, {"messages": TWO_TURNS}])
    with pytest.raises(InputError, match=f"data.source line 2: {reason}"):
        prepare(make_spec(target, source, tmp_path / "out"), strict=True, workers=1)


def test_truncation_cuts_to_max_length_and_counts(target, tokenizer, tmp_path):
    long_answer = {"input_ids": list(range(1, 41)), "loss_mask": [0] * 10 + [1] * 30}
    supervised_too_late = {"input_ids": list(range(1, 41)), "loss_mask": [0] * 30 + [1] * 10}
    source = write_jsonl(tmp_path / "long.jsonl", [long_answer, supervised_too_late, {"input_ids": [1, 2], "loss_mask": [0, 1]}])
    spec = make_spec(target, source, tmp_path / "out", max_length=20, chunk_tokens=64)
    prepare(spec, workers=1)
    index, chunks = read_output(tmp_path / "out")
    samples = all_samples(chunks)
    assert index.truncated == 1
    assert index.dropped == {"no_supervised_tokens": 1}
    assert samples[0][1].tolist() == list(range(1, 21)) and samples[0][2].tolist() == [0] * 10 + [1] * 10
    with pytest.raises(InputError, match="line 1 is longer than data.max_length = 20"):
        prepare(spec, strict=True, workers=1)


def test_chunks_are_packed_in_order_never_splitting_a_sample(target, tmp_path):
    rows = list(tiny_chat_rows(60, seed=5))
    source = write_jsonl(tmp_path / "chats.jsonl", rows)
    prepare(make_spec(target, source, tmp_path / "reference", chunk_tokens=100_000), workers=1)
    _, (whole,) = read_output(tmp_path / "reference")

    prepare(make_spec(target, source, tmp_path / "out", max_length=256, chunk_tokens=400), workers=1)
    index, chunks = read_output(tmp_path / "out")
    assert len(chunks) > 3
    lengths = whole.lengths.tolist()
    for info, chunk, following in zip(index.chunks, chunks, chunks[1:] + [None]):
        assert info.tokens == chunk.num_tokens <= 400 and info.samples == chunk.num_samples
        if following is not None:  # cut only when the next sample would not fit
            assert chunk.num_tokens + following.lengths[0] > 400
    assert [c.id for c in index.chunks] == list(range(len(chunks)))
    # Concatenated, the chunks are exactly the unchunked data set.
    assert np.concatenate([c.sample_ids for c in chunks]).tolist() == list(range(60))
    assert np.concatenate([c.input_ids for c in chunks]).tolist() == whole.input_ids.tolist()
    assert np.concatenate([c.lengths for c in chunks]).tolist() == lengths


def test_holdout_keeps_the_last_samples_out_of_training_as_prompts(target, tokenizer, tmp_path):
    rows = list(tiny_chat_rows(20, seed=2))
    source = write_jsonl(tmp_path / "chats.jsonl", rows)
    prepare(make_spec(target, source, tmp_path / "out", holdout=3), workers=1)
    index, chunks = read_output(tmp_path / "out")
    assert [s for s, _, _ in all_samples(chunks)] == list(range(17))
    assert index.holdout["samples"] == 3 and index.holdout["sample_ids"] == [17, 18, 19]
    held = TokenChunk.decode(open_storage(str(tmp_path / "out")).get_bytes(HOLDOUT_KEY), HOLDOUT_KEY)
    assert held.sample_ids.tolist() == [17, 18, 19] and index.holdout["path"] == HOLDOUT_KEY
    for i, sample_id in enumerate(held.sample_ids):
        ids, mask = held.sample(i)
        prompt = tokenizer.decode(ids[: prompt_length(mask)].tolist())
        assert prompt == tokenizer.apply_chat_template(rows[sample_id]["messages"][:-1], tokenize=False, add_generation_prompt=True)

    with pytest.raises(InputError, match="all held out"):
        prepare(make_spec(target, source, tmp_path / "out2", holdout=20), workers=1)


def test_output_is_deterministic_across_runs_and_worker_counts(target, tmp_path):
    # More than one batch of rows (BATCH_ROWS), so that two workers share the work.
    rows = list(tiny_chat_rows(BATCH_ROWS + 100, seed=9)) + ["bad", {"input_ids": [3, 4], "loss_mask": [1, 1]}]
    source = write_jsonl(tmp_path / "chats.jsonl", rows)
    outputs = []
    for name, workers in (("one", 1), ("two", 2)):
        prepare(make_spec(target, source, tmp_path / name, max_length=128, chunk_tokens=8192, holdout=4), workers=workers)
        outputs.append(tmp_path / name)
    files = sorted(p.relative_to(outputs[0]) for p in outputs[0].rglob("*") if p.is_file())
    assert Path(DATASET_KEY) in files and len(files) > 5
    assert files == sorted(p.relative_to(outputs[1]) for p in outputs[1].rglob("*") if p.is_file())
    for name in files:
        assert (outputs[0] / name).read_bytes() == (outputs[1] / name).read_bytes(), name


def test_a_rerun_replaces_the_previous_data_set(target, tmp_path):
    source = write_jsonl(tmp_path / "chats.jsonl", list(tiny_chat_rows(40, seed=1)))
    prepare(make_spec(target, source, tmp_path / "out", chunk_tokens=300), workers=1)
    many = len(read_output(tmp_path / "out")[1])
    prepare(make_spec(target, source, tmp_path / "out", chunk_tokens=100_000), workers=1)
    index, chunks = read_output(tmp_path / "out")
    assert many > 1 and len(chunks) == 1
    assert open_storage(str(tmp_path / "out")).list("tokens/chunks/") == [index.chunks[0].path]


def test_a_rerun_over_extracted_chunks_is_refused_and_keeps_them(target, tmp_path):
    source = write_jsonl(tmp_path / "chats.jsonl", list(tiny_chat_rows(20, seed=1)))
    prepare(make_spec(target, source, tmp_path / "out"), workers=1)
    storage = open_storage(str(tmp_path / "out"))
    storage.put_bytes(done_key(0), b"{}")
    before = storage.get_bytes(DATASET_KEY)
    with pytest.raises(InputError, match="1 extracted chunks") as error:
        prepare(make_spec(target, source, tmp_path / "out", chunk_tokens=300), workers=1)
    assert "extract first" in error.value.fix
    assert storage.get_bytes(DATASET_KEY) == before and storage.exists(done_key(0))


def test_a_missing_source_is_a_spec_error(target, tmp_path):
    with pytest.raises(SpecError, match="data.source"):
        prepare(make_spec(target, tmp_path / "nowhere.jsonl", tmp_path / "out"), workers=1)


def test_s3_source_target_and_output_match_a_local_run(target, tmp_path, s3_bucket):
    rows = list(tiny_chat_rows(30, seed=4)) + ["oops"]
    source = write_jsonl(tmp_path / "chats.jsonl", rows)
    bucket = open_storage(f"s3://{s3_bucket}")
    bucket.put_file("data/chats.jsonl", source)
    for path in target.iterdir():
        bucket.put_file(f"models/tiny/{path.name}", path)

    prepare(make_spec(target, source, tmp_path / "local", holdout=2), workers=1)
    s3_spec = make_spec(f"s3://{s3_bucket}/models/tiny", f"s3://{s3_bucket}/data/chats.jsonl", f"s3://{s3_bucket}/run", holdout=2)
    prepare(s3_spec, workers=1)

    remote = open_storage(f"s3://{s3_bucket}/run")
    local = open_storage(str(tmp_path / "local"))
    keys = local.list("tokens/")
    assert remote.list("tokens/") == keys
    for key in keys:
        if key == DATASET_KEY:  # names the source and tokenizer, which differ
            continue
        assert remote.get_bytes(key) == local.get_bytes(key), key
    remote_index = DatasetIndex.from_json(remote.get_bytes(DATASET_KEY))
    assert remote_index.source == f"s3://{s3_bucket}/data/chats.jsonl"
    assert remote_index.dropped == {"malformed_json": 1} and remote_index.samples == 28


def test_module_entry_point_exits_2_on_bad_input_under_strict(target, tmp_path, capsys):
    source = bad_rows_source(tmp_path / "bad.jsonl")
    spec_file = write_spec_file(tmp_path / "dflash.yaml", target, source, tmp_path / "out")
    assert main(["-f", str(spec_file), "--strict"]) == EXIT_BAD_SPEC
    assert "data.source line 2: malformed_json" in capsys.readouterr().out


def test_dflashctl_prepare_runs_the_job_module_and_surfaces_its_exit_code(target, tmp_path, capfd):
    source = bad_rows_source(tmp_path / "bad.jsonl")
    spec_file = write_spec_file(tmp_path / "dflash.yaml", target, source, tmp_path / "out")
    result = CliRunner().invoke(app, ["prepare", "-f", str(spec_file), "--strict"])
    assert result.exit_code == 2
    assert "data.source line 2: malformed_json" in capfd.readouterr().out
    assert not (tmp_path / "out" / DATASET_KEY).exists()


def test_a_target_without_a_tokenizer_is_a_spec_error(tmp_path):
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": TWO_TURNS}])
    with pytest.raises(SpecError, match="target.model"):
        prepare(make_spec(tmp_path / "no-model", source, tmp_path / "out"), workers=1)


# ---- answers as their writer wrote them ------------------------------------------------------------


def byte_ids(tokenizer, text: str) -> list[int]:
    """`text` as one byte-level token per UTF-8 byte: a split the tokenizer never makes, as a
    sampling target can produce it (and the only way to write text its normaliser would change)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_tokens = bytes_to_unicode()
    return tokenizer.convert_tokens_to_ids([byte_tokens[b] for b in text.encode()])


def generated(question: str, content: str, finish_reason: str, token_ids: list[int] | None = None, **answer) -> dict:
    """A row as the generate step stores it (with the answer's token ids, or, written before it stored them, without)."""
    generation = {"finish_reason": finish_reason, "prompt_tokens": 0, "completion_tokens": len(token_ids or [])}
    if token_ids is not None:
        generation["token_ids"] = token_ids
    return {"messages": [SYSTEM, {"role": "user", "content": question}, {"role": "assistant", "content": content, **answer}],
            "generation": generation}


def test_a_regenerated_answer_is_trained_on_the_token_ids_the_target_produced(target, tokenizer, tmp_path):
    """After the generation prompt, the answer's ids as they are: a split the tokenizer would not
    make, text it would normalise (a decomposed accent, not NFC) and the end token the target
    stopped on (<|endoftext|>, not the template's <|im_end|>) survive byte for byte; an answer cut
    at the limit has no end token."""
    endoftext, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    decomposed = "Cafe\u0301 au lait"  # e + combining acute: the tokenizer's NFC would make it one character
    answers = [
        (byte_ids(tokenizer, decomposed) + [endoftext], "stop"),
        (tokenizer("Paris.", add_special_tokens=False)["input_ids"] + [im_end], "stop"),
        (byte_ids(tokenizer, "the quick brown"), "length"),
    ]
    rows = [generated(f"Question {i}?", tokenizer.decode(ids, skip_special_tokens=True), reason, ids) for i, (ids, reason) in enumerate(answers)]
    index = prepare(make_spec(target, write_jsonl(tmp_path / "generated.jsonl", rows), tmp_path / "out"), workers=1)
    samples = all_samples(read_output(tmp_path / "out")[1])
    assert [sample_id for sample_id, _, _ in samples] == [0, 1, 2]
    for (_, ids, mask), row, (answer, _) in zip(samples, rows, answers):
        start = prompt_length(mask)
        assert tokenizer.decode(ids[:start].tolist()) == tokenizer.apply_chat_template(row["messages"][:-1], tokenize=False, add_generation_prompt=True)
        assert ids[start:].tolist() == answer and mask[start:].all() and not mask[:start].any()
    first = samples[0][1][prompt_length(samples[0][2]):].tolist()
    assert tokenizer.backend_tokenizer.decode(first, skip_special_tokens=False) == decomposed + "<|endoftext|>"
    # Two of the three would have been trained as other tokens from their text.
    assert index.answers == {"target_ids": 3, "target_ids_retokenized_differently": 2, "text": 0, "text_changed_by_tokenizer": 0}


def test_rows_with_only_text_are_counted_and_a_split_answer_is_never_rejoined(target, tokenizer, tmp_path, caplog):
    """Text alone (a source's answers, or rows generated before their ids were stored) is tokenized
    here: what can be measured is whether the tokens give the text back (non-NFC text does not).
    An answer a reasoning parser split, stored without ids, is dropped with its reason: the template
    would rejoin it with a </think> and an <|im_end|> the target, cut at the limit, never wrote."""
    rows = [
        generated("Spell it.", "Cafe\u0301", "stop"),  # not NFC: the tokenizer composes the accent
        generated("Count.", "1, 2, 3", "length"),
        generated("Why?", "Because", "length", reasoning_content="Let me think about"),
        {"messages": TWO_TURNS},  # the source's own answers: two turns, tokens that give the text back
    ]
    with caplog.at_level(logging.INFO, logger="dflash.prepare"):
        index = prepare(make_spec(target, write_jsonl(tmp_path / "old.jsonl", rows), tmp_path / "out"), workers=1)
    samples = all_samples(read_output(tmp_path / "out")[1])
    assert [sample_id for sample_id, _, _ in samples] == [0, 1, 3]
    assert supervised_runs(tokenizer, samples[0][1], samples[0][2]) == ["Caf\u00e9<|im_end|>"]
    assert supervised_runs(tokenizer, samples[1][1], samples[1][2]) == ["1, 2, 3"]
    assert index.dropped == {SPLIT_ANSWER: 1}
    assert index.answers == {"target_ids": 0, "target_ids_retokenized_differently": 0, "text": 3, "text_changed_by_tokenizer": 1}
    assert "answers: 0 as the target's token ids (0 of them tokenize otherwise from their text), 3 from text (1 of them changed" in caplog.text
    rejected = [json.loads(line) for line in open_storage(str(tmp_path / "out")).get_bytes(REJECTED_KEY).splitlines()]
    assert [(r["line"], r["reason"]) for r in rejected] == [(3, SPLIT_ANSWER)] and "without a reasoning parser" in rejected[0]["detail"]


def test_an_earlier_reply_opening_with_a_tag_is_kept_whole(target, tokenizer, tmp_path):
    """Qwen's template renders a turn before the last user message without the <think> block the
    generation prompt opens; a reply opening with "<" (HTML, a Hermes-style <tool_call> in the text)
    agrees with "<think>" for a character or two, and must not start the supervised span there."""
    html = "<b>Paris</b> is the capital of France."
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    rows = [{"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": reply},
                          {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "You are welcome."}]}
            for reply in (html, hermes)]
    index = prepare(make_spec(target, write_jsonl(tmp_path / "tags.jsonl", rows), tmp_path / "out"), workers=1)
    assert index.dropped == {} and index.samples == 2
    for (_, ids, mask), row in zip(all_samples(read_output(tmp_path / "out")[1]), rows):
        assert tokenizer.decode(ids.tolist()) == tokenizer.apply_chat_template(row["messages"], tokenize=False)
        reply = row["messages"][1]["content"]
        assert supervised_runs(tokenizer, ids, mask) == [f"{reply}<|im_end|>", "\n</think>\n\nYou are welcome.<|im_end|>"]


# Qwen3.5/3.6's way with tools (its chat template, reduced to what renders text): the tools in the
# system turn, an assistant turn's calls after its content as <tool_call><function=...> blocks, tool
# results as a user turn of <tool_response> blocks, a <think> block on turns after the last user message.
TOOL_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or message.role == 'system' %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + content | trim }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content | trim }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call %}
            {%- if not loop.first %}{{- '\\n' }}{%- elif content | trim %}{{- '\\n\\n' }}{%- endif %}
            {{- '<tool_call>\\n<function=' + call.name + '>\\n' }}
            {%- for name, value in call.arguments | items %}
                {{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' }}
            {%- endfor %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {{- '<think>\\n\\n</think>\\n\\n' if enable_thinking is defined and enable_thinking is false else '<think>\\n' }}
{%- endif %}
"""


def tool_call(city: str) -> dict:
    return {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


def test_structured_tool_calls_are_rendered_and_learned_whole(target, tmp_path):
    """A target whose template renders tool calls (Qwen3.5/3.6's, whose vocabulary holds <tool_call>
    and </tool_call> as tokens): with generation off, every assistant turn is learned, the calls
    included, from their first token. An earlier call opening with <tool_call> is not cut inside it;
    a turn after a tool's result, which the template renders before that call with a <think> block
    it drops once a user message follows, starts where its content does."""
    tools_target = tmp_path / "tools-target"
    tools_tokenizer = AutoTokenizer.from_pretrained(target)
    tools_tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tools_tokenizer.chat_template = TOOL_TEMPLATE
    tools_tokenizer.save_pretrained(tools_target)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    with_result = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [tool_call("Paris")]},
        {"role": "tool", "content": "sunny, 24 C"},
        {"role": "assistant", "content": "It is sunny in Paris."},
        {"role": "user", "content": "And in Rome?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [tool_call("Rome")]},
    ]
    call_only = [
        {"role": "user", "content": "Check Paris."},
        {"role": "assistant", "content": "", "tool_calls": [tool_call("Paris")]},
        {"role": "user", "content": "Never mind."},
        {"role": "assistant", "content": "Fine."},
    ]
    rows = [{"messages": messages, "tools": tools} for messages in (with_result, call_only)]
    index = prepare(make_spec(tools_target, write_jsonl(tmp_path / "tools.jsonl", rows), tmp_path / "out", max_length=1024), workers=1)
    assert index.dropped == {} and index.samples == 2 and index.truncated == 0
    tokenizer = AutoTokenizer.from_pretrained(tools_target)
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\n{}\n</parameter>\n</function>\n</tool_call>"
    expected = [
        [call.format("Paris") + "<|im_end|>", "It is sunny in Paris.<|im_end|>", "\n</think>\n\nLet me look.\n\n" + call.format("Rome") + "<|im_end|>"],
        [call.format("Paris") + "<|im_end|>", "\n</think>\n\nFine.<|im_end|>"],
    ]
    opening = tokenizer.convert_tokens_to_ids("<tool_call>")
    for (_, ids, mask), row, runs in zip(all_samples(read_output(tmp_path / "out")[1]), rows, expected):
        assert tokenizer.decode(ids.tolist()) == tokenizer.apply_chat_template(row["messages"], tools=tools, tokenize=False)
        assert supervised_runs(tokenizer, ids, mask) == runs
        assert ids[int(np.flatnonzero(mask)[0])] == opening  # the first supervised token is <tool_call>, whole
