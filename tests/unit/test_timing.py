"""The step breakdown's accounting and the trace writer, with a fake clock (no processes);
and the in-process counter and queues of the threads runtime."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from mpengine.protocol import (
    Array,
    EngineStats,
    Feedback,
    StageTimes,
    StepResult,
    encoder,
    feedback_decoder,
    result_decoder,
    scheduler_reply_decoder,
)
from mpengine.runtime.threads import Counter, queue_link
from mpengine.runtime.timing import (
    Clock,
    Trace,
    breakdown,
    counters,
    merge_trace,
    part_path,
    per_step,
    since,
)


class FakeTime:
    """``now()`` returns the time set by the test."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def at(self, t: float) -> FakeTime:
        self.t = t
        return self


@pytest.fixture
def now() -> FakeTime:
    return FakeTime()


def one_step(clock: Clock, now: FakeTime, start: float, step: int) -> None:
    """An executor step: 1 s waiting for the plan, 2 s of forward, 0.5 s handing it on."""
    now.at(start + 1.0)
    clock.wait("executor", "plan_ring")
    clock.begin_step("executor", step)
    now.at(start + 3.0)
    clock.work("executor", "forward")
    now.at(start + 3.5)
    clock.wait("executor", "result_ring")
    clock.end_step("executor")


def test_laps_tile_the_loop_time_and_idle_is_not_wall(now: FakeTime) -> None:
    clock = Clock(["executor"], now=now)
    clock.begin_step("executor", 1)  # a step began: waits count from here on
    now.at(102.0)
    clock.work("executor", "prepare")
    now.at(105.0)
    clock.work("executor", "forward")
    now.at(106.0)
    clock.wait("executor", "result_ring")
    now.at(110.0)
    clock.idle()
    (times,) = clock.snapshot().values()
    assert times.phases == {"prepare": 2.0, "forward": 3.0}
    assert times.waits == {"result_ring": 1.0}
    assert times.busy == 5.0 and times.steps == 1
    assert times.idle == 4.0 and times.wall == 6.0  # every lap but the idle one


def test_a_wait_that_ends_idle_polls_is_idle(now: FakeTime) -> None:
    """The executor's first plan after a quiet spell: it waited for a client, not a peer."""
    clock = Clock(["executor"], now=now)
    now.at(100.05)
    clock.idle()  # a poll found nothing
    now.at(100.08)
    clock.wait("executor", "plan_ring")  # then a plan came: still idle
    clock.begin_step("executor", 1)
    now.at(101.0)
    clock.work("executor", "forward")
    now.at(101.5)
    clock.wait("executor", "plan_ring")  # within the run of steps: a real wait
    times = clock.snapshot()["executor"]
    assert times.idle == pytest.approx(0.08)
    assert times.waits == {"plan_ring": pytest.approx(0.5)}
    assert times.wall == pytest.approx(1.42)


def test_marks_charge_the_executor_phases(now: FakeTime) -> None:
    clock = Clock(["executor"], now=now)
    clock.begin_step("executor", 1)
    now.at(100.5)
    clock.work("executor", "decode")
    marks = [("prepare", 100.6), ("forward", 101.0), ("sample", 103.0), ("end", 103.25)]
    assert clock.marks("executor", marks) == 103.25
    times = clock.snapshot()["executor"]
    # The gap between the last lap and the first mark goes to the first phase.
    assert times.phases == {"decode": 0.5, "prepare": 0.5, "forward": 2.0, "sample": 0.25}
    assert times.busy == pytest.approx(3.25)
    now.at(103.5)
    clock.work("executor", "encode")  # the next lap starts at the end mark
    assert clock.snapshot()["executor"].phases["encode"] == pytest.approx(0.25)


def test_snapshot_is_a_copy_and_report_adds_what_was_heard(now: FakeTime) -> None:
    clock = Clock(["scheduler"], now=now)
    clock.begin_step("scheduler", 1)
    now.at(101.0)
    clock.work("scheduler", "schedule")
    snap = clock.snapshot()
    now.at(102.0)
    clock.work("scheduler", "schedule")
    assert snap["scheduler"].phases == {"schedule": 1.0}
    clock.hear({"output": StageTimes(steps=1), "executor": StageTimes(steps=1)})
    assert list(clock.report()) == ["scheduler", "executor", "output"]  # pipeline order


def test_several_stages_share_one_loops_wall(now: FakeTime) -> None:
    """The serial runtime: one loop, three stages; each stage's wall is the loop's."""
    clock = Clock(["scheduler", "executor", "output"], now=now)
    for stage in ("scheduler", "executor", "output"):
        clock.begin_step(stage, 1)
    now.at(101.0)
    clock.work("scheduler", "schedule")
    now.at(104.0)
    clock.work("executor", "forward")
    now.at(105.0)
    clock.work("output", "process")
    report = clock.report()
    assert {t.wall for t in report.values()} == {5.0}
    assert sum(t.busy for t in report.values()) == 5.0
    assert breakdown(report)["executor_duty"] == pytest.approx(3.0 / 5.0)


def test_derived_figures(now: FakeTime) -> None:
    clock = Clock(["executor"], now=now)
    before = clock.report()
    for step in range(1, 5):
        one_step(clock, now, 100.0 + 3.5 * (step - 1), step)
    totals = since(clock.report(), before)["executor"]
    assert totals.steps == 4 and totals.wall == pytest.approx(13.0)  # the first wait: idle
    figures = per_step(totals)
    assert figures["forward_ms"] == pytest.approx(2000.0)
    assert figures["wait_result_ring_ms"] == pytest.approx(500.0)
    assert figures["wait_plan_ring_ms"] == pytest.approx(750.0)
    assert figures["step_ms"] == pytest.approx(3250.0)
    derived = breakdown({"executor": totals})
    assert derived["step_period_ms"] == pytest.approx(3250.0)
    assert derived["executor_duty"] == pytest.approx(8.0 / 13.0)
    named = counters(totals)
    assert named["forward_s"] == 8.0 and named["wait_result_ring_s"] == 2.0
    assert named["steps"] == 4 and "idle_s" in named
    assert per_step(StageTimes())["step_ms"] == 0.0  # no steps, no division


