"""The run spec; its sections move out of `sections` into modules of their own in the next commit."""

from dflash_jobs.spec.sections import *  # noqa: F403
