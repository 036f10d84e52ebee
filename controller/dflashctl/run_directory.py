"""A run directory for Git (`dflashctl render -d`): exactly what one render of one spec produced.

A GitOps tool applies whatever the directory holds, and a Job cannot change under its name. So a
render into a directory refuses (Conflict, unless forced) a directory holding another run, the same
run from another spec (its spec hash), or a Job it would change; and it removes the files of an
earlier render that it does not produce (`render all`'s step Jobs under a `render controller`),
which would otherwise all start at once. Files dflashctl did not write are left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from dflashctl.errors import Conflict
from dflashctl.render import MANAGED_BY, MANAGED_BY_LABEL, RUN_LABEL, SPEC_HASH, Manifest, manifest_filename, to_yaml


@dataclass(frozen=True, slots=True)
class WrittenDirectory:
    written: list[Path]
    """Files this render created or changed."""
    unchanged: list[Path]
    """Files that already held what this render produces: left as they were (their mtime too)."""
    removed: list[Path]
    """Files of an earlier render that this one does not produce."""


def write_manifests(objects: list[Manifest], directory: Path, *, force: bool = False) -> WrittenDirectory:
    """One file per object, for Git: afterwards dflashctl's files in `directory` are exactly those
    of this render. Unless `force`, a render that would change a run there is refused (Conflict)."""
    new = {manifest_filename(obj): to_yaml([obj]) for obj in objects}
    ours = rendered_files(directory)
    if not force:
        _refuse_a_changed_run(directory, objects, ours, new)
    directory.mkdir(parents=True, exist_ok=True)
    removed = [path for path in ours if path.name not in new]
    for path in removed:
        path.unlink()
    written, unchanged = [], []
    for name, text in new.items():
        path = directory / name
        if path.is_file() and path.read_text() == text:
            unchanged.append(path)
            continue
        path.write_text(text)
        written.append(path)
    return WrittenDirectory(written=written, unchanged=unchanged, removed=removed)


def rendered_files(directory: Path) -> dict[Path, Manifest]:
    """The files of `directory` that dflashctl wrote: one object each, labelled as managed by
    dflashctl, under the name `manifest_filename` gives it. Anything else is the user's."""
    found = {}
    for path in sorted(directory.glob("*.yaml")) if directory.is_dir() else []:
        try:
            docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
        except (yaml.YAMLError, UnicodeDecodeError):
            continue
        obj = docs[0] if len(docs) == 1 and isinstance(docs[0], dict) else {}
        metadata = obj.get("metadata")
        if not isinstance(metadata, dict) or not isinstance(obj.get("kind"), str) or not isinstance(metadata.get("name"), str):
            continue
        labels = metadata.get("labels")
        if isinstance(labels, dict) and labels.get(MANAGED_BY_LABEL) == MANAGED_BY and path.name == manifest_filename(obj):
            found[path] = obj
    return found


def _refuse_a_changed_run(directory: Path, objects: list[Manifest], ours: dict[Path, Manifest], new: dict[str, str]) -> None:
    run = next(obj["metadata"]["labels"][RUN_LABEL] for obj in objects if RUN_LABEL in obj["metadata"]["labels"])
    spec_hash = next(obj["metadata"]["annotations"][SPEC_HASH] for obj in objects if SPEC_HASH in obj["metadata"].get("annotations", {}))
    for path, obj in ours.items():
        metadata = obj["metadata"]
        other_run = metadata["labels"].get(RUN_LABEL)
        if other_run not in (None, run):
            raise Conflict(
                f"{directory} holds run {other_run} ({path.name}), not {run}",
                f"Render each run into a directory of its own, e.g. k8s/runs/{run}/ (or pass --force to replace run {other_run} there)",
            )
        other_hash = (metadata.get("annotations") or {}).get(SPEC_HASH)
        if other_hash not in (None, spec_hash):
            raise Conflict(
                f"{directory} holds run {run} rendered from another spec (spec hash {other_hash}, this spec {spec_hash}); "
                "a Job cannot change under the same name, so Argo CD or Flux could not apply it",
                "Give the changed run a new `name:` in the spec and render it into its own directory, or pass --force "
                "to overwrite this one (then delete its Jobs in the cluster for the new ones to be created)",
            )
        if obj["kind"] == "Job" and path.name in new and path.read_text() != new[path.name]:
            raise Conflict(
                f"{path} would change although the spec hash is the same ({spec_hash}): a setting outside the run's identity "
                "(cluster.namespace, cluster.metrics_port) or another dflashctl version, and a Job cannot change under the same name",
                "Render into a new directory under a new `name:`, or pass --force to overwrite it (then delete the Job in the cluster for the new one to be created)",
            )
