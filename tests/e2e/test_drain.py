"""Graceful drain: stop admitting, let admitted requests finish until the deadline, abort
the rest, exit cleanly. Every request's outcome is counted: none lost, none duplicated, none
left hanging.

Requests of ``SHORT`` tokens finish well inside the drain timeout; requests of ``LONG``
tokens (thousands of steps) cannot, so they end with finish reason ``abort``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

import mpengine
from mpengine import InvalidRequestError, SamplingParams
from tests.e2e.test_server_cli import start

SHORT, LONG = 24, 4000
DRAIN_TIMEOUT_S = 3.0
WAIT_S = 60.0


class Outcomes:
    """What each request ended with, recorded once per request (a second record, or none,
    fails the test)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.results: dict[str, tuple] = {}

    def record(self, name: str, *outcome: object) -> None:
        with self.lock:
            assert name not in self.results, f"{name} ended twice"
            self.results[name] = outcome


def _wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _health(url: str) -> int:
    """The status of ``GET /health``."""
    try:
        urllib.request.urlopen(url + "/health", timeout=5).close()
    except urllib.error.HTTPError as error:
        return error.code
    return 200


def _stream(api: openai.OpenAI, name: str, max_tokens: int, started, outcomes: Outcomes) -> None:
    try:
        stream = api.completions.create(
            model="tiny",
            prompt=f"Story {name}",
            max_tokens=max_tokens,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        num_tokens, finishes = 0, []
        for chunk in stream:
            for choice in chunk.choices:
                num_tokens += 1
                started.add(name)
                if choice.finish_reason:
                    finishes.append(choice.finish_reason)
        outcomes.record(name, finishes, num_tokens)
    except Exception as exc:
        outcomes.record(name, "error", repr(exc))


@pytest.mark.parametrize("group", [False, True], ids=["server", "process-group"])
def test_sigterm_drains_the_http_server(tmp_path: Path, group: bool) -> None:
    """SIGTERM to the server, or to its whole process group (``timeout``, ``kill -- -PGID``,
    a service manager): the stages leave it to the server, which drains."""
    flags = ("--drain-timeout", str(DRAIN_TIMEOUT_S), "--max-num-seqs", "16")
    served = start(tmp_path, *flags, new_session=group)
    try:
        api = openai.OpenAI(base_url=served.base_url, api_key="-", max_retries=0, timeout=WAIT_S)
        outcomes, started = Outcomes(), set()
        plan = {f"short{i}": SHORT for i in range(4)} | {f"long{i}": LONG for i in range(4)}
        threads = [
            threading.Thread(target=_stream, args=(api, name, n, started, outcomes))
            for name, n in plan.items()
        ]
        for thread in threads:
            thread.start()
        _wait_until(lambda: set(plan) <= started, WAIT_S, "every stream to start")
        if group:
            os.killpg(served.proc.pid, signal.SIGTERM)
        else:
            served.proc.send_signal(signal.SIGTERM)

        # Draining: health says so and new requests are refused, over HTTP and IPC.
        _wait_until(lambda: _health(served.url) == 503, WAIT_S, "/health to report draining")
        with pytest.raises(openai.APIStatusError) as refused:
            api.completions.create(model="tiny", prompt="late", max_tokens=2)
        assert refused.value.status_code == 503 and refused.value.body["code"] == "draining"
        with mpengine.Client(served.address) as client, pytest.raises(InvalidRequestError) as late:
            client.generate("late", SamplingParams(max_tokens=2))
        assert late.value.kind == "overloaded" and "draining" in str(late.value)

        assert served.proc.wait(DRAIN_TIMEOUT_S + 30) == 0, served.log()
        for thread in threads:
            thread.join(WAIT_S)
            assert not thread.is_alive(), "a request was left hanging"
    finally:
        if served.proc.poll() is None:
            served.stop(signal.SIGKILL)
    assert set(outcomes.results) == set(plan), "a request was lost"
    for name, outcome in outcomes.results.items():
        finishes, num_tokens = outcome
        if name.startswith("short"):
            assert (finishes, num_tokens) == (["length"], SHORT), (name, outcome)
        else:
            assert finishes == ["abort"] and 0 < num_tokens < LONG, (name, outcome)


def test_a_second_signal_stops_without_waiting_for_the_drain(tmp_path: Path) -> None:
    """Ctrl-C twice (as uvicorn and vLLM take it): the drain's 60 s are not waited out; the
    stream in flight ends with ``abort``."""
    served = start(tmp_path, "--drain-timeout", "60")
    try:
        api = openai.OpenAI(base_url=served.base_url, api_key="-", max_retries=0, timeout=WAIT_S)
        outcomes, started = Outcomes(), set()
        thread = threading.Thread(target=_stream, args=(api, "long", LONG, started, outcomes))
        thread.start()
        _wait_until(lambda: "long" in started, WAIT_S, "the stream to start")
        served.proc.send_signal(signal.SIGINT)
        _wait_until(lambda: _health(served.url) == 503, WAIT_S, "the drain to start")
        begun = time.monotonic()
        served.proc.send_signal(signal.SIGINT)
        assert served.proc.wait(30) == 0, served.log()
        assert time.monotonic() - begun < 30
        thread.join(WAIT_S)
        assert not thread.is_alive()
    finally:
        if served.proc.poll() is None:
            served.stop(signal.SIGKILL)
    finishes, num_tokens = outcomes.results["long"]
    assert finishes == ["abort"] and 0 < num_tokens < LONG


def _refused(client: mpengine.Client) -> bool:
    """Whether a new request is refused as the engine drains (one admitted before the drain
    signal landed finishes: the caller tries again)."""
    try:
        client.generate("late", SamplingParams(max_tokens=1), timeout=WAIT_S)
    except InvalidRequestError as exc:
        assert exc.kind == "overloaded" and "draining" in str(exc)
        return True
    return False


def _generate(client: mpengine.Client, name: str, max_tokens: int, outcomes: Outcomes) -> None:
    try:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        out = client.generate(f"Story {name}", params, request_id=name, timeout=WAIT_S)
        outcomes.record(name, [o.finish_reason for o in out.outputs], len(out.token_ids))
    except Exception as exc:
        outcomes.record(name, "error", repr(exc))


def test_engine_shutdown_drains(start_engine) -> None:
    engine = start_engine(model="tiny", num_gpu_blocks_override=512, log_level="WARNING")
    client = engine.client()
    outcomes = Outcomes()
    plan = {f"short{i}": SHORT for i in range(3)} | {f"long{i}": LONG for i in range(3)}
    threads = [
        threading.Thread(target=_generate, args=(client, name, n, outcomes))
        for name, n in plan.items()
    ]
    for thread in threads:
        thread.start()
    _wait_until(lambda: client.stats().admitted == len(plan), WAIT_S, "all requests to run")

    engine.stop_admitting()

    _wait_until(lambda: _refused(client), WAIT_S, "new requests to be refused")
    started = time.monotonic()
    engine.shutdown(drain=True, drain_timeout=1.0)
    assert time.monotonic() - started < 1.0 + 10.0
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive(), "a request was left hanging"
    assert set(outcomes.results) == set(plan), "a request was lost"
    for name, outcome in outcomes.results.items():
        finishes, num_tokens = outcome
        if name.startswith("short"):
            assert (finishes, num_tokens) == (["length"], SHORT), (name, outcome)
        else:
            assert finishes == ["abort"] and 0 < num_tokens < LONG, (name, outcome)
    client.close()


def test_a_batch_call_admitted_before_the_drain_finishes(start_engine) -> None:
    """A batch call sends its prompts in windows (half the waiting queue at a time): those
    it sends after the drain began belong to admitted work and are served, while a new call
    is refused. They were refused, failing the whole call (a large embeddings request cut
    off by the server's SIGTERM)."""
    engine = start_engine(model="tiny", max_waiting_requests=4, log_level="WARNING")
    client = engine.client()
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    prompts = [f"Batch {i}" for i in range(32)]  # windows of 2: 16 rounds of 32 steps
    outcomes = Outcomes()

    def batch() -> None:
        try:
            outs = client.generate_many(prompts, params, timeout=WAIT_S)
            outcomes.record("batch", [o.outputs[0].finish_reason for o in outs])
        except Exception as exc:
            outcomes.record("batch", "error", repr(exc))

    thread = threading.Thread(target=batch)
    thread.start()
    try:
        # (its whole first window: a request of it still on its way when the drain begins
        # is a new request, refused)
        _wait_until(lambda: client.stats().admitted >= 2, WAIT_S, "the batch to start")
        engine.stop_admitting()
        _wait_until(lambda: _refused(client), WAIT_S, "new requests to be refused")
        received_at_drain = client.stats().received
    finally:
        thread.join(WAIT_S)
    assert not thread.is_alive(), "the batch was left hanging"
    assert outcomes.results["batch"] == (["length"] * len(prompts),)
    assert client.stats().received > received_at_drain  # windows admitted while draining
    client.close()
