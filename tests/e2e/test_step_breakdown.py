"""The step breakdown end to end: every runtime's counters after a known workload,
``mpengine stats``, the Chrome trace of a multi-step run, and the threads runtime against
the serial one (tiny Qwen3, one torch thread everywhere so the runtimes compute alike)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import mpengine
from mpengine.protocol import SamplingParams
from mpengine.testing.engine import wait_idle

ENGINE = dict(model="tiny", num_gpu_blocks_override=256, max_num_seqs=32, num_threads=1)
PROMPTS = [f"Step breakdown prompt {i}: the weather over the hills" for i in range(8)]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
EXECUTOR_PHASES = ("prepare", "forward", "sample", "copy")


@pytest.fixture(scope="module")
def engine(start_engine) -> Callable[[str], mpengine.Engine]:
    """``engine(runtime)``: one engine per runtime for the module, started on first use."""
    started: dict[str, mpengine.Engine] = {}

    def get(runtime: str) -> mpengine.Engine:
        if runtime not in started:
            started[runtime] = start_engine(runtime=runtime, log_level="WARNING", **ENGINE)
        return started[runtime]

    return get


@pytest.mark.parametrize("runtime", ["processes", "serial", "threads"])
def test_counters_after_a_known_workload_are_consistent(engine, runtime):
    with engine(runtime).client() as client:
        outs = client.generate_many(PROMPTS, GREEDY)
        assert all(len(o.token_ids) == 16 for o in outs)
        stats = wait_idle(client, timeout=30)
    stages = stats.stages
    assert list(stages) == ["scheduler", "executor", "output"]
    for name, times in stages.items():
        # Every stage took part in every step the scheduler planned.
        assert times.steps == stats.step >= 16, (name, times.steps, stats.step)
        assert 0 < times.busy <= times.wall + 1e-9, name
        assert times.busy == pytest.approx(sum(times.phases.values())), name
        assert times.idle > 0, name  # the engine waited for these requests at first
    executor = stages["executor"]
    assert set(EXECUTOR_PHASES) <= set(executor.phases)
    assert sum(executor.phases[p] for p in EXECUTOR_PHASES) <= executor.busy
    assert executor.phases["forward"] > 0
    if runtime == "serial":  # one loop: the stages share its wall time, nobody waits
        assert len({t.wall for t in stages.values()}) == 1
        assert sum(t.busy for t in stages.values()) <= executor.wall + 1e-9
        assert not any(t.waits for t in stages.values())
    else:
        assert "lockstep" in stages["scheduler"].waits
        assert {"plan_ring", "result_ring"} <= set(executor.waits)
        assert {"result_ring", "feedback_ring"} <= set(stages["output"].waits)


def test_stats_read_after_the_outputs_count_their_step(engine):
    """The serial runtime sent a step's outputs before its feedback reached the scheduler:
    stats read right after a request's output still showed it running (26 of 30)."""
    with engine("serial").client() as client:
        for i in range(10):
            client.generate(f"fresh {i}", SamplingParams(max_tokens=2, temperature=0.0))
            stats = client.stats()
            assert (stats.num_running, stats.step) == (0, stats.done), stats


