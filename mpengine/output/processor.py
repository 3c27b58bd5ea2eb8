"""The output processor stage: step results in, client deltas and scheduler feedback out.

Per step (``process``):

1. collect prompt logprobs (they precede the first sampled token of a request);
2. finish the sequences of a failed step with ``error``;
3. for each sampled token of a sequence still open: append it, detokenize it, run the stop
   checks, and build the sequence's delta;
4. build the ``Feedback``: accepted tokens, and the sequences that finished in this step
   or were dropped with their client since the last feedback.

Stop checks per token, in vLLM's order of precedence: EOS (unless ``ignore_eos``), then
``stop_token_ids``, then stop strings, then ``max_tokens``. None but ``max_tokens`` ends a
sequence within its first ``min_tokens`` tokens. An EOS or stop token stays in
``token_ids``, but its text is not sent unless ``include_stop_str_in_output``; a stop string
cuts the text before it (or after it, with ``include_stop_str_in_output``). Without stop
strings, the final text is the text those tokens (less the stop token) add after the
prompt's last tokens (``detokenizer.py``): ``tokenizer.decode(token_ids)`` for byte-level
tokenizers; for SentencePiece-style ones the first word keeps its leading space. Invalid
UTF-8 from byte-fallback tokens may read differently (one U+FFFD per byte or per group),
as in vLLM.

A finished sequence is forgotten: under async depth 1 the scheduler may already have
planned one more step for it, and that token is neither sent nor accepted.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from struct import Struct

import msgspec
import numpy as np

from mpengine.output.beams import BeamGroup
from mpengine.output.detokenizer import Detokenizer, DetokenizerStream
from mpengine.output.logprobs import concat_logprobs, join_logprobs, logprob_row
from mpengine.output.stop import StopStrings, TextState
from mpengine.protocol import (
    EMPTY_IDS,
    GONE_CLIENTS_PER_FEEDBACK,
    AbortRequests,
    Array,
    Feedback,
    FinishReason,
    Logprobs,
    NewRequest,
    OutputDelta,
    PromptLogprobs,
    Resync,
    ResyncRequest,
    StepResult,
)

log = logging.getLogger(__name__)
_pack_i32 = Struct("<i").pack
Output = tuple[str, OutputDelta]  # (client id, delta)
GONE_CLIENTS_KEPT = 4096


@dataclass(slots=True)
class _Request:
    msg: NewRequest
    num_open: int  # samples still running
    # What the per-token path needs, flattened out of msg.sampling.
    stops: StopStrings | None = None
    stop_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) and stop_token_ids
    eos_ids: frozenset[int] = frozenset()  # EOS ids that stop this request
    min_tokens: int = 0
    max_tokens: int = 0  # max_tokens, capped by max_model_len
    include_stop: bool = False
    num_logprobs: int | None = None
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    prompt_logprobs_due: bool = False  # asked for and not sent yet (sample 0's first delta)
    # best_of > n: every sample's deltas are held until the last one ends, then the n with
    # the highest cumulative logprob are sent, as one final delta each.
    ranked: list[_Sequence] | None = None
    beams: BeamGroup | None = None  # beam search: its state, decided here each step
    # The prompt's last tokens (``NewRequest.prompt_tail``): an output's text follows them.
    context: list[int] = field(default_factory=list)
    # It started over after this step (``ResyncRequest.restarted_after``): results of that
    # step and earlier are for its old state.
    restarted_after: int = 0


@dataclass(slots=True)
class _Sequence:
    seq_id: int
    index: int  # the sample index within the request
    request: _Request
    stream: DetokenizerStream | None  # None for pooling requests
    token_ids: list[int] = field(default_factory=list)
    text: TextState = field(default_factory=TextState)
    first_token_time: float = 0.0
    cumulative_logprob: float = 0.0
    held: list[OutputDelta] = field(default_factory=list)  # ranked requests only


@dataclass(slots=True)
class _StepNews:
    """What one step's result produced: client deltas and the scheduler's feedback."""

    now: float
    finished_ids: list[int]  # with reasons: the sequences that ended (or were dropped)
    reasons: list[FinishReason] = field(default_factory=list)
    outputs: list[Output] = field(default_factory=list)
    accepted_seqs: list[int] = field(default_factory=list)  # with accepted_tokens
    accepted_tokens: list[int] = field(default_factory=list)
    beam_steps: list[tuple[_Request, np.ndarray, np.ndarray]] = field(default_factory=list)
    scored: list[tuple[int, float]] = field(default_factory=list)  # ranked samples' tokens

    def finished(self, seq_id: int, reason: FinishReason) -> None:
        self.finished_ids.append(seq_id)
        self.reasons.append(reason)


class OutputProcessor:
    """Turns ``StepResult`` frames into ``OutputDelta`` s and ``Feedback``.

    ``max_model_len`` (optional) also ends a sequence with ``length`` when prompt plus
    output reach it; the scheduler normally caps ``max_tokens`` before that.
    """

    def __init__(
        self, tokenizer_path: str, eos_token_ids: list[int], max_model_len: int | None = None
    ) -> None:
        self.detokenizer = Detokenizer.from_path(tokenizer_path)
        self.detokenizer.stream(skip_special_tokens=True)  # build the common table now
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        # Requests by (client id, request id): ids are scoped to their client.
        self._requests: dict[tuple[str, str], _Request] = {}
        self._by_client: dict[str, set[tuple[str, str]]] = {}
        self._seqs: dict[int, _Sequence] = {}  # open sequences only
        self._dropped: list[int] = []  # seq ids of dropped clients, for the next feedback
        # Clients found gone (the latest GONE_CLIENTS_KEPT; the client library's connections
        # never reuse a routing id, a raw client that does greets again first, see
        # ``client_back``), and those the scheduler has not been told of yet.
        self._gone: OrderedDict[str, None] = OrderedDict()
        self._gone_news: list[str] = []
        self._id_arrays: dict[int, Array] = {}  # token id -> its one-element Array
        # Restarted (a ``Resync`` came): deltas say where they start, as the client may
        # have some of their tokens already.
        self.numbered = False

    @property
    def num_unfinished(self) -> int:
        """Requests with at least one sample still running."""
        return len(self._requests)

    # -- announcements and clients -------------------------------------------------------

    def announce(self, msg: NewRequest | AbortRequests | Resync) -> list[Output]:
        """Register a new request, end aborted ones (returning their final deltas), or
        carry on from a predecessor (``resync``).

        Aborts come from the scheduler, which already freed the sequences: they are not
        reported back in the feedback. Unknown request ids are ignored.
        """
        match msg:
            case Resync():
                return self.resync(msg)
            case NewRequest():
                self._register(msg)
                if msg.client_id in self._gone:  # queued before the scheduler heard of it
                    self.abort_client(msg.client_id, "the client disconnected")
                return []
            case AbortRequests(client_id=client_id, request_ids=request_ids):
                now = time.time()
                outputs: list[Output] = []
                for request_id in request_ids:
                    request = self._requests.get((client_id, request_id))
                    if request is None:
                        continue
                    for seq in self._open_seqs(request):
                        delta = self._finish(seq, msg.reason, None, now, self._drain(seq))
                        delta.error = msg.message or None
                        outputs += self._emit(seq, delta)
                return outputs

    def resync(self, msg: Resync) -> list[Output]:
        """Carry on from a predecessor that died: register each request the scheduler
        lists (replacing one registered from an announcement it had not read), replay each
        open sample's tokens through the detokenizer and stop checks, and send each one
        everything so far (``num_prior_tokens=0``: the client keeps what it lacks)."""
        self.numbered = True
        now = time.time()
        outputs: list[Output] = []
        for entry in msg.requests:
            new = entry.request
            key = (new.client_id, new.request_id)
            if (old := self._requests.get(key)) is not None:
                for seq in self._open_seqs(old):
                    del self._seqs[seq.seq_id]
                del self._requests[key]
                self._by_client[new.client_id].discard(key)
            self._register(new)
            request = self._requests.get(key)
            if request is None:
                continue
            request.restarted_after = entry.restarted_after
            if request.ranked is not None:
                outputs += self._replay_ranked(request, entry, now)
                continue
            for index in entry.ended:
                del self._seqs[new.seq_ids[index]]
                request.num_open -= 1
            for seq in self._open_seqs(request):
                tokens = entry.outputs[seq.index].numpy().tolist()
                if not tokens:
                    continue
                if seq.index == 0:
                    request.prompt_logprobs_due = False  # sent with the first token
                text = []
                for token_id in tokens:
                    delta = self._on_token(seq, token_id, now)
                    text.append(delta.text)
                    if delta.finish_reason is not None:  # (fed back before, never: defensive)
                        self._dropped.append(seq.seq_id)
                        break
                replay = msgspec.structs.replace(
                    delta, token_ids=Array.of(seq.token_ids), text="".join(text)
                )
                replay.num_prior_tokens = 0
                outputs += self._emit(seq, replay)
        log.info("carrying on with %d requests", len(msg.requests))
        return outputs

    def _replay_ranked(self, request: _Request, entry: ResyncRequest, now: float) -> list[Output]:
        """A request whose samples are ranked at their end: every sample's tokens again,
        each delta held back as they were (an ended sample ends again at its last token),
        with the cumulative logprobs fed back; its result if every sample has ended."""
        outputs: list[Output] = []
        for seq in self._open_seqs(request):
            seq.cumulative_logprob = entry.scores[seq.index] if entry.scores else 0.0
            for token_id in entry.outputs[seq.index].numpy().tolist():
                delta = self._on_token(seq, token_id, now)
                outputs += self._emit(seq, delta)
                if delta.finish_reason is not None:
                    break
            if seq.index in entry.ended and seq.seq_id in self._seqs:  # (aborted, failed)
                outputs += self._emit(seq, self._finish(seq, "abort", None, now, self._drain(seq)))
        return outputs

    def abort_client(self, client_id: str, message: str) -> list[Output]:
        """End every request of a client here (it stopped reading, or is gone); return the
        final deltas. The scheduler learns of them through the next feedback."""
        now = time.time()
        outputs: list[Output] = []
        for key in list(self._by_client.get(client_id, ())):
            for seq in self._open_seqs(self._requests[key]):
                delta = self._finish(seq, "abort", None, now, self._drain(seq))
                delta.error = message
                outputs += self._emit(seq, delta)
                self._dropped.append(seq.seq_id)
        return outputs

    def drop_client(self, client_id: str) -> bool:
        """The client is gone: abort its requests silently, and have the next feedback tell
        the scheduler to drop those it still queues. Returns whether this is news."""
        self.abort_client(client_id, "the client disconnected")
        if client_id in self._gone:
            return False
        self._gone[client_id] = None
        if len(self._gone) > GONE_CLIENTS_KEPT:
            self._gone.popitem(last=False)
        self._gone_news.append(client_id)
        return True

    def client_back(self, client_id: str) -> None:
        """A connection greeted under ``client_id``: whatever was found gone under it, this
        one is a new client (whose requests come after its greeting)."""
        if client_id in self._gone:
            del self._gone[client_id]
            if client_id in self._gone_news:  # (not told yet: the scheduler never will be)
                self._gone_news.remove(client_id)

    # -- the step ------------------------------------------------------------------------

    def process(self, result: StepResult) -> tuple[Feedback, list[Output]]:
        """Handle one step's result; returns the scheduler's feedback and client deltas."""
        step = _StepNews(now=time.time(), finished_ids=self._dropped)
        step.reasons = ["abort"] * len(step.finished_ids)
        self._dropped = []

        # 1. prompt logprobs
        for chunk in result.prompt_logprobs:
            seq = self._seqs.get(chunk.seq_id)
            if seq is not None and seq.index == 0:  # sample 0 scores the prompt
                seq.request.prompt_logprobs.append(chunk)

        # 2. sequences that failed in this step
        failed = result.failed_seq_ids.numpy().tolist()
        for seq_id, error in zip(failed, result.errors, strict=True):
            seq = self._seqs.get(seq_id)
            if seq is not None and not 0 < result.step <= seq.request.restarted_after:
                # A beam fails its whole search: the others would wait for it forever.
                group = self._open_seqs(seq.request) if seq.request.beams is not None else [seq]
                self._fail(group, error, step)

        # 3. sampled tokens
        self._take_tokens(result, step)

        # 4. embeddings (the scheduler finished those sequences when it planned them)
        if result.embeddings is not None:
            vectors = result.embeddings.numpy()
            for row, seq_id in enumerate(result.pooled_seq_ids.numpy().tolist()):
                seq = self._seqs.get(seq_id)
                if seq is not None:
                    step.outputs += self._emit(seq, self._embedding(seq, vectors[row], step.now))

        # 5. feedback
        return self._feedback(result.step, step), step.outputs

    def _take_tokens(self, result: StepResult, step: _StepNews) -> None:
        """Each sampled token to its sequence (beam searches decide their step here)."""
        logprobs = result.logprobs
        rows: dict[int, int] = {}
        if logprobs is not None:
            rows = {pos: row for row, pos in enumerate(result.logprob_rows.numpy().tolist())}
        seq_ids = result.seq_ids.numpy().tolist()
        token_ids = result.token_ids.numpy().tolist()
        seqs = self._seqs
        for pos, (seq_id, token_id) in enumerate(zip(seq_ids, token_ids, strict=True)):
            seq = seqs.get(seq_id)
            if seq is None:  # finished, aborted or dropped: this token is never visible
                continue
            request = seq.request
            if 0 < result.step <= request.restarted_after:
                continue  # for the state it had before it started over
            row = rows.get(pos)
            try:
                if request.beams is not None:
                    # (the executor always returns a beam's continuations)
                    if logprobs is not None and row is not None:
                        self._beam_row(seq, logprobs, row, step)
                    continue
                step.accepted_seqs.append(seq_id)
                step.accepted_tokens.append(token_id)
                delta = self._on_token(seq, token_id, step.now)
                if self.numbered:
                    delta.num_prior_tokens = len(seq.token_ids) - 1
                if logprobs is not None and row is not None:
                    if request.num_logprobs is not None:
                        delta.logprobs = logprob_row(logprobs, row, request.num_logprobs)
                    if request.ranked is not None:
                        score = logprobs.logprobs.numpy()[row].item()
                        seq.cumulative_logprob += score
                        step.scored.append((seq_id, score))
                if request.prompt_logprobs_due and seq.index == 0:
                    self._attach_prompt_logprobs(seq, delta)
                if delta.finish_reason is not None:
                    step.finished(seq_id, delta.finish_reason)
                step.outputs += self._emit(seq, delta)
            except Exception as exc:  # a bug, or input nothing checked: this request only
                log.exception("request %s failed in the output processor", request.msg.request_id)
                error = f"internal error in the output processor: {type(exc).__name__}: {exc}"
                finished = set(step.finished_ids)
                group = [s for s in self._open_seqs(request) if s.seq_id not in finished]
                self._fail(group, error, step)

    def _beam_row(self, seq: _Sequence, logprobs: Logprobs, row: int, step: _StepNews) -> None:
        """One beam's continuations; the last beam of a search reported decides its step."""
        request = seq.request
        beams: BeamGroup = request.beams  # type: ignore[assignment]
        top_ids = logprobs.top_ids.numpy()[row]
        if not beams.report(seq.index, top_ids, logprobs.top_logprobs.numpy()[row]):
            return
        parents, tokens = beams.step()
        if not beams.done:
            step.beam_steps.append((request, parents, tokens))
            return
        for delta_seq, delta in self._finish_beams(request, step.now):
            step.finished(delta_seq, delta.finish_reason or "stop")
            if delta.index < request.msg.sampling.n:  # type: ignore[union-attr]
                step.outputs.append((request.msg.client_id, delta))

    def _feedback(self, step_number: int, step: _StepNews) -> Feedback:
        """What the scheduler learns of this step (and of clients gone since the last)."""
        feedback = Feedback(
            step=step_number,
            seq_ids=Array.of(step.accepted_seqs, "int64"),
            token_ids=Array.of(step.accepted_tokens, "int32"),
            finished_seq_ids=step.finished_ids,
            finish_reasons=step.reasons,
        )
        if step.scored:
            feedback.scored_seq_ids = [seq_id for seq_id, _ in step.scored]
            feedback.scores = [score for _, score in step.scored]
        if self._gone_news:
            feedback.gone_clients = self._gone_news[:GONE_CLIENTS_PER_FEEDBACK]
            del self._gone_news[:GONE_CLIENTS_PER_FEEDBACK]
        if step.beam_steps:
            beam_seq_ids: list[int] = []
            beam_parents: list[int] = []
            beam_tokens: list[int] = []
            for request, parents, tokens in step.beam_steps:
                ids = request.msg.seq_ids
                beam_seq_ids += ids
                beam_parents += [ids[p] for p in parents.tolist()]
                beam_tokens += tokens.tolist()
            feedback.beam_seq_ids = Array.of(beam_seq_ids, "int64")
            feedback.beam_parents = Array.of(beam_parents, "int64")
            feedback.beam_tokens = Array.of(beam_tokens, "int32")
        return feedback

    # -- per sequence --------------------------------------------------------------------

    def _on_token(self, seq: _Sequence, token_id: int, now: float) -> OutputDelta:
        """Accept one token: detokenize, run the stop checks, return the delta."""
        request = seq.request
        stream: DetokenizerStream = seq.stream  # type: ignore[assignment]
        tokens = seq.token_ids
        if not tokens:
            seq.first_token_time = now
        tokens.append(token_id)
        ids = self._id_arrays.get(token_id)
        if ids is None:  # frozen, so one Array per token id serves every delta
            ids = self._id_arrays[token_id] = Array("int32", (1,), _pack_i32(token_id))
        may_stop = len(tokens) > request.min_tokens
        if may_stop and token_id in request.stop_ids:
            # The stop token's own text is sent only with include_stop_str_in_output,
            # and then nothing is held back, so no held text precedes it.
            text = stream.push(token_id) if request.include_stop else ""
            stop_reason = None if token_id in request.eos_ids else token_id
            return self._finish(seq, "stop", stop_reason, now, text + self._drain(seq), ids)
        text = stream.push(token_id)
        stops = request.stops
        if text and stops is not None:
            text, stop = stops.scan(seq.text, text, may_stop)
            if stop is not None:
                return self._finish(seq, "stop", stop, now, text, ids)
        if len(tokens) >= request.max_tokens:
            return self._finish(seq, "length", None, now, text + self._drain(seq), ids)
        return OutputDelta(request.msg.request_id, seq.index, ids, text)

    def _drain(self, seq: _Sequence) -> str:
        """The text a sequence still holds back, now final: held stop-string prefixes, then
        incomplete bytes (which decode to U+FFFD, as a full decode would)."""
        if seq.stream is None:
            return ""
        stops = seq.request.stops
        held = stops.release(seq.text) if stops is not None else ""
        return held + seq.stream.flush()

    def _finish(
        self,
        seq: _Sequence,
        reason: FinishReason,
        stop_reason: str | int | None,
        now: float,
        text: str,
        token_ids: Array = EMPTY_IDS,
    ) -> OutputDelta:
        """Close a sequence (and its request after the last sample); its final delta."""
        request = seq.request
        msg = request.msg
        del self._seqs[seq.seq_id]
        request.num_open -= 1
        if request.num_open == 0:
            key = (msg.client_id, msg.request_id)
            del self._requests[key]
            keys = self._by_client[msg.client_id]
            keys.discard(key)
            if not keys:
                del self._by_client[msg.client_id]
        delta = OutputDelta(
            msg.request_id,
            seq.index,
            token_ids,
            text,
            finish_reason=reason,
            stop_reason=stop_reason,
            num_prompt_tokens=msg.num_prompt_tokens,
            arrival_time=msg.arrival_time,
            scheduled_time=msg.scheduled_time,
            first_token_time=seq.first_token_time,
            finished_time=now,
        )
        if request.prompt_logprobs_due and seq.index == 0:
            self._attach_prompt_logprobs(seq, delta)
        return delta

    def _finish_beams(self, request: _Request, now: float) -> list[tuple[int, OutputDelta]]:
        """A finished beam search: every beam's sequence closes; the first ``n`` carry the
        best hypotheses, whole (text decoded at once), scored by their penalised logprob."""
        beams = request.beams
        assert beams is not None and request.msg.sampling is not None
        sampling = request.msg.sampling
        best = beams.best(sampling.n)
        out = []
        for seq in self._open_seqs(request):
            if seq.index >= len(best):
                out.append((seq.seq_id, self._finish(seq, "stop", None, now, "")))
                continue
            hypothesis = best[seq.index]
            ids = hypothesis.token_ids
            last = int(ids[-1]) if len(ids) else -1
            stopped = last in request.stop_ids
            stream = self.detokenizer.stream(sampling.skip_special_tokens, request.context)
            kept = ids if (not stopped or request.include_stop) else ids[:-1]
            text = "".join(stream.push(int(t)) for t in kept) + stream.flush()
            stop_reason = last if stopped and last not in request.eos_ids else None
            # A beam's tokens reach the client only now, all at once: its first token too.
            seq.first_token_time = seq.first_token_time or now
            delta = self._finish(
                seq, "stop" if stopped else "length", stop_reason, now, text, Array.of(ids)
            )
            delta.cumulative_logprob = hypothesis.score
            delta.num_generated_tokens = len(ids)  # what usage counts: the returned beams
            out.append((seq.seq_id, delta))
        request.beams = None
        return out

    def _embedding(self, seq: _Sequence, vector: np.ndarray, now: float) -> OutputDelta:
        """A pooling request ends with its one embedding, cut to its ``dimensions``."""
        seq.first_token_time = now
        delta = self._finish(seq, "stop", None, now, "")
        pooling = seq.request.msg.pooling
        dims = (pooling.dimensions if pooling is not None else None) or len(vector)
        delta.embedding = Array("float32", (dims,), vector[:dims].tobytes())
        return delta

    def _emit(self, seq: _Sequence, delta: OutputDelta) -> list[Output]:
        """What a sequence's delta sends: itself, or for a ranked request nothing until its
        last sample ends, then the best ``n``."""
        request = seq.request
        sampling = request.msg.sampling
        if sampling is not None and sampling.use_beam_search and delta.index >= sampling.n:
            return []  # a beam past the n returned (aborted, or failed)
        if request.ranked is None:
            return [(request.msg.client_id, delta)]
        seq.held.append(delta)
        return self._best(request) if request.num_open == 0 else []

    def _best(self, request: _Request) -> list[Output]:
        """The ``n`` samples with the highest cumulative logprob, each as one final delta
        (renumbered 0..n-1), the tokens of all samples counted on index 0's. Failed samples
        rank last (with no tokens, their cumulative logprob is the highest there is)."""
        assert request.ranked is not None and request.msg.sampling is not None
        ranked = sorted(
            request.ranked,
            key=lambda seq: (seq.held[-1].finish_reason == "error", -seq.cumulative_logprob),
        )
        prompt_logprobs = next(
            (d.prompt_logprobs for s in ranked for d in s.held if d.prompt_logprobs), None
        )
        outputs: list[Output] = []
        for index, seq in enumerate(ranked[: request.msg.sampling.n]):
            last = seq.held[-1]
            rows = [d.logprobs for d in seq.held if d.logprobs is not None]
            final = msgspec.structs.replace(
                last,
                index=index,
                token_ids=Array.of(seq.token_ids),
                text="".join(d.text for d in seq.held),
                logprobs=join_logprobs(rows) if rows else None,
                prompt_logprobs=prompt_logprobs if index == 0 else None,
                cumulative_logprob=seq.cumulative_logprob,
                num_generated_tokens=(sum(len(s.token_ids) for s in ranked) if index == 0 else 0),
            )
            outputs.append((request.msg.client_id, final))
        request.ranked = None  # the samples' state is no longer needed
        return outputs

    # -- helpers -------------------------------------------------------------------------

    def _register(self, msg: NewRequest) -> None:
        request = _Request(msg=msg, num_open=len(msg.seq_ids))
        sampling = msg.sampling
        if sampling is not None:
            if sampling.stop:
                stops = tuple(sampling.stop)
                request.stops = StopStrings(stops, sampling.include_stop_str_in_output)
            request.eos_ids = frozenset() if sampling.ignore_eos else self.eos_token_ids
            request.stop_ids = request.eos_ids | frozenset(sampling.stop_token_ids)
            request.min_tokens = sampling.min_tokens
            request.max_tokens = sampling.max_tokens
            if self.max_model_len is not None:
                room = max(1, self.max_model_len - msg.num_prompt_tokens)
                request.max_tokens = min(request.max_tokens, room)
            request.include_stop = sampling.include_stop_str_in_output
            request.num_logprobs = sampling.logprobs
            request.prompt_logprobs_due = sampling.prompt_logprobs is not None
            if sampling.ranks_samples:
                request.ranked = []
            if sampling.use_beam_search:
                request.beams = BeamGroup(sampling, request.max_tokens, request.stop_ids)
            if msg.prompt_tail is not None:
                request.context = msg.prompt_tail.numpy().tolist()
        key = (msg.client_id, msg.request_id)
        if key in self._requests:
            # The scheduler rejects duplicate ids; never let one clobber a live request.
            log.warning("ignoring a second request with id %r", msg.request_id)
            return
        if request.num_open == 0:
            return
        self._requests[key] = request
        self._by_client.setdefault(msg.client_id, set()).add(key)
        for index, seq_id in enumerate(msg.seq_ids):
            stream = None
            if sampling is not None:
                stream = self.detokenizer.stream(sampling.skip_special_tokens, request.context)
            seq = self._seqs[seq_id] = _Sequence(seq_id, index, request, stream)
            if request.ranked is not None:
                request.ranked.append(seq)

    def _fail(self, seqs: list[_Sequence], error: str, step: _StepNews) -> None:
        """Finish ``seqs`` with ``error``: their final deltas, and the scheduler's news."""
        for seq in seqs:
            delta = self._finish(seq, "error", None, step.now, self._drain(seq))
            delta.error = error
            step.outputs += self._emit(seq, delta)
            step.finished(seq.seq_id, "error")

    def _open_seqs(self, request: _Request) -> list[_Sequence]:
        seqs = (self._seqs.get(seq_id) for seq_id in request.msg.seq_ids)
        return [seq for seq in seqs if seq is not None and seq.request is request]

    def _attach_prompt_logprobs(self, seq: _Sequence, delta: OutputDelta) -> None:
        request = seq.request
        num_top: int = request.msg.sampling.prompt_logprobs  # type: ignore[union-attr,assignment]
        request.prompt_logprobs_due = False
        delta.prompt_logprobs = concat_logprobs(request.prompt_logprobs, num_top)
        request.prompt_logprobs = []
