"""The executor's grammar matchers: one per sequence with structured outputs.

A matcher advances by the tokens its sequence has computed, read from the slot's token
history (``SlotState.history``), and then fills the bitmask of the tokens that may come
next. On a GPU, or where a CPU has a core to spare beside the torch threads and the two
other stages, both happen in one worker thread while the step's forward pass runs (llguidance
releases the GIL while it computes a mask, as torch does in its kernels), so a step waits
only for what is left of the masks when its logits are ready. Without one, the worker
would take a core from the forward and the GIL from its Python: measured on two cores
(tiny model, 16 constrained requests), 2,260 tok/s with the thread against 3,418 with the
masks filled at once, before the forward (unconstrained: 4,654).

The masks of a step are computed by one call into llguidance, across its threads (the
spare cores beside a forward; before one, the torch threads' cores): on two cores, tiny
model, 64 constrained requests, alike with one thread (7,292-7,974 tok/s against
7,413-7,655); on a GPU host a step of hundreds of rows is what it is for.

Matchers are kept by sequence, not by slot, until their request is released: a preempted
sequence resumes, in any slot, with its matcher where it was; the token it sampled last,
which no step had computed yet, is read from the new slot's history once its recompute
computes it.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import torch

from mpengine.protocol import RequestParams
from mpengine.structured.grammars import grammar_text

logger = logging.getLogger(__name__)

MASK_TIMEOUT_S = 60.0  # a mask not ready by then is a failed step, not a hang
MAX_COMPILED = 64  # grammars kept compiled, the most recently used


class GrammarError(RuntimeError):
    """A sequence's matcher failed (a token its grammar does not allow, a library error)."""


@dataclass(slots=True)
class _Matcher:
    grammar: str
    matcher: llguidance.LLMatcher | None = None  # built by the worker, on first use
    consumed: int = 0  # output tokens it has consumed
    ended: bool = False  # the last one was an EOS


@dataclass(slots=True)
class Masks:
    """The masks of a step's constrained rows, on their way from the worker."""

    rows: np.ndarray  # int64, indexes into the step's sampling rows
    future: Future[tuple[torch.Tensor, dict[int, str]]]
    allowed: torch.Tensor | None = None  # bool [len(rows), vocab]
    errors: dict[int, str] = field(default_factory=dict)  # row -> why its matcher failed

    def wait(self) -> None:
        if self.allowed is None:
            self.allowed, self.errors = self.future.result(timeout=MASK_TIMEOUT_S)

    def select(self, rows: np.ndarray) -> tuple[np.ndarray, torch.Tensor | None]:
        """For the sampling rows ``rows`` (a subset, in order): the positions among them
        of the constrained ones, and their masks; raises :class:`GrammarError` if one of
        their matchers failed."""
        self.wait()
        assert self.allowed is not None
        mine = np.flatnonzero(np.isin(self.rows, rows))
        failed = [self.errors[k] for k in mine.tolist() if k in self.errors]
        if failed:
            raise GrammarError(failed[0])
        if not len(mine):
            return np.zeros(0, np.int64), None
        return np.searchsorted(rows, self.rows[mine]), self.allowed[torch.from_numpy(mine)]


