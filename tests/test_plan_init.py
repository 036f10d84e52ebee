"""`dflashctl init` writes a valid, complete, commented spec; `dflashctl plan` bills it correctly."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import typing
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dflash_jobs.errors import SpecError
from dflash_jobs.formats import DATASET_KEY, ChunkInfo, DatasetIndex
from dflash_jobs.spec import RunSpec, parse_spec
from dflash_jobs.storage import open_storage

from dflashctl.cli.app import app
from dflashctl.errors import EXIT_USAGE, exit_code
from dflashctl.starter import STARTER_VALUES, field_docs, starter_spec

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]


def _sections(cls: type, raw: dict, path: str = "") -> list[str]:
    """Every dotted field path of `cls` missing from the mapping `raw` (nested sections included)."""
    missing = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            missing.append(path + f.name)
            continue
        nested = hints[f.name]
        if dataclasses.is_dataclass(nested):
            missing += _sections(nested, raw[f.name], f"{path}{f.name}.")
    return missing


def test_init_writes_a_valid_spec_with_every_field_at_its_default(tmp_path):
    spec_file = tmp_path / "dflash.yaml"
    result = runner.invoke(app, ["init", "-f", str(spec_file)])
    assert result.exit_code == 0, result.output
    text = spec_file.read_text()
    raw = yaml.safe_load(text)
    assert _sections(RunSpec, raw) == []
    # Every value is the default, except what the starter fills in (the required fields, the PVC).
    assert parse_spec(raw) == parse_spec(STARTER_VALUES)
    assert parse_spec(raw).to_dict() == parse_spec(STARTER_VALUES).to_dict()


def test_the_starter_says_where_init_filled_in_a_value_and_shows_the_default_everywhere_else():
    """Issue 37, item 3: the header's promise holds. Every value is its field's default, but the ones
    whose comment says `dflashctl init` filled them in, and those comments give the default."""
    lines = starter_spec().splitlines()
    said, comment = {}, []
    for line in lines[lines.index("name: qwen36-27b-v1") - 2:]:
        if line.strip().startswith("#"):
            comment.append(line.strip().lstrip("# "))
        elif ":" in line and line.strip():
            said[line.split(":")[0]] = " ".join(comment)
            comment = []
    filled = {key.strip() for key, note in said.items() if "`dflashctl init`" in note}
    assert filled == {"name", "model", "source", "output", "generate", "model_volume", "claim"}, filled
    assert "Filled in by `dflashctl init`; the default is null." in said["generate"] and "the default is null" in said["  model_volume"]
    # Everything else is the default: the starter without init's values differs only there.
    raw = yaml.safe_load(starter_spec())
    assert parse_spec(raw) == parse_spec(STARTER_VALUES)


def _spec_classes(cls: type) -> list[type]:
    hints = typing.get_type_hints(cls)
    nested = [arg for f in dataclasses.fields(cls) for arg in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(arg)]
    return [cls] + [c for n in nested for c in _spec_classes(n)]


def test_init_explains_each_field_with_its_docstring():
    text = starter_spec()
    lines = text.splitlines()
    # Comment text, also of the commented-out optional sections ("#   # doc" lines).
    comments = " ".join(re.sub(r"^[#\s]+", "", line) for line in lines if line.strip().startswith("# "))
    classes = _spec_classes(RunSpec)
    assert len(classes) >= 9  # RunSpec, its eight sections, the model volume
    for cls in classes:
        for name, doc in field_docs(cls).items():
            assert doc in comments, f"{cls.__name__}.{name}"
    assert lines[lines.index("  chunk_tokens: 65536") - 1] == "  # Target size of one work unit (a token chunk and its hidden-state chunk)."
    assert lines[lines.index("backend: kubernetes") - 1] == "# One of: kubernetes, local."
    # An optional section left off is there to turn on: uncommented, it parses with every default.
    first = lines.index("  dflash2: null") + 1
    block = lines[first:first + 1] + list(itertools.takewhile(lambda line: line.startswith("  #   "), lines[first + 1:]))
    block = [line.replace("# ", "", 1) for line in block]
    assert block[0] == "  dflash2:" and len(block) > 2
    turned_on = parse_spec({**STARTER_VALUES, "train": {"drafter": "dflash2", **yaml.safe_load("\n".join(block))}})
    assert turned_on.train.dflash2 == parse_spec({**STARTER_VALUES, "train": {"drafter": "dflash2"}}).train.dflash2
    # Only such sections: an optional nested one left off (no model volume) stays a plain null.
    without_volume = starter_spec({**STARTER_VALUES, "target": {"model": "s3://my-bucket/models/Qwen3.6-27B"}, "cluster": {}})
    assert "  model_volume: null" in without_volume.splitlines() and "  # model_volume:" not in without_volume.splitlines()


def test_the_starter_regenerates_answers_cites_only_what_exists_and_flags_the_images():
    text = starter_spec()
    spec = parse_spec(yaml.safe_load(text))
    # Every real run regenerates the answers with the target (README): generation is on, with vLLM.
    assert spec.generate is not None and spec.generate.engine == "vllm"
    assert "generate: null" not in text.splitlines()
    # The header points at files of this repository only.
    header = text[: text.index("\nname:")]
    cited = re.findall(r"\b(?:[\w-]+/)*[\w-]+\.md\b|\b(?:[\w-]+/)+[\w.-]+\.yaml\b", header)  # not dflash.yaml itself
    assert cited and all((REPO / path).is_file() for path in cited), cited
    assert "DESIGN" not in header
    # The images are the user's to build and push: the starter says so where it sets them.
    cluster = text[text.index("\ncluster:") - 300: text.index("\ncluster:")]
    assert "placeholders, not published images" in cluster and "images/README.md" in cluster
    assert (REPO / "images" / "README.md").is_file()


def test_a_number_in_yaml_1_2_spelling_is_read_as_the_number_it_is(tmp_path):
    """PyYAML reads YAML 1.1, where `6e-4` (no dot) is a string: a float field takes it as the number
    the user wrote; a value that is no number is still refused, and an integer field says how to write it."""
    spec_file = tmp_path / "dflash.yaml"
    starter = starter_spec().replace("  lr: 0.0006\n", "  lr: 6e-4\n")
    assert "  lr: 6e-4" in starter and yaml.safe_load(starter)["train"]["lr"] == "6e-4"
    spec_file.write_text(starter)
    assert runner.invoke(app, ["plan", "-f", str(spec_file), "-o", "json"]).exit_code == 0
    assert parse_spec(yaml.safe_load(starter)).train.lr == 6e-4
    assert parse_spec({**STARTER_VALUES, "train": {"lr": "1E-3", "warmup_ratio": ".05"}}).train.warmup_ratio == 0.05
    for bad in ("fast", "1_000", ".inf", "6e-4 "):
        with pytest.raises(SpecError, match=r"train\.lr .*Expected a number"):
            parse_spec({**STARTER_VALUES, "train": {"lr": bad}})
    with pytest.raises(SpecError, match=r"Expected an integer \(YAML read 1e6 as a string: write 1000000\)"):
        parse_spec({**STARTER_VALUES, "train": {"anchors": yaml.safe_load("anchors: 1e6")["anchors"]}})
    with pytest.raises(SpecError, match=r"Expected an integer \(write 512\)"):
        parse_spec({**STARTER_VALUES, "train": {"anchors": 512.0}})


def test_init_refuses_to_overwrite_without_force(tmp_path):
    spec_file = tmp_path / "dflash.yaml"
    spec_file.write_text("name: mine\n")
    refused = runner.invoke(app, ["init", "-f", str(spec_file)])
    assert exit_code(refused.exception) == EXIT_USAGE and "--force" in str(refused.exception)
    assert spec_file.read_text() == "name: mine\n"
    assert runner.invoke(app, ["init", "-f", str(spec_file), "--force"]).exit_code == 0
    assert parse_spec(yaml.safe_load(spec_file.read_text())).name == STARTER_VALUES["name"]


# ---- plan --------------------------------------------------------------------------------------


def write_run(tmp_path, *, tokens: int | None, samples: int = 1000, layers=None, dtype="bfloat16", shards=8) -> str:
    """A spec file, a checkpoint config.json of the 27B's shape and, if `tokens`, a tokens/dataset.json."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": {"hidden_size": 5120, "num_hidden_layers": 64}}))
    source = tmp_path / "chats.jsonl"
    source.write_bytes(b"x" * 4_000_000)
    output = tmp_path / "out"
    if tokens is not None:
        index = DatasetIndex(samples=samples, tokens=tokens, vocab_size=248077, chunks=[ChunkInfo(0, "tokens/chunks/000000.safetensors", samples, tokens)])
        open_storage(str(output)).put_bytes(DATASET_KEY, index.to_json().encode())
    spec = {
        "name": "bill", "backend": "local", "target": {"model": str(model), "layers": layers}, "data": {"source": str(source)},
        "output": str(output), "extract": {"shards": shards, "dtype": dtype},
    }
    spec_file = tmp_path / "dflash.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    return str(spec_file)


