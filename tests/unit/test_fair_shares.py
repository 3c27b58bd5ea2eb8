"""Fair shares between tenants: whose turn it is (``WaitingQueue``), and a tenant over its
share giving way to one under it, with the outputs still those of an undisturbed run.
No model, no processes."""

from __future__ import annotations

import pytest

from mpengine.config import EngineConfig
from mpengine.protocol import AddRequest, Array, SamplingParams
from mpengine.scheduler import Scheduler
from mpengine.scheduler.request import Request, Sequence
from mpengine.scheduler.waiting import WaitingQueue
from mpengine.testing.fake import FakeExecutor, FakeOutput, drive, reference_generate

VOCAB = 97
EOS = 5


def request(key: int, tenant: str, priority: int = 0, n: int = 1) -> Request:
    made = Request(key, f"r{key}", "c", [7, 8], None, None, 0.0, 4, priority, tenant=("c", tenant))
    made.seqs = [Sequence(key * 10 + i, made, i, [7, 8]) for i in range(n)]
    return made


def turns(queue: WaitingQueue, seat: bool = True) -> list[int]:
    """The keys in the order ``first`` gives them, each admitted (and seated) in turn."""
    order = []
    while (head := queue.first()) is not None:
        queue.admit(head)
        if seat:
            queue.seat(head.tenant, len(head.seqs))
        order.append(head.key)
    return order


def test_tenants_take_turns_and_one_tenant_is_first_come_first_served() -> None:
    queue = WaitingQueue()
    for key, tenant in enumerate("aaaab"):
        queue.append(request(key, tenant))
    assert queue.num_requests == 5 and queue.load(("c", "a")) == (4, 8)
    # a's first, then b's (running nothing beside a's one), then a's in order
    assert turns(queue) == [0, 4, 1, 2, 3]
    alone = WaitingQueue()
    for key in range(5):
        alone.append(request(key, "a"))
    assert turns(alone) == [0, 1, 2, 3, 4]


def test_the_tenant_running_fewest_goes_first_and_priority_before_that() -> None:
    queue = WaitingQueue()
    queue.seat(("c", "a"), 5)
    queue.seat(("c", "b"), 2)
    for key, tenant in [(0, "a"), (1, "b"), (2, "c")]:
        queue.append(request(key, tenant))
    assert queue.first().key == 2  # c runs nothing
    queue.append(request(3, "a", priority=-1))  # (the priority policy): more urgent
    assert turns(queue, seat=False) == [3, 2, 1, 0]


def test_a_tenant_that_stops_running_is_back_in_turn_and_aborted_heads_are_skipped() -> None:
    queue = WaitingQueue()
    queue.seat(("c", "a"))
    early_b, late_a = request(0, "b"), request(1, "a")
    queue.append(early_b)
    queue.append(late_a)
    queue.seat(("c", "b"), 3)
    assert queue.first() is late_a  # a runs 1, b runs 3
    queue.unseat(("c", "a"))
    queue.seat(("c", "a"), 4)
    assert queue.first() is early_b
    for _ in range(3):
        queue.unseat(("c", "b"))
    assert queue.running == {("c", "a"): 4} and queue.first() is early_b  # idle again
    early_b.seqs[0].status = early_b.seqs[0].status.FINISHED  # aborted while it waits
    queue.forget(early_b)
    assert queue.first() is late_a and queue.num_seqs == 1 and len(queue) == 1


def make(max_num_seqs: int = 4, num_blocks: int = 256) -> Scheduler:
    config = EngineConfig(block_size=4, max_num_seqs=max_num_seqs, max_num_batched_tokens=64)
    return Scheduler(config, num_blocks, VOCAB, 512)


def add(sched: Scheduler, request_id: str, client: str, prompt: list[int], **params) -> None:
    sampling = SamplingParams(ignore_eos=True, **params)
    sched.add_request(AddRequest(request_id, Array.of(prompt), sampling), client)


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("short_of", ["seats", "blocks"])
def test_a_small_request_is_served_beside_a_tenant_holding_the_whole_engine(
    lag: int, short_of: str
) -> None:
    """One client's request of 2 prompts x n=4 takes every seat (or every block); another
    client's 3-token request, arriving then, is admitted in the next step or so (a
    sequence of the big tenant gives way) and done in a few more, long before the big one
    ends; every output is still the reference's (the preempted ones recomputed)."""
    seats, blocks, long = (4, 256, 60) if short_of == "seats" else (16, 16, 40)
    sched = make(max_num_seqs=seats, num_blocks=blocks)
    output = FakeOutput(EOS)
    prompts = {"big0": [11, 12, 13], "big1": [14, 15, 16], "small": [21, 22, 23]}
    max_tokens = {"big0": long, "big1": long}
    for name in max_tokens:
        add(sched, name, "hog", prompts[name], n=4, seed=1, max_tokens=long)
    seq_ids = {name: [s.seq_id for s in sched.requests["hog", name].seqs] for name in max_tokens}
    seq_ids["small"] = []
    arrived: list[int] = []
    finished: dict[str, int] = {}

    def on_plan(plan) -> None:
        full = len(sched.running) == seats if short_of == "seats" else not sched.blocks.num_free
        if not arrived and full:
            arrived.append(plan.step)
            add(sched, "small", "other", prompts["small"], max_tokens=3)
            max_tokens["small"] = 3
            seq_ids["small"] = [s.seq_id for s in sched.requests["other", "small"].seqs]
        small = seq_ids["small"]
        if small and not finished and all(i in output.finished for i in small):
            finished["small"] = plan.step
            big = seq_ids["big0"] + seq_ids["big1"]
            finished["big_most"] = max(len(output.outputs.get(i, [])) for i in big)

    executor = FakeExecutor(sched.blocks.block_size, VOCAB)
    drive(sched, executor, output, lag=lag, on_plan=on_plan)
    assert arrived, "the big request never filled the engine"
    assert finished["small"] - arrived[0] <= 8, (arrived, finished)
    assert finished["big_most"] < long - 10, finished  # the big one went on long after
    assert sched.counters["fair_preemptions"] >= 1
    for name, prompt in prompts.items():
        want = reference_generate(prompt, max_tokens[name], EOS, VOCAB)
        for seq_id in seq_ids[name]:
            assert output.outputs[seq_id] == want, name
    sched.blocks.check()


def test_balanced_tenants_do_not_preempt_each_other() -> None:
    """Tenants running as many sequences each wait their turn: a fair preemption needs
    the victim's tenant to keep at least as many as the one it makes room for."""
    sched = make(max_num_seqs=4)
    for client in ("a", "b"):
        for i in range(3):
            add(sched, f"{client}{i}", client, [30 + i, 40], max_tokens=20)
    output = FakeOutput(EOS)
    executor = FakeExecutor(sched.blocks.block_size, VOCAB)
    shares: list[dict] = []

    def on_plan(plan) -> None:
        shares.append(dict(sched.waiting.running))

    drive(sched, executor, output, on_plan=on_plan)
    assert sched.counters["fair_preemptions"] == 0 and sched.counters["preemptions"] == 0
    assert shares[0] == {("a", ""): 2, ("b", ""): 2}  # a0, b0, a1, b1: turns, not arrival
