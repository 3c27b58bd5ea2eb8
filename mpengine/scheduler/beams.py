"""Samples of one request that share KV blocks: the ``n`` samples forked from sample 0's
prompt, and beams, which continue each other's tokens after every beam step."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mpengine.limits import FrameLimits
from mpengine.prefix_hash import BlockHash
from mpengine.protocol import Feedback, SamplingParams
from mpengine.scheduler.block_manager import BlockManager
from mpengine.scheduler.request import Sequence, Status, urgency
from mpengine.scheduler.step import BlockDelta, StepBudget


def beam_stop_ids(sampling: SamplingParams, eos_token_ids: Iterable[int]) -> set[int]:
    """The tokens that end a beam: EOS (unless ignored) and the stop token ids."""
    eos = set() if sampling.ignore_eos else set(eos_token_ids)
    return eos | set(sampling.stop_token_ids)


def beam_candidates(sampling: SamplingParams | None, eos_token_ids: Iterable[int]) -> int:
    """The continuations a beam step weighs per beam (0 unless beam search)."""
    if sampling is None or not sampling.use_beam_search:
        return 0
    return sampling.beam_candidates(len(beam_stop_ids(sampling, eos_token_ids)))


def fork_sample(seq: Sequence, done: int, blocks: BlockManager, budget: StepBudget) -> int | None:
    """A sibling of an n > 1 request starts once its parent's prompt is computed: it
    shares the parent's full prompt blocks and computes only the tail itself (all of it
    when the parent holds no blocks). The blocks shared, or None while it must wait."""
    parent = seq.fork_parent
    assert parent is not None
    prompt_len = seq.num_prompt_tokens
    parent_running = parent.status is Status.RUNNING
    if parent_running and (parent.num_computed < prompt_len or parent.prompt_step > done):
        # Wait for the parent's prefill to have run: under async depth 1 this plan is
        # built before its feedback, and a failed step leaves the blocks unwritten.
        return None
    if not parent_running:
        seq.fork_parent = None
        return 0
    num_shared = (prompt_len - 1) // blocks.block_size
    cost = FrameLimits.shared_table_bytes(num_shared)
    if cost > budget.num_frame_bytes:
        return None  # this plan is full: fork in the next one
    budget.num_frame_bytes -= cost
    seq.fork_parent = None
    seq.block_ids = blocks.share(parent.block_ids[:num_shared])
    seq.num_computed = num_shared * blocks.block_size
    seq.num_registered = min(num_shared, parent.num_registered)
    seq.block_hashes = parent.block_hashes[: seq.num_registered]
    return num_shared


def waiting_beam(running: list[Sequence], seq: Sequence) -> Sequence | None:
    """The most recent running beam other than ``seq`` that holds blocks while it waits
    for its beam step (it computed its last token; its group waits on beams that cannot
    run) and may give way to ``seq``: a beam of the same request, or of a request that
    arrived later (by priority: that is less urgent)."""
    for beam in reversed(running):
        waits = beam.num_inflight and beam.request.beam_search and beam.block_ids
        gives_way = beam.request is seq.request or urgency(beam) > urgency(seq)
        if waits and gives_way and beam is not seq:
            return beam
    return None


@dataclass(frozen=True, slots=True)
class _BeamState:
    """A beam as it stood before the beam step's continuations were applied."""

    token_ids: list[int]
    block_ids: list[int]
    num_computed: int
    block_hashes: list[BlockHash]
    num_registered: int

    @classmethod
    def of(cls, seq: Sequence) -> _BeamState:
        return cls(
            seq.token_ids, seq.block_ids, seq.num_computed, seq.block_hashes, seq.num_registered
        )


def continue_beams(
    feedback: Feedback,
    seqs: dict[int, Sequence],
    blocks: BlockManager,
    table_updates: list[BlockDelta],
) -> int:
    """A beam step was decided: each beam now continues a parent beam's tokens plus one.
    The first child of a parent takes over all the parent's blocks; other children
    share its full blocks and recompute the rest (fewer than ``block_size`` tokens), so
    no block is ever copied. New references are taken before the old ones are dropped.
    Only what differs from the beam's own row is touched (references, the executor's
    block table in ``table_updates``, registration): beams share most of their context,
    and redoing it all made each step cost the context's length per beam (11 ms at width
    32 and 2k). Returns the beams continued (0 when the group was aborted meanwhile)."""
    children = list(
        zip(
            feedback.beam_seq_ids.numpy().tolist(),
            feedback.beam_parents.numpy().tolist(),
            feedback.beam_tokens.numpy().tolist(),
            strict=True,
        )
    )
    if any(seqs.get(i) is None or seqs.get(p) is None for i, p, _ in children):
        return 0
    before = {seq_id: _BeamState.of(seqs[seq_id]) for seq_id, _, _ in children}
    block_size = blocks.block_size
    owners: set[int] = set()
    dropped: list[int] = []
    for seq_id, parent_id, token_id in children:
        seq, parent = seqs[seq_id], before[parent_id]
        seq.token_ids = [*parent.token_ids, token_id]  # its confirmed tokens and the new one
        seq.num_inflight = 0  # (its own sample is dropped)
        if seq.status is not Status.RUNNING:  # preempted meanwhile: it will recompute
            row, seq.num_computed = [], 0
        elif parent_id not in owners:
            owners.add(parent_id)
            row, seq.num_computed = parent.block_ids, parent.num_computed
        else:
            num_kept = parent.num_computed // block_size
            row, seq.num_computed = parent.block_ids[:num_kept], num_kept * block_size
        dropped += _take_row(seq, row, parent, before[seq_id].block_ids, blocks, table_updates)
    blocks.free(dropped)
    return len(children)


def _take_row(
    seq: Sequence,
    row: list[int],
    parent: _BeamState,
    own_row: list[int],
    blocks: BlockManager,
    table_updates: list[BlockDelta],
) -> list[int]:
    """Give ``seq`` the blocks ``row`` of its parent (``num_computed`` set already), taking
    references and rewriting its table only past the blocks its own row ``own_row``
    already holds there; returns those of ``own_row`` it no longer holds, to be freed once
    every beam has taken its new references."""
    num_same = 0
    limit = min(len(own_row), len(row))
    while num_same < limit and own_row[num_same] == row[num_same]:
        num_same += 1
    blocks.share(row[num_same:])
    seq.block_ids = list(row)
    num_full = seq.num_computed // blocks.block_size
    seq.block_hashes = list(parent.block_hashes[:num_full])
    # The parent's blocks it registered are the same blocks (named, or to be).
    seq.num_registered = min(parent.num_registered, num_full)
    if seq.slot >= 0:
        table_updates += [(seq.slot, i, row[i]) for i in range(num_same, len(row))]
    return own_row[num_same:]
