"""Which run an output belongs to: <output>/run.yaml, the resolved spec of the first command that started
work there. Two runs never write into one output: every command that starts work there (`run` and so
the in-cluster controller, every `submit`, `retry`, `eval`, `prepare`, `verify`) claims the output
first, and `check` looks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import yaml

from dflash_jobs.formats import RUN_KEY
from dflash_jobs.spec import RunSpec, dump_spec, run_identity
from dflash_jobs.storage import ObjectNotFound, Storage, storage_for

from dflashctl.errors import Conflict


def output_elsewhere(spec: RunSpec) -> str | None:
    """Why this machine cannot see a local output of a Kubernetes run (its claim is not mounted here), or None.
    Such an output is claimed where it is seen: by `dflashctl run` in the cluster (the controller)."""
    volume = spec.cluster.output_volume
    if spec.backend != "kubernetes" or volume is None or Path(volume.mount).is_dir():
        return None
    return f"{spec.output} lies on claim {volume.claim}, which is not mounted here at {volume.mount}"


def identity_conflict(storage: Storage, spec: RunSpec) -> Conflict | None:
    """The Conflict that claiming the output for `spec` would raise; None when the output is free or holds this run."""
    try:
        existing = storage.get_bytes(RUN_KEY).decode()
    except ObjectNotFound:
        return None
    return _conflict(storage, spec, existing)


def claim_output(storage: Storage, spec: RunSpec, *, force: bool, say: Callable[[str], None]) -> None:
    """Writes <output>/run.yaml for `spec`; the same spec there already passes, a different one raises
    Conflict, unless `force`, which replaces it (outputs already in storage are kept)."""
    text = dump_spec(spec)
    if storage.put_if_absent(RUN_KEY, text.encode()):
        return
    conflict = _conflict(storage, spec, storage.get_bytes(RUN_KEY).decode())
    if conflict is None:
        return
    if not force:
        raise conflict
    storage.put_bytes(RUN_KEY, text.encode())
    say(f"replaced {storage.url}/{RUN_KEY} with this spec (--force); outputs already in storage are kept, delete them to redo their steps")


def claim_here(spec: RunSpec, *, force: bool, say: Callable[[str], None]) -> None:
    """claim_output on the run's output, where this machine sees it (else its pods' controller claims it)."""
    if output_elsewhere(spec) is None:
        claim_output(storage_for(spec), spec, force=force, say=say)


def _conflict(storage: Storage, spec: RunSpec, existing: str) -> Conflict | None:
    if existing == dump_spec(spec):
        return None
    old = yaml.safe_load(existing) or {}
    ours, theirs = run_identity(spec.to_dict()), run_identity(old)
    if ours == theirs:  # the same run, perhaps in another namespace or serving metrics on another port
        return None
    changed = sorted(key for key, value in ours.items() if theirs.get(key) != value)
    return Conflict(
        f"{storage.url} already holds run {old.get('name')!r} with another spec (differs in: {', '.join(changed)})",
        "Use another `output` (or `name`) for a new run, restore the spec it was started with, or pass --force",
    )
