"""Is the engine healthy? What ``GET /health``, the systemd watchdog and ``STATUS=`` say.

The monitor polls the scheduler's stats (``client.stats()``). The pipeline is healthy when
the engine answers, is neither dead nor draining, and either has nothing to do or its
lockstep counter (``EngineStats.done``, advanced by the output stage after every step) moved
within the last ``stall_timeout`` seconds. A stage that hangs (a deadlock, a stuck device,
SIGSTOP) stops the counter while requests wait: that is a stall.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from mpengine.client.async_client import AsyncClient
from mpengine.metrics import ServerMetrics
from mpengine.protocol import EngineStats

if TYPE_CHECKING:
    from mpengine.launch import Engine

STATS_TIMEOUT_S = 2.0


def has_work(stats: EngineStats) -> bool:
    busy = stats.num_running + stats.num_waiting + stats.num_preempted
    return busy > 0 or stats.step > stats.done


class EngineMonitor:
    def __init__(
        self,
        client: AsyncClient,
        metrics: ServerMetrics,
        stall_timeout: float,
        engine: Engine | None = None,
    ) -> None:
        self.client = client
        self.engine = engine  # the launcher, when this process runs it (stage restarts)
        self.metrics = metrics
        self.stall_timeout = stall_timeout
        self.stats: EngineStats | None = None
        self.error: str | None = None  # why the last poll got no stats
        self.dead: str | None = None  # set by the launcher when a stage died
        self.draining = False
        self._last_done = -1
        self._done_moved_at = time.monotonic()

    async def poll(self) -> EngineStats | None:
        """Fresh stats (also fed to the metrics); None when the engine does not answer."""
        try:
            stats = await self.client.stats(timeout=STATS_TIMEOUT_S)
        except Exception as exc:  # timeout, engine gone: both mean unhealthy
            self.error = f"{type(exc).__name__}: {exc}"
            return None
        self.observe(stats)
        if self.engine is not None:
            self.metrics.engine.restarts = dict(self.engine.restarts.total)
        return stats

    @property
    def recovering(self) -> str | None:
        """The stage the launcher is restarting now, if any."""
        return None if self.engine is None else self.engine.recovering

    def observe(self, stats: EngineStats, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.stats, self.error = stats, None
        if stats.done != self._last_done:
            self._last_done, self._done_moved_at = stats.done, now
        self.metrics.engine.update(stats)

    def problem(self, now: float | None = None) -> str | None:
        """Why the engine is not healthy, or None when it is."""
        now = time.monotonic() if now is None else now
        if self.dead:
            return f"the engine is dead: {self.dead}"
        if self.draining:
            return "draining: the server is shutting down"
        if self.recovering:
            return f"recovering: the {self.recovering} stage died and is restarting"
        if self.error:
            return f"the engine does not answer: {self.error}"
        stats = self.stats
        if stats is None:
            return "starting"
        still = now - self._done_moved_at
        if has_work(stats) and still > self.stall_timeout:
            return (
                f"stalled: no step finished for {still:.0f} s with "
                f"{stats.num_running} running and {stats.num_waiting} waiting"
            )
        return None

    def status(self, model: str) -> str:
        """One line for systemd's ``STATUS=``."""
        problem = self.problem()
        stats = self.stats
        counts = (
            f"{stats.num_running} running, {stats.num_waiting + stats.num_preempted} waiting"
            if stats is not None
            else "no stats"
        )
        return f"{model}: {problem or 'serving'}; {counts}"


STATS_LOG_INTERVAL_S = 10.0


class StatsLog:
    """The periodic line vLLM's servers log while they work: throughput over the last
    interval, requests running and waiting, KV cache use, prefix cache hit rate. Nothing
    while the engine is idle."""

    def __init__(self, interval: float = STATS_LOG_INTERVAL_S) -> None:
        self.interval = interval
        self.last: EngineStats | None = None
        self.last_at = 0.0

    def line(self, stats: EngineStats, now: float) -> str | None:
        """The line due at ``now``, if any."""
        if self.last is None:
            self.last, self.last_at = stats, now
            return None
        if now - self.last_at < self.interval:
            return None
        prev, seconds = self.last, now - self.last_at
        self.last, self.last_at = stats, now
        if stats.generated_tokens < prev.generated_tokens:  # another engine: a new start
            return None
        generated = stats.generated_tokens - prev.generated_tokens
        prompt = max(0, stats.computed_tokens - prev.computed_tokens - generated)
        waiting = stats.num_waiting + stats.num_preempted
        if not (generated or prompt or stats.num_running or waiting):
            return None
        used = 1.0 - stats.num_free_blocks / stats.num_blocks if stats.num_blocks else 0.0
        queries = stats.prefix_cache_queries - prev.prefix_cache_queries
        hits = stats.prefix_cache_hits - prev.prefix_cache_hits
        return (
            f"prompt {prompt / seconds:.1f} tokens/s, generation {generated / seconds:.1f} "
            f"tokens/s; {stats.num_running} running, {waiting} waiting; KV cache {used:.1%} "
            f"used; prefix cache hits {hits / queries if queries else 0.0:.1%}"
        )
