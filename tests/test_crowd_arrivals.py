"""The crowd bench offers its rate from the go: each client's first pause is the rest of a pause
already under way (bench/_crowd_clients.first_pause), so the clients' steps do not bunch up
one pause-length after the start, where the bench would time a burst of its own making."""

from __future__ import annotations

import random

from bench._crowd_clients import after_last_push, first_pause

LONGEST_S = 20.0  # pauses uniform on [0, 20 s]: 0.1 steps per second per client at steady state
CLIENTS = 20_000
WINDOW_S = 2.0


def _arrivals_per_window(first) -> list[float]:
    """Steps per client per second in each 2-s window of the first 60 s, for ``CLIENTS`` clients
    whose first pause is ``first(rng)`` and whose later pauses are uniform on [0, LONGEST_S]."""
    rng = random.Random(7)
    counts = [0] * int(60.0 / WINDOW_S)
    for _ in range(CLIENTS):
        t = first(rng)
        while t < 60.0:
            counts[int(t / WINDOW_S)] += 1
            t += rng.uniform(0.0, LONGEST_S)
    return [c / CLIENTS / WINDOW_S for c in counts]


def test_the_first_pauses_make_the_offered_rate_flat_from_the_start():
    steady = 2.0 / LONGEST_S  # one step per mean pause (10 s)
    rates = _arrivals_per_window(lambda rng: first_pause(rng, LONGEST_S))
    assert max(rates) < 1.08 * steady and min(rates) > 0.92 * steady, rates


def test_uniform_first_pauses_would_overshoot_one_pause_length_after_the_start():
    """What the bench did before: the same check fails (the rate peaks about 1.3x near 20 s)."""
    steady = 2.0 / LONGEST_S
    rates = _arrivals_per_window(lambda rng: rng.uniform(0.0, LONGEST_S))
    peak = max(range(len(rates)), key=rates.__getitem__)
    assert rates[peak] > 1.2 * steady and 16.0 <= peak * WINDOW_S <= 24.0, rates


def test_a_sync_step_is_timed_from_its_rounds_last_push_as_well():
    marks = [(1, 10.0, 10.9), (1, 10.8, 10.9), (1, 10.2, 10.95),  # round 1: its last push at 10.8
             (2, 11.0, 11.5), (2, 11.4, 11.45)]  # round 2: its last push at 11.4
    assert [round(t, 6) for t in after_last_push(marks)] == [0.1, 0.1, 0.15, 0.1, 0.05]
    assert after_last_push([]) == []
