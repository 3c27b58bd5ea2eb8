"""Killing any one stage with SIGKILL fails in-flight requests with EngineDeadError within
2 s (no hang), stops the other stages, and leaves nothing in /dev/shm or on disk."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

import pytest

import mpengine
from mpengine.protocol import SamplingParams
from tests.e2e.conftest import leftovers


@pytest.mark.parametrize("stage", ["scheduler", "executor", "output"])
def test_killed_stage_fails_requests_and_cleans_up(stage, start_engine):
    """(With restarts off: a restarted output processor is ``test_stage_restarts.py``'s.)"""
    engine = start_engine(model="tiny", num_gpu_blocks_override=256, max_stage_restarts=0)
    client = engine.client()
    local = mpengine.Client(engine.address)  # also a client that knows nothing of the launcher
    errors: dict[str, BaseException] = {}
    started = threading.Barrier(3, timeout=60)

    def run(name: str, c: mpengine.Client) -> None:
        stream = c.stream("x " * 20, SamplingParams(max_tokens=2000, ignore_eos=True))
        try:
            next(stream)
            started.wait()
            for _ in stream:
                pass
        except BaseException as exc:
            errors[name] = exc

    threads = [threading.Thread(target=run, args=(n, c)) for n, c in (("a", client), ("b", local))]
    for t in threads:
        t.start()
    started.wait()
    pids = engine.pids
    assert engine._reaper is not None
    reaper = engine._reaper.popen
    os.kill(pids[stage], signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a request hung after the engine died"
    elapsed = time.monotonic() - killed_at
    assert set(errors) == {"a", "b"}
    assert all(isinstance(e, mpengine.EngineDeadError) for e in errors.values()), errors
    assert elapsed < 2.0, f"EngineDeadError took {elapsed:.2f} s"
    with pytest.raises(mpengine.EngineDeadError):
        client.generate("again", SamplingParams(max_tokens=2))
    # The supervisor stops the rest and removes segments and socket files.
    assert engine.stopped.wait(10), "the supervisor did not stop the engine"
    for name, pid in pids.items():
        assert not _alive(pid), f"{name} still running"
    assert engine.dead and stage in engine.dead
    assert leftovers(engine.config.engine_id) == []
    assert not os.path.exists(engine.runtime_dir)
    assert reaper.poll() == 0  # told the launcher cleaned up, it exited
    client.close()
    local.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes; the launcher reaps its children.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_killed_launcher_takes_its_stages_along_and_its_reaper_cleans_up(tmp_path, signum):
    """A launcher killed (SIGKILL, or SIGTERM with Python's default action): its stages die
    with it (PR_SET_PDEATHSIG), and its reaper removes what it owned in /dev/shm, its
    runtime dir and its ipc socket files (they waited for the next launch's sweep)."""
    ipc_dir = tmp_path / "ipc"
    script = (
        "import json, mpengine, sys\n"
        "e = mpengine.launch(model='tiny', num_gpu_blocks_override=64, log_level='WARNING',\n"
        f"                    address='ipc://{ipc_dir}')\n"
        "print(json.dumps({'id': e.config.engine_id, 'pids': e.pids, 'dir': e.runtime_dir}))\n"
        "sys.stdout.flush()\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "the launcher did not start"
        info = json.loads(proc.stdout.readline())
        assert leftovers(info["id"]) and (ipc_dir / "requests.sock").exists()
    finally:
        proc.send_signal(signum)
        proc.wait(10)
    assert proc.returncode == -signum

    def left() -> list[str]:
        stages = [name for name, pid in info["pids"].items() if _alive(pid)]
        files = [p.name for p in ipc_dir.iterdir() if p.name != "engine.lock"]
        return stages + leftovers(info["id"]) + files + [info["dir"]] * os.path.exists(info["dir"])

    deadline = time.monotonic() + 20
    while left():  # (polls: no sleep decides anything)
        assert time.monotonic() < deadline, f"left after the launcher died: {left()}"
        time.sleep(0.02)


def test_a_ctrl_c_while_stopping_hurries_the_stop_and_still_cleans_up(start_engine):
    """A second Ctrl-C, landing while the launcher waited for its stages to stop, left the
    runtime dir and unreaped stages behind: now it kills the stages, the clean-up runs to
    its end, and the KeyboardInterrupt comes after."""
    engine = start_engine(model="tiny", runtime="processes")
    stages = list(engine.processes.values())
    reap = engine._reap

    def interrupted_reap(procs, grace):
        signal.raise_signal(signal.SIGINT)  # as a terminal's Ctrl-C would, mid-stop
        reap(procs, grace)

    engine._reap = interrupted_reap
    previous = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        engine.shutdown()
    assert signal.getsignal(signal.SIGINT) is previous
    assert not os.path.exists(engine.runtime_dir)
    assert not engine.processes and all(stage.exitcode is not None for stage in stages)


def test_a_forked_child_leaves_its_parents_engine_alone(start_engine, tmp_path):
    """A child of os.fork() that exits normally runs the exit hooks it inherited: the
    engine's shutdown removed the parent's segments, runtime dir and socket files, and new
    clients of the parent's engine waited out their timeout."""
    engine = start_engine(
        model="tiny", num_gpu_blocks_override=64, address=f"ipc://{tmp_path / 'ipc'}"
    )
    before = leftovers(engine.config.engine_id)
    pid = os.fork()
    if pid == 0:  # the child: exit as a normal exit would, then leave at once
        try:
            import atexit

            atexit._run_exitfuncs()
        finally:
            os._exit(0)
    deadline = time.monotonic() + 30
    while os.waitpid(pid, os.WNOHANG) == (0, 0):  # (polls: no sleep decides anything)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child did not exit")
        time.sleep(0.02)
    assert leftovers(engine.config.engine_id) == before
    assert os.path.isdir(engine.runtime_dir) and (tmp_path / "ipc" / "requests.sock").exists()
    with mpengine.Client(engine.address, timeout=30) as client:
        out = client.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(out.token_ids) == 2


# Loaded by every interpreter the test starts (stages, reaper) through PYTHONPATH: makes
# the scheduler's Nth plan raise, and notes whether the interpreter's teardown ran.
RAISING_SCHEDULER = """
import os, sys

_at = int(os.environ.get("MPENGINE_TEST_RAISE_AT", "0"))
if _at and sys.argv[1:2] in (["scheduler"], ["engine"]):
    import mpengine.scheduler.scheduler as module

    _schedule = module.Scheduler.schedule
    _calls = [0]

    def schedule(self, *args, **kwargs):
        _calls[0] += 1
        if _calls[0] == _at:
            raise RuntimeError("planted scheduler failure")
        return _schedule(self, *args, **kwargs)

    module.Scheduler.schedule = schedule

    class _Teardown:  # collected only when the interpreter tears its modules down
        def __del__(self, path=os.environ["MPENGINE_TEST_TEARDOWN"], open=open):
            open(path, "a").write("teardown\\n")  # (builtins are gone by then)

    _teardown = _Teardown()
"""


@pytest.mark.parametrize("runtime", ["processes", "threads"])
def test_a_stage_that_raises_fails_requests_and_leaves_at_once(
    runtime, start_engine, tmp_path, monkeypatch
):
    """An exception in a stage's loop fails every request with EngineDeadError naming the
    error, and the stage leaves without the interpreter's teardown: with torch loaded that
    took 2-3 s, during which the launcher did not know the engine was dead."""
    (tmp_path / "sitecustomize.py").write_text(RAISING_SCHEDULER)
    marker = tmp_path / "teardown"
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{path}" if path else str(tmp_path))
    monkeypatch.setenv("MPENGINE_TEST_RAISE_AT", "30")
    monkeypatch.setenv("MPENGINE_TEST_TEARDOWN", str(marker))
    engine = start_engine(
        model="tiny", num_gpu_blocks_override=64, runtime=runtime, max_stage_restarts=0
    )
    stage = "scheduler" if runtime == "processes" else "engine"
    failure = pytest.raises(mpengine.EngineDeadError, match="planted scheduler failure")
    with engine.client(timeout=60) as client, failure:
        client.generate([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
    assert engine.stopped.wait(30), "the supervisor did not stop the engine"
    assert engine.dead and f"{stage} stage died (exit code 1)" in engine.dead
    assert not marker.exists(), "the failed stage tore its interpreter down"
