"""The wire protocol: round trips, validation in the types, and hostile frames."""

from __future__ import annotations

import contextlib
import re

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpengine.protocol import (
    DECODERS,
    Abort,
    AbortRequests,
    AddRequest,
    Array,
    EngineStats,
    Feedback,
    Hello,
    Logprobs,
    NewRequest,
    OutputBatch,
    OutputDelta,
    PoolingParams,
    PromptLogprobs,
    RequestHeader,
    RequestParams,
    SamplingParams,
    SeqStart,
    StepPlan,
    StepResult,
    describe_error,
    encoder,
)

IDS = Array.of([5, 6, 7])
LP = Logprobs(
    Array.of([1]),
    Array.of([-0.5], "float32"),
    Array.of(np.zeros((1, 2)), "int32"),
    Array.of(np.zeros((1, 2)), "float32"),
)

SAMPLES = [
    ("client_request", Hello("c1")),
    ("client_request", AddRequest("r", IDS, SamplingParams(temperature=0.3, stop=["x"]))),
    ("client_request", AddRequest("r", IDS, pooling=PoolingParams(pooling="mean"))),
    ("client_request", Abort(["a", "b"])),
    ("announcement", NewRequest("r", "c", [1, 2], 3, SamplingParams(n=2), None, 1.0, 2.0)),
    ("announcement", AbortRequests("c", ["r"], "error", "boom")),
    (
        "plan",
        StepPlan(
            7,
            Array.of([0]),
            Array.of([1, 2, -1]),
            Array.of([3]),
            Array.of([3]),
            Array.of([True], "bool"),
            Array.of([9], "int64"),
            [SeqStart(3, 9, 5, 0, True)],
            Array.of([3]),
            Array.of([0]),
            Array.of([11]),
            [RequestParams(5, 2, SamplingParams(), None, Array.of([1, 2]))],
            Array.of([4], "int64"),
        ),
    ),
    (
        "result",
        StepResult(
            7,
            Array.of([9], "int64"),
            Array.of([4]),
            LP,
            Array.of([0]),
            [PromptLogprobs(9, 1, LP)],
        ),
    ),
    ("feedback", Feedback(7, Array.of([9], "int64"), Array.of([4]), [9], ["stop"])),
    (
        "output_reply",
        OutputBatch([OutputDelta("r", 0, IDS, "hi", finish_reason="length", logprobs=LP)]),
    ),
    ("scheduler_reply", EngineStats(1, *range(12))),
]


@pytest.mark.parametrize("channel, msg", SAMPLES, ids=[type(m).__name__ for _, m in SAMPLES])
def test_round_trip(channel, msg):
    assert DECODERS[channel]().decode(encoder.encode(msg)) == msg


def test_arrays_travel_as_raw_bytes():
    ids = np.arange(1000, dtype=np.int32)
    frame = encoder.encode(AddRequest("r", Array.of(ids), SamplingParams()))
    assert len(frame) < 4000 + 100  # 4 bytes a token, no per-element msgpack ints
    decoded = DECODERS["client_request"]().decode(frame)
    assert np.array_equal(decoded.prompt_token_ids.numpy(), ids)


def test_array_shape_must_match_data():
    frame = encoder.encode(AddRequest("r", IDS, SamplingParams()))
    bad = frame.replace(b"\x91\x03", b"\x91\x04")  # claim 4 elements, carry 3
    with pytest.raises(msgspec.ValidationError, match="shape"):
        DECODERS["client_request"]().decode(bad)


BAD_NUMBERS = [
    ("temperature", -1.0, ">= 0.0"),
    ("top_p", 0.0, "> 0.0"),
    ("top_p", 1.5, "<= 1.0"),
    ("max_tokens", 0, ">= 1"),
    ("min_p", 2.0, "<= 1.0"),
    ("n", 0, ">= 1"),
    ("logprobs", 100, "<= 20"),
    ("repetition_penalty", 0.0, ">= 1e-06"),
    # Past float32's range the executor's division overflows, and the draw is NaN.
    ("repetition_penalty", 1e-300, ">= 1e-06"),
    ("repetition_penalty", 1e300, "<= 1000000.0"),
    ("temperature", 1e300, "<= 1000000.0"),
]


