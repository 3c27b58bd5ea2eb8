"""Debug switches: the only environment variables the engine reads (in its stages).

They exist for tests and diagnosis, never for behaviour a user should configure (that is
``EngineConfig``). Stages inherit the launcher's environment, so a test sets them before
``mpengine.launch``.

- ``MPENGINE_FAULT_STEPS``: comma-separated step numbers whose forward pass raises in the
  executor (every sequence of those steps fails; the engine must keep serving the rest).
- ``MPENGINE_FAULT_SEQS``: comma-separated sequence ids whose sampling raises in the
  executor (only those sequences fail).

One more says where things built on this machine are kept:

- ``MPENGINE_CACHE_DIR``: the built-in tiny models (``models/``) and the CPU attention
  kernels (``kernels/``); default ``~/.cache/mpengine``. Files there (and the engine's
  other files that readers may open at any time) are written with ``write_atomically``.

And the executor honours two of its tools' own: ``CC`` (the C compiler that builds the CPU
attention kernels, default ``cc``) and ``TRITON_INTERPRET=1`` (Triton's interpreter, which
lets the triton backend run on a CPU, for tests).
"""

from __future__ import annotations

import os
from pathlib import Path


def _ints(name: str) -> frozenset[int]:
    raw = os.environ.get(name, "")
    return frozenset(int(part) for part in raw.split(",") if part.strip())


def cache_dir() -> Path:
    return Path(os.environ.get("MPENGINE_CACHE_DIR") or Path.home() / ".cache" / "mpengine")


def write_atomically(path: str | os.PathLike[str], data: bytes) -> None:
    """A reader never sees a half-written file: write a sibling, then rename it."""
    tmp = f"{os.fspath(path)}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def fault_steps() -> frozenset[int]:
    return _ints("MPENGINE_FAULT_STEPS")


def fault_seqs() -> frozenset[int]:
    return _ints("MPENGINE_FAULT_SEQS")


class InjectedFault(RuntimeError):
    """Raised where a debug switch asks for a failure."""
