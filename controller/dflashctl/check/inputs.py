"""The run's inputs and outputs in the preflight: placeholders left in the spec, the output (reachable,
and free or holding this same run), the order of the steps, data.source (readable, its first rows
parse), the target checkpoint (its config read here, or through a probe pod on the model volume),
and the image. Storage answers through the real S3 client, its failures told apart by their type
(no credentials, unreachable endpoint, access denied, missing bucket, missing object)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from dflash_jobs.architectures import MODEL_TYPES, architecture_name, model_type, supported
from dflash_jobs.errors import InputError, SpecError, StorageError
from dflash_jobs.formats import DATASET_KEY, DRAFTER_CONFIG_KEY, MANIFEST_KEY, RUN_KEY, Manifest, check_final_hidden
from dflash_jobs.generation import current_manifest
from dflash_jobs.rows import CHAT_TEMPLATE_FILES, CHAT_TEMPLATE_FIX, chat_template_text
from dflash_jobs.spec import ClusterSpec, RunSpec, is_s3, local_path, resolve_layers, rope_kind, text_config, under
from dflash_jobs.stage_model import describe_checkpoint
from dflash_jobs.storage import Storage, read_head

from dflashctl.check import STORAGE_ATTEMPTS, CheckResult, Preflight, fail, from_error, ok, skipped, warn
from dflashctl.identity import identity_conflict, output_elsewhere
from dflashctl.kube import exit_reason
from dflashctl.placement import patch_warnings
from dflashctl.plan_states import online_fit
from dflashctl.render import WORKER
from dflashctl.starter import STARTER_VALUES
from dflashctl.tool_pods import model_directory, probe_pod_name, render_probe_pod

SOURCE_HEAD_BYTES = 1 << 20
"""Of data.source read to parse its first rows."""
ROWS_CHECKED = 3
CHAT_ROWS = "chat conversations"
PULL_FAILURES = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
PLACEHOLDER_BUCKETS = {url[len("s3://"):].split("/", 1)[0] for url in (STARTER_VALUES["output"], STARTER_VALUES["data"]["source"]) if is_s3(url)}
"""The bucket `dflashctl init` writes for the user to replace."""
PROBE_LINES_SHOWN = 5
"""Of a probe pod's log, the lines a failed target check quotes."""
PROBE_LINE_CHARS = 200
STAGE_FIX = "Stage it: `dflashctl stage-model --from hf://Qwen/Qwen3.6-27B` (or --from s3://...)"
STEP_INPUTS = {"extract": DATASET_KEY, "train": MANIFEST_KEY, "eval": DRAFTER_CONFIG_KEY}
"""What a step's Job reads from the output and an earlier step writes (online training reads prepare's: step_input)."""
STEP_BEFORE = {DATASET_KEY: "prepare (`dflashctl run`, or `dflashctl prepare` here)", MANIFEST_KEY: "extraction, then `dflashctl verify`",
               DRAFTER_CONFIG_KEY: "training (`dflashctl submit train`)"}


def placeholders(pf: Preflight) -> CheckResult:
    """The starter's bucket (a failure: nothing can be read or written there) and the project's default
    image names, which nothing publishes (a warning: a mirror may hold them; the probe pod pulls cluster.image)."""
    spec, defaults = pf.spec, ClusterSpec()
    buckets = [f"{name} {url}" for name, url in (("output", spec.output), ("data.source", spec.data.source), ("target.model", spec.target.model))
               if is_s3(url) and url[len("s3://"):].split("/", 1)[0] in PLACEHOLDER_BUCKETS]
    images = [f"cluster.{name} {value}" for name, value, default in (("image", spec.cluster.image, defaults.image),
                                                                    ("controller_image", spec.cluster.controller_image, defaults.controller_image))
              if spec.backend == "kubernetes" and value == default and (name == "image" or pf.whole_run)]
    found = [(f"the starter's placeholder bucket is still there: {', '.join(buckets)}", "Set them to your bucket")] if buckets else []
    found += [(f"the project's default image names, which nothing publishes: {', '.join(images)}",
               "Build and push your images (images/README.md), then set them")] if images else []
    if not found:
        return ok("placeholders", "none of the starter's placeholder values is left")
    detail, fix = "; ".join(what for what, _ in found), "; ".join(fix for _, fix in found)
    return fail("placeholders", detail, fix) if buckets else warn("placeholders", detail, fix)


