"""The engine's own environment variables (besides those of its tools and of systemd,
below): debug switches, the cache, and the command line's secrets.

The debug switches exist for tests and diagnosis, never for behaviour a user should
configure (that is ``EngineConfig``). Stages inherit the launcher's environment, so a test
sets them before ``mpengine.launch``.

- ``MPENGINE_FAULT_STEPS``: comma-separated step numbers whose forward pass raises in the
  executor (every sequence of those steps fails; the engine must keep serving the rest).
- ``MPENGINE_FAULT_SEQS``: comma-separated sequence ids whose sampling raises in the
  executor (only those sequences fail).

With either set, the executor stage runs ``executor.faults.FaultyExecutor``; the executor
that serves has no fault branches.

One more says where things built on this machine are kept:

- ``MPENGINE_CACHE_DIR``: the built-in tiny models (``models/``) and the CPU attention
  kernels (``kernels/``); default ``$XDG_CACHE_HOME/mpengine``, ``~/.cache/mpengine``
  without it. Files there (and the engine's
  other files that readers may open at any time) are written with ``write_atomically``.

The command line reads ``MPENGINE_AUTH_TOKEN`` (the engine's auth token) and ``mpengine
serve`` ``MPENGINE_API_KEY`` (else vLLM's ``VLLM_API_KEY``), so secrets stay out of the
process list. The executor honours its tools' own: ``CC`` (the C compiler that builds the
CPU attention kernels, default ``cc``), ``TRITON_INTERPRET=1`` (Triton's interpreter, which
lets the triton backend run on a CPU, for tests), OpenMP's ``OMP_WAIT_POLICY`` /
``GOMP_SPINCOUNT`` and Hugging Face's ``HF_HOME`` / ``HF_HUB_CACHE``; ``mpengine serve``
speaks to systemd through ``NOTIFY_SOCKET`` and ``WATCHDOG_USEC``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _ints(name: str) -> frozenset[int]:
    raw = os.environ.get(name, "")
    return frozenset(int(part) for part in raw.split(",") if part.strip())


def cache_dir() -> Path:
    if explicit := os.environ.get("MPENGINE_CACHE_DIR"):
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"  # (as XDG says)
    return base / "mpengine"


def write_atomically(path: str | os.PathLike[str], data: bytes, mode: int | None = None) -> None:
    """A reader never sees a half-written file: write a sibling, then rename it. The sibling
    is created new, under a random name (a predictable one, planted as a symlink, would
    have the data written wherever it points). ``mode``: the file's, whatever the umask
    (default: as ``open`` makes it)."""
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~UMASK if mode is None else mode)  # (mkstemp makes it 0600)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _read_umask() -> int:
    mask = os.umask(0o022)  # read once, at import: setting it is process-wide
    os.umask(mask)
    return mask


UMASK = _read_umask()  # the process umask, as it was at start


def fault_steps() -> frozenset[int]:
    return _ints("MPENGINE_FAULT_STEPS")


def fault_seqs() -> frozenset[int]:
    return _ints("MPENGINE_FAULT_SEQS")


class InjectedFault(RuntimeError):
    """Raised where a debug switch asks for a failure."""


TOKEN_FILE_HELP = (
    "read the auth token from this file (also: the environment's MPENGINE_AUTH_TOKEN); a "
    "token on the command line is readable by every user in the process list"
)


def auth_token(token: str | None, path: str | None) -> str | None:
    """The command line's auth token: ``--auth-token``, else the content of
    ``--auth-token-file``, else ``MPENGINE_AUTH_TOKEN`` (else None). ValueError says what
    is wrong with them."""
    if token is not None and path is not None:
        raise ValueError("give --auth-token or --auth-token-file, not both")
    if path is not None:
        try:
            with open(path) as token_file:
                token = token_file.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read --auth-token-file: {exc}") from None
        if not token:
            raise ValueError(f"--auth-token-file {path} holds no token")
    return token if token is not None else os.environ.get("MPENGINE_AUTH_TOKEN") or None
