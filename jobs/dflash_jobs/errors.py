"""The error vocabulary shared by both planes, and the exit codes the pods use.

Each error says what is wrong with which input and how to fix it. The controller maps them to
its own exit codes (DESIGN section 9); the pods exit with the codes below, which the rendered
`podFailurePolicy` understands.
"""

from __future__ import annotations

from typing import Any

# Pod exit codes. Anything else (a crash, OOM-kill, SIGKILL) is retried up to backoffLimitPerIndex.
EXIT_OK = 0
EXIT_BAD_SPEC = 2
"""The spec itself is wrong: every index would fail the same way, so the rendered policy fails the Job."""
EXIT_FAILED = 1
"""Anything else (storage after its retries, a crash): the Job retries the pod."""
EXIT_BAD_INPUT = 42
"""This shard's input (a chunk) is bad or its output failed the integrity checks: FailIndex, no retry."""


class DflashError(Exception):
    """Base class: `str(err)` is the whole message, `what` and `fix` its two halves."""

    def __init__(self, what: str, fix: str = "") -> None:
        self.what = what
        self.fix = fix
        super().__init__(f"{what}. {fix}" if fix else what)


class SpecError(DflashError):
    """A spec field has a bad value; or several fields have (`errors`, made by `SpecError.of`), each
    said as it would be alone. `field`, `value` and `allowed` are those of the first."""

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        self.errors: list[SpecError] = [self]
        super().__init__(f"spec field {field!s} = {value!r} is invalid", f"Expected {allowed}")

    @staticmethod
    def of(errors: list[SpecError]) -> SpecError:
        """One error for every bad field found: a single one as it is, several a line each."""
        found = [each for error in errors for each in error.errors]
        if len(found) == 1:
            return found[0]
        first = found[0]
        several = SpecError(first.field, first.value, first.allowed)
        several.errors = found
        DflashError.__init__(several, f"{len(found)} spec fields are invalid:\n" + "\n".join(f"  {error}" for error in found))
        return several


class SpecFileError(SpecError):
    """The spec file itself is missing, unreadable or not YAML: a bad spec, named by its path rather than a field."""

    def __init__(self, path: Any, problem: str, fix: str) -> None:
        super().__init__("-f", str(path), fix)
        DflashError.__init__(self, f"spec file {path} {problem}", fix)


class StorageError(DflashError):
    """Storage is unreachable, forbids the call, or lacks an object that must exist."""


class StorageUnavailable(StorageError):
    """Storage did not answer, or answered with a server error (5xx, SlowDown), past the client's
    retries: transient, so trying again later can succeed (unlike refused credentials or a missing bucket)."""


class FormatError(DflashError):
    """A file does not follow its format: truncated, mislabeled or inconsistent."""


class IntegrityError(DflashError):
    """Data failed an integrity check (non-finite, all zero, tokens differ from the input)."""


class InputError(DflashError):
    """User input (a JSONL data set, a checkpoint directory) is unusable."""


def pod_exit_code(error: BaseException) -> int:
    """The code a pod's worker (extract, train, eval) exits with for `error`."""
    if isinstance(error, SpecError):
        return EXIT_BAD_SPEC
    if isinstance(error, (InputError, IntegrityError, FormatError)):
        return EXIT_BAD_INPUT
    return EXIT_FAILED
