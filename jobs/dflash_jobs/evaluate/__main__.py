"""`python -m dflash_jobs.evaluate -f dflash.yaml`: the trained drafter's acceptance length and speed.

The last step of `dflashctl run` (and `dflashctl eval`): DFlash speculative decoding with the
target on held-out prompts, against plain greedy and prompt lookup, decoding by draft trees
(eval.tree_budgets), and the drafter's training forward on the same prompts (teacher forced);
writes eval/report.json and eval/acceptance.png and prints the report's headline as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from dflash_jobs.errors import EXIT_OK, DflashError, pod_exit_code
from dflash_jobs.spec import DEFAULT_SPEC_FILE, load_spec
from dflash_jobs.storage import storage_for

log = logging.getLogger("dflash.eval")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_jobs.evaluate", description="Evaluate the run's exported drafter by speculative decoding.")
    parser.add_argument("-f", "--file", default=DEFAULT_SPEC_FILE, help="the run spec (default: ./dflash.yaml)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s eval: %(message)s", stream=sys.stdout, force=True)
    try:
        spec = load_spec(args.file)
        from dflash_jobs.devices import pick_device
        from dflash_jobs.evaluate.evaluator import evaluate
        from dflash_jobs.evaluate.report import report_warnings

        # As extraction and training decide: local.device on the local backend, else the pod's GPU.
        report = evaluate(spec, storage_for(spec), device=pick_device(spec))
    except DflashError as exc:
        log.error("%s", exc)
        return pod_exit_code(exc)
    for line in report_warnings(report):
        log.warning("%s", line)
    headline = {
        name: {"acceptance_length": round(s["acceptance_length"], 3), "speedup": round(s["speedup"], 3),
               **({"tree_acceptance_length": {b: round(d["acceptance_length"], 3) for b, d in s["tree"]["decoded"].items()}} if "tree" in s else {})}
        for name, s in report["drafters"].items()
    }
    sets = {name: {drafter: round(figures["acceptance_length"], 3) for drafter, figures in table["drafters"].items()}
            for name, table in report["prompt_sets"].items()}
    print(json.dumps({"lossless": report["lossless"], **headline, **({"prompt_sets": sets} if sets else {})}))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
