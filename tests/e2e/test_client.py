"""The client library: lifetime (dropped clients, dead engines), an I/O thread that survives
bad deliveries, timeouts, chunked aborts, the handshake, tcp from another host, auth tokens.

Tests that need no real engine talk to ``FakeEngine``: two ROUTER sockets played by a
thread of the test, which answers greetings, records what the client sends and sends what
the test asks for.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import numpy as np
import pytest
import zmq

import mpengine
from mpengine.addresses import output_address
from mpengine.client.connection import abort_frames
from mpengine.client.tokens import INLINE_TOKENIZE_CHARS, off_the_loop
from mpengine.errors import ClientClosedError, ProtocolError
from mpengine.protocol import (
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    Array,
    EngineInfo,
    EngineStats,
    Hello,
    OutputBatch,
    OutputDelta,
    PoolingParams,
    RequestError,
    SamplingParams,
    StatsQuery,
    client_request_decoder,
    encoder,
)
from mpengine.testing.engine import client_process, free_port_pair, wait_idle

PROMPT = "The old lighthouse keeper looked at the sea and said"
LONG = SamplingParams(max_tokens=2000, temperature=1.0, ignore_eos=True)
ASYNC_LIMIT_S = 30.0  # bounds every await of an asyncio test


# -- a fake engine ---------------------------------------------------------------------------


def final_delta(request_id: str) -> bytes:
    delta = OutputDelta(request_id, 0, Array.of([5]), "x", finish_reason="length")
    return encoder.encode(OutputBatch([delta]))


def caller_id(wire_id: str) -> str:
    """The caller's request id in a client's wire id ("ID#N")."""
    return wire_id.rpartition("#")[0]


class FakeEngine:
    """Answers ``Hello`` (with ``hello_reply`` if given, ``"ignore"``: not at all) and, if
    ``answer_stats``, ``StatsQuery``; ``respond(request)`` returns the frames to send for an
    ``AddRequest`` as ``("out" | "req", frame)`` pairs. Everything received is recorded."""

    def __init__(
        self,
        tmp_path,
        *,
        hello_reply: RequestError | str | None = None,
        answer_stats: bool = True,
        respond: Callable[[AddRequest], list[tuple[str, bytes]]] | None = None,
        max_request_bytes: int = 1 << 20,
    ) -> None:
        self.address = f"ipc://{tmp_path}/requests.sock"
        self.info = EngineInfo(
            engine_id="fake",
            model="fake",
            tokenizer="",
            vocab_size=100,
            max_model_len=1000,
            block_size=16,
            num_blocks=10,
            max_num_seqs=4,
            max_num_batched_tokens=100,
            eos_token_ids=[2],
            runtime="fake",
            async_depth=0,
            request_address=self.address,
            output_address=f"ipc://{tmp_path}/outputs.sock",
            max_request_bytes=max_request_bytes,
        )
        self.hello_reply = hello_reply
        self.answer_stats = answer_stats
        self.respond = respond or (lambda request: [])
        self.received: list[object] = []  # decoded messages on the request socket
        self.abort_frames: list[bytes] = []
        self.changed = threading.Condition()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.stop = threading.Event()
        self.ctx = zmq.Context()
        self.requests = self._router(self.address)
        self.outputs = self._router(self.info.output_address)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _router(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        return sock

    def _run(self) -> None:
        decoder = client_request_decoder()
        poller = zmq.Poller()
        poller.register(self.requests, zmq.POLLIN)
        poller.register(self.outputs, zmq.POLLIN)
        while not self.stop.is_set():
            events = dict(poller.poll(10))
            if self.outputs in events:
                client, _ = self.outputs.recv_multipart()
                self.outputs.send_multipart([client, encoder.encode(Hello("fake"))])
            if self.requests in events:
                client, frame = self.requests.recv_multipart()
                self._handle(client, frame, decoder.decode(frame))
            while not self.outbox.empty():
                which, client, frame = self.outbox.get()
                sock = self.outputs if which == "out" else self.requests
                sock.send_multipart([client, frame])

    def _handle(self, client: bytes, frame: bytes, msg: object) -> None:
        with self.changed:
            self.received.append(msg)
            if isinstance(msg, Abort):
                self.abort_frames.append(frame)
            self.changed.notify_all()
        match msg:
            case Hello() if self.hello_reply != "ignore":
                reply = self.hello_reply or self.info
                self.requests.send_multipart([client, encoder.encode(reply)])
            case StatsQuery() if self.answer_stats:
                stats = EngineStats(msg.query_id, *([0] * 12))
                self.requests.send_multipart([client, encoder.encode(stats)])
            case AddRequest():
                for which, reply in self.respond(msg):
                    self.outbox.put((which, client, reply))

    def wait_for(self, predicate: Callable[[list[object]], bool], timeout: float = 10.0) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: predicate(self.received), timeout), (
                "the fake engine did not receive what was expected"
            )

    def aborted(self) -> set[str]:
        """The caller's ids of the requests aborted (the wire ids without their number)."""
        return {caller_id(i) for m in self.received if isinstance(m, Abort) for i in m.request_ids}

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.ctx.destroy(linger=0)


