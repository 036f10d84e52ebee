"""bench/evaluation/eval_chain.py's reading of an eval step's log: setup, decoding and report by the
log's times, and the version after's own load and warm-up lines where it logs them."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "evaluation"

AFTER_LOG = """\
2026-12-07 15:00:00,000 eval: target /t (cuda:0, torch.bfloat16), drafter: dflash, 3 layers, block 16; 4 prompts
2026-12-07 15:00:04,500 eval: target and drafter loaded on cuda:0 in 2.5 s
2026-12-07 15:00:07,000 eval: warm-up prompt decoded in 2.4 s (kernels chosen, graphs captured)
2026-12-07 15:00:08,000 eval: prompt 1/4: dflash tau 1.00; every output identical to greedy so far: True
2026-12-07 15:00:10,250 eval: prompt 4/4: dflash tau 1.00; every output identical to greedy so far: True
2026-12-07 15:00:13,250 eval: serve it with vLLM:
"""


@pytest.fixture
def eval_chain(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("eval_chain")


def test_the_parts_of_an_evaluation_after_include_its_load_and_warm_up(eval_chain):
    assert eval_chain.logged_parts(AFTER_LOG) == {"setup_seconds": 8.0, "load_seconds": 2.5, "warm_up_seconds": 2.4,
                                                  "decoding_seconds": 2.25, "prompts": 3, "report_seconds": 3.0}


def test_the_timed_prompts_alone_and_their_decodings_share_are_read_where_logged(eval_chain):
    timed = ("2026-12-07 15:00:09,000 eval: timed prompts: 2 decoded alone in 1.9 s, 1.2 s of it their timed decodings "
             "(greedy 0.5 s, dflash 0.7 s)\n")
    lines = AFTER_LOG.splitlines(keepends=True)
    log = "".join(lines[:4]) + timed + "".join(lines[4:])
    assert eval_chain.logged_parts(log) == {"setup_seconds": 8.0, "load_seconds": 2.5, "warm_up_seconds": 2.4, "timed_alone_seconds": 1.9,
                                            "timed_decodings_seconds": 1.2, "decoding_seconds": 2.25, "prompts": 3, "report_seconds": 3.0}


def test_a_log_without_the_setup_lines_gives_the_three_parts_alone(eval_chain):
    before = "\n".join(line for line in AFTER_LOG.splitlines() if "loaded on" not in line and "warm-up" not in line)
    assert eval_chain.logged_parts(before) == {"setup_seconds": 8.0, "decoding_seconds": 2.25, "prompts": 3, "report_seconds": 3.0}


def test_the_logs_go_beside_the_json(eval_chain, tmp_path):
    logs = eval_chain.logs_beside(tmp_path / "out" / "eval-chain-plain-h100.json")
    assert logs == tmp_path / "out" / "eval-chain-plain-h100-logs" and logs.is_dir()