@pytest.mark.parametrize(("name", "value", "bound"), BAD_NUMBERS)
def test_validation_names_the_field(name, value, bound):
    """The engine refuses a frame whose parameters are out of range (a client that did
    not make them with the constructor), naming the field."""
    params = SamplingParams()
    setattr(params, name, value)  # (past the constructor's checks)
    frame = encoder.encode(AddRequest("r", IDS, params))
    with pytest.raises(msgspec.ValidationError) as info:
        DECODERS["client_request"]().decode(frame)
    assert f"sampling.{name}" in describe_error(info.value, AddRequest)
    # The request can still be named in the reply.
    assert msgspec.msgpack.decode(frame, type=RequestHeader).request_id == "r"


@pytest.mark.parametrize(("name", "value", "bound"), BAD_NUMBERS)
def test_the_constructor_refuses_numbers_out_of_range(name, value, bound):
    """At construction, in Python's words (msgspec checks the ranges only on decode: they
    failed later, at the request)."""
    with pytest.raises(ValueError, match=rf"^{name} must be {re.escape(bound)}, got "):
        SamplingParams(**{name: value})


def test_temperatures_below_the_sampling_epsilon_are_greedy():
    """float32 logits divided by 1e-38 overflow to inf, and the draw picks NaN's token 0."""
    for tiny in (1e-38, 1e-30, 9e-6):
        assert SamplingParams(temperature=tiny).temperature == 0.0
    assert SamplingParams(temperature=1e-5).temperature == 1e-5


def test_stop_strings_must_be_unicode():
    with pytest.raises(ValueError, match="surrogate"):
        SamplingParams(stop=["ok", "\ud800"])


def test_cross_field_checks():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="non-empty"):
        SamplingParams(stop=[""])
    with pytest.raises(ValueError, match="exactly one"):
        AddRequest("r", IDS)
    both = msgspec.msgpack.encode(["AddRequest", "r", ["int32", [1], b"\0" * 4], {}, {}])
    with pytest.raises(msgspec.ValidationError, match="exactly one"):
        DECODERS["client_request"]().decode(both)


def test_vllm_spellings_and_wrong_types():
    """What vLLM's ``SamplingParams`` takes works the same; a wrong type or an integer
    msgpack cannot carry is a ``ValueError`` naming the field, not a ``TypeError`` or an
    ``OverflowError`` from deep inside."""
    assert SamplingParams(stop="ab").validate().stop == ["ab"]
    assert SamplingParams(top_k=-1).validate().top_k == 0
    assert SamplingParams(max_tokens=None).validate().max_tokens == 2**31 - 1
    for kwargs, field in [
        ({"temperature": "0.5"}, "temperature"),
        ({"n": 2.0}, "n"),
        ({"seed": True}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs).validate()
    with pytest.raises(ValueError, match=r"max_tokens must be >= 1, got -3"):
        SamplingParams(max_tokens=-3)
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=2**64)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be <= 2147483647"):
        PoolingParams(truncate_prompt_tokens=2**40)


def test_validate_before_sending():
    """``validate`` checks every constraint (the constructor checks the numbers): a field
    set after construction, a stop string too long."""
    params = SamplingParams()
    params.temperature = -2.0
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        params.validate()
    with pytest.raises(msgspec.ValidationError, match="stop"):
        SamplingParams(stop=["x" * 5000]).validate()
    assert SamplingParams(temperature=0.0).validate().greedy


def _decode_or_reject(data: bytes) -> None:
    for make in DECODERS.values():
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            make().decode(data)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_only_raise_decode_errors(data):
    _decode_or_reject(data)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(
    tag=st.sampled_from([type(m).__name__ for _, m in SAMPLES] + ["Nope"]),
    fields=st.lists(msgpack_values, max_size=12),
)
def test_well_formed_but_wrong_frames_only_raise_validation_errors(tag, fields):
    _decode_or_reject(msgspec.msgpack.encode([tag, *fields]))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_valid_frames_only_raise_decode_errors(data):
    _, msg = data.draw(st.sampled_from(SAMPLES))
    frame = bytearray(encoder.encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    _decode_or_reject(bytes(frame))
