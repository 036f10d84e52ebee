"""Rendered objects as text: the YAML and JSON `dflashctl render` prints, and their names as kubectl prints them."""

from __future__ import annotations

import json
from typing import Any

import yaml

from dflashctl.render.names import Manifest


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings (the spec in the ConfigMap stays readable in Git), no anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def to_yaml(objects: list[Manifest]) -> str:
    """A multi-document YAML stream; the same objects always give the same bytes."""
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000, explicit_start=True)


def object_ref(obj: Manifest) -> str:
    """An object's name as kubectl prints it (`-o name`): kind.group/name, the core group left out
    (job.batch/run-extract, configmap/run-spec)."""
    group = obj["apiVersion"].rpartition("/")[0]
    kind = obj["kind"].lower()
    return f"{kind}.{group}/{obj['metadata']['name']}" if group else f"{kind}/{obj['metadata']['name']}"


def job_ref(name: str) -> str:
    """A Job's name as kubectl prints it."""
    return object_ref({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name}})


def manifest_filename(obj: Manifest) -> str:
    """`<kind>-<name>.yaml`, e.g. job-qwen36-27b-v1-extract.yaml."""
    return f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def to_json(objects: list[Manifest]) -> str:
    """The objects as one `v1 List`, as `kubectl get -o json` prints several (and `kubectl apply -f` reads)."""
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=2) + "\n"
