"""shm.lockstep in one process: monotonic advances, waits, reader slots, close."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator

import pytest

from shm import Lockstep, Segment


@pytest.fixture
def counter(shm_engine_id: str) -> Iterator[Lockstep]:
    with Lockstep.create(shm_engine_id, "done") as c:
        yield c


def test_starts_at_zero_and_advances(counter: Lockstep) -> None:
    assert counter.value == 0
    counter.advance_to(1)
    counter.advance_to(5)  # steps may be skipped
    assert counter.value == 5
    with Lockstep.attach(counter.name) as reader:
        assert reader.value == 5
        assert reader.wait_at_least(3, timeout=0) == 5


def test_going_back_raises_and_equal_is_a_no_op(counter: Lockstep) -> None:
    counter.advance_to(4)
    counter.advance_to(4)
    assert counter.value == 4
    with pytest.raises(ValueError, match="cannot go back"):
        counter.advance_to(3)
    assert counter.value == 4


def test_writer_attached_later_continues_from_the_value(counter: Lockstep) -> None:
    counter.advance_to(7)
    with Lockstep.attach(counter.name) as writer:
        with pytest.raises(ValueError):
            writer.advance_to(6)
        writer.advance_to(8)
    assert counter.value == 8
    # A stale writer (attached before the value moved on) cannot move it back either.
    with Lockstep.attach(counter.name) as stale:
        counter.advance_to(20)
        with pytest.raises(ValueError, match="cannot go back from 20 to 10"):
            stale.advance_to(10)
    assert counter.value == 20


def test_wait_times_out_loudly(counter: Lockstep) -> None:
    started = time.perf_counter()
    with pytest.raises(TimeoutError, match="did not reach 1"):
        counter.wait_at_least(1, timeout=0.05)
    assert time.perf_counter() - started >= 0.05
    assert counter.num_sleeps >= 1
    with pytest.raises(TimeoutError):
        counter.wait_at_least(1, timeout=0)


def test_reader_slots(shm_engine_id: str) -> None:
    with Lockstep.create(shm_engine_id, "done", num_readers=3) as writer:
        base = writer.name.lstrip("/")
        for entry in (base, *(f"sem.{base}.r{i}" for i in range(3))):
            assert stat.S_IMODE(os.stat(f"/dev/shm/{entry}").st_mode) == 0o600
        with Lockstep.attach(writer.name, reader=2) as reader:
            assert reader.num_readers == 3 and reader.reader == 2
            writer.advance_to(2)
            assert reader.wait_at_least(2, timeout=1) == 2
        with pytest.raises(ValueError, match="reader slot"):
            Lockstep.attach(writer.name, reader=3)
    with pytest.raises(ValueError):
        Lockstep.create(shm_engine_id, "none", num_readers=0)


def test_close_unlinks_only_for_the_creator(shm_engine_id: str) -> None:
    counter = Lockstep.create(shm_engine_id, "done")
    base = counter.name.lstrip("/")
    files = [f"/dev/shm/{base}", f"/dev/shm/sem.{base}.r0"]
    Lockstep.attach(counter.name).close()
    assert all(os.path.exists(f) for f in files)
    counter.close()
    counter.close()
    assert not any(os.path.exists(f) for f in files)
    with pytest.raises(FileNotFoundError):
        Lockstep.attach(counter.name)


def test_attach_rejects_a_segment_that_is_not_a_counter(shm_engine_id: str) -> None:
    with Segment.create(shm_engine_id, "plain", 4096) as seg, pytest.raises(ValueError):
        Lockstep.attach(seg.name)
