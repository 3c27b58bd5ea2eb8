"""Which data-parallel replica runs a request (``Router``), as vLLM's and SGLang's front
ends choose between their engines.

- ``least_outstanding`` (the default): the serving replica with the fewest of this client's
  requests in flight; ties go round the replicas in turn.
- ``prefix_affinity`` (SGLang's cache-aware router, with the engine's own hashes): the
  prompt's first full blocks are hashed as the scheduler hashes them for its prefix cache
  (``prefix_hash.chain_hashes``), and a table remembers which replica ran each hash last.
  The replica that ran the longest prefix of the prompt gets it when that prefix is at
  least ``MIN_MATCH`` of the prompt's hashed blocks, and when the load is even: uneven
  (max - min above ``MAX_SPREAD`` and max above ``MAX_RATIO`` times min, SGLang's
  thresholds), or that replica's load above ``MAX_RATIO`` times the mean plus
  ``LOAD_SLACK`` (bounded load: a popular prefix does not pile onto one replica), the
  request goes to the least loaded replica instead.

A replica out of rotation (its stage died, unreachable) has load ``None`` and is never
chosen.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

from mpengine.prefix_hash import BlockHash, chain_hashes

Policy = Literal["least_outstanding", "prefix_affinity"]
POLICIES: tuple[Policy, ...] = ("least_outstanding", "prefix_affinity")

AFFINITY_BLOCKS = 32  # the prompt's first blocks hashed (a prefix longer than this is rare)
TABLE_SIZE = 1 << 16  # hashes remembered, least recently used dropped first
MIN_MATCH = 0.3  # of the prompt's hashed blocks, to follow a prefix (SGLang's threshold)
MAX_SPREAD = 64  # requests between the most and least loaded replica: uneven beyond ...
MAX_RATIO = 1.5  # ... and this ratio (SGLang's balance thresholds)
LOAD_SLACK = 4  # requests a prefix's replica may hold above its bound share


class Router:
    """Chooses a replica for each request from the replicas' loads (requests in flight,
    ``None`` for a replica out of rotation) and, with ``prefix_affinity``, the prompt."""

    def __init__(
        self,
        policy: Policy,
        block_size: int,
        *,
        max_spread: int = MAX_SPREAD,
        max_ratio: float = MAX_RATIO,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy {policy!r}: one of {', '.join(POLICIES)}")
        self.policy = policy
        self.block_size = block_size
        self.max_spread = max_spread
        self.max_ratio = max_ratio
        self._owner: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> replica
        self._turn = itertools.count()

    def choose(self, prompt: Sequence[int], loads: Sequence[int | None]) -> int:
        """The replica for a request of ``prompt``; ``ValueError`` when none serves."""
        serving = [i for i, load in enumerate(loads) if load is not None]
        if not serving:
            raise ValueError("no replica is serving")
        if self.policy == "least_outstanding":
            return self._least_loaded(serving, loads)
        hashes = chain_hashes(prompt[: AFFINITY_BLOCKS * self.block_size], self.block_size)
        chosen = self._affine(hashes, serving, loads)
        if chosen is None:
            chosen = self._least_loaded(serving, loads)
        for block_hash in hashes:  # this replica now holds the prompt's prefix
            self._owner[block_hash] = chosen
            self._owner.move_to_end(block_hash)
        while len(self._owner) > TABLE_SIZE:
            self._owner.popitem(last=False)
        return chosen

    def _least_loaded(self, serving: list[int], loads: Sequence[int | None]) -> int:
        least = min(loads[i] for i in serving)  # type: ignore[type-var]
        tied = [i for i in serving if loads[i] == least]
        return tied[next(self._turn) % len(tied)]

    def _affine(
        self, hashes: list[BlockHash], serving: list[int], loads: Sequence[int | None]
    ) -> int | None:
        """The serving replica that ran the longest prefix of the prompt, if it matched
        enough of it and taking one more keeps the load even; else None."""
        for matched in range(len(hashes), 0, -1):
            owner = self._owner.get(hashes[matched - 1])
            if owner is not None and owner in serving:
                break
        else:
            return None
        if matched < MIN_MATCH * len(hashes):
            return None
        counts = [loads[i] for i in serving]
        most, least = max(counts), min(counts)  # type: ignore[type-var]
        if most - least > self.max_spread and most > self.max_ratio * least:
            return None  # uneven: the shortest queue first
        mean = sum(counts) / len(counts)  # type: ignore[arg-type]
        if loads[owner] > self.max_ratio * mean + LOAD_SLACK:  # type: ignore[operator]
            return None
        return owner
