"""The control plane's error vocabulary and its exit codes (DESIGN section 9).

Errors from the shared contract (SpecError, StorageError, ...) are mapped here too, once.
"""

from __future__ import annotations

from dflash_jobs.errors import DflashError, InputError, SpecError, StorageError, StorageUnavailable

EXIT_RUN_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_CLUSTER = 4
EXIT_STORAGE_UNAVAILABLE = 5
"""Storage did not answer (or answered 5xx) for longer than the command waits: running it again
later goes on. The in-cluster controller's podFailurePolicy retries it; only 1 and 2 are final."""
EXIT_INTERRUPTED = 130


class ClusterUnreachable(DflashError):
    """The Kubernetes API cannot be reached."""


class Forbidden(DflashError):
    """The Kubernetes API refused the call (RBAC, admission)."""


class RunFailed(DflashError):
    """A Job of the run failed, or its output failed verification."""


class WaitTimeout(DflashError):
    """Waiting for a condition ran past its deadline."""


class Conflict(DflashError):
    """A different spec already runs under this name."""


class ChecksFailed(DflashError):
    """Preflight checks failed (check/): nothing was started. `code` is the exit code their failures call for."""

    def __init__(self, what: str, fix: str, code: int) -> None:
        super().__init__(what, fix)
        self.code = code


def exit_code(error: BaseException) -> int:
    """The exit code for an error, from the table in DESIGN section 9."""
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(error, ChecksFailed):
        return error.code
    if isinstance(error, (ClusterUnreachable, Forbidden)):
        return EXIT_CLUSTER
    if isinstance(error, WaitTimeout):
        return EXIT_TIMEOUT
    if isinstance(error, (SpecError, InputError, Conflict)):
        return EXIT_USAGE
    if isinstance(error, StorageUnavailable):
        return EXIT_STORAGE_UNAVAILABLE
    if isinstance(error, StorageError):
        # Refused credentials or a missing bucket: the user must fix the setup, like a bad spec.
        return EXIT_USAGE
    return EXIT_RUN_FAILED  # RunFailed, FormatError, IntegrityError and anything unforeseen


__all__ = [
    "ChecksFailed", "ClusterUnreachable", "Conflict", "DflashError", "Forbidden", "RunFailed", "WaitTimeout", "exit_code",
    "EXIT_RUN_FAILED", "EXIT_USAGE", "EXIT_TIMEOUT", "EXIT_CLUSTER", "EXIT_STORAGE_UNAVAILABLE", "EXIT_INTERRUPTED",
]
