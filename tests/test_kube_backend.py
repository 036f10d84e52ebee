"""The kubernetes backend against a test double of the Kubernetes HTTP API: the official client's code runs."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import free_port
from k8s_fake_api import fake_k8s  # noqa: F401 - the fixture
from test_render import make_spec

from kubernetes.client import ApiClient, Configuration

from dflash_jobs.errors import InputError

from dflashctl.backend import EVENT_EXTRACTION_FINISHED, PROGRESS_ANNOTATION, LogQuery
from dflashctl.cluster import Cluster
from dflashctl.errors import ClusterUnreachable, Conflict, Forbidden, RunFailed, WaitTimeout, exit_code
from dflashctl.kube import KubernetesBackend
from dflashctl.render import controller_role_rules, job_name, render_selection

SPEC = make_spec(extract={"shards": 3, "backoff_limit_per_index": 2})
EXTRACT = job_name(SPEC, "extract")


@pytest.fixture
def backend(fake_k8s):  # noqa: F811 - the fixture above
    return KubernetesBackend.connect(SPEC.cluster.namespace)


def scripted(*steps):
    """An on_update callback that runs the next step of the cluster's story on every update it sees."""
    remaining = list(steps)
    seen = []

    def on_update(status):
        seen.append(status)
        if remaining:
            remaining.pop(0)()

    on_update.seen = seen
    return on_update


def test_submit_creates_then_attaches_and_refuses_a_different_spec(backend, fake_k8s):  # noqa: F811
    objects = render_selection(SPEC, "extract")
    assert backend.submit(objects) == {EXTRACT: "created"}
    uid = fake_k8s.api.get("Job", EXTRACT)["metadata"]["uid"]
    assert len(fake_k8s.api.all("Pod")) == 3
    assert backend.submit(objects) == {EXTRACT: "attached"}  # the same spec again
    assert fake_k8s.api.get("Job", EXTRACT)["metadata"]["uid"] == uid
    assert len(fake_k8s.api.requests_matching("POST", "/jobs")) == 2  # the second answered 409
    changed = render_selection(make_spec(extract={"shards": 4, "backoff_limit_per_index": 2}), "extract")
    with pytest.raises(Conflict, match="--force") as error:
        backend.submit(changed)
    assert exit_code(error.value) == 2
    assert backend.submit(changed, force=True) == {EXTRACT: "replaced"}
    job = fake_k8s.api.get("Job", EXTRACT)
    assert job["metadata"]["uid"] != uid and job["spec"]["completions"] == 4
    assert len(fake_k8s.api.all("Pod")) == 4  # the old Job's pods went with it


def test_wait_follows_an_extraction_through_failure_preemption_a_lost_watch_410_and_a_500(backend, fake_k8s):  # noqa: F811
    api = fake_k8s.api
    backend.submit(render_selection(SPEC, "extract"))

    def lose_the_watch():
        api.finish(EXTRACT, 0)
        api.compact()  # the version the client resumes from is gone: 410, then a fresh list
        api.fail_requests(1, status=500, path="watch=true")
        api.drop_watches()

    on_update = scripted(
        lambda: api.start(EXTRACT),
        lose_the_watch,
        lambda: api.finish(EXTRACT, 1, exit_code=42),
        lambda: api.preempt(EXTRACT, 2),
        lambda: api.start(EXTRACT, node="gpu-node-2"),
        lambda: api.finish(EXTRACT, 2),
    )
    final = backend.wait(EXTRACT, timeout=30, on_update=on_update)
    assert final.finished and final.failed_terminally and not final.complete
    assert final.conditions["Failed"].startswith("FailedIndexes")
    assert final.completed_indexes == {0, 2} and final.failed_indexes == {1}
    assert final.failed == 1  # the preempted pod did not count against the shard
    shards = {s.index: s for s in final.shards}
    assert shards[1].phase == "Failed" and shards[1].exit_reason == "exit 42 (Error)"
    assert shards[2].phase == "Succeeded" and shards[2].attempts == 2 and shards[2].node == "gpu-node-2"
    assert shards[0].attempts == 1 and shards[0].node == "gpu-node-1"
    assert api.sent_gone >= 1
    assert len(api.requests_matching("GET", "fieldSelector=metadata.name")) >= 3  # list, watches, re-list
    assert all("allowWatchBookmarks=true" in r for r in api.requests_matching("GET", "watch=true"))
    assert [len(s.completed_indexes) for s in on_update.seen][-1] == 2
    preempted = [s for s in on_update.seen if any(sh.exit_reason == "retry after: preempted (PreemptionByScheduler)" for sh in s.shards)]
    assert preempted, "the preempted pod shows up with its reason before the replacement runs"


