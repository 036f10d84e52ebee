"""Named prompt sets (eval.prompt_sets): a chat JSONL's prompts as the evaluation decodes them, the
rows that give none counted by why, and a set or a field that is wrong refused, naming it and the fix."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from dflash_jobs.errors import InputError, SpecError
from dflash_jobs.evaluate.prompt_sets import NO_USER_TURN, OVER_CONTEXT, read_prompt_sets
from dflash_jobs.rows import MALFORMED_JSON, MISSING_FIELDS
from dflash_jobs.spec import EvalSpec, parse_spec
from cli_runner import cli

MAX_LENGTH = 96
NEW_TOKENS = 16

TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a loop."}, {"role": "assistant", "content": "for x in y:"},
         {"role": "user", "content": "In C now."}, {"role": "assistant", "content": "for (;;) {}"}]


def write_rows(path, rows) -> str:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def spec_with(tmp_path, target_dir, prompt_sets, **eval_settings):
    return parse_spec({
        "name": "sets", "backend": "local", "target": {"model": str(target_dir)}, "data": {"source": str(tmp_path / "unused.jsonl"),
        "max_length": MAX_LENGTH}, "output": str(tmp_path / "run"),
        "eval": {"max_new_tokens": NEW_TOKENS, "prompt_sets": prompt_sets, **eval_settings},
    })


def test_a_sets_prompts_run_through_the_last_user_turn_and_refused_rows_are_counted_by_why(tmp_path, target_dir):
    source = write_rows(tmp_path / "set.jsonl", [
        {"messages": [{"role": "user", "content": "What is 2 + 2?"}]},
        {"messages": TURNS},
        {"messages": [{"role": "assistant", "content": "Hello."}]},
        "not json",
        {"prompt": "a completion row, not a chat"},
        {"messages": [{"role": "user", "content": "word " * MAX_LENGTH}]},
    ])
    spec = spec_with(tmp_path, target_dir, {"mixed": source})
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    (read,) = read_prompt_sets(spec)
    expected = [tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                for messages in ([{"role": "user", "content": "What is 2 + 2?"}], TURNS[:4])]
    assert [tokenizer.decode(p) for p in read.prompts] == expected
    assert read.describe() == {"source": source, "rows": 6, "prompts": 2,
                               "refused": {MALFORMED_JSON: 1, MISSING_FIELDS: 1, NO_USER_TURN: 1, OVER_CONTEXT: 1}}
    # At most eval.prompts prompts, reading no further than the last one taken.
    (first,) = read_prompt_sets(spec_with(tmp_path, target_dir, {"mixed": source}, prompts=1))
    assert (first.rows, len(first.prompts)) == (1, 1)


def test_a_set_that_gives_no_prompt_is_refused_naming_it_and_the_fix(tmp_path, target_dir):
    source = write_rows(tmp_path / "answers.jsonl", [{"messages": [{"role": "assistant", "content": "Hi."}]}, "[1, 2]"])
    with pytest.raises(InputError, match=r"eval.prompt_sets.answers .*answers.jsonl.* no prompt from its 2 rows") as caught:
        read_prompt_sets(spec_with(tmp_path, target_dir, {"answers": source}))
    assert "user turn" in caught.value.fix and f"data.max_length ({MAX_LENGTH})" in caught.value.fix
    with pytest.raises(SpecError) as missing:
        read_prompt_sets(spec_with(tmp_path, target_dir, {"gone": str(tmp_path / "gone.jsonl")}))
    assert missing.value.field == "eval.prompt_sets.gone"


@pytest.mark.parametrize("prompt_sets, field", [
    (["mt_bench.jsonl"], "eval.prompt_sets"), ({"1st": "a.jsonl"}, "eval.prompt_sets"), ({"mt bench": "a.jsonl"}, "eval.prompt_sets"),
    ({"mt_bench": "http://host/mt.jsonl"}, "eval.prompt_sets.mt_bench"), ({"mt_bench": ""}, "eval.prompt_sets.mt_bench"),
])
def test_bad_prompt_sets_are_refused_at_the_edge(prompt_sets, field):
    with pytest.raises(SpecError) as caught:
        EvalSpec(prompt_sets=prompt_sets)
    assert caught.value.field == field
    assert EvalSpec().prompt_sets == {} and EvalSpec().timed_prompts == 16
    with pytest.raises(SpecError, match="eval.timed_prompts"):
        EvalSpec(timed_prompts=0)


def test_dflashctl_eval_refuses_a_bad_prompt_set_before_it_starts_anything(tmp_path, monkeypatch, capsys):
    spec = tmp_path / "dflash.yaml"
    spec.write_text(json.dumps({"name": "sets", "backend": "local", "target": {"model": str(tmp_path / "m")},
                                "data": {"source": str(tmp_path / "d.jsonl")}, "output": str(tmp_path / "out")}))
    code, _, err = cli(monkeypatch, capsys, "eval", "-f", str(spec), "--prompt-set", "mt_bench")
    assert code == 2 and "NAME=FILE" in err
    code, _, err = cli(monkeypatch, capsys, "eval", "-f", str(spec), "--prompt-set", "9x=./a.jsonl")
    assert code == 2 and "eval.prompt_sets" in err and not (tmp_path / "out").exists()
