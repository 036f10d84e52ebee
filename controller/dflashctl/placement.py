"""Where the pods of a run are placed, and what every pod carries besides its work.

Pure functions of the spec, used by the renderers for every pod they build (render.py and
tool_pods.py): the GPU pods go where cluster.node_selector, cluster.tolerations and cluster.affinity
say (and always tolerate nvidia.com/gpu), the CPU pods where cluster.cpu_placement says; every pod
gets the image pull secrets, the priority class, the extra labels and annotations; then
cluster.pod_template_patch is applied last, as a strategic merge patch.

The strategic merge is the subset of Kubernetes' (k8s.io/apimachinery strategicpatch) that a pod
template needs, with its results, list order included, as `kubectl patch --type strategic` gives
them (tests/test_placement.py compares the two):
- maps merge key by key; a null value deletes the key; `$patch: replace` in a map replaces it and
  `$patch: delete` removes it;
- the lists below merge item by item on their merge key: an item whose key matches is merged into
  its match, a new one is added, one with `$patch: delete` removes its match, and an item
  `{$patch: replace}` makes the list exactly the patch's other items. Patch items come in the
  patch's order, each item only in the template keeps its place relative to them where both are
  in the template;
- every other list is replaced by the patch's: a `tolerations` list in the patch replaces the
  rendered one, nvidia.com/gpu included (`patch_warnings` says so; `check` and `render` print it).

Where it departs from kubectl, on purpose: a container item names a container of the pod. Merged
into a pod without that container, kubectl adds it, with no image (an invalid pod); here an item
naming a container of another pod of the run (`stage` of the vLLM generation pod, the GPU pods'
`selfcheck`) changes only the pods that have it, and any other name is refused, naming the
containers there are, unless the item carries an image and so is a new container (a sidecar).
"""

from __future__ import annotations

import copy
from typing import Any

from dflash_jobs.errors import SpecError
from dflash_jobs.spec import RunSpec

GPU = "nvidia.com/gpu"
GPU_TOLERATION = {"key": GPU, "operator": "Exists", "effect": "NoSchedule"}
"""Not every cluster runs the ExtendedResourceToleration admission plugin, which would add it."""

MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "imagePullSecrets": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}
"""The lists of a pod template that merge item by item, and the key that matches their items (the
patchMergeKey of the Kubernetes API's Go types)."""
DIRECTIVE = "$patch"
PATCH_FIELD = "cluster.pod_template_patch"
RUN_CONTAINERS = ("worker", "selfcheck", "stage")
"""Every container of the run's pods (render.py's worker and its selfcheck init container, the vLLM
generation pod's stage init container; tested equal to what is rendered)."""


def placement_fields(spec: RunSpec, *, gpu: bool) -> dict[str, Any]:
    """The pod spec's placement fields, in the order they are rendered; empty ones left out."""
    cluster = spec.cluster
    if gpu:
        selector, tolerations, affinity = cluster.node_selector, [GPU_TOLERATION, *cluster.tolerations], cluster.affinity
    else:
        placement = cluster.cpu_placement
        selector, tolerations, affinity = placement.node_selector, placement.tolerations, placement.affinity
    fields: dict[str, Any] = {}
    if cluster.priority_class:
        fields["priorityClassName"] = cluster.priority_class
    if selector:
        fields["nodeSelector"] = dict(sorted(selector.items()))
    if affinity:
        fields["affinity"] = copy.deepcopy(affinity)
    if tolerations:
        fields["tolerations"] = copy.deepcopy(tolerations)
    if cluster.image_pull_secrets:
        fields["imagePullSecrets"] = [{"name": name} for name in cluster.image_pull_secrets]
    return fields


def extra_labels(spec: RunSpec) -> dict[str, str]:
    """cluster.labels, for every Job and pod (the spec refuses keys the run sets itself)."""
    return dict(sorted(spec.cluster.labels.items()))


def finish_pod_template(spec: RunSpec, template: dict[str, Any]) -> dict[str, Any]:
    """The pod template with the extra labels and annotations, then cluster.pod_template_patch applied."""
    finished = copy.deepcopy(template)
    metadata = finished.setdefault("metadata", {})
    if spec.cluster.labels:
        metadata["labels"] = {**metadata.get("labels", {}), **extra_labels(spec)}
    if spec.cluster.annotations:
        metadata["annotations"] = {**metadata.get("annotations", {}), **dict(sorted(spec.cluster.annotations.items()))}
    if spec.cluster.pod_template_patch is None:
        return finished
    return strategic_merge(finished, _patch_for_pod(finished["spec"], spec.cluster.pod_template_patch), path=PATCH_FIELD)


