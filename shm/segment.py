"""Named POSIX shared-memory segments and semaphores for one engine.

Every object this package puts in ``/dev/shm`` is named

    /mpe.<engine_id>.<owner_pid>-<pid_ns>.<purpose>[.<suffix>]

so that two engines on one host never collide, and so that :func:`sweep_stale`
can tell from the name alone which process owns an object. ``<pid_ns>`` is the
creator's pid namespace (the inode of ``/proc/self/ns/pid``, in hex): a pid means
something only in its own namespace, and containers may share ``/dev/shm``.
Segments appear as ``/dev/shm/mpe...``; posix_ipc semaphores as ``/dev/shm/sem.mpe...``.

Ownership: the process that creates an object unlinks it, on ``close()``, or at
interpreter exit if it forgot (an ``atexit`` hook). A process killed with
SIGKILL cannot clean up; the next engine start (or anyone) calls
:func:`sweep_stale` to remove objects whose owner pid is gone. The sweep only
judges objects of its own user and pid namespace, and never raises for one
entry it cannot remove. Attachers only unmap.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import mmap
import os
import re
from collections.abc import Callable
from types import TracebackType

import posix_ipc

SHM_DIR = "/dev/shm"
PREFIX = "mpe."
MODE = 0o600
_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,20}")
_NS_TOKEN = re.compile(r"[A-Za-z0-9]{1,16}")
_MIB = 1 << 20

logger = logging.getLogger(__name__)

# Objects created and not unlinked yet: (kind "shm" or "sem", name) -> creator pid. The pid
# keeps a forked child from unlinking its parent's objects when it exits.
_owned: dict[tuple[str, str], int] = {}


@functools.cache
def pid_namespace() -> str:
    """This process's pid namespace as a short token: the inode of ``/proc/self/ns/pid`` in
    hex (``"0"`` where /proc does not tell). A process never leaves its pid namespace."""
    try:
        return format(os.stat("/proc/self/ns/pid").st_ino, "x")
    except OSError:
        return "0"


def make_name(engine_id: str, purpose: str, pid: int | None = None, ns: str | None = None) -> str:
    """The POSIX name (leading slash) of an object owned by ``pid`` in pid namespace ``ns``
    (default: this process, this namespace)."""
    for label, token in (("engine_id", engine_id), ("purpose", purpose)):
        if not _TOKEN.fullmatch(token):
            raise ValueError(f"{label} {token!r} must be 1-20 characters of [A-Za-z0-9_-]")
    ns = pid_namespace() if ns is None else ns
    if not _NS_TOKEN.fullmatch(ns):
        raise ValueError(f"ns {ns!r} must be 1-16 characters of [A-Za-z0-9]")
    return f"/{owner_prefix(engine_id, pid, ns)}{purpose}"


def owner_prefix(engine_id: str, pid: int | None = None, ns: str | None = None) -> str:
    """What the names of one owner's objects start with (a ``/dev/shm`` file name without
    ``sem.``): ``mpe.<engine_id>.<pid>-<ns>.``."""
    ns = pid_namespace() if ns is None else ns
    return f"{PREFIX}{engine_id}.{os.getpid() if pid is None else pid}-{ns}."


def _owner(name: str) -> tuple[int, str] | None:
    """(pid, pid namespace) from an object name (with or without slash / ``sem.``), or None."""
    parts = name.lstrip("/").removeprefix("sem.").split(".")
    if len(parts) < 4:
        return None
    pid, _, ns = parts[2].partition("-")
    if not pid.isdigit() or not _NS_TOKEN.fullmatch(ns):
        return None
    return int(pid), ns


def owner_pid(name: str) -> int | None:
    """The owner pid encoded in an object name (with or without slash / ``sem.``), or None.
    The pid is one of the namespace the name also carries."""
    owner = _owner(name)
    return None if owner is None else owner[0]


class ShmSpaceError(OSError):
    """/dev/shm has too little free space for a new segment."""


def free_space() -> int:
    """Bytes /dev/shm can still take."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def check_free_space(size: int, name: str) -> None:
    """Raise ShmSpaceError unless /dev/shm can hold ``size`` more bytes.

    tmpfs allocates lazily, so an oversized segment is created without error and
    the process dies of SIGBUS much later, when it first touches a missing page.
    """
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise ShmSpaceError(
            f"shared memory segment {name} needs {size / _MIB:.1f} MiB in {SHM_DIR}, "
            f"only {free / _MIB:.1f} MiB free (size {st.f_blocks * st.f_frsize / _MIB:.0f} MiB); "
            f"enlarge it (docker run --shm-size=1g, or mount -o remount,size=1g {SHM_DIR}) "
            f"or configure smaller shared-memory buffers"
        )


