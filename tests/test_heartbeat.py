"""A training loop that goes quiet says how far it is, and one that stalls says where: run in a
process of its own, as a pod runs it, with the loop stuck in a step."""

from __future__ import annotations

import subprocess
import sys
import textwrap

STUCK_LOOP = textwrap.dedent(
    """
    import logging, sys, time
    from dflash_jobs.train.heartbeat import Heartbeat

    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")

    def a_step_that_never_returns():
        time.sleep(2.4)  # one stall (1.5 s) and not two: a 3 s step raced the second dump against the loop's exit

    with Heartbeat(total_steps=100, step=40, quiet_seconds=0.5, stall_seconds=1.5) as heartbeat:
        for step in (41, 42):
            time.sleep(0.1)
            heartbeat.stepped(step)
        a_step_that_never_returns()
    print("left the loop", flush=True)
    """
)


def test_a_stuck_step_is_reported_with_every_threads_stack_and_a_line_a_while():
    run = subprocess.run([sys.executable, "-c", STUCK_LOOP], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    quiet = [line for line in lines if line.startswith("step 42/100:")]
    assert quiet and "2 steps completed in the last" in quiet[0] and "step 43 running for" in quiet[0], lines
    assert len(quiet) >= 3  # one each quiet_seconds while the step hangs, not once
    assert any(line.startswith("no training step for 1s") for line in lines), lines
    assert "Timeout (0:00:01.500000)!" in run.stderr
    assert "a_step_that_never_returns" in run.stderr and 'File "<string>"' in run.stderr  # where it is stuck
    assert lines[-1] == "left the loop"  # and no dump after the loop is left
    assert run.stderr.count("Timeout") == 1

