"""How often a loop that runs faster than a person reads says where it is: a line every few seconds."""

from __future__ import annotations

import time
from collections.abc import Callable


class Every:
    """`due()` is true at most once every `seconds` (the first time `seconds` after construction or
    `restart()`): the pacing of a progress line in a loop of any speed."""

    def __init__(self, seconds: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds, self.clock = seconds, clock
        self.last = clock()

    def restart(self) -> None:
        self.last = self.clock()

    def due(self) -> bool:
        now = self.clock()
        if now - self.last < self.seconds:
            return False
        self.last = now
        return True
