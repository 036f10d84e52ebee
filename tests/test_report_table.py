"""`dflashctl eval`'s table of the evaluation report (controller/dflashctl/cli/reporting.py)."""

from __future__ import annotations

from dflashctl.cli.options import OutputFormat
from dflashctl.cli.reporting import print_report


def decoding(acceptance_length: float, tokens_per_second: float, speedup: float, lossless: bool) -> dict:
    """The figures metrics.summarize gives a decoding (the table reads these four)."""
    return {"acceptance_length": acceptance_length, "tokens_per_second": tokens_per_second, "speedup": speedup, "lossless": lossless,
            "verify_steps": 10, "mismatches": []}


def test_each_draft_tree_budget_gets_a_row_under_its_drafter(capsys):
    trees = {"budgets": [7, 16, 64], "decoded": {"7": decoding(2.9, 51.0, 1.7, True), "16": decoding(3.4, 55.5, 1.85, True),
                                                 "64": decoding(3.9, 48.25, 1.6, False)}, "lossless": False}
    report = {"prompts": 8, "block_size": 8, "greedy": {"tokens_per_second": 30.0},
              "drafters": {"dflash": {**decoding(2.8, 60.0, 2.0, True), "tree": trees}, "prompt_lookup": decoding(1.3, 35.0, 1.17, True)}}
    print_report(report, OutputFormat.table)
    rows = [line.strip("│┃ ").split("│") for line in capsys.readouterr().out.splitlines() if line.count("│") >= 4]
    cells = {row[0].strip(): [cell.strip() for cell in row[1:]] for row in rows}
    assert list(cells) == ["greedy (reference)", "dflash", "tree of 7", "tree of 16", "tree of 64", "prompt_lookup"]
    assert cells["dflash"] == ["2.80", "60.00", "2.00x", "yes"]
    assert cells["tree of 16"] == ["3.40", "55.50", "1.85x", "yes"]
    assert cells["tree of 64"] == ["3.90", "48.25", "1.60x", "NO"]


def test_tau_is_shown_with_its_interval_where_the_report_has_one(capsys):
    report = {"prompts": 32, "block_size": 16, "greedy": {"tokens_per_second": 30.0},
              "drafters": {"dflash": {**decoding(2.8, 60.0, 2.0, True), "acceptance_length_interval": [2.614, 2.991]},
                           "bigram": {**decoding(1.3, 35.0, 1.17, True), "acceptance_length_interval": [None, None]}}}
    print_report(report, OutputFormat.table)
    printed = capsys.readouterr().out
    assert "[95% interval]" in printed  # the column's title
    rows = {row[0].strip(): row[1].strip() for row in (line.strip("│┃ ").split("│") for line in printed.splitlines() if line.count("│") >= 4)}
    assert rows["dflash"] == "2.80 [2.61, 2.99]" and rows["bigram"] == "1.30"  # no interval (no verify step): tau alone


def test_a_report_without_trees_has_no_tree_rows(capsys):
    print_report({"greedy": {}, "drafters": {"dflash": decoding(2.8, 60.0, 2.0, True)}}, OutputFormat.table)
    assert "tree of" not in capsys.readouterr().out
