"""Code prompts at scale (issue 48 item 1): the public functions of many packages of the package
index, read from their wheels (or sdists) with `ast` (nothing imported or run), made into chats of
code_prompts.py's kinds, written as one xz-compressed JSONL of prompts alone (the target writes
the answers: the generate step) and a JSON of where every count comes from.

    python bench/quality/package_prompts.py fetch CACHE                 # pip download, the pinned versions
    python bench/quality/package_prompts.py build CACHE OUT             # OUT/code-prompts.jsonl.xz, OUT/code-prompts.json
    python bench/quality/package_prompts.py subset OUT PART --train N   # the first N training prompts and every held-out one

A line: {"messages": [{"role": "user", "content": ...}], "kind", "package", "split": "train" | "held_out"}.
Held out by package: the held-out prompts come from HELD_OUT's packages, and no training prompt does
(nor any prompt equal to one of theirs, dropped and counted). A package that cannot be fetched or
read is skipped, a module that does not parse is skipped; both are counted and named. A chat whose
prompt is over --max-prompt-chars is dropped and counted by kind. Everything is sorted and seeded:
the same archives give the same file, byte for byte.
"""

from __future__ import annotations

import argparse
import ast
import json
import lzma
import os
import platform
import random
import shlex
import subprocess
import sys
import tarfile
import time
import zipfile
from collections import Counter
from pathlib import Path, PurePosixPath
from typing import Iterator

from code_prompts import KINDS, MORE_KINDS, CodeChat, code_chats, functions_in_tree, is_public_module

