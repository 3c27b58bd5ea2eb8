"""The step breakdown (always on) and the Chrome trace (``--trace FILE``).

**Laps.** A stage loop keeps one :class:`Clock` and calls it at the end of each piece of
its step: ``work(stage, phase)`` after work, ``wait(stage, peer)`` after waiting on a ring
or the lockstep counter, ``idle()`` after a poll that found nothing to do with nothing in
flight (the scheduler has no request; every step the executor ran is fed back; the output
processor has no open request: anything else is waiting on a peer). Each call charges the
time since the previous one, so the laps tile the loop's time and nothing is counted twice
or missed. A lap costs one ``perf_counter()`` and two additions (under a microsecond);
with the totals the frames carry, a stage pays 10-25 us a step on a 2-core VM
(``tools/bench_engine.py`` prints it): well under 1 % of a step. Stage objects that time
their own phases (the executor's ``marks``) are charged with ``marks``.

Per stage (:class:`~mpengine.protocol.StageTimes`):

- ``wall``: the loop's time with work to do, every lap but the idle ones. A wait that ends
  a run of idle polls is idle as well: the stage was waiting for a client, not a peer.
  Several stages in one loop (the serial runtime) share the loop's wall time.
- ``busy``: the stage's phases (``phases`` splits it); ``waits`` by ring / counter.
- ``steps``: the steps the stage took part in, counted when it starts one.

The executor's totals ride on its results and the output processor adds its own to the
feedback, so the scheduler, which answers stats queries, always holds every stage's latest
totals without a channel of its own. :func:`breakdown` derives the figures ``mpengine
stats`` prints: per-stage milliseconds per step, waits per step, the executor's duty.

**Trace.** With a :class:`Trace`, every lap and every step is also a span, kept in a ring
of the last ``MAX_TRACE_EVENTS`` per process. At exit each process writes its part,
``FILE.<process>.json`` (Chrome trace-event JSON, one track per stage), and the launcher
merges the parts into ``FILE`` once the stages are gone (:func:`merge_trace`).
``perf_counter`` is ``CLOCK_MONOTONIC`` on Linux, one clock for every process of a host, so
the stages' spans line up: step k's forward beside step k+1's schedule and step k-1's
output.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from time import perf_counter

import msgspec

from mpengine.envs import write_atomically
from mpengine.protocol import StageTimes

logger = logging.getLogger(__name__)

SCHEDULER, EXECUTOR, OUTPUT = "scheduler", "executor", "output"
STAGES = (SCHEDULER, EXECUTOR, OUTPUT)
MAX_TRACE_EVENTS = 200_000
# The executor phases that make its duty (the device's share of the step).
DUTY_PHASES = ("forward", "sample", "pool")

_TRACK_IDS = {stage: i for i, stage in enumerate(STAGES, 1)}
_TRACE_HEAD = b'{"displayTimeUnit":"ms","traceEvents":['
_TRACE_TAIL = b"]}\n"


class Clock:
    """Charges one loop's time, lap by lap, to its stages' phases and waits."""

    def __init__(
        self,
        stages: Iterable[str],
        trace: Trace | None = None,
        now: Callable[[], float] = perf_counter,
    ) -> None:
        # Per stage: steps, busy, phases, waits. Wall and idle time are the loop's (below).
        self.times = {stage: StageTimes(phases={}, waits={}) for stage in stages}
        self.trace = trace
        self.now = now
        self.last = now()  # where the next lap starts
        self.wall = 0.0
        self.idle_time = 0.0
        self.idling = True  # no step began since the last idle poll: waits are idle too
        self.step_starts: dict[str, tuple[int, float]] = {}
        self.heard: dict[str, StageTimes] = {}  # other stages' totals, from their frames

    # -- laps -----------------------------------------------------------------------------

    def work(self, stage: str, phase: str) -> float:
        """Charge the lap to ``stage``'s ``phase``; return the lap's end."""
        now = self.now()
        self._busy(stage, phase, self.last, now)
        self.last = now
        return now

    def wait(self, stage: str, peer: str) -> float:
        """Charge the lap to ``stage``'s wait on ``peer`` (idle after idle polls)."""
        now = self.now()
        span = now - self.last
        if self.idling:
            self.idle_time += span
        else:
            waits = self.times[stage].waits
            waits[peer] = waits.get(peer, 0.0) + span
            self.wall += span
            if self.trace is not None:
                self.trace.span(stage, f"wait {peer}", "wait", self.last, now)
        self.last = now
        return now

    def idle(self) -> None:
        """Charge the lap to nobody: the loop polled and found nothing to do."""
        now = self.now()
        self.idle_time += now - self.last
        self.idling = True
        self.last = now

    def marks(self, stage: str, marks: list[tuple[str, float]]) -> float:
        """Charge phases a stage object timed itself: ``(phase, start)`` in order, closed by
        an end mark. The gap before the first mark goes to the first phase."""
        start = self.last
        for (phase, _), (_, end) in itertools.pairwise(marks):
            self._busy(stage, phase, start, end)
            start = end
        self.last = start
        return start

    def _busy(self, stage: str, phase: str, start: float, end: float) -> None:
        span = end - start
        times = self.times[stage]
        times.busy += span
        times.phases[phase] = times.phases.get(phase, 0.0) + span
        self.wall += span
        if self.trace is not None:
            self.trace.span(stage, phase, "phase", start, end)

    # -- steps ----------------------------------------------------------------------------

    def begin_step(self, stage: str, step: int, start: float | None = None) -> None:
        """Count a step of ``stage`` that began at ``start`` (default: the last lap's end)."""
        self.times[stage].steps += 1
        self.idling = False
        if self.trace is not None:
            self.step_starts[stage] = (step, self.last if start is None else start)

    def end_step(self, stage: str) -> None:
        """The step of ``stage`` ends with the last lap (a span in the trace)."""
        if self.trace is not None and stage in self.step_starts:
            step, start = self.step_starts.pop(stage)
            self.trace.span(stage, f"step {step}", "step", start, self.last)

    # -- totals ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, StageTimes]:
        """A copy of this loop's stages' totals (safe to send or hand to another thread)."""
        return {
            stage: StageTimes(
                t.steps, self.wall, t.busy, self.idle_time, dict(t.phases), dict(t.waits)
            )
            for stage, t in self.times.items()
        }

    def hear(self, times: dict[str, StageTimes]) -> None:
        """Keep the latest totals other stages reported on a frame."""
        self.heard.update(times)

    def report(self) -> dict[str, StageTimes]:
        """Every stage's latest totals, those heard and this loop's own, in pipeline order."""
        latest = {**self.heard, **self.snapshot()}
        return {stage: latest[stage] for stage in sorted(latest, key=_pipeline_order)}