@pytest.fixture
def fake(tmp_path) -> Iterator[Callable[..., FakeEngine]]:
    fakes: list[FakeEngine] = []

    def make(**kwargs) -> FakeEngine:
        fakes.append(FakeEngine(tmp_path / str(len(fakes)), **kwargs))
        return fakes[-1]

    for i in range(3):
        (tmp_path / str(i)).mkdir()
    yield make
    for f in fakes:
        f.close()


def add_request(request_id: str) -> AddRequest:
    return AddRequest(request_id, Array.of([1, 2, 3]), LONG)


# -- pure client behaviour (fake engine) -----------------------------------------------------


def test_addresses_and_abort_frames():
    assert output_address("tcp://10.1.2.3:5555", "tcp://*:5556") == "tcp://10.1.2.3:5556"
    assert output_address("tcp://gpu-box:5555", "tcp://0.0.0.0:5556") == "tcp://gpu-box:5556"
    assert output_address("tcp://[::1]:5555", "tcp://[::]:5556") == "tcp://[::1]:5556"
    advertised = "tcp://public.example:5556"
    assert output_address("tcp://10.1.2.3:5555", advertised) == advertised
    assert output_address("ipc:///x/requests.sock", "ipc:///x/outputs.sock").endswith(
        "outputs.sock"
    )
    ids = [f"{i:0200d}" for i in range(3000)]
    frames = abort_frames(ids, 32 * 1024)
    assert all(len(f) <= 32 * 1024 for f in frames) and len(frames) > 10
    decoded = [msgspec.msgpack.decode(f, type=Abort) for f in frames]
    assert [i for a in decoded for i in a.request_ids] == ids


@pytest.mark.parametrize(
    "reply, error",
    [
        (RequestError("", "protocol version 3 is not supported", "invalid"), ConnectionError),
        (RequestError("", "bad token", "unauthorized"), PermissionError),
    ],
)
def test_refused_hello_raises_a_clear_error(fake, reply, error):
    engine = fake(hello_reply=reply)
    with pytest.raises(error, match=reply.message):
        mpengine.Client(engine.address, timeout=5)
    hello = engine.received[0]
    assert isinstance(hello, Hello) and hello.protocol_version == PROTOCOL_VERSION


def test_unanswered_hello_times_out(fake):
    engine = fake(hello_reply="ignore")
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=r"no answer from an engine .* within 0\.5 s"):
        mpengine.Client(engine.address, timeout=0.5)
    assert time.monotonic() - start < 3


def test_io_thread_survives_bad_frames_and_failing_receivers(fake):
    def respond(request: AddRequest) -> list[tuple[str, bytes]]:
        rid = request.request_id  # (the wire id: the engine's outputs name it)
        if caller_id(rid) == "garbage-first":  # undecodable bytes on both sockets, then the answer
            return [("out", b"\xc1\x00garbage"), ("req", b"\xff"), ("out", final_delta(rid))]
        if caller_id(rid) == "bad-batch":  # msgpack that fails validation: only this request fails
            return [("out", msgspec.msgpack.encode(["OutputBatch", [["OutputDelta", rid, "?"]]]))]
        return [("out", final_delta(rid))]

    engine = fake(respond=respond)
    with mpengine.Client(engine.address, timeout=5) as client:
        thread = client._conn.thread

        def failing_sink(item: object) -> None:
            raise RuntimeError("the receiver is broken")

        client._conn.submit(add_request("broken-sink"), failing_sink)
        engine.wait_for(lambda _: "broken-sink" in engine.aborted())
        out = client.generate([1, 2], request_id="garbage-first", timeout=10)
        assert out.finished and out.text == "x"
        with pytest.raises(ProtocolError):
            client.generate([1, 2], request_id="bad-batch", timeout=10)
        engine.wait_for(lambda _: "bad-batch" in engine.aborted())
        assert client.generate([1, 2], request_id="after", timeout=10).finished
        assert thread.is_alive()


