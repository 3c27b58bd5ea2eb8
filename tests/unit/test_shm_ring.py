"""shm.ring in one process: layout edge cases, timeouts, views, close, and a model check."""

from __future__ import annotations

import os
import random
import stat
import time
from collections import deque
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shm import Ring, Segment

POOL = random.Random(0).randbytes(1 << 17)


def payload(i: int, n: int) -> bytes:
    """A frame whose bytes depend on its index and offset (catches misplaced copies)."""
    start = (i * 7919) % (len(POOL) - n) if n < len(POOL) else 0
    return POOL[start : start + n]


def record_size(n: int) -> int:
    return 8 + (n + 7) // 8 * 8


@pytest.fixture
def ring(shm_engine_id: str) -> Iterator[Ring]:
    with Ring.create(shm_engine_id, "ring", 256) as r:
        yield r


def test_objects_named_and_mode_0600(ring: Ring) -> None:
    assert ring.capacity == 256 and ring.max_frame_size == 248
    base = ring.name.lstrip("/")
    for entry in (base, f"sem.{base}.d", f"sem.{base}.s"):
        assert stat.S_IMODE(os.stat(f"/dev/shm/{entry}").st_mode) == 0o600, entry


def test_round_trip_between_two_instances(ring: Ring) -> None:
    with Ring.attach(ring.name) as consumer:
        for i, n in enumerate([0, 1, 7, 8, 9, 100, 248]):
            ring.put(payload(i, n), timeout=1)
            assert consumer.get(timeout=1) == payload(i, n)
        assert consumer.try_get() is None


def test_accepts_bytearray_and_memoryviews(ring: Ring) -> None:
    ring.put(bytearray(b"abc"))
    ring.put(memoryview(b"xyz12345")[2:6])
    array = np.arange(10, dtype=np.float32)
    ring.put(memoryview(array))
    assert ring.get(1) == b"abc"
    assert ring.get(1) == b"z123"
    assert np.array_equal(np.frombuffer(ring.get(1), dtype=np.float32), array)


def test_capacity_rounds_up_and_must_be_positive(shm_engine_id: str) -> None:
    with Ring.create(shm_engine_id, "odd", 100) as r:
        assert r.capacity == 128
    with pytest.raises(ValueError):
        Ring.create(shm_engine_id, "zero", 0)


