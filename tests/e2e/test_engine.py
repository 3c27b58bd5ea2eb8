"""The engine end to end (processes runtime, async depth 1, tiny Qwen3): sampling features,
streaming, aborts, disconnects and bad input."""

from __future__ import annotations

import asyncio
import itertools

import msgspec
import pytest
import zmq

import mpengine
from mpengine.protocol import AddRequest, Array, SamplingParams, encoder
from mpengine.testing.engine import client_process, wait_idle, wait_until

PROMPT = "The old lighthouse keeper looked at the sea and said"


@pytest.fixture(scope="module")
def engine(start_engine):
    return start_engine(model="tiny", num_gpu_blocks_override=256, max_num_seqs=32)


@pytest.fixture(scope="module")
def client(engine):
    with engine.client() as client:
        yield client


def test_generate_text_prompt(client):
    out = client.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert out.finished and out.finish_reason == "length"
    assert len(out.token_ids) == 12 and out.text
    assert out.prompt_token_ids == client.tokenize(PROMPT)
    m = out.metrics
    assert m.arrival_time <= m.scheduled_time <= m.first_token_time <= m.finished_time


def test_seeded_sampling_reproducible_across_batches(client):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    alone = client.generate(PROMPT, params).token_ids
    others = [SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)] * 6
    batch = client.generate_many(
        [f"Prompt number {i} " * (i + 1) for i in range(6)] + [PROMPT], [*others, params]
    )
    assert batch[-1].token_ids == alone
    unseeded = client.generate_many([PROMPT] * 2, SamplingParams(max_tokens=16, ignore_eos=True))
    assert unseeded[0].token_ids != unseeded[1].token_ids


def test_n_samples_differ_and_share_prompt_blocks(client):
    before = client.stats().forked_blocks
    prompt = "A long shared prompt " * 10
    out = client.generate(
        prompt, SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    )
    assert len(out.outputs) == 4 and out.finished
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert client.stats().forked_blocks - before == 3 * ((len(client.tokenize(prompt)) - 1) // 16)


def test_stop_string_across_token_boundary(client):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    free = client.generate(PROMPT, params)
    tokenizer = client._text.tokenizer
    pieces = [tokenizer.decode([t]) for t in free.token_ids]
    # A stop string made of the end of one token's text and the start of the next one's
    # (whole characters on both sides, present in the text).
    stop = next(
        a[-2:] + b[:1]
        for a, b in itertools.pairwise(pieces[2:])
        if len(a) >= 2 and b and "\ufffd" not in a[-2:] + b[:1] and a[-2:] + b[:1] in free.text
    )
    cut = free.text.index(stop)
    out = client.generate(PROMPT, msgspec.structs.replace(params, stop=[stop]))
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == free.text[:cut]
    kept = client.generate(
        PROMPT, msgspec.structs.replace(params, stop=[stop], include_stop_str_in_output=True)
    )
    assert kept.text == free.text[: cut + len(stop)]


def test_stream_deltas_add_up_and_multibyte_text_is_whole(client):
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=11, ignore_eos=True)
    prompt = "Café crème, 東京の夜 🌙 and naïve façades:"
    deltas = list(client.stream(prompt, params))
    final = client.generate(prompt, params)
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    # Had a delta emitted U+FFFD for a character whose bytes were still arriving, the
    # concatenated stream would differ from decoding all the ids at once.
    decoded = client._text.tokenizer.decode(final.token_ids, skip_special_tokens=True)
    assert final.text == decoded


def test_logprobs_returned(client):
    out = client.generate(
        PROMPT,
        SamplingParams(
            max_tokens=5, temperature=0.0, logprobs=3, prompt_logprobs=2, ignore_eos=True
        ),
    )
    assert len(out.logprobs) == 5
    for token, row in zip(out.token_ids, out.logprobs, strict=True):
        assert token in row and max(row.values()) == row[token]  # greedy takes the top one
        assert all(v <= 0 for v in row.values())
    assert out.prompt_logprobs is not None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert len(out.prompt_logprob_ranks) == len(out.prompt_token_ids)
    # One entry per prompt token for a one-token prompt too (its first is None), not None.
    one = client.generate([7], SamplingParams(max_tokens=2, prompt_logprobs=2))
    assert one.prompt_logprobs == [None] and one.prompt_logprob_ranks == [None]


def test_abort_mid_stream_frees_every_block(client):
    params = SamplingParams(max_tokens=2000, temperature=1.0, ignore_eos=True)
    stream = client.stream(PROMPT, params, request_id="to-abort")
    for _ in range(3):
        next(stream)
    client.abort("to-abort")
    rest = list(stream)
    assert rest and rest[-1].finished and rest[-1].finish_reason == "abort"
    stats = wait_idle(client)
    assert stats.num_free_blocks == stats.num_blocks