PACKAGES = (
    "accelerate==1.16.0", "aiohttp==3.14.5", "alembic==1.20.1", "altair==6.3.0", "apache-beam==2.78.0", "arrow==1.4.0",
    "ase==3.29.0", "astroid==4.4.0", "astropy==8.0.2", "attrs==26.1.0", "babel==2.19.0", "beautifulsoup4==4.15.0",
    "biopython==1.88", "black==26.10.1", "bokeh==3.9.2", "boltons==26.2.0", "boto3==1.44.18", "botocore==1.44.18",
    "bottle==0.13.5", "bottleneck==1.6.1", "catboost==1.2.10", "category-encoders==2.11.2", "celery==5.7.0", "cffi==2.1.1",
    "cirq-core==1.7.0", "click==8.5.1", "cloudpickle==3.1.3", "corner==2.3.0", "coverage==7.18.0", "cryptography==51.0.1",
    "cvxpy==1.9.3", "dask==2026.11.0", "datasets==5.2.0", "diffusers==0.42.1", "dill==0.4.1", "django==5.2.19",
    "docutils==0.23.1", "eli5==0.16.0", "emcee==3.1.6", "falcon==4.4.0", "fastapi==0.165.0", "flask==3.1.3", "flax==0.12.8",
    "folium==0.20.0", "fsspec==2026.9.0", "gensim==4.4.0", "geopandas==1.2.0", "google-api-core==2.44.0", "gunicorn==27.0.1",
    "h5py==3.16.0", "healpy==1.20.1", "holoviews==1.23.2", "html5lib==1.1", "httpx==0.29.0", "hyperopt==0.3.0",
    "hypothesis==6.170.27", "ibis-framework==12.0.0", "imbalanced-learn==0.14.2", "ipython==9.19.1", "jax==0.10.2",
    "jedi==0.20.1", "jinja2==3.1.6", "joblib==1.6.0", "jupyter-client==8.10.0", "jupyter-core==5.9.1", "keras==3.15.1",
    "kombu==5.7.0", "kornia==0.9.0", "langchain-core==1.8.4", "lark==1.3.1", "lightgbm==4.7.0", "lime==0.2.0.1",
    "lmfit==1.3.4", "lxml==6.2.0", "marshmallow==4.4.0", "matplotlib==3.11.2", "mlflow==3.18.0", "more-itertools==11.2.1",
    "mpmath==1.4.1", "msgpack==1.2.4", "music21==10.5.1", "mypy==2.4.1", "narwhals==2.29.0", "nbconvert==7.17.2",
    "nbformat==5.11.1", "networkx==3.6.1", "nltk==3.10.4", "notebook==7.6.5", "nox==2026.10.20", "numba==0.68.1",
    "numexpr==2.14.2", "numpy==2.4.6", "obspy==1.5.1", "openpyxl==3.1.5", "optax==0.2.8", "optuna==5.1.0", "packaging==26.4",
    "pandas==3.1.1", "panel==1.9.4", "param==2.4.2", "paramiko==5.1.0", "parso==0.8.7", "patsy==1.0.3", "peft==0.21.2",
    "pennylane==0.45.1", "pexpect==4.9.0", "pillow==13.0.0", "pint==0.25.3", "pip==26.3", "plotly==7.1.0", "polars==2.1.0",
    "prefect==3.9.1", "prompt-toolkit==3.0.53", "protobuf==7.36.2", "psutil==7.2.2", "pyarrow==26.0.1", "pycparser==3.12",
    "pydantic==2.14.4", "pygments==2.21.0", "pylint==4.1.5", "pymatgen==2026.10.24", "pymc==5.28.5", "pymongo==4.20.1",
    "pyomo==6.10.1", "pyparsing==3.3.3", "pyproj==3.7.2", "pyqtgraph==0.14.0", "pyramid==2.1", "pytensor==3.0.7",
    "pytest==9.2.0", "python-dateutil==4.0.0", "pytz==2026.6", "pyyaml==6.0.4", "qiskit==2.6.2", "ray==2.60.0",
    "redis==8.2.0", "reportlab==5.1.0", "requests==2.34.2", "rich==15.0.0", "sagemaker==3.27.0", "sanic==25.12.1",
    "scapy==2.8.0", "scikit-image==0.26.0", "scikit-learn==1.9.1", "scipy==1.17.1", "scrapy==2.19.0", "seaborn==0.13.2",
    "setuptools==84.2.1", "shap==0.51.0", "shapely==2.2.0", "simplejson==4.3.0", "sklearn-pandas==2.2.0", "sktime==1.2.0",
    "sortedcontainers==2.4.0", "spacy==3.8.18", "sphinx-rtd-theme==3.1.0", "sphinx==9.0.4", "sqlalchemy==2.1.9",
    "sqlglot==30.31.0", "sqlparse==0.6.1", "starlette==1.10.0", "statsmodels==0.15.0", "streamlit==1.67.0", "sunpy==7.0.5",
    "sympy==1.14.0", "tables==3.11.1", "tensorflow-probability==0.25.0", "textblob==0.20.1", "toml==0.10.2",
    "tomlkit==0.15.3", "toolz==1.2.0", "torchmetrics==1.9.0", "torchvision==0.29.1", "tornado==6.6.1", "tox==4.67.17",
    "tqdm==4.70.1", "traitlets==5.16.1", "transformers==5.25.0", "twisted==26.10.0", "typer==0.29.2", "ujson==6.1.0",
    "uncertainties==3.2.3", "urllib3==2.8.0", "uvicorn==0.55.0", "virtualenv==21.15.14", "werkzeug==3.1.9", "wheel==0.48.0",
    "xarray==2026.9.0", "xgboost==3.2.0", "xlsxwriter==3.3.1", "zarr==3.1.6",
)
"""Pinned, so that a build of another day reads the same source. Pure-Python-heavy, documented code."""
HELD_OUT = ("boltons", "more-itertools", "sortedcontainers", "toolz")
"""Packages of small, doctested utilities that none of the others vendors: the held-out prompts."""
SKIPPED_TOP = {"doc", "docs", "examples", "example", "benchmarks", "benchmark", "scripts", "tools", "setup.py", "conftest.py"}
"""An sdist's parts beside its package: documentation, examples and build scripts are not its API."""
MAX_PROMPT_CHARS = 3000
OUTPUT = "code-prompts.jsonl.xz"
SUMMARY = "code-prompts.json"
XZ_PRESET = 6


def split_pin(pin: str) -> tuple[str, str]:
    name, _, version = pin.partition("==")
    if not name or not version:
        raise ValueError(f"package {pin!r} is not pinned as NAME==VERSION: pin it, so a build reads the same source again")
    return name, version


