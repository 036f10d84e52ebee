"""A dense Llama target with tied embeddings (dflash_jobs.architectures.tiny.llama, shaped as SmolLM2: its tokenizer
fills every embedding row) through training and evaluation, where the target's architecture and
tokenizer are read: each drafter trains on its states with the mask token its tokenizer leaves
(<repo_name>, logged with why, recorded in every export) and its tied LM head, the evaluation job
decodes by chains and draft trees losslessly on plain attention, and every export is written
(z-lab's for DFlash and DFlash2, DeepSpec's and speculators' for DSpark, and the run's hidden states
in speculators' layout by `dflashctl export-states`).

Each step on its own runs on both tiny targets where it is tested (test_extract_*, test_tree_verify,
test_drafter_checkpoint, test_drafter_export, ...); each variant's whole run on the hybrid target is
test_dflash2_train's, test_dspark_pipeline's and test_demo's."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from safetensors import safe_open

from cli_runner import cli
from conftest import shared_directory
from dflash_jobs.errors import EXIT_OK
from dflash_jobs.evaluate.__main__ import main as evaluate_main
from dflash_jobs.formats import DRAFTER_CONFIG_KEY, EVAL_REPORT_KEY, SPECULATORS_DRAFTER_DIR, Manifest
from dflash_jobs.speculators import SUMMARY_KEY, hs_key
from dflash_jobs.architectures.tiny.llama import UNUSED_MARKER
from dflash_jobs.train.__main__ import main as train_main
from train_fixtures import LAYERS, copy_extract, hold_out_tiny_chats, tiny_extract, tiny_target, train_spec_dict, write_spec

BLOCK = 4
PROMPTS, NEW_TOKENS, TREE = 2, 12, 6
MASK = 3  # <repo_name>: the lowest special token with no role that the template never writes
EXPORTED_MASK = {  # where each export states its mask token
    "dflash": lambda config: config["dflash_config"]["mask_token_id"],
    "dflash2": lambda config: config["dflash_config"]["mask_token_id"],
    "dspark": lambda config: config["mask_token_id"],
}

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def states(root) -> Path:
    """The tiny Llama's states with its final hidden state (what DSpark reads), as verify leaves them: shared, read only."""
    return shared_directory(lambda: tiny_extract(root, final_hidden=True, architecture="llama"))


@pytest.mark.parametrize("drafter", list(EXPORTED_MASK))
def test_each_drafter_trains_exports_and_decodes_losslessly_by_chains_and_trees(root, states, tmp_path, caplog, capfd, drafter):
    target = tiny_target(root, "llama")
    output = copy_extract(states, tmp_path / "run")
    spec = train_spec_dict(target, output, drafter=drafter, block_size=BLOCK, epochs=1, checkpoint_every=100,
                           **({"dspark": {"markov_rank": 16}} if drafter == "dspark" else {}))
    spec["eval"] = {"prompts": PROMPTS, "max_new_tokens": NEW_TOKENS, "tree_budgets": [TREE]}
    spec_file = write_spec(tmp_path / "dflash.yaml", spec)
    with caplog.at_level(logging.INFO):
        assert train_main(["-f", str(spec_file)]) == EXIT_OK
    assert f"mask token {MASK}: {UNUSED_MARKER} ({MASK}): the tokenizer uses all 975 embedding rows" in caplog.text
    config = json.loads((output / DRAFTER_CONFIG_KEY).read_text())
    assert EXPORTED_MASK[drafter](config) == MASK and config["vocab_size"] == 975
    with safe_open(output / "train/drafter/model.safetensors", "pt") as weights:
        assert not any("embed" in key or "lm_head" in key for key in weights.keys())  # vLLM shares the target's (tied) tables
    if drafter == "dspark":
        assert json.loads((output / SPECULATORS_DRAFTER_DIR / "config.json").read_text())["mask_token_id"] == MASK

    hold_out_tiny_chats(target, output, PROMPTS, seed=7)
    assert evaluate_main(["-f", str(spec_file)]) == EXIT_OK
    report = json.loads((output / EVAL_REPORT_KEY).read_text())
    assert report["drafter_variant"] == drafter and report["lossless"]
    trees = report["drafters"][drafter]["tree"]
    assert trees["budgets"][-1] == TREE and trees["lossless"]  # after the chain's own budget
    assert set(trees["decoded"]) == {str(budget) for budget in trees["budgets"]} and all(d["lossless"] for d in trees["decoded"].values())
    assert report["drafters"][drafter]["verify_steps"] >= PROMPTS and report["drafters"]["prompt_lookup"]["lossless"]
    assert '"lossless": true' in capfd.readouterr().out


def test_its_hidden_states_export_in_speculators_layout(root, states, tmp_path, monkeypatch, capsys):
    """`dflashctl export-states` of the run: one file a sample, its captured layers then its final hidden state."""
    output = copy_extract(states, tmp_path / "run")
    spec = write_spec(tmp_path / "dflash.yaml", train_spec_dict(tiny_target(root, "llama"), output))
    code, _, err = cli(monkeypatch, capsys, "export-states", "--format", "speculators", "-f", str(spec))
    assert code == 0, err
    destination = output / "export/speculators/hidden_states"
    summary = json.loads((destination / SUMMARY_KEY).read_text())
    manifest = Manifest.from_json((output / "extract/manifest.json").read_bytes())
    assert summary["samples"] == manifest.samples and summary["final_hidden"] and summary["last_layer"] == 8
    assert summary["aux_hidden_state_layer_ids"] == [layer + 1 for layer in LAYERS]
    with safe_open(destination / hs_key(0), "pt") as first:
        assert first.get_slice("hidden_states").get_shape()[1:] == [len(LAYERS) + 1, 64]
