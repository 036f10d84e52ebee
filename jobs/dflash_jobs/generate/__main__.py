"""`python -m dflash_jobs.generate -f SPEC [--shard I]`: regenerate the answers of one shard's chunks.

Exit codes: 0 done; EXIT_BAD_SPEC (2) for a bad spec, checkpoint or engine image (every shard would
fail alike); EXIT_BAD_INPUT (42) for an input that cannot be read as planned (the Job fails this
index, no retry); 1 for anything else (storage, an engine crash), which the Job retries up to
backoffLimitPerIndex. Lines that cannot be answered are not failures: they are counted by reason.
"""

from __future__ import annotations

import argparse
import logging
import sys

from dflash_jobs.errors import EXIT_OK, DflashError, SpecError, pod_exit_code
from dflash_jobs.extract.__main__ import shard_index
from dflash_jobs.generate.progress import Summary
from dflash_jobs.spec import DEFAULT_SPEC_FILE, load_spec
from dflash_jobs.termination import write_termination_message

log = logging.getLogger("dflash.generate")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_jobs.generate", description=__doc__.splitlines()[0])
    parser.add_argument("-f", "--file", default=DEFAULT_SPEC_FILE, help="the run spec (default: ./dflash.yaml)")
    parser.add_argument("--shard", type=int, default=None, help="shard index (default: $JOB_COMPLETION_INDEX)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)

    summary = Summary(shard=-1, shards=0)
    try:
        spec = load_spec(args.file)
        if spec.generate is None:
            raise SpecError("generate", None, "a generate section: generation is off in this spec")
        summary.shard, summary.shards = shard_index(args.shard), spec.generate.shards
        if not 0 <= summary.shard < summary.shards:
            raise SpecError("--shard", summary.shard, f"0..{summary.shards - 1} (generate.shards = {summary.shards})")
        from dflash_jobs.generate.worker import build_worker  # transformers (and torch): after the spec is known good

        build_worker(spec, summary.shard, summary=summary).run()
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
        write_termination_message(summary.to_json())


if __name__ == "__main__":
    sys.exit(main())
