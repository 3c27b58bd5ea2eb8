"""Fair shares through the client library: tenants named by ``tenant=``; one that holds
every seat gives way to another's small request, and its own streams still carry the
tokens of an undisturbed run."""

from __future__ import annotations

import time

import pytest

import mpengine
from mpengine import SamplingParams

TIMEOUT_S = 60.0


def test_a_tenant_holding_every_seat_gives_way_and_loses_nothing(start_engine) -> None:
    engine = start_engine(model="tiny", max_num_seqs=4, log_level="WARNING")
    with engine.client() as client:
        prompt = [11, 12, 13, 14]
        wide = SamplingParams(n=4, max_tokens=300, temperature=0.0, ignore_eos=True)
        undisturbed = client.generate(prompt, wide, timeout=TIMEOUT_S)
        hog = client.stream(prompt, wide, tenant="hog", timeout=TIMEOUT_S)
        first = next(hog)  # it runs: its four samples take every seat
        deadline = time.monotonic() + TIMEOUT_S
        while client.stats().num_running < 4:
            assert time.monotonic() < deadline, "the wide request never took every seat"
        small = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        out = client.generate([21, 22, 23], small, tenant="guest", timeout=TIMEOUT_S)
        assert len(out.outputs[0].token_ids) == 4
        stats = client.stats()
        assert stats.fair_preemptions >= 1
        assert stats.num_running + stats.num_preempted == 4, stats  # the hog goes on
        tokens: dict[int, list[int]] = {}
        for delta in [first, *hog]:
            for sample in delta.outputs:
                tokens.setdefault(sample.index, []).extend(sample.token_ids)
        want = {sample.index: list(sample.token_ids) for sample in undisturbed.outputs}
        assert tokens == want  # the preempted samples recomputed, their streams seamless


def test_a_tenant_name_is_bounded(start_engine) -> None:
    engine = start_engine(model="tiny", log_level="WARNING")
    with engine.client() as client:
        params = SamplingParams(max_tokens=2)
        with pytest.raises(mpengine.InvalidRequestError, match="tenant: at most 256 characters"):
            client.generate([5, 6], params, tenant="x" * 300, timeout=TIMEOUT_S)
        assert client.generate([5, 6], params, tenant="t" * 256, timeout=TIMEOUT_S).finished