def test_timeouts_raise_and_abort(fake):
    engine = fake(answer_stats=False)  # answers hellos only
    with mpengine.Client(engine.address, timeout=5) as client:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            client.stats(timeout=0.2)
        with pytest.raises(TimeoutError):
            client.generate([1, 2], LONG, request_id="g", timeout=0.2)
        with pytest.raises(TimeoutError):
            list(client.stream([1, 2], LONG, request_id="s", timeout=0.2))
        with pytest.raises(TimeoutError):
            client.generate_many([[1], [2]], LONG, timeout=0.2, request_ids=["m1", "m2"])
        assert time.monotonic() - start < 5
        engine.wait_for(lambda _: {"g", "s", "m1", "m2"} <= engine.aborted())

    async def main() -> None:
        async with mpengine.AsyncClient(engine.address, timeout=5) as aclient:
            with pytest.raises(TimeoutError):
                await aclient.generate([1, 2], LONG, request_id="ag", timeout=0.2)
            with pytest.raises(TimeoutError):
                async for _ in aclient.stream([1, 2], LONG, request_id="as", timeout=0.2):
                    pass
            with pytest.raises(TimeoutError):
                await aclient.stats(timeout=0.2)

    asyncio.run(asyncio.wait_for(main(), ASYNC_LIMIT_S))
    engine.wait_for(lambda _: {"ag", "as"} <= engine.aborted())


def test_close_aborts_thousands_of_requests_in_small_frames(fake):
    engine = fake(max_request_bytes=100 * 1024)
    ids = [f"{i:0200d}" for i in range(3000)]
    client = mpengine.Client(engine.address, timeout=5)
    for request_id in ids:
        client._conn.submit(add_request(request_id), lambda item: None)
    engine.wait_for(lambda got: sum(isinstance(m, AddRequest) for m in got) == len(ids))
    client.close()
    engine.wait_for(lambda _: engine.aborted() == set(ids))
    assert max(len(f) for f in engine.abort_frames) <= min(64 * 1024, 50 * 1024)


# -- with a real engine ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(start_engine):
    # A small frame limit: one Abort of thousands of long ids would exceed it.
    return start_engine(
        model="tiny",
        num_gpu_blocks_override=256,
        max_num_seqs=32,
        max_request_bytes=256 * 1024,
        max_waiting_requests=8192,
    )


@pytest.fixture(scope="module")
def client(engine):
    with engine.client() as client:
        yield client


def assert_idle(client: mpengine.Client, timeout: float = 30.0) -> None:
    stats = wait_idle(client, timeout=timeout)
    assert stats.num_free_blocks == stats.num_blocks


def test_batches_larger_than_the_queue_are_fed_as_it_drains(start_engine):
    """A queue of 4 requests or 64 prompt tokens: a 30-prompt batch still completes (fed as
    earlier ones finish, never ``overloaded``), with the same results as one at a time."""
    small = start_engine(
        model="tiny", max_num_seqs=4, max_waiting_requests=4, max_waiting_tokens=64
    )
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = [[3 + i, 5, 7, 9 + i % 7] * (1 + i % 5) for i in range(30)]
    with small.client() as c:
        outs = c.generate_many(prompts, params, timeout=120)
        alone = [c.generate(p, params, timeout=60).token_ids for p in prompts[:3]]
        assert [o.token_ids for o in outs[:3]] == alone
        assert all(len(o.token_ids) == 3 for o in outs)
        assert c.stats().rejected == 0 and c.stats().received == 33
        assert_idle(c)


@pytest.mark.parametrize("max_num_seqs", [2, 8])
def test_concurrent_batch_calls_share_the_queue(start_engine, max_num_seqs):
    """Each batch call keeps at most four steps of ``max_num_seqs``, and an eighth of the
    queue unless a step takes more, in flight (here 8 of a 64-sequence queue), so three
    calls of 40 prompts of one client at once fit its half of the queue: with half the
    queue each, the third was refused as ``overloaded``."""
    small = start_engine(model="tiny", max_num_seqs=max_num_seqs, max_waiting_requests=64)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def run() -> list[list]:
        async with mpengine.AsyncClient(small.address) as client:
            calls = [
                client.generate_many([[3 + i, 5 + c, 7] for i in range(40)], params, timeout=120)
                for c in range(3)
            ]
            return await asyncio.gather(*calls)

    results = asyncio.run(run())
    assert [len(outs) for outs in results] == [40, 40, 40]
    with small.client() as c:
        assert c.stats().rejected == 0
        assert_idle(c)


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_long_request_does_not_hold_back_the_rest_of_its_batch(start_engine, use_async):
    """A batch call keeps 8 requests in flight (four steps of max_num_seqs 2): a long one
    first, 40 short ones after it. The short ones flow beside the long one as each ends
    (200 steps); waiting for the oldest in flight ran them after it (234)."""
    small = start_engine(model="tiny", max_num_seqs=2)
    prompts = [[3 + i, 5, 7] for i in range(41)]
    params = [SamplingParams(max_tokens=200, ignore_eos=True)]
    params += [SamplingParams(max_tokens=2, ignore_eos=True)] * 40
    with small.client() as c:
        before = c.stats().step
        if use_async:

            async def run() -> list:
                async with mpengine.AsyncClient(small.address) as a:
                    return await a.generate_many(prompts, params, timeout=120)

            outs = asyncio.run(run())
        else:
            outs = c.generate_many(prompts, params, timeout=120)
        assert [len(o.token_ids) for o in outs] == [200] + [2] * 40
        assert wait_idle(c).step - before < 220


