"""`python -m dflash_jobs.generate -f SPEC [--shard I]`: regenerate the answers of one shard's chunks.

Exit codes: 0 done; EXIT_BAD_SPEC (2) for a bad spec, checkpoint or engine image (every shard would
fail alike); EXIT_BAD_INPUT (42) for an input that cannot be read as planned (the Job fails this
index, no retry); 1 for anything else (storage, an engine crash), which the Job retries up to
backoffLimitPerIndex. Lines that cannot be answered are not failures: they are counted by reason.
"""

from __future__ import annotations

import logging
import sys

from dflash_jobs.errors import SpecError
from dflash_jobs.generate.progress import Summary
from dflash_jobs.shard import check_shard, run_shard, shard_command
from dflash_jobs.spec import load_spec

log = logging.getLogger("dflash.generate")


def main(argv: list[str] | None = None) -> int:
    args = shard_command("python -m dflash_jobs.generate", __doc__, argv)
    summary = Summary(shard=-1, shards=0)

    def generate() -> None:
        spec = load_spec(args.file)
        if spec.generate is None:
            raise SpecError("generate", None, "a generate section: generation is off in this spec")
        check_shard(summary, args.shard, spec.generate.shards, "generate.shards")
        from dflash_jobs.generate.worker import build_worker  # transformers (and torch): after the spec is known good

        build_worker(spec, summary.shard, summary=summary).run()

    return run_shard(summary, generate, log)


if __name__ == "__main__":
    sys.exit(main())
