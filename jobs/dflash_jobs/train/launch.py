"""`python -m dflash_jobs.train.launch [torchrun options] -m dflash_jobs.train -f SPEC`: torchrun that
keeps the workers' verdict; and how a worker ends, so that its verdict is the one it exits with.

torchrun reports any failed worker as its own failure (exit 1), so a worker that found a bad spec
(EXIT_BAD_SPEC) or bad input (EXIT_BAD_INPUT) would be retried by the Job up to its backoffLimit
instead of failing at once through the rendered podFailurePolicy. This runs torchrun in-process
and exits with the failed workers' own code when it is one of those two, else with EXIT_FAILED
(retried: a crash, a lost node, storage past its retries).
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

from dflash_jobs.errors import EXIT_BAD_INPUT, EXIT_BAD_SPEC, EXIT_FAILED, EXIT_OK

FINAL_CODES = (EXIT_BAD_SPEC, EXIT_BAD_INPUT)


def pod_code(worker_codes: list[int]) -> int:
    """The pod's exit code from its failed workers' codes: a final verdict wins over a crash."""
    for code in FINAL_CODES:
        if code in worker_codes:
            return code
    return EXIT_FAILED


def exit_worker(code: int) -> NoReturn:
    """Ends a training worker with `code` once it has left its process group, without the
    interpreter's finalization.

    DDP keeps the process group alive past destroy_process_group (its reducer holds it), and with it
    the group's C++ threads: gloo's work threads and TCP loop (NCCL's watchdog). Such a thread may
    still be dropping its last collective, and freeing a tensor that Python once owned takes the
    GIL. A thread that takes the GIL while the interpreter finalizes is ended by pthread_exit, whose
    unwinding through a C++ destructor (noexcept) calls std::terminate: SIGABRT, "terminate called
    without an active exception", and a pod that trained well is reported failed and retried. So
    what an exit runs while the interpreter is whole runs here (the atexit handlers: logging's
    flush, the compile workers' shutdown), the streams are flushed, and the process ends at once."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
