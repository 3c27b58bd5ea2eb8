"""No request may take the engine down or hang it: requests that once killed a stage, froze
every stream or poisoned other clients' steps, each next to well-behaved traffic that must
complete exactly as it would alone."""

from __future__ import annotations

import random

import msgspec
import pytest
import zmq

import mpengine
from mpengine.protocol import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOTAL_CHARS,
    PROTOCOL_VERSION,
    AddRequest,
    Array,
    Hello,
    SamplingParams,
    encoder,
    scheduler_reply_decoder,
)
from mpengine.testing.engine import wait_idle

PROMPT = "The old lighthouse keeper looked at the sea and said"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(start_engine):
    return start_engine(model="tiny", num_gpu_blocks_override=512, max_num_seqs=64)


@pytest.fixture(scope="module")
def client(engine):
    with engine.client() as client:
        yield client


@pytest.fixture(scope="module")
def reference(client) -> list[list[int]]:
    """Greedy outputs of the well-behaved prompts, each run alone."""
    return [client.generate(p, GREEDY).token_ids for p in good_prompts()]


def good_prompts() -> list[str]:
    return [f"{PROMPT} {i} times," * (1 + i % 3) for i in range(16)]


def test_long_stop_strings_do_not_kill_the_output_stage(client, reference) -> None:
    """A 500-character stop string once made the output stage die of RecursionError."""
    out = client.generate("hi", SamplingParams(max_tokens=4, stop=["x" * 500]))
    assert out.finished
    # The largest stop strings allowed, next to ordinary traffic.
    count = MAX_STOP_TOTAL_CHARS // MAX_STOP_STRING_CHARS
    stops = [chr(0x4E00 + i) * MAX_STOP_STRING_CHARS for i in range(count)]
    outs = client.generate_many(
        ["hi", *good_prompts()], [SamplingParams(max_tokens=8, stop=stops), *[GREEDY] * 16]
    )
    assert outs[0].finished and [o.token_ids for o in outs[1:]] == reference


def test_min_tokens_past_the_capped_max_tokens_is_an_error_for_that_request(client) -> None:
    with pytest.raises(mpengine.InvalidRequestError, match=r"sampling\.min_tokens \(4000\)"):
        client.generate([5] * 200, SamplingParams(max_tokens=4000, min_tokens=4000), timeout=60)
    assert len(client.generate(PROMPT, GREEDY).token_ids) == 12


def raw_socket(ctx: zmq.Context, address: str, client_id: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, client_id)
    sock.connect(address)
    return sock


def test_oversized_parameters_are_refused_by_field(engine, client) -> None:
    """Too many stop strings (1.1 MB of them once overflowed a ring), top_k and stop ids
    beyond int64 (once an OverflowError that failed other clients' steps). Sent raw, past
    the client library's own checks."""
    cases = [
        ({"stop": ["a" * 400] * 2750}, "sampling.stop"),
        ({"stop": ["b" * 450] * 2000}, "sampling.stop"),
        ({"stop": ["c" * 4096] * 5}, "16384"),
        ({"top_k": 2**63}, "sampling.top_k"),
        ({"stop_token_ids": [2**63]}, "sampling.stop_token_ids"),
    ]
    ctx = zmq.Context()
    try:
        raw = raw_socket(ctx, engine.address, b"raw-sender")
        for i, (params, field) in enumerate(cases):
            prompt = ["int32", [3], b"\x01\x00\x00\x00" * 3]
            raw.send(msgspec.msgpack.encode(["AddRequest", f"bad-{i}", prompt, params]))
            assert raw.poll(10_000), field
            reply = msgspec.msgpack.decode(raw.recv())
            assert reply[:2] == ["RequestError", f"bad-{i}"] and field in reply[2], reply[2]
    finally:
        ctx.destroy(linger=0)
    # The parameters' constructor refuses them, naming the field too.
    with pytest.raises(ValueError, match="top_k must be <= 2147483647"):
        SamplingParams(top_k=2**40)
    # The largest top_k is fine (it keeps the whole vocabulary).
    top = client.generate(PROMPT, SamplingParams(max_tokens=4, top_k=2**31 - 1, seed=1))
    assert len(top.token_ids) == 4


