"""Stage the target checkpoint into the model volume, the pod side of `dflashctl stage-model`.

    python -m dflash_jobs.stage_model -f dflash.yaml --from hf://Qwen/Qwen3.6-27B[@revision]
    python -m dflash_jobs.stage_model -f dflash.yaml --from s3://bucket/models/Qwen3.6-27B
    python -m dflash_jobs.stage_model -f dflash.yaml --from s3://bucket/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
    python -m dflash_jobs.stage_model --describe /models/Qwen3.6-27B

The checkpoint lands in target.model, a directory on the model volume:
- from the Hugging Face Hub (or the mirror HF_ENDPOINT names) with huggingface_hub, HF_TOKEN for
  gated and private repositories. The revision (a branch, a tag or a commit; default main) is
  resolved to its commit once, and every file is downloaded at that commit;
- from an s3:// prefix, every object under it, through the project's storage layer;
- from a GGUF file (llama.cpp's format: an s3:// object, or a path on the model volume), converted
  into a checkpoint (gguf.py: its weights dequantized to bf16 safetensors, its tokenizer and chat
  template): what every step reads. The weights are the quantized ones made dense: a drafter trained
  on them drafts for that quantized model. Transformers holds the whole model in float32 while it
  dequantizes: about 6 bytes a parameter of the pod's memory (the stage-model Job of a GGUF source
  asks for more: controller/dflashctl/tool_pods.py).

Every file is checked after it lands: against the sha256 the hub lists for an LFS file, the git blob
id for any other, the size and MD5 (single or multipart ETag) for S3 (a GGUF object before it is
converted; the files converted from it are recorded with their sha256). A file that fails its check
is deleted and the pod exits 1 (the Job retries it); a GGUF file transformers cannot read fails the
Job at once (bad input, exit 42), naming it. Resumable: what landed and passed its check is
recorded in .dflash-staged.json beside the weights (with the source, the revision and its commit),
and a restarted pod skips it; huggingface_hub resumes a file a network error interrupted.
The record says `complete` once every file is there: `dflashctl check` reads it.

`--describe PATH` prints one JSON line about a checkpoint directory (its config.json, its staging
record, its files): what the target-config probe pod of `dflashctl check` runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dflash_jobs.errors import DflashError, InputError, SpecError, pod_exit_code
from dflash_jobs.gguf import convert_gguf
from dflash_jobs.rows import chat_template_text
from dflash_jobs.spec import DEFAULT_SPEC_FILE, RunSpec, is_s3, load_spec
from dflash_jobs.storage import HASH_BLOCK, ObjectInfo, Storage, open_storage, open_url, sha256_file

log = logging.getLogger("dflash.stage_model")

RECORD_FILE = ".dflash-staged.json"
"""Beside the weights: where they came from (source, revision, commit), each file's size and checksum, and whether all landed."""
HUB_SOURCE = re.compile(r"^hf://(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[^\s@]+))?$")
GGUF_SUFFIX = ".gguf"
GGUF_DOWNLOAD = ".dflash-gguf"
"""Where a GGUF object is fetched to, inside target.model, until it is converted (then deleted)."""
DEFAULT_REVISION = "main"
LOG_EVERY_S = 10.0
MIB = 1 << 20
MULTIPART_PART_SIZES_MIB = (8, 16, 64, 5, 100, 128, 256, 512)
"""Part sizes a multipart ETag is tried with: the AWS CLI's and boto3's (8 MiB), this project's (64 MiB), common others."""


@dataclass(frozen=True, slots=True)
class Source:
    url: str
    """As given: hf://org/repo[@revision] or s3://bucket/prefix."""
    repo: str | None = None
    revision: str | None = None

    @property
    def hub(self) -> bool:
        return self.repo is not None

    @property
    def gguf(self) -> bool:
        """A single GGUF file, staged as the checkpoint it converts to."""
        return self.url.endswith(GGUF_SUFFIX)

    @property
    def path(self) -> str | None:
        """The GGUF file's path where it is one on a volume (not in S3)."""
        return None if is_s3(self.url) or self.hub else self.url


