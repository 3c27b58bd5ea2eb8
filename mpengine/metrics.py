"""Prometheus metrics of the HTTP front end (``GET /metrics``).

Names are vLLM's where the two overlap, with ``mpengine:`` for ``vllm:``, and every series
carries a ``model_name`` label, so that dashboards built for vLLM work. Each count is produced
once, by one process:

- Request-level metrics are counted only by the HTTP process, from the outputs it receives
  (``RequestTracker``): tokens as they stream in, latencies when a request ends, from the
  engine's timestamps (``RequestOutput.metrics``: epoch seconds, all taken on this host).
  A request made with ``n > 1`` is one request for the histograms; each of its samples
  counts once in ``request_success_total`` (as vLLM counts its parallel samples).
- Engine-wide numbers are the engine's own totals and levels (``EngineStats`` from
  ``client.stats()``), exposed as they were at the latest poll (``EngineCollector``); they
  are never added up here, so no restart or second front end can double them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from mpengine.protocol import STEP_TOKEN_BUCKETS

if TYPE_CHECKING:
    from mpengine.client.outputs import RequestOutput
    from mpengine.protocol import EngineStats

PREFIX = "mpengine:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, with finer ones below 10 ms for small models.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5)
TTFT_BUCKETS += (5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4)
ITL_BUCKETS += (0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0)
REQUEST_BUCKETS += (30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50... up to ``max_model_len`` (vLLM's ``build_1_2_5_buckets``)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_model_len:
                return buckets
            buckets.append(float(value))
        scale *= 10


class ServerMetrics:
    """Every metric the front end exposes, in a registry of its own."""

    def __init__(
        self, model_name: str, max_model_len: int, cache_config: dict[str, object] | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=self.registry)

        m = model_name

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(
                PREFIX + name, doc, labels, buckets=buckets, registry=self.registry
            ).labels(m)

        def seconds(name: str, doc: str) -> Histogram:
            return histogram(name, doc, REQUEST_BUCKETS)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of answered requests.").labels(
            m
        )
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(m)
        self.request_success = counter(
            "request_success", "Finished samples, by finish reason.", ("finished_reason",)
        )
        self.http_requests = Counter(  # (vLLM's name, without its prefix)
            "http_requests_total",
            "HTTP answers, by handler, method and status class.",
            ["handler", "method", "status"],
            registry=self.registry,
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Between a sample's successive outputs.", ITL_BUCKETS
        )
        self.e2e = seconds("e2e_request_latency_seconds", "Arrival to last token.")
        self.queue = seconds("request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill = seconds("request_prefill_time_seconds", "First scheduled to first token.")
        self.decode = seconds("request_decode_time_seconds", "First token to last token.")
        self.inference = seconds("request_inference_time_seconds", "First scheduled to last token.")
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", tokens
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request (all samples).", tokens
        )
        self.engine = EngineCollector(model_name)
        self.registry.register(self.engine)
        if cache_config:  # vLLM's info gauge: the KV cache's configuration as labels, value 1
            names = sorted(cache_config)
            info = Gauge(
                PREFIX + "cache_config_info",
                "Information of the KV cache configuration.",
                [*labels, *names],
                registry=self.registry,
            )
            info.labels(m, *(_label(cache_config[name]) for name in names)).set(1)

    def tracker(self, num_prompt_tokens: int, n: int, ranked: bool = False) -> RequestTracker:
        return RequestTracker(self, num_prompt_tokens, n, ranked, time.monotonic())

    def success(self, reason: str) -> None:
        self.request_success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _label(value: object) -> str:
    """A configuration value as vLLM's info gauges write it (``True``, ``16``, ``None``)."""
    return str(value)


