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
