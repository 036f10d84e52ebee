"""`dflashctl verify`: every chunk against its done marker; writes extract/manifest.json."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from dflash_jobs.formats import MANIFEST_KEY
from dflash_jobs.spec import load_spec
from dflash_jobs.storage import storage_for

from dflashctl.cli import output
from dflashctl.cli.options import DEFAULT_SPEC, OutputFormat, OutputOpt, SpecOpt, Targets
from dflashctl.cli.reporting import reporter_for
from dflashctl.identity import claim_here
from dflashctl.pipeline import StepUpdate
from dflashctl.verify import Expected, verify_run

DeepOpt = Annotated[bool, typer.Option("--deep", help="Recompute every chunk's sha256, even where the etag vouches for it (reads everything).")]
DeleteBadOpt = Annotated[bool, typer.Option("--delete-bad", help="Delete the done markers of chunks that fail, so `dflashctl run` extracts them again.")]


def verify(
    spec_file: SpecOpt = DEFAULT_SPEC,
    deep: DeepOpt = False,
    delete_bad: DeleteBadOpt = False,
    fmt: OutputOpt = OutputFormat.table,
) -> None:
    """Check every hidden-state chunk against its done marker and write extract/manifest.json.

    Size, etag, the safetensors header (tokens, layers, dtype, width, final hidden state) and, where the storage has no
    etag or with --deep, the sha256. Training starts only from the manifest. Exit 1 lists each bad
    chunk and how to redo it.

    Examples:

      dflashctl verify

      dflashctl verify --deep   # before a long training run, on suspect storage

      dflashctl verify --delete-bad; dflashctl run
    """
    spec = load_spec(spec_file)
    storage = storage_for(spec)
    claim_here(spec, force=False, say=output.info)  # it writes extract/manifest.json
    with reporter_for(output.stderr) as reporter:
        manifest = verify_run(
            storage, Expected.of(spec), deep=deep, delete_bad=delete_bad,
            on_checked=lambda done, total: reporter.update(StepUpdate("verify", done=done, total=total)),
        )
    if fmt is not OutputFormat.table:
        output.result(fmt, {
            "manifest": f"{storage.url}/{MANIFEST_KEY}", "chunks": len(manifest.chunks), "samples": manifest.samples,
            "tokens": manifest.tokens, "bytes": manifest.bytes, "layers": manifest.layers, "dtype": manifest.dtype,
            "hidden_size": manifest.hidden_size, "model": manifest.model, "final_hidden": manifest.final_hidden,
        }, [f"{storage.url}/{MANIFEST_KEY}"])
    else:
        table = Table(title=f"verified: {storage.url}/{MANIFEST_KEY}", show_header=False, title_justify="left")
        for name, value in (
            ("chunks", len(manifest.chunks)), ("samples", f"{manifest.samples:,}"), ("tokens", f"{manifest.tokens:,}"),
            ("size", f"{manifest.bytes / 2**30:.2f} GiB"), ("layers", manifest.layers), ("dtype", manifest.dtype),
            ("hidden size", manifest.hidden_size), ("target", manifest.model),
            ("final hidden state", manifest.final_hidden or "not stored (extract.final_hidden)"),
        ):
            table.add_row(name, str(value))
        output.stdout.print(table)
    output.hint("dflashctl run   (training starts from the manifest)")


def register(app: typer.Typer) -> None:
    app.command(targets=Targets.none)(verify)
