"""The pipeline's progress as Prometheus metrics, for a cluster that already scrapes its pods.

`dflashctl run` serves them at http://<pod>:<cluster.metrics_port>/metrics when the spec sets the
port (the in-cluster controller Job renders it as its "metrics" port; k8s/components/metrics holds
the ServiceMonitor). They come from what the pipeline reports anyway (`StepUpdate`), so serving
them costs no storage or API call of its own:

    dflash_step{run, step}                 1 for the step the pipeline is at, 0 for those it was at
    dflash_chunks_landed{run}              chunks whose done marker exists
    dflash_chunks{run}                     chunks in tokens/dataset.json
    dflash_chunks_verified{run}            chunks verify has checked so far
    dflash_extract_tokens_per_second{run}  tokens landed per second since the extraction Job started
    dflash_extract_eta_seconds{run}        until every chunk has landed at that rate
    dflash_failed_shards{run}              extraction shards (indexes) failed in the current Job
    dflash_progress_timestamp_seconds{run} when the pipeline last reported (stale: it is stuck)

A value not known (yet) is NaN, never a stale number.
"""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from dflash_jobs.errors import SpecError
from dflash_jobs.spec import RunSpec

from dflashctl.pipeline import Reporter, StepUpdate

UNKNOWN = float("nan")


class RunMetrics:
    """The gauges of one run, in a registry of their own (no process metrics of this client)."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.current_step: str | None = None
        self.registry = CollectorRegistry()
        self.step = self._gauge("dflash_step", "1 for the step the pipeline is at, 0 for the others", "step")
        self.chunks_landed = self._gauge("dflash_chunks_landed", "Chunks whose done marker exists")
        self.chunks = self._gauge("dflash_chunks", "Chunks in tokens/dataset.json")
        self.chunks_verified = self._gauge("dflash_chunks_verified", "Chunks checked against their markers so far")
        self.tokens_per_second = self._gauge("dflash_extract_tokens_per_second", "Tokens landed per second since the extraction Job started")
        self.eta = self._gauge("dflash_extract_eta_seconds", "Seconds until every chunk has landed at the current rate")
        self.failed_shards = self._gauge("dflash_failed_shards", "Extraction shards (indexes) failed in the current Job")
        self.reported = self._gauge("dflash_progress_timestamp_seconds", "When the pipeline last reported progress (Unix time)")
        for gauge in (self.chunks_landed, self.chunks, self.chunks_verified, self.tokens_per_second, self.eta, self.failed_shards):
            gauge.labels(run=run).set(UNKNOWN)

    def _gauge(self, name: str, documentation: str, *labels: str) -> Gauge:
        return Gauge(name, documentation, ["run", *labels], registry=self.registry)

    def observe(self, update: StepUpdate) -> None:
        if update.step != self.current_step:
            if self.current_step is not None:
                self.step.labels(run=self.run, step=self.current_step).set(0)
            self.step.labels(run=self.run, step=update.step).set(1)
            self.current_step = update.step
        if update.step == "extract":
            self._set(self.chunks_landed, update.done)
            self._set(self.chunks, update.total)
            self._set(self.tokens_per_second, update.tokens_per_s)
            self._set(self.eta, update.eta_s)
            if update.job is not None and update.job.exists:
                self.failed_shards.labels(run=self.run).set(len(update.job.failed_indexes))
        else:  # the rate and the ETA are extraction's: once it is over they are not known
            self._set(self.tokens_per_second, None)
            self._set(self.eta, None)
        if update.step == "verify":  # which runs once every chunk has landed
            self._set(self.chunks_verified, update.done)
            self._set(self.chunks, update.total)
            self._set(self.chunks_landed, update.total)
        self.reported.labels(run=self.run).set(time.time())

    def _set(self, gauge: Gauge, value: float | None) -> None:
        gauge.labels(run=self.run).set(UNKNOWN if value is None else value)

    def serve(self, port: int, *, or_any_free: bool = False) -> int:
        """/metrics on every address of this host (the pod's), from a daemon thread. Returns the port:
        `port`, or with `or_any_free` a free one the system picks when `port` is taken."""
        try:
            server, _ = start_http_server(port, registry=self.registry)
        except OSError as error:
            if not or_any_free:
                raise SpecError("cluster.metrics_port", port, f"a port free on this host ({error.strerror}), or null for no metrics") from None
            server, _ = start_http_server(0, registry=self.registry)
        return server.server_port


class MetricsReporter:
    """A Reporter that feeds the metrics and passes everything on to the one people read."""

    def __init__(self, inner: Reporter, metrics: RunMetrics) -> None:
        self.inner = inner
        self.metrics = metrics

    def say(self, message: str) -> None:
        self.inner.say(message)

    def update(self, update: StepUpdate) -> None:
        self.metrics.observe(update)
        self.inner.update(update)



def with_metrics(spec: RunSpec, reporter: Reporter) -> Reporter:
    """`reporter`, feeding metrics served on cluster.metrics_port when the spec sets one.

    In a pod (the in-cluster controller) the port is the spec's, the one the controller Job declares
    and the metrics Service targets: taken, it is an error. Anywhere else (`dflashctl run` on a
    laptop, where another program may hold it) a port that is taken gives way to a free one, and
    the reporter says which: the port is not part of the run's identity (spec.OUTSIDE_RUN_IDENTITY).
    """
    port = spec.cluster.metrics_port
    if port is None:
        return reporter
    metrics = RunMetrics(spec.name)
    served = metrics.serve(port, or_any_free=not in_pod())
    if served == port:
        reporter.say(f"metrics: Prometheus text on port {port} at /metrics")
    else:
        reporter.say(f"metrics: port {port} (cluster.metrics_port) is taken here: Prometheus text on port {served} at /metrics instead")
    return MetricsReporter(reporter, metrics)


def in_pod() -> bool:
    """Whether this process runs in a Kubernetes pod: the kubelet sets KUBERNETES_SERVICE_HOST in every container."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
