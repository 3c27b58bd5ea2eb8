"""A dead owner's leftovers, removed: shared-memory objects, directories, socket files.

A program that launched an engine and is then killed (SIGTERM with Python's default
action, SIGKILL, the OOM killer) never runs its clean-up: its stages die with it
(``PR_SET_PDEATHSIG``), but its segments and semaphores in ``/dev/shm``, its runtime
directory and its ipc socket files stayed until the next launch swept them. The owner
starts this small process (no torch, no model; ``Reaper.start``) with a pipe that only
the owner writes to. An owner that cleaned up itself says so (``CLEAN_STOP``) and closes
the pipe; end of file without it means the owner died: the reaper waits for the owner's
exit to finish (its files closed), removes its objects and paths, and exits.

An ipc directory's files go only when its lock can be taken: the kernel dropped the dead
owner's ``flock``, and no other engine took the directory meanwhile.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import shutil
import signal
import subprocess
import sys

import msgspec

from shm.segment import remove_all

# ``python -c REAPER_ENTRY``: the caller's cwd leaves sys.path before any import (a stray
# module there must not run), as for the engine's stages.
REAPER_ENTRY = (
    "import sys\n"
    "if sys.path and sys.path[0] == '':\n"
    "    del sys.path[0]\n"
    "from shm.reaper import main\n"
    "main()\n"
)
CLEAN_STOP = b"stopped"  # what the owner writes before closing the pipe when it cleaned up
OWNER_EXIT_S = 5.0  # for a dead owner's exit to finish, past the pipe's end of file


class Leftovers(msgspec.Struct, frozen=True):
    """What the owner leaves if it dies: objects under ``shm_prefix``, the ``trees``, and
    the ``files`` of ``locked_dir`` (when its ``lock_name`` can be taken). ``title``: the
    reaper's process title."""

    owner_pid: int
    shm_prefix: str
    title: str = ""
    trees: list[str] = []
    locked_dir: str | None = None
    lock_name: str = ""
    files: list[str] = []


def remove_ipc_files(directory: str, names: list[str]) -> None:
    """Unlink ``names`` in ``directory`` (those that are there)."""
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))


def clean(leftovers: Leftovers) -> None:
    """Remove what a dead owner left."""
    remove_all(leftovers.shm_prefix)
    for tree in leftovers.trees:
        shutil.rmtree(tree, ignore_errors=True)
    if leftovers.locked_dir is None:
        return
    try:
        fd = os.open(
            os.path.join(leftovers.locked_dir, leftovers.lock_name),
            os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC,
        )
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        remove_ipc_files(leftovers.locked_dir, leftovers.files)
    except OSError:
        pass  # another engine serves the directory now: its files are its own
    finally:
        os.close(fd)


class Reaper:
    """The owner's handle: ``start`` spawns the reaper, ``release`` (after the owner's own
    clean-up) lets it exit."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen

    @classmethod
    def start(cls, leftovers: Leftovers, env: dict[str, str] | None = None) -> Reaper:
        popen = subprocess.Popen(
            [sys.executable, "-c", REAPER_ENTRY, msgspec.json.encode(leftovers).decode()],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env=env,
            # Its own session: a SIGKILL to the owner's whole process group (``kill -9
            # -PGID``, Ray ending an actor's worker) must leave it to clean up.
            start_new_session=True,
        )
        return cls(popen)

    def release(self, timeout: float = 5.0) -> None:
        """Tell the reaper the owner cleaned up (nothing for it to do) and wait for it."""
        if self.popen.stdin is not None:
            with contextlib.suppress(OSError):  # (a reaper killed by someone)
                self.popen.stdin.write(CLEAN_STOP)
                self.popen.stdin.close()
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def main() -> None:
    """``python -c REAPER_ENTRY LEFTOVERS_JSON``, with the owner's pipe on stdin."""
    leftovers = msgspec.json.decode(sys.argv[1], type=Leftovers)
    # Ctrl-C and SIGTERM sent to the owner's process group are the owner's to act on: this
    # process must outlive it. It exits when the pipe closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if leftovers.title:
        with contextlib.suppress(ImportError):
            import setproctitle

            setproctitle.setproctitle(leftovers.title)
    exited: int | None = None  # readable once the owner has exited, its files closed
    if os.getppid() == leftovers.owner_pid:  # (else it is gone already, or its pid reused)
        with contextlib.suppress(OSError):
            exited = os.pidfd_open(leftovers.owner_pid)
    said = b""
    while chunk := os.read(0, 4096):
        said += chunk
    if said != CLEAN_STOP:  # end of file without it: the owner died
        if exited is not None:  # (its pipe closes before its other files and its exit)
            select.select([exited], [], [], OWNER_EXIT_S)
        clean(leftovers)
