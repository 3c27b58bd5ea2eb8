"""Automatic prefix caching in the block manager and the scheduler, with no model.

The fake executor keeps token ids in the blocks the plans name and samples from what it
reads back, so a cached block reused with the wrong contents changes the outputs compared
against ``reference_generate``.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mpengine.config import EngineConfig
from mpengine.prefix_hash import chain_hashes
from mpengine.protocol import AddRequest, Array, Feedback, SamplingParams
from mpengine.scheduler import Scheduler
from mpengine.scheduler.block_manager import BlockManager
from mpengine.testing.fake import FakeExecutor, FakeOutput, drive, reference_generate
from tests.unit.test_scheduler import EOS, VOCAB, run

BS = 4


def make(caching: bool, num_blocks: int = 64, max_num_seqs: int = 6, budget: int = 16):
    config = EngineConfig(
        block_size=BS,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        prefix_caching=caching,
    )
    return Scheduler(config, num_blocks=num_blocks, vocab_size=VOCAB, max_model_len=512)


def add(sched: Scheduler, request_id: str, prompt: list[int], **params) -> int:
    params.setdefault("max_tokens", 6)
    sched.add_request(AddRequest(request_id, Array.of(prompt), SamplingParams(**params)), "c")
    return sched.requests["c", request_id].seqs[0].seq_id


def test_chain_hashes_name_prefixes() -> None:
    a = chain_hashes(list(range(10)), BS)
    assert len(a) == 2  # full blocks only
    assert chain_hashes([*range(8), 99, 98], BS) == a  # the partial tail is not named
    b = chain_hashes([0, 1, 2, 3, 9, 9, 9, 9], BS)
    assert b[0] == a[0] and b[1] != a[1]
    # The same block after a different parent is a different block.
    assert chain_hashes([9, 9, 9, 9, 4, 5, 6, 7], BS)[1] != a[1]
    assert chain_hashes(list(range(12)), BS, a[1], 2) == chain_hashes(list(range(12)), BS)[2:]


def test_block_manager_keeps_freed_blocks_cached_until_space_is_needed() -> None:
    bm = BlockManager(4, BS, caching=True)
    hashes = chain_hashes(list(range(8)), BS)
    blocks = bm.allocate(2)
    for block, h in zip(blocks, hashes, strict=True):
        bm.register(block, h)
    bm.free(blocks)
    assert bm.num_free == 4 and bm.num_cached == 2
    again = bm.lookup(hashes)
    assert again == blocks and bm.num_free == 2  # taken back off the free queue
    bm.free(again)
    bm.allocate(2)  # the two never-cached blocks go first
    assert bm.num_cached == 2
    bm.allocate(1)  # then the least recently freed cached block: the chain's tail
    assert bm.num_cached == 1 and bm.lookup(hashes) == blocks[:1]
    bm.check()


@pytest.mark.parametrize("lag", [0, 1])
def test_shared_prefix_outputs_are_identical_with_and_without_caching(lag) -> None:
    rng = random.Random(lag)
    system = [rng.randrange(6, VOCAB) for _ in range(37)]
    prompts = [
        system + [rng.randrange(6, VOCAB) for _ in range(rng.randint(1, 9))] for _ in range(16)
    ]
    results = {}
    for caching in (False, True):
        sched = make(caching)
        output = FakeOutput(EOS)
        ids = [add(sched, f"r{i}", p, max_tokens=5 + i % 4) for i, p in enumerate(prompts)]
        run(sched, output, lag)
        results[caching] = [output.outputs[s] for s in ids]
        assert sched.blocks.num_free == sched.blocks.num_blocks
        if caching:
            assert sched.counters["prefix_cache_hits"] >= 9 * BS * 8  # most reused the system
        else:
            assert sched.counters["prefix_cache_hits"] == 0
    expected = [reference_generate(p, 5 + i % 4, EOS, VOCAB) for i, p in enumerate(prompts)]
    assert results[False] == expected and results[True] == expected


def test_a_repeated_prompt_recomputes_only_its_last_token() -> None:
    sched = make(True)
    output = FakeOutput(EOS)
    prompt = list(range(10, 30))  # 5 full blocks
    add(sched, "a", prompt)
    run(sched, output, 0)
    add(sched, "b", prompt)
    plan = sched.schedule()
    assert plan is not None
    # 4 blocks (16 tokens) reused: the last block is recomputed for the last token's logits.
    assert plan.starts.numpy().tolist() == [16] and plan.num_tokens.numpy().tolist() == [4]
    assert sched.counters["prefix_cache_hits"] == 16


def test_eviction_under_pressure_stays_exact() -> None:
    rng = random.Random(7)
    sched = make(True, num_blocks=20, max_num_seqs=3)
    output = FakeOutput(EOS)
    expected = {}
    for i in range(30):  # three families of prefixes, more than the cache holds
        family = [(i % 3) + 6] * 12
        prompt = family + [rng.randrange(6, VOCAB) for _ in range(rng.randint(1, 14))]
        seq_id = add(sched, f"r{i}", prompt, max_tokens=rng.randint(1, 8))
        expected[seq_id] = reference_generate(
            prompt, sched.seqs[seq_id].request.max_tokens, EOS, VOCAB
        )
    run(sched, output, 1)
    assert sched.blocks.num_evicted > 0 and sched.counters["prefix_cache_hits"] > 0
    assert {s: output.outputs[s] for s in expected} == expected


def test_preemption_and_abort_with_shared_blocks() -> None:
    rng = random.Random(3)
    sched = make(True, num_blocks=22, max_num_seqs=6, budget=16)
    output = FakeOutput(EOS)
    system = [rng.randrange(6, VOCAB) for _ in range(16)]
    expected = {}
    for i in range(12):
        prompt = system + [rng.randrange(6, VOCAB) for _ in range(rng.randint(1, 6))]
        seq_id = add(sched, f"r{i}", prompt, max_tokens=20)
        expected[seq_id] = reference_generate(prompt, 20, EOS, VOCAB)
    expected_ids = {f"r{i}": seq_id for i, seq_id in enumerate(expected)}
    aborted = False

    def abort_once_preempted(plan) -> None:
        nonlocal aborted
        if not aborted and sched.counters["preemptions"]:
            sched.abort("c", ["r0", "r5"])  # while blocks are shared and some preempted
            aborted = True
        sched.blocks.check()

    drive(sched, FakeExecutor(BS, VOCAB), output, on_plan=abort_once_preempted)
    assert aborted and sched.counters["prefix_cache_hits"] > 0
    for rid in ("r0", "r5"):
        expected.pop(expected_ids[rid])
    assert {s: output.outputs[s] for s in expected} == expected
    assert sched.blocks.num_free == sched.blocks.num_blocks


@pytest.mark.parametrize("fails", [False, True])
def test_blocks_are_named_once_the_step_that_fills_them_ran(fails: bool) -> None:
    """A step's full blocks become reusable when its feedback says it ran, never when it
    failed (they were not written). Under async depth 1 the next plan is built before that
    feedback: it reused the blocks of a step that then failed, and another request got
    wrong tokens."""
    sched = make(True)
    a = add(sched, "a", list(range(10, 30)), max_tokens=3)
    first = sched.schedule()
    assert first is not None and sched.blocks.num_cached == 0
    b = add(sched, "b", list(range(10, 30)), max_tokens=3)
    second = sched.schedule()  # (depth 1: before step 1's feedback)
    assert second is not None and b in second.seq_ids.numpy().tolist()
    assert second.starts.numpy()[second.seq_ids.numpy().tolist().index(b)] == 0
    finished = ([a], ["error"]) if fails else ([], [])
    feedback = Feedback(first.step, Array.of([], "int64"), Array.of([]), *finished)
    sched.schedule([feedback])
    assert sched.blocks.num_cached == (0 if fails else 4)
    sched.blocks.check()


@pytest.mark.parametrize(
    "penalty",
    [{"frequency_penalty": 0.5}, {"presence_penalty": 0.5}, {"repetition_penalty": 1.2}],
)
def test_a_resumed_sequence_with_penalties_recomputes_its_outputs(penalty) -> None:
    """Penalties read the slot's token history, which only the tokens computed in it fill:
    a sequence preempted by recompute and resumed in a new slot recomputes its outputs, not
    reuses their cached blocks (with frequency or presence penalties it did, and penalised
    other tokens: greedy output changed with caching on)."""
    sched = make(True, num_blocks=12, max_num_seqs=3)
    output = FakeOutput(EOS)
    for i in range(3):
        add(sched, f"r{i}", list(range(10 + i, 18 + i)), max_tokens=24, ignore_eos=True, **penalty)
    resumed = []

    def on_step(sched: Scheduler, plan) -> None:
        slots = plan.slots.numpy().tolist()
        for start in plan.new_seqs:
            if sched.seqs[start.seq_id].num_outputs:
                resumed.append(plan.starts.numpy()[slots.index(start.slot)])

    run(sched, output, 0, on_step)
    assert resumed and all(start == 0 for start in resumed), resumed


def test_prompt_logprobs_requests_compute_their_prompt() -> None:
    sched = make(True)
    output = FakeOutput(EOS)
    add(sched, "a", list(range(10, 30)))
    run(sched, output, 0)
    add(sched, "b", list(range(10, 30)), prompt_logprobs=2)
    plan = sched.schedule()
    assert plan is not None and plan.starts.numpy().tolist() == [0]
    assert sched.counters["prefix_cache_hits"] == 0


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 20), st.integers(1, 10), st.integers(1, 2)),
        min_size=1,
        max_size=12,
    ),
    num_blocks=st.integers(20, 48),
    lag=st.sampled_from([0, 1]),
    seed=st.integers(0, 1000),
)
# A sample preempted before it was ever started once gave its slot (-1) to the free list,
# and a later sequence ran at slot -1.
@example(
    shapes=[
        (1, 17, 6, 1),
        (2, 0, 1, 1),
        (1, 0, 5, 2),
        (0, 0, 1, 2),
        (0, 0, 1, 1),
        (0, 0, 1, 2),
        (0, 0, 1, 2),
        (0, 0, 2, 1),
    ],
    num_blocks=20,
    lag=1,
    seed=0,
)
def test_property_shared_prefix_workloads_match_reference(shapes, num_blocks, lag, seed):
    """Random requests drawn from three prefixes (so blocks are reused, shared, evicted and
    preempted): every output equals the model-free reference."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(6, VOCAB) for _ in range(rng.randint(4, 24))] for _ in range(3)]
    sched = make(True, num_blocks=num_blocks, max_num_seqs=5, budget=12)
    output = FakeOutput(EOS)
    expected = {}
    for i, (family, tail, max_tokens, n) in enumerate(shapes):
        prompt = prefixes[family] + [rng.randrange(6, VOCAB) for _ in range(tail)]
        sched.add_request(
            AddRequest(f"r{i}", Array.of(prompt), SamplingParams(max_tokens=max_tokens, n=n)),
            "c",
        )
        for seq in sched.requests["c", f"r{i}"].seqs:
            expected[seq.seq_id] = reference_generate(prompt, seq.request.max_tokens, EOS, VOCAB)
    run(sched, output, lag)
    assert {s: output.outputs[s] for s in expected} == expected
    assert sched.blocks.num_free == sched.blocks.num_blocks


