"""The cluster's side of the preflight: namespace, what this client may do, the controller's
ServiceAccount, the Secrets, the volumes, and the nodes the pods would land on. Every call goes
through the `Cluster` (the official client); Secret values are never read into a result."""

from __future__ import annotations

import json

from dflash_jobs.spec import is_s3

from dflashctl.check import CheckResult, Preflight, fail, ok, skipped, warn
from dflashctl.check.inputs import source_needed
from dflashctl.errors import EXIT_CLUSTER, ClusterUnreachable, DflashError, Forbidden
from dflashctl.pod_fit import Node, PodAsk, claim_users, place, pod_asks, why_not_placed
from dflashctl.render import controller_role_rules

S3_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
HF_KEY = "HF_TOKEN"
PULL_SECRET_TYPES = {"kubernetes.io/dockerconfigjson": ".dockerconfigjson", "kubernetes.io/dockercfg": ".dockercfg"}
RBAC_GROUP = "rbac.authorization.k8s.io"
SHARED_MODES = {"ReadWriteMany", "ReadOnlyMany"}
"""Access modes that let pods of several nodes mount a claim at once."""
SELECTED_NODE = "volume.kubernetes.io/selected-node"
"""The annotation the scheduler sets on a WaitForFirstConsumer claim: the node its first pod went to."""
PLACEMENT = ("nodeSelector", "affinity", "tolerations")
"""The fields of a pod spec that decide where it may go."""
SETUP_FIX = "Apply the namespace's objects first: `kubectl apply -k k8s/overlays/<cluster>` (k8s/default for the defaults)"


def _unavailable(pf: Preflight, name: str) -> CheckResult | None:
    if pf.spec.backend != "kubernetes":
        return skipped(name, "backend: local")
    if pf.cluster_error is not None or pf.cluster is None:
        return skipped(name, "not checked: see namespace")
    return None


def namespace(pf: Preflight) -> CheckResult:
    if pf.spec.backend == "kubernetes" and pf.cluster is None and pf.cluster_error is not None:
        return fail("namespace", pf.cluster_error.what, pf.cluster_error.fix, EXIT_CLUSTER)  # no client at all
    if (early := _unavailable(pf, "namespace")) is not None:
        return early
    name = pf.spec.cluster.namespace
    try:
        found = pf.cluster.get_cluster_object("Namespace", name)
    except Forbidden:
        # Reading a namespace is a cluster-wide permission many users lack: its Jobs tell as much.
        pf.cluster.list("Job")
        return ok("namespace", f"{name} (its Jobs can be listed; reading the namespace itself is not allowed here)")
    except ClusterUnreachable as error:
        pf.cluster_error = error
        return fail("namespace", error.what, error.fix, EXIT_CLUSTER)
    if found is None:
        missing = fail("namespace", f"namespace {name} does not exist", f"{SETUP_FIX}, or set cluster.namespace")
        pf.cluster_error = DflashError(missing.detail, missing.fix)  # nothing in it to check
        return missing
    return ok("namespace", f"{name} exists")


def permissions(pf: Preflight) -> CheckResult:
    """What `dflashctl` (from a terminal, or as the controller) does in the namespace: SelfSubjectAccessReviews."""
    if (early := _unavailable(pf, "permissions")) is not None:
        return early
    wanted = [(verb, group, resource) for rule in controller_role_rules() for group in rule["apiGroups"]
              for resource in rule["resources"] for verb in rule["verbs"]]
    if pf.probe and pf.step is None:  # `check`; a step's target check says it when it may not start the probe pod
        wanted += [("create", "", "pods"), ("delete", "", "pods")]
    denied = []
    for verb, group, resource in wanted:
        base, _, sub = resource.partition("/")
        if not pf.cluster.can_i(verb, base, group=group, subresource=sub):
            denied.append(f"{verb} {resource}")
    if denied:
        return fail("permissions", f"this client may not {', '.join(denied)} in {pf.spec.cluster.namespace}",
                    "Bind the Role of k8s/components/rbac to your user or group (check with `kubectl auth can-i --list -n "
                    f"{pf.spec.cluster.namespace}`)", EXIT_CLUSTER)
    return ok("permissions", f"may {len(wanted)} of {len(wanted)} verbs the pipeline uses (jobs, pods, pods/log, configmaps, services, events)")


