"""Single-producer single-consumer ring of variable-length frames in shared memory.

Layout of the segment (``/mpe.<engine>.<pid>.<purpose>``; every integer is a
native u64, offsets in bytes)::

      0 +------------------------------------------------------------+
        | magic | version | capacity | (unused)                       |  set once by the creator
     64 +------------------------------------------------------------+
        | write cursor | skip cursor                 (producer only) |  own cache line each, so the
    128 +------------------------------------------------------------+  two sides never write one
        | read cursor                                (consumer only) |  line ("false sharing")
    192 +------------------------------------------------------------+
        | consumer sleeping flag                     (consumer only) |
    256 +------------------------------------------------------------+
        | producer sleeping flag                     (producer only) |
    320 +------------------------------------------------------------+ data: capacity bytes
        | len | payload ..pad8 | len | payload ..pad8 | (skipped)     |
        +------------------------------------------------------------+

A record is an 8-byte length followed by the payload, padded to a multiple of
8: ``8 + ceil8(n)`` bytes, always contiguous so that a reader can take a
zero-copy view of it. Records start 8-aligned and the capacity is a multiple
of 8. When a record does not fit in the rest of the lap, the producer stores
the write cursor in the *skip cursor* and writes the record at offset 0 of the
next lap, publishing skip and record with one cursor store; a consumer whose
read cursor equals the skip cursor jumps to the next lap. The mark lives in
the header, not in the data, so the record may overwrite the skipped bytes:
an empty ring accepts any frame up to ``capacity - 8`` bytes in one step.
Anything larger raises ValueError at once.

Cursors count bytes since creation and only grow (a u64 does not wrap in the
lifetime of a machine); a record lives at ``cursor % capacity``. The ring is
empty when the cursors are equal. The producer writes a record at cursors
``[a, a + size)`` only once ``read >= a + size - capacity`` (the previous lap's
bytes there are consumed) or, for a record starting a lap after a skip,
``read == write`` (nothing is unread at all). The skip cursor cannot move on
before the consumer has passed it: the next skip lies a lap further, and
reserving room for it needs ``read`` beyond the current one.

**Ordering.** Each cursor has exactly one writer, which stores it with one
aligned 8-byte ``mov`` (``ctypes.c_uint64.from_buffer``: a single load or
store, never torn; ``struct.pack_into("<Q")`` packs byte by byte and was seen
to tear). The producer writes the skip cursor, the length and the payload
(CPython's memcpy), *then* stores the write cursor; the consumer loads the
write cursor, *then* the skip cursor and the record. These are separate C
calls made by the interpreter, so no compiler reorders them. On x86-64 (TSO)
stores become visible in program order (fast-string copies may reorder among
themselves but not past a later store, and glibc ends its non-temporal large
copies with ``sfence``) and loads are not reordered with older loads, so a
consumer that sees the new cursor sees the whole record. Likewise the consumer
has read a record before its read-cursor store frees the space: TSO does not
move a store ahead of older loads. On weakly ordered CPUs (aarch64) none of
this holds without barriers, which Python cannot issue; there only hand-overs
through the sleep path are ordered, since ``sem_post`` / ``sem_wait`` are
atomic read-modify-writes with release / acquire semantics. This module
targets x86-64; a port needs a release store and an acquire load (a small C
helper).

**Waiting.** A side that must wait first spins, re-reading the other side's
cursor (cheap: the line stays in its cache until it changes), then sets its
sleeping flag, re-checks, and sleeps on its semaphore (``<name>.d``: data
available, ``<name>.s``: space available); the spin budget adapts between
``spin_s`` and an eighth of it (see ``shm.wait``). After every publish the other
side posts the semaphore if the flag is set. This is Dekker's pattern, and TSO
*may* let each side's flag or cursor store wait in the store buffer past its
following load, so both can miss each other: a lost wake-up. It is made
harmless rather than impossible: a sleeper re-checks after ``shm.wait.WAIT_SLICE_S``,
then after slices that double up to ``MAX_WAIT_SLICE_S`` (an idle waiter wakes
rarely; a busy one re-checks often), so a lost wake-up costs at most one slice
(``num_missed_wakeups`` counts slices that expired with the wait already over:
7 of 530k sleeps in a run of the 1M-frame stress test). Surplus posts only
cause a spurious re-check.
"""

from __future__ import annotations

import contextlib
import ctypes
from time import perf_counter
from typing import TYPE_CHECKING

from shm.segment import Segment, close_semaphore, create_semaphore, open_semaphore
from shm.wait import SPIN_S, wait_until

if TYPE_CHECKING:
    from types import TracebackType

Frame = bytes | bytearray | memoryview

MAGIC = int.from_bytes(b"mpe-ring", "little")
VERSION = 1
NO_SKIP = (1 << 64) - 1  # skip cursor value before the first skip
HEADER_SIZE = 320
_WCUR, _SKIP, _RCUR, _CWAIT, _PWAIT = 64, 72, 128, 192, 256


