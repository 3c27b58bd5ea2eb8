"""How the client assembles a request's deltas."""

from __future__ import annotations

import numpy as np
import pytest

from mpengine.client.outputs import Assembly
from mpengine.client.requests import Window
from mpengine.client.tokens import token_array
from mpengine.errors import InvalidRequestError, RequestFailedError
from mpengine.protocol import (
    EMPTY_IDS,
    AddRequest,
    Array,
    EngineInfo,
    Logprobs,
    OutputDelta,
    PoolingParams,
    SamplingParams,
)


def request(ids: list[int]) -> AddRequest:
    return AddRequest("r", Array.of(ids), pooling=PoolingParams())


def test_the_embedding_and_the_tokens_the_engine_pooled():
    assembly = Assembly(request([5, 6, 7, 8]))
    vector = Array.of(np.array([0.6, 0.8]), "float32")
    # The engine truncated the prompt to 3 tokens (truncate_prompt_tokens).
    delta = OutputDelta(
        "r", 0, EMPTY_IDS, "", finish_reason="stop", embedding=vector, num_prompt_tokens=3
    )
    assert assembly.add(delta).finished
    out = assembly.embedding_output()
    assert out.prompt_token_ids == [5, 6, 7] and out.num_prompt_tokens == 3
    np.testing.assert_array_equal(out.embedding, np.array([0.6, 0.8], np.float32))
    out.embedding[0] = 0.0  # a copy the caller owns, not a view of the frame


def logprobs(ids: list[int], values: list[float]) -> Logprobs:
    none = Array.of(np.zeros((len(ids), 0)), "float32")
    return Logprobs(Array.of(ids), Array.of(values, "float32"), none, none)


def test_cumulative_logprob_is_the_running_sum_when_logprobs_are_asked_for():
    """As vLLM: with logprobs, each sample's cumulative logprob is the sum of its sampled
    tokens' logprobs (so far, in a stream); without them, None."""
    asked = Assembly(AddRequest("r", Array.of([1]), SamplingParams(max_tokens=3, logprobs=0)))
    first = asked.add(
        OutputDelta("r", 0, Array.of([5, 6]), "ab", logprobs=logprobs([5, 6], [-0.5, -1.25]))
    )
    assert first.outputs[0].cumulative_logprob == -1.75
    last = asked.add(
        OutputDelta(
            "r", 0, Array.of([7]), "c", finish_reason="length", logprobs=logprobs([7], [-0.25])
        )
    )
    assert last.finished and last.outputs[0].cumulative_logprob == -2.0
    plain = Assembly(AddRequest("r", Array.of([1]), SamplingParams(max_tokens=1)))
    out = plain.add(OutputDelta("r", 0, Array.of([5]), "a", finish_reason="length"))
    assert out.outputs[0].cumulative_logprob is None


def test_a_request_that_ends_without_its_embedding_raises():
    assembly = Assembly(request([5, 6]))
    assembly.add(OutputDelta("r", 0, EMPTY_IDS, "", finish_reason="error", error="step 3 failed"))
    with pytest.raises(RequestFailedError, match="step 3 failed"):
        assembly.embedding_output()


def test_prompt_token_ids_are_checked_before_they_are_packed() -> None:
    assert token_array([1, 2, 2**31 - 1]).numpy().tolist() == [1, 2, 2**31 - 1]
    assert token_array(np.arange(3)).numpy().tolist() == [0, 1, 2]
    assert len(token_array([])) == 0
    for prompt, message in [
        ([2**31], "outside int32"),
        ([10**20], "outside int32"),
        ([-(2**31) - 1], "outside int32"),
        ([5.0, 6.0], "integers"),
        ([True], "integers"),
        ([[1, 2]], "integers"),
        (b"ab", "not bytes"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            token_array(prompt)


def test_a_hello_with_no_connection_to_take_it_never_blocks_past_the_deadline():
    """A DEALER with no connection (the engine hung up on a failed handshake) blocks a
    send until it has one: the hello was sent blocking, before the deadline loop, and a
    client given a timeout hung forever. Nothing listens here, and the socket's
    connection is dropped before the hello: the handshake still ends at its deadline."""
    import socket
    import threading

    import msgspec
    import zmq

    from mpengine.client.sockets import Deadline, Dealer

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    ctx = zmq.Context()
    dealer = Dealer(ctx, address, "client-1", None)
    dealer.sock.disconnect(address)
    raised: list[BaseException] = []

    def shake() -> None:
        try:
            dealer.handshake(b"hello", msgspec.msgpack.Decoder(), Deadline(0.5))
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=shake, daemon=True)
    thread.start()
    thread.join(30)
    try:
        assert not thread.is_alive(), "the handshake blocked past its deadline"
        assert len(raised) == 1 and isinstance(raised[0], ConnectionError), raised
    finally:
        if not thread.is_alive():
            dealer.close()
            ctx.term()


@pytest.mark.parametrize(
    ("queue", "seqs", "window"),
    [
        (4096, 256, 512),  # the defaults: an eighth of the queue, two steps
        (4096, 1024, 1024),  # a step's worth: two big calls fit a tenant's half
        (128, 64, 32),  # a lone call fills half a step (within a quarter of the queue)
        (64, 2, 8),  # at most four steps
        (7, 8, 1),  # never past a quarter of the queue: the first window is not `continues`
        (1, 8, 1),
    ],
)
def test_a_batch_call_window(queue: int, seqs: int, window: int) -> None:
    info = EngineInfo(
        "e", "m", "t", 100, 4096, 16, 64, seqs, 2048, [2], "processes", 1,
        max_waiting_requests=queue, max_waiting_tokens=1 << 20,
    )  # fmt: skip
    assert Window(info).max_seqs == window
