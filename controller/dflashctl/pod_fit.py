"""Whether the run's pods fit the cluster's nodes: what each pod asks, read from the rendered objects
themselves (so the placement and the pod template patch count), against each node's allocatable
resources, labels, taints and cordon. Used by `dflashctl check` and `dflashctl plan`.

A pod asks, per resource, the larger of its containers' sum and its largest init container (the
scheduler's rule). A node is a candidate for a pod when it is schedulable, carries the pod's
nodeSelector labels, satisfies its required node affinity, and every NoSchedule/NoExecute taint of
it is tolerated. Allocatable is what the kubelet offers pods in all, not what is free now.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from dflash_jobs.spec import RunSpec

from dflashctl.placement import GPU
from dflashctl.render import render_all
from dflashctl.tool_pods import tool_pod_specs

RESOURCES = ("cpu", "memory", GPU)
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)(?:([eE][+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E))?$")
_SUFFIXES = {
    **{suffix: Decimal(1024) ** power for power, suffix in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"), start=1)},
    **{suffix: Decimal(10) ** power for suffix, power in (("n", -9), ("u", -6), ("m", -3), ("k", 3), ("M", 6), ("G", 9), ("T", 12), ("P", 15), ("E", 18))},
}


def quantity(value: str | int | float) -> Decimal:
    """A Kubernetes resource quantity ("500m", "96Gi", "1e3", 8) as a number. Parsed here rather than by
    the client's parse_quantity: `plan` bills pods on machines that have no Kubernetes client."""
    match = _QUANTITY.match(str(value).strip())
    if match is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    number, exponent, suffix = match.groups()
    if exponent:
        return Decimal(number + exponent)
    return Decimal(number) * _SUFFIXES.get(suffix, Decimal(1))


@dataclass(frozen=True, slots=True)
class PodAsk:
    """What one pod of a component asks of its node."""

    component: str
    cpu: Decimal
    memory: Decimal
    """Bytes."""
    gpus: int
    count: int
    """Pods of the component that run at once (the Job's parallelism)."""
    pod_spec: dict[str, Any]
    """The rendered pod spec: its nodeSelector, affinity and tolerations decide where it may go."""

    def of(self, resource: str) -> Decimal:
        return {"cpu": self.cpu, "memory": self.memory, GPU: Decimal(self.gpus)}[resource]

    def describe(self) -> str:
        gpus = f"{self.gpus} GPU, " if self.gpus else ""
        return f"{self.component}: {gpus}{format_cpu(self.cpu)} CPU, {format_bytes(self.memory)}"


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    labels: dict[str, str]
    taints: list[dict[str, Any]]
    allocatable: dict[str, Decimal]
    unschedulable: bool

    @classmethod
    def of(cls, obj: dict[str, Any]) -> Node:
        spec, status = obj.get("spec") or {}, obj.get("status") or {}
        allocatable = {key: quantity(value) for key, value in (status.get("allocatable") or {}).items() if key in RESOURCES}
        return cls(obj["metadata"]["name"], obj["metadata"].get("labels") or {}, spec.get("taints") or [], allocatable, bool(spec.get("unschedulable")))

    def describe(self) -> str:
        gpus = self.allocatable.get(GPU, Decimal(0))
        return (f"{self.name} ({int(gpus)} GPU, {format_cpu(self.allocatable.get('cpu', Decimal(0)))} CPU, "
                f"{format_bytes(self.allocatable.get('memory', Decimal(0)))} allocatable)")


def pod_asks(spec: RunSpec) -> list[PodAsk]:
    """One PodAsk per Job of the run, in pipeline order."""
    asks = []
    for obj in render_all(spec):
        if obj["kind"] != "Job":
            continue
        pod = obj["spec"]["template"]["spec"]
        totals = {resource: _effective(pod, resource) for resource in RESOURCES}
        component = obj["metadata"]["labels"]["app.kubernetes.io/component"]
        asks.append(PodAsk(component, totals["cpu"], totals["memory"], int(totals[GPU]), obj["spec"].get("parallelism") or 1, pod))
    return asks


def claim_users(spec: RunSpec) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """Every pod of the run by the PersistentVolumeClaims it mounts, as (component, pod spec): its
    Jobs' pods, stage-model's and the probe's."""
    pods = [(obj["metadata"]["labels"]["app.kubernetes.io/component"], obj["spec"]["template"]["spec"])
            for obj in render_all(spec) if obj["kind"] == "Job"]
    users: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for component, pod in [*pods, *tool_pod_specs(spec)]:
        for volume in pod.get("volumes") or []:
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim:
                users.setdefault(claim, []).append((component, pod))
    return users


