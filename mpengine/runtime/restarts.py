"""Which stages the launcher restarts when they die, how often it may, and how a death is
described.

The output processor is restarted: its state is rebuilt from the scheduler's (``Resync``)
and its clients connect to the new one by themselves. The executor is restarted: the
scheduler recomputes what it had computed, as after a preemption. The scheduler held every
request: they fail (clients are told to retry them), and the engine starts again but for
the launcher (the other stages stopped, new segments, the model loaded again); clients keep
their connections. A crash loop gives up: at most
``max_stage_restarts`` restarts of a stage in any ``stage_restart_window_s``; a start that
fails counts as one more.
"""

from __future__ import annotations

import signal
import time
from collections import deque
from collections.abc import Callable

RESTARTABLE = frozenset({"output", "executor", "scheduler"})
# A tensor-parallel executor is not restarted: a new rank cannot join its peers' process
# group, so a rank that dies ends the engine.
RESTARTABLE_WITH_RANKS = frozenset({"output", "scheduler"})


class Restarts:
    """Each stage's restarts: how many in all (``total``), and whether one more fits the
    limit now."""

    def __init__(
        self,
        limit: int,
        window_s: float,
        clock: Callable[[], float] = time.monotonic,
        restartable: frozenset[str] = RESTARTABLE,
    ) -> None:
        self.restartable = restartable
        self.limit = limit
        self.window_s = window_s
        self.clock = clock
        self.total: dict[str, int] = {}
        self._recent: dict[str, deque[float]] = {}

    def allow(self, stage: str) -> bool:
        """Whether ``stage`` may be restarted once more now."""
        if stage not in self.restartable:
            return False
        recent = self._recent.setdefault(stage, deque())
        while recent and self.clock() - recent[0] > self.window_s:
            recent.popleft()
        return len(recent) < self.limit

    def record(self, stage: str) -> int:
        """``stage`` is being restarted; its number of restarts so far, this one included."""
        self._recent.setdefault(stage, deque()).append(self.clock())
        self.total[stage] = self.total.get(stage, 0) + 1
        return self.total[stage]


def exit_cause(code: int | None) -> str:
    """How a stage process ended, from its exit status (negative: the signal)."""
    if code is not None and code < 0:
        try:
            return f"exit code {code}: killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"exit code {code}: killed by signal {-code}"
    return f"exit code {code}"