class RequestTracker:
    """One engine request as the HTTP process sees it; feeds the request-level metrics.

    ``on_output`` takes every delta the client library yields; ``on_abandoned`` is called
    when the HTTP client went away and the request was aborted: its open samples count as
    aborted then (their final outputs are no longer delivered). A request the engine
    refused (``on_refused``) counts in no finish reason.

    A ``ranked`` request (``best_of > n``, beam search) arrives whole at its end, one
    finished output per returned sample; its generated tokens are what the outputs' own
    ``num_generated_tokens`` say (every sample's, returned or not, as the usage counts).

    Times are the HTTP process's own, from ``started`` (its prompt tokenized), as vLLM's
    front end takes them: time to first token when the first token arrives (a stream the
    client dropped had none before), end-to-end latency and the request's token counts
    when it ends, aborted too.
    """

    def __init__(
        self,
        metrics: ServerMetrics,
        num_prompt_tokens: int,
        n: int,
        ranked: bool = False,
        started: float = 0.0,
    ) -> None:
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.ranked = ranked
        self.started = started  # monotonic seconds
        self.num_generated = 0
        self.open_samples = set(range(n))
        self.last_output_at: dict[int, float] = {}  # sample index -> monotonic seconds
        self.answered = False
        self.first_token_seen = False
        self.ended = False

    def on_output(self, delta: RequestOutput, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        m = self.metrics
        if not self.answered:
            self.answered = True
            m.prompt_tokens.inc(self.num_prompt_tokens)
        if self.ranked and delta.num_generated_tokens:
            m.generation_tokens.inc(delta.num_generated_tokens)
            self.num_generated += delta.num_generated_tokens
        if not self.first_token_seen and any(s.token_ids for s in delta.outputs):
            self.first_token_seen = True
            m.ttft.observe(max(0.0, now - self.started))
        for sample in delta.outputs:
            if sample.token_ids:
                if not self.ranked:
                    m.generation_tokens.inc(len(sample.token_ids))
                    self.num_generated += len(sample.token_ids)
                last = self.last_output_at.get(sample.index)
                if last is not None:
                    m.itl.observe(now - last)
                self.last_output_at[sample.index] = now
            if sample.finish_reason is not None and sample.index in self.open_samples:
                self.open_samples.discard(sample.index)
                m.success(sample.finish_reason)
        if delta.finished:
            t = delta.metrics  # the engine's times, for what happens inside it
            if t.scheduled_time:
                m.queue.observe(max(0.0, t.scheduled_time - t.arrival_time))
                m.inference.observe(max(0.0, t.finished_time - t.scheduled_time))
                if t.first_token_time:
                    m.prefill.observe(max(0.0, t.first_token_time - t.scheduled_time))
                    m.decode.observe(max(0.0, t.finished_time - t.first_token_time))
            self._ended(now)

    def _ended(self, now: float) -> None:
        if self.ended:
            return
        self.ended = True
        m = self.metrics
        m.e2e.observe(max(0.0, now - self.started))
        m.request_prompt_tokens.observe(self.num_prompt_tokens)
        m.request_generation_tokens.observe(self.num_generated)

    def on_refused(self) -> None:
        """The engine refused the request (bad input, overloaded): it never ran, so it
        finished nothing, as vLLM counts."""
        self.open_samples.clear()

    def on_abandoned(self, now: float | None = None) -> None:
        for _ in self.open_samples:
            self.metrics.success("abort")
        self.open_samples.clear()
        if self.answered:  # (its prompt tokens were counted: its histograms count it too)
            self._ended(time.monotonic() if now is None else now)


class EngineCollector(Collector):
    """The engine's own totals and levels, as of the latest ``EngineStats`` (``update``)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None
        self.restarts: dict[str, int] = {}  # stages restarted by the launcher, and how often

    def update(self, stats: EngineStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        restarts = CounterMetricFamily(
            PREFIX + "stage_restarts",
            "Stages restarted after they died, by stage.",
            labels=["model_name", "stage"],
        )
        for stage in ("scheduler", "executor", "output"):
            restarts.add_metric([self.model_name, stage], self.restarts.get(stage, 0))
        yield restarts
        stats = self.stats
        if stats is None:
            return
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        yield gauge("num_requests_running", "Sequences in the running batch.", stats.num_running)
        yield gauge(
            "num_requests_waiting",
            "Sequences waiting for admission or preempted.",
            stats.num_waiting + stats.num_preempted,
        )
        used = 1.0 - stats.num_free_blocks / stats.num_blocks if stats.num_blocks else 0.0
        yield gauge("kv_cache_usage_perc", "KV cache usage (1 = full).", used)
        yield counter("num_preemptions", "Preemptions since the engine started.", stats.preemptions)
        yield counter(
            "num_fair_preemptions",
            "Preemptions of a tenant over its share for one waiting under it.",
            stats.fair_preemptions,
        )
        yield gauge("num_tenants_running", "Tenants with sequences running.", stats.num_tenants)
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            getattr(stats, "prefix_cache_queries", 0),
        )
        yield counter(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            getattr(stats, "prefix_cache_hits", 0),
        )
        if stats.step_tokens:
            counts, cumulative = [], 0
            for bound, count in zip(
                [*(str(float(b)) for b in STEP_TOKEN_BUCKETS), "+Inf"],
                stats.step_tokens,
                strict=True,
            ):
                cumulative += count
                counts.append((bound, cumulative))
            tokens = HistogramMetricFamily(
                PREFIX + "iteration_tokens_total",
                "Tokens computed per engine step.",
                labels=["model_name"],
            )
            tokens.add_metric(labels, counts, float(stats.computed_tokens))
            yield tokens
        yield from self._stage_metrics(stats)

    def _stage_metrics(self, stats: EngineStats) -> Iterator[Metric]:
        # -- stage metrics: from the step breakdown (EngineStats.stages) ------------------
        # Each stage's running totals as of the latest step that reached the scheduler
        # (``StageTimes``: ``busy`` seconds of work, ``wall`` busy + waiting on a peer).
        # Adjust here if that breakdown changes shape.
        labels = ["model_name", "stage"]
        busy = CounterMetricFamily(
            PREFIX + "stage_busy_seconds", "Seconds each stage spent working.", labels=labels
        )
        wait = CounterMetricFamily(
            PREFIX + "stage_wait_seconds",
            "Seconds each stage spent waiting on a peer (ring, lockstep counter).",
            labels=labels,
        )
        for stage, times in sorted(getattr(stats, "stages", {}).items()):
            busy.add_metric([self.model_name, stage], times.busy)
            wait.add_metric([self.model_name, stage], max(0.0, times.wall - times.busy))
        yield busy
        yield wait
        steps = CounterMetricFamily(
            PREFIX + "steps", "Steps output-processed.", labels=["model_name"]
        )
        steps.add_metric([self.model_name], stats.done)
        yield steps
        lag = GaugeMetricFamily(
            PREFIX + "lockstep_lag_steps",
            "Steps planned but not yet output-processed.",
            labels=["model_name"],
        )
        lag.add_metric([self.model_name], stats.step - stats.done)
        yield lag
