"""`python -m dflash_jobs.selfcheck`: passes in cpu mode on a good local run, and fails early with a
message naming the fix for unreachable storage, a bad checkpoint, a too-old driver, missing GPUs
or missing fast paths."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
import sys
from pathlib import Path

import pytest
import yaml

from dflash_jobs.errors import EXIT_BAD_SPEC
from dflash_jobs.selfcheck import COMPONENTS, GpuReport, SelfCheck, check_gpu, component_needs, main, read_kernel_driver
from dflash_jobs.spec import parse_spec

H200 = GpuReport(
    torch_version="2.13.0+cu130", torch_cuda="13.0", arch_list=("sm_80", "sm_90", "sm_100", "sm_120"),
    driver_cuda=(13, 0), kernel_driver="580.95.05", devices=(("NVIDIA H200", (9, 0)),),
)


@pytest.fixture
def run(tmp_path) -> dict:
    """A tiny local run in cpu mode: checkpoint files, a data set and an output directory."""
    checkpoint = tmp_path / "target"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 8}}))
    (checkpoint / "model.safetensors").write_bytes(b"\0" * 8)
    (checkpoint / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chats.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    return {
        "name": "tiny",
        "backend": "local",
        "target": {"model": str(checkpoint)},
        "data": {"source": str(tmp_path / "chats.jsonl"), "max_length": 64, "chunk_tokens": 256},
        "output": str(tmp_path / "out"),
        "train": {"gpus_per_node": 2},
        "local": {"device": "cpu"},
    }


def selfcheck(raw: dict, tmp_path: Path, component: str, capsys) -> tuple[int, str]:
    spec_file = tmp_path / "dflash.yaml"
    spec_file.write_text(yaml.safe_dump(raw))
    code = main(["-f", str(spec_file), "--component", component])
    return code, capsys.readouterr().out


def summary(output: str) -> str:
    return output.strip().splitlines()[-1]


# ---- cpu mode on this machine ------------------------------------------------------------------


@pytest.mark.parametrize("component", COMPONENTS)
def test_cpu_mode_passes_and_skips_the_gpu_checks(run, tmp_path, capsys, component):
    code, output = selfcheck(run, tmp_path, component, capsys)
    assert code == 0, output
    assert summary(output).startswith(f"selfcheck {component}: passed (")
    for name in ("gpu", "flash-linear-attention", "causal-conv1d"):
        assert f"selfcheck {component}: {name:<22} skip  cpu mode: local.device is cpu" in output
    assert "target                 ok    " in output and "capturing [1, 2, 3, 4, 5]" in output
    assert ("data.source" in output) == (component in ("generate", "prepare"))


def test_module_entry_point_prints_one_summary_line(run, tmp_path):
    spec_file = tmp_path / "dflash.yaml"
    spec_file.write_text(yaml.safe_dump(run))
    result = subprocess.run([sys.executable, "-m", "dflash_jobs.selfcheck", "-f", str(spec_file), "--component", "extract"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sum("passed" in line for line in result.stdout.splitlines()) == 1


# ---- storage and inputs ------------------------------------------------------------------------


def test_checkpoint_without_config_json_fails_naming_the_fix(run, tmp_path, capsys):
    Path(run["target"]["model"], "config.json").unlink()
    code, output = selfcheck(run, tmp_path, "extract", capsys)
    assert code == EXIT_BAD_SPEC
    assert summary(output) == (
        f"selfcheck extract: FAILED target: target.model {run['target']['model']} has no config.json. "
        "Point target.model at a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer)"
    )


def test_layers_deeper_than_the_checkpoint_fail(run, tmp_path, capsys):
    run["target"]["layers"] = [1, 8]
    code, output = selfcheck(run, tmp_path, "train", capsys)
    assert code == EXIT_BAD_SPEC
    assert "FAILED target: spec field target.layers = [1, 8] is invalid. Expected layer indices 0..7" in summary(output)


def test_each_component_asks_for_the_checkpoint_files_it_loads(run, tmp_path, capsys):
    Path(run["target"]["model"], "model.safetensors").unlink()
    Path(run["target"]["model"], "tokenizer_config.json").unlink()
    assert selfcheck(run, tmp_path, "extract", capsys)[0] == EXIT_BAD_SPEC
    code, output = selfcheck(run, tmp_path, "eval", capsys)
    assert "has no weights (*.safetensors) and no tokenizer (tokenizer_config.json)" in summary(output)
    code, output = selfcheck(run, tmp_path, "prepare", capsys)
    assert "has no tokenizer (tokenizer_config.json)" in summary(output) and "weights" not in summary(output)


def test_missing_data_source_fails_prepare_only(run, tmp_path, capsys):
    Path(run["data"]["source"]).unlink()
    code, output = selfcheck(run, tmp_path, "prepare", capsys)
    assert code == EXIT_BAD_SPEC
    assert f"FAILED data.source: {run['data']['source']} does not exist. Fix data.source" in summary(output)
    assert selfcheck(run, tmp_path, "extract", capsys)[0] == 0


def test_output_under_a_file_is_not_writable(run, tmp_path, capsys):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    run["output"] = str(blocker / "out")
    code, output = selfcheck(run, tmp_path, "extract", capsys)
    assert code == EXIT_BAD_SPEC
    assert f"FAILED output: {blocker / 'out'} cannot be created: {blocker} is not a writable directory" in summary(output)


def test_s3_output_reachable_passes_and_a_missing_bucket_fails(run, tmp_path, capsys, s3_bucket):
    run["output"] = f"s3://{s3_bucket}/runs/tiny"
    code, output = selfcheck(run, tmp_path, "extract", capsys)
    assert code == 0, output
    assert f"output                 ok    s3://{s3_bucket}/runs/tiny reachable (run.yaml not yet written)" in output
    run["output"] = "s3://no-such-bucket-dflash/runs/tiny"
    code, output = selfcheck(run, tmp_path, "extract", capsys)
    assert code == EXIT_BAD_SPEC
    assert summary(output) == (
        "selfcheck extract: FAILED output: output s3://no-such-bucket-dflash/runs/tiny is unreachable: "
        "the S3 bucket of s3://no-such-bucket-dflash/runs/tiny/run.yaml does not exist. Create the bucket or fix the URL"
    )


def test_empty_credentials_from_the_secret_template_name_the_secret(run, tmp_path, capsys, s3_bucket, monkeypatch):
    run["output"] = f"s3://{s3_bucket}/runs/tiny"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "")
    code, output = selfcheck(run, tmp_path, "extract", capsys)
    assert code == EXIT_BAD_SPEC
    assert summary(output) == (
        "selfcheck extract: FAILED output: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY set but empty. "
        "Fill the Secret 'dflash-s3' (k8s/components/s3-secret/ is a template without values)"
    )


# ---- on a GPU: the rules, fed with what a pod could see ----------------------------------------


def gpu_spec(run: dict):
    # The output on a claim mounted where this test sees it, as a pod would.
    volume = {"claim": "runs", "mount": str(Path(run["output"]).parent)}
    return parse_spec(run | {"backend": "kubernetes", "cluster": {"output_volume": volume}})


def test_a_healthy_gpu_pod_without_fast_paths_fails_extract_and_warns_eval(run):
    # flash-linear-attention and causal-conv1d are not installed on this machine (they crash on CPU).
    extract = SelfCheck(gpu_spec(run), "extract", probe=lambda: H200)
    checks = {check.name: check for check in extract.run()}
    assert [checks[name].status for name in ("torch", "driver", "gpu")] == ["ok", "ok", "ok"]
    assert checks["gpu"].detail == "1 x NVIDIA H200 (sm_90), 1 needed"
    assert checks["flash-linear-attention"].status == "fail"
    assert "cannot import fla.ops.gated_delta_rule.chunk_gated_delta_rule" in checks["flash-linear-attention"].detail
    assert checks["causal-conv1d"].status == "warn"
    assert extract.summary().startswith("selfcheck extract: FAILED flash-linear-attention:")
    evaluate = SelfCheck(gpu_spec(run), "eval", probe=lambda: H200)
    evaluate.run()
    assert not evaluate.failures and "flash-linear-attention warn" in evaluate.summary()


def test_a_dense_target_s_gpu_pods_pass_without_flash_linear_attention(run):
    """A Llama target has no Gated DeltaNet layers: its extract pod and its online train pod need no FLA."""
    (Path(run["target"]["model"]) / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 8}))
    run["train"] = {"gpus_per_node": 1, "states": "online"}
    for component in ("extract", "train"):
        check = SelfCheck(gpu_spec(run), component, probe=lambda: H200)
        checks = {c.name: c for c in check.run()}
        assert not check.failures, check.summary()
        assert checks["flash-linear-attention"].status == "skip" and checks["flash-linear-attention"].detail == "the target has no Gated DeltaNet layers"


def test_online_training_runs_the_target_so_its_pod_needs_the_fast_path_as_extract_s_does(run):
    run["train"] = {"gpus_per_node": 1, "states": "online"}
    online = SelfCheck(gpu_spec(run), "train", probe=lambda: H200)
    online.run()
    assert online.summary().startswith("selfcheck train: FAILED flash-linear-attention:")
    run["train"]["states"] = "stored"
    stored = SelfCheck(gpu_spec(run), "train", probe=lambda: H200)
    stored.run()
    assert not stored.failures and "flash-linear-attention skip" in stored.summary()


def test_train_needs_every_gpu_of_its_node(run):
    checks = check_gpu(H200, 2, "train")
    assert checks[-1].status == "fail"
    assert checks[-1].detail == "1 GPU(s) visible, train needs 2"
    assert "nvidia.com/gpu: 2" in checks[-1].fix


def test_driver_older_than_cuda_13_fails_with_the_minimum_version():
    old = GpuReport(torch_version="2.13.0+cu130", torch_cuda="13.0", driver_cuda=(12, 8), kernel_driver="570.124.06",
                    error="Found no NVIDIA driver on your system")
    checks = check_gpu(old, 1, "extract")
    assert (checks[-1].name, checks[-1].status) == ("driver", "fail")
    assert checks[-1].detail == "driver 570.124.06 supports CUDA up to 12.8"
    assert "needs NVIDIA driver >= 580.65.06" in checks[-1].fix
    # Without libcuda's answer the kernel module version decides.
    checks = check_gpu(GpuReport(torch_version="2.13.0+cu130", torch_cuda="13.0", kernel_driver="575.57.08"), 1, "extract")
    assert checks[-1].detail == "driver 575.57.08 is older than 580.65.06"


def test_no_driver_in_the_container_says_to_request_gpus():
    checks = check_gpu(GpuReport(torch_version="2.13.0+cu130", torch_cuda="13.0"), 1, "eval")
    assert checks[-1].detail == "no NVIDIA driver is visible in this container"
    assert "request nvidia.com/gpu: 1" in checks[-1].fix


def test_wrong_torch_build_fails_before_the_driver_is_considered():
    assert check_gpu(GpuReport(torch_version="2.13.0+cpu"), 1, "extract")[0].detail == "torch 2.13.0+cpu is a CPU-only build"
    cu12 = check_gpu(GpuReport(torch_version="2.13.0+cu128", torch_cuda="12.8"), 1, "extract")
    assert cu12[0].detail == "torch 2.13.0+cu128 is built for CUDA 12.8, not 13"
    assert "cu130" in cu12[0].fix
    assert check_gpu(GpuReport(error="cannot import torch (No module named 'torch')"), 1, "extract")[0].status == "fail"


def test_gpu_architecture_without_kernels_fails():
    ampere = GpuReport(torch_version="2.13.0+cu130", torch_cuda="13.0", arch_list=("sm_90", "sm_120"),
                       driver_cuda=(13, 0), kernel_driver="580.95.05", devices=(("NVIDIA A100", (8, 0)),))
    assert check_gpu(ampere, 1, "extract")[-1].detail == "torch has no kernels for sm_80 (built for sm_90, sm_120)"
    # PTX of an older architecture is JIT-compiled by the driver: supported.
    assert check_gpu(replace(ampere, arch_list=("sm_90", "compute_75")), 1, "extract")[-1].status == "ok"


def test_kernel_driver_version_is_read_from_both_module_flavours(tmp_path):
    proprietary = tmp_path / "proprietary"
    proprietary.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Wed Feb 26 20:00:00 UTC 2025\nGCC version: gcc 12\n")
    open_module = tmp_path / "open"
    open_module.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (nixbld@)  \n")
    assert read_kernel_driver(proprietary) == "570.124.06"
    assert read_kernel_driver(open_module) == "580.159.04"
    assert read_kernel_driver(tmp_path / "absent") is None


def test_generation_needs_the_source_the_checkpoint_and_its_engines_gpus(run):
    vllm = component_needs(parse_spec({**run, "generate": {"gpus_per_shard": 2}}), "generate")
    assert (vllm.gpus, vllm.fla_missing, vllm.weights, vllm.tokenizer, vllm.reads_source) == (2, "skip", True, True, True)
    transformers = component_needs(parse_spec({**run, "generate": {"engine": "transformers"}}), "generate")
    assert (transformers.gpus, transformers.fla_missing) == (1, "warn")