def service_account(pf: Preflight) -> CheckResult:
    """The in-cluster controller's ServiceAccount, bound to a Role that grants what it does."""
    if not pf.needs("controller"):
        return skipped("service account", "only the in-cluster controller uses it")
    if (early := _unavailable(pf, "service account")) is not None:
        return early
    account = pf.spec.cluster.service_account
    try:
        missing = [kind for kind in ("ServiceAccount", "Role", "RoleBinding") if pf.cluster.get(kind, account) is None]
        role = pf.cluster.get("Role", account)
    except Forbidden:
        return warn("service account", f"cannot read ServiceAccount/Role/RoleBinding {account} here: not verified")
    if missing:
        creatable = all(pf.cluster.can_i("create", resource, group=group)
                        for resource, group in (("serviceaccounts", ""), ("roles", RBAC_GROUP), ("rolebindings", RBAC_GROUP)))
        if creatable:
            return warn("service account", f"{account}: {', '.join(missing)} missing", "`dflashctl submit controller` creates them "
                        "(`dflashctl render controller` renders them for Git), or apply k8s/components/rbac: `kubectl apply -k k8s/overlays/<cluster>`")
        return fail("service account", f"{account}: {', '.join(missing)} missing, and this client may not create them",
                    f"{SETUP_FIX} (k8s/components/rbac), or set cluster.service_account")
    granted = {(group, resource, verb) for rule in role.get("rules") or [] for group in rule.get("apiGroups") or []
               for resource in rule.get("resources") or [] for verb in rule.get("verbs") or []}
    lacking = [f"{verb} {resource}" for rule in controller_role_rules() for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]
               if not {(group, resource, verb), (group, resource, "*"), (group, "*", verb), (group, "*", "*")} & granted]
    if lacking:
        return fail("service account", f"Role {account} does not grant {', '.join(lacking)}", "Apply k8s/components/rbac again (it grants exactly what the controller does)")
    return ok("service account", f"{account}, bound to Role {account} with what the controller does")


def _secret(pf: Preflight, name: str, secret: str, keys: tuple[str, ...], fix: str) -> CheckResult:
    try:
        found = pf.cluster.secret_keys(secret)
    except Forbidden:
        return warn(name, f"cannot read Secrets here: {secret} not verified", "`dflashctl check` as a user who may get secrets verifies it")
    if found is None:
        return fail(name, f"Secret {secret} does not exist in {pf.spec.cluster.namespace}", fix)
    _, values = found
    absent = [key for key in keys if not values.get(key)]
    if absent:
        return fail(name, f"Secret {secret} has no {' or '.join(absent)} (or an empty one); it holds {', '.join(values) or 'nothing'}", fix)
    return ok(name, f"{secret} holds {', '.join(values)}")


def s3_secret(pf: Preflight) -> CheckResult:
    """Only where the step's pods reach an s3:// location: the output, the checkpoint, the source (if read); stage-model's --from."""
    spec = pf.spec
    if pf.step == "stage-model":
        read = [pf.stage_source or ""]
    else:
        read = [spec.output, spec.target.model] + ([spec.data.source] if source_needed(pf) else [])
    used = [url for url in read if is_s3(url)]
    if not used:
        return skipped("s3 secret", "the pods reach no s3:// location")
    if spec.cluster.s3_secret is None:
        return skipped("s3 secret", "cluster.s3_secret is null: the pods' credentials come from elsewhere (workload identity)")
    if (early := _unavailable(pf, "s3 secret")) is not None:
        return early
    create = (f"kubectl -n {spec.cluster.namespace} create secret generic {spec.cluster.s3_secret} "
              "--from-literal=AWS_ACCESS_KEY_ID=... --from-literal=AWS_SECRET_ACCESS_KEY=... [--from-literal=AWS_ENDPOINT_URL=...]")
    return _secret(pf, "s3 secret", spec.cluster.s3_secret, S3_KEYS, f"Create it: `{create}`, or set cluster.s3_secret: null for workload identity")


