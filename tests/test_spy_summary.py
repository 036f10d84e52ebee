"""bench/evaluation/spy_summary.py: py-spy's raw records (a command over several lines among them)
summed per process into inclusive and self seconds, and the seconds spent compiling sources."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "evaluation"

RAW = """\
process 10:"python3 -c 
import x
main()";<module> (<string>:3);main (m.py:5);decode (m.py:9) 30
process 10:"python3 -c 
import x
main()";<module> (<string>:3);main (m.py:6);_find_and_load (<frozen importlib._bootstrap>:1);SourceLoader.source_to_code (<frozen importlib._bootstrap_external>:9) 20
process 11:"bench";<module> (b.py:1) 5
"""


@pytest.fixture
def spy_summary(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("spy_summary")


def test_each_process_gets_its_seconds_its_functions_over_their_lines_and_its_compiling(spy_summary):
    out = spy_summary.summarize(RAW, rate=10.0, top=10)
    assert list(out) == ["process 10", "process 11"]
    main = out["process 10"]
    assert main["seconds"] == 5.0 and main["compiling_sources_seconds"] == 2.0
    inclusive = {row["frame"]: row["seconds"] for row in main["inclusive"]}
    assert inclusive["main (m.py)"] == 5.0  # lines 5 and 6 of one function
    assert inclusive["decode (m.py)"] == 3.0
    assert {row["frame"]: row["seconds"] for row in main["self"]}["decode (m.py:9)"] == 3.0
    assert out["process 11"]["seconds"] == 0.5 and out["process 11"]["compiling_sources_seconds"] == 0.0