def parse_source(text: str) -> Source:
    """`--from`: hf://org/repo[@revision], s3://bucket/prefix, or a .gguf file (s3://bucket/key.gguf or an absolute path)."""
    match = HUB_SOURCE.match(text)
    if match:
        return Source(text, repo=match["repo"], revision=match["revision"] or DEFAULT_REVISION)
    path = text.removeprefix("file://")
    if path.endswith(GGUF_SUFFIX) and path.startswith("/"):
        return Source(path)
    if is_s3(text) and len(text.rstrip("/")) > len("s3://"):
        return Source(text.rstrip("/"))
    raise InputError(
        f"--from {text!r} is not a checkpoint source",
        "Use hf://<org>/<repo>[@<revision>] (e.g. hf://Qwen/Qwen3.6-27B@main), s3://<bucket>/<prefix>, "
        "or a GGUF file: s3://<bucket>/<key>.gguf, or its absolute path on the model volume",
    )


@dataclass(slots=True)
class StageRecord:
    """.dflash-staged.json: what was staged from where, file by file."""

    source: str
    revision: str | None
    commit: str | None
    """The hub commit the revision resolved to; None for S3."""
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    """name -> {size, checksum ("sha256:..", "git-sha1:..", "md5:..", "s3-etag:.."), mtime_ns}: files that landed and passed their check."""
    complete: bool = False
    staged_at: str | None = None

    @classmethod
    def read(cls, directory: Path) -> StageRecord | None:
        try:
            data = json.loads((directory / RECORD_FILE).read_text())
        except FileNotFoundError:
            return None
        except ValueError:
            raise InputError(f"{directory / RECORD_FILE} is not valid JSON", "Delete it and stage again") from None
        return cls(**data)

    def write(self, directory: Path) -> None:
        temp = directory / f".{RECORD_FILE}.tmp"
        temp.write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")
        os.replace(temp, directory / RECORD_FILE)

    def trusted(self, directory: Path, name: str, size: int) -> bool:
        """Landed and checked by an earlier attempt, unchanged since (same size and modification time)."""
        entry = self.files.get(name)
        if entry is None or entry["size"] != size:
            return False
        try:
            stat = (directory / name).stat()
        except FileNotFoundError:
            return False
        return stat.st_size == size and stat.st_mtime_ns == entry["mtime_ns"]

    def landed(self, directory: Path, name: str, size: int, checksum: str) -> None:
        self.files[name] = {"size": size, "checksum": checksum, "mtime_ns": (directory / name).stat().st_mtime_ns}
        self.write(directory)


# ---- checks ----------------------------------------------------------------------------------