def hf_secret(pf: Preflight) -> CheckResult:
    secret = pf.spec.cluster.hf_secret
    if secret is None or not pf.needs("stage-model"):
        return skipped("hf secret", "cluster.hf_secret is null" if secret is None else "only stage-model uses it")
    if (early := _unavailable(pf, "hf secret")) is not None:
        return early
    create = f"kubectl -n {pf.spec.cluster.namespace} create secret generic {secret} --from-literal=HF_TOKEN=hf_..."
    return _secret(pf, "hf secret", secret, (HF_KEY,), f"Create it: `{create}`")


def pull_secrets(pf: Preflight) -> CheckResult | list[CheckResult]:
    names = pf.spec.cluster.image_pull_secrets
    if not names:
        return skipped("image pull secrets", "none set (cluster.image_pull_secrets): the images are public or the nodes can pull them")
    if (early := _unavailable(pf, "image pull secrets")) is not None:
        return early
    results = []
    for name in names:
        check = f"image pull secret {name}"
        fix = (f"Create it: `kubectl -n {pf.spec.cluster.namespace} create secret docker-registry {name} --docker-server=... "
               "--docker-username=... --docker-password=...`")
        try:
            found = pf.cluster.secret_keys(name)
        except Forbidden:
            results.append(warn(check, f"cannot read Secrets here: {name} not verified"))
            continue
        if found is None:
            results.append(fail(check, f"Secret {name} does not exist in {pf.spec.cluster.namespace}", fix))
        elif found[0] not in PULL_SECRET_TYPES or not found[1].get(PULL_SECRET_TYPES[found[0]]):
            results.append(fail(check, f"Secret {name} is of type {found[0]}, not a registry credential ({', '.join(PULL_SECRET_TYPES)})", fix))
        else:
            results.append(ok(check, f"{name} ({found[0]})"))
    return results


def volumes(pf: Preflight) -> CheckResult | list[CheckResult]:
    """Each claim the pods mount: it exists and is bound; a ReadWriteOnce one where every pod that mounts it lands on one node."""
    cluster = pf.spec.cluster
    claims = []
    if cluster.model_volume is not None:
        claims.append(("model_volume", cluster.model_volume.claim))
    if cluster.output_volume is not None:
        claims.append(("output_volume", cluster.output_volume.claim))
    claims += [(field, claim) for field, claim in (("model_cache", cluster.model_cache), ("kernel_cache", cluster.kernel_cache)) if claim]
    if not claims:
        return skipped("volumes", "the spec names no PersistentVolumeClaim")
    if (early := _unavailable(pf, "volumes")) is not None:
        return early
    users = claim_users(pf.spec)
    results = []
    for field, claim in claims:
        name = f"volume {claim}"
        try:
            pvc = pf.cluster.get("PersistentVolumeClaim", claim)
        except Forbidden:
            results.append(warn(name, f"cannot read PersistentVolumeClaims here: {claim} not verified"))
            continue
        if pvc is None:
            results.append(fail(name, f"cluster.{field} names claim {claim}, which does not exist in {cluster.namespace}", SETUP_FIX))
            continue
        phase = (pvc.get("status") or {}).get("phase", "Pending")
        modes = (pvc.get("status") or {}).get("accessModes") or (pvc.get("spec") or {}).get("accessModes") or []
        capacity = ((pvc.get("status") or {}).get("capacity") or {}).get("storage", "?")
        one_node = None if not modes or SHARED_MODES & set(modes) else _one_node(pf, claim, pvc, users.get(claim, []))
        if phase == "Lost":
            results.append(fail(name, f"claim {claim} lost its volume", "Recreate the claim and its volume (`kubectl describe pvc`)"))
        elif one_node is not None:
            pf.unsafe_claims.add(claim)
            results.append(one_node)
        elif phase != "Bound":
            results.append(warn(name, f"claim {claim} is {phase}: a WaitForFirstConsumer class binds it with the first pod; otherwise it waits for a volume",
                                f"`kubectl -n {cluster.namespace} describe pvc {claim}` says which"))
        else:
            results.append(ok(name, f"{claim} is Bound ({capacity}, {', '.join(modes) or 'access modes unknown'})"))
    return results


