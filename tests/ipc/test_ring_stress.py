"""Rings and lockstep counters across a process boundary.

The parent is the consumer; children are started as ``python this_file.py <role> ...``
(see ``main`` at the bottom), so they need nothing from pytest's import machinery.
"""

from __future__ import annotations

import os
import select
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from shm import Lockstep, Ring, sweep_stale

HEADER = struct.Struct("<QII")  # sequence number, crc32 of the payload, payload length
MAX_PAYLOAD = 65536
STEP_TIMEOUT_S = 30.0  # any single wait longer than this is a hang: fail loudly

Spawn = Callable[..., subprocess.Popen[str]]


def frame_sizes(rng: np.random.Generator, count: int) -> np.ndarray:
    """Log-uniform payload sizes in [0, MAX_PAYLOAD]: small frames dominate (as in the
    engine) and the run stays short, yet every size is possible."""
    sizes = np.exp(rng.uniform(0.0, np.log(MAX_PAYLOAD + 2), count)).astype(np.int64) - 1
    return np.minimum(sizes, MAX_PAYLOAD)


def produce(ring: Ring, count: int | None, seed: int) -> None:
    """Put ``count`` frames (None: until killed): header + a random slice of a pool."""
    rng = np.random.default_rng(seed)
    pool = memoryview(rng.bytes(4 * MAX_PAYLOAD))
    buf = bytearray(HEADER.size + MAX_PAYLOAD)
    out = memoryview(buf)
    seq = 0
    while count is None or seq < count:
        todo = 1 << 16 if count is None else min(1 << 16, count - seq)
        sizes = frame_sizes(rng, todo)
        if seq == 0:  # the extremes, early
            sizes[:4] = [0, MAX_PAYLOAD, 1, MAX_PAYLOAD - 1][:todo]
        starts = rng.integers(0, 3 * MAX_PAYLOAD, todo)
        for n, start in zip(sizes.tolist(), starts.tolist(), strict=True):
            payload = pool[start : start + n]
            HEADER.pack_into(buf, 0, seq, zlib.crc32(payload), n)
            out[HEADER.size : HEADER.size + n] = payload
            ring.put(out[: HEADER.size + n], timeout=STEP_TIMEOUT_S)
            seq += 1


def check(frame: bytes | memoryview, seq: int) -> None:
    got_seq, crc, n = HEADER.unpack_from(frame)
    assert got_seq == seq, f"expected frame {seq}, got {got_seq}: lost or reordered"
    assert len(frame) == HEADER.size + n, f"frame {seq}: length {len(frame)}, header says {n}"
    assert zlib.crc32(frame[HEADER.size :]) == crc, f"frame {seq}: payload corrupted"


def consume(ring: Ring, count: int, proc: subprocess.Popen[str]) -> None:
    """Get and check ``count`` frames, alternating copies and zero-copy views."""
    for seq in range(count):
        if seq & 1:
            with wait_for(ring.get_view, proc) as mv:
                check(mv, seq)
        else:
            check(wait_for(ring.get, proc), seq)


def wait_for(get: Callable[[float], object], proc: subprocess.Popen[str]) -> object:
    """``get(timeout)``, failing fast if the peer process died, loudly if it hangs."""
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while True:
        try:
            return get(1.0)  # type: ignore[return-value]
        except TimeoutError:
            if proc.poll() is not None:
                pytest.fail(f"peer exited with {proc.returncode}:\n{child_errors(proc)}")
            if time.monotonic() > deadline:
                pytest.fail(f"no progress in {STEP_TIMEOUT_S} s")


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """Start ``python this_file.py *args``; every child is killed and reaped at teardown."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: object) -> subprocess.Popen[str]:
        err = open(tmp_path / f"child{len(procs)}.err", "w")  # noqa: SIM115  (closed below)
        proc = subprocess.Popen(
            [sys.executable, __file__, *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        proc.err_file = err  # type: ignore[attr-defined]
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=STEP_TIMEOUT_S)
        proc.err_file.close()  # type: ignore[attr-defined]
        assert proc.stdout is not None
        proc.stdout.close()


def child_errors(proc: subprocess.Popen[str]) -> str:
    err = proc.err_file  # type: ignore[attr-defined]
    err.flush()
    return Path(err.name).read_text()


def finish(proc: subprocess.Popen[str]) -> None:
    """Wait for a child that should exit cleanly; show its stderr if it did not."""
    code = proc.wait(timeout=STEP_TIMEOUT_S)
    assert code == 0, f"child exited with {code}:\n{child_errors(proc)}"


def read_line(proc: subprocess.Popen[str]) -> str:
    """The child's first line of output (it must print only one: the pipe is buffered)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], STEP_TIMEOUT_S)
    line = proc.stdout.readline().strip() if ready else ""
    assert line, f"child printed nothing:\n{child_errors(proc)}"
    return line


def shm_files(engine_id: str) -> list[str]:
    marker = f"mpe.{engine_id}."
    return sorted(e for e in os.listdir("/dev/shm") if e.removeprefix("sem.").startswith(marker))


