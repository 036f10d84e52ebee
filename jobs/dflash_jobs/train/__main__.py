"""`python -m dflash_jobs.train -f SPEC`, one process per GPU under torchrun."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

from dflash_jobs.errors import EXIT_OK, DflashError, pod_exit_code
from dflash_jobs.spec import CHUNK_CACHE_ENV, DEFAULT_SPEC_FILE, load_spec
from dflash_jobs.train.launch import exit_worker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_jobs.train", description="Train a DFlash drafter on the extracted hidden states.")
    parser.add_argument("-f", "--spec", default=DEFAULT_SPEC_FILE, help="the run spec (dflash.yaml)")
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s", stream=sys.stdout)
    from dflash_jobs.train.trainer import Runtime, Trainer

    try:
        spec = load_spec(args.spec)
        cache_dir = Path(os.environ.get(CHUNK_CACHE_ENV, Path(tempfile.gettempdir()) / "dflash-cache")) / spec.name / f"rank{rank}"
        trainer = Trainer.build(spec, Runtime.from_env(spec), cache_dir=cache_dir)
        try:
            trainer.train()
        finally:
            trainer.close()
    except DflashError as exc:
        logging.error("%s", exc)
        return pod_exit_code(exc)
    return EXIT_OK


if __name__ == "__main__":
    exit_worker(main())
