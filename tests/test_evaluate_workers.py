"""The evaluation's worker processes (evaluate/workers.py): started at once, loading and warming up
while this process does, idle until handed prompts; and the prompts shared between them and this
process, the results in prompt order."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import partial
from pathlib import Path

import pytest
import torch

from dflash_jobs.evaluate.workers import WORKER_QUEUE, Workers, share_prompts


class RecordingDecoder:
    """A worker's decoder that writes what it does to a file of its process's own (the worker is another process)."""

    def __init__(self, events: Path) -> None:
        self.events = events.with_name(f"{events.name}-{os.getpid()}")
        self.record("loaded")

    def record(self, event: str) -> None:
        with self.events.open("a") as out:
            out.write(event + "\n")

    def warm_up(self, asked, *, speeds=True) -> None:
        self.record(f"warm-up {int(asked[0])}{' with speeds' if speeds else ''}")

    def decode(self, prompt, known=None):
        self.record(f"decode {int(prompt)}")
        return int(prompt) * 10


class FailingDecoder(RecordingDecoder):
    def __init__(self, events: Path) -> None:
        raise RuntimeError("the target does not fit")


def recorded(events: Path) -> list[str]:
    return events.read_text().splitlines() if events.exists() else []


def test_workers_load_and_warm_up_at_once_each_once_and_then_wait_for_prompts(tmp_path):
    """Entering the pool starts the workers, which load their decoders and warm up while this process
    loads and warms up its own; wait_warm returns once every one is warm, each warmed up once (one
    waiting for the others takes no second warm-up), and they do nothing more until handed a prompt."""
    def all_events() -> list[str]:
        return sorted(event for path in tmp_path.glob("events-*") for event in recorded(path))

    with Workers(2, partial(RecordingDecoder, tmp_path / "events"), torch.tensor(7)) as workers:
        workers.wait_warm()
        assert all_events() == ["loaded", "loaded", "warm-up 7", "warm-up 7"]  # no prompt handed to them
        time.sleep(0.5)
        assert all_events() == ["loaded", "loaded", "warm-up 7", "warm-up 7"]  # idle while the timed prompts would decode
        workers.go()
        assert sorted(workers.submit((torch.tensor(i), None)).result(timeout=120) for i in (3, 4)) == [30, 40]
    assert all_events() == ["decode 3", "decode 4", "loaded", "loaded", "warm-up 7", "warm-up 7"]
    assert [recorded(path)[:2] for path in tmp_path.glob("events-*")] == [["loaded", "warm-up 7"]] * 2  # one warm-up a process


def test_a_worker_that_fails_to_load_is_said_at_wait_warm_and_the_pool_ends(tmp_path):
    with pytest.raises(BrokenProcessPool):
        with Workers(1, partial(FailingDecoder, tmp_path / "events"), torch.tensor(7)) as workers:
            workers.wait_warm()


class OneSlowToLoadDecoder(RecordingDecoder):
    """The first process to load is quick; any other takes 3 s to load."""

    def __init__(self, events: Path) -> None:
        try:
            os.close(os.open(events.with_name("quick"), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            time.sleep(3.0)
        super().__init__(events)


def test_a_failure_while_a_warm_worker_waits_for_the_others_ends_the_pool(tmp_path):
    """This process fails while one worker, warm, waits at the barrier for another still loading: the
    pool ends (once the slow one has loaded), without the shutdown waiting on the barrier for ever."""
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="the timed prompts failed"):
        with Workers(2, partial(OneSlowToLoadDecoder, tmp_path / "events"), torch.tensor(7)):
            deadline = time.monotonic() + 60
            while not any("warm-up 7" in recorded(path) for path in tmp_path.glob("events-*")) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sum("warm-up 7" in recorded(path) for path in tmp_path.glob("events-*")) == 1  # the quick one, at the barrier
            raise RuntimeError("the timed prompts failed")
    assert time.monotonic() - started < 60


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
