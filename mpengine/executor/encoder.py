"""Encoder models (BERT family): whole prompts through the model's own attention.

An encoder attends both ways and keeps no KV cache, so each step computes its prompts
from scratch, as padded batches through upstream SDPA with a padding mask. Prompts are
sorted by length and cut into batches where padding costs less than another forward call
would (``pooler.padded_groups``); what a call costs is measured once at start.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from mpengine.executor.pooler import padded_groups, pool_padded, token_rows

logger = logging.getLogger(__name__)


class Encoder:
    def __init__(self, model: torch.nn.Module, device: torch.device, hidden_size: int) -> None:
        self.model = model
        self.device = device
        self.hidden_size = hidden_size
        self.call_tokens = 0.0  # one forward call's fixed cost, in padded tokens

    @torch.inference_mode()
    def encode(self, token_ids: np.ndarray, lengths: np.ndarray, kinds: np.ndarray) -> torch.Tensor:
        """Pooled vectors ``[B, hidden]`` of the prompts ``token_ids`` (concatenated, of
        ``lengths``), in order, by pooling ``kinds``."""
        offsets = np.cumsum(lengths) - lengths
        out = torch.empty(len(lengths), self.hidden_size, device=self.device)
        for index in padded_groups(lengths, self.call_tokens):
            rows = token_rows(offsets[index], lengths[index])
            pooled = self._padded(token_ids[rows], lengths[index], kinds[index])
            out.index_copy_(0, torch.from_numpy(index).to(self.device), pooled)
        return out

    def _padded(
        self, token_ids: np.ndarray, lengths: np.ndarray, kinds: np.ndarray
    ) -> torch.Tensor:
        width = int(lengths.max())
        mask = np.arange(width)[None, :] < lengths[:, None]
        ids = np.zeros((len(lengths), width), np.int64)
        ids[mask] = token_ids
        ids_t = torch.from_numpy(ids).to(self.device)
        mask_t = torch.from_numpy(mask).to(self.device)
        hidden = self.model(
            input_ids=ids_t, attention_mask=mask_t.long(), token_type_ids=torch.zeros_like(ids_t)
        ).last_hidden_state
        return pool_padded(hidden, mask_t, torch.from_numpy(lengths).to(self.device), kinds)

    @torch.inference_mode()
    def calibrate(self, max_model_len: int) -> None:
        """Time a call of one one-token prompt (the fixed cost) and one of 8 x 64 tokens (the
        cost per token); their ratio is ``call_tokens``. Also warms the model up."""

        def seconds(batch: int, width: int) -> float:
            ids = np.ones(batch * width, np.int64)
            lengths = np.full(batch, width, np.int64)
            kinds = np.zeros(batch, np.int8)
            best = math.inf
            for _ in range(3):
                started = time.perf_counter()
                self._padded(ids, lengths, kinds).cpu()
                best = min(best, time.perf_counter() - started)
            return best

        width = min(64, max_model_len)
        fixed = seconds(1, 1)
        per_token = max(seconds(8, width) - fixed, 1e-9) / (8 * width)
        self.call_tokens = fixed / per_token
        logger.info(
            "encoder: a forward call costs %.2f ms, as much as %.0f padded tokens",
            1e3 * fixed,
            self.call_tokens,
        )