def test_a_batch_call_under_way_is_not_refused_by_others_filling_the_queue(start_engine):
    """Single requests of another client keep the queue (4 requests) full while a batch
    call feeds its windows (2 requests): the batch's later requests go in past the bound
    (up to twice it), so the call completes; the single requests are refused as
    ``overloaded`` meanwhile. It failed part-way before."""
    small = start_engine(model="tiny", max_num_seqs=2, max_waiting_requests=4)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [[3 + i, 5, 7] for i in range(24)]

    async def run() -> tuple[list, int]:
        async with (
            mpengine.AsyncClient(small.address) as batcher,
            mpengine.AsyncClient(small.address) as other,
        ):
            batch = asyncio.create_task(batcher.generate_many(prompts, params, timeout=120))
            deadline = time.monotonic() + 60
            while (await other.stats()).received < 2:  # the batch's first window is in
                assert time.monotonic() < deadline, "the batch call sent nothing"
            refused = 0
            while not batch.done():
                wave = [other.generate([9, 9, 9 + i], params, timeout=60) for i in range(6)]
                for result in await asyncio.gather(*wave, return_exceptions=True):
                    if isinstance(result, mpengine.InvalidRequestError):
                        assert result.kind == "overloaded", result
                        refused += 1
                    elif isinstance(result, BaseException):
                        raise result
            return await batch, refused

    outs, refused = asyncio.run(run())
    assert [len(o.token_ids) for o in outs] == [4] * len(prompts)
    assert refused > 0  # the queue was full while the batch went on


def test_async_embed_many_feeds_a_small_queue_and_checks_counts(start_engine):
    small = start_engine(model="tiny-bert", max_waiting_requests=4)
    texts = [f"sentence number {i} about the sea" for i in range(25)]

    async def run() -> list:
        async with mpengine.AsyncClient(small.address) as c:
            with pytest.raises(ValueError, match="25 prompts, 2 parameter sets"):
                await c.embed_many(texts, [PoolingParams(), PoolingParams()])
            outs = await c.embed_many(texts, timeout=120)
            alone = await c.embed(texts[7], timeout=60)
            # A refused input raises as it arrives (the batch's requests share one queue).
            bad = [c.info.vocab_size + 5]
            with pytest.raises(mpengine.InvalidRequestError, match="vocabulary"):
                await c.embed_many([*texts[:3], bad, texts[3]], timeout=60)
            return outs, alone

    outs, alone = asyncio.run(run())
    assert len(outs) == 25
    np.testing.assert_allclose(outs[7].embedding, alone.embedding, atol=1e-5)


def test_priority_scheduling_serves_every_priority(start_engine):
    urgent_first = start_engine(model="tiny", max_num_seqs=2, scheduling_policy="priority")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i, 6, 7] for i in range(6)]
    with urgent_first.client() as c:
        outs = c.generate_many(prompts, params, priority=[3, -1, 0, 7, -1, 2], timeout=60)
        alone = [c.generate(p, params, priority=1, timeout=60).token_ids for p in prompts]
        assert [o.token_ids for o in outs] == alone
        with pytest.raises(ValueError, match="6 prompts and 2 priorities"):
            c.generate_many(prompts, params, priority=[1, 2])
        for bad in (2**40, 1.5, None, "1"):  # (a float or None was a TypeError)
            with pytest.raises(mpengine.InvalidRequestError, match="priority"):
                c.generate(prompts[0], params, priority=bad)
        assert_idle(c)


