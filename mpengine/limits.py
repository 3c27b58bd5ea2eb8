"""How big a step frame can get, derived once from the config, so every frame fits its ring.

A ring takes any frame up to its capacity (less an 8-byte header); a bigger one cannot be
sent at all, and a stage that tried would die. So no frame size may depend on a client
without a bound. The bounds, per ring:

- **announce** (scheduler -> output): a ``NewRequest`` is its ``AddRequest`` (at most
  ``max_request_bytes``) plus at most ``ANNOUNCE_SLACK``; ``EngineConfig`` checks that
  ``ring_bytes`` holds that. Abort announcements are split into frames of at most
  ``ABORT_CHUNK_BYTES`` of ids.
- **plan** (scheduler -> executor): a fixed part bounded by ``max_num_seqs`` and
  ``max_num_batched_tokens`` (per-sequence arrays, token ids, block-table growth, starts,
  released keys), and a variable part the scheduler spends while building the step (request
  parameters, which carry the prompt when prompt logprobs are asked for, and the shared
  block tables of forked samples) up to ``plan_extra_bytes``. A step that would need more
  defers the rest to the next step; one request alone always fits an empty step.
- **result** (executor -> output): a fixed part for the sampled tokens with top logprobs,
  and prompt logprobs of at most ``max_prompt_logprob_tokens`` positions per step, which
  the scheduler enforces by shortening such prefill chunks.
- **feedback** (output -> scheduler): bounded by the number of slots, and at most
  ``GONE_CLIENTS_PER_FEEDBACK`` ids of clients found gone.

Sizes are msgpack upper bounds (ints at most 9 bytes, array headers at most 5, etc.).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpengine.config import EngineConfig
from mpengine.protocol import (
    GONE_CLIENTS_PER_FEEDBACK,
    MAX_BEAM_CANDIDATES,
    MAX_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
)

RING_HEADER = 8
ABORT_CHUNK_BYTES = 64 * 1024
MAX_RELEASED_PER_PLAN = 4096
# msgpack upper bounds per element
_SEQ_ROW = 4 + 4 + 4 + 1 + 8  # start, slot, num_tokens, sample, seq_id
_BLOCK_DELTA = 3 * 4  # slot, index, block id
_SEQ_START = 48  # tag + slot, seq id, request key, sample index, flag
_FRAME = 512  # tags, array headers, dtype names, step numbers
_PARAMS = 512 + 9 * MAX_STOP_TOKEN_IDS  # RequestParams without the prompt
_RESULT_ROW = 8 + 4 + 4 + 4  # seq id, token, logprob, row index; then 8 bytes per top-N
_PROMPT_LOGPROB_ROW = 8 + 8 * MAX_LOGPROBS
_GONE_CLIENTS = (2 + 255) * GONE_CLIENTS_PER_FEEDBACK  # ids of clients found gone


class ConfigError(ValueError):
    """An engine option that cannot work; the message names it."""


@dataclass(frozen=True, slots=True)
class FrameLimits:
    plan_fixed_bytes: int
    plan_extra_bytes: int  # what the scheduler may spend on parameters and shared tables
    max_prompt_logprob_tokens: int  # prompt-logprob positions per step
    result_fixed_bytes: int
    feedback_bytes: int
    # A beam's continuations per step: up to MAX_BEAM_CANDIDATES where the ring has room
    # for them beside what the logprobs requests may ask for, never fewer than those.
    max_beam_candidates: int = MAX_LOGPROBS

    @staticmethod
    def request_params_bytes(num_prompt_tokens: int, prompt_logprobs: bool) -> int:
        """Upper bound of one request's ``RequestParams`` in a plan."""
        return _PARAMS + (4 * num_prompt_tokens if prompt_logprobs else 0)

    @staticmethod
    def shared_table_bytes(num_blocks: int) -> int:
        """A forked sample's start and the block-table entries it shares."""
        return _SEQ_START + _BLOCK_DELTA * num_blocks

    @classmethod
    def derive(cls, config: EngineConfig, max_model_len: int) -> FrameLimits:
        """The limits for ``config``; raises ConfigError when ``ring_bytes`` cannot hold
        the frames that ``max_num_seqs`` and ``max_num_batched_tokens`` allow."""
        capacity = config.ring_bytes - RING_HEADER
        seqs, tokens = config.max_num_seqs, config.max_num_batched_tokens
        block_size = config.block_size
        growth = tokens // block_size + seqs  # blocks one step can allocate
        plan_fixed = (
            _FRAME
            + _SEQ_ROW * seqs
            + 4 * tokens
            + _BLOCK_DELTA * growth
            + _SEQ_START * seqs
            + 9 * MAX_RELEASED_PER_PLAN
        )
        max_blocks_per_seq = -(-max_model_len // block_size)
        one_request = cls.request_params_bytes(max_model_len, True) + cls.shared_table_bytes(
            max_blocks_per_seq
        )
        plan_extra = capacity - plan_fixed
        if plan_extra < one_request:
            raise ConfigError(
                f"ring_bytes ({config.ring_bytes}) is too small for a step plan: "
                f"max_num_seqs={seqs}, max_num_batched_tokens={tokens} and max_model_len="
                f"{max_model_len} need at least {plan_fixed + one_request + RING_HEADER} bytes; "
                "raise ring_bytes or lower those"
            )

        def result_bytes(num_top: int) -> int:
            return _FRAME + (_RESULT_ROW + 8 * num_top) * seqs

        prompt_room = capacity - result_bytes(MAX_LOGPROBS) - 64 * seqs  # 64: a chunk's framing
        max_prompt_tokens = min(tokens, prompt_room // _PROMPT_LOGPROB_ROW)
        if max_prompt_tokens < 1:
            raise ConfigError(
                f"ring_bytes ({config.ring_bytes}) is too small for a step result of "
                f"max_num_seqs={seqs} sequences with logprobs; raise ring_bytes or lower "
                "max_num_seqs"
            )
        # Wider rows for beams only from what that many prompt-logprob positions leave.
        spare = prompt_room - max_prompt_tokens * _PROMPT_LOGPROB_ROW
        max_beam = min(MAX_BEAM_CANDIDATES, MAX_LOGPROBS + spare // (8 * seqs))
        result_fixed = result_bytes(max_beam)
        feedback = _FRAME + (8 + 4 + 9 + 6) * config.num_slots + _GONE_CLIENTS
        if feedback > capacity:
            raise ConfigError(
                f"ring_bytes ({config.ring_bytes}) is too small for the feedback of "
                f"max_num_seqs={seqs}; raise ring_bytes or lower max_num_seqs"
            )
        return cls(plan_fixed, plan_extra, max_prompt_tokens, result_fixed, feedback, max_beam)
