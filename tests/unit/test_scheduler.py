"""The scheduler and block manager with no model and no processes.

A fake executor keeps a KV cache of token ids in the blocks the plans name, and samples from
the context it reads back, so wrong block tables, early block reuse or a bad recompute all
change the tokens compared against ``reference_generate``.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpengine.config import EngineConfig
from mpengine.protocol import STEP_TOKEN_BUCKETS, AddRequest, Array, Feedback, SamplingParams
from mpengine.scheduler import BlockManager, RequestRejected, Scheduler
from mpengine.testing.fake import FakeExecutor, FakeOutput, drive, reference_generate

VOCAB = 97
EOS = 5


def make_scheduler(
    num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_len=512, num_host_blocks=0
):
    config = EngineConfig(
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        preemption_mode="swap" if num_host_blocks else "recompute",
    )
    return Scheduler(
        config,
        num_blocks=num_blocks,
        vocab_size=VOCAB,
        max_model_len=max_len,
        num_host_blocks=num_host_blocks,
    )


def add(sched, request_id, prompt, max_tokens=8, n=1, seed=None):
    params = SamplingParams(max_tokens=max_tokens, n=n, seed=seed)
    sched.add_request(AddRequest(request_id, Array.of(prompt), params), "client")


def run(sched, output, lag, on_step=None):
    """Drive plans through the fake stages under the lockstep rule with ``lag``."""
    executor = FakeExecutor(sched.blocks.block_size, VOCAB)
    on_plan = None if on_step is None else lambda plan: on_step(sched, plan)
    return drive(sched, executor, output, lag=lag, on_plan=on_plan)


def outputs_of(sched_seqs_by_request, output):
    return {rid: [output.outputs[s] for s in ids] for rid, ids in sched_seqs_by_request.items()}


@pytest.mark.parametrize("num_host_blocks", [0, 64, 5], ids=["recompute", "swap", "swap-full"])
@pytest.mark.parametrize("lag", [0, 1])
def test_outputs_match_reference_with_preemption(lag, num_host_blocks):
    """Recompute, swap, and swap that runs out of host blocks (then recomputes) all give
    the reference outputs."""
    rng = random.Random(lag)
    sched = make_scheduler(
        num_blocks=24, block_size=4, max_num_seqs=6, budget=16, num_host_blocks=num_host_blocks
    )
    output = FakeOutput(EOS)
    prompts = {}
    for i in range(20):
        prompt = [rng.randrange(6, VOCAB) for _ in range(rng.randint(1, 30))]
        prompts[f"r{i}"] = (prompt, rng.randint(1, 20))
        add(sched, f"r{i}", prompt, max_tokens=prompts[f"r{i}"][1])
    seq_ids = {rid: [s.seq_id for s in sched.requests["client", rid].seqs] for rid in prompts}
    run(sched, output, lag)
    assert sched.counters["preemptions"] > 0, "the cache was meant to be too small"
    swapped = sched.counters["swapped_out_blocks"]
    assert (swapped > 0) == (num_host_blocks > 0)
    assert sched.counters["swapped_in_blocks"] <= swapped
    assert len(sched.swap.free_host_blocks) == num_host_blocks
    for rid, (prompt, max_tokens) in prompts.items():
        (seq_id,) = seq_ids[rid]
        assert output.outputs[seq_id] == reference_generate(prompt, max_tokens, EOS, VOCAB), rid
    assert sched.blocks.num_free == sched.blocks.num_blocks
    assert not sched.requests and not sched.seqs and len(sched.free_slots) == 12


@pytest.mark.parametrize("lag", [0, 1])
def test_n_samples_share_prompt_blocks(lag):
    sched = make_scheduler(num_blocks=64, block_size=4)
    output = FakeOutput(EOS)
    prompt = list(range(10, 40))
    add(sched, "r", prompt, max_tokens=6, n=3)
    seq_ids = [s.seq_id for s in sched.requests["client", "r"].seqs]
    shared = []

    def on_step(sched, plan):  # how many samples hold a block
        held = Counter(b for seq in sched.seqs.values() for b in seq.block_ids)
        shared.append(max(held.values(), default=0))

    run(sched, output, lag, on_step)
    assert max(shared) == 3, "the three samples should share the prompt's full blocks"
    assert sched.counters["forked_blocks"] == 2 * ((len(prompt) - 1) // 4)
    expected = reference_generate(prompt, 6, EOS, VOCAB)  # the fake model is deterministic
    assert all(output.outputs[s] == expected for s in seq_ids)
    assert sched.blocks.num_free == sched.blocks.num_blocks


@pytest.mark.parametrize("fails", [False, True])
def test_samples_fork_from_a_prompt_step_that_ran(fails):
    """The other samples of an n > 1 request share its first sample's prompt blocks once
    the step computing them has reported back: under async depth 1 the next plan is built
    before that, and forked then, they read the blocks of a step that failed (never
    written) and returned wrong tokens. When the first sample fails, they compute the
    prompt themselves."""
    sched = make_scheduler(num_blocks=64, block_size=4)
    prompt = list(range(10, 30))
    add(sched, "r", prompt, max_tokens=4, n=3)
    first, *others = [s.seq_id for s in sched.requests["client", "r"].seqs]
    plan1 = sched.schedule()
    assert plan1 is not None and plan1.seq_ids.numpy().tolist() == [first]
    plan2 = sched.schedule()  # (depth 1: before step 1's feedback)
    assert plan2 is not None and plan2.seq_ids.numpy().tolist() == [first]
    reason = ["error"] if fails else []
    failed = [first] if fails else []
    feedback = Feedback(
        plan1.step,
        Array.of([] if fails else [first], "int64"),
        Array.of([] if fails else [7]),
        failed,
        reason,
    )
    plan3 = sched.schedule([feedback])
    assert plan3 is not None
    starts = dict(zip(plan3.seq_ids.numpy().tolist(), plan3.starts.numpy().tolist(), strict=True))
    shared = (len(prompt) - 1) // 4 * 4
    assert [starts[s] for s in others] == ([0, 0] if fails else [shared, shared])


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize(
    "prompt_len, n, num_blocks",
    [(25, 2, 7), (3, 8, 8), (25, 4, 8)],
    ids=["prompt-fills-the-cache", "many-samples", "samples-outgrow-the-cache"],
)
def test_samples_that_the_cache_cannot_hold_together_still_run(lag, prompt_len, n, num_blocks):
    """A request whose samples cannot all fit beside each other is admitted anyway and its
    samples take turns (preempting each other), rather than waiting forever at the head of
    the queue with every later request behind it."""
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_len=64)
    output = FakeOutput(EOS)
    prompt = list(range(10, 10 + prompt_len))
    add(sched, "big", prompt, max_tokens=3, n=n)
    add(sched, "small", [7, 8], max_tokens=3)
    ids = {rid: [s.seq_id for s in sched.requests["client", rid].seqs] for rid in ("big", "small")}
    run(sched, output, lag)
    for rid, (p, count) in {"big": (prompt, n), "small": ([7, 8], 1)}.items():
        expected = reference_generate(p, 3, EOS, VOCAB)
        assert [output.outputs[s] for s in ids[rid]] == [expected] * count, rid
    assert sched.blocks.num_free == sched.blocks.num_blocks


def test_lag1_finished_request_wastes_one_slot_and_frees_after_its_last_step():
    sched = make_scheduler()
    output = FakeOutput(eos=-1)  # finish by max_tokens only... and by a stop we force:
    add(sched, "r", [10, 11, 12], max_tokens=50)
    (seq_id,) = [s.seq_id for s in sched.requests["client", "r"].seqs]
    executor = FakeExecutor(4, VOCAB)
    plans = [sched.schedule()]
    output.announce(sched.take_announcements())
    results = [executor.execute(plans[0])]
    plans.append(sched.schedule())  # step 2 planned ahead of step 1's feedback
    results.append(executor.execute(plans[1]))
    # The output processor decides the request stops at its first token (a stop string).
    fb1 = output.process(results[0])
    output.finished[seq_id] = "stop"
    fb1 = type(fb1)(fb1.step, fb1.seq_ids, fb1.token_ids, [seq_id], ["stop"])
    plan3 = sched.schedule([fb1])
    assert plan3 is None, "no further step for a finished request"
    # Step 2 still touches its blocks: they must not be free before step 2 is processed.
    assert sched.blocks.num_free < sched.blocks.num_blocks
    fb2 = output.process(results[1])
    assert len(fb2.seq_ids) == 0, "the wasted token is never visible"
    assert sched.schedule([fb2]) is None
    assert sched.blocks.num_free == sched.blocks.num_blocks


def test_abort_frees_blocks_at_next_safe_point():
    sched = make_scheduler()
    add(sched, "a", list(range(10, 30)), max_tokens=100)
    add(sched, "b", list(range(10, 20)), max_tokens=100)
    executor = FakeExecutor(4, VOCAB)
    executor.execute(sched.schedule())
    sched.abort("client", ["a", "unknown"])
    anns = sched.take_announcements()
    assert [type(a).__name__ for a in anns][-1] == "AbortRequests"
    assert anns[-1].request_ids == ["a"]
    from mpengine.protocol import Feedback

    fb = Feedback(1, Array.of([], "int64"), Array.of([]))
    plan = sched.schedule([fb])
    assert plan is not None and set(plan.seq_ids.numpy().tolist()) == {1}
    assert ("client", "a") not in sched.requests


def test_requests_the_output_stage_aborts_count_as_aborted():
    """A client gone (or not reading) has its requests ended by the output stage, which
    reports their samples back as ``abort``: each request counts once, as the scheduler's
    own aborts do."""
    sched = make_scheduler()
    add(sched, "two", [10, 11, 12], max_tokens=8, n=2)
    add(sched, "one", [13, 14], max_tokens=8)
    plan = sched.schedule()
    assert plan is not None
    dropped = [s.seq_id for s in sched.requests["client", "two"].seqs]
    feedback = Feedback(plan.step, Array.of([], "int64"), Array.of([]), dropped, ["abort"] * 2)
    sched.schedule([feedback])
    assert sched.counters["aborted"] == 1
    assert ("client", "two") not in sched.requests and ("client", "one") in sched.requests


def test_gone_client_has_its_queued_requests_dropped_unannounced():
    """The output stage found a client gone: its requests still queued here end without
    being admitted or announced (the output stage ends those it knows of itself)."""
    sched = make_scheduler(num_blocks=8, block_size=4, budget=20)
    add(sched, "runs", list(range(10, 30)), max_tokens=8)  # the whole budget
    add(sched, "waits", list(range(40, 60)), max_tokens=8)
    sched.add_request(AddRequest("other", Array.of([70, 71]), SamplingParams()), "stays")
    plan = sched.schedule()
    assert plan is not None and plan.seq_ids.numpy().tolist() == [0]
    assert [a.request_id for a in sched.take_announcements()] == ["runs"]
    running = [s.seq_id for s in sched.requests["client", "runs"].seqs]
    feedback = Feedback(
        plan.step, Array.of([], "int64"), Array.of([]), running, ["abort"], gone_clients=["client"]
    )
    sched.schedule([feedback])
    assert sched.counters["aborted"] == 2
    assert set(sched.requests) == {("stays", "other")}
    assert [a.request_id for a in sched.take_announcements()] == ["other"]  # admitted
    assert sched.stats()["num_waiting"] == 0


def test_steps_are_counted_by_tokens_computed():
    sched = make_scheduler(budget=32)
    add(sched, "a", list(range(10, 30)), max_tokens=3)  # a 20-token prefill, then decodes
    tokens = []
    steps = run(sched, FakeOutput(EOS), 0, lambda _, plan: tokens.append(len(plan.token_ids)))
    counts = sched.stats()["step_tokens"]
    assert tokens == [20, 1, 1] and sum(counts) == steps == 3
    assert counts[STEP_TOKEN_BUCKETS.index(1)] == 2  # the decodes
    assert counts[STEP_TOKEN_BUCKETS.index(32)] == 1  # the prefill (17..32 tokens)


def test_abort_of_waiting_request_is_announced_then_aborted():
    sched = make_scheduler()
    add(sched, "w", [10, 11])
    sched.abort("client", ["w"])
    names = [type(a).__name__ for a in sched.take_announcements()]
    assert names == ["NewRequest", "AbortRequests"]
    assert sched.schedule() is None and not sched.has_unfinished


def test_chunked_prefill_respects_budget_and_max_num_seqs():
    sched = make_scheduler(budget=10, max_num_seqs=2)
    for i in range(3):
        add(sched, f"r{i}", list(range(10, 35)), max_tokens=2)
    seen = set()

    def on_step(sched, plan):
        if plan.step == 1:
            assert plan.num_seqs == 1 and not plan.sample.numpy().any()  # a partial chunk
        assert plan.num_tokens.numpy().sum() <= 10
        assert len(sched.running) <= 2
        seen.update(plan.seq_ids.numpy().tolist())

    run(sched, FakeOutput(EOS), 1, on_step)
    assert seen == {0, 1, 2}


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "empty"),
        (list(range(10, 600)), "max_model_len"),
        ([1, 2, VOCAB], "outside the vocabulary"),
        ([-3], "outside the vocabulary"),
    ],
)
def test_rejects_bad_requests(prompt, message):
    sched = make_scheduler()
    with pytest.raises(RequestRejected, match=message):
        add(sched, "bad", prompt)
    assert not sched.has_unfinished


def test_rejects_request_bigger_than_cache_and_duplicate_ids():
    sched = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(RequestRejected, match="cannot hold"):
        add(sched, "big", list(range(10, 20)), max_tokens=20)
    with pytest.raises(RequestRejected, match="cannot hold"):
        add(sched, "one-too-many", list(range(10, 20)), max_tokens=8)
    # 10 + 7 tokens fill the 16 slots but one: the last is sampled, never computed.
    add(sched, "fits", list(range(10, 20)), max_tokens=7)
    seq_id = sched.requests["client", "fits"].seqs[0].seq_id
    output = FakeOutput(EOS)
    run(sched, output, 1)
    assert output.outputs[seq_id] == reference_generate(list(range(10, 20)), 7, EOS, VOCAB)
    add(sched, "ok", [10])
    with pytest.raises(RequestRejected, match="already in use"):
        add(sched, "ok", [10])


def test_truncate_prompt_tokens_keeps_the_last_tokens():
    sched = make_scheduler(max_len=64)
    long = [10 + i % 80 for i in range(200)]  # longer than max_model_len
    for request_id, limit, kept in [("k", 5, long[-5:]), ("all", -1, long[-63:])]:
        params = SamplingParams(max_tokens=1, truncate_prompt_tokens=limit)
        sched.add_request(AddRequest(request_id, Array.of(long), params), "client")
        assert sched.requests["client", request_id].prompt_token_ids == kept
    assert SamplingParams(truncate_prompt_tokens=3).truncated([1, 2], 64) == [1, 2]
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_priority_policy_orders_admission_and_preemption():
    config = EngineConfig(
        block_size=4, max_num_seqs=2, max_num_batched_tokens=64, scheduling_policy="priority"
    )
    sched = Scheduler(config, num_blocks=6, vocab_size=VOCAB, max_model_len=512)
    for request_id, priority in [("low", 5), ("mid", 0), ("urgent", -3), ("mid2", 0)]:
        params = SamplingParams(max_tokens=13)  # 16 tokens, 4 blocks: two need 8
        add = AddRequest(request_id, Array.of([10, 11, 12]), params, priority=priority)
        sched.add_request(add, "client")
    assert [r.request_id for r in sched.waiting] == ["urgent", "mid", "mid2", "low"]
    # The two most urgent run first; they grow until the 6 blocks run out, and the less
    # urgent one gives way.
    first_running, first_preempted = [], []

    def watch(sched, plan) -> None:
        if not first_running:
            first_running.extend(s.request.request_id for s in sched.running)
        if sched.counters["preemptions"] and not first_preempted:
            first_preempted.extend(s.request.request_id for s in sched.preempted)

    output = FakeOutput(EOS)
    for request in sched.requests.values():
        for seq in request.seqs:
            output.add(seq.seq_id, request.max_tokens)
    run(sched, output, 0, on_step=watch)
    assert first_running == ["urgent", "mid"] and first_preempted == ["mid"]
    fcfs = make_scheduler()
    with pytest.raises(RequestRejected, match="scheduling-policy priority"):
        fcfs.add_request(AddRequest("p", Array.of([10]), SamplingParams(), priority=1), "c")


def test_an_urgent_request_is_not_held_behind_a_less_urgent_preempted_one():
    """A preempted sequence goes back among the waiting requests by its priority: one that
    does not fit yet must not keep a more urgent request that fits from starting."""
    config = EngineConfig(
        block_size=4, max_num_seqs=4, max_num_batched_tokens=64, scheduling_policy="priority"
    )
    sched = Scheduler(config, num_blocks=12, vocab_size=VOCAB, max_model_len=512)
    executor, output = FakeExecutor(4, VOCAB), FakeOutput(eos=-1)  # no early stop

    def submit(request_id: str, priority: int, num_prompt: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        prompt = Array.of(list(range(10, 10 + num_prompt)))
        add = AddRequest(request_id, prompt, params, priority=priority)
        sched.add_request(add, "c")

    def step() -> list[str]:
        plan = sched.schedule(feedback)
        feedback.clear()
        output.announce(sched.take_announcements())  # on admission
        if plan is not None:
            feedback.append(output.process(executor.execute(plan)))
        return sorted({s.request.request_id for s in sched.running})

    feedback: list = []
    submit("low1", 5, 3, 40)  # 11 and 12 blocks at the end, of 12
    submit("low2", 5, 8, 40)
    for _ in range(100):
        step()
        if sched.preempted:
            break
    (low2,) = sched.preempted
    assert low2.request.request_id == "low2"
    # low2 needs more blocks than are free; the urgent request's one block is free.
    assert sched.blocks.blocks_for(len(low2)) > sched.blocks.num_free >= 1
    submit("urgent", 0, 3, 1)
    assert "urgent" in step()
    for _ in range(200):
        step()
        if not sched.has_unfinished:
            break
    assert output.finished == {0: "length", 1: "length", 2: "length"}
    sched.blocks.check()


def test_block_manager_refcounts():
    bm = BlockManager(4, 16)
    a = bm.allocate(2)
    b = bm.share(a)
    assert bm.num_free == 2 and all(bm.ref_count(x) == 2 for x in a)
    bm.free(a)
    assert bm.num_free == 2
    bm.free(b)
    assert bm.num_free == 4
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(5)
    with pytest.raises(AssertionError, match="double free"):
        bm.free([0])
    assert bm.blocks_for(0) == 0 and bm.blocks_for(16) == 1 and bm.blocks_for(17) == 2
    bm.check()


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=12),
    num_blocks=st.integers(14, 40),  # a request alone needs up to 13
    lag=st.sampled_from([0, 1]),
    seed=st.integers(0, 1000),
)
def test_property_random_workloads_match_reference(lengths, num_blocks, lag, seed):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=5, budget=12)
    output = FakeOutput(EOS)
    expected = {}
    for i, (plen, max_tokens) in enumerate(lengths):
        prompt = [rng.randrange(6, VOCAB) for _ in range(plen)]
        add(sched, f"r{i}", prompt, max_tokens=max_tokens)
        expected[sched.requests["client", f"r{i}"].seqs[0].seq_id] = reference_generate(
            prompt, max_tokens, EOS, VOCAB
        )
    run(sched, output, lag)
    for seq_id, tokens in expected.items():
        assert output.outputs[seq_id] == tokens
    assert sched.blocks.num_free == sched.blocks.num_blocks


@pytest.mark.parametrize("lag", [0, 1])
def test_token_counters(lag):
    sched = make_scheduler(budget=8)
    prompts = {"a": list(range(10, 23)), "b": list(range(30, 35))}
    for rid, prompt in prompts.items():
        add(sched, rid, prompt, max_tokens=6)
    output = FakeOutput(EOS)
    run(sched, output, lag)
    stats = sched.stats()
    generated = sum(len(tokens) for tokens in output.outputs.values())
    assert stats["generated_tokens"] == generated
    # Every prompt token and every output but the last of each sequence was computed; under
    # lag 1 a sequence that finished may have had one more decode planned (wasted).
    expected = 13 + 5 + generated - 2
    assert expected <= stats["computed_tokens"] <= expected + 2 * lag


def test_a_prompt_still_being_scored_is_preempted_by_recompute_not_swap():
    """Prompt logprobs are scored by the slot of a sequence's first prefill: one swapped
    out half-way through its prompt resumed in a slot that scored nothing, and returned
    fewer prompt logprobs than prompt tokens. It recomputes instead (its scored prompt
    chunks start again from 0); the others still swap."""
    rng = random.Random(3)
    sched = make_scheduler(
        num_blocks=16, block_size=4, max_num_seqs=4, budget=8, num_host_blocks=32
    )
    for i in range(3):
        add(sched, f"d{i}", [rng.randrange(6, VOCAB) for _ in range(8)], max_tokens=30)
    params = SamplingParams(max_tokens=4, prompt_logprobs=1)
    prompt = [rng.randrange(6, VOCAB) for _ in range(40)]
    sched.add_request(AddRequest("p", Array.of(prompt), params), "client")
    scored = sched.requests["client", "p"].seqs[0].seq_id
    output = FakeOutput(EOS)
    starts: list[tuple[int, bool]] = []  # (start, scores) of each start of the scored one

    def on_step(sched, plan):
        slots = plan.slots.numpy().tolist()
        for start in plan.new_seqs:
            if start.seq_id == scored:
                starts.append(
                    (int(plan.starts.numpy()[slots.index(start.slot)]), start.prompt_logprobs)
                )

    run(sched, output, 1, on_step)
    assert sched.counters["swapped_out_blocks"] > 0  # the decoding ones swapped
    assert len(starts) > 1 and all(start == (0, True) for start in starts), starts


def test_aborting_a_swapped_sequence_frees_its_host_blocks():
    rng = random.Random(7)
    sched = make_scheduler(
        num_blocks=16, block_size=4, max_num_seqs=4, budget=16, num_host_blocks=32
    )
    prompts = {f"r{i}": [rng.randrange(6, VOCAB) for _ in range(12)] for i in range(4)}
    for rid, prompt in prompts.items():
        add(sched, rid, prompt, max_tokens=20)
    seq_ids = {rid: sched.requests["client", rid].seqs[0].seq_id for rid in prompts}
    output = FakeOutput(EOS)
    aborted = []

    def on_step(sched, plan):
        swapped = [seq for seq in sched.preempted if seq.host_block_ids]
        if swapped and not aborted:
            request = swapped[0].request
            aborted.append(request.request_id)
            sched.abort(request.client_id, [request.request_id])
            output.abort(swapped[0].seq_id)

    run(sched, output, 1, on_step)
    assert aborted, "no sequence was swapped out"
    assert len(sched.swap.free_host_blocks) == 32 and sched.stats()["num_swapped"] == 0
    for rid, prompt in prompts.items():
        if rid not in aborted:
            expected = reference_generate(prompt, 20, EOS, VOCAB)
            assert output.outputs[seq_ids[rid]] == expected, rid


def _priority_scheduler(num_blocks: int, budget: int, max_num_seqs: int = 8) -> Scheduler:
    config = EngineConfig(
        block_size=4,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        scheduling_policy="priority",
    )
    return Scheduler(config, num_blocks=num_blocks, vocab_size=VOCAB, max_model_len=512)


@pytest.mark.parametrize("lag", [0, 1])
def test_an_urgent_prefill_takes_what_the_running_decodes_leave(lag):
    """Priority orders admission and preemption, not the running list: an urgent long
    prompt admitted while others decode is chunked from the budget they leave, and every
    step goes on carrying their tokens (it took the whole budget until its prefill ended,
    and their streams stopped meanwhile)."""
    sched = _priority_scheduler(num_blocks=256, budget=32)
    output = FakeOutput(eos=-1)
    decodes = []
    for i in range(4):
        params = SamplingParams(max_tokens=40)
        sched.add_request(AddRequest(f"d{i}", Array.of([10 + i] * 3), params), "c")
        decodes.append(sched.requests["c", f"d{i}"].seqs[0].seq_id)
    plans, urgent_ids = [], []

    def on_step(sched, plan) -> None:
        if len(plans) == 3:  # they decode: now the urgent prompt
            urgent = SamplingParams(max_tokens=2)
            sched.add_request(AddRequest("u", Array.of([20] * 300), urgent, priority=-1), "c")
            urgent_ids.append(sched.requests["c", "u"].seqs[0].seq_id)
        plans.append(plan)

    run(sched, output, lag, on_step=on_step)
    prefill = []
    for plan in plans:
        ids, sizes = plan.seq_ids.numpy().tolist(), plan.num_tokens.numpy().tolist()
        chunks = dict(zip(ids, sizes, strict=True))
        if chunks.get(urgent_ids[0], 0) > 1:
            prefill.append(chunks)
    # 28 tokens a step (the budget less the 4 decodes), 300 in 11 steps
    assert [chunks[urgent_ids[0]] for chunks in prefill] == [28] * 10 + [20]
    for chunks in prefill:
        assert all(chunks.get(s) == 1 for s in decodes), "a running decode lost its turn"
    assert all(output.finished[s] == "length" for s in decodes)


@pytest.mark.parametrize("lag", [0, 1])
def test_a_victim_chosen_by_priority_gives_back_its_chunk(lag):
    """By priority the least urgent sequence gives way, wherever it stands in the running
    list: one given a chunk earlier in the same step gives the chunk back (tokens to the
    budget, blocks to the cache) and is preempted, and every request still ends with the
    reference outputs."""
    given_back = []
    for seed in range(4):
        rng = random.Random(seed)
        sched = _priority_scheduler(num_blocks=20, budget=16, max_num_seqs=6)
        output = FakeOutput(EOS)
        original = sched._give_back

        def give_back(seq, batch, budget, original=original):
            tokens = original(seq, batch, budget)
            given_back.append(tokens)
            return tokens

        sched._give_back = give_back
        prompts: dict[str, tuple[list[int], int]] = {}
        seq_ids: dict[str, int] = {}

        def arrive(sched, plan=None, rng=rng, prompts=prompts, seq_ids=seq_ids) -> None:
            # Requests keep arriving, any priority: running is in admission order, so the
            # least urgent may stand before the sequence that needs its blocks.
            if len(prompts) < 24 and (plan is None or rng.random() < 0.5):
                rid = f"r{len(prompts)}"
                prompts[rid] = ([rng.randrange(6, VOCAB) for _ in range(rng.randint(1, 24))], 0)
                prompts[rid] = (prompts[rid][0], rng.randint(1, 24))
                params = SamplingParams(max_tokens=prompts[rid][1])
                priority = rng.randint(0, 3)
                sched.add_request(
                    AddRequest(rid, Array.of(prompts[rid][0]), params, priority=priority), "client"
                )
                seq_ids[rid] = sched.requests["client", rid].seqs[0].seq_id

        for _ in range(4):
            arrive(sched)
        run(sched, output, lag, on_step=arrive)
        assert len(prompts) == 24 and sched.counters["preemptions"] > 0
        for rid, (prompt, max_tokens) in prompts.items():
            expected = reference_generate(prompt, max_tokens, EOS, VOCAB)
            assert output.outputs[seq_ids[rid]] == expected, (seed, rid)
        assert sched.blocks.num_free == sched.blocks.num_blocks
    assert any(tokens > 0 for tokens in given_back), "no victim had been given a chunk"


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_later_request_does_not_preempt_a_beam_waiting_for_its_step(policy):
    """A beam waiting for its beam step holds blocks it cannot use yet, and gives way to
    its own group's beams (or they would wait on each other forever); to another
    request's sequence only if that request is more urgent (by priority; under FCFS,
    arrived first). An urgent beam search was preempted, again and again, for a
    low-priority request's decode."""
    config = EngineConfig(
        block_size=4, max_num_seqs=8, max_num_batched_tokens=64, scheduling_policy=policy
    )
    sched = Scheduler(config, num_blocks=3, vocab_size=VOCAB, max_model_len=64)
    beams = SamplingParams(n=2, use_beam_search=True, max_tokens=4)
    urgent = AddRequest("beam", Array.of(list(range(10, 18))), beams)  # 2 blocks
    low = AddRequest("low", Array.of([30, 31, 32, 33]), SamplingParams(max_tokens=4))  # 1
    if policy == "priority":
        low = AddRequest("low", low.prompt_token_ids, low.sampling, priority=5)
    sched.add_request(urgent, "c")
    sched.add_request(low, "c")
    assert sched.schedule() is not None  # both prompts, both sample: every block is taken
    assert sched.blocks.num_free == 0
    beam = sched.requests["c", "beam"].seqs[0]
    assert beam.num_inflight == 1 and not beam.wants_tokens()  # it waits for its beam step
    # Under async depth 1 the next plan comes before that step's feedback: the low
    # request's decode needs a block, and must not take the waiting beam's.
    sched.schedule()
    (preempted,) = sched.preempted
    assert preempted.request.request_id == "low"
    assert beam.status.name == "RUNNING" and beam.block_ids


