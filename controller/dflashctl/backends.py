"""Which backend a spec gets: the factory above both backends, which import their types from
backend.py (so backend.py never imports them back); and the spec placed where the command line
says (`-n/--namespace`, target.py)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from dflash_jobs.errors import InputError

from dflashctl.backend import Backend
from dflashctl.target import current_target

if TYPE_CHECKING:
    from dflash_jobs.spec import RunSpec


def open_backend(spec: RunSpec) -> Backend:
    """The backend the spec asks for. Imported lazily: the local one must not need a kubeconfig.

    The kubernetes one connects where the command line says (`Cluster.connect` reads the target),
    so every command that opens a backend honours --context and -n without code of its own.
    """
    if spec.backend == "local":
        from dflashctl.local.backend import LocalBackend

        return LocalBackend(spec)
    return cluster_backend(spec.cluster.namespace)


def cluster_backend(namespace: str) -> Backend:
    """The kubernetes backend in `namespace` (or where the command line says), for a spec's run or
    for the commands that find runs by name."""
    try:
        import kubernetes  # noqa: F401 - only whether the client is installed here
    except ImportError:
        raise InputError(
            "the kubernetes backend needs the `kubernetes` package, which this Python cannot import",
            "`pip install kubernetes` (or `pip install .` from the repository), or use `backend: local` in the spec",
        ) from None
    from dflashctl.kube import KubernetesBackend

    return KubernetesBackend.connect(namespace)


def targeted(spec: RunSpec) -> RunSpec:
    """The spec with the command line's -n/--namespace as its cluster.namespace, so that what is
    rendered from it (metadata.namespace, the RoleBinding's subject, the spec in the ConfigMap
    that the in-cluster controller reads) lands where the commands talk to. The namespace is
    outside the run's identity: the spec hash stays the same."""
    namespace = current_target().namespace
    if namespace is None or namespace == spec.cluster.namespace:
        return spec
    return dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, namespace=namespace))
