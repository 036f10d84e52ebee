"""`python -m dflash_jobs.extract -f SPEC [--shard I]`: extract the hidden states of one shard.

Exit codes: 0 done; EXIT_BAD_SPEC (2) for a bad spec or checkpoint (every shard would fail alike);
EXIT_BAD_INPUT (42) for a bad chunk or an integrity failure (the Job fails this index, no retry);
1 for anything else (storage, crash), which the Job retries up to backoffLimitPerIndex.
"""

from __future__ import annotations

import logging
import sys
import time

from dflash_jobs.extract.progress import Summary
from dflash_jobs.shard import check_shard, run_shard, shard_command
from dflash_jobs.spec import load_spec

log = logging.getLogger("dflash.extract")


def main(argv: list[str] | None = None) -> int:
    args = shard_command("python -m dflash_jobs.extract", __doc__, argv)
    started = time.monotonic()
    summary = Summary(shard=-1, shards=0)

    def extract() -> None:
        spec = load_spec(args.file)
        check_shard(summary, args.shard, spec.extract.shards, "extract.shards")
        from dflash_jobs.extract.worker import build_worker  # torch and transformers: after the spec is known good

        worker = build_worker(spec, summary.shard, summary=summary, started=started)
        try:
            worker.run()
        finally:
            worker.close()

    return run_shard(summary, extract, log)


if __name__ == "__main__":
    sys.exit(main())
