"""A stage as a child process of the launcher: how it is started (a fresh interpreter, on
one long-lived spawner thread), its control pipe and exit sentinel, and how a set of them
is stopped."""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import signal
import site
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path

from mpengine.runtime.stage import STOP_SIGNAL

# What each stage runs (``python -c STAGE_ENTRY STAGE FD PPID``). ``-c`` and ``-m`` put the
# caller's cwd first on sys.path, where a stray ``setproctitle.py`` or ``msgspec.py`` would
# shadow the real module in every stage: drop it before the first import. (``-P`` does the
# same, but only from Python 3.11 on; under PYTHONSAFEPATH there is no such entry.)
STAGE_ENTRY = (
    "import sys\n"
    "if sys.path and sys.path[0] == '':\n"
    "    del sys.path[0]\n"
    "from mpengine.runtime.entry import main\n"
    "main()\n"
)


_Job = tuple[Callable[[], subprocess.Popen[bytes]], Future[subprocess.Popen[bytes]]]


class _Spawner:
    """Runs every stage's ``Popen`` on one daemon thread that lives as long as the process.

    A stage asks for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), and the kernel
    means the *thread* that forked it: a stage spawned from a short-lived thread would be
    killed when that thread returns.
    """

    _lock = threading.Lock()
    _current: _Spawner | None = None

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="mpengine-spawner", daemon=True).start()

    @classmethod
    def popen(cls, argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """``subprocess.Popen(argv, **kwargs)``, run on the spawner thread."""
        with cls._lock:
            if cls._current is None or cls._current.pid != os.getpid():  # none yet, or forked
                cls._current = cls()
            spawner = cls._current
        future: Future[subprocess.Popen[bytes]] = Future()
        spawner.jobs.put((functools.partial(subprocess.Popen, argv, **kwargs), future))
        return future.result()

    def _serve(self) -> None:
        while True:
            call, future = self.jobs.get()
            try:
                future.set_result(call())
            except BaseException as exc:
                future.set_exception(exc)


def _stage_env(root: str | None = None) -> dict[str, str]:
    """The caller's environment, with the directory holding the package (``root``) first
    on PYTHONPATH when it is a checkout, so that an uninstalled one works; an installed
    package's site directory is found by the stages as by any interpreter, and put on
    PYTHONPATH it would come before the standard library (a backport installed there, such
    as PyPI's ``pathlib``, would shadow it in the stages only). The caller's entries stay,
    except empty ones, which Python reads as the cwd."""
    env = dict(os.environ)
    root = root or str(Path(__file__).resolve().parents[2])
    entries = env.get("PYTHONPATH", "").split(os.pathsep)
    if os.path.realpath(root) not in _site_dirs():
        entries.insert(0, root)
    env["PYTHONPATH"] = os.pathsep.join(p for p in entries if p)
    return env


def _site_dirs() -> set[str]:
    """Where this interpreter installs packages (its venv's, the user's)."""
    paths = sysconfig.get_paths()
    dirs = [paths["purelib"], paths["platlib"], *site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return {os.path.realpath(d) for d in dirs}


class StageProcess:
    """A stage as a child process: ``python -c STAGE_ENTRY STAGE FD PPID RUNTIME_DIR``.

    A fresh interpreter (not multiprocessing's spawn) so the caller's ``__main__`` is never
    re-imported; the control connection is one end of a socketpair; ``sentinel`` is a pidfd
    that becomes readable when the process exits.
    """

    def __init__(self, stage: str, runtime_dir: str) -> None:
        self.stage = stage
        ours, theirs = socket.socketpair()
        argv = [sys.executable, "-c", STAGE_ENTRY, stage, str(theirs.fileno()), str(os.getpid())]
        argv.append(runtime_dir)  # where it writes its stack dumps
        try:
            self.popen = _Spawner.popen(
                argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=_stage_env()
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.pid = self.popen.pid
        self.sentinel = os.pidfd_open(self.pid)

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self) -> None:
        """Ask the stage to stop (``STOP_SIGNAL``: SIGTERM is its launcher's to handle)."""
        with contextlib.suppress(ProcessLookupError):
            self.popen.send_signal(STOP_SIGNAL)

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    def close(self) -> None:
        self.conn.close()
        os.close(self.sentinel)


def halt(procs: list[StageProcess], grace: float) -> None:
    """Stop stage processes (their stop signal: the loops see their stop flag within
    POLL_S; SIGKILL past ``grace``) and let go of them."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(5.0)
    for proc in procs:
        proc.close()