def test_totals_ride_on_results_and_feedback() -> None:
    times = {"executor": StageTimes(3, 1.5, 1.0, 0.5, {"forward": 0.75}, {"plan_ring": 0.5})}
    result = StepResult(3, Array.of([7], "int64"), Array.of([1]), times=times)
    assert result_decoder().decode(encoder.encode(result)).times == times
    feedback = Feedback(3, Array.of([7], "int64"), Array.of([1]), times=times)
    assert feedback_decoder().decode(encoder.encode(feedback)).times == times
    # An engine without the breakdown answers stats without the field: it decodes to {}.
    stats = EngineStats(1, 2, 2, 0, 0, 0, 8, 8, 1, 1, 0, 0, 0)
    assert scheduler_reply_decoder().decode(encoder.encode(stats)).stages == {}


# -- the trace ----------------------------------------------------------------------------


@pytest.fixture
def trace_file(tmp_path: Path) -> Iterator[str]:
    yield str(tmp_path / "run.json")


def traced_steps(trace: Trace, now: FakeTime, num_steps: int) -> None:
    clock = Clock(["executor"], trace, now=now)
    for step in range(1, num_steps + 1):
        one_step(clock, now, 100.0 + 3.5 * (step - 1), step)


def test_trace_part_is_chrome_trace_json_with_nested_spans(trace_file: str, now: FakeTime) -> None:
    trace = Trace.open(trace_file, "executor")
    assert trace is not None and Trace.open(None, "executor") is None
    traced_steps(trace, now, 2)
    trace.write()
    events = json.loads(Path(part_path(trace_file, "executor")).read_text())["traceEvents"]
    meta = {e["name"]: e["args"] for e in events if e["ph"] == "M"}
    assert meta["process_name"] == {"name": "mpengine: executor"}
    assert meta["thread_name"] == {"name": "executor"}
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {2} and {e["cat"] for e in spans} == {
        "phase",
        "wait",
        "step",
    }
    step2 = next(e for e in spans if e["name"] == "step 2")
    forward2 = [e for e in spans if e["name"] == "forward"][1]
    # Microseconds; a step's phases lie inside it, boundaries shared exactly.
    assert step2["ts"] == pytest.approx(104.5e6) and step2["dur"] == pytest.approx(2.5e6)
    assert forward2["ts"] + forward2["dur"] <= step2["ts"] + step2["dur"]
    assert forward2["ts"] == step2["ts"]


def test_trace_keeps_only_the_last_events(trace_file: str, now: FakeTime) -> None:
    trace = Trace(part_path(trace_file, "executor"), "executor", max_events=10)
    traced_steps(trace, now, 20)
    assert len(trace.events) == 10
    assert trace.events[-1][1] == "step 20"


def test_merge_joins_the_parts_and_leaves_a_cut_one(trace_file: str, now: FakeTime) -> None:
    for process in ("scheduler", "executor"):
        trace = Trace.open(trace_file, process)
        assert trace is not None
        traced_steps(trace, now, 2)
        trace.write()
    Path(part_path(trace_file, "output")).write_text('{"displayTimeUnit":"ms","traceEve')
    merged = merge_trace(trace_file, ["scheduler", "executor", "output", "engine"])
    assert merged == ["scheduler", "executor"]
    events = json.loads(Path(trace_file).read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {"mpengine: scheduler", "mpengine: executor"}
    assert not Path(part_path(trace_file, "executor")).exists()
    assert Path(part_path(trace_file, "output")).exists()  # kept for a look by hand


def test_merge_of_nothing_is_an_empty_valid_trace(trace_file: str) -> None:
    assert merge_trace(trace_file, ["engine"]) == []
    assert json.loads(Path(trace_file).read_text()) == {
        "displayTimeUnit": "ms",
        "traceEvents": [],
    }


# -- the threads runtime's counter and queues ------------------------------------------------


def test_counter_waits_and_never_goes_back() -> None:
    done = Counter()
    with pytest.raises(TimeoutError):
        done.wait_at_least(1, timeout=0.01)
    waiter_saw: list[int] = []
    waiter = threading.Thread(target=lambda: waiter_saw.append(done.wait_at_least(2, 10.0)))
    waiter.start()
    done.advance_to(1)
    done.advance_to(2)
    waiter.join(10.0)
    assert waiter_saw == [2] and done.wait_at_least(0) == 2
    done.advance_to(2)  # re-announcing the same step is fine
    with pytest.raises(ValueError):
        done.advance_to(1)


def test_queue_link_carries_the_messages_themselves() -> None:
    link = queue_link()
    with pytest.raises(TimeoutError):
        link.get_view(0.01)
    assert link.try_get() is None
    message = StepResult(1, Array.of([], "int64"), Array.of([]))
    link.put(link.encode(message))
    link.put(link.encode(message))
    with link.get_view(1.0) as frame:
        assert link.decode(frame) is message
    assert link.try_get() is message
    link.close()


def test_stage_times_is_a_wire_struct() -> None:
    times = StageTimes(1, 2.0, 1.0, 0.0, {"forward": 1.0}, {})
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(times), type=StageTimes) == times