def _map(fd: int, size: int) -> mmap.mmap:
    """Map shared, with every page faulted in now (``MAP_POPULATE``): no page-fault stalls on
    the hot path, and a process's resident size does not creep up as a ring's cursor reaches
    pages it has not touched yet (which looked like a leak)."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags)


class Segment:
    """A named shared-memory segment mapped into this process.

    ``buf`` is the mmap. ``close()`` unmaps it unless views into it (memoryviews,
    ctypes objects) are still alive; then it is unmapped when the last one dies.
    """

    def __init__(self, name: str, buf: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.buf = buf
        self.size = len(buf)
        self.owner = owner
        self._closed = False

    @classmethod
    def create(cls, engine_id: str, purpose: str, size: int) -> Segment:
        """Create ``/mpe.<engine_id>.<pid>-<pid_ns>.<purpose>`` of ``size`` bytes, mode 0600."""
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        name = make_name(engine_id, purpose)
        check_free_space(size, name)
        try:
            mem = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=MODE)
        except posix_ipc.ExistentialError as e:
            raise FileExistsError(f"shared memory segment {name} already exists") from e
        _owned["shm", name] = os.getpid()
        try:
            os.fchmod(mem.fd, MODE)  # shm_open's mode is filtered by the umask
            # Reserve the pages now: a clear ENOSPC here beats a SIGBUS later.
            try:
                os.posix_fallocate(mem.fd, 0, size)
            except OSError as e:
                check_free_space(size, name)  # raced with another allocation: explain
                raise ShmSpaceError(f"cannot allocate {size} bytes for {name}: {e}") from e
            buf = _map(mem.fd, size)
        except BaseException:
            _unlink("shm", name)
            raise
        finally:
            mem.close_fd()
        return cls(name, buf, owner=True)

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map an existing segment created by another process (or this one)."""
        try:
            mem = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError as e:
            raise FileNotFoundError(f"shared memory segment {name} does not exist") from e
        try:
            if mem.size == 0:  # mapped before its creator sized it
                raise ValueError(f"shared memory segment {name} is empty (still being created?)")
            buf = _map(mem.fd, mem.size)
        finally:
            mem.close_fd()
        return cls(name, buf, owner=False)

    def close(self) -> None:
        """Unmap; the creator also unlinks the name. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.owner:
            _unlink("shm", self.name)
        # Views into the mapping may still live (a kept traceback can hold some): then the
        # mapping goes away with the last of them. The name is gone already, which matters.
        with contextlib.suppress(BufferError):
            self.buf.close()

    def __enter__(self) -> Segment:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, size={self.size}, owner={self.owner})"


def create_semaphore(name: str) -> posix_ipc.Semaphore:
    """Create a semaphore (value 0, mode 0600) that this process owns and must unlink."""
    try:
        sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=MODE, initial_value=0)
    except posix_ipc.ExistentialError as e:
        raise FileExistsError(f"semaphore {name} already exists") from e
    _owned["sem", name] = os.getpid()
    return sem


def open_semaphore(name: str) -> posix_ipc.Semaphore:
    """Open a semaphore created by :func:`create_semaphore`."""
    try:
        return posix_ipc.Semaphore(name)
    except posix_ipc.ExistentialError as e:
        raise FileNotFoundError(f"semaphore {name} does not exist") from e


def close_semaphore(sem: posix_ipc.Semaphore, owner: bool) -> None:
    """Close a semaphore handle; the owner also unlinks its name."""
    name = sem.name
    sem.close()
    if owner:
        _unlink("sem", name)


def _unlink(kind: str, name: str) -> bool:
    """Unlink a segment or semaphore by POSIX name; False if it was already gone."""
    _owned.pop((kind, name), None)
    unlink = posix_ipc.unlink_shared_memory if kind == "shm" else posix_ipc.unlink_semaphore
    try:
        unlink(name)
    except posix_ipc.ExistentialError:
        return False
    return True


@atexit.register
def _unlink_owned_at_exit() -> None:
    pid = os.getpid()
    for (kind, name), creator in list(_owned.items()):
        if creator == pid:
            _unlink(kind, name)


def _pid_started_after(pid: int, mtime: float) -> bool:
    """True when process ``pid`` started after ``mtime``: it reuses a dead owner's pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # Field 22 (starttime, clock ticks since boot) follows the parenthesised comm.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        return False
    started = boot + start_ticks / os.sysconf("SC_CLK_TCK")
    return started > mtime + 1.0  # btime has 1 s resolution


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (any owner)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def sweep_stale(prefix: str = PREFIX) -> list[str]:
    """Remove segments and semaphores under ``prefix`` whose owner process is gone.

    ``prefix`` is matched against the ``/dev/shm`` file name without ``sem.``,
    e.g. ``"mpe."`` (every engine) or ``"mpe.<engine_id>."`` (one engine).
    Only objects of this user (the effective uid) and of this pid namespace are
    judged: another user's objects are not ours to remove, and another
    namespace's pids mean nothing here (its live owners would look dead). An
    owner counts as gone when its pid does not exist, or exists but started after
    the object was last modified (the pid was reused). An entry that cannot be
    inspected or removed is logged and skipped: the sweep never raises for one.
    Returns the removed ``/dev/shm`` file names.
    """

    def stale(entry: str, base: str) -> bool:
        owner = _owner(base)
        return owner is not None and owner[1] == pid_namespace() and _is_stale(entry, owner[0])

    return _remove(prefix, stale)


