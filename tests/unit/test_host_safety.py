"""Host safety without an engine: model names vs directories, the ipc directory checks and
lock, the runtime-dir sweep, the stage entry and the spawner thread."""

from __future__ import annotations

import errno
import importlib
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

import mpengine
from mpengine.launch import (
    EngineStartError,
    lock_dir,
    private_dir,
    sweep_stale_runtime_dirs,
)
from mpengine.models import tiny
from mpengine.models.resolve import resolve_model
from mpengine.runtime.entry import GOMP_SPINCOUNT, failure_message, openmp_defaults
from mpengine.runtime.stage_process import STAGE_ENTRY, _Spawner, _stage_env
from shm.segment import pid_namespace

launch_mod = importlib.import_module("mpengine.launch")  # mpengine.launch is also a function


@pytest.fixture
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    assert proc.wait(timeout=30) == 0
    return proc.pid


# -- 3: model names ---------------------------------------------------------------------


def test_builtin_name_wins_over_a_directory_in_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    built = tmp_path / "cache" / "tiny-built"
    monkeypatch.setattr(tiny, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(tiny, "model_spec", lambda arch, preset: _Digest())
    built.mkdir(parents=True)  # already "built": resolve_model returns it without building
    assert resolve_model("tiny") == str(built)
    # Written as a path, the local directory is what it means.
    assert resolve_model("./tiny") == "./tiny"
    assert resolve_model(str(tmp_path / "tiny")) == str(tmp_path / "tiny")


class _Digest:
    def digest(self) -> str:
        return "built"


def test_tilde_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    assert resolve_model("~/m") == str(tmp_path / "m")


def test_unknown_name_names_the_builtins_even_if_a_directory_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mymodel").mkdir()
    with pytest.raises(ValueError, match="built-in models") as info:
        resolve_model("mymodel")
    assert all(name in str(info.value) for name in tiny.KNOWN_MODELS)
    assert "./mymodel" in str(info.value)  # how to say "the directory"
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        resolve_model("./no-such-dir")


# -- 4: the ipc directory ---------------------------------------------------------------


def test_private_dir_is_created_0700(tmp_path: Path) -> None:
    path = tmp_path / "a" / "engine"
    assert private_dir(str(path) + "/") == str(path)
    assert (path.stat().st_mode & 0o777) == 0o700


def test_world_writable_dir_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "shared"
    path.mkdir()
    path.chmod(0o777)
    with pytest.raises(EngineStartError, match="world-writable") as info:
        private_dir(str(path))
    assert str(path) in str(info.value)
    path.chmod(0o720)
    with pytest.raises(EngineStartError, match="group- or world-writable"):
        private_dir(str(path))


def test_symlink_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(EngineStartError, match="symlink") as info:
        private_dir(str(link))
    assert str(link) in str(info.value)
    with pytest.raises(EngineStartError, match="symlink"):
        private_dir(str(link) + "/")  # a trailing slash must not make lstat follow it


def test_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(EngineStartError, match="not a directory"):
        private_dir(str(tmp_path / "f"))


def test_another_users_dir_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "theirs"
    path.mkdir(mode=0o700)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(path).st_uid + 4242)
    with pytest.raises(EngineStartError, match="owned by uid") as info:
        private_dir(str(path))
    assert str(path) in str(info.value)


