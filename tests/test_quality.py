"""The whole chain makes a drafter that drafts: bench/quality at its CPU size, end to end.

A small Qwen3.5-architecture target is trained briefly on the Python standard library, answers
new prompts (the regenerated data), and the product's own entry points prepare, extract (two
shards), verify, train and evaluate. Training accuracy can look fine on broken data (leaky masks,
all-zero hidden states, text the target never wrote); speculative decoding on held-out prompts
cannot: it must accept far more than the plain one token per step, beat training-free prompt
lookup on the same prompts, and return exactly the target's greedy output.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "quality" / "run_quality.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("run_quality", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_cpu_chain_trains_a_drafter_that_drafts(tmp_path):
    result = load_bench().run("cpu", tmp_path)

    dflash, lookup = result["drafters"]["dflash"], result["drafters"]["prompt_lookup"]
    assert result["lossless"] and dflash["lossless"] and lookup["lossless"], (dflash["mismatches"], lookup["mismatches"])
    assert dflash["acceptance_length"] > 1.5
    assert dflash["acceptance_length"] > lookup["acceptance_length"] + 0.5
    # A drafter that drafts gets past the first position: a next-token-only one would stop there.
    assert dflash["acceptance_per_position"][1] > 0.2
    assert result["regeneration"]["rows"] == result["settings"]["chats"]
