"""A model-free executor and output processor that check the scheduler's plans.

``FakeExecutor`` keeps a KV cache of token ids: every computed position is written into the
block the plan's tables name, and every sample reads its whole context back from the cache,
so a wrong block table, a reused block or a bad recompute changes the tokens. Tokens are a
deterministic function of the context, so a request's output can be checked against
``reference_generate``. Used by unit tests of the scheduler and the runtimes' loops.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from mpengine.protocol import (
    AbortRequests,
    Announcement,
    Array,
    Feedback,
    NewRequest,
    RequestParams,
    SamplingParams,
    SeqStart,
    StepPlan,
    StepResult,
)

if TYPE_CHECKING:
    from mpengine.scheduler import Scheduler


def next_token(context: list[int], vocab_size: int) -> int:
    return (sum(context[-3:]) * 7 + len(context) * 13) % vocab_size


def reference_generate(prompt: list[int], max_tokens: int, eos: int, vocab_size: int) -> list[int]:
    tokens = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        tok = next_token(tokens, vocab_size)
        tokens.append(tok)
        out.append(tok)
        if tok == eos:
            break
    return out


class FakeExecutor:
    def __init__(self, block_size: int, vocab_size: int) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.tables: dict[int, dict[int, int]] = {}
        self.last: dict[int, int] = {}
        self.cache: dict[tuple[int, int], int] = {}
        self.host: dict[tuple[int, int], int] = {}  # swapped-out blocks
        self.requests: set[int] = set()  # parameter keys held, as the real executor does
        self.params_sent = 0

    def execute(self, plan: StepPlan) -> StepResult:
        bs = self.block_size
        for params in plan.new_requests:  # sent once per request
            assert params.key not in self.requests, f"request {params.key} sent twice"
            assert params.sampling is None or not params.sampling.stop, "stops reach executor"
            self.requests.add(params.key)
            self.params_sent += 1
        pairs = plan.swap_out.numpy().tolist()
        for device, host in zip(pairs[::2], pairs[1::2], strict=True):
            self._copy(self.cache, device, self.host, host)
        pairs = plan.swap_in.numpy().tolist()
        for host, device in zip(pairs[::2], pairs[1::2], strict=True):
            self._copy(self.host, host, self.cache, device)
        for start in plan.new_seqs:
            assert start.request in self.requests, f"seq {start.seq_id}: unknown request"
            self.tables[start.slot] = {}
            self.last.pop(start.slot, None)
        for slot, index, block in zip(
            plan.block_slots.numpy().tolist(),
            plan.block_indices.numpy().tolist(),
            plan.block_ids.numpy().tolist(),
            strict=True,
        ):
            self.tables[slot][index] = block
        for key in plan.released_requests.numpy().tolist():
            self.requests.remove(key)
        tokens = plan.token_ids.numpy().tolist()
        offset = 0
        rows = list(
            zip(
                plan.seq_ids.numpy().tolist(),
                plan.slots.numpy().tolist(),
                plan.starts.numpy().tolist(),
                plan.num_tokens.numpy().tolist(),
                plan.sample.numpy().tolist(),
                strict=True,
            )
        )
        # Every token of the step is stored before any sequence reads (as the attention
        # backends store a layer's keys and values first): a sequence may read blocks
        # another one of the same step fills.
        for _, slot, start, n, _ in rows:
            table = self.tables[slot]
            for pos in range(start, start + n):
                tok = tokens[offset]
                offset += 1
                if tok == -1:
                    tok = self.last[slot]
                self.cache[(table[pos // bs], pos % bs)] = tok
        seq_ids, sampled = [], []
        for seq_id, slot, start, n, sample in rows:
            if sample:
                table = self.tables[slot]
                context = [self.cache[(table[p // bs], p % bs)] for p in range(start + n)]
                tok = next_token(context, self.vocab_size)
                self.last[slot] = tok
                seq_ids.append(seq_id)
                sampled.append(tok)
        assert offset == len(tokens)
        return StepResult(plan.step, Array.of(seq_ids, "int64"), Array.of(sampled))

    def _copy(self, src: dict, src_block: int, dst: dict, dst_block: int) -> None:
        """A block's positions from one cache to the other (stale ones removed)."""
        for offset in range(self.block_size):
            value = src.get((src_block, offset))
            if value is None:
                dst.pop((dst_block, offset), None)
            else:
                dst[(dst_block, offset)] = value


