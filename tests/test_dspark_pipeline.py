"""A DSpark run through the product's own entry points on the tiny fixtures: `python -m
dflash_jobs.train` on the stored states, then `python -m dflash_jobs.evaluate` on held-out chats:
its exports, its training figures, lossless speculative decoding with every slot of the block
drafted, the training forward's acceptance at the decoded anchors, the confidence head's
calibration, and the serve line. A spec that reads the target's final hidden state is refused on
states stored without it, naming both fixes, and the CE-only one of them trains."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_jobs.formats import DRAFTER_CONFIG_KEY, EVAL_REPORT_KEY, SPECULATORS_DRAFTER_DIR, TRAIN_METRICS_KEY
from dflash_jobs.train.dspark_loss import RATIOS
from train_fixtures import copy_extract, hold_out_tiny_chats, tiny_target, train_spec_dict, write_spec

BLOCK = 4
HOLDOUT = 3
NEW_TOKENS = 24


def dspark_spec(root: Path, output: Path, **dspark) -> dict:
    spec = train_spec_dict(tiny_target(root), output, drafter="dspark", block_size=BLOCK, epochs=4, lr=1e-2, dspark={"markov_rank": 16, **dspark})
    spec["eval"] = {"prompts": HOLDOUT, "max_new_tokens": NEW_TOKENS}
    return spec


def job(module: str, spec: Path, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, "-f", str(spec)], capture_output=True, text=True, timeout=900,
        env={**os.environ, "DFLASH_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"},
    )


def trained_and_evaluated(root: Path, extract: Path, tmp_path: Path, **dspark) -> tuple[Path, subprocess.CompletedProcess]:
    output = copy_extract(extract, tmp_path / "run")
    spec = write_spec(tmp_path / "dflash.yaml", dspark_spec(root, output, **dspark))
    trained = job("dflash_jobs.train", spec, tmp_path / "cache")
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    hold_out_tiny_chats(tiny_target(root), output, HOLDOUT, seed=11)
    evaluated = job("dflash_jobs.evaluate", spec, tmp_path / "cache")
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    return output, trained


def check_exported_and_evaluated(output: Path, *, confidence_head: bool) -> dict:
    config = json.loads((output / DRAFTER_CONFIG_KEY).read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["sample_from_anchor"] is True
    assert (config["block_size"], config["enable_confidence_head"]) == (BLOCK, confidence_head)
    assert json.loads((output / SPECULATORS_DRAFTER_DIR / "config.json").read_text())["speculators_model_type"] == "dspark"
    report = json.loads((output / EVAL_REPORT_KEY).read_text())
    assert report["drafter_variant"] == "dspark" and report["block_size"] == BLOCK + 1  # the verify block: the anchor and B drafts
    assert report["lossless"], report["drafters"]["dspark"]["mismatches"]
    dspark = report["drafters"]["dspark"]
    assert len(dspark["acceptance_per_position"]) == BLOCK
    assert dspark["simulated"]["at_decoded_anchors"]["steps"] > 0 and dspark["simulated"]["disagreeing_positions"] == []
    assert '"method": "dspark"' in report["vllm_serve"] and f'"num_speculative_tokens": {BLOCK}' in report["vllm_serve"]
    assert report["vllm_serve"].startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve")
    assert ("calibration" in dspark) == confidence_head and "calibration" not in report["drafters"]["prompt_lookup"]
    bigram = report["drafters"]["bigram"]  # the baselines draft as many tokens a block as DSpark does
    assert bigram["lossless"] and len(bigram["acceptance_per_position"]) == len(bigram["conditional_acceptance"]["rates"]) == BLOCK
    return report


@pytest.mark.slow
def test_a_ce_only_dspark_trains_on_states_without_the_final_hidden_state_and_decodes_lossless(root, extract, tmp_path):
    output, trained = trained_and_evaluated(root, extract, tmp_path, ce_only=True)
    records = [json.loads(line) for line in (output / TRAIN_METRICS_KEY).read_text().splitlines()]
    assert set(RATIOS) <= records[-1].keys()
    assert records[-1]["ce"] < records[0]["ce"]
    assert all(math.isnan(records[-1][name]) for name in ("l1", "confidence", "confidence_target", "confidence_error"))  # nothing read them
    check_exported_and_evaluated(output, confidence_head=False)


@pytest.fixture(scope="module")
def extract_with_final(root) -> Path:
    """The tiny extract with the target's final hidden state (pre-norm, the last decoder layer's output) in every chunk."""
    from train_fixtures import tiny_extract

    return tiny_extract(root, final_hidden=True)


@pytest.mark.slow
def test_a_dspark_run_trains_toward_the_targets_distribution_and_decodes_lossless_with_its_calibration(root, extract_with_final, tmp_path):
    output, trained = trained_and_evaluated(root, extract_with_final, tmp_path)
    assert "| ce " in trained.stdout and " l1 " in trained.stdout  # the console line shows the heads' figures
    records = [json.loads(line) for line in (output / TRAIN_METRICS_KEY).read_text().splitlines()]
    first, last = records[0], records[-1]
    assert all(math.isfinite(last[name]) for name in RATIOS)
    assert last["loss"] < first["loss"] and 0 < last["l1"] < 2
    assert last["confidence_target"] == pytest.approx(1 - last["l1"] / 2, abs=1e-4)  # c* = 1 - L1/2 (L1 <= 2: the clamp never binds)
    assert last["confidence_error"] < first["confidence_error"] / 2  # the head learns to predict it
    report = check_exported_and_evaluated(output, confidence_head=True)
    calibration = report["drafters"]["dspark"]["calibration"]
    positions = calibration["per_position"]
    assert [p["position"] for p in positions] == list(range(1, BLOCK + 1))
    assert 0 < positions[0]["steps"] <= report["drafters"]["dspark"]["verify_steps"]
    for position in positions:
        if position["steps"]:
            assert 0 <= position["predicted_survival"] <= 1 and 0 <= position["realized_survival"] <= 1
            assert 0 <= position["brier"] <= 1 and 0 <= position["ece"] <= 1

@pytest.mark.slow
def test_a_dspark_spec_on_states_without_the_final_hidden_state_is_refused_naming_both_fixes(root, extract, tmp_path):
    from dflash_jobs.errors import EXIT_BAD_INPUT

    output = copy_extract(extract, tmp_path / "run")
    spec = write_spec(tmp_path / "dflash.yaml", dspark_spec(root, output))
    refused = job("dflash_jobs.train", spec, tmp_path / "cache")
    assert refused.returncode == EXIT_BAD_INPUT
    assert "extract.final_hidden: true" in refused.stdout and "train.dspark.ce_only: true" in refused.stdout
    assert not (output / "train").exists()
