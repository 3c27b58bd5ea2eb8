"""Shared pytest fixtures."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run (a run's verdict must not depend on
# its luck) and keep no database of past failures between runs; randomised searches belong
# in tools/ (soak runs), and a failure found there becomes an explicit example here.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.load_profile("deterministic")


@pytest.fixture
def shm_engine_id() -> Iterator[str]:
    """A fresh engine id for shm objects; after the test, removes and reports (as a failure)
    any segment or semaphore still named with it, whichever process created it."""
    engine_id = "t" + uuid.uuid4().hex[:10]
    yield engine_id
    marker = f"mpe.{engine_id}."
    leftovers = sorted(
        e for e in os.listdir("/dev/shm") if e.removeprefix("sem.").startswith(marker)
    )
    for entry in leftovers:
        os.unlink(os.path.join("/dev/shm", entry))
    assert not leftovers, f"shm objects left behind: {leftovers}"
