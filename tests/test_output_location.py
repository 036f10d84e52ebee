"""The spec refuses locations that cannot work (issue 31, item 2): a malformed s3 URL, a bucket name S3
refuses, a local output the pods of a Kubernetes run have no way to write; the message names the fix."""

from __future__ import annotations

import pytest

from dflash_jobs.errors import SpecError
from dflash_jobs.spec import parse_spec
from dflashctl.render import render_all


def spec(output: str, cluster: dict | None = None, **fields):
    return parse_spec({"name": "out", "target": {"model": "/models/m"}, "data": {"source": "s3://dflash-data/c.jsonl"}, "output": output,
                       "cluster": {"model_volume": {"claim": "models"}, **(cluster or {})}, **fields})


@pytest.mark.parametrize("output, allowed", [
    ("s3:/dflash-runs/x", "s3:// with two slashes, e.g. s3://dflash-runs/x"),
    ("S3:/dflash-runs/x", "s3:// with two slashes"),
    ("s3:///x", "with a bucket name"),
    ("s3://ab/x", "'ab' has 2 characters (3 to 63)"),
    ("s3://" + "b" * 64 + "/x", "has 64 characters"),
    ("s3://Dflash_Runs/x", "lower-case letters, digits, '.' and '-'"),
    ("s3://-runs/x", "start and end with a letter or digit"),
    ("s3://dflash..runs/x", "two adjacent periods"),
    ("s3://192.168.1.10/x", "formatted as an IP address"),
    ("s3://xn--runs/x", "reserves"),
    ("s3://runs-s3alias/x", "reserves"),
    ("file:/data/x", "file:// with two slashes"),
])
def test_malformed_s3_urls_and_bucket_names_are_refused(output, allowed):
    with pytest.raises(SpecError) as refused:
        spec(output)
    assert refused.value.field == "output" and allowed in refused.value.allowed


def test_the_same_rules_hold_for_the_source_and_the_target():
    with pytest.raises(SpecError) as refused:
        parse_spec({"name": "out", "target": {"model": "s3://m/q"}, "data": {"source": "s3://dflash-data/c.jsonl"}, "output": "s3://dflash-runs/x"})
    assert refused.value.field == "target.model"
    with pytest.raises(SpecError) as refused:
        parse_spec({"name": "out", "target": {"model": "/models/m"}, "data": {"source": "s3:/dflash-data/c.jsonl"}, "output": "s3://dflash-runs/x"})
    assert refused.value.field == "data.source"


def test_a_local_output_on_kubernetes_needs_a_declared_volume_under_which_it_lies():
    with pytest.raises(SpecError) as refused:
        spec("/data/runs/x")
    assert refused.value.field == "output"
    assert "cluster.output_volume" in refused.value.allowed and "backend: local" in refused.value.allowed
    with pytest.raises(SpecError) as refused:
        spec("/elsewhere/x", cluster={"output_volume": {"claim": "runs", "mount": "/data/runs"}})
    assert "under cluster.output_volume.mount (/data/runs)" in refused.value.allowed
    with pytest.raises(SpecError) as refused:
        spec("relative/x", cluster={"output_volume": {"claim": "runs", "mount": "/data/runs"}})
    assert "an absolute path" in refused.value.allowed
    with pytest.raises(SpecError) as refused:
        spec("/data/runs/x", cluster={"output_volume": {"claim": "runs", "mount": "/"}})
    assert refused.value.field == "cluster.output_volume.mount"
    # Accepted: the local backend, an s3 URL, a path (or file:// URL) on the declared claim.
    assert spec("/data/runs/x", backend="local").output == "/data/runs/x"
    assert spec("s3://dflash-runs/x").output == "s3://dflash-runs/x"
    assert spec("file:///data/runs/x", cluster={"output_volume": {"claim": "runs", "mount": "/data/runs/"}}).cluster.output_volume.claim == "runs"


def test_every_pod_mounts_the_output_volume_read_write():
    declared = spec("/data/runs/x", cluster={"output_volume": {"claim": "runs", "mount": "/data/runs"}})
    jobs = [obj for obj in render_all(declared) if obj["kind"] == "Job"]
    assert len(jobs) == 5  # prepare, extract, train, eval, controller
    for job in jobs:
        pod = job["spec"]["template"]["spec"]
        assert {"name": "output", "persistentVolumeClaim": {"claimName": "runs"}} in pod["volumes"], job["metadata"]["name"]
        for container in pod["containers"] + pod.get("initContainers", []):
            assert {"name": "output", "mountPath": "/data/runs"} in container["volumeMounts"], (job["metadata"]["name"], container["name"])
