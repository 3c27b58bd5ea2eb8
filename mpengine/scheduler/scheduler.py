"""The scheduler stage: which tokens of which sequences the next step computes.

One token-budget model, no prefill or decode phases: each running sequence catches
``num_computed`` up to its length, in chunks of at most the step's remaining budget
(chunked prefill); a decode is simply a chunk of one. Per step:

1. apply feedback: confirmed tokens, finished sequences (their blocks and slots are freed
   once no planned step still touches them), and frees those whose last step is now done;
2. running sequences, in the order they were admitted or resumed; when one's next chunk
   needs blocks the cache lacks, preempt the most recently admitted running sequence (with
   ``scheduling_policy="priority"``, the least urgent one): by recompute (drop its
   blocks, requeue it; it resumes by recomputing prompt + outputs, its stream goes on
   seamlessly) or, with ``preemption_mode="swap"``, by copying its blocks to host memory
   (the plan lists the copies; they come back when it resumes);
3. if nothing was preempted: resume preempted sequences, then admit waiting requests (FCFS)
   within ``max_num_seqs``, the token budget and the free blocks;
4. emit the plan: per sequence slot, start, chunk tokens (``-1`` for the in-flight sample the
   executor holds), whether to sample; new slot states; block-table deltas; then commit it
   (the planned sequences advance, pooled ones finish) and send with it the swap copies and
   the requests the executor may forget.

With ``scheduling_policy="priority"`` (lower numbers first) priority decides who is admitted
or resumed (the most urgent, then the earliest) and who is preempted (the least urgent, then
the latest, even one given a chunk earlier in the same step, which gives it back), as in
vLLM; it does not reorder the running list, so an urgent prompt's prefill takes the budget
that the running decodes leave, and their streams go on meanwhile.

Under async depth 1 the plan for step ``s`` is built before step ``s - 1``'s feedback: a
decoding sequence is assumed to gain its in-flight token (``num_inflight``), and one that
in fact finished there wastes one slot of one step; the output processor drops that token.

Pooling (embedding) requests are prompts only, scheduled beside generation under the same
budget: the plan marks their last chunk as "sample" (the executor pools it instead) and
the sequence finishes right there; its blocks are freed once that step is processed. An
encoder model has no KV cache: its prompts are scheduled whole, in one step each.

The parts: ``admission`` (what a request may ask), ``step`` (the budget and the batch of the
step being built), ``prefix_staging`` (which cached blocks a sequence reuses, and when a
computed block becomes reusable), ``beams`` (forked samples, beams continuing each other),
``swap`` (host blocks) and ``plan`` (the messages, built without changing state).
"""

from __future__ import annotations

import itertools
import logging
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable
from typing import ClassVar

from mpengine.config import EngineConfig
from mpengine.limits import MAX_RELEASED_PER_PLAN, FrameLimits
from mpengine.protocol import (
    EMPTY_IDS,
    STEP_TOKEN_BUCKETS,
    AddRequest,
    Announcement,
    Array,
    Feedback,
    ModelInfo,
    PoolingInfo,
    Resync,
    SeqStart,
    StepPlan,
)
from mpengine.scheduler.admission import AdmissionRules, RequestRejected
from mpengine.scheduler.beams import continue_beams, fork_sample, waiting_beam
from mpengine.scheduler.block_manager import BlockManager
from mpengine.scheduler.plan import aborted_requests, build_plan, new_request, request_params
from mpengine.scheduler.policy import choose_victim, fair_victim, next_to_resume, resume_first
from mpengine.scheduler.prefix_staging import PrefixStaging
from mpengine.scheduler.request import Request, Sequence, Status
from mpengine.scheduler.resync import RESTARTED, replayable, resync_frames, resync_request
from mpengine.scheduler.step import BlockDelta, StepBatch, StepBudget
from mpengine.scheduler.swap import HostSwap
from mpengine.scheduler.waiting import WaitingQueue

__all__ = ["RequestRejected", "Scheduler"]

logger = logging.getLogger(__name__)

COUNTERS = (
    "received",
    "rejected",
    "admitted",
    "finished",
    "aborted",
    "preemptions",
    "fair_preemptions",
    "resyncs",
    "executor_restarts",
    "forked_blocks",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "generated_tokens",
    "computed_tokens",
    "swapped_out_blocks",
    "swapped_in_blocks",
)


