"""The exact vLLM command that serves a run's drafter: num_speculative_tokens = block_size - 1 (vLLM
never reads block_size), the attention backend and runner its layers need, local paths for vLLM;
shown by the evaluation report and by `dflashctl status` once the drafter is exported."""

from __future__ import annotations

import json
import shlex
import textwrap
from pathlib import Path

import pytest
import yaml

from dflash_jobs.drafter.model import DrafterConfig
from dflash_jobs.drafter.serving import run_serve_command, vllm_serve_command
from dflash_jobs.errors import FormatError
from dflash_jobs.formats import DRAFTER_CONFIG_KEY, EVAL_REPORT_KEY
from dflash_jobs.spec import load_spec, parse_spec
from dflash_jobs.storage import open_storage
from dflashctl.cli.main import main
from dflashctl.cli.options import OutputFormat
from dflashctl.cli.reporting import print_report


def exported(*, block_size=16, sliding=0, layers=5) -> dict:
    """The config.json the export writes (DrafterConfig.to_zlab), for a Qwen3.6-27B-shaped drafter."""
    config = DrafterConfig(
        hidden_size=5120, num_layers=layers, num_attention_heads=24, num_key_value_heads=4, head_dim=256, intermediate_size=17408,
        vocab_size=248320, target_layer_ids=[1, 16, 31, 46, 61], num_target_layers=64, block_size=block_size, mask_token_id=248070,
        layer_types=["sliding_attention"] * sliding + ["full_attention"] * (layers - sliding),
    )
    return json.loads(json.dumps(config.to_zlab()))


def speculative_config_of(command: str) -> dict:
    words = shlex.split(command[command.index("vllm serve"):])
    return json.loads(words[words.index("--speculative-config") + 1])


def test_local_drafter_full_attention():
    command = vllm_serve_command(target="/models/Qwen3.6-27B", drafter="/runs/v1/train/drafter", exported=exported())
    assert command == (
        "vllm serve /models/Qwen3.6-27B \\\n"
        """  --speculative-config '{"method": "dflash", "model": "/runs/v1/train/drafter", "num_speculative_tokens": 15}' \\\n"""
        "  --attention-backend flash_attn"
    )
    words = shlex.split(command)  # valid shell: the JSON survives quoting
    assert words[:3] == ["vllm", "serve", "/models/Qwen3.6-27B"]
    assert speculative_config_of(command) == {"method": "dflash", "model": "/runs/v1/train/drafter", "num_speculative_tokens": 15}


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_num_speculative_tokens_is_block_size_minus_one(block_size):
    command = vllm_serve_command(target="/t", drafter="/d", exported=exported(block_size=block_size))
    assert speculative_config_of(command)["num_speculative_tokens"] == block_size - 1


def test_mixed_layers_need_the_v2_runner_and_all_sliding_layers_no_non_causal_backend():
    mixed = vllm_serve_command(target="/t", drafter="/d", exported=exported(sliding=4))  # z-lab's Qwen3.6-27B drafter
    assert mixed.startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve /t") and "--attention-backend flash_attn" in mixed
    causal = vllm_serve_command(target="/t", drafter="/d", exported=exported(sliding=5))
    assert causal.startswith("vllm serve /t") and "--attention-backend" not in causal


def exported_dflash2(*, block_size=8, sliding=5, layers=5) -> dict:
    """The config.json of a DFlash2 export (DFlash2Config.to_zlab), Qwen3.6-27B-shaped, z-lab's layout by default."""
    from dflash_jobs.drafter.dflash2_model import DFlash2Config

    config = DFlash2Config(**DrafterConfig.from_zlab(exported(block_size=block_size, sliding=sliding, layers=layers)).to_dict() | {"is_causal": False})
    return json.loads(json.dumps(config.to_zlab()))


