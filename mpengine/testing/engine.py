"""Helpers for driving a running engine in tests and tools."""

from __future__ import annotations

import contextlib
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

from mpengine.client.sync_client import Client
from mpengine.protocol import EngineStats


def wait_until(
    client: Client, done: Callable[[EngineStats], bool], timeout: float = 10.0, what: str = ""
) -> EngineStats:
    """Poll the engine's stats until ``done(stats)``; return them. Raises TimeoutError
    (naming ``what`` and the last stats) if that takes more than ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if done(stats):
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine not {what or 'there'} after {timeout} s: {stats}")
        time.sleep(0.01)


def wait_idle(client: Client, timeout: float = 10.0) -> EngineStats:
    """Poll the scheduler's stats until it has no request and no step in flight; return them.
    (Blocks of a finished request are freed once its last planned step is processed.)
    Raises TimeoutError if the engine is still busy after ``timeout`` seconds."""

    def idle(stats: EngineStats) -> bool:
        busy = stats.num_running + stats.num_waiting + stats.num_preempted
        return busy == 0 and stats.done == stats.step

    return wait_until(client, idle, timeout, "idle")


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port P with P + 1 also free on ``host`` (a ``tcp://`` engine binds both: requests
    and outputs). Raises OSError when ``host`` cannot be bound at all (no IPv6)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(50):
        with socket.socket(family) as a, socket.socket(family) as b:
            a.bind((host, 0))
            port = a.getsockname()[1]
            try:
                b.bind((host, port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no two consecutive free ports on {host}")


@contextlib.contextmanager
def client_process(script: str, ready: str, timeout: float = 60.0) -> Iterator[None]:
    """Run ``script`` (a client of some engine) in a Python process of its own until it
    prints ``ready``, then the body; the process is killed when the body ends (a client
    that dies without closing). Raises AssertionError if ``ready`` does not come in
    ``timeout`` seconds."""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        readable, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline().strip() if readable else b""
        assert line == ready.encode(), f"the client process printed {line!r}, not {ready!r}"
        yield
    finally:
        proc.kill()
        proc.wait(10)