class FakeOutput:
    """Finishes sequences on ``eos`` or after their ``max_tokens`` outputs."""

    def __init__(self, eos: int) -> None:
        self.eos = eos
        self.max_tokens: dict[int, int] = {}
        self.outputs: dict[int, list[int]] = {}
        self.finished: dict[int, str] = {}
        self.seq_ids: dict[str, list[int]] = {}  # request id -> its samples

    def add(self, seq_id: int, max_tokens: int) -> None:
        self.max_tokens[seq_id] = max_tokens
        self.outputs[seq_id] = []

    def announce(self, announcements: list[Announcement]) -> None:
        """What the scheduler announced: new requests' samples, aborts."""
        for announcement in announcements:
            if isinstance(announcement, NewRequest):
                self.seq_ids[announcement.request_id] = announcement.seq_ids
                for seq_id in announcement.seq_ids:
                    self.add(seq_id, announcement.sampling.max_tokens)  # type: ignore[union-attr]
            elif isinstance(announcement, AbortRequests):
                for request_id in announcement.request_ids:
                    for seq_id in self.seq_ids.get(request_id, ()):
                        self.abort(seq_id)

    def abort(self, seq_id: int) -> None:
        self.finished.setdefault(seq_id, "abort")

    def process(self, result: StepResult) -> Feedback:
        seq_ids, tokens, done, reasons = [], [], [], []
        for seq_id, tok in zip(
            result.seq_ids.numpy().tolist(), result.token_ids.numpy().tolist(), strict=True
        ):
            if seq_id in self.finished:
                continue  # a token planned before the finish was known: never visible
            out = self.outputs[seq_id]
            out.append(tok)
            seq_ids.append(seq_id)
            tokens.append(tok)
            if tok == self.eos or len(out) >= self.max_tokens[seq_id]:
                reason = "stop" if tok == self.eos else "length"
                self.finished[seq_id] = reason
                done.append(seq_id)
                reasons.append(reason)
        return Feedback(result.step, Array.of(seq_ids, "int64"), Array.of(tokens), done, reasons)


def start_seq(
    slot: int,
    seq_id: int,
    num_prompt_tokens: int,
    sampling: SamplingParams,
    sample_index: int = 0,
    prompt_token_ids: Array | None = None,
) -> tuple[SeqStart, RequestParams]:
    """A plan's start of one sequence as its own request (key = seq id), for tests and
    benchmarks that build plans by hand: ``new_seqs`` and ``new_requests`` entries."""
    params = RequestParams(seq_id, num_prompt_tokens, sampling, None, prompt_token_ids)
    return SeqStart(slot, seq_id, seq_id, sample_index, prompt_token_ids is not None), params


def drive(
    sched: Scheduler,
    executor: FakeExecutor,
    output: FakeOutput,
    *,
    lag: int = 0,
    on_plan: Callable[[StepPlan], None] | None = None,
    max_iterations: int = 20_000,
) -> int:
    """Run ``sched``'s requests to the end through the fake stages, under the lockstep rule
    with ``lag`` steps in flight (the async depth); ``on_plan`` sees each plan once it ran.
    Returns the number of steps; fails if the scheduler stops making progress."""
    unprocessed: deque[StepResult] = deque()  # executed, not yet output-processed
    feedback: list[Feedback] = []
    steps = 0
    for _ in range(max_iterations):
        while len(unprocessed) > lag:
            feedback.append(output.process(unprocessed.popleft()))
        plan = sched.schedule(feedback)
        feedback = []
        output.announce(sched.take_announcements())
        if plan is None:
            if unprocessed:
                feedback.append(output.process(unprocessed.popleft()))
            elif not sched.has_unfinished:
                sched.blocks.check()
                return steps
            continue
        steps += 1
        unprocessed.append(executor.execute(plan))
        if on_plan is not None:
            on_plan(plan)
    raise AssertionError("the scheduler does not make progress")
