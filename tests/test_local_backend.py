"""The local backend runs rendered Jobs as processes with the Job controller's semantics.

The pods run small `python -c` scripts: what is under test is the backend (indexes, env, mounts,
parallelism, retries, podFailurePolicy, logs, attach, delete), not the data-plane jobs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_jobs.errors import InputError, SpecError
from dflash_jobs.spec import dump_spec, parse_spec

from dflashctl.backend import LogQuery
from dflashctl.errors import Conflict, RunFailed, WaitTimeout
from dflashctl.local.backend import LocalBackend
from dflashctl.local.pod import PathMap, resolve_container
from dflashctl.local.processes import ProcessRef, kill_groups, start_time
from dflashctl.local.state import JobFiles
from dflashctl.render import SPEC_HASH, render_extract_job, render_selection
from dflashctl.runs import list_runs, remove_run, spec_of_run

from cli_runner import cli

WAIT_S = 30


def make_spec(tmp_path: Path, **local):
    return parse_spec({
        "name": "demo",
        "backend": "local",
        "target": {"model": str(tmp_path / "models" / "tiny")},
        "data": {"source": str(tmp_path / "chats.jsonl"), "max_length": 64, "chunk_tokens": 256},
        "output": str(tmp_path / "out"),
        "extract": {"shards": 3, "backoff_limit_per_index": 2},
        "cluster": {"model_volume": {"claim": "models", "mount": "/models"}},
        "local": {"workdir": str(tmp_path / "work"), **local},
    })


def make_job(name: str, script: str, *, completions: int = 1, parallelism: int | None = None, indexed: bool = True,
             backoff_per_index: int | None = 0, rules: list | None = None, spec_hash: str = "h1",
             init_script: str | None = None, env_from_secret: bool = False, **job_spec) -> dict:
    """A Job shaped like render.py's: Indexed, restartPolicy Never, a "worker" container."""
    worker = {"name": "worker", "command": ["python", "-c", script], "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}]}
    if env_from_secret:
        worker["envFrom"] = [{"secretRef": {"name": "dflash-s3", "optional": True}}]
    pod_spec = {"restartPolicy": "Never", "containers": [worker]}
    if init_script is not None:
        pod_spec["initContainers"] = [{"name": "selfcheck", "command": ["python", "-c", init_script]}]
    spec = {"completions": completions, "parallelism": parallelism or completions, "template": {"spec": pod_spec}, **job_spec}
    if indexed:
        spec["completionMode"] = "Indexed"
    if backoff_per_index is not None and indexed:
        spec["backoffLimitPerIndex"] = backoff_per_index
    if rules is not None:
        spec["podFailurePolicy"] = {"rules": rules}
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": "dflash", "annotations": {SPEC_HASH: spec_hash}},
        "spec": spec,
    }


def run_job(backend: LocalBackend, job: dict):
    backend.submit([job])
    return backend.wait(job["metadata"]["name"], timeout=WAIT_S)