class Ring:
    """SPSC ring of variable-length frames. One process puts, one process gets.

    Every instance caches its own cursors, so per ring there must be one
    instance that puts and one that gets (they may be the same instance), each
    used by one thread at a time.
    """

    def __init__(self, segment: Segment, spin_s: float) -> None:
        buf = segment.buf
        magic, version, capacity = (ctypes.c_uint64 * 3).from_buffer(buf, 0)
        if magic != MAGIC or version != VERSION or HEADER_SIZE + capacity > segment.size:
            segment.close()
            raise ValueError(f"{segment.name} is not a version {VERSION} ring")
        self.segment = segment
        self.name = segment.name
        self.capacity = capacity
        self.spin_s = spin_s
        self.spin_budget_s = spin_s  # adapted by every wait
        self.num_sleeps = 0  # semaphore waits (slow path), for tests and benchmarks
        self.num_missed_wakeups = 0  # slices that expired although the wait was over
        self._buf = buf
        self._ro = memoryview(buf).toreadonly()
        self._hdr = (ctypes.c_uint64 * (capacity // 8)).from_buffer(buf, HEADER_SIZE)
        self._wcur = ctypes.c_uint64.from_buffer(buf, _WCUR)
        self._skip = ctypes.c_uint64.from_buffer(buf, _SKIP)
        self._rcur = ctypes.c_uint64.from_buffer(buf, _RCUR)
        self._cwait = ctypes.c_uint64.from_buffer(buf, _CWAIT)
        self._pwait = ctypes.c_uint64.from_buffer(buf, _PWAIT)
        owner = segment.owner
        self._data_sem = (create_semaphore if owner else open_semaphore)(self.name + ".d")
        try:
            self._space_sem = (create_semaphore if owner else open_semaphore)(self.name + ".s")
        except BaseException:
            close_semaphore(self._data_sem, owner)
            raise
        # Producer side: own write cursor, last seen read cursor. Consumer side: the reverse.
        self._w = self._r_seen = self._wcur.value
        self._r = self._w_seen = self._rcur.value
        self._skip_seen = self._skip.value
        self._view = _FrameView(self)
        self._view_size = -1  # record size of the open zero-copy view, -1 when none

    @classmethod
    def create(cls, engine_id: str, purpose: str, capacity: int, *, spin_s: float = SPIN_S) -> Ring:
        """Create a ring holding ``capacity`` bytes of records (rounded up to 64)."""
        capacity = -(-capacity // 64) * 64
        if capacity < 64:
            raise ValueError(f"ring capacity must be positive, got {capacity}")
        segment = Segment.create(engine_id, purpose, HEADER_SIZE + capacity)
        (ctypes.c_uint64 * 3).from_buffer(segment.buf, 0)[:] = [MAGIC, VERSION, capacity]
        ctypes.c_uint64.from_buffer(segment.buf, _SKIP).value = NO_SKIP
        try:
            return cls(segment, spin_s)
        except BaseException:
            segment.close()
            raise

    @classmethod
    def attach(cls, name: str, *, spin_s: float = SPIN_S) -> Ring:
        """Attach to a ring created by another process (the producer or the consumer side)."""
        return cls(Segment.attach(name), spin_s)

    @property
    def max_frame_size(self) -> int:
        """The largest frame ``put`` accepts."""
        return self.capacity - 8

    @property
    def used_bytes(self) -> int:
        """Bytes of published, unconsumed records (a snapshot)."""
        return self._wcur.value - self._rcur.value

    # -- producer -------------------------------------------------------------------------------

    def put(self, frame: Frame, timeout: float | None = None) -> None:
        """Append one frame, blocking while the ring is full.

        Raises ValueError if the frame can never fit, TimeoutError if no space
        appeared within ``timeout`` seconds (nothing of the frame is published).
        """
        n = frame.nbytes if type(frame) is memoryview else len(frame)
        cap = self.capacity
        w, need, skip = place(self._w, n, cap, self.name)
        if need > self._r_seen:
            self._reserve(need, timeout)
        pos = w % cap
        self._hdr[pos >> 3] = n
        start = HEADER_SIZE + 8 + pos
        self._buf[start : start + n] = frame
        if skip >= 0:  # the lap end is skipped once the record is there (a copy that raised,
            self._skip.value = skip  # for a frame of the wrong type, leaves the ring as it was)
        w += (n + 15) & ~7
        self._w = w
        self._wcur.value = w  # publish: the record is complete in memory before this store
        if self._cwait.value:
            self._data_sem.release()

    def _reserve(self, read: int, timeout: float | None) -> None:
        """Wait until the consumer's read cursor reaches ``read``."""
        r = self._rcur.value
        if r < read:
            r = wait_until(self._rcur, read, self._pwait, self._space_sem, self, _deadline(timeout))
            if r < 0:
                raise TimeoutError(f"{self.name}: full")
        self._r_seen = r

    # -- consumer -------------------------------------------------------------------------------

    def get(self, timeout: float | None = None) -> bytes:
        """Remove and return the next frame (a copy), blocking while the ring is empty."""
        # get, get_view and _release_view repeat the record lookup and release inline: as
        # shared helpers they cost ~1 us more per hop (measured with tools/bench_ipc.py).
        if self._view_size >= 0:  # it would return the viewed frame again, then lose one
            raise RuntimeError(f"{self.name}: a view is still open")
        r = self._r
        if (r == self._w_seen or r == self._skip_seen) and (r := self._seek(timeout)) < 0:
            raise TimeoutError(f"{self.name}: empty")
        pos = r % self.capacity
        n = self._hdr[pos >> 3]
        start = HEADER_SIZE + 8 + pos
        frame = self._buf[start : start + n]
        r += (n + 15) & ~7
        self._r = r
        self._rcur.value = r  # frees the record: it has been copied out
        if self._pwait.value:
            self._space_sem.release()
        return frame

    def try_get(self) -> bytes | None:
        """The next frame, or None if the ring is empty right now (never waits)."""
        if self._view_size >= 0:
            raise RuntimeError(f"{self.name}: a view is still open")
        r = self._r
        if (r == self._w_seen or r == self._skip_seen) and self._seek(0) < 0:
            return None
        return self.get()

    def get_view(self, timeout: float | None = None) -> _FrameView:
        """Wait for the next frame and return a context manager yielding a read-only
        zero-copy memoryview of it::

            with ring.get_view(timeout=1.0) as mv:
                msg = decoder.decode(mv)

        The view (and anything derived from it) is valid only inside the block;
        leaving the block, normally or by an exception, consumes the frame.
        Raises TimeoutError before the block if no frame arrives in time.
        """
        if self._view_size >= 0:
            raise RuntimeError(f"{self.name}: a view is still open")
        r = self._r
        if (r == self._w_seen or r == self._skip_seen) and (r := self._seek(timeout)) < 0:
            raise TimeoutError(f"{self.name}: empty")
        pos = r % self.capacity
        n = self._hdr[pos >> 3]
        start = HEADER_SIZE + 8 + pos
        self._view.mv = self._ro[start : start + n]
        self._view_size = (n + 15) & ~7
        return self._view

    def _release_view(self) -> None:
        mv = self._view.mv
        self._view.mv = None
        if mv is not None:
            try:  # noqa: SIM105  (contextlib.suppress costs an allocation per frame)
                mv.release()
            except BufferError:  # something derived from the view still lives: its problem
                pass
        r = self._r + self._view_size
        self._view_size = -1
        self._r = r
        self._rcur.value = r
        if self._pwait.value:
            self._space_sem.release()

    def _seek(self, timeout: float | None) -> int:
        """Slow path of the reads: wait for a record (refreshing the cached write and skip
        cursors) and jump over a skipped lap end. Return the record's cursor, or -1 when
        ``timeout == 0`` and the ring is empty."""
        r = self._r
        if r == self._w_seen:
            w = self._wcur.value  # load the cursor first, then skip and record (see docstring)
            if w == r:
                if timeout == 0:
                    return -1
                w = wait_until(
                    self._wcur, r + 8, self._cwait, self._data_sem, self, _deadline(timeout)
                )
                if w < 0:
                    return -1
            self._w_seen = w
            self._skip_seen = self._skip.value
        if r == self._skip_seen:
            r += self.capacity - r % self.capacity
            self._r = r
        return r

    # -- both -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Detach; the creator also unlinks the segment and semaphores. Idempotent."""
        if self._hdr is None:
            return
        if self._view_size >= 0:
            self._release_view()
        # ctypes objects and memoryviews pin the mmap: drop them so it can be unmapped.
        self._hdr = self._wcur = self._skip = self._rcur = None  # type: ignore[assignment]
        self._cwait = self._pwait = None  # type: ignore[assignment]
        try:
            with contextlib.suppress(BufferError):
                self._ro.release()
            self.segment.close()
        finally:
            owner = self.segment.owner
            close_semaphore(self._data_sem, owner)
            close_semaphore(self._space_sem, owner)

    def __enter__(self) -> Ring:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ring({self.name!r}, capacity={self.capacity})"


class _FrameView:
    """The reusable context manager returned by :meth:`Ring.get_view`."""

    __slots__ = ("mv", "ring")

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self.mv: memoryview | None = None

    def __enter__(self) -> memoryview:
        assert self.mv is not None, "get_view() must be entered once"
        return self.mv

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.ring._release_view()


def place(w: int, n: int, cap: int, name: str) -> tuple[int, int, int]:
    """Where a record of ``n`` payload bytes goes when the write cursor is ``w`` in a ring
    of ``cap`` bytes: ``(start, need, skip)``, its start cursor, the read cursor the room
    needs, and the skip cursor to publish with it (-1: none). A record that does not fit in
    the rest of the lap starts the next one, skipping the rest. ValueError if it can never
    fit."""
    size = (n + 15) & ~7
    pos = w % cap
    if size <= cap - pos:
        return w, w + size - cap, -1
    if size > cap:
        raise ValueError(f"frame of {n} bytes exceeds {name}'s max of {cap - 8}")
    lap_end = w + cap - pos
    return lap_end, min(w, lap_end + size - cap), w


def _deadline(timeout: float | None) -> float:
    return float("inf") if timeout is None else perf_counter() + timeout