def test_clients_of_a_stopped_engine_fail_at_once(start_engine):
    engine = start_engine(model="tiny", max_num_seqs=2, num_gpu_blocks_override=64)
    for _ in range(5):  # closed and dropped clients are not kept
        with engine.client() as c:
            c.generate([5, 6], SamplingParams(max_tokens=1), timeout=60)
    del c
    gc.collect()
    assert len(engine._clients) == 0
    engine.shutdown()
    for connect in (engine.client, engine.async_client):
        with pytest.raises(mpengine.EngineDeadError, match="shut down"):
            connect()


def test_long_texts_are_tokenized_off_the_event_loop() -> None:
    async def where(texts: list) -> int:
        return await off_the_loop(texts, threading.get_ident)

    here = threading.get_ident()
    assert asyncio.run(where(["short", [1, 2, 3]])) == here
    assert asyncio.run(where(["x" * (INLINE_TOKENIZE_CHARS + 1)])) != here


def test_client_dropped_after_engine_death_never_hangs(start_engine):
    """A subprocess streams through a client it never closes; the engine is killed under
    it; the subprocess drops its clients, collects garbage and exits, within the timeout."""
    doomed = start_engine(
        model="tiny", num_gpu_blocks_override=64, max_num_seqs=4, max_stage_restarts=0
    )
    script = (
        "import gc, sys, mpengine\n"
        "short = mpengine.SamplingParams(max_tokens=2, ignore_eos=True)\n"
        "long = mpengine.SamplingParams(max_tokens=900, ignore_eos=True)\n"
        "held = mpengine.Client(sys.argv[1])\n"
        "held.generate([1, 2, 3], short, timeout=60)\n"
        "try:\n"
        "    for i, _ in enumerate(mpengine.Client(sys.argv[1]).stream([1], long, timeout=60)):\n"
        "        if i == 0:\n"
        "            print('streaming', flush=True)\n"
        "except mpengine.EngineDeadError:\n"
        "    print('engine dead', flush=True)\n"
        "del held\n"
        "gc.collect()\n"
        "print('collected', flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, doomed.address], stdout=subprocess.PIPE, text=True
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 90)
        assert ready and proc.stdout.readline().strip() == "streaming"
        os.kill(doomed.pids["scheduler"], signal.SIGKILL)
        assert doomed.stopped.wait(30), "the launcher stops the engine"
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and out.split() == ["engine", "dead", "collected"]
    finally:
        proc.kill()
        proc.wait(10)


def test_dropped_client_stops_its_thread_and_aborts_its_requests(engine, client):
    admitted = client.stats().admitted
    dropped = mpengine.Client(engine.address)
    thread = dropped._conn.thread
    dropped._conn.submit(add_request("left-behind"), lambda item: None)
    deadline = time.monotonic() + 30
    while client.stats().admitted == admitted:  # until the engine runs it
        assert time.monotonic() < deadline
    del dropped
    gc.collect()
    thread.join(5)
    assert not thread.is_alive(), "the I/O thread of a dropped client ends"
    assert_idle(client)


def test_async_client_outlives_its_event_loops(engine, client):
    aclient = engine.async_client()
    try:
        # 1. asyncio.run ends while a task still streams: the request is aborted.
        async def leave_streaming() -> None:
            started = asyncio.Event()

            async def consume() -> None:
                async for _ in aclient.stream([1, 2, 3], LONG):
                    started.set()

            asyncio.get_running_loop().create_task(consume())
            await asyncio.wait_for(started.wait(), ASYNC_LIMIT_S)

        asyncio.run(leave_streaming())
        # 2. A loop closed under a stream that was never finalized: its next delta meets a
        # closed loop, which fails (and aborts) that request only.
        loop = asyncio.new_event_loop()
        orphan = aclient.stream([1, 2, 3], LONG, request_id="orphan")
        loop.run_until_complete(asyncio.wait_for(orphan.__anext__(), ASYNC_LIMIT_S))
        loop.close()
        assert_idle(client)
        assert aclient._conn.thread.is_alive()

        async def again() -> mpengine.RequestOutput:
            return await aclient.generate(PROMPT, SamplingParams(max_tokens=4), timeout=30)

        assert len(asyncio.run(again()).token_ids) == 4
        asyncio.run(orphan.aclose())
    finally:
        aclient.close()


def test_timeouts_abort_on_the_engine(client):
    with pytest.raises(TimeoutError):
        client.generate([1, 2, 3], LONG, timeout=0.5)
    with pytest.raises(TimeoutError):
        for _ in client.stream([1, 2, 3], LONG, timeout=0.5):
            pass

    async def main() -> None:
        async with mpengine.AsyncClient(client.info.request_address) as aclient:
            with pytest.raises(TimeoutError):
                await aclient.generate([1, 2, 3], LONG, timeout=0.5)

    asyncio.run(asyncio.wait_for(main(), ASYNC_LIMIT_S))
    assert_idle(client)