@pytest.fixture
def backend(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return LocalBackend(make_spec(tmp_path))


def test_rendered_extract_job_runs_every_index_with_its_env_and_mounts(tmp_path, monkeypatch):
    """The manifest of render.py itself: the ConfigMap mount, emptyDirs, the model claim, the selfcheck init."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value")
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    spec = make_spec(tmp_path)
    configmap, job = render_selection(spec, "extract")
    probe = (
        "import json, os, sys; spec = open(sys.argv[sys.argv.index('-f') + 1]).read(); "
        "print(json.dumps({'index': os.environ['JOB_COMPLETION_INDEX'], 'spec': spec, 'home': os.environ['HOME'], "
        "'home_exists': os.path.isdir(os.environ['HOME']), 'models': os.listdir(sys.argv[-1]), "
        "'secret': os.environ.get('AWS_SECRET_ACCESS_KEY'), 'cwd': os.getcwd()}))"
    )
    for container in (*job["spec"]["template"]["spec"]["initContainers"], *job["spec"]["template"]["spec"]["containers"]):
        # Keep the rendered arguments (`-f /etc/dflash/dflash.yaml`): the backend must map the mount path.
        container["command"] = ["python", "-c", probe, *container["command"][3:], "/models"]
    backend = LocalBackend(spec)
    backend.submit([configmap, job])
    status = backend.wait("demo-extract", timeout=WAIT_S)

    assert status.complete and status.completed_indexes == {0, 1, 2} and not status.failed_indexes
    assert [shard.attempts for shard in status.shards] == [1, 1, 1]
    for index in range(3):
        selfcheck = [json.loads(line) for line in backend.logs("demo-extract", index, LogQuery(container="selfcheck")) if line.startswith("{")]
        (worker,) = [json.loads(line) for line in backend.logs("demo-extract", index) if line.startswith("{")]
        assert selfcheck and selfcheck[-1]["index"] == str(index)  # the init container ran first, with the same env
        assert worker["index"] == str(index)
        assert worker["spec"] == dump_spec(spec)
        assert worker["home_exists"] and worker["home"].startswith(str(tmp_path / "work" / "pods"))
        assert worker["models"] == ["tiny"]  # the claim shows the directory holding target.model
        assert worker["secret"] == "s3cr3t-value"  # envFrom secretRef -> this environment
        assert worker["cwd"] == str(tmp_path)
    # The Secret's value is handed to processes, never written under the workdir.
    for path in (tmp_path / "work").rglob("*"):
        if path.is_file() and "logs" not in path.parts:
            assert b"s3cr3t-value" not in path.read_bytes(), path
    assert not list((tmp_path / "work" / "pods").glob("*/*")), "emptyDirs are removed with their pod"


def test_container_without_the_secret_reference_gets_no_credentials(backend, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key-id")
    script = "import os; print('creds', os.environ.get('AWS_ACCESS_KEY_ID'))"
    assert run_job(backend, make_job("nosecret", script)).complete
    assert list(backend.logs("nosecret", 0))[-1] == "creds None"
    assert run_job(backend, make_job("secret", script, env_from_secret=True)).complete
    assert list(backend.logs("secret", 0))[-1] == "creds key-id"


def test_resolve_container_maps_launchers_field_refs_and_paths(tmp_path):
    container = {
        "name": "worker",
        "command": ["torchrun", "--nproc_per_node=2", "-m", "dflash_jobs.train", "-f", "/etc/dflash/dflash.yaml", "--cache=/var/cache/x"],
        "env": [
            {"name": "RANK0", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
            {"name": "CACHE", "value": "/var/cache/dflash"},
            {"name": "HF_HOME", "value": "$(CACHE)/huggingface"},
        ],
    }
    paths = PathMap({"/etc/dflash": tmp_path / "cm", "/var/cache": tmp_path / "cache", "/var/cache/dflash": tmp_path / "dc"})
    resolved = resolve_container(container, pod="t-3-0", namespace="ns", index=3, paths=paths, cwd="/w")
    assert resolved.argv == [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "dflash_jobs.train",
        "-f", str(tmp_path / "cm" / "dflash.yaml"), f"--cache={tmp_path / 'cache' / 'x'}",
    ]
    assert resolved.env["JOB_COMPLETION_INDEX"] == "3" and resolved.env["RANK0"] == "3"
    assert resolved.env["CACHE"] == str(tmp_path / "dc")  # the longest mount wins
    assert resolved.env["HF_HOME"] == str(tmp_path / "dc" / "huggingface")


def test_parallelism_is_honoured_and_capped_by_local_parallelism(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    backend = LocalBackend(make_spec(tmp_path, parallelism=2))
    spans = tmp_path / "spans"
    spans.mkdir()
    script = (
        "import os, time; i = os.environ['JOB_COMPLETION_INDEX']; start = time.time(); time.sleep(0.4); "
        f"open(os.path.join({str(spans)!r}, i), 'w').write(f'{{start}} {{time.time()}}')"
    )
    status = run_job(backend, make_job("par", script, completions=5, parallelism=4))
    assert status.complete and status.completed_indexes == set(range(5))
    intervals = [tuple(map(float, (spans / str(i)).read_text().split())) for i in range(5)]
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running, most = 0, 0
    for _, delta in events:
        running += delta
        most = max(most, running)
    assert most == 2


@pytest.mark.parametrize(("cores", "expected"), [(None, {"7"}), (4, {"2"}), (1, {"1"})])
def test_local_cores_fix_the_pods_threads_whatever_the_environment_says(tmp_path, monkeypatch, cores, expected):
    """Without local.cores the shell's OMP_NUM_THREADS wins (else cores / parallelism); with it, each of
    the Job's parallel pods gets its share of those cores, so a spec's figures do not change with the shell."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    backend = LocalBackend(make_spec(tmp_path, **({} if cores is None else {"cores": cores})))
    seen = tmp_path / "threads"
    seen.mkdir()
    script = f"import os; open(os.path.join({str(seen)!r}, os.environ['JOB_COMPLETION_INDEX']), 'w').write(os.environ['OMP_NUM_THREADS'])"
    assert run_job(backend, make_job("threads", script, completions=2, parallelism=2)).complete
    assert {(seen / str(i)).read_text() for i in range(2)} == expected


def test_local_cores_must_be_positive(tmp_path):
    with pytest.raises(SpecError, match="local.cores"):
        make_spec(tmp_path, cores=0)


def test_a_failed_index_is_retried_within_its_backoff_limit(backend, tmp_path):
    script = (
        "import os, sys, pathlib; i = os.environ['JOB_COMPLETION_INDEX']; "
        f"flag = pathlib.Path({str(tmp_path)!r}) / ('tried-' + i); "
        "first = i == '1' and not flag.exists(); flag.touch(); print('attempt of', i, 'first' if first else 'again'); "
        "sys.exit(1 if first else 0)"
    )
    status = run_job(backend, make_job("retry", script, completions=3, backoff_per_index=1))
    assert status.complete and status.completed_indexes == {0, 1, 2}
    assert [shard.attempts for shard in status.shards] == [1, 2, 1]
    assert status.failed == 1
    files = JobFiles(backend.workdir, "retry")
    assert "first" in files.pod_log(1, 0).read_text() and "again" in files.pod_log(1, 1).read_text()
    assert list(backend.logs("retry", 1))[-1] == "attempt of 1 again"


def test_logs_take_kubectls_options_container_tail_and_the_previous_attempt(backend, tmp_path):
    """One log file per attempt holds every container's lines, each after its `==> container` line:
    each option reads the part kubectl logs would."""
    script = (
        "import os, sys, pathlib; i = os.environ['JOB_COMPLETION_INDEX']; "
        f"flag = pathlib.Path({str(tmp_path)!r}) / ('tried-' + i); first = not flag.exists(); flag.touch(); "
        "[print('line', n, 'first' if first else 'again') for n in range(3)]; sys.exit(1 if first else 0)"
    )
    job = make_job("retried", script, backoff_per_index=1, init_script="print('checked: ok')")
    assert run_job(backend, job).complete
    assert list(backend.logs("retried", 0)) == [f"line {n} again" for n in range(3)]
    assert list(backend.logs("retried", 0, LogQuery(previous=True))) == [f"line {n} first" for n in range(3)]
    assert list(backend.logs("retried", 0, LogQuery(previous=True, tail=1))) == ["line 2 first"]
    assert list(backend.logs("retried", None, LogQuery(tail=2))) == ["[shard 0] line 1 again", "[shard 0] line 2 again"]
    assert list(backend.logs("retried", 0, LogQuery(container="selfcheck", follow=True))) == ["checked: ok"]
    with pytest.raises(InputError, match="no container 'stage'.*selfcheck, worker"):
        backend.logs("retried", 0, LogQuery(container="stage"))
    with pytest.raises(InputError, match="--since needs each line's time"):
        backend.logs("retried", 0, LogQuery(since_s=60))
    assert run_job(backend, make_job("once", "print('hi')")).complete
    with pytest.raises(InputError, match="has had one attempt"):
        backend.logs("once", 0, LogQuery(previous=True))


def test_an_index_that_keeps_failing_fails_the_job_after_its_retries(backend):
    script = "import os, sys; sys.exit(1 if os.environ['JOB_COMPLETION_INDEX'] == '0' else 0)"
    status = run_job(backend, make_job("flaky", script, completions=2, backoff_per_index=2))
    assert status.failed_terminally and status.failure_message.startswith("FailedIndexes")
    assert status.failed_indexes == {0} and status.completed_indexes == {1}
    assert status.shards[0].attempts == 3 and status.shards[0].exit_reason == "exit 1 (Error)"


def test_pod_failure_policy_fail_index_on_bad_input_is_not_retried(backend):
    rules = [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [2]}},
        {"action": "FailIndex", "onExitCodes": {"operator": "In", "values": [42]}},
    ]
    script = "import os, sys; sys.exit(42 if os.environ['JOB_COMPLETION_INDEX'] == '2' else 0)"
    status = run_job(backend, make_job("badinput", script, completions=3, backoff_per_index=3, rules=rules))
    assert status.failed_terminally and status.failed_indexes == {2} and status.completed_indexes == {0, 1}
    assert status.shards[2].attempts == 1 and status.shards[2].exit_reason == "exit 42 (Error)"


