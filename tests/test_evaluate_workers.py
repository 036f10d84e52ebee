"""The evaluation's worker processes (evaluate/workers.py): started at once, loading while this process
decodes the timed prompts alone, warming up only when let go; and the prompts shared between them and
this process, the results in prompt order."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

from dflash_jobs.evaluate.workers import WORKER_QUEUE, Workers, share_prompts


class RecordingDecoder:
    """A worker's decoder that writes what it does to a file (the worker is another process)."""

    def __init__(self, events: Path) -> None:
        self.events = events
        self.record("loaded")

    def record(self, event: str) -> None:
        with self.events.open("a") as out:
            out.write(event + "\n")

    def warm_up(self, asked, *, speeds=True) -> None:
        self.record(f"warm-up {int(asked[0])}{' with speeds' if speeds else ''}")

    def decode(self, prompt, known=None):
        self.record(f"decode {int(prompt)}")
        return int(prompt) * 10


def recorded(events: Path) -> list[str]:
    return events.read_text().split() if events.exists() else []


def test_a_worker_loads_at_once_and_warms_up_only_when_let_go(tmp_path):
    """Entering the pool starts the worker, which loads its decoder while this process decodes the timed
    prompts; its warm-up (kernels on the device) waits for `go`, and prompts are handed to it after."""
    events = tmp_path / "events"
    with Workers(1, partial(RecordingDecoder, events), torch.tensor(7)) as workers:
        deadline = time.monotonic() + 120
        while recorded(events) != ["loaded"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert recorded(events) == ["loaded"]  # started and loaded, with no prompt handed to it
        time.sleep(0.5)  # time enough to warm up, were it not held
        assert recorded(events) == ["loaded"]
        workers.go()
        assert workers.submit((torch.tensor(3), None)).result(timeout=120) == 30
    assert " ".join(recorded(events)) == "loaded warm-up 7 decode 3"


def test_a_pool_of_no_workers_starts_no_process_and_leaves_the_threads():
    threads = torch.get_num_threads()
    with Workers(0, partial(RecordingDecoder, Path("/nonexistent")), None) as workers:
        workers.go()
        assert workers.count == 0 and torch.get_num_threads() == threads


def test_this_process_decodes_beside_the_workers_and_the_results_come_in_prompt_order():
    """The workers hold up to WORKER_QUEUE prompts each, this process takes the rest as they wait (after
    its warm-up prompt), and every result comes back once, in prompt order, whoever decoded it."""
    asked = [(torch.tensor([i]), None) for i in range(9)]
    here_calls = []
    decoded_here = threading.Event()

    class Here:  # this process's decoder (DecoderOnFirstUse's warm and PromptDecoder's decode)
        def warm(self, asked):
            if not here_calls:
                self.decode(*asked)
            return self

        def decode(self, prompt, known):
            here_calls.append(int(prompt))
            if len(here_calls) == 2:  # its warm-up, then a prompt of its own
                decoded_here.set()
            return ("here", int(prompt))

    def in_worker(item):
        # The worker ends nothing before this process has taken a prompt (whatever the machine's load),
        # so the results end out of prompt order and this process's first take is the same every run.
        assert decoded_here.wait(timeout=30)
        return (threading.current_thread().name, int(item[0]))

    with ThreadPoolExecutor(1, thread_name_prefix="worker") as pool:
        results = list(share_prompts(lambda item: pool.submit(in_worker, item), 1, Here(), asked))
    assert [index for _, index in results] == list(range(9))
    by_worker = [index for who, index in results if who.startswith("worker")]
    assert by_worker[:WORKER_QUEUE] == list(range(WORKER_QUEUE))  # handed out first
    assert here_calls[0] == 0 and here_calls[1] == WORKER_QUEUE  # the warm-up prompt, then the first the workers do not hold
    assert sorted(by_worker + here_calls[1:]) == list(range(9))  # every prompt decoded once
