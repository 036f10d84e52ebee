"""Worker processes decoding held-out prompts beside the evaluation's own (eval.processes > 1).

A small target at batch 1 leaves the GPU idle between its kernel launches, so several processes,
each with its own target and drafter, decode prompts at once on one device. They are spawned as
the evaluation starts, and load and warm up (their first kernels and graph captures) while it loads
and warms up its own; it waits for them to be warm before it decodes the timed prompts, which then
run on a device no other process runs kernels on (a warm worker waits for prompts), and hands them
prompts only after. Then whoever is free takes the next prompt, and the results come back in prompt
order (share_prompts).
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, Callable, Iterator, Protocol

import torch

WORKER_QUEUE = 2
"""Prompts a worker holds (the one it decodes and the next), so that it never waits while this process
decodes one of its own; this process takes the rest."""

Asked = tuple[torch.Tensor, Any]
"""A prompt and what is known of it (its reference decoding from an earlier evaluation, or None)."""


class Decoder(Protocol):
    def decode(self, prompt: torch.Tensor, known: Any = None) -> Any: ...

    def warm_up(self, asked: Asked, *, speeds: bool = True) -> None: ...


class WarmDecoder(Protocol):
    def warm(self, asked: Asked) -> Decoder:
        """This process's decoder, loaded and warmed up (with `asked` where it was not yet)."""
        ...


_worker_decoder: Decoder | None = None
_all_warm: Any = None


def _start_worker(load: Callable[[], Decoder], threads: int, all_warm: Any) -> None:
    global _worker_decoder, _all_warm
    torch.set_num_threads(threads)
    _worker_decoder, _all_warm = load(), all_warm


def _warm_up_worker(warm_up_prompt: torch.Tensor) -> None:
    assert _worker_decoder is not None
    _worker_decoder.warm_up((warm_up_prompt, None), speeds=False)  # a worker decodes no timed prompt
    # One warm-up a worker: one that waits here for the others takes no second.
    _all_warm.wait()


def _decode_in_worker(asked: Asked) -> Any:
    assert _worker_decoder is not None
    return _worker_decoder.decode(*asked)


class Workers:
    """`count` worker processes, each loading its decoder with `load` (a picklable call: they are spawned
    interpreters, since CUDA cannot be used in a forked child) and warming up on `warm_up_prompt` as
    soon as the pool is entered; `wait_warm` returns once all are warm. The CPU threads are shared out
    between them and this process from `go` on, when they start taking prompts. count 0: no process;
    share_prompts then decodes every prompt here."""

    def __init__(self, count: int, load: Callable[[], Decoder], warm_up_prompt: torch.Tensor | None) -> None:
        self.count, self.load, self.warm_up_prompt = count, load, warm_up_prompt

    def __enter__(self) -> Workers:
        if self.count:
            context = multiprocessing.get_context("spawn")
            self._all_warm = context.Barrier(self.count)
            self._own_threads = torch.get_num_threads()
            self._threads = max(1, self._own_threads // (self.count + 1))
            self._pool = ProcessPoolExecutor(self.count, mp_context=context, initializer=_start_worker,
                                             initargs=(self.load, self._threads, self._all_warm))
            # The pool starts a process for each task submitted while none is idle: started now, they
            # load and warm up while this process does, rather than from the first prompt handed to them.
            self._warming = [self._pool.submit(_warm_up_worker, self.warm_up_prompt) for _ in range(self.count)]
        return self

    def wait_warm(self) -> None:
        """Returns once every worker is loaded and warmed up; raises where one failed to."""
        for warming in self._warming if self.count else ():
            warming.result()

    def go(self) -> None:
        if self.count:
            torch.set_num_threads(self._threads)

    def submit(self, asked: Asked) -> Future:
        return self._pool.submit(_decode_in_worker, asked)

    def __exit__(self, failed: type[BaseException] | None, *_) -> None:
        if self.count:
            if failed is not None:
                # The pool hands each call to its queue as soon as it can: a warm-up it had not yet would
                # be cancelled below, and a worker waiting at the barrier for it would hold the shutdown.
                self._all_warm.abort()
            self._pool.shutdown(cancel_futures=failed is not None)
            torch.set_num_threads(self._own_threads)


def share_prompts(there: Callable[[Asked], Future], workers: int, decoder: WarmDecoder, asked: list[Asked]) -> Iterator[Any]:
    """The prompts' results in order, each decoded by one of `workers` (`there`: a prompt handed to them,
    its result to come; holding up to WORKER_QUEUE each) or by this process (`decoder`, warmed up on
    the first prompt where it was not yet), which takes the next prompt whenever the workers hold
    theirs and waits only where the next result is a worker's and no prompt is left to take."""
    waiting = deque(range(len(asked)))
    held: dict[int, Future] = {}  # prompt index -> a worker's decoding of it
    finished: dict[int, Any] = {}
    for index in range(len(asked)):
        while index not in finished:
            while waiting and len(held) < workers * WORKER_QUEUE:
                taken = waiting.popleft()
                held[taken] = there(asked[taken])
            finished.update({i: held.pop(i).result() for i in [i for i, future in held.items() if future.done()]})
            if index in finished:
                break
            if waiting:
                here = decoder.warm(asked[0])
                taken = waiting.popleft()
                finished[taken] = here.decode(*asked[taken])
            else:
                finished[index] = held.pop(index).result()
        yield finished.pop(index)
