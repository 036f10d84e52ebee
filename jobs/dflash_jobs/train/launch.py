"""`python -m dflash_jobs.train.launch [torchrun options] -m dflash_jobs.train -f SPEC`: torchrun that
keeps the workers' verdict.

torchrun reports any failed worker as its own failure (exit 1), so a worker that found a bad spec
(EXIT_BAD_SPEC) or bad input (EXIT_BAD_INPUT) would be retried by the Job up to its backoffLimit
instead of failing at once through the rendered podFailurePolicy. This runs torchrun in-process
and exits with the failed workers' own code when it is one of those two, else with EXIT_FAILED
(retried: a crash, a lost node, storage past its retries).
"""

from __future__ import annotations

import sys

from dflash_jobs.errors import EXIT_BAD_INPUT, EXIT_BAD_SPEC, EXIT_FAILED, EXIT_OK

FINAL_CODES = (EXIT_BAD_SPEC, EXIT_BAD_INPUT)


def pod_code(worker_codes: list[int]) -> int:
    """The pod's exit code from its failed workers' codes: a final verdict wins over a crash."""
    for code in FINAL_CODES:
        if code in worker_codes:
            return code
    return EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(argv)
    try:
        run(args)
    except ChildFailedError as failed:
        codes = [failure.exitcode for failure in failed.failures.values()]
        code = pod_code(codes)
        print(f"dflash: training workers failed with exit codes {sorted(set(codes))}: the pod exits {code}", file=sys.stderr, flush=True)
        return code
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
