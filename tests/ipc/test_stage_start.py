"""A stage waiting for the model info at start-up: it sees its stop flag (a failed start
stops it without waiting out the start-up timeout), and it times out loudly."""

from __future__ import annotations

import multiprocessing

import pytest

from mpengine.runtime.stage import Control, StopFlag


def test_a_stopped_stage_stops_waiting_for_the_model() -> None:
    ours, theirs = multiprocessing.Pipe()
    stop = StopFlag()
    stop.set()
    try:
        assert Control("scheduler", theirs).wait_model(timeout=300.0, stop=stop) is None
    finally:
        ours.close()
        theirs.close()


def test_no_model_info_times_out() -> None:
    ours, theirs = multiprocessing.Pipe()
    try:
        with pytest.raises(TimeoutError, match="no model info"):
            Control("output", theirs).wait_model(timeout=0.2, stop=StopFlag())
    finally:
        ours.close()
        theirs.close()


def test_ready_freezes_what_start_up_allocated() -> None:
    """A stage's start-up objects leave the collector's generations when it is ready."""
    import gc

    ours, theirs = multiprocessing.Pipe()
    garbage = [[i] for i in range(1000)]  # start-up's objects
    try:
        Control("executor", ours).ready()
        assert gc.get_freeze_count() >= len(garbage)
        assert theirs.poll(10) and theirs.recv_bytes()
    finally:
        gc.unfreeze()
        ours.close()
        theirs.close()
