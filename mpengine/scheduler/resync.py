"""What a restarted output processor needs to carry on: every announced request with each
sample's output tokens fed back so far (``Resync`` frames).

The output processor's state is a function of those tokens (detokenizer offsets, stop
string matching, the text sent), which it rebuilds by replaying them. What it cannot
rebuild fails its request with an error the client may retry: the collected logprobs of
samples ranked at the end (``best_of > n``), a beam search's hypotheses, and prompt
logprobs gathered from a prefill not yet reported.
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
    if sampling.use_beam_search or sampling.ranks_samples:
        return False
    first = request.seqs[0]
    # Prompt logprobs go with sample 0's first token; those of a prefill under way are lost.
    return not (request.wants_prompt_logprobs and first.num_outputs == 0 and first.num_computed)


def resync_request(request: Request, seqs: list[Sequence]) -> ResyncRequest:
    """``request``'s announcement (of ``seqs``, its sequences) and each one's output
    tokens fed back so far."""
    outputs, ended = [], []
    start = request.num_prompt_tokens
    for seq in seqs:
        outputs.append(Array.of(seq.token_ids[start:]))
        if seq.status is Status.FINISHED and request.pooling is None:
            ended.append(seq.sample_index)
    return ResyncRequest(new_request(request, request.scheduled_time, seqs), outputs, ended)


def resync_frames(
    requests: list[tuple[Request, list[Sequence]]],
    generation: int,
    done: int,
    max_frame_bytes: int,
) -> Iterator[Resync]:
    """The ``Resync`` frames for ``requests`` (each with its sequences), each at most
    ``max_frame_bytes`` encoded (a request larger than that alone in one)."""
    chunk: list[ResyncRequest] = []
    size = 0
    for request, seqs in requests:
        entry = resync_request(request, seqs)
        entry_size = len(encoder.encode(entry))
        if chunk and size + entry_size > max_frame_bytes:
            yield Resync(generation, done, chunk, last=False)
            chunk, size = [], 0
        chunk.append(entry)
        size += entry_size
    yield Resync(generation, done, chunk, last=True)