def test_a_bookmark_moves_the_watch_forward_so_a_reconnect_needs_no_relist(backend, fake_k8s):  # noqa: F811
    api = fake_k8s.api
    backend.submit(render_selection(SPEC, "extract"))

    def unrelated_change_then_cut():
        sent = api.sent_bookmarks
        api.create("ConfigMap", "dflash", {"metadata": {"name": "unrelated"}})
        deadline = time.monotonic() + 5
        while api.sent_bookmarks == sent and time.monotonic() < deadline:
            time.sleep(0.01)
        api.compact(below=api.version)  # only the bookmark's version is still watchable
        api.drop_watches()
        for index in range(3):
            api.finish(EXTRACT, index)

    final = backend.wait(EXTRACT, timeout=30, on_update=scripted(lambda: api.start(EXTRACT), unrelated_change_then_cut))
    assert final.complete and final.completed_indexes == {0, 1, 2}
    assert api.sent_bookmarks >= 1 and api.sent_gone == 0


def test_single_pod_jobs_retry_up_to_their_backoff_limit_or_fail_at_once_on_a_bad_spec(backend, fake_k8s):  # noqa: F811
    api = fake_k8s.api
    train = job_name(SPEC, "train")
    backend.submit(render_selection(SPEC, "train"))
    for _ in range(4):  # TRAIN_BACKOFF_LIMIT = 3: the fourth failure is the last
        api.start(train)
        api.finish(train, 0, exit_code=1)
    status = backend.job_status(train)
    assert status.failed_terminally and status.conditions["Failed"].startswith("BackoffLimitExceeded")
    assert status.shards[0].attempts == 4 and status.shards[0].exit_reason == "exit 1 (Error)"

    evaluation = job_name(SPEC, "eval")
    backend.submit(render_selection(SPEC, "eval"))
    api.start(evaluation)
    api.finish(evaluation, 0, exit_code=2)  # EXIT_BAD_SPEC: FailJob, no retry
    status = backend.wait(evaluation, timeout=10)
    assert status.failed_terminally and status.conditions["Failed"].startswith("PodFailurePolicy")
    assert status.shards[0].attempts == 1


def test_a_failed_pod_s_last_words_are_read_from_whatever_its_termination_message_holds(backend, fake_k8s):  # noqa: F811
    """Issue 43, item 1: the termination message is the kubelet's copy of the log's tail, and a log
    that ends in blank lines leaves one of blank lines; the status shows no last words then, and
    does not fail on it."""
    api = fake_k8s.api
    backend.submit(render_selection(SPEC, "extract"))
    api.start(EXTRACT)
    for index, message in enumerate(("step 3\nError: the chunk is corrupt\nbye\n", "\n \n\n", "plain last line")):
        api.finish(EXTRACT, index, exit_code=42, message=message)  # bad input: the index fails, no retry
    shards = backend.job_status(EXTRACT).shards
    assert [shard.message for shard in shards] == ["Error: the chunk is corrupt", None, "plain last line"]


def test_wait_times_out_and_a_deleted_job_is_a_failure(backend, fake_k8s):  # noqa: F811
    backend.submit(render_selection(SPEC, "extract"))
    with pytest.raises(WaitTimeout) as error:
        backend.wait(EXTRACT, timeout=0.5)
    assert exit_code(error.value) == 3
    backend.delete(EXTRACT)
    assert fake_k8s.api.get("Job", EXTRACT) is None and fake_k8s.api.all("Pod") == []
    assert not backend.job_status(EXTRACT).exists
    with pytest.raises(RunFailed, match="does not exist"):
        backend.wait(EXTRACT, timeout=5)


def test_logs_per_shard_all_shards_and_followed(backend, fake_k8s):  # noqa: F811
    api = fake_k8s.api
    backend.submit(render_selection(SPEC, "extract"))
    api.start(EXTRACT)
    api.write_log(EXTRACT, 1, "loading target", "chunk 7: 65536 tokens")
    api.write_log(EXTRACT, 2, "loading target")
    assert list(backend.logs(EXTRACT, 1)) == ["loading target", "chunk 7: 65536 tokens"]
    assert list(backend.logs(EXTRACT, None)) == [
        "[shard 1] loading target", "[shard 1] chunk 7: 65536 tokens", "[shard 2] loading target",
    ]

    def later():
        time.sleep(0.2)
        api.write_log(EXTRACT, 0, "chunk 3 done")
        api.finish(EXTRACT, 0)

    threading.Thread(target=later).start()
    assert list(backend.logs(EXTRACT, 0, LogQuery(follow=True))) == ["chunk 3 done"]
    with pytest.raises(InputError, match="shard 9"):
        backend.logs(EXTRACT, 9)