def _effective(pod: dict[str, Any], resource: str) -> Decimal:
    def asked(container: dict[str, Any]) -> Decimal:
        resources = container.get("resources") or {}
        # A limit without a request (GPUs are limits only) requests the same amount.
        value = (resources.get("requests") or {}).get(resource) or (resources.get("limits") or {}).get(resource)
        return quantity(value) if value is not None else Decimal(0)

    containers = sum((asked(c) for c in pod.get("containers") or []), Decimal(0))
    return max([containers, *(asked(c) for c in pod.get("initContainers") or [])])


@dataclass(frozen=True, slots=True)
class Placement:
    """One component's pod against the nodes: where it may go and which of those can hold it."""

    ask: PodAsk
    refusals: dict[str, str]
    """Node -> why the pod may not go there."""
    candidates: list[Node]
    fitting: list[Node]

    @property
    def largest(self) -> Node | None:
        return max(self.candidates, key=lambda node: tuple(node.allocatable.get(r, Decimal(0)) for r in (GPU, "memory", "cpu")), default=None)

    def describe(self) -> str:
        """Where it fits, or why it cannot (the largest candidate's shortfall, or each node's refusal)."""
        if self.fitting:
            names = ", ".join(node.name for node in self.fitting[:3]) + (f" and {len(self.fitting) - 3} more" if len(self.fitting) > 3 else "")
            return f"fits {names} (of {len(self.candidates)} candidate(s))"
        if self.candidates:
            largest = self.largest
            return f"no node can hold one: the largest of {len(self.candidates)} candidate(s), {largest.name}, has {', '.join(shortfalls(largest, self.ask))}"
        return "no node takes it now (" + ("; ".join(f"{name}: {why}" for name, why in list(self.refusals.items())[:4]) or "no nodes") + ")"


def place(ask: PodAsk, nodes: list[Node]) -> Placement:
    refusals = {node.name: why for node in nodes if (why := why_not_placed(node, ask.pod_spec)) is not None}
    candidates = [node for node in nodes if node.name not in refusals]
    return Placement(ask, refusals, candidates, [node for node in candidates if not shortfalls(node, ask)])


def why_not_placed(node: Node, pod: dict[str, Any]) -> str | None:
    """Why `pod` may not run on `node` (cordoned, a label, the affinity, a taint); None if it may."""
    if node.unschedulable:
        return "cordoned"
    for key, value in (pod.get("nodeSelector") or {}).items():
        if node.labels.get(key) != value:
            return f"no label {key}={value}"
    required = ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if required and not any(_term_matches(node, term) for term in required.get("nodeSelectorTerms") or []):
        return "its labels fail the required node affinity"
    for taint in node.taints:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not any(_tolerates(t, taint) for t in pod.get("tolerations") or []):
            return f"taint {taint.get('key')}{'=' + taint['value'] if taint.get('value') else ''}:{taint.get('effect')} not tolerated"
    return None


def shortfalls(node: Node, ask: PodAsk) -> list[str]:
    """The resources of which the node offers less than the pod asks, e.g. ["memory: 512Gi < 768Gi"]."""
    short = []
    for resource in RESOURCES:
        wanted, offered = ask.of(resource), node.allocatable.get(resource, Decimal(0))
        if wanted > offered:
            show = format_bytes if resource == "memory" else format_cpu
            short.append(f"{resource} {show(offered)} < {show(wanted)}")
    return short


def _term_matches(node: Node, term: dict[str, Any]) -> bool:
    expressions = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not expressions and not fields:
        return False  # an empty term matches no node
    return all(_expression_matches(node.labels.get(e["key"]), e) for e in expressions) and \
        all(_expression_matches(node.name if f["key"] == "metadata.name" else None, f) for f in fields)


def _expression_matches(value: str | None, expression: dict[str, Any]) -> bool:
    operator, values = expression["operator"], expression.get("values") or []
    if operator == "In":
        return value in values
    if operator == "NotIn":
        return value not in values
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    if operator in ("Gt", "Lt") and value is not None and value.lstrip("-").isdigit():
        return int(value) > int(values[0]) if operator == "Gt" else int(value) < int(values[0])
    return False


def _tolerates(toleration: dict[str, Any], taint: dict[str, Any]) -> bool:
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("operator") == "Exists":
        return not toleration.get("key") or toleration["key"] == taint.get("key")
    return toleration.get("key") == taint.get("key") and (toleration.get("value") or "") == (taint.get("value") or "")


def format_cpu(cores: Decimal) -> str:
    return f"{cores.normalize():f}" if cores == cores.to_integral_value() or cores >= 1 else f"{int(cores * 1000)}m"


def format_bytes(size: Decimal) -> str:
    for unit, factor in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20)):
        if size >= factor:
            return f"{float(size) / factor:.4g}{unit}"
    return f"{int(size)}"