def test_pod_failure_policy_fail_job_ends_the_other_pods(backend, tmp_path):
    rules = [{"action": "FailJob", "onExitCodes": {"containerName": "worker", "operator": "In", "values": [2]}}]
    finished = tmp_path / "finished"
    script = (
        "import os, sys, time\nif os.environ['JOB_COMPLETION_INDEX'] == '0':\n    time.sleep(0.3); sys.exit(2)\n"
        f"time.sleep(20); open({str(finished)!r}, 'w').write('x')"
    )
    started = time.monotonic()
    status = run_job(backend, make_job("badspec", script, completions=3, backoff_per_index=3, rules=rules))
    assert time.monotonic() - started < 15
    assert status.failed_terminally and status.failure_message.startswith("PodFailurePolicy")
    assert "exit code 2 matching FailJob rule" in status.failure_message
    assert not finished.exists() and status.active == 0


def test_init_container_failure_fails_the_pod_before_the_worker(backend):
    rules = [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [2]}}]
    job = make_job("selfcheck", "print('worker ran')", init_script="import sys; print('no GPU'); sys.exit(2)", rules=rules)
    status = run_job(backend, job)
    assert status.failed_terminally and status.shards[0].exit_reason == "selfcheck exit 2 (Error)"
    assert list(backend.logs("selfcheck", 0, LogQuery(container="selfcheck"))) == ["no GPU"]
    assert list(backend.logs("selfcheck", 0)) == []  # the worker never ran


