"""The local backend: the rendered Jobs of a run, run as local processes (DESIGN section 8).

It takes the very objects `dflashctl render` prints and plays the Kubernetes Job controller on one
machine, so a local run exercises the manifests themselves:

- every index of a Job is a "pod": its initContainers, then its containers, one after the other, each
  a subprocess with the manifest's command and env, `JOB_COMPLETION_INDEX` and the downward-API
  completion index, in a process group of its own;
- `parallelism` (at most `local.parallelism`), `backoffLimit` / `backoffLimitPerIndex`,
  `maxFailedIndexes`, `podFailurePolicy` exit-code rules and `successPolicy` are honoured, with the
  Job conditions and reasons the real controller sets;
- volumes become local directories: a ConfigMap its data written under the workdir, an emptyDir a
  fresh directory per pod, the model PersistentVolumeClaim the directory holding `target.model`;
  mount paths in commands and env values are rewritten to them;
- an `envFrom` Secret reference passes this environment's S3 variables (never written to disk);
  containers without one get no credentials, as in a pod;
- one log file per pod attempt: <workdir>/logs/<job>/<index>-<attempt>.log.
- the machine's cores are shared among the Job's parallel pods as a node's are among its pods:
  each gets OMP_NUM_THREADS = cores / parallelism unless the environment sets it; `local.cores`
  fixes the cores, and then the threads whatever the environment says.

Each Job is run by a detached supervisor process (`python -m dflashctl.local.supervisor <job dir>`)
that writes the Job's state as JSON under the workdir. `submit` returns at once; `wait`, `status`
and `logs`, from this process or another, read that state. The supervisor holds an flock on the
job's supervisor.lock for its whole life: a free lock means no supervisor, and `submit` of the same
Job resumes it. Once supervisor.lock is no longer the file it locked (the workdir deleted, a new Job
of the name in its place), the supervisor ends the Job's pods and itself; `delete` ends both too.

The modules, by responsibility:

- state.py: where a Job's files live under the workdir, the Job as submitted and its rules, and the
  state the supervisor writes (read by every process);
- processes.py: the process groups of pods and supervisors, and whether a recorded pid still is the
  process that was started;
- pod.py: one attempt at one index, its containers run one after the other;
- supervisor.py: the Job controller of one Job, a detached process;
- backend.py: the Backend interface (submit, status, wait, logs, delete, events) over the above.
"""
