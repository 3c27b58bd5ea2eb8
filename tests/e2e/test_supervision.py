"""Killing any one stage with SIGKILL fails in-flight requests with EngineDeadError within
2 s (no hang), stops the other stages, and leaves nothing in /dev/shm or on disk."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import mpengine
from mpengine.protocol import SamplingParams
from tests.e2e.conftest import leftovers


@pytest.mark.parametrize("stage", ["scheduler", "executor", "output"])
def test_killed_stage_fails_requests_and_cleans_up(stage, start_engine):
    engine = start_engine(model="tiny", num_gpu_blocks_override=256)
    client = engine.client()
    local = mpengine.Client(engine.address)  # also a client that knows nothing of the launcher
    errors: dict[str, BaseException] = {}
    started = threading.Barrier(3, timeout=60)

    def run(name: str, c: mpengine.Client) -> None:
        stream = c.stream("x " * 20, SamplingParams(max_tokens=2000, ignore_eos=True))
        try:
            next(stream)
            started.wait()
            for _ in stream:
                pass
        except BaseException as exc:
            errors[name] = exc

    threads = [threading.Thread(target=run, args=(n, c)) for n, c in (("a", client), ("b", local))]
    for t in threads:
        t.start()
    started.wait()
    pids = engine.pids
    os.kill(pids[stage], signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a request hung after the engine died"
    elapsed = time.monotonic() - killed_at
    assert set(errors) == {"a", "b"}
    assert all(isinstance(e, mpengine.EngineDeadError) for e in errors.values()), errors
    assert elapsed < 2.0, f"EngineDeadError took {elapsed:.2f} s"
    with pytest.raises(mpengine.EngineDeadError):
        client.generate("again", SamplingParams(max_tokens=2))
    # The supervisor stops the rest and removes segments and socket files.
    assert engine.stopped.wait(10), "the supervisor did not stop the engine"
    for name, pid in pids.items():
        assert not _alive(pid), f"{name} still running"
    assert engine.dead and stage in engine.dead
    assert leftovers(engine.config.engine_id) == []
    assert not os.path.exists(engine.runtime_dir)
    client.close()
    local.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes; the launcher reaps its children.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"
