"""The scheduler's view of requests and their sequences (one sequence per sample)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from mpengine.protocol import PoolingParams, SamplingParams

# Whose share of the engine a request uses: (client id, the tenant it names; "" for itself).
Tenant = tuple[str, str]


class Status(enum.Enum):
    WAITING = "waiting"  # never scheduled
    RUNNING = "running"  # holds a slot and blocks
    PREEMPTED = "preempted"  # blocks dropped (recompute) or in host memory (swapped)
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample of a request, caught up step by step.

    ``token_ids`` are the known tokens (prompt, then the outputs feedback has confirmed).
    ``num_inflight`` samples are planned but not fed back yet: the executor holds the newest
    one in the slot. A sequence's length is ``len(token_ids) + num_inflight``; each step
    computes tokens ``num_computed ..`` towards it, and samples when it reaches the end.
    """

    seq_id: int
    request: Request
    sample_index: int
    token_ids: list[int]
    status: Status = Status.WAITING
    num_computed: int = 0
    num_inflight: int = 0
    slot: int = -1
    block_ids: list[int] = field(default_factory=list)
    last_step: int = 0  # the last step that touched its slot and blocks
    prompt_step: int = 0  # the step that computed its prompt's last token
    fork_parent: Sequence | None = None  # share the parent's prompt blocks when it has them
    # Prefix cache: the hash chain of its full blocks of known tokens (kept across
    # preemption: it depends on the tokens only), and how many of ``block_ids`` are in it.
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered: int = 0
    # Swapped out: the host blocks holding its KV (``num_computed`` is kept).
    host_block_ids: list[int] = field(default_factory=list)
    # Ranked at the end (best_of > n): the sum of its tokens' logprobs, as fed back.
    cumulative_logprob: float = 0.0

    def __post_init__(self) -> None:
        assert 0 <= self.num_computed <= len(self) and self.num_inflight >= 0

    def __len__(self) -> int:
        return len(self.token_ids) + self.num_inflight

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def num_outputs(self) -> int:
        """Outputs sampled so far, confirmed or in flight."""
        return len(self) - self.request.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def scores_prompt(self) -> bool:
        """Whether computing its prompt yields prompt logprobs (sample 0, first prefill;
        see ``Scheduler._start``)."""
        return (
            self.request.wants_prompt_logprobs
            and self.sample_index == 0
            and self.num_outputs == 0
            and self.num_computed < self.num_prompt_tokens - 1
        )

    def wants_tokens(self) -> bool:
        """Whether a step could compute something for it now."""
        if self.request.pooling is not None:
            return self.num_computed < len(self)  # a prompt, computed to its last token
        if self.num_inflight and self.request.beam_search:
            return False  # a beam's next token comes from the beam step, not its sample
        if self.num_computed < len(self) - 1:
            return True  # prompt or recompute left
        return self.num_computed == len(self) - 1 and self.num_outputs < self.request.max_tokens


@dataclass(slots=True, eq=False)
class Request:
    """A client's request. ``request_id`` is the client's name for it (unique per client);
    ``key`` is the engine's (unique per engine, names its parameters in the executor)."""

    key: int
    request_id: str
    client_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams | None
    pooling: PoolingParams | None
    arrival_time: float
    max_tokens: int  # capped so prompt + outputs fit max_model_len
    priority: int = 0  # lower first (the priority scheduling policy)
    tenant: Tenant = ("", "")  # (client_id, the tenant it names)
    seqs: list[Sequence] = field(default_factory=list)
    announced: bool = False
    scheduled_time: float = 0.0  # when it was announced (first scheduled)
    params_sent: bool = False  # the executor holds its RequestParams

    @property
    def beam_search(self) -> bool:
        return self.sampling is not None and self.sampling.use_beam_search

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling is not None and self.sampling.prompt_logprobs is not None

    @property
    def penalises_prompt(self) -> bool:
        """A repetition penalty counts prompt tokens: the executor needs them all, also those
        a sequence never computes in its own slot (cached or shared blocks)."""
        return self.sampling is not None and self.sampling.repetition_penalty != 1.0

    @property
    def sends_prompt(self) -> bool:
        """Whether the executor gets the prompt's token ids with the request's parameters."""
        return self.wants_prompt_logprobs or self.penalises_prompt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.seqs)


def urgency(seq: Sequence) -> tuple[int, int, int]:
    """Higher for a sequence that gives way first: lower priority (a higher number), then
    later arrival (the request key counts arrivals), then a later sample."""
    return seq.request.priority, seq.request.key, seq.sample_index
