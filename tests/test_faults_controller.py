"""The controller (`dflashctl run`, a real process) against the fake Kubernetes API while the
cluster misbehaves: watches dropped mid-stream, history compacted (410 Gone), bursts of API 500s,
and the controller itself SIGKILLed in the middle of the extraction and started again. The second
controller must attach to the running Job (not create another), and the run must end exactly as an
undisturbed one: every chunk verified, training started once from the manifest, the report there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import yaml
from extracted_chunks import CHUNKS, LAYERS, hidden_chunk, mark_done, write_dataset
from k8s_fake_api import fake_k8s, make_pvc  # noqa: F401 - the fixture

from dflash_jobs.formats import DRAFTER_CONFIG_KEY, EVAL_REPORT_KEY, MANIFEST_KEY
from dflash_jobs.storage import open_storage

SHARDS = 2
DEADLINE_S = 90
# The fixture shortens the client's waits in this process; the controller processes get the same.
CONTROLLER = (
    "import sys; from dflashctl.cluster import Cluster; "
    "Cluster.retry_delays = (0.05, 0.1, 0.2, 0.4); Cluster.poll_interval = 0.05; Cluster.watch_window = 2; "
    "from dflashctl.cli.main import main; main()"
)


def start_controller(spec, env, log):
    return subprocess.Popen([sys.executable, "-c", CONTROLLER, "run", "-f", str(spec)], env=env,
                            stdout=log, stderr=subprocess.STDOUT)


def wait_for(condition, what: str, timeout: float = DEADLINE_S):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def faults_left(api) -> int:
    with api.lock:
        return sum(fault.count for fault in api.faults)


def test_the_controller_survives_dropped_watches_500s_and_its_own_restart(fake_k8s, tmp_path):  # noqa: F811
    api = fake_k8s.api
    output = tmp_path / "out"
    storage = open_storage(str(output))
    spec = tmp_path / "dflash.yaml"
    # What the controller's preflight looks at: the output's claim, a readable source on it.
    api.add(make_pvc("runs"))
    (tmp_path / "chats.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    spec.write_text(yaml.safe_dump({
        "name": "chaos", "target": {"model": str(tmp_path / "model"), "layers": LAYERS},  # on the output's claim, as the pods see it
        "data": {"source": str(tmp_path / "chats.jsonl"), "max_length": 64, "chunk_tokens": 1024},
        "output": str(output), "extract": {"shards": SHARDS, "backoff_limit_per_index": 1},
        "cluster": {"output_volume": {"claim": "runs", "mount": str(tmp_path)}},
    }))
    env = {**os.environ, "KUBECONFIG": os.environ["KUBECONFIG"], "PYTHONUNBUFFERED": "1"}
    logs = open(tmp_path / "controllers.log", "w")

    # The first controller: it prepares and submits the extraction, then dies (SIGKILL) mid-run.
    first = start_controller(spec, env, logs)
    wait_for(lambda: api.get("Job", "chaos-prepare"), "the prepare Job")
    api.start("chaos-prepare")
    write_dataset(storage, chunks=CHUNKS)
    api.drop_watches()  # the controller's watch is cut while the Job finishes
    api.finish("chaos-prepare", 0)
    extract = wait_for(lambda: api.get("Job", "chaos-extract"), "the extract Job")
    uid = extract["metadata"]["uid"]
    api.start("chaos-extract")
    mark_done(storage, 0, hidden_chunk(0))
    api.fail_requests(3, status=500)  # a burst of API errors while it watches
    api.drop_watches()
    wait_for(lambda: not faults_left(api), "the first controller to meet the 500s")
    first.send_signal(signal.SIGKILL)
    assert first.wait(10) == -signal.SIGKILL

    # Meanwhile the cluster goes on: shard 0 finishes.
    mark_done(storage, 2, hidden_chunk(2))
    api.finish("chaos-extract", 0)

    # The second controller attaches to the same Job and finishes the run through more faults.
    # (Its own requests are those after the first one's: it starts with its preflight checks.)
    looked, watched = len(api.requests_matching("GET", "chaos-extract")), len(api.requests_matching("GET", "watch=true"))
    second = start_controller(spec, env, logs)

    def cluster():
        wait_for(lambda: len(api.requests_matching("GET", "chaos-extract")) > looked, "the second controller to look")
        api.fail_requests(2, status=503)
        wait_for(lambda: len(api.requests_matching("GET", "watch=true")) > watched, "the second controller to watch")
        api.compact()  # its watch resumes from a compacted version: 410 Gone, then a relist
        api.drop_watches()
        for chunk in (1, 3):
            mark_done(storage, chunk, hidden_chunk(chunk))
        api.finish("chaos-extract", 1)
        for step, key, payload in (("train", DRAFTER_CONFIG_KEY, {"dflash_config": {}}),
                                   ("eval", EVAL_REPORT_KEY, {"drafters": {"dflash": {"acceptance_length": 3.0, "speedup": 2.0}}, "lossless": True})):
            wait_for(lambda: api.get("Job", f"chaos-{step}"), f"the {step} Job")
            api.start(f"chaos-{step}")
            api.drop_watches()
            storage.put_bytes(key, json.dumps(payload).encode())
            api.finish(f"chaos-{step}", 0)

    player = threading.Thread(target=cluster, daemon=True)
    player.start()
    try:
        code = second.wait(DEADLINE_S)
    finally:
        logs.close()
    log = (tmp_path / "controllers.log").read_text()
    assert code == 0, log
    player.join(5)

    assert api.get("Job", "chaos-extract")["metadata"]["uid"] == uid  # attached, never replaced
    assert sorted(job["metadata"]["name"] for job in api.all("Job")) == ["chaos-eval", "chaos-extract", "chaos-prepare", "chaos-train"]
    manifest = json.loads(storage.get_bytes(MANIFEST_KEY))
    assert [c["chunk"] for c in manifest["chunks"]] == list(range(CHUNKS))
    assert storage.exists(EVAL_REPORT_KEY)
    assert api.sent_gone >= 1  # the restarted controller really met a compacted history