def pod_template_patch(pf: Preflight) -> CheckResult:
    if pf.spec.cluster.pod_template_patch is None:
        return skipped("pod template patch", "no cluster.pod_template_patch")
    warnings = patch_warnings(pf.spec)
    if warnings:
        return warn("pod template patch", *warnings[0].split(". ", 1))
    return ok("pod template patch", "applied to every pod, its container items each naming a container there")


def output(pf: Preflight) -> CheckResult:
    spec = pf.spec
    if pf.step == "stage-model":
        return skipped("output", "stage-model writes the model volume only")
    if (elsewhere := output_elsewhere(spec)) is not None:
        return skipped("output", f"{elsewhere}: the pods (the in-cluster controller) check it")
    storage = pf.storage(spec.output)
    try:
        conflict = identity_conflict(storage, spec)
        if conflict is not None and pf.force and conflict.force_allowed:
            return warn("output", f"{conflict.what}; --force replaces its run.yaml (what it holds is kept)")
        if conflict is not None:
            return fail("output", conflict.what, conflict.fix)
        if storage.exists(RUN_KEY):
            return ok("output", f"{storage.url} holds this run (the steps done are skipped)")
        storage.list_modified(RUN_KEY)  # a missing bucket answers a read of run.yaml as a missing object does
    except StorageError as error:
        return from_error("output", error, what="cannot use it: ")
    return ok("output", f"{storage.url}: no run there yet")


def next_step(storage: Storage, spec: RunSpec) -> str:
    """The first step whose output is not in storage: what `dflashctl run` would start."""
    if not storage.exists(DATASET_KEY):
        return "generate" if spec.generate is not None and current_manifest(storage, spec) is None else "prepare"
    if "extract" in spec.steps and not storage.exists(MANIFEST_KEY):
        return "extract"
    return "train" if not storage.exists(DRAFTER_CONFIG_KEY) else "eval"


def step_input(spec: RunSpec, step: str) -> str:
    """What `step`'s Job reads from the output: online training reads prepare's token chunks, not verified states."""
    return DATASET_KEY if step == "train" and spec.train.states == "online" else STEP_INPUTS[step]


def step_order(pf: Preflight) -> CheckResult:
    """A step's Job needs what the step before it wrote: `submit extract` before prepare is refused."""
    spec, step = pf.spec, pf.step
    if step not in (*STEP_INPUTS, "prepare", None) or (step == "prepare" and spec.generate is None) or output_elsewhere(spec):
        return skipped("step order", "nothing to wait for")
    storage = pf.storage(spec.output)
    try:
        if step is None:
            return ok("step order", f"the run starts at {next_step(storage, spec)}")
        if step == "prepare":
            if current_manifest(storage, spec) is None:
                return fail("step order", "prepare reads the regenerated answers, and generate/manifest.json of these settings does not exist",
                            "Generate them first: `dflashctl submit generate --wait` (or `dflashctl run`, which does every step in turn)")
            return ok("step order", "the answers are generated")
        needed = step_input(spec, step)
        if not storage.exists(needed):
            return fail("step order", f"{storage.url}/{needed} does not exist, and {step} reads it",
                        f"Run {STEP_BEFORE[needed]} first, or `dflashctl run`, which does every step in turn")
        if needed == MANIFEST_KEY and step == "train":  # the states are there: do they hold what this drafter reads?
            check_final_hidden(Manifest.from_json(storage.get_bytes(MANIFEST_KEY)), spec.train, f"{storage.url}/{MANIFEST_KEY}")
    except InputError as error:
        return fail("step order", error.what, error.fix)
    except StorageError as error:
        return from_error("step order", error, what="cannot read the output: ")
    return ok("step order", f"{needed} exists")


def source_needed(pf: Preflight) -> bool:
    """Whether the step about to start reads data.source (generation, or prepare before any answers exist)."""
    spec = pf.spec
    if pf.step in ("generate", "prepare"):
        return pf.step == "generate" or spec.generate is None
    if not pf.whole_run:
        return False
    if output_elsewhere(spec):
        return True
    try:
        storage = pf.storage(spec.output)
        return not storage.exists(DATASET_KEY) and (spec.generate is None or current_manifest(storage, spec) is None)
    except StorageError:
        return True  # the output check says why; the source is checked anyway