def test_many_samples_with_long_stops_complete(client, reference) -> None:
    """n=64 with ~130 KB of stop strings once overflowed the plan ring (parameters were
    repeated per sample) or never completed; now 64 stops of 256 characters (UTF-8: 32 KB)
    are as much as a request may carry."""
    stops = [f"{i:02d}" + "\u00e9" * 254 for i in range(MAX_STOP_STRINGS)]
    params = SamplingParams(n=64, max_tokens=6, temperature=1.0, seed=3, stop=stops)
    outs = client.generate_many([PROMPT, *good_prompts()], [params, *[GREEDY] * 16], timeout=120)
    assert len(outs[0].outputs) == 64 and all(len(o.token_ids) == 6 for o in outs[0].outputs)
    assert [o.token_ids for o in outs[1:]] == reference


def test_prompt_logprobs_over_a_large_token_budget(start_engine) -> None:
    """A step's prompt logprobs once outgrew the result ring: the scheduler now shortens
    prompt-scoring chunks to what the ring holds."""
    engine = start_engine(
        model="tiny",
        num_gpu_blocks_override=512,
        max_num_batched_tokens=4096,
        ring_bytes=512 * 1024,
        max_request_bytes=128 * 1024,
    )
    with engine.client() as client:
        prompt = [random.Random(0).randrange(3, 300) for _ in range(3500)]
        out = client.generate(prompt, SamplingParams(max_tokens=2, prompt_logprobs=20))
        assert out.finished and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        assert all(len(row) >= 20 for row in out.prompt_logprobs[1:])


def test_request_ids_belong_to_their_client(engine, client) -> None:
    with engine.client() as other:
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        mine = client.stream(PROMPT, params, request_id="shared-id")
        first = next(mine)
        other.abort("shared-id")  # not its request: nothing happens
        theirs = other.generate(PROMPT, params, request_id="shared-id")  # no clash either
        rest = list(mine)
        assert rest[-1].finish_reason == "length"
        assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 40
        assert theirs.finish_reason == "length" and len(theirs.token_ids) == 40


@pytest.mark.parametrize("edge", ["requests", "outputs"])
def test_unknown_protocol_version_is_refused(engine, client, edge) -> None:
    ctx = zmq.Context()
    try:
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.ROUTING_ID, b"old-client")
        address = engine.address if edge == "requests" else client.info.output_address
        raw.connect(address)
        raw.send(encoder.encode(Hello("old-client", protocol_version=PROTOCOL_VERSION + 7)))
        assert raw.poll(10_000)
        reply = msgspec.msgpack.decode(raw.recv())
        assert reply[0] == "RequestError" and "protocol version" in reply[2]
    finally:
        ctx.destroy(linger=0)


def mutations(base: bytes, rng: random.Random) -> bytes:
    frame = bytearray(base)
    match rng.randrange(4):
        case 0:  # flip bytes
            for _ in range(rng.randint(1, 8)):
                frame[rng.randrange(len(frame))] = rng.randrange(256)
        case 1:  # truncate
            del frame[rng.randrange(len(frame)) :]
        case 2:  # splice in random bytes
            at = rng.randrange(len(frame))
            frame[at:at] = rng.randbytes(rng.randint(1, 32))
        case 3:  # duplicate a slice
            a = rng.randrange(len(frame))
            frame[a:a] = frame[a : a + rng.randint(1, 64)]
    return bytes(frame)


def random_msgpack(rng: random.Random, depth: int = 0) -> object:
    choices = [
        lambda: rng.randint(-(2**63), 2**64 - 1),
        lambda: rng.random() * 1e6,
        lambda: rng.randbytes(rng.randint(0, 16)).decode("latin-1"),
        lambda: rng.randbytes(rng.randint(0, 16)),
        lambda: None,
        lambda: rng.choice(["AddRequest", "Abort", "Hello", "StatsQuery", "TokenizerQuery"]),
    ]
    if depth < 3:
        choices.append(lambda: [random_msgpack(rng, depth + 1) for _ in range(rng.randint(0, 6))])
        choices.append(lambda: {"max_tokens": random_msgpack(rng, depth + 1)})
    return rng.choice(choices)()


