"""The exported drafter loads where its users look: z-lab's `AutoModel.from_pretrained(dir,
trust_remote_code=True)` in a fresh process that cannot import this project, with the logits of
the training model, z-lab's cached forward convention, and a lossless `spec_generate`, for a
drafter of each tiny target (the hybrid Qwen3.5, the dense Llama with tied embeddings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_jobs.drafter.checkpoint import TargetCheckpoint, drafter_config_for_target
from dflash_jobs.drafter.export import MODELING_FILES, export_dflash
from dflash_jobs.drafter.masks import one_block_attention
from dflash_jobs.drafter.model import Drafter, DrafterConfig
from dflash_jobs.spec import TrainSpec, text_config
from dflash_jobs.storage import open_storage
from train_fixtures import LAYERS, mask_token_id

USER_PROCESS = Path(__file__).with_name("zlab_user_process.py")
CONTEXT, SPLIT = 40, 25  # context positions; the cached run feeds them in two steps
WINDOW = 16  # small enough that the sliding layers' window cuts into the context


@pytest.fixture(scope="module")
def target_dir(each_target) -> Path:
    """This module's tests run on each tiny target."""
    return each_target


@pytest.fixture(scope="module")
def trained(target_dir):
    """A drafter with sliding and full layers, its final norm moved off 1 as training moves it, its
    weights already bf16-exact as the export stores them."""
    checkpoint = TargetCheckpoint(open_storage(str(target_dir)))
    train = TrainSpec(draft_layers=3, sliding_window_layers=2, sliding_window=WINDOW, block_size=8)
    mask = mask_token_id(checkpoint)
    torch.manual_seed(0)
    drafter = Drafter(drafter_config_for_target(checkpoint, train, LAYERS, mask))
    tensors = checkpoint.read_target_tensors()
    drafter.load_target_tensors(tensors.embed_tokens, tensors.lm_head, tensors.final_norm)
    with torch.no_grad():
        drafter.norm.weight.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(4))
        for parameter in drafter.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())
    return drafter.eval()


def training_view_logits(drafter: Drafter, context: torch.Tensor, anchor_token: int) -> torch.Tensor:
    """The block's logits [B-1, V] computed as training computes them (Drafter.forward, the masks' rule)."""
    config = drafter.config
    B, C = config.block_size, context.shape[1]
    block_ids = torch.full((1, B), config.mask_token_id)
    block_ids[0, 0] = anchor_token
    block_positions = C + torch.arange(B)[None]
    positions = torch.cat([torch.arange(C), block_positions[0]])
    attention = {kind: one_block_attention(positions, B, config.window(kind)) for kind in set(config.layer_types)}
    with torch.no_grad():
        return drafter.logits(drafter(context[0], torch.arange(C), block_ids, block_positions, attention))[0, 1:]