def test_non_indexed_job_retries_up_to_its_backoff_limit(backend):
    job = make_job("single", "import sys; sys.exit(3)", indexed=False, backoffLimit=1)
    status = run_job(backend, job)
    assert status.failed_terminally and status.failure_message.startswith("BackoffLimitExceeded")
    assert status.failed == 2 and status.shards[0].attempts == 2


def test_success_policy_completes_on_rank_zero_and_reaps_the_rest(backend):
    script = "import os, time; time.sleep(0 if os.environ['JOB_COMPLETION_INDEX'] == '0' else 30)"
    job = make_job("train", script, completions=2, backoff_per_index=None, successPolicy={"rules": [{"succeededIndexes": "0"}]})
    started = time.monotonic()
    status = run_job(backend, job)
    assert status.complete and "SuccessCriteriaMet" in status.conditions
    assert time.monotonic() - started < 15


def test_submit_attaches_to_the_same_spec_and_refuses_another(backend, tmp_path):
    counter = tmp_path / "runs"
    script = f"open({str(counter)!r}, 'a').write('x')"
    assert run_job(backend, make_job("once", script)).complete
    assert backend.submit([make_job("once", script)]) == {"once": "attached"}  # the Job exists and is complete, nothing runs again
    assert backend.wait("once", timeout=WAIT_S).complete and counter.read_text() == "x"
    with pytest.raises(Conflict, match="--force"):
        backend.submit([make_job("once", script, spec_hash="h2")])
    assert backend.submit([make_job("once", script, spec_hash="h2")], force=True) == {"once": "replaced"}
    assert backend.wait("once", timeout=WAIT_S).complete and counter.read_text() == "xx"