def test_empty_frames_take_eight_bytes(ring: Ring) -> None:
    for _ in range(ring.capacity // 8):
        ring.put(b"", timeout=0)
    assert ring.used_bytes == ring.capacity
    with pytest.raises(TimeoutError):
        ring.put(b"", timeout=0)
    for _ in range(ring.capacity // 8):
        assert ring.get(timeout=0) == b""
    assert ring.try_get() is None


def test_wrap_around_keeps_frames_contiguous_and_intact(ring: Ring) -> None:
    sizes = [1, 50, 100, 13, 200, 0, 77, 248, 3, 120, 99, 64] * 20
    inflight: deque[bytes] = deque()
    for i, n in enumerate(sizes):
        frame = payload(i, n)
        while True:
            try:
                ring.put(frame, timeout=0)
                break
            except TimeoutError:  # full: drain one and retry; never a partial frame
                assert ring.get(timeout=0) == inflight.popleft()
        inflight.append(frame)
        if i % 3 == 0:
            with ring.get_view(timeout=0) as mv:
                assert mv == inflight.popleft()
    while inflight:
        assert ring.get(timeout=0) == inflight.popleft()
    assert ring.try_get() is None


def test_exact_fit_to_lap_end_then_offset_zero(ring: Ring) -> None:
    ring.put(b"a" * 100)  # record of 8 + 104 = 112 bytes
    assert ring.get(0) == b"a" * 100
    ring.put(b"b" * 136)  # 8 + 136 = 144: ends exactly at the lap end, no skip
    ring.put(b"c" * 104)  # starts the next lap at offset 0
    assert ring.used_bytes == 144 + 112
    assert ring.get(0) == b"b" * 136
    assert ring.get(0) == b"c" * 104


def test_largest_frame_fits_an_empty_ring_at_any_offset(ring: Ring) -> None:
    for offset_frame in (b"", b"x" * 30, b"y" * 120):
        ring.put(offset_frame, timeout=0)
        assert ring.get(timeout=0) == offset_frame
        big = payload(3, ring.max_frame_size)
        ring.put(big, timeout=0)  # skips the rest of the lap, no waiting on the consumer
        assert ring.used_bytes >= ring.capacity
        with pytest.raises(TimeoutError):
            ring.put(b"", timeout=0)
        assert ring.get(timeout=0) == big


def test_full_ring_put_times_out_then_succeeds_after_get(ring: Ring) -> None:
    ring.put(b"1" * 120)
    ring.put(b"2" * 100)
    started = time.perf_counter()
    with pytest.raises(TimeoutError):
        ring.put(b"3" * 100, timeout=0.05)
    assert time.perf_counter() - started >= 0.05
    assert ring.get(timeout=0) == b"1" * 120
    ring.put(b"3" * 100, timeout=0)
    assert [ring.get(0), ring.get(0)] == [b"2" * 100, b"3" * 100]


def test_get_times_out_on_empty_ring_without_consuming(ring: Ring) -> None:
    started = time.perf_counter()
    with pytest.raises(TimeoutError):
        ring.get(timeout=0.05)
    assert time.perf_counter() - started >= 0.05
    with pytest.raises(TimeoutError):
        ring.get_view(timeout=0.01)
    assert ring.try_get() is None
    ring.put(b"late")
    assert ring.get(timeout=0) == b"late"


def test_too_big_frame_fails_at_once_even_when_full(ring: Ring) -> None:
    ring.put(b"x" * 200)
    started = time.perf_counter()
    with pytest.raises(ValueError, match="exceeds"):
        ring.put(b"x" * (ring.max_frame_size + 1))
    assert time.perf_counter() - started < 0.5
    assert ring.get(timeout=0) == b"x" * 200


def test_view_is_zero_copy_read_only_and_scoped(ring: Ring) -> None:
    ring.put(b"hello world")
    with ring.get_view(timeout=0) as mv:
        assert mv.readonly and mv == b"hello world"
        assert mv.obj is ring.segment.buf  # a view of the shared mapping, not a copy
        assert ring.used_bytes == record_size(11)  # not consumed yet
        with pytest.raises(RuntimeError):
            ring.get_view(timeout=0)
    assert ring.used_bytes == 0
    with pytest.raises(ValueError):
        bytes(mv)  # released on exit


def test_reads_while_a_view_is_open_are_refused(ring: Ring) -> None:
    """get/try_get inside a view returned the viewed frame again, then lost the next."""
    ring.put(b"first")
    ring.put(b"second")
    with ring.get_view(timeout=0) as mv:
        for read in (lambda: ring.get(timeout=0), ring.try_get, lambda: ring.get_view(0)):
            with pytest.raises(RuntimeError, match="a view is still open"):
                read()
        assert mv == b"first"
    assert ring.get(timeout=0) == b"second"


def test_a_put_whose_copy_fails_at_a_lap_end_publishes_nothing(ring: Ring) -> None:
    """A frame that cannot be copied (a non-contiguous view) where the ring wraps left the
    lap end marked skipped: the next frame was lost and the reader passed the writer."""
    ring.put(b"a" * 100)
    assert ring.get(timeout=0) == b"a" * 100
    strided = memoryview(bytes(400))[::2]  # 200 bytes, not contiguous: does not fit the lap
    with pytest.raises((BufferError, ValueError, TypeError)):
        ring.put(strided, timeout=0)
    with pytest.raises(TypeError):
        ring.put("a str", timeout=0)  # type: ignore[arg-type]
    assert ring.used_bytes == 0 and ring.try_get() is None
    ring.put(b"b" * 30, timeout=0)  # fits this lap: the reader skipped to the next one
    assert ring.get(timeout=0) == b"b" * 30
    ring.put(b"c" * 120, timeout=0)  # wraps
    assert ring.get(timeout=0) == b"c" * 120
    assert ring.try_get() is None and ring.used_bytes == 0


def test_view_block_that_raises_still_consumes_the_frame(ring: Ring) -> None:
    ring.put(b"poison")
    ring.put(b"next")
    with pytest.raises(KeyError), ring.get_view(timeout=0):
        raise KeyError("decode failed")
    assert ring.get(timeout=0) == b"next"


def test_close_unlinks_only_for_the_creator(shm_engine_id: str) -> None:
    ring = Ring.create(shm_engine_id, "ring", 256)
    base = ring.name.lstrip("/")
    files = [base, f"sem.{base}.d", f"sem.{base}.s"]
    other = Ring.attach(ring.name)
    other.put(b"abc")
    with other.get_view(timeout=0):
        pass
    other.put(b"open view at close")
    other.get_view(timeout=0)
    other.close()
    other.close()
    assert all(os.path.exists(f"/dev/shm/{f}") for f in files)
    ring.close()
    ring.close()
    assert not any(os.path.exists(f"/dev/shm/{f}") for f in files)
    with pytest.raises(FileNotFoundError):
        Ring.attach(ring.name)


def test_attach_rejects_a_segment_that_is_not_a_ring(shm_engine_id: str) -> None:
    with Segment.create(shm_engine_id, "plain", 4096) as seg, pytest.raises(ValueError):
        Ring.attach(seg.name)


class RingModel:
    """The ring's byte accounting, written from its docstring (independent of the code)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.write = self.read = 0
        self.frames: deque[tuple[int, bytes]] = deque()  # (end cursor, frame)

    def put(self, frame: bytes) -> bool:
        size, cap = record_size(len(frame)), self.capacity
        lap_left = cap - self.write % cap
        if size <= lap_left:
            start, need = self.write, self.write + size - cap
        else:
            start = self.write + lap_left
            need = min(self.write, start + size - cap)
        if need > self.read:
            return False
        self.write = start + size
        self.frames.append((self.write, frame))
        return True

    def get(self) -> bytes | None:
        if not self.frames:
            return None
        self.read, frame = self.frames.popleft()
        return frame


_purposes = iter(range(10**9))


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(capacity=st.sampled_from([64, 128, 192, 512]), data=st.data())
def test_matches_model_under_random_interleavings(
    shm_engine_id: str, capacity: int, data: st.DataObject
) -> None:
    ops = data.draw(
        st.lists(
            st.one_of(
                st.integers(0, capacity - 8).map(lambda n: ("put", n)),
                st.sampled_from([("get", 0), ("view", 0), ("try", 0)]),
            ),
            max_size=120,
        )
    )
    model = RingModel(capacity)
    with (
        Ring.create(shm_engine_id, f"p{next(_purposes)}", capacity) as producer,
        Ring.attach(producer.name) as consumer,
    ):
        for i, (op, n) in enumerate(ops):
            if op == "put":
                frame = payload(i, n)
                was_empty = not model.frames
                expect_ok = model.put(frame)
                assert expect_ok or not was_empty, "an empty ring accepts any frame"
                try:
                    producer.put(frame, timeout=0)
                    ok = True
                except TimeoutError:
                    ok = False
                assert ok == expect_ok
            else:
                expected = model.get()
                if op == "view" and expected is not None:
                    with consumer.get_view(timeout=0) as mv:
                        assert mv == expected
                elif op == "get" and expected is not None:
                    assert consumer.get(timeout=0) == expected
                else:
                    assert consumer.try_get() == expected
            assert producer.used_bytes == model.write - model.read
            assert sum(record_size(len(f)) for _, f in model.frames) <= capacity