def test_dflash2_serves_block_size_minus_one_on_the_v2_runner_of_vllm_0_28_with_a_non_causal_backend():
    command = vllm_serve_command(target="/models/Qwen3.6-27B", drafter="/runs/v1/train/drafter", exported=exported_dflash2())
    assert command == (
        "# a dflash2 drafter needs vLLM >= 0.28.0\n"
        "VLLM_USE_V2_MODEL_RUNNER=1 vllm serve /models/Qwen3.6-27B \\\n"
        """  --speculative-config '{"method": "dflash", "model": "/runs/v1/train/drafter", "num_speculative_tokens": 7}' \\\n"""
        "  --attention-backend flash_attn"
    )
    assert shlex.split(command, comments=True)[:4] == ["VLLM_USE_V2_MODEL_RUNNER=1", "vllm", "serve", "/models/Qwen3.6-27B"]  # the note is a comment
    # The V2 runner whatever the layers (V1 would draft it as DFlash); all-sliding layers still need
    # the non-causal backend, since is_causal false makes them bidirectional (DFlash's would be causal).
    for block_size, sliding in ((4, 0), (16, 2)):
        command = vllm_serve_command(target="/t", drafter="/d", exported=exported_dflash2(block_size=block_size, sliding=sliding))
        assert "VLLM_USE_V2_MODEL_RUNNER=1 vllm serve" in command and command.endswith("--attention-backend flash_attn")
        assert speculative_config_of(command)["num_speculative_tokens"] == block_size - 1


def test_an_architecture_vllm_is_not_told_how_to_serve_is_refused_naming_the_file():
    unknown = exported() | {"architectures": ["Eagle3DraftModel"]}
    with pytest.raises(FormatError, match=r"train/drafter/config.json names architectures \['Eagle3DraftModel'\], none of which"):
        vllm_serve_command(target="/t", drafter="/d", exported=unknown)


def test_s3_locations_are_synced_to_local_directories_first():
    command = vllm_serve_command(
        target="s3://models/Qwen3.6-27B/", drafter="s3://bucket/dflash/v1/train/drafter", exported=exported(),
        endpoint_url="https://minio.example:9000",
    )
    lines = command.splitlines()
    assert lines[0] == "aws s3 sync --endpoint-url https://minio.example:9000 s3://bucket/dflash/v1/train/drafter ./drafter"
    assert lines[1] == "aws s3 sync --endpoint-url https://minio.example:9000 s3://models/Qwen3.6-27B ./Qwen3.6-27B"
    assert lines[2].startswith("vllm serve ./Qwen3.6-27B")
    assert speculative_config_of(command)["model"] == "./drafter"


def test_a_config_without_block_size_is_refused_naming_the_file():
    broken = exported()
    del broken["block_size"]
    with pytest.raises(FormatError, match="train/drafter/config.json has no block_size"):
        vllm_serve_command(target="/t", drafter="/d", exported=broken)


def test_the_report_table_ends_with_the_command(capsys):
    print_report({"block_size": 16, "drafters": {}, "greedy": {}, "vllm_serve": "vllm serve /t \\\n  --x"}, OutputFormat.table)
    assert capsys.readouterr().out.endswith("serve it with vLLM:\nvllm serve /t \\\n  --x\n")


def finished_run(tmp_path, config: dict | bytes):
    output = tmp_path / "out"
    spec = {"name": "served", "backend": "local", "target": {"model": "/models/Qwen3.6-27B"}, "data": {"source": "/d.jsonl"}, "output": str(output)}
    spec_file = tmp_path / "dflash.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    storage = open_storage(str(output))
    storage.put_bytes(DRAFTER_CONFIG_KEY, config if isinstance(config, bytes) else json.dumps(config).encode())
    storage.put_bytes(EVAL_REPORT_KEY, b"{}")
    return spec_file, parse_spec(spec)


