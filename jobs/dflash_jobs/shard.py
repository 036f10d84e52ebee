"""What every shard of an Indexed Job does alike (extraction, generation): find its index, and end
as one log line, one exit code and a termination message, whatever happened."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Protocol

from dflash_jobs.errors import EXIT_OK, DflashError, SpecError, pod_exit_code
from dflash_jobs.termination import write_termination_message


class ShardSummary(Protocol):
    shard: int
    shards: int
    status: str
    error: str | None

    def to_json(self) -> str: ...


def shard_index(arg: int | None) -> int:
    if arg is not None:
        return arg
    value = os.environ.get("JOB_COMPLETION_INDEX")
    if value is None or not value.isdigit():
        raise SpecError("--shard", value, "a shard index: pass --shard I, or run in an Indexed Job (JOB_COMPLETION_INDEX)")
    return int(value)


def check_shard(summary: ShardSummary, arg: int | None, shards: int, field: str) -> None:
    """Sets the summary's shard from --shard or the Job's index, refusing one outside 0..shards-1."""
    summary.shard, summary.shards = shard_index(arg), shards
    if not 0 <= summary.shard < shards:
        raise SpecError("--shard", summary.shard, f"0..{shards - 1} ({field} = {shards})")


def run_shard(summary: ShardSummary, work: Callable[[], None], log: logging.Logger) -> int:
    """Runs `work`; every failure ends as one message, one exit code (errors.pod_exit_code) and the
    summary as the termination message."""
    try:
        work()
        summary.status = "done"
        log.info("shard %d/%d done: %s", summary.shard, summary.shards, summary.to_json())
        return EXIT_OK
    except Exception as error:
        summary.status = "failed"
        summary.error = str(error)[:1000]
        if isinstance(error, DflashError):
            log.error("shard %s failed: %s", summary.shard, error)
        else:
            log.exception("shard %s failed", summary.shard)
        return pod_exit_code(error)
    finally:
        write_termination_message(summary.to_json())
