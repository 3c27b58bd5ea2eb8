"""The executor stage: runs one :class:`~mpengine.protocol.StepPlan` per call.

A step, in order: apply the plan's deltas to the per-slot state (host arrays, mirrored on
the device by :class:`~mpengine.executor.input_batch.InputBatch`), lay the step out on the
host and move its inputs to the device in one copy, run the model (a captured CUDA graph for
pure-decode steps on a GPU, eager otherwise), launch sampling with its copy back to the
host, then wait for the sampled ids; pooling sequences whose last chunk ran get their
embeddings from the same forward's hidden states (see ``pooler``).

An encoder model (BERT family) has no KV cache: each step computes whole prompts, as
padded batches through the model's own attention (``_execute_encoder``, ``encoder``).
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from mpengine.config import EngineConfig
from mpengine.envs import InjectedFault, fault_seqs, fault_steps
from mpengine.executor import linear
from mpengine.executor.attention import METADATA_KWARG, Backend, choose_backend
from mpengine.executor.compiled import CompiledDecode
from mpengine.executor.encoder import Encoder
from mpengine.executor.input_batch import InputBatch, StepInputs
from mpengine.executor.kv_cache import (
    KVCacheSpec,
    Swapper,
    allocate_kv_cache,
    allocate_swap_space,
    clear_blocks,
    num_blocks_for,
)
from mpengine.executor.model_loader import LoadedModel, load_model
from mpengine.executor.pooler import Pooler, finalize
from mpengine.executor.sampler import PendingSample, Sampler, token_logprobs
from mpengine.executor.slots import SlotState
from mpengine.executor.threads import ThreadTuner
from mpengine.protocol import (
    EMPTY_IDS,
    Array,
    ModelInfo,
    PromptLogprobs,
    RequestParams,
    StepPlan,
    StepResult,
)

if TYPE_CHECKING:
    from mpengine.executor.cuda_graphs import DecodeGraphs
    from mpengine.executor.gpu_memory import MemoryStart

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


# What a CUDA context that can no longer run anything says (a device-side assert, an
# illegal address): every later call fails the same way.
_DEVICE_LOST_MARKS = ("CUDA error", "device-side assert", "illegal memory access", "CUBLAS_STATUS")


def device_lost(exc: BaseException) -> bool:
    """Whether ``exc`` left the device unusable: no later step can succeed, so failing
    this step's sequences and serving on would fail every request from now on. Out of
    memory is not such an error."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    if isinstance(exc, getattr(torch, "AcceleratorError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _DEVICE_LOST_MARKS)


