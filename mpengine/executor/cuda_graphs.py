"""CUDA graphs of pure-decode steps: captured at start-up, replayed with static buffers.

A decode step of ``n`` sequences (one token each) runs the graph of the smallest captured
batch size ``>= n`` (:func:`graph_batch_sizes`: 1, 2, 4, 8, then every 8 up to 64 and every
16 beyond, up to :func:`max_graph_batch`: ``max_num_seqs``, no more than a step's token
budget holds, nor than ``MAX_GRAPH_BATCH`` as vLLM's default capture sizes; each size keeps
its own logits, ``size x vocabulary``, in the graph pool). The graph reads its inputs from
static buffers: the step's inputs are copied into their first ``n`` rows, and the padding
rows are made harmless: their keys and values are not stored (slot -1) and each attends to
one key of block 0 (whatever it holds, a finite value), so every row stays finite and no
real row reads them. The logits of every row are computed in the graph; the caller keeps its rows.

Graphs are captured largest first into one shared memory pool (a smaller graph's
activations fit in what the largest one used). Prefill and mixed steps run eagerly, as do
decode steps larger than the largest graph. Only the triton attention backend is captured:
its kernels take every shape from the buffers' sizes and read nothing back to the host.

If capture fails (a model whose code syncs with the host, for example), the executor logs
why and runs every step eagerly: slower, never wrong.
"""

from __future__ import annotations

import logging

import torch

from mpengine.config import EngineConfig
from mpengine.executor.attention import METADATA_KWARG
from mpengine.executor.input_batch import StepInputs
from mpengine.executor.paged_attention import AttentionMetadata

logger = logging.getLogger(__name__)


MAX_GRAPH_BATCH = 512


def max_graph_batch(config: EngineConfig) -> int:
    """The largest pure-decode step that gets a graph: larger ones run eagerly."""
    return min(config.max_num_seqs, config.max_num_batched_tokens, MAX_GRAPH_BATCH)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes that get a graph, ascending; the last is >= ``max_num_seqs``."""
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + (8 if sizes[-1] < 64 else 16))
    return [s for s in sizes if s < max_num_seqs] + [next(s for s in sizes if s >= max_num_seqs)]


class DecodeGraphs:
    """One captured forward per padded batch size, over shared static input buffers."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        sizes: list[int],
        max_blocks_per_seq: int,
    ) -> None:
        device = kv_caches[0].device
        largest = sizes[-1]
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sizes
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        # One token per sequence: the query starts never change.
        self.cu_seqlens_q = torch.arange(largest + 1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(
            largest, max_blocks_per_seq, dtype=torch.int32, device=device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    @classmethod
    def capture(
        cls,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_blocks_per_seq: int,
    ) -> DecodeGraphs | None:
        """Capture every size, or None (and a warning) if the model cannot be captured."""
        graphs = cls(model, kv_caches, graph_batch_sizes(max_num_seqs), max_blocks_per_seq)
        try:
            graphs._capture_all()
        except Exception:
            logger.warning("CUDA graph capture failed: every step runs eagerly", exc_info=True)
            torch.cuda.synchronize()
            return None
        logger.info("captured CUDA graphs for decode batches of %s", graphs.sizes)
        return graphs

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            backend="triton",
            kv_caches=self.kv_caches,
            slot_mapping=self.slot_mapping[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            num_tokens=size,
            # The sliding-window check runs at capture only; the loader already refused any
            # window shorter than max_model_len.
            max_context=1,
            decode_only=True,
        )

    def _forward(self, size: int, metadata: AttentionMetadata) -> torch.Tensor:
        output = self.model(
            input_ids=self.input_ids[None, :size],
            position_ids=self.positions[None, :size],
            use_cache=False,
            logits_to_keep=0,  # every row: the caller picks its own
            **{METADATA_KWARG: metadata},
        )
        return output.logits[0]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        # One side stream for every warm-up: what the allocator caches for a stream serves
        # that stream only, so a stream per size would keep each size's warm-up memory.
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):
            metadata = self._metadata(size)
            # Warm up on a side stream (lazy initialisations, Triton compilation), then
            # capture on it: nothing in the graph may be a first-time allocation.
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(size, metadata)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size, metadata)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-ups' cached blocks (the graphs' pool stays)

    def fits(self, metadata: AttentionMetadata) -> bool:
        """A pure-decode eager step this set of graphs can replay."""
        return (
            metadata.decode_only
            and metadata.backend == "triton"
            and metadata.num_tokens <= self.sizes[-1]
        )

    def replay(self, inputs: StepInputs) -> torch.Tensor:
        """The logits ``[n, vocab]`` of a pure-decode step of ``n`` sequences."""
        metadata = inputs.metadata
        n = metadata.num_tokens
        size = next(s for s in self.sizes if s >= n)
        width = metadata.block_table.shape[1]
        # 1. the step's rows, then padding rows that store nothing and read one key
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.position_ids)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.block_table[:n, :width].copy_(metadata.block_table)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.block_table[n:size, 0].fill_(0)
        # 2. replay; the logits buffer is the graph's and is rewritten by the next replay
        self.graphs[size].replay()
        return self.logits[size][:n]
