"""shm.segment: naming, mode, create/attach/close, the /dev/shm space check, the stale sweep."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator

import posix_ipc
import pytest

import shm.segment
from shm import Segment, ShmSpaceError, make_name, owner_pid, sweep_stale
from shm.segment import pid_namespace, remove_all


def shm_path(name: str) -> str:
    return "/dev/shm/" + name.lstrip("/")


def sem_path(name: str) -> str:
    return "/dev/shm/sem." + name.lstrip("/")


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    assert proc.wait(timeout=30) == 0
    return proc.pid


@pytest.fixture
def live_child() -> Iterator[subprocess.Popen[bytes]]:
    """A process that started now and lives until the test ends."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_name_carries_engine_owner_pid_and_pid_namespace(shm_engine_id: str) -> None:
    ns = format(os.stat("/proc/self/ns/pid").st_ino, "x")
    assert pid_namespace() == ns
    name = make_name(shm_engine_id, "plan")
    assert name == f"/mpe.{shm_engine_id}.{os.getpid()}-{ns}.plan"
    assert len(name) < 60
    assert owner_pid(name) == os.getpid()
    assert owner_pid("sem." + name.lstrip("/") + ".d") == os.getpid()
    assert owner_pid(make_name(shm_engine_id, "plan", pid=7, ns="other")) == 7
    assert owner_pid("mpe.noid") is None
    assert owner_pid(f"mpe.{shm_engine_id}.123.plan") is None  # no namespace: not ours
    longest = make_name("e" * 20, "p" * 20, pid=2**22, ns="f" * 16)
    assert len("sem." + longest + ".d") < 100  # NAME_MAX is 255
    for bad in ("", "a.b", "a/b", "x" * 21):
        with pytest.raises(ValueError):
            make_name(bad, "plan")
        with pytest.raises(ValueError):
            make_name(shm_engine_id, bad)
    for bad_ns in ("", "a-b", "a.b", "x" * 17):
        with pytest.raises(ValueError):
            make_name(shm_engine_id, "plan", ns=bad_ns)


def test_create_attach_share_bytes_and_mode_0600(shm_engine_id: str) -> None:
    with Segment.create(shm_engine_id, "seg", 4096) as seg:
        assert seg.owner and seg.size == 4096
        st = os.stat(shm_path(seg.name))
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == 4096
        with Segment.attach(seg.name) as other:
            assert not other.owner and other.size == 4096
            seg.buf[100:105] = b"hello"
            assert other.buf[100:105] == b"hello"
        assert os.path.exists(shm_path(seg.name)), "an attacher's close must not unlink"
    assert not os.path.exists(shm_path(seg.name)), "the creator's close unlinks"


def test_mode_0600_despite_permissive_umask(shm_engine_id: str) -> None:
    old = os.umask(0)
    try:
        with Segment.create(shm_engine_id, "seg", 64) as seg:
            assert stat.S_IMODE(os.stat(shm_path(seg.name)).st_mode) == 0o600
    finally:
        os.umask(old)


def test_close_is_idempotent_and_attach_after_unlink_fails(shm_engine_id: str) -> None:
    seg = Segment.create(shm_engine_id, "seg", 64)
    seg.close()
    seg.close()
    with pytest.raises(FileNotFoundError):
        Segment.attach(seg.name)


def test_duplicate_name_is_an_error(shm_engine_id: str) -> None:
    with Segment.create(shm_engine_id, "seg", 64), pytest.raises(FileExistsError):
        Segment.create(shm_engine_id, "seg", 64)


def test_bad_size(shm_engine_id: str) -> None:
    with pytest.raises(ValueError):
        Segment.create(shm_engine_id, "seg", 0)


