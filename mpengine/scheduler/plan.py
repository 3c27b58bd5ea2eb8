"""The messages the scheduler sends, built from its decisions without changing any state:
the step plan (to the executor), a request's parameters (with the plan that first starts
it), and the announcements (to the output processor)."""

from __future__ import annotations

import time
from collections.abc import Iterable

import msgspec
import numpy as np

from mpengine.limits import ABORT_CHUNK_BYTES
from mpengine.protocol import (
    PROMPT_TAIL_TOKENS,
    AbortRequests,
    Array,
    FinishReason,
    NewRequest,
    RequestParams,
    StepPlan,
)
from mpengine.scheduler.beams import beam_candidates
from mpengine.scheduler.request import Request, Sequence
from mpengine.scheduler.step import StepBatch


def build_plan(batch: StepBatch) -> StepPlan:
    """The plan of ``batch``, read from its sequences as they stand before it runs: each
    chunk computes tokens ``num_computed ..``, and samples (or pools) when it reaches the
    sequence's end (a generation only while outputs are left to sample)."""
    num_seqs = len(batch.chunks)
    seq_ids = np.empty(num_seqs, np.int64)
    slots = np.empty(num_seqs, np.int32)
    starts = np.empty(num_seqs, np.int32)
    num_tokens = np.empty(num_seqs, np.int32)
    sample = np.zeros(num_seqs, np.bool_)
    token_ids: list[int] = []
    for i, (seq, num) in enumerate(batch.chunks):
        start, end = seq.num_computed, seq.num_computed + num
        seq_ids[i], slots[i], starts[i], num_tokens[i] = seq.seq_id, seq.slot, start, num
        known = seq.token_ids[start:end]
        token_ids += known
        if len(known) < num:  # the in-flight sample, held by the executor
            assert len(known) == num - 1 and seq.num_inflight > 0
            token_ids.append(-1)
        if end == len(seq):
            pools = seq.request.pooling is not None
            sample[i] = pools or seq.num_outputs < seq.request.max_tokens
    if batch.block_deltas:
        delta = np.asarray(batch.block_deltas, np.int32)
        block_slots, block_indices, block_ids = (Array.of(delta[:, k]) for k in range(3))
    else:
        block_slots = block_indices = block_ids = Array.of([])
    return StepPlan(
        step=batch.step,
        starts=Array.of(starts),
        token_ids=Array.of(token_ids),
        slots=Array.of(slots),
        num_tokens=Array.of(num_tokens),
        sample=Array.of(sample, "bool"),
        seq_ids=Array.of(seq_ids, "int64"),
        new_seqs=batch.starts,
        block_slots=block_slots,
        block_indices=block_indices,
        block_ids=block_ids,
        new_requests=batch.new_requests,
    )


def request_params(request: Request, eos_token_ids: Iterable[int]) -> RequestParams:
    """What the executor keeps of ``request`` (see ``RequestParams``)."""
    sampling = request.sampling
    if sampling is not None:
        beams = sampling.use_beam_search
        sampling = sampling.for_beam_executor() if beams else sampling.for_executor()
    return RequestParams(
        key=request.key,
        num_prompt_tokens=request.num_prompt_tokens,
        sampling=sampling,
        pooling=request.pooling,
        prompt_token_ids=Array.of(request.prompt_token_ids) if request.sends_prompt else None,
        beam_candidates=beam_candidates(request.sampling, eos_token_ids),
    )


def new_request(
    request: Request, scheduled_time: float | None = None, seqs: list[Sequence] | None = None
) -> NewRequest:
    """The announcement of ``request``, scheduled now (or at ``scheduled_time``), of its
    sequences (or ``seqs``: a finished request has let go of its own)."""
    sampling = request.sampling
    prompt_ids = tail = None
    if request.wants_prompt_logprobs:
        prompt_ids = Array.of(request.prompt_token_ids)
    if sampling is not None:
        tail = Array.of(request.prompt_token_ids[-PROMPT_TAIL_TOKENS:])
    if sampling is not None and sampling.max_tokens != request.max_tokens:
        sampling = msgspec.structs.replace(sampling, max_tokens=request.max_tokens)
    return NewRequest(
        request_id=request.request_id,
        client_id=request.client_id,
        seq_ids=[seq.seq_id for seq in (request.seqs if seqs is None else seqs)],
        num_prompt_tokens=request.num_prompt_tokens,
        sampling=sampling,
        pooling=request.pooling,
        arrival_time=request.arrival_time,
        scheduled_time=time.time() if scheduled_time is None else scheduled_time,
        prompt_token_ids=prompt_ids,
        prompt_tail=tail,
    )


def aborted_requests(
    client_id: str, request_ids: list[str], reason: FinishReason = "abort", message: str = ""
) -> list[AbortRequests]:
    """The announcements of a client's aborted requests, in frames of bounded size (a
    client may abort thousands of long ids at once); ``reason``: their finish reason."""
    frames: list[AbortRequests] = []
    chunk: list[str] = []
    size = 0
    for request_id in request_ids:
        if chunk and size + len(request_id) * 4 > ABORT_CHUNK_BYTES:
            frames.append(AbortRequests(client_id, chunk, reason, message))
            chunk, size = [], 0
        chunk.append(request_id)
        size += len(request_id) * 4 + 3
    if chunk:
        frames.append(AbortRequests(client_id, chunk, reason, message))
    return frames