def test_client_disconnect_frees_every_block(engine, client):
    """A client process killed mid-stream: the output processor finds it gone and the
    scheduler frees its blocks."""
    script = (
        "import sys, mpengine\n"
        f"c = mpengine.Client({engine.address!r})\n"
        "s = c.stream('x' * 50, mpengine.SamplingParams(max_tokens=5000, ignore_eos=True))\n"
        "next(s); print('streaming', flush=True)\n"
        "for _ in s: pass\n"
    )
    with client_process(script, "streaming"):
        assert client.stats().num_running == 1
    stats = wait_idle(client, timeout=20)
    assert stats.num_free_blocks == stats.num_blocks


def test_dead_client_queue_is_dropped(engine, client):
    """A client process killed with requests still queued: they are dropped unrun, not
    computed one by one until each is found undeliverable."""
    script = (
        "import threading, mpengine\n"
        f"c = mpengine.Client({engine.address!r})\n"
        "p = mpengine.SamplingParams(max_tokens=1000, ignore_eos=True)\n"
        "s = c.stream([7] * 3000, p)\n"  # holds most of the 256 blocks
        "next(s)\n"
        "for i in range(6):\n"
        "    prompt = [100 + i] * 1500\n"  # does not fit beside the first: waits
        "    threading.Thread(target=c.generate, args=(prompt, p), daemon=True).start()\n"
        "print('queued', flush=True)\n"
        "for _ in s: pass\n"
    )
    before = client.stats()
    with client_process(script, "queued"):
        stats = wait_until(client, lambda s: s.num_waiting == 6, timeout=30)
        assert stats.num_running == 1
    after = wait_idle(client, timeout=30)
    assert after.num_free_blocks == after.num_blocks
    assert after.aborted - before.aborted == 7
    # Only the running request's last decodes: none of the queued prompts was computed.
    assert after.computed_tokens - stats.computed_tokens < 1500


def test_async_client(engine):
    async def main():
        client = engine.async_client()
        try:
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            outs = await asyncio.gather(*(client.generate(PROMPT, params) for _ in range(3)))
            deltas = [d async for d in client.stream(PROMPT, params)]
            return outs, deltas
        finally:
            client.close()

    outs, deltas = asyncio.run(main())
    assert all(o.token_ids == outs[0].token_ids for o in outs)
    assert [t for d in deltas for t in d.token_ids] == outs[0].token_ids


def test_client_connects_by_address(engine):
    with mpengine.Client(engine.address) as other:
        assert other.info.engine_id == engine.config.engine_id
        assert other.info.num_blocks == 256
        out = other.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out.token_ids) == 3


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "empty"),
        (list(range(5000)), SamplingParams(), "max_model_len"),
        ([1, 2, 10**6], SamplingParams(), "outside the vocabulary"),
        ([1, 2], {"max_tokens": 0}, "sampling.max_tokens"),
        ([1, 2], {"temperature": -1.0}, "sampling.temperature"),
        ([1, 2], {"top_p": 1.5}, "sampling.top_p"),
    ],
)
def test_bad_requests_fail_alone(client, prompt, params, message):
    """Sent raw (bypassing the client's own checks) so the engine's validation answers."""
    if isinstance(params, dict):  # set past the constructor's checks
        (name, value), params = next(iter(params.items())), SamplingParams()
        setattr(params, name, value)
    good = client._conn
    request = AddRequest(f"bad-{message}", Array.of(prompt), params)
    handle_errors: list = []
    good.sinks[request.request_id] = handle_errors.append
    good.send(request)
    ok = client.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(ok.token_ids) == 4, "the engine keeps serving"
    client.stats()  # a round trip on the request socket: the error reply came before it
    assert handle_errors and isinstance(handle_errors[0], mpengine.InvalidRequestError)
    assert message in str(handle_errors[0])


def test_client_side_validation_names_the_field(client):
    with pytest.raises(ValueError, match=r"top_p must be > 0\.0, got 0\.0"):
        SamplingParams(top_p=0.0)
    set_later = SamplingParams()
    set_later.top_p = 0.0
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        client.generate(PROMPT, set_later)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)
    params = [SamplingParams(max_tokens=2)] * 2
    with pytest.raises(ValueError, match="3 prompts, 2 parameter sets"):
        client.generate_many([PROMPT] * 3, params)
    with pytest.raises(ValueError, match="1 request ids"):
        client.embed_many([PROMPT] * 2, request_ids=["a"])
    assert client.generate(PROMPT, SamplingParams(max_tokens=2)).outputs[0].token_ids


