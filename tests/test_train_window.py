"""The trainer's log window: its figures over the steps since the last line, with the share of the
window the loop waited for its batches (a loader that starves the GPU shows as that, not as a slow
step), and the console line that shows it."""

from __future__ import annotations

import time

import pytest
import torch

from dflash_jobs.train.loss import DraftLoss
from dflash_jobs.train.metrics import ConsoleSink
from dflash_jobs.train.trainer import MetricsWindow


def step_out(block_size: int) -> DraftLoss:
    return DraftLoss(loss=torch.tensor(2.0), correct_per_slot=torch.ones(block_size, dtype=torch.int64),
                     supervised_per_slot=torch.full((block_size,), 2, dtype=torch.int64), accepted=torch.tensor(3), blocks=4)


def test_the_window_gives_its_tokens_per_second_and_the_share_of_it_spent_waiting_for_batches():
    window = MetricsWindow(4, torch.device("cpu"))
    window.add(step_out(4), tokens=1000)
    window.add(step_out(4), tokens=1000)
    window.started = time.monotonic() - 2.0  # a window of two seconds, not a sleep
    metrics = window.read(waited_s=0.5)
    assert metrics["data_wait"] == pytest.approx(0.25, rel=0.01)
    assert metrics["tokens_per_s"] == pytest.approx(1000.0, rel=0.01)
    assert metrics["loss"] == 2.0 and metrics["blocks"] == 8
    window.reset()
    window.add(step_out(4), tokens=10)
    assert window.read()["data_wait"] == 0.0  # a loop that never waited


def test_the_console_line_says_how_much_of_the_interval_the_loop_waited_for_data(caplog):
    record = {"total_steps": 20, "epoch": 0, "loss": 2.9, "accuracy": [1.0, 0.7], "acceptance_length": 3.16, "lr": 5e-4,
              "tokens_per_s": 77026.0, "tflop_per_s": 40.8, "mfu": 0.041, "data_wait": 0.254, "eta_s": 60}
    with caplog.at_level("INFO"):
        ConsoleSink().log(record, 10)
    assert "| 77026 tok/s, 40.8 TFLOP/s, MFU 4.1%, waiting for data 25% | eta 1m" in caplog.text