def test_a_request_id_is_free_again_once_its_caller_is_done(client):
    """A retry under the id of a request that timed out got that request's late final
    output (``abort``, its tokens), and the retry ran on unread; an id reused right after
    its request finished was refused now and then, the engine not having let it go yet.
    Each submission now has its own id on the wire."""
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = client.generate([7, 8, 9], short, timeout=30).token_ids
    for trial in range(5):
        with pytest.raises(TimeoutError):
            client.generate([1, 2, 3], LONG, request_id="retried", timeout=0.05 * trial)
        out = client.generate([7, 8, 9], short, request_id="retried", timeout=30)
        assert (out.request_id, out.finish_reason, out.token_ids) == ("retried", "length", want)
    for _ in range(50):
        out = client.generate([7, 8], SamplingParams(max_tokens=1), request_id="again")
        assert out.finished and out.request_id == "again"
    stream = client.stream([1, 2, 3], LONG, request_id="running")
    next(stream)
    with pytest.raises(mpengine.InvalidRequestError, match="'running' is already in use"):
        client.generate([1, 2], short, request_id="running", timeout=30)
    client.abort("running")  # the caller's id reaches the request running under it
    assert [o.finish_reason for o in stream][-1] == "abort"
    assert_idle(client)


def test_a_stream_times_out_for_a_reader_slower_than_the_engine(client):
    """A reader slower than the engine always found a delta waiting, so a stream's
    ``timeout`` never fired (sync); each step now checks the deadline first."""

    def slow_reader() -> None:  # (the sleep is the slow reader, not a synchronisation)
        for _ in client.stream([1, 2, 3], LONG, timeout=0.3):
            time.sleep(0.4)

    with pytest.raises(TimeoutError, match=r"within 0\.3 s"):
        slow_reader()

    async def main() -> None:
        async with mpengine.AsyncClient(client.info.request_address) as aclient:
            with pytest.raises(TimeoutError, match=r"within 0\.3 s"):
                async for _ in aclient.stream([1, 2, 3], LONG, timeout=0.3):
                    await asyncio.sleep(0.4)

    asyncio.run(asyncio.wait_for(main(), ASYNC_LIMIT_S))
    assert_idle(client)


