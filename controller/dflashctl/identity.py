"""Which run an output belongs to: <output>/run.yaml, the resolved spec of the first command that started
work there. Two runs never write into one output: every command that starts work there (`run` and so
the in-cluster controller, every `submit`, `retry`, `eval`, `prepare`, `verify`) claims the output
first, and `check` looks.

Ownership works as helm's does for a release's objects: `--force` may re-spec the same run (its
`name`), and may hand the output to another run only once the run that owns it has no Jobs left
(cancelled, or deleted): a run that has Jobs keeps its output, whatever the flags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from dflash_jobs.errors import DflashError
from dflash_jobs.formats import RUN_KEY
from dflash_jobs.spec import RunSpec, dump_spec, parse_spec, run_identity
from dflash_jobs.storage import ObjectNotFound, Storage, storage_for

from dflashctl.backends import open_backend
from dflashctl.errors import Conflict
from dflashctl.target import ClusterTarget, current_target, set_target


class OutputTaken(Conflict):
    """<output>/run.yaml holds another spec. `force_allowed`: whether --force may replace it (the same
    run re-specced, or another run that has no Jobs left)."""

    def __init__(self, what: str, fix: str, *, force_allowed: bool) -> None:
        super().__init__(what, fix)
        self.force_allowed = force_allowed


def output_elsewhere(spec: RunSpec) -> str | None:
    """Why this machine cannot see a local output of a Kubernetes run (its claim is not mounted here), or None.
    Such an output is claimed where it is seen: by `dflashctl run` in the cluster (the controller)."""
    volume = spec.cluster.output_volume
    if spec.backend != "kubernetes" or volume is None or Path(volume.mount).is_dir():
        return None
    return f"{spec.output} lies on claim {volume.claim}, which is not mounted here at {volume.mount}"


def identity_conflict(storage: Storage, spec: RunSpec) -> OutputTaken | None:
    """What claiming the output for `spec` would meet; None when the output is free or holds this run."""
    try:
        existing = storage.get_bytes(RUN_KEY).decode()
    except ObjectNotFound:
        return None
    return _conflict(storage, spec, existing)


def claim_output(storage: Storage, spec: RunSpec, *, force: bool, say: Callable[[str], None]) -> None:
    """Writes <output>/run.yaml for `spec`; the same spec there already passes, a different one raises
    OutputTaken, unless `force` and the conflict allows it (module docstring): then run.yaml is replaced
    and the outputs already in storage are kept."""
    text = dump_spec(spec)
    if storage.put_if_absent(RUN_KEY, text.encode()):
        return
    conflict = _conflict(storage, spec, storage.get_bytes(RUN_KEY).decode())
    if conflict is None:
        return
    if not (force and conflict.force_allowed):
        raise conflict
    storage.put_bytes(RUN_KEY, text.encode())
    say(f"replaced {storage.url}/{RUN_KEY} with this spec (--force); outputs already in storage are kept, delete them to redo their steps")


def claim_here(spec: RunSpec, *, force: bool, say: Callable[[str], None]) -> None:
    """claim_output on the run's output, where this machine sees it (else its pods' controller claims it)."""
    if output_elsewhere(spec) is None:
        claim_output(storage_for(spec), spec, force=force, say=say)


def _conflict(storage: Storage, spec: RunSpec, existing: str) -> OutputTaken | None:
    if existing == dump_spec(spec):
        return None
    old = yaml.safe_load(existing) or {}
    ours, theirs = run_identity(spec.to_dict()), run_identity(as_read_now(old))
    if ours == theirs:  # the same run, perhaps in another namespace or serving metrics on another port
        return None
    changed = sorted(key for key, value in ours.items() if theirs.get(key) != value)
    owner = old.get("name")
    what = f"{storage.url} already holds run {owner!r} with another spec (differs in: {', '.join(changed)})"
    if owner == spec.name:
        return OutputTaken(what, f"Restore the spec it was started with, use another `output` (and `name`) for a new run, or pass --force "
                                 f"to re-spec run {owner} (its run.yaml is replaced; what is stored is kept)", force_allowed=True)
    try:
        jobs, namespace = owner_jobs(spec, old)
    except DflashError as error:
        return OutputTaken(f"{what}; whether run {owner!r} still has Jobs cannot be told from here ({error.what})",
                           f"Use another `output` for this run; or, from where run {owner}'s Jobs can be listed, end it first", force_allowed=False)
    if jobs:
        return OutputTaken(
            f"{what}; run {owner!r} owns it: its Jobs {', '.join(jobs)} exist in namespace {namespace}",
            f"Use another `output` for this run. To take this one over, end run {owner} first (`dflashctl delete {owner} -n {namespace}`, "
            f"or `dflashctl cancel -f <its spec>`): an output whose run has Jobs is never handed over",
            force_allowed=False,
        )
    return OutputTaken(what, f"Use another `output` (or `name`) for a new run, restore the spec it was started with, or pass --force "
                             f"to take the output over (run {owner} has no Jobs left)", force_allowed=True)


def as_read_now(written: dict[str, Any]) -> dict[str, Any]:
    """A run.yaml resolved as this version reads it: a setting added since it was written takes its
    default (a new setting's default is the behaviour before it), so a run started by an older
    dflashctl is still the same run. One this version cannot read is compared as written."""
    try:
        return parse_spec(written).to_dict()
    except DflashError:
        return written


def owner_jobs(spec: RunSpec, owner: dict[str, Any]) -> tuple[list[str], str]:
    """The Jobs that exist of the run a run.yaml records (`owner`, read back), where that run lives:
    its backend and namespace; and that namespace."""
    try:
        run = parse_spec(owner)
    except DflashError:  # written by another version of dflashctl: its name and namespace are what count
        cluster = owner.get("cluster") if isinstance(owner.get("cluster"), dict) else {}
        run = dataclasses.replace(spec, name=owner.get("name"), cluster=dataclasses.replace(
            spec.cluster, namespace=cluster.get("namespace", spec.cluster.namespace)))
    previous = set_target(ClusterTarget(context=current_target().context, namespace=run.cluster.namespace))
    try:
        jobs = [obj.name for obj in open_backend(run).run_objects(run.name) if obj.kind == "Job"]
    finally:
        set_target(previous)
    return jobs, run.cluster.namespace
