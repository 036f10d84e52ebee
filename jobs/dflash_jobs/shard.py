"""What every shard of an Indexed Job does alike (extraction, generation): read its command line,
find its index, report in one summary, and end as one log line, one exit code and a termination
message, whatever happened."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

from dflash_jobs.errors import EXIT_OK, DflashError, SpecError, pod_exit_code
from dflash_jobs.spec import DEFAULT_SPEC_FILE
from dflash_jobs.termination import write_termination_message


@dataclass(slots=True)
class ShardSummary:
    """What a shard reports, in its log and as its termination message; each step's Summary adds its own counts."""

    shard: int
    shards: int
    status: str = "running"  # running | done | failed
    chunks_total: int = 0
    chunks_skipped: int = 0
    chunks_done: int = 0
    elapsed_s: float = 0.0
    tokens_per_s: float = 0.0
    error: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


def shard_command(prog: str, doc: str, argv: list[str] | None) -> argparse.Namespace:
    """The command line of a shard's pod, `python -m <step> -f SPEC [--shard I]`, parsed; log lines go to stdout."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("-f", "--file", default=DEFAULT_SPEC_FILE, help="the run spec (default: ./dflash.yaml)")
    parser.add_argument("--shard", type=int, default=None, help="shard index (default: $JOB_COMPLETION_INDEX)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    return args


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
