"""Is the engine healthy? What ``GET /health``, the systemd watchdog and ``STATUS=`` say.

The monitor polls the scheduler's stats (``client.stats()``). The pipeline is healthy when
the engine answers, is neither dead nor draining, and either has nothing to do or its
lockstep counter (``EngineStats.done``, advanced by the output stage after every step) moved
within the last ``stall_timeout`` seconds. A stage that hangs (a deadlock, a stuck device,
SIGSTOP) stops the counter while requests wait: that is a stall.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from mpengine.client.async_client import AsyncClient
from mpengine.client.replicas import combined_stats
from mpengine.metrics import ServerMetrics
from mpengine.protocol import EngineStats

STATS_TIMEOUT_S = 2.0


def has_work(stats: EngineStats) -> bool:
    busy = stats.num_running + stats.num_waiting + stats.num_preempted
    return busy > 0 or stats.step > stats.done


class Watch:
    """One replica's health as the monitor last saw it: its stats, and since when its
    lockstep counter stands still."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None
        self.error: str | None = None  # why the last poll got no stats
        self.last_done = -1
        self.done_moved_at = time.monotonic()

    def observe(self, stats: EngineStats, now: float) -> None:
        self.stats, self.error = stats, None
        if stats.done != self.last_done:
            self.last_done, self.done_moved_at = stats.done, now

    def problem(self, now: float, stall_timeout: float) -> str | None:
        if self.error:
            return f"the engine does not answer: {self.error}"
        stats = self.stats
        if stats is None:
            return "starting"
        still = now - self.done_moved_at
        if has_work(stats) and still > stall_timeout:
            return (
                f"stalled: no step finished for {still:.0f} s with "
                f"{stats.num_running} running and {stats.num_waiting} waiting"
            )
        return None


class EngineMonitor:
    """The health of the engine, and of each of its data-parallel replicas: the engine
    serves while one replica does (``problem``); ``replica_problems`` says which do not."""

    def __init__(
        self,
        client: AsyncClient,
        metrics: ServerMetrics,
        stall_timeout: float,
        engine: Any = None,
    ) -> None:
        self.client = client
        self.engine = engine  # the launcher, when this process runs it (stage restarts)
        self.metrics = metrics
        self.stall_timeout = stall_timeout
        self.size = client.data_parallel_size if client is not None else 1
        self.watches = [Watch() for _ in range(self.size)]
        self.stats: EngineStats | None = None  # the whole engine's, as of the last poll
        self.dead: str | None = None  # set by the launcher when the engine died
        self.draining = False

    @property
    def error(self) -> str | None:
        """Why the last poll got no stats (of any replica)."""
        errors = [w.error for w in self.watches]
        return None if None in errors else errors[0]

    @error.setter
    def error(self, value: str | None) -> None:
        for watch in self.watches:
            watch.error = value

    async def poll(self) -> EngineStats | None:
        """Fresh stats of every replica (also fed to the metrics); the whole engine's, or
        None when no replica answers."""
        ranks = [None] if self.size == 1 else list(range(self.size))
        answers = await asyncio.gather(
            *(self.client.stats(timeout=STATS_TIMEOUT_S, data_parallel_rank=r) for r in ranks),
            return_exceptions=True,
        )
        problems = self.client.replica_problems()
        now = time.monotonic()
        for index, (answer, watch) in enumerate(zip(answers, self.watches, strict=True)):
            if isinstance(answer, BaseException):  # timeout, engine gone: both unhealthy
                watch.error = problems[index] or f"{type(answer).__name__}: {answer}"
            else:
                self.observe(answer, now, index)
            self.metrics.engine.up[index] = watch.error is None and problems[index] is None
        self._restarts()
        good = [w.stats for w in self.watches if w.error is None and w.stats is not None]
        if not good:
            return None
        self.stats = good[0] if self.size == 1 else combined_stats(good, 0)
        return self.stats

    def _restarts(self) -> None:
        """Each replica's restarts, as its launcher in this process counted them."""
        engine = self.engine
        if engine is None:
            return
        replicas = getattr(engine, "replicas", [engine])
        for index, replica in enumerate(replicas):
            counts = dict(replica.restarts.total) if replica is not None else {}
            if replica is not engine and (again := engine.restarts.total.get(f"replica {index}")):
                counts["replica"] = again
            self.metrics.engine.restarts[index] = counts

    @property
    def recovering(self) -> str | None:
        """The stage the launcher is restarting now, if any."""
        return None if self.engine is None else self.engine.recovering

    def observe(self, stats: EngineStats, now: float | None = None, engine: int = 0) -> None:
        now = time.monotonic() if now is None else now
        self.watches[engine].observe(stats, now)
        if self.size == 1:
            self.stats = stats
        self.metrics.engine.update(stats, engine)

    def replica_problems(self, now: float | None = None) -> list[str | None]:
        """Why each replica does not serve now (None for those that do)."""
        now = time.monotonic() if now is None else now
        problems = self.client.replica_problems() if self.client is not None else [None]
        return [
            problems[i] or watch.problem(now, self.stall_timeout)
            for i, watch in enumerate(self.watches)
        ]

    def problem(self, now: float | None = None) -> str | None:
        """Why the engine is not healthy, or None when it is (one replica serving is
        enough: the front routes around the others)."""
        now = time.monotonic() if now is None else now
        if self.dead:
            return f"the engine is dead: {self.dead}"
        if self.draining:
            return "draining: the server is shutting down"
        if self.size == 1:
            if self.recovering:
                return f"recovering: the {self.recovering} stage died and is restarting"
            return self.watches[0].problem(now, self.stall_timeout)
        problems = self.replica_problems(now)
        if None in problems:
            return None
        return "no replica serves: " + "; ".join(
            f"replica {i}: {problem}" for i, problem in enumerate(problems)
        )

    def status(self, model: str) -> str:
        """One line for systemd's ``STATUS=``."""
        problem = self.problem()
        stats = self.stats
        counts = (
            f"{stats.num_running} running, {stats.num_waiting + stats.num_preempted} waiting"
            if stats is not None
            else "no stats"
        )
        if problem is None and self.size > 1:
            down = [i for i, p in enumerate(self.replica_problems()) if p is not None]
            serving = self.size - len(down)
            problem = f"serving with {serving} of {self.size} replicas" if down else None
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