@pytest.mark.slow
def test_million_frames_across_processes(shm_engine_id: str, spawn: Spawn) -> None:
    count = 1_000_000
    with Ring.create(shm_engine_id, "stress", 256 << 10) as ring:
        proc = spawn("produce", ring.name, count, 1234, ring.spin_s)
        consume(ring, count, proc)
        finish(proc)
        assert ring.try_get() is None
        print(f"consumer sleeps {ring.num_sleeps}, missed wake-ups {ring.num_missed_wakeups}")


def test_sleep_path_only(shm_engine_id: str, spawn: Spawn) -> None:
    """No spinning: every wait sleeps, so every hand-over goes through the semaphores."""
    count = 20_000
    with Ring.create(shm_engine_id, "sleepy", 128 << 10, spin_s=0.0) as ring:
        proc = spawn("produce", ring.name, count, 99, 0.0)
        consume(ring, count, proc)
        finish(proc)
        assert ring.num_sleeps > 0
        print(f"consumer sleeps {ring.num_sleeps}, missed wake-ups {ring.num_missed_wakeups}")


@pytest.mark.parametrize("spin_s", [0.0, 50e-6])
def test_lockstep_ping_pong(shm_engine_id: str, spawn: Spawn, spin_s: float) -> None:
    rounds = 5_000
    with (
        Lockstep.create(shm_engine_id, "fwd", spin_s=spin_s) as fwd,
        Lockstep.create(shm_engine_id, "ack", spin_s=spin_s) as ack,
    ):
        proc = spawn("ping", fwd.name, ack.name, rounds, spin_s)
        for k in range(1, rounds + 1):
            # The writer cannot run ahead of the acknowledgement: we see exactly k.
            assert wait_for(lambda t, k=k: fwd.wait_at_least(k, t), proc) == k
            ack.advance_to(k)
        finish(proc)
        print(f"reader sleeps {fwd.num_sleeps}, missed wake-ups {fwd.num_missed_wakeups}")


def test_lockstep_free_running_writer(shm_engine_id: str, spawn: Spawn) -> None:
    steps = 200_000
    with Lockstep.create(shm_engine_id, "done") as done:
        proc = spawn("advance", done.name, steps)
        last = 0
        for k in range(1, steps + 1):
            value = wait_for(lambda t, k=k: done.wait_at_least(k, t), proc)
            assert isinstance(value, int) and k <= value <= steps and value >= last
            last = value
        finish(proc)
        assert done.value == steps


def test_killed_producer_leaves_nothing_after_owner_close(shm_engine_id: str, spawn: Spawn) -> None:
    ring = Ring.create(shm_engine_id, "plan", 256 << 10)
    proc = spawn("produce", ring.name, "forever", 7, ring.spin_s)
    consume(ring, 1000, proc)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=STEP_TIMEOUT_S) == -signal.SIGKILL
    ring.close()
    assert shm_files(shm_engine_id) == []


def test_killed_owner_leaves_nothing_after_sweep(shm_engine_id: str, spawn: Spawn) -> None:
    proc = spawn("own-and-produce", shm_engine_id)
    ring_name, counter_name = read_line(proc).split()
    ring = Ring.attach(ring_name)
    counter = Lockstep.attach(counter_name)
    consume(ring, 1000, proc)
    assert counter.wait_at_least(1, timeout=STEP_TIMEOUT_S) >= 1
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=STEP_TIMEOUT_S) == -signal.SIGKILL
    left = shm_files(shm_engine_id)
    assert len(left) == 5, left  # ring + 2 semaphores, counter + 1 semaphore
    assert sorted(sweep_stale(prefix=f"mpe.{shm_engine_id}.")) == left
    ring.close()
    counter.close()
    assert shm_files(shm_engine_id) == []


def test_owner_exiting_without_close_unlinks_at_exit(shm_engine_id: str, spawn: Spawn) -> None:
    proc = spawn("exit-without-close", shm_engine_id)
    assert read_line(proc).startswith("/mpe.")
    assert proc.wait(timeout=STEP_TIMEOUT_S) == 0
    assert shm_files(shm_engine_id) == []


def main(role: str, *args: str) -> None:
    if role == "produce":
        name, count, seed, spin_s = args
        with Ring.attach(name, spin_s=float(spin_s)) as ring:
            produce(ring, None if count == "forever" else int(count), int(seed))
    elif role == "own-and-produce":
        ring = Ring.create(args[0], "plan", 256 << 10)
        counter = Lockstep.create(args[0], "done")
        print(ring.name, counter.name, flush=True)
        counter.advance_to(1)
        produce(ring, None, 7)
    elif role == "ping":
        fwd_name, ack_name, rounds, spin_s = args
        with (
            Lockstep.attach(fwd_name, spin_s=float(spin_s)) as fwd,
            Lockstep.attach(ack_name, spin_s=float(spin_s)) as ack,
        ):
            for k in range(1, int(rounds) + 1):
                fwd.advance_to(k)
                ack.wait_at_least(k, timeout=STEP_TIMEOUT_S)
    elif role == "advance":
        with Lockstep.attach(args[0]) as done:
            for k in range(1, int(args[1]) + 1):
                done.advance_to(k)
    elif role == "exit-without-close":
        ring = Ring.create(args[0], "plan", 4096)
        Lockstep.create(args[0], "done")
        print(ring.name, flush=True)
    else:
        raise SystemExit(f"unknown role {role}")


if __name__ == "__main__":
    main(*sys.argv[1:])