def test_abort_unknown_id_and_garbage_frames_are_harmless(engine, client):
    client.abort("no-such-request")
    ctx = zmq.Context()
    try:
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.ROUTING_ID, b"\xff\xfe-not-utf8")
        raw.connect(engine.address)
        raw.send(b"\x00garbage\xff")
        assert raw.poll(5000), "the engine answers a garbage frame with an error"
        reply = msgspec.msgpack.decode(raw.recv())
        assert reply[0] == "RequestError"
        # Over the size limit (but under twice it): rejected with an error reply.
        limit = engine.config.max_request_bytes
        big = AddRequest("too-big", Array.of([1] * (limit // 4 + 1000)), SamplingParams())
        raw.send(encoder.encode(big))
        assert raw.poll(10000)
        reply = msgspec.msgpack.decode(raw.recv())
        assert (
            reply[0] == "RequestError" and reply[1] == "too-big" and "max_request_bytes" in reply[2]
        )
        # A routing id that is not text: outputs could not be routed by it.
        raw.send(encoder.encode(AddRequest("anon", Array.of([1, 2]), SamplingParams())))
        assert raw.poll(5000)
        reply = msgspec.msgpack.decode(raw.recv())
        assert reply[0] == "RequestError" and reply[1] == "anon" and "routing id" in reply[2]
    finally:
        ctx.destroy(linger=0)
    with pytest.raises(mpengine.InvalidRequestError, match="max_request_bytes"):
        client.generate([1] * (engine.config.max_request_bytes // 4), SamplingParams())
    ok = client.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(ok.token_ids) == 4


def peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def test_a_huge_frame_is_refused_before_it_is_buffered(engine, client):
    """libzmq reads the frame size first: past the limit it drops the connection unread."""
    scheduler = engine.pids["scheduler"]
    before = peak_rss_kib(scheduler)
    ctx = zmq.Context()
    try:
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.ROUTING_ID, b"huge-sender")
        monitor = raw.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        raw.connect(engine.address)
        raw.send(b"\x00" * (256 * 1024 * 1024), copy=False)
        assert monitor.poll(30_000), "the engine closes the connection of a huge frame"
    finally:
        ctx.destroy(linger=0)
    ok = client.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(ok.token_ids) == 4
    assert peak_rss_kib(scheduler) - before < 64 * 1024, "the frame was not buffered"


def test_best_of_returns_the_n_most_likely_samples(client):
    params = SamplingParams(
        n=2, best_of=5, max_tokens=6, temperature=1.0, seed=11, logprobs=1, ignore_eos=True
    )
    out = client.generate(PROMPT, params)
    assert [o.index for o in out.outputs] == [0, 1] and out.finished
    scores = [o.cumulative_logprob for o in out.outputs]
    assert scores[0] >= scores[1]

    def total(sample) -> float:
        return sum(row[t] for row, t in zip(sample.logprobs, sample.token_ids, strict=True))

    for sample, score in zip(out.outputs, scores, strict=True):
        assert abs(total(sample) - score) < 1e-3
    assert out.num_generated_tokens == 5 * 6  # every sample counts
    # The two kept are the best of the five: with the same seed all five, returned, agree.
    everything = client.generate(PROMPT, msgspec.structs.replace(params, n=5))
    best = sorted((total(o) for o in everything.outputs), reverse=True)[:2]
    assert [round(s, 3) for s in scores] == [round(s, 3) for s in best]
    with pytest.raises(mpengine.InvalidRequestError, match="cannot be streamed"):
        next(client.stream(PROMPT, params))


def test_a_cache_smaller_than_the_context_lowers_max_model_len(start_engine):
    """8 blocks of 16 hold 128 tokens of tiny's 4096: max_model_len is 128 (with a warning),
    so a request that gives no max_tokens ("up to max_model_len") runs to that limit; it was
    refused as too large for the cache."""
    small = start_engine(model="tiny", num_gpu_blocks_override=8)
    with small.client() as c:
        assert c.info.max_model_len == 8 * 16
        prompt = list(range(5, 25))
        out = c.generate(prompt, SamplingParams(max_tokens=None, ignore_eos=True), timeout=120)
        assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == 128
        with pytest.raises(mpengine.InvalidRequestError, match="max_model_len"):
            c.generate(list(range(5, 140)), SamplingParams(max_tokens=1))
    # A max_model_len the user gave is not lowered behind them: refused at start, as vLLM.
    with pytest.raises(mpengine.EngineStartError, match="max_model_len 1024 is larger than"):
        start_engine(model="tiny", num_gpu_blocks_override=8, max_model_len=1024)