@pytest.fixture(scope="module")
def target_model(target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def stop_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def test_a_fresh_process_loads_the_export_with_automodel_and_gets_the_training_logits(tmp_path, target_dir, target_model, trained):
    export_dflash(trained, open_storage(str(tmp_path / "export")), prefix="")
    export = tmp_path / "export"
    assert {path.name for path in export.iterdir()} == {"config.json", "model.safetensors", *MODELING_FILES}
    assert json.loads((export / "config.json").read_text())["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}

    config = trained.config
    generator = torch.Generator().manual_seed(3)
    context = torch.randn(1, CONTEXT, config.context_features, generator=generator)
    prompt = torch.randint(0, 200, (12,), generator=generator)
    inputs = {
        "context": context, "anchor_token": 17, "first_anchor_token": 5, "split": SPLIT,
        "prompt": prompt, "max_new_tokens": 20, "stop_token_ids": stop_ids(target_model),
    }
    torch.save(inputs, tmp_path / "inputs.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "hf-modules")}
    subprocess.run(
        [sys.executable, str(USER_PROCESS), str(export), str(target_dir), str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt")],
        check=True, env=env, cwd=tmp_path,
    )
    outputs = torch.load(tmp_path / "outputs.pt")

    assert outputs["class_name"] == "DFlashDraftModel" and outputs["module"].startswith("transformers_modules.")
    expected = training_view_logits(trained, context, 17)
    torch.testing.assert_close(outputs["logits"], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs["cached_logits"], expected, rtol=1e-5, atol=1e-5)
    # And the training model's own inference entry point drafts the same tokens.
    assert torch.equal(trained.draft_block(context, torch.arange(CONTEXT), 17, CONTEXT), expected.argmax(-1))
    assert torch.equal(outputs["drafted"], expected.argmax(-1))
    # spec_generate is lossless: plain greedy decoding's tokens, whatever the (random) drafter proposed.
    reference = target_model.generate(prompt[None], max_new_tokens=20, do_sample=False)
    assert outputs["generated"].tolist() == reference.tolist()


def test_the_window_cuts_into_the_context_so_a_mask_without_it_would_be_caught(trained):
    """A control: the sliding layers' window cuts into the context, so the export test sees a mask without it."""
    config = trained.config
    context = torch.randn(1, CONTEXT, config.context_features, generator=torch.Generator().manual_seed(3))
    wider = Drafter(DrafterConfig(**{**config.to_dict(), "sliding_window": 4 * WINDOW}))
    wider.load_state_dict(trained.state_dict())
    wider.load_target_tensors(trained.embed_tokens, trained.lm_head, trained.target_norm)
    assert not torch.allclose(training_view_logits(wider.eval(), context, 17), training_view_logits(trained, context, 17))


def test_the_exported_modeling_files_import_nothing_of_this_project():
    package = Path(__import__("dflash_jobs.drafter", fromlist=["_"]).__file__).parent
    for name in MODELING_FILES:
        source = (package / name).read_text()
        assert "from dflash_jobs" not in source and "import dflash_jobs" not in source, name


def test_the_drafter_rotates_with_the_targets_rope_base_stated_in_both_config_forms(tmp_path, target_dir, trained):
    """Transformers 5 moved rope_theta into rope_parameters; a reader of only one form lost the base
    (theta 10,000 instead of 1e6, Model Optimizer #2221: no error, only lower acceptance)."""
    from transformers import AutoConfig

    from dflash_jobs.drafter.dflash import DFlashDraftModel
    from dflash_jobs.drafter.export import load_drafter_config

    target_rope = text_config(json.loads((target_dir / "config.json").read_text()))["rope_parameters"]
    theta = target_rope["rope_theta"]  # 1e7 for the tiny Qwen3.5, 1e5 for the tiny Llama (SmolLM2's)
    assert target_rope["rope_type"] == "default" and theta in (1e7, 1e5)  # no scaling to carry over
    assert trained.config.rope_theta == theta and trained.rope.theta == theta
    export_dflash(trained, open_storage(str(tmp_path)), prefix="")
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["rope_theta"] == theta and raw["rope_scaling"] is None
    assert raw["rope_parameters"] == {"rope_type": "default", "rope_theta": theta}  # and as Transformers 5 states it
    hf = AutoConfig.from_pretrained(tmp_path)  # what vLLM and AutoModel read: the Transformers 5 form
    assert hf.rope_parameters["rope_theta"] == theta and hf.rope_parameters["rope_type"] == "default"
    assert DFlashDraftModel(hf).rope.theta == theta
    assert load_drafter_config(str(tmp_path)).rope_theta == theta
    # A config holding the base only in rope_parameters (a Transformers 5 re-save) keeps it too.
    only_parameters = {key: value for key, value in raw.items() if key not in ("rope_theta", "rope_scaling")}
    only_parameters["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    assert DrafterConfig.from_zlab(only_parameters).rope_theta == theta


def test_the_mask_token_is_read_from_dflash_config(tmp_path, target_dir, trained):
    """Where vLLM and z-lab's loader read it: dflash_config.mask_token_id, never a top-level key."""
    from transformers import AutoConfig

    from dflash_jobs.drafter.dflash import DFlashDraftModel
    from dflash_jobs.drafter.export import load_drafter, load_drafter_config

    mask = trained.config.mask_token_id
    export_dflash(trained, open_storage(str(tmp_path)), prefix="")
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["dflash_config"]["mask_token_id"] == mask and "mask_token_id" not in raw
    raw["mask_token_id"] = mask + 1  # a decoy where a careless reader would look
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_drafter_config(str(tmp_path)).mask_token_id == mask
    loaded, _ = load_drafter(str(tmp_path), target=str(target_dir))
    assert loaded.config.mask_token_id == mask
    assert DFlashDraftModel(AutoConfig.from_pretrained(tmp_path)).mask_token_id == mask


def test_the_export_carries_the_drafters_trained_norm_as_the_x_times_w_weight_vllm_loads(tmp_path, target_dir, trained):
    """vLLM's DFlash drafter (qwen3_dflash.py) loads `norm.weight` into its RMSNorm, x * w as Qwen3's
    (never the target's zero-centred 1 + w): the export holds the drafter's own trained norm in that
    form, and the evaluation's loader keeps it (the target's tensors, loaded after, do not replace it)."""
    from safetensors.torch import load_file
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from dflash_jobs.drafter.export import load_drafter

    export_dflash(trained, open_storage(str(tmp_path)), prefix="")
    exported = load_file(tmp_path / "model.safetensors")["norm.weight"]
    assert torch.equal(exported.float(), trained.norm.weight)
    qwen3 = Qwen3RMSNorm(trained.config.hidden_size, eps=trained.config.rms_norm_eps)
    qwen3.weight.data.copy_(exported.float())
    x = torch.randn(5, trained.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(qwen3(x), trained.norm(x))
    loaded, _ = load_drafter(str(tmp_path), target=str(target_dir))
    assert torch.equal(loaded.norm.weight.float(), trained.norm.weight)
    # Loaded to draft, never to train: no weight tracks a gradient (a tracked one made scoring outside
    # inference mode raise "Inference tensors cannot be saved for backward" on DFlash2's trees).
    assert not any(p.requires_grad for p in loaded.parameters())
    assert not torch.allclose(loaded.norm.weight.float(), loaded.target_norm.float(), atol=1e-2)  # the target's norm is another one
