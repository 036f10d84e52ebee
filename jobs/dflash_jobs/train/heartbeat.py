"""A training loop that goes quiet says so, and says where it is.

Slow steps are normal at times (the first one compiles), silence is not: when `quiet_seconds` pass
without a line (the metric line comes every few steps), one says how far the loop is, how many
steps completed since the last line and how long the current one has run. The lines are this
rank's own: a metric line reduces across ranks, and ranks must not decide by their own clocks to
enter a collective.

Once no step has completed for `stall_seconds`, faulthandler writes every thread's stack to
stderr, again each time as long again passes. faulthandler's own C thread does this without the
GIL, so a loop stuck inside a C call that holds it still gets its dump.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time

from dflash_jobs.units import format_duration

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, *, total_steps: int, step: int = 0, quiet_seconds: float = 60.0, stall_seconds: float = 600.0) -> None:
        self.total_steps = total_steps
        self.quiet_seconds, self.stall_seconds = quiet_seconds, stall_seconds
        self._lock = threading.Lock()
        self._step = self._line_step = step  # a resumed run starts past 0
        self._last_step = self._last_line = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="heartbeat")

    def __enter__(self) -> Heartbeat:
        faulthandler.dump_traceback_later(self.stall_seconds, repeat=True, file=sys.stderr)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()
        self._thread.join()

    def stepped(self, step: int) -> None:
        """A step completed: the stall clock starts again."""
        with self._lock:
            self._step, self._last_step = step, time.monotonic()
        faulthandler.dump_traceback_later(self.stall_seconds, repeat=True, file=sys.stderr)

    def logged(self) -> None:
        """A metric line went out: the loop is not quiet."""
        with self._lock:
            self._last_line, self._line_step = time.monotonic(), self._step

    def _watch(self) -> None:
        reported_stall = 0
        while not self._stop.wait(min(5.0, self.quiet_seconds / 4)):
            now = time.monotonic()
            with self._lock:
                step, since_step, since_line = self._step, now - self._last_step, now - self._last_line
                if quiet := since_line >= self.quiet_seconds:
                    completed, self._last_line, self._line_step = step - self._line_step, now, step
            if quiet:
                log.info("step %d/%d: %d steps completed in the last %s, step %d running for %s", step, self.total_steps,
                         completed, format_duration(since_line), step + 1, format_duration(since_step))
            stalls = int(since_step // self.stall_seconds)
            if stalls > reported_stall:
                log.warning("no training step for %s: the stack of every thread follows on stderr (faulthandler, \"Timeout\")",
                            format_duration(since_step))
            reported_stall = stalls
