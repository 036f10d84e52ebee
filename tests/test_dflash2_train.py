"""DFlash2 end to end on the tiny fixtures: `python -m dflash_jobs.train` with train.drafter: dflash2
on the same stored states as DFlash, its export in z-lab's DFlash2 format (config keys, weight names
and shapes, bare codebooks), loaded back by `load_drafter` and by `AutoModel(trust_remote_code)` in
a fresh process whose spec_generate is plain greedy, and the evaluation job, which decodes with it
losslessly and finds the training forward accepting what decoding accepts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dflash_jobs.drafter.checkpoint import TargetCheckpoint
from dflash_jobs.drafter.dflash2_model import DFlash2Config, DFlash2Drafter
from dflash_jobs.drafter.export import load_drafter
from dflash_jobs.errors import EXIT_BAD_SPEC, EXIT_OK
from dflash_jobs.evaluate.__main__ import main as evaluate_main
from dflash_jobs.formats import EVAL_REPORT_KEY, TRAIN_METRICS_KEY
from dflash_jobs.storage import open_storage
from dflash_jobs.train.__main__ import main as train_main
from dflash_jobs.variants import drafter_variant
from train_fixtures import LAYERS, copy_extract, hold_out_tiny_chats, tiny_target, train_spec_dict, write_spec

USER_PROCESS = Path(__file__).with_name("zlab_user_process.py")
BLOCK = 4
PROMPTS, NEW_TOKENS = 4, 16
# z-lab's DFlash2 config (tests/fixtures/dflash2-config.json) less what belongs to its target
# (bos/eos/pad ids), to Transformers (transformers_version, max_window_layers) or is optional there
# (output_multiplier, final_logit_softcapping: absent for Qwen, 1 and off).
ZLAB_KEYS = {
    "architectures", "attention_bias", "attention_dropout", "is_causal", "dflash_config", "dtype", "head_dim", "hidden_act",
    "hidden_size", "initializer_range", "intermediate_size", "layer_types", "max_position_embeddings", "model_type",
    "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "num_target_layers", "rms_norm_eps", "rope_parameters",
    "sliding_window", "tie_word_embeddings", "use_cache", "use_sliding_window", "vocab_size",
}
ZLAB_DFLASH_CONFIG_KEYS = {"block_size", "conv_group_size", "conv_kernel_size", "mask_token_id", "selector_rank", "selector_top_k", "target_layer_ids"}


def dflash2_spec(root: Path, output: Path, **train) -> dict:
    """The tiny training spec with train.drafter: dflash2 (one sliding layer, window 32, and one full), evaluated on 4 prompts."""
    spec = train_spec_dict(tiny_target(root), output, **{
        "drafter": "dflash2", "block_size": BLOCK, "epochs": 4, "lr": 1e-2, "checkpoint_every": 100,
        "dflash2": {"selector_rank": 32, "selector_top_k": 8}, **train,
    })
    return {**spec, "eval": {"prompts": PROMPTS, "max_new_tokens": NEW_TOKENS}}


@pytest.fixture(scope="module")
def run(root, extract, tmp_path_factory) -> tuple[Path, Path]:
    """(spec file, output) of a DFlash2 trained by `python -m dflash_jobs.train` on the tiny extract."""
    base = tmp_path_factory.mktemp("dflash2-run")
    output = copy_extract(extract, base / "out")
    hold_out_tiny_chats(tiny_target(root), output, PROMPTS, seed=7)
    spec = write_spec(base / "dflash.yaml", dflash2_spec(root, output))
    result = subprocess.run(
        [sys.executable, "-m", "dflash_jobs.train", "-f", str(spec)],
        env={**os.environ, "DFLASH_CACHE_DIR": str(base / "cache")}, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "drafter: dflash2" in result.stdout
    assert " | loss " in result.stdout and " selector_accuracy " in result.stdout and " top_k_recall " in result.stdout  # in the pod's log line
    return spec, output


def test_training_logs_the_selector_s_figures_beside_loss_and_acceptance(run):
    _, output = run
    records = [json.loads(line) for line in (output / TRAIN_METRICS_KEY).read_text().splitlines()]
    # It learns (the total loss is no measure here: the selector's share of it grows with the recall).
    assert records[-1]["accuracy"][1] > records[0]["accuracy"][1] + 0.05
    assert records[-1]["acceptance_length"] > records[0]["acceptance_length"]
    assert records[-1]["top_k_recall"] > records[0]["top_k_recall"]
    for record in records:
        assert len(record["accuracy"]) == BLOCK and record["acceptance_length"] >= 1.0 and record["selector_loss"] > 0
        assert 0 <= record["selector_accuracy"] <= 1 and 0 <= record["unary_accuracy"] <= 1 and 0 < record["top_k_recall"] <= 1
    # The selector learns to do better than the unary top-1 it starts as (equal at step 1: B = 0).
    assert records[0]["selector_accuracy"] == records[0]["unary_accuracy"]
    assert records[-1]["selector_accuracy"] > records[-1]["unary_accuracy"]


def test_the_export_is_z_lab_s_dflash2_format(run):
    _, output = run
    export = output / "train/drafter"
    config = json.loads((export / "config.json").read_text())
    assert ZLAB_KEYS <= set(config) and set(config["dflash_config"]) == ZLAB_DFLASH_CONFIG_KEYS
    assert config["architectures"] == ["DFlash2DraftModel"] and config["auto_map"] == {"AutoModel": "dflash2.DFlash2DraftModel"}
    assert config["is_causal"] is False and config["tie_word_embeddings"] is False and "block_size" not in config
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["use_sliding_window"] and config["sliding_window"] == 32
    assert config["dflash_config"] == {
        "block_size": BLOCK, "mask_token_id": config["dflash_config"]["mask_token_id"], "target_layer_ids": LAYERS,
        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 32, "selector_top_k": 8,
    }
    assert {"selector_alpha", "selector_stop_gradient"}.isdisjoint(config)  # training settings stay out
    assert {"dflash2.py", "dflash2_model.py", "dflash.py", "model.py", "masks.py", "speculative.py"} <= {p.name for p in export.iterdir()}

    d, V, r, T, G = 64, 1024, 32, 2, 64 // 16
    with safe_open(export / "model.safetensors", "pt") as weights:
        shapes = {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
        assert {weights.get_slice(name).get_dtype() for name in weights.keys()} == {"BF16"}
    expected = {
        "candidate_selector.predecessor_codebook": (V, r), "candidate_selector.successor_codebook": (V, r),  # bare: no .weight
        "candidate_selector.hidden_projection.weight": (r, d), "fc.weight": (d, len(LAYERS) * d), "hidden_norm.weight": (d,), "norm.weight": (d,),
    }
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            expected[f"layers.{i}.{conv}.base_kernel"] = (2, T, d)
            expected[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * T * G, d)
    assert {name: shapes[name] for name in expected} == expected
    assert not any(name.startswith(("embed_tokens", "lm_head", "model.")) for name in shapes)
    layers = set(shapes) - set(expected)  # the rest: DFlash's 11 per layer (attention, its norms, MLP, two layer norms)
    assert len(layers) == 2 * 11 and all(name.startswith(("layers.0.", "layers.1.")) and "_conv" not in name for name in layers)


def test_load_drafter_round_trips_the_export_with_its_variant(run, root):
    _, output = run
    variant = drafter_variant("dflash2")
    drafter, config = load_drafter(str(output / "train/drafter"), target=str(tiny_target(root)), variant=variant)
    assert isinstance(drafter, DFlash2Drafter) and isinstance(config, DFlash2Config) and config.is_causal is False
    assert (config.block_size, config.selector_top_k, config.selector_rank) == (BLOCK, 8, 32)
    from safetensors.torch import load_file

    exported = load_file(output / "train/drafter/model.safetensors")
    state = drafter.state_dict()
    assert exported.keys() == state.keys() and all(torch.equal(exported[name], state[name]) for name in exported)
    assert drafter.candidate_selector.successor_codebook.abs().sum() > 0  # trained off its no-op start


def test_a_fresh_process_loads_it_with_automodel_drafts_the_selector_s_walk_and_decodes_as_greedy(run, root, tmp_path):
    from transformers import AutoModelForCausalLM

    from dflash_jobs.drafter.masks import one_block_attention

    _, output = run
    target_dir = tiny_target(root)
    drafter, config = load_drafter(str(output / "train/drafter"), target=str(target_dir), variant=drafter_variant("dflash2"))
    # In fp32 as the user process loads it, with the target's tables as it reads them (load_drafter keeps them in bf16).
    drafter = drafter.float()
    tables = TargetCheckpoint(open_storage(str(target_dir))).read_target_tensors()
    drafter.embed_tokens, drafter.lm_head = tables.embed_tokens.float(), tables.lm_head.float()
    generator = torch.Generator().manual_seed(3)
    C = 40
    context = torch.randn(1, C, config.context_features, generator=generator)
    target_model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompt = torch.randint(0, 200, (12,), generator=generator)
    eos = target_model.generation_config.eos_token_id
    inputs = {
        "context": context, "anchor_token": 17, "first_anchor_token": 5, "split": 25,
        "prompt": prompt, "max_new_tokens": 20, "stop_token_ids": [eos] if isinstance(eos, int) else list(eos or []),
    }
    torch.save(inputs, tmp_path / "inputs.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "hf-modules")}
    subprocess.run(
        [sys.executable, str(USER_PROCESS), str(output / "train/drafter"), str(target_dir), str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt")],
        check=True, env=env, cwd=tmp_path,
    )
    outputs = torch.load(tmp_path / "outputs.pt")
    assert outputs["class_name"] == "DFlash2DraftModel" and outputs["module"].startswith("transformers_modules.")

    # The training module's view of the same block: its unary logits and its selector's walk.
    B = config.block_size
    block_ids = torch.full((1, B), config.mask_token_id)
    block_ids[0, 0] = 17
    positions = torch.cat([torch.arange(C), C + torch.arange(B)])
    attention = {kind: one_block_attention(positions, B, config.window(kind), config.is_causal) for kind in set(config.layer_types)}
    with torch.no_grad():
        hidden = drafter(context[0], torch.arange(C), block_ids, (C + torch.arange(B))[None], attention)[0]
    torch.testing.assert_close(outputs["logits"], drafter.logits(hidden[1:]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs["cached_logits"], drafter.logits(hidden[1:]), rtol=1e-5, atol=1e-5)
    walk = drafter.draft_block(context, torch.arange(C), 17, C)
    assert torch.equal(outputs["drafted"], walk) and torch.equal(walk, drafter.block_drafts(hidden, 17))
    reference = target_model.generate(prompt[None], max_new_tokens=20, do_sample=False)
    assert outputs["generated"].tolist() == reference.tolist()


def test_the_evaluation_job_decodes_with_it_losslessly_and_training_and_serving_agree(run, capsys):
    spec, output = run
    assert evaluate_main(["-f", str(spec)]) == EXIT_OK
    report = json.loads((output / EVAL_REPORT_KEY).read_text())
    assert report["drafter_variant"] == "dflash2" and set(report["drafters"]) == {"dflash2", "prompt_lookup", "bigram"}
    assert report["lossless"] and report["drafters"]["dflash2"]["lossless"]
    assert report["block_size"] == BLOCK  # the anchor and its B - 1 drafts
    dflash2 = report["drafters"]["dflash2"]
    # Decoded through the export, every verify step judged; what a taught DFlash2 accepts is
    # test_dflash2_consistency's: this one learned the untaught tiny target, whose greedy output it
    # drafts right about once in 70 steps, whichever final norm it has (first position 0.012 with its
    # own trained one, 0.016 with the target's frozen one, over 8 prompts of 32 tokens).
    assert dflash2["verify_steps"] >= PROMPTS and len(dflash2["acceptance_per_position"]) == BLOCK - 1
    simulated = dflash2["simulated"]
    assert simulated["anchors"] > 0 and simulated["disagreeing_positions"] == []
    assert report["vllm_serve"].splitlines()[0] == "# a dflash2 drafter needs vLLM >= 0.28.0"
    assert "VLLM_USE_V2_MODEL_RUNNER=1 vllm serve" in report["vllm_serve"] and '"num_speculative_tokens": 3' in report["vllm_serve"]
    assert '"lossless": true' in capsys.readouterr().out


def test_a_target_the_settings_cannot_fit_is_refused_at_training_start_naming_the_fix(root, extract, tmp_path, caplog):
    output = copy_extract(extract, tmp_path / "refused")
    spec = write_spec(tmp_path / "dflash.yaml", dflash2_spec(root, output, dflash2={"conv_group_size": 24}))
    assert train_main(["-f", str(spec)]) == EXIT_BAD_SPEC
    assert "train.dflash2.conv_group_size = 24" in caplog.text and "a divisor of the target's hidden size 64, e.g. 16" in caplog.text
    spec = write_spec(tmp_path / "dflash.yaml", dflash2_spec(root, output, dflash2={"selector_top_k": 2000}))
    assert train_main(["-f", str(spec)]) == EXIT_BAD_SPEC
    assert "at most the target's vocabulary size (1024)" in caplog.text
    assert not (output / "train").exists()
