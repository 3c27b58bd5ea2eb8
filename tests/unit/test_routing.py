"""Which replica of a data-parallel engine runs a request: each routing policy, replicas
out of rotation, and the engine's stats summed over its replicas."""

from __future__ import annotations

import pytest

from mpengine.client.replicas import addresses_of, check_rank, combined_stats
from mpengine.client.routing import Router
from mpengine.errors import InvalidRequestError
from mpengine.protocol import EngineStats, StageTimes

BLOCK = 4


def prompt(prefix: int, length: int = 32, tail: int = 0) -> list[int]:
    """``length`` tokens, the same for a ``prefix``, differing in the last ``tail``."""
    return [prefix * 1000 + i for i in range(length - tail)] + [7000 + i for i in range(tail)]


def test_least_outstanding_takes_the_least_loaded_and_turns_between_ties() -> None:
    router = Router("least_outstanding", BLOCK)
    assert router.choose(prompt(1), [3, 1, 2]) == 1
    assert {router.choose(prompt(1), [0, 0, 5]) for _ in range(4)} == {0, 1}
    assert router.choose(prompt(1), [None, 4, 2]) == 2  # out of rotation: never
    with pytest.raises(ValueError, match="no replica is serving"):
        router.choose(prompt(1), [None, None])


def test_prefix_affinity_follows_the_prompt_s_first_blocks() -> None:
    router = Router("prefix_affinity", BLOCK)
    first = router.choose(prompt(1), [0, 0])
    other = router.choose(prompt(2), [1 if first == 0 else 0, 1 if first == 1 else 0])
    assert other != first  # a new prefix: the least loaded
    loads = [2, 2]
    for tail in range(1, 4):  # same first blocks, other ends: where the prefix ran
        assert router.choose(prompt(1, tail=tail * 4), loads) == first
        assert router.choose(prompt(2, tail=tail * 4), loads) == other
    # A prompt sharing less than MIN_MATCH of its hashed blocks goes by load.
    shared = prompt(1, length=8) + prompt(9, length=40)
    loads = [0, 0]
    loads[first] = 3
    assert router.choose(shared, loads) == 1 - first


def test_prefix_affinity_falls_back_when_the_load_is_uneven_or_its_replica_is_gone() -> None:
    router = Router("prefix_affinity", BLOCK, max_spread=8)
    owner = router.choose(prompt(1), [0, 0])
    idle = 1 - owner
    loads = [0, 0]
    loads[owner], loads[idle] = 30, 21  # spread 9 > 8 but 30 < 1.5 x 21: even enough
    assert router.choose(prompt(1), loads) == owner
    loads[owner], loads[idle] = 20, 2  # spread and ratio both past: the shortest queue
    assert router.choose(prompt(1, tail=4), loads) == idle
    # Bounded load: even when not "uneven", a replica far above the mean is passed over.
    bounded = Router("prefix_affinity", BLOCK)
    owner = bounded.choose(prompt(3), [0, 0, 0])
    loads = [0, 0, 0]
    loads[owner] = 9  # mean 3: the bound is 1.5 x 3 + 4
    assert bounded.choose(prompt(3), loads) != owner
    gone = [0, 0, 0]
    gone[owner] = None  # type: ignore[call-overload]
    assert bounded.choose(prompt(3), gone) != owner


def test_a_short_prompt_without_a_full_block_goes_by_load() -> None:
    router = Router("prefix_affinity", BLOCK)
    assert router.choose([1, 2], [5, 1]) == 1
    with pytest.raises(ValueError, match="routing policy"):
        Router("random", BLOCK)  # type: ignore[arg-type]


def test_the_engine_s_stats_are_its_replicas_summed() -> None:
    def stats(running: int, done: int, stage_busy: float) -> EngineStats:
        fields = dict.fromkeys(EngineStats.__struct_fields__, 0)
        fields.update(query_id=5, num_running=running, step=done, done=done, num_blocks=100)
        fields.update(step_tokens=[1, 2, 3], stages={"executor": StageTimes(busy=stage_busy)})
        return EngineStats(**fields)

    whole = combined_stats([stats(2, 10, 1.0), stats(3, 20, 2.0)], query_id=9)
    assert whole.query_id == 9 and whole.num_running == 5 and whole.num_blocks == 200
    assert whole.done == whole.step == 30 and whole.step_tokens == [2, 4, 6]
    assert {k: v.busy for k, v in whole.stages.items()} == {
        "executor dp0": 1.0,
        "executor dp1": 2.0,
    }


def test_addresses_and_ranks() -> None:
    assert addresses_of("ipc:///a, ipc:///b") == ["ipc:///a", "ipc:///b"]
    assert addresses_of(["tcp://h:1"]) == ["tcp://h:1"]
    with pytest.raises(ValueError):
        addresses_of(" , ")
    check_rank(1, 2)
    for bad in (2, -1, True, "1"):
        with pytest.raises(InvalidRequestError, match="data_parallel_rank"):
            check_rank(bad, 2)