def test_a_late_reader_still_gets_a_request_that_ended(client):
    """The deadline ends a stream whose request still runs, not one whose every delta has
    arrived: those are the caller's, read late or not."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    stream = client.stream([1, 2, 3], params, timeout=0.3)
    first = next(stream)
    steps = stream.gi_frame.f_locals["steps"].gi_frame  # (the stream's steps, driven)
    request = steps.f_locals["request"]  # (their own request)
    deadline = time.monotonic() + 30
    passed = steps.f_locals["deadline"].at
    while not request.ended or time.monotonic() < passed:  # (polls)
        assert time.monotonic() < deadline, "the request did not end"
        time.sleep(0.01)
    rest = list(stream)  # past the deadline, and nothing lost
    assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 4
    assert rest[-1].finished


def test_a_stream_dropped_while_its_thread_submits_does_not_hang(client):
    """A stream dropped in a reference cycle is closed by the collector in whatever thread
    runs it, maybe one inside ``submit`` holding the connection's lock: its cleanup took
    that lock again and the thread hung for good."""
    stream = client.stream([1, 2, 3], LONG)
    next(stream)
    with client._conn._lock:  # (as submit holds it when the collector runs)
        stream.close()
    assert_idle(client)


def test_a_cancelled_call_with_a_timeout_stops(client):
    """``asyncio.wait_for`` before Python 3.12 drops a cancellation that comes in the loop
    turn its awaitable finishes in: a cancelled ``generate(timeout=...)`` ran on to the
    end about one time in five, for a caller that had given up."""

    async def main() -> int:
        finished = 0
        async with mpengine.AsyncClient(client.info.request_address) as aclient:
            for trial in range(40):
                task = asyncio.ensure_future(aclient.generate([1, 2, 3], LONG, timeout=60))
                async for _ in aclient.stream([4, 5], SamplingParams(max_tokens=1 + trial % 7)):
                    pass  # (some of the engine's steps: the cancel lands at varied moments)
                task.cancel()
                try:
                    await task
                    finished += 1
                except asyncio.CancelledError:
                    pass
        return finished

    assert asyncio.run(asyncio.wait_for(main(), 4 * ASYNC_LIMIT_S)) == 0
    assert_idle(client)


def test_no_deadline_is_an_infinite_timeout(engine):
    with mpengine.Client(engine.address, timeout=math.inf) as client:
        short = SamplingParams(max_tokens=2)
        assert client.generate([1, 2], short, timeout=math.inf).finished
        assert client.generate([1, 2], short, timeout=1e12).finished
        assert client.stats(timeout=math.inf).num_blocks


def test_a_forked_child_never_waits_on_a_lock_its_parent_held(client):
    """A fork while another thread fetched the tokenizer (holding the client's locks) left
    them held in the child: its ``tokenize`` hung forever. The child makes them anew, and
    its use of the client fails as every other call there does."""
    fresh = mpengine.Client(client.info.request_address)  # (no tokenizer fetched yet)
    try:
        with fresh._tokenizer_lock, fresh._conn._lock:  # as another thread would hold them
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    signal.alarm(10)  # (a hang ends the child, failing the test)
                    fresh.tokenize("hello")
                except ClientClosedError:
                    code = 0
                finally:
                    os._exit(code)
        deadline = time.monotonic() + 30
        while (status := os.waitpid(pid, os.WNOHANG)) == (0, 0):  # (polls a deadline)
            assert time.monotonic() < deadline, "the child hung"
            time.sleep(0.02)
        assert os.waitstatus_to_exitcode(status[1]) == 0
    finally:
        fresh.close()


def test_a_refused_prompt_of_a_batch_raises_at_once_and_aborts_the_rest(client):
    """The batch waited for the requests before the bad one to finish, and left them
    running: now the refusal raises as it arrives, and the others are aborted."""
    before = client.stats()
    bad = [client.info.vocab_size + 5]
    with pytest.raises(mpengine.InvalidRequestError, match="vocabulary"):
        client.generate_many([[1, 2, 3], bad, [4, 5, 6]], LONG, timeout=60)
    after = wait_idle(client, timeout=30)
    assert after.aborted - before.aborted == 2
    assert after.generated_tokens - before.generated_tokens < LONG.max_tokens


def test_arguments_of_the_wrong_type_fail_at_once(client):
    """An int request id once went to the engine, whose refusal never reached the caller:
    it hung. A dict of parameters was iterated as one set per prompt."""
    with pytest.raises(TypeError, match="params must be SamplingParams"):
        client.generate([1, 2], {"max_tokens": 2})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="request_id must be a str"):
        client.generate([1, 2], SamplingParams(max_tokens=2), request_id=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="request_id must be a str"):
        client.generate_many([[1], [2]], request_ids=[1, 2])  # type: ignore[list-item]
    assert client.generate([1, 2], SamplingParams(max_tokens=2), request_id="ok").finished


def test_close_with_thousands_pending_frees_every_block(engine, client):
    ids = [f"{i:0200d}" for i in range(3000)]

    async def main() -> list[BaseException | mpengine.RequestOutput]:
        aclient = engine.async_client()
        tasks = [asyncio.create_task(aclient.generate([1, 2, 3], LONG, request_id=i)) for i in ids]
        deadline = time.monotonic() + 60
        while True:  # until the engine holds every request
            stats = await aclient.stats()
            if stats.num_waiting + stats.num_running + stats.num_preempted == len(ids):
                break
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.05)
        aclient.close()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(asyncio.wait_for(main(), 120))
    assert all(isinstance(r, ClientClosedError) for r in results)
    assert_idle(client, timeout=60)
    assert len(client.generate(PROMPT, SamplingParams(max_tokens=4)).token_ids) == 4


def test_a_client_id_is_free_again_once_its_client_closed(engine):
    """The engine's socket lets go of a closed connection a moment later; a new one under
    the same id, made at once, was ignored until its handshake timed out."""
    for _ in range(3):
        with mpengine.Client(engine.address, client_id="reused", timeout=10) as c:
            assert c.generate(PROMPT, SamplingParams(max_tokens=2), timeout=30).finished


def test_clients_may_share_a_name(engine, client):
    """Each connection routes under the caller's name plus a nonce of its own."""
    with mpengine.Client(engine.address, client_id=client.client_id, timeout=10) as twin:
        assert twin.client_id == client.client_id
        assert twin._conn.routing_id != client._conn.routing_id
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        assert twin.generate(PROMPT, params).token_ids == client.generate(PROMPT, params).token_ids
    with pytest.raises(ValueError, match="client_id"):
        mpengine.Client(engine.address, client_id="x" * 300)


def test_a_client_that_comes_back_under_its_name_is_served(engine, client):
    """A service killed mid-stream and restarted under the same name: the engine found the
    old connection gone (and drops what it still queued), and serves the new one."""
    script = (
        "import mpengine\n"
        f"c = mpengine.Client({engine.address!r}, client_id='service')\n"
        "s = c.stream([5, 6, 7], mpengine.SamplingParams(max_tokens=4000, ignore_eos=True))\n"
        "next(s); print('streaming', flush=True)\n"
        "for _ in s: pass\n"
    )
    with client_process(script, "streaming"):
        pass
    assert_idle(client)  # the old connection was found gone and its request aborted
    with mpengine.Client(engine.address, client_id="service", timeout=10) as again:
        out = again.generate(PROMPT, SamplingParams(max_tokens=3), timeout=30)
        assert out.finished and len(out.token_ids) == 3


# -- tcp and authentication ------------------------------------------------------------------


@pytest.fixture(scope="module")
def remote(start_engine):
    """An engine on every interface with an auth token, as a remote client would see it."""
    port = free_port_pair()
    engine = start_engine(
        model="tiny", address=f"tcp://*:{port}", auth_token="s3cret", num_gpu_blocks_override=64
    )
    return engine, port


def test_tcp_wildcard_engine_serves_text_prompts(remote):
    engine, port = remote
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with mpengine.Client(f"tcp://127.0.0.1:{port}", auth_token="s3cret", timeout=10) as far:
        assert far._conn.output_address == f"tcp://127.0.0.1:{port + 1}"
        out = far.generate(PROMPT, params, timeout=60)
    with engine.client() as near:  # passes the engine's token itself
        ids = near.tokenize(PROMPT)
        assert out.prompt_token_ids == ids
        assert near.generate(ids, params, timeout=60).token_ids == out.token_ids


def test_an_ipv6_engine_serves(start_engine) -> None:
    """The engine's sockets bind IPv6 hosts (they failed with "No such device")."""
    try:
        port = free_port_pair("::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    engine = start_engine(model="tiny", address=f"tcp://[::1]:{port}", num_gpu_blocks_override=64)
    with mpengine.Client(engine.address, timeout=10) as client:
        assert client._conn.output_address == f"tcp://[::1]:{port + 1}"
        assert len(client.generate([1, 2, 3], SamplingParams(max_tokens=2)).token_ids) == 2


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("tcp://127.0.0.1", "tcp://HOST:PORT"),
        ("tcp://127.0.0.1:abc", "tcp://HOST:PORT"),
        ("tcp://:5555", "tcp://HOST:PORT"),
        ("tcp://127.0.0.1:0", "out of range"),
        ("tcp://127.0.0.1:65535", "out of range"),
        ("tcp://127.0.0.1:99999", "out of range"),
        ("tcp://::1:5555", "brackets"),
        ("ipc://", "no directory"),
        ("http://x:1", "ipc://DIR or tcp://HOST:PORT"),
    ],
)
def test_bad_addresses_are_refused_in_one_line(address: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        mpengine.EngineConfig(address=address)


@pytest.mark.parametrize("token", ["wrong", None])
def test_wrong_or_missing_token_is_refused_fast(remote, token):
    engine, port = remote
    start = time.monotonic()
    with pytest.raises(PermissionError, match="refused"):
        mpengine.Client(f"tcp://127.0.0.1:{port}", auth_token=token, timeout=10)
    assert time.monotonic() - start < 5
    with engine.client() as ok:
        assert len(ok.generate([1, 2, 3], SamplingParams(max_tokens=2)).token_ids) == 2


def test_a_connection_that_never_handshakes_is_dropped(remote) -> None:
    """Bare tcp connections (no token, no greeting) were kept for libzmq's 30 s: 1,100 of
    them made clients with the right token fail. The engine drops them after HANDSHAKE_MS."""
    from mpengine.runtime.edges import HANDSHAKE_MS

    _, port = remote
    limit = 3 * HANDSHAKE_MS / 1000  # (a socket timeout past it fails the test)
    with socket.create_connection(("127.0.0.1", port), timeout=limit) as bare:
        start = time.monotonic()
        with contextlib.suppress(ConnectionResetError):
            while bare.recv(4096):  # libzmq's greeting, then nothing until the close
                pass
        assert time.monotonic() - start >= HANDSHAKE_MS / 2000  # dropped, not refused


def test_an_address_that_is_no_engine_address_is_a_value_error():
    for address in ("http://127.0.0.1:8000", "/tmp/some/dir", "127.0.0.1:5555"):
        with pytest.raises(ValueError, match="is not an engine address"):
            mpengine.Client(address, timeout=1)