def test_events_and_the_progress_annotation_land_on_the_job(backend, fake_k8s):  # noqa: F811
    backend.submit(render_selection(SPEC, "extract"))
    backend.annotate(EXTRACT, PROGRESS_ANNOTATION, "2/3")
    backend.record_event(EXTRACT, EVENT_EXTRACTION_FINISHED, "3/3 chunks landed")
    backend.record_event(EXTRACT, "ShardsFailed", "shard 1 failed: exit 42", warning=True)
    job = fake_k8s.api.get("Job", EXTRACT)
    assert job["metadata"]["annotations"][PROGRESS_ANNOTATION] == "2/3"
    assert job["metadata"]["annotations"]["dflash.dev/spec-hash"] == SPEC.fingerprint()  # a merge patch
    events = fake_k8s.api.all("Event")
    assert [(e["reason"], e["type"]) for e in events] == [(EVENT_EXTRACTION_FINISHED, "Normal"), ("ShardsFailed", "Warning")]
    assert events[0]["involvedObject"] == {
        "apiVersion": "batch/v1", "kind": "Job", "name": EXTRACT, "namespace": "dflash", "uid": job["metadata"]["uid"],
    }


def test_transient_500s_are_retried_and_persistent_ones_exit_4(backend, fake_k8s):  # noqa: F811
    backend.submit(render_selection(SPEC, "extract"))
    fake_k8s.api.fail_requests(2, status=500, method="GET")
    assert backend.job_status(EXTRACT).exists
    fake_k8s.api.fail_requests(100, status=503, path="watch=true")
    with pytest.raises(ClusterUnreachable, match="503"):
        backend.wait(EXTRACT, timeout=20)  # a watch that keeps failing is given up, not retried forever
    fake_k8s.api.fail_requests(100, status=503, method="GET")
    with pytest.raises(ClusterUnreachable, match="503") as error:
        backend.job_status(EXTRACT)
    assert exit_code(error.value) == 4


def test_forbidden_and_unreachable_clusters_exit_4(backend, fake_k8s, tmp_path, monkeypatch):  # noqa: F811
    fake_k8s.api.fail_requests(1, status=403, method="POST")
    with pytest.raises(Forbidden, match="RBAC") as error:
        backend.submit(render_selection(SPEC, "extract"))
    assert exit_code(error.value) == 4
    nowhere = Cluster(ApiClient(Configuration(host=f"http://127.0.0.1:{free_port()}")), "dflash")
    with pytest.raises(ClusterUnreachable, match="unreachable") as error:
        KubernetesBackend(nowhere).job_status(EXTRACT)
    assert exit_code(error.value) == 4
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ClusterUnreachable, match="KUBECONFIG"):
        Cluster.connect("dflash")


def test_a_missing_namespace_and_a_refused_object_exit_2_naming_the_fix(backend, fake_k8s):  # noqa: F811
    fake_k8s.api.namespaces = {"default"}
    with pytest.raises(InputError, match="namespace dflash does not exist") as error:
        backend.submit(render_selection(SPEC, "extract"))
    assert exit_code(error.value) == 2 and "kubectl apply -k" in error.value.fix
    fake_k8s.api.namespaces = None
    posts = len(fake_k8s.api.requests_matching("POST", "/namespaces/dflash/"))
    fake_k8s.api.fail_requests(1, status=422, method="POST")
    with pytest.raises(InputError, match="refused to create") as error:
        backend.submit(render_selection(SPEC, "extract"))
    assert exit_code(error.value) == 2
    assert len(fake_k8s.api.requests_matching("POST", "/namespaces/dflash/")) == posts + 1, "a refused object is not retried"


def test_the_controller_role_allows_every_call_the_backend_makes(backend, fake_k8s):  # noqa: F811
    api = fake_k8s.api
    spec = make_spec(extract={"shards": 3, "backoff_limit_per_index": 2}, train={"nodes": 2})
    backend.submit(render_selection(spec, "train"))  # with its rendezvous Service
    backend.submit(render_selection(spec, "extract"))
    api.start(EXTRACT)
    api.write_log(EXTRACT, 0, "hello")
    list(backend.logs(EXTRACT, 0))
    backend.annotate(EXTRACT, PROGRESS_ANNOTATION, "0/3")
    backend.record_event(EXTRACT, EVENT_EXTRACTION_FINISHED, "done")
    backend.wait(EXTRACT, timeout=10, on_update=scripted(lambda: [api.finish(EXTRACT, index) for index in range(3)]))
    backend.delete(EXTRACT)
    allowed = {
        (group, resource, verb)
        for rule in controller_role_rules()
        for group in rule["apiGroups"] for resource in rule["resources"] for verb in rule["verbs"]
    }
    made = {_permission(method, path) for method, path in api.requests}
    assert made - allowed == set()
    assert {("batch", "jobs", "watch"), ("", "pods/log", "get"), ("", "events", "create"), ("", "services", "create")} <= made


def _permission(method: str, path: str) -> tuple[str, str, str]:
    """The RBAC (apiGroup, resource, verb) an API request needs."""
    route, _, query = path.partition("?")
    parts = route.strip("/").split("/")
    group = "" if parts[0] == "api" else parts[1]
    rest = parts[4:] if parts[0] == "api" else parts[5:]
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    if method == "GET":
        verb = "get" if len(rest) > 1 else ("watch" if "watch=true" in query else "list")
    else:
        verb = {"POST": "create", "PATCH": "patch", "DELETE": "delete"}[method]
    return group, resource, verb
