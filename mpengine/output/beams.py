"""Beam search bookkeeping: transformers' ``_beam_search`` step, one request at a time.

Each beam step, every beam's top ``K`` continuations arrive (token ids and logprobs from
the executor, ``K = max(2, 1 + #stop ids) * width``); this picks, as transformers 5 does
(``_get_top_k_continuations``, ``_get_running_beams_for_next_iteration``,
``_update_finished_beams``, ``_check_early_stop_heuristic``), the ``K`` best
continuations over all beams, the ``width`` best of those that do not stop (the running
beams of the next step) and the finished hypotheses, with the length penalty and the
early-stopping rule. Scores are float32, added and divided in the same order as there.
Tokens live in one ``[width, capacity]`` array per request (no Python object per token),
the capacity doubling as the beams grow: a step costs what the beams hold, not what
``max_tokens`` (all the context left, when unset) would allow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpengine.protocol import SamplingParams

NEG = np.float32(-1.0e9)
INITIAL_CAPACITY = 64  # tokens per beam, before the first doubling


@dataclass(slots=True)
class Hypothesis:
    token_ids: np.ndarray  # int32
    score: float


class BeamGroup:
    def __init__(self, params: SamplingParams, max_tokens: int, stop_ids: frozenset[int]) -> None:
        width = params.num_samples
        self.width = width
        self.num_candidates = params.beam_candidates(len(stop_ids))
        self.max_tokens = max_tokens
        self.stop_ids = np.fromiter(sorted(stop_ids), np.int64, len(stop_ids))
        self.length_penalty = params.length_penalty
        self.early_stopping = params.early_stopping
        self.length = 0  # tokens generated so far by every running beam
        capacity = min(max_tokens, INITIAL_CAPACITY)
        self.tokens = np.zeros((width, capacity), np.int32)
        self.scores = np.full(width, NEG, np.float32)
        self.scores[0] = 0.0  # every beam starts from the prompt: count it once
        self.finished_tokens = np.zeros((width, capacity), np.int32)
        self.finished_lengths = np.zeros(width, np.int64)
        self.finished_scores = np.full(width, NEG, np.float32)
        self.is_finished = np.zeros(width, bool)
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.done = False
        self._ids = np.zeros((width, self.num_candidates), np.int64)
        self._logprobs = np.zeros((width, self.num_candidates), np.float32)
        self._reported = np.zeros(width, bool)

    def report(self, beam: int, top_ids: np.ndarray, top_logprobs: np.ndarray) -> bool:
        """One beam's continuations for this step; True once every beam has reported."""
        self._ids[beam] = top_ids[: self.num_candidates]
        self._logprobs[beam] = top_logprobs[: self.num_candidates]
        self._reported[beam] = True
        return bool(self._reported.all())

    def step(self) -> tuple[np.ndarray, np.ndarray]:
        """Decide the step: returns, per beam of the next step, its parent beam and new
        token (only meaningful while not ``done``)."""
        self._reported[:] = False
        width, k = self.width, self.num_candidates
        if self.length == self.tokens.shape[1]:
            self._grow()
        accumulated = (self.scores[:, None] + self._logprobs).reshape(-1)
        order = np.argsort(-accumulated, kind="stable")[:k]
        top_scores = accumulated[order]
        parents = order // k
        tokens = self._ids.reshape(-1)[order].astype(np.int32)
        stops = np.isin(tokens, self.stop_ids) | (self.length + 1 >= self.max_tokens)

        # The running beams of the next step: the best that did not stop.
        running_scores = top_scores + stops.astype(np.float32) * NEG
        keep = np.argsort(-running_scores, kind="stable")[:width]
        new_tokens = self.tokens[parents[keep]].copy()
        new_tokens[:, self.length] = tokens[keep]

        # Finished hypotheses: candidates among the first `width` that stopped.
        just_finished = stops & (np.arange(k) < width)
        final = _normalised(top_scores, self.length + 1, self.length_penalty)
        if self.is_finished.all() and self.early_stopping is True:
            final = final + NEG
        if not self.improvable:
            final = final + NEG
        final = final + (~just_finished).astype(np.float32) * NEG
        merged = np.concatenate([self.finished_scores, final])
        best = np.argsort(-merged, kind="stable")[:width]
        candidate_tokens = self.tokens[parents].copy()
        candidate_tokens[:, self.length] = tokens
        merged_tokens = np.concatenate([self.finished_tokens, candidate_tokens])
        merged_lengths = np.concatenate(
            [self.finished_lengths, np.full(k, self.length + 1, np.int64)]
        )
        merged_finished = np.concatenate([self.is_finished, just_finished])
        self.finished_scores = merged[best]
        self.finished_tokens = merged_tokens[best]
        self.finished_lengths = merged_lengths[best]
        self.is_finished = merged_finished[best]

        self.tokens, self.scores = new_tokens, running_scores[keep]
        self.length += 1
        self._check_improvable()
        self.done = (
            not self.improvable
            or (self.is_finished.all() and self.early_stopping is True)
            or bool(stops.all())
        )
        return parents[keep], tokens[keep]

    def _grow(self) -> None:
        """Double the token arrays' capacity (up to ``max_tokens``)."""
        capacity = min(self.max_tokens, 2 * self.tokens.shape[1])
        pad = ((0, 0), (0, capacity - self.tokens.shape[1]))
        self.tokens = np.pad(self.tokens, pad)
        self.finished_tokens = np.pad(self.finished_tokens, pad)

    def _check_improvable(self) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_tokens
        else:
            best_length = self.length
        best_running = _normalised(self.scores[0], best_length, self.length_penalty)
        worst = np.where(self.is_finished, self.finished_scores.min(), NEG)
        self.improvable = self.improvable and bool((best_running > worst).any())

    def best(self, n: int) -> list[Hypothesis]:
        """The ``n`` best finished hypotheses, best first."""
        return [
            Hypothesis(self.finished_tokens[i, : self.finished_lengths[i]], float(score))
            for i, score in enumerate(self.finished_scores[:n])
        ]


def _normalised(scores: np.ndarray, length: int, penalty: float) -> np.ndarray:
    """``scores / length ** penalty`` (transformers' ``length_penalty``) in float32. An
    extreme penalty takes the divisor out of float32's range: the scores then become 0 (all
    tied, kept in rank order) or are held at ``NEG / 2``, above the empty slots' ``NEG``;
    never an error."""
    with np.errstate(over="ignore", under="ignore", divide="ignore", invalid="ignore"):
        return np.fmax(scores / np.float32(np.power(np.float64(length), penalty)), NEG / 2)
