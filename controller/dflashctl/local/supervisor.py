"""The supervisor of one local Job: the Kubernetes Job controller's rules for one Job, as a detached
process (`python -m dflashctl.local.supervisor <job dir> <lock fd>`) started by the backend.

It starts pods up to the Job's parallelism, applies `podFailurePolicy`, the backoff limits and
`successPolicy` to each pod's end, sets the Job's conditions, and writes the state after every change.

The Job is the supervisor's only while its directory holds the lock file it locked: once that file
is gone (the workdir was deleted) or is another (a new Job of the same name took the path), it ends
its pods and itself at the next poll, writing nothing there, as a node's kubelet ends the pods of a
Job deleted from the API server. Whatever else ends it (SIGTERM from `delete`, a crash) ends its pods too.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from dflashctl.local.pod import Pod, exit_reason, kill_pods
from dflashctl.local.processes import kill_groups
from dflashctl.local.state import POLL_S, IndexState, JobFiles, JobRecord, JobState, holds, record_supervisor, write_json


class Supervisor:
    """Runs one Job's pods to the Job's end, writing its state after every change."""

    def __init__(self, files: JobFiles, lock_fd: int) -> None:
        self.files = files
        self.lock_fd = lock_fd
        """The Job's lock, held: while files.lock is this very file, the Job is this supervisor's."""
        record = JobRecord.load(files)
        assert record is not None, f"{files.job} is written before its supervisor starts"
        self.record = record
        self.policy = record.policy()
        saved = JobState.load(files)
        if saved is None:
            self.state = JobState([IndexState(i) for i in range(self.policy.completions)])
        else:
            self.state = saved
            self._adopt_orphans()
        self.pods: dict[int, Pod] = {}
        self.stopping = False
        self.disowned = False
        """The Job's directory is gone or another Job's: nothing more is written there."""

    def _adopt_orphans(self) -> None:
        """A previous supervisor died: end the pods it left, and run those indexes again.

        Like a pod lost with its node, the interrupted attempt does not count against the retries.
        A pod whose pid now belongs to another process (the machine rebooted) is not signalled."""
        interrupted = [shard for shard in self.state.shards if shard.phase in ("Pending", "Running")]
        kill_groups([shard.process for shard in interrupted if shard.process is not None])
        for shard in interrupted:
            shard.phase, shard.process = "Missing", None

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._stop)
        if self.state.started_at is None:
            self.state.started_at = time.time()
        self._save()
        try:
            self._loop()
        finally:  # whatever ended the loop (a crash too), no pod outlives its supervisor
            kill_pods(list(self.pods.values()))
        for pod in list(self.pods.values()):
            self._settle(pod, counted=False)
        self._save()

    def _loop(self) -> None:
        while not self.state.finished and not self.stopping:
            if self._disowned():
                return
            changed = self._reap()
            changed |= self._decide()
            if not self.state.finished:
                changed |= self._launch()
            if changed:
                self._save()
            time.sleep(POLL_S)

    def _stop(self, signum: int, frame: Any) -> None:
        self.stopping = True

    def _launch(self) -> bool:
        started = False
        for shard in self.state.shards:
            if len(self.pods) >= self.policy.parallelism:
                break
            if shard.phase != "Missing":
                continue
            pod = Pod(self.files, self.record, shard.index, shard.attempts, indexed=self.policy.indexed,
                      threads=max(1, (self.record.cores or os.cpu_count() or 1) // self.policy.parallelism))
            shard.attempts += 1
            shard.pod, shard.phase = pod.name, "Pending"
            self.pods[shard.index] = pod
            pod.start()
            shard.process = pod.running_process
            started = True
        return started

    def _reap(self) -> bool:
        changed = False
        for index, pod in list(self.pods.items()):
            if self.state.finished:
                break  # a FailJob or success policy ended the Job, and its other pods with it
            shard = self.state.shards[index]
            ended = pod.poll()
            phase = "Pending" if pod.in_init and not ended else "Running"
            if not ended and (phase != shard.phase or pod.running_process != shard.process):
                shard.phase, shard.process = phase, pod.running_process
                changed = True
            if ended:
                self._settle(pod, counted=True)
                changed = True
        return changed

    def _settle(self, pod: Pod, *, counted: bool) -> None:
        """Applies a finished pod's outcome to its index (and perhaps to the Job)."""
        del self.pods[pod.index]
        shard = self.state.shards[pod.index]
        shard.process = None
        container, exit_code = pod.result or ("", 0)
        if exit_code == 0:
            shard.phase, shard.exit_reason = "Succeeded", None
            return
        shard.exit_reason = exit_reason(container, exit_code)
        if not counted:  # ended by the supervisor itself: the Job was deleted
            shard.phase = "Failed"
            return
        action, rule = self.policy.failure_action(container, exit_code)
        if action == "Ignore":
            shard.phase = "Missing"
            return
        self.state.failed_pods += 1
        shard.failures += 1
        shard.phase = "Failed"
        if action == "FailJob":
            self._fail(
                "PodFailurePolicy",
                f"Container {container} for pod {pod.name} failed with exit code {exit_code} matching FailJob rule at index {rule}",
            )
        elif action == "FailIndex":
            pass
        elif self.policy.backoff_limit_per_index is not None:
            if shard.failures <= self.policy.backoff_limit_per_index:
                shard.phase = "Missing"
        elif self.state.failed_pods <= self.policy.backoff_limit:
            shard.phase = "Missing"
        else:
            self._fail("BackoffLimitExceeded", "Job has reached the specified backoff limit")

    def _decide(self) -> bool:
        """The Job's terminal condition, once there is one."""
        if self.state.finished:
            return False
        succeeded = {s.index for s in self.state.shards if s.phase == "Succeeded"}
        failed = {s.index for s in self.state.shards if s.phase == "Failed"}
        if self.policy.success_rules and self.policy.success_met(succeeded):
            self.state.conditions["SuccessCriteriaMet"] = "SuccessPolicy: Matched rules at index 0"
            self._end("Complete", "SuccessPolicy: Matched rules at index 0")
        elif self.policy.max_failed_indexes is not None and len(failed) > self.policy.max_failed_indexes:
            self._fail("MaxFailedIndexesExceeded", "Job has exceeded the specified maximal number of failed indexes")
        elif len(succeeded) + len(failed) == self.policy.completions:
            if failed:
                self._fail("FailedIndexes", "Job has failed indexes")
            else:
                self._end("Complete", "CompletionsReached: Reached expected number of succeeded pods")
        return self.state.finished

    def _fail(self, reason: str, message: str) -> None:
        self._end("Failed", f"{reason}: {message}")

    def _end(self, condition: str, text: str) -> None:
        """Terminal: the pods still running are ended, and their indexes count as failed."""
        self.state.conditions[condition] = text
        kill_pods(list(self.pods.values()))
        for pod in list(self.pods.values()):
            del self.pods[pod.index]
            shard = self.state.shards[pod.index]
            shard.process = None
            shard.phase = "Failed"
            shard.exit_reason = "terminated (the Job ended)"

    def _disowned(self) -> bool:
        """Whether the Job's directory is gone or another Job's (said once, in this supervisor's log if it still can)."""
        if not self.disowned and not holds(self.lock_fd, self.files.lock):
            self.disowned = True
            print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} the directory of Job {self.files.name} ({self.files.dir}) is gone or holds "
                  f"another Job now: ending its {len(self.pods)} running pod(s) and this supervisor", file=sys.stderr, flush=True)
        return self.disowned

    def _save(self) -> None:
        if not self._disowned():  # never into a new Job's directory of the same name
            write_json(self.files.state, self.state.to_json())


def supervise(job_dir: Path, lock_fd: int) -> None:
    """The detached supervisor's main: runs the Job, holding the lock (inherited as `lock_fd`)."""
    files = JobFiles(job_dir.parent.parent, job_dir.name)
    record_supervisor(files, os.getpid())
    try:
        Supervisor(files, lock_fd).run()
    finally:
        os.close(lock_fd)



if __name__ == "__main__":
    supervise(Path(sys.argv[1]), int(sys.argv[2]))