def test_what_the_local_backend_cannot_map_is_refused_at_submit(backend):
    job = make_job("nocm", "pass")
    job["spec"]["template"]["spec"]["volumes"] = [{"name": "spec", "configMap": {"name": "demo-spec"}}]
    with pytest.raises(InputError, match="ConfigMap demo-spec"):
        backend.submit([job])
    assert not backend.job_status("nocm").exists
    secret_key = make_job("secretkey", "pass")
    secret_key["spec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}}
    )
    with pytest.raises(InputError, match="env TOKEN of container worker"):
        backend.submit([secret_key])


def test_wait_times_out_and_delete_kills_the_processes(backend, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    script = f"import os, time; open(os.path.join({str(pids)!r}, str(os.getpid())), 'w'); time.sleep(60)"
    backend.submit([make_job("sleepy", script, completions=2)])
    with pytest.raises(WaitTimeout):
        backend.wait("sleepy", timeout=1.0)
    running = backend.job_status("sleepy")
    assert running.active == 2 and not running.finished
    assert len(list(pids.iterdir())) == 2
    backend.delete("sleepy")
    assert not backend.job_status("sleepy").exists
    for pid in (int(p.name) for p in pids.iterdir()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RunFailed, match="does not exist"):
        backend.wait("sleepy", timeout=1.0)


def test_a_lost_supervisor_shows_as_failed_and_submit_resumes_the_job(backend, tmp_path):
    gate = tmp_path / "gate"
    script = (
        "import os, sys, time, pathlib\nif os.environ['JOB_COMPLETION_INDEX'] == '1':\n"
        f"    while not pathlib.Path({str(gate)!r}).exists(): time.sleep(0.05)\nprint('done')"
    )
    job = make_job("resumable", script, completions=2)
    backend.submit([job])
    deadline = time.monotonic() + WAIT_S
    while backend.job_status("resumable").completed_indexes != {0}:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    files = JobFiles(backend.workdir, "resumable")
    supervisor = json.loads(files.pid.read_text())["pid"]
    os.killpg(supervisor, signal.SIGKILL)  # the supervisor dies; its pod of index 1 is left running
    while not backend.job_status("resumable").finished:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    lost = backend.job_status("resumable")
    assert lost.failure_message.startswith("SupervisorLost")
    gate.touch()
    backend.submit([job])  # the same spec: attach, and resume where it stopped
    status = backend.wait("resumable", timeout=WAIT_S)
    assert status.complete and status.completed_indexes == {0, 1}
    assert status.shards[0].attempts == 1, "a finished index is not run again"


def start_stranger() -> subprocess.Popen:
    """A process this backend did not start, in a session of its own (as a pod's leader would be)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)


def start_stranger_unlike(started: str) -> subprocess.Popen:
    """A stranger whose start time is not `started`. Start times are read to a clock's grain (10 ms
    from /proc, 1 s from ps): a process started within it of a pod reads as that pod. A real reuse of
    the pid comes after the pid space wraps or a reboot changes the boot id, never within the grain."""
    while True:
        stranger = start_stranger()
        if start_time(stranger.pid) != started:
            return stranger
        stranger.kill()
        stranger.wait()
        time.sleep(0.01)


def test_a_recorded_process_is_signalled_only_while_its_pid_is_still_that_process():
    stranger = start_stranger()
    try:
        genuine = ProcessRef.of(stranger.pid)
        assert genuine.is_running() and ProcessRef.of(os.getpid()).is_running()
        reused = ProcessRef(stranger.pid, started="an earlier boot:12345")  # the pid as a state file recorded it
        assert not reused.is_running()
        kill_groups([reused])
        assert stranger.poll() is None, "a pid that now belongs to another process was signalled"
        kill_groups([genuine])
        assert stranger.wait(5) == -signal.SIGTERM
        assert not genuine.is_running() and start_time(stranger.pid) is None
    finally:
        stranger.kill()


def test_pids_reused_after_a_reboot_survive_resume_and_delete(backend, tmp_path):
    """The state file of a Job whose supervisor and pods died with the machine names pids that now
    belong to other processes: resuming the Job and deleting it must leave those alone."""
    gate = tmp_path / "gate"
    script = f"import pathlib, time\nwhile not pathlib.Path({str(gate)!r}).exists(): time.sleep(0.05)"
    job = make_job("rebooted", script, completions=2)
    backend.submit([job])
    files = JobFiles(backend.workdir, "rebooted")
    deadline = time.monotonic() + WAIT_S
    while backend.job_status("rebooted").active != 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # "The reboot": the supervisor and its pods are gone, and two strangers hold the pods' pids.
    os.killpg(json.loads(files.pid.read_text())["pid"], signal.SIGKILL)
    state = json.loads(files.state.read_text())
    for shard in state["shards"]:
        assert ProcessRef(shard["pid"], shard["pid_started"]).is_running()  # the state names the pods exactly
        os.killpg(shard["pid"], signal.SIGKILL)
    strangers = [start_stranger_unlike(shard["pid_started"]) for shard in state["shards"]]
    try:
        for shard, stranger in zip(state["shards"], strangers):
            shard["pid"] = stranger.pid  # what the kernel could hand out again; the start time stays the pod's
        files.state.write_text(json.dumps(state))
        while not backend.job_status("rebooted").finished:  # SupervisorLost
            assert time.monotonic() < deadline
            time.sleep(0.05)

        backend.submit([job])  # resumes: the new supervisor adopts the orphans it finds in the state
        gate.touch()
        assert backend.wait("rebooted", timeout=WAIT_S).complete
        assert all(stranger.poll() is None for stranger in strangers), "resume signalled a stranger"

        files.state.write_text(json.dumps(state))  # the state again as the dead supervisor left it
        backend.delete("rebooted")
        assert not backend.job_status("rebooted").exists
        assert all(stranger.poll() is None for stranger in strangers), "delete signalled a stranger"
    finally:
        for stranger in strangers:
            stranger.kill()


def test_logs_follow_streams_every_shard_until_the_job_ends(backend):
    script = "import os, time\nfor step in range(3):\n    print('step', step, flush=True); time.sleep(0.2)"
    backend.submit([make_job("chatty", script, completions=2)])
    lines = list(backend.logs("chatty", None, LogQuery(follow=True)))
    for shard in (0, 1):
        assert [line for line in lines if line.startswith(f"[shard {shard}] step")] == [
            f"[shard {shard}] step {step}" for step in range(3)
        ]
    assert backend.job_status("chatty").complete


def test_events_and_annotations_are_recorded(backend):
    assert run_job(backend, make_job("noted", "pass")).complete
    backend.annotate("noted", "dflash.dev/progress", "3/3")
    backend.record_event("noted", "ChunksVerified", "3 chunks", warning=False)
    assert backend.annotations("noted")["dflash.dev/progress"] == "3/3"
    assert backend.annotations("noted")[SPEC_HASH] == "h1"
    (event,) = backend.events("noted")
    assert event["reason"] == "ChunksVerified" and event["type"] == "Normal"


def test_rendered_extract_job_carries_the_policy_the_backend_honours(tmp_path):
    """Pins the contract with render.py: the rules the local tests exercise are the rendered ones."""
    job = render_extract_job(make_spec(tmp_path))
    rules = job["spec"]["podFailurePolicy"]["rules"]
    actions = {rule["action"]: rule.get("onExitCodes", {}).get("values") for rule in rules}
    assert actions["FailIndex"] == [42] and actions["FailJob"] == [2]
    assert job["spec"]["backoffLimitPerIndex"] == 2


def test_the_kernel_cache_claim_is_one_directory_every_local_pod_shares(tmp_path, monkeypatch):
    """Compiled kernels land where the next pod finds them, as the claim is one volume per node."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    spec = make_spec(tmp_path)
    spec = parse_spec({**spec.to_dict(), "cluster": {**spec.to_dict()["cluster"], "kernel_cache": "kernels"}})
    configmap, job = render_selection(spec, "extract")
    probe = "import os; print(os.environ['TRITON_CACHE_DIR'])"
    for container in (*job["spec"]["template"]["spec"]["initContainers"], *job["spec"]["template"]["spec"]["containers"]):
        container["command"] = ["python", "-c", probe]
    backend = LocalBackend(spec)
    backend.submit([configmap, job])
    status = backend.wait("demo-extract", timeout=WAIT_S)
    assert status.complete
    seen = {line.strip() for index in range(3) for line in backend.logs("demo-extract", index)
            if line.strip() and not line.startswith("==> container")}
    assert seen == {str(tmp_path / "work" / "volumes" / "kernels" / "triton")}