def git_blob_sha1(path: Path) -> str:
    """The git object id of a file (what the hub lists as blobId for a file not stored in LFS)."""
    digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def s3_etag_matches(path: Path, etag: str) -> bool | None:
    """Whether the file has this S3 ETag: the MD5 of a single-part upload, or the MD5 of its parts'
    MD5s ("-N") tried with common part sizes. None: a multipart ETag of no part size tried."""
    etag = etag.strip('"')
    size = path.stat().st_size
    if "-" not in etag:
        digest = hashlib.md5()
        with open(path, "rb") as f:
            while block := f.read(HASH_BLOCK):
                digest.update(block)
        return digest.hexdigest() == etag
    parts = int(etag.rsplit("-", 1)[1])
    candidates = [mib * MIB for mib in MULTIPART_PART_SIZES_MIB]
    candidates.append(-(-size // parts // MIB) * MIB)  # the smallest whole MiB that gives N parts
    for part_size in dict.fromkeys(candidates):
        if -(-size // part_size) != parts:
            continue
        digests = b""
        with open(path, "rb") as f:
            while block := f.read(part_size):
                digests += hashlib.md5(block).digest()
        if f"{hashlib.md5(digests).hexdigest()}-{parts}" == etag:
            return True
    return None


# ---- progress --------------------------------------------------------------------------------


class _Heartbeat:
    """One log line every LOG_EVERY_S: bytes on the volume so far, the rate, the time left."""

    def __init__(self, directory: Path, total: int) -> None:
        self.directory = directory
        self.total = total
        self.start = time.monotonic()
        self.initial = _bytes_under(directory)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="stage-heartbeat")

    def __enter__(self) -> _Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stop.wait(LOG_EVERY_S):
            done = _bytes_under(self.directory)
            rate = (done - self.initial) / max(time.monotonic() - self.start, 1e-9)
            left = f", {(self.total - done) / rate:.0f} s left" if rate > 0 and done < self.total else ""
            log.info("%.2f of %.2f GB on the volume, %.0f MB/s%s", done / 1e9, self.total / 1e9, rate / 1e6, left)


def _bytes_under(directory: Path) -> int:
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:  # renamed or removed meanwhile
                continue
    return total


# ---- staging ---------------------------------------------------------------------------------


def destination(spec: RunSpec) -> Path:
    """target.model as a directory here (the model volume in the pod)."""
    if is_s3(spec.target.model):
        raise SpecError("target.model", spec.target.model, "a directory on the model volume to stage into (an s3:// target is read from there as it is)")
    return Path(spec.target.model.removeprefix("file://"))


def open_record(directory: Path, source: Source, commit: str | None) -> StageRecord:
    """The record to stage into: the one there for this source and commit, a new one in an empty directory."""
    directory.mkdir(parents=True, exist_ok=True)
    record = StageRecord.read(directory)
    if record is not None and (record.source, record.commit) != (source.url, commit):
        raise InputError(
            f"{directory} holds {record.source} (commit {record.commit}), not {source.url} (commit {commit})",
            "Set target.model to another directory for this checkpoint, or delete that one first",
        )
    if record is None:
        others = [p.name for p in directory.iterdir() if p.name != ".cache"]
        if others:
            raise InputError(
                f"{directory} is not empty ({len(others)} entries, e.g. {sorted(others)[0]}) and was not staged by dflashctl",
                "Set target.model to an empty directory, or leave this one as it is: it is used as found",
            )
        record = StageRecord(source=source.url, revision=source.revision, commit=commit)
        record.write(directory)
    return record


def stage(spec: RunSpec, source: Source) -> StageRecord:
    directory = destination(spec)
    if source.hub:
        return stage_from_hub(source, directory)
    if source.gguf:
        return stage_from_gguf(spec, source, directory)
    return stage_from_s3(spec, source, directory)


def stage_from_hub(source: Source, directory: Path) -> StageRecord:
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    endpoint = os.environ.get("HF_ENDPOINT") or None
    token = os.environ.get("HF_TOKEN") or None
    where = f"{source.repo} on {endpoint or 'the Hugging Face Hub'}"
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(source.repo, revision=source.revision, files_metadata=True)
    except GatedRepoError:
        raise InputError(f"{where} is gated and {'the token was refused' if token else 'no HF_TOKEN is set'}",
                         "Accept its terms on the hub, then put a token in the Secret cluster.hf_secret names (key HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise InputError(f"{where} has no revision {source.revision!r}", "Name a branch, tag or commit of the repository after @") from None
    except RepositoryNotFoundError:
        raise InputError(f"{where} does not exist, or is private and {'the token cannot see it' if token else 'no HF_TOKEN is set'}",
                         "Check the name; for a private repository put a token in the Secret cluster.hf_secret names (key HF_TOKEN)") from None
    except HfHubHTTPError as exc:
        raise DflashError(f"the hub answered {exc}", "Retried by the Job; check HF_ENDPOINT and the network") from None
    commit = info.sha
    files = sorted(info.siblings or [], key=lambda sibling: sibling.rfilename)
    record = open_record(directory, source, commit)
    total = sum(sibling.size or 0 for sibling in files)
    log.info("staging %s@%s (commit %s): %d files, %.2f GB, into %s", source.repo, source.revision, commit, len(files), total / 1e9, directory)
    with _Heartbeat(directory, total):
        for number, sibling in enumerate(files, 1):
            name, size = sibling.rfilename, sibling.size or 0
            if record.trusted(directory, name, size):
                continue
            hf_hub_download(source.repo, name, revision=commit, local_dir=directory, endpoint=endpoint, token=token)
            if sibling.lfs is not None:
                checksum, actual = f"sha256:{sibling.lfs.sha256}", f"sha256:{sha256_file(directory / name)}"
            else:
                checksum, actual = f"git-sha1:{sibling.blob_id}", f"git-sha1:{git_blob_sha1(directory / name)}"
            _check(directory, name, size, expected=checksum, actual=actual)
            record.landed(directory, name, size, checksum)
            log.info("file %d/%d %s: %.2f GB, %s verified", number, len(files), name, size / 1e9, checksum.split(":")[0])
    return _complete(record, directory)


def stage_from_s3(spec: RunSpec, source: Source, directory: Path) -> StageRecord:
    storage = open_storage(source.url, endpoint_url=spec.storage.endpoint_url, region=spec.storage.region)
    listing = {key: storage.stat(key) for key in storage.list("")}
    listing = {key: info for key, info in listing.items() if info is not None}  # deleted since the listing
    if not listing:
        raise InputError(f"{source.url} holds no objects", "Point --from at the prefix the checkpoint's files (config.json, *.safetensors) are under")
    record = open_record(directory, source, None)
    total = sum(info.size for info in listing.values())
    log.info("staging %s: %d files, %.2f GB, into %s", source.url, len(listing), total / 1e9, directory)
    with _Heartbeat(directory, total):
        for number, (key, info) in enumerate(sorted(listing.items()), 1):
            if record.trusted(directory, key, info.size):
                continue
            checksum = fetch_object(storage, key, info, directory)
            record.landed(directory, key, info.size, checksum)
            log.info("file %d/%d %s: %.2f GB, %s verified", number, len(listing), key, info.size / 1e9, checksum.split(":")[0])
    return _complete(record, directory)


def fetch_object(storage: Storage, key: str, info: ObjectInfo, directory: Path) -> str:
    """Downloads the object to directory/key and checks it against its size and ETag: the checksum that passed."""
    storage.get_file(key, directory / key)
    etag = (info.etag or "").strip('"')
    matched = s3_etag_matches(directory / key, etag) if etag else None
    checksum = "size" if matched is None else f"s3-etag:{etag}"
    _check(directory, key, info.size, expected=checksum, actual=checksum if matched is not False else "an ETag of other bytes")
    if matched is None:
        log.warning("%s: its ETag %r is of a multipart upload with a part size not tried: only its size is checked", key, etag)
    return checksum


def stage_from_gguf(spec: RunSpec, source: Source, directory: Path) -> StageRecord:
    """The checkpoint a GGUF file converts to: an S3 object is fetched into the directory first (and
    checked as any S3 object), a path is read where it is; every converted file is recorded."""
    record = open_record(directory, source, None)
    if record.complete and all(record.trusted(directory, name, entry["size"]) for name, entry in record.files.items()):
        log.info("%s is staged from %s already", directory, source.url)
        return record
    gguf = Path(source.path) if source.path is not None else fetch_gguf(spec, source, directory)
    log.info("converting %s (%.2f GB) into %s", gguf, gguf.stat().st_size / 1e9, directory)
    convert_gguf(gguf, directory)
    shutil.rmtree(directory / GGUF_DOWNLOAD, ignore_errors=True)
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name != RECORD_FILE:
            record.landed(directory, path.name, path.stat().st_size, f"sha256:{sha256_file(path)}")
    return _complete(record, directory)


def fetch_gguf(spec: RunSpec, source: Source, directory: Path) -> Path:
    """The GGUF object, in the directory's download folder, checked against its size and ETag (one
    already there that passes is kept: a restarted pod converts without fetching again)."""
    storage, key = open_url(source.url, endpoint_url=spec.storage.endpoint_url, region=spec.storage.region)
    info = storage.stat(key)
    if info is None:
        raise InputError(f"{source.url} does not exist", "Upload the GGUF file there, or fix --from")
    local = directory / GGUF_DOWNLOAD / key
    etag = (info.etag or "").strip('"')
    if local.is_file() and local.stat().st_size == info.size and (not etag or s3_etag_matches(local, etag) is not False):
        log.info("%s: fetched by an earlier attempt", local)
        return local
    local.parent.mkdir(parents=True, exist_ok=True)
    fetch_object(storage, key, info, local.parent)
    return local


def _check(directory: Path, name: str, size: int, *, expected: str, actual: str) -> None:
    """The file has its size and checksum; else it is deleted (the retry downloads it again)."""
    path = directory / name
    found = path.stat().st_size
    if found == size and actual == expected:
        return
    path.unlink()
    what = f"{found} bytes, not {size}" if found != size else f"checksum {actual}, not {expected}"
    # Not bad input (exit 42, no retry): a transfer gone wrong, which the Job's retry downloads again.
    raise DflashError(f"{name} landed with {what}; deleted", "The Job retries it; a file that fails again means the source changed or the transfer is corrupted")


def _complete(record: StageRecord, directory: Path) -> StageRecord:
    record.complete = True
    record.staged_at = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    record.write(directory)
    log.info("staged %d files into %s: %s%s", len(record.files), directory, record.source, f" at commit {record.commit}" if record.commit else "")
    return record


# ---- describe (the probe) --------------------------------------------------------------------


def describe_checkpoint(path: str) -> dict[str, Any]:
    """What `dflashctl check` needs of a checkpoint directory: its config.json (None if absent or
    unreadable, with why), its staging record, its weight and tokenizer files, and whether its
    tokenizer carries a chat template."""
    directory = Path(path)
    description: dict[str, Any] = {"path": path, "exists": directory.is_dir()}
    if not directory.is_dir():
        return description
    try:
        description["config"] = json.loads((directory / "config.json").read_text())
    except FileNotFoundError:
        description["config"], description["config_error"] = None, "no config.json"
    except (ValueError, UnicodeDecodeError) as exc:
        description["config"], description["config_error"] = None, f"config.json is not valid JSON ({exc})"
    try:
        record = StageRecord.read(directory)
    except InputError as exc:
        record, description["staged_error"] = None, exc.what
    description["staged"] = None if record is None else {key: value for key, value in asdict(record).items() if key != "files"} | {"files": len(record.files)}
    weights = sorted(directory.glob("*.safetensors"))
    description["safetensors"] = {"files": len(weights), "bytes": sum(p.stat().st_size for p in weights)}
    description["tokenizer"] = (directory / "tokenizer_config.json").is_file()
    description["chat_template"] = bool(chat_template_text(lambda name: (directory / name).read_bytes() if (directory / name).is_file() else None))
    return description


def main(argv: list[str] | None = None, *, emit: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_jobs.stage_model", description="Stage the target checkpoint into target.model.")
    parser.add_argument("-f", "--file", default=DEFAULT_SPEC_FILE, help="the run spec (default: ./dflash.yaml)")
    parser.add_argument("--from", dest="source", help="hf://org/repo[@revision], s3://bucket/prefix, or a .gguf file (s3:// or a path)")
    parser.add_argument("--describe", metavar="PATH", help="print one JSON line about the checkpoint directory PATH, and stage nothing")
    args = parser.parse_args(argv)
    if args.describe is not None:
        emit(json.dumps(describe_checkpoint(args.describe), sort_keys=True))
        return 0
    if args.source is None:
        parser.error("--from or --describe is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s stage-model: %(message)s", stream=sys.stdout, force=True)
    try:
        stage(load_spec(args.file), parse_source(args.source))
    except DflashError as exc:
        log.error("%s", exc)
        return pod_exit_code(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