def test_announcements_carry_the_prompts_tail():
    """The output stage decodes a request's outputs after the prompt's last tokens."""
    sched = make_scheduler()
    add(sched, "long", list(range(10, 30)))
    add(sched, "short", [11, 12])
    sched.schedule()
    tails = {a.request_id: a.prompt_tail.numpy().tolist() for a in sched.take_announcements()}
    assert tails == {"long": [25, 26, 27, 28, 29], "short": [11, 12]}


def test_a_sequence_that_preempts_itself_by_priority_does_not_end_the_step():
    """By priority, a less urgent sequence ahead of more urgent ones in the running list
    (admitted first) that runs out of blocks preempts itself; the more urgent ones behind
    it still run in that step (the pass ended there, and the step planned nothing)."""
    sched = _priority_scheduler(num_blocks=8, budget=64)
    executor, output = FakeExecutor(4, VOCAB), FakeOutput(eos=-1)
    params = SamplingParams(max_tokens=21, ignore_eos=True)
    sched.add_request(AddRequest("low", Array.of(list(range(10, 17))), params, priority=5), "c")
    feedback: list = []

    def step():
        plan = sched.schedule(feedback)
        feedback.clear()
        output.announce(sched.take_announcements())
        if plan is not None:
            feedback.append(output.process(executor.execute(plan)))
        return plan

    step()
    sched.add_request(AddRequest("urgent", Array.of(list(range(20, 27))), params), "c")
    urgent = sched.requests["c", "urgent"].seqs[0].seq_id
    for _ in range(40):
        preempted_before = sched.counters["preemptions"]
        plan = step()
        if sched.counters["preemptions"] > preempted_before:
            (low,) = sched.preempted
            assert low.request.request_id == "low"
            assert plan is not None and urgent in plan.seq_ids.numpy().tolist()
            break
    else:
        pytest.fail("the low-priority sequence was meant to run out of blocks")
