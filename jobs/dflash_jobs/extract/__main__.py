"""`python -m dflash_jobs.extract -f SPEC [--shard I]`: extract the hidden states of one shard.

Exit codes: 0 done; EXIT_BAD_SPEC (2) for a bad spec or checkpoint (every shard would fail alike);
EXIT_BAD_INPUT (42) for a bad chunk or an integrity failure (the Job fails this index, no retry);
1 for anything else (storage, crash), which the Job retries up to backoffLimitPerIndex.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from dflash_jobs.errors import EXIT_OK, DflashError, SpecError, pod_exit_code
from dflash_jobs.extract.progress import Summary
from dflash_jobs.spec import DEFAULT_SPEC_FILE, load_spec
from dflash_jobs.termination import write_termination_message

log = logging.getLogger("dflash.extract")


def shard_index(arg: int | None) -> int:
    if arg is not None:
        return arg
    value = os.environ.get("JOB_COMPLETION_INDEX")
    if value is None or not value.isdigit():
        raise SpecError("--shard", value, "a shard index: pass --shard I, or run in an Indexed Job (JOB_COMPLETION_INDEX)")
    return int(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_jobs.extract", description=__doc__.splitlines()[0])
    parser.add_argument("-f", "--file", default=DEFAULT_SPEC_FILE, help="the run spec (default: ./dflash.yaml)")
    parser.add_argument("--shard", type=int, default=None, help="shard index (default: $JOB_COMPLETION_INDEX)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)

    summary = Summary(shard=-1, shards=0)
    worker = None
    try:
        spec = load_spec(args.file)
        summary.shard, summary.shards = shard_index(args.shard), spec.extract.shards
        if not 0 <= summary.shard < summary.shards:
            raise SpecError("--shard", summary.shard, f"0..{summary.shards - 1} (extract.shards = {summary.shards})")
        from dflash_jobs.extract.worker import build_worker  # torch and transformers: after the spec is known good

        worker = build_worker(spec, summary.shard, summary=summary, started=started)
        worker.run()
        summary.status = "done"
        log.info("shard %d/%d done: %s", summary.shard, summary.shards, summary.to_json())
        return EXIT_OK
    except Exception as error:  # every failure ends as one message, one exit code and a termination message
        summary.status = "failed"
        summary.error = str(error)[:1000]
        if isinstance(error, DflashError):
            log.error("shard %s failed: %s", summary.shard, error)
        else:
            log.exception("shard %s failed", summary.shard)
        return pod_exit_code(error)
    finally:
        if worker is not None:
            worker.close()
        write_termination_message(summary.to_json())


if __name__ == "__main__":
    sys.exit(main())