def test_runs_are_found_by_their_labels_and_one_is_removed_without_touching_another(tmp_path, monkeypatch):
    """Two runs in one workdir, as `dflashctl list`, `status NAME`, `cancel` and `delete` see them."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    specs = [dataclasses.replace(make_spec(tmp_path), name=name, output=str(tmp_path / name)) for name in ("first", "second")]
    backend = LocalBackend(specs[0])
    for spec in specs:
        configmap, job = render_selection(spec, "extract")
        for container in (*job["spec"]["template"]["spec"]["initContainers"], *job["spec"]["template"]["spec"]["containers"]):
            container["command"] = ["python", "-c", "import time; time.sleep(60)"]
        backend.submit([configmap, job])
    deadline = time.monotonic() + WAIT_S
    while any(backend.job_status(f"{spec.name}-extract").active < 3 for spec in specs) and time.monotonic() < deadline:
        time.sleep(0.1)
    listings = list_runs(backend)
    assert [(listing.name, [obj.ref for obj in listing.objects], listing.spec) for listing in listings] == [
        ("first", ["job.batch/first-extract", "configmap/first-spec"], specs[0]),
        ("second", ["job.batch/second-extract", "configmap/second-spec"], specs[1]),
    ]
    assert spec_of_run(backend, "second", "here") == specs[1]  # from its ConfigMap: `status second` needs no file

    said = []
    assert [obj.ref for obj in remove_run(backend, "first", dry_run=True, say=said.append)] == ["job.batch/first-extract", "configmap/first-spec"]
    assert said == ["job.batch/first-extract deleted (dry run)", "configmap/first-spec deleted (dry run)"]
    assert [listing.name for listing in list_runs(backend)] == ["first", "second"]
    remove_run(backend, "first", dry_run=False, say=said.append)
    assert [listing.name for listing in list_runs(backend)] == ["second"]
    assert not (backend.workdir / "configmaps" / "first-spec").exists() and (backend.workdir / "configmaps" / "second-spec").is_dir()
    second = backend.job_status("second-extract")
    assert second.active == 3 and not second.finished  # still running
    with pytest.raises(InputError, match="no run 'first' in here.*Runs there: second"):
        spec_of_run(backend, "first", "here")
    remove_run(backend, "second", dry_run=False, say=said.append)
    assert list_runs(backend) == []


# ---- nothing of a local run outlives it (issue 43, item 2) -------------------------------------

FAMILY_SCRIPT = """import os, pathlib, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # in the pod's process group
pathlib.Path({pids!r}, os.environ.get("JOB_COMPLETION_INDEX", "0")).write_text(f"{{os.getpid()}} {{child.pid}}")
time.sleep(120)
"""
"""A pod's worker that starts a process of its own, then records both pids (outside the workdir)."""


