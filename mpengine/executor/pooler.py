"""Embeddings: pooling a step's hidden states, on the device, for every pooled sequence at once.

Decoders run pooling requests through the paged path, a prompt possibly in several chunks:
mean pooling adds each chunk's rows into a per-slot sum, CLS keeps the row of position 0,
last-token pooling reads the final chunk's last row. Encoders compute whole prompts in a
padded batch (see ``Executor._execute_encoder``) and pool it in one go. Either way the
step's vectors are finished together: truncated to their ``dimensions`` (Matryoshka),
normalised where asked, float32, one copy to the host.
"""

from __future__ import annotations

import numpy as np
import torch

from mpengine.protocol import Pooling

# Pooling kinds as stored per slot (-1: the slot's sequence samples).
LAST, MEAN, CLS = 0, 1, 2
KINDS: dict[Pooling, int] = {"last": LAST, "mean": MEAN, "cls": CLS}


def token_rows(firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concat(arange(f, f + c) for f, c in zip(firsts, counts))``, without a loop."""
    offsets = np.repeat(firsts - (np.cumsum(counts) - counts), counts)
    return np.arange(int(counts.sum())) + offsets


class Pooler:
    """Per-slot running sums (mean) and first rows (CLS) across a prompt's chunks."""

    def __init__(self, num_slots: int, hidden_size: int, device: torch.device) -> None:
        self.device = device
        self.acc = torch.zeros(num_slots, hidden_size, dtype=torch.float32, device=device)

    def _index(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values, np.int64)).to(self.device)

    def reset(self, slots: np.ndarray) -> None:
        """Slots that start a pooling sequence (again, after a preemption)."""
        if len(slots):
            self.acc.index_fill_(0, self._index(slots), 0.0)

    def accumulate(
        self,
        hidden: torch.Tensor,
        kinds: np.ndarray,
        slots: np.ndarray,
        starts: np.ndarray,
        num_tokens: np.ndarray,
        first_token: np.ndarray,
    ) -> None:
        """Fold this step's chunks into the slots' sums: every row for mean pooling, the row
        of position 0 for CLS (``hidden`` is ``[T, H]`` in plan order)."""
        mean = np.flatnonzero(kinds == MEAN)
        if len(mean):
            rows = token_rows(first_token[mean], num_tokens[mean])
            row_slots = np.repeat(slots[mean], num_tokens[mean])
            self.acc.index_add_(
                0, self._index(row_slots), hidden.index_select(0, self._index(rows)).float()
            )
        cls = np.flatnonzero((kinds == CLS) & (starts == 0))
        if len(cls):
            rows = hidden.index_select(0, self._index(first_token[cls])).float()
            self.acc.index_copy_(0, self._index(slots[cls]), rows)

    def finish(
        self,
        hidden: torch.Tensor,
        kinds: np.ndarray,
        slots: np.ndarray,
        last_rows: np.ndarray,
        lengths: np.ndarray,
    ) -> torch.Tensor:
        """The pooled vectors ``[P, H]`` of sequences whose last chunk ran this step (after
        ``accumulate``): the last row, the mean over ``lengths`` tokens, or the CLS row."""
        last = hidden.index_select(0, self._index(last_rows)).float()
        if (kinds == LAST).all():
            return last
        acc = self.acc.index_select(0, self._index(slots))
        scale = torch.from_numpy(np.where(kinds == MEAN, 1.0 / lengths, 1.0).astype(np.float32))
        pooled = acc * scale.to(self.device)[:, None]
        is_last = torch.from_numpy(kinds == LAST).to(self.device)[:, None]
        return torch.where(is_last, last, pooled)


def padded_groups(lengths: np.ndarray, call_tokens: float) -> list[np.ndarray]:
    """Cut prompts into padded batches: sorted by length, a prompt starts a new batch when
    joining the current one would pad more tokens than a forward call costs
    (``call_tokens``: a call's fixed cost, in padded tokens). Returns index arrays."""
    order = np.argsort(lengths, kind="stable")
    groups: list[list[int]] = [[]]
    longest = 0
    for i in order.tolist():  # ascending: each new prompt is the longest of its batch
        group = groups[-1]
        if group and len(group) * (int(lengths[i]) - longest) > call_tokens:
            groups.append([])
            group = groups[-1]
        group.append(i)
        longest = int(lengths[i])
    return [np.asarray(group) for group in groups]


def pool_padded(
    hidden: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, kinds: np.ndarray
) -> torch.Tensor:
    """Pool a padded batch ``hidden [B, L, H]`` (``mask [B, L]``, 1 for real tokens): the
    masked mean, the first row, or each sequence's last real row, by ``kinds``."""
    hidden = hidden.float()
    batch = torch.arange(len(hidden), device=hidden.device)
    if (kinds == MEAN).all():
        return _masked_mean(hidden, mask, lengths)
    if (kinds == CLS).all():
        return hidden[:, 0]
    last = hidden[batch, lengths - 1]
    if (kinds == LAST).all():
        return last
    mean = _masked_mean(hidden, mask, lengths)
    kind = torch.from_numpy(kinds).to(hidden.device)[:, None]
    return torch.where(kind == MEAN, mean, torch.where(kind == CLS, hidden[:, 0], last))


def _masked_mean(hidden: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    summed = (hidden * mask[:, :, None].to(hidden.dtype)).sum(dim=1)
    return summed / lengths[:, None].to(hidden.dtype)


def finalize(vectors: torch.Tensor, normalize: np.ndarray, dims: np.ndarray) -> np.ndarray:
    """Truncate each row to its ``dims`` (zeros past them), L2-normalise the rows asked to
    be (as ``torch.nn.functional.normalize``), and bring them to the host as float32."""
    width = vectors.shape[1]
    device = vectors.device
    if (dims < width).any():
        keep = (
            torch.arange(width, device=device)[None, :] < torch.from_numpy(dims).to(device)[:, None]
        )
        vectors = vectors * keep
    if normalize.any():
        norms = vectors.norm(dim=1, keepdim=True).clamp_min(1e-12)
        scaled = vectors / norms
        vectors = (
            scaled
            if normalize.all()
            else torch.where(torch.from_numpy(normalize).to(device)[:, None], scaled, vectors)
        )
    return vectors.float().cpu().numpy()
