"""Beam bookkeeping with penalties far outside any useful range: a request's parameters
must never raise inside the output stage (an exception there stops the engine)."""

from __future__ import annotations

import numpy as np
import pytest

from mpengine.output.beams import BeamGroup
from mpengine.protocol import SamplingParams


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("length_penalty", [2000.0, 100.0, -2000.0, 0.0, 1.0])
def test_extreme_length_penalties_finish_without_errors(
    length_penalty: float, early_stopping: bool | str
) -> None:
    params = SamplingParams(
        n=2,
        use_beam_search=True,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        max_tokens=2000,
    )
    group = BeamGroup(params, max_tokens=12, stop_ids=frozenset({0}))
    rng = np.random.default_rng(0)
    k = group.num_candidates
    with np.errstate(all="raise"):  # no floating-point warning either
        for _ in range(12):
            for beam in range(group.width):
                ids = rng.permutation(50)[:k]  # token 0 (stop) now and then
                logprobs = np.sort(rng.uniform(-8, -0.1, k).astype(np.float32))[::-1]
                group.report(beam, ids, logprobs)
            group.step()
            if group.done:
                break
    best = group.best(2)
    assert len(best) == 2 and all(len(h.token_ids) >= 1 for h in best)


@pytest.mark.parametrize("early_stopping", [False, True])
def test_a_step_costs_what_the_beams_hold_not_max_tokens(early_stopping: bool) -> None:
    """The token arrays were ``[width, max_tokens]`` and copied whole every step: with the
    context left as ``max_tokens`` (131,072) a width-10 step took 35 ms. The history now
    grows with the beams, to the same hypotheses as a search whose arrays start at full
    size; a step writes one row of it."""
    params = SamplingParams(n=4, use_beam_search=True, early_stopping=early_stopping)
    rng = np.random.default_rng(1)
    steps = []
    for _ in range(150):
        k = params.beam_candidates(1)
        steps.append(
            [
                (rng.permutation(200)[:k], np.sort(rng.uniform(-6, -0.1, k))[::-1])
                for _ in range(params.num_samples)
            ]
        )

    def search(max_tokens: int, capacity: int | None = None) -> BeamGroup:
        group = BeamGroup(params, max_tokens=max_tokens, stop_ids=frozenset({0}))
        if capacity is not None:  # arrays at full size from the start, as before
            group.parents = np.zeros((capacity, group.width), np.int32)
            group.tokens = np.zeros((capacity, group.width), np.int32)
        for step in steps:
            for beam, (ids, logprobs) in enumerate(step):
                group.report(beam, ids, logprobs.astype(np.float32))
            group.step()
            if group.done:
                break
        return group

    grown, full = search(131_072), search(131_072, capacity=131_072)
    assert grown.length == full.length > 64  # (past the first doubling)
    assert grown.tokens.shape[0] <= 2 * grown.length
    assert [(h.token_ids.tolist(), h.score) for h in grown.best(4)] == [
        (h.token_ids.tolist(), h.score) for h in full.best(4)
    ]


def test_beams_read_back_through_their_parents_are_the_tokens_each_step_chose() -> None:
    """The history keeps only each step's parents and tokens: the running beams read back
    from it are the sequences the returned (parent, token) pairs build, at every step."""
    params = SamplingParams(n=6, use_beam_search=True, early_stopping="never")
    group = BeamGroup(params, max_tokens=300, stop_ids=frozenset({0, 1}))
    rng = np.random.default_rng(2)
    k = group.num_candidates
    sequences: list[list[int]] = [[] for _ in range(group.width)]
    for _ in range(299):
        for beam in range(group.width):
            ids = rng.permutation(40)[:k]
            group.report(beam, ids, np.sort(rng.uniform(-5, -0.1, k).astype(np.float32))[::-1])
        parents, tokens = group.step()
        sequences = [sequences[p] + [int(t)] for p, t in zip(parents, tokens, strict=True)]
        row = group.length - 1
        read = group.beam_tokens([row] * group.width, list(range(group.width)))
        assert [r.tolist() for r in read] == sequences
    best = group.best(group.width)
    assert all(h.token_ids.dtype == np.int32 and len(h.token_ids) >= 1 for h in best)
