"""Pure-decode steps through ``torch.compile`` on the CPU (``compile_decode``).

A small model's decode step on the CPU is mostly the cost of running a few hundred small
operators one by one from Python. Inductor fuses the elementwise ones (norms, rotary
embeddings, activations, residuals) into generated C++ loops, and the native attention
kernels enter the graph as operators (``native_attention``), so a step is one compiled
call: measured 1.3-1.4x faster decode steps for the tiny model, 1.1x for the small one
(64 sequences at context 128), 1.23x the serial runtime's tokens/s on the tiny model
(``tools/bench_engine.py``); SmolLM2-135M's decode steps 1.17-1.32x faster with two threads
(1-64 sequences), and 1.12x the processes runtime's tokens/s in float32 (64 requests of
mixed lengths, 2 cores). Dynamo guards on torch's thread count: the graphs are compiled
for each count the thread tuner may pick, so its switching compiles nothing. Its linear
layers are the packed ones (``linear``), as operators inductor calls as they are.

As with CUDA graphs on a GPU, only pure-decode steps take this path; prefill and mixed
steps run eagerly. The model is compiled with dynamic shapes at start-up by two warm-up
decodes per thread count, of one sequence and of five (a compiled graph treats a size of 1
apart; from 2 on one graph serves every batch size and context length), which costs
20-40 s per thread count on two cores. Inductor keeps what it compiled in its on-disk
cache, so later starts are faster. If compilation fails, or a compiled step raises, the
executor logs why and runs every step eagerly from then on: slower, never wrong (a step
that failed half-way is run again eagerly; its cache writes are the same).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

import mpengine.executor.native_attention as native_attention
from mpengine.executor.attention import METADATA_KWARG
from mpengine.executor.paged_attention import AttentionMetadata
from mpengine.executor.torch_attention import NativeDecodePlan, TorchPlan

logger = logging.getLogger(__name__)


class CompiledDecode:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor]) -> None:
        self.forward: Callable[..., object] = torch.compile(model, dynamic=True)
        self.kv_caches = kv_caches
        self.failed = False

    @classmethod
    def compile(
        cls,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        thread_counts: tuple[int, ...] = (1,),
    ) -> CompiledDecode | None:
        """Compile with warm-up decodes for each of ``thread_counts`` (the thread tuner's
        candidates; the last is left set), or None (and a warning) if that fails."""
        compiled = cls(model, kv_caches)
        started = time.perf_counter()
        for cache in kv_caches:  # fixed shapes: never a symbol a batch size could equal
            torch._dynamo.mark_static(cache)
        try:
            for threads in thread_counts:
                torch.set_num_threads(threads)
                for size in (5, 1):
                    compiled._warm_up(size)
        except Exception:
            logger.warning("torch.compile of decode steps failed: they run eagerly", exc_info=True)
            return None
        logger.info(
            "compiled decode steps for %s thread(s) in %.1f s",
            "/".join(map(str, thread_counts)),
            time.perf_counter() - started,
        )
        return compiled

    def fits(self, metadata: AttentionMetadata) -> bool:
        plan = metadata.torch_plan
        return (
            not self.failed
            and metadata.decode_only
            and plan is not None
            and plan.native is not None
            and isinstance(plan.decode, NativeDecodePlan)
        )

    def run(self, eager: Callable[..., object], **kwargs: object) -> object:
        """The model's output through the compiled forward; through ``eager`` (the model)
        if it raises, and every later step too."""
        try:
            return self.forward(**kwargs)
        except Exception:
            logger.exception("a compiled decode step failed: decode steps now run eagerly")
            self.failed = True
            return eager(**kwargs)

    @torch.inference_mode()
    def _warm_up(self, size: int, width: int = 3) -> None:
        """A decode of ``size`` sequences of one token each, at position 0, over block 0,
        that writes nothing to the cache (slot -1). Sizes that equal each other when traced
        are assumed equal ever after (a recompilation when they differ): the batch size
        (5), its query starts (6) and the block-table width (3) are all different here."""
        lib = native_attention.kernels()
        assert lib is not None
        none = torch.full((size,), -1, dtype=torch.int64)
        plan = TorchPlan(
            decode=NativeDecodePlan(
                rows=None,
                block_table=torch.zeros(size, width, dtype=torch.int32),
                contexts=torch.ones(size, dtype=torch.int64),
            ),
            prefill=None,
            native=lib,
        )
        metadata = AttentionMetadata(
            backend="native",
            kv_caches=self.kv_caches,
            slot_mapping=none,
            cu_seqlens_q=torch.arange(size + 1, dtype=torch.int64),
            seq_lens=torch.ones(size, dtype=torch.int64),
            block_table=torch.zeros(size, width, dtype=torch.int32),
            num_tokens=size,
            max_context=1,
            decode_only=True,
            torch_plan=plan,
        )
        self.forward(
            input_ids=torch.zeros(1, size, dtype=torch.int64),
            position_ids=torch.zeros(1, size, dtype=torch.int64),  # not the same tensor
            use_cache=False,
            logits_to_keep=torch.arange(size),
            **{METADATA_KWARG: metadata},
        )
