"""Engine fixtures: every engine a test starts is stopped, and must leave nothing behind."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest

import mpengine


def leftovers(engine_id: str) -> list[str]:
    marker = f"mpe.{engine_id}."
    return sorted(e for e in os.listdir("/dev/shm") if e.removeprefix("sem.").startswith(marker))


@pytest.fixture(scope="module")
def start_engine() -> Iterator[Callable[..., mpengine.Engine]]:
    """``start_engine(model=..., **config)``: launch; shut down and check for leaks after."""
    engines: list[mpengine.Engine] = []

    def start(**kwargs) -> mpengine.Engine:
        kwargs.setdefault("engine_id", "e" + uuid.uuid4().hex[:8])
        kwargs.setdefault("startup_timeout", 120.0)
        engine = mpengine.launch(**kwargs)
        engines.append(engine)
        return engine

    yield start
    problems = []
    for engine in engines:
        engine.shutdown()
        if left := leftovers(engine.config.engine_id):
            problems.append(f"{engine.config.engine_id}: shm left behind: {left}")
        if os.path.exists(engine.runtime_dir):
            problems.append(f"runtime dir left behind: {engine.runtime_dir}")
    assert not problems, problems
