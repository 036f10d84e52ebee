"""Which backend a spec gets: the factory above both backends, which import their types from
backend.py (so backend.py never imports them back)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflashctl.backend import Backend

if TYPE_CHECKING:
    from dflash_jobs.spec import RunSpec


def open_backend(spec: RunSpec) -> Backend:
    """The backend the spec asks for. Imported lazily: the local one must not need a kubeconfig."""
    if spec.backend == "local":
        from dflashctl.local.backend import LocalBackend

        return LocalBackend(spec)
    from dflashctl.kube import KubernetesBackend

    return KubernetesBackend.connect(spec.cluster.namespace)
