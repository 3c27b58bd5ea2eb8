"""One writer, N readers: a ring of variable-length frames that every reader reads whole.

The records, the skip at a lap's end and the cursors are those of :mod:`shm.ring` (read
its docstring for the ordering argument, which holds unchanged: each cursor has one
writer, stored with one aligned 8-byte ``mov``); what differs is that each reader has its
own read cursor, and the writer reuses bytes only once the *slowest* reader has passed
them. Layout (every integer a native u64)::

      0 +---------------------------------------------------------------+
        | magic | version | capacity | num_readers | writer pid         |  set once
     64 +---------------------------------------------------------------+
        | write cursor | skip cursor                        (writer)    |
    128 +---------------------------------------------------------------+
        | writer sleeping flag                               (writer)    |
    192 +---------------------------------------------------------------+ reader i at 192 + 128 i:
        | read cursor i                                     (reader i)  |   its own cache lines,
        | reader i sleeping flag | reader i pid             (reader i)  |   as in Ring
        +---------------------------------------------------------------+ data: capacity bytes

**Waiting** is ``shm.wait``'s spin-then-sleep: each reader sleeps on its own semaphore
(``<name>.d<i>``), posted by the writer after a publish when that reader's flag is set;
the writer sleeps on one (``<name>.s``), posted by any reader that frees bytes while the
writer's flag is set, and re-checks the slowest reader. A wait never trusts a peer to be
alive: it runs in slices of ``PEER_CHECK_S``, and between them checks the pid the peer
wrote (a reader's at attach, the writer's at creation), so a dead reader is named within
one slice (:class:`PeerGone`) instead of stalling the writer until a timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from time import perf_counter
from typing import TYPE_CHECKING

from shm.ring import place
from shm.segment import Segment, close_semaphore, create_semaphore, open_semaphore
from shm.wait import SPIN_S, wait_until

if TYPE_CHECKING:
    from types import TracebackType

    import posix_ipc

Frame = bytes | bytearray | memoryview

MAGIC = int.from_bytes(b"mpe-bcst", "little")
VERSION = 1
NO_SKIP = (1 << 64) - 1
_WCUR, _SKIP, _WWAIT, _READERS = 64, 72, 128, 192
_READER_SIZE = 128
MAX_READERS = 256
# How often a wait checks that its peer still lives.
PEER_CHECK_S = 0.1


class PeerGone(ConnectionError):
    """The other side of a wait died: a reader the writer waits for, or the writer."""


def _header_size(num_readers: int) -> int:
    return _READERS + _READER_SIZE * num_readers


class Broadcast:
    """A ring with one writer and ``num_readers`` readers, each of whom gets every frame.

    ``Broadcast.create`` makes the segment (its creator may be the writer or neither: a
    launcher creates it for its children); ``Broadcast.writer(name)`` and
    ``Broadcast.reader(name, index)`` attach the two roles. One instance per role and
    process, used by one thread at a time.
    """

    def __init__(self, segment: Segment, reader: int | None, spin_s: float) -> None:
        buf = segment.buf
        magic, version, capacity, num_readers, _ = (ctypes.c_uint64 * 5).from_buffer(buf, 0)
        header = _header_size(num_readers)
        if magic != MAGIC or version != VERSION or header + capacity > segment.size:
            segment.close()
            raise ValueError(f"{segment.name} is not a version {VERSION} broadcast ring")
        if reader is not None and not 0 <= reader < num_readers:
            segment.close()
            raise ValueError(f"{segment.name} has {num_readers} readers, not a reader {reader}")
        self.segment, self.name = segment, segment.name
        self.capacity, self.num_readers, self.index = capacity, num_readers, reader
        self.spin_s = self.spin_budget_s = spin_s
        self.num_sleeps = self.num_missed_wakeups = 0
        self._header = header
        self._buf = buf
        self._lens = (ctypes.c_uint64 * (capacity // 8)).from_buffer(buf, header)
        self._wcur = ctypes.c_uint64.from_buffer(buf, _WCUR)
        self._skip = ctypes.c_uint64.from_buffer(buf, _SKIP)
        self._wwait = ctypes.c_uint64.from_buffer(buf, _WWAIT)
        self._writer_pid = ctypes.c_uint64.from_buffer(buf, 32)
        bases = [_READERS + _READER_SIZE * i for i in range(num_readers)]
        self._rcurs = [ctypes.c_uint64.from_buffer(buf, b) for b in bases]
        self._rwaits = [ctypes.c_uint64.from_buffer(buf, b + 64) for b in bases]
        self._rpids = [ctypes.c_uint64.from_buffer(buf, b + 72) for b in bases]
        self._sems: list[posix_ipc.Semaphore] = []
        opening = create_semaphore if segment.owner else open_semaphore
        try:
            self._space_sem = opening(self.name + ".s")
            self._sems.append(self._space_sem)
            self._data_sems = []
            for i in range(num_readers):
                self._data_sems.append(opening(f"{self.name}.d{i}"))
                self._sems.append(self._data_sems[-1])
        except BaseException:
            for sem in self._sems:
                close_semaphore(sem, segment.owner)
            raise
        self._w = self._wcur.value  # the writer's own cursor
        self._slowest_seen = min((c.value for c in self._rcurs), default=self._w)
        self._r = self._rcurs[reader].value if reader is not None else 0
        self._w_seen = self._r
        self._skip_seen = self._skip.value

    @classmethod
    def create(
        cls,
        engine_id: str,
        purpose: str,
        capacity: int,
        num_readers: int,
        *,
        spin_s: float = SPIN_S,
    ) -> Broadcast:
        """Create a ring of ``capacity`` bytes of records (rounded up to 64) for
        ``num_readers`` readers; the creator becomes the writer until another attaches as
        one."""
        capacity = -(-capacity // 64) * 64
        if capacity < 64 or not 1 <= num_readers <= MAX_READERS:
            raise ValueError(f"bad broadcast ring: {capacity} bytes, {num_readers} readers")
        segment = Segment.create(engine_id, purpose, _header_size(num_readers) + capacity)
        init = [MAGIC, VERSION, capacity, num_readers, os.getpid()]
        (ctypes.c_uint64 * 5).from_buffer(segment.buf, 0)[:] = init
        ctypes.c_uint64.from_buffer(segment.buf, _SKIP).value = NO_SKIP
        try:
            return cls(segment, None, spin_s)
        except BaseException:
            segment.close()
            raise

    @classmethod
    def writer(cls, name: str, *, spin_s: float = SPIN_S) -> Broadcast:
        """Attach as the (one) writer: readers waiting on it watch this process from now."""
        ring = cls(Segment.attach(name), None, spin_s)
        ring._writer_pid.value = os.getpid()
        return ring

    @classmethod
    def reader(cls, name: str, index: int, *, spin_s: float = SPIN_S) -> Broadcast:
        """Attach as reader ``index`` (one process per index): the writer watches this
        process from now."""
        ring = cls(Segment.attach(name), index, spin_s)
        ring._rpids[index].value = os.getpid()
        return ring

    @property
    def max_frame_size(self) -> int:
        return self.capacity - 8

    # -- writer ---------------------------------------------------------------------------

    def put(self, frame: Frame, timeout: float | None = None) -> None:
        """Append one frame for every reader, blocking while the slowest has not freed the
        room. Raises ValueError if it can never fit, TimeoutError if no room appeared in
        ``timeout`` seconds, :class:`PeerGone` if a reader it waits for died."""
        n = frame.nbytes if type(frame) is memoryview else len(frame)
        w, need, skip = place(self._w, n, self.capacity, self.name)
        if need > self._slowest_seen:
            self._reserve(need, timeout)
        pos = w % self.capacity
        self._lens[pos >> 3] = n
        start = self._header + 8 + pos
        self._buf[start : start + n] = frame
        if skip >= 0:  # (as in Ring: a copy that raised leaves the ring as it was)
            self._skip.value = skip
        w += (n + 15) & ~7
        self._w = w
        self._wcur.value = w  # publish to every reader at once
        for flag, sem in zip(self._rwaits, self._data_sems, strict=True):
            if flag.value:
                sem.release()

    def _reserve(self, read: int, timeout: float | None) -> None:
        """Wait until every reader's cursor reaches ``read`` (one at a time: cursors only
        grow, so a reader past it stays past it)."""
        deadline = _deadline(timeout)
        for i, cursor in enumerate(self._rcurs):
            while cursor.value < read:
                pid = self._rpids[i].value
                if pid and not running(pid):
                    raise PeerGone(f"{self.name}: reader {i} (pid {pid}) died")
                slice_end = min(deadline, perf_counter() + PEER_CHECK_S)
                got = wait_until(cursor, read, self._wwait, self._space_sem, self, slice_end)
                if got < 0 and perf_counter() >= deadline:
                    raise TimeoutError(f"{self.name}: full (reader {i} is behind)")
        self._slowest_seen = min(c.value for c in self._rcurs)

    # -- reader ---------------------------------------------------------------------------

    def get(self, timeout: float | None = None) -> bytes:
        """The next frame (a copy), blocking while there is none. Raises TimeoutError when
        none came in ``timeout`` seconds, :class:`PeerGone` when the writer died."""
        assert self.index is not None, "get() is a reader's"
        r = self._r
        if r == self._w_seen or r == self._skip_seen:
            r = self._seek(timeout)
        pos = r % self.capacity
        n = self._lens[pos >> 3]
        start = self._header + 8 + pos
        frame = self._buf[start : start + n]
        r += (n + 15) & ~7
        self._r = r
        self._rcurs[self.index].value = r  # frees the record for the writer (if last)
        if self._wwait.value:
            self._space_sem.release()
        return frame

    def _seek(self, timeout: float | None) -> int:
        """Wait for a record and jump over a skipped lap end; its cursor."""
        r = self._r
        if r == self._w_seen:
            w = self._wcur.value
            deadline = _deadline(timeout)
            flag, sem = self._rwaits[self.index], self._data_sems[self.index]  # type: ignore[index]
            while w == r:
                pid = self._writer_pid.value
                if pid and not running(pid):
                    raise PeerGone(f"{self.name}: the writer (pid {pid}) died")
                slice_end = min(deadline, perf_counter() + PEER_CHECK_S)
                w = wait_until(self._wcur, r + 8, flag, sem, self, slice_end)
                if w < 0:
                    if perf_counter() >= deadline:
                        raise TimeoutError(f"{self.name}: empty")
                    w = r
            self._w_seen = w
            self._skip_seen = self._skip.value
        if r == self._skip_seen:
            r += self.capacity - r % self.capacity
            self._r = r
        return r

    # -- both -----------------------------------------------------------------------------

    def close(self) -> None:
        """Detach; the creator also unlinks the segment and semaphores. Idempotent."""
        if self._lens is None:
            return
        self._lens = self._wcur = self._skip = self._wwait = None  # type: ignore[assignment]
        self._writer_pid = None  # type: ignore[assignment]
        self._rcurs, self._rwaits, self._rpids = [], [], []
        try:
            self.segment.close()
        finally:
            for sem in self._sems:
                with contextlib.suppress(Exception):
                    close_semaphore(sem, self.segment.owner)

    def __enter__(self) -> Broadcast:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Broadcast({self.name!r}, capacity={self.capacity}, readers={self.num_readers})"


def running(pid: int) -> bool:
    """Whether process ``pid`` runs: exists and is not a zombie (a killed child stays one
    until its parent reaps it, and signalling it still succeeds)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def _deadline(timeout: float | None) -> float:
    return float("inf") if timeout is None else perf_counter() + timeout