def running(pid: int) -> bool:
    """Whether `pid` still runs: an ended process not yet reaped (a zombie) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def live_family(backend: LocalBackend, job: str, pids: Path, pods: int) -> list[ProcessRef]:
    """The Job's supervisor, its pods' workers and their children, once all `pods` have started."""
    deadline = time.monotonic() + WAIT_S
    while len(recorded := [path.read_text().split() for path in pids.iterdir()]) < pods or any(len(pair) < 2 for pair in recorded):
        assert time.monotonic() < deadline, f"the pods of {job} did not start"
        time.sleep(0.05)
    supervisor = json.loads(JobFiles(backend.workdir, job).pid.read_text())["pid"]
    family = [ProcessRef.of(pid) for pid in [supervisor, *(int(pid) for pair in recorded for pid in pair)]]
    assert all(process.is_running() for process in family)
    return family


def remove_tree(path: Path) -> None:
    """`rm -rf path`, again while it fails: the live Job inside may write a file meanwhile."""
    deadline = time.monotonic() + WAIT_S
    while path.exists():
        assert time.monotonic() < deadline, f"{path} could not be removed"
        shutil.rmtree(path, ignore_errors=True)


def end_within(family: list[ProcessRef], seconds: float) -> list[ProcessRef]:
    """Waits up to `seconds` for every process of `family` to end; returns those still running, and
    kills them (a test leaves no process behind, whatever it found)."""
    deadline = time.monotonic() + seconds
    while (left := [p for p in family if p.is_running() and running(p.pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for process in left:
        os.kill(process.pid, signal.SIGKILL)
    return left


@pytest.mark.parametrize("gone", ["workdir", "job directory"])
def test_a_job_whose_directory_is_deleted_ends_its_pods_and_its_supervisor(backend, tmp_path, gone):
    """The workdir (or the Job's own directory) deleted under a live Job: its supervisor ends its
    workers, their children and itself within seconds, and says why in its log while that is open."""
    pids = tmp_path / "pids"
    pids.mkdir()
    backend.submit([make_job("orphaned", FAMILY_SCRIPT.format(pids=str(pids)), completions=2)])
    family = live_family(backend, "orphaned", pids, pods=2)
    files = JobFiles(backend.workdir, "orphaned")
    with open(files.supervisor_log) as log:  # read once the file is deleted, as a `tail -f` would
        remove_tree(backend.workdir if gone == "workdir" else files.dir)
        assert end_within(family, 10.0) == []
        said = log.read()
    assert f"the directory of Job orphaned ({files.dir}) is gone or holds another Job now: ending its 2 running pod(s) and this supervisor" in said


def test_a_job_replaced_under_its_supervisor_is_left_to_the_new_one(backend, tmp_path):
    """The issue's case: the workdir deleted and a run of the same name started again before the old
    supervisor looked (held here with SIGSTOP): the old one ends its own processes at its next look,
    and writes nothing into the new Job's directory."""
    pids = tmp_path / "pids"
    pids.mkdir()
    backend.submit([make_job("again", FAMILY_SCRIPT.format(pids=str(pids)))])
    family = live_family(backend, "again", pids, pods=1)
    os.kill(family[0].pid, signal.SIGSTOP)
    try:
        remove_tree(backend.workdir)
        new = run_job(backend, make_job("again", "print('the new run')", spec_hash="h2"))
        assert new.complete
    finally:
        os.kill(family[0].pid, signal.SIGCONT)
    assert end_within(family, 10.0) == []
    after = backend.job_status("again")
    assert after.complete and after.shards[0].attempts == 1 and after.shards[0].phase == "Succeeded"
    assert list(backend.logs("again", 0)) == ["the new run"]


@pytest.mark.parametrize("command", [["cancel"], ["delete", "demo"]])
def test_cancel_and_delete_end_every_process_of_a_local_run(tmp_path, monkeypatch, capsys, command):
    """`dflashctl cancel` and `dflashctl delete NAME` on the local backend end the run's supervisors,
    their workers and the workers' children, as on a cluster deleting the Jobs ends their pods."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    spec = make_spec(tmp_path)
    spec_file = tmp_path / "dflash.yaml"
    spec_file.write_text(dump_spec(spec))
    pids = tmp_path / "pids"
    pids.mkdir()
    configmap, job = render_selection(spec, "extract")
    for container in job["spec"]["template"]["spec"]["initContainers"]:
        container["command"] = ["python", "-c", "pass"]
    job["spec"]["template"]["spec"]["containers"][0]["command"] = ["python", "-c", FAMILY_SCRIPT.format(pids=str(pids))]
    backend = LocalBackend(spec)
    backend.submit([configmap, job])
    family = live_family(backend, "demo-extract", pids, pods=3)
    code, _, err = cli(monkeypatch, capsys, *command, "-f", str(spec_file))
    assert code == 0 and "job.batch/demo-extract deleted" in err, err
    assert end_within(family, 10.0) == []
    assert list_runs(backend) == []
