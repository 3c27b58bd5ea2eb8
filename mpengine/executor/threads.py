"""The executor's torch thread count on the CPU: chosen per size of step, by timing.

More threads do not always make a step faster. A small model's operators last tens of
microseconds, so splitting them gains less than the threads' fork and join cost; and in
the processes runtime the scheduler and the output processor wake on the same cores
mid-step, stalling a parallel region until its slowest thread is scheduled again. On two
cores, a 4-layer model of hidden size 64 decoded 1.1-1.3x faster with one thread than with
two, and a model of hidden size 512 1.2x faster with two (``tools/bench_engine.py``); which
count wins depends on the model, the step's size and what else runs on the machine, so the
executor measures it where it runs.

Steps are grouped in size classes by their token count (1, 2-3, 4-7, ... tokens). The first
``trials`` steps of a class cycle through the candidate counts; the class then runs with
the count of the lowest median step period: a step's own time plus the wait for the next
plan after it. The wait is what a step costs the processes beside it: while two threads
hold both cores of a two-core machine, the scheduler and output processor run late, and
the next plan with them (the tiny model decoding in the processes runtime: 4.2 ms steps
but a 4.9 ms period with two threads, 4.0 and 4.0 ms with one). A wait longer than the
step itself is the engine idling, not contention, and is left out.

The load beside the engine changes, and a parallel region whose core is taken stalls
(with a busy neighbour process, two threads took 5-15x longer per step here, one thread
about 1.2x): a class is timed again after ``first_recheck`` more steps, then after twice
as many each time up to ``recheck`` (a choice made while the machine was busy does not
last), or as soon as the median of its last ``window`` steps is ``slowdown`` times the
median it was chosen at. An explicit ``num_threads`` turns this off.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)


@dataclass
class _SizeClass:
    samples: dict[int, list[float]] = field(default_factory=dict)  # threads -> seconds
    chosen: int | None = None
    chosen_median: float = 0.0
    steps_since_choice: int = 0
    interval: int = 0  # steps until the next timing
    recent: deque[float] = field(default_factory=deque)  # the last `window` steps at it


class ThreadTuner:
    """Per size class of step, the thread count of the shortest median step period."""

    def __init__(
        self,
        candidates: tuple[int, ...],
        trials: int = 4,
        first_recheck: int = 64,
        recheck: int = 1000,
        window: int = 8,
        slowdown: float = 1.5,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not candidates or min(candidates) < 1:
            raise ValueError(f"thread candidates must be >= 1, got {candidates}")
        self.candidates = tuple(sorted(set(candidates)))
        self.trials = trials
        self.first_recheck = min(first_recheck, recheck)
        self.recheck = recheck
        self.window = window
        self.slowdown = slowdown
        self._set_threads = set_threads
        self._clock = clock
        self._classes: dict[int, _SizeClass] = {}
        self._current = 0  # unknown: the first choice always sets it
        self._step: tuple[int, int, bool] | None = None  # (size class, threads, trial)
        # The step ended last, until the next one begins: (step, its seconds, when it ended).
        self._ended: tuple[tuple[int, int, bool], float, float] | None = None

    @staticmethod
    def size_class(num_tokens: int) -> int:
        return max(int(num_tokens), 1).bit_length()

    def begin(self, num_tokens: int) -> int:
        """Set the thread count for a step of ``num_tokens`` tokens; returns it."""
        self._settle()
        key = self.size_class(num_tokens)
        size = self._classes.get(key)
        if size is None:
            size = self._classes[key] = _SizeClass(recent=deque(maxlen=self.window))
        trial = size.chosen is None or size.steps_since_choice >= size.interval
        if trial:
            # Round robin over the candidates, fewest samples first.
            threads = min(self.candidates, key=lambda n: len(size.samples.get(n, ())))
        else:
            size.steps_since_choice += 1
            threads = size.chosen
        self._step = (key, threads, trial)
        if threads != self._current:
            self._set_threads(threads)
            self._current = threads
        return threads

    def end(self, seconds: float) -> None:
        """The step begun last took ``seconds``; it counts with the wait after it, when the
        next step begins (or :meth:`choices` is asked)."""
        if self._step is not None:
            self._ended = (self._step, seconds, self._clock())
            self._step = None

    def _settle(self) -> None:
        if self._ended is None:
            return
        step, seconds, ended = self._ended
        self._ended = None
        wait = self._clock() - ended
        self._record(step, seconds + wait if wait <= seconds else seconds)

    def _record(self, step: tuple[int, int, bool], seconds: float) -> None:
        key, threads, trial = step
        size = self._classes[key]
        if not trial:
            size.recent.append(seconds)
            slow = size.chosen_median * self.slowdown
            if len(size.recent) == self.window and statistics.median(size.recent) > slow:
                size.steps_since_choice = size.interval  # time the candidates again
            return
        size.samples.setdefault(threads, []).append(seconds)
        if any(len(size.samples.get(n, ())) < self.trials for n in self.candidates):
            return
        medians = {n: statistics.median(size.samples[n]) for n in self.candidates}
        chosen = min(medians, key=medians.__getitem__)
        if chosen != size.chosen:
            low, high = 1 << (key - 1), (1 << key) - 1
            logger.info(
                "steps of %d-%d tokens run with %d torch thread(s): median %s",
                low,
                high,
                chosen,
                ", ".join(f"{1e3 * t:.2f} ms with {n}" for n, t in sorted(medians.items())),
            )
        size.chosen, size.chosen_median = chosen, medians[chosen]
        size.interval = min(2 * size.interval, self.recheck) or self.first_recheck
        size.steps_since_choice, size.samples = 0, {}
        size.recent.clear()

    def choices(self) -> dict[int, int]:
        """The settled thread count of each size class, by its largest token count."""
        self._settle()
        return {
            (1 << key) - 1: size.chosen
            for key, size in sorted(self._classes.items())
            if size.chosen is not None
        }
