"""The runs a backend holds, found by name rather than by a spec file: listing them (their Jobs,
ConfigMaps and Services carry the run's label), a run's spec from its `<run>-spec` ConfigMap (so
`status NAME` needs no file), and removing a run's objects (`cancel`, `delete`), which touches
nothing of another run: only objects labelled with this run's name, one by one."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import yaml

from dflash_jobs.errors import InputError, SpecError
from dflash_jobs.formats import RUN_KEY
from dflash_jobs.spec import RunSpec, parse_spec
from dflash_jobs.storage import ObjectNotFound, Storage, storage_for

from dflashctl.backend import Backend, JobStatus, RunObject
from dflashctl.render import SPEC_FILE, spec_configmap_name

DELETE_WORKERS = 32
"""Storage deletes at once (`delete --data`): one request per object."""


@dataclass(frozen=True, slots=True)
class RunListing:
    """One run on a backend: its objects, its Jobs' states and, from its spec ConfigMap, its spec."""

    name: str
    objects: list[RunObject]
    jobs: list[JobStatus]
    spec: RunSpec | None
    """None when the run's spec ConfigMap is gone (or unreadable)."""


def list_runs(backend: Backend) -> list[RunListing]:
    """Every run with an object on the backend, by name."""
    objects = backend.run_objects()
    listings = []
    for run in sorted({obj.run for obj in objects}):
        own = [obj for obj in objects if obj.run == run]
        jobs = [backend.job_status(obj.name) for obj in own if obj.kind == "Job"]
        listings.append(RunListing(run, own, jobs, stored_spec(backend, run)))
    return listings


def spec_of_run(backend: Backend, run: str, where: str) -> RunSpec:
    """Run `run`'s spec as its `<run>-spec` ConfigMap holds it; InputError naming the runs that are
    there (`where`: the namespace or workdir, for the message) when it holds none."""
    spec = stored_spec(backend, run)
    if spec is None:
        raise InputError(
            f"no run {run!r} in {where}: no ConfigMap {spec_configmap_name(run)} holds its spec",
            f"Runs there: {', '.join(listing.name for listing in list_runs(backend)) or 'none'}; or give its spec file with -f",
        )
    return spec


def stored_spec(backend: Backend, run: str) -> RunSpec | None:
    """The spec in the run's `<run>-spec` ConfigMap; None when there is none (or it is unreadable)."""
    configmap = backend.find("ConfigMap", spec_configmap_name(run))
    text = ((configmap or {}).get("data") or {}).get(SPEC_FILE)
    if text is None:
        return None
    try:
        return parse_spec(yaml.safe_load(text))
    except (SpecError, yaml.YAMLError):  # a spec from another dflashctl version: listed, not read
        return None


def removal_order(objects: list[RunObject]) -> list[RunObject]:
    """The controller's Job first (so that it starts nothing meanwhile), then the other Jobs (with their
    pods), the Services, and the spec ConfigMap last (the pods still running read it)."""
    def rank(obj: RunObject) -> tuple[int, str]:
        if obj.kind == "Job":
            return (0 if obj.name == f"{obj.run}-controller" else 1, obj.name)
        return (2 if obj.kind == "Service" else 3, obj.name)

    return sorted(objects, key=rank)


def remove_run(backend: Backend, run: str, *, dry_run: bool, say: Callable[[str], None]) -> list[RunObject]:
    """Deletes the run's objects, only those labelled with its name, saying each (kubectl's words);
    with `dry_run` says what it would delete and deletes nothing. Storage is not touched."""
    objects = removal_order(backend.run_objects(run))
    for obj in objects:
        if not dry_run:
            backend.delete_object(obj.kind, obj.name)
        say(f"{obj.ref} deleted{' (dry run)' if dry_run else ''}")
    return objects


def output_objects(spec: RunSpec) -> tuple[Storage, list[str]]:
    """The run's storage and every object under its output (`delete --data`); refuses an output that
    holds another run."""
    storage = storage_for(spec)
    try:
        holder = (yaml.safe_load(storage.get_bytes(RUN_KEY)) or {}).get("name")
    except ObjectNotFound:
        holder = None
    if holder not in (None, spec.name):
        raise InputError(f"{storage.url} holds run {holder!r}, not {spec.name!r}: its storage is not this run's to delete", "Check the output of the spec")
    return storage, storage.list("")


def delete_objects(storage: Storage, keys: list[str]) -> None:
    with ThreadPoolExecutor(max_workers=DELETE_WORKERS) as pool:
        list(pool.map(storage.delete, keys))
