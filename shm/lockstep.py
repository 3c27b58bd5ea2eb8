"""The lockstep counter: a u64 in shared memory advanced by exactly one writer.

In the engine the output processor advances it to ``k`` once step ``k``'s
output and feedback are complete, and the scheduler waits on it before
planning a step (the lockstep rule in DESIGN.md). Layout::

      0 +---------------------------------------------+
        | magic | version | num_readers | (unused)     |  set once by the creator
     64 +---------------------------------------------+
        | value                          (writer only) |
    128 +---------------------------------------------+
        | reader 0 sleeping flag      (reader 0 only)  |  one cache line per reader slot
    192 +---------------------------------------------+
        | reader 1 sleeping flag ...                   |
        +---------------------------------------------+

The value starts at 0 and only grows: ``advance_to(k)`` with ``k`` below the
value raises ValueError, ``k`` equal to it is a no-op (so a writer may
re-announce the step it has just finished without tracking whether it did).

**Wake-up.** Readers are fixed at creation (``num_readers``); each attaches
with its own slot, which owns one sleeping flag and one semaphore
(``<name>.r<slot>``), so a post always wakes the reader it was meant for and
several readers never steal each other's wake-ups. A reader spins (an
adaptive budget of up to ``spin_s``, as in :mod:`shm.ring`), then sets its
flag, re-checks the value and sleeps on its semaphore; after each store of the
value the writer posts the semaphore of every slot whose flag is set. The
value store and the flag store are separate words, so, exactly as for
:mod:`shm.ring`, x86 may let both sides miss each other; a sleeper therefore
re-checks after growing slices (``WAIT_SLICE_S`` up to ``MAX_WAIT_SLICE_S``),
which bound the cost of a lost wake-up.

**Ordering.** The value is one aligned 8-byte store (never torn). Whatever the
writer stored before ``advance_to(k)``, such as feedback frames published in a
ring, is visible to a reader that has seen ``k`` and reads afterwards: x86-64
keeps stores in order and loads in order (see :mod:`shm.ring` for the
argument and for weakly ordered CPUs).
"""

from __future__ import annotations

import ctypes
from time import perf_counter
from types import TracebackType

import posix_ipc

from shm.segment import Segment, close_semaphore, create_semaphore, open_semaphore
from shm.wait import SPIN_S, wait_until

MAGIC = int.from_bytes(b"mpe-lock", "little")
VERSION = 1
MAX_READERS = 16
_U64_MAX = (1 << 64) - 1
_VALUE = 64
_FLAGS = 128


class Lockstep:
    """A monotonic u64 counter: one writer advances it, up to ``num_readers`` readers wait on it."""

    def __init__(self, segment: Segment, reader: int, spin_s: float) -> None:
        magic, version, num_readers = (ctypes.c_uint64 * 3).from_buffer(segment.buf, 0)
        if magic != MAGIC or version != VERSION:
            segment.close()
            raise ValueError(f"{segment.name} is not a version {VERSION} lockstep counter")
        if not 0 <= reader < num_readers:
            segment.close()
            raise ValueError(f"reader slot {reader} not in [0, {num_readers}) for {segment.name}")
        self.segment = segment
        self.name = segment.name
        self.num_readers = num_readers
        self.reader = reader
        self.spin_s = spin_s
        self.spin_budget_s = spin_s  # adapted by every wait
        self.num_sleeps = 0
        self.num_missed_wakeups = 0
        self._value = ctypes.c_uint64.from_buffer(segment.buf, _VALUE)
        self._flags = [
            ctypes.c_uint64.from_buffer(segment.buf, _FLAGS + 64 * i) for i in range(num_readers)
        ]
        self._sems: list[posix_ipc.Semaphore] = []
        make = create_semaphore if segment.owner else open_semaphore
        try:
            for i in range(num_readers):
                self._sems.append(make(f"{self.name}.r{i}"))
        except BaseException:
            self.close()
            raise

    @classmethod
    def create(
        cls,
        engine_id: str,
        purpose: str,
        *,
        num_readers: int = 1,
        reader: int = 0,
        spin_s: float = SPIN_S,
    ) -> Lockstep:
        """Create a counter at 0 with ``num_readers`` reader slots."""
        if not 1 <= num_readers <= MAX_READERS:
            raise ValueError(f"num_readers must be in [1, {MAX_READERS}], got {num_readers}")
        segment = Segment.create(engine_id, purpose, _FLAGS + 64 * num_readers)
        (ctypes.c_uint64 * 3).from_buffer(segment.buf, 0)[:] = [MAGIC, VERSION, num_readers]
        return cls(segment, reader, spin_s)

    @classmethod
    def attach(cls, name: str, *, reader: int = 0, spin_s: float = SPIN_S) -> Lockstep:
        """Attach as the writer, or as the reader of slot ``reader`` (one process per slot)."""
        return cls(Segment.attach(name), reader, spin_s)

    @property
    def value(self) -> int:
        """The current value (a snapshot)."""
        return self._value.value

    def advance_to(self, k: int) -> None:
        """Set the value to ``k`` and wake sleeping readers (writer only).

        ``k`` equal to the value is a no-op; below it raises ValueError. The shared value is
        compared, not what this handle last wrote: a second (stale) writer cannot move the
        counter back.
        """
        current = self._value.value
        if k <= current:
            if k == current:
                return
            raise ValueError(f"{self.name}: cannot go back from {current} to {k}")
        if k > _U64_MAX:
            raise ValueError(f"{self.name}: {k} does not fit in a u64")
        self._value.value = k
        for flag, sem in zip(self._flags, self._sems, strict=True):
            if flag.value:
                sem.release()

    def wait_at_least(self, k: int, timeout: float | None = None) -> int:
        """Block until the value is at least ``k``; return the value seen.

        Spins for ``spin_s``, then sleeps on this reader slot's semaphore.
        Raises TimeoutError after ``timeout`` seconds (None: wait forever).
        """
        value = self._value.value
        if value >= k:
            return value
        deadline = float("inf") if timeout is None else perf_counter() + timeout
        flag = self._flags[self.reader]
        value = wait_until(self._value, k, flag, self._sems[self.reader], self, deadline)
        if value < 0:
            raise TimeoutError(f"{self.name}: value {self._value.value} did not reach {k}")
        return value

    def close(self) -> None:
        """Detach; the creator also unlinks the segment and semaphores. Idempotent."""
        if self._flags is None:
            return
        self._value = self._flags = None  # type: ignore[assignment]  # unpin the mmap
        try:
            self.segment.close()
        finally:
            for sem in self._sems:
                close_semaphore(sem, self.segment.owner)
            self._sems = []

    def __enter__(self) -> Lockstep:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Lockstep({self.name!r}, value={self.value if self._flags else 'closed'})"