def test_fuzzed_frames_beside_valid_traffic(engine, client, reference) -> None:
    """10,000 random and mutated frames at the request socket while valid requests run:
    the engine stays up and the valid requests complete exactly."""
    rng = random.Random(1234)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    valid = encoder.encode(AddRequest("fuzz", Array.of([5, 6, 7]), params, arrival_time=1.0))
    ctx = zmq.Context()
    try:
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.ROUTING_ID, b"fuzzer")
        raw.connect(engine.address)
        handles = [client.stream(p, GREEDY) for p in good_prompts()]
        firsts = [next(h) for h in handles]  # the valid requests are running
        for i in range(10_000):
            kind = i % 3
            if kind == 0:
                frame = rng.randbytes(rng.randint(0, 64))
            elif kind == 1:
                frame = msgspec.msgpack.encode(random_msgpack(rng))
            else:
                frame = mutations(valid, rng)
            raw.send(frame)
            while raw.poll(0):
                raw.recv()
        outs = [
            f.token_ids + [t for d in h for t in d.token_ids]
            for f, h in zip(firsts, handles, strict=True)
        ]
    finally:
        ctx.destroy(linger=0)
    assert outs == reference
    stats = wait_idle(client, timeout=60)
    assert stats.num_free_blocks == stats.num_blocks


def test_a_failed_step_fails_only_its_sequences(start_engine, monkeypatch, reference) -> None:
    """Fault injection under load, async depth 1. A sampling fault of sequences 3 and 7
        (their first token) fails those two only: the next step, planned before the failure was
        known, runs without them instead of failing on their missing token. A forward fault in
        step 6 fails that step's sequences, and every failure says it was injected (a poisoned
    next step would fail with a missing-token error instead)."""
    monkeypatch.setenv("MPENGINE_FAULT_SEQS", "3,7")
    monkeypatch.setenv("MPENGINE_FAULT_STEPS", "6")
    engine = start_engine(model="tiny", num_gpu_blocks_override=512, max_num_seqs=64)
    lengths = [2 + i % 8 for i in range(16)]
    params = [msgspec.structs.replace(GREEDY, max_tokens=m) for m in lengths]
    with engine.client() as client:
        outs = client.generate_many(good_prompts(), params, timeout=120)
        failed = {i for i, o in enumerate(outs) if o.finish_reason == "error"}
        assert {3, 7} <= failed
        for i, out in enumerate(outs):
            if i in failed:
                assert "injected" in out.outputs[0].error, out.outputs[0].error
            else:
                assert out.finish_reason == "length"
                assert out.token_ids == reference[i][: lengths[i]]
        # Later requests run normally (step 6 is long past, seq ids 3 and 7 are gone).
        again = client.generate_many(good_prompts(), GREEDY, timeout=120)
        assert [o.token_ids for o in again] == reference
        stats = wait_idle(client, timeout=60)
        assert stats.num_free_blocks == stats.num_blocks


def test_a_client_that_stops_reading_is_cut_off_alone(start_engine, reference) -> None:
    """One client that never reads its outputs beside 16 streaming ones: past
    ``client_send_hwm`` its requests are aborted; the others complete exactly and the
    engine's queue for it stays bounded."""
    engine = start_engine(
        model="tiny", num_gpu_blocks_override=1024, max_num_seqs=128, client_send_hwm=4
    )
    ctx = zmq.Context()
    try:

        def connect(address: str) -> zmq.Socket:
            """A raw client socket that reads as little as it can."""
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, b"stalled")
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 4096)
            sock.connect(address)
            sock.send(encoder.encode(Hello("stalled")))
            assert sock.poll(10_000), "no greeting"
            return sock

        requests = connect(engine.address)
        info = scheduler_reply_decoder().decode(requests.recv())
        connect(info.output_address).recv()  # its greeting; nothing is read after this
        # Big output messages (64 samples with 20 logprobs each) fill its buffers fast.
        params = SamplingParams(n=64, max_tokens=3000, logprobs=20, ignore_eos=True)
        requests.send(encoder.encode(AddRequest("flood", Array.of([5, 6]), params)))
        with engine.client() as client:
            outs = client.generate_many(good_prompts(), GREEDY, timeout=120)
            assert [o.token_ids for o in outs] == reference
            # Its 3000-token samples were aborted long before they could finish.
            stats = wait_idle(client, timeout=120)
            assert stats.num_free_blocks == stats.num_blocks
            assert stats.finished >= 1 + len(outs)
            assert stats.aborted == 1  # the flood, ended by the output stage
    finally:
        ctx.destroy(linger=0)