def _patch_for_pod(pod_spec: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """The patch as it applies to this pod: without the items naming another pod's container; an item
    naming no container of the run, and bringing no image to be a new one, is a typo: refused."""
    spec_patch = patch.get("spec")
    if not isinstance(spec_patch, dict):
        return patch
    present = {key: [container["name"] for container in pod_spec.get(key) or []] for key in ("containers", "initContainers")}
    lists = {}
    for key, other in (("containers", "initContainers"), ("initContainers", "containers")):
        items = spec_patch.get(key)
        if not isinstance(items, list) or any(isinstance(item, dict) and item.get(DIRECTIVE) == "replace" for item in items):
            continue
        lists[key] = []
        for item in items:
            name = item.get("name") if isinstance(item, dict) else None
            if name in present[other]:
                raise SpecError(f"{PATCH_FIELD}.spec.{key}[name={name}]", name, f"{name} is one of the pod's {other}: patch it there")
            if name is None or name in present[key] or item.get(DIRECTIVE) == "delete" or "image" in item:
                lists[key].append(item)
            elif name not in RUN_CONTAINERS:
                raise SpecError(
                    f"{PATCH_FIELD}.spec.{key}[name={name}]", name,
                    f"a container of the run's pods ({', '.join(RUN_CONTAINERS)}), or an image to add it as a new container",
                )
    kept = {key: items for key, items in lists.items() if items or not spec_patch[key]}  # none left for this pod: no list to merge
    return {**patch, "spec": {**{key: value for key, value in spec_patch.items() if key not in lists}, **kept}}


def patch_warnings(spec: RunSpec) -> list[str]:
    """What the pod template patch does that is likely a mistake: a tolerations list (which replaces
    the rendered one) that leaves the GPU pods without the nvidia.com/gpu toleration."""
    spec_patch = (spec.cluster.pod_template_patch or {}).get("spec")
    tolerations = spec_patch.get("tolerations") if isinstance(spec_patch, dict) else None
    if not isinstance(tolerations, list) or any(_tolerates_gpu(toleration) for toleration in tolerations if isinstance(toleration, dict)):
        return []
    return [
        f"{PATCH_FIELD}.spec.tolerations replaces every pod's tolerations (a strategic merge replaces a list without a merge key): "
        f"the GPU pods no longer tolerate {GPU}, nor cluster.tolerations. Put the tolerations in cluster.tolerations "
        f"(cluster.cpu_placement.tolerations for the CPU pods) instead, or list {{key: {GPU}, operator: Exists, effect: NoSchedule}} in the patch too"
    ]


def _tolerates_gpu(toleration: dict[str, Any]) -> bool:
    """Whether a toleration tolerates the GPU nodes' nvidia.com/gpu:NoSchedule taint (with or without a value)."""
    if toleration.get("effect") not in (None, "", "NoSchedule"):
        return False
    if not toleration.get("key"):
        return toleration.get("operator") == "Exists"  # no key: every taint, with Exists only
    return toleration["key"] == GPU


# ---- strategic merge -------------------------------------------------------------------------


def strategic_merge(original: dict[str, Any], patch: dict[str, Any], *, path: str = "patch") -> dict[str, Any]:
    """`patch` merged into a copy of `original` (see the module docstring for the rules)."""
    return _merge_map(copy.deepcopy(original), patch, path)


def _merge_map(original: dict[str, Any], patch: dict[str, Any], path: str) -> dict[str, Any]:
    directive = patch.get(DIRECTIVE)
    if directive == "replace":
        return _clean({key: value for key, value in patch.items() if key != DIRECTIVE}, path)
    if directive == "delete":
        return {}
    if directive is not None:
        raise SpecError(f"{path}.{DIRECTIVE}", directive, "replace | delete")
    for key, value in patch.items():
        where = f"{path}.{key}"
        if value is None:
            original.pop(key, None)
        elif isinstance(value, dict) and isinstance(original.get(key), dict):
            original[key] = _merge_map(original[key], value, where)
        elif isinstance(value, list) and key in MERGE_KEYS and isinstance(original.get(key, []), list):
            original[key] = _merge_list(original.get(key, []), value, MERGE_KEYS[key], where)
        else:
            original[key] = _clean(value, where)
    return original


def _merge_list(original: list[Any], patch: list[Any], key: str, path: str) -> list[Any]:
    for item in [*original, *patch]:
        if not isinstance(item, dict):
            raise SpecError(path, item, "mappings: the items of this list merge by their " + key)
    if any(item.get(DIRECTIVE) == "replace" for item in patch):
        return [_clean(item, path) for item in patch if item.get(DIRECTIVE) != "replace"]
    for item in patch:
        if key not in item:
            raise SpecError(path, item, f"items with their merge key {key!r} (the list merges item by item)")
    deleted = {item[key] for item in patch if item.get(DIRECTIVE) == "delete"}
    merged = [item for item in original if item.get(key) not in deleted]
    for item in patch:
        if item.get(DIRECTIVE) == "delete":
            continue
        match = next((i for i, existing in enumerate(merged) if existing.get(key) == item[key]), None)
        if match is None:
            merged.append(_merge_map({}, item, f"{path}[{key}={item[key]}]"))
        else:
            merged[match] = _merge_map(merged[match], item, f"{path}[{key}={item[key]}]")
    return _ordered(merged, patch, original, key)


def _ordered(merged: list[dict], patch: list[dict], original: list[dict], key: str) -> list[dict]:
    """Kubernetes' order of a merged list: the patch's items in patch order, each item only in the
    original placed before the first patch item that the original has after it."""
    patch_order = [item[key] for item in patch]
    server_order = [item.get(key) for item in original]
    from_patch = sorted((item for item in merged if item[key] in patch_order), key=lambda item: patch_order.index(item[key]))
    server_only = [item for item in merged if item.get(key) not in patch_order]  # already in original order
    result: list[dict] = []
    while server_only or from_patch:
        if not from_patch:
            result.append(server_only.pop(0))
        elif server_only and from_patch[0][key] in server_order and \
                server_order.index(server_only[0].get(key)) < server_order.index(from_patch[0][key]):
            result.append(server_only.pop(0))
        else:
            result.append(from_patch.pop(0))
    return result


def _clean(value: Any, path: str) -> Any:
    """A value taken from the patch as it is, without the nulls and directives only a merge gives meaning to."""
    if isinstance(value, dict):
        return _merge_map({}, value, path)
    if isinstance(value, list):
        return [_clean(item, path) for item in value]
    return value
