"""`python -m dflash_jobs.generate.stage DIR`: this package and the pure-Python packages it needs
beyond a vLLM image, copied into DIR for the generation pod's vLLM container (PYTHONPATH=DIR).

The vllm engine runs in the official vLLM image, untouched: the pod's init container (the dflash
image) stages the job's code into an emptyDir, and the vLLM container runs it with its own Python,
numpy, PyYAML, torch and transformers. S3's client is missing there; it is pure Python, staged too.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
from pathlib import Path

STAGED = ("dflash_jobs", "boto3", "botocore", "s3transfer", "jmespath", "dateutil", "six", "urllib3")
"""This package, boto3 and its dependencies, all pure Python: nothing of the job depends on what else
a vLLM image holds besides numpy, PyYAML, torch and transformers (vLLM's own requirements)."""


def stage(directory: Path, modules: tuple[str, ...] = STAGED) -> list[Path]:
    """Copies each module (a package directory or a single file) into `directory`; returns what it wrote."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError(f"{name} is not installed here, so it cannot be staged")
        if spec.submodule_search_locations:
            source = Path(next(iter(spec.submodule_search_locations)))
            target = directory / name
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            source = Path(spec.origin)
            target = directory / source.name
            shutil.copy2(source, target)
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_jobs.generate.stage", description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="where to copy the packages (the vLLM container's PYTHONPATH)")
    args = parser.parse_args(argv)
    for path in stage(args.directory):
        print(f"staged {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
