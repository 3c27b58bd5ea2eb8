"""Pooling requests in the scheduler: prompts only, beside generation under one budget."""

from __future__ import annotations

import pytest

from mpengine.config import EngineConfig
from mpengine.protocol import (
    AddRequest,
    Array,
    Feedback,
    PoolingInfo,
    PoolingParams,
    SamplingParams,
)
from mpengine.scheduler import RequestRejected, Scheduler

VOCAB = 97
DECODER = PoolingInfo("last", True, hidden_size=32)
ENCODER = PoolingInfo("mean", True, hidden_size=32, is_encoder=True)


def make(pooling=DECODER, can_generate=True, budget=8, num_blocks=32, max_len=64):
    config = EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=budget)
    return Scheduler(config, num_blocks, VOCAB, max_len, pooling, can_generate)


def embed(sched, request_id, prompt, **params):
    sched.add_request(
        AddRequest(request_id, Array.of(prompt), pooling=PoolingParams(**params)), "c"
    )


def generate(sched, request_id, prompt, max_tokens=4):
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    sched.add_request(AddRequest(request_id, Array.of(prompt), params), "c")


def done(step):
    return Feedback(step, Array.of([], "int64"), Array.of([]))


def test_pooling_prompts_are_chunked_beside_generation_and_finish_when_planned():
    sched = make(budget=8)
    generate(sched, "g", list(range(10, 14)))
    embed(sched, "e", list(range(20, 30)))  # 10 tokens: chunks of 4, 8 -> 4 + 6
    plans = [sched.schedule()]
    assert plans[0].num_tokens.numpy().tolist() == [4, 4]  # the budget is shared
    assert plans[0].sample.numpy().tolist() == [True, False]
    plans.append(sched.schedule())
    # g decodes (1 token, the -1 in flight), e's last 6 tokens: it pools ("sample").
    assert plans[1].num_tokens.numpy().tolist() == [1, 6]
    assert plans[1].sample.numpy().tolist() == [True, True]
    assert plans[1].starts.numpy().tolist() == [4, 4]
    request = next(a for a in sched.take_announcements() if a.request_id == "e")
    assert request.pooling == PoolingParams("last", True) and request.sampling is None
    # Finished when planned; its blocks go back once that step's output is processed.
    assert sched.stats()["finished"] == 1 and ("c", "e") not in sched.requests
    held = sched.blocks.num_blocks - sched.blocks.num_free
    sched.apply_feedback(done(plans[1].step))
    assert sched.blocks.num_blocks - sched.blocks.num_free < held
    # The executor may forget its parameters after that very step.
    assert plans[1].released_requests.numpy().tolist() == [1]


def test_encoder_prompts_are_scheduled_whole_without_blocks():
    sched = make(pooling=ENCODER, can_generate=False, budget=12, num_blocks=0)
    for i, length in enumerate((5, 6, 7)):
        embed(sched, f"e{i}", list(range(10, 10 + length)))
    first = sched.schedule()
    assert first.num_tokens.numpy().tolist() == [5, 6]  # 7 more would pass the budget
    assert first.sample.numpy().all() and not len(first.block_ids)
    second = sched.schedule()
    assert second.num_tokens.numpy().tolist() == [7]
    assert sched.schedule() is None and not sched.has_unfinished
    with pytest.raises(RequestRejected, match="in one step"):
        embed(sched, "long", list(range(10, 23)))  # 13 tokens > the 12-token budget


@pytest.mark.parametrize(("pooling", "hits"), [("last", 8), ("mean", 0)])
def test_only_last_token_pooling_reuses_cached_prefixes(pooling, hits):
    sched = make(budget=64)
    prompt = list(range(10, 21))  # 11 tokens: 2 full blocks of 4
    embed(sched, "a", prompt, pooling=pooling)
    plan = sched.schedule()
    sched.apply_feedback(done(plan.step))
    embed(sched, "b", prompt, pooling=pooling)
    sched.schedule()
    assert sched.stats()["prefix_cache_hits"] == hits


@pytest.mark.parametrize(
    ("kwargs", "prompt", "params", "match"),
    [
        ({"pooling": None}, [10, 11], {}, "cannot embed"),
        ({}, [10, 11], {"dimensions": 33}, "exceeds the model's embedding size"),
        ({}, [10, 11], {"pooling": "cls"}, "needs an encoder"),
        ({}, list(range(10, 80)), {}, "at most 64"),
        ({}, [], {}, "empty"),
        ({}, [10, VOCAB], {}, "outside the vocabulary"),
    ],
)
def test_bad_pooling_requests_are_rejected(kwargs, prompt, params, match):
    sched = make(**kwargs)
    with pytest.raises(RequestRejected, match=match):
        embed(sched, "x", prompt, **params)


def test_truncation_and_resolved_defaults():
    sched = make(pooling=ENCODER, can_generate=False, num_blocks=0, budget=64)
    embed(sched, "t", list(range(10, 90)), truncate_prompt_tokens=-1)  # 80 -> 64
    embed(sched, "u", list(range(10, 90)), truncate_prompt_tokens=5, normalize=False)
    assert [r.num_prompt_tokens for r in sched.requests.values()] == [64, 5]
    assert [r.pooling for r in sched.requests.values()] == [
        PoolingParams("mean", True),
        PoolingParams("mean", False),
    ]
    with pytest.raises(RequestRejected, match="only embeds"):
        generate(sched, "g", [10, 11])
