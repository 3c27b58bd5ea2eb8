"""The executor stage: runs one :class:`~mpengine.protocol.StepPlan` per call.

A step, in order: apply the plan's deltas to the per-slot state (host arrays, mirrored on
the device by :class:`~mpengine.executor.input_batch.InputBatch`), take the plan's rows on
the host without the sequences that cannot run (``plan_checks``), move the step's inputs to
the device in one copy, run the model (a captured CUDA graph for pure-decode steps on a GPU,
eager otherwise), launch sampling with its copy back to the host, then wait for the sampled
ids; pooling sequences whose last chunk ran get their embeddings from the same forward's
hidden states (see ``pooler``).

An encoder model (BERT family) has no KV cache: each step computes whole prompts, as
padded batches through the model's own attention (``_execute_encoder``, ``encoder``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

import mpengine.executor.linear as linear
import mpengine.executor.plan_checks as plan_checks
from mpengine.config import EngineConfig, available_cpus
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
)
from mpengine.executor.kv_sizing import KVCacheSize, gpu_memory_start, kv_cache_spec, size_kv_cache
from mpengine.executor.model_loader import LoadedModel, load_model
from mpengine.executor.pooler import Pooler, finalize
from mpengine.executor.sampler import PendingSample, Sampler, token_logprobs
from mpengine.executor.slots import SlotState
from mpengine.executor.step_rows import StepRows
from mpengine.executor.tensor_parallel import LostRank, RankGroup
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
from mpengine.structured.matchers import GrammarMatchers, Masks

if TYPE_CHECKING:
    from mpengine.executor.cuda_graphs import DecodeGraphs

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


class PromptChunk(NamedTuple):
    """A step row that computes prompt positions of a sequence asking for prompt logprobs."""

    row: int  # its row in the step
    first: int  # the first prompt index it scores
    logits_rows: np.ndarray  # the batch rows whose logits score it, in prompt order
    num_top: int  # top alternatives asked for


class Executor:
    """Owns the model, the KV cache and the per-slot state; ``execute`` runs one step.

    A sequence that cannot run, or a step whose forward raises, is reported in the result's
    ``failed_seq_ids``; the executor keeps serving (see ``execute``). ``attention_backend``
    overrides the device's default (tests compare the backends). ``ranks``: this process
    is one rank of a tensor-parallel executor (``tensor_parallel``); rank 0 alone samples,
    the others take its ids.
    """

    def __init__(
        self,
        config: EngineConfig,
        attention_backend: Backend | None = None,
        ranks: RankGroup | None = None,
    ) -> None:
        if attention_backend is None and config.attention_backend != "auto":
            attention_backend = config.attention_backend
        torch.set_num_threads(config.max_threads)
        self.config = config
        self.ranks = ranks
        self.driver = ranks is None or ranks.driver
        memory = gpu_memory_start(config)  # before the model takes any of the device's
        self.loaded: LoadedModel = load_model(config)
        _check_encoder_budget(config, self.loaded)
        self.model = self.loaded.model
        self.device = self.loaded.device
        if self.device.type == "cpu" and ranks is None:
            linear.install(self.model)  # weights prepacked by oneDNN (see linear.py)
        spec = kv_cache_spec(self.loaded, config.block_size)
        self.backend: Backend = choose_backend(
            attention_backend,
            self.device,
            _empty_layer_cache(spec, self.device),
            self.loaded.num_heads,
        )
        size = size_kv_cache(config, self.loaded, spec, self.backend, memory)
        if ranks is not None:  # every rank holds as many blocks, as long sequences
            size = dataclasses.replace(
                size,
                num_blocks=ranks.agree_min(size.num_blocks),
                num_host_blocks=ranks.agree_min(size.num_host_blocks),
                max_model_len=ranks.agree_min(size.max_model_len),
            )
        self.num_blocks, self.max_model_len = size.num_blocks, size.max_model_len
        self.kv_storage = allocate_kv_cache(spec, self.num_blocks, self.device)
        self.kv_caches = list(self.kv_storage.unbind(0))
        self.swapper = self._swapper(size)
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
        overlap, mask_threads = _mask_placement(config, self.device)
        self.grammars = GrammarMatchers(
            config.tokenizer or self.loaded.path,
            self.loaded.vocab_size,
            self.loaded.eos_token_ids,
            overlap,
            mask_threads,
        )
        self._masks: Masks | None = None  # the step's grammar masks (structured outputs)
        self._forwarded = False  # the step's forward began (with ranks: past agreement)
        # The last hidden state of the step being run, kept by a hook on the base model
        # while a step pools (a causal LM's forward returns only logits).
        self._hidden: torch.Tensor | None = None
        self._keep_hidden = False
        self.pooler = self._pooler()
        self.graphs = self._capture_graphs()
        tuned = self.device.type == "cpu" and config.num_threads is None and config.max_threads > 1
        thread_counts = (1, config.max_threads) if tuned else (config.max_threads,)
        self.compiled = self._compile_decode(thread_counts)
        self.encoder = self._encoder()
        self.threads = ThreadTuner(thread_counts) if tuned else None
        self.requests: dict[int, RequestParams] = {}  # by key, from plan to release
        # The last step's phases: (name, perf_counter() when it began), in order, closed by
        # ("end", t). The runtime charges them to the step breakdown (runtime/timing.py).
        self.marks: list[tuple[str, float]] = []
        self.info = self._model_info(size)
        logger.info("executor ready (%s attention): %s", self.backend, self.info)

    # -- start-up ---------------------------------------------------------------------------

    def _swapper(self, size: KVCacheSize) -> Swapper | None:
        """The copies between the cache and its swap space (``preemption_mode`` swap)."""
        if not size.num_host_blocks:
            return None
        host = allocate_swap_space(size.spec, size.num_host_blocks, self.device)
        return Swapper(self.kv_caches, host, self.num_blocks)

    def _pooler(self) -> Pooler | None:
        """A decoder that embeds: its per-slot pooling state, and for a causal LM the hook
        that keeps the hidden states its forward does not return."""
        pooling = self.loaded.pooling
        if pooling is None or self.loaded.is_encoder:
            return None
        pooler = Pooler(self.config.num_slots, pooling.hidden_size, self.device)
        if self.loaded.can_generate:
            self.model.base_model.register_forward_hook(self._hidden_hook)
        return pooler

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
            or self.ranks is not None  # (collectives in graphs: not built yet)
        ):
            return None
        from mpengine.executor.cuda_graphs import DecodeGraphs, max_graph_batch

        return DecodeGraphs.capture(
            self.model,
            self.kv_caches,
            max_num_seqs=max_graph_batch(self.config),
            max_blocks_per_seq=self.slots.block_table.shape[1],
        )

    def _compile_decode(self, thread_counts: tuple[int, ...]) -> CompiledDecode | None:
        """``compile_decode``: decode steps through ``torch.compile``, for each thread count
        the tuner may pick, where it applies."""
        if not self.config.compile_decode:
            return None
        compiles = self.loaded.can_generate and self.pooler is None and self.ranks is None
        if self.backend == "native" and compiles:
            return CompiledDecode.compile(self.model, self.kv_caches, thread_counts)
        logger.warning(
            "compile_decode ignored: it compiles the decode steps of a generating "
            "model without pooling on native attention, in one rank (here %s attention, "
            "generating %s, pooling %s, %d ranks)",
            self.backend,
            self.loaded.can_generate,
            self.loaded.pooling is not None,
            self.config.tensor_parallel_size,
        )
        return None

    def _encoder(self) -> Encoder | None:
        """An encoder model's padded batches, calibrated (see ``encoder``)."""
        if not self.loaded.is_encoder:
            return None
        assert self.loaded.pooling is not None
        encoder = Encoder(self.model, self.device, self.loaded.pooling.hidden_size)
        encoder.calibrate(self.max_model_len)
        return encoder

    def _model_info(self, size: KVCacheSize) -> ModelInfo:
        loaded = self.loaded
        return ModelInfo(
            model_path=loaded.path,
            tokenizer_path=self.config.tokenizer or loaded.path,
            vocab_size=loaded.vocab_size,
            max_model_len=self.max_model_len,
            num_blocks=self.num_blocks,
            block_size=self.config.block_size,
            eos_token_ids=loaded.eos_token_ids,
            kv_cache_bytes=size.num_bytes,
            device=str(self.device),
            dtype=_DTYPE_NAMES.get(loaded.dtype, str(loaded.dtype)),
            num_threads=self.config.max_threads,
            thread_tuning=self.threads is not None,
            pooling=loaded.pooling,
            can_generate=loaded.can_generate,
            num_host_blocks=size.num_host_blocks,
            sampling_defaults=loaded.sampling_defaults,
        )

    # -- a step -----------------------------------------------------------------------------

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
        self._forwarded = False
        try:
            if len(plan.swap_out) or len(plan.swap_in):
                self._swap(plan)
            if self.loaded.is_encoder:
                result = self._execute_encoder(plan, failures)
            else:
                result = self._execute(plan, failures)
        except Exception as exc:
            if device_lost(exc) or isinstance(exc, LostRank):
                raise  # the stage exits: its supervisor fails the requests, a service restarts
            if self.ranks is not None and self._forwarded:  # the ranks may no longer agree
                raise LostRank(f"rank {self.ranks.rank}: step {plan.step} failed: {exc!r}") from exc
            logger.exception("step %d failed", plan.step)
            message = f"{type(exc).__name__}: {exc}"
            for seq_id in plan.seq_ids.numpy().tolist():
                failures.setdefault(seq_id, message)
            result = _empty_result(plan.step)
        finally:
            self._masks = None
            released = plan.released_requests.numpy().tolist()
            for key in released:
                self.requests.pop(key, None)
            self.grammars.release(released)
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
        """A decoder's step, in the order of the module doc; each phase is marked."""
        # 1. slot resets, then block-table deltas (host state, then its device mirror)
        self._apply_deltas(plan, failures)

        # 2. the step's rows on the host, without the sequences that cannot run
        rows = self._checked_rows(plan)
        keep = self._runnable(rows, failures)
        if not keep.all():
            rows = rows.select(keep)
        self._record_tokens(rows)

        # 3. which logits rows are needed (sampling positions, then prompt-logprob positions);
        # the step's inputs on the device. A pooling sequence "samples" when its last chunk
        # runs: it is pooled instead.
        pool_kinds = self.slots.pool_kind[rows.slots]
        pooled = np.flatnonzero(rows.sample & (pool_kinds >= 0))
        sampling = np.flatnonzero(rows.sample & (pool_kinds < 0))
        prompt_chunks = self._prompt_logprob_chunks(rows)
        inputs = self._prepare(rows, sampling, prompt_chunks)
        if self.driver:
            self._masks = self._fill_masks(rows, sampling)

        # 4. forward, into blocks zeroed where it writes their first row (beside it, where a
        # core is spare, a worker thread fills the grammar masks; "grammar": what is left)
        self.marks.append(("forward", time.perf_counter()))
        pools = bool((pool_kinds >= 0).any())
        logits, hidden = self._forward_step(inputs, pools) if inputs is not None else (None, None)
        if self._masks is not None:
            self.marks.append(("grammar", time.perf_counter()))
            self._masks.wait()

        # 5. sample, then wait for the ids on the host ("copy": from sampling launched to the
        # ids on the host); remember each sampled token for the slot's next decode
        self.marks.append(("sample", time.perf_counter()))
        result = _empty_result(plan.step)
        if len(sampling) and not self.driver:
            assert inputs is not None
            self._follow_samples(rows, sampling, inputs.sample_slots, failures)
            return result  # (only rank 0's results leave the executor)
        if len(sampling):
            assert logits is not None and inputs is not None
            self._sample_step(result, rows, sampling, logits, inputs.sample_slots, failures)

        # 6. pooling: fold the chunks in, finish the sequences whose last chunk ran
        if pools:
            self.marks.append(("pool", time.perf_counter()))
            self._pool(result, rows, pool_kinds, pooled, hidden, failures)

        # 7. prompt logprobs, one entry per chunk (their logits follow the sampling rows')
        self.marks.append(("finish", time.perf_counter()))
        if prompt_chunks and self.driver:
            assert logits is not None
            chunk_logits = logits[len(sampling) :]
            self._add_prompt_logprobs(result, rows, prompt_chunks, chunk_logits, failures)
        return result

    @torch.inference_mode()
    def _execute_encoder(self, plan: StepPlan, failures: dict[int, str]) -> StepResult:
        """An encoder's step: every scheduled sequence is a whole prompt (no KV cache to
        continue from), run as padded batches of similar lengths, then pooled."""
        self._apply_deltas(plan, failures)
        rows = self._checked_rows(plan)
        keep = self._runnable(rows, failures)
        whole = plan_checks.whole_prompts(rows, self.slots.num_prompt, self.slots.pool_kind)
        for i in np.flatnonzero(keep & ~whole):
            failures[int(rows.seq_ids[i])] = plan_checks.NOT_WHOLE
        rows = rows.select(keep & whole)
        result = _empty_result(plan.step)
        if not len(rows):
            return result
        self.marks.append(("forward", time.perf_counter()))
        vectors = self._encode(rows)
        self.marks.append(("pool", time.perf_counter()))
        result.embeddings = self._finalize(vectors, rows.slots)
        result.pooled_seq_ids = Array.of(rows.seq_ids, "int64")
        self.marks.append(("finish", time.perf_counter()))
        return result

    # -- the plan's changes and rows --------------------------------------------------------

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
        started: list[int] = []
        for seq in plan.new_seqs:
            started.append(seq.slot)
            try:
                self.slots.start(seq, self.requests[seq.request])
                self.grammars.start(seq.seq_id, self.requests[seq.request])
            except Exception as exc:
                logger.warning("seq %d cannot start: %r", seq.seq_id, exc)
                failures[seq.seq_id] = f"{type(exc).__name__}: {exc}"
        if self.pooler is not None and started:
            slots = plan_checks.slots_in_range(np.asarray(started, np.int64), self.slots.num_slots)
            self.pooler.reset(slots[self.slots.pool_kind[slots] >= 0])
        try:
            self._update_block_table(plan)
        finally:
            touched = np.concatenate([np.asarray(started, np.int64), plan.block_slots.numpy()])
            self.batch.sync_rows(plan_checks.slots_in_range(touched, self.slots.num_slots))

    def _update_block_table(self, plan: StepPlan) -> None:
        if not len(plan.block_ids):
            return
        slots, indices, block_ids = (
            plan.block_slots.numpy(),
            plan.block_indices.numpy(),
            plan.block_ids.numpy(),
        )
        # Checked on the host: a bad index on a GPU is a device assert that ends the process.
        table = self.slots.block_table
        plan_checks.check_block_updates(slots, indices, block_ids, table.shape, self.num_blocks)
        table[slots, indices] = block_ids

    def _checked_rows(self, plan: StepPlan) -> StepRows:
        """The plan's rows on the host, checked for shape (else the step fails)."""
        rows = StepRows.of(plan)
        plan_checks.check_rows(rows, self.slots.num_slots)
        return rows

    def _runnable(self, rows: StepRows, failures: dict[int, str]) -> np.ndarray:
        """Which rows can run ([N] bool); the others go to ``failures`` with a reason (a
        sequence that failed already, at its start, keeps its first one)."""
        reasons = plan_checks.why_unrunnable(
            rows,
            self.slots.last_token,
            self.slots.seq_id,
            self.loaded.vocab_size,
            self.max_model_len,
        )
        for i in np.flatnonzero(reasons != ""):
            failures.setdefault(int(rows.seq_ids[i]), str(reasons[i]))
        keep = reasons == ""
        if failures:
            keep &= ~np.isin(rows.seq_ids, np.fromiter(failures, np.int64, len(failures)))
        if not keep.all():
            table, block_size = self.slots.block_table, self.config.block_size
            for i in plan_checks.readers_of_unwritten(rows, keep, table, block_size):
                keep[i] = False
                failures.setdefault(int(rows.seq_ids[i]), plan_checks.READS_UNWRITTEN)
        return keep

    def _record_tokens(self, rows: StepRows) -> None:
        """Remember the tokens of sequences with penalties or a grammar (the only readers),
        their ``-1`` tokens filled in from the slots' last sampled tokens (``rows`` keeps its
        ``-1``s: the device fills them from its own copy)."""
        token_slots = rows.token_slots()
        keep = self.slots.keeps_history[token_slots]
        if not keep.any():
            return
        positions = rows.positions()
        token_ids = rows.token_ids
        resolved = np.where(token_ids < 0, self.slots.last_token[token_slots], token_ids)
        self.slots.record(token_slots[keep], positions[keep], resolved[keep])

    def _fill_masks(self, rows: StepRows, sampling: np.ndarray) -> Masks | None:
        """Start filling the grammar masks of the ``sampling`` rows that have one."""
        slots = rows.slots[sampling]
        num_prompt = self.slots.num_prompt[slots]
        contexts = rows.starts[sampling] + rows.num_tokens[sampling]
        return self.grammars.fill(
            rows.seq_ids[sampling], slots, num_prompt, contexts - num_prompt, self.slots.history
        )

    def _prompt_logprob_chunks(self, rows: StepRows) -> list[PromptChunk]:
        """The rows that compute prompt positions of sequences asking for prompt logprobs.

        The logits at position ``p`` score prompt token ``p + 1``, so a chunk over
        ``[s, e)`` scores prompt tokens ``s + 1 .. min(e, P - 1)``; the last prompt position's
        logits are the first sample's, not a prompt logprob.
        """
        wanting = np.flatnonzero(self.slots.prompt_logprobs[rows.slots] >= 0)
        if not len(wanting):
            return []
        first_token = rows.first_token
        chunks: list[PromptChunk] = []
        for i in wanting:
            slot, start = rows.slots[i], int(rows.starts[i])
            prompt = self.slots.prompt_token_ids[slot]
            assert prompt is not None
            end = min(start + int(rows.num_tokens[i]), len(prompt) - 1)
            if end <= start:
                continue
            logits_rows = first_token[i] + np.arange(end - start)
            num_top = int(self.slots.prompt_logprobs[slot])
            chunks.append(PromptChunk(int(i), start + 1, logits_rows, num_top))
        return chunks

    # -- forward ----------------------------------------------------------------------------

    def _prepare(
        self, rows: StepRows, sampling: np.ndarray, prompt_chunks: list[PromptChunk]
    ) -> StepInputs | None:
        """The step's inputs on the device (None for a step of no tokens), keeping the
        logits of the ``sampling`` rows' last tokens, then of the prompt chunks' rows. A
        chunk that samples nothing still runs: its keys and values fill the cache."""
        if not len(rows.token_ids):
            return None
        sample_rows = rows.first_token[sampling] + rows.num_tokens[sampling] - 1
        logits_rows = np.concatenate([sample_rows, *(c.logits_rows for c in prompt_chunks)])
        return self.batch.prepare(rows, logits_rows, rows.slots[sampling])

    def _forward_step(
        self, inputs: StepInputs, pools: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``_forward``; with ranks, a forward that raises ends this rank (the others wait
        in its collectives: they cannot go on without it)."""
        self._forwarded = True
        if self.ranks is None:
            return self._forward(inputs, pools)
        before = self.ranks.collective_s
        try:
            out = self._forward(inputs, pools)
        except Exception as exc:
            raise LostRank(f"rank {self.ranks.rank}: the forward failed: {exc!r}") from exc
        # its collectives, charged as one phase after it
        spent = self.ranks.collective_s - before
        self.marks.append(("collective", time.perf_counter() - spent))
        return out

    def _forward(
        self, inputs: StepInputs, pools: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits ``[len(inputs.logits_rows), vocab]`` (None for a model that only embeds)
        and, when the step pools, the last hidden state ``[T, hidden]``: a captured graph for
        a pure-decode step that fits one, the model run eagerly otherwise. The blocks whose
        first row the step writes are zeroed first (see ``kv_cache.clear_blocks``)."""
        clear_blocks(self.kv_storage, inputs.new_blocks)
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

    def _encode(self, rows: StepRows) -> torch.Tensor:
        """An encoder's forward: the pooled vectors of the whole prompts ``rows``."""
        assert self.encoder is not None
        kinds = self.slots.pool_kind[rows.slots]
        return self.encoder.encode(rows.token_ids, rows.num_tokens, kinds)

    # -- sampling ---------------------------------------------------------------------------

    def _sample_step(
        self,
        result: StepResult,
        rows: StepRows,
        sampling: np.ndarray,
        logits: torch.Tensor,
        sample_slots: torch.Tensor,
        failures: dict[int, str],
    ) -> None:
        """Sample the rows ``sampling`` (their logits first in ``logits``, their slots
        ``sample_slots`` on the device) into ``result``; a row whose sampling fails goes to
        ``failures``."""
        contexts = rows.starts[sampling] + rows.num_tokens[sampling]
        sampling_logits = logits[: len(sampling)]
        ok, error, pending = self._sample(
            sampling_logits, rows.slots[sampling], contexts, sample_slots
        )
        if pending is not None and ok.all():
            self.batch.record_sampled(sample_slots, pending.token_ids)
        self.marks.append(("copy", time.perf_counter()))
        for row in np.flatnonzero(~ok):
            failures[int(rows.seq_ids[sampling[row]])] = error
        sampled = sampling[ok]
        if pending is not None:
            self._collect(pending, result, rows.slots[sampled], synced=bool(ok.all()))
        result.seq_ids = Array.of(rows.seq_ids[sampled], "int64")
        if self.ranks is not None:  # the other ranks' last tokens (see _follow_samples)
            ids = np.full(len(sampling), -1, np.int64)
            if pending is not None:
                ids[ok] = result.token_ids.numpy()
            self.marks.append(("collective", time.perf_counter()))
            self.ranks.share_ids(ids, len(sampling))

    def _follow_samples(
        self,
        rows: StepRows,
        sampling: np.ndarray,
        sample_slots: torch.Tensor,
        failures: dict[int, str],
    ) -> None:
        """A rank other than 0: rank 0's draws for the rows ``sampling`` become the slots'
        last tokens, as its own did there; a row it failed to sample fails here too."""
        assert self.ranks is not None
        self.marks.append(("collective", time.perf_counter()))
        ids = self.ranks.share_ids(None, len(sampling))
        self.marks.append(("copy", time.perf_counter()))
        ok = ids >= 0
        slots = rows.slots[sampling]
        self.slots.last_token[slots[ok]] = ids[ok]
        for row in np.flatnonzero(~ok):
            failures[int(rows.seq_ids[sampling[row]])] = "its sampling failed on rank 0"
        if ok.all():
            token_ids = torch.from_numpy(ids.astype(np.int32))  # (the slots' dtype)
            self.batch.record_sampled(sample_slots, token_ids.to(self.device))
        else:
            self.batch.sync_rows(slots[ok])

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
                self._sample_rows(
                    logits[one], slots[one], contexts[one], rows=np.array([row])
                ).wait()
            except Exception as row_exc:
                if device_lost(row_exc):
                    raise
                ok[row] = False
                error = f"{type(row_exc).__name__}: {row_exc}"
        if ok.all():  # no row fails alone: the batch as a whole did
            ok[:] = False
        if not ok.any():
            return ok, error, None
        good_rows = np.flatnonzero(ok)
        good = torch.from_numpy(good_rows).to(logits.device)
        return ok, error, self._sample_rows(logits[good], slots[ok], contexts[ok], rows=good_rows)

    def _sample_rows(
        self,
        logits: torch.Tensor,
        slots: np.ndarray,
        contexts: np.ndarray,
        device_slots: torch.Tensor | None = None,
        rows: np.ndarray | None = None,
    ) -> PendingSample:
        """Launch the sampling of the step's sampling rows ``rows`` (all of them by default;
        their grammar masks are found by these indexes)."""
        sampling = self.slots.sampling_rows(slots, contexts)
        if self._masks is not None:
            rows = np.arange(len(slots)) if rows is None else rows
            sampling.allowed_rows, sampling.allowed = self._masks.select(rows)
        params = self.batch.sampling_params_of(slots if device_slots is None else device_slots)
        return self.sampler.sample_async(logits, sampling, params)

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

    def _add_prompt_logprobs(
        self,
        result: StepResult,
        rows: StepRows,
        chunks: list[PromptChunk],
        logits: torch.Tensor,
        failures: dict[int, str],
    ) -> None:
        """One entry per chunk, from its rows of ``logits`` (the chunks', in order); a
        sequence that failed gets none."""
        offset = 0
        for chunk in chunks:
            num_rows = len(chunk.logits_rows)
            chunk_logits = logits[offset : offset + num_rows]
            offset += num_rows
            seq_id = int(rows.seq_ids[chunk.row])
            if seq_id in failures:
                continue
            prompt = self.slots.prompt_token_ids[rows.slots[chunk.row]]
            assert prompt is not None
            targets = prompt[chunk.first : chunk.first + num_rows].astype(np.int64)
            target_ids = torch.from_numpy(targets).to(self.device)
            logprobs = token_logprobs(chunk_logits, target_ids, chunk.num_top)
            result.prompt_logprobs.append(PromptLogprobs(seq_id, chunk.first, logprobs))

    # -- pooling ----------------------------------------------------------------------------

    def _pool(
        self,
        result: StepResult,
        rows: StepRows,
        kinds: np.ndarray,
        pooled: np.ndarray,
        hidden: torch.Tensor | None,
        failures: dict[int, str],
    ) -> None:
        """Fold the step's pooling chunks (``kinds``: each row's pooling, -1 for none) into
        their slots; put the embeddings of the sequences whose last chunk ran (rows
        ``pooled``) in ``result``. If that fails, every pooling sequence of the step does."""
        first_token = rows.first_token
        try:
            assert self.pooler is not None
            if hidden is None:
                raise RuntimeError("the model's forward kept no hidden states to pool")
            self.pooler.accumulate(
                hidden, kinds, rows.slots, rows.starts, rows.num_tokens, first_token
            )
            if len(pooled):
                lengths = rows.starts[pooled] + rows.num_tokens[pooled]
                last_rows = first_token[pooled] + rows.num_tokens[pooled] - 1
                slots = rows.slots[pooled]
                vectors = self.pooler.finish(hidden, kinds[pooled], slots, last_rows, lengths)
                result.embeddings = self._finalize(vectors, slots)
                result.pooled_seq_ids = Array.of(rows.seq_ids[pooled], "int64")
        except Exception as exc:
            if device_lost(exc):
                raise
            logger.exception("pooling failed in step %d", result.step)
            for i in np.flatnonzero(kinds >= 0):
                failures.setdefault(int(rows.seq_ids[i]), f"{type(exc).__name__}: {exc}")
            result.pooled_seq_ids, result.embeddings = EMPTY_IDS, None

    def _finalize(self, vectors: torch.Tensor, slots: np.ndarray) -> Array:
        dims = self.slots.pool_dims[slots]
        dims = np.where(dims > 0, dims, vectors.shape[1])
        return Array.of(finalize(vectors, self.slots.pool_normalize[slots], dims), "float32")


def _mask_placement(config: EngineConfig, device: torch.device) -> tuple[bool, int]:
    """Whether grammar masks are filled in a worker thread beside the forward, and by how
    many of llguidance's threads: beside it on a GPU (the host waits on the device), or on
    a CPU with cores left beside the torch threads (of every rank of the host) and the two
    other stages (those cores); else before it, with the torch threads' cores (idle then)."""
    cpus = available_cpus()
    if device.type == "cuda":
        return True, max(1, min(8, cpus - 3))
    spare = cpus - config.max_threads * config.ranks_per_node - 2
    return (True, spare) if spare > 0 else (False, config.max_threads)


def _check_encoder_budget(config: EngineConfig, loaded: LoadedModel) -> None:
    if loaded.is_encoder and config.max_num_batched_tokens < loaded.max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({config.max_num_batched_tokens}) is below max_model_len "
            f"({loaded.max_model_len}): an encoder computes each input whole in one "
            "step; raise max_num_batched_tokens or lower max_model_len"
        )


def _empty_layer_cache(spec: KVCacheSpec, device: torch.device) -> torch.Tensor:
    """A layer cache's shape and dtype, with no blocks: what the kernels must take."""
    shape = (2, spec.num_kv_heads, 0, spec.block_size, spec.head_dim)
    return torch.empty(shape, dtype=spec.dtype, device=device)


def _empty_result(step: int) -> StepResult:
    return StepResult(step=step, seq_ids=Array.of([], "int64"), token_ids=EMPTY_IDS)
