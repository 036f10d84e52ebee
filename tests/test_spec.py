"""The run spec fails before anything runs, naming the field, the bad value and what is allowed."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash_jobs.errors import EXIT_BAD_SPEC, SpecError, pod_exit_code
from dflash_jobs.spec import OUTSIDE_RUN_IDENTITY, default_layers, dump_spec, load_spec, parse_spec, resolve_layers, run_identity


def minimal(**overrides):
    raw = {"name": "qwen36-27b-v1", "target": {"model": "/models/Qwen3.6-27B"}, "data": {"source": "s3://bucket/chats.jsonl"}, "output": "s3://bucket/dflash/v1",
           "cluster": {"model_volume": {"claim": "models"}}}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return raw


def test_minimal_spec_gets_the_documented_defaults():
    spec = parse_spec(minimal())
    assert spec.backend == "kubernetes"
    assert (spec.extract.shards, spec.extract.token_budget, spec.extract.dtype) == (8, 32768, "bfloat16")
    assert (spec.train.draft_layers, spec.train.block_size, spec.train.anchors, spec.train.epochs, spec.train.lr) == (5, 16, 512, 6, 6.0e-4)
    assert (spec.data.max_length, spec.data.chunk_tokens) == (4096, 65536)
    assert spec.cluster.ttl_seconds_after_finished is None
    assert spec.train.stall_seconds == 600.0  # well above a first step's compile


@pytest.mark.parametrize(
    "drafter, block_size, gamma, drafts, final_hidden",
    [("dflash", 16, 7.0, 15, False), ("dflash2", 8, 7.0, 7, False), ("dspark", 7, 4.0, 7, True)],
)
def test_each_drafter_gets_its_own_layout_defaults_and_settings(drafter, block_size, gamma, drafts, final_hidden):
    spec = parse_spec(minimal(train={"drafter": drafter}))
    assert (spec.train.block_size, spec.train.gamma, spec.train.layout.drafts) == (block_size, gamma, drafts)
    assert spec.train.reads_final_hidden is spec.stores_final_hidden is final_hidden
    resolved = spec.to_dict()["train"]
    # Only the chosen drafter's own section is resolved into run.yaml; the others are left out.
    assert {name for name in ("dflash2", "dspark") if name in resolved} == ({drafter} - {"dflash"})
    assert parse_spec(spec.to_dict()) == spec


def test_dflash2_settings_default_to_the_published_checkpoint_and_its_kernel_may_span_the_block():
    spec = parse_spec(minimal(train={"drafter": "dflash2"}))
    settings = spec.train.dflash2
    assert (settings.conv_kernel_size, settings.conv_group_size, settings.selector_rank, settings.selector_top_k) == (2, 16, 256, 16)
    assert (settings.selector_alpha, settings.selector_stop_gradient) == (1.0, False)
    assert not spec.train.layout.sample_from_anchor and not spec.stores_final_hidden  # the stored DFlash states suffice
    spanning = parse_spec(minimal(train={"drafter": "dflash2", "block_size": 4, "dflash2": {"conv_kernel_size": 4, "selector_stop_gradient": True}}))
    assert spanning.train.dflash2.conv_kernel_size == 4 and spanning.train.dflash2.selector_stop_gradient


def test_a_chosen_block_size_and_the_stored_final_state_are_the_spec_s_to_set():
    spec = parse_spec(minimal(train={"drafter": "dspark", "block_size": 5, "dspark": {"ce_only": True}}, extract={"final_hidden": True}))
    assert (spec.train.block_size, spec.train.layout.drafts, spec.train.dspark.markov_rank) == (5, 5, 256)
    assert not spec.train.reads_final_hidden and spec.stores_final_hidden  # CE-only reads none; extraction still keeps it
    assert not parse_spec(minimal(train={"drafter": "dspark"}, extract={"final_hidden": False})).stores_final_hidden


@pytest.mark.parametrize(
    "settings, device, compiled, checkpointing",
    [
        ({}, "cuda", True, "none"),  # 66.7 GiB at the default micro-batch on an H200, the fastest that fits 96 GB
        ({}, "cpu", False, "mlp"),
        ({"compile": False}, "cuda", False, "mlp"),  # eager without checkpointing would not fit 96 GB
        ({"compile": True}, "cpu", True, "none"),
        ({"compile": True, "activation_checkpointing": "layers"}, "cuda", True, "layers"),
        ({"activation_checkpointing": "none"}, "cpu", False, "none"),
    ],
)
def test_unset_compile_means_on_a_gpu_and_auto_checkpointing_follows_it(settings, device, compiled, checkpointing):
    spec = parse_spec(minimal(train=settings, extract={key: settings[key] for key in ("compile",) if key in settings}))
    assert spec.train.compiled_on(device) is compiled
    assert spec.extract.compiled_on(device) is compiled
    assert spec.train.checkpointing_on(device) == checkpointing


@pytest.mark.parametrize(
    "overrides, field, allowed",
    [
        ({"colour": "blue"}, "colour", "one of the known keys"),
        ({"extract": {"shardz": 2}}, "extract.shardz", "one of the known keys"),
        ({"extract": {"shards": "eight"}}, "extract.shards", "an integer"),
        ({"extract": {"shards": 0}}, "extract.shards", "an integer >= 1"),
        ({"extract": {"shards": True}}, "extract.shards", "an integer"),
        ({"extract": {"dtype": "float16"}}, "extract.dtype", "'bfloat16' | 'float8_e4m3fn'"),
        ({"train": {"lr": "fast"}}, "train.lr", "a number"),
        ({"name": "Qwen_27B"}, "name", "DNS-1123 label"),
        ({"name": "a" * 41}, "name", "at most 40 characters"),
        ({"name": "-leading"}, "name", "DNS-1123 label"),
        ({"backend": "slurm"}, "backend", "'kubernetes' | 'local'"),
        ({"output": "gs://bucket/x"}, "output", "s3://bucket/prefix URL"),
        ({"output": ""}, "output", "s3://bucket/prefix URL"),
        ({"output": "s3://"}, "output", "with a bucket name"),
        ({"target": {"layers": [1, 1]}}, "target.layers", "distinct"),
        ({"target": {"layers": [5, 1, 3]}}, "target.layers", "= [5, 1, 3] is invalid. Expected layer indices in ascending order, [1, 3, 5]"),
        ({"target": {"layers": "1,2"}}, "target.layers", "a list of an integer"),
        ({"data": {"chunk_tokens": 1024}}, "data.chunk_tokens", ">= data.max_length"),
        ({"cluster": {"namespace": "My NS"}}, "cluster.namespace", "DNS-1123 label"),
        ({"cluster": {"node_selector": {"gpu": 1}}}, "cluster.node_selector", "mapping of strings"),
        ({"train": {"sliding_window_layers": 9}}, "train.sliding_window_layers", "0..train.draft_layers"),
        ({"cluster": {"memory_per_gpu": "96G"}}, "cluster.memory_per_gpu", "whole binary quantity"),
        ({"cluster": {"shm_size": "1.5Gi"}}, "cluster.shm_size", "whole binary quantity"),
        ({"cluster": {"model_cache": "Model_Cache"}}, "cluster.model_cache", "DNS-1123"),
        ({"train": {"activation_checkpointing": "some"}}, "train.activation_checkpointing", "'auto' | 'none' | 'mlp' | 'layers'"),
        ({"extract": {"compile": "yes"}}, "extract.compile", "true or false or null"),
        ({"train": {"stall_seconds": 0}}, "train.stall_seconds", "a number > 0"),
        ({"train": {"drafter": "eagle3"}}, "train.drafter", "'dflash' | 'dflash2' | 'dspark'"),
        ({"train": {"dspark": {"markov_rank": 64}}}, "train.dspark", "set train.drafter: dspark, or remove train.dspark"),
        ({"train": {"drafter": "dspark", "dflash2": {}}}, "train.dflash2", "while train.drafter is dspark"),
        ({"train": {"drafter": "dflash2", "dflash2": {"selector_top_k": 1}}}, "train.dflash2.selector_top_k", "an integer >= 2"),
        ({"train": {"drafter": "dspark", "dspark": {"l1_weight": -1}}}, "train.dspark.l1_weight", "a number >= 0"),
        ({"train": {"drafter": "dflash2", "block_size": 4, "dflash2": {"conv_kernel_size": 5}}}, "train.dflash2.conv_kernel_size",
         "at most train.block_size (4): the convolution resets at every block"),
        ({"train": {"drafter": "dflash2", "dflash2": {"selector_stop_gradient": "yes"}}}, "train.dflash2.selector_stop_gradient", "true or false"),
    ],
)
def test_bad_field_is_named_with_value_and_allowed(overrides, field, allowed):
    with pytest.raises(SpecError) as info:
        parse_spec(minimal(**overrides))
    assert info.value.field == field
    assert allowed in str(info.value)
    assert f"spec field {field}" in str(info.value)


def test_missing_required_field_is_named():
    raw = minimal()
    del raw["output"]
    with pytest.raises(SpecError, match="spec field output"):
        parse_spec(raw)


def test_layers_beyond_the_checkpoint_depth_are_refused(tmp_path):
    config = {"model_type": "qwen3_5", "text_config": {"num_hidden_layers": 64}}
    spec = parse_spec(minimal(target={"layers": [1, 16, 64]}))
    with pytest.raises(SpecError, match=r"0\.\.63: the checkpoint has 64 decoder layers"):
        resolve_layers(spec, config)
    assert resolve_layers(parse_spec(minimal()), config) == [1, 16, 31, 46, 61]
    assert resolve_layers(parse_spec(minimal()), {"num_hidden_layers": 36}) == [1, 9, 17, 25, 33]


def test_default_layers_follow_the_z_lab_rule():
    assert default_layers(64) == [1, 16, 31, 46, 61]
    assert default_layers(32) == [1, 8, 15, 22, 29]
    assert default_layers(36, 1) == [18]


def test_a_spec_with_several_errors_reports_each_naming_its_field():
    """Issue 37, item 12: every bad field at once, each as it would be said alone; one error type, exit 2 in a pod too."""
    with pytest.raises(SpecError) as caught:
        parse_spec(minimal(extract={"shards": "x", "dtype": "fp9"}, train={"lr": -1}, cluster={"namespace": "Team_A"}, bogus=1))
    lines = str(caught.value).splitlines()
    assert lines[0] == "5 spec fields are invalid:"
    assert sorted(lines[1:]) == sorted([
        "  spec field bogus = 1 is invalid. Expected one of the known keys: name, target, data, output, backend, storage, extract, train, "
        "eval, generate, cluster, local",
        "  spec field extract.shards = 'x' is invalid. Expected an integer",
        "  spec field extract.dtype = 'fp9' is invalid. Expected 'bfloat16' | 'float8_e4m3fn'",
        "  spec field train.lr = -1.0 is invalid. Expected a number > 0",
        "  spec field cluster.namespace = 'Team_A' is invalid. Expected a DNS-1123 label: lower-case letters, digits and '-', "
        "starting and ending with a letter or digit, at most 63 characters",
    ])
    assert {error.field for error in caught.value.errors} == {"bogus", "extract.shards", "extract.dtype", "train.lr", "cluster.namespace"}
    assert pod_exit_code(caught.value) == EXIT_BAD_SPEC
    # One alone is said as before, whole.
    with pytest.raises(SpecError) as alone:
        parse_spec(minimal(extract={"shards": "x"}))
    assert str(alone.value) == "spec field extract.shards = 'x' is invalid. Expected an integer" and alone.value.errors == [alone.value]
    # In lists too: each bad item.
    with pytest.raises(SpecError) as items:
        parse_spec(minimal(cluster={"image_pull_secrets": [1, "ok", 2]}))
    assert [error.field for error in items.value.errors] == ["cluster.image_pull_secrets[0]", "cluster.image_pull_secrets[2]"]


@pytest.mark.parametrize("fields, allowed", [
    ({"cluster": {"model_volume": None}}, "set cluster.model_volume {claim, mount} to the claim that holds the checkpoint"),
    ({"cluster": {"model_volume": {"claim": "models", "mount": "/weights"}}}, "a path under cluster.model_volume.mount (/weights), where the pods see claim models"),
])
def test_a_kubernetes_target_on_no_volume_the_pods_mount_is_refused_with_the_fix(fields, allowed):
    """Issue 37, item 3: /models/... with no volume there would run Jobs with no model mounted."""
    with pytest.raises(SpecError) as refused:
        parse_spec(minimal(**fields))
    assert refused.value.field == "target.model" and allowed in refused.value.allowed
    mounted_by_patch = {"pod_template_patch": {"spec": {"containers": [{"name": "worker", "volumeMounts": [{"name": "nfs", "mountPath": "/models"}]}]}}}
    for fine in (minimal(), minimal(backend="local", **fields), minimal(target={"model": "s3://bucket/models/Qwen3.6-27B"}, **fields),
                 minimal(cluster={"model_volume": None, **mounted_by_patch})):
        assert parse_spec(fine).target.model


def test_load_spec_names_the_file_and_round_trips(tmp_path):
    with pytest.raises(SpecError, match="dflashctl init") as missing:
        load_spec(tmp_path / "missing.yaml")
    assert str(missing.value).startswith(f"spec file {tmp_path / 'missing.yaml'} does not exist.") and "spec field" not in str(missing.value)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="invalid YAML at line"):
        load_spec(bad)
    good = tmp_path / "dflash.yaml"
    good.write_text(yaml.safe_dump(minimal(extract={"shards": 3})))
    spec = load_spec(good)
    again = tmp_path / "resolved.yaml"
    again.write_text(dump_spec(spec))
    assert load_spec(again) == spec and load_spec(again).fingerprint() == spec.fingerprint()
    assert parse_spec(minimal(extract={"shards": 4})).fingerprint() != spec.fingerprint()


def test_importing_the_control_plane_loads_neither_torch_nor_transformers():
    code = (
        "import sys, json, dflashctl, dflashctl.cli.app, dflashctl.cli.main, dflash_jobs.spec, dflash_jobs.storage, dflash_jobs.formats;"
        "import dflashctl.render, dflashctl.backend, dflashctl.backends, dflashctl.kube, dflashctl.local.backend;"
        "print(json.dumps([m for m in ('torch', 'transformers', 'safetensors.torch') if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert json.loads(out) == []


CONTROLLER = Path(__file__).resolve().parents[1] / "controller" / "dflashctl"
JOBS = Path(__file__).resolve().parents[1] / "jobs" / "dflash_jobs"


def imported(path: Path) -> set[str]:
    """The modules a source file imports, at any depth (function-level imports too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_imports_run_one_way_the_interface_below_the_backends_below_the_factory():
    """backend.py (the types) imports neither backend; kube.py and local/ import the types, never
    the factory (backends.py); the data plane never imports the control plane."""
    controller, jobs = CONTROLLER, JOBS
    assert not {name for name in imported(controller / "backend.py") if name.startswith(("dflashctl.kube", "dflashctl.local"))}
    for path in [controller / "kube.py", *sorted((controller / "local").glob("*.py"))]:
        assert "dflashctl.backends" not in imported(path), path
    for path in jobs.rglob("*.py"):
        assert not {name for name in imported(path) if name.split(".")[0] == "dflashctl"}, path


def test_the_data_plane_s_root_modules_import_no_step_s_package():
    """prepare and the contract (storage, formats, generation) sit at dflash_jobs' root; the steps
    (the packages a pod runs: generate, extract, train, evaluate) sit below it. A step reads what
    another wrote through the contract, so no root module reaches down into a step's package."""
    steps = {path.parent.name for path in JOBS.glob("*/__main__.py")}
    assert {"generate", "extract", "train", "evaluate"} <= steps
    for path in JOBS.glob("*.py"):
        reaching_down = {name for name in imported(path) if name.split(".")[:2] in (["dflash_jobs", step] for step in steps)}
        assert not reaching_down, f"{path.name} imports {sorted(reaching_down)}"


def test_what_training_resumes_across_keeps_the_run_s_identity():
    """The trainer resumes across a new checkpoint interval or chunk cache (checkpointer.RESUMABLE_CHANGES),
    so the output the run writes to takes the changed spec as the same run; a setting of what it makes does not."""
    from dflash_jobs.train.checkpointer import RESUMABLE_CHANGES

    first = parse_spec(minimal()).to_dict()
    resumable = parse_spec(minimal(train={"checkpoint_every": 7, "cache_gb": 1.5, "cache_storage_class": "local-nvme"})).to_dict()
    assert {f"train.{name}" for name in RESUMABLE_CHANGES} <= set(OUTSIDE_RUN_IDENTITY)
    assert run_identity(resumable) == run_identity(first)
    assert run_identity(parse_spec(minimal(train={"lr": 1e-4})).to_dict()) != run_identity(first)


def test_a_run_written_before_a_setting_existed_is_the_same_run_under_its_default(tmp_path):
    from dflashctl.errors import Conflict
    from dflashctl.identity import claim_output
    from dflash_jobs.formats import RUN_KEY
    from dflash_jobs.storage import open_storage

    spec = parse_spec(minimal(output=str(tmp_path / "out"), backend="local"))
    storage = open_storage(spec.output)
    written = spec.to_dict()
    del written["eval"]["baselines"]  # as a dflashctl from before eval.baselines wrote run.yaml
    storage.put_bytes(RUN_KEY, yaml.safe_dump(written, sort_keys=False).encode())
    claim_output(storage, spec, force=False, say=print)
    assert yaml.safe_load(storage.get_bytes(RUN_KEY)) == written  # kept as it was written
    # A setting written otherwise than its default is another run, as before.
    storage.put_bytes(RUN_KEY, yaml.safe_dump({**written, "eval": {**written["eval"], "baselines": []}}, sort_keys=False).encode())
    with pytest.raises(Conflict, match="differs in: eval"):
        claim_output(storage, spec, force=False, say=print)
