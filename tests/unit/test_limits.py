"""Client-controlled sizes: admission checks naming the field, frames bounded by the rings,
per-client request ids, and the waiting-queue caps. No model, no processes."""

from __future__ import annotations

import msgspec
import pytest

from mpengine.config import EngineConfig, MiB
from mpengine.limits import ABORT_CHUNK_BYTES, RING_HEADER, ConfigError, FrameLimits
from mpengine.protocol import (
    MAX_BEAM_CANDIDATES,
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    AbortRequests,
    AddRequest,
    Array,
    SamplingParams,
    encoder,
)
from mpengine.scheduler import RequestRejected, Scheduler
from mpengine.testing.fake import FakeExecutor, FakeOutput, drive

VOCAB = 97


def make(max_len: int = 512, num_blocks: int = 256, **config) -> Scheduler:
    config.setdefault("block_size", 4)
    config.setdefault("max_num_seqs", 16)
    config.setdefault("max_num_batched_tokens", 64)
    return Scheduler(EngineConfig(**config), num_blocks, VOCAB, max_len)


def add(sched: Scheduler, request_id: str, prompt: list[int], client: str = "c", **params):
    sched.add_request(AddRequest(request_id, Array.of(prompt), SamplingParams(**params)), client)


def decode_params(**params) -> SamplingParams:
    """Decode params as the engine does (the constraints are checked on decode)."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)


@pytest.mark.parametrize(
    "params, field",
    [
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(2000))}, "stop_token_ids"),
        ({"top_k": 2**63 - 1}, "top_k"),
        ({"n": 65}, "n"),
        ({"max_tokens": 2**40}, "max_tokens"),
    ],
)
def test_sizes_a_client_controls_are_bounded_at_decode(params, field) -> None:
    with pytest.raises(msgspec.ValidationError, match=field):
        decode_params(**params)


@pytest.mark.parametrize(
    "option, value",
    [
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("max_num_seqs", 2**64),
        ("kv_cache_bytes", 2**64),
        ("num_gpu_blocks_override", 2**62),  # block ids are int32
        ("num_threads", 2**40),
        ("ring_bytes", 2**40),
        ("swap_space", 2**60),
        ("startup_timeout", float("inf")),
    ],
)
def test_engine_options_beyond_any_machine_are_refused_by_name(option, value) -> None:
    """They crashed later with a traceback (OverflowError) that named no option."""
    with pytest.raises(msgspec.ValidationError, match=rf"\$\.{option}"):
        EngineConfig.from_kwargs(**{option: value})


def test_a_trace_that_is_a_folder_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="is a folder"):
        EngineConfig(trace=str(tmp_path))


def test_non_finite_temperature_is_refused() -> None:
    for value in (float("inf"), float("nan")):
        with pytest.raises(msgspec.ValidationError, match="temperature"):
            decode_params(temperature=value)


def test_min_tokens_above_capped_max_tokens_is_rejected_naming_the_field() -> None:
    sched = make(max_len=256)
    with pytest.raises(RequestRejected, match=r"sampling\.min_tokens \(4000\) exceeds max_tokens"):
        add(sched, "r", [5] * 200, max_tokens=4000, min_tokens=4000)
    add(sched, "ok", [5] * 200, max_tokens=4000, min_tokens=56)  # exactly what fits


def test_too_many_samples_name_the_field_that_asked_for_them() -> None:
    sched = make(max_num_seqs=2)
    for params, field in [
        ({"n": 3}, "n"),
        ({"n": 1, "best_of": 3}, "best_of"),
        ({"n": 1, "use_beam_search": True, "beam_width": 4}, "beam_width"),
        ({"n": 3, "use_beam_search": True}, "n"),
    ]:
        with pytest.raises(RequestRejected, match=rf"sampling\.{field}=\d+ exceeds max_num_seqs"):
            add(sched, "r", [5, 6], temperature=0.0, **params)


def test_stop_token_ids_outside_the_vocabulary_are_rejected() -> None:
    with pytest.raises(RequestRejected, match=r"sampling\.stop_token_ids: token id 97"):
        add(make(), "r", [5, 6], stop_token_ids=[3, VOCAB])


def test_waiting_queue_caps_answer_overloaded() -> None:
    sched = make(max_waiting_requests=3, max_waiting_tokens=100)
    for i in range(3):
        add(sched, f"r{i}", [5] * 10, client=f"c{i}")
    with pytest.raises(RequestRejected, match="max_waiting_requests=3") as info:
        add(sched, "r3", [5] * 10, client="c3")
    assert info.value.kind == "overloaded"
    sched.abort("c0", ["r0"])  # an aborted request leaves the queue
    with pytest.raises(RequestRejected, match="max_waiting_tokens=100") as info:
        add(sched, "big", [5] * 90, client="c3")
    assert info.value.kind == "overloaded"
    add(sched, "small", [5] * 70, client="c3")
    # An empty queue takes any prompt that fits the model, whatever the token cap.
    lone = make(max_waiting_tokens=10)
    add(lone, "long", [5] * 300)


def test_the_caps_count_sequences_and_a_tenant_takes_half_of_them() -> None:
    """A request counts once per sample (``n``, ``best_of``, beams); one tenant (a client,
    or a tenant a client names) may fill half the queue, so others still get in."""
    sched = make(max_waiting_requests=8, max_waiting_tokens=1000)
    add(sched, "wide", [5] * 10, client="a", n=4)
    with pytest.raises(RequestRejected, match="sequences of this tenant") as info:
        add(sched, "more", [5] * 10, client="a")
    assert info.value.kind == "overloaded"
    named = AddRequest("named", Array.of([5] * 10), SamplingParams(n=3), tenant="user-1")
    sched.add_request(named, "a")  # the same client, another tenant
    with pytest.raises(RequestRejected, match=r"7 sequences are waiting \(max_waiting_requests=8"):
        add(sched, "two", [5] * 10, client="b", n=2)
    add(sched, "one", [5] * 10, client="b")
    assert sched.waiting.num_seqs == 8 and sched.waiting.num_requests == 3
    tokens = make(max_waiting_tokens=100)
    add(tokens, "half", [5] * 50, client="a")
    with pytest.raises(RequestRejected, match="prompt tokens of this tenant"):
        add(tokens, "over", [5] * 10, client="a")
    add(tokens, "other", [5] * 50, client="b")


def test_a_batch_call_under_way_goes_on_past_the_caps_up_to_twice_them() -> None:
    """Requests that continue a batch call (``continues``) are refused only at twice the
    caps: several batch calls at once, each with half the queue in flight, failed
    part-way. New requests still stop at the caps."""
    sched = make(max_waiting_requests=3, max_waiting_tokens=1000)

    def more(request_id: str, size: int = 10) -> None:
        request = AddRequest(request_id, Array.of([5] * size), SamplingParams(), continues=True)
        sched.add_request(request, "batch")

    for i in range(3):
        add(sched, f"r{i}", [5] * 10, client=f"c{i}")
    with pytest.raises(RequestRejected, match="max_waiting_requests=3"):
        add(sched, "new", [5] * 10, client="c3")
    for i in range(3):
        more(f"more{i}")
    with pytest.raises(RequestRejected, match="max_waiting_requests=3") as info:
        more("more3")
    assert info.value.kind == "overloaded"
    tokens = make(max_waiting_requests=10, max_waiting_tokens=100)
    add(tokens, "r", [5] * 90)
    with pytest.raises(RequestRejected, match="max_waiting_tokens=100"):
        add(tokens, "new", [5] * 20, client="d")
    more_tokens = AddRequest("more", Array.of([5] * 100), SamplingParams(), continues=True)
    tokens.add_request(more_tokens, "batch")
    with pytest.raises(RequestRejected, match="max_waiting_tokens=100"):
        too_many = AddRequest("more2", Array.of([5] * 20), SamplingParams(), continues=True)
        tokens.add_request(too_many, "batch")


def test_request_ids_are_scoped_to_their_client() -> None:
    sched = make()
    add(sched, "same", [5, 6], client="alice")
    add(sched, "same", [5, 6], client="bob")  # no clash
    with pytest.raises(RequestRejected, match="already in use"):
        add(sched, "same", [5, 6], client="bob")
    sched.abort("mallory", ["same"])  # cannot touch the others'
    assert sched.take_announcements() == []
    assert sched.counters["aborted"] == 0
    sched.abort("bob", ["same"])
    (*_, aborted) = sched.take_announcements()
    assert isinstance(aborted, AbortRequests) and aborted.client_id == "bob"
    assert ("alice", "same") in sched.requests and ("bob", "same") not in sched.requests


def test_mass_abort_is_announced_in_bounded_frames() -> None:
    sched = make(max_waiting_requests=6000)
    ids = [f"{i:0200d}" for i in range(3000)]
    for request_id in ids:
        add(sched, request_id, [5, 6])
    sched.take_announcements()
    sched.abort("c", ids)
    aborts = [a for a in sched.take_announcements() if isinstance(a, AbortRequests)]
    assert len(aborts) > 1
    assert [rid for a in aborts for rid in a.request_ids] == ids
    assert max(len(encoder.encode(a)) for a in aborts) <= ABORT_CHUNK_BYTES + 1024


def drive_checked(sched: Scheduler, limit: int) -> tuple[list[int], FakeExecutor]:
    """Run to completion (async depth 0) checking every plan fits the ring; return the
    encoded plan sizes and the fake executor."""
    executor = FakeExecutor(sched.blocks.block_size, VOCAB)
    sizes: list[int] = []

    def check(plan) -> None:
        sizes.append(len(encoder.encode(plan)))
        assert sizes[-1] <= limit, f"plan of {sizes[-1]} bytes exceeds the ring's {limit}"

    drive(sched, executor, FakeOutput(eos=-1), on_plan=check)
    return sizes, executor


def test_plans_fit_the_ring_when_many_samples_fork_long_prompts() -> None:
    # A small ring: 16 requests of n=16 samples fork 15 x 255 shared blocks each.
    config = {"ring_bytes": 1 * MiB, "max_request_bytes": 256 * 1024, "block_size": 4}
    sched = make(
        max_len=2048, num_blocks=16_000, max_num_seqs=64, max_num_batched_tokens=4096, **config
    )
    for i in range(16):
        add(sched, f"r{i}", [5 + i] * 1021, n=16, max_tokens=3, stop=["zz" * 500] * 8)
    sizes, executor = drive_checked(
        sched, sched.limits.plan_fixed_bytes + sched.limits.plan_extra_bytes
    )
    assert max(sizes) <= 1 * MiB - RING_HEADER
    # Parameters crossed once per request, without their stop strings.
    assert executor.params_sent == 16
    assert executor.requests == set(sched.keys_to_forget)  # released by the next plan
    assert sched.blocks.num_free == sched.blocks.num_blocks


def test_prompt_logprob_positions_per_step_are_capped() -> None:
    sched = make(
        max_len=4096,
        num_blocks=4096,
        max_num_batched_tokens=4096,
        ring_bytes=256 * 1024,
        max_request_bytes=64 * 1024,
    )
    cap = sched.limits.max_prompt_logprob_tokens
    assert cap < 3000
    add(sched, "r", [5] * 3000, max_tokens=2, prompt_logprobs=20)
    plan = sched.schedule()
    assert plan is not None and int(plan.num_tokens.numpy()[0]) == cap


@pytest.mark.parametrize("max_num_seqs", [256, 4096, 16384, 34376])
def test_beam_rows_take_only_what_the_ring_spares(max_num_seqs: int) -> None:
    """Reserving rows of 64 continuations for every sequence refused configurations that
    started before (16,384 sequences with the default ring) and halved the prompt-logprob
    positions of a step. Beams get wider rows only from what is spare."""
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_seqs)
    limits = FrameLimits.derive(config, max_model_len=2048)
    narrow = 512 + (20 + 8 * MAX_LOGPROBS) * max_num_seqs  # rows of the 20 one may ask for
    room = config.ring_bytes - RING_HEADER - narrow - 64 * max_num_seqs
    assert limits.max_prompt_logprob_tokens == min(max_num_seqs, room // (8 + 8 * MAX_LOGPROBS))
    assert MAX_LOGPROBS <= limits.max_beam_candidates <= MAX_BEAM_CANDIDATES
    prompt = limits.max_prompt_logprob_tokens * (8 + 8 * MAX_LOGPROBS) + 64 * max_num_seqs
    assert limits.result_fixed_bytes + prompt <= config.ring_bytes - RING_HEADER
    if max_num_seqs == 256:
        assert limits.max_beam_candidates == MAX_BEAM_CANDIDATES


def test_a_ring_too_small_for_the_batch_limits_is_refused_naming_the_option() -> None:
    config = EngineConfig(
        ring_bytes=256 * 1024,
        max_request_bytes=64 * 1024,
        max_num_batched_tokens=65536,
        max_num_seqs=1024,
    )
    with pytest.raises(ConfigError, match=r"ring_bytes \(262144\) is too small"):
        FrameLimits.derive(config, max_model_len=32768)


def test_ring_must_hold_a_request() -> None:
    with pytest.raises(ValueError, match=r"ring_bytes .* must be at least max_request_bytes"):
        EngineConfig(ring_bytes=4 * MiB, max_request_bytes=4 * MiB)


def test_a_trace_into_a_missing_folder_fails_at_start(tmp_path) -> None:
    """The stages write their parts when they stop: a missing folder was found out then."""
    with pytest.raises(ValueError, match="trace: the folder"):
        EngineConfig(trace=str(tmp_path / "missing" / "trace.json"))
    assert EngineConfig(trace=str(tmp_path / "trace.json")).trace