def _one_node(pf: Preflight, claim: str, pvc: dict, users: list[tuple[str, dict]]) -> CheckResult | None:
    """A ReadWriteOnce claim is mounted on one node at a time, and its first pod binds it to that node
    (a WaitForFirstConsumer class, node-local disk): the failure when the pods that mount it may land on
    different nodes, or may not go to the node it is bound to; None when they all land on one."""
    name = f"volume {claim}"
    bound = ((pvc.get("metadata") or {}).get("annotations") or {}).get(SELECTED_NODE)
    fix = ("Pin every pod that mounts it to one node: cluster.cpu_placement with the GPU pods' node_selector (and a toleration of their "
           "taints), as examples/qwen36-27b/dflash.yaml sets for k8s/overlays/rtx-pro-6000; or a ReadWriteMany class (k8s/default)")
    try:
        nodes = [Node.of(obj) for obj in pf.node_objects()]
    except Forbidden:  # where they may go is not known here: whether their placements differ is
        placements = {json.dumps({key: pod.get(key) for key in PLACEMENT}, sort_keys=True) for _, pod in users}
        if len(placements) > 1:
            return warn(name, f"claim {claim} is ReadWriteOnce, and the pods that mount it are placed apart "
                              f"({', '.join(component for component, _ in users)}): they may land on different nodes", fix)
        return None
    where: dict[str, set[str]] = {}
    for component, pod in users:
        where.setdefault(component, {node.name for node in nodes if why_not_placed(node, pod) is None})
    if bound is not None:
        away = [component for component, names in where.items() if names and bound not in names]
        if away:
            return fail(name, f"claim {claim} is ReadWriteOnce and bound to node {bound} (by the first pod that mounted it), where "
                              f"{', '.join(away)} may not go: those pods cannot mount it",
                        f"It stays bound there: recreate it (`kubectl -n {pf.spec.cluster.namespace} delete pvc {claim}`, then apply "
                        f"the overlay again) and stage the model again. {fix}")
        return None
    landing = {component: names for component, names in where.items() if names}
    if len(set().union(*landing.values())) > 1:
        groups: dict[tuple[str, ...], list[str]] = {}
        for component, names in landing.items():
            groups.setdefault(tuple(sorted(names)), []).append(component)
        spread = "; ".join(f"{', '.join(components)} on {', '.join(names)}" for names, components in groups.items())
        return fail(name, f"claim {claim} is ReadWriteOnce and its first pod binds it to that pod's node, but the pods that mount it "
                          f"may land on different nodes ({spread})", fix)
    return None


def nodes(pf: Preflight) -> CheckResult | list[CheckResult]:
    """Each pod of the step against the nodes: where it may go, and whether one of those can hold it."""
    if (early := _unavailable(pf, "nodes")) is not None:
        return early
    try:
        found = [Node.of(obj) for obj in pf.node_objects()]
    except Forbidden:
        return warn("nodes", "cannot list nodes here (a cluster-wide permission): whether the pods fit is not checked",
                    "`dflashctl check` as a user who may list nodes checks it; `dflashctl plan` shows what each pod asks")
    asks = [ask for ask in pod_asks(pf.spec) if pf.whole_run or ask.component == pf.step]
    return [_placement(ask, found) for ask in asks]


def _placement(ask: PodAsk, found: list[Node]) -> CheckResult:
    name = f"nodes for {ask.component}"
    settings = "cluster.node_selector, cluster.tolerations, cluster.affinity" if ask.gpus else "cluster.cpu_placement"
    placement = place(ask, found)
    if not placement.candidates:
        return warn(name, f"{ask.describe()}: {placement.describe()}", f"Fix {settings}; a cluster autoscaler may still add a node for it")
    if not placement.fitting:
        return fail(name, f"{ask.describe()}: {placement.describe()}",
                    "Lower what the pod asks (cluster.cpu_per_gpu, cluster.memory_per_gpu, train.gpus_per_node) or place it on larger nodes")
    return ok(name, f"{ask.describe()} {placement.describe()}; allocatable, not free now")