def data_source(pf: Preflight) -> CheckResult:
    spec = pf.spec
    source = spec.data.source
    if not source_needed(pf):
        return skipped("data.source", "the step about to start does not read it (prepared or generated already)")
    path = local_path(source)
    if path is not None and spec.backend == "kubernetes":
        mounts = [volume.mount for volume in (spec.cluster.output_volume, spec.cluster.model_volume) if volume is not None]
        if not any(under(path, mount) for mount in mounts):
            return fail("data.source", f"{source} is a path on this machine, which the pods that read it cannot see",
                        f"Upload it (e.g. to s3://<bucket>/chats.jsonl) and set data.source, or tokenize here first: `dflashctl prepare` (it writes {DATASET_KEY})")
        if not Path(path).exists() and not any(Path(mount).is_dir() for mount in mounts):
            return skipped("data.source", f"{source} lies on a claim not mounted here: the pods read it")
    try:
        size, head = read_head(source, SOURCE_HEAD_BYTES, endpoint_url=spec.storage.endpoint_url, region=spec.storage.region,
                               max_attempts=STORAGE_ATTEMPTS)
    except StorageError as error:
        return from_error("data.source", error, what="cannot read it: ")
    problem, rows = first_rows_problem(head, whole=len(head) >= size)
    pf.chat_rows = CHAT_ROWS in rows
    if problem is not None:
        return fail("data.source", f"{source}: {problem}", 'Each line must be a JSON object: {"messages": [{"role": ..., "content": ...}, ...]} '
                    'or {"input_ids": [...], "loss_mask": [...]}')
    return ok("data.source", f"{source}: {size:,} bytes; the first {len(rows)} row(s) are {' and '.join(sorted(set(rows)))}")


def first_rows_problem(head: bytes, *, whole: bool) -> tuple[str | None, list[str]]:
    """What is wrong with the first complete rows of a JSONL head, or None; and each row's kind."""
    lines = head.split(b"\n")
    if not whole:
        lines = lines[:-1]  # the last one may be cut
    kinds = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            return f"line {number} is not JSON ({exc})", kinds
        if isinstance(row, dict) and isinstance(row.get("messages"), list) and all(isinstance(m, dict) and "role" in m for m in row["messages"]):
            kinds.append(CHAT_ROWS)
        elif isinstance(row, dict) and isinstance(row.get("input_ids"), list) and isinstance(row.get("loss_mask"), list):
            kinds.append("pre-tokenized")
        else:
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            return f"line {number} is neither a chat row (messages with roles) nor a pre-tokenized one (input_ids, loss_mask): it has {keys}", kinds
        if len(kinds) == ROWS_CHECKED:
            break
    if not kinds:
        return "no complete row in its first MiB", kinds
    return None, kinds


# ---- the target ------------------------------------------------------------------------------


def target(pf: Preflight) -> CheckResult:
    spec = pf.spec
    model = spec.target.model
    volume = spec.cluster.model_volume
    if pf.step == "stage-model":
        return skipped("target", "about to be staged")
    try:
        if is_s3(model):
            description = _describe_s3(pf, model)
            where = ""
        elif Path(local_path(model)).is_dir() or spec.backend == "local":
            description, where = describe_checkpoint(local_path(model)), ""
        elif volume is not None and under(local_path(model), volume.mount):
            if not pf.probe:
                return skipped("target", f"{model} lies on claim {volume.claim}: `dflashctl check` reads it through a pod")
            if pf.cluster is None or pf.cluster_error is not None:
                return skipped("target", "not checked: see namespace")
            if volume.claim in pf.unsafe_claims:  # the probe's mount would bind it where the run's pods may not go
                return skipped("target", f"{model} lies on claim {volume.claim}: not read (see volume {volume.claim})")
            if pf.step is not None and not pf.cluster.can_i("create", "pods"):
                return warn("target", f"{model} lies on claim {volume.claim}, read through a pod, and this client may not create pods: not checked",
                            "`dflashctl check` as a user who may create pods reads it")
            description, where = _read_through_pod(pf), f" (read by pod {probe_pod_name(spec)} on claim {volume.claim})"
        else:  # on another volume the pods mount (the spec allows no other path on Kubernetes), not mounted here
            return warn("target", f"{model} is not readable here: not checked",
                        "Run `dflashctl check` where its volume is mounted at that path, or put it on cluster.model_volume (read through a pod)")
    except StorageError as error:
        return from_error("target", error, what="cannot read its config.json: ")
    return judge_target(spec, description, where, chat_rows=pf.chat_rows)