class Scheduler:
    # Drain (``Engine.drain``): set by the stage's signal handlers (one scheduler per stage
    # process), read only at safe points: admission refuses new requests while draining;
    # once aborting, the next schedule aborts every unfinished request.
    draining: ClassVar[bool] = False
    aborting: ClassVar[bool] = False
    # Output processor restarts signalled (its generation): re-announce at the next safe
    # point (``resync``) when it is past the last one announced.
    resyncs_asked: ClassVar[int] = 0
    # Executor restarts signalled (its generation): start over at the next safe point
    # (``lose_executor``) when it is past the last one handled.
    executor_losses: ClassVar[int] = 0

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        vocab_size: int,
        max_model_len: int,
        pooling: PoolingInfo | None = None,
        can_generate: bool = True,
        num_host_blocks: int = 0,
        eos_token_ids: list[int] | None = None,
    ) -> None:
        self.limits = FrameLimits.derive(config, max_model_len)
        self.rules = AdmissionRules.derive(
            config,
            self.limits,
            num_blocks,
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            pooling=pooling,
            can_generate=can_generate,
            eos_token_ids=eos_token_ids,
        )
        self.max_num_seqs = config.max_num_seqs
        self.ring_bytes = config.ring_bytes
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.by_priority = self.rules.by_priority
        self.encoder = self.rules.encoder  # whole prompts, no blocks
        # The executor's KV cache, host blocks and slots, as this plans them (``_empty``).
        self._cache = (
            num_blocks,
            config.block_size,
            config.prefix_caching and not self.encoder,
            num_host_blocks if config.preemption_mode == "swap" else 0,
            config.num_slots,
        )
        self._empty()
        self.executor_generation = 0  # restarts of the executor: its plans carry it
        self.requests: dict[tuple[str, str], Request] = {}  # by (client id, request id)
        self.seqs: dict[int, Sequence] = {}
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []  # in admission order
        self.preempted: deque[Sequence] = deque()
        # Finished sequences that still hold blocks and a slot: freed once no planned step
        # touches them (``last_step`` done).
        self.finished_unfreed: list[Sequence] = []
        # Keys of finished requests whose parameters the executor may drop, for the next
        # plans to list (``StepPlan.released_requests``).
        self.keys_to_forget: list[int] = []
        self.announcements: list[Announcement] = []
        self._keys = itertools.count()  # a request's key names it in the executor
        self._seq_ids = itertools.count()
        self.next_step = 1
        self.done = 0  # highest step whose feedback was applied
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.step_tokens = [0] * (len(STEP_TOKEN_BUCKETS) + 1)  # steps by tokens computed

    def _empty(self) -> None:
        """An executor's state as it starts: every block and slot free, nothing cached."""
        num_blocks, block_size, caching, num_host_blocks, num_slots = self._cache
        self.blocks = BlockManager(num_blocks, block_size, caching)
        self.prefix = PrefixStaging(self.blocks)
        self.swap = HostSwap(num_host_blocks)
        self.free_slots = deque(range(num_slots))
        # Block-table rows rewritten between plans (beams continuing other beams).
        self._table_updates: list[BlockDelta] = []

    @classmethod
    def for_model(cls, config: EngineConfig, model: ModelInfo) -> Scheduler:
        return cls(
            config,
            model.num_blocks,
            model.vocab_size,
            model.max_model_len,
            model.pooling,
            model.can_generate,
            model.num_host_blocks,
            model.eos_token_ids,
        )

    # -- requests -------------------------------------------------------------------------

    def add_request(self, req: AddRequest, client_id: str) -> None:
        """Queue a request, or raise RequestRejected with a message for its client."""
        try:
            self._queue(req, client_id)
        except RequestRejected as exc:
            self.counters["rejected"] += 1
            logger.debug("refused request %r: %s", req.request_id, exc)
            raise
        self.counters["received"] += 1

    def _queue(self, req: AddRequest, client_id: str) -> None:
        if self.aborting or (self.draining and not req.continues):
            raise RequestRejected(
                "draining: the engine is shutting down and admits no new requests", "overloaded"
            )
        if (client_id, req.request_id) in self.requests:
            raise RequestRejected(f"request id {req.request_id!r} is already in use")
        checked = self.rules.check(req)
        num_tokens = len(checked.prompt)
        request = checked.make_request(next(self._keys), client_id, req, self._seq_ids)
        self.rules.check_room(self.waiting, request, req.continues)
        self.requests[client_id, req.request_id] = request
        self.seqs.update((seq.seq_id, seq) for seq in request.seqs)
        self.waiting.append(request)
        logger.debug("queued %s: %d prompt tokens", req.request_id, num_tokens)

    def abort(self, client_id: str, request_ids: list[str]) -> None:
        """Drop a client's requests at this safe point (between plans); ids the client does
        not have are ignored (another client's requests are out of reach)."""
        aborted: list[str] = []
        for request_id in request_ids:
            request = self.requests.get((client_id, request_id))
            if request is None:
                continue
            if not request.announced:  # the output processor must know it to tell the client
                self._announce(request)
            self._finish_request(request)
            aborted.append(request_id)
        self.counters["aborted"] += len(aborted)
        self._free_finished()
        if aborted:
            logger.debug("aborted %d requests of %s", len(aborted), client_id)
        self.announcements += aborted_requests(client_id, aborted)

    def resync(self, generation: int) -> None:
        """The output processor was restarted (every feedback its predecessor wrote is
        applied): announce what it needs to carry on (``resync.py``); beam searches start
        over (``_restart_beams``); the requests it cannot carry on fail, to be retried."""
        restarted = {id(r) for r in self._restart_beams()}
        requests = [(r, list(r.seqs)) for r in self.requests.values() if r.announced]
        # Pooled requests finish when planned; those whose step is not fed back yet still
        # wait for their embedding.
        requests += [
            (seq.request, [seq])
            for seq in self.finished_unfreed
            if seq.request.pooling is not None and seq.last_step > self.done
        ]
        frame_bytes = min(1 << 20, self.ring_bytes // 4)
        planned = self.next_step - 1  # (the steps in flight carry the beams' old state)
        entries = [(r, seqs, planned if id(r) in restarted else 0) for r, seqs in requests]
        self.announcements += resync_frames(entries, generation, self.done, frame_bytes)
        lost: dict[str, list[str]] = {}
        for request, _ in requests:
            if not request.finished and not replayable(request):
                lost.setdefault(request.client_id, []).append(request.request_id)
                self._finish_request(request)
        for client_id, request_ids in lost.items():
            self.announcements += aborted_requests(client_id, request_ids, "error", RESTARTED)
        self._free_finished()
        self.counters["resyncs"] += 1
        logger.info(
            "re-announced %d requests to a restarted output processor (%d lost)",
            len(requests),
            sum(map(len, lost.values())),
        )

    def _restart_beams(self) -> list[Request]:
        """Every announced beam search starts over, its hypotheses and scores lost with a
        stage (its result is sent only when it ends: no client saw any of it): each beam
        back to the prompt, preempted for recompute. Returns those requests."""
        requests = [r for r in self.requests.values() if r.beam_search and r.announced]
        for request in requests:
            for seq in request.seqs:
                if seq.status is Status.RUNNING:
                    self.running.remove(seq)
                    self.waiting.unseat(request.tenant)
                    self.prefix.withdraw(seq)
                    self.preempted.appendleft(seq)
                elif seq.status is Status.PREEMPTED:
                    self.swap.drop(seq)
                else:
                    continue
                self._free_blocks_and_slot(seq)
                seq.status = Status.PREEMPTED
                seq.token_ids, seq.block_hashes = list(request.prompt_token_ids), []
                seq.num_computed = seq.num_inflight = seq.num_registered = 0
        return requests

    def lose_executor(self, generation: int, output_generation: int = 0) -> None:
        """The executor died and one of ``generation`` starts, with an empty cache, no
        slots and no request parameters (every feedback of the dead one applied). What it
        computed is recomputed, as after a preemption; the steps planned after ``done`` are
        lost, so the next plan is ``done + 1`` (the new executor drops older generations').
        Seeded samples draw what they would have (a draw's seed is derived from the
        request's seed and the token's index). Beam searches start over (a lost step's
        continuations are missing), and the output processor (of ``output_generation``)
        learns so (a ``Resync`` of them). What cannot be recomputed fails, to be retried:
        pooled requests planned in a lost step (they finish when planned)."""
        beams = self._restart_beams()
        if beams:
            entries = [resync_request(r, list(r.seqs), self.done) for r in beams]
            self.announcements.append(Resync(output_generation, self.done, entries))
        lost: dict[str, list[str]] = {}
        for request in self.requests.values():
            request.params_sent = False
        for seq in self.finished_unfreed:
            if seq.request.pooling is not None and seq.last_step > self.done:
                lost.setdefault(seq.request.client_id, []).append(seq.request.request_id)
            self.seqs.pop(seq.seq_id, None)
        for seq in reversed(self.running):  # (resumed in admission order)
            self.waiting.unseat(seq.request.tenant)
            seq.status = Status.PREEMPTED
            self.preempted.appendleft(seq)
        self.running = []
        for seq in self.preempted:
            seq.block_ids, seq.host_block_ids, seq.slot, seq.fork_parent = [], [], -1, None
            seq.num_computed = seq.num_registered = seq.num_inflight = seq.last_step = 0
        self._empty()
        self.finished_unfreed, self.keys_to_forget = [], []
        self.next_step = self.done + 1
        self.executor_generation = generation
        message = "the executor restarted and lost this request's state; retry it"
        for client_id, request_ids in lost.items():
            self.announcements += aborted_requests(client_id, request_ids, "error", message)
        self.counters["executor_restarts"] += 1
        logger.info(
            "the executor restarted: %d sequences recompute, %d requests lost",
            len(self.preempted),
            sum(map(len, lost.values())),
        )

    def _drop_clients(self, client_ids: set[str]) -> list[int]:
        """The output processor found these clients gone: end their requests here, queued
        ones included, silently (the output processor ends those it knows of, and those
        announced later, itself). Returns the keys of the requests ended."""
        requests = [request for key, request in self.requests.items() if key[0] in client_ids]
        for request in requests:
            self._finish_request(request)
        if requests:
            logger.debug("dropped %d requests of %d clients gone", len(requests), len(client_ids))
        return [request.key for request in requests]

    def abort_all(self) -> None:
        """Abort every unfinished request (a drain's deadline): each client gets its final
        outputs with reason ``abort``."""
        by_client: dict[str, list[str]] = {}
        for client_id, request_id in list(self.requests):
            by_client.setdefault(client_id, []).append(request_id)
        for client_id, request_ids in by_client.items():
            self.abort(client_id, request_ids)

    def take_announcements(self) -> list[Announcement]:
        """What the output processor must learn before the plan just built."""
        announcements, self.announcements = self.announcements, []
        return announcements

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- feedback -------------------------------------------------------------------------

    def apply_feedback(self, feedback: Feedback) -> None:
        finished = list(zip(feedback.finished_seq_ids, feedback.finish_reasons, strict=True))
        # What a failed sequence's step should have written is not to be reused.
        self.prefix.name(feedback.step, {seq_id for seq_id, r in finished if r == "error"})
        for seq_id, token_id in zip(
            feedback.seq_ids.numpy().tolist(), feedback.token_ids.numpy().tolist(), strict=True
        ):
            seq = self.seqs.get(seq_id)
            if seq is None or seq.finished:
                continue
            seq.token_ids.append(token_id)
            seq.num_inflight -= 1
            self.counters["generated_tokens"] += 1
            assert seq.num_inflight >= 0, f"seq {seq_id}: more tokens than planned"
        for seq_id, score in zip(feedback.scored_seq_ids, feedback.scores, strict=True):
            if (seq := self.seqs.get(seq_id)) is not None:
                seq.cumulative_logprob += score
        if len(feedback.beam_seq_ids):
            self.counters["generated_tokens"] += continue_beams(
                feedback, self.seqs, self.blocks, self._table_updates
            )
        # Requests the output stage aborted (a client gone, or not reading its outputs).
        aborted: set[int] = set()
        for seq_id, reason in finished:
            seq = self.seqs.get(seq_id)
            if seq is None or seq.finished:  # (a pooling one finished when its chunk was planned)
                continue
            if reason == "abort":
                aborted.add(seq.request.key)
            elif reason != "error" and seq.request.beam_search:
                # The beam step that ended the search decided one token per beam too; no
                # continuation comes back for it (``continue_beams`` counts the others).
                self.counters["generated_tokens"] += 1
            self._finish(seq)
        if feedback.gone_clients:
            aborted.update(self._drop_clients(set(feedback.gone_clients)))
        self.counters["aborted"] += len(aborted)
        self.done = max(self.done, feedback.step)
        self._free_finished()

    # -- the step -------------------------------------------------------------------------

    def schedule(self, feedback: Iterable[Feedback] = ()) -> StepPlan | None:
        """Build the next step's plan, or None when nothing can run now."""
        for step_feedback in feedback:
            self.apply_feedback(step_feedback)
        if self.aborting and self.requests:
            self.abort_all()
        budget = StepBudget(
            num_tokens=self.max_num_batched_tokens,
            num_frame_bytes=self.limits.plan_extra_bytes - self.swap.num_pending_bytes,
            num_prompt_logprob_tokens=self.limits.max_prompt_logprob_tokens,
        )
        carried, self._table_updates = self._table_updates, []
        batch = StepBatch(self.next_step, block_deltas=list(carried))
        self.prefix.begin_step()

        # 1. running sequences, in admission order
        preempted_now = self._schedule_running(batch, budget)
        # 2. resume preempted, then admit waiting, if nothing had to give way this step
        if not preempted_now:
            self._admit(batch, budget)
        # 3. slots for the chunked sequences that hold none (admitted, resumed, forked)
        for seq, _ in batch.chunks:
            if seq.slot < 0:
                self._start(seq, batch)
        if not batch.chunks:
            # Swap-outs issued meanwhile, and the rows beam steps changed, go with the
            # next plan.
            self._table_updates = carried
            return None
        # 4. the plan, then the state it leaves; it carries out the swap copies and the
        # requests the executor may forget (this step's pooled ones too)
        plan = build_plan(batch)
        plan.generation = self.executor_generation
        self._commit(batch, plan)
        plan.swap_out, plan.swap_in = self.swap.take_copies()
        plan.released_requests = self._take_keys_to_forget()
        return plan

    def _schedule_running(self, batch: StepBatch, budget: StepBudget) -> bool:
        """Give each running sequence its next chunk, preempting others (or itself) where
        the cache lacks the blocks; whether any was preempted."""
        preempted_now = False
        for seq in list(self.running):  # (a copy: preemption takes sequences out of it)
            if budget.num_tokens <= 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted for one before it
            if seq.fork_parent is not None:
                num_shared = fork_sample(seq, self.done, self.blocks, budget)
                if num_shared is None:
                    continue
                self.counters["forked_blocks"] += num_shared
            num_tokens = self._chunk_size(seq, budget) if seq.wants_tokens() else 0
            if num_tokens == 0:
                continue
            need = self._blocks_needed(seq, num_tokens) - len(seq.block_ids)
            while not self.blocks.can_allocate(need):
                victim = choose_victim(self.running, seq, self.by_priority, self.waiting.running)
                self._give_back(victim, batch, budget)
                self._preempt(victim, budget)
                preempted_now = True
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:  # it was the victim itself
                if self.by_priority:
                    continue  # more urgent sequences may follow it
                break  # nothing later in the list holds blocks
            self._grow(seq, need, batch)
            self._take(seq, num_tokens, batch, budget)
        return preempted_now

    def _give_back(self, seq: Sequence, batch: StepBatch, budget: StepBudget) -> int:
        """Take back the chunk ``seq`` was given earlier in this step (a victim chosen by
        priority may stand before the sequence it gives way to): the tokens returned to the
        budget. Its blocks go with its preemption."""
        for index, (chunked, num_tokens) in enumerate(batch.chunks):
            if chunked is seq:
                del batch.chunks[index]
                budget.give_back(seq, num_tokens)
                return num_tokens
        return 0

    def _admit(self, batch: StepBatch, budget: StepBudget) -> None:
        """Resume preempted sequences and admit waiting requests, in turn by priority and
        tenant (``resume_first``). One that lacks seats or blocks while a tenant runs more
        than its share takes them from that tenant (``_make_room``); else it ends the
        turns: nothing behind it overtakes it."""
        counts = self.waiting.running
        while budget.num_tokens > 0:
            request = self.waiting.first()
            if resume_first(self.preempted, request, counts):
                seq = next_to_resume(self.preempted, self.by_priority, counts)
                if seq is None:
                    break  # the next ones wait for their tokens in flight
                if self._resume(seq, batch, budget):
                    continue
                owner, want = seq.request, 1
            elif request is not None:
                if self._admit_request(request, batch, budget):
                    continue
                seq, owner, want = request.seqs[0], request, len(request.seqs)
            else:
                break
            if not self._make_room(owner, want, seq, batch, budget):
                break

    def _resume(self, seq: Sequence, batch: StepBatch, budget: StepBudget) -> bool:
        """Resume the preempted ``seq``; False when it cannot now."""
        while len(self.running) < self.max_num_seqs:
            if seq.host_block_ids:
                num_tokens, need = self._swap_in(seq, budget)
            else:
                num_tokens, need = self._place(seq, budget, 0, 0, whole=True)
            if num_tokens == 0:
                # A beam may hold blocks while it waits for its beam step: without this,
                # such beams can hold every block while the ones their step needs are
                # preempted, and no one moves.
                victim = waiting_beam(self.running, seq)
                if victim is None:
                    return False
                self._preempt(victim, budget)
                continue  # its blocks may be enough now
            self.preempted.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.waiting.seat(seq.request.tenant)
            self._grow(seq, need, batch)
            self._take(seq, num_tokens, batch, budget)
            logger.debug("step %d: resumed seq %d (%d tokens)", batch.step, seq.seq_id, len(seq))
            return True
        return False

    def _make_room(
        self, owner: Request, want: int, seq: Sequence, batch: StepBatch, budget: StepBudget
    ) -> bool:
        """``owner``'s turn to run ``want`` sequences (the first: ``seq``) lacks seats or
        blocks: preempt one of a tenant over its share (``fair_victim``). Whether one was."""
        tokens = len(seq) if seq.status is Status.PREEMPTED else min(len(seq), budget.num_tokens)
        blocks = 0 if self.encoder else self.blocks.blocks_for(tokens) + 2 * (want - 1)
        seats = len(self.running) + want > self.max_num_seqs
        if not seats and self.blocks.can_allocate(blocks):
            return False  # the budget or the frame is short: the next step has more
        counts = self.waiting.running
        victim = fair_victim(self.running, owner.tenant, want, owner.priority, counts)
        if victim is None:
            return False
        self._give_back(victim, batch, budget)
        self._preempt(victim, budget)
        self.counters["fair_preemptions"] += 1
        return True

    def _admit_request(self, request: Request, batch: StepBatch, budget: StepBudget) -> bool:
        """Admit the first waiting request; False when it does not fit now."""
        if len(self.running) + len(request.seqs) > self.max_num_seqs:
            return False
        parent = request.seqs[0]
        params_bytes = FrameLimits.request_params_bytes(
            request.num_prompt_tokens, request.sends_prompt
        )
        # Keep room for the siblings' own tail blocks so admitting does not preempt.
        reserve = (len(request.seqs) - 1) * 2
        num_tokens, need = self._place(parent, budget, params_bytes, reserve)
        if num_tokens == 0:
            return False
        self.waiting.admit(request)
        self.waiting.seat(request.tenant, len(request.seqs))
        self.counters["admitted"] += 1
        self._announce(request)
        for seq in request.seqs:
            seq.status = Status.RUNNING
            self.running.append(seq)
        self._grow(parent, need, batch)
        self._take(parent, num_tokens, batch, budget)
        logger.debug("step %d: admitted %s", batch.step, request.request_id)
        return True

    def _place(
        self,
        seq: Sequence,
        budget: StepBudget,
        frame_bytes: int,
        reserve: int,
        whole: bool = False,
    ) -> tuple[int, int]:
        """Make room for a sequence without blocks (admitted or resumed): reuse its longest
        cached prefix, then size its first chunk, which takes ``frame_bytes`` of the plan.
        Returns ``(tokens, new blocks needed)``, or ``(0, 0)`` with nothing taken when it
        does not fit this step. ``whole``: only if the blocks of all its tokens are free,
        not just its first chunk's (a recompute that would run out of blocks half-way
        preempts itself again, and again)."""
        num_cached = self.prefix.reuse(seq)
        num_tokens = self._chunk_size(seq, budget)
        need = self._blocks_needed(seq, num_tokens) - num_cached
        if whole:
            reserve += max(self.blocks.blocks_for(len(seq)) - num_cached - need, 0)
        # The siblings' room is a wish, not a condition: where the whole cache cannot hold
        # it beside this chunk, the samples take turns instead of the request waiting
        # forever (with every later request behind it).
        reserve = min(reserve, max(self.blocks.num_blocks - num_cached - need, 0))
        if num_cached:  # a new slot's table holds the cached blocks too
            frame_bytes += FrameLimits.shared_table_bytes(num_cached)
        if (
            num_tokens == 0
            or frame_bytes > budget.num_frame_bytes
            or not self.blocks.can_allocate(need + reserve)
        ):
            self.blocks.free(seq.block_ids)
            seq.block_ids, seq.num_computed, seq.num_registered = [], 0, 0
            return 0, 0
        budget.num_frame_bytes -= frame_bytes
        self.counters["prefix_cache_queries"] += len(seq) if self.blocks.caching else 0
        self.counters["prefix_cache_hits"] += seq.num_computed
        return num_tokens, need

    def _swap_in(self, seq: Sequence, budget: StepBudget) -> tuple[int, int]:
        """Make room for a swapped-out sequence (see ``HostSwap.swap_in``): as ``_place``."""
        num_tokens = self._chunk_size(seq, budget)
        need = self.swap.swap_in(seq, num_tokens, self.blocks, budget)
        if need is None:
            return 0, 0
        self.counters["swapped_in_blocks"] += len(seq.block_ids)  # (those swapped in, so far)
        return num_tokens, need

    def _chunk_size(self, seq: Sequence, budget: StepBudget) -> int:
        """Tokens to compute for ``seq`` now: what it lacks, within the step's token budget
        and, for a prompt being scored, the step's prompt-logprob positions."""
        num_tokens = min(len(seq) - seq.num_computed, budget.num_tokens)
        if self.encoder and num_tokens < len(seq):
            return 0  # an encoder's prompt is computed whole or not at all
        if seq.scores_prompt:
            num_tokens = min(num_tokens, budget.num_prompt_logprob_tokens)
        return num_tokens

    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """KV blocks ``seq`` holds once ``num_tokens`` more are computed (none for an
        encoder)."""
        return 0 if self.encoder else self.blocks.blocks_for(seq.num_computed + num_tokens)

    def _take(self, seq: Sequence, num_tokens: int, batch: StepBatch, budget: StepBudget) -> None:
        """Give ``seq`` a chunk of ``num_tokens`` in this step (its blocks taken already)."""
        budget.take(seq, num_tokens)
        batch.chunks.append((seq, num_tokens))
        self.prefix.offer(seq, num_tokens)

    def _grow(self, seq: Sequence, need: int, batch: StepBatch) -> None:
        """Give ``seq`` ``need`` more blocks (a started slot's table learns them)."""
        first = len(seq.block_ids)
        seq.block_ids += self.blocks.allocate(need)
        if seq.slot < 0:
            return  # a new slot gets its whole table in _start
        batch.block_deltas += [
            (seq.slot, i, seq.block_ids[i]) for i in range(first, len(seq.block_ids))
        ]

    def _start(self, seq: Sequence, batch: StepBatch) -> None:
        """Give ``seq`` a slot (and the executor its request's parameters, the first time)."""
        assert seq.num_computed <= len(seq)
        seq.slot = self.free_slots.popleft()
        request = seq.request
        if not request.params_sent:
            request.params_sent = True
            batch.new_requests.append(request_params(request, self.rules.eos_token_ids))
        # Prompt logprobs come from sample 0's prefill (again after a preemption before its
        # first output; the output processor keeps the first value of each position).
        first_prefill = seq.sample_index == 0 and seq.num_outputs == 0 and seq.num_computed == 0
        scores = request.wants_prompt_logprobs and first_prefill
        batch.starts.append(SeqStart(seq.slot, seq.seq_id, request.key, seq.sample_index, scores))
        batch.block_deltas += [(seq.slot, i, b) for i, b in enumerate(seq.block_ids)]

    def _commit(self, batch: StepBatch, plan: StepPlan) -> None:
        """``plan`` is built: each planned sequence has computed its chunk, as far as the
        next plan knows; a sampled one has a token in flight, a pooled one is done."""
        step = batch.step
        self.next_step += 1
        pooled: list[Sequence] = []
        samples = plan.sample.numpy().tolist()
        for (seq, num_tokens), sampled in zip(batch.chunks, samples, strict=True):
            start = seq.num_computed
            seq.num_computed += num_tokens
            seq.last_step = step
            if start < seq.num_prompt_tokens <= seq.num_computed:
                seq.prompt_step = step
            self.prefix.stage(seq, step)
            if sampled and seq.request.pooling is not None:
                pooled.append(seq)  # the executor pools its last chunk
            elif sampled:
                seq.num_inflight += 1
        for seq in pooled:
            self._finish(seq)
        num_tokens = len(plan.token_ids)
        self.counters["computed_tokens"] += num_tokens
        self.step_tokens[bisect_left(STEP_TOKEN_BUCKETS, num_tokens)] += 1
        logger.debug("step %d: %d seqs, %d tokens", step, len(batch.chunks), num_tokens)

    def _take_keys_to_forget(self) -> Array:
        """The keys the plan being sent releases (at most ``MAX_RELEASED_PER_PLAN``)."""
        keys = self.keys_to_forget[:MAX_RELEASED_PER_PLAN]
        del self.keys_to_forget[:MAX_RELEASED_PER_PLAN]
        return Array.of(keys, "int64") if keys else EMPTY_IDS

    # -- state changes --------------------------------------------------------------------

    def _announce(self, request: Request) -> None:
        request.announced = True
        announcement = new_request(request)
        request.scheduled_time = announcement.scheduled_time
        self.announcements.append(announcement)

    def _preempt(self, seq: Sequence, budget: StepBudget) -> None:
        """Preempt by swap when it can (``HostSwap.swap_out``), else by recompute: drop
        blocks and slot now (the executor runs steps in order, so a later plan reusing them
        cannot overtake the step in flight)."""
        self.running.remove(seq)
        self.waiting.unseat(seq.request.tenant)
        self.prefix.withdraw(seq)
        swapped = self.swap.swap_out(seq, budget)
        self.counters["swapped_out_blocks"] += len(seq.host_block_ids) if swapped else 0
        self._free_blocks_and_slot(seq)
        seq.num_registered = 0
        if not swapped:
            seq.num_computed = 0
        seq.status = Status.PREEMPTED
        self.preempted.appendleft(seq)
        self.counters["preemptions"] += 1
        logger.debug("preempted seq %d of %s", seq.seq_id, seq.request.request_id)

    def _finish_request(self, request: Request) -> None:
        for seq in request.seqs:  # (``_finish`` empties the list of a finished request)
            if not seq.finished:
                self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        was_waiting = seq.status is Status.WAITING
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.waiting.unseat(seq.request.tenant)
        elif seq.status is Status.PREEMPTED:
            self.preempted.remove(seq)
            self.swap.drop(seq)
        seq.status = Status.FINISHED
        self.finished_unfreed.append(seq)
        request = seq.request
        if request.finished:
            if was_waiting:
                self.waiting.forget(request)
            if request.params_sent:
                self.keys_to_forget.append(request.key)
            del self.requests[request.client_id, request.request_id]
            request.seqs = []  # no request <-> sequence cycle left for the GC to find
            self.counters["finished"] += 1

    def _free_finished(self) -> None:
        """Free finished sequences' blocks and slots once their last step is output-processed."""
        unfreed: list[Sequence] = []
        for seq in self.finished_unfreed:
            if seq.last_step > self.done:
                unfreed.append(seq)
                continue
            self._free_blocks_and_slot(seq)
            del self.seqs[seq.seq_id]
        self.finished_unfreed = unfreed

    def _free_blocks_and_slot(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_ids)
        seq.block_ids = []
        if seq.slot >= 0:  # a sample not yet started (forked this step) holds none
            self.free_slots.append(seq.slot)
        seq.slot = -1
        seq.fork_parent = None

    def stats(self) -> dict[str, int | list[int]]:
        return {
            **self.counters,
            "step_tokens": list(self.step_tokens),
            "num_waiting": self.waiting.num_seqs,
            "num_running": len(self.running),
            "num_preempted": len(self.preempted),
            "num_tenants": len(self.waiting.running),
            "num_swapped": sum(1 for seq in self.preempted if seq.host_block_ids),
            "num_free_blocks": self.blocks.num_free,
            "num_cached_blocks": self.blocks.num_cached,
            "num_blocks": self.blocks.num_blocks,
            "step": self.next_step - 1,
            "done": self.done,
        }
