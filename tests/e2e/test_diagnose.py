"""``mpengine stacks`` and ``mpengine top`` against a running engine, which goes on serving."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import mpengine
from mpengine import SamplingParams
from mpengine.cli.top import Sample, render_top, verdict
from mpengine.protocol import EngineStats, StageTimes
from mpengine.runtime.engine_file import write_engine_file

STAGES = ("scheduler", "executor", "output")
WAIT_S = 30.0


@pytest.fixture(scope="module")
def engine(start_engine, tmp_path_factory: pytest.TempPathFactory) -> mpengine.Engine:
    directory = tmp_path_factory.mktemp("diagnose")
    return start_engine(
        model="tiny",
        address=f"ipc://{directory}/engine",
        num_gpu_blocks_override=256,
        log_level="WARNING",
    )


def cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "mpengine.cli", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done


def still_serves(engine: mpengine.Engine) -> None:
    with engine.client() as client:
        out = client.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out.token_ids) == 3


def test_stacks_by_address_and_by_pid(engine: mpengine.Engine) -> None:
    for target in ([engine.address], ["--pid", str(engine.pids["scheduler"])]):
        out = cli("stacks", *target, "--faulthandler").stdout
        for stage in STAGES:
            header = f"=== {stage} (pid {engine.pids[stage]}) ==="
            assert header in out, out
            section = out.split(header, 1)[1].split("===", 1)[0]
            assert "Current thread" in section and "in run_stage" in section, section
    still_serves(engine)


def test_stacks_name_a_stopped_stage(engine: mpengine.Engine) -> None:
    output = engine.pids["output"]
    os.kill(output, signal.SIGSTOP)
    try:
        out = cli("stacks", engine.address, "--faulthandler", "--timeout", "1").stdout
    finally:
        os.kill(output, signal.SIGCONT)
    section = out.split(f"=== output (pid {output}) ===", 1)[1]
    assert "stopped (SIGSTOP)" in section.split("===", 1)[0]
    assert "in run_stage" in out.split("=== executor", 1)[1]  # the others still dumped
    still_serves(engine)


def test_top_once_under_load(engine: mpengine.Engine) -> None:
    client = engine.client()
    params = SamplingParams(max_tokens=4000, ignore_eos=True)

    def generate() -> None:
        with contextlib.suppress(mpengine.ClientClosedError):  # the test closes it
            client.generate([5, 6, 7], params, timeout=120)

    worker = threading.Thread(target=generate)
    worker.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while client.stats().num_running == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        out = cli("top", engine.address, "--once", "--interval", "0.5").stdout
    finally:
        client.close()  # aborts the request
        worker.join(WAIT_S)
    assert "1 running" in out and "KV cache" in out and "steps/s" in out, out
    for stage in STAGES:
        assert any(line.startswith(stage) for line in out.splitlines()), out
    assert "verdict" in out


def _stats(done: int, stages: dict[str, tuple[int, float]], **counts: int) -> EngineStats:
    fields = dict.fromkeys(EngineStats.__struct_fields__, 0)
    fields.update(query_id=0, step=done + 1, done=done, num_blocks=100, num_free_blocks=75)
    fields["stages"] = {
        name: StageTimes(steps=steps, wall=busy * 2, busy=busy, phases={}, waits={})
        for name, (steps, busy) in stages.items()
    }
    fields.update(counts)
    return EngineStats(**fields)


def test_top_and_stats_of_no_engine_fail_at_once(tmp_path) -> None:
    """``top`` waited out the client's whole handshake timeout (30 s) where ``stats`` said
    at once that nothing is there."""
    address = f"ipc://{tmp_path}"
    for command in ("top", "stats"):
        cmd = [sys.executable, "-m", "mpengine.cli", command, address]
        if command == "top":
            cmd.append("--once")
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        assert done.returncode != 0 and "no engine at" in done.stderr, done.stderr


def test_a_killed_engine_s_leftovers_are_no_engine(tmp_path: Path) -> None:
    """A launcher killed outright leaves its engine.json and socket files: ``stacks``
    signals no recorded pid that is not a live stage of that launcher (a reused pid would
    have been killed by the signal), and ``top`` and ``stats`` say nothing listens."""
    directory = tmp_path / "engine"
    directory.mkdir(mode=0o700)
    stale = {"scheduler": os.getpid(), "executor": os.getppid()}  # alive, not stages
    write_engine_file(str(directory), {"pid": os.getpid(), "stages": stale})
    with socket.socket(socket.AF_UNIX) as dead:  # a socket file no one listens at
        dead.bind(str(directory / "requests.sock"))
    address = f"ipc://{directory}"
    cmd = [sys.executable, "-m", "mpengine.cli"]
    done = subprocess.run([*cmd, "stacks", address], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "is left from an engine" in done.stderr, done.stderr
    for command in (["top", address, "--once"], ["stats", address]):
        done = subprocess.run([*cmd, *command], capture_output=True, text=True, timeout=20)
        assert done.returncode != 0 and "nothing listens there" in done.stderr, done.stderr
    done = subprocess.run(
        [*cmd, "stats", address, "--timeout", "-1"], capture_output=True, text=True, timeout=20
    )
    assert done.returncode == 2 and "positive number of seconds" in done.stderr, done.stderr


def test_render_top_names_the_bottleneck() -> None:
    before = Sample(
        _stats(100, {"scheduler": (100, 0.1), "executor": (100, 1.0)}, generated_tokens=1000),
        10.0,
    )
    after = Sample(
        _stats(
            300,
            {"scheduler": (300, 0.3), "executor": (300, 2.8)},
            num_running=4,
            generated_tokens=1800,
            computed_tokens=3000,
        ),
        12.0,
    )
    screen = render_top(before, after, "title")
    assert "4 running" in screen and "25.0% of 100 blocks" in screen
    assert "400.0 tokens/s generated" in screen and "1500.0 tokens/s computed" in screen
    assert "100.0 steps/s" in screen and "lag 1 steps" in screen
    executor = next(line for line in screen.splitlines() if line.startswith("executor"))
    assert executor.split() == ["executor", "90%", "9.00"]
    assert (
        screen.splitlines()[-1] == "verdict   the executor is the bottleneck: busy 90% of the time"
    )
    assert "no stage is saturated" in verdict({"scheduler": 0.1, "executor": 0.3})


def test_stacks_needs_a_target(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mpengine.cli", "stacks"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "ADDRESS or --pid" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "mpengine.cli", "stacks", f"ipc://{tmp_path}/none"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "no running engine" in done.stderr