def _describe_s3(pf: Preflight, model: str) -> dict[str, Any]:
    _, config = read_head(f"{model.rstrip('/')}/config.json", 1 << 20, endpoint_url=pf.spec.storage.endpoint_url,
                          region=pf.spec.storage.region, max_attempts=STORAGE_ATTEMPTS)
    storage = pf.storage(model)
    files = storage.list("")
    weights = [key for key in files if key.endswith(".safetensors")]
    description = {"exists": True, "staged": None, "tokenizer": "tokenizer_config.json" in files,
                   "chat_template": bool(chat_template_text(lambda name: storage.get_bytes(name) if name in files else None)),
                   "safetensors": {"files": len(weights), "bytes": sum(storage.stat(key).size for key in weights)}}
    try:
        return description | {"config": json.loads(config)}
    except ValueError as exc:
        return description | {"config": None, "config_error": f"config.json is not valid JSON ({exc})"}


def judge_target(spec: RunSpec, description: dict[str, Any], where: str = "", *, chat_rows: bool = False) -> CheckResult:
    """The checkpoint against the spec: there and complete, layers in range, plain RoPE, a chat template
    where data.source holds chat rows (`chat_rows`), an architecture the suite proves."""
    model = spec.target.model
    if not description.get("exists"):
        return fail("target", f"{model} does not exist{where}", STAGE_FIX)
    staged = description.get("staged")
    if staged is not None and not staged.get("complete"):
        return fail("target", f"{model} is staged only in part ({staged['files']} file(s) from {staged['source']}){where}",
                    "Run `dflashctl stage-model` again with the same --from: it fetches what is missing")
    config = description.get("config")
    if config is None:
        return fail("target", f"{model}: {description.get('config_error', 'no config.json')}{where}", STAGE_FIX)
    if not description["safetensors"]["files"]:
        return fail("target", f"{model} has a config.json but no *.safetensors{where}", STAGE_FIX)
    try:
        layers = resolve_layers(spec, config)
    except SpecError as error:
        return fail("target", f"{error.field} = {error.value} does not fit the checkpoint: expected {error.allowed}{where}",
                    f"Set {error.field} within it (null: the default for its depth)")
    if rope_kind(config) != "default":
        return fail("target", f"{model} scales its RoPE ({rope_kind(config)!r}){where}, which the DFlash drafter does not implement",
                    "Use a target with plain RoPE (training would run and its export refuse it)")
    text = text_config(config)
    origin = f"; staged from {staged['source']} at {(staged.get('commit') or '')[:12] or 'its listing'}" if staged else ""
    detail = f"{model}: {model_type(config)}, {text['num_hidden_layers']} layers, hidden {text.get('hidden_size', '?')}, capturing {layers}{origin}{where}"
    if chat_rows and description.get("chat_template") is False:  # None: a probe of an image that predates the key
        return fail("target", f"{detail}; its tokenizer has no chat template (none in tokenizer_config.json, {' or '.join(CHAT_TEMPLATE_FILES)}), "
                    "and data.source holds chat conversations", CHAT_TEMPLATE_FIX)
    if not description.get("tokenizer"):
        return warn("target", f"{detail}; no tokenizer_config.json", "prepare needs the target's tokenizer and chat template beside the weights")
    if spec.train.states == "online" and isinstance(text.get("hidden_size"), int):
        fit = online_fit(spec, config, description["safetensors"].get("bytes"))
        if not fit.fits[spec.extract.compute_dtype]:
            return fail("target", f"{detail}; train.states online: {fit.why}",
                        "Set train.states: stored (extract once, then train from storage), or the settings named, or a card with more memory")
    if not supported(config):
        return warn("target", f"{detail}; {model_type(config)} is not an architecture the suite proves ({', '.join(MODEL_TYPES)}): "
                    f"it runs as the nearest, {architecture_name(config)}", "Check the evaluation's lossless figures before trusting it")
    return ok("target", detail)


