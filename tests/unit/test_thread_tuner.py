"""The executor's thread tuner: timed trials per size class, then the faster count."""

from __future__ import annotations

import pytest

from mpengine.executor.threads import ThreadTuner


class Recorder:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, n: int) -> None:
        self.calls.append(n)


def run_steps(tuner: ThreadTuner, num_tokens: int, cost: dict[int, float], steps: int) -> list:
    """Run ``steps`` steps of ``num_tokens`` tokens whose time is ``cost[threads]``."""
    used = []
    for _ in range(steps):
        threads = tuner.begin(num_tokens)
        used.append(threads)
        tuner.end(cost[threads])
    return used


def test_trials_alternate_then_the_faster_count_runs() -> None:
    setter = Recorder()
    tuner = ThreadTuner((1, 2), trials=3, recheck=100, set_threads=setter)
    used = run_steps(tuner, 64, {1: 0.010, 2: 0.014}, 20)
    assert used[:6] == [1, 2, 1, 2, 1, 2]  # the trials, round robin
    assert used[6:] == [1] * 14  # one thread was faster
    assert tuner.choices() == {127: 1}
    # The count is set only when it changes.
    assert setter.calls == [1, 2, 1, 2, 1, 2, 1]


def test_size_classes_are_tuned_apart() -> None:
    tuner = ThreadTuner((1, 2), trials=2, recheck=100, set_threads=lambda n: None)
    run_steps(tuner, 64, {1: 0.010, 2: 0.014}, 4)  # decode-sized: 1 thread wins
    run_steps(tuner, 2048, {1: 0.200, 2: 0.120}, 4)  # prefill-sized: 2 threads win
    assert tuner.choices() == {127: 1, 4095: 2}
    # Steps of the same size class share the choice.
    assert tuner.begin(70) == 1
    tuner.end(0.010)
    assert tuner.begin(3000) == 2
    tuner.end(0.120)
    assert tuner.choices() == {127: 1, 4095: 2}


def test_the_choice_is_timed_again_after_recheck_steps() -> None:
    tuner = ThreadTuner((1, 2), trials=2, recheck=5, set_threads=lambda n: None)
    assert run_steps(tuner, 8, {1: 0.01, 2: 0.02}, 4) == [1, 2, 1, 2]
    assert run_steps(tuner, 8, {1: 0.01, 2: 0.02}, 5) == [1] * 5
    # The load changed: the next trials find two threads faster now.
    used = run_steps(tuner, 8, {1: 0.03, 2: 0.02}, 6)
    assert used[:4] == [1, 2, 1, 2] and used[4:] == [2, 2]
    assert tuner.choices() == {15: 2}


def test_the_median_decides_not_one_outlier() -> None:
    tuner = ThreadTuner((1, 2), trials=3, recheck=100, set_threads=lambda n: None)
    times = iter([0.010, 0.012, 0.500, 0.012, 0.010, 0.012])  # one descheduled step
    for _ in range(6):
        tuner.begin(32)
        tuner.end(next(times))
    assert tuner.choices() == {63: 1}


def test_candidates_are_checked() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        ThreadTuner((0, 2))
    assert ThreadTuner((2, 1, 2)).candidates == (1, 2)


def test_a_slowdown_at_the_chosen_count_times_the_candidates_again() -> None:
    tuner = ThreadTuner((1, 2), trials=2, recheck=1000, window=4, set_threads=lambda n: None)
    run_steps(tuner, 64, {1: 0.020, 2: 0.010}, 4)
    assert tuner.choices() == {127: 2}
    # A neighbour takes a core: two threads stall, one thread barely slows down.
    loaded = {1: 0.024, 2: 0.100}
    used = run_steps(tuner, 64, loaded, 4 + 4 + 3)
    assert used[:4] == [2] * 4  # the window fills, its median is 10x the chosen one's
    assert used[4:8] == [1, 2, 1, 2]  # timed again at once, not after `recheck` steps
    assert used[8:] == [1] * 3
    assert tuner.choices() == {127: 1}


def test_rechecks_come_soon_then_twice_as_far_apart_each_time() -> None:
    tuner = ThreadTuner((1, 2), trials=2, first_recheck=3, recheck=12, set_threads=lambda n: None)
    used = run_steps(tuner, 8, {1: 0.01, 2: 0.02}, 4 + 3 + 4 + 6 + 4 + 12 + 4 + 12)
    trial, chosen = [1, 2, 1, 2], [1]
    expected = trial + chosen * 3 + trial + chosen * 6 + trial + chosen * 12 + trial + chosen * 12
    assert used == expected


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_wait_after_a_step_counts_against_its_thread_count() -> None:
    """Two threads make the step faster but the next plan late (the stages beside it were
    starved): one thread has the shorter period, and wins."""
    clock = Clock()
    tuner = ThreadTuner((1, 2), trials=3, recheck=100, set_threads=lambda n: None, clock=clock)
    step = {1: 0.010, 2: 0.008}
    wait = {1: 0.000, 2: 0.004}
    for _ in range(6):
        threads = tuner.begin(64)
        clock.now += step[threads]
        tuner.end(step[threads])
        clock.now += wait[threads]
    assert tuner.choices() == {127: 1}


def test_an_idle_gap_is_not_counted() -> None:
    """A wait longer than the step is the engine idling between requests: left out."""
    clock = Clock()
    tuner = ThreadTuner((1, 2), trials=3, recheck=100, set_threads=lambda n: None, clock=clock)
    step = {1: 0.010, 2: 0.008}
    for i in range(6):
        threads = tuner.begin(64)
        clock.now += step[threads]
        tuner.end(step[threads])
        clock.now += 5.0 if i % 2 else 0.0  # idle after every two-thread trial
    assert tuner.choices() == {127: 2}
