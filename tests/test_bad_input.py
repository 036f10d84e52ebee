"""Bad input at every door: each failure names the input and the fix, with the exit codes of
DESIGN section 9 for `dflashctl` (2 bad spec or setup, 1 the run failed) and the pod codes of
dflash_jobs.errors for the jobs (2 bad spec, 42 bad input), which the rendered podFailurePolicy
turns into "fail the Job" / "fail this index" instead of pointless retries.

The jobs are driven through their entry points' `main` in this process (what `python -m` runs):
a subprocess per case would spend its time importing torch."""

from __future__ import annotations

import logging
import shutil

import pytest
import yaml
from cli_runner import cli
from extract_helpers import LAYERS, random_chunks, tiny_target, write_prepared
from faults.s3_fault_proxy import S3FaultProxy

from dflash_jobs.errors import EXIT_BAD_INPUT, EXIT_BAD_SPEC
from dflash_jobs.storage import open_storage


def spec_dict(tmp_path, **overrides) -> dict:
    spec = {
        "name": "bad-input", "backend": "local",
        "target": {"model": str(tmp_path / "target"), "layers": LAYERS},
        "data": {"source": str(tmp_path / "chats.jsonl"), "max_length": 48, "chunk_tokens": 512, "holdout": 0},
        "output": str(tmp_path / "out"),
        "extract": {"shards": 1, "token_budget": 96, "pad_multiple": 16, "sort_window": 1},
    }
    for key, value in overrides.items():
        section, _, field = key.partition(".")
        if field:
            spec[section][field] = value
        else:
            spec[section] = value
    return spec


def write(tmp_path, spec: dict | str):
    path = tmp_path / "dflash.yaml"
    path.write_text(spec if isinstance(spec, str) else yaml.safe_dump(spec))
    return path


# ---- the spec --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "names", "fix"),
    [
        ("name: [unclosed\n", "dflash.yaml", "invalid YAML at line"),
        ({"extract.shards": 0}, "extract.shards", "an integer >= 1"),
        ({"extract.dtype": "float16"}, "extract.dtype", "'bfloat16' | 'float8_e4m3fn'"),
        ({"name": "Bad_Name"}, "name", "DNS-1123 label"),
        ({"extract.shard": 4}, "extract.shard", "one of the known keys"),
        ({"output": "gs://bucket/run"}, "output", "s3://bucket/prefix URL"),
        ({"data.chunk_tokens": 16}, "data.chunk_tokens", ">= data.max_length"),
    ],
    ids=["yaml", "shards", "dtype", "name", "unknown-key", "output-scheme", "chunk-size"],
)
def test_a_bad_spec_exits_2_naming_the_field_and_what_is_allowed(spec, names, fix, tmp_path, monkeypatch, capsys):
    path = write(tmp_path, spec if isinstance(spec, str) else spec_dict(tmp_path, **spec))
    for verb in ("plan", "render", "verify", "run"):
        code, _, err = cli(monkeypatch, capsys, verb, "-f", str(path))
        assert code == 2, (verb, err)
        assert names in err and fix in err, (verb, err)


def test_a_spec_with_several_bad_fields_exits_2_naming_each(tmp_path, monkeypatch, capsys):
    path = write(tmp_path, spec_dict(tmp_path, **{"extract.shards": "x", "extract.dtype": "fp9", "train": {"lr": -1}}))
    for verb in ("plan", "render", "verify", "run"):
        code, _, err = cli(monkeypatch, capsys, verb, "-f", str(path))
        assert code == 2 and "Error: 3 spec fields are invalid:" in err, (verb, err)
        assert "extract.shards = 'x'" in err and "extract.dtype = 'fp9'" in err and "train.lr = -1.0" in err, (verb, err)


def test_a_missing_spec_file_names_it_and_dflashctl_init(tmp_path, monkeypatch, capsys):
    code, _, err = cli(monkeypatch, capsys, "status", "-f", str(tmp_path / "nowhere.yaml"))
    assert code == 2 and "nowhere.yaml" in err and "dflashctl init" in err