# -- derived figures ---------------------------------------------------------------------


def counters(times: StageTimes) -> dict[str, float]:
    """One stage's totals as named counters: ``steps``, ``wall_s``, ``busy_s``, ``idle_s``,
    ``<phase>_s``, ``wait_<peer>_s``."""
    named: dict[str, float] = {
        "steps": times.steps,
        "wall_s": times.wall,
        "busy_s": times.busy,
        "idle_s": times.idle,
    }
    named.update({f"{phase}_s": s for phase, s in times.phases.items()})
    named.update({f"wait_{peer}_s": s for peer, s in times.waits.items()})
    return named


def per_step(times: StageTimes) -> dict[str, float]:
    """Milliseconds per step: ``step_ms`` (wall: the step period), ``busy_ms``, each phase,
    each wait (``wait_<peer>_ms``)."""
    scale = 1e3 / times.steps if times.steps else 0.0
    figures = {"step_ms": times.wall * scale, "busy_ms": times.busy * scale}
    figures.update({f"{phase}_ms": s * scale for phase, s in times.phases.items()})
    figures.update({f"wait_{peer}_ms": s * scale for peer, s in times.waits.items()})
    return figures


def duty(times: StageTimes) -> float:
    """The share of the executor's wall time spent in forward and sampling."""
    device = sum(times.phases.get(phase, 0.0) for phase in DUTY_PHASES)
    return device / times.wall if times.wall > 0 else 0.0


def breakdown(stages: dict[str, StageTimes]) -> dict[str, object]:
    """The figures ``mpengine stats`` and the benchmark print: the executor's duty and step
    period, then per stage (in pipeline order) milliseconds per step."""
    figures: dict[str, object] = {}
    if EXECUTOR in stages:
        figures["executor_duty"] = duty(stages[EXECUTOR])
        figures["step_period_ms"] = per_step(stages[EXECUTOR])["step_ms"]
    for stage in sorted(stages, key=_pipeline_order):
        figures[stage] = per_step(stages[stage])
    return figures


def since(after: dict[str, StageTimes], before: dict[str, StageTimes]) -> dict[str, StageTimes]:
    """The totals accrued between two reports (``before`` may lack a stage: it had none)."""
    zero = StageTimes(phases={}, waits={})
    return {stage: _minus(times, before.get(stage, zero)) for stage, times in after.items()}