class GrammarMatchers:
    """The matchers of one executor (``tokenizer``: the model's tokenizer directory,
    loaded on the first structured request; ``vocab_size``: the logits' width; ``overlap``:
    fill the masks in a worker thread beside the forward pass, else at once; ``threads``:
    llguidance's threads that compute them)."""

    def __init__(
        self,
        tokenizer: str,
        vocab_size: int,
        eos_token_ids: list[int],
        overlap: bool,
        threads: int = 1,
    ) -> None:
        self.overlap = overlap
        self.mask_threads = threads
        self.tokenizer_path = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.matchers: dict[int, _Matcher] = {}  # seq id ->
        self.by_request: dict[int, list[int]] = {}  # request key -> seq ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._prototypes: dict[str, llguidance.LLMatcher] = {}  # grammar -> fresh matcher
        self._worker: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None  # llguidance's mask threads

    def start(self, seq_id: int, request: RequestParams) -> None:
        """A sequence takes a slot: a fresh matcher if its request is constrained, the one
        it had if it resumes."""
        spec = request.sampling.structured_outputs if request.sampling is not None else None
        if spec is None or seq_id in self.matchers:
            return
        self.matchers[seq_id] = _Matcher(grammar_text(spec))
        self.by_request.setdefault(request.key, []).append(seq_id)

    def release(self, request_keys: list[int]) -> None:
        for key in request_keys:
            for seq_id in self.by_request.pop(key, ()):
                self.matchers.pop(seq_id, None)

    def fill(
        self,
        seq_ids: np.ndarray,
        slots: np.ndarray,
        num_prompt: np.ndarray,
        num_output: np.ndarray,
        history: np.ndarray,
    ) -> Masks | None:
        """Start the masks of the sampling rows (``seq_ids``, ``slots``, their prompt and
        output lengths before this sample) whose sequences are constrained; None if none."""
        if not self.matchers:
            return None
        rows = np.flatnonzero([int(s) in self.matchers for s in seq_ids])
        if not len(rows):
            return None
        jobs = [
            (
                self.matchers[int(seq_ids[r])],
                history[slots[r], num_prompt[r] : num_prompt[r] + num_output[r]],
                int(num_output[r]),
            )
            for r in rows
        ]
        rows = rows.astype(np.int64)
        if not self.overlap:
            done: Future[tuple[torch.Tensor, dict[int, str]]] = Future()
            done.set_result(self._fill(jobs))
            return Masks(rows, done)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="mpengine-grammar")
        return Masks(rows, self._worker.submit(self._fill, jobs))

    def _fill(
        self, jobs: list[tuple[_Matcher, np.ndarray, int]]
    ) -> tuple[torch.Tensor, dict[int, str]]:
        """Each job's matcher advanced and its mask filled: the masks as booleans, and the
        errors of the rows whose matcher failed (their mask allows everything)."""
        bitmask = llguidance.numpy.allocate_token_bitmask(len(jobs), self.vocab_size)
        errors: dict[int, str] = {}
        filling: list[tuple[llguidance.LLMatcher, int]] = []
        for k, (state, outputs, num_output) in enumerate(jobs):
            try:
                matcher = self._advance(state, outputs, num_output)
            except Exception as exc:
                errors[k] = self._failed(exc)
                continue  # (the row fails; its mask, all ones, will do)
            # After the EOS that ended its sequence a row was planned ahead of that token
            # (async depth 1): its draw is discarded, any mask will do.
            if not state.ended:
                filling.append((matcher, k))
        if filling:  # one call for every mask, computed in llguidance's threads
            llguidance.numpy.fill_next_token_bitmask_par(self._llg_executor(), filling, bitmask)
        for matcher, k in filling:
            if matcher.is_error():
                errors[k] = self._failed(ValueError(matcher.get_error()))
                bitmask[k] = -1
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, : self.vocab_size].view(np.bool_)), errors

    @staticmethod
    def _failed(exc: Exception) -> str:
        logger.warning("grammar matcher failed: %s", exc)
        return f"structured outputs: {exc}"

    def _llg_executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self.mask_threads)
        return self._executor

    def _advance(
        self, state: _Matcher, outputs: np.ndarray, num_output: int
    ) -> llguidance.LLMatcher:
        """The matcher with every output token before this sample consumed."""
        if state.matcher is None:
            state.matcher = self._compiled(state.grammar).deep_copy()
        matcher = state.matcher
        for token in outputs[state.consumed :].tolist():
            if state.ended:
                break
            if not matcher.consume_token(token):
                raise ValueError(matcher.get_error() or f"token {token} is not allowed here")
            state.ended = token in self.eos_token_ids
        state.consumed = max(state.consumed, num_output)
        return matcher

    def _compiled(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher of ``grammar``, kept to copy: compiling one for a JSON schema of
        30 fields took 1.3 ms (SmolLM2's vocabulary), a copy 2 us; the ``n`` samples of a
        request and the requests that share a schema compile it once."""
        matcher = self._prototypes.pop(grammar, None)
        if matcher is None:
            matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar)
        self._prototypes[grammar] = matcher  # the most recent last
        while len(self._prototypes) > MAX_COMPILED:
            self._prototypes.pop(next(iter(self._prototypes)))
        return matcher

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            started = time.perf_counter()
            hf = AutoTokenizer.from_pretrained(self.tokenizer_path)
            self._tokenizer = llguidance.hf.from_tokenizer(
                hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
            )
            logger.info("grammar tokenizer ready in %.2f s", time.perf_counter() - started)
        return self._tokenizer
