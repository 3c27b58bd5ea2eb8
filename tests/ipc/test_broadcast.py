"""The one-writer, N-reader ring (``shm.broadcast``): semantics in one process, then a
stress test with reader processes, and peers that die.

Children run as ``python this_file.py <role> ...`` (see ``main`` at the bottom).
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shm.broadcast import PEER_CHECK_S, Broadcast, PeerGone

HEADER = struct.Struct("<QII")  # sequence number, crc32 of the payload, payload length
MAX_PAYLOAD = 20000
STEP_TIMEOUT_S = 30.0


def frame(seq: int, rng: np.random.Generator, pool: bytes) -> bytes:
    n = int(min(MAX_PAYLOAD, np.exp(rng.uniform(0, np.log(MAX_PAYLOAD + 2))) - 1))
    start = int(rng.integers(0, len(pool) - n + 1))
    payload = pool[start : start + n]
    return HEADER.pack(seq, zlib.crc32(payload), n) + payload


def check(data: bytes, seq: int) -> None:
    got, crc, n = HEADER.unpack_from(data)
    assert got == seq, f"expected frame {seq}, got {got}: lost or reordered"
    assert len(data) == HEADER.size + n and zlib.crc32(data[HEADER.size :]) == crc


@pytest.fixture
def ring(shm_engine_id: str) -> Iterator[Broadcast]:
    with Broadcast.create(shm_engine_id, "bcast", 512, 3) as r:
        yield r


def test_every_reader_gets_every_frame_in_order(ring: Broadcast) -> None:
    readers = [Broadcast.reader(ring.name, i) for i in range(3)]
    try:
        for round_ in range(40):  # many laps of the 512-byte ring, sizes across the lap end
            frames = [bytes([round_ % 256]) * ((round_ * 7 + k * 13) % 120) for k in range(3)]
            for f in frames:
                ring.put(f, timeout=1.0)
            for reader in readers:
                assert [reader.get(timeout=1.0) for _ in frames] == frames
    finally:
        for reader in readers:
            reader.close()


def test_the_writer_waits_for_the_slowest_reader(ring: Broadcast) -> None:
    fast, slow = Broadcast.reader(ring.name, 0), Broadcast.reader(ring.name, 1)
    other = Broadcast.reader(ring.name, 2)
    try:
        big = b"x" * 200
        ring.put(big, timeout=0)
        ring.put(big, timeout=0)
        for reader in (fast, other):
            assert reader.get(timeout=0) == big and reader.get(timeout=0) == big
        with pytest.raises(TimeoutError, match="reader 1 is behind"):
            ring.put(big, timeout=0.05)  # the room is free for two readers, not the third
        assert slow.get(timeout=0) == big
        ring.put(big, timeout=0)  # one record freed by every reader: room again
        assert fast.get(timeout=0) == big
        with pytest.raises(TimeoutError):
            fast.get(timeout=0)
        assert slow.get(timeout=0) == big and slow.get(timeout=0) == big
    finally:
        for reader in (fast, slow, other):
            reader.close()


def test_bad_frames_and_readers_are_refused(ring: Broadcast, shm_engine_id: str) -> None:
    with pytest.raises(ValueError, match="exceeds"):
        ring.put(b"x" * ring.capacity)
    with pytest.raises(ValueError, match="3 readers, not a reader 3"):
        Broadcast.reader(ring.name, 3)
    with pytest.raises(ValueError):
        Broadcast.create(shm_engine_id, "none", 512, 0)


def test_close_unlinks_only_for_the_creator(shm_engine_id: str) -> None:
    ring = Broadcast.create(shm_engine_id, "b", 256, 2)
    reader = Broadcast.reader(ring.name, 1)
    reader.close()
    assert any(ring.name.lstrip("/") in e for e in os.listdir("/dev/shm"))
    ring.close()
    ring.close()  # idempotent
    assert not any(ring.name.lstrip("/") in e for e in os.listdir("/dev/shm"))


# -- across processes -------------------------------------------------------------------------


@pytest.fixture
def children(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=STEP_TIMEOUT_S)


def start(procs: list[subprocess.Popen[str]], *args: object) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, __file__, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    procs.append(proc)
    return proc


def test_stress_three_reader_processes(
    shm_engine_id: str, children: list[subprocess.Popen[str]]
) -> None:
    """60,000 frames of 0-20,000 bytes through a 64 KiB ring to three readers of different
    speeds (one re-hashes each frame ten times), each checking order and contents."""
    count = 60_000
    with Broadcast.create(shm_engine_id, "stress", 1 << 16, 3) as ring:
        readers = [start(children, "read", ring.name, i, count, 1 + 9 * (i == 2)) for i in range(3)]
        rng = np.random.default_rng(7)
        pool = rng.bytes(3 * MAX_PAYLOAD)
        total = 0
        for seq in range(count):
            data = frame(seq, rng, pool)
            total = zlib.crc32(data, total)
            ring.put(data, timeout=STEP_TIMEOUT_S)
        for proc in readers:
            out, err = proc.communicate(timeout=STEP_TIMEOUT_S)
            assert proc.returncode == 0, err
            assert int(out.split()[0]) == total


@pytest.mark.parametrize("mode", ["killed", "exited"])
def test_a_dead_reader_is_found_by_its_pid(
    shm_engine_id: str, children: list[subprocess.Popen[str]], mode: str
) -> None:
    with Broadcast.create(shm_engine_id, "dead", 4096, 2) as ring:
        live = Broadcast.reader(ring.name, 0)
        try:
            proc = start(children, "attach", ring.name, 1, mode)
            assert proc.stdout is not None and proc.stdout.readline().strip() == "attached"
            if mode == "killed":  # not reaped: a zombie counts as dead
                proc.send_signal(signal.SIGKILL)
            else:
                proc.wait(timeout=STEP_TIMEOUT_S)
            for _ in range(4):  # the ring fills: reader 1 never reads
                ring.put(b"y" * 1000, timeout=0)
                live.get(timeout=0)
            started = time.monotonic()
            with pytest.raises(PeerGone, match=f"reader 1 \\(pid {proc.pid}\\) died"):
                ring.put(b"y" * 1000, timeout=STEP_TIMEOUT_S)
            assert time.monotonic() - started < 2 * PEER_CHECK_S + 1.0
        finally:
            live.close()


def test_a_reader_learns_that_the_writer_died(
    shm_engine_id: str, children: list[subprocess.Popen[str]]
) -> None:
    with Broadcast.create(shm_engine_id, "gone", 4096, 1) as ring:
        proc = start(children, "write-once", ring.name)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "attached"
        with Broadcast.reader(ring.name, 0) as reader:
            assert reader.get(timeout=STEP_TIMEOUT_S) == b"hello"
            proc.send_signal(signal.SIGKILL)
            with pytest.raises(PeerGone, match="the writer"):
                reader.get(timeout=STEP_TIMEOUT_S)


def main() -> None:
    role, name = sys.argv[1], sys.argv[2]
    if role == "read":
        index, count, work = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        total = 0
        with Broadcast.reader(name, index) as ring:
            for seq in range(count):
                data = ring.get(timeout=STEP_TIMEOUT_S)
                for _ in range(work):
                    check(data, seq)
                total = zlib.crc32(data, total)
        print(total, flush=True)
    elif role == "attach":
        ring = Broadcast.reader(name, int(sys.argv[3]))
        print("attached", flush=True)
        if sys.argv[4] == "killed":
            time.sleep(STEP_TIMEOUT_S)  # until killed
    elif role == "write-once":
        ring = Broadcast.writer(name)
        ring.put(b"hello")
        print("attached", flush=True)
        time.sleep(STEP_TIMEOUT_S)  # until killed
    else:
        raise SystemExit(f"unknown role {role}")


if __name__ == "__main__":
    main()
