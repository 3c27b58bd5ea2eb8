"""Prefix caching, as the scheduler stages it: which blocks a sequence may reuse, and when a
block a step computes becomes reusable.

A block a planned step fills is named (registered in the ``BlockManager``, reusable by
other sequences) only once feedback says the step ran. Under async depth 1 the next plan
is built before that, and a failed step leaves its blocks unwritten: reused at once, they
gave another request wrong tokens. Each such block holds a reference meanwhile, so that it
cannot go to another sequence unnamed (``unnamed``).

Except within the step being built: a request admitted beside the one that computes a
prefix starts after it (every attention backend stores a step's keys and values before any
sequence of the step reads them, as vLLM's do; a burst of requests sharing a system prompt
computed it once per admission step, up to one per request). If the writer cannot run, the
executor fails its readers too (``provisional``).
"""

from __future__ import annotations

from mpengine.prefix_hash import BlockHash, chain_hashes
from mpengine.scheduler.block_manager import BlockManager
from mpengine.scheduler.request import Sequence


class PrefixStaging:
    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        # Step -> (seq id, block, hash) of the blocks it fills, named once it has run.
        self.unnamed: dict[int, list[tuple[int, int, BlockHash]]] = {}
        # Hash -> (block, the sequence computing it) in the step being built.
        self.provisional: dict[BlockHash, tuple[int, Sequence]] = {}

    def begin_step(self) -> None:
        self.provisional = {}

    def reuse(self, seq: Sequence) -> int:
        """Give ``seq`` (holding no blocks) the cached blocks of its longest computed prefix,
        never its last token (whose logits are needed); return how many. Requests asking
        for prompt logprobs compute their prompt."""
        request = seq.request
        if not self.blocks.caching or request.wants_prompt_logprobs:
            return 0
        if seq.num_outputs and request.sampling is not None and request.sampling.has_penalties:
            # Penalties read the slot's token history, which holds the prompt (when a
            # repetition penalty needs it) and the tokens computed in the slot: a resumed
            # sequence recomputes its earlier outputs, so that they are counted again.
            return 0
        if request.pooling is not None and request.pooling.pooling != "last":
            return 0  # mean and CLS pooling read the prompt's first tokens' hidden states
        num_blocks = (len(seq) - 1) // self.blocks.block_size
        hashes = self.hashes(seq, num_blocks)[:num_blocks]
        seq.block_ids = self.blocks.lookup(hashes)
        for block_hash in hashes[len(seq.block_ids) :] if self.provisional else ():
            computing = self.provisional.get(block_hash)
            if computing is None:
                break
            seq.block_ids += self.blocks.share([computing[0]])
        seq.num_computed = seq.num_registered = len(seq.block_ids)
        seq.num_computed *= self.blocks.block_size
        return len(seq.block_ids)

    def hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """The hash chain of ``seq``'s full blocks, extended (lazily) to at least its first
        ``num_blocks``; only the new blocks' tokens are read (a copy of the whole context
        made every decode step cost its length)."""
        have = seq.block_hashes
        if len(have) < num_blocks:
            size = self.blocks.block_size
            parent = have[-1] if have else None
            have += chain_hashes(seq.token_ids[len(have) * size : num_blocks * size], size, parent)
        return have

    def offer(self, seq: Sequence, num_tokens: int) -> None:
        """``seq`` computes ``num_tokens`` more in the step being built: the full blocks of
        known tokens it computes whole are shareable within the step at once."""
        if not self.blocks.caching or seq.request.wants_prompt_logprobs:
            return
        size = self.blocks.block_size
        first = -(-seq.num_computed // size)
        end = min(seq.num_computed + num_tokens, len(seq.token_ids)) // size
        if end > first:
            hashes = self.hashes(seq, end)
            for index in range(first, end):
                self.provisional.setdefault(hashes[index], (seq.block_ids[index], seq))

    def withdraw(self, seq: Sequence) -> None:
        """``seq`` gives up its chunk (preempted): what it offered is not computed."""
        if any(writer is seq for _, writer in self.provisional.values()):
            self.provisional = {h: e for h, e in self.provisional.items() if e[1] is not seq}

    def stage(self, seq: Sequence, step: int) -> None:
        """Name the full blocks whose tokens are known and computed as of the plan just
        built, once step ``step`` has run (``name``)."""
        num_full = min(seq.num_computed, len(seq.token_ids)) // self.blocks.block_size
        if not self.blocks.caching or num_full <= seq.num_registered:
            return
        hashes = self.hashes(seq, num_full)
        unnamed = self.unnamed.setdefault(step, [])
        for index in range(seq.num_registered, num_full):
            block = seq.block_ids[index]
            self.blocks.share([block])
            unnamed.append((seq.seq_id, block, hashes[index]))
        seq.num_registered = num_full

    def name(self, step: int, failed: set[int]) -> None:
        """Step ``step`` ran (feedback comes in step order): name the blocks it filled,
        except those of ``failed`` sequences, whose later steps are skipped too."""
        for planned in sorted(s for s in self.unnamed if s <= step):
            entries = self.unnamed.pop(planned)
            for seq_id, block, block_hash in entries:
                if seq_id not in failed:
                    self.blocks.register(block, block_hash)
            self.blocks.free([block for _, block, _ in entries])
        if failed:
            for planned, entries in self.unnamed.items():
                dropped = [block for seq_id, block, _ in entries if seq_id in failed]
                self.unnamed[planned] = [e for e in entries if e[0] not in failed]
                self.blocks.free(dropped)
