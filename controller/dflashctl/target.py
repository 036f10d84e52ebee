"""Where the commands of this process talk to, when the command line says so (`--context`,
`-n/--namespace`, as in kubectl): over the kubeconfig's current context and the spec's
cluster.namespace. `Cluster.connect` and `backends.targeted` read it; the command line sets it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClusterTarget:
    context: str | None = None
    """A context of the kubeconfig, instead of its current one."""
    namespace: str | None = None
    """Instead of the spec's cluster.namespace."""


_target = ClusterTarget()


def current_target() -> ClusterTarget:
    return _target


def set_target(target: ClusterTarget) -> ClusterTarget:
    """Sets where the commands talk to; returns what it replaced, to restore it."""
    global _target
    previous, _target = _target, target
    return previous