@pytest.mark.parametrize("lag", [0, 1])
def test_a_burst_sharing_a_prefix_computes_it_once(lag: int) -> None:
    """Requests admitted in the step that computes their shared prefix start after it (the
    step stores every sequence's keys and values before any reads them, as vLLM relies on
    too): a burst with a common system prompt computed it once per request admitted before
    the first step's feedback (17,728 prompt tokens for 2,848 in a 32-request burst)."""
    sched = make(True, budget=64, max_num_seqs=8)
    system = list(range(20, 44))  # 6 full blocks
    prompts = {f"r{i}": [*system, 50 + i, 60 + i, 70 + i] for i in range(6)}
    seq_ids = {rid: add(sched, rid, prompt, max_tokens=5) for rid, prompt in prompts.items()}
    plans = []
    output = FakeOutput(EOS)
    for seq_id in seq_ids.values():
        output.add(seq_id, 5)
    run(sched, output, lag, on_step=lambda sched, plan: plans.append(plan))
    assert plans[0].num_tokens.numpy().tolist() == [27, 3, 3, 3, 3, 3]
    assert sched.counters["prefix_cache_hits"] == 5 * 24
    for rid, prompt in prompts.items():
        assert output.outputs[seq_ids[rid]] == reference_generate(prompt, 5, EOS, VOCAB)
    assert sched.blocks.num_free == sched.blocks.num_blocks
