"""The persistent batch: per-slot state mirrored on the device, and a step's inputs.

:class:`~mpengine.executor.slots.SlotState` keeps every slot's state as host arrays,
updated by the plans' deltas (slot starts, block-table entries). The attention kernels and
the next step's inputs need three of them on the device: the block table, each slot's
last sampled token, and the parameters the sampler's draw reads. On the CPU the "device"
tensors are views of the host arrays (nothing to copy, always in sync); on a GPU they are
mirrors that a step updates with the rows it touched (one copy) and, for the last tokens,
with the sampled ids still on the device, so a decode's ``-1`` token is filled in without a
trip through the host.

A step's index arrays (token ids, positions, slot mapping, query starts, context lengths,
logits rows ...) are written with numpy into one staging buffer (pinned on a GPU) and moved
with one non-blocking copy; the device tensors are views of that copy. The staging buffer is
reused: each step waits for its sampled ids before the next one begins, so the previous
copy has completed by then.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mpengine.executor.attention import Backend, StepLayout
from mpengine.executor.paged_attention import AttentionMetadata, build_metadata
from mpengine.executor.slots import SlotState
from mpengine.executor.step_rows import StepRows
from mpengine.executor.torch_attention import Workspace


@dataclass(slots=True)
class StepInputs:
    """One step's device inputs."""

    input_ids: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64
    logits_rows: torch.Tensor  # [R] int64, batch rows whose logits are kept
    sample_slots: torch.Tensor  # [S] int64, slots of the sampling rows (logits rows 0 .. S-1)
    new_blocks: torch.Tensor  # [B] int64, the blocks whose first row this step writes
    metadata: AttentionMetadata


