"""pacing.Every: a progress line at most once every few seconds, whatever the loop's speed."""

from __future__ import annotations

from dflash_jobs.pacing import Every


def test_a_line_is_due_once_the_seconds_have_passed_and_not_again_until_they_pass_again():
    now = [100.0]
    every = Every(5.0, clock=lambda: now[0])
    seen = []
    for t in (101.0, 104.9, 105.0, 106.0, 109.9, 110.0, 130.0, 131.0):
        now[0] = t
        seen.append(every.due())
    assert seen == [False, False, True, False, False, True, True, False]


def test_restart_counts_the_seconds_from_then():
    now = [0.0]
    every = Every(5.0, clock=lambda: now[0])
    now[0] = 20.0
    every.restart()
    now[0] = 24.0
    assert not every.due()
    now[0] = 25.0
    assert every.due()
