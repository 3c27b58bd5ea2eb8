"""Helpers for driving a running engine in tests and tools."""

from __future__ import annotations

import time

from mpengine.client import Client
from mpengine.protocol import EngineStats


def wait_idle(client: Client, timeout: float = 10.0) -> EngineStats:
    """Poll the scheduler's stats until it has no request and no step in flight; return them.
    (Blocks of a finished request are freed once its last planned step is processed.)
    Raises TimeoutError if the engine is still busy after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        busy = stats.num_running + stats.num_waiting + stats.num_preempted
        if busy == 0 and stats.done == stats.step:
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine not idle after {timeout} s: {stats}")
        time.sleep(0.01)
