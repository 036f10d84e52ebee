"""How a duration reads, the same in a pod's log lines and on `dflashctl`'s terminal."""

from __future__ import annotations


def format_duration(seconds: float | None) -> str:
    """1h02m, 4m05s or 9s; "-" when unknown."""
    if seconds is None:
        return "-"
    hours, rest = divmod(int(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
