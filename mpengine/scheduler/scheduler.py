"""The scheduler stage: which tokens of which sequences the next step computes.

One token-budget model, no prefill or decode phases: each running sequence catches
``num_computed`` up to its length, in chunks of at most the step's remaining budget
(chunked prefill); a decode is simply a chunk of one. Per step:

1. apply feedback: confirmed tokens, finished sequences (their blocks are released once no
   planned step still touches them), pending releases whose last step is now done;
2. running sequences, in the order they were admitted or resumed; when one's next chunk
   needs blocks the cache lacks, preempt the most recently admitted running sequence (with
   ``scheduling_policy="priority"``, the least urgent one): by recompute (drop its
   blocks, requeue it; it resumes by recomputing prompt + outputs, its stream goes on
   seamlessly) or, with ``preemption_mode="swap"``, by copying its blocks to host memory
   (the plan lists the copies; they come back when it resumes);
3. if nothing was preempted: resume preempted sequences, then admit waiting requests (FCFS)
   within ``max_num_seqs``, the token budget and the free blocks;
4. emit the plan: per sequence slot, start, chunk tokens (``-1`` for the in-flight sample the
   executor holds), whether to sample; new slot states; block-table deltas.

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
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable
from typing import ClassVar

import msgspec
import numpy as np

from mpengine.config import EngineConfig
from mpengine.limits import ABORT_CHUNK_BYTES, MAX_RELEASED_PER_PLAN, FrameLimits
from mpengine.protocol import (
    MAX_BEAM_CANDIDATES,
    PROMPT_TAIL_TOKENS,
    STEP_TOKEN_BUCKETS,
    AbortRequests,
    AddRequest,
    Announcement,
    Array,
    Feedback,
    ModelInfo,
    NewRequest,
    PoolingInfo,
    PoolingParams,
    RequestParams,
    SamplingParams,
    SeqStart,
    StepPlan,
)
from mpengine.scheduler.block_manager import BlockHash, BlockManager, chain_hashes
from mpengine.scheduler.request import Request, Sequence, Status, WaitingQueue

logger = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """A request the engine cannot serve; the message goes back to its client."""

    def __init__(self, message: str, kind: str = "invalid") -> None:
        super().__init__(message)
        self.kind = kind


class Scheduler:
    # Drain (``Engine.drain``): set by the stage's signal handlers (one scheduler per stage
    # process), read only at safe points: admission refuses new requests while draining;
    # once aborting, the next schedule aborts every unfinished request.
    draining: ClassVar[bool] = False
    aborting: ClassVar[bool] = False

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
        self.eos_token_ids = list(eos_token_ids or [])
        self.pooling = pooling  # None: the model cannot embed
        self.can_generate = can_generate
        self.encoder = pooling is not None and pooling.is_encoder  # whole prompts, no blocks
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_waiting_requests = config.max_waiting_requests
        self.max_waiting_tokens = config.max_waiting_tokens
        self.by_priority = config.scheduling_policy == "priority"
        self.limits = FrameLimits.derive(config, max_model_len)
        caching = config.prefix_caching and not self.encoder
        self.blocks = BlockManager(num_blocks, config.block_size, caching)
        self.free_slots = deque(range(config.num_slots))
        # Swap preemption: free host blocks, and this plan's copies.
        self.swap = config.preemption_mode == "swap" and num_host_blocks > 0
        self.free_host_blocks: deque[int] = deque(range(num_host_blocks if self.swap else 0))
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        # Block-table rows rewritten between plans (beams continuing other beams).
        self._table_updates: list[tuple[int, int, int]] = []
        # Prefix caching: blocks a planned step fills, named (reusable by other sequences)
        # once its feedback says the step ran. Under async depth 1 the next plan is built
        # before that, and a failed step leaves its blocks unwritten: reused at once, they
        # gave another request wrong tokens. Each holds a reference meanwhile, so that it
        # cannot go to another sequence unnamed. Step -> (seq id, block, hash).
        self._unnamed: dict[int, list[tuple[int, int, BlockHash]]] = {}
        # ... except within the step being built: a request admitted beside the one that
        # computes a prefix starts after it (every attention backend stores a step's keys
        # and values before any sequence of the step reads them, as vLLM's do; a burst of
        # requests sharing a system prompt computed it once per admission step, up to
        # one per request). If the writer cannot run, the executor fails its readers too.
        # Hash -> (block, the sequence computing it).
        self._provisional: dict[BlockHash, tuple[int, Sequence]] = {}
        self.requests: dict[tuple[str, str], Request] = {}  # by (client id, request id)
        self.num_waiting_requests = 0  # the queue also holds aborted ones, skipped later
        self.num_waiting_tokens = 0
        self.released: list[int] = []  # request keys the executor may forget
        # What the step being built may still spend (see limits.py).
        self._extra_bytes = 0
        self._prompt_logprob_tokens = 0
        self._next_key = 0
        self.seqs: dict[int, Sequence] = {}
        self.waiting = WaitingQueue(self.by_priority)
        self.running: list[Sequence] = []  # in admission order
        self.preempted: deque[Sequence] = deque()
        self.pending_release: list[Sequence] = []  # finished, a planned step still touches them
        self.announcements: list[Announcement] = []
        self.next_step = 1
        self.done = 0  # highest step whose feedback was applied
        self._next_seq_id = 0
        self.counters = dict.fromkeys(
            (
                "received",
                "rejected",
                "admitted",
                "finished",
                "aborted",
                "preemptions",
                "forked_blocks",
                "prefix_cache_queries",
                "prefix_cache_hits",
                "generated_tokens",
                "computed_tokens",
                "swapped_out_blocks",
                "swapped_in_blocks",
            ),
            0,
        )
        self.step_tokens = [0] * (len(STEP_TOKEN_BUCKETS) + 1)  # steps by tokens computed

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
        if req.priority and not self.by_priority:
            raise RequestRejected(
                f"priority: {req.priority} given, but the engine schedules first come, first "
                "served (start it with --scheduling-policy priority)"
            )
        prompt = req.prompt_token_ids.numpy()
        sampling, pooling = req.sampling, req.pooling
        if pooling is not None:
            pooling, prompt = self._check_pooling(prompt, pooling)
            max_tokens = 0
        else:
            assert sampling is not None
            prompt = sampling.truncated(prompt, self.max_model_len)
            if sampling.use_beam_search and sampling.num_samples == 1:
                # One beam is greedy search (as transformers' generate(num_beams=1) is).
                sampling = msgspec.structs.replace(
                    sampling, use_beam_search=False, beam_width=None, temperature=0.0
                )
            max_tokens = self._check(prompt, sampling)
        # The bounds stop new work. A batch call already under way keeps at most half of
        # each in flight (its client's window) and may go on up to twice them: several
        # batch calls together failed part-way, their finished work thrown away.
        slack = 2 if req.continues else 1
        if self.num_waiting_requests >= slack * self.max_waiting_requests:
            raise RequestRejected(
                f"overloaded: {self.num_waiting_requests} requests are waiting "
                f"(max_waiting_requests={self.max_waiting_requests}); retry later",
                "overloaded",
            )
        waiting_tokens = self.num_waiting_tokens + len(prompt)
        if self.num_waiting_requests and waiting_tokens > slack * self.max_waiting_tokens:
            raise RequestRejected(
                f"overloaded: {self.num_waiting_tokens} prompt tokens are waiting "
                f"(max_waiting_tokens={self.max_waiting_tokens}); retry later",
                "overloaded",
            )
        request = Request(
            key=self._next_key,
            request_id=req.request_id,
            client_id=client_id,
            prompt_token_ids=prompt.tolist(),
            sampling=sampling if pooling is None else None,
            pooling=pooling,
            arrival_time=req.arrival_time or time.time(),
            max_tokens=max_tokens,
            priority=req.priority,
        )
        self._next_key += 1
        for index in range(1 if sampling is None else sampling.num_samples):
            seq = Sequence(self._next_seq_id, request, index, list(request.prompt_token_ids))
            self._next_seq_id += 1
            request.seqs.append(seq)
            self.seqs[seq.seq_id] = seq
        for child in request.seqs[1:]:
            child.fork_parent = request.seqs[0]
        self.requests[client_id, req.request_id] = request
        self.waiting.append(request)
        self.num_waiting_requests += 1
        self.num_waiting_tokens += len(prompt)
        logger.debug("queued %s: %d prompt tokens", req.request_id, len(prompt))

    def _check_tokens(self, prompt: np.ndarray) -> None:
        if len(prompt) == 0:
            raise RequestRejected("the prompt is empty")
        low, high = int(prompt.min()), int(prompt.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise RequestRejected(
                f"prompt_token_ids: token id {bad} is outside the vocabulary "
                f"(0..{self.vocab_size - 1})"
            )

    def _check_pooling(
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
        self._check_tokens(prompt)
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
        if not self.encoder and self.blocks.blocks_for(len(prompt)) > self.blocks.num_blocks:
            raise RequestRejected(
                f"the KV cache ({self.blocks.num_blocks} blocks) cannot hold this request",
                "too_large",
            )
        normalize = model.normalize if params.normalize is None else params.normalize
        resolved = PoolingParams(pooling, normalize, params.dimensions)
        return resolved, prompt

    def _check(self, prompt: np.ndarray, sampling: SamplingParams) -> int:
        """Reject what this engine cannot serve; return ``max_tokens`` capped so prompt and
        output fit ``max_model_len``. (Sizes the protocol bounds are already checked.)"""
        if not self.can_generate:
            raise RequestRejected(
                "this model only embeds (it has no language-model head): send embedding requests"
            )
        if len(prompt) >= self.max_model_len:
            raise RequestRejected(
                f"the prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len} "
                "and at least one must be left to generate"
            )
        self._check_tokens(prompt)
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
            num_stops = len(self._beam_stop_ids(sampling))
            num_candidates = sampling.beam_candidates(num_stops)
            limit = min(self.limits.max_beam_candidates, self.vocab_size)
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
        if self.blocks.blocks_for(len(prompt) + max_tokens - 1) > self.blocks.num_blocks:
            raise RequestRejected(
                f"the KV cache ({self.blocks.num_blocks} blocks) cannot hold this request",
                "too_large",
            )
        return max_tokens

    def _beam_stop_ids(self, sampling: SamplingParams) -> set[int]:
        """The tokens that end a beam: EOS (unless ignored) and the stop token ids."""
        eos = set() if sampling.ignore_eos else set(self.eos_token_ids)
        return eos | set(sampling.stop_token_ids)

    def abort(self, client_id: str, request_ids: list[str]) -> None:
        """Drop a client's requests at this safe point (between plans); ids the client does
        not have are ignored (another client's requests are out of reach)."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get((client_id, request_id))
            if request is None:
                continue
            if not request.announced:  # the output processor must know it to tell the client
                self._announce(request)
            for seq in request.seqs:
                if not seq.finished:
                    self._finish(seq)
            aborted.append(request_id)
            self.counters["aborted"] += 1
        self._release_done()
        if aborted:
            logger.debug("aborted %d requests of %s", len(aborted), client_id)
        # In frames of bounded size: a client may abort thousands of long ids at once.
        chunk: list[str] = []
        size = 0
        for request_id in aborted:
            if chunk and size + len(request_id) * 4 > ABORT_CHUNK_BYTES:
                self.announcements.append(AbortRequests(client_id, chunk))
                chunk, size = [], 0
            chunk.append(request_id)
            size += len(request_id) * 4 + 3
        if chunk:
            self.announcements.append(AbortRequests(client_id, chunk))

    def _drop_clients(self, client_ids: set[str]) -> list[int]:
        """The output processor found these clients gone: end their requests here, queued
        ones included, silently (the output processor ends those it knows of, and those
        announced later, itself). Returns the keys of the requests ended."""
        requests = [request for key, request in self.requests.items() if key[0] in client_ids]
        for request in requests:
            for seq in request.seqs:
                if not seq.finished:
                    self._finish(seq)
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
        failed = [
            seq_id
            for seq_id, reason in zip(
                feedback.finished_seq_ids, feedback.finish_reasons, strict=True
            )
            if reason == "error"  # what its step should have written is not to be reused
        ]
        self._name_blocks(feedback.step, set(failed))
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
        if len(feedback.beam_seq_ids):
            self._continue_beams(feedback)
        # Requests the output stage aborted (a client gone, or not reading its outputs).
        aborted: set[int] = set()
        for seq_id, reason in zip(feedback.finished_seq_ids, feedback.finish_reasons, strict=True):
            seq = self.seqs.get(seq_id)
            if seq is None:
                continue
            if reason == "abort" and not seq.finished:
                aborted.add(seq.request.key)
            if reason not in ("abort", "error") and seq.request.beam_search and not seq.finished:
                # The beam step that ended the search decided one token per beam too; no
                # continuation comes back for it (``_continue_beams`` counts the others).
                self.counters["generated_tokens"] += 1
            if not seq.finished:  # (a pooling sequence finished when its last chunk was planned)
                self._finish(seq)
        if feedback.gone_clients:
            aborted.update(self._drop_clients(set(feedback.gone_clients)))
        self.counters["aborted"] += len(aborted)
        self.done = max(self.done, feedback.step)
        self._release_done()

    def _continue_beams(self, feedback: Feedback) -> None:
        """A beam step was decided: each beam now continues a parent beam's tokens plus one.
        The first child of a parent takes over all the parent's blocks; other children
        share its full blocks and recompute the rest (fewer than ``block_size`` tokens), so
        no block is ever copied. New references are taken before the old ones are dropped.
        Only what differs from the beam's own row is touched (references, the executor's
        block table, registration): beams share most of their context, and redoing it all
        made each step cost the context's length per beam (11 ms at width 32 and 2k)."""
        children = list(
            zip(
                feedback.beam_seq_ids.numpy().tolist(),
                feedback.beam_parents.numpy().tolist(),
                feedback.beam_tokens.numpy().tolist(),
                strict=True,
            )
        )
        seqs = self.seqs
        if any(seqs.get(i) is None or seqs.get(p) is None for i, p, _ in children):
            return  # the group was aborted meanwhile
        old = {
            seq_id: (
                seq.token_ids,
                seq.block_ids,
                seq.num_computed,
                seq.block_hashes,
                seq.num_registered,
            )
            for seq_id, seq in ((i, seqs[i]) for i, _, _ in children)
        }
        bs = self.blocks.block_size
        owners: set[int] = set()
        dropped: list[int] = []
        for seq_id, parent, token in children:
            seq = seqs[seq_id]
            tokens, blocks, computed, hashes, registered = old[parent]
            mine = old[seq_id][1]
            seq.token_ids = [*tokens, token]  # the parent's confirmed tokens and the new one
            seq.num_inflight = 0  # (its own sample is dropped)
            if seq.status is not Status.RUNNING:  # preempted meanwhile: it will recompute
                row, seq.num_computed = [], 0
            elif parent not in owners:
                owners.add(parent)
                row, seq.num_computed = blocks, computed
            else:
                keep = computed // bs
                row, seq.num_computed = blocks[:keep], keep * bs
            same = 0  # the blocks the beam's own row already holds there
            limit = min(len(mine), len(row))
            while same < limit and mine[same] == row[same]:
                same += 1
            self.blocks.share(row[same:])
            dropped += mine[same:]
            seq.block_ids = list(row)
            seq.block_hashes = list(hashes[: seq.num_computed // bs])
            # The parent's blocks it registered are the same blocks (named, or to be).
            seq.num_registered = min(registered, seq.num_computed // bs)
            if seq.slot >= 0:
                self._table_updates += [(seq.slot, i, row[i]) for i in range(same, len(row))]
            self.counters["generated_tokens"] += 1
        self.blocks.free(dropped)

    # -- the step -------------------------------------------------------------------------

    def schedule(self, feedback: Iterable[Feedback] = ()) -> StepPlan | None:
        """Build the next step's plan, or None when nothing can run now."""
        for fb in feedback:
            self.apply_feedback(fb)
        if self.aborting and self.requests:
            self.abort_all()
        step = self.next_step
        budget = self.max_num_batched_tokens
        # Swap-outs issued for a step that then planned nothing still wait to be sent (their
        # blocks are free already: this plan's forward must come after the copies).
        self._extra_bytes = self.limits.plan_extra_bytes - 8 * len(self._swap_out)
        self._provisional = {}
        self._prompt_logprob_tokens = self.limits.max_prompt_logprob_tokens
        chunks: list[tuple[Sequence, int]] = []
        starts: list[SeqStart] = []
        block_deltas, self._table_updates = self._table_updates, []
        preempted_now = False

        # 1. running sequences, in admission order
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.fork_parent is not None and not self._try_fork(seq):
                index += 1
                continue
            num_tokens = self._chunk_size(seq, budget) if seq.wants_tokens() else 0
            if num_tokens == 0:
                index += 1
                continue
            need = self._blocks_needed(seq, num_tokens) - len(seq.block_ids)
            while not self.blocks.can_allocate(need):
                victim = self._victim(index)
                budget += self._give_back(victim, chunks)
                self._preempt(victim)
                preempted_now = True
                if victim is seq:
                    break
                index = self.running.index(seq)  # a waiting beam before it may have gone
            if seq.status is not Status.RUNNING:  # it was the victim itself
                if self.by_priority:
                    continue  # more urgent sequences may follow it (the list lost it)
                break  # nothing later in the list holds blocks
            self._grow(seq, need, block_deltas)
            self._take(seq, num_tokens, chunks)
            budget -= num_tokens
            index += 1

        # 2. resume preempted, then admit waiting, if nothing had to give way this step
        if not preempted_now:
            budget = self._admit(step, budget, chunks, block_deltas)

        # Sequences that got a slot but no chunk yet (or a SeqStart) still need starting.
        params: list[RequestParams] = []
        for seq, _ in chunks:
            if seq.slot < 0:
                self._start(seq, starts, params, block_deltas)
        if not chunks:
            return None  # swap-outs issued meanwhile go with the next plan
        self.next_step += 1
        plan = self._plan(step, chunks, starts, block_deltas)
        plan.new_requests = params
        if self._swap_out:
            plan.swap_out = Array.of(np.asarray(self._swap_out, np.int32).reshape(-1))
        if self._swap_in:
            plan.swap_in = Array.of(np.asarray(self._swap_in, np.int32).reshape(-1))
        self._swap_out, self._swap_in = [], []
        if self.released:
            released = self.released[:MAX_RELEASED_PER_PLAN]
            del self.released[:MAX_RELEASED_PER_PLAN]
            plan.released_requests = Array.of(released, "int64")
        return plan

    def _victim(self, index: int) -> Sequence:
        """Who gives way to ``running[index]``: the most recently admitted running sequence
        after it that holds blocks (preempting one without blocks frees nothing); by
        priority, the least urgent one that holds blocks, if it is less urgent than
        ``running[index]``; else a beam that holds blocks while it waits for its beam step
        and may give way (``_waiting_beam``), else ``running[index]`` itself."""
        seq = self.running[index]
        if self.by_priority:
            holders = [s for s in self.running if s.block_ids and s is not seq]
            least = max(holders, key=_urgency, default=None)
            if least is not None and _urgency(least) > _urgency(seq):
                return least
        else:
            for victim in reversed(self.running[index + 1 :]):
                if victim.block_ids:
                    return victim
        return self._waiting_beam(seq) or seq

    def _give_back(self, seq: Sequence, chunks: list) -> int:
        """Take back the chunk ``seq`` was given earlier in this step (a victim chosen by
        priority may stand before the sequence it gives way to): the tokens returned to the
        budget. Its blocks go with its preemption."""
        for i, (chunked, num_tokens) in enumerate(chunks):
            if chunked is seq:
                del chunks[i]
                if self._scores_prompt(seq):
                    self._prompt_logprob_tokens += num_tokens
                return num_tokens
        return 0

    def _admit(self, step: int, budget: int, chunks: list, block_deltas: list) -> int:
        """Resume preempted sequences and admit waiting requests, in turn by priority (a
        preempted sequence goes back among the waiting requests, before those of its own
        priority; under first-come-first-served, before them all). A sequence or request
        that does not fit ends the turns: nothing behind it overtakes it."""
        while budget > 0:
            request = self._first_waiting()
            preempted_turn = bool(self.preempted) and (
                request is None
                or min(s.request.priority for s in self.preempted) <= request.priority
            )
            if preempted_turn:
                resumed = self._resume(step, budget, chunks, block_deltas)
                if resumed is None:
                    break
                budget -= resumed
            elif request is not None:
                admitted = self._admit_request(request, step, budget, chunks, block_deltas)
                if admitted is None:
                    break
                budget -= admitted
            else:
                break
        return budget

    def _first_waiting(self) -> Request | None:
        """The first waiting request (dropping those aborted meanwhile), or None."""
        while self.waiting and self.waiting.head().finished:
            self.waiting.popleft()
        return self.waiting.head() if self.waiting else None

    def _resume(self, step: int, budget: int, chunks: list, block_deltas: list) -> int | None:
        """Resume the most urgent (then oldest) preempted sequence that can; the tokens it
        takes this step, or None when it cannot now. Its in-flight tokens must be confirmed
        first (the recompute needs every token id): one with a token still in flight waits
        for it (a beam, for its whole beam step), without holding up the others."""
        while len(self.running) < self.max_num_seqs:
            ready = [s for s in self.preempted if not s.num_inflight]
            if not ready:
                return None
            seq = min(ready, key=_urgency) if self.by_priority else ready[0]
            if seq.host_block_ids:
                num_tokens, need = self._swap_in_place(seq, budget)
            else:
                num_tokens, need = self._place(seq, budget, 0, 0, whole=True)
            if num_tokens == 0:
                if self._preempt_waiting_beam(seq):
                    continue  # its blocks may be enough now
                return None
            self.preempted.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._grow(seq, need, block_deltas)
            self._take(seq, num_tokens, chunks)
            logger.debug("step %d: resumed seq %d (%d tokens)", step, seq.seq_id, len(seq))
            return num_tokens
        return None

    def _admit_request(
        self, request: Request, step: int, budget: int, chunks: list, block_deltas: list
    ) -> int | None:
        """Admit the first waiting request; the tokens it takes this step, or None when it
        does not fit now."""
        if len(self.running) + len(request.seqs) > self.max_num_seqs:
            return None
        parent = request.seqs[0]
        params_bytes = FrameLimits.request_params_bytes(
            request.num_prompt_tokens, request.sends_prompt
        )
        # Keep room for the siblings' own tail blocks so admitting does not preempt.
        reserve = (len(request.seqs) - 1) * 2
        num_tokens, need = self._place(parent, budget, params_bytes, reserve)
        if num_tokens == 0:
            return None
        self.waiting.popleft()
        self.num_waiting_requests -= 1
        self.num_waiting_tokens -= request.num_prompt_tokens
        self.counters["admitted"] += 1
        self._announce(request)
        for seq in request.seqs:
            seq.status = Status.RUNNING
            self.running.append(seq)
        self._grow(parent, need, block_deltas)
        self._take(parent, num_tokens, chunks)
        logger.debug("step %d: admitted %s", step, request.request_id)
        return num_tokens

    def _preempt_waiting_beam(self, seq: Sequence) -> bool:
        """Preempt, for ``seq``, a running beam that holds blocks while it waits for its
        beam step (``_waiting_beam``): without this, such beams can hold every block while
        the ones their step needs are preempted, and no one moves. True if one was."""
        victim = self._waiting_beam(seq)
        if victim is not None:
            self._preempt(victim)
        return victim is not None

    def _waiting_beam(self, seq: Sequence) -> Sequence | None:
        """The most recent running beam other than ``seq`` that holds blocks while it waits
        for its beam step (it computed its last token; its group waits on beams that cannot
        run) and may give way to ``seq``: a beam of the same request, or of a request that
        arrived later (by priority: that is less urgent)."""
        for beam in reversed(self.running):
            waits = beam.num_inflight and beam.request.beam_search and beam.block_ids
            gives_way = beam.request is seq.request or _urgency(beam) > _urgency(seq)
            if waits and gives_way and beam is not seq:
                return beam
        return None

    def _place(
        self, seq: Sequence, budget: int, extra_bytes: int, reserve: int, whole: bool = False
    ) -> tuple[int, int]:
        """Make room for a sequence without blocks (admitted or resumed): reuse its longest
        cached prefix, then size its first chunk. Returns ``(tokens, new blocks needed)``,
        or ``(0, 0)`` with nothing taken when it does not fit this step. ``whole``: only if
        the blocks of all its tokens are free, not just its first chunk's (a recompute that
        would run out of blocks half-way preempts itself again, and again)."""
        num_cached = self._reuse_cached(seq)
        num_tokens = self._chunk_size(seq, budget)
        need = self._blocks_needed(seq, num_tokens) - num_cached
        if whole:
            reserve += max(self.blocks.blocks_for(len(seq)) - num_cached - need, 0)
        # The siblings' room is a wish, not a condition: where the whole cache cannot hold
        # it beside this chunk, the samples take turns instead of the request waiting
        # forever (with every later request behind it).
        reserve = min(reserve, max(self.blocks.num_blocks - num_cached - need, 0))
        if num_cached:  # a new slot's table holds the cached blocks too
            extra_bytes += FrameLimits.shared_table_bytes(num_cached)
        if (
            num_tokens == 0
            or extra_bytes > self._extra_bytes
            or not self.blocks.can_allocate(need + reserve)
        ):
            self.blocks.free(seq.block_ids)
            seq.block_ids, seq.num_computed, seq.num_registered = [], 0, 0
            return 0, 0
        self._extra_bytes -= extra_bytes
        self.counters["prefix_cache_queries"] += len(seq) if self.blocks.caching else 0
        self.counters["prefix_cache_hits"] += seq.num_computed
        return num_tokens, need

    def _swap_in_place(self, seq: Sequence, budget: int) -> tuple[int, int]:
        """Make room for a swapped-out sequence: device blocks for its host blocks (copied
        in before this step's forward) and for its next chunk. ``(0, 0)`` when it does not
        fit this step."""
        host = seq.host_block_ids
        num_tokens = self._chunk_size(seq, budget)
        need = self.blocks.blocks_for(seq.num_computed + num_tokens) - len(host)
        cost = FrameLimits.shared_table_bytes(len(host)) + 8 * len(host)
        if num_tokens == 0 or cost > self._extra_bytes:
            return 0, 0
        if not self.blocks.can_allocate(len(host) + max(need, 0)):
            return 0, 0
        self._extra_bytes -= cost
        seq.block_ids = self.blocks.allocate(len(host))
        self._swap_in += zip(host, seq.block_ids, strict=True)
        self.free_host_blocks.extend(host)
        self.counters["swapped_in_blocks"] += len(host)
        seq.host_block_ids = []
        return num_tokens, need

    def _reuse_cached(self, seq: Sequence) -> int:
        """Give ``seq`` (holding no blocks) the cached blocks of its longest computed prefix,
        never its last token (whose logits are needed); return how many. Requests asking
        for prompt logprobs compute their prompt."""
        request = seq.request
        if not self.blocks.caching or request.wants_prompt_logprobs:
            return 0
        if seq.num_outputs and request.sampling is not None and request.sampling.has_penalties:
            # Penalties read the slot's token history, which holds the prompt (when a
            # repetition penalty needs it) and the tokens computed in the slot: a resumed
            # sequence recomputes its earlier outputs, so that they are counted again.
            return 0
        if request.pooling is not None and request.pooling.pooling != "last":
            return 0  # mean and CLS pooling read the prompt's first tokens' hidden states
        num_blocks = (len(seq) - 1) // self.blocks.block_size
        hashes = self._hashes(seq, num_blocks)[:num_blocks]
        seq.block_ids = self.blocks.lookup(hashes)
        for block_hash in hashes[len(seq.block_ids) :] if self._provisional else ():
            computing = self._provisional.get(block_hash)
            if computing is None:
                break
            seq.block_ids += self.blocks.share([computing[0]])
        seq.num_computed = seq.num_registered = len(seq.block_ids)
        seq.num_computed *= self.blocks.block_size
        return len(seq.block_ids)

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The hash chain of ``seq``'s full blocks, extended (lazily) to at least its first
        ``num_blocks``; only the new blocks' tokens are read (a copy of the whole context
        made every decode step cost its length)."""
        have = seq.block_hashes
        if len(have) < num_blocks:
            size = self.blocks.block_size
            parent = have[-1] if have else None
            have += chain_hashes(seq.token_ids[len(have) * size : num_blocks * size], size, parent)
        return have

    def _register_computed(self, seq: Sequence, step: int) -> None:
        """Name the full blocks whose tokens are known and computed as of the plan being
        built, once step ``step`` has run (``_name_blocks``)."""
        num_full = min(seq.num_computed, len(seq.token_ids)) // self.blocks.block_size
        if not self.blocks.caching or num_full <= seq.num_registered:
            return
        hashes = self._hashes(seq, num_full)
        unnamed = self._unnamed.setdefault(step, [])
        for index in range(seq.num_registered, num_full):
            block = seq.block_ids[index]
            self.blocks.share([block])
            unnamed.append((seq.seq_id, block, hashes[index]))
        seq.num_registered = num_full

    def _name_blocks(self, step: int, failed: set[int]) -> None:
        """Step ``step`` ran (feedback comes in step order): name the blocks it filled,
        except those of ``failed`` sequences, whose later steps are skipped too."""
        for planned in sorted(s for s in self._unnamed if s <= step):
            entries = self._unnamed.pop(planned)
            for seq_id, block, block_hash in entries:
                if seq_id not in failed:
                    self.blocks.register(block, block_hash)
            self.blocks.free([block for _, block, _ in entries])
        if failed:
            for planned, entries in self._unnamed.items():
                dropped = [block for seq_id, block, _ in entries if seq_id in failed]
                self._unnamed[planned] = [e for e in entries if e[0] not in failed]
                self.blocks.free(dropped)

    def _try_fork(self, seq: Sequence) -> bool:
        """A sibling of an n > 1 request starts once its parent's prompt is computed: it
        shares the parent's full prompt blocks and computes only the tail itself."""
        parent = seq.fork_parent
        assert parent is not None
        prompt_len = seq.num_prompt_tokens
        if parent.status is Status.RUNNING and (
            parent.num_computed < prompt_len or parent.prompt_step > self.done
        ):
            # Wait for the parent's prefill to have run: under async depth 1 this plan is
            # built before its feedback, and a failed step leaves the blocks unwritten.
            return False
        num_shared = (prompt_len - 1) // self.blocks.block_size
        if parent.status is Status.RUNNING:
            cost = FrameLimits.shared_table_bytes(num_shared)
            if cost > self._extra_bytes:
                return False  # this plan is full: fork in the next one
            self._extra_bytes -= cost
        seq.fork_parent = None
        if parent.status is Status.RUNNING:
            seq.block_ids = self.blocks.share(parent.block_ids[:num_shared])
            seq.num_computed = num_shared * self.blocks.block_size
            seq.num_registered = min(num_shared, parent.num_registered)
            seq.block_hashes = parent.block_hashes[: seq.num_registered]
            self.counters["forked_blocks"] += num_shared
        return True

    def _scores_prompt(self, seq: Sequence) -> bool:
        """Whether computing this sequence's prompt yields prompt logprobs (sample 0, first
        prefill; see ``_start``)."""
        return (
            seq.request.wants_prompt_logprobs
            and seq.sample_index == 0
            and seq.num_outputs == 0
            and seq.num_computed < seq.num_prompt_tokens - 1
        )

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        """Tokens to compute for ``seq`` now: what it lacks, within the step's token budget
        and, for a prompt being scored, the step's prompt-logprob positions."""
        num_tokens = min(len(seq) - seq.num_computed, budget)
        if self.encoder and num_tokens < len(seq):
            return 0  # an encoder's prompt is computed whole or not at all
        if self._scores_prompt(seq):
            num_tokens = min(num_tokens, self._prompt_logprob_tokens)
        return num_tokens

    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """KV blocks ``seq`` holds once ``num_tokens`` more are computed (none for an
        encoder)."""
        return 0 if self.encoder else self.blocks.blocks_for(seq.num_computed + num_tokens)

    def _take(self, seq: Sequence, num_tokens: int, chunks: list) -> None:
        if self._scores_prompt(seq):
            self._prompt_logprob_tokens -= num_tokens
        chunks.append((seq, num_tokens))
        if self.blocks.caching and not seq.request.wants_prompt_logprobs:
            # The full blocks of known tokens this chunk computes whole: shareable at once.
            size = self.blocks.block_size
            first = -(-seq.num_computed // size)
            end = min(seq.num_computed + num_tokens, len(seq.token_ids)) // size
            if end > first:
                hashes = self._hashes(seq, end)
                for index in range(first, end):
                    self._provisional.setdefault(hashes[index], (seq.block_ids[index], seq))

    def _grow(self, seq: Sequence, need: int, block_deltas: list) -> None:
        first = len(seq.block_ids)
        seq.block_ids += self.blocks.allocate(need)
        if seq.slot < 0:
            return  # a new slot gets its whole table in _start
        block_deltas += [(seq.slot, i, seq.block_ids[i]) for i in range(first, len(seq.block_ids))]

    def _start(
        self,
        seq: Sequence,
        starts: list[SeqStart],
        params: list[RequestParams],
        block_deltas: list,
    ) -> None:
        assert seq.num_computed <= len(seq)
        seq.slot = self.free_slots.popleft()
        request = seq.request
        if not request.params_sent:
            request.params_sent = True
            sampling = request.sampling
            params.append(
                RequestParams(
                    key=request.key,
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling=self._executor_sampling(sampling),
                    pooling=request.pooling,
                    prompt_token_ids=(
                        Array.of(request.prompt_token_ids) if request.sends_prompt else None
                    ),
                    beam_candidates=(
                        sampling.beam_candidates(len(self._beam_stop_ids(sampling)))
                        if sampling is not None and sampling.use_beam_search
                        else 0
                    ),
                )
            )
        # Prompt logprobs come from sample 0's prefill (again after a preemption before its
        # first output; the output processor keeps the first value of each position).
        first_prefill = seq.sample_index == 0 and seq.num_outputs == 0 and seq.num_computed == 0
        scores = request.wants_prompt_logprobs and first_prefill
        starts.append(SeqStart(seq.slot, seq.seq_id, request.key, seq.sample_index, scores))
        block_deltas += [(seq.slot, i, b) for i, b in enumerate(seq.block_ids)]

    def _executor_sampling(self, sampling: SamplingParams | None) -> SamplingParams | None:
        if sampling is None:
            return None
        if sampling.use_beam_search:
            return sampling.for_beam_executor()
        return sampling.for_executor()

    def _plan(
        self,
        step: int,
        chunks: list[tuple[Sequence, int]],
        starts: list[SeqStart],
        block_deltas: list[tuple[int, int, int]],
    ) -> StepPlan:
        num = len(chunks)
        seq_ids = np.empty(num, np.int64)
        slots = np.empty(num, np.int32)
        seq_starts = np.empty(num, np.int32)
        num_tokens = np.empty(num, np.int32)
        sample = np.zeros(num, np.bool_)
        token_ids: list[int] = []
        pooled: list[Sequence] = []
        for i, (seq, n) in enumerate(chunks):
            start, end = seq.num_computed, seq.num_computed + n
            seq_ids[i], slots[i], seq_starts[i], num_tokens[i] = seq.seq_id, seq.slot, start, n
            known = seq.token_ids[start:end]
            token_ids += known
            if len(known) < n:  # the in-flight sample, held by the executor
                assert len(known) == n - 1 and seq.num_inflight > 0
                token_ids.append(-1)
            seq.num_computed = end
            seq.last_step = step
            if start < seq.num_prompt_tokens <= end:
                seq.prompt_step = step
            self._register_computed(seq, step)
            if seq.request.pooling is not None:
                if end == len(seq):  # the last chunk: the executor pools it
                    sample[i] = True
                    pooled.append(seq)
            elif end == len(seq) and seq.num_outputs < seq.request.max_tokens:
                sample[i] = True
                seq.num_inflight += 1
        for seq in pooled:
            self._finish(seq)
        if block_deltas:
            delta = np.asarray(block_deltas, np.int32)
            block_slots, block_indices, block_ids = (Array.of(delta[:, k]) for k in range(3))
        else:
            block_slots = block_indices = block_ids = Array.of([])
        self.counters["computed_tokens"] += len(token_ids)
        self.step_tokens[bisect_left(STEP_TOKEN_BUCKETS, len(token_ids))] += 1
        logger.debug("step %d: %d seqs, %d tokens", step, num, len(token_ids))
        return StepPlan(
            step=step,
            starts=Array.of(seq_starts),
            token_ids=Array.of(token_ids),
            slots=Array.of(slots),
            num_tokens=Array.of(num_tokens),
            sample=Array.of(sample, "bool"),
            seq_ids=Array.of(seq_ids, "int64"),
            new_seqs=starts,
            block_slots=block_slots,
            block_indices=block_indices,
            block_ids=block_ids,
        )

    # -- state changes --------------------------------------------------------------------

    def _announce(self, request: Request) -> None:
        request.announced = True
        sampling = request.sampling
        prompt_ids = tail = None
        if request.wants_prompt_logprobs:
            prompt_ids = Array.of(request.prompt_token_ids)
        if sampling is not None:
            tail = Array.of(request.prompt_token_ids[-PROMPT_TAIL_TOKENS:])
        if sampling is not None and sampling.max_tokens != request.max_tokens:
            sampling = msgspec.structs.replace(sampling, max_tokens=request.max_tokens)
        self.announcements.append(
            NewRequest(
                request_id=request.request_id,
                client_id=request.client_id,
                seq_ids=[seq.seq_id for seq in request.seqs],
                num_prompt_tokens=request.num_prompt_tokens,
                sampling=sampling,
                pooling=request.pooling,
                arrival_time=request.arrival_time,
                scheduled_time=time.time(),
                prompt_token_ids=prompt_ids,
                prompt_tail=tail,
            )
        )

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by swap when it can (see ``_swap_out``), else by recompute: drop blocks
        and slot now (the executor runs steps in order, so a later plan reusing them cannot
        overtake the step in flight)."""
        self.running.remove(seq)
        if any(writer is seq for _, writer in self._provisional.values()):
            self._provisional = {h: e for h, e in self._provisional.items() if e[1] is not seq}
        swapped = self._swap_out_blocks(seq)
        self.blocks.free(seq.block_ids)
        seq.block_ids = []
        if seq.slot >= 0:  # a sample not yet started (forked this step) holds none
            self.free_slots.append(seq.slot)
        seq.slot = -1
        seq.num_registered = 0
        if not swapped:
            seq.num_computed = 0
        seq.fork_parent = None
        seq.status = Status.PREEMPTED
        self.preempted.appendleft(seq)
        self.counters["preemptions"] += 1
        logger.debug("preempted seq %d of %s", seq.seq_id, seq.request.request_id)

    def _swap_out_blocks(self, seq: Sequence) -> bool:
        """Copy ``seq``'s blocks to host memory (listed in the plan, done before its
        forward, so the blocks can serve another sequence in the same step); False when it
        must recompute instead: swap off or full, a pooling sequence (its running sums are
        per slot), penalties (their token history is per slot), or a prompt still being
        scored (its slot scores from the first prefill only)."""
        request = seq.request
        num_blocks = len(seq.block_ids)
        if (
            not self.swap
            or not num_blocks
            or num_blocks > len(self.free_host_blocks)
            or request.pooling is not None
            or request.beam_search  # another beam may continue it meanwhile
            or (request.sampling is not None and request.sampling.has_penalties)
            or self._scores_prompt(seq)
            or 8 * num_blocks > self._extra_bytes
        ):
            return False
        self._extra_bytes -= 8 * num_blocks
        host = [self.free_host_blocks.popleft() for _ in range(num_blocks)]
        self._swap_out += zip(seq.block_ids, host, strict=True)
        seq.host_block_ids = host
        self.counters["swapped_out_blocks"] += num_blocks
        return True

    def _finish(self, seq: Sequence) -> None:
        was_waiting = seq.status is Status.WAITING
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.PREEMPTED:
            self.preempted.remove(seq)
            self.free_host_blocks.extend(seq.host_block_ids)
            seq.host_block_ids = []
        seq.status = Status.FINISHED
        self.pending_release.append(seq)
        request = seq.request
        if request.finished:
            if was_waiting:  # it stays in the queue, skipped at admission (no O(n) removal)
                self.num_waiting_requests -= 1
                self.num_waiting_tokens -= request.num_prompt_tokens
            if request.params_sent:
                self.released.append(request.key)
            del self.requests[request.client_id, request.request_id]
            request.seqs = []  # no request <-> sequence cycle left for the GC to find
            self.counters["finished"] += 1

    def _release_done(self) -> None:
        """Free finished sequences' blocks and slots once their last step is output-processed."""
        keep = []
        for seq in self.pending_release:
            if seq.last_step > self.done:
                keep.append(seq)
                continue
            self.blocks.free(seq.block_ids)
            seq.block_ids = []
            if seq.slot >= 0:
                self.free_slots.append(seq.slot)
                seq.slot = -1
            seq.fork_parent = None
            del self.seqs[seq.seq_id]
        self.pending_release = keep

    def stats(self) -> dict[str, int | list[int]]:
        return {
            **self.counters,
            "step_tokens": list(self.step_tokens),
            "num_waiting": sum(len(r.seqs) for r in self.waiting),
            "num_running": len(self.running),
            "num_preempted": len(self.preempted),
            "num_swapped": sum(1 for seq in self.preempted if seq.host_block_ids),
            "num_free_blocks": self.blocks.num_free,
            "num_cached_blocks": self.blocks.num_cached,
            "num_blocks": self.blocks.num_blocks,
            "step": self.next_step - 1,
            "done": self.done,
        }


def _urgency(seq: Sequence) -> tuple[int, int, int]:
    """Higher for a sequence that gives way first: lower priority (a higher number), then
    later arrival (the request key counts arrivals), then a later sample."""
    return seq.request.priority, seq.request.key, seq.sample_index