def normalized(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def archive_pin(path: Path) -> tuple[str, str] | None:
    """(normalized name, version) of a wheel's or an sdist's file name; None for another file."""
    if path.suffix == ".whl":
        name, version = path.name.split("-")[:2]
    elif path.name.endswith((".tar.gz", ".zip")):
        name, _, version = path.name.removesuffix(".tar.gz").removesuffix(".zip").rpartition("-")
    else:
        return None
    return normalized(name), version


def archive_of(cache: Path, pin: str) -> Path | None:
    """The cached wheel or sdist of `pin` (a wheel first), or None."""
    name, version = split_pin(pin)
    found = sorted(path for path in cache.iterdir() if archive_pin(path) == (normalized(name), version))
    return next((path for path in found if path.suffix == ".whl"), found[0] if found else None)


def fetch(cache: Path, pins: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """Each pinned package's wheel (its sdist where it has none) into `cache`, by pip; those pip could
    not fetch, and why (pip's last line)."""
    cache.mkdir(parents=True, exist_ok=True)
    failed = {}
    for pin in pins:
        if archive_of(cache, pin) is not None:
            continue
        for kind in ("--only-binary", "--no-binary"):
            done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", kind, ":all:", "-d", str(cache), pin],
                                  capture_output=True, text=True)
            if done.returncode == 0:
                break
        else:
            failed[pin] = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
    return failed


def archive_modules(archive: Path) -> Iterator[tuple[PurePosixPath, bytes]]:
    """The .py files of a wheel or an sdist, path-sorted, each path relative to the import root (an
    sdist's top folder and its src/ taken off)."""
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as z:
            members = {name: z.read for name in z.namelist() if name.endswith(".py")}
            entries = [(name, members[name](name)) for name in sorted(members)]
    else:
        with tarfile.open(archive) as t:
            files = sorted((m for m in t.getmembers() if m.isfile() and m.name.endswith(".py")), key=lambda m: m.name)
            entries = [(m.name, t.extractfile(m).read()) for m in files]
    for name, data in entries:
        parts = PurePosixPath(name).parts
        if archive.suffix != ".whl":
            parts = parts[1:]
            parts = parts[1:] if parts[:1] == ("src",) else parts
        if parts and parts[0] not in SKIPPED_TOP and not parts[0].endswith((".data", ".dist-info")):
            yield PurePosixPath(*parts), data


def package_chats(name: str, archive: Path, kinds: tuple[str, ...]) -> tuple[list[CodeChat], dict]:
    """The chats of one package's archive, and its counts (modules read, unparsable, functions)."""
    counts = Counter()
    functions = []
    for relative, data in archive_modules(archive):
        if not is_public_module(Path(relative)):
            continue
        counts["modules"] += 1
        text = data.decode("utf-8", errors="replace")
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            counts["unparsable_modules"] += 1
            continue
        functions.extend(functions_in_tree(name, "", Path(relative), text, tree))
    counts["functions"] = len(functions)
    return code_chats(functions, kinds), dict(counts)


def build(cache: Path, out: Path, *, pins: tuple[str, ...] = PACKAGES, held_out: tuple[str, ...] = HELD_OUT,
          kinds: tuple[str, ...] = (*KINDS, *MORE_KINDS), seed: int = 0, max_prompt_chars: int = MAX_PROMPT_CHARS) -> dict:
    """OUT/code-prompts.jsonl.xz and OUT/code-prompts.json (returned) from the archives in `cache`."""
    unknown = set(held_out) - {split_pin(pin)[0] for pin in pins}
    if unknown:
        raise ValueError(f"held-out packages {sorted(unknown)} are not among the packages read: add them to the pins or hold out others")
    packages, skipped, rows = {}, {}, {"train": [], "held_out": []}
    over_length = Counter()
    for pin in sorted(pins):
        name, version = split_pin(pin)
        archive = archive_of(cache, pin)
        if archive is None:
            skipped[pin] = f"no archive in {cache}: run `fetch` (pip could not fetch it, or it was not asked)"
            continue
        try:
            chats, counts = package_chats(name, archive, kinds)
        except (zipfile.BadZipFile, tarfile.TarError, OSError, EOFError) as exc:
            skipped[pin] = f"{archive.name} is unreadable: {type(exc).__name__}: {exc}"
            continue
        kept = [chat for chat in chats if len(chat.prompt) <= max_prompt_chars]
        over_length.update(chat.kind for chat in chats if len(chat.prompt) > max_prompt_chars)
        split = "held_out" if name in held_out else "train"
        rows[split].extend((name, chat) for chat in kept)
        packages[name] = {"version": version, "archive": archive.name, "split": split, **counts,
                          "chats": dict(sorted(Counter(chat.kind for chat in kept).items()))}
    # A chat asked in two packages (a copied function: the same code and answer under another
    # module's name) is kept once; a held-out one asked in training too goes.
    seen: set[tuple[str, str, str]] = set()
    dropped = Counter()
    for split, reason in (("train", "duplicate"), ("held_out", "shared_with_training")):
        unique = []
        for name, chat in rows[split]:
            key = (chat.kind, chat.prompt.split("\n", 1)[-1], chat.answer)  # the first line names the module
            if key in seen:
                dropped[reason] += 1
                continue
            unique.append((name, chat))
            if split == "train":
                seen.add(key)
        rows[split] = unique
    rng = random.Random(seed)
    lines = []
    for split in ("train", "held_out"):
        rng.shuffle(rows[split])
        lines.extend(prompt_line(chat, name, split) for name, chat in rows[split])
    data = write_lines(out, lines)
    summary = {
        "kinds": list(kinds), "seed": seed, "max_prompt_chars": max_prompt_chars, "held_out_packages": list(held_out),
        "chats": {split: len(rows[split]) for split in rows},
        "per_kind": {split: dict(sorted(Counter(chat.kind for _, chat in rows[split]).items())) for split in rows},
        "dropped": {"over_length": dict(sorted(over_length.items())), **dict(sorted(dropped.items()))},
        "skipped_packages": skipped, "unparsable_modules": sum(p.get("unparsable_modules", 0) for p in packages.values()),
        "file": {"name": OUTPUT, "bytes": (out / OUTPUT).stat().st_size, "uncompressed_bytes": len(data)},
        "packages": packages,
    }
    (out / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def prompt_line(chat: CodeChat, package: str, split: str) -> str:
    """A chat of the file, its prompt alone (the target writes the answers)."""
    return json.dumps({"messages": [{"role": "user", "content": chat.prompt}], "kind": chat.kind, "package": package, "split": split},
                      ensure_ascii=False) + "\n"


def write_lines(out: Path, lines: list[str]) -> bytes:
    """OUT/code-prompts.jsonl.xz of these JSON lines; returns them uncompressed."""
    data = "".join(lines).encode()
    out.mkdir(parents=True, exist_ok=True)
    (out / OUTPUT).write_bytes(lzma.compress(data, format=lzma.FORMAT_XZ, preset=XZ_PRESET))
    return data


def read_lines(directory: Path) -> list[dict]:
    """The rows of a built DIRECTORY/code-prompts.jsonl.xz, in file order (shuffled, seeded, at build)."""
    path = directory / OUTPUT
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: build it first (`package_prompts.py build CACHE {directory}`)")
    with lzma.open(path, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]


def subset(source: Path, out: Path, *, train: int, max_prompt_chars: int) -> dict:
    """OUT/code-prompts.jsonl.xz: the first `train` training prompts of SOURCE's of at most
    `max_prompt_chars` characters, then every held-out prompt of SOURCE: a part that travels where
    the whole does not fit (the GPU machine takes 64 MiB a call). A prefix of a shuffled file, so any
    smaller part is a prefix of a larger one."""
    rows = read_lines(source)
    short = [row for row in rows if row["split"] == "train" and len(row["messages"][0]["content"]) <= max_prompt_chars]
    if len(short) < train:
        raise ValueError(f"{source / OUTPUT} holds {len(short)} training prompts of at most {max_prompt_chars} characters, "
                         f"not {train}: ask for fewer, or allow longer prompts (--max-prompt-chars)")
    kept = short[:train] + [row for row in rows if row["split"] == "held_out"]
    data = write_lines(out, [json.dumps(row, ensure_ascii=False) + "\n" for row in kept])
    summary = {"of": str(source / OUTPUT), "max_prompt_chars": max_prompt_chars,
               "chats": dict(Counter(row["split"] for row in kept)),
               "per_kind": {split: dict(sorted(Counter(row["kind"] for row in kept if row["split"] == split).items())) for split in ("train", "held_out")},
               "file": {"name": OUTPUT, "bytes": (out / OUTPUT).stat().st_size, "uncompressed_bytes": len(data)}}
    (out / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    fetch_parser = commands.add_parser("fetch", help="the pinned packages' archives into CACHE (pip download)")
    fetch_parser.add_argument("cache", type=Path)
    build_parser = commands.add_parser("build", help="CACHE's archives into OUT/code-prompts.jsonl.xz and OUT/code-prompts.json")
    build_parser.add_argument("cache", type=Path)
    build_parser.add_argument("out", type=Path)
    build_parser.add_argument("--max-prompt-chars", type=int, default=MAX_PROMPT_CHARS)
    subset_parser = commands.add_parser("subset", help="the first N training prompts of SOURCE's file and every held-out one, into PART")
    subset_parser.add_argument("source", type=Path)
    subset_parser.add_argument("part", type=Path)
    subset_parser.add_argument("--train", type=int, required=True)
    subset_parser.add_argument("--max-prompt-chars", type=int, default=MAX_PROMPT_CHARS)
    args = parser.parse_args(argv)
    if args.command == "fetch":
        for pin, why in fetch(args.cache).items():
            print(f"skipped {pin}: {why}")
        return 0
    if args.command == "subset":
        print(json.dumps(subset(args.source, args.part, train=args.train, max_prompt_chars=args.max_prompt_chars), indent=1))
        return 0
    started = time.perf_counter()
    summary = build(args.cache, args.out, max_prompt_chars=args.max_prompt_chars)
    # Where the figures come from, as bench/results/ records it: the command, the machine, the wall time.
    summary = {"command": shlex.join(["python", "bench/quality/package_prompts.py", *(sys.argv[1:] if argv is None else argv)]),
               "machine": {"cpus": os.cpu_count(), "processor": platform.machine(), "python": platform.python_version()},
               "seconds": round(time.perf_counter() - started, 1), **summary}
    (args.out / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({key: summary[key] for key in ("seconds", "chats", "per_kind", "dropped", "skipped_packages", "unparsable_modules", "file")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
