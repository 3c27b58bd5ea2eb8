"""The model cache: built-in and converted models, each built once into a directory of its own.

An entry is a directory ``cache_root() / NAME`` whose name holds a digest of everything its
files depend on, so an entry is never updated in place: a change gives a new name. An entry
is built at most once, however many engines ask for it at the same time:

- a builder holds ``.NAME.lock`` (``flock``) while it builds; the others wait on it, then
  find the entry and use it (the lock file goes once the entry is in place);
- it builds into a private temporary directory beside the entry and renames it into place:
  the rename is atomic, so a directory under its final name is always complete;
- a builder that died (killed, out of disk) leaves at most its temporary directory, which
  the next builder removes under the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from mpengine.envs import UMASK, cache_dir


class CacheError(OSError):
    """The cache cannot hold an entry (not writable, full): one line that says what to do."""


def cache_root() -> Path:
    """Where models are kept: ``models/`` under ``envs.cache_dir()``."""
    return cache_dir() / "models"


def build_once(final: Path, build: Callable[[Path], None], what: str) -> Path:
    """``final``, built by ``build(tmp_dir)`` unless it exists; see the module docstring.
    Raises :class:`CacheError` when the cache cannot hold it."""
    if final.is_dir():
        return final
    lock_path = final.parent / f".{final.name}.lock"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        with _locked(lock_path):
            if not final.is_dir():  # (else built by the engine we waited for)
                _build(final, build)
            # Whoever comes now finds the entry before looking at the lock, and those
            # waiting on it find it once they hold it. (After a failure the file stays: a
            # newcomer's new lock file beside a waiter's old one would let two build.)
            lock_path.unlink(missing_ok=True)
    except OSError as exc:
        if final.is_dir():  # built by an engine that took no lock (an older version)
            return final
        reason = exc.strerror or str(exc)
        raise CacheError(
            f"cannot write {what} into the model cache {final.parent} ({reason}): free space "
            "there or set MPENGINE_CACHE_DIR to a writable directory"
        ) from None
    return final


def _build(final: Path, build: Callable[[Path], None]) -> None:
    """Under the lock: build into a temporary directory, then rename it into place."""
    for leftover in final.parent.glob(f".{final.name}.*"):
        if leftover.is_dir():  # a builder that died: no live one, we hold the lock
            shutil.rmtree(leftover, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        _make_readable(tmp)  # (mkdtemp and some writers make files private)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _make_readable(directory: Path) -> None:
    """Entries are shared by every user of the cache (a service and its operator)."""
    directory.chmod(0o777 & ~UMASK)
    for path in directory.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~UMASK)
