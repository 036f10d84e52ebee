"""Preflight checks: what a first cluster run gets wrong, found before a GPU is spent.

`dflashctl check` runs every check (as `kubectl auth can-i` or `sky check` do) and prints one line
per check with what to do when it fails. `dflashctl run`, every `dflashctl submit`, `retry`, `eval`
and `stage-model` run the same checks first, those of the step about to start (`preflight`), and
start nothing when one fails: nothing that `check` refuses starts. Which checks a step needs is
decided in one place, each check's own `Preflight.needs`/`whole_run`: `run` and `submit controller`
all of them, a single step its own (its inputs in storage, the Secrets and claims its pods use, its
pods' nodes), `stage-model` the cluster's and its source's. The target's config on the model volume
is read through the probe pod, as `check` does, when a run starts (no Job of it exists yet, or
--force re-specs it); once its Jobs exist it was read then, so re-attaching (and the in-cluster
controller, which may not create pods) does not start one again.

Each check is a small function of a `Preflight` (the spec, what is about to start, the cluster)
returning its results: ok, warn (worth a look, not blocking), fail (blocking, with the fix) or
skipped (not relevant here, or not knowable from here). A failure carries its exit code (DESIGN
section 9): 2 for a spec or setup to fix, 4 for a cluster that cannot be reached or forbids the
call, 5 for storage that does not answer. The checks live in cluster.py (namespace, permissions,
ServiceAccount, Secrets, volumes, nodes) and inputs.py (the spec's placeholders, the output and
the run it holds, the steps' order, data.source, the target, the image).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from dflash_jobs.errors import DflashError, StorageUnavailable
from dflash_jobs.spec import RunSpec
from dflash_jobs.storage import Storage, open_storage

from dflashctl.errors import EXIT_CLUSTER, EXIT_STORAGE_UNAVAILABLE, EXIT_USAGE, ChecksFailed, ClusterUnreachable, Forbidden, exit_code
from dflashctl.render import COMPONENTS, RUN_LABEL, job_name

if TYPE_CHECKING:  # the client is imported where the kubernetes backend is used (backends.py)
    from dflashctl.cluster import Cluster

Status = Literal["ok", "warn", "fail", "skipped"]
STORAGE_ATTEMPTS = 2
"""A check answers in seconds: a store that does not answer twice is reported, not waited for."""
PROBE_TIMEOUT_S = 360.0
"""How long `check` waits for the probe pod (its own deadline is 300 s: a volume that does not attach, an image pull)."""
WHOLE_RUN = ("run", "controller")
"""Steps that start the whole pipeline: `dflashctl run` and `dflashctl submit controller`."""


@dataclass(frozen=True, slots=True)
class CheckResult:
    name: str
    status: Status
    detail: str
    fix: str = ""
    exit_code: int = EXIT_USAGE
    """For a failure: 2 (fix the spec or the setup), 4 (the cluster), 5 (storage)."""

    def line(self) -> str:
        text = f"{self.status:<7} {self.name}: {self.detail}"
        return f"{text}. {self.fix}" if self.fix and self.status in ("warn", "fail") else text

    def to_dict(self) -> dict[str, Any]:
        """The result for `-o json`: an exit code only on a failure, the only status that has one."""
        result = asdict(self)
        if self.status != "fail":
            del result["exit_code"]
        return result


def ok(name: str, detail: str) -> CheckResult:
    return CheckResult(name, "ok", detail)


def warn(name: str, detail: str, fix: str = "") -> CheckResult:
    return CheckResult(name, "warn", detail, fix)


def fail(name: str, detail: str, fix: str, code: int = EXIT_USAGE) -> CheckResult:
    return CheckResult(name, "fail", detail, fix, code)


def skipped(name: str, detail: str) -> CheckResult:
    return CheckResult(name, "skipped", detail)


def from_error(name: str, error: DflashError, *, what: str = "") -> CheckResult:
    """A failure from a typed error, with the error's fix and exit code."""
    return fail(name, f"{what}{error.what}", error.fix, exit_code(error))


def checks_failed(failures: list[CheckResult]) -> ChecksFailed:
    lines = "; ".join(f"{f.name}: {f.detail}" for f in failures)
    fix = failures[0].fix if len(failures) == 1 else "`dflashctl check` lists each with its fix"
    return ChecksFailed(f"{len(failures)} preflight check(s) failed, nothing was started: {lines}", fix, exit_code_of(failures))


def exit_code_of(results: list[CheckResult]) -> int:
    """0 without failures; 2 when one asks to fix the spec or setup; else the first failure's (4, 5)."""
    failures = [result for result in results if result.status == "fail"]
    if not failures:
        return 0
    return EXIT_USAGE if any(f.exit_code == EXIT_USAGE for f in failures) else failures[0].exit_code