def _owned_by_another_user(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``path`` as another user's: given away when this is root, else this user made to
    look like someone else (its own files then being another's)."""
    if os.geteuid() == 0:
        os.chown(path, 4242, 4242)
    else:
        monkeypatch.setattr(os, "geteuid", lambda: os.stat(path).st_uid + 4242)


def test_a_parent_another_user_owns_is_refused(tmp_path: Path, monkeypatch) -> None:
    """That user could rename our directory and put theirs, with sockets of their own, in
    its place: the next client's prompts would go to them."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    (theirs / "sub").mkdir(mode=0o700)  # ours, already there
    _owned_by_another_user(theirs, monkeypatch)
    with pytest.raises(EngineStartError, match=f"its parent {theirs} is owned by uid"):
        private_dir(str(theirs / "sub"))


def test_a_parent_others_may_write_is_refused_unless_sticky(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(EngineStartError, match=f"its parent {shared} is writable by others"):
        private_dir(str(shared / "engine"))
    shared.chmod(0o1777)  # as /tmp: only an entry's owner may rename it
    assert private_dir(str(shared / "engine")) == str(shared / "engine")


def test_missing_parents_are_created_0700_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        path = private_dir(str(tmp_path / "x" / "y" / "engine"))
    finally:
        os.umask(old)
    for directory in (tmp_path / "x", tmp_path / "x" / "y", Path(path)):
        assert directory.stat().st_mode & 0o777 == 0o700, directory


def test_socket_files_and_the_engine_file_are_0600_whatever_the_umask(tmp_path: Path) -> None:
    from mpengine.runtime.edges import bind_router
    from mpengine.runtime.engine_file import ENGINE_FILE, write_engine_file

    ctx = zmq.Context()
    old = os.umask(0)
    try:
        sock = bind_router(ctx, f"ipc://{tmp_path}/requests.sock", 1 << 20)
        write_engine_file(str(tmp_path), {"pid": os.getpid()})
    finally:
        os.umask(old)
    try:
        assert (tmp_path / "requests.sock").stat().st_mode & 0o777 == 0o600
        assert (tmp_path / ENGINE_FILE).stat().st_mode & 0o777 == 0o600
    finally:
        sock.close(linger=0)
        ctx.term()


def test_lock_dir_admits_one_holder(tmp_path: Path) -> None:
    fd = lock_dir(str(tmp_path))
    try:
        with pytest.raises(EngineStartError, match="in use"):
            lock_dir(str(tmp_path))
    finally:
        os.close(fd)
    os.close(lock_dir(str(tmp_path)))  # released with the fd


def test_lock_dir_waits_out_a_brief_hold(tmp_path: Path, monkeypatch) -> None:
    """A killed engine's reaper holds the lock for a moment while it removes the socket
    files: an engine restarted at that moment waits, not fails as "in use"."""
    held = lock_dir(str(tmp_path))
    waits = []

    def release(seconds: float) -> None:  # the reaper lets go while the launcher waits
        waits.append(seconds)
        os.close(held)

    monkeypatch.setattr(sys.modules["mpengine.launch"].time, "sleep", release)
    os.close(lock_dir(str(tmp_path)))
    assert len(waits) == 1


# -- 6: the runtime-dir sweep -----------------------------------------------------------


@pytest.fixture
def runtime_dirs() -> Iterator[list[Path]]:
    """Dirs a test creates in the temp dir; removed after it, whatever happens."""
    made: list[Path] = []
    yield made
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def _runtime_dir(made: list[Path], pid: int, ns: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"mpengine-tsweep-{pid}-{ns}-"))
    made.append(path)
    return path


def test_runtime_dir_sweep_only_takes_ours(runtime_dirs: list[Path], dead_pid: int) -> None:
    ours = _runtime_dir(runtime_dirs, dead_pid, pid_namespace())
    (ours / "requests.sock").write_text("")
    alive = _runtime_dir(runtime_dirs, os.getpid(), pid_namespace())
    other_ns = _runtime_dir(runtime_dirs, dead_pid, "abc123")
    other_user = _runtime_dir(runtime_dirs, dead_pid, pid_namespace())
    os.chown(other_user, 12345, 12345)
    removed = sweep_stale_runtime_dirs()
    assert str(ours) in removed and not ours.exists()
    assert alive.exists() and other_ns.exists() and other_user.exists()
    assert not {str(alive), str(other_ns), str(other_user)} & set(removed)


def test_runtime_dir_sweep_logs_and_goes_on(
    runtime_dirs: list[Path], dead_pid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _runtime_dir(runtime_dirs, dead_pid, pid_namespace())
    second = _runtime_dir(runtime_dirs, dead_pid, pid_namespace())
    real_rmtree = launch_mod.shutil.rmtree

    def rmtree(path: Path) -> None:
        if Path(path) == first:
            raise PermissionError(13, "Permission denied", str(path))
        real_rmtree(path)

    monkeypatch.setattr(launch_mod.shutil, "rmtree", rmtree)
    removed = sweep_stale_runtime_dirs()
    assert str(second) in removed and not second.exists()
    assert first.exists() and str(first) not in removed


# -- 1, 2, 5: the stage entry, the spawner, the failure message -------------------------


def test_stage_entry_drops_the_cwd_before_any_import(tmp_path: Path) -> None:
    """STAGE_ENTRY with a stand-in ``mpengine.runtime.entry`` found through PYTHONPATH: a
    ``setproctitle.py`` in the cwd must not shadow the real one."""
    fake = tmp_path / "fake" / "mpengine" / "runtime"
    fake.mkdir(parents=True)
    (fake.parent / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "entry.py").write_text(
        "import sys\ndef main():\n    import setproctitle\n    print(sys.argv[1:])\n"
    )
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "setproctitle.py").write_text("raise SystemExit('the cwd was on sys.path')\n")
    done = subprocess.run(
        [sys.executable, "-c", STAGE_ENTRY, "scheduler", "7", "1"],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(fake.parent.parent)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['scheduler', '7', '1']"


def test_stage_entry_sets_openmp_spin_before_torch_loads() -> None:
    """libgomp reads its environment once, when torch loads it: the stage entry must not
    import torch itself."""
    code = "import sys, mpengine.runtime.entry; print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "False"


def test_openmp_workers_spin_briefly_unless_the_user_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    openmp_defaults()
    assert os.environ["GOMP_SPINCOUNT"] == GOMP_SPINCOUNT
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    openmp_defaults()
    assert os.environ["GOMP_SPINCOUNT"] == "5"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    openmp_defaults()
    assert "GOMP_SPINCOUNT" not in os.environ


def test_stage_env_keeps_pythonpath_but_no_empty_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(Path(launch_mod.__file__).resolve().parent.parent)
    monkeypatch.setenv("PYTHONPATH", f"/x{os.pathsep}{os.pathsep}rel{os.pathsep}")
    assert _stage_env()["PYTHONPATH"] == os.pathsep.join([root, "/x", "rel"])
    monkeypatch.delenv("PYTHONPATH")
    assert _stage_env()["PYTHONPATH"] == root


def test_an_installed_package_is_not_put_before_the_standard_library(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Installed (not a checkout), the package's site directory went first on the stages'
    PYTHONPATH, before the standard library: a backport installed there (PyPI's
    ``pathlib``) shadowed it in the stages only, which then failed to start."""
    import sysconfig

    monkeypatch.setenv("PYTHONPATH", "/x")
    purelib = sysconfig.get_paths()["purelib"]
    assert _stage_env(purelib)["PYTHONPATH"] == "/x"
    assert _stage_env("/some/checkout")["PYTHONPATH"] == os.pathsep.join(["/some/checkout", "/x"])


ARMED_CHILD = """
import ctypes, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG, as a stage does
print("armed", flush=True)
sys.stdin.readline()
print("alive", flush=True)
"""


def wait_thread_gone(native_id: int, timeout: float = 10.0) -> None:
    """Wait until the OS thread is reaped (its exit, hence any PDEATHSIG, is done):
    ``Thread.join`` returns a little before that."""
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/self/task/{native_id}"):
        assert time.monotonic() < deadline, "the thread did not exit"
        time.sleep(0.005)


def test_a_child_spawned_from_a_thread_that_returns_lives_on() -> None:
    procs: list[subprocess.Popen[str]] = []

    def spawn() -> None:
        proc = _Spawner.popen(
            [sys.executable, "-c", ARMED_CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert select.select([proc.stdout], [], [], 60)[0], "the child did not start"
        assert proc.stdout.readline() == "armed\n"

    thread = threading.Thread(target=spawn)
    thread.start()
    thread.join(90)
    try:
        assert not thread.is_alive() and procs
        wait_thread_gone(thread.native_id)
        proc = procs[0]
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert select.select([proc.stdout], [], [], 60)[0], "no answer"
        assert proc.stdout.readline() == "alive\n", "the child died with its spawning thread"
        spawners = [t for t in threading.enumerate() if t.name == "mpengine-spawner"]
        assert len(spawners) == 1 and spawners[0].daemon
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(30)
            proc.stdin.close()
            proc.stdout.close()


def test_address_in_use_is_said_plainly() -> None:
    message = failure_message(zmq.ZMQError(errno.EADDRINUSE))
    assert message.startswith("address in use")
    assert failure_message(ValueError("x")) == "ValueError: x"


def test_atomic_writes_do_not_follow_planted_links(tmp_path) -> None:
    """The sibling written first had a predictable name (FILE.PID.tmp): a symlink planted
    there (a trace path in a shared folder) had the data overwrite whatever it pointed at."""
    from mpengine.envs import UMASK, write_atomically

    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    target = tmp_path / "trace.json"
    os.symlink(victim, f"{target}.{os.getpid()}.tmp")
    write_atomically(target, b"{}")
    assert target.read_bytes() == b"{}" and victim.read_bytes() == b"keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["victim", "trace.json", f"trace.json.{os.getpid()}.tmp"]
    )
    assert (target.stat().st_mode & 0o777) == 0o666 & ~UMASK


def test_the_open_files_limit_is_raised() -> None:
    """At a soft limit of 256 open files, about 240 IPC clients made ZMQ abort the
    scheduler (every client's requests failed with the engine); vLLM raises it too."""
    import resource

    script = (
        "import resource; from mpengine.launch import raise_open_files_limit; "
        "raise_open_files_limit(); print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip("the hard limit leaves nothing to raise")

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    out = subprocess.run(
        [sys.executable, "-c", script], preexec_fn=low, capture_output=True, text=True, timeout=60
    )
    want = 65536 if hard == resource.RLIM_INFINITY else min(65536, hard)
    assert int(out.stdout) == want, out.stderr


def test_a_start_without_room_says_what_to_change(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """/dev/shm too small for the rings (8 MB, under Docker's 64 MB default), a temporary
    directory that cannot be used, or one whose path leaves no room for the sockets' names:
    one error that says what to change (these were tracebacks, or came after the model had
    loaded); one CPU for three stage processes is said too."""
    monkeypatch.setattr(launch_mod, "shm_free_bytes", lambda: 8 << 20)
    monkeypatch.setattr(launch_mod, "available_cpus", lambda: 1)
    with (
        caplog.at_level("WARNING", logger="mpengine.launch"),
        pytest.raises(EngineStartError, match=r"need 32 MiB.*--ring-bytes"),
    ):
        mpengine.launch(model="tiny")
    assert "one CPU for three stage processes" in caplog.text
    monkeypatch.undo()

    monkeypatch.setattr(tempfile, "tempdir", "/proc/no-such-dir")
    with pytest.raises(EngineStartError, match="set TMPDIR"):
        mpengine.launch(model="tiny")
    monkeypatch.undo()

    deep = Path(tempfile.mkdtemp()) / ("d" * 90)
    deep.mkdir()
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(deep))
        with pytest.raises(EngineStartError, match="shorter TMPDIR"):
            mpengine.launch(model="tiny")
    finally:
        monkeypatch.undo()
        shutil.rmtree(deep.parent)


def test_available_cpus_follow_a_cgroup_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    """``docker run --cpus 1`` leaves every core in the affinity mask: the torch threads
    were sized for all of them."""
    import builtins
    import io

    from mpengine import config as config_mod

    files: dict[str, str] = {}
    real_open = builtins.open

    def fake_open(path, *args, **kwargs):
        if str(path).startswith(("/proc/self/cgroup", "/sys/fs/cgroup")):
            if str(path) not in files:
                raise FileNotFoundError(path)
            return io.StringIO(files[str(path)])
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(builtins, "open", fake_open)
    files["/proc/self/cgroup"] = "\nno colons here\n0::/docker/abc\n"  # (odd lines skipped)
    assert config_mod.available_cpus() == 8  # no cpu.max: no quota
    files["/sys/fs/cgroup/docker/abc/cpu.max"] = "max 100000\n"
    files["/sys/fs/cgroup/docker/cpu.max"] = "250000 100000\n"  # a parent's quota counts
    assert config_mod.available_cpus() == 3
    files.clear()
    files["/proc/self/cgroup"] = "4:cpu,cpuacct:/job\n3:memory:/job\n"
    files["/sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_quota_us"] = "100000\n"
    files["/sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_period_us"] = "100000\n"
    assert config_mod.available_cpus() == 1
    files["/sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_quota_us"] = "-1\n"  # v1: no quota
    assert config_mod.available_cpus() == 8
