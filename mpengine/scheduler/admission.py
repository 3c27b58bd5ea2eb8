"""Admission checks: what a request may ask of this engine, decided from the request, the
model and the config alone (no scheduler state but the queue's size, passed in); then the
request as the scheduler queues it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import numpy as np

from mpengine.config import EngineConfig
from mpengine.limits import FrameLimits
from mpengine.protocol import (
    MAX_BEAM_CANDIDATES,
    AddRequest,
    PoolingInfo,
    PoolingParams,
    SamplingParams,
)
from mpengine.scheduler.beams import beam_stop_ids
from mpengine.scheduler.request import Request, Sequence
from mpengine.scheduler.waiting import WaitingQueue
from mpengine.structured import grammars


class RequestRejected(ValueError):
    """A request the engine cannot serve; the message goes back to its client."""

    def __init__(self, message: str, kind: str = "invalid") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class CheckedRequest:
    """A request that passed the checks: its prompt (truncated where it asked to be),
    parameters with the engine's defaults resolved, and ``max_tokens`` capped so prompt and
    outputs fit ``max_model_len`` (0 for pooling)."""

    prompt: np.ndarray
    sampling: SamplingParams | None
    pooling: PoolingParams | None
    max_tokens: int

    def make_request(
        self, key: int, client_id: str, req: AddRequest, seq_ids: Iterator[int]
    ) -> Request:
        """The request to queue, and its sequences: one per sample, numbered from
        ``seq_ids`` (the others fork from the first)."""
        request = Request(
            key=key,
            request_id=req.request_id,
            client_id=client_id,
            prompt_token_ids=self.prompt.tolist(),
            sampling=self.sampling,
            pooling=self.pooling,
            arrival_time=req.arrival_time or time.time(),
            max_tokens=self.max_tokens,
            priority=req.priority,
            tenant=(client_id, req.tenant),
        )
        num_samples = 1 if self.sampling is None else self.sampling.num_samples
        for index in range(num_samples):
            request.seqs.append(
                Sequence(next(seq_ids), request, index, list(request.prompt_token_ids))
            )
        for child in request.seqs[1:]:
            child.fork_parent = request.seqs[0]
        return request


@dataclass(frozen=True, slots=True)
class AdmissionRules:
    """What this engine can serve: the model's vocabulary, length, pooling and heads, the
    KV cache's size, and the config's bounds."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting_requests: int
    max_waiting_tokens: int
    max_beam_candidates: int
    num_blocks: int
    block_size: int
    by_priority: bool
    can_generate: bool
    pooling: PoolingInfo | None  # None: the model cannot embed
    eos_token_ids: tuple[int, ...]

    @classmethod
    def derive(
        cls,
        config: EngineConfig,
        limits: FrameLimits,
        num_blocks: int,
        *,
        vocab_size: int,
        max_model_len: int,
        pooling: PoolingInfo | None,
        can_generate: bool,
        eos_token_ids: list[int] | None,
    ) -> AdmissionRules:
        """The rules of an engine with ``config`` serving a model (the rest)."""
        return cls(
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_waiting_requests=config.max_waiting_requests,
            max_waiting_tokens=config.max_waiting_tokens,
            max_beam_candidates=limits.max_beam_candidates,
            num_blocks=num_blocks,
            block_size=config.block_size,
            by_priority=config.scheduling_policy == "priority",
            can_generate=can_generate,
            pooling=pooling,
            eos_token_ids=tuple(eos_token_ids or ()),
        )

    @property
    def encoder(self) -> bool:
        """An encoder model: whole prompts in one step each, no KV cache."""
        return self.pooling is not None and self.pooling.is_encoder

    def check(self, req: AddRequest) -> CheckedRequest:
        """Reject what this engine cannot serve (sizes the protocol bounds are checked
        already); return the request as the scheduler queues it."""
        if req.priority and not self.by_priority:
            raise RequestRejected(
                f"priority: {req.priority} given, but the engine schedules first come, first "
                "served (start it with --scheduling-policy priority)"
            )
        prompt = req.prompt_token_ids.numpy()
        if req.pooling is not None:
            pooling, prompt = self.check_pooling(prompt, req.pooling)
            return CheckedRequest(prompt, None, pooling, 0)
        sampling = req.sampling
        assert sampling is not None
        prompt = sampling.truncated(prompt, self.max_model_len)
        if sampling.use_beam_search and sampling.num_samples == 1:
            # One beam is greedy search (as transformers' generate(num_beams=1) is).
            sampling = msgspec.structs.replace(
                sampling, use_beam_search=False, beam_width=None, temperature=0.0
            )
        return CheckedRequest(prompt, sampling, None, self.check_sampling(prompt, sampling))

    def check_room(self, queue: WaitingQueue, request: Request, continues: bool) -> None:
        """Reject ``request`` while the queue is full. The bounds count sequences (each
        sample or beam: ``max_waiting_requests``) and prompt tokens (``max_waiting_tokens``),
        of all tenants and of ``request``'s own, which may take half of each: one tenant
        alone cannot fill the queue for the others. A request always fits an empty queue."""
        # The bounds stop new work. A batch call already under way keeps at most a quarter
        # of each in flight (its client's window; of sequences, a step's worth where that
        # is more) and may go on up to twice them: several batch calls together failed
        # part-way, their finished work thrown away.
        slack = 2 if continues else 1
        for (seqs, tokens), share, whose in (
            ((queue.num_seqs, queue.num_tokens), 1, ""),
            (queue.load(request.tenant), 2, " of this tenant (at most half the queue)"),
        ):
            most = max(1, slack * self.max_waiting_requests // share)
            if seqs and seqs + len(request.seqs) > most:
                raise RequestRejected(
                    f"overloaded: {seqs} sequences{whose} are waiting "
                    f"(max_waiting_requests={self.max_waiting_requests}, counting each "
                    "sample); retry later",
                    "overloaded",
                )
            most = max(1, slack * self.max_waiting_tokens // share)
            if seqs and tokens + request.num_prompt_tokens > most:
                raise RequestRejected(
                    f"overloaded: {tokens} prompt tokens{whose} are waiting "
                    f"(max_waiting_tokens={self.max_waiting_tokens}); retry later",
                    "overloaded",
                )

    def check_tokens(self, prompt: np.ndarray) -> None:
        if len(prompt) == 0:
            raise RequestRejected("the prompt is empty")
        low, high = int(prompt.min()), int(prompt.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise RequestRejected(
                f"prompt_token_ids: token id {bad} is outside the vocabulary "
                f"(0..{self.vocab_size - 1})"
            )

    def check_pooling(
        self, prompt: np.ndarray, params: PoolingParams
    ) -> tuple[PoolingParams, np.ndarray]:
        """Reject an embedding request this engine cannot serve; return its parameters with
        the model's defaults filled in, and its prompt (truncated when it asks to be)."""
        model = self.pooling
        if model is None:
            raise RequestRejected(
                "this model cannot embed: it declares no pooling (no sentence-transformers "
                "modules.json); start the engine with --pooling last|mean|cls to embed with it"
            )
        limit = params.truncate_prompt_tokens
        if limit is not None:
            limit = self.max_model_len if limit == -1 else min(limit, self.max_model_len)
            prompt = prompt[:limit]
        self.check_tokens(prompt)
        if len(prompt) > self.max_model_len:
            raise RequestRejected(
                f"the input has {len(prompt)} tokens; this model takes at most "
                f"{self.max_model_len} (truncate_prompt_tokens=-1 truncates it)"
            )
        if self.encoder and len(prompt) > self.max_num_batched_tokens:
            raise RequestRejected(
                f"the input has {len(prompt)} tokens; an encoder computes a prompt in one "
                f"step and max_num_batched_tokens is {self.max_num_batched_tokens}",
                "too_large",
            )
        if params.dimensions is not None and params.dimensions > model.hidden_size:
            raise RequestRejected(
                f"pooling.dimensions ({params.dimensions}) exceeds the model's embedding size "
                f"({model.hidden_size})"
            )
        pooling = params.pooling or model.pooling
        if pooling == "cls" and not model.is_encoder:
            raise RequestRejected(
                "pooling.pooling 'cls' needs an encoder model: the first token of a causal "
                "model attends to nothing but itself (use 'last' or 'mean')"
            )
        if not self.encoder:
            self._check_cache(len(prompt))
        normalize = model.normalize if params.normalize is None else params.normalize
        return PoolingParams(pooling, normalize, params.dimensions), prompt

    def check_sampling(self, prompt: np.ndarray, sampling: SamplingParams) -> int:
        """Reject a generation request this engine cannot serve; return its ``max_tokens``
        capped so prompt and outputs fit ``max_model_len``."""
        if not self.can_generate:
            raise RequestRejected(
                "this model only embeds (it has no language-model head): send embedding requests"
            )
        if len(prompt) >= self.max_model_len:
            raise RequestRejected(
                f"the prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len} "
                "and at least one must be left to generate"
            )
        self.check_tokens(prompt)
        for name, token_ids in (
            ("stop_token_ids", sampling.stop_token_ids),
            ("logit_bias", sampling.logit_bias or ()),
        ):
            for token_id in token_ids:
                if token_id >= self.vocab_size:
                    raise RequestRejected(
                        f"sampling.{name}: token id {token_id} is outside the vocabulary "
                        f"(0..{self.vocab_size - 1})"
                    )
        if sampling.use_beam_search:
            self._check_beams(sampling)
        if sampling.structured_outputs is not None:
            try:
                grammars.check(sampling.structured_outputs)
            except grammars.InvalidGrammar as exc:
                raise RequestRejected(str(exc)) from None
        if sampling.num_samples > self.max_num_seqs:
            if sampling.use_beam_search:
                field = "beam_width" if sampling.beam_width else "n"
            else:
                field = "best_of" if sampling.best_of else "n"
            raise RequestRejected(
                f"sampling.{field}={sampling.num_samples} exceeds max_num_seqs={self.max_num_seqs}"
            )
        max_tokens = min(sampling.max_tokens, self.max_model_len - len(prompt))
        if sampling.min_tokens > max_tokens:
            raise RequestRejected(
                f"sampling.min_tokens ({sampling.min_tokens}) exceeds max_tokens: at most "
                f"{max_tokens} tokens fit after the {len(prompt)}-token prompt "
                f"(max_model_len={self.max_model_len})"
            )
        # (the last token is sampled, never computed: its keys and values take no slot)
        self._check_cache(len(prompt) + max_tokens - 1)
        return max_tokens

    def _check_beams(self, sampling: SamplingParams) -> None:
        """Reject a beam search whose continuations would not fit a step's result."""
        num_stops = len(beam_stop_ids(sampling, self.eos_token_ids))
        num_candidates = sampling.beam_candidates(num_stops)
        limit = min(self.max_beam_candidates, self.vocab_size)
        if num_candidates > limit:
            width = sampling.num_samples
            per_beam = num_candidates // width
            bound = " (ring_bytes bounds it)" if limit < MAX_BEAM_CANDIDATES else ""
            raise RequestRejected(
                f"sampling.beam_width: {width} beams weigh {num_candidates} continuations "
                f"a step, at most {limit}{bound}: {per_beam} per beam, one more than the "
                f"{num_stops} tokens that end a beam (EOS and stop_token_ids), at least "
                f"2. At most {limit // per_beam} beams with these, or fewer stop_token_ids"
            )

    def _check_cache(self, num_tokens: int) -> None:
        """Reject a sequence of ``num_tokens`` computed tokens the whole KV cache cannot hold."""
        if -(-num_tokens // self.block_size) > self.num_blocks:
            raise RequestRejected(
                f"the KV cache ({self.num_blocks} blocks) cannot hold this request",
                "too_large",
            )