def _minus(a: StageTimes, b: StageTimes) -> StageTimes:
    return StageTimes(
        steps=a.steps - b.steps,
        wall=a.wall - b.wall,
        busy=a.busy - b.busy,
        idle=a.idle - b.idle,
        phases={k: v - b.phases.get(k, 0.0) for k, v in a.phases.items()},
        waits={k: v - b.waits.get(k, 0.0) for k, v in a.waits.items()},
    )


def _pipeline_order(stage: str) -> int:
    return _TRACK_IDS.get(stage, len(_TRACK_IDS) + 1)


# -- trace -------------------------------------------------------------------------------


class Trace:
    """The last ``max_events`` spans of one process, written as Chrome trace-event JSON.

    ``process`` names the process (``scheduler``, ``executor``, ``output``, or ``engine``
    for the runtimes that run every stage in one process); each stage is one track.
    Appending to the ring is safe from several threads (the threads runtime shares one).
    """

    def __init__(self, path: str, process: str, max_events: int = MAX_TRACE_EVENTS) -> None:
        self.path = path
        self.process = process
        self.events: deque[tuple[str, str, str, float, float]] = deque(maxlen=max_events)

    @classmethod
    def open(cls, trace: str | None, process: str) -> Trace | None:
        """The trace of ``process`` if ``trace`` (the engine's ``--trace FILE``) is set."""
        return cls(part_path(trace, process), process) if trace else None

    def span(self, track: str, name: str, category: str, start: float, end: float) -> None:
        self.events.append((track, name, category, start, end))

    def write(self) -> None:
        """Write the part file; a failure is logged, never raised (this runs at exit)."""
        try:
            write_atomically(self.path, _TRACE_HEAD + self._body() + _TRACE_TAIL)
        except Exception:
            logger.exception("cannot write the trace %s", self.path)

    def _body(self) -> bytes:
        pid = os.getpid()
        tracks = sorted({track for track, *_ in self.events} | self._own_tracks())
        events: list[dict[str, object]] = [
            _meta("process_name", pid, None, {"name": f"mpengine: {self.process}"}),
            _meta("process_sort_index", pid, None, {"sort_index": _pipeline_order(self.process)}),
        ]
        for track in tracks:
            tid = _TRACK_IDS.get(track, 0)
            events.append(_meta("thread_name", pid, tid, {"name": track}))
            events.append(_meta("thread_sort_index", pid, tid, {"sort_index": tid}))
        for track, name, category, start, end in self.events:
            # Whole nanoseconds first: spans that share a boundary keep sharing it, so a
            # step's phases nest inside it exactly.
            start_ns, end_ns = int(start * 1e9), int(end * 1e9)
            events.append(
                {
                    "name": name,
                    "cat": category,
                    "ph": "X",
                    "pid": pid,
                    "tid": _TRACK_IDS.get(track, 0),
                    "ts": start_ns / 1e3,
                    "dur": (end_ns - start_ns) / 1e3,
                }
            )
        return msgspec.json.encode(events)[1:-1]

    def _own_tracks(self) -> set[str]:
        return {self.process} if self.process in _TRACK_IDS else set()


def _meta(kind: str, pid: int, tid: int | None, args: dict[str, object]) -> dict[str, object]:
    event: dict[str, object] = {"name": kind, "ph": "M", "pid": pid, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def part_path(trace: str, process: str) -> str:
    """Where ``process`` writes its part of the trace ``trace``."""
    return f"{trace}.{process}.json"


def merge_trace(trace: str, processes: Iterable[str]) -> list[str]:
    """Merge the parts the processes wrote into ``trace`` and remove them; return the
    processes merged. A missing or cut-off part (a stage that was killed) is left out, and
    left on disk if it exists."""
    bodies, merged = [], []
    for process in processes:
        path = Path(part_path(trace, process))
        try:
            data = path.read_bytes()
        except OSError as exc:
            logger.warning("trace of %s missing: %s", process, exc)
            continue
        if not (data.startswith(_TRACE_HEAD) and data.endswith(_TRACE_TAIL)):
            logger.warning("trace of %s is incomplete: left in %s", process, path)
            continue
        body = data[len(_TRACE_HEAD) : -len(_TRACE_TAIL)]
        if body:
            bodies.append(body)
        merged.append(process)
    try:
        write_atomically(trace, _TRACE_HEAD + b",".join(bodies) + _TRACE_TAIL)
    except OSError as exc:
        logger.warning("cannot write the trace %s: %s (its parts stay)", trace, exc)
        return []
    for process in merged:
        Path(part_path(trace, process)).unlink(missing_ok=True)
    logger.info("trace of %s written to %s", ", ".join(merged) or "no stage", trace)
    return merged