class InputBatch:
    """Device mirrors of the slot state and the staging of a step's inputs."""

    def __init__(
        self,
        state: SlotState,
        device: torch.device,
        block_size: int,
        backend: Backend,
        kv_caches: list[torch.Tensor],
    ) -> None:
        self.state = state
        self.device = device
        self.block_size = block_size
        self.backend = backend
        self.kv_caches = kv_caches
        self.on_cpu = device.type == "cpu"
        self.block_table = torch.from_numpy(state.block_table)
        self.last_token = torch.from_numpy(state.last_token)
        self.sampling_params = torch.from_numpy(state.sampling_params)  # [slots, 4] float32
        if not self.on_cpu:
            self.block_table = self.block_table.to(device)
            self.last_token = self.last_token.to(device)
            self.sampling_params = self.sampling_params.to(device)
        self._staging = {"rows": _Staging(self.on_cpu), "step": _Staging(self.on_cpu)}
        self.workspace = Workspace()  # the torch backend's gathers

    def sync_rows(self, slots: np.ndarray) -> None:
        """Copy the host state of ``slots`` (started or given blocks this step) to the device
        mirrors; nothing to do on the CPU."""
        if self.on_cpu or not len(slots):
            return
        slots = np.unique(slots)
        n = len(slots)
        # [slots | last tokens | sampling parameters (4 float32 as 2 int64 each) | table]
        params = np.ascontiguousarray(self.state.sampling_params[slots]).view(np.int64)
        parts = [slots, self.state.last_token[slots], params.reshape(-1)]
        parts.append(self.state.block_table[slots].reshape(-1))
        rows = self._staging["rows"].upload(parts, self.device)
        index = rows[:n]
        self.last_token.index_copy_(0, index, rows[n : 2 * n].to(torch.int32))
        params_rows = rows[2 * n : 4 * n].view(torch.float32).view(n, -1)
        self.sampling_params.index_copy_(0, index, params_rows)
        self.block_table.index_copy_(0, index, rows[4 * n :].view(n, -1).to(torch.int32))

    def sampling_params_of(self, slots: torch.Tensor | np.ndarray) -> torch.Tensor:
        """The draw's parameters (``sampler.pack_params``) of ``slots``, on the device."""
        if isinstance(slots, np.ndarray):
            slots = torch.from_numpy(slots.astype(np.int64)).to(self.device)
        return self.sampling_params.index_select(0, slots)

    def record_sampled(self, sample_slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """The sampled ids become their slots' last tokens on the device, where the next
        step's ``-1`` tokens read them (the host arrays are updated by the executor)."""
        if not self.on_cpu:
            self.last_token.index_copy_(0, sample_slots, token_ids)

    def prepare(
        self, rows: StepRows, logits_rows: np.ndarray, sample_slots: np.ndarray
    ) -> StepInputs:
        """The device inputs of the step ``rows`` (whose ``-1`` tokens are the slots' last
        sampled tokens): ``logits_rows`` starts with the batch rows of the sequences that
        sample, whose slots are ``sample_slots``."""
        bs = self.block_size
        token_ids, num_tokens = rows.token_ids, rows.num_tokens
        positions = rows.positions()
        token_slots = rows.token_slots()
        blocks = self.state.block_table[token_slots, positions // bs]
        if (blocks < 0).any():
            raise ValueError("a scheduled position has no block in its slot's block table")
        contexts = rows.starts + num_tokens
        width = -(-int(contexts.max()) // bs) if len(contexts) else 0
        layout = StepLayout(
            starts=rows.starts,
            num_tokens=num_tokens,
            block_table=self.state.block_table[rows.slots, :width],
            block_size=bs,
        )

        # One buffer, one copy: [ids | positions | slot mapping | token slots | query starts |
        # context lengths | slots | logits rows | sampling slots | new blocks]
        parts = [
            token_ids,
            positions,
            blocks.astype(np.int64) * bs + positions % bs,
            token_slots,
            np.concatenate([[0], np.cumsum(num_tokens)]),
            contexts,
            rows.slots,
            logits_rows,
            sample_slots,
            blocks[positions % bs == 0],
        ]
        lengths = [len(p) for p in parts]
        device_buffer = self._staging["step"].upload(parts, self.device)
        (ids, pos, slot_mapping, tok_slots, cu_seqlens_q, seq_lens, step_slots, kept, samp, new) = (
            device_buffer.split(lengths)
        )
        if (token_ids < 0).any():
            ids = torch.where(ids < 0, self.last_token.index_select(0, tok_slots).long(), ids)
        if self.on_cpu:
            block_table = torch.from_numpy(layout.block_table)
        else:
            block_table = self.block_table.index_select(0, step_slots)[:, :width]
        metadata = build_metadata(
            self.backend,
            layout,
            self.kv_caches,
            slot_mapping,
            cu_seqlens_q,
            seq_lens,
            block_table,
            self.workspace,
        )
        return StepInputs(ids, pos, kept, samp, new, metadata)


class _Staging:
    """A growing int64 host buffer that parts of a step are written into, then moved to the
    device in one copy (pinned and non-blocking on a GPU)."""

    def __init__(self, on_cpu: bool) -> None:
        self.on_cpu = on_cpu
        self.buffer = torch.empty(0, dtype=torch.int64)
        self.copied: torch.cuda.Event | None = None

    def upload(self, parts: list[np.ndarray], device: torch.device) -> torch.Tensor:
        size = sum(len(p) for p in parts)
        if self.on_cpu:
            # The forward reads these tensors synchronously: no staging needed.
            return torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False))
        if self.copied is not None:
            self.copied.synchronize()  # the last copy out of the buffer is done (it always
            # is after a step that completed; this guards a step that failed half-way)
        if size > len(self.buffer):
            self.buffer = torch.empty(max(size, 2 * len(self.buffer)), dtype=torch.int64)
            self.buffer = self.buffer.pin_memory()
        staging = self.buffer.numpy()
        offset = 0
        for part in parts:
            staging[offset : offset + len(part)] = part
            offset += len(part)
        tensor = self.buffer[:size].to(device, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()
        return tensor
