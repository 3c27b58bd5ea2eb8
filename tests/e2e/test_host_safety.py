"""An engine on a shared host: stray modules in the cwd, launching from a short-lived
thread, a second engine on a served address, unsafe ipc directories, another user's
leftovers in /dev/shm."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import posix_ipc
import pytest

import mpengine
from mpengine import EngineStartError, SamplingParams
from mpengine.testing.engine import free_port_pair
from shm import make_name
from tests.e2e.conftest import leftovers

CONFIG = {"model": "tiny", "num_gpu_blocks_override": 64, "log_level": "WARNING"}
GREEDY = SamplingParams(max_tokens=3, ignore_eos=True)


def serves(engine: mpengine.Engine) -> bool:
    with engine.client(timeout=30) as client:
        return len(client.generate("hi", GREEDY, timeout=60).token_ids) == 3


def refused(**kwargs: object) -> EngineStartError:
    """Launch, expecting EngineStartError; an engine that starts anyway is stopped."""
    try:
        engine = mpengine.launch(**{**CONFIG, "startup_timeout": 120.0, **kwargs})
    except EngineStartError as exc:
        return exc
    engine.shutdown()
    pytest.fail("the engine started")


def assert_left_nothing(engine_id: str) -> None:
    assert leftovers(engine_id) == []
    assert list(Path(tempfile.gettempdir()).glob(f"mpengine-{engine_id}-*")) == []


def new_id() -> str:
    return "h" + uuid.uuid4().hex[:8]


def wait_thread_gone(native_id: int, timeout: float = 10.0) -> None:
    """Wait until the OS thread is reaped (its exit, hence any PDEATHSIG, is done):
    ``Thread.join`` returns a little before that."""
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/self/task/{native_id}"):
        assert time.monotonic() < deadline, "the thread did not exit"
        time.sleep(0.005)


def test_stray_modules_in_the_cwd_do_not_run_in_the_stages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, start_engine: Callable[..., mpengine.Engine]
) -> None:
    marker = tmp_path / "marker"
    for module in ("setproctitle", "msgspec"):
        (tmp_path / f"{module}.py").write_text(
            f"open({str(marker)!r}, 'a').write('{module} imported from the cwd\\n')\n"
            f"raise ImportError('the stray {module}.py ran')\n"
        )
    (tmp_path / "tiny").mkdir()  # nor is "tiny" this empty directory
    monkeypatch.chdir(tmp_path)
    engine = start_engine(**CONFIG)
    try:
        assert serves(engine)
    finally:
        engine.shutdown()
    assert not marker.exists(), marker.read_text()


def test_launch_from_a_thread_that_returns(start_engine: Callable[..., mpengine.Engine]) -> None:
    engines: list[mpengine.Engine] = []
    errors: list[BaseException] = []

    def launch() -> None:
        try:
            engines.append(start_engine(**CONFIG))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=launch)
    thread.start()
    thread.join(180)
    assert not thread.is_alive() and not errors, errors
    wait_thread_gone(thread.native_id)  # its exit is what would have killed the stages
    engine = engines[0]
    try:
        assert serves(engine)
        assert engine.dead is None
    finally:
        engine.shutdown()


def test_second_engine_on_a_served_ipc_address_is_refused(
    tmp_path: Path, start_engine: Callable[..., mpengine.Engine]
) -> None:
    address = f"ipc://{tmp_path}/engine"
    first = start_engine(address=address, **CONFIG)
    try:
        files = sorted(os.listdir(tmp_path / "engine"))
        assert {"requests.sock", "outputs.sock"} <= set(files)
        second_id = new_id()
        error = refused(address=address, engine_id=second_id)
        assert "in use" in str(error) and str(tmp_path / "engine") in str(error)
        assert sorted(os.listdir(tmp_path / "engine")) == files
        assert os.path.exists(first.runtime_dir)
        assert_left_nothing(second_id)
        assert serves(first)
    finally:
        first.shutdown()


def test_second_engine_on_a_served_tcp_address_is_refused(
    start_engine: Callable[..., mpengine.Engine],
) -> None:
    address = f"tcp://127.0.0.1:{free_port_pair()}"
    first = start_engine(address=address, **CONFIG)
    try:
        second_id = new_id()
        error = refused(address=address, engine_id=second_id)
        assert "address in use" in str(error), error
        assert_left_nothing(second_id)
        assert serves(first)
    finally:
        first.shutdown()


def test_a_second_engine_with_the_same_id_is_refused(
    start_engine: Callable[..., mpengine.Engine],
) -> None:
    engine_id = new_id()
    first = start_engine(engine_id=engine_id, **CONFIG)
    error = refused(engine_id=engine_id)
    assert f"engine_id {engine_id!r} is in use" in str(error), error
    assert serves(first)


def test_an_ipc_dir_that_cannot_be_made_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    engine_id = new_id()
    error = refused(address=f"ipc://{tmp_path}/file/engine", engine_id=engine_id)
    assert str(error).startswith(f"cannot create ipc directory {tmp_path}/file/engine"), error
    assert_left_nothing(engine_id)


def test_world_writable_ipc_dir_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    engine_id = new_id()
    error = refused(address=f"ipc://{shared}", engine_id=engine_id)
    assert str(shared) in str(error) and "writable" in str(error)
    assert os.listdir(shared) == []
    assert_left_nothing(engine_id)


def test_symlinked_ipc_dir_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    engine_id = new_id()
    error = refused(address=f"ipc://{tmp_path}/link", engine_id=engine_id)
    assert str(tmp_path / "link") in str(error) and "symlink" in str(error)
    assert os.listdir(real) == []
    assert_left_nothing(engine_id)


@pytest.fixture
def foreign_stale_segment() -> Iterator[str]:
    """A segment of a dead owner of this pid namespace, but of another user (uid 12345)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    assert proc.wait(timeout=30) == 0
    name = make_name(new_id(), "plan", pid=proc.pid)
    posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=64).close_fd()
    try:
        os.chown("/dev/shm" + name, 12345, 12345)
        yield name
    finally:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(name)


def test_another_users_leftover_is_left_and_launch_works(
    foreign_stale_segment: str, start_engine: Callable[..., mpengine.Engine]
) -> None:
    engine = start_engine(**CONFIG)
    try:
        assert os.path.exists("/dev/shm" + foreign_stale_segment)
        assert serves(engine)
    finally:
        engine.shutdown()