def plan_json(*args: str) -> dict:
    result = runner.invoke(app, ["plan", *args, "-o", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_plan_from_the_dataset_index_matches_hand_computed_figures(tmp_path):
    plan = plan_json("-f", write_run(tmp_path, tokens=1_000_000_000))
    # 5 default layers [1, 16, 31, 46, 61] of hidden 5120.
    assert plan["target"]["layers"] == [1, 16, 31, 46, 61] and plan["target"]["hidden_size"] == 5120
    assert plan["data"] == {"samples": 1000, "tokens": 1_000_000_000, "estimated": False, "basis": f"{tmp_path / 'out'}/{DATASET_KEY}",
                            "tokens_upper_bound": None}
    # bf16: 5 x 5120 x 2 bytes + 4 (input_id) + 1 (loss_mask) = 51,205 bytes per token.
    # fp8:  5 x (5120 + 4 bytes of scale) + 5                  = 25,625 bytes per token.
    assert plan["bytes_per_token"] == {"bfloat16": 51_205, "float8_e4m3fn": 25_625}
    assert plan["storage_tb"] == pytest.approx({"bfloat16": 51.205, "float8_e4m3fn": 25.625})
    # 1e9 tokens / 11,973 tokens/s (measured: bf16, compiled as a GPU pod is by default,
    # bench/results/extract-compile-h200.json) / 3600 s = 23.200 GPU-hours; on 8 shards 2.900 hours.
    assert plan["tokens_per_second_per_gpu"] == 11973.0
    assert plan["gpu_hours"] == pytest.approx(23.200349)
    assert plan["wall_clock_hours"] == pytest.approx(2.900044)
    # 8 GPUs x 11,973 tokens/s x 51,205 bytes = 4,904.6 MB/s; fp8 x 25,625 bytes = 2,454.5 MB/s.
    assert plan["upload_mb_per_s_per_node"] == pytest.approx({"bfloat16": 4904.61972, "float8_e4m3fn": 2454.465})
    # Training: 6 epochs x 1e9 tokens / 14,288 tokens/s (compiled, no checkpointing: bench/results/train-compile-h200.json)
    # / 3600 s = 116.648 GPU-hours; on 1 node x 8 GPUs 14.581 hours.
    assert plan["train_gpu_hours"] == pytest.approx(116.648003)
    assert plan["train_wall_clock_hours"] == pytest.approx(14.581000)


def test_plan_bills_what_training_reads_from_storage_and_warns_where_the_store_cannot_keep_up(tmp_path):
    spec_file = write_run(tmp_path, tokens=1_000_000_000)
    reads = plan_json("-f", spec_file)["training_reads"]
    # 1e9 tokens x 51,205 bytes = 51.205 TB over 8 ranks: 6.400625 TB each, against 64 GiB / 8 of
    # cache: 8 GiB kept (0.134%), the rest read again every epoch after the first.
    assert reads["share_tb_per_rank"] == pytest.approx(6.400625) and reads["cache_gib_per_rank"] == 8.0
    assert reads["fits_cache"] is False and reads["resident_fraction"] == pytest.approx(8 * 2**30 / 6.400625e12)
    later = 51.205 * (1 - 8 * 2**30 / 6.400625e12)
    assert reads["read_tb_first_epoch"] == pytest.approx(51.205) and reads["read_tb_per_later_epoch"] == pytest.approx(later)
    assert reads["read_tb_total"] == pytest.approx(51.205 + 5 * later)
    # 14,288 tokens/s x 51,205 bytes = 731.6 MB/s per GPU, 5,852.9 MB/s for the node's 8.
    assert reads["consumed_mb_per_s_per_gpu"] == pytest.approx(731.61704)
    assert reads["store_mb_per_s_per_node_first_epoch"] == pytest.approx(5852.93632)
    first, later_epochs = reads["warnings"]
    assert "5,853 MB/s per node" in first and "over the 2,000 MB/s" in first and "float8_e4m3fn" in first
    # The whole share on each node: 6.400625e12 x 8 / 2^30 = 47,688.2 GiB; or 51.205 TB / 64 GiB = 745.1 -> 746 nodes.
    assert "train.cache_gb: 47,689" in later_epochs and "train.nodes: 746" in later_epochs and "float8_e4m3fn" in later_epochs

    spec = yaml.safe_load(open(spec_file))
    spec["train"] = {"cache_gb": 50_000, "cache_storage_class": "local-nvme"}
    spec["extract"]["dtype"] = "float8_e4m3fn"
    open(spec_file, "w").write(yaml.safe_dump(spec))
    fits = plan_json("-f", spec_file, "--store-mb-per-s", "3000")["training_reads"]
    # fp8: 25,625 bytes a token; the share (3.203 TB) fits the cache: nothing is read twice; and 8 x
    # 14,288 x 25,625 = 2,929.04 MB/s stays under the 3,000 given.
    assert fits["fits_cache"] is True and fits["read_tb_per_later_epoch"] == 0 and fits["read_tb_total"] == pytest.approx(25.625)
    assert fits["store_mb_per_s_per_node_first_epoch"] == pytest.approx(2929.04) and fits["warnings"] == []
    table = runner.invoke(app, ["plan", "-f", spec_file])
    assert "100% of it stays on local disk" in table.stdout and "warning: the first epoch" in table.stderr


def test_plan_rate_flag_layers_and_small_jobs(tmp_path):
    spec_file = write_run(tmp_path, tokens=36_000_000, layers=[3, 7, 11], shards=2, dtype="float8_e4m3fn")
    plan = plan_json("-f", spec_file, "--tokens-per-second", "10000")
    assert plan["dtype"] == "float8_e4m3fn"
    assert plan["bytes_per_token"]["float8_e4m3fn"] == 3 * (5120 + 4) + 5
    assert plan["gpu_hours"] == pytest.approx(1.0)  # 36e6 / 1e4 / 3600
    assert plan["wall_clock_hours"] == pytest.approx(0.5)
    # Two shards: two GPUs upload from a node, not eight.
    assert plan["gpus_per_node"] == 2
    assert plan["upload_mb_per_s_per_node"]["float8_e4m3fn"] == pytest.approx(10_000 * 15_377 * 2 / 1e6)
    trained = plan_json("-f", spec_file, "--train-tokens-per-second", "12000")
    assert trained["train_gpu_hours"] == pytest.approx(36e6 * 6 / 12_000 / 3600)


@pytest.mark.parametrize(
    "extract, train, rate, train_rate",
    [
        ({"compute_dtype": "float8"}, {}, 16775.0, 14288.0),
        ({"compute_dtype": "float8", "compile": False}, {}, 13092.0, 14288.0),
        ({"compile": False}, {"compile": False}, 10408.0, 11228.0),
        ({"compile": True}, {"compile": True}, 11973.0, 14288.0),
    ],
)
def test_plan_uses_the_measured_rate_of_the_compute_dtype_and_compilation(tmp_path, extract, train, rate, train_rate):
    spec_file = write_run(tmp_path, tokens=36_000_000)
    spec = yaml.safe_load(open(spec_file))
    spec["extract"].update(extract)
    spec["train"] = train
    open(spec_file, "w").write(yaml.safe_dump(spec))
    plan = plan_json("-f", spec_file)
    assert plan["tokens_per_second_per_gpu"] == rate
    assert plan["gpu_hours"] == pytest.approx(36e6 / rate / 3600)
    assert plan["train_tokens_per_second_per_gpu"] == train_rate
    assert plan["train_gpu_hours"] == pytest.approx(36e6 * 6 / train_rate / 3600)


def test_plan_before_prepare_estimates_from_the_source_size(tmp_path):
    plan = plan_json("-f", write_run(tmp_path, tokens=None))
    assert plan["data"]["estimated"] is True and plan["data"]["samples"] is None
    assert plan["data"]["tokens"] == 1_000_000  # 4,000,000 bytes at 4 bytes/token
    assert plan["storage_tb"]["bfloat16"] == pytest.approx(1e6 * 51_205 / 1e12)


def test_plan_table_states_its_basis(tmp_path):
    result = runner.invoke(app, ["plan", "-f", write_run(tmp_path, tokens=None)])
    assert result.exit_code == 0, result.output
    assert "1,000,000 (estimate)" in result.stdout
    assert "storage bfloat16" in result.stdout and "4,905 MB/s" in result.stdout
    assert "estimate: 4,000,000 bytes" in result.stderr


def test_plan_without_a_readable_checkpoint_assumes_the_27b_and_says_so(tmp_path):
    spec_file = tmp_path / "dflash.yaml"
    spec_file.write_text(starter_spec({**STARTER_VALUES, "backend": "local", "data": {"source": str(tmp_path / "absent.jsonl")}, "output": str(tmp_path / "out")}))
    plan = plan_json("-f", str(spec_file))
    assert plan["target"]["hidden_size"] == 5120 and plan["target"]["layers"] == [1, 16, 31, 46, 61]
    assert plan["target"]["basis"].startswith("assumed Qwen3.6-27B: /models/Qwen3.6-27B/config.json cannot be read (no such file on this machine)")
    assert "Upload" not in plan["target"]["basis"] and "object" not in plan["target"]["basis"]  # a path, not S3
    assert plan["data"]["tokens"] is None and plan["gpu_hours"] is None


def test_plan_rejects_layers_deeper_than_the_checkpoint(tmp_path):
    result = runner.invoke(app, ["plan", "-f", write_run(tmp_path, tokens=10, layers=[1, 64])])
    assert isinstance(result.exception, SpecError) and exit_code(result.exception) == EXIT_USAGE
    assert "0..63" in str(result.exception)


def with_settings(spec_file: str, *, extract: dict | None = None, train: dict | None = None) -> str:
    spec = yaml.safe_load(open(spec_file))
    spec["extract"].update(extract or {})
    spec["train"] = train or {}
    open(spec_file, "w").write(yaml.safe_dump(spec))
    return spec_file


def test_plan_bills_the_final_hidden_state_where_the_drafter_reads_it(tmp_path):
    plan = plan_json("-f", with_settings(write_run(tmp_path, tokens=1_000_000_000), train={"drafter": "dspark"}))
    # 5 layers + the final hidden state: 6 x 5120 x 2 + 5 = 61,445 bytes a token; fp8: 6 x (5120 + 4) + 5 = 30,749.
    assert plan["bytes_per_token"] == {"bfloat16": 61_445, "float8_e4m3fn": 30_749}
    assert plan["storage_tb"] == pytest.approx({"bfloat16": 61.445, "float8_e4m3fn": 30.749})
    final = plan["final_hidden"]
    # Its own line: 5120 x 2 = 10,240 bytes a token, +20.0% over the 51,205 without it; 1e9 tokens: 10.24 TB.
    assert final["stored"] is True and final["dtype"] == "bfloat16" and final["bytes_per_token"] == 10_240
    assert final["fraction"] == pytest.approx(10_240 / 51_205) and final["storage_tb"] == pytest.approx(10.24)
    # Uploaded by 8 GPUs at 11,973 tokens/s: 980.8 MB/s a node; read by training at 14,288 tokens/s: 146.3 MB/s a GPU, 1,170.5 a node.
    assert final["upload_mb_per_s_per_node"] == pytest.approx(11_973 * 10_240 * 8 / 1e6)
    assert final["train_read_mb_per_s_per_gpu"] == pytest.approx(146.30912)
    assert final["train_read_mb_per_s_per_node"] == pytest.approx(1170.47296)
    # ...and in the training read bill: 14,288 x 61,445 = 877.9 MB/s a GPU.
    assert plan["training_reads"]["consumed_mb_per_s_per_gpu"] == pytest.approx(877.92616)
    assert plan["upload_mb_per_s_per_node"]["bfloat16"] == pytest.approx(11_973 * 61_445 * 8 / 1e6)
    table = runner.invoke(app, ["plan", "-f", str(tmp_path / "dflash.yaml")], env={"COLUMNS": "400"})  # one line a row
    assert "final hidden state" in table.stdout and "stored, in the figures below: +10,240 bytes/token (+20%, bfloat16), 10.2 TB, +981 MB/s upload per node, +146 MB/s training reads per GPU (1,170 per node)" in table.stdout


def test_plan_says_what_the_final_hidden_state_would_add_when_not_stored(tmp_path):
    plan = plan_json("-f", with_settings(write_run(tmp_path, tokens=1_000_000_000), extract={"dtype": "float8_e4m3fn"}))
    assert plan["bytes_per_token"]["float8_e4m3fn"] == 25_625  # without it
    final = plan["final_hidden"]
    assert final["stored"] is False and final["bytes_per_token"] == 5_124 and final["fraction"] == pytest.approx(5_124 / 25_625)
    table = runner.invoke(app, ["plan", "-f", str(tmp_path / "dflash.yaml")], env={"COLUMNS": "400"})  # one line a row
    assert "not stored (extract.final_hidden); it would add +5,124 bytes/token (+20%, float8_e4m3fn), 5.12 TB" in table.stdout

    stored = plan_json("-f", with_settings(str(tmp_path / "dflash.yaml"), extract={"final_hidden": True}, train={"drafter": "dflash2"}))
    assert stored["final_hidden"]["stored"] is True and stored["bytes_per_token"]["float8_e4m3fn"] == 25_625 + 5_124


def test_plan_refuses_a_drafter_that_reads_the_final_hidden_state_on_verified_states_without_it(tmp_path):
    from dflash_jobs.errors import InputError
    from dflash_jobs.formats import MANIFEST_KEY, DoneMarker, Manifest

    spec_file = with_settings(write_run(tmp_path, tokens=1000), train={"drafter": "dspark"})
    plan_json("-f", spec_file)  # no manifest yet: nothing to check against
    marker = DoneMarker(chunk=0, samples=1000, tokens=1000, bytes=1, sha256="0", etag=None, dtype="bfloat16", layers=[1, 16, 31, 46, 61], hidden_size=5120)
    manifest = Manifest(model="m", layers=marker.layers, dtype="bfloat16", hidden_size=5120, samples=1000, tokens=1000, bytes=1, chunks=[marker])
    output = open_storage(str(tmp_path / "out"))
    output.put_bytes(MANIFEST_KEY, manifest.to_json().encode())
    refused = runner.invoke(app, ["plan", "-f", spec_file])
    assert isinstance(refused.exception, InputError) and exit_code(refused.exception) == EXIT_USAGE
    assert "hold no final hidden state of the target" in str(refused.exception) and "train.dspark.ce_only: true" in str(refused.exception)
    plan_json("-f", with_settings(spec_file, train={"drafter": "dspark", "dspark": {"ce_only": True}}))
    output.put_bytes(MANIFEST_KEY, Manifest(**{**manifest.__dict__, "final_hidden": "bfloat16"}).to_json().encode())
    plan_json("-f", with_settings(spec_file, train={"drafter": "dspark"}))


def test_plan_prices_stored_and_online_states_side_by_side_and_picks(tmp_path):
    """A 27B target (54 GB of weights, an untied head) beside its drafter on a 96 GB card: bf16 does not
    fit online, FP8 compute with mlp checkpointing does; where it fits, the cheaper path at the stated prices."""
    spec_file = write_run(tmp_path, tokens=1_000_000_000)
    model = tmp_path / "model"
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": {
        "hidden_size": 5120, "num_hidden_layers": 64, "vocab_size": 248320, "tie_word_embeddings": False}}))
    with open(model / "model.safetensors", "wb") as weights:
        weights.truncate(54_000_000_000)  # sparse: the size is what the plan reads
    plan = plan_json("-f", spec_file)
    states = plan["states"]
    head = 248320 * 5120 * 2
    # bf16: (54e9 - the head) bytes of weights (capture never loads the head), the drafter's compiled peak 66.7 GiB,
    # the capture buffer of 16,384 tokens x 5 layers x 5120 x 2 bytes, and 4 GiB of activations.
    capture = 16384 * 5 * 5120 * 2 / 2**30
    assert states["target_gib"]["bfloat16"] == pytest.approx((54e9 - head) / 2**30)
    assert states["target_gib"]["float8"] == pytest.approx(((54e9 - 2 * head) / 2 + head) / 2**30)
    assert states["rank_gib"]["bfloat16"] == pytest.approx(states["target_gib"]["bfloat16"] + 66.7 + capture + 4.0)
    assert states["fits"] == {"bfloat16": False, "float8": False} and states["card_gib"] == 96.0
    assert states["pick"] == "stored" and "extract.compute_dtype: float8 and train.activation_checkpointing: mlp" in states["why"]
    # 6 epochs of the target's forward (at the extractor's rate: 23.2 GPU-hours an epoch) against 51.2 TB and one extraction.
    assert states["online_forward_gpu_hours"] == pytest.approx(6 * 23.200349)
    assert states["stored_tb"] == pytest.approx(51.205)

    online = plan_json("-f", with_settings(spec_file, extract={"compute_dtype": "float8"}, train={"activation_checkpointing": "mlp", "states": "online"}),
                       "--gpu-hour-usd", "1", "--tb-month-usd", "1000")
    assert online["states"]["fits"]["float8"] and online["states"]["states"] == "online"
    assert online["states"]["pick"] == "online" and online["states"]["online_usd"] < online["states"]["stored_usd"]
    stored = plan_json("-f", spec_file, "--gpu-hour-usd", "100", "--tb-month-usd", "1")
    assert stored["states"]["pick"] == "stored" and "epochs of target forwards cost more" in stored["states"]["why"]