def remove_all(prefix: str) -> list[str]:
    """Remove this user's segments and semaphores under ``prefix`` (a ``/dev/shm`` file name
    without ``sem.``, at least ``mpe.<engine_id>.<pid>-<ns>.``), whoever they look owned
    by: for a caller that knows their owner is dead (``sweep_stale`` judges by the pid,
    and a dead owner whose parent has not reaped it yet still has one). Never raises for
    one entry. Returns the removed file names."""
    if _owner(prefix + "x") is None or not prefix.endswith("."):
        raise ValueError(f"{prefix!r} names no owner: refusing to remove more than its objects")

    def ours(entry: str, _: str) -> bool:
        return os.stat(os.path.join(SHM_DIR, entry), follow_symlinks=False).st_uid == os.geteuid()

    return _remove(prefix, ours)


def _remove(prefix: str, judge: Callable[[str, str], bool]) -> list[str]:
    """Unlink the objects under ``prefix`` that ``judge(file name, name without sem.)``
    condemns; log and skip one that cannot be inspected or removed."""
    removed: list[str] = []
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for entry in sorted(entries):
        is_sem = entry.startswith("sem.")
        base = entry[4:] if is_sem else entry
        if not base.startswith(prefix):
            continue
        try:
            if judge(entry, base) and _unlink("sem" if is_sem else "shm", "/" + base):
                removed.append(entry)
        except FileNotFoundError:
            continue  # its owner removed it meanwhile
        except (OSError, posix_ipc.Error) as exc:
            logger.warning("left %s/%s: %s", SHM_DIR, entry, exc)
    return removed


def _is_stale(entry: str, pid: int) -> bool:
    """Whether ``/dev/shm/<entry>`` is ours and its owner ``pid`` is gone."""
    st = os.stat(os.path.join(SHM_DIR, entry), follow_symlinks=False)
    if st.st_uid != os.geteuid():
        return False  # another user's engine: not ours to judge
    return not pid_alive(pid) or _pid_started_after(pid, st.st_mtime)
