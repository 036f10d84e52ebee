"""bench/evaluation/sdpa_shapes.py: its attention calls are the evaluation's layouts (a prompt's causal
prefill over its window, the drafter's blocks against a document), a padded call differs from the
unpadded one only by rows or columns no real query reads, and a CPU run writes every layout's
timings and agreement (a backend the device lacks reported as refused) and the linear layers'
padded rows against the unpadded ones."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "evaluation"
CPU = torch.device("cpu")


@pytest.fixture
def sdpa_shapes(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("sdpa_shapes")


def test_a_prefill_is_causal_over_its_window_and_its_padding_adds_query_rows_only(sdpa_shapes):
    (q, k, v), kwargs = sdpa_shapes.prefill_call(70, False, device=CPU, dtype=torch.float32, seed=3)
    (pq, pk, pv), padded = sdpa_shapes.prefill_call(70, True, device=CPU, dtype=torch.float32, seed=3)
    assert q.shape == (1, 9, 70, 64) and k.shape == v.shape == (1, 9, 128, 64)  # the window: 70 rounded up to 64s
    mask = kwargs["attn_mask"][0, 0]
    assert mask.sum(dim=1).tolist() == list(range(1, 71))  # row r sees columns 0..r
    assert pq.shape[2] == 128 and torch.equal(pq[:, :, :70], q) and torch.equal(pk, k) and torch.equal(pv, v)
    assert torch.equal(padded["attn_mask"][0, 0, :70], mask)


def test_the_drafters_blocks_see_their_anchors_context_and_their_own_block_and_never_the_padding(sdpa_shapes):
    length, blocks, block = 30, sdpa_shapes.NEW_TOKENS, sdpa_shapes.BLOCK
    (q, k, v), kwargs = sdpa_shapes.simulate_call(length, False, device=CPU, dtype=torch.float32, seed=5)
    (pq, pk, pv), padded = sdpa_shapes.simulate_call(length, True, device=CPU, dtype=torch.float32, seed=5)
    context = length + blocks
    queries = blocks * block
    keys = context + queries
    assert q.shape[2] == queries and k.shape[2] == keys and kwargs["enable_gqa"]
    mask = kwargs["attn_mask"]
    for query in (0, block - 1, block, queries - 1):
        anchor = length + query // block
        seen = mask[query].nonzero().flatten().tolist()
        own = context + (query // block) * block
        assert seen == [*range(anchor), *range(own, own + block)]
    assert pk.shape[2] == 896 and torch.equal(pq, q)  # 846 keys padded to a multiple of 64
    assert torch.equal(pk[:, :, :keys], k) and torch.equal(pv[:, :, :keys], v)
    assert torch.equal(padded["attn_mask"][:, :keys], mask)
    assert not padded["attn_mask"][:, keys:].any()  # padding columns: seen by no query


def test_a_cpu_run_times_and_compares_every_layout_and_says_which_backend_it_lacks(sdpa_shapes, tmp_path, monkeypatch):
    out = tmp_path / "sdpa.json"
    monkeypatch.setattr(sys, "argv", ["sdpa_shapes.py", "--device", "cpu", "--lengths", "2", "--backends", "default,MATH,CUDNN_ATTENTION",
                                      "--out", str(out)])
    assert sdpa_shapes.main() == 0
    result = json.loads(out.read_text())
    assert set(result["layouts"]) == {"prefill", "simulate"}
    for layout in result["layouts"].values():
        assert layout["default_backend"] in {"FLASH_ATTENTION", "MATH"}
        assert "No viable backend" in layout["timings"]["CUDNN_ATTENTION"]["refused"]
        for backend in ("default", "MATH"):
            assert layout["timings"][backend]["lengths"] == 2 and layout["timings"][backend]["new_shape_ms"] > 0
        assert set(layout["agreement"]) == {"default", "MATH"}
        assert layout["agreement"]["default"]["equal_to_default"] == 2  # the default against itself: bitwise
        assert layout["agreement"]["MATH"]["max_diff_to_default"] < 1e-4
    assert set(result["gemms"]) == set(sdpa_shapes.GEMMS)
    for gemm in result["gemms"].values():
        assert gemm["lengths"] == 2 and 0 <= gemm["padded_equal"] <= 2 and gemm["padded_max_diff"] < 1e-4


def test_an_unknown_backend_or_layout_is_refused_by_name(sdpa_shapes, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["sdpa_shapes.py", "--device", "cpu", "--backends", "CUDNN", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit):
        sdpa_shapes.main()
    assert "'CUDNN' is neither a backend" in capsys.readouterr().err