def test_stats_command_prints_the_breakdown(engine):
    address = engine("processes").address
    with mpengine.Client(address) as client:
        client.generate_many(PROMPTS[:4], GREEDY)
        wait_idle(client, timeout=30)
    done = subprocess.run(
        [sys.executable, "-m", "mpengine.cli", "stats", address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed["step"] > 0 and "num_free_blocks" in printed  # the scheduler's, as before
    executor = printed["stages"]["executor"]
    assert executor["steps"] == printed["step"]
    assert {"wall_s", "busy_s", "idle_s", "forward_s", "wait_plan_ring_s"} <= set(executor)
    per_step = printed["per_step"]
    assert 0 < per_step["executor_duty"] <= 1
    assert per_step["step_period_ms"] > 0
    assert {"busy_ms", "wait_lockstep_ms", "schedule_ms"} <= set(per_step["scheduler"])
    assert {"prepare_ms", "forward_ms", "sample_ms", "copy_ms", "wait_result_ring_ms"} <= set(
        per_step["executor"]
    )
    assert {"process_ms", "send_ms", "wait_result_ring_ms", "wait_feedback_ring_ms"} <= set(
        per_step["output"]
    )


def spans_by_track(events: list[dict]) -> dict[str, list[dict]]:
    """Complete events by stage (track), each phase span tagged with the step enclosing it."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    tracks: dict[str, list[dict]] = {}
    for e in events:
        if e["ph"] == "X":
            tracks.setdefault(names[e["pid"], e["tid"]], []).append(e)
    for spans in tracks.values():
        steps = [e for e in spans if e["cat"] == "step"]
        for e in spans:
            e["step"] = next(
                (
                    int(s["name"].split()[1])
                    for s in steps
                    if s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"]
                ),
                None,
            )
    return tracks


def overlap(a: dict, b: dict) -> bool:
    return a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]


def overlapping(forwards: dict[int, dict], steps: dict[int, dict], offset: int) -> list[int]:
    """The steps k whose forward pass overlaps another stage's step k + offset."""
    return [k for k, f in forwards.items() if k + offset in steps and overlap(f, steps[k + offset])]


def test_trace_shows_the_stages_overlapping(start_engine, tmp_path: Path):
    """Async depth 1: step k's forward runs beside step k+1's scheduling and step k-1's
    output processing, in three processes whose clocks are one."""
    trace = tmp_path / "trace.json"
    # A forward pass of milliseconds, not the tiny model's tenths: beside another test's
    # engine on the same cores, the next step's scheduling must fall within one.
    config = {**ENGINE, "model": "small"}
    engine = start_engine(runtime="processes", trace=str(trace), log_level="WARNING", **config)
    with engine.client() as client:
        client.generate_many(PROMPTS * 2, SamplingParams(max_tokens=24, ignore_eos=True))
    engine.shutdown()  # the stages write their parts, the launcher merges them
    assert not list(tmp_path.glob("trace.json.*")), "parts left behind"
    events = json.loads(trace.read_text())["traceEvents"]
    processes = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {"mpengine: scheduler", "mpengine: executor", "mpengine: output"}
    tracks = spans_by_track(events)
    assert set(tracks) == {"scheduler", "executor", "output"}
    steps = {
        track: {e["step"]: e for e in spans if e["cat"] == "step"}
        for track, spans in tracks.items()
    }
    assert all(len(by_step) >= 24 for by_step in steps.values())
    forwards = {e["step"]: e for e in tracks["executor"] if e["name"] == "forward"}
    assert {"prepare", "sample", "copy", "wait plan_ring"} <= {
        e["name"] for e in tracks["executor"]
    }
    assert {"process", "send"} <= {e["name"] for e in tracks["output"]}
    ahead = overlapping(forwards, steps["scheduler"], 1)
    behind = overlapping(forwards, steps["output"], -1)
    assert ahead, "no forward pass overlapped the scheduling of the next step"
    assert behind, "no forward pass overlapped the output processing of the step before"


def test_threads_runtime_matches_serial_greedy_outputs(engine):
    prompts = [*PROMPTS[:3], "A much longer prompt about lighthouses and the sea " * 6]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    with engine("serial").client() as serial, engine("threads").client() as threads:
        expected = [o.token_ids for o in serial.generate_many(prompts, params)]
        assert [o.token_ids for o in threads.generate_many(prompts, params)] == expected
        assert threads.info.runtime == "threads"


def test_threads_runtime_aborts_and_frees_every_block(engine):
    with engine("threads").client() as client:
        stream = client.stream(
            "x" * 40, SamplingParams(max_tokens=2000, ignore_eos=True), request_id="long"
        )
        for _ in range(3):
            next(stream)
        client.abort("long")
        rest = list(stream)
        assert rest and rest[-1].finished and rest[-1].finish_reason == "abort"
        stats = wait_idle(client, timeout=30)
        assert stats.num_free_blocks == stats.num_blocks
        # It keeps serving after the abort.
        assert len(client.generate("after", GREEDY).token_ids) == 16
