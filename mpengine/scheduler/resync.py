"""What a restarted output processor needs to carry on: every announced request with each
sample's output tokens fed back so far (``Resync`` frames).

The output processor's state is a function of those tokens (detokenizer offsets, stop
string matching, the text sent; for samples ranked at their end, ``best_of > n``, what it
holds back, with their cumulative logprobs, fed back too), which it rebuilds by replaying
them; beam searches start over (``Scheduler._restart_beams``). What it cannot rebuild fails
its request with an error the client may retry: the logprobs held back by ranked samples,
and prompt logprobs gathered from a prefill not yet reported (or held back by ranked
samples).
"""

from __future__ import annotations

from collections.abc import Iterator

from mpengine.protocol import Array, Resync, ResyncRequest, encoder
from mpengine.scheduler.plan import new_request
from mpengine.scheduler.request import Request, Sequence, Status

RESTARTED = "the output processor restarted and lost this request's state; retry it"


def replayable(request: Request) -> bool:
    """Whether a restarted output processor can rebuild the request's state."""
    sampling = request.sampling
    if sampling is None:
        return True
    if sampling.ranks_samples and (sampling.logprobs is not None or request.wants_prompt_logprobs):
        return False
    first = request.seqs[0]
    # Prompt logprobs go with sample 0's first token; those of a prefill under way are lost.
    return not (request.wants_prompt_logprobs and first.num_outputs == 0 and first.num_computed)


def resync_request(
    request: Request, seqs: list[Sequence], restarted_after: int = 0
) -> ResyncRequest:
    """``request``'s announcement (of ``seqs``, its sequences) and each one's output
    tokens fed back so far; ``restarted_after``: it starts over after that step."""
    outputs, ended = [], []
    start = request.num_prompt_tokens
    for seq in seqs:
        outputs.append(Array.of(seq.token_ids[start:]))
        if seq.status is Status.FINISHED and request.pooling is None:
            ended.append(seq.sample_index)
    ranked = request.sampling is not None and request.sampling.ranks_samples
    scores = [seq.cumulative_logprob for seq in seqs] if ranked else []
    announcement = new_request(request, request.scheduled_time, seqs)
    return ResyncRequest(announcement, outputs, ended, scores, restarted_after)


def resync_frames(
    requests: list[tuple[Request, list[Sequence], int]],
    generation: int,
    done: int,
    max_frame_bytes: int,
) -> Iterator[Resync]:
    """The ``Resync`` frames for ``requests`` (each with its sequences and the step it
    starts over after), each at most ``max_frame_bytes`` encoded (a request larger than
    that alone in one)."""
    chunk: list[ResyncRequest] = []
    size = 0
    for request, seqs, restarted_after in requests:
        entry = resync_request(request, seqs, restarted_after)
        entry_size = len(encoder.encode(entry))
        if chunk and size + entry_size > max_frame_bytes:
            yield Resync(generation, done, chunk, last=False)
            chunk, size = [], 0
        chunk.append(entry)
        size += entry_size
    yield Resync(generation, done, chunk, last=True)