# ---- the data set and the checkpoint (the jobs) --------------------------------------------------


def logged(capsys, caplog) -> str:
    """What a job's main logged: its handler writes to stdout (prepare replaces the root handlers)."""
    return caplog.text + capsys.readouterr().out


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory)


def test_malformed_jsonl_fails_prepare_naming_the_line_and_the_fix(target, tmp_path, capsys, caplog):
    from dflash_jobs.prepare import main as prepare_main

    (tmp_path / "chats.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
        '{"messages": [{"role": "user", "content": "cut'  # a truncated line
        "\n"
    )
    spec = write(tmp_path, spec_dict(tmp_path, **{"target.model": str(target)}))
    with caplog.at_level(logging.ERROR):
        assert prepare_main(["-f", str(spec), "--strict"]) == EXIT_BAD_SPEC
    text = logged(capsys, caplog)
    assert "data.source line 2" in text and "Fix or remove the row" in text


def test_a_missing_data_source_names_it(target, tmp_path, capsys, caplog):
    from dflash_jobs.prepare import main as prepare_main

    spec = write(tmp_path, spec_dict(tmp_path, **{"target.model": str(target)}))
    with caplog.at_level(logging.ERROR):
        assert prepare_main(["-f", str(spec)]) in (EXIT_BAD_SPEC, 1)
    assert "chats.jsonl" in logged(capsys, caplog)


def extract_shard(spec, shard: int, capsys, caplog) -> tuple[int, str]:
    """`python -m dflash_jobs.extract -f SPEC --shard SHARD`, in this process: its exit code and what it logged."""
    from dflash_jobs.extract.__main__ import main as extract_main

    with caplog.at_level(logging.ERROR):
        code = extract_main(["-f", str(spec), "--shard", str(shard)])
    return code, logged(capsys, caplog)


def broken_checkpoint(target, tmp_path, remove: str):
    broken = tmp_path / "target"
    shutil.copytree(target, broken)
    for path in broken.glob(remove):
        path.unlink()
    return broken


@pytest.mark.parametrize(
    ("remove", "code", "message"),
    [
        ("config.json", EXIT_BAD_SPEC, ["target.model", "config.json"]),
        ("*.safetensors", EXIT_BAD_SPEC, ["target.model", "safetensors"]),
    ],
    ids=["no-config", "no-weights"],
)
def test_a_broken_checkpoint_fails_extraction_naming_it_and_what_it_lacks(remove, code, message, target, tmp_path, capsys, caplog):
    broken_checkpoint(target, tmp_path, remove)
    write_prepared(open_storage(str(tmp_path / "out")), random_chunks(0, 1))
    spec = write(tmp_path, spec_dict(tmp_path))
    exit_code, text = extract_shard(spec, 0, capsys, caplog)
    assert exit_code == code
    assert all(part in text for part in message), text


def test_extraction_before_prepare_names_the_missing_index_and_the_command(target, tmp_path, capsys, caplog):
    spec = write(tmp_path, spec_dict(tmp_path, **{"target.model": str(target)}))
    exit_code, text = extract_shard(spec, 0, capsys, caplog)
    assert exit_code == EXIT_BAD_INPUT
    assert "tokens/dataset.json does not exist" in text and "dflashctl prepare" in text


def test_a_shard_index_outside_the_spec_is_a_spec_error(target, tmp_path, capsys, caplog):
    spec = write(tmp_path, spec_dict(tmp_path, **{"target.model": str(target)}))
    exit_code, text = extract_shard(spec, 3, capsys, caplog)
    assert exit_code == EXIT_BAD_SPEC
    assert "--shard" in text and "extract.shards = 1" in text


# ---- the target: what its architecture lacks ------------------------------------------------------