def test_space_check_names_shortfall_and_fix(
    shm_engine_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Small:
        f_frsize = 4096
        f_bavail = (60 << 20) // 4096  # 60 MiB free
        f_blocks = (64 << 20) // 4096  # the 64 MB default of a container

    monkeypatch.setattr(shm.segment.os, "statvfs", lambda path: Small)
    with pytest.raises(ShmSpaceError) as info:
        Segment.create(shm_engine_id, "kv", 256 << 20)
    message = str(info.value)
    assert "256.0 MiB" in message and "60.0 MiB free" in message
    assert "--shm-size" in message
    assert not os.path.exists(shm_path(make_name(shm_engine_id, "kv")))
    # A segment that fits is still created.
    with Segment.create(shm_engine_id, "small", 1 << 20):
        pass


def test_sweep_removes_objects_of_dead_owner_only(shm_engine_id: str, dead_pid: int) -> None:
    stale_shm = make_name(shm_engine_id, "plan", pid=dead_pid)
    stale_sem = stale_shm + ".d"
    posix_ipc.SharedMemory(stale_shm, posix_ipc.O_CREX, mode=0o600, size=64).close_fd()
    posix_ipc.Semaphore(stale_sem, posix_ipc.O_CREX, mode=0o600).close()
    with Segment.create(shm_engine_id, "live", 64) as live:
        removed = sweep_stale(prefix=f"mpe.{shm_engine_id}.")
        assert sorted(removed) == sorted([stale_shm[1:], "sem." + stale_sem[1:]])
        assert os.path.exists(shm_path(live.name))
        assert not os.path.exists(shm_path(stale_shm))
        assert not os.path.exists(sem_path(stale_sem))
        assert sweep_stale(prefix=f"mpe.{shm_engine_id}.") == []


def test_remove_all_takes_one_owners_objects_whatever_their_pid_says(
    shm_engine_id: str, live_child: subprocess.Popen[bytes]
) -> None:
    """For a caller that knows the owner is dead (a dead process not reaped yet still has
    its pid): every object of that owner goes, another owner's stay; a prefix that names
    no owner is refused."""
    owner = make_name(shm_engine_id, "plan", pid=live_child.pid)
    other = make_name(shm_engine_id, "plan", pid=live_child.pid + 1)
    for name in (owner, other):
        posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=64).close_fd()
    posix_ipc.Semaphore(owner + ".d", posix_ipc.O_CREX, mode=0o600).close()
    prefix = owner[1:].removesuffix("plan")
    try:
        assert sorted(remove_all(prefix)) == sorted([owner[1:], "sem." + owner[1:] + ".d"])
        assert os.path.exists(shm_path(other)) and not os.path.exists(shm_path(owner))
        for bad in (f"mpe.{shm_engine_id}.", "mpe.", prefix.rstrip(".")):
            with pytest.raises(ValueError, match="names no owner"):
                remove_all(bad)
    finally:
        posix_ipc.unlink_shared_memory(other)


def test_sweep_treats_a_reused_pid_as_dead(
    shm_engine_id: str, live_child: subprocess.Popen[bytes]
) -> None:
    # The segment is older than the process that now has the pid in its name.
    name = make_name(shm_engine_id, "plan", pid=live_child.pid)
    posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=64).close_fd()
    hour_ago = time.time() - 3600
    os.utime(shm_path(name), (hour_ago, hour_ago))
    assert sweep_stale(prefix=f"mpe.{shm_engine_id}.") == [name[1:]]


def test_sweep_keeps_a_live_owners_fresh_segment(
    shm_engine_id: str, live_child: subprocess.Popen[bytes]
) -> None:
    name = make_name(shm_engine_id, "plan", pid=live_child.pid)
    posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=64).close_fd()
    try:
        assert sweep_stale(prefix=f"mpe.{shm_engine_id}.") == []
    finally:
        posix_ipc.unlink_shared_memory(name)


@pytest.fixture
def unlink_after() -> Iterator[list[str]]:
    """POSIX names of segments a test creates and expects the sweep to leave; unlinked after
    the test, whatever happens."""
    names: list[str] = []
    yield names
    for name in names:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(name)


def test_sweep_leaves_another_users_object(
    shm_engine_id: str, dead_pid: int, unlink_after: list[str]
) -> None:
    name = make_name(shm_engine_id, "plan", pid=dead_pid)
    posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=64).close_fd()
    unlink_after.append(name)
    os.chown(shm_path(name), 12345, 12345)
    assert sweep_stale(prefix=f"mpe.{shm_engine_id}.") == []
    assert os.path.exists(shm_path(name))


def test_sweep_leaves_another_pid_namespaces_object(
    shm_engine_id: str, dead_pid: int, unlink_after: list[str]
) -> None:
    # A live owner in another container sharing /dev/shm: its pid means nothing here.
    name = make_name(shm_engine_id, "plan", pid=dead_pid, ns="0ther")
    posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=64).close_fd()
    unlink_after.append(name)
    assert sweep_stale(prefix=f"mpe.{shm_engine_id}.") == []
    assert os.path.exists(shm_path(name))


def test_sweep_logs_and_skips_an_entry_it_cannot_remove(
    shm_engine_id: str,
    dead_pid: int,
    unlink_after: list[str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    stuck, stale = (make_name(shm_engine_id, p, pid=dead_pid) for p in ("a", "b"))
    for name in (stuck, stale):
        posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=64).close_fd()
    unlink_after.append(stuck)
    real_unlink = posix_ipc.unlink_shared_memory

    def unlink(name: str) -> None:
        if name == stuck:  # what another user's object does to a non-root sweep
            raise posix_ipc.PermissionsError("Permission denied")
        real_unlink(name)

    monkeypatch.setattr(posix_ipc, "unlink_shared_memory", unlink)
    assert sweep_stale(prefix=f"mpe.{shm_engine_id}.") == [stale[1:]]
    assert os.path.exists(shm_path(stuck)) and stuck[1:] in caplog.text
