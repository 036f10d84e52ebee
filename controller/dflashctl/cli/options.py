"""Options shared by the commands. Flags select things; every knob of a run lives in the spec.

`-o/--output` is always an output format, as in kubectl; a directory has a flag of its own
(`render -d`). `--context` and `-n/--namespace` are added to every command that talks to a cluster
by the app itself (cli/app.py), and the commands read their spec with `read_spec`, which places it
in that namespace.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from dflash_jobs.spec import DNS1123_LABEL, ClusterSpec, RunSpec, load_spec

from dflashctl.backend import Backend
from dflashctl.backends import cluster_backend, open_backend, targeted
from dflashctl.target import current_target


class Targets(Enum):
    """Which of --context and -n/--namespace a command takes (`app.command(targets=...)`)."""

    cluster = "cluster"  # both: the command talks to a cluster
    namespace = "namespace"  # -n only: the command renders objects into a namespace
    none = "none"  # the command does not touch a cluster


class OutputFormat(str, Enum):
    table = "table"
    json = "json"
    yaml = "yaml"
    name = "name"


SpecOpt = Annotated[
    Path,
    typer.Option("-f", "--file", "--spec", help="The run spec (YAML).", envvar="DFLASH_SPEC", show_default=True),
]
OutputOpt = Annotated[
    OutputFormat,
    typer.Option("-o", "--output", help="The output format: table for people; json or yaml, the same document; name, what the command is about, one per line (kubectl's -o name)."),
]
WatchOpt = Annotated[bool, typer.Option("--watch", "-w", help="Keep refreshing until the run ends.")]
ShardOpt = Annotated[int | None, typer.Option("--shard", min=0, help="One shard only (the Job's completion index, from 0).")]
TimeoutOpt = Annotated[
    float | None, typer.Option("--timeout", min=0, help="Give up waiting after this many seconds (exit 3); the Jobs go on.")
]
ForceOpt = Annotated[bool, typer.Option(
    "--force", help="Re-spec this run: replace what a different spec of this run's name left (its Jobs, run.yaml). An output "
    "another run owns is taken over only once that run has no Jobs left.")]

LocatorSpecOpt = Annotated[
    Path | None,
    typer.Option(
        "-f", "--file", "--spec", envvar="DFLASH_SPEC", show_default=False,
        help="The run spec (YAML; default dflash.yaml). With a run's NAME, only where to look: its backend, namespace or local.workdir; without a file, the cluster (-n, or the namespace dflash).",
    ),
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Say what would be created or deleted, and change nothing (no API writes, no storage writes).")]

DEFAULT_SPEC = Path("dflash.yaml")


def read_spec(spec_file: Path) -> RunSpec:
    """The spec, validated, in the namespace the command line names (-n), if it names one."""
    return targeted(load_spec(spec_file))


def locate(spec_file: Path | None) -> tuple[Backend, RunSpec | None, str]:
    """Where a command that names a run (`list`, `status NAME`, `cancel NAME`, `delete`) looks: the
    backend of the spec file (given, DFLASH_SPEC, or dflash.yaml when there is one), else the cluster
    in -n's namespace or the spec's default one. Returns the backend, the spec read (if any) and
    where that is, for messages."""
    path = spec_file or (DEFAULT_SPEC if DEFAULT_SPEC.is_file() else None)
    if path is not None:
        spec = read_spec(path)
        return open_backend(spec), spec, backend_location(spec)
    namespace = current_target().namespace or ClusterSpec().namespace
    return cluster_backend(namespace), None, f"namespace {namespace}"


def backend_location(spec: RunSpec) -> str:
    """Where the spec's backend keeps its runs, for messages: "namespace dflash", "the local backend's .dflash"."""
    return f"the local backend's {spec.local.workdir}" if spec.backend == "local" else f"namespace {spec.cluster.namespace}"


def namespace_name(value: str | None) -> str | None:
    """-n/--namespace: a Kubernetes namespace name, checked before anything talks to a cluster."""
    if value is not None and (not DNS1123_LABEL.match(value) or len(value) > 63):
        raise typer.BadParameter(
            f"{value!r} is not a namespace name: lower-case letters, digits and '-', starting and ending with a letter or digit, at most 63 characters"
        )
    return value


ContextOpt = Annotated[
    str | None,
    typer.Option("--context", help="The kubeconfig context to talk to, instead of its current context (as in kubectl).", show_default=False),
]
NamespaceOpt = Annotated[
    str | None,
    typer.Option(
        "-n", "--namespace", callback=namespace_name, show_default=False,
        help="The namespace to talk to, instead of the spec's cluster.namespace; the spec hash stays the same.",
    ),
]
RenderNamespaceOpt = Annotated[
    str | None,
    typer.Option(
        "-n", "--namespace", callback=namespace_name, show_default=False,
        help="Render the objects into this namespace instead of the spec's cluster.namespace; the spec hash stays the same.",
    ),
]
