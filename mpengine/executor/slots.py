"""Per-slot executor state, as host arrays indexed by slot.

A slot belongs to one sequence from its :class:`~mpengine.protocol.SeqStart` until the
scheduler gives it to another. Everything a step needs about its sequences is gathered
from these arrays with the plan's slot indexes (numpy fancy indexing, no per-token Python).
"""

from __future__ import annotations

import numpy as np

from mpengine.executor.pooler import KINDS
from mpengine.executor.sampler import SamplingRows, draw_seed, pack_params
from mpengine.protocol import RequestParams, SamplingParams, SeqStart

_NO_STOP_IDS = np.zeros(0, np.int64)
_NO_BIAS = np.zeros(0, np.float32)


class SlotState:
    """Sequence identity, sampling parameters, block table and token state per slot.

    ``history[slot, pos]`` keeps the tokens of sequences with penalties or a grammar (the
    only readers), written as the tokens are computed; a recomputed sequence rewrites the
    same positions.
    """

    def __init__(
        self,
        num_slots: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: list[int],
    ) -> None:
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.block_table = np.full((num_slots, max_blocks_per_seq), -1, np.int32)  # -1: none
        self.seq_id = np.full(num_slots, -1, np.int64)
        self.last_token = np.full(num_slots, -1, np.int32)
        self.num_prompt = np.zeros(num_slots, np.int64)
        self.sample_index = np.zeros(num_slots, np.int64)
        self.temperature = np.ones(num_slots, np.float32)
        self.top_k = np.zeros(num_slots, np.int64)
        self.top_p = np.ones(num_slots, np.float32)
        self.min_p = np.zeros(num_slots, np.float32)
        self.repetition_penalty = np.ones(num_slots, np.float32)
        self.presence_penalty = np.zeros(num_slots, np.float32)
        self.frequency_penalty = np.zeros(num_slots, np.float32)
        self.has_penalties = np.zeros(num_slots, bool)
        self.keeps_history = np.zeros(num_slots, bool)  # penalties or structured outputs
        self.seeded = np.zeros(num_slots, bool)
        self.seed = np.zeros(num_slots, np.int64)
        self.min_tokens = np.zeros(num_slots, np.int64)
        self.logprobs = np.full(num_slots, -1, np.int32)
        self.prompt_logprobs = np.full(num_slots, -1, np.int32)
        # Pooling sequences: the kind (pooler.KINDS; -1 for a sequence that samples), whether
        # to normalise, how many dimensions to keep.
        self.pool_kind = np.full(num_slots, -1, np.int8)
        # The draw's parameters as it reads them (sampler.pack_params), mirrored on the
        # device by the persistent batch.
        self.sampling_params = pack_params(
            self.temperature, self.min_p, self.top_p, self.top_k, vocab_size
        )
        self.pool_normalize = np.zeros(num_slots, bool)
        self.pool_dims = np.zeros(num_slots, np.int64)
        # Per slot, Python objects: only read for the few sequences that need them.
        self.suppressed_ids: list[np.ndarray] = [_NO_STOP_IDS] * num_slots
        self.has_bias = np.zeros(num_slots, bool)
        self.bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * num_slots  # ids, values
        self.prompt_token_ids: list[np.ndarray | None] = [None] * num_slots
        # np.zeros maps untouched pages lazily: only rows of penalised slots cost memory.
        self.history = np.zeros((num_slots, max_model_len), np.int32)

    def start(self, seq: SeqStart, request: RequestParams) -> None:
        """Reset ``seq.slot`` for a new sequence (or a recomputed one) of ``request``."""
        if not 0 <= seq.slot < self.num_slots:
            raise ValueError(f"slot {seq.slot} out of range [0, {self.num_slots})")
        s = seq.slot
        self.seq_id[s] = -1  # until the start is complete
        self.block_table[s] = -1
        self.last_token[s] = -1
        self.num_prompt[s] = request.num_prompt_tokens
        pooling = request.pooling
        if pooling is not None:
            # The scheduler resolved the model's defaults: every field is set.
            if pooling.pooling is None or pooling.normalize is None:
                raise ValueError("pooling parameters reach the executor unresolved")
            self.pool_kind[s] = KINDS[pooling.pooling]
            self.pool_normalize[s] = pooling.normalize
            self.pool_dims[s] = pooling.dimensions or 0
            self.has_penalties[s] = self.has_bias[s] = self.keeps_history[s] = False
            self.logprobs[s] = self.prompt_logprobs[s] = -1
            self.prompt_token_ids[s] = None
            self.seq_id[s] = seq.seq_id
            return
        if request.sampling is None:
            raise ValueError("a request needs sampling or pooling parameters")
        p = request.sampling
        self.pool_kind[s] = -1
        self.sample_index[s] = seq.sample_index
        self.temperature[s] = p.temperature
        self.top_k[s] = p.top_k
        self.top_p[s] = p.top_p
        self.min_p[s] = p.min_p
        self.repetition_penalty[s] = p.repetition_penalty
        self.presence_penalty[s] = p.presence_penalty
        self.frequency_penalty[s] = p.frequency_penalty
        self.sampling_params[s] = pack_params(
            self.temperature[s], p.min_p, p.top_p, self.top_k[s], self.vocab_size
        )
        self.has_penalties[s] = p.has_penalties
        self.keeps_history[s] = p.has_penalties or p.structured_outputs is not None
        self.seeded[s] = p.seed is not None
        self.seed[s] = 0 if p.seed is None else p.seed  # negative ones wrap in draw_seed
        self.min_tokens[s] = p.min_tokens
        if request.beam_candidates:
            self.logprobs[s] = request.beam_candidates
        else:
            self.logprobs[s] = -1 if p.logprobs is None else p.logprobs
        self.suppressed_ids[s] = _suppressed_ids(p, self.eos_token_ids, self.vocab_size)
        self.has_bias[s] = bool(p.logit_bias)
        self.bias[s] = None
        if p.logit_bias:
            ids = np.fromiter(p.logit_bias.keys(), np.int64, len(p.logit_bias))
            values = np.fromiter(p.logit_bias.values(), np.float32, len(p.logit_bias))
            self.bias[s] = ids, values
        prompt = request.prompt_token_ids
        if p.repetition_penalty != 1.0 and prompt is not None:
            # Every prompt token counts, also those this slot never computes (cached or
            # shared blocks).
            self.history[s, : len(prompt)] = prompt.numpy()
        wants_prompt = seq.prompt_logprobs and p.prompt_logprobs is not None and prompt is not None
        self.prompt_logprobs[s] = p.prompt_logprobs if wants_prompt else -1
        self.prompt_token_ids[s] = prompt.numpy() if wants_prompt else None
        self.seq_id[s] = seq.seq_id

    def poison(self, seq_ids: list[int]) -> None:
        """These sequences failed: their slots serve them no more (a plan that still names
        them fails them instead of running them without their state)."""
        self.seq_id[np.isin(self.seq_id, seq_ids)] = -1

    def record(self, token_slots: np.ndarray, positions: np.ndarray, token_ids: np.ndarray) -> None:
        """Remember the step's tokens of sequences that keep their history."""
        keep = self.keeps_history[token_slots]
        if keep.any():
            self.history[token_slots[keep], positions[keep]] = token_ids[keep]

    def sampling_rows(self, slots: np.ndarray, contexts: np.ndarray) -> SamplingRows:
        """The parameters of sequences in ``slots`` that sample after ``contexts`` tokens."""
        num_prompt = self.num_prompt[slots]
        num_output = np.maximum(contexts - num_prompt, 0)
        penalty_rows = np.flatnonzero(self.has_penalties[slots])
        tokens, is_output = self._penalty_tokens(slots[penalty_rows], contexts[penalty_rows])
        banned_rows, banned_ids = self._banned(slots, num_output)
        bias_rows, bias_ids, bias_values = self._biases(slots)
        return SamplingRows(
            temperature=self.temperature[slots],
            top_k=self.top_k[slots],
            top_p=self.top_p[slots],
            min_p=self.min_p[slots],
            repetition_penalty=self.repetition_penalty[slots],
            presence_penalty=self.presence_penalty[slots],
            frequency_penalty=self.frequency_penalty[slots],
            seeded=self.seeded[slots],
            draw_seeds=draw_seed(self.seed[slots], self.sample_index[slots], num_output),
            logprobs=self.logprobs[slots],
            penalty_rows=penalty_rows,
            penalty_tokens=tokens,
            penalty_is_output=is_output,
            banned_rows=banned_rows,
            banned_ids=banned_ids,
            bias_rows=bias_rows,
            bias_ids=bias_ids,
            bias_values=bias_values,
        )

    def _biases(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(row, token, bias) triples of the rows with a ``logit_bias``."""
        rows = np.flatnonzero(self.has_bias[slots])
        if not len(rows):
            return _NO_STOP_IDS, _NO_STOP_IDS, _NO_BIAS
        pairs = [self.bias[slots[r]] for r in rows]
        counts = [len(ids) for ids, _ in pairs]
        return (
            np.repeat(rows, counts).astype(np.int64),
            np.concatenate([ids for ids, _ in pairs]),
            np.concatenate([values for _, values in pairs]),
        )

    def _penalty_tokens(
        self, slots: np.ndarray, contexts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        if not len(slots):
            return np.zeros((0, 0), np.int64), np.zeros((0, 0), bool)
        width = np.arange(int(contexts.max()))
        tokens = self.history[slots, : len(width)].astype(np.int64)
        tokens[width[None, :] >= contexts[:, None]] = -1
        is_output = width[None, :] >= self.num_prompt[slots][:, None]
        return tokens, is_output

    def _banned(self, slots: np.ndarray, num_output: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row, token) pairs that ``min_tokens`` suppresses: EOS and stop ids while fewer
        than ``min_tokens`` tokens have been generated."""
        rows = np.flatnonzero(num_output < self.min_tokens[slots])
        if not len(rows):
            return _NO_STOP_IDS, _NO_STOP_IDS
        ids = [self.suppressed_ids[slots[r]] for r in rows]
        counts = [len(i) for i in ids]
        return np.repeat(rows, counts).astype(np.int64), np.concatenate(ids).astype(np.int64)


def _suppressed_ids(
    params: SamplingParams, eos_token_ids: list[int], vocab_size: int
) -> np.ndarray:
    if params.min_tokens == 0:
        return _NO_STOP_IDS
    stops = list(params.stop_token_ids) + ([] if params.ignore_eos else eos_token_ids)
    ids = np.unique(np.asarray(stops, np.int64))
    # A stop id outside the vocabulary can never be sampled: nothing to suppress.
    return ids[ids < vocab_size]