@dataclass(slots=True)
class Preflight:
    """What the checks look at."""

    spec: RunSpec
    step: str | None = None
    """What is about to start: "run", a component ("extract", "controller", ...) or "stage-model";
    None for `dflashctl check` (everything)."""
    cluster: Cluster | None = None
    """None on the local backend."""
    probe: bool = False
    """Whether a probe pod may be started to read the target's config from the model volume."""
    probe_timeout: float = PROBE_TIMEOUT_S
    force: bool = False
    """--force: an output holding another run is replaced, not refused."""
    stage_source: str | None = None
    """For stage-model: where the checkpoint comes from (hf://... or s3://...)."""
    cluster_error: DflashError | None = None
    """Why the cluster cannot be looked at (unreachable, no such namespace), set by the namespace check: the others then skip."""
    image_pulled: bool | None = None
    """Whether the probe pod pulled cluster.image (None: no probe ran)."""
    chat_rows: bool = False
    """Whether the data.source check read chat conversations (the target then needs its chat template)."""
    unsafe_claims: set[str] = field(default_factory=set)
    """ReadWriteOnce claims the volumes check found the run's pods may mount from different nodes: no probe mounts them."""
    _storages: dict[str, Storage] = field(default_factory=dict)
    _nodes: list[dict[str, Any]] | None = None

    def needs(self, *steps: str) -> bool:
        """Whether the step about to start is one of `steps` (`check` covers every step)."""
        return self.step is None or self.step in steps

    @property
    def whole_run(self) -> bool:
        return self.step is None or self.step in WHOLE_RUN

    def node_objects(self) -> list[dict[str, Any]]:
        """The cluster's nodes, listed once for every check (Forbidden where this client may not list them)."""
        if self._nodes is None:
            self._nodes = self.cluster.list_cluster_objects("Node")
        return self._nodes

    def storage(self, url: str) -> Storage:
        """Storage rooted at `url`, failing fast (no patience for outages: a check reports them)."""
        if url not in self._storages:
            self._storages[url] = open_storage(url, endpoint_url=self.spec.storage.endpoint_url, region=self.spec.storage.region,
                                               max_attempts=STORAGE_ATTEMPTS)
        return self._storages[url]


Check = Callable[[Preflight], "CheckResult | list[CheckResult]"]


def _checks() -> list[Check]:
    from dflashctl.check import cluster, inputs

    return [
        inputs.placeholders, cluster.namespace, cluster.permissions, cluster.service_account, cluster.s3_secret,
        cluster.hf_secret, cluster.pull_secrets, cluster.volumes, inputs.pod_template_patch, cluster.nodes,
        inputs.output, inputs.step_order, inputs.data_source, inputs.target, inputs.image,
    ]


def run_checks(preflight: Preflight) -> list[CheckResult]:
    """Every check, in order; one that raises becomes a failure with the error's exit code."""
    results: list[CheckResult] = []
    for check in _checks():
        results.extend(_run_one(check, preflight))
    return results


def _run_one(check: Check, preflight: Preflight) -> Iterator[CheckResult]:
    name = check.__name__.replace("_", " ")
    try:
        outcome = check(preflight)
    except (ClusterUnreachable, Forbidden) as error:
        preflight.cluster_error = preflight.cluster_error or error
        yield fail(name, error.what, error.fix, EXIT_CLUSTER)
        return
    except StorageUnavailable as error:
        yield fail(name, error.what, error.fix, EXIT_STORAGE_UNAVAILABLE)
        return
    except DflashError as error:
        yield from_error(name, error)
        return
    yield from outcome if isinstance(outcome, list) else [outcome]


def cluster_of(backend: Any) -> Cluster | None:
    """The Cluster behind a kubernetes backend (the one `open_backend` connected); None for the local one."""
    from dflashctl.kube import KubernetesBackend

    return backend.cluster if isinstance(backend, KubernetesBackend) else None


def preflight(spec: RunSpec, step: str, cluster: Cluster | None, *, force: bool, say: Callable[[str], None],
              stage_source: str | None = None, dry_run: bool = False) -> list[CheckResult]:
    """The checks before `step` starts (`run`, `submit`, `stage-model`; module docstring): every line
    that is not ok is said; a failure raises ChecksFailed. A dry run starts no probe pod: it writes nothing."""
    probe = not dry_run and step != "stage-model" and cluster is not None and (force or not run_has_jobs(cluster, spec))
    results = run_checks(Preflight(spec, step=step, cluster=cluster, force=force, stage_source=stage_source, probe=probe))
    for result in results:
        if result.status in ("warn", "fail"):
            say(f"check {result.line()}")
    failures = [result for result in results if result.status == "fail"]
    if failures:
        raise checks_failed(failures)
    return results


def run_has_jobs(cluster: Cluster, spec: RunSpec) -> bool:
    """Whether a Job of the run's pipeline exists (stage-model's does not count: it starts no run).
    An unreachable cluster answers False: the namespace check says why."""
    try:
        jobs, _ = cluster.list("Job", label_selector=f"{RUN_LABEL}={spec.name}")
    except DflashError:
        return False
    return bool({job["metadata"]["name"] for job in jobs} & {job_name(spec, component) for component in COMPONENTS})