def dflashctl(monkeypatch, capsys, *args):
    monkeypatch.setattr("sys.argv", ["dflashctl", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code, capsys.readouterr().out


def test_status_of_a_finished_run_prints_the_serve_command(tmp_path, monkeypatch, capsys):
    spec_file, spec = finished_run(tmp_path, exported(block_size=8))
    expected = run_serve_command(spec, exported(block_size=8))
    assert f'"model": "{tmp_path}/out/train/drafter", "num_speculative_tokens": 7' in expected

    code, out = dflashctl(monkeypatch, capsys, "status", "-f", str(spec_file))
    assert code == 0 and out.endswith(f"serve with vLLM:\n{expected}\n")
    code, out = dflashctl(monkeypatch, capsys, "status", "-f", str(spec_file), "-o", "json")
    assert code == 0 and json.loads(out)["serve"] == expected


def test_status_with_an_unreadable_drafter_config_says_so_and_goes_on(tmp_path, monkeypatch, capsys):
    spec_file, _ = finished_run(tmp_path, b"{not json")
    code, out = dflashctl(monkeypatch, capsys, "status", "-f", str(spec_file))
    assert code == 0 and f"(cannot tell: {tmp_path}/out/{DRAFTER_CONFIG_KEY} is unreadable" in out


def test_the_readme_shows_the_command_of_the_example_spec():
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    shown = readme.split("for `examples/qwen36-27b/dflash.yaml`:\n", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    spec = load_spec(root / "examples/qwen36-27b/dflash.yaml")
    assert (spec.train.draft_layers, spec.train.sliding_window_layers, spec.train.block_size) == (5, 4, 16)
    assert textwrap.dedent(shown).strip() == run_serve_command(spec, exported(sliding=4))


def test_the_readme_shows_each_drafters_command_for_the_example_spec():
    """The README's per-drafter lines are what the same run prints with train.drafter changed, at
    the drafter's default block (the `aws s3 sync` line, shown once above them, left out)."""
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    shown = readme.split("The same run with another drafter", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = {chunk.splitlines()[0].removeprefix("# train.drafter: "): "\n".join(chunk.splitlines()[1:])
                for chunk in shown.strip().split("\n\n")}
    example = yaml.safe_load((root / "examples/qwen36-27b/dflash.yaml").read_text())
    assert commands.keys() == {"dflash2", "dspark"}
    for drafter, export in (("dflash2", exported_dflash2), ("dspark", exported_dspark)):
        train = {key: value for key, value in example["train"].items() if key != "block_size"} | {"drafter": drafter}
        spec = parse_spec({**example, "train": train})
        printed = run_serve_command(spec, export(block_size=spec.train.block_size, sliding=spec.train.sliding_window_layers))
        assert commands[drafter] == "\n".join(line for line in printed.splitlines() if not line.startswith("aws s3 sync")), drafter


def exported_dspark(*, block_size=7, sliding=0) -> dict:
    """The config.json of a Qwen3.6-27B-shaped DSpark drafter (DSparkConfig.to_deepspec)."""
    from dflash_jobs.drafter.dspark_model import DSparkConfig

    config = DSparkConfig(
        hidden_size=5120, num_layers=5, num_attention_heads=24, num_key_value_heads=4, head_dim=256, intermediate_size=17408,
        vocab_size=248320, target_layer_ids=[1, 16, 31, 46, 61], num_target_layers=64, block_size=block_size, mask_token_id=248070,
        layer_types=["sliding_attention"] * sliding + ["full_attention"] * (5 - sliding),
    )
    return json.loads(json.dumps(config.to_deepspec()))


@pytest.mark.parametrize("block_size", [5, 7, 8])
def test_dspark_serves_every_slot_of_its_block_with_method_dspark_on_the_v2_runner(block_size):
    """The anchor is a prediction slot: num_speculative_tokens is the trained block size itself, and
    vLLM runs DSpark only in its V2 model runner, whatever the layers."""
    command = vllm_serve_command(target="/t", drafter="/d", exported=exported_dspark(block_size=block_size))
    assert command == (
        "VLLM_USE_V2_MODEL_RUNNER=1 vllm serve /t \\\n"
        f"""  --speculative-config '{{"method": "dspark", "model": "/d", "num_speculative_tokens": {block_size}}}' \\\n"""
        "  --attention-backend flash_attn"
    )
    causal = vllm_serve_command(target="/t", drafter="/d", exported=exported_dspark(sliding=5))
    assert causal.startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve /t") and "--attention-backend" not in causal


def test_an_architecture_without_a_serving_entry_is_refused_naming_it():
    """SpecForge's DSpark export name, which vLLM maps to its DeepSeek-V4 drafter, is never served as a Qwen3 drafter."""
    config = {**exported_dspark(), "architectures": ["DSparkDraftModel"]}
    with pytest.raises(FormatError, match=r"names architectures \['DSparkDraftModel'\], none of which this version serves"):
        vllm_serve_command(target="/t", drafter="/d", exported=config)