class Executor:
    """Owns the model, the KV cache and the per-slot state; ``execute`` runs one step.

    A sequence that cannot run, or a step whose forward raises, is reported in the result's
    ``failed_seq_ids``; the executor keeps serving (see ``execute``). ``attention_backend``
    overrides the device's default (tests compare the backends).
    """

    def __init__(self, config: EngineConfig, attention_backend: Backend | None = None) -> None:
        if attention_backend is None and config.attention_backend != "auto":
            attention_backend = config.attention_backend
        torch.set_num_threads(config.max_threads)
        self.config = config
        memory = _gpu_memory_start(config)
        self.loaded: LoadedModel = load_model(config)
        if self.loaded.is_encoder and config.max_num_batched_tokens < self.loaded.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) is below max_model_len "
                f"({self.loaded.max_model_len}): an encoder computes each input whole in one "
                "step; raise max_num_batched_tokens or lower max_model_len"
            )
        self.model = self.loaded.model
        self.device = self.loaded.device
        if self.device.type == "cpu":
            linear.install(self.model)  # decode steps' few rows: W @ x^T (see linear.py)
        spec = KVCacheSpec(
            num_layers=self.loaded.num_layers,
            num_kv_heads=self.loaded.num_kv_heads,
            head_dim=self.loaded.head_dim,
            block_size=config.block_size,
            dtype=self.loaded.dtype,
        )
        # A layer cache's shape and dtype, with no blocks: what the kernels must take.
        like = torch.empty(
            (2, spec.num_kv_heads, 0, spec.block_size, spec.head_dim),
            dtype=spec.dtype,
            device=self.device,
        )
        self.backend: Backend = choose_backend(
            attention_backend, self.device, like, self.loaded.num_heads
        )
        if self.loaded.is_encoder:
            self.num_blocks = 0  # whole prompts per step: nothing to keep between steps
        elif self.device.type == "cuda" and config.num_gpu_blocks_override is None:
            from mpengine.executor.gpu_memory import profiled_num_blocks

            self.num_blocks = profiled_num_blocks(config, spec, self.loaded, self.backend, memory)
        else:
            self.num_blocks = num_blocks_for(config, spec, self.device)
        self.kv_storage = allocate_kv_cache(spec, self.num_blocks, self.device)
        self.kv_caches = list(self.kv_storage.unbind(0))
        self.swapper: Swapper | None = None
        num_host_blocks = 0
        if config.preemption_mode == "swap" and self.num_blocks:
            num_host_blocks = config.swap_space // spec.bytes_per_block
            if num_host_blocks == 0:  # (vLLM's --swap-space 4 means GiB; here, bytes)
                raise ValueError(
                    f"swap_space ({config.swap_space} bytes) holds no KV block of "
                    f"{spec.bytes_per_block} bytes: give it in bytes or with a unit "
                    "(--swap-space 4GiB), or use preemption_mode recompute"
                )
            host = allocate_swap_space(spec, num_host_blocks, self.device)
            self.swapper = Swapper(self.kv_caches, host, self.num_blocks)
        self.max_model_len = self.loaded.max_model_len
        capacity = self.num_blocks * config.block_size
        if self.num_blocks and capacity < self.max_model_len:
            if config.max_model_len is not None:  # the user's own: not changed behind them
                raise ValueError(
                    f"max_model_len {config.max_model_len} is larger than the KV cache holds "
                    f"({capacity} tokens, {self.num_blocks} blocks of {config.block_size}): "
                    "give the cache more memory (kv_cache_bytes, gpu_memory_utilization, "
                    "num_gpu_blocks_override) or lower max_model_len"
                )
            # A sequence longer than the whole cache could never run: requests asking for
            # one (no max_tokens given means "up to max_model_len") were refused.
            logger.warning(
                "the KV cache holds %d tokens (%d blocks of %d): max_model_len lowered from %d "
                "to %d; give the cache more memory (kv_cache_bytes, gpu_memory_utilization) "
                "for longer sequences",
                capacity,
                self.num_blocks,
                config.block_size,
                self.max_model_len,
                capacity,
            )
            self.max_model_len = capacity
        self.slots = SlotState(
            config.num_slots,
            max_blocks_per_seq=math.ceil(self.max_model_len / config.block_size),
            max_model_len=self.max_model_len,
            vocab_size=self.loaded.vocab_size,
            eos_token_ids=self.loaded.eos_token_ids,
        )
        self.batch = InputBatch(
            self.slots, self.device, config.block_size, self.backend, self.kv_caches
        )
        self.sampler = Sampler(self.device, config.seed)
        self.pooler: Pooler | None = None
        # The last hidden state of the step being run, kept by a hook on the base model
        # while a step pools (a causal LM's forward returns only logits).
        self._hidden: torch.Tensor | None = None
        self._keep_hidden = False
        if self.loaded.pooling is not None and not self.loaded.is_encoder:
            self.pooler = Pooler(config.num_slots, self.loaded.pooling.hidden_size, self.device)
            if self.loaded.can_generate:
                self.model.base_model.register_forward_hook(self._hidden_hook)
        self.graphs = self._capture_graphs()
        tuned = self.device.type == "cpu" and config.num_threads is None and config.max_threads > 1
        thread_counts = (1, config.max_threads) if tuned else (config.max_threads,)
        self.compiled: CompiledDecode | None = None
        if config.compile_decode:
            if self.backend == "native" and self.loaded.can_generate and self.pooler is None:
                self.compiled = CompiledDecode.compile(self.model, self.kv_caches, thread_counts)
            else:
                logger.warning(
                    "compile_decode ignored: it compiles the decode steps of a generating "
                    "model without pooling on native attention (here %s attention, "
                    "generating %s, pooling %s)",
                    self.backend,
                    self.loaded.can_generate,
                    self.loaded.pooling is not None,
                )
        self.encoder: Encoder | None = None
        if self.loaded.is_encoder:
            self.encoder = Encoder(self.model, self.device, self.loaded.pooling.hidden_size)
            self.encoder.calibrate(self.max_model_len)
        self.threads = ThreadTuner(thread_counts) if tuned else None
        self.requests: dict[int, RequestParams] = {}  # by key, from plan to release
        self.fault_steps, self.fault_seqs = fault_steps(), fault_seqs()
        # The last step's phases: (name, perf_counter() when it began), in order, closed by
        # ("end", t). The runtime charges them to the step breakdown (runtime/timing.py).
        self.marks: list[tuple[str, float]] = []
        self.info = ModelInfo(
            model_path=self.loaded.path,
            tokenizer_path=config.tokenizer or self.loaded.path,
            vocab_size=self.loaded.vocab_size,
            max_model_len=self.max_model_len,
            num_blocks=self.num_blocks,
            block_size=config.block_size,
            eos_token_ids=self.loaded.eos_token_ids,
            kv_cache_bytes=self.num_blocks * spec.bytes_per_block,
            device=str(self.device),
            dtype=_DTYPE_NAMES.get(self.loaded.dtype, str(self.loaded.dtype)),
            num_threads=config.max_threads,
            thread_tuning=self.threads is not None,
            pooling=self.loaded.pooling,
            can_generate=self.loaded.can_generate,
            num_host_blocks=num_host_blocks,
            sampling_defaults=self.loaded.sampling_defaults,
        )
        logger.info("executor ready (%s attention): %s", self.backend, self.info)

    def _hidden_hook(self, module: torch.nn.Module, args: object, output: object) -> None:
        if self._keep_hidden:
            self._hidden = output.last_hidden_state[0]  # type: ignore[attr-defined]

    def _capture_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs of pure-decode steps (GPU, triton attention, not ``enforce_eager``,
        a model that generates)."""
        if (
            self.device.type != "cuda"
            or self.backend != "triton"
            or self.config.enforce_eager
            or not self.loaded.can_generate
        ):
            return None
        from mpengine.executor.cuda_graphs import DecodeGraphs, max_graph_batch

        return DecodeGraphs.capture(
            self.model,
            self.kv_caches,
            max_num_seqs=max_graph_batch(self.config),
            max_blocks_per_seq=self.slots.block_table.shape[1],
        )

    def execute(self, plan: StepPlan) -> StepResult:
        """Run ``plan``: apply its slot and block-table changes, compute its tokens, sample.

        Failures stay as small as they can be tied: a sequence whose start, tokens or
        sampling are bad fails alone; a forward pass that raises fails the step's sequences.
        A failed sequence's slot is poisoned, so a step planned before the failure was known
        (async depth 1) runs without it instead of failing on its missing token.
        """
        started = time.perf_counter()
        self.marks = [("prepare", started)]
        if self.threads is not None and len(plan.token_ids):
            self.threads.begin(len(plan.token_ids))
        for params in plan.new_requests:
            self.requests[params.key] = params
        failures: dict[int, str] = {}  # seq id -> why it failed
        try:
            if len(plan.swap_out) or len(plan.swap_in):
                self._swap(plan)
            if self.loaded.is_encoder:
                result = self._execute_encoder(plan, failures)
            else:
                result = self._execute(plan, failures)
        except Exception as exc:
            if device_lost(exc):
                raise  # the stage exits: its supervisor fails the requests, a service restarts
            logger.exception("step %d failed", plan.step)
            message = f"{type(exc).__name__}: {exc}"
            for seq_id in plan.seq_ids.numpy().tolist():
                failures.setdefault(seq_id, message)
            result = StepResult(step=plan.step, seq_ids=Array.of([], "int64"), token_ids=EMPTY_IDS)
        finally:
            for key in plan.released_requests.numpy().tolist():
                self.requests.pop(key, None)
        if failures:
            self.slots.poison(list(failures))
            result.failed_seq_ids = Array.of(list(failures), "int64")
            result.errors = list(failures.values())
        ended = time.perf_counter()
        result.execute_time = ended - started
        if self.threads is not None:
            self.threads.end(ended - started)
        self.marks.append(("end", ended))
        return result

    @torch.inference_mode()
    def _execute(self, plan: StepPlan, failures: dict[int, str]) -> StepResult:
        # 1. slot resets, then block-table deltas (host state, then its device mirror)
        self._apply_deltas(plan, failures)

        # 2. the step's layout on the host, without the sequences that cannot run
        slots, starts, num_tokens, sample, seq_ids, token_ids = self._layout(plan)
        keep = self._runnable(slots, starts, num_tokens, seq_ids, token_ids, failures)
        if not keep.all():
            token_ids = token_ids[np.repeat(keep, num_tokens)]
            slots, starts, num_tokens = slots[keep], starts[keep], num_tokens[keep]
            sample, seq_ids = sample[keep], seq_ids[keep]
        total = int(num_tokens.sum())
        first_token = np.cumsum(num_tokens) - num_tokens
        self._record_tokens(slots, starts, num_tokens, token_ids)

        # 3. which logits rows are needed (sampling positions, then prompt-logprob positions);
        # the step's inputs on the device. A pooling sequence "samples" when its last chunk
        # runs: it is pooled instead.
        pool_kinds = self.slots.pool_kind[slots]
        pooled = np.flatnonzero(sample & (pool_kinds >= 0))
        sampling = np.flatnonzero(sample & (pool_kinds < 0))
        sample_rows = first_token[sampling] + num_tokens[sampling] - 1
        prompt_chunks = self._prompt_logprob_chunks(slots, starts, num_tokens, first_token)
        rows_kept = np.concatenate([sample_rows, *(rows for _, _, rows, _ in prompt_chunks)])
        # A chunk that samples nothing still runs: its keys and values fill the cache.
        inputs = (
            self.batch.prepare(slots, starts, num_tokens, token_ids, rows_kept, slots[sampling])
            if total
            else None
        )
        if total and plan.step in self.fault_steps:
            raise InjectedFault(f"injected failure of step {plan.step} (MPENGINE_FAULT_STEPS)")

        # 4. forward, into blocks zeroed where it writes their first row
        self.marks.append(("forward", time.perf_counter()))
        if inputs is not None:
            clear_blocks(self.kv_storage, inputs.new_blocks)
        pools = bool((pool_kinds >= 0).any())
        logits, hidden = self._forward(inputs, pools) if inputs is not None else (None, None)

        # 5. sample, then wait for the ids on the host ("copy": from sampling launched to the
        # ids on the host); remember each sampled token for the slot's next decode
        self.marks.append(("sample", time.perf_counter()))
        result = StepResult(step=plan.step, seq_ids=Array.of([], "int64"), token_ids=EMPTY_IDS)
        if len(sampling):
            assert logits is not None and inputs is not None
            contexts = starts[sampling] + num_tokens[sampling]
            ok, error, pending = self._sample(
                logits[: len(sampling)], slots[sampling], contexts, inputs.sample_slots
            )
            if pending is not None and ok.all():
                self.batch.record_sampled(inputs.sample_slots, pending.token_ids)
            self.marks.append(("copy", time.perf_counter()))
            for row in np.flatnonzero(~ok):
                failures[int(seq_ids[sampling[row]])] = error
            sampled = sampling[ok]
            if pending is not None:
                self._collect(pending, result, slots[sampled], synced=bool(ok.all()))
            result.seq_ids = Array.of(seq_ids[sampled], "int64")

        # 6. pooling: fold the chunks in, finish the sequences whose last chunk ran
        if pools:
            self.marks.append(("pool", time.perf_counter()))
            first = first_token
            try:
                if hidden is None:
                    raise RuntimeError("the model's forward kept no hidden states to pool")
                self._pool(result, hidden, pool_kinds, slots, starts, num_tokens, first, pooled)
            except Exception as exc:
                if device_lost(exc):
                    raise
                logger.exception("pooling failed in step %d", plan.step)
                for i in np.flatnonzero(pool_kinds >= 0):
                    failures.setdefault(int(seq_ids[i]), f"{type(exc).__name__}: {exc}")
                result.pooled_seq_ids, result.embeddings = EMPTY_IDS, None
            if len(pooled) and result.embeddings is not None:
                result.pooled_seq_ids = Array.of(seq_ids[pooled], "int64")

        # 7. prompt logprobs, one entry per chunk
        self.marks.append(("finish", time.perf_counter()))
        offset = len(sampling)
        for i, first, rows, num_top in prompt_chunks:
            targets = self.slots.prompt_token_ids[slots[i]][first : first + len(rows)]
            chunk_logits = logits[offset : offset + len(rows)]
            offset += len(rows)
            if int(seq_ids[i]) in failures:
                continue
            target_ids = torch.from_numpy(targets.astype(np.int64)).to(self.device)
            logprobs = token_logprobs(chunk_logits, target_ids, num_top)
            result.prompt_logprobs.append(PromptLogprobs(int(seq_ids[i]), first, logprobs))
        return result

    def _swap(self, plan: StepPlan) -> None:
        """Swap-outs, then swap-ins (the scheduler's order), before anything else of the
        step: a block copied out may be reused by this very step."""
        if self.swapper is None:
            raise ValueError("the plan swaps blocks, but this executor has no swap space")
        if len(plan.swap_out):
            self.swapper.swap_out(plan.swap_out.numpy())
        if len(plan.swap_in):
            self.swapper.swap_in(plan.swap_in.numpy())

    def _apply_deltas(self, plan: StepPlan, failures: dict[int, str]) -> None:
        """Slot starts, then block-table entries, on the host; then the rows they touched
        on the device."""
        started = []
        for seq in plan.new_seqs:
            started.append(seq.slot)
            try:
                self.slots.start(seq, self.requests[seq.request])
            except Exception as exc:
                logger.warning("seq %d cannot start: %r", seq.seq_id, exc)
                failures[seq.seq_id] = f"{type(exc).__name__}: {exc}"
        if self.pooler is not None and started:
            started_slots = np.asarray(started, np.int64)
            started_slots = started_slots[
                (started_slots >= 0) & (started_slots < len(self.slots.seq_id))
            ]
            self.pooler.reset(started_slots[self.slots.pool_kind[started_slots] >= 0])
        try:
            self._update_block_table(plan)
        finally:
            touched = np.concatenate([np.asarray(started, np.int64), plan.block_slots.numpy()])
            touched = touched[(touched >= 0) & (touched < self.slots.num_slots)]
            self.batch.sync_rows(touched)

    def _record_tokens(
        self, slots: np.ndarray, starts: np.ndarray, num_tokens: np.ndarray, token_ids: np.ndarray
    ) -> None:
        """Remember the tokens of sequences with penalties (the only readers), their ``-1``
        tokens filled in from the slots' last sampled tokens (``token_ids`` keeps its ``-1``s:
        the device fills them from its own copy)."""
        token_slots = np.repeat(slots, num_tokens)
        keep = self.slots.has_penalties[token_slots]
        if not keep.any():
            return
        first_token = np.cumsum(num_tokens) - num_tokens
        positions = np.arange(len(token_ids)) + np.repeat(starts - first_token, num_tokens)
        resolved = np.where(token_ids < 0, self.slots.last_token[token_slots], token_ids)
        self.slots.record(token_slots[keep], positions[keep], resolved[keep])

    def _forward(
        self, inputs: StepInputs, pools: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits ``[len(inputs.logits_rows), vocab]`` (None for a model that only embeds)
        and, when the step pools, the last hidden state ``[T, hidden]``: a captured graph for
        a pure-decode step that fits one, the model run eagerly otherwise."""
        metadata = inputs.metadata
        if not pools and self.graphs is not None and self.graphs.fits(metadata):
            return self.graphs.replay(inputs).index_select(0, inputs.logits_rows), None
        kwargs = {
            "input_ids": inputs.input_ids[None],
            "position_ids": inputs.position_ids[None],
            "use_cache": False,
            METADATA_KWARG: metadata,
        }
        if not self.loaded.can_generate:  # a base model: hidden states only
            return None, self.model(**kwargs).last_hidden_state[0]
        if not pools and self.compiled is not None and self.compiled.fits(metadata):
            output = self.compiled.run(self.model, logits_to_keep=inputs.logits_rows, **kwargs)
            return output.logits[0], None  # type: ignore[attr-defined]
        self._hidden, self._keep_hidden = None, pools
        try:
            output = self.model(logits_to_keep=inputs.logits_rows, **kwargs)
        finally:
            self._keep_hidden = False
        hidden, self._hidden = self._hidden, None
        return output.logits[0], hidden

    def _pool(
        self,
        result: StepResult,
        hidden: torch.Tensor,
        kinds: np.ndarray,
        slots: np.ndarray,
        starts: np.ndarray,
        num_tokens: np.ndarray,
        first_token: np.ndarray,
        pooled: np.ndarray,
    ) -> None:
        """Fold the step's pooling chunks into their slots; put the finished sequences'
        embeddings (plan indices ``pooled``) in ``result``."""
        assert self.pooler is not None
        self.pooler.accumulate(hidden, kinds, slots, starts, num_tokens, first_token)
        if not len(pooled):
            return
        lengths = starts[pooled] + num_tokens[pooled]
        last_rows = first_token[pooled] + num_tokens[pooled] - 1
        vectors = self.pooler.finish(hidden, kinds[pooled], slots[pooled], last_rows, lengths)
        result.embeddings = self._finalize(vectors, slots[pooled])

    def _finalize(self, vectors: torch.Tensor, slots: np.ndarray) -> Array:
        dims = self.slots.pool_dims[slots]
        dims = np.where(dims > 0, dims, vectors.shape[1])
        return Array.of(finalize(vectors, self.slots.pool_normalize[slots], dims), "float32")

    @torch.inference_mode()
    def _execute_encoder(self, plan: StepPlan, failures: dict[int, str]) -> StepResult:
        """An encoder's step: every scheduled sequence is a whole prompt (no KV cache to
        continue from), run as padded batches of similar lengths, then pooled."""
        self._apply_deltas(plan, failures)
        slots, starts, num_tokens, sample, seq_ids, token_ids = self._layout(plan)
        keep = self._runnable(slots, starts, num_tokens, seq_ids, token_ids, failures)
        whole = (starts == 0) & (num_tokens == self.slots.num_prompt[slots]) & sample
        whole &= self.slots.pool_kind[slots] >= 0
        for i in np.flatnonzero(keep & ~whole):
            failures[int(seq_ids[i])] = "an encoder model computes whole prompts, in one step"
        token_ids = token_ids[np.repeat(keep & whole, num_tokens)]
        keep &= whole
        slots, num_tokens, seq_ids = slots[keep], num_tokens[keep], seq_ids[keep]
        result = StepResult(step=plan.step, seq_ids=Array.of([], "int64"), token_ids=EMPTY_IDS)
        if not len(slots):
            return result
        if plan.step in self.fault_steps:
            raise InjectedFault(f"injected failure of step {plan.step} (MPENGINE_FAULT_STEPS)")
        self.marks.append(("forward", time.perf_counter()))
        assert self.encoder is not None
        vectors = self.encoder.encode(token_ids, num_tokens, self.slots.pool_kind[slots])
        self.marks.append(("pool", time.perf_counter()))
        result.embeddings = self._finalize(vectors, slots)
        result.pooled_seq_ids = Array.of(seq_ids, "int64")
        self.marks.append(("finish", time.perf_counter()))
        return result

    def _sample(
        self,
        logits: torch.Tensor,
        slots: np.ndarray,
        contexts: np.ndarray,
        device_slots: torch.Tensor,
    ) -> tuple[np.ndarray, str, PendingSample | None]:
        """Launch the sampling of every row (``device_slots``: ``slots`` on the device);
        return which rows succeeded, the error of the others and the launched sampling of
        the good rows. A batch that raises is retried row by row to find the rows at fault,
        then the others are sampled together."""
        ok = np.ones(len(slots), bool)
        error = ""
        try:
            return ok, error, self._sample_rows(logits, slots, contexts, device_slots)
        except Exception as exc:
            if device_lost(exc):
                raise
            logger.warning("sampling failed (%r): finding the rows at fault", exc)
            error = f"{type(exc).__name__}: {exc}"
        for row in range(len(slots)):
            one = slice(row, row + 1)
            try:
                self._sample_rows(logits[one], slots[one], contexts[one]).wait()
            except Exception as row_exc:
                if device_lost(row_exc):
                    raise
                ok[row] = False
                error = f"{type(row_exc).__name__}: {row_exc}"
        if ok.all():  # no row fails alone: the batch as a whole did
            ok[:] = False
        if not ok.any():
            return ok, error, None
        good = torch.from_numpy(np.flatnonzero(ok)).to(logits.device)
        return ok, error, self._sample_rows(logits[good], slots[ok], contexts[ok])

    def _sample_rows(
        self,
        logits: torch.Tensor,
        slots: np.ndarray,
        contexts: np.ndarray,
        device_slots: torch.Tensor | None = None,
    ) -> PendingSample:
        if self.fault_seqs and not self.fault_seqs.isdisjoint(self.slots.seq_id[slots].tolist()):
            raise InjectedFault("injected sampling failure (MPENGINE_FAULT_SEQS)")
        rows = self.slots.sampling_rows(slots, contexts)
        params = self.batch.sampling_params_of(slots if device_slots is None else device_slots)
        return self.sampler.sample_async(logits, rows, params)

    def _collect(
        self, pending: PendingSample, result: StepResult, slots: np.ndarray, synced: bool
    ) -> None:
        """Wait for the sampled ids on the host and put them in ``result``; they become their
        slots' last tokens (``synced``: the device copy was updated from the device)."""
        out = pending.wait()
        result.token_ids = Array.of(out.token_ids, "int32")
        if out.logprobs is not None:
            result.logprobs = out.logprobs
            result.logprob_rows = Array.of(out.logprob_rows, "int32")
        self.slots.last_token[slots] = out.token_ids
        if not synced:
            self.batch.sync_rows(slots)

    def _prompt_logprob_chunks(
        self,
        slots: np.ndarray,
        starts: np.ndarray,
        num_tokens: np.ndarray,
        first_token: np.ndarray,
    ) -> list[tuple[int, int, np.ndarray, int]]:
        """Per chunk that computes prompt positions of a sequence asking for prompt
        logprobs: (plan index, first prompt index scored, batch rows, top-N).

        The logits at position ``p`` score prompt token ``p + 1``, so a chunk over
        ``[s, e)`` scores prompt tokens ``s + 1 .. min(e, P - 1)``; the last prompt position's
        logits are the first sample's, not a prompt logprob.
        """
        chunks = []
        for i in np.flatnonzero(self.slots.prompt_logprobs[slots] >= 0):
            prompt = self.slots.prompt_token_ids[slots[i]]
            assert prompt is not None
            end = min(starts[i] + num_tokens[i], len(prompt) - 1)
            if end <= starts[i]:
                continue
            rows = first_token[i] + np.arange(end - starts[i])
            chunks.append(
                (int(i), int(starts[i]) + 1, rows, int(self.slots.prompt_logprobs[slots[i]]))
            )
        return chunks

    def _update_block_table(self, plan: StepPlan) -> None:
        if not len(plan.block_ids):
            return
        table = self.slots.block_table
        slots, indices, ids = (
            plan.block_slots.numpy(),
            plan.block_indices.numpy(),
            plan.block_ids.numpy(),
        )
        if not len(slots) == len(indices) == len(ids):
            raise ValueError("block_slots, block_indices and block_ids differ in length")
        # Checked on the host: a bad index on a GPU is a device assert that ends the process.
        if slots.min() < 0 or slots.max() >= table.shape[0]:
            raise ValueError("block table update names a slot out of range")
        if indices.min() < 0 or indices.max() >= table.shape[1]:
            raise ValueError(f"block index out of range [0, {table.shape[1]})")
        if ids.min() < 0 or ids.max() >= self.num_blocks:
            raise ValueError(f"block id out of range [0, {self.num_blocks})")
        table[slots, indices] = ids

    def _layout(self, plan: StepPlan) -> tuple[np.ndarray, ...]:
        """The plan's per-sequence arrays as writable host copies (slots, starts, token
        counts, sample flags, seq ids, then the flat token ids), checked for shape."""
        slots = plan.slots.numpy().astype(np.int64)
        starts = plan.starts.numpy().astype(np.int64)
        num_tokens = plan.num_tokens.numpy().astype(np.int64)
        sample = plan.sample.numpy().astype(bool)
        seq_ids = plan.seq_ids.numpy().astype(np.int64)
        self._check_plan(plan, slots, starts, num_tokens, sample, seq_ids)
        return slots, starts, num_tokens, sample, seq_ids, plan.token_ids.numpy().astype(np.int64)

    def _check_plan(
        self,
        plan: StepPlan,
        slots: np.ndarray,
        starts: np.ndarray,
        num_tokens: np.ndarray,
        sample: np.ndarray,
        seq_ids: np.ndarray,
    ) -> None:
        """The plan's shape; a plan that fails these is wrong as a whole."""
        n = len(slots)
        if not len(starts) == len(num_tokens) == len(sample) == len(seq_ids) == n:
            raise ValueError("plan arrays differ in length")
        if n and num_tokens.min() < 1:
            raise ValueError("every scheduled sequence needs >= 1 token")
        if len(plan.token_ids) != int(num_tokens.sum()):
            raise ValueError(
                f"plan has {len(plan.token_ids)} token ids for {num_tokens.sum()} tokens"
            )
        if n and (slots.min() < 0 or slots.max() >= self.slots.num_slots):
            raise ValueError(f"slot out of range [0, {self.slots.num_slots})")

    def _runnable(
        self,
        slots: np.ndarray,
        starts: np.ndarray,
        num_tokens: np.ndarray,
        seq_ids: np.ndarray,
        token_ids: np.ndarray,
        failures: dict[int, str],
    ) -> np.ndarray:
        """Which scheduled sequences can run; the others go to ``failures`` with a reason."""
        reasons = np.full(len(slots), "", dtype=object)
        token_seq = np.repeat(np.arange(len(slots)), num_tokens)
        pending = token_ids < 0
        no_token = np.zeros(len(slots), bool)
        no_token[token_seq[pending & (self.slots.last_token[slots[token_seq]] < 0)]] = True
        bad_id = np.zeros(len(slots), bool)
        bad_id[token_seq[token_ids >= self.loaded.vocab_size]] = True
        reasons[bad_id] = f"a token id is out of range [0, {self.loaded.vocab_size})"
        reasons[no_token] = "a -1 token refers to a slot that has sampled nothing yet"
        reasons[(starts < 0) | (starts + num_tokens > self.max_model_len)] = (
            f"positions outside [0, max_model_len={self.max_model_len})"
        )
        reasons[self.slots.seq_id[slots] != seq_ids] = (
            "the sequence does not hold its slot (an earlier step of it failed)"
        )
        for i in np.flatnonzero(reasons != ""):
            failures.setdefault(int(seq_ids[i]), str(reasons[i]))
        keep = reasons == ""
        if failures:
            keep &= ~np.isin(seq_ids, np.fromiter(failures, np.int64, len(failures)))
        if not keep.all():
            self._drop_readers_of_unwritten(slots, starts, num_tokens, seq_ids, keep, failures)
        return keep

    def _drop_readers_of_unwritten(
        self,
        slots: np.ndarray,
        starts: np.ndarray,
        num_tokens: np.ndarray,
        seq_ids: np.ndarray,
        keep: np.ndarray,
        failures: dict[int, str],
    ) -> None:
        """A sequence may start from prefix blocks another sequence of the same step
        computes (the scheduler shares them at once, as vLLM does): when that one cannot
        run, its blocks stay unwritten, and the sequences reading them fail too, rather
        than attend to whatever the blocks held (``keep`` is updated in place)."""
        size = self.config.block_size
        table = self.slots.block_table
        while True:
            unwritten: set[int] = set()
            for i in np.flatnonzero(~keep):
                if 0 <= slots[i] < len(table):
                    first, last = starts[i] // size, (starts[i] + num_tokens[i] - 1) // size
                    unwritten.update(table[slots[i], first : last + 1].tolist())
            unwritten.discard(-1)
            dropped = False
            for j in np.flatnonzero(keep):
                read = table[slots[j], : -(-int(starts[j]) // size)].tolist()
                if not unwritten.isdisjoint(read):
                    keep[j], dropped = False, True
                    failures.setdefault(
                        int(seq_ids[j]),
                        "its prompt's prefix blocks were computed by a sequence that failed",
                    )
            if not dropped:
                return


def _gpu_memory_start(config: EngineConfig) -> MemoryStart | None:
    """On a GPU whose KV cache is sized by ``gpu_memory_utilization``: the device's memory
    before this process loads anything (see ``gpu_memory``)."""
    from mpengine.executor.model_loader import resolve_device

    device = resolve_device(config.device)
    if config.num_gpu_blocks_override is not None or device.type != "cuda":
        return None
    from mpengine.executor.gpu_memory import MemoryStart

    return MemoryStart.take(device)