def test_replies_a_client_does_not_read_are_bounded(engine, client) -> None:
    """A client that asked and never read grew the scheduler's memory without bound (each
    tokenizer reply a copy of the file). A client gets the tokenizer a few times at most,
    and the replies kept for it are bounded (REPLY_HWM in ZMQ, then
    MAX_PENDING_REPLY_BYTES); the engine serves others meanwhile."""
    from mpengine.protocol import StatsQuery, TokenizerQuery
    from mpengine.runtime.edges import REPLY_HWM
    from mpengine.runtime.front import TOKENIZER_REPLIES

    ctx = zmq.Context()
    try:
        raw = raw_socket(ctx, engine.address, b"greedy-asker")
        for query_id in range(TOKENIZER_REPLIES + 3):
            raw.send(encoder.encode(TokenizerQuery(query_id)))
        raw.send(encoder.encode(StatsQuery(999)))
        kinds = []
        while not kinds or kinds[-1] != "EngineStats":  # replies come in order
            assert raw.poll(10_000), kinds
            kinds.append(msgspec.msgpack.decode(raw.recv())[0])
        assert kinds == ["TokenizerFile"] * TOKENIZER_REPLIES + ["EngineStats"]
        # Never read: the edge drops what passes its bound, and others are served.
        for query_id in range(4 * REPLY_HWM):
            raw.send(encoder.encode(StatsQuery(query_id)))
        assert client.generate(PROMPT, GREEDY).token_ids
        # (the output arrives before the scheduler hears that it finished)
        assert wait_idle(client, timeout=30).num_running == 0
    finally:
        ctx.destroy(linger=0)


def test_a_client_that_reads_late_gets_every_reply_in_order(engine) -> None:
    """Past REPLY_HWM unread replies, the rest were dropped: a burst of refusals left
    requests unanswered forever (the HTTP server, one client, lost 81 in a 9,000-request
    burst). They wait for the client now, in order."""
    from mpengine.protocol import StatsQuery
    from mpengine.runtime.edges import REPLY_HWM

    ctx = zmq.Context()
    try:
        raw = raw_socket(ctx, engine.address, b"late-reader")
        count = 20 * REPLY_HWM
        for query_id in range(count):
            raw.send(encoder.encode(StatsQuery(query_id)))
        ids = []
        while len(ids) < count:
            assert raw.poll(10_000), f"{len(ids)} of {count} replies"
            reply = msgspec.msgpack.decode(raw.recv())
            assert reply[0] == "EngineStats"
            ids.append(reply[1])
        assert ids == list(range(count))
    finally:
        ctx.destroy(linger=0)


def test_concurrent_text_requests_fetch_the_tokenizer_once(engine, monkeypatch) -> None:
    """An AsyncClient's first text requests, made at once, each fetched the whole file."""
    import asyncio

    from mpengine.protocol import TokenizerQuery

    fetches = []
    query = mpengine.AsyncClient._aquery

    async def counting(client, make, timeout):
        fetches.append(make)
        return await query(client, make, timeout)

    monkeypatch.setattr(mpengine.AsyncClient, "_aquery", counting)

    async def main() -> list:
        async with engine.async_client() as aclient:
            params = SamplingParams(max_tokens=2, temperature=0.0)
            return await asyncio.gather(
                *(aclient.generate(f"{PROMPT} {i}", params) for i in range(8))
            )

    outs = asyncio.run(main())
    assert len(outs) == 8 and all(o.token_ids for o in outs)
    assert fetches.count(TokenizerQuery) == 1
