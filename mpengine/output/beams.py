"""Beam search bookkeeping: transformers' ``_beam_search`` step, one request at a time.

Each beam step, every beam's top ``K`` continuations arrive (token ids and logprobs from
the executor, ``K = max(2, 1 + #stop ids) * width``); this picks, as transformers 5 does
(``_get_top_k_continuations``, ``_get_running_beams_for_next_iteration``,
``_update_finished_beams``, ``_check_early_stop_heuristic``), the ``K`` best
continuations over all beams, the ``width`` best of those that do not stop (the running
beams of the next step) and the finished hypotheses, with the length penalty and the
early-stopping rule. Scores are float32, added and divided in the same order as there.
Tokens are kept as back-pointers: for each step, every running beam's parent beam and new
token (two ``[capacity, width]`` arrays per request, the capacity doubling as the beams
grow; no Python object per token). A finished hypothesis is the step and beam it left
from plus its last token; its tokens are read back only when the search ends. A step
costs the same at any length, not what the beams hold nor what ``max_tokens`` (all the
context left, when unset) would allow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpengine.protocol import SamplingParams

NEG = np.float32(-1.0e9)
INITIAL_CAPACITY = 64  # tokens per beam, before the first doubling
EMPTY = -2  # a finished-hypothesis slot not filled yet


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
        # Row t: each running beam's parent among the beams of row t - 1, and its token t.
        self.parents = np.zeros((capacity, width), np.int32)
        self.tokens = np.zeros((capacity, width), np.int32)
        self.scores = np.full(width, NEG, np.float32)
        self.scores[0] = 0.0  # every beam starts from the prompt: count it once
        # Finished hypotheses: the tokens of beam `finished_beams` after row `finished_rows`
        # (-1: none), then `finished_last`; row EMPTY: an empty slot.
        self.finished_rows = np.full(width, EMPTY, np.int64)
        self.finished_beams = np.zeros(width, np.int64)
        self.finished_last = np.zeros(width, np.int32)
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
        if self.length == self.tokens.shape[0]:
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
        self.parents[self.length] = parents[keep]
        self.tokens[self.length] = tokens[keep]

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
        self.finished_scores = merged[best]
        self.finished_rows = np.concatenate([self.finished_rows, np.full(k, self.length - 1)])[best]
        self.finished_beams = np.concatenate([self.finished_beams, parents])[best]
        self.finished_last = np.concatenate([self.finished_last, tokens])[best]
        self.is_finished = np.concatenate([self.is_finished, just_finished])[best]

        self.scores = running_scores[keep]
        self.length += 1
        self._check_improvable()
        self.done = (
            not self.improvable
            or (self.is_finished.all() and self.early_stopping is True)
            or bool(stops.all())
        )
        return parents[keep], tokens[keep]

    def beam_tokens(self, rows: list[int], beams: list[int]) -> list[np.ndarray]:
        """The tokens of running beam ``beams[i]`` after step ``rows[i]`` (none for -1 or
        less), read back through the parents."""
        top = max(rows, default=-1)
        parents, tokens = self.parents[: top + 1].tolist(), self.tokens[: top + 1].tolist()
        paths = []
        for row, beam in zip(rows, beams, strict=True):
            path = [0] * max(row + 1, 0)
            for r in range(row, -1, -1):
                path[r] = tokens[r][beam]
                beam = parents[r][beam]
            paths.append(np.array(path, np.int32))
        return paths

    def _grow(self) -> None:
        """Double the history's capacity (up to ``max_tokens``)."""
        capacity = min(self.max_tokens, 2 * self.tokens.shape[0])
        pad = ((0, capacity - self.tokens.shape[0]), (0, 0))
        self.parents = np.pad(self.parents, pad)
        self.tokens = np.pad(self.tokens, pad)

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
        paths = self.beam_tokens(self.finished_rows[:n].tolist(), self.finished_beams[:n].tolist())
        return [
            Hypothesis(
                path if self.finished_rows[i] == EMPTY else np.append(path, self.finished_last[i]),
                float(self.finished_scores[i]),
            )
            for i, path in enumerate(paths)
        ]


def _normalised(scores: np.ndarray, length: int, penalty: float) -> np.ndarray:
    """``scores / length ** penalty`` (transformers' ``length_penalty``) in float32. An
    extreme penalty takes the divisor out of float32's range: the scores then become 0 (all
    tied, kept in rank order) or are held at ``NEG / 2``, above the empty slots' ``NEG``;
    never an error."""
    with np.errstate(over="ignore", under="ignore", divide="ignore", invalid="ignore"):
        return np.fmax(scores / np.float32(np.power(np.float64(length), penalty)), NEG / 2)