def chat_check(tmp_path, monkeypatch, capsys, spec) -> dict:
    """`dflashctl check -o json` of a spec whose data.source holds chat rows: its checks by name."""
    import json

    (tmp_path / "chats.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    _, out, _ = cli(monkeypatch, capsys, "check", "-f", str(spec), "-o", "json")
    return {check["name"]: check for check in json.loads(out)["checks"]}


def test_a_target_without_a_chat_template_is_refused_for_chat_rows_by_check_and_prepare(target_of, tmp_path, monkeypatch, capsys, caplog):
    """The tiny Llama with its template removed (chat_template.jinja, where Transformers 5 saves it):
    `dflashctl check` and prepare name target.model and the ways out, before any GPU runs."""
    from dflash_jobs.prepare import main as prepare_main

    broken = broken_checkpoint(target_of("llama"), tmp_path, "chat_template.jinja")
    spec = write(tmp_path, spec_dict(tmp_path))
    target = chat_check(tmp_path, monkeypatch, capsys, spec)["target"]
    assert target["status"] == "fail" and f"{broken}: llama, 8 layers" in target["detail"] and "has no chat template" in target["detail"]
    with caplog.at_level(logging.ERROR):
        assert prepare_main(["-f", str(spec)]) == EXIT_BAD_SPEC
    text = logged(capsys, caplog)
    assert f"target.model {broken}: its tokenizer has no chat template" in text and "chat_template.jinja" in text and "pre-tokenized rows" in text


def test_captured_layers_past_the_targets_depth_are_refused_by_check_and_the_pods_selfcheck(target_of, tmp_path, monkeypatch, capsys):
    """target.layers [1, 3, 8] of the 8-layer tiny Llama: `dflashctl check` fails the target, and the
    extraction pod's selfcheck (its init container) exits 2 before the target is loaded."""
    from dflash_jobs.selfcheck import main as selfcheck_main

    spec = write(tmp_path, spec_dict(tmp_path, **{"target.model": str(target_of("llama")), "target.layers": [1, 3, 8]}))
    target = chat_check(tmp_path, monkeypatch, capsys, spec)["target"]
    assert target["status"] == "fail" and "target.layers = [1, 3, 8] does not fit the checkpoint: expected layer indices 0..7" in target["detail"]
    assert selfcheck_main(["-f", str(spec), "--component", "extract"]) == EXIT_BAD_SPEC
    assert "FAILED target: spec field target.layers = [1, 3, 8] is invalid. Expected layer indices 0..7" in capsys.readouterr().out


# ---- storage: unreachable, wrong credentials ---------------------------------------------------


def test_unreachable_storage_names_the_endpoint_and_the_fix(tmp_path, monkeypatch, capsys):
    from conftest import free_port

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    from dflash_jobs import storage

    # Two attempts instead of ten: the same error, without half a minute of backoff.
    monkeypatch.setattr(storage.open_storage, "__kwdefaults__", {**storage.open_storage.__kwdefaults__, "max_attempts": 2})
    path = write(tmp_path, spec_dict(tmp_path, output="s3://bucket/run"))
    code, _, err = cli(monkeypatch, capsys, "verify", "-f", str(path))
    # Exit 5, not 2: a wrong endpoint and a store that is down look the same from here, and only
    # the second may pass by itself; the message names what to check either way.
    assert code == 5 and "cannot reach the S3 endpoint" in err and "AWS_ENDPOINT_URL" in err


def test_wrong_credentials_name_the_variables_to_fix(s3_server, s3_bucket, tmp_path, monkeypatch, capsys):
    # The loopback S3 server accepts any key; the proxy answers the way AWS does for an unknown one.
    with S3FaultProxy(s3_server, seed=0, rate=1.0, max_faults=1, kinds=("403-invalid-key",)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        path = write(tmp_path, spec_dict(tmp_path, output=f"s3://{s3_bucket}/run"))
        code, _, err = cli(monkeypatch, capsys, "verify", "-f", str(path))
    assert code == 2, err
    assert "refused access" in err and "InvalidAccessKeyId" in err and "AWS_SECRET_ACCESS_KEY" in err
