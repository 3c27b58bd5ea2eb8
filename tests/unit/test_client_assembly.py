"""How the client assembles an embedding request's final delta."""

from __future__ import annotations

import numpy as np
import pytest

from mpengine.client import _Assembly
from mpengine.errors import RequestFailedError
from mpengine.protocol import EMPTY_IDS, AddRequest, Array, OutputDelta, PoolingParams


def request(ids: list[int]) -> AddRequest:
    return AddRequest("r", Array.of(ids), pooling=PoolingParams())


def test_the_embedding_and_the_tokens_the_engine_pooled():
    assembly = _Assembly(request([5, 6, 7, 8]))
    vector = Array.of(np.array([0.6, 0.8]), "float32")
    # The engine truncated the prompt to 3 tokens (truncate_prompt_tokens).
    delta = OutputDelta("r", 0, EMPTY_IDS, "", "stop", embedding=vector, num_prompt_tokens=3)
    assert assembly.add(delta).finished
    out = assembly.embedding_output()
    assert out.prompt_token_ids == [5, 6, 7] and out.num_prompt_tokens == 3
    np.testing.assert_array_equal(out.embedding, np.array([0.6, 0.8], np.float32))
    out.embedding[0] = 0.0  # a copy the caller owns, not a view of the frame


def test_a_request_that_ends_without_its_embedding_raises():
    assembly = _Assembly(request([5, 6]))
    assembly.add(OutputDelta("r", 0, EMPTY_IDS, "", "error", error="step 3 failed"))
    with pytest.raises(RequestFailedError, match="step 3 failed"):
        assembly.embedding_output()