def _read_through_pod(pf: Preflight) -> dict[str, Any]:
    """Starts the probe pod, waits for it, reads the description it logs, and deletes it. Whatever
    keeps it from answering (no pull, no end, a failure, a log without the description) is an
    InputError: the check fails, with what the pod printed and the fix."""
    cluster, spec = pf.cluster, pf.spec
    pod = render_probe_pod(spec)
    name = pod["metadata"]["name"]
    cluster.delete("Pod", name, wait=60)  # one an interrupted check left
    cluster.create(pod)
    try:
        current = None
        for current in cluster.watch_object("Pod", name, deadline=time.monotonic() + pf.probe_timeout):
            if current is None:
                raise InputError(f"the probe pod {name} was deleted before it ended", "Run `dflashctl check` again")
            waiting = _waiting(current)
            if waiting is not None and waiting[0] in PULL_FAILURES:
                pf.image_pulled = False
                raise InputError(f"the probe pod cannot pull {spec.cluster.image}: {waiting[0]} {waiting[1]}".strip(),
                                 "Push the image there, or give the nodes access: cluster.image_pull_secrets")
            if (current.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                break
        else:
            why = exit_reason(current) if current is not None else None
            raise InputError(f"the probe pod {name} did not finish within {pf.probe_timeout:.0f} s{f' ({why})' if why else ''}",
                             f"`kubectl -n {spec.cluster.namespace} describe pod {name}` says what it waits for (the volume, the node)")
        pf.image_pulled = True
        lines = list(cluster.logs(name, container=WORKER, follow=False))
        if current["status"]["phase"] == "Failed":
            raise InputError(f"the probe pod {name} failed ({exit_reason(current)}) running {spec.cluster.image}; {_last_lines(lines)}",
                             "The image may predate stage-model: rebuild and push it (images/README.md)")
        description = _probe_description(lines)
        if description is None:  # an image older than --describe, a log cut or rotated, other output in the stream
            raise InputError(f"the probe pod {name} ran {spec.cluster.image} and printed no description of {model_directory(spec)}; "
                             f"{_last_lines(lines)}",
                             "The image may predate `python -m dflash_jobs.stage_model --describe`: rebuild and push cluster.image "
                             "(images/README.md), then `dflashctl check` again")
        return description
    finally:
        cluster.delete("Pod", name)


def _probe_description(lines: list[str]) -> dict[str, Any] | None:
    """The probe's JSON line (`stage_model --describe`), the last one in its log; None when none is
    there (another program's JSON, or the line cut short, is not it)."""
    for line in reversed(lines):
        if not line.startswith("{"):
            continue
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if isinstance(found, dict) and isinstance(found.get("exists"), bool):
            return found
    return None


def _last_lines(lines: list[str]) -> str:
    """What a pod printed last, on one line, for a check's detail."""
    if not lines:
        return "it printed nothing"
    shown = [line if len(line) <= PROBE_LINE_CHARS else line[:PROBE_LINE_CHARS] + "…" for line in lines[-PROBE_LINES_SHOWN:]]
    return f"its last lines: {' | '.join(shown)}"


def _waiting(pod: dict[str, Any]) -> tuple[str, str] | None:
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting")
        if waiting:
            return waiting.get("reason") or "", waiting.get("message") or ""
    return None


def image(pf: Preflight) -> CheckResult:
    cluster = pf.spec.cluster
    if pf.spec.backend != "kubernetes":
        return skipped("image", "backend: local")
    if pf.image_pulled:
        return ok("image", f"{cluster.image} was pulled by the probe pod")
    if pf.image_pulled is False:
        return fail("image", f"{cluster.image} cannot be pulled (see target)", "Push it, or set cluster.image_pull_secrets")
    return skipped("image", "pulled by the first pod (`dflashctl check` pulls cluster.image through a probe pod)")
